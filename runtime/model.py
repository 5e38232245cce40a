"""The DeepseekV3 / Kimi-K2 forward pass in numpy float32, computing what transformers'
`DeepseekV3ForCausalLM` computes: MLA attention (optional q LoRA, YaRN RoPE, interleaved or not),
dense first layers, sigmoid routing with correction bias and group-limited top-k, shared experts.

Attention runs in the "absorbed" form: the KV cache holds only the normalised latent (kv_lora_rank)
and the rotated key part (qk_rope_head_dim) per token and layer; kv_b_proj is folded into the query
and the output instead of expanding keys and values for every cached token.

This module is only the model: typed modules (Attention, DenseMLP, MoE, Layer) whose forwards are the
equations. Where weights live and how they are decoded is runtime/weights.py; which routed experts are
read, cached and fetched ahead is the expert provider's (ModelWeights, backed by runtime/pager.py);
calibration observes the modules from outside (runtime/quality.py)."""

from __future__ import annotations

import math
import os

import numpy as np

from kimistream.formats import blas
from kimistream.formats.config import ModelConfig, RopeConfig
from kimistream.formats.ggufcodecs import is_gguf_codec
from kimistream.formats.layout import split_kv_b_names
from kimistream.formats.memplan import projection_block

from . import kernels
from .weights import ExpertProvider, ModelWeights, Weight, has_fused_kernel

# every core for prefill's large products (kimi-run --threads sets the variable)
_THREADS = int(os.environ.get("KIMI_STREAM_THREADS") or len(os.sched_getaffinity(0)))


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """w * x / sqrt(mean(x**2) + eps) over the last axis (one C call: it runs four times per layer
    and token)."""
    return kernels.rms_norm(x, w, eps)


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up = gate / (1 + e^-gate) * up (one C call, kernels.swiglu)."""
    return kernels.swiglu(gate, up)


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
    Output pairs come out as [first halves, second halves] in both layouts (as in the reference):
    x1 cos - x2 sin, then x2 cos + x1 sin (one C call, kernels.rope)."""
    return kernels.rope(x, cos, sin, interleave)


# What the Python side of running one expert on its own costs (three linear calls, ~90 us), in bytes
# read at memory speed: fusing several tokens' experts into one call may read this much more per
# expert it saves (MoE._fusing_pays).
GROUPED_CALL_BYTES = 2 << 20


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


class Rope:
    """RoPE (default or YaRN) cos/sin tables, computed once per step and shared by every layer."""

    def __init__(self, cfg: ModelConfig):
        self.inv_freq, self.amp = rope_tables(cfg.rope, cfg.qk_rope_head_dim)
        self.interleave = cfg.rope.interleave
        self._key, self._cs = None, None
        self._recent: dict = {}

    def tables(self, start: int, T: int, B: int):
        """cos, sin [B * T, rope/2] for positions start .. start+T-1 of every sequence (the last few
        kept: a prompt window asks for each of its chunks' at every layer)."""
        key = (start, T, B)
        if self._key != key:
            cs = self._recent.get(key)
            if cs is None:
                pos = np.tile(np.arange(start, start + T, dtype=np.float32), B)
                freqs = pos[:, None] * self.inv_freq[None, :]
                cs = ((np.cos(freqs) * self.amp).astype(np.float32), (np.sin(freqs) * self.amp).astype(np.float32))
                if len(self._recent) >= 64:
                    self._recent.clear()
                self._recent[key] = cs
            self._key, self._cs = key, cs
        return self._cs


class Attention:
    """Multi-head latent attention (MLA), absorbed: q from h (through a LoRA when q_lora_rank), the
    KV latent and the rotated key from kv_a, kv_b folded into the query and the output."""

    def __init__(self, cfg: ModelConfig, index: int, *, kv_a: Weight, kv_ln: np.ndarray, o: Weight,
                 kv_b: Weight | None = None, k_b: Weight | None = None, v_b: Weight | None = None,
                 q: Weight | None = None, q_a: Weight | None = None, q_ln: np.ndarray | None = None,
                 q_b: Weight | None = None):
        """kv_b as Hugging Face stores it, or its halves k_b [nh x r, nope] and v_b [nh x v, r] as a
        GGUF keeps them (formats/layout.py)."""
        self.cfg, self.index = cfg, index
        self.kv_a, self.kv_ln, self.kv_b, self.k_b, self.v_b, self.o = kv_a, kv_ln, kv_b, k_b, v_b, o
        self.q, self.q_a, self.q_ln, self.q_b = q, q_a, q_ln, q_b
        # q_a and kv_a read the same input: one kernel call for both when their codecs allow it
        self.qkv_a = (kernels.stacked([(w.codec, w.raw, w.shape) for w in (q_a, kv_a)])
                      if q_a is not None else None)
        # kv_b per head as strided views of the mapping when stored as f32; otherwise it stays packed
        # (a resident float32 copy of every layer's would take 2 GB for Kimi K2)
        self.w_k = self.w_v_t = None
        if kv_b is not None and kv_b.codec == "f32":
            self.w_k, self.w_v_t = self.split_kv_b(kv_b.dense())
        if kv_b is not None:
            self.packed = has_fused_kernel(kv_b.codec) and self.w_k is None
        else:
            self.packed = kernels.has_kernel(k_b.codec) and kernels.has_kernel(v_b.codec)
        # a decode step's attention in one kernel call (kernels.LatentAttention) when kv_b stays packed
        self.mla = (kernels.LatentAttention(kv_b.codec, kv_b.raw, kv_b.shape, cfg.qk_nope_head_dim, cfg.v_head_dim)
                    if kv_b is not None and self.packed else None)
        scale = cfg.qk_head_dim ** -0.5
        if cfg.rope.type != "default" and cfg.rope.mscale_all_dim:
            scale *= _yarn_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim) ** 2
        self.softmax_scale = scale

    def decode_step(self, ln1: np.ndarray, ln2: np.ndarray, eps: float, router=None):
        """A kernels.AttentionStep for Layer's decode tokens (its attention half in one call, and the
        next half's routing with `router`, MoE.router_spec), or None where the weights do not allow one."""
        if self.q_a is None or self.qkv_a is None or self.mla is None:
            return None
        q_b, o = (kernels.Linear(w.codec, w.raw, w.shape) for w in (self.q_b, self.o))
        if not kernels.AttentionStep.fits(self.qkv_a, q_b, self.mla, o):
            return None
        return kernels.AttentionStep(ln1, ln2, eps, self.qkv_a, self.q_ln, q_b, self.mla, self.kv_ln, o,
                                     self.cfg.rope.interleave, self.softmax_scale, router)

    def split_kv_b(self, kv_b: np.ndarray):
        cfg = self.cfg
        nh, nope, v, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        kv_b = kv_b.reshape(nh, nope + v, r)
        return kv_b[:, :nope, :], kv_b[:, nope:, :].transpose(0, 2, 1)     # [nh, nope, r], [nh, r, v]

    def absorbed(self):
        """(w_k [nh, nope, r], w_v_t [nh, r, v]) as float32: the key rows folded into the query, the
        value rows applied to the attention's latent output."""
        if self.w_k is not None:
            return self.w_k, self.w_v_t
        if self.kv_b is not None:
            return self.split_kv_b(self.kv_b.dense())
        cfg = self.cfg
        nh, r = cfg.num_attention_heads, cfg.kv_lora_rank
        return (self.k_b.dense().reshape(nh, r, -1).transpose(0, 2, 1),
                self.v_b.dense().reshape(nh, -1, r).transpose(0, 2, 1))

    def _expand_keys(self, T: int, S: int) -> bool:
        """Whether T new tokens over S positions take fewer multiply-adds with kv_b applied to the
        cached latents (keys and values per head, as the attention is written) than folded into the
        queries and outputs (absorbed, as decode does)."""
        cfg = self.cfg
        nope, v, r, rope = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        absorbed = T * nope * r + T * S * (r + rope) + T * S * r + T * r * v
        expanded = S * r * (nope + v) + T * S * (nope + rope) + T * S * v
        return expanded < absorbed

    def absorb_query(self, q_nope: np.ndarray) -> np.ndarray:
        """One token's q_nope [nh, nope] -> [nh, r], from the packed weights."""
        cfg = self.cfg
        if self.kv_b is not None:
            kv_b = self.kv_b
            return kernels.heads_t(kv_b.codec, kv_b.raw, kv_b.shape, q_nope, cfg.qk_nope_head_dim + cfg.v_head_dim)
        r = cfg.kv_lora_rank
        return kernels.heads(self.k_b.codec, self.k_b.raw, self.k_b.shape, q_nope, r, 0, r)

    def values(self, o_lat: np.ndarray) -> np.ndarray:
        """One token's attention output in the latent [nh, r] -> [nh, v], from the packed weights."""
        cfg = self.cfg
        nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
        if self.kv_b is not None:
            kv_b = self.kv_b
            return kernels.heads(kv_b.codec, kv_b.raw, kv_b.shape, o_lat, nope + v, nope, v)
        return kernels.heads(self.v_b.codec, self.v_b.raw, self.v_b.shape, o_lat, v, 0, v)

    def query(self, h: np.ndarray) -> np.ndarray:
        if self.q_a is not None:
            return linear(rms_norm(linear(h, self.q_a), self.q_ln, self.cfg.rms_norm_eps), self.q_b)
        return linear(h, self.q)

    def compress(self, h: np.ndarray):
        """The normalised KV latent (kv_b's input) and the key's rotary part, before rotation."""
        return self.split_latent(linear(h, self.kv_a))

    def split_latent(self, ckv: np.ndarray):
        r = self.cfg.kv_lora_rank
        return rms_norm(ckv[:, :r], self.kv_ln, self.cfg.rms_norm_eps), ckv[:, r:]

    def decode(self, h: np.ndarray, start: int, cache: KVCache, rope: Rope) -> np.ndarray:
        """One token of one sequence: the projections, then everything from the latent's norm to the
        heads' values in one kernel call (the packed-kv_b branch of `forward`, bit for bit)."""
        eps = self.cfg.rms_norm_eps
        if self.qkv_a is not None:
            qa, ckv = self.qkv_a(h)
            q = linear(rms_norm(qa, self.q_ln, eps), self.q_b)
        else:
            q, ckv = self.query(h), linear(h, self.kv_a)
        cos, sin = rope.tables(start, 1, 1)
        o = self.mla(q, ckv, self.kv_ln, eps, cos, sin, rope.interleave, cache.latent[self.index][0],
                     cache.k_rot[self.index][0], start, self.softmax_scale)
        return linear(o.reshape(1, -1), self.o)

    def forward(self, h: np.ndarray, start: int, cache: KVCache, rope: Rope) -> np.ndarray:
        """h [B * T, hidden]: B sequences (the cache's batch), T new tokens each."""
        if h.shape[0] == 1 and cache.batch == 1 and self.mla is not None:
            return self.decode(h, start, cache, rope)
        q_nope, q_rot = self.project(h, start, cache, rope)
        return linear(self.attend(q_nope, q_rot, start, cache), self.o)

    def project(self, h: np.ndarray, start: int, cache: KVCache, rope: Rope):
        """The queries of h [B * T, hidden] at positions start .. start+T-1, (q_nope [B * T, nh, nope],
        rotated q_rot [B * T, nh, rope]); their keys' latents and rotated parts written to the cache."""
        cfg, B = self.cfg, cache.batch
        T = h.shape[0] // B
        nh, nope = cfg.num_attention_heads, cfg.qk_nope_head_dim
        if self.qkv_a is not None and B * T < kernels.BLAS_MIN_TOKENS:
            qa, ckv = self.qkv_a(h)
            q = linear(rms_norm(qa, self.q_ln, cfg.rms_norm_eps), self.q_b)
            latent, k_rot = self.split_latent(ckv)
        else:
            q = self.query(h)
            latent, k_rot = self.compress(h)
        q = q.reshape(B * T, nh, cfg.qk_head_dim)
        q_nope, q_rot = q[..., :nope], q[..., nope:]
        cos, sin = rope.tables(start, T, B)
        q_rot = apply_rope(q_rot, cos, sin, rope.interleave)
        k_rot = apply_rope(k_rot, cos, sin, rope.interleave)

        C, K = cache.latent[self.index], cache.k_rot[self.index]          # [B, context, r], [B, context, rope]
        C[:, start:start + T] = latent.reshape(B, T, -1)
        K[:, start:start + T] = k_rot.reshape(B, T, -1)
        return q_nope, q_rot

    def attend(self, q_nope: np.ndarray, q_rot: np.ndarray, start: int, cache: KVCache) -> np.ndarray:
        """The heads' outputs [B * T, nh * v] of T tokens a sequence at positions start .. start+T-1 (their
        queries from `project`), each over the cache up to itself."""
        cfg, B = self.cfg, cache.batch
        T = q_nope.shape[0] // B
        nh, nope = cfg.num_attention_heads, cfg.qk_nope_head_dim
        C, K = cache.latent[self.index], cache.k_rot[self.index]          # [B, context, r], [B, context, rope]
        S = start + T
        # [B, nh, T, d]
        q_nope = q_nope.reshape(B, T, nh, nope).transpose(0, 2, 1, 3)
        q_rot = q_rot.reshape(B, T, nh, -1).transpose(0, 2, 1, 3)
        if T == 1:                      # decode steps: every sequence's cache read once for all heads
            packed = self.packed and B == 1
            if packed:
                # one token: kv_b stays packed, its key rows applied transposed and its value rows as
                # mat-vecs, head by head (no float32 copy of the whole matrix at every step)
                q_lat = self.absorb_query(q_nope[0, :, 0])[None, :, None, :]
            else:
                w_k, w_v_t = self.absorbed()
                q_lat = np.matmul(q_nope, w_k)                                 # [B, nh, 1, r]
            o_lat = np.empty(q_lat.shape, np.float32)
            for b in range(B):
                o_lat[b, :, 0] = kernels.attend(q_lat[b, :, 0], q_rot[b, :, 0], C[b], K[b], S, self.softmax_scale)
            o = self.values(o_lat[0, :, 0, :])[None, :, None, :] if packed else np.matmul(o_lat, w_v_t)
        else:
            Cs, Ks = C[:, :S], K[:, :S]                                        # [B, S, r], [B, S, rope]
            # llama.cpp's halves take 8-bit inputs (kernels.gguf_input): q_nope and the latent output,
            # as its graph multiplies them, so those files keep the absorbed form
            rounded = self.k_b is not None and kernels.rounds_gguf_inputs(self.k_b.codec, self.v_b.codec)
            expand = not rounded and self._expand_keys(T, S)
            w_k, w_v_t = (None, None) if expand and self.kv_b is not None else self.absorbed()
            if expand:
                # many new tokens: the keys' and values' head parts for every position, then attention
                # as written (fewer multiply-adds than folding kv_b into every query and output); with
                # kv_b whole, one product for every head's keys and values (one large GEMM instead of
                # two per head: 1.6x faster, and kv_b is not turned to float32 for it)
                if self.kv_b is not None:
                    kv = linear(Cs.reshape(B * S, -1), self.kv_b).reshape(B, S, nh, nope + cfg.v_head_dim)
                    keys = kv[..., :nope].transpose(0, 2, 1, 3)                 # [B, nh, S, nope]
                    values = kv[..., nope:].transpose(0, 2, 1, 3)               # [B, nh, S, v]
                else:
                    keys = np.matmul(Cs[:, None], w_k.transpose(0, 2, 1))
                    values = np.matmul(Cs[:, None], w_v_t)
                scores = np.matmul(q_nope, keys.transpose(0, 1, 3, 2))
            else:
                q_lat = (kernels.gguf_heads_matmul(self.k_b.codec, self.k_b.raw, self.k_b.shape, q_nope, w_k)
                         if rounded else np.matmul(q_nope, w_k))               # [B, nh, T, r]
                scores = _times_shared(q_lat, Cs.transpose(0, 2, 1))
            scores += _times_shared(q_rot, Ks.transpose(0, 2, 1))               # [B, nh, T, S]
            kernels.causal_softmax(scores, start, self.softmax_scale)
            probs = scores
            if expand:
                o = np.matmul(probs, values)                                   # [B, nh, T, v]
            else:
                o_lat = _times_shared(probs, Cs)                                # [B, nh, T, r]
                o = (kernels.gguf_heads_matmul(self.v_b.codec, self.v_b.raw, self.v_b.shape, o_lat, w_v_t)
                     if rounded else np.matmul(o_lat, w_v_t))
        return o.transpose(0, 2, 1, 3).reshape(B * T, nh * cfg.v_head_dim)




def _times_shared(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a [B, nh, T, n] times b [B, n, m], a matrix every head shares (the rotated keys, the latents):
    one product of nh * T rows per sequence (as many small per-head products ran at half BLAS's
    speed)."""
    B, nh, T, n = a.shape
    return np.matmul(a.reshape(B, nh * T, n), b).reshape(B, nh, T, -1)


class DenseMLP:
    """SwiGLU: down(silu(gate x) * up x)."""

    def __init__(self, gate: Weight, up: Weight, down: Weight):
        self.gate, self.up, self.down = gate, up, down

    def forward(self, x: np.ndarray) -> np.ndarray:
        both = self._gate_up(x.shape[0])
        g, u = both(x) if both is not None else (linear(x, self.gate), linear(x, self.up))
        return linear(swiglu(g, u), self.down)

    def _gate_up(self, tokens: int):
        """gate and up as one product of several tokens on the integer kernel (their input rounded once,
        one call instead of two), kept on the gate's Weight; None where they do not stack."""
        gate, up = self.gate, self.up
        if tokens < 2 or not (kernels.takes_int8(gate.codec, gate.shape[1], tokens) and
                              kernels.takes_int8(up.codec, up.shape[1], tokens)):
            return None
        if gate._with_up is None or gate._with_up[0] is not up:
            gate._with_up = (up, kernels.stacked([(w.codec, w.raw, w.shape) for w in (gate, up)]))
        return gate._with_up[1]


class MoE:
    """DeepSeek-V3 mixture of experts: sigmoid router with a correction bias and group-limited top-k,
    the routed experts' SwiGLUs weighted by their normalised scores, plus the shared expert."""

    def __init__(self, cfg: ModelConfig, index: int, *, router: Weight, bias: np.ndarray,
                 experts: ExpertProvider, shared: DenseMLP | None = None):
        self.cfg, self.index = cfg, index
        self.router, self.bias, self.experts, self.shared = router, bias, experts, shared
        self.next: Layer | None = None      # the next MoE layer, whose experts this one can guess
        self._buffer = experts.buffer       # what the two below were worked out for
        self._shared_fused = False          # not yet worked out (see _shared_in_buffer)
        self._step = False                  # not yet worked out (see _one_token)
        self._spec = None                   # uniform()'s codecs and shapes, with _step
        self._offsets = None                # known experts' offsets in the buffer (see _learn)
        self.launch_spec = None             # AttentionStep's launch of this layer's call (see _learn)
        self.one_token_calls = self.launched_calls = 0      # (the run summary's: how often it launched)
        # a float32 router (the usual case) multiplies one token in C, as Layer.step does it
        self._router_f32 = np.ascontiguousarray(router.dense()) if router.codec == "f32" else None

    def route(self, h: np.ndarray):
        """Top-k expert ids [T, k] and weights [T, k] (DeepSeek-V3 noaux_tc routing): the sigmoid
        scores plus the correction bias choose among the topk_group best groups (n_group > 1); the
        chosen scores, normalised (norm_topk_prob), times routed_scaling_factor weigh them."""
        cfg = self.cfg
        z = (kernels.matvec(h, self._router_f32) if h.shape[0] == 1 and self._router_f32 is not None
             else linear(h, self.router))
        return kernels.route(z, self.bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                             cfg.norm_topk_prob, cfg.routed_scaling_factor, logits=True)

    def router_spec(self):
        """(router [E, hidden] float32, bias, k, n_group, topk_group, norm, scale) for routing one token in
        C (kernels.AttentionStep), or None for a router stored in another codec."""
        if self._router_f32 is None:
            return None
        cfg = self.cfg
        return (self._router_f32, self.bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                cfg.norm_topk_prob, cfg.routed_scaling_factor)

    def forward(self, h: np.ndarray, x: np.ndarray, routed=None, launched: bool = False, defer: bool = False,
                guess: bool = True):
        """h: the normalised input [T, hidden]; x: the residual stream, for guessing the next layer;
        routed: route(h) when the caller has it already (Layer.step); launched: the caller's step has
        handed this token's call to the thread pool already (launch_spec). Returns the output, or with
        defer the launched call itself (kernels.PendingMoE), to be collected later. guess=False: no
        guess at the next layer's experts (a prompt window's would be most of them, read too early)."""
        idx, weights = routed if routed is not None else self.route(h)
        if self.experts.buffer is not self._buffer:        # the provider changed it between steps
            self._buffer, self._shared_fused, self._step = self.experts.buffer, False, False
            self.forget_offsets()
        if idx.shape[0] == 1:
            self.one_token_calls += 1
            self.launched_calls += launched
        if launched:
            pending = kernels.PendingMoE(self._step.codec, h.shape)
            if self.experts.held(self.index, idx[0]) is not None:      # the provider's bookkeeping meanwhile
                self._guess(x)
                return pending if defer else pending.result()
            pending.result()            # (offsets_stay: not reached) not held after all: go the usual way
        if idx.shape[0] == 1:
            step = self._one_token()
            held = step and self.experts.held(self.index, idx[0])
            if held:                        # a warm decode step: every expert in memory, one kernel call
                self._learn(step, idx[0], held)
                self._guess(x)
                out = step(self.experts.buffer, held, h, weights)
                return out + self.shared.forward(h) if self.shared is not None and step.shared is None else out
        # one token's are distinct, and in routing order its reads land in the order the sums take them
        used = idx[0] if idx.shape[0] == 1 else np.unique(idx)
        self.experts.routed(self.index, used)
        if guess:
            self._guess(x)
        out = np.zeros(h.shape, np.float32)
        if idx.shape[0] == 1 and not self.experts.offsets_stay and self._one_token() is not None:
            runs = self.experts.landing(self.index, used)
            if runs is not None:
                return self._as_they_land(runs, idx, h, weights, out)
        used = np.sort(used)
        experts = self.experts.together(self.index, used)
        if experts is not None and self.experts.offsets_stay:        # (a prompt's chunk teaches most of them)
            step = self._one_token()
            if step is not None:
                self._learn(step, used, [(g.offset, u.offset, d.offset) for g, u, d in experts.values()])
        if experts is not None and self._fusing_pays(idx, experts):
            rg, _, rd = next(iter(experts.values()))
            shared = self._shared_in_buffer((rg.codec, rg.shape), (rd.codec, rd.shape))
            if self._fused(experts, idx, h, weights, out, shared):
                if self.shared is not None and shared is None:
                    out += self.shared.forward(h)
                return out
        # Group the chunk's tokens by expert: each expert is fetched once per chunk, in id order, the
        # provider reading ahead of the one in use when they cannot all be held (stream)
        order = np.argsort(idx, axis=None, kind="stable")       # (token, slot) pairs, grouped by expert
        ends = np.searchsorted(idx.ravel()[order], used, side="right")
        pairs = experts.items() if experts is not None else self.experts.stream(self.index, used)
        for (e, (gate, up, down)), end, begin in zip(pairs, ends, np.concatenate(([0], ends[:-1]))):
            tok, slot = np.divmod(order[begin:end], idx.shape[1])
            out[tok] += DenseMLP(gate, up, down).forward(h[tok]) * weights[tok, slot][:, None]
        if self.shared is not None:
            out += self.shared.forward(h)
        return out

    def _as_they_land(self, runs, idx: np.ndarray, h: np.ndarray, weights: np.ndarray, out) -> np.ndarray:
        """One token through its routed experts run by run as the provider's reads land (each run, in
        routing order, one fused call adding to `out`: the sums of one call over all of them), the
        shared expert's own products done while the first reads are in flight."""
        shared = self._shared_in_buffer(*self._spec)
        alone = self.shared.forward(h) if self.shared is not None and shared is None else None
        k = 0
        for run in runs:
            if not self._fused(run, idx[:, k:k + len(run)], h, weights[:, k:k + len(run)], out):
                for j, (gate, up, down) in enumerate(run.values()):       # (an expert outside the buffer)
                    out += DenseMLP(gate, up, down).forward(h) * weights[0, k + j]
            k += len(run)
        if shared is not None:             # the shared expert is the one call's last pair
            kernels.moe_decode(self.experts.buffer, np.zeros((0, 3), np.int64), *self._spec, h,
                               np.zeros((1, 0), np.float32), out, shared)
        return out if alone is None else out + alone

    def _learn(self, step, ids: np.ndarray, held: list) -> None:
        """Keep the offsets `held` gave for these experts when the provider says they stay (offsets_stay):
        a later step that routes only to known experts can then be launched by the attention half's
        call, before the provider is asked (launch_spec)."""
        if not (self.experts.offsets_stay and step.overlaps() and (step.shared is not None or self.shared is None)):
            return
        if self._offsets is None:
            self._offsets = np.full((self.cfg.n_routed_experts, 3), -1, np.int64)
            self.launch_spec = step.launch_spec(self.experts.buffer, self._offsets)
        held = np.asarray(held, np.int64).reshape(-1, 3)
        ok = (held >= 0).all(axis=1)          # (an offset of -1: not in the buffer, the expert stays unknown)
        self._offsets[np.asarray(ids)[ok]] = held[ok]

    def forget_offsets(self) -> None:
        """The experts' buffer changed (the provider's pager did): no offsets known, nothing launched."""
        self._offsets = self.launch_spec = None

    def _guess(self, x: np.ndarray) -> None:
        if self.next is not None and self.experts.wants_guesses:
            # the next MoE layer's router applied to the current residual stream guesses its experts
            nxt = self.next
            guess, _ = nxt.mlp.route(rms_norm(x, nxt.ln2, self.cfg.rms_norm_eps))
            self.experts.guess(nxt.index, np.unique(guess))

    def _one_token(self):
        """A kernels.MoEStep for one token's routed experts (and the shared expert where it can join
        them) when every routed expert of the layer has the same fused-kernel codecs and shapes and
        lies in the provider's buffer; None otherwise. Worked out at the first call."""
        if self._step is False:
            spec = self._spec = self.experts.uniform(self.index)
            ok = (spec is not None and self.experts.buffer is not None and has_fused_kernel(spec[0][0])
                  and has_fused_kernel(spec[1][0]))
            self._step = (kernels.MoEStep(*spec, self.cfg.num_experts_per_tok, self._shared_in_buffer(*spec))
                          if ok else None)
        return self._step

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

    def _shared_in_buffer(self, gate_up: tuple, down_spec: tuple):
        """The shared expert as moe_decode's `shared` argument when it can join the call of routed
        experts of these (codec, shape)s (same shapes, fused codecs, its bytes inside the experts'
        buffer, as with the mmap pager); None otherwise (it then runs as its own three products)."""
        if self._shared_fused is False:
            self._shared_fused = None
            base = self.experts.buffer
            if self.shared is not None and base is not None:
                gate, up, down = self.shared.gate, self.shared.up, self.shared.down
                b0, end = base.ctypes.data, base.ctypes.data + base.size
                inside = all(b0 <= t.raw.ctypes.data and t.raw.ctypes.data + t.raw.nbytes <= end
                             for t in (gate, up, down))
                fits = (tuple(gate.shape) == tuple(up.shape) == tuple(gate_up[1])
                        and tuple(down.shape) == tuple(down_spec[1]) and gate.codec == up.codec
                        and has_fused_kernel(gate.codec) and has_fused_kernel(down.codec))
                if inside and fits:
                    self._shared_fused = ((gate.raw.ctypes.data - b0, up.raw.ctypes.data - b0,
                                           down.raw.ctypes.data - b0), (gate.codec, gate.shape), (down.codec, down.shape))
        return self._shared_fused

    def _fused(self, experts: dict, idx: np.ndarray, h: np.ndarray, weights: np.ndarray, out, shared=None) -> bool:
        """Tokens h [T, hidden] through all their routed experts (and `shared`, see _shared_in_buffer) in
        one kernel call (both cores busy even when each expert is small). False when the experts'
        tensors do not allow it (float codecs, mixed codecs or shapes): the caller then groups tokens
        by expert."""
        gate, up, down = next(iter(experts.values()))
        spec_gu, spec_d = (gate.codec, gate.shape), (down.codec, down.shape)
        base = self.experts.buffer
        ggml = is_gguf_codec(gate.codec) and is_gguf_codec(down.codec) and shared is None
        if base is None or not (ggml or has_fused_kernel(gate.codec) and has_fused_kernel(down.codec)):
            return False
        where = {}
        for e, (g, u, d) in experts.items():
            if (g.codec, g.shape) != spec_gu or (u.codec, u.shape) != spec_gu or (d.codec, d.shape) != spec_d \
                    or min(g.offset, u.offset, d.offset) < 0:
                return False
            where[e] = (g.offset, u.offset, d.offset)
        offs = np.array([[where[e] for e in row] for row in idx.tolist()], np.int64)     # [T, k, 3]
        if ggml:
            kernels.ggml_moe_decode(base, offs, spec_gu, spec_d, h, weights, out)
        else:
            kernels.moe_decode(base, offs, spec_gu, spec_d, h, weights, out, shared)
        return True


class Layer:
    """x + attention(norm(x)), then x + mlp(norm(x)), the mlp dense or a mixture of experts."""

    def __init__(self, index: int, ln1: np.ndarray, ln2: np.ndarray, attn: Attention, mlp: DenseMLP | MoE, eps: float):
        self.index, self.ln1, self.ln2, self.attn, self.mlp, self.eps = index, ln1, ln2, attn, mlp, eps
        # one decode token's first two lines, and its routing, in one call
        self.step = attn.decode_step(ln1, ln2, eps, mlp.router_spec() if isinstance(mlp, MoE) else None)

    def forward(self, x, start: int, cache: KVCache, rope: Rope, defer: bool = False):
        """x [T, hidden] -> the next layer's input. With defer (Model.forward), a decode step may take
        and return a Deferred x (the sum with a MoE call still running on the thread pool): the next
        layer's attention call collects it, so the interpreter's work in between overlaps the call."""
        routed, launched, mlp = None, False, self.mlp
        if self.step is not None and cache.batch == 1 and (type(x) is Deferred or x.shape[0] == 1):
            cos, sin = rope.tables(start, 1, 1)
            spec = mlp.launch_spec if defer and type(mlp) is MoE else None
            latent, k_rot = cache.latent[self.index][0], cache.k_rot[self.index][0]
            if type(x) is Deferred:
                x, h, routed, launched = self.step(x.x, start, latent, k_rot, cos, sin, spec, x.pending)
            else:
                x, h, routed, launched = self.step(x, start, latent, k_rot, cos, sin, spec)
        else:
            x = settled(x)
            x = x + self.attn.forward(rms_norm(x, self.ln1, self.eps), start, cache, rope)
            h = rms_norm(x, self.ln2, self.eps)
        if type(mlp) is not MoE:
            return x + mlp.forward(h)
        out = mlp.forward(h, x, routed, launched, defer)
        return Deferred(x, out) if type(out) is kernels.PendingMoE else x + out


class Deferred:
    """x + the output of a MoE call still running on the thread pool (MoE.forward with defer)."""
    __slots__ = ("x", "pending")

    def __init__(self, x: np.ndarray, pending):
        self.x, self.pending = x, pending

    def value(self) -> np.ndarray:
        return self.x + self.pending.result()


def settled(x) -> np.ndarray:
    return x.value() if type(x) is Deferred else x


def load_layer(w: ModelWeights, cfg: ModelConfig, i: int) -> Layer:
    """Layer i's modules over the weights' tensors (named as in the Hugging Face checkpoint)."""
    p = f"model.layers.{i}."
    if cfg.q_lora_rank:
        q = {"q_a": w.resident(p + "self_attn.q_a_proj.weight"), "q_ln": w.vector(p + "self_attn.q_a_layernorm.weight"),
             "q_b": w.resident(p + "self_attn.q_b_proj.weight")}
    else:
        q = {"q": w.resident(p + "self_attn.q_proj.weight")}
    k_b, v_b = split_kv_b_names(i)
    kv = ({"k_b": w.weight(k_b), "v_b": w.weight(v_b)} if w.has(k_b) else
          {"kv_b": w.weight(p + "self_attn.kv_b_proj.weight")})
    attn = Attention(cfg, i, kv_a=w.resident(p + "self_attn.kv_a_proj_with_mqa.weight"),
                     kv_ln=w.vector(p + "self_attn.kv_a_layernorm.weight"),
                     o=w.resident(p + "self_attn.o_proj.weight"), **kv, **q)
    if cfg.is_moe_layer(i):
        shared = None
        if cfg.n_shared_experts:
            shared = DenseMLP(*(w.weight(p + f"mlp.shared_experts.{n}.weight") for n in ("gate_proj", "up_proj", "down_proj")))
        mlp = MoE(cfg, i, router=w.resident(p + "mlp.gate.weight"), bias=w.vector(p + "mlp.gate.e_score_correction_bias"),
                  experts=w, shared=shared)
    else:
        mlp = DenseMLP(*(w.weight(p + f"mlp.{n}.weight") for n in ("gate_proj", "up_proj", "down_proj")))
    return Layer(i, w.vector(p + "input_layernorm.weight"), w.vector(p + "post_attention_layernorm.weight"), attn,
                 mlp, cfg.rms_norm_eps)


class Model:
    def __init__(self, weights: ModelWeights, max_context: int, kv_dtype: str = "f32"):
        self.w = weights
        self.cfg = cfg = weights.config
        if max_context < 1:
            raise ValueError("--max-context must be at least 1")
        self.cache = KVCache(cfg, max_context, kv_dtype)
        self.rope = Rope(cfg)
        self.layers = [load_layer(weights, cfg, i) for i in range(cfg.num_hidden_layers)]
        moe = [L for L in self.layers if isinstance(L.mlp, MoE)]
        for a, b in zip(moe, moe[1:]):
            a.mlp.next = b
        self._experts_buffer = weights.buffer
        self.embed = weights.embed_rows
        self.final_norm = weights.vector("model.norm.weight")
        self.lm_head = weights.resident("lm_head.weight" if weights.has("lm_head.weight") else "model.embed_tokens.weight")

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
        self._step_begins(T)
        x = self.embed(ids2.reshape(-1))
        for layer in self.layers:
            x = layer.forward(x, start, self.cache, self.rope, defer=True)
        x = settled(x)
        self.cache.length = start + T
        if not all_logits:
            x = x.reshape(B, T, -1)[:, -1]
        return linear(rms_norm(x, self.final_norm, self.cfg.rms_norm_eps), self.lm_head)

    def _step_begins(self, T: int) -> None:
        blas.set_threads(1 if T == 1 else _THREADS)   # see formats/blas.py: decode steps, one or several sequences
        kernels.set_decoding(T == 1)
        self.w.step_begins()
        if self.w.buffer is not self._experts_buffer:   # the pager changed: launches must not use the old one
            self._experts_buffer = self.w.buffer
            for layer in self.layers:
                if type(layer.mlp) is MoE:
                    layer.mlp.forget_offsets()

    def window(self, ids, chunk: int, all_logits: bool = False, cancelled=None):
        """Tokens `ids` of one sequence at the next positions of the cache, a layer at a time: each
        layer's attention half takes its projections a block of whole chunks at a time
        (memplan.projection_block) and its scores a chunk of `chunk` tokens at a time (in order, each
        chunk attending to the ones before it, as forward would chunk by chunk), then its MLP half
        takes all the tokens at once, so that a MoE layer reads each routed expert once for the whole
        window instead of once per chunk. Logits as forward gives them; None when `cancelled()` said so
        between two layers (the cache then stays where it was)."""
        if self.cache.batch != 1:
            raise ValueError("a prompt window runs one sequence")
        ids = np.asarray(ids).reshape(-1)
        T, start, cache, eps = len(ids), self.cache.length, self.cache, self.cfg.rms_norm_eps
        if start + T > cache.max_context:
            raise ContextFull(f"context of {cache.max_context} tokens is full (raise --max-context)")
        self._step_begins(T)
        x = self.embed(ids)
        chunks = [slice(a, min(a + chunk, T)) for a in range(0, T, chunk)]      # (the dense layers')
        step = projection_block(chunk, T)
        for layer in self.layers:
            if cancelled is not None and cancelled():
                return None
            attn = layer.attn
            for b in range(0, T, step):
                # the projections for a block of whole chunks at once (each weight decoded once for all
                # of them), the scores a chunk at a time (their memory grows with chunk x context)
                blk = slice(b, min(b + step, T))
                q_nope, q_rot = attn.project(rms_norm(x[blk], layer.ln1, eps), start + b, cache, self.rope)
                o = [attn.attend(q_nope[a:a + chunk], q_rot[a:a + chunk], start + b + a, cache)
                     for a in range(0, blk.stop - b, chunk)]
                x[blk] += linear(np.concatenate(o), attn.o)
            if type(layer.mlp) is MoE:
                x += layer.mlp.forward(rms_norm(x, layer.ln2, eps), x, guess=False)
            else:
                for c in chunks:
                    x[c] += layer.mlp.forward(rms_norm(x[c], layer.ln2, eps))
        cache.length = start + T
        if not all_logits:
            x = x[-1:]
        return linear(rms_norm(x, self.final_norm, eps), self.lm_head)

    def moe_overlap(self) -> tuple[int, int]:
        """(one-token MoE calls launched beside the interpreter, one-token MoE calls) so far."""
        moe = [layer.mlp for layer in self.layers if type(layer.mlp) is MoE]
        return sum(m.launched_calls for m in moe), sum(m.one_token_calls for m in moe)

    def sequences(self, batch: int):
        """A context in which the model runs `batch` sequences side by side in a cache of their own
        (forward takes [batch, T]); the single-sequence cache is restored after."""
        return _Sequences(self, batch)

    def prefill(self, ids, batch: int, all_logits: bool = False, window: int | None = None, cancelled=None,
                on_step=None) -> np.ndarray | None:
        """Feed the prompt in windows of `window` tokens a layer at a time (see `window`), each layer's
        attention in chunks of `batch`; a window of one chunk or less (the default) feeds it chunk by
        chunk through forward. Logits of every position or of the last; None when `cancelled()` said
        so. `on_step(n)` after each window or chunk of n tokens."""
        if batch < 1:
            raise ValueError("--prefill-batch-size must be at least 1")
        step = max(batch, window or 0)
        outs = []
        for s in range(0, len(ids), step):
            if cancelled is not None and cancelled():
                return None
            part = ids[s:s + step]
            out = (self.forward(part, all_logits=all_logits) if len(part) <= batch
                   else self.window(part, batch, all_logits, cancelled))
            if out is None:
                return None
            outs.append(out)
            if on_step is not None:
                on_step(len(part))
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
