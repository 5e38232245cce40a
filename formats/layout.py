"""Which tensors a DeepseekV3-family model has, their shapes, and how they are laid out in a weight
file: resident tensors first (one extent per layer, then the head), the embedding table, then every
routed expert as one extent holding its gate, up and down projections, experts of a layer adjacent.

MLA's up-projection of the latent comes in one of two forms: `kv_b_proj` [heads x (nope + v), latent] as
Hugging Face stores it, or (`split_kv_b`) as the two halves llama.cpp stores, kept when a GGUF's blocks
are kept as they are: `k_b_proj` [heads x latent, nope] (each head's key rows, transposed) and
`v_b_proj` [heads x v, latent]."""

from __future__ import annotations

from .config import ModelConfig
from .constants import EXTENT_EMBEDDING, EXTENT_EXPERT, EXTENT_RESIDENT, classify

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def expert_tensor(layer: int, expert: int, proj: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"


def expert_extent(layer: int, expert: int) -> str:
    return f"expert.{layer}.{expert}"


def split_kv_b_names(layer: int) -> tuple[str, str]:
    p = f"model.layers.{layer}.self_attn."
    return p + "k_b_proj.weight", p + "v_b_proj.weight"


def layer_shapes(cfg: ModelConfig, i: int, split_kv_b: bool = False) -> dict[str, tuple]:
    """Shapes of layer i's tensors except routed experts, attention first."""
    p, H = f"model.layers.{i}.", cfg.hidden_size
    nh, qk, v = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim
    s: dict[str, tuple] = {}
    if cfg.q_lora_rank:
        s[p + "self_attn.q_a_proj.weight"] = (cfg.q_lora_rank, H)
        s[p + "self_attn.q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        s[p + "self_attn.q_b_proj.weight"] = (nh * qk, cfg.q_lora_rank)
    else:
        s[p + "self_attn.q_proj.weight"] = (nh * qk, H)
    s[p + "self_attn.kv_a_proj_with_mqa.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H)
    s[p + "self_attn.kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
    if split_kv_b:
        k_b, v_b = split_kv_b_names(i)
        s[k_b] = (nh * cfg.kv_lora_rank, cfg.qk_nope_head_dim)
        s[v_b] = (nh * v, cfg.kv_lora_rank)
    else:
        s[p + "self_attn.kv_b_proj.weight"] = (nh * (cfg.qk_nope_head_dim + v), cfg.kv_lora_rank)
    s[p + "self_attn.o_proj.weight"] = (H, nh * v)
    s[p + "input_layernorm.weight"] = (H,)
    s[p + "post_attention_layernorm.weight"] = (H,)
    if cfg.is_moe_layer(i):
        E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
        s[p + "mlp.gate.weight"] = (E, H)
        s[p + "mlp.gate.e_score_correction_bias"] = (E,)
        if cfg.n_shared_experts:
            Is = I * cfg.n_shared_experts
            s[p + "mlp.shared_experts.gate_proj.weight"] = (Is, H)
            s[p + "mlp.shared_experts.up_proj.weight"] = (Is, H)
            s[p + "mlp.shared_experts.down_proj.weight"] = (H, Is)
    else:
        I = cfg.intermediate_size
        s[p + "mlp.gate_proj.weight"] = (I, H)
        s[p + "mlp.up_proj.weight"] = (I, H)
        s[p + "mlp.down_proj.weight"] = (H, I)
    return s


def expert_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    return {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}


def model_shapes(cfg: ModelConfig, split_kv_b: bool = False) -> dict[str, tuple]:
    """Every tensor the model needs, name -> shape."""
    s = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    for i in range(cfg.num_hidden_layers):
        s.update(layer_shapes(cfg, i, split_kv_b))
        if cfg.is_moe_layer(i):
            es = expert_shapes(cfg)
            for e in range(cfg.n_routed_experts):
                for proj in EXPERT_PROJS:
                    s[expert_tensor(i, e, proj)] = es[proj]
    s["model.norm.weight"] = (cfg.hidden_size,)
    if not cfg.tie_word_embeddings:
        s["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return s


def _entry(name: str, shape: tuple, codec_for):
    cls = classify(name)
    return (name, cls, codec_for(name, cls, shape), shape)


def expert_entries(cfg: ModelConfig, layer: int, expert: int, codec_for) -> list:
    """The (tensor, class, codec, shape) entries of one routed expert's extent."""
    es = expert_shapes(cfg)
    return [_entry(expert_tensor(layer, expert, p), es[p], codec_for) for p in EXPERT_PROJS]


def plan_extents(cfg: ModelConfig, codec_for, experts=True, split_kv_b: bool = False):
    """The extent layout: a list of (extent_name, kind, [(tensor, class, codec, shape), ...]).

    `codec_for(tensor_name, tensor_class, shape) -> codec name` applies the precision plan.
    `experts`: every routed expert (True), none (False), or only these (layer, expert) pairs."""

    def entry(name, shape):
        return _entry(name, shape, codec_for)

    out = []
    for i in range(cfg.num_hidden_layers):
        out.append((f"layer.{i}", EXTENT_RESIDENT, [entry(n, sh) for n, sh in layer_shapes(cfg, i, split_kv_b).items()]))
    head = [entry("model.norm.weight", (cfg.hidden_size,))]
    if not cfg.tie_word_embeddings:
        head.append(entry("lm_head.weight", (cfg.vocab_size, cfg.hidden_size)))
    out.append(("head", EXTENT_RESIDENT, head))
    # A tied embedding doubles as the lm_head, so it must stay resident.
    out.append(("embed", EXTENT_RESIDENT if cfg.tie_word_embeddings else EXTENT_EMBEDDING,
                [entry("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))]))
    if experts is True:
        experts = [(i, e) for i in cfg.moe_layers for e in range(cfg.n_routed_experts)]
    for i, e in experts or ():
        out.append((expert_extent(i, e), EXTENT_EXPERT, expert_entries(cfg, i, e, codec_for)))
    return out

