"""GGUF files written here from a bundled trained model the way llama.cpp's converter lays out a
DeepSeek-V3 model (architecture `deepseek2`): its metadata keys, tensor names, experts merged on the
outer axis, MLA's kv_b split into attn_k_b / attn_v_b, norms, routers and the correction bias in F32,
and a GPT-2-style tokenizer. Used by the tests of formats/gguffile.py."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.torch import load_file

LAYER = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_a_proj.weight": "attn_q_a.weight",
         "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight", "self_attn.q_b_proj.weight": "attn_q_b.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
         "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight", "self_attn.o_proj.weight": "attn_output.weight",
         "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
         "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
         "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
         "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
         "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
         "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight"}


# Q2_K keeps its two f16 scales (d, dmin) in the last four bytes of each block
RANDOM_BLOCKS = (gguf.GGMLQuantizationType.Q2_K,)


def _typed(w: gguf.GGUFWriter, name: str, a: np.ndarray, qtype) -> None:
    a = np.ascontiguousarray(a, np.float32)
    keep_f32 = a.ndim == 1 or name.endswith(("_norm.weight", "ffn_gate_inp.weight", ".bias"))
    if keep_f32 or qtype == gguf.GGMLQuantizationType.F32:
        w.add_tensor(name, a)
        return
    if qtype in RANDOM_BLOCKS:                   # no Python quantizer: valid random blocks
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        if a.shape[-1] % block:
            w.add_tensor(name, a.astype(np.float16))
            return
        rng = np.random.default_rng(len(name))
        blocks = rng.integers(0, 256, (*a.shape[:-1], a.shape[-1] // block, size), dtype=np.uint8)
        blocks[..., size - 4:] = np.frombuffer(np.array([1e-3, 1e-4], np.float16).tobytes(), np.uint8)  # d, dmin
        w.add_tensor(name, blocks.reshape(*a.shape[:-1], -1), raw_dtype=qtype)
        return
    try:
        w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    except gguf.QuantError:                      # rows not a multiple of the block: F16, as llama.cpp does
        w.add_tensor(name, a.astype(np.float16))


def write_gguf(model_dir: Path, out: Path, qtype=gguf.GGMLQuantizationType.F32, arch: str = "deepseek2",
               pre: str = "gpt2", end_ids: dict | None = None) -> Path:
    """end_ids: more tokenizer metadata, e.g. {"eot": 5} for tokenizer.ggml.eot_token_id."""
    cfg = json.loads((model_dir / "config.json").read_text())
    st = {k: v.float().numpy() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    w = gguf.GGUFWriter(str(out), arch)
    L, H = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    nope, v, kvl, rope = cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    w.add_block_count(L)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(H)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_key_length(kvl + rope)
    w.add_value_length(kvl)
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(kvl)
    w.add_key_length_mla(nope + rope)
    w.add_value_length_mla(v)
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg["norm_topk_prob"]:
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rope)
    _tokenizer(w, model_dir, pre)
    for kind, i in (end_ids or {}).items():
        getattr(w, f"add_{kind}_token_id")(i)

    _typed(w, "token_embd.weight", st["model.embed_tokens.weight"], qtype)
    for i in range(L):
        p = f"model.layers.{i}."
        for hf, g in LAYER.items():
            if p + hf in st:
                _typed(w, f"blk.{i}.{g}", st[p + hf], qtype)
        kv = st[p + "self_attn.kv_b_proj.weight"].reshape(H, nope + v, kvl)
        _typed(w, f"blk.{i}.attn_k_b.weight", kv[:, :nope, :].transpose(0, 2, 1), qtype)
        _typed(w, f"blk.{i}.attn_v_b.weight", kv[:, nope:, :], qtype)
        if i >= cfg["first_k_dense_replace"]:
            for proj, g in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
                stacked = np.stack([st[f"{p}mlp.experts.{e}.{proj}.weight"] for e in range(cfg["n_routed_experts"])])
                _typed(w, f"blk.{i}.{g}.weight", stacked, qtype)
    _typed(w, "output_norm.weight", st["model.norm.weight"], qtype)
    if "lm_head.weight" in st:
        _typed(w, "output.weight", st["lm_head.weight"], qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _tokenizer(w: gguf.GGUFWriter, model_dir: Path, pre: str) -> None:
    tj = json.loads((model_dir / "tokenizer.json").read_text())
    tc = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = tj["model"]["vocab"]
    special = {t["id"] for t in tj["added_tokens"] if t.get("special")}
    tokens = [None] * (max(vocab.values()) + 1)
    for tok, i in vocab.items():
        tokens[i] = tok
    for t in tj["added_tokens"]:
        tokens[t["id"]] = t["content"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list([t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)])
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    merges = tj["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    cfg = json.loads((model_dir / "config.json").read_text())
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(True)
    if tc.get("chat_template"):
        w.add_chat_template(tc["chat_template"])
