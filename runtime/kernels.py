"""Fused low-bit kernels: y = x @ W.T straight from a block codec's packed bytes (formats/quants.py,
layout in formats/SPEC.md), with numba, compiled lazily and cached on disk.

T = 1 (decode): unpacking is fused with the multiply-add, rows run in parallel, nothing is
dequantized; per 32-weight span the kernel adds scale * sum(level * x) + offset * sum(x), with
sum(x) per span computed once per call. A few tokens: that, token by token. More (prefill): rows are
dequantized 64 at a time into a cache-sized block and BLAS multiplies — never the whole weight.
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

# Below this many weights a parallel region costs more than it saves (a 192x256 matvec: 90 us on one
# thread, 7 ms on two when the other core is busy), so small weights run on the calling thread.
PARALLEL_MIN_WEIGHTS = 1 << 21
BLAS_MIN_TOKENS = 6       # from this many tokens on, dequantized row blocks + BLAS beat T mat-vecs
BLOCK_ROWS = 64           # rows per dequantized block: 64 x 7168 floats = 1.8 MB

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
        # the f16 parameters of the row's super-blocks first, then one flat loop over the spans
        # (slices keep indices provably non-negative: no wraparound selects, and it vectorizes)
        npar = g[G_NPAR]
        par = raw[po:po + g[G_PARROW]]
        sub = raw[so:so + g[G_SUBROW]]
        D = np.empty(g[G_NBLK], np.float32)
        M = np.empty(g[G_NBLK], np.float32)
        for blk in range(g[G_NBLK]):
            q = 2 * npar * blk
            D[blk] = lut[np.int64(par[q]) | (np.int64(par[q + 1]) << 8)]
            M[blk] = lut[np.int64(par[q + 2]) | (np.int64(par[q + 3]) << 8)] if npar == 2 else np.float32(0)
        if kind == K_Q2:
            for i in range(nspan):
                sb = np.int32(sub[i])
                As[i] = D[i >> 3] * np.float32(sb & 15)
                Bs[i] = M[i >> 3] * np.float32(sb >> 4)
        elif kind == K_Q4:
            for i in range(nspan):
                As[i] = D[i >> 3] * np.float32(sub[2 * i])
                Bs[i] = M[i >> 3] * np.float32(sub[2 * i + 1])
        elif kind == K_Q6:
            for i in range(nspan):
                As[i] = D[i >> 3] * np.float32(sub[i])
                Bs[i] = np.float32(0)
        else:  # t1, q1: two 4-bit scales per byte; q1's offset is per super-block
            for i in range(nspan):
                As[i] = D[i >> 3] * np.float32((np.int32(sub[i >> 1]) >> (4 * (i & 1))) & 15)
                Bs[i] = M[i >> 3]


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

@njit(cache=True, fastmath=True)
def _row_dot(raw, g, x, xs, As, Bs, acc):
    """Sum over the full-chunk part of row codes: sum_span As[span] * sum(level * x) + Bs[span] * xs[span].
    As, Bs are per 32-weight span; acc is 32 lanes of scratch. Returns (sum, first column not covered)."""
    cols, kind = g[G_COLS], g[G_KIND]
    for j in range(32):
        acc[j] = 0
    if kind == K_Q6:
        nspan = (cols // 128) * 4
        lo_bytes = np.uint64((cols // 64) * 32 + ((cols % 64) + 1) // 2)
        for c in range(nspan // 4):
            lo = np.uint64(64 * c)
            hi = lo_bytes + np.uint64(32 * c)
            xo = np.uint64(128 * c)
            a0, a1, a2, a3 = As[4 * c], As[4 * c + 1], As[4 * c + 2], As[4 * c + 3]
            for j in range(32):
                uj = np.uint64(j)
                h = np.int32(raw[hi + uj])
                l0 = np.int32(raw[lo + uj])
                l1 = np.int32(raw[lo + np.uint64(32) + uj])
                v0 = np.float32(((l0 & 15) | ((h & 3) << 4)) - 32)
                v1 = np.float32(((l0 >> 4) | (((h >> 2) & 3) << 4)) - 32)
                v2 = np.float32(((l1 & 15) | (((h >> 4) & 3) << 4)) - 32)
                v3 = np.float32(((l1 >> 4) | ((h >> 6) << 4)) - 32)
                acc[uj] += (a0 * v0 * x[xo + uj] + a1 * v1 * x[xo + np.uint64(32) + uj]) + \
                    (a2 * v2 * x[xo + np.uint64(64) + uj] + a3 * v3 * x[xo + np.uint64(96) + uj])
    elif kind == K_Q8:
        nspan = cols // 32
        sraw = raw.view(np.int8)
        for c in range(nspan):
            src, xo, a0 = np.uint64(32 * c), np.uint64(32 * c), As[c]
            for j in range(32):
                uj = np.uint64(j)
                acc[uj] += a0 * np.float32(sraw[src + uj]) * x[xo + uj]
    elif kind == K_Q4:
        nspan = (cols // 64) * 2
        for c in range(nspan // 2):
            src, xo = np.uint64(32 * c), np.uint64(64 * c)
            a0, a1 = As[2 * c], As[2 * c + 1]
            for j in range(32):
                uj = np.uint64(j)
                b = np.int32(raw[src + uj])
                acc[uj] += a0 * np.float32(b & 15) * x[xo + uj] + a1 * np.float32(b >> 4) * x[xo + np.uint64(32) + uj]
    elif kind == K_Q2 or kind == K_Q2RTN:
        nspan = (cols // 128) * 4
        for c in range(nspan // 4):
            src, xo = np.uint64(32 * c), np.uint64(128 * c)
            a0, a1, a2, a3 = As[4 * c], As[4 * c + 1], As[4 * c + 2], As[4 * c + 3]
            for j in range(32):
                uj = np.uint64(j)
                b = np.int32(raw[src + uj])
                acc[uj] += (a0 * np.float32(b & 3) * x[xo + uj]
                            + a1 * np.float32((b >> 2) & 3) * x[xo + np.uint64(32) + uj]) + \
                    (a2 * np.float32((b >> 4) & 3) * x[xo + np.uint64(64) + uj]
                     + a3 * np.float32(b >> 6) * x[xo + np.uint64(96) + uj])
    elif kind == K_T1:
        nspan = (cols // 160) * 5
        for c in range(nspan // 5):
            src, xo = np.uint64(32 * c), np.uint64(160 * c)
            a0, a1, a2, a3, a4 = As[5 * c], As[5 * c + 1], As[5 * c + 2], As[5 * c + 3], As[5 * c + 4]
            for j in range(32):
                uj = np.uint64(j)
                # trit k = floor(3 * frac(q * 3^k / 256)) - 1, exact in float32 (see SPEC.md)
                f = np.float32(raw[src + uj]) * np.float32(1.0 / 256.0)
                f1 = f * np.float32(3)
                f2 = f * np.float32(9)
                f3 = f * np.float32(27)
                f4 = f * np.float32(81)
                t0 = np.floor(np.float32(3) * f) - np.float32(1)
                t1 = np.floor(np.float32(3) * (f1 - np.floor(f1))) - np.float32(1)
                t2 = np.floor(np.float32(3) * (f2 - np.floor(f2))) - np.float32(1)
                t3 = np.floor(np.float32(3) * (f3 - np.floor(f3))) - np.float32(1)
                t4 = np.floor(np.float32(3) * (f4 - np.floor(f4))) - np.float32(1)
                acc[uj] += (a0 * t0 * x[xo + uj] + a1 * t1 * x[xo + np.uint64(32) + uj]) + \
                    (a2 * t2 * x[xo + np.uint64(64) + uj] + a3 * t3 * x[xo + np.uint64(96) + uj]) + \
                    a4 * t4 * x[xo + np.uint64(128) + uj]
    else:  # q1
        nspan = (cols // 256) * 8
        for c in range(nspan // 8):
            src, xo = np.uint64(32 * c), np.uint64(256 * c)
            a0, a1, a2, a3 = As[8 * c], As[8 * c + 1], As[8 * c + 2], As[8 * c + 3]
            a4, a5, a6, a7 = As[8 * c + 4], As[8 * c + 5], As[8 * c + 6], As[8 * c + 7]
            for j in range(32):
                uj = np.uint64(j)
                b = np.int32(raw[src + uj])
                acc[uj] += ((a0 * np.float32(2 * (b & 1) - 1) * x[xo + uj]
                             + a1 * np.float32((b & 2) - 1) * x[xo + np.uint64(32) + uj])
                            + (a2 * np.float32(((b >> 1) & 2) - 1) * x[xo + np.uint64(64) + uj]
                               + a3 * np.float32(((b >> 2) & 2) - 1) * x[xo + np.uint64(96) + uj])) + \
                    ((a4 * np.float32(((b >> 3) & 2) - 1) * x[xo + np.uint64(128) + uj]
                      + a5 * np.float32(((b >> 4) & 2) - 1) * x[xo + np.uint64(160) + uj])
                     + (a6 * np.float32(((b >> 5) & 2) - 1) * x[xo + np.uint64(192) + uj]
                        + a7 * np.float32(((b >> 6) & 2) - 1) * x[xo + np.uint64(224) + uj]))
    tot = np.float32(0)
    for j in range(32):
        tot += acc[j]
    for i in range(nspan):
        tot += Bs[i] * xs[i]
    return tot, 32 * nspan


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


@njit(cache=True, fastmath=True)
def _matvec_rows(raw, g, lut, x, xs, y, r_lo, r_hi, As, Bs, acc, lev):
    cols, k_out = g[G_COLS], g[G_K]
    for r in range(r_lo, r_hi):
        _row_scales(raw, g, lut, r, As, Bs)
        base = g[G_OFFCODE] + r * g[G_CODEROW]
        codes = raw[base:base + g[G_CODEROW]]
        tot, done = _row_dot(codes, g, x, xs, As, Bs, acc)
        if done < cols:
            tot += _tail_dot(codes, g, x, As, Bs, done, lev)
        for i in range(k_out):
            o = g[G_OFFOCOL] + 2 * (r * k_out + i)
            col = np.int64(raw[o]) | (np.int64(raw[o + 1]) << 8)
            v = _f16(raw, g[G_OFFOVAL] + 2 * (r * k_out + i), lut)
            tot += (v - (As[col >> 5] * np.float32(_level_fast(codes, g, col)) + Bs[col >> 5])) * x[col]
        y[r] = tot


@njit(parallel=True, fastmath=True, cache=True)
def _matvec(raw, g, lut, x, xs, y):
    rows, cols = g[G_ROWS], g[G_COLS]
    nb = (rows + 7) // 8
    for bi in prange(nb):
        As = np.empty(cols // 32, np.float32)
        Bs = np.empty(cols // 32, np.float32)
        acc = np.empty(32, np.float32)
        lev = np.empty(256, np.float32)
        _matvec_rows(raw, g, lut, x, xs, y, bi * 8, min(rows, bi * 8 + 8), As, Bs, acc, lev)


@njit(fastmath=True, cache=True)
def _matvec_serial(raw, g, lut, x, xs, y):
    cols = g[G_COLS]
    _matvec_rows(raw, g, lut, x, xs, y, 0, g[G_ROWS], np.empty(cols // 32, np.float32),
                 np.empty(cols // 32, np.float32), np.empty(32, np.float32), np.empty(256, np.float32))


# ----------------------------------------------------------------------------------------------- public API

def _prepare(codec_name: str, raw, shape):
    codec = get_codec(codec_name)
    if not isinstance(codec, BlockCodec):
        raise CodecError(f"no kernel for codec {codec_name!r}")
    g = _geometry_vector(codec, shape)
    raw = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw.reshape(-1)
    if raw.dtype != np.uint8 or raw.size < g[G_NBYTES]:
        raise CodecError(f"{codec_name}: need {int(g[G_NBYTES])} bytes of uint8 for shape {list(shape)}")
    k, rows = int(g[G_K]), int(g[G_ROWS])
    if k and rows:
        ocol = raw[g[G_OFFOCOL]:g[G_OFFOCOL] + 2 * rows * k].view("<u2").reshape(rows, k)
        if not outlier_columns_valid(ocol, int(g[G_COLS])):
            raise CodecError(f"{codec_name}: corrupt data: outlier columns out of range or not increasing")
    return codec, g, raw


def dequantize(codec: str, raw, shape) -> np.ndarray:
    """Float32 weight from the codec's bytes; equal to the reference decoder bit for bit."""
    _, g, raw = _prepare(codec, raw, shape)
    out = np.empty(tuple(shape), np.float32)
    if out.size:
        deq = _dequantize_serial if out.size < PARALLEL_MIN_WEIGHTS else _dequantize
        deq(raw, g, _F16_TO_F32, 0, out)
    return out


def warm_up(codec: str) -> None:
    """Load (or compile) every kernel variant `codec` can run, on a one-row weight."""
    shape = (1, 256)
    _, g, raw = _prepare(codec, np.zeros(get_codec(codec).nbytes(shape), np.uint8), shape)
    x, y, out = np.zeros(256, np.float32), np.empty(1, np.float32), np.empty(shape, np.float32)
    xs = np.zeros(8, np.float32)
    for matvec, deq in ((_matvec, _dequantize), (_matvec_serial, _dequantize_serial)):
        matvec(raw, g, _F16_TO_F32, x, xs, y)
        deq(raw, g, _F16_TO_F32, 0, out)


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
            _linear_into(x2, raw, g, rows, cols, y, _matvec_serial, _dequantize_serial)
        else:
            # dynamic scheduling in small chunks: a thread that loses its core does not hold up the call
            with parallel_chunksize(4):
                _linear_into(x2, raw, g, rows, cols, y, _matvec, _dequantize)
    return y[0] if squeeze else y


def _linear_into(x2, raw, g, rows, cols, y, matvec, deq):
    T = x2.shape[0]
    if T < BLAS_MIN_TOKENS:
        for t in range(T):
            xs = x2[t].reshape(-1, 32).sum(axis=1, dtype=np.float32)
            matvec(raw, g, _F16_TO_F32, x2[t], xs, y[t])
    else:
        # a few tokens or more: dequantize BLOCK_ROWS rows at a time (cache-sized, never the
        # whole weight) and let BLAS do the products
        buf = np.empty((min(BLOCK_ROWS, rows), cols), np.float32)
        for r0 in range(0, rows, BLOCK_ROWS):
            blk = buf[:min(BLOCK_ROWS, rows - r0)]
            deq(raw, g, _F16_TO_F32, r0, blk)
            np.matmul(x2, blk.T, out=y[:, r0:r0 + blk.shape[0]])
