"""Fused low-bit kernels: y = x @ W.T straight from a block codec's packed bytes (formats/quants.py,
layout in formats/SPEC.md), with numba, compiled lazily and cached on disk.

T = 1 (decode): integer dot products. x is quantised once per call (16-bit integers per 32 values);
each codec has one loop that multiplies its stored digits by them into int32 sums per 32-weight
span, and the span's scale and offset are applied once per span; outliers are corrected exactly.
Nothing is dequantized. A few tokens: that, token by token. More (prefill): rows are dequantized 64
at a time into a cache-sized block and BLAS multiplies — never the whole weight.
`moe_decode` runs one token through all of its routed experts in one call, and `heads` / `heads_t`
apply kv_b per attention head without a float copy.
`dequantize` equals the numpy reference decoder bit for bit (no fastmath there); tests hold it to it.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit, parallel_chunksize, prange

from kimistream.formats.codecs import CodecError, get_codec
from kimistream.formats.quants import outlier_columns_valid, K_Q1, K_Q2, K_Q2RTN, K_Q4, K_Q6, K_Q8, K_T1, QUANT_CODECS, BlockCodec

_F16_TO_F32 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
_POW3 = np.array([1, 3, 9, 27, 81], dtype=np.int64)
_U = np.uint64

# Below this many weights a parallel region costs more than it saves (a 192x256 matvec: 90 us on one
# thread, 7 ms on two when the other core is busy), so small weights run on the calling thread.
PARALLEL_MIN_WEIGHTS = 1 << 21
BLAS_MIN_TOKENS = 6       # from this many tokens on, dequantized row blocks + BLAS beat T mat-vecs
BLOCK_ROWS = 64           # rows per dequantized block: 64 x 7168 floats = 1.8 MB
XQ_MAX = 32767            # activations are quantised to -XQ_MAX .. XQ_MAX per 32 values
XQ_DTYPE = np.int16

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
    return lut[np.int64(raw[off]) | (np.int64(raw[off + 1]) << 8)]


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


# ----------------------------------------------------------------------------------------------- matvec (T = 1)
#
# Integer dot products. The activation vector is quantised once per call to 16-bit integers per
# 32 values (x ~ xsc[s] * xq on span s) and its exact float sum per span is kept. For a row whose
# weights are A[s] * level + B[s] with level = mul * digit - z (digit: the stored code), span s adds
#     A[s] * mul * xsc[s] * isum[s] + (B[s] - z * A[s]) * xs[s],    isum[s] = sum(digit * xq)
# so the only inexact part is the rounding of x inside isum. isum comes from one loop per codec over
# 32-byte code chunks in int32 lanes, which LLVM turns into vpmaddwd. Why 16 bits and not 8 as
# llama.cpp does: on the bundled models 8-bit activations (per 32 values) cost a KL of 4e-3 against
# the exact product (as much as q2 itself); 16 bits cost 3e-9, and as numba's LLVM widens to 16-bit
# lanes either way, run at the same speed (benchmarks/RESULTS.md).

@njit(cache=True)
def _quantize_x(x, xq, xsc, xs):
    """x [cols] float32 (cols a multiple of 32) -> xq (int16 codes), xsc (span scale), xs (exact
    span sum)."""
    for s in range(x.shape[0] // 32):
        amax = np.float32(0)
        tot = np.float32(0)
        for j in range(32):
            v = x[32 * s + j]
            tot += v
            amax = max(amax, abs(v))
        xs[s] = tot
        if amax == 0:
            xsc[s] = 0
            for j in range(32):
                xq[32 * s + j] = 0
        else:
            xsc[s] = amax / np.float32(XQ_MAX)
            inv = np.float32(XQ_MAX) / amax
            for j in range(32):
                xq[32 * s + j] = XQ_DTYPE(np.rint(x[32 * s + j] * inv))


@njit(cache=True)
def _isum_q2(codes, xq, n, isum):
    """2-bit digits, 4 spans per 32-byte chunk (also q2rtn)."""
    for c in range(n):
        s0 = np.int32(0)
        s1 = np.int32(0)
        s2 = np.int32(0)
        s3 = np.int32(0)
        cb, xb = _U(32 * c), _U(128 * c)
        for j in range(32):
            uj = _U(j)
            b = np.int32(codes[cb + uj])
            s0 = np.int32(s0 + np.int32((b & np.int32(3)) * np.int32(xq[xb + uj])))
            s1 = np.int32(s1 + np.int32(((b >> np.int32(2)) & np.int32(3)) * np.int32(xq[xb + _U(32) + uj])))
            s2 = np.int32(s2 + np.int32(((b >> np.int32(4)) & np.int32(3)) * np.int32(xq[xb + _U(64) + uj])))
            s3 = np.int32(s3 + np.int32((b >> np.int32(6)) * np.int32(xq[xb + _U(96) + uj])))
        isum[4 * c] = s0
        isum[4 * c + 1] = s1
        isum[4 * c + 2] = s2
        isum[4 * c + 3] = s3


@njit(cache=True)
def _isum_q4(codes, xq, n, isum):
    for c in range(n):
        s0 = np.int32(0)
        s1 = np.int32(0)
        cb, xb = _U(32 * c), _U(64 * c)
        for j in range(32):
            uj = _U(j)
            b = np.int32(codes[cb + uj])
            s0 = np.int32(s0 + np.int32((b & np.int32(15)) * np.int32(xq[xb + uj])))
            s1 = np.int32(s1 + np.int32((b >> np.int32(4)) * np.int32(xq[xb + _U(32) + uj])))
        isum[2 * c] = s0
        isum[2 * c + 1] = s1


@njit(cache=True)
def _isum_q8(codes, xq, n, isum):
    sc = codes.view(np.int8)
    for c in range(n):
        s0 = np.int32(0)
        cb = _U(32 * c)
        for j in range(32):
            uj = _U(j)
            s0 = np.int32(s0 + np.int32(np.int32(sc[cb + uj]) * np.int32(xq[cb + uj])))
        isum[c] = s0


@njit(cache=True)
def _isum_q6(codes, xq, n, lo_bytes, isum):
    """Low nibbles in one plane (64 bytes per 128 weights), high 2 bits in the next (32 bytes)."""
    for c in range(n):
        s0 = np.int32(0)
        s1 = np.int32(0)
        s2 = np.int32(0)
        s3 = np.int32(0)
        lo, hi, xb = _U(64 * c), _U(lo_bytes + 32 * c), _U(128 * c)
        for j in range(32):
            uj = _U(j)
            h = np.int32(codes[hi + uj])
            l0 = np.int32(codes[lo + uj])
            l1 = np.int32(codes[lo + _U(32) + uj])
            s0 = np.int32(s0 + np.int32(((l0 & np.int32(15)) | ((h & np.int32(3)) << np.int32(4))) * np.int32(xq[xb + uj])))
            s1 = np.int32(s1 + np.int32(((l0 >> np.int32(4)) | (((h >> np.int32(2)) & np.int32(3)) << np.int32(4))) * np.int32(xq[xb + _U(32) + uj])))
            s2 = np.int32(s2 + np.int32(((l1 & np.int32(15)) | (((h >> np.int32(4)) & np.int32(3)) << np.int32(4))) * np.int32(xq[xb + _U(64) + uj])))
            s3 = np.int32(s3 + np.int32(((l1 >> np.int32(4)) | ((h >> np.int32(6)) << np.int32(4))) * np.int32(xq[xb + _U(96) + uj])))
        isum[4 * c] = s0
        isum[4 * c + 1] = s1
        isum[4 * c + 2] = s2
        isum[4 * c + 3] = s3


@njit(cache=True)
def _isum_t1(codes, xq, n, isum):
    """Trit digits d_k = ((q * 3^k) mod 256) * 3 >> 8, five spans per chunk."""
    for c in range(n):
        s0 = np.int32(0)
        s1 = np.int32(0)
        s2 = np.int32(0)
        s3 = np.int32(0)
        s4 = np.int32(0)
        cb, xb = _U(32 * c), _U(160 * c)
        for j in range(32):
            uj = _U(j)
            q = np.int32(codes[cb + uj])
            m255 = np.int32(255)
            s0 = np.int32(s0 + np.int32(((q * np.int32(3)) >> np.int32(8)) * np.int32(xq[xb + uj])))
            s1 = np.int32(s1 + np.int32(((((q * np.int32(3)) & m255) * np.int32(3)) >> np.int32(8)) * np.int32(xq[xb + _U(32) + uj])))
            s2 = np.int32(s2 + np.int32(((((q * np.int32(9)) & m255) * np.int32(3)) >> np.int32(8)) * np.int32(xq[xb + _U(64) + uj])))
            s3 = np.int32(s3 + np.int32(((((q * np.int32(27)) & m255) * np.int32(3)) >> np.int32(8)) * np.int32(xq[xb + _U(96) + uj])))
            s4 = np.int32(s4 + np.int32(((((q * np.int32(81)) & m255) * np.int32(3)) >> np.int32(8)) * np.int32(xq[xb + _U(128) + uj])))
        isum[5 * c] = s0
        isum[5 * c + 1] = s1
        isum[5 * c + 2] = s2
        isum[5 * c + 3] = s3
        isum[5 * c + 4] = s4


@njit(cache=True)
def _isum_q1(codes, xq, n, isum):
    for c in range(n):
        s0 = np.int32(0)
        s1 = np.int32(0)
        s2 = np.int32(0)
        s3 = np.int32(0)
        s4 = np.int32(0)
        s5 = np.int32(0)
        s6 = np.int32(0)
        s7 = np.int32(0)
        cb, xb = _U(32 * c), _U(256 * c)
        one = np.int32(1)
        for j in range(32):
            uj = _U(j)
            b = np.int32(codes[cb + uj])
            s0 = np.int32(s0 + np.int32((b & one) * np.int32(xq[xb + uj])))
            s1 = np.int32(s1 + np.int32(((b >> np.int32(1)) & one) * np.int32(xq[xb + _U(32) + uj])))
            s2 = np.int32(s2 + np.int32(((b >> np.int32(2)) & one) * np.int32(xq[xb + _U(64) + uj])))
            s3 = np.int32(s3 + np.int32(((b >> np.int32(3)) & one) * np.int32(xq[xb + _U(96) + uj])))
            s4 = np.int32(s4 + np.int32(((b >> np.int32(4)) & one) * np.int32(xq[xb + _U(128) + uj])))
            s5 = np.int32(s5 + np.int32(((b >> np.int32(5)) & one) * np.int32(xq[xb + _U(160) + uj])))
            s6 = np.int32(s6 + np.int32(((b >> np.int32(6)) & one) * np.int32(xq[xb + _U(192) + uj])))
            s7 = np.int32(s7 + np.int32((b >> np.int32(7)) * np.int32(xq[xb + _U(224) + uj])))
        isum[8 * c] = s0
        isum[8 * c + 1] = s1
        isum[8 * c + 2] = s2
        isum[8 * c + 3] = s3
        isum[8 * c + 4] = s4
        isum[8 * c + 5] = s5
        isum[8 * c + 6] = s6
        isum[8 * c + 7] = s7


@njit(cache=True, inline="always")
def _digit_form(kind):
    """(mul, z) with level = mul * digit - z."""
    if kind == K_Q6:
        return np.float32(1), np.float32(32)
    if kind == K_T1:
        return np.float32(1), np.float32(1)
    if kind == K_Q1:
        return np.float32(2), np.float32(1)
    return np.float32(1), np.float32(0)


@njit(cache=True, inline="always")
def _full_cols(g):
    """Columns covered by full code chunks (the integer path); the rest is the tail."""
    kind, cols = g[G_KIND], g[G_COLS]
    if kind == K_Q6:
        return (cols // 128) * 128
    return (cols // (32 * g[G_PB0])) * 32 * g[G_PB0]


@njit(cache=True, inline="always")
def _digit_full(codes, kind, col, cols):
    """Stored digit of column col of a row's codes, col inside the full chunks (shifts only)."""
    c = _U(col)
    lane = c & _U(31)
    if kind == K_Q2 or kind == K_Q2RTN:
        return (np.int32(codes[((c >> _U(7)) << _U(5)) | lane]) >> np.int32(2 * ((col >> 5) & 3))) & 3
    if kind == K_Q4:
        return (np.int32(codes[((c >> _U(6)) << _U(5)) | lane]) >> np.int32(4 * ((col >> 5) & 1))) & 15
    if kind == K_Q8:
        return ((np.int32(codes[c]) ^ 128) - 128)        # the byte as int8
    if kind == K_Q1:
        return (np.int32(codes[((c >> _U(8)) << _U(5)) | lane]) >> np.int32((col >> 5) & 7)) & 1
    if kind == K_Q6:
        lo = (np.int32(codes[((c >> _U(6)) << _U(5)) | lane]) >> np.int32(4 * ((col >> 5) & 1))) & 15
        hi_base = _U((cols // 64) * 32 + ((cols % 64) + 1) // 2)
        hi = (np.int32(codes[hi_base + (((c >> _U(7)) << _U(5)) | lane)]) >> np.int32(2 * ((col >> 5) & 3))) & 3
        return lo | (hi << 4)
    # t1: chunks of 160 weights in 32 bytes, field k = position // 32 inside the chunk
    ch = col // 160
    k = (col - 160 * ch) >> 5
    q = np.int32(codes[_U(32 * ch) + lane])
    return (((q * np.int32(_POW3[k])) & 255) * 3) >> 8


@njit(cache=True, fastmath=True)
def _row_int(raw, t0, g, lut, r, x, xq, xsc, xs, As, Bs, isum, lev, bad):
    """x . row r of the tensor starting at byte t0 of raw, from the quantised activations."""
    cols, kind = g[G_COLS], g[G_KIND]
    _row_scales(raw[t0:], g, lut, r, As, Bs)
    base = t0 + g[G_OFFCODE] + r * g[G_CODEROW]
    codes = raw[base:base + g[G_CODEROW]]
    done = _full_cols(g)
    if kind == K_Q2 or kind == K_Q2RTN:
        _isum_q2(codes, xq, done // 128, isum)
    elif kind == K_Q4:
        _isum_q4(codes, xq, done // 64, isum)
    elif kind == K_Q8:
        _isum_q8(codes, xq, done // 32, isum)
    elif kind == K_Q6:
        _isum_q6(codes, xq, done // 128, (cols // 64) * 32 + ((cols % 64) + 1) // 2, isum)
    elif kind == K_T1:
        _isum_t1(codes, xq, done // 160, isum)
    else:
        _isum_q1(codes, xq, done // 256, isum)
    mul, z = _digit_form(kind)
    tot = np.float32(0)
    for s in range(done // 32):
        a = As[s]
        tot += (a * mul * xsc[s]) * np.float32(isum[s]) + (Bs[s] - z * a) * xs[s]
    if done < cols:
        tot += _tail_dot(codes, g, x, As, Bs, done, lev)
    k_out = g[G_K]
    prev = np.int64(-1)
    for i in range(k_out):
        # outliers: take back exactly what the sums above added for this column, add the stored value
        o = t0 + g[G_OFFOCOL] + 2 * (r * k_out + i)
        col = np.int64(raw[o]) | (np.int64(raw[o + 1]) << 8)
        if col >= cols or col <= prev:
            # corrupt, unless the row's columns are all zero (a sparse hole of a synthetic file)
            for i2 in range(k_out):
                o2 = t0 + g[G_OFFOCOL] + 2 * (r * k_out + i2)
                if raw[o2] != 0 or raw[o2 + 1] != 0:
                    bad[0] = 1
            break
        prev = col
        v = _f16(raw, t0 + g[G_OFFOVAL] + 2 * (r * k_out + i), lut)
        s = col >> 5
        if col < done:
            d = np.float32(_digit_full(codes, kind, col, cols))
            used = As[s] * mul * d * (xsc[s] * np.float32(xq[col])) + (Bs[s] - z * As[s]) * x[col]
        else:
            used = (As[s] * np.float32(_level_fast(codes, g, col)) + Bs[s]) * x[col]
        tot += v * x[col] - used
    return tot


@njit(cache=True)
def _scratch(g):
    nspan = g[G_COLS] // 32
    return (np.empty(nspan, np.float32), np.empty(nspan, np.float32), np.empty(nspan, np.int32),
            np.empty(256, np.float32))


@njit(parallel=True, fastmath=True, cache=True)
def _matvec(raw, g, lut, x, xq, xsc, xs, y, bad):
    rows = g[G_ROWS]
    nb = (rows + 7) // 8
    for bi in prange(nb):
        As, Bs, isum, lev = _scratch(g)
        for r in range(bi * 8, min(rows, bi * 8 + 8)):
            y[r] = _row_int(raw, 0, g, lut, r, x, xq, xsc, xs, As, Bs, isum, lev, bad)


@njit(fastmath=True, cache=True)
def _matvec_serial(raw, g, lut, x, xq, xsc, xs, y, bad):
    As, Bs, isum, lev = _scratch(g)
    for r in range(g[G_ROWS]):
        y[r] = _row_int(raw, 0, g, lut, r, x, xq, xsc, xs, As, Bs, isum, lev, bad)


@njit(cache=True, fastmath=True)
def _silu_mul(g, u, out):
    for i in range(out.shape[0]):
        out[i] = g[i] / (np.float32(1) + np.exp(-g[i])) * u[i]


@njit(parallel=True, fastmath=True, cache=True)
def _moe_decode(base, offs, g_gu, g_d, lut, x, gate_w, out, bad):
    """One token through the routed experts whose gate, up and down tensors start at base[offs[e]]:
    out = sum_e gate_w[e] * down_e(silu(gate_e x) * up_e x). Two parallel regions (gate and up rows
    of every expert, then down rows of every expert), so both cores stay busy even when each
    expert's matrices are too small to split."""
    n, inter, hidden = offs.shape[0], g_gu[G_ROWS], g_d[G_ROWS]
    xq = np.empty(x.shape[0], XQ_DTYPE)
    xsc = np.empty(x.shape[0] // 32, np.float32)
    xs = np.empty(x.shape[0] // 32, np.float32)
    _quantize_x(x, xq, xsc, xs)
    h = np.empty((n, 2, inter), np.float32)
    nb = (inter + 7) // 8
    for it in prange(n * 2 * nb):
        e = it // (2 * nb)
        which = (it - e * 2 * nb) // nb
        b = it - e * 2 * nb - which * nb
        As, Bs, isum, lev = _scratch(g_gu)
        t0 = offs[e, which]
        for r in range(b * 8, min(inter, b * 8 + 8)):
            h[e, which, r] = _row_int(base, t0, g_gu, lut, r, x, xq, xsc, xs, As, Bs, isum, lev, bad)
    a = np.empty((n, inter), np.float32)
    aq = np.empty((n, inter), XQ_DTYPE)
    asc = np.empty((n, inter // 32), np.float32)
    asum = np.empty((n, inter // 32), np.float32)
    for e in range(n):
        _silu_mul(h[e, 0], h[e, 1], a[e])
        _quantize_x(a[e], aq[e], asc[e], asum[e])
    y = np.empty((n, hidden), np.float32)
    nb = (hidden + 7) // 8
    for it in prange(n * nb):
        e = it // nb
        b = it - e * nb
        As, Bs, isum, lev = _scratch(g_d)
        t0 = offs[e, 2]
        for r in range(b * 8, min(hidden, b * 8 + 8)):
            y[e, r] = _row_int(base, t0, g_d, lut, r, a[e], aq[e], asc[e], asum[e], As, Bs, isum, lev, bad)
    for e in range(n):
        for r in range(hidden):
            out[r] += gate_w[e] * y[e, r]


@njit(parallel=True, fastmath=True, cache=True)
def _heads_t(raw, g, lut, v, stride, out):
    """out[h] = sum_j v[h, j] * W[h * stride + j] (rows of one head's block, transposed product):
    each row dequantized exactly, then accumulated."""
    nh, n = v.shape
    for h in prange(nh):
        row = np.empty(g[G_COLS], np.float32)
        As, Bs, _, _ = _scratch(g)
        acc = out[h]
        acc[:] = 0
        for j in range(n):
            _deq_row(raw, g, lut, h * stride + j, row, As, Bs)
            c = v[h, j]
            for i in range(row.shape[0]):
                acc[i] += c * row[i]


@njit(parallel=True, fastmath=True, cache=True)
def _heads(raw, g, lut, x, stride, first, out, bad):
    """out[h, i] = W[h * stride + first + i] . x[h]: per-head row ranges, each head its own input."""
    nh, n = out.shape
    cols = g[G_COLS]
    for h in prange(nh):
        xq = np.empty(cols, XQ_DTYPE)
        xsc = np.empty(cols // 32, np.float32)
        xs = np.empty(cols // 32, np.float32)
        _quantize_x(x[h], xq, xsc, xs)
        As, Bs, isum, lev = _scratch(g)
        for i in range(n):
            out[h, i] = _row_int(raw, 0, g, lut, h * stride + first + i, x[h], xq, xsc, xs, As, Bs, isum, lev, bad)


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


@njit(cache=True, fastmath=True)
def _tail_dot(codes, g, x, As, Bs, start, lev):
    """The tail chunk (columns start..cols) of one row: levels into lev (>= 256 floats), then spans."""
    n = g[G_COLS] - start
    _tail_levels(codes, g, start, lev)
    tot = np.float32(0)
    for i in range(n // 32):
        a, b = As[(start >> 5) + i], Bs[(start >> 5) + i]
        xo = start + 32 * i
        for j in range(32):
            tot += (a * lev[32 * i + j] + b) * x[xo + j]
    return tot


# ----------------------------------------------------------------------------------------------- public API

def _prepare(codec_name: str, raw, shape):
    codec = get_codec(codec_name)
    if not isinstance(codec, BlockCodec):
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
    _quantize_x(x, xq, xsc, xs)
    return xq, xsc, xs


def dequantize(codec: str, raw, shape) -> np.ndarray:
    """Float32 weight from the codec's bytes; equal to the reference decoder bit for bit."""
    _, g, raw = _prepare(codec, raw, shape)
    _check_outliers(codec, raw, g)
    out = np.empty(tuple(shape), np.float32)
    if out.size:
        deq = _dequantize_serial if out.size < PARALLEL_MIN_WEIGHTS else _dequantize
        deq(raw, g, _F16_TO_F32, 0, out)
    return out


def warm_up(codec: str) -> None:
    """Load (or compile) every kernel variant `codec` can run, on small all-zero weights."""
    shape = (1, 256)
    _, g, raw = _prepare(codec, np.zeros(get_codec(codec).nbytes(shape), np.uint8), shape)
    x, y, out = np.zeros(256, np.float32), np.empty(1, np.float32), np.empty(shape, np.float32)
    xq, xsc, xs = quantize_activations(x)
    bad = np.zeros(1, np.int64)
    for matvec, deq in ((_matvec, _dequantize), (_matvec_serial, _dequantize_serial)):
        matvec(raw, g, _F16_TO_F32, x, xq, xsc, xs, y, bad)
        deq(raw, g, _F16_TO_F32, 0, out)
    # the kernels over several weights take the codec as data: one compilation serves every codec
    gu, dn = (64, 256), (256, 64)
    zeros = np.zeros(2 * get_codec(codec).nbytes(gu) + get_codec(codec).nbytes(dn), np.uint8)
    offs = np.array([[0, get_codec(codec).nbytes(gu), 2 * get_codec(codec).nbytes(gu)]], np.int64)
    moe_decode(zeros, offs, (codec, gu), (codec, dn), x, np.ones(1, np.float32), np.zeros(256, np.float32))
    heads_t(codec, zeros, gu, np.zeros((2, 32), np.float32), 32)
    heads(codec, zeros, gu, np.zeros((2, 256), np.float32), 32, 0, 32)


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
    y = np.empty((x2.shape[0], rows), np.float32)
    if rows and x2.shape[0]:
        if rows * cols < PARALLEL_MIN_WEIGHTS:
            _linear_into(x2, raw, g, rows, cols, y, _matvec_serial, _dequantize_serial, codec)
        else:
            # dynamic scheduling in small chunks: a thread that loses its core does not hold up the call
            with parallel_chunksize(4):
                _linear_into(x2, raw, g, rows, cols, y, _matvec, _dequantize, codec)
    return y[0] if squeeze else y


def _linear_into(x2, raw, g, rows, cols, y, matvec, deq, codec):
    T = x2.shape[0]
    if T < BLAS_MIN_TOKENS:
        bad = np.zeros(1, np.int64)
        for t in range(T):
            xq, xsc, xs = quantize_activations(x2[t])
            matvec(raw, g, _F16_TO_F32, x2[t], xq, xsc, xs, y[t], bad)
        _raise_if_bad(bad, codec)
    else:
        # a few tokens or more: dequantize BLOCK_ROWS rows at a time (cache-sized, never the
        # whole weight) and let BLAS do the products
        _check_outliers(codec, raw, g)
        buf = np.empty((min(BLOCK_ROWS, rows), cols), np.float32)
        for r0 in range(0, rows, BLOCK_ROWS):
            blk = buf[:min(BLOCK_ROWS, rows - r0)]
            deq(raw, g, _F16_TO_F32, r0, blk)
            np.matmul(x2, blk.T, out=y[:, r0:r0 + blk.shape[0]])


def moe_decode(base: np.ndarray, offsets: np.ndarray, gate_up: tuple, down: tuple, x: np.ndarray,
               weights: np.ndarray, out: np.ndarray) -> None:
    """out += sum_e weights[e] * down_e(silu(gate_e x) * up_e x) for one token, every routed expert in
    one call. `offsets` [n, 3] are the byte offsets in `base` of each expert's gate, up and down
    tensors; `gate_up` and `down` are (codec, shape) of those tensors (block codecs)."""
    g_gu = _geometry_vector(get_codec(gate_up[0]), gate_up[1])
    g_d = _geometry_vector(get_codec(down[0]), down[1])
    if offsets.size and (offsets.min() < 0 or offsets[:, :2].max() + g_gu[G_NBYTES] > base.size
                         or offsets[:, 2].max() + g_d[G_NBYTES] > base.size):
        raise CodecError("expert tensors lie outside their buffer")
    bad = np.zeros(1, np.int64)
    with parallel_chunksize(2):
        _moe_decode(base, offsets, g_gu, g_d, _F16_TO_F32, x, weights, out, bad)
    _raise_if_bad(bad, f"{gate_up[0]}/{down[0]}")


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
    out = np.empty((x.shape[0], n), np.float32)
    bad = np.zeros(1, np.int64)
    _heads(raw, g, _F16_TO_F32, x, stride, first, out, bad)
    _raise_if_bad(bad, codec)
    return out
