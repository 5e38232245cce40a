"""The model configuration the runtime needs, normalised from a Hugging Face `config.json` of the
DeepseekV3 family (DeepSeek-V3/R1, Kimi K2). Both spellings of RoPE settings are read: the original
`rope_theta` + `rope_scaling` ({"type": "yarn", ...}) and transformers 5's `rope_parameters`
({"rope_type": ...}). RoPE is interleaved unless the config says `rope_interleave: false`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

SUPPORTED_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2")


class ConfigError(ValueError):
    pass


@dataclass
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"              # "default" or "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0               # 0 = not given
    mscale_all_dim: float = 0.0
    truncate: bool = True
    interleave: bool = True


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    rope: RopeConfig = field(default_factory=RopeConfig)

    # ----- derived geometry -----
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return (self.n_routed_experts > 0 and layer >= self.first_k_dense_replace
                and layer % self.moe_layer_freq == 0)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def eos_token_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else ([e] if isinstance(e, int) else list(e))

    # ----- (de)serialisation -----
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        try:
            d = dict(d)
            rope = RopeConfig(**d.pop("rope", {}))
            cfg = cls(**d, rope=rope)
        except TypeError as e:
            raise ConfigError(f"malformed model config: {e}") from None
        cfg.validate()
        return cfg

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Normalise a Hugging Face config.json dict; raises ConfigError naming what is wrong."""
        archs = hf.get("architectures") or []
        mt = hf.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ConfigError(f"unsupported model: model_type={mt!r} architectures={archs!r} "
                              f"(supported: DeepseekV3ForCausalLM — DeepSeek-V3/R1, Kimi K2)")
        if hf.get("scoring_func", "sigmoid") != "sigmoid":
            raise ConfigError(f"unsupported scoring_func {hf.get('scoring_func')!r}: only 'sigmoid' (DeepSeek-V3 family)")
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
        missing = [k for k in required if hf.get(k) is None]
        if missing:
            raise ConfigError(f"config.json lacks {', '.join(missing)}")
        kw = {k: hf[k] for k in required}
        for k in ("q_lora_rank", "moe_intermediate_size", "first_k_dense_replace", "moe_layer_freq",
                  "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group",
                  "norm_topk_prob", "routed_scaling_factor", "rms_norm_eps", "max_position_embeddings",
                  "hidden_act", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
            if hf.get(k) is not None or k == "q_lora_rank":
                kw[k] = hf.get(k)
        kw.setdefault("moe_intermediate_size", 0)
        kw["n_group"] = kw.get("n_group") or 1
        kw["topk_group"] = kw.get("topk_group") or 1
        kw["n_shared_experts"] = kw.get("n_shared_experts") or 0
        kw["rope"] = _rope_from_hf(hf)
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def need(cond, msg):
            if not cond:
                raise ConfigError(msg)
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool)
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings", "moe_layer_freq",
                  "n_group", "topk_group"):
            need(is_int(getattr(self, k)) and getattr(self, k) > 0, f"{k} must be a positive integer")
        for k in ("qk_nope_head_dim", "first_k_dense_replace", "n_routed_experts", "n_shared_experts",
                  "num_experts_per_tok", "moe_intermediate_size"):
            need(is_int(getattr(self, k)) and getattr(self, k) >= 0, f"{k} must be a non-negative integer")
        need(self.q_lora_rank is None or (is_int(self.q_lora_rank) and self.q_lora_rank > 0),
             "q_lora_rank must be a positive integer or null")
        for k in ("routed_scaling_factor", "rms_norm_eps"):
            need(is_num(getattr(self, k)) and getattr(self, k) > 0, f"{k} must be a positive number")
        for k in ("norm_topk_prob", "tie_word_embeddings"):
            need(isinstance(getattr(self, k), bool), f"{k} must be true or false")
        for k in ("bos_token_id",):
            need(getattr(self, k) is None or is_int(getattr(self, k)), f"{k} must be an integer or null")
        e = self.eos_token_id
        need(e is None or is_int(e) or (isinstance(e, list) and all(is_int(i) for i in e)),
             "eos_token_id must be an integer, a list of integers or null")
        need(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim must be even")
        need(self.hidden_act == "silu", f"unsupported hidden_act {self.hidden_act!r} (only silu)")
        if self.n_routed_experts:
            need(0 < self.num_experts_per_tok <= self.n_routed_experts,
                 "num_experts_per_tok must be in 1..n_routed_experts")
            need(self.n_routed_experts % self.n_group == 0, "n_routed_experts must be divisible by n_group")
            need(0 < self.topk_group <= self.n_group, "topk_group must be in 1..n_group")
            need(self.n_routed_experts // self.n_group >= 2, "each expert group needs at least 2 experts")
            need(self.moe_intermediate_size > 0, "moe_intermediate_size must be positive")
            need(self.moe_layer_freq >= 1, "moe_layer_freq must be >= 1")
        need(self.rope.type in ("default", "yarn"), f"unsupported rope type {self.rope.type!r} (default, yarn)")


def _rope_from_hf(hf: dict) -> RopeConfig:
    for k in ("rope_parameters", "rope_scaling"):
        if hf.get(k) is not None and not isinstance(hf[k], dict):
            raise ConfigError(f"{k} must be an object, not {type(hf[k]).__name__}")
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    try:
        return _rope_params(hf, params)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"rope parameters: a value is not a number ({e})") from None


def _rope_params(hf: dict, params: dict) -> RopeConfig:
    if any(isinstance(v, dict) for v in params.values()):
        raise ConfigError("per-layer-type rope_parameters are not supported")
    rtype = params.get("rope_type") or params.get("type") or "default"
    theta = params.get("rope_theta") or hf.get("rope_theta") or 10000.0
    rope = RopeConfig(theta=float(theta), type=rtype, interleave=bool(hf.get("rope_interleave", True)))
    if rtype == "yarn":
        if params.get("attention_factor") is not None:
            raise ConfigError("yarn attention_factor overrides are not supported")
        if params.get("factor") is None:
            raise ConfigError("rope scaling of type yarn needs a factor")
        rope.factor = float(params["factor"])
        rope.original_max_position_embeddings = int(
            params.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
            or hf.get("max_position_embeddings", 4096))
        rope.beta_fast = float(params.get("beta_fast") or 32)
        rope.beta_slow = float(params.get("beta_slow") or 1)
        rope.mscale = float(params.get("mscale") or 0.0)
        rope.mscale_all_dim = float(params.get("mscale_all_dim") or 0.0)
        rope.truncate = bool(params.get("truncate", True))
    return rope
