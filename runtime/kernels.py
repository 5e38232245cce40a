"""Fused low-bit kernels: y = x @ W.T straight from a block codec's packed bytes (formats/quants.py,
layout in formats/SPEC.md).

T = 1 (decode): the C kernel runtime/_qdot.c (integer dot products; AVX2 where the CPU has it, portable
C otherwise). It quantises x once per call (16-bit integers per 32 values, exact float sums kept),
multiplies each codec's stored digits by them in int32 lanes, applies each span's scale and offset
once, and corrects outliers exactly; nothing is dequantized. Every caller hands it a list of row jobs
(a linear, all routed experts of a token, kv_b's heads), shared out over a small thread pool.
A few tokens: that, token by token. More (prefill): rows are dequantized 64 at a time into a
cache-sized block (numba, compiled lazily and cached on disk) and BLAS multiplies.
`dequantize` equals the numpy reference decoder bit for bit (no fastmath there); tests hold it to it.
"""

from __future__ import annotations

import functools
import os

import numpy as np
from numba import njit, prange

from kimistream.runtime import _qdot

from kimistream.formats.codecs import CodecError, get_codec
from kimistream.formats.quants import outlier_columns_valid, K_Q1, K_Q2, K_Q2RTN, K_Q4, K_Q6, K_Q8, K_T1, QUANT_CODECS, BlockCodec

_F16_TO_F32 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
_POW3 = np.array([1, 3, 9, 27, 81], dtype=np.int64)
# binary16 exponent e -> the float32 factor of (1024 + mantissa): 2^(e-25); subnormals (e = 0)
# have no implicit bit and the factor 2^-24; e = 31 is infinity
_F16_POW2 = np.array([2.0 ** -24] + [2.0 ** (e - 25) for e in range(1, 31)] + [np.inf], dtype=np.float32)
_U = np.uint64

# Below this many weights a mat-vec runs on one thread (numba's thread count set to 1 around the
# call): splitting a small weight saves less than a busy second core costs (q4 512x1024: 163 us on
# one thread; 143 us on two when both cores are idle, 740 us when the other one is busy).
PARALLEL_MIN_WEIGHTS = 1 << 20
BLAS_MIN_TOKENS = 6       # from this many tokens on, dequantized row blocks + BLAS beat T mat-vecs
BLOCK_ROWS = 64           # rows per dequantized block: 64 x 7168 floats = 1.8 MB
XQ_MAX = 32767            # activations are quantised to -XQ_MAX .. XQ_MAX per 32 values
XQ_DTYPE = np.int16
_threads = int(os.environ.get("NUMBA_NUM_THREADS") or len(os.sched_getaffinity(0)))

# indices into the int64 geometry vector handed to the kernels
(G_ROWS, G_COLS, G_NSUB, G_NBLK, G_K, G_PARROW, G_SUBROW, G_CODEROW, G_OFFPAR, G_OFFOCOL, G_OFFOVAL, G_OFFSUB,
 G_OFFCODE, G_NBYTES, G_KIND, G_S, G_P, G_NPAR, G_BITS0, G_PB0, G_BITS1, G_PB1) = range(22)


def has_kernel(codec: str) -> bool:
    return codec in QUANT_CODECS


def _geometry_vector(codec: BlockCodec, shape) -> np.ndarray:
    if len(shape) != 2:
        codec.geometry(shape)            # raises the codec's own error
    return _geometry_cached(codec, int(shape[0]), int(shape[1]))


@functools.lru_cache(maxsize=4096)
def _geometry_cached(codec: BlockCodec, rows: int, cols: int) -> np.ndarray:
    # once per codec and shape, not per call: a decode step makes hundreds of calls
    g = codec.geometry((rows, cols))
    planes = list(codec.code_planes) + [(0, 1)] * (2 - len(codec.code_planes))
    extra = [codec.kind, codec.sub, codec.blk, codec.npar,
             planes[0][0] or 0, planes[0][1], planes[1][0] or 0, planes[1][1]]
    vec = np.concatenate([g.as_array(), np.array(extra, dtype=np.int64)])
    vec.flags.writeable = False
    return vec


# ----------------------------------------------------------------------------------------------- scalar helpers

@njit(cache=True, inline="always")
def _f16(raw, off, lut):
    """The binary16 at raw[off:off+2] as float32, exactly, by arithmetic: (1024 + mantissa) or the
    subnormal mantissa times a power of two from a 32-entry table (a 256 KiB lookup table would be
    evicted by the weights streaming through the cache). Infinities stay infinite; the encoder
    never writes NaN."""
    h = np.int32(raw[_U(off)]) | (np.int32(raw[_U(off) + _U(1)]) << 8)
    e = (h >> 10) & 31
    mag = np.float32((h & 1023) | (np.int32(e != 0) << 10)) * _F16_POW2[e]
    return -mag if h & 0x8000 else mag


@njit(cache=True)
def _digit(raw, base, n, p, bits, idx):
    """Digit of weight idx in a plane of n codes packed p per byte (bits 0: trits), starting at base."""
    chunk = 32 * p
    full = n // chunk
    c = idx // chunk
    if c < full:
        w = idx - c * chunk
        k = w // 32
        b = np.int64(raw[base + c * 32 + w - k * 32])
    else:
        lane = (n - full * chunk + p - 1) // p
        w = idx - full * chunk
        k = w // lane
        b = np.int64(raw[base + full * 32 + w - k * lane])
    if bits == 0:
        return (((b * _POW3[k]) & 255) * 3) >> 8
    return (b >> (k * bits)) & ((1 << bits) - 1)


# ----------------------------------------------------------------------------------------------- row scales

@njit(cache=True)
def _row_scales(raw, g, lut, r, As, Bs):
    """As[i], Bs[i] of every 32-weight span i of row r: value = A * level + B, with the exact f32
    operations of SPEC.md. One straight loop per kind: this runs once per row and call."""
    kind, cols = g[G_KIND], g[G_COLS]
    nspan = cols // 32
    po = g[G_OFFPAR] + r * g[G_PARROW]
    so = g[G_OFFSUB] + r * g[G_SUBROW]
    if kind == K_Q8:
        for i in range(nspan):
            q = po + 2 * i
            As[i] = lut[np.int64(raw[q]) | (np.int64(raw[q + 1]) << 8)]
            Bs[i] = np.float32(0)
    elif kind == K_Q2RTN:
        for i in range(nspan):
            q = po + 4 * (i >> 1)
            As[i] = lut[np.int64(raw[q]) | (np.int64(raw[q + 1]) << 8)]
            Bs[i] = lut[np.int64(raw[q + 2]) | (np.int64(raw[q + 3]) << 8)]
    else:
        # super-block by super-block, the f16 parameters read once per block (unsigned indices:
        # no wraparound selects, so the inner loops vectorize)
        npar = g[G_NPAR]
        nfull = nspan // 8
        for blk in range(g[G_NBLK]):
            q = po + 2 * npar * blk
            d = lut[np.int64(raw[q]) | (np.int64(raw[q + 1]) << 8)]
            m = lut[np.int64(raw[q + 2]) | (np.int64(raw[q + 3]) << 8)] if npar == 2 else np.float32(0)
            s0 = _U(8 * blk)
            n = _U(8) if blk < nfull else _U(nspan - 8 * blk)
            if kind == K_Q2:
                for i in range(n):
                    sb = np.int32(raw[_U(so) + s0 + i])
                    As[s0 + i] = d * np.float32(sb & 15)
                    Bs[s0 + i] = m * np.float32(sb >> 4)
            elif kind == K_Q4:
                for i in range(n):
                    As[s0 + i] = d * np.float32(raw[_U(so) + _U(2) * (s0 + i)])
                    Bs[s0 + i] = m * np.float32(raw[_U(so) + _U(2) * (s0 + i) + _U(1)])
            elif kind == K_Q6:
                for i in range(n):
                    As[s0 + i] = d * np.float32(raw[_U(so) + s0 + i])
                    Bs[s0 + i] = np.float32(0)
            else:  # t1, q1: two 4-bit scales per byte; q1's offset is per super-block
                for i in range(n):
                    k = s0 + i
                    As[k] = d * np.float32((np.int32(raw[_U(so) + (k >> _U(1))]) >> np.int32(4 * (k & _U(1)))) & 15)
                    Bs[k] = m


# ----------------------------------------------------------------------------------------------- dequantize

@njit(cache=True)
def _deq_row(raw, g, lut, r, out, As, Bs):
    """Row r dequantized into out (float32 [cols]), bit for bit as the reference decoder: no
    fastmath here, so no fused multiply-add and no reassociation."""
    cols, kind, p = g[G_COLS], g[G_KIND], g[G_PB0]
    _row_scales(raw, g, lut, r, As, Bs)
    base = g[G_OFFCODE] + r * g[G_CODEROW]
    codes = raw[base:base + g[G_CODEROW]]
    hasb = not (kind == K_Q8 or kind == K_Q6 or kind == K_T1)   # A * level, never + 0 (keeps -0.0)
    lo_bytes = (cols // 64) * 32 + ((cols % 64) + 1) // 2
    nfull = (cols // 128) * 128 if kind == K_Q6 else (cols // (32 * p)) * 32 * p
    # chunk by chunk, one destination slice per field: this shape is what LLVM vectorizes well
    if kind == K_Q6:
        for c in range(nfull // 128):
            hi = codes[lo_bytes + 32 * c:lo_bytes + 32 * c + 32]
            for h in range(2):
                lo = codes[64 * c + 32 * h:64 * c + 32 * h + 32]
                i = 4 * c + 2 * h
                a0, a1 = As[i], As[i + 1]
                d0 = out[32 * i:32 * i + 32]
                d1 = out[32 * i + 32:32 * i + 64]
                s0, s1 = np.int32(4 * h), np.int32(4 * h + 2)
                for j in range(32):
                    l, hb = np.int32(lo[j]), np.int32(hi[j])
                    d0[j] = a0 * np.float32(((l & 15) | (((hb >> s0) & 3) << 4)) - 32)
                    d1[j] = a1 * np.float32(((l >> 4) | (((hb >> s1) & 3) << 4)) - 32)
    elif kind == K_T1:
        for c in range(nfull // 160):
            src = codes[32 * c:32 * c + 32]
            for k in range(5):
                a = As[5 * c + k]
                dst = out[160 * c + 32 * k:160 * c + 32 * k + 32]
                m3 = np.int32(_POW3[k])
                for j in range(32):
                    dst[j] = a * (np.float32((((np.int32(src[j]) * m3) & 255) * 3) >> 8) - np.float32(1))
    elif kind == K_Q8:
        sc = codes.view(np.int8)
        for c in range(nfull // 32):
            src = sc[32 * c:32 * c + 32]
            dst = out[32 * c:32 * c + 32]
            a = As[c]
            for j in range(32):
                dst[j] = a * np.float32(src[j])
    elif kind == K_Q1:
        for c in range(nfull // 256):
            src = codes[32 * c:32 * c + 32]
            for k in range(8):
                a, bb = As[8 * c + k], Bs[8 * c + k]
                dst = out[256 * c + 32 * k:256 * c + 32 * k + 32]
                sh = np.int32(k)
                for j in range(32):
                    dst[j] = a * np.float32(2 * ((np.int32(src[j]) >> sh) & 1) - 1) + bb
    elif kind == K_Q4:
        for c in range(nfull // 64):
            src = codes[32 * c:32 * c + 32]
            a0, a1, b0, b1 = As[2 * c], As[2 * c + 1], Bs[2 * c], Bs[2 * c + 1]
            d0 = out[64 * c:64 * c + 32]
            d1 = out[64 * c + 32:64 * c + 64]
            for j in range(32):
                b = np.int32(src[j])
                d0[j] = a0 * np.float32(b & 15) + b0
                d1[j] = a1 * np.float32(b >> 4) + b1
    else:  # q2, q2rtn
        for c in range(nfull // 128):
            src = codes[32 * c:32 * c + 32]
            a0, a1, a2, a3 = As[4 * c], As[4 * c + 1], As[4 * c + 2], As[4 * c + 3]
            b0, b1, b2, b3 = Bs[4 * c], Bs[4 * c + 1], Bs[4 * c + 2], Bs[4 * c + 3]
            d0 = out[128 * c:128 * c + 32]
            d1 = out[128 * c + 32:128 * c + 64]
            d2 = out[128 * c + 64:128 * c + 96]
            d3 = out[128 * c + 96:128 * c + 128]
            for j in range(32):
                b = np.int32(src[j])
                d0[j] = a0 * np.float32(b & 3) + b0
                d1[j] = a1 * np.float32((b >> 2) & 3) + b1
                d2[j] = a2 * np.float32((b >> 4) & 3) + b2
                d3[j] = a3 * np.float32(b >> 6) + b3
    if nfull < cols:
        tail = out[nfull:]
        _tail_levels(codes, g, nfull, tail)
        for col in range(nfull, cols):
            lv = tail[col - nfull]
            out[col] = As[col >> 5] * lv + Bs[col >> 5] if hasb else As[col >> 5] * lv
    k = g[G_K]
    for i in range(k):
        o = g[G_OFFOCOL] + 2 * (r * k + i)
        col = np.int64(raw[o]) | (np.int64(raw[o + 1]) << 8)
        if col < cols:          # never write outside the row, whatever the bytes say
            out[col] = _f16(raw, g[G_OFFOVAL] + 2 * (r * k + i), lut)


@njit(parallel=True, cache=True)
def _dequantize(raw, g, lut, r0, out):
    """Rows r0 .. r0 + len(out) - 1 into out."""
    n = out.shape[0]
    nb = (n + 7) // 8
    for bi in prange(nb):
        A = np.empty(g[G_COLS] // 32, np.float32)
        B = np.empty(g[G_COLS] // 32, np.float32)
        for i in range(bi * 8, min(n, bi * 8 + 8)):
            _deq_row(raw, g, lut, r0 + i, out[i], A, B)


@njit(cache=True)
def _dequantize_serial(raw, g, lut, r0, out):
    """_dequantize on the calling thread (small weights: no parallel region to wake)."""
    A = np.empty(g[G_COLS] // 32, np.float32)
    B = np.empty(g[G_COLS] // 32, np.float32)
    for i in range(out.shape[0]):
        _deq_row(raw, g, lut, r0 + i, out[i], A, B)


# ----------------------------------------------------------------------------------------------- kv_b heads
#
# The decode mat-vec itself is in runtime/_qdot.c. Why its activations are 16-bit and not 8 as in
# llama.cpp: on the bundled models 8-bit activations (per 32 values) cost a KL of 4e-3 against the
# exact product (as much as q2 itself); 16 bits cost 2e-9 (benchmarks/RESULTS.md).

@njit(parallel=True, fastmath=True, cache=True)
def _heads_t(raw, g, lut, v, stride, out):
    """out[h] = sum_j v[h, j] * W[h * stride + j] (rows of one head's block, transposed product):
    each row dequantized exactly, then accumulated."""
    nh, n = v.shape
    for h in prange(nh):
        row = np.empty(g[G_COLS], np.float32)
        As = np.empty(g[G_COLS] // 32, np.float32)
        Bs = np.empty(g[G_COLS] // 32, np.float32)
        acc = out[h]
        acc[:] = 0
        for j in range(n):
            _deq_row(raw, g, lut, h * stride + j, row, As, Bs)
            c = v[h, j]
            for i in range(row.shape[0]):
                acc[i] += c * row[i]


@njit(cache=True, inline="always")
def _level_fast(codes, g, col):
    """Level of weight col from one row's codes; shifts instead of divisions for the common codecs."""
    kind, cols = g[G_KIND], g[G_COLS]
    if kind == K_Q2 or kind == K_Q2RTN:
        if col < (cols >> 7) << 7:
            return (np.int64(codes[((col >> 7) << 5) | (col & 31)]) >> (2 * ((col >> 5) & 3))) & 3
    elif kind == K_Q1:
        if col < (cols >> 8) << 8:
            b = (np.int64(codes[((col >> 8) << 5) | (col & 31)]) >> ((col >> 5) & 7)) & 1
            return 2 * b - 1
    d = _digit(codes, 0, cols, g[G_PB0], g[G_BITS0], col)
    if kind == K_Q8:
        return d - ((d & 128) << 1)
    if kind == K_Q6:
        lo_bytes = (cols // 64) * 32 + ((cols % 64) + 1) // 2
        return (d | (_digit(codes, lo_bytes, cols, g[G_PB1], g[G_BITS1], col) << 4)) - 32
    if kind == K_T1:
        return d - 1
    if kind == K_Q1:
        return 2 * d - 1
    return d


@njit(cache=True)
def _tail_levels(codes, g, start, lev):
    """Levels (as float32, exact) of the tail chunk, columns start..cols, into lev[0 .. cols-start):
    lane width L = ceil(R / per_byte)."""
    cols, kind, bits, p = g[G_COLS], g[G_KIND], g[G_BITS0], g[G_PB0]
    n = cols - start
    if kind == K_Q6:
        for i in range(n):
            lev[i] = np.float32(_level_fast(codes, g, start + i))
        return
    lane = (n + p - 1) // p
    tail = codes[(start // (32 * p)) * 32:]
    # levels relative to digits: q8 signed, t1 digit - 1, q1 2 * digit - 1
    mul = np.float32(2) if kind == K_Q1 else np.float32(1)
    add = np.float32(-1) if (kind == K_Q1 or kind == K_T1) else np.float32(0)
    for k in range(p):
        o = k * lane
        jn = min(lane, n - o)
        if bits == 0:
            m3 = np.int32(_POW3[k])
            for j in range(jn):
                lev[o + j] = np.float32((((np.int32(tail[j]) * m3) & 255) * 3) >> 8) + add
        elif kind == K_Q8:
            for j in range(jn):
                d = np.int32(tail[j])
                lev[o + j] = np.float32(d - ((d & 128) << 1))
        else:
            sh, mask = np.int32(k * bits), np.int32((1 << bits) - 1)
            for j in range(jn):
                lev[o + j] = mul * np.float32((np.int32(tail[j]) >> sh) & mask) + add


# ----------------------------------------------------------------------------------------------- public API

def _prepare(codec_name: str, raw, shape):
    codec = get_codec(codec_name)
    if not isinstance(codec, BlockCodec):
        raise CodecError(f"no kernel for codec {codec_name!r}")
    g = _geometry_vector(codec, shape)
    raw = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw.reshape(-1)
    if raw.dtype != np.uint8 or raw.size < g[G_NBYTES]:
        raise CodecError(f"{codec_name}: need {int(g[G_NBYTES])} bytes of uint8 for shape {list(shape)}")
    return codec, g, _readonly(raw)


def _readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view: weights from a file mapping are read-only, and numba compiles read-only and
    writeable arrays as different types; one type means one compilation of each kernel."""
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def _check_outliers(codec_name: str, raw, g) -> None:
    k, rows = int(g[G_K]), int(g[G_ROWS])
    if k and rows:
        ocol = raw[g[G_OFFOCOL]:g[G_OFFOCOL] + 2 * rows * k].view("<u2").reshape(rows, k)
        if not outlier_columns_valid(ocol, int(g[G_COLS])):
            raise CodecError(f"{codec_name}: corrupt data: outlier columns out of range or not increasing")


_CHECKED: dict = {}


def _check_outliers_once(codec_name: str, raw, g) -> None:
    """_check_outliers for a resident tensor, once per (address, size) it is used at."""
    key = (raw.ctypes.data, raw.size, codec_name)
    if key not in _CHECKED:
        _check_outliers(codec_name, raw, g)
        _CHECKED[key] = True


def _raise_if_bad(bad, codec_name: str) -> None:
    if bad[0]:
        raise CodecError(f"{codec_name}: corrupt data: outlier columns out of range or not increasing")


def quantize_activations(x: np.ndarray):
    """x [cols] float32 -> (xq int16 [cols], xsc float32 [cols/32], xs float32 [cols/32]): x is about
    xsc[s] * xq on span s (the rounding the integer kernels make), xs the exact span sums."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = x.shape[0] // 32
    xq, xsc, xs = np.empty(x.shape[0], XQ_DTYPE), np.empty(n, np.float32), np.empty(n, np.float32)
    _qdot.quantize(x, xq, xsc, xs)
    return xq, xsc, xs


def isa() -> str:
    """The instruction set the mat-vec kernel runs with ("avx2" or "generic")."""
    return _qdot.isa()


def set_threads(n: int) -> None:
    """Threads of the mat-vec kernel (the caller's included)."""
    global _threads
    _threads = max(1, int(n))


def dequantize(codec: str, raw, shape) -> np.ndarray:
    """Float32 weight from the codec's bytes; equal to the reference decoder bit for bit."""
    _, g, raw = _prepare(codec, raw, shape)
    _check_outliers(codec, raw, g)
    out = np.empty(tuple(shape), np.float32)
    if out.size:
        deq = _dequantize if out.size >= PARALLEL_MIN_WEIGHTS else _dequantize_serial
        deq(raw, g, _F16_TO_F32, 0, out)
    return out


def warm_up(codec: str) -> None:
    """Load (or compile) every kernel `codec` can run, on small all-zero weights. The mat-vec kernel
    takes the codec as data: after the first codec, this only loads what is cached."""
    c = get_codec(codec)
    gu, dn = (64, 256), (256, 64)
    zeros = np.zeros(2 * c.nbytes(gu) + c.nbytes(dn), np.uint8)
    x = np.zeros(256, np.float32)
    linear(x, codec, zeros, gu)
    dequantize(codec, zeros, gu)
    offs = np.array([[0, c.nbytes(gu), 2 * c.nbytes(gu)]], np.int64)
    moe_decode(zeros, offs, (codec, gu), (codec, dn), x, np.ones(1, np.float32), np.zeros(256, np.float32))
    heads_t(codec, zeros, gu, np.zeros((2, 32), np.float32), 32)
    heads(codec, zeros, gu, np.zeros((2, 256), np.float32), 32, 0, 32)


JOB_ROWS = 8              # rows per job of the mat-vec kernel


def _jobs(t0s, gi: int, first: int, rows: int, xis, outs) -> np.ndarray:
    """Jobs [m * ceil(rows / JOB_ROWS), 6] covering rows first .. first+rows-1 of m tensors (byte
    offsets t0s, inputs xis, outputs written from outs)."""
    lo = np.arange(0, rows, JOB_ROWS, dtype=np.int64)
    hi = np.minimum(lo + JOB_ROWS, rows)
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
def _linear_jobs(rows: int, T: int) -> np.ndarray:
    """Jobs of T tokens through one weight, shared by every call of this shape. Left writeable: numba
    compiles a read-only array as another type, and the kernel is too big to compile twice."""
    return _jobs(np.zeros(T), 0, 0, rows, np.arange(T), np.arange(T) * rows)


@functools.lru_cache(maxsize=1024)
def _head_jobs(nh: int, stride: int, first: int, n: int) -> np.ndarray:
    return np.concatenate([_jobs([0], 0, h * stride + first, n, [h], [h * n]) for h in range(nh)])


def _run(raw, geoms, xf, jobs, out, weights: int, what: str) -> None:
    """Run the jobs in the C kernel (which quantises the inputs xf [n, cols] itself), on the calling
    thread alone for a small amount of work."""
    threads = _threads if weights >= PARALLEL_MIN_WEIGHTS else 1
    if _qdot.rows(raw, geoms, xf, jobs, out, threads):
        raise CodecError(f"{what}: corrupt data: outlier columns out of range or not increasing")


def linear(x: np.ndarray, codec: str, raw, shape: tuple) -> np.ndarray:
    """y = x @ W.T for x [T, in] (or [in]) float32 and W [out, in] held in `raw` with `codec`."""
    x = np.asarray(x, dtype=np.float32)
    squeeze = x.ndim == 1
    x2 = np.ascontiguousarray(x.reshape(1, -1) if squeeze else x)
    rows, cols = (int(s) for s in shape)
    if x2.shape[-1] != cols:
        raise ValueError(f"x has {x2.shape[-1]} features, weight has {cols}")
    if not has_kernel(codec):
        w = get_codec(codec).decode(raw if not isinstance(raw, np.ndarray) else raw.reshape(-1), (rows, cols))
        y = x2 @ w.T
        return y[0] if squeeze else y
    _, g, raw = _prepare(codec, raw, (rows, cols))
    T = x2.shape[0]
    y = np.empty((T, rows), np.float32)
    if rows and T:
        if T < BLAS_MIN_TOKENS:
            jobs = _linear_jobs(rows, T)
            # a few tokens come from prefill, where BLAS's spinning threads sit next to every call:
            # there a parallel region waits for a core, so only a single token gets both
            _run(raw, g[None, :], x2, jobs, y.reshape(-1), rows * cols if T == 1 else 0, codec)
        else:
            _dequantized_matmul(x2, raw, g, rows, cols, y, codec)
    return y[0] if squeeze else y


def _dequantized_matmul(x2, raw, g, rows, cols, y, codec):
    """More tokens: dequantize BLOCK_ROWS rows at a time (cache-sized, never the whole weight) and
    let BLAS do the products."""
    _check_outliers(codec, raw, g)
    buf = np.empty((min(BLOCK_ROWS, rows), cols), np.float32)
    for r0 in range(0, rows, BLOCK_ROWS):
        blk = buf[:min(BLOCK_ROWS, rows - r0)]
        # on this thread: BLAS's threads spin between products, and a parallel region next to
        # them waits for a core (measured: 3.8 ms per 64-row block instead of 0.1)
        _dequantize_serial(raw, g, _F16_TO_F32, r0, blk)
        np.matmul(x2, blk.T, out=y[:, r0:r0 + blk.shape[0]])


def moe_decode(base: np.ndarray, offsets: np.ndarray, gate_up: tuple, down: tuple, x: np.ndarray,
               weights: np.ndarray, out: np.ndarray) -> None:
    """out += sum_e weights[e] * down_e(silu(gate_e x) * up_e x) for one token and all of its routed
    experts: two kernel calls (every expert's gate and up rows, then every expert's down rows), so
    both cores stay busy even when each expert is small. `offsets` [n, 3] are the byte offsets in
    `base` of each expert's gate, up and down tensors; `gate_up` and `down` are (codec, shape)."""
    g_gu = _geometry_vector(get_codec(gate_up[0]), gate_up[1])
    g_d = _geometry_vector(get_codec(down[0]), down[1])
    offsets = np.asarray(offsets, np.int64)
    if offsets.size and (offsets.min() < 0 or offsets[:, :2].max() + g_gu[G_NBYTES] > base.size
                         or offsets[:, 2].max() + g_d[G_NBYTES] > base.size):
        raise CodecError("expert tensors lie outside their buffer")
    base = _readonly(base)
    n, inter, hidden = len(offsets), int(g_gu[G_ROWS]), int(g_d[G_ROWS])
    if int(g_d[G_COLS]) != inter or int(g_gu[G_COLS]) != x.shape[0] or hidden != out.shape[0]:
        raise ValueError("expert shapes do not chain: gate/up [inter, hidden], down [hidden, inter]")
    h = np.empty(2 * n * inter, np.float32)
    jobs = _jobs(offsets[:, :2].reshape(-1), 0, 0, inter, np.zeros(2 * n), np.arange(2 * n) * inter)
    _run(base, g_gu[None, :], np.ascontiguousarray(x, np.float32)[None, :], jobs, h,
         2 * n * inter * x.shape[0], gate_up[0])
    h = h.reshape(n, 2, inter)
    with np.errstate(over="ignore"):
        act = (h[:, 0] / (1 + np.exp(-h[:, 0])) * h[:, 1]).astype(np.float32)
    y = np.empty(n * hidden, np.float32)
    jobs = _jobs(offsets[:, 2], 0, 0, hidden, np.arange(n), np.arange(n) * hidden)
    _run(base, g_d[None, :], act, jobs, y, n * hidden * inter, down[0])
    out += np.asarray(weights, np.float32) @ y.reshape(n, hidden)


def heads_t(codec: str, raw, shape, v: np.ndarray, stride: int) -> np.ndarray:
    """[nh, cols]: for each head h, v[h] (length n) times rows h*stride .. h*stride+n-1 of W,
    transposed (kv_b's key part applied to the query in absorbed attention)."""
    _, g, raw = _prepare(codec, raw, shape)
    _check_outliers_once(codec, raw, g)
    v = np.ascontiguousarray(v, dtype=np.float32)
    out = np.empty((v.shape[0], int(g[G_COLS])), np.float32)
    _heads_t(raw, g, _F16_TO_F32, v, stride, out)
    return out


def heads(codec: str, raw, shape, x: np.ndarray, stride: int, first: int, n: int) -> np.ndarray:
    """[nh, n]: for each head h, rows h*stride+first .. +n-1 of W times x[h] (kv_b's value part)."""
    _, g, raw = _prepare(codec, raw, shape)
    x = np.ascontiguousarray(x, dtype=np.float32)
    nh = x.shape[0]
    out = np.empty(nh * n, np.float32)
    jobs = _head_jobs(nh, stride, first, n)
    _run(raw, g[None, :], x, jobs, out, nh * n * x.shape[1], codec)
    return out.reshape(nh, n)
