"""The DeepseekV3 / Kimi-K2 forward pass in numpy float32, computing what transformers'
`DeepseekV3ForCausalLM` computes: MLA attention (optional q LoRA, YaRN RoPE, interleaved or not),
dense first layers, sigmoid routing with correction bias and group-limited top-k, shared experts.

Attention runs in the "absorbed" form: the KV cache holds only the normalised latent (kv_lora_rank)
and the rotated key part (qk_rope_head_dim) per token and layer; kv_b_proj is folded into the query
and the output instead of expanding keys and values for every cached token."""

from __future__ import annotations

import math
import os

import numpy as np

from kimistream.formats.config import ModelConfig, RopeConfig

from . import blas, kernels
from .weights import ModelWeights, Weight, has_fused_kernel

# every core for prefill's large products (kimi-run --threads sets the variable)
_THREADS = int(os.environ.get("KIMI_STREAM_THREADS") or len(os.sched_getaffinity(0)))


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    # np.mean's own reduction, without its Python wrapper (this runs four times per layer and token)
    var = np.add.reduce(x * x, axis=-1, keepdims=True) / np.float32(x.shape[-1])
    return w * (x / np.sqrt(var + eps))


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-x))


def linear(x: np.ndarray, w: Weight) -> np.ndarray:
    return w.matmul_t(x)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_tables(rope: RopeConfig, dim: int):
    """(inv_freq [dim/2], cos/sin amplitude) for default or YaRN RoPE."""
    pos_freqs = rope.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv_freq = 1.0 / pos_freqs
    if rope.type != "yarn":
        return inv_freq.astype(np.float32), 1.0
    f = rope.factor

    def correction_dim(rot):
        return dim * math.log(rope.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (inv_freq / f) * (1 - extrapolation) + inv_freq * extrapolation
    if rope.mscale and rope.mscale_all_dim:
        amp = _yarn_mscale(f, rope.mscale) / _yarn_mscale(f, rope.mscale_all_dim)
    else:
        amp = _yarn_mscale(f)
    return inv_freq.astype(np.float32), float(amp)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleave: bool) -> np.ndarray:
    """Rotate the last axis. cos/sin: [T, d/2] broadcast over the middle axes of x [T, ..., d].
    Output pairs come out as [first halves, second halves] in both layouts (as in the reference)."""
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
    shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (cos.shape[1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


# What the Python side of running one expert on its own costs (three linear calls, ~90 us), in bytes
# read at memory speed: fusing several tokens' experts into one call may read this much more per
# expert it saves (Model._fusing_pays).
GROUPED_CALL_BYTES = 2 << 20

# Attention projections used at every token are decoded once to float32 and kept (f32 is a view).
DECODED_ONCE = ("kv_a", "o", "q_a", "q_b", "q")
_DECODED_SUFFIXES = ("kv_a_proj_with_mqa.weight", "o_proj.weight", "q_a_proj.weight", "q_b_proj.weight",
                     "q_proj.weight")


class KVCache:
    """Per layer: the normalised KV latent [batch, max_context, kv_lora_rank] and rotated key part
    [batch, max_context, qk_rope_head_dim], float32 (exact) or float16 (half the memory); `batch`
    sequences advance together (one, except when calibration samples several at once)."""

    def __init__(self, cfg: ModelConfig, max_context: int, dtype: str = "f32", batch: int = 1):
        if dtype not in ("f32", "f16"):
            raise ValueError(f"unknown --kv-dtype {dtype!r} (f32, f16)")
        self.max_context, self.batch, self.dtype = max_context, batch, dtype
        dt = np.float32 if dtype == "f32" else np.float16
        L = cfg.num_hidden_layers
        self.latent = [np.zeros((batch, max_context, cfg.kv_lora_rank), dt) for _ in range(L)]
        self.k_rot = [np.zeros((batch, max_context, cfg.qk_rope_head_dim), dt) for _ in range(L)]
        self.length = 0


class Model:
    def __init__(self, weights: ModelWeights, max_context: int, prefetch: str = "off", kv_dtype: str = "f32"):
        if prefetch not in ("off", "next-layer"):
            raise ValueError(f"unknown --prefetch {prefetch!r} (off, next-layer)")
        self.prefetch = prefetch
        self.observer = None      # observer(tensor_name, inputs): sees every weight's input (calibration)
        self.w = weights
        self.cfg = cfg = weights.config
        if max_context < 1:
            raise ValueError("--max-context must be at least 1")
        self.cache = KVCache(cfg, max_context, kv_dtype)
        self.inv_freq, self.rope_amp = rope_tables(cfg.rope, cfg.qk_rope_head_dim)
        self._rope_key, self._rope_cs = None, None
        scale = cfg.qk_head_dim ** -0.5
        if cfg.rope.type != "default" and cfg.rope.mscale_all_dim:
            scale *= _yarn_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim) ** 2
        self.softmax_scale = scale
        self.layers = [self._bind_layer(i) for i in range(cfg.num_hidden_layers)]
        moe = [L for L in self.layers if L["moe"]]
        for a, b in zip(moe, moe[1:]):
            a["next_moe"] = b
        self.final_norm = weights.vector("model.norm.weight")
        self.lm_head = weights.weight("lm_head.weight" if weights.has("lm_head.weight") else "model.embed_tokens.weight")
        self.decoded_resident_bytes = self.lm_head.keep_dense()

    def _bind_layer(self, i: int) -> dict:
        cfg, w, p = self.cfg, self.w, f"model.layers.{i}."
        L = {"moe": cfg.is_moe_layer(i), "index": i,
             "ln1": w.vector(p + "input_layernorm.weight"), "ln2": w.vector(p + "post_attention_layernorm.weight"),
             "kv_a": w.weight(p + "self_attn.kv_a_proj_with_mqa.weight"),
             "kv_ln": w.vector(p + "self_attn.kv_a_layernorm.weight"),
             "o": w.weight(p + "self_attn.o_proj.weight")}
        if cfg.q_lora_rank:
            L["q_a"] = w.weight(p + "self_attn.q_a_proj.weight")
            L["q_ln"] = w.vector(p + "self_attn.q_a_layernorm.weight")
            L["q_b"] = w.weight(p + "self_attn.q_b_proj.weight")
        else:
            L["q"] = w.weight(p + "self_attn.q_proj.weight")
        # kv_b_proj, split per head: strided views of the mapping when stored as f32; otherwise it
        # stays packed and is decoded into a transient buffer at each use (a resident float32 copy
        # of every layer's would take 2 GB for Kimi K2).
        L["kv_b"] = w.weight(p + "self_attn.kv_b_proj.weight")
        if L["kv_b"].codec == "f32":
            L["w_k"], L["w_v_t"] = self._split_kv_b(L["kv_b"].dense())
        if L["moe"]:
            L["router"] = w.vector(p + "mlp.gate.weight")
            L["bias"] = w.vector(p + "mlp.gate.e_score_correction_bias")
            if cfg.n_shared_experts:
                L["shared"] = tuple(w.weight(p + f"mlp.shared_experts.{n}.weight")
                                    for n in ("gate_proj", "up_proj", "down_proj"))
        else:
            L["mlp"] = tuple(w.weight(p + f"mlp.{n}.weight") for n in ("gate_proj", "up_proj", "down_proj"))
        for k in DECODED_ONCE:
            if k in L:
                self.w.decoded_bytes += L[k].keep_dense()
        return L

    def _split_kv_b(self, kv_b: np.ndarray):
        cfg = self.cfg
        nh, nope, v, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        kv_b = kv_b.reshape(nh, nope + v, r)
        return kv_b[:, :nope, :], kv_b[:, nope:, :].transpose(0, 2, 1)     # [nh, nope, r], [nh, r, v]

    # ------------------------------------------------------------------ blocks
    def _lin(self, x: np.ndarray, w: Weight) -> np.ndarray:
        if self.observer is not None:
            self.observer(w.name, x)
        return linear(x, w)

    def _attention(self, L: dict, h: np.ndarray, start: int) -> np.ndarray:
        """h [B * T, hidden]: B sequences (the cache's batch), T new tokens each."""
        cfg, B = self.cfg, self.cache.batch
        T = h.shape[0] // B
        nh, nope = cfg.num_attention_heads, cfg.qk_nope_head_dim
        if cfg.q_lora_rank:
            q = self._lin(rms_norm(self._lin(h, L["q_a"]), L["q_ln"], cfg.rms_norm_eps), L["q_b"])
        else:
            q = self._lin(h, L["q"])
        q = q.reshape(B * T, nh, cfg.qk_head_dim)
        q_nope, q_rot = q[..., :nope], q[..., nope:]
        ckv = self._lin(h, L["kv_a"])
        latent = rms_norm(ckv[:, :cfg.kv_lora_rank], L["kv_ln"], cfg.rms_norm_eps)
        if self.observer is not None:
            self.observer(f"model.layers.{L['index']}.self_attn.kv_b_proj.weight", latent)
        k_rot = ckv[:, cfg.kv_lora_rank:]

        cos, sin = self._rope(start, T, B)
        q_rot = apply_rope(q_rot, cos, sin, cfg.rope.interleave)
        k_rot = apply_rope(k_rot, cos, sin, cfg.rope.interleave)

        i = L["index"]
        C, K = self.cache.latent[i], self.cache.k_rot[i]                    # [B, context, r], [B, context, rope]
        C[:, start:start + T] = latent.reshape(B, T, -1)
        K[:, start:start + T] = k_rot.reshape(B, T, -1)
        S = start + T
        # [B, nh, T, d]
        q_nope = q_nope.reshape(B, T, nh, nope).transpose(0, 2, 1, 3)
        q_rot = q_rot.reshape(B, T, nh, -1).transpose(0, 2, 1, 3)
        kv_b = L["kv_b"]
        packed = "w_k" not in L and B * T == 1 and has_fused_kernel(kv_b.codec)
        if packed:
            # one token: kv_b stays packed, its key rows applied transposed and its value rows as
            # mat-vecs, head by head (no float32 copy of the whole matrix at every step)
            stride = nope + cfg.v_head_dim
            q_lat = kernels.heads_t(kv_b.codec, kv_b.raw, kv_b.shape, q_nope[0, :, 0], stride)[None, :, None, :]
        else:
            w_k, w_v_t = (L["w_k"], L["w_v_t"]) if "w_k" in L else self._split_kv_b(kv_b.dense())
            q_lat = np.matmul(q_nope, w_k)                                     # [B, nh, T, r]
        if T == 1:                      # decode steps: every sequence's cache read once for all heads
            o_lat = np.stack([kernels.attend(q_lat[b, :, 0], q_rot[b, :, 0], C[b], K[b], S, self.softmax_scale)
                              for b in range(B)])[:, :, None, :]
        else:
            Ct, Kt = C[:, None, :S], K[:, None, :S]
            scores = np.matmul(q_lat, Ct.transpose(0, 1, 3, 2)) + np.matmul(q_rot, Kt.transpose(0, 1, 3, 2))
            scores *= self.softmax_scale                                       # [B, nh, T, S]
            if T > 1:
                causal = np.arange(S)[None, :] > (start + np.arange(T))[:, None]
                scores[..., causal] = -np.inf
            scores -= scores.max(axis=-1, keepdims=True)
            probs = np.exp(scores)
            probs /= probs.sum(axis=-1, keepdims=True)
            o_lat = np.matmul(probs, Ct)                                       # [B, nh, T, r]
        if packed:
            o = kernels.heads(kv_b.codec, kv_b.raw, kv_b.shape, o_lat[0, :, 0, :], stride, nope,
                              cfg.v_head_dim)[None, :, None, :]
        else:
            o = np.matmul(o_lat, w_v_t)                                        # [B, nh, T, v]
        return self._lin(o.transpose(0, 2, 1, 3).reshape(B * T, nh * cfg.v_head_dim), L["o"])

    def _rope(self, start: int, T: int, B: int):
        """cos, sin [B * T, rope/2] for positions start .. start+T-1 of every sequence, computed once
        per step (every layer uses the same)."""
        key = (start, T, B)
        if self._rope_key != key:
            pos = np.tile(np.arange(start, start + T, dtype=np.float32), B)
            freqs = pos[:, None] * self.inv_freq[None, :]
            self._rope_cs = ((np.cos(freqs) * self.rope_amp).astype(np.float32),
                             (np.sin(freqs) * self.rope_amp).astype(np.float32))
            self._rope_key = key
        return self._rope_cs

    def _mlp(self, x: np.ndarray, gate: Weight, up: Weight, down: Weight) -> np.ndarray:
        return self._lin(silu(self._lin(x, gate)) * self._lin(x, up), down)

    def route(self, L: dict, h: np.ndarray):
        """Top-k expert ids [T, k] and weights [T, k] (DeepSeek-V3 noaux_tc routing)."""
        cfg = self.cfg
        logits = h @ L["router"].T
        scores = 1.0 / (1.0 + np.exp(-logits))
        choice = scores + L["bias"]
        E, G = cfg.n_routed_experts, cfg.n_group
        if G > 1:
            grouped = choice.reshape(-1, G, E // G)
            group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)            # [T, G]
            keep = np.argsort(-group_scores, axis=-1, kind="stable")[:, :cfg.topk_group]
            mask = np.zeros_like(group_scores, dtype=bool)
            np.put_along_axis(mask, keep, True, axis=-1)
            choice = np.where(np.repeat(mask, E // G, axis=-1), choice, -np.inf)
        idx = np.argsort(-choice, axis=-1, kind="stable")[:, :cfg.num_experts_per_tok]
        weights = np.take_along_axis(scores, idx, axis=-1)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return idx, (weights * cfg.routed_scaling_factor).astype(np.float32)

    def _predict_next(self, L: dict, x: np.ndarray) -> None:
        """Speculative prefetch: the next MoE layer's router applied to the current residual stream
        guesses that layer's experts; their reads start while this layer computes."""
        nxt = L.get("next_moe")
        if nxt is None:
            return
        guess, _ = self.route(nxt, rms_norm(x, nxt["ln2"], self.cfg.rms_norm_eps))
        self.w.pager.prefetch(nxt["index"], np.unique(guess))

    def _moe(self, L: dict, h: np.ndarray, x: np.ndarray) -> np.ndarray:
        idx, weights = self.route(L, h)
        used = np.unique(idx)
        self.w.pager.note_routed(L["index"], used)
        self.w.pager.fetch_ahead(L["index"], used)
        if self.prefetch == "next-layer":
            self._predict_next(L, x)
        out = np.zeros_like(h)
        if self.observer is None and self.w.pager.holds_together(len(used)):
            experts = {int(e): self.w.expert(L["index"], int(e)) for e in used}
            if self._fusing_pays(idx, experts):
                shared = self._shared_in_base(L, experts)
                if self._moe_fused(experts, idx, h, weights, out, shared):
                    if "shared" in L and shared is None:
                        out += self._mlp(h, *L["shared"])
                    return out
        # Group the chunk's tokens by expert: each expert is fetched once per chunk.
        for e in used:
            tok, slot = np.nonzero(idx == e)
            gate, up, down = self.w.expert(L["index"], int(e))
            out[tok] += self._mlp(h[tok], gate, up, down) * weights[tok, slot][:, None]
        if "shared" in L:
            out += self._mlp(h, *L["shared"])
        return out

    @staticmethod
    def _fusing_pays(idx: np.ndarray, experts: dict) -> bool:
        """Every (token, expert) pair in one fused call reads an expert once per token routed to it;
        grouping by expert reads it once but costs three Python calls per expert. Fuse for one token,
        or while the extra reads cost less than the calls saved."""
        T, k = idx.shape
        if T == 1:
            return True
        gate, up, down = next(iter(experts.values()))
        expert_bytes = gate.raw.nbytes + up.raw.nbytes + down.raw.nbytes
        return (T * k - len(experts)) * expert_bytes <= len(experts) * GROUPED_CALL_BYTES

    def _shared_in_base(self, L: dict, experts: dict):
        """The shared expert as moe_decode's `shared` argument when it can join the routed experts' call
        (same shapes, fused codecs, its bytes inside the pager's buffer, as with the mmap pager); None
        otherwise (it then runs as its own three products)."""
        if "shared" not in L:
            return None
        if "shared_fused" not in L:
            gate, up, down = L["shared"]
            rg, _, rd = next(iter(experts.values()))
            base = self.w.pager.base
            b0, end = base.ctypes.data, base.ctypes.data + base.size
            inside = all(b0 <= t.raw.ctypes.data and t.raw.ctypes.data + t.raw.nbytes <= end for t in L["shared"])
            fits = (gate.shape == up.shape == rg.shape and down.shape == rd.shape and gate.codec == up.codec
                    and has_fused_kernel(gate.codec) and has_fused_kernel(down.codec))
            L["shared_fused"] = ((gate.raw.ctypes.data - b0, up.raw.ctypes.data - b0, down.raw.ctypes.data - b0),
                                 (gate.codec, gate.shape), (down.codec, down.shape)) if inside and fits else None
        return L["shared_fused"]

    def _moe_fused(self, experts: dict, idx: np.ndarray, h: np.ndarray, weights: np.ndarray, out,
                   shared=None) -> bool:
        """Tokens h [T, hidden] through all their routed experts (and `shared`, see _shared_in_base) in
        one kernel call (both cores busy even when each expert is small). False when the experts'
        tensors do not allow it (float codecs, mixed codecs or shapes): the caller then groups tokens
        by expert."""
        gate, up, down = next(iter(experts.values()))
        spec_gu, spec_d = (gate.codec, gate.shape), (down.codec, down.shape)
        if not (has_fused_kernel(gate.codec) and has_fused_kernel(down.codec)):
            return False
        base = self.w.pager.base
        b0 = base.ctypes.data
        where = {}
        for e, (g, u, d) in experts.items():
            if (g.codec, g.shape) != spec_gu or (u.codec, u.shape) != spec_gu or (d.codec, d.shape) != spec_d:
                return False
            where[e] = (g.raw.ctypes.data - b0, u.raw.ctypes.data - b0, d.raw.ctypes.data - b0)
        offs = np.array([[where[int(e)] for e in row] for row in idx], np.int64)     # [T, k, 3]
        kernels.moe_decode(base, offs, spec_gu, spec_d, h, weights, out, shared)
        return True

    # ------------------------------------------------------------------ forward
    def forward(self, ids, all_logits: bool = False) -> np.ndarray:
        """Run tokens `ids` at the next positions of the cache; logits [T, vocab] or [1, vocab]. With a
        cache of several sequences, `ids` is [batch, T] and the logits [batch * T, vocab] or [batch, vocab]
        (each sequence's last)."""
        ids = np.asarray(ids)
        B = self.cache.batch
        ids2 = ids.reshape(B, -1)
        T, start = ids2.shape[1], self.cache.length
        if start + T > self.cache.max_context:
            raise ContextFull(f"context of {self.cache.max_context} tokens is full (raise --max-context)")
        cfg = self.cfg
        blas.set_threads(1 if T == 1 else _THREADS)   # see runtime/blas.py: decode steps, one or several sequences
        kernels.set_spin(T == 1)
        x = self.w.embed_rows(ids2.reshape(-1))
        for L in self.layers:
            x = x + self._attention(L, rms_norm(x, L["ln1"], cfg.rms_norm_eps), start)
            h = rms_norm(x, L["ln2"], cfg.rms_norm_eps)
            x = x + (self._moe(L, h, x) if L["moe"] else self._mlp(h, *L["mlp"]))
        self.cache.length = start + T
        if not all_logits:
            x = x.reshape(B, T, -1)[:, -1]
        return self._lin(rms_norm(x, self.final_norm, cfg.rms_norm_eps), self.lm_head)

    def sequences(self, batch: int):
        """A context in which the model runs `batch` sequences side by side in a cache of their own
        (forward takes [batch, T]); the single-sequence cache is restored after."""
        return _Sequences(self, batch)

    def prefill(self, ids, batch: int, all_logits: bool = False) -> np.ndarray:
        """Feed the prompt in chunks of `batch` tokens; logits of every position or of the last."""
        if batch < 1:
            raise ValueError("--prefill-batch-size must be at least 1")
        outs = []
        for s in range(0, len(ids), batch):
            outs.append(self.forward(ids[s:s + batch], all_logits=all_logits))
        return np.concatenate(outs, axis=0) if all_logits else outs[-1]

    def reset(self):
        self.cache.length = 0


class _Sequences:
    def __init__(self, model: Model, batch: int):
        self.model, self.batch = model, batch

    def __enter__(self):
        m = self.model
        self.saved = m.cache
        m.cache = KVCache(m.cfg, m.cache.max_context, m.cache.dtype, self.batch)
        return m

    def __exit__(self, *exc):
        self.model.cache = self.saved


class ContextFull(RuntimeError):
    pass
