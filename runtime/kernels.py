"""Fused low-bit kernels: y = x @ W.T straight from a block codec's packed bytes (formats/quants.py,
layout in formats/SPEC.md).

T = 1 (decode): the C kernel runtime/_qdot.c (integer dot products; AVX2 where the CPU has it, portable
C otherwise). It quantises x once per call (16-bit integers per 32 values, exact float sums kept),
multiplies each codec's stored digits by them in int32 lanes, applies each span's scale and offset
once, and adds each outlier's stored correction times its input; nothing is dequantized. q2, q1 and
t1 weights (the routed experts) take x as int8 per 128 values instead (q4/q6 too with
`set_activations("int8")`): byte products, the sub-block scales applied as integers, one float step
per 128 weights (one t1 token: -21 .. 21, so that its trits never have to be taken out of their bytes).
q1t (q1's values, 32 rows side by side) takes x as -31 .. 31 per 128 and looks its products up in a
table of every four inputs' signed sums, 32 rows a lookup; its jobs go in whole tiles of 32 rows.
Every caller hands it a list of row jobs (a linear, all routed experts of a token, kv_b's heads),
shared out over a small thread pool.
A decode step's attention from the projections to the heads' values is one call (LatentAttention),
with q LoRA a layer's whole attention half is (AttentionStep: norms, projections and residual too),
and so is a token's MoE layer once its experts' offsets are known (MoEStep).
Several tokens (prefill, or the tokens routed to one expert): the same kernel takes each block's
digits out once and multiplies them by four tokens at a time. From BLAS_MIN_TOKENS tokens on
(X8_BLAS_MIN_TOKENS with int8 inputs, T1_BLAS_MIN_TOKENS for t1) rows are dequantized one block at
a time (BLOCK_BYTES, bit for bit as the reference decoder) and BLAS multiplies.
`dequantize` equals the numpy reference decoder bit for bit (no fastmath there); tests hold it to it.
llama.cpp's block types kept from a GGUF file (codecs `gguf-<type>`) have their own C decoders
(runtime/_ggml.c, equal bit for bit to the gguf package's dequantizer): a product decodes one block at
a time into L1 and multiplies it in float32 by every token. By default the input of such a product is
first rounded as llama.cpp rounds it (8 bits per 256 or 32 values, see `set_gguf_inputs`), so a GGUF
file gives llama.cpp's logits; "f32" multiplies the float32 input as it is.
"""

from __future__ import annotations

import functools
import os
import threading

import numpy as np

from kimistream.formats.codecs import CodecError, get_codec
from kimistream.formats.ggufcodecs import BLOCK_SIZES, is_gguf_codec
from kimistream.formats.quants import QUANT_CODECS, BlockCodec, TiledQ1Codec, outlier_columns_valid
from kimistream.runtime import _qdot


# Below this many weights a mat-vec runs on the calling thread alone: splitting a small weight saves less than a busy second core costs (q4 512x1024: 163 us on
# one thread; 143 us on two when both cores are idle, 740 us when the other one is busy).
PARALLEL_MIN_WEIGHTS = 1 << 20
# From this many tokens on, dequantized row blocks + BLAS beat the several-token kernel on 16-bit
# inputs (benchmarks/RESULTS.md: at 24 tokens q2 2048x7168 takes 10 ms against 25; at 48 they are
# even). With int8 inputs, rows multiplied as bytes of digit x scale, the kernel holds out past a
# 256-token batch (benchmarks/RESULTS.md: q2 1024x1024 at 256 tokens 4.1 ms against 4.8, 2048x7168
# 52 against 56; at 512 BLAS wins on the larger shape).
BLAS_MIN_TOKENS = 32
X8_BLAS_MIN_TOKENS = 320
# t1 takes its digits out again for every tile of 32 tokens: on 1024-wide rows BLAS wins from about
# 192 tokens (benchmarks/RESULTS.md: 256 tokens 8.0 ms against 5.9; 128 tokens 3.5 against 3.9)
T1_BLAS_MIN_TOKENS = 192
BLOCK_BYTES = 2 << 20    # float32 bytes per dequantized block of rows (at least 64 rows): fewer, larger
                          # products (BLAS packs the tokens again for each; measured: 256 tokens x 1024
                          # columns prefill +15-20 % with 512-row blocks against 64)
MIN_BLOCK_ROWS = 64
SPIN_US = 1000            # decode: the pool's idle workers spin this long for the next call
XQ_MAX = 32767            # activations are quantised to -XQ_MAX .. XQ_MAX per 32 values
XQ_DTYPE = np.int16
ACTIVATIONS = ("auto", "int8", "int16")   # kimi-run --activations (set_activations)
_activations = "auto"
_decoding = True          # Model.forward: one token per sequence (set_decoding)
X8_BLOCK = 128            # int8 activations: values per float scale (one q2 chunk)
T1_INPUT_TOP = 21         # one t1 token's input, as runtime/_qdot.c's quantize_xt rounds it
Q1T_INPUT_TOP = 31        # q1t's input (four of them sum within a byte), as runtime/_qdot.c's q1t_inputs
X8_CODECS = ("q2", "q1", "t1", "q4", "q6")    # the codecs with an int8-activation kernel (set_activations)
_threads = int(os.environ.get("KIMI_STREAM_THREADS") or len(os.sched_getaffinity(0)))   # kimi-run --threads
GGUF_INPUTS = ("llama.cpp", "f32")
_llama_inputs = True      # kimi-run --gguf-inputs: llama.cpp's 8-bit rounding of GGUF products' inputs

# indices into the int64 geometry vector handed to the kernels
(G_ROWS, G_COLS, G_NSUB, G_NBLK, G_K, G_PARROW, G_SUBROW, G_CODEROW, G_OFFPAR, G_OFFOCOL, G_OFFOVAL, G_OFFSUB,
 G_OFFCODE, G_NBYTES, G_KIND, G_S, G_P, G_NPAR, G_BITS0, G_PB0, G_BITS1, G_PB1) = range(22)


def has_kernel(codec: str) -> bool:
    """The codec's weights multiply straight from their packed bytes (this project's block codecs,
    and llama.cpp's blocks kept from a GGUF file)."""
    return codec in QUANT_CODECS or is_gguf_codec(codec)


@functools.lru_cache(maxsize=None)
def ggml_type(codec: str) -> int:
    """The GGML type id of a `gguf-<type>` codec, its codebook handed to the C kernels on first use
    (the IQ types' grids come from the gguf package, not from a table of ours)."""
    import gguf
    name = codec[len("gguf-"):].upper()
    t = gguf.GGMLQuantizationType[name].value
    ready, _, _, needs_grid = _qdot.ggml_info(t)
    if not ready and needs_grid:
        cls = getattr(gguf.quants, name)
        cls.init_grid()
        _qdot.ggml_grid(t, np.ascontiguousarray(cls.grid, np.float32).reshape(-1))
    if not _qdot.ggml_info(t)[0]:
        raise CodecError(f"{codec}: no kernel for this block type")
    return t


def _ggml_raw(codec: str, raw, shape):
    raw = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw.reshape(-1)
    need = get_codec(codec).nbytes(shape)
    if raw.dtype != np.uint8 or raw.size < need:
        raise CodecError(f"{codec}: need {need} bytes of uint8 for shape {list(shape)}")
    return raw


def _geometry_vector(codec: BlockCodec | TiledQ1Codec, shape) -> np.ndarray:
    if len(shape) != 2:
        codec.geometry(shape)            # raises the codec's own error
    return _geometry_cached(codec, int(shape[0]), int(shape[1]))


@functools.lru_cache(maxsize=4096)
def _geometry_cached(codec: BlockCodec | TiledQ1Codec, rows: int, cols: int) -> np.ndarray:
    # once per codec and shape, not per call: a decode step makes hundreds of calls
    g = codec.geometry((rows, cols))
    planes = list(codec.code_planes) + [(0, 1)] * (2 - len(codec.code_planes))
    extra = [codec.kind, codec.sub, codec.blk, codec.npar,
             planes[0][0] or 0, planes[0][1], planes[1][0] or 0, planes[1][1]]
    vec = np.concatenate([g.as_array(), np.array(extra, dtype=np.int64)])
    vec.flags.writeable = False
    return vec


# ----------------------------------------------------------------------------------------------- public API

def _prepare(codec_name: str, raw, shape):
    codec = get_codec(codec_name)
    if not isinstance(codec, (BlockCodec, TiledQ1Codec)):
        raise CodecError(f"no kernel for codec {codec_name!r}")
    g = _geometry_vector(codec, shape)
    raw = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw.reshape(-1)
    if raw.dtype != np.uint8 or raw.size < g[G_NBYTES]:
        raise CodecError(f"{codec_name}: need {int(g[G_NBYTES])} bytes of uint8 for shape {list(shape)}")
    return codec, g, raw


def _check_outliers(codec_name: str, raw, g) -> None:
    k, rows = int(g[G_K]), int(g[G_ROWS])
    if k and rows:
        ocol = raw[g[G_OFFOCOL]:g[G_OFFOCOL] + 2 * rows * k].view("<u2").reshape(rows, k)
        if not outlier_columns_valid(ocol, int(g[G_COLS])):
            raise CodecError(f"{codec_name}: corrupt data: outlier columns out of range or not increasing")


def quantize_activations(x: np.ndarray):
    """x [cols] float32 -> (xq int16 [cols], xsc float32 [cols/32], xs float32 [cols/32]): x is about
    xsc[s] * xq on span s (the rounding the integer kernels make), xs the exact span sums."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = x.shape[0] // 32
    xq, xsc, xs = np.empty(x.shape[0], XQ_DTYPE), np.empty(n, np.float32), np.empty(n, np.float32)
    _qdot.quantize(x, xq, xsc, xs)
    return xq, xsc, xs


def set_activations(mode: str) -> None:
    """How the integer kernels round a product's input: "auto" (the default) takes int8 per 128 values
    for q2, q1 and t1 weights (routed experts: byte products, vpmaddubsw, one float step per 128
    weights; one t1 token -21 .. 21), and 16-bit integers per 32 values for every other
    codec; "int8" takes int8 for q4 and q6 as well (attention, shared experts, lm_head: faster, at a
    measurable KL cost, see benchmarks/RESULTS.md);
    "int16" keeps 16 bits everywhere. Products of fewer than X8_BLAS_MIN_TOKENS tokens (t1:
    T1_BLAS_MIN_TOKENS; a decode step, a short prompt, the tokens a prompt routes to most experts) take
    these inputs; more tokens multiply dequantized blocks by BLAS, exactly. Calibration observes with 16-bit inputs
    (quality.observing)."""
    global _activations
    if mode not in ACTIVATIONS:
        raise ValueError(f"activations: {mode!r} is not one of {', '.join(ACTIVATIONS)}")
    _activations = mode
    _apply_x8()


def activations() -> str:
    """The current setting of set_activations."""
    return _activations


def set_decoding(decoding: bool) -> None:
    """Decode steps call the kernels back to back: idle pool workers spin for the next call. With
    several tokens BLAS runs between the kernel calls and wants every core (workers sleep at once)."""
    global _decoding
    _qdot.set_spin_us(SPIN_US if decoding else 0)
    _decoding = decoding


def decoding() -> bool:
    """The current setting of set_decoding."""
    return _decoding


def _x8_codecs() -> tuple:
    return {"auto": ("q2", "q1", "t1"), "int8": X8_CODECS, "int16": ()}[_activations]


def _apply_x8() -> None:
    _qdot.set_x8(sum(1 << get_codec(c).kind for c in _x8_codecs()))


_apply_x8()     # the C side starts as the setting says, whoever imports this module (not only kimi-run)


def set_x8_levels(n: int) -> int:
    """Round int8 inputs to -n .. n per 128 values instead of -127 .. 127 (1 <= n <= 127): for
    measuring what coarser inputs would cost in quality (a table-lookup kernel needs four inputs to sum
    within a byte, n = 31: benchmarks/bench_activation_rounding.py --x8-levels). One t1 token's
    -21 .. 21 is its own. Returns the previous n."""
    global _x8_levels
    old = _qdot.set_x8_levels(int(n))
    _x8_levels = int(n)
    return old


_x8_levels = 127


def takes_int8(codec: str, cols: int | None = None, tokens: int = 1) -> bool:
    """Whether a product of `tokens` tokens by a `codec` weight (of `cols` columns) rounds its input to
    int8 now: rows of whole 128-column blocks and whole code chunks only (q1's are 256; t1 takes its
    digits out of the chunks first for several tokens, and one t1 token's input is rounded to -21 .. 21,
    see `rounded_input`)."""
    if codec == "q1t":           # its lookup tables always take -31 .. 31 per 128 (runtime/_qdot.c)
        return tokens < X8_BLAS_MIN_TOKENS
    if cols is not None and cols % (256 if codec == "q1" else X8_BLOCK):
        return False
    limit = T1_BLAS_MIN_TOKENS if codec == "t1" else X8_BLAS_MIN_TOKENS
    return tokens < limit and isa() == "avx2" and codec in _x8_codecs()


def rounded_input(codec: str, x: np.ndarray, tokens: int = 1) -> np.ndarray:
    """x [cols] as the integer kernels multiply it by a `codec` weight in a product of `tokens` tokens
    (float64; exact float sums aside): int8 per X8_BLOCK values where `takes_int8`, else int16 per 32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if takes_int8(codec, x.shape[0], tokens):
        # one t1 token: -21 .. 21 (its kernel multiplies bytes up to 255 by -3 times them, runtime/_qdot.c)
        top = np.float32(T1_INPUT_TOP if codec == "t1" and tokens == 1 else Q1T_INPUT_TOP if codec == "q1t"
                         else _x8_levels)
        b = x.reshape(-1, X8_BLOCK)
        amax = np.abs(b).max(axis=1, keepdims=True)
        inv = np.where(amax > 0, top / np.where(amax > 0, amax, 1), 0).astype(np.float32)
        return (np.rint(b * inv).astype(np.float64) * (amax.astype(np.float64) / float(top))).reshape(-1)
    xq, xsc, _ = quantize_activations(x)
    return np.repeat(xsc, 32).astype(np.float64) * xq


def isa() -> str:
    """The instruction set the mat-vec kernel runs with ("avx2" or "generic")."""
    return _qdot.isa()


def set_gguf_inputs(mode: str) -> None:
    """How a product by llama.cpp's blocks treats its input: "llama.cpp" rounds it first to the 8-bit
    values llama.cpp multiplies such a weight by (Q8_K per 256 values for the k-, i- and ternary types,
    Q8_0/Q8_1 per 32 for the legacy ones), so the logits are llama.cpp's; "f32" keeps it as it is
    (the weights' exact product, which llama.cpp does not compute)."""
    global _llama_inputs
    if mode not in GGUF_INPUTS:
        raise ValueError(f"GGUF inputs: {mode!r} is not one of {', '.join(GGUF_INPUTS)}")
    _llama_inputs = mode == "llama.cpp"


def rounds_gguf_inputs(*codecs: str) -> bool:
    """Whether products by weights of these codecs round their inputs as llama.cpp does."""
    return _llama_inputs and any(is_gguf_codec(c) for c in codecs)


def gguf_input(codec: str, x: np.ndarray):
    """(x', fix): x [..., cols] as a product by a `codec` weight takes it, rounded row by row as
    llama.cpp rounds it for a GGUF block type (see set_gguf_inputs), else unchanged; fix [..., cols/32]
    for Q4_1/Q5_1 weights (llama.cpp's input carries a block sum rounded on its own: the product adds
    fix times each weight block's offset), else None."""
    if not (_llama_inputs and is_gguf_codec(codec)) or not np.size(x):
        return x, None
    t = ggml_type(codec)
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty_like(x)
    fix = np.empty(x.shape[:-1] + (x.shape[-1] // 32,), np.float32) if t in _OFFSET_TYPES else None
    if not _qdot.ggml_round(t, int(x.shape[-1]), x, out, fix):
        return x, None
    return out, fix


# Q4_1, Q5_1 (GGML type ids): bytes per 32-weight block (binary16 scale, binary16 offset, codes)
_OFFSET_TYPES = {3: BLOCK_SIZES["Q4_1"][1], 7: BLOCK_SIZES["Q5_1"][1]}


def _gguf_offsets(codec: str, raw, rows: int, cols: int) -> np.ndarray:
    """[rows, cols/32]: each block's offset of a Q4_1/Q5_1 weight (binary16 at byte 2), as float32."""
    bs, nb = _OFFSET_TYPES[ggml_type(codec)], cols // 32
    blocks = _ggml_raw(codec, raw, (rows, cols))[:rows * nb * bs].reshape(rows, nb, bs)
    return np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float32)


def gguf_heads_matmul(codec: str, raw, shape, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """np.matmul(x, w) for x [..., nh, T, cols] and w [nh, cols, n], the float32 form of a weight held
    as `codec` [nh * n, cols] (MLA's halves, several tokens): x taken as llama.cpp takes it."""
    xr, fix = gguf_input(codec, x)
    y = np.matmul(xr, w)
    if fix is not None:
        nh = w.shape[0]
        mins = _gguf_offsets(codec, raw, int(shape[0]), int(shape[1])).reshape(nh, -1, fix.shape[-1])
        y += np.matmul(fix, mins.transpose(0, 2, 1))
    return y


def set_threads(n: int) -> None:
    """Threads of the mat-vec kernel (the caller's included)."""
    global _threads
    _threads = max(1, int(n))


def threads() -> int:
    """The current setting of set_threads."""
    return _threads


def pool_wait() -> float:
    """Seconds the callers of multi-threaded kernel calls have spent, their own jobs done, waiting for
    the other threads' (all calls so far): a thread the OS took off its core mid-job shows here."""
    return _qdot.pool_wait()


def dequantize(codec: str, raw, shape) -> np.ndarray:
    """Float32 weight from the codec's bytes; equal to the reference decoder bit for bit."""
    if is_gguf_codec(codec):
        t, raw = ggml_type(codec), _ggml_raw(codec, raw, shape)
        out = np.empty(tuple(shape), np.float32)
        if out.size:
            _qdot.ggml_dequantize(raw, t, int(shape[-1]), out, _threads if out.size >= PARALLEL_MIN_WEIGHTS else 1)
        return out
    _, g, raw = _prepare(codec, raw, shape)
    _check_outliers(codec, raw, g)
    out = np.empty(tuple(shape), np.float32)
    if out.size:
        _qdot.dequantize(raw, g, 0, out, _threads if out.size >= PARALLEL_MIN_WEIGHTS else 1)
    return out


def dequantize_rows(codec: str, raw, shape, ids) -> np.ndarray:
    """Rows `ids` of a block-codec weight as float32 [len(ids), cols] (an embedding lookup: one C call
    per row, no pass over the table); equal to the reference decoder bit for bit."""
    _, g, raw = _prepare(codec, raw, shape)
    rows = np.asarray(ids, np.int64).reshape(-1)
    if rows.size and (rows.min() < 0 or rows.max() >= g[G_ROWS]):
        raise CodecError(f"{codec}: row {int(rows.max() if rows.max() >= g[G_ROWS] else rows.min())} outside "
                         f"the weight's {int(g[G_ROWS])} rows")
    k = int(g[G_K])
    if k and rows.size:
        ocol = raw[g[G_OFFOCOL]:g[G_OFFOCOL] + 2 * int(g[G_ROWS]) * k].view("<u2").reshape(-1, k)[rows]
        if not outlier_columns_valid(ocol, int(g[G_COLS])):
            raise CodecError(f"{codec}: corrupt data: outlier columns out of range or not increasing")
    out = np.empty((rows.size, int(g[G_COLS])), np.float32)
    for i, r in enumerate(rows.tolist()):
        _qdot.dequantize(raw, g, r, out[i:i + 1], 1)
    return out


def warm_up(codec: str) -> None:
    """Run every kernel `codec` can use once, on small all-zero weights: the code is paged in and the
    thread pool started before the first real call (and before the planner measures this process;
    for llama.cpp's blocks that includes the gguf package and the type's codebook)."""
    c = get_codec(codec)
    if is_gguf_codec(codec):
        shape = (8, c.block)
        zeros = np.zeros(c.nbytes(shape), np.uint8)
        linear(np.zeros(shape[1], np.float32), codec, zeros, shape)
        dequantize(codec, zeros, shape)
        return
    gu, dn = ((64, 256), (256, 64)) if codec != "q1t" else ((64, 256), (256, 256))
    zeros = np.zeros(2 * c.nbytes(gu) + c.nbytes(dn), np.uint8)
    x = np.zeros(256, np.float32)
    linear(x, codec, zeros, gu)
    dequantize(codec, zeros, gu)
    if codec == "q1t":          # routed experts only (their gate/up and down as inter = hidden)
        offs = np.array([[0, 0, 0]], np.int64)
        moe_decode(zeros, offs, (codec, dn), (codec, dn), x, np.ones(1, np.float32), np.zeros(256, np.float32))
        return
    offs = np.array([[0, c.nbytes(gu), 2 * c.nbytes(gu)]], np.int64)
    moe_decode(zeros, offs, (codec, gu), (codec, dn), x, np.ones(1, np.float32), np.zeros(256, np.float32))
    heads_t(codec, zeros, gu, np.zeros((2, 32), np.float32), 32)
    heads(codec, zeros, gu, np.zeros((2, 256), np.float32), 32, 0, 32)


JOB_WEIGHTS = 1 << 15     # weights per job of the mat-vec kernel (at least 8 rows): a job is taken
                          # with an atomic add on a line both cores write, so not too many of them


def _jobs(t0s, gi: int, first: int, rows: int, xis, outs, cols: int, tiles: bool = False) -> np.ndarray:
    """Jobs [m * ceil(rows / per), 6] covering rows first .. first+rows-1 of m tensors of `cols`
    columns (byte offsets t0s, inputs xis, outputs written from outs); with `tiles`, whole tiles of 32
    rows (q1t)."""
    per = max(8, JOB_WEIGHTS // max(cols, 1))
    if tiles:
        per = -(-per // 32) * 32
    lo = np.arange(0, rows, per, dtype=np.int64)
    hi = np.minimum(lo + per, rows)
    m, nb = len(t0s), len(lo)
    jobs = np.empty((m, nb, 6), np.int64)
    jobs[:, :, 0] = np.asarray(t0s, np.int64)[:, None]
    jobs[:, :, 1] = gi
    jobs[:, :, 2] = first + lo
    jobs[:, :, 3] = first + hi
    jobs[:, :, 4] = np.asarray(xis, np.int64)[:, None]
    jobs[:, :, 5] = np.asarray(outs, np.int64)[:, None] + lo
    return jobs.reshape(-1, 6)


@functools.lru_cache(maxsize=1024)
def _linear_jobs(rows: int, cols: int, tiles: bool = False) -> np.ndarray:
    """Jobs covering one weight, shared by every call of this shape (the tokens are the kernel's)."""
    return _jobs([0], 0, 0, rows, [0], [0], cols, tiles)


@functools.lru_cache(maxsize=1024)
def _head_jobs(nh: int, stride: int, first: int, n: int, cols: int) -> np.ndarray:
    return np.concatenate([_jobs([0], 0, h * stride + first, n, [h], [h * n], cols) for h in range(nh)])


def _run(raw, geoms, xf, jobs, out, weights: int, what: str, ntok: int = 1, ostride: int = 0) -> None:
    """Run the jobs in the C kernel (which quantises the inputs xf [n, cols] itself), on the calling
    thread alone for a small amount of work."""
    threads = _threads if weights >= PARALLEL_MIN_WEIGHTS else 1
    if _qdot.rows(raw, geoms, xf, jobs, out, threads, ntok, ostride):
        raise CodecError(f"{what}: corrupt data: outlier columns out of range or not increasing")


class Linear:
    """y = x @ W.T for one weight W [out, in] held in `raw` with `codec`, everything but the input worked
    out once (geometry, bounds, jobs): a decode step makes about five calls per layer."""
    __slots__ = ("codec", "raw", "g", "geoms", "jobs", "rows", "cols", "ggml")

    def __init__(self, codec: str, raw, shape: tuple):
        rows, cols = (int(s) for s in shape)
        self.codec, self.rows, self.cols = codec, rows, cols
        self.ggml = ggml_type(codec) if is_gguf_codec(codec) else None
        if self.ggml is not None:
            self.raw = _ggml_raw(codec, raw, (rows, cols))
        elif has_kernel(codec):
            _, self.g, self.raw = _prepare(codec, raw, (rows, cols))
            self.geoms, self.jobs = self.g[None, :], _linear_jobs(rows, cols, codec == "q1t")
        else:
            self.raw = raw if not isinstance(raw, np.ndarray) else raw.reshape(-1)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x [T, in] or [in] float32 -> [T, out] or [out]."""
        x = np.asarray(x, dtype=np.float32)
        squeeze = x.ndim == 1
        x2 = np.ascontiguousarray(x.reshape(1, -1) if squeeze else x)
        rows, cols = self.rows, self.cols
        if x2.shape[-1] != cols:
            raise ValueError(f"x has {x2.shape[-1]} features, weight has {cols}")
        if not has_kernel(self.codec):
            y = x2 @ get_codec(self.codec).decode(self.raw, (rows, cols)).T
            return y[0] if squeeze else y
        T = x2.shape[0]
        y = np.empty((T, rows), np.float32)
        if rows and T and self.ggml is not None:
            if T < BLAS_MIN_TOKENS:     # each block decoded once into L1 and multiplied by every token
                threads = _threads if rows * cols * T >= PARALLEL_MIN_WEIGHTS else 1
                _qdot.ggml_rows(self.raw, self.ggml, rows, cols, x2, y, threads, 0, _llama_inputs)
            else:
                x2, fix = gguf_input(self.codec, x2)
                _dequantized_matmul(x2, self.raw, None, rows, cols, y, self.codec)
                if fix is not None:
                    y += fix @ _gguf_offsets(self.codec, self.raw, rows, cols).T
        elif rows and T:
            if T < BLAS_MIN_TOKENS or takes_int8(self.codec, cols, T):
                # every token through each block of rows in one pass (the digits are taken out once)
                _run(self.raw, self.geoms, x2, self.jobs, y, rows * cols * T, self.codec, T, rows)
            else:
                _dequantized_matmul(x2, self.raw, self.g, rows, cols, y, self.codec)
        return y[0] if squeeze else y


class Stacked:
    """[x @ W_1.T, x @ W_2.T, ...] for weights of one column count that lie in one buffer, in one
    kernel call below BLAS_MIN_TOKENS tokens: two small products sharing an input (MLA's q_a and
    kv_a, each under PARALLEL_MIN_WEIGHTS and so on one thread alone) share out over the threads as
    one. `parts`: (codec, raw, shape) with raw a view into `base`."""

    def __init__(self, base: np.ndarray, parts):
        cols = int(parts[0][2][1])
        b0 = base.ctypes.data
        geoms, jobs, self.splits, out0 = [], [], [], 0
        for gi, (codec, raw, shape) in enumerate(parts):
            rows = int(shape[0])
            off = raw.ctypes.data - b0
            if int(shape[1]) != cols or not 0 <= off <= base.size - raw.nbytes:
                raise ValueError("Stacked: weights of one column count inside the buffer")
            _, g, _ = _prepare(codec, raw, (rows, cols))
            geoms.append(g)
            jobs.append(_jobs([off], gi, 0, rows, [0], [out0], cols))
            self.splits.append((out0, out0 + rows))
            out0 += rows
        self.base, self.cols, self.rows = base, cols, out0
        self.geoms, self.jobs = np.stack(geoms), np.concatenate(jobs)
        self.what = "+".join(p[0] for p in parts)

    def __call__(self, x: np.ndarray) -> list[np.ndarray]:
        """x [T, cols] float32 (T < BLAS_MIN_TOKENS) -> one [T, rows_i] per weight."""
        x2 = np.ascontiguousarray(x, np.float32)
        T = x2.shape[0]
        y = np.empty((T, self.rows), np.float32)
        _run(self.base, self.geoms, x2, self.jobs, y, self.rows * self.cols * T, self.what, T, self.rows)
        return [y[:, a:b] for a, b in self.splits]


def stacked(parts) -> Stacked | None:
    """A Stacked over (codec, raw, shape) parts when they allow one (block codecs with kernels, one
    column count, views of one buffer such as the weight file's mapping); None otherwise."""
    def owner(raw):          # the object whose buffer a view was made from (np.frombuffer of an mmap)
        b = raw.base if isinstance(raw, np.ndarray) else None
        return b.obj if isinstance(b, memoryview) else b
    first = owner(parts[0][1])
    if first is None or not all(owner(r) is first and c in QUANT_CODECS and c != "q1t" for c, r, _ in parts):
        return None
    try:
        return Stacked(np.frombuffer(first, np.uint8), parts)
    except (ValueError, TypeError, CodecError):
        return None


def linear(x: np.ndarray, codec: str, raw, shape: tuple) -> np.ndarray:
    """y = x @ W.T for x [T, in] (or [in]) float32 and W [out, in] held in `raw` with `codec`."""
    return Linear(codec, raw, shape)(x)


_blocks = threading.local()


def _block_buffer(n: int) -> np.ndarray:
    """n float32 values of this thread's block buffer, kept between products: a fresh one of a few MiB
    per product was mapped and faulted in page by page every time."""
    buf = getattr(_blocks, "buf", None)
    if buf is None or buf.size < n:
        buf = _blocks.buf = np.empty(n, np.float32)
    return buf[:n]


def _dequantized_matmul(x2, raw, g, rows, cols, y, codec):
    """More tokens: dequantize a block of rows at a time (BLOCK_BYTES, never the whole weight) and
    let BLAS do the products."""
    if g is not None:
        _check_outliers(codec, raw, g)
    step = max(MIN_BLOCK_ROWS, BLOCK_BYTES // (4 * cols) // 8 * 8)
    buf = _block_buffer(min(step, rows) * cols).reshape(-1, cols)
    if g is None:                      # llama.cpp blocks: the type and a row's bytes
        gt, rb = ggml_type(codec), get_codec(codec).nbytes((1, cols))
    for r0 in range(0, rows, step):
        blk = buf[:min(step, rows - r0)]
        # on every core: with blocks of BLOCK_BYTES the pool no longer waits on BLAS threads spinning
        # from the previous product (it did with 64-row blocks: 3.8 ms per block instead of 0.1);
        # measured: 256-token prefill of the bench_llamacpp model 120 -> 129 tok/s (benchmarks/RESULTS.md)
        if g is None:
            _qdot.ggml_dequantize(raw[r0 * rb:(r0 + blk.shape[0]) * rb], gt, cols, blk, _threads)
        else:
            _qdot.dequantize(raw, g, r0, blk, _threads)
        # on AMX tiles where the CPU has them (bf16 pairs, three products: ~1e-5 of the product's size;
        # measured 1.2-1.6x OpenBLAS's sgemm, benchmarks/RESULTS.md), else BLAS
        if cols % 32 or not _qdot.amx_matmul(x2, blk, y[:, r0:r0 + blk.shape[0]], _threads):
            np.matmul(x2, blk.T, out=y[:, r0:r0 + blk.shape[0]])


def moe_decode(base: np.ndarray, offsets: np.ndarray, gate_up: tuple, down: tuple, x: np.ndarray,
               weights: np.ndarray, out: np.ndarray, shared: tuple | None = None) -> None:
    """out[t] += sum_e weights[t, e] * down_te(silu(gate_te x[t]) * up_te x[t]) for tokens t and their
    routed experts e, in one C call of two passes whatever the number of tokens (every token's gate and
    up rows, then every down row), so both cores stay busy even when each expert is small and no Python
    runs per expert. `offsets` [T, k, 3] are the byte offsets in `base` of each expert's gate, up and
    down tensors ([k, 3] and x [hidden], weights [k], out [hidden] for one token); `gate_up` and `down`
    are (codec, shape). `shared` = (offsets [3], gate_up, down): an expert every token also goes
    through with weight 1 (DeepSeek's shared expert), in the same passes; same shapes as the routed."""
    specs = (gate_up, down) + ((shared[1], shared[2]) if shared is not None else ())
    try:
        geoms = _moe_geometries(specs)
    except TypeError:                   # shapes given as lists: the cache wants tuples
        geoms = _moe_geometries(tuple((c, tuple(int(d) for d in sh)) for c, sh in specs))
    offsets = np.asarray(offsets, np.int64).reshape(-1, 3)
    x2 = np.asarray(x, np.float32)
    x2 = np.ascontiguousarray(x2.reshape(-1, x2.shape[-1]))
    T = x2.shape[0]
    w = np.asarray(weights, np.float32).reshape(T, -1)
    k = w.shape[1]
    if offsets.shape[0] != T * k:
        raise ValueError(f"offsets for {offsets.shape[0]} experts, weights for {T} x {k}")
    pick, tok = _moe_pairs(T, k, shared is not None)
    offs, wts = np.empty((len(pick), 3), np.int64), np.empty(len(pick), np.float32)
    offs[:T * k], wts[:T * k] = offsets, w.reshape(-1)
    if shared is not None:
        offs[T * k:], wts[T * k:] = shared[0], 1.0
    out2 = out.reshape(T, -1)
    if not out2.flags.c_contiguous or out2.dtype != np.float32:
        raise ValueError("moe_decode: out must be contiguous float32")
    work = len(pick) * 3 * int(geoms[0, G_ROWS]) * int(geoms[0, G_COLS])
    try:
        bad = _qdot.moe(base, geoms, offs, pick, tok, wts, x2, out2,
                        _threads if work >= PARALLEL_MIN_WEIGHTS else 1)
    except ValueError as e:
        raise (CodecError(str(e)) if "outside" in str(e) else e) from None
    if bad:
        raise CodecError(f"{gate_up[0]}: corrupt data: outlier columns out of range or not increasing")


class MoEStep:
    """moe_decode for one token whose routed experts all have the same codecs and shapes, everything
    but their offsets and weights worked out once (a decode step calls it once per MoE layer)."""
    __slots__ = ("geoms", "pick", "tok", "k", "shared", "work", "codec", "wts")

    def __init__(self, gate_up: tuple, down: tuple, k: int, shared: tuple | None = None):
        specs = (gate_up, down) + ((shared[1], shared[2]) if shared is not None else ())
        self.geoms = _moe_geometries(tuple((c, tuple(int(d) for d in sh)) for c, sh in specs))
        self.pick, self.tok = _moe_pairs(1, k, shared is not None)
        self.k, self.codec = k, gate_up[0]
        self.shared = tuple(shared[0]) if shared is not None else None
        self.work = len(self.pick) * 3 * int(self.geoms[0, G_ROWS]) * int(self.geoms[0, G_COLS])
        self.wts = np.ones(len(self.pick), np.float32)      # the routed experts' weights, then the shared one's 1

    def __call__(self, base: np.ndarray, offsets: list, x: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """offsets: k (gate, up, down) byte offsets in base; x [1, hidden]; weights [1, k] -> [1, hidden]."""
        if self.shared is not None:
            offsets = offsets + [self.shared]
        self.wts[:self.k] = weights[0]
        out = np.zeros(x.shape, np.float32)
        try:
            bad = _qdot.moe(base, self.geoms, np.array(offsets, np.int64), self.pick, self.tok, self.wts, x, out,
                            _threads if self.work >= PARALLEL_MIN_WEIGHTS else 1)
        except ValueError as e:
            raise (CodecError(str(e)) if "outside" in str(e) else e) from None
        if bad:
            raise CodecError(f"{self.codec}: corrupt data: outlier columns out of range or not increasing")
        return out

    def overlaps(self) -> bool:
        """Whether this call may run on the thread pool while the interpreter goes on (AttentionStep's
        launch): two threads or more, and work enough for them."""
        return _threads >= 2 and self.work >= PARALLEL_MIN_WEIGHTS

    def launch_spec(self, base: np.ndarray, offsets: np.ndarray) -> tuple:
        """AttentionStep's launch argument for this call over `base`, with the experts' offsets in it
        (int64 [E, 3], -1 where not known: a token routed to such an expert is not launched)."""
        shared = np.array(self.shared, np.int64) if self.shared is not None else None
        return (base, self.geoms, offsets, shared, self.pick, self.tok)


class PendingMoE:
    """A MoE call running on the thread pool (launched by AttentionStep); result() waits for its
    output, or the next layer's AttentionStep adds it into its input (join)."""
    __slots__ = ("codec", "shape")

    def __init__(self, codec: str, shape):
        self.codec, self.shape = codec, shape

    def result(self) -> np.ndarray:
        out = np.zeros(self.shape, np.float32)
        if _qdot.moe_join(out):
            raise self.corrupt()
        return out

    def corrupt(self) -> CodecError:
        return CodecError(f"{self.codec}: corrupt data: outlier columns out of range or not increasing")


def ggml_moe_decode(base: np.ndarray, offsets: np.ndarray, gate_up: tuple, down: tuple, x: np.ndarray,
                    weights: np.ndarray, out: np.ndarray) -> None:
    """moe_decode for routed experts held in llama.cpp's blocks (codecs gguf-<type>): one C call, two
    passes over the threads, no Python per expert. Same arguments, without a shared expert."""
    (cgu, sgu), (cd, sd) = gate_up, down
    inter, hidden = int(sgu[0]), int(sgu[1])
    if tuple(int(v) for v in sd) != (hidden, inter):
        raise ValueError("ggml_moe_decode: gate/up [inter, hidden], down [hidden, inter]")
    x2 = np.ascontiguousarray(np.reshape(x, (-1, hidden)), np.float32)
    T = x2.shape[0]
    w = np.ascontiguousarray(weights, np.float32).reshape(-1)
    offs = np.ascontiguousarray(offsets, np.int64).reshape(-1, 3)
    k = offs.shape[0] // max(T, 1)
    tok = _moe_pairs(T, k, False)[1]
    out2 = out.reshape(T, -1)
    if not out2.flags.c_contiguous or out2.dtype != np.float32 or w.size != offs.shape[0]:
        raise ValueError("ggml_moe_decode: out contiguous float32, one weight per expert")
    types = np.array([ggml_type(cgu), ggml_type(cd)], np.int64)
    work = offs.shape[0] * 3 * inter * hidden
    try:
        _qdot.ggml_moe(base, types, offs, tok, w, x2, out2, hidden, inter,
                       _threads if work >= PARALLEL_MIN_WEIGHTS else 1, _llama_inputs)
    except ValueError as e:
        raise (CodecError(str(e)) if "outside" in str(e) else e) from None


@functools.lru_cache(maxsize=256)
def _moe_pairs(T: int, k: int, shared: bool):
    """moe's pick and tok arrays: k routed pairs per token (geometry pair 0), then with `shared` one
    shared-expert pair per token (geometry pair 1)."""
    pick = np.zeros(T * k + (T if shared else 0), np.int64)
    tok = np.concatenate([np.repeat(np.arange(T, dtype=np.int64), k), np.arange(T if shared else 0, dtype=np.int64)])
    pick[T * k:] = 1
    pick.flags.writeable = tok.flags.writeable = False
    return pick, tok


@functools.lru_cache(maxsize=64)
def _moe_geometries(specs: tuple) -> np.ndarray:
    geoms = np.stack([_geometry_vector(get_codec(c), sh) for c, sh in specs])
    geoms.flags.writeable = False
    return geoms


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """w * x / sqrt(mean(x**2) + eps) over the last axis, in one call, rounded as llama.cpp rounds it
    (float32 squares summed in double, the mean rounded to float32, then (x * scale) * w), so a GGUF
    file's hidden states carry llama.cpp's bits and not only its values."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty_like(x)
    _qdot.rms_norm(x, np.ascontiguousarray(w, np.float32), eps, out)
    return out


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleave: bool) -> np.ndarray:
    """RoPE over the last axis of x [T, ..., d] (cos/sin [T, d/2]), pairs interleaved or split in
    halves; the result holds the pairs' first members then their second. The same bits as the numpy
    form (x1 c - x2 s, x2 c + x1 s) in one call."""
    T = x.shape[0]
    out = np.empty(x.shape, np.float32)
    _qdot.rope(np.ascontiguousarray(x, np.float32), np.ascontiguousarray(cos, np.float32),
               np.ascontiguousarray(sin, np.float32), interleave, T, x.size // (T * x.shape[-1]) if T else 1, out)
    return out


def route(scores: np.ndarray, bias: np.ndarray, k: int, n_group: int = 1, topk_group: int = 1,
          norm: bool = True, scale: float = 1.0, logits: bool = False):
    """DeepSeek-V3 (noaux_tc) top-k over scores [T, E] (the router's sigmoids, or with `logits` its
    outputs, whose sigmoids are taken first: one call less per layer) plus the correction bias,
    limited to the topk_group best groups when n_group > 1: expert ids [T, k] in descending order of
    choice (ties to the lower id) and their weights [T, k] (scores, normalised if `norm`, times
    `scale`). Given the scores, equal bit for bit to the numpy formulation it replaces (argsort,
    take_along_axis, sum); the sigmoids of `logits` use C's expf, within an ulp of numpy's exp."""
    scores = np.ascontiguousarray(scores, np.float32)
    idx = np.empty((scores.shape[0], k), np.int64)
    weights = np.empty((scores.shape[0], k), np.float32)
    _qdot.route(scores, np.ascontiguousarray(bias, np.float32), n_group, topk_group, norm, scale, idx, weights, logits)
    return idx, weights


def matvec(x: np.ndarray, W: np.ndarray) -> np.ndarray:
    """x [T, cols] @ W.T for a float32 W [E, cols], each row's sum in one fixed order (a decode step's
    router product: the same bits as inside AttentionStep, on any number of threads)."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty((x.shape[0], W.shape[0]), np.float32)
    _qdot.matvec(np.ascontiguousarray(W, np.float32), x, out, W.shape[1],
                 _threads if W.size >= PARALLEL_MIN_WEIGHTS else 1)
    return out


def attend(q: np.ndarray, q_rot: np.ndarray, latent: np.ndarray, k_rot: np.ndarray, length: int,
           scale: float) -> np.ndarray:
    """One token's absorbed attention for every head: q [nh, r] against the first `length` rows of the
    latent cache [context, r] plus q_rot [nh, dr] against the rotated keys [context, dr] (both float32
    or both float16), times `scale`, softmax over positions, then the probabilities times the latent
    rows: [nh, r]. The cache is read once for all heads (a batched mat-vec reads it once per head)."""
    q = np.ascontiguousarray(q, np.float32)
    q_rot = np.ascontiguousarray(q_rot, np.float32)
    if latent.dtype != k_rot.dtype or latent.dtype not in (np.float32, np.float16):
        raise ValueError("attend: the caches must both be float32 or both float16")
    nh = q.shape[0]
    out = np.empty_like(q)
    work = nh * length * (q.shape[1] + q_rot.shape[1])
    _qdot.attend(q, q_rot, np.ascontiguousarray(latent), np.ascontiguousarray(k_rot), int(length), nh,
                 latent.dtype == np.float16, float(scale), out, _threads if work >= PARALLEL_MIN_WEIGHTS else 1)
    return out


class LatentAttention:
    """One token's multi-head latent attention from the projections' outputs to the heads' values, in
    one C call (`_qdot.mla_decode`): the KV latent's norm and the rotary parts, the cache rows written,
    kv_b's key rows folded into the query (heads_t), attention over the cache (attend), kv_b's value
    rows applied (heads). The same bits as those steps one by one; the Python between them cost more
    than the arithmetic of the small ones (a decode step runs it once per layer)."""
    __slots__ = ("codec", "raw", "g", "nope", "v")

    def __init__(self, codec: str, raw, shape, nope: int, v: int):
        _, self.g, self.raw = _prepare(codec, raw, shape)
        self.codec, self.nope, self.v = codec, int(nope), int(v)

    def __call__(self, q: np.ndarray, ckv: np.ndarray, kv_ln: np.ndarray, eps: float, cos: np.ndarray,
                 sin: np.ndarray, interleave: bool, latent: np.ndarray, k_rot: np.ndarray, pos: int,
                 scale: float) -> np.ndarray:
        """q [nh, nope + dr] (q_b's output), ckv [r + dr] (kv_a's), the caches' rows [context, r] and
        [context, dr] of one sequence (row `pos` is written) -> [nh, v]."""
        if latent.dtype != k_rot.dtype or latent.dtype not in (np.float32, np.float16):
            raise ValueError("LatentAttention: the caches must both be float32 or both float16")
        nh = q.size // (self.nope + cos.size * 2)
        out = np.empty((nh, self.v), np.float32)
        if _qdot.mla_decode(q, ckv, kv_ln, eps, cos, sin, interleave, latent, k_rot, pos, latent.dtype == np.float16,
                            self.raw, self.g, self.nope, self.v, scale, out, _threads, PARALLEL_MIN_WEIGHTS):
            raise CodecError(f"{self.codec}: corrupt data: outlier columns out of range or not increasing")
        return out


class AttentionStep:
    """One decode token through a layer's attention half in one C call (`_qdot.attn_step`): x ->
    (x + attention(rms_norm(x, ln1)), rms_norm(that, ln2)) and, with a float32 router, that output's
    routing, for attention with q LoRA whose q_a and kv_a stack (Stacked), q_b and o on the block
    kernels and kv_b packed (LatentAttention). The same bits as
    the modules' calls one by one: the Python between about ten calls a layer cost more than the small
    ones' arithmetic, and memory traffic stalls it (the products stream megabytes past its objects)."""
    __slots__ = ("consts", "what", "router", "k")

    def __init__(self, ln1, ln2, eps: float, qkv_a: Stacked, q_ln, q_b: Linear, mla: LatentAttention, kv_ln,
                 o: Linear, interleave: bool, scale: float, router=None):
        """router: (W float32 [E, hidden], bias, k, n_group, topk_group, norm, scale) to route the output
        too (MoE.router_spec: the same bits as MoE.route for one token), or None."""
        f32 = functools.partial(np.ascontiguousarray, dtype=np.float32)
        self.consts = (f32(ln1), f32(ln2), f32(q_ln), f32(kv_ln), float(eps), qkv_a.base, qkv_a.geoms, qkv_a.jobs,
                       q_b.raw, q_b.geoms, q_b.jobs, mla.raw, mla.g, mla.nope, mla.v, o.raw, o.geoms, o.jobs,
                       bool(interleave), float(scale))
        self.what = f"{qkv_a.what}, {q_b.codec}, {mla.codec}, {o.codec}"
        self.router, self.k = None, 0
        if router is not None:
            W, bias, k, n_group, topk_group, norm, rscale = router
            self.router = (np.ascontiguousarray(W, np.float32), np.ascontiguousarray(bias, np.float32), int(n_group),
                           int(topk_group), bool(norm), float(rscale))
            self.k = int(k)

    @staticmethod
    def fits(qkv_a, q_b: Linear, mla, o: Linear) -> bool:
        """Whether these products can run as one step (block codecs on this project's kernels)."""
        return (qkv_a is not None and mla is not None and len(qkv_a.splits) == 2 and
                all(w.ggml is None and has_kernel(w.codec) for w in (q_b, o)))

    def __call__(self, x: np.ndarray, pos: int, latent: np.ndarray, k_rot: np.ndarray, cos: np.ndarray,
                 sin: np.ndarray, launch: tuple | None = None, join: PendingMoE | None = None):
        """x [1, hidden] float32; one sequence's cache rows [context, r], [context, dr] (row pos is
        written); cos, sin [1, dr/2] -> (x_out, h_out, routed, launched): x_out and h_out [1, hidden],
        routed the expert ids [1, k] and weights [1, k] with a router, else None. join: the previous
        layer's MoE call, still running, whose output is added into x (in place) first. launch: the
        MoE half's call (MoEStep.launch_spec), handed to the thread pool at once when every routed
        expert's offsets are known; launched says whether it was (the MoE half then collects it)."""
        if latent.dtype != k_rot.dtype or latent.dtype not in (np.float32, np.float16):
            raise ValueError("AttentionStep: the caches must both be float32 or both float16")
        x = np.ascontiguousarray(x, np.float32)
        x_out, h_out = np.empty_like(x), np.empty_like(x)
        routed = (np.empty((1, self.k), np.int64), np.empty((1, self.k), np.float32)) if self.router else None
        bits = _qdot.attn_step(x, self.consts, cos, sin, latent, k_rot, pos, latent.dtype == np.float16, x_out, h_out,
                               _threads, PARALLEL_MIN_WEIGHTS, self.router, *(routed or (None, None)),
                               launch if self.router else None, join is not None)
        if bits & 3:
            raise (join.corrupt() if bits & 2 else
                   CodecError(f"{self.what}: corrupt data: outlier columns out of range or not increasing"))
        return x_out, h_out, routed, bool(bits & 4)


def keep_heap(nbytes: int) -> int:
    """Let the C allocator (glibc) serve blocks up to `nbytes` from its heap and keep up to `nbytes` of
    freed heap mapped, at most 32 MiB: a prefill's temporaries then reuse pages instead of faulting in
    fresh ones at every layer. The caller sizes it to memory its plan already holds for temporaries.
    Returns the bytes applied (0: unchanged, e.g. under 128 KiB or without glibc)."""
    return _qdot.keep_heap(int(nbytes))


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up elementwise, float32, in one pass (numpy takes four over the tensor); e^x is
    the softmax's polynomial on AVX2 (relative error about 2e-7, as float32 rounding)."""
    g = np.ascontiguousarray(gate, np.float32)
    u = np.ascontiguousarray(up, np.float32)
    if g.shape != u.shape:
        raise ValueError(f"swiglu: gate {g.shape} and up {u.shape} differ")
    out = np.empty(g.shape, np.float32)
    _qdot.swiglu(g, u, out)
    return out


def causal_softmax(scores: np.ndarray, start: int, scale: float) -> None:
    """A prompt chunk's attention scores [..., T, S] (float32, contiguous; new tokens at positions
    start .. start+T-1 of S), in place: each row times `scale`, softmax over the positions it may see
    (up to its own), 0 past them. One pass over the pool instead of numpy's six."""
    if scores.dtype != np.float32 or not scores.flags.c_contiguous or scores.ndim < 2:
        raise ValueError("causal_softmax: contiguous float32 scores [..., T, S]")
    T = scores.shape[-2]
    _qdot.causal_softmax(scores.reshape(-1, T, scores.shape[-1]), T, start, scale,
                         _threads if scores.size >= PARALLEL_MIN_WEIGHTS // 8 else 1)


def _no_tiles(codec: str) -> None:
    if codec == "q1t":
        raise CodecError("q1t lays out routed experts for their products; attention's kv_b takes q1")


def heads_t(codec: str, raw, shape, v: np.ndarray, stride: int) -> np.ndarray:
    """[nh, cols]: for each head h, v[h] (length n) times rows h*stride .. h*stride+n-1 of W,
    transposed (kv_b's key part applied to the query in absorbed attention)."""
    _no_tiles(codec)
    _, g, raw = _prepare(codec, raw, shape)
    v = np.ascontiguousarray(v, dtype=np.float32)
    out = np.empty((v.shape[0], int(g[G_COLS])), np.float32)
    weights = v.size * int(g[G_COLS])
    if _qdot.heads_t(raw, g, v, stride, out, _threads if weights >= PARALLEL_MIN_WEIGHTS else 1):
        raise CodecError(f"{codec}: corrupt data: outlier columns out of range or not increasing")
    return out


def heads(codec: str, raw, shape, x: np.ndarray, stride: int, first: int, n: int) -> np.ndarray:
    """[nh, n]: for each head h, rows h*stride+first .. +n-1 of W times x[h] (kv_b's value part)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    nh = x.shape[0]
    if is_gguf_codec(codec):
        return _ggml_heads(codec, raw, shape, x, stride, first, n)
    _no_tiles(codec)
    _, g, raw = _prepare(codec, raw, shape)
    out = np.empty(nh * n, np.float32)
    jobs = _head_jobs(nh, stride, first, n, x.shape[1])
    _run(raw, g[None, :], x, jobs, out, nh * n * x.shape[1], codec)
    return out.reshape(nh, n)


def _ggml_heads(codec: str, raw, shape, x: np.ndarray, stride: int, first: int, n: int) -> np.ndarray:
    """heads() for llama.cpp's blocks."""
    nh, raw, cols = x.shape[0], _ggml_raw(codec, raw, shape), int(shape[1])
    rb = get_codec(codec).nbytes((1, cols))
    if first or stride != n:          # one call per head, on its rows
        return np.concatenate([_ggml_heads(codec, raw[(h * stride + first) * rb:(h * stride + first + n) * rb],
                                           (n, cols), x[h:h + 1], n, 0, n) for h in range(nh)])
    out = np.empty(nh * n, np.float32)
    rows = nh * n
    _qdot.ggml_rows(raw[:rows * rb], ggml_type(codec), rows, cols, x, out,
                    _threads if rows * cols >= PARALLEL_MIN_WEIGHTS else 1, n, _llama_inputs)
    return out.reshape(nh, n)
