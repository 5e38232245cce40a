"""Fused low-bit kernels: y = x @ W.T straight from a block codec's packed bytes (formats/quants.py,
layout in formats/SPEC.md), with numba. Unpacking is fused with the multiply-add, rows run in
parallel, and no dequantized copy of a whole weight is made (T > 1 dequantizes one row at a time).
`dequantize` equals the numpy reference decoder bit for bit; tests hold both to it.

Per 32-weight span the T=1 kernel computes sum(code * x) and adds scale * that + offset * sum(x),
with sum(x) per span computed once per call and shared by every row.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kimistream.formats.codecs import CodecError, get_codec
from kimistream.formats.quants import K_Q1, K_Q2, K_Q2RTN, K_Q4, K_Q6, K_Q8, K_T1, QUANT_CODECS, BlockCodec

_F16_TO_F32 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
_POW3 = np.array([1, 3, 9, 27, 81], dtype=np.int64)

# indices into the int64 geometry vector handed to the kernels
(G_ROWS, G_COLS, G_NSUB, G_NBLK, G_K, G_PARROW, G_SUBROW, G_CODEROW, G_OFFPAR, G_OFFOCOL, G_OFFOVAL, G_OFFSUB,
 G_OFFCODE, G_NBYTES, G_KIND, G_S, G_P, G_NPAR, G_BITS0, G_PB0, G_BITS1, G_PB1) = range(22)


def has_kernel(codec: str) -> bool:
    return codec in QUANT_CODECS


def _geometry_vector(codec: BlockCodec, shape) -> np.ndarray:
    g = codec.geometry(shape)
    planes = list(codec.code_planes) + [(0, 1)] * (2 - len(codec.code_planes))
    extra = [codec.kind, codec.sub, codec.blk, codec.npar,
             planes[0][0] or 0, planes[0][1], planes[1][0] or 0, planes[1][1]]
    return np.concatenate([g.as_array(), np.array(extra, dtype=np.int64)])


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


@njit(cache=True)
def _sub_params(raw, g, r, s):
    """(first, second) parameter of sub-block s of row r as float32 (see SPEC.md)."""
    kind = g[G_KIND]
    base = g[G_OFFSUB] + r * g[G_SUBROW]
    if kind == K_Q2:
        b = np.int64(raw[base + s])
        return np.float32(b & 15), np.float32(b >> 4)
    if kind == K_Q4:
        return np.float32(raw[base + 2 * s]), np.float32(raw[base + 2 * s + 1])
    if kind == K_Q6:
        return np.float32(raw[base + s]), np.float32(0)
    if kind == K_T1 or kind == K_Q1:
        b = np.int64(raw[base + s // 2])
        return np.float32((b >> (4 * (s & 1))) & 15), np.float32(0)
    return np.float32(0), np.float32(0)


@njit(cache=True)
def _span_scale(raw, g, lut, r, s):
    """(A, B) of sub-block s of row r: value = A * level + B, levels as in SPEC.md, exact f32 ops."""
    kind = g[G_KIND]
    blk = (s * g[G_S]) // g[G_P]
    po = g[G_OFFPAR] + r * g[G_PARROW] + blk * g[G_NPAR] * 2
    p0 = _f16(raw, po, lut)
    p1 = _f16(raw, po + 2, lut) if g[G_NPAR] == 2 else np.float32(0)
    s1, s2 = _sub_params(raw, g, r, s)
    if kind == K_Q8 or kind == K_Q2RTN:
        return p0, p1
    if kind == K_Q4 or kind == K_Q2:
        return p0 * s1, p1 * s2
    if kind == K_Q1:
        return p0 * s1, p1
    return p0 * s1, np.float32(0)     # q6, t1


@njit(cache=True)
def _level(raw, g, r, col):
    """The integer level of weight col of row r (int8 value, code - 32, trit, +-1 or plain code)."""
    kind = g[G_KIND]
    cols = g[G_COLS]
    base = g[G_OFFCODE] + r * g[G_CODEROW]
    d = _digit(raw, base, cols, g[G_PB0], g[G_BITS0], col)
    if kind == K_Q8:
        return d - ((d & 128) << 1)
    if kind == K_Q6:
        lo_bytes = (cols // 64) * 32 + ((cols % 64) + 1) // 2
        return (d | (_digit(raw, base + lo_bytes, cols, g[G_PB1], g[G_BITS1], col) << 4)) - 32
    if kind == K_T1:
        return d - 1
    if kind == K_Q1:
        return 2 * d - 1
    return d


@njit(cache=True)
def _value(raw, g, lut, r, col):
    """Exact dequantized value of (r, col), not counting outliers."""
    A, B = _span_scale(raw, g, lut, r, col // g[G_S])
    lev = np.float32(_level(raw, g, r, col))
    if g[G_KIND] == K_Q8 or g[G_KIND] == K_Q6 or g[G_KIND] == K_T1:
        return A * lev
    return A * lev + B


# ----------------------------------------------------------------------------------------------- row scales

@njit(cache=True)
def _row_scales(raw, g, lut, r, A, B):
    """A[s], B[s] of every sub-block s of row r: value = A * level + B, exact f32 ops as in SPEC.md."""
    for s in range(g[G_NSUB]):
        A[s], B[s] = _span_scale(raw, g, lut, r, s)


# ----------------------------------------------------------------------------------------------- dequantize

@njit(cache=True)
def _levels_row(raw, g, r, out):
    """out[col] = float32 level of every weight of row r (full chunks unpacked lane-wise)."""
    cols, kind, bits, p = g[G_COLS], g[G_KIND], g[G_BITS0], g[G_PB0]
    base = np.uint64(g[G_OFFCODE] + r * g[G_CODEROW])
    if kind == K_Q6:
        nfull = (cols // 128) * 128
        lo_bytes = np.uint64((cols // 64) * 32 + ((cols % 64) + 1) // 2)
        for i in range(nfull // 32):
            lo = base + np.uint64(32 * (i // 2))
            hi = base + lo_bytes + np.uint64(32 * (i // 4))
            sl, sh = np.uint64(4 * (i % 2)), np.uint64(2 * (i % 4))
            o = np.uint64(32 * i)
            for j in range(32):
                uj = np.uint64(j)
                c = ((np.uint64(raw[lo + uj]) >> sl) & np.uint64(15)) | (((np.uint64(raw[hi + uj]) >> sh) & np.uint64(3)) << np.uint64(4))
                out[o + uj] = np.float32(np.int64(c) - 32)
    else:
        nfull = (cols // (32 * p)) * 32 * p
        for i in range(nfull // 32):
            src = base + np.uint64(32 * (i // p))
            k = i % p
            o = np.uint64(32 * i)
            if bits == 0:
                m = np.uint64(_POW3[k])
                for j in range(32):
                    uj = np.uint64(j)
                    d = (((np.uint64(raw[src + uj]) * m) & np.uint64(255)) * np.uint64(3)) >> np.uint64(8)
                    out[o + uj] = np.float32(np.int64(d) - 1)
            else:
                sh, mask = np.uint64(k * bits), np.uint64((1 << bits) - 1)
                for j in range(32):
                    uj = np.uint64(j)
                    d = np.int64((np.uint64(raw[src + uj]) >> sh) & mask)
                    if kind == K_Q8:
                        d = d - ((d & 128) << 1)
                    elif kind == K_Q1:
                        d = 2 * d - 1
                    out[o + uj] = np.float32(d)
    for col in range(nfull, cols):
        out[col] = np.float32(_level(raw, g, r, col))


@njit(cache=True)
def _deq_row(raw, g, lut, r, out, A, B):
    cols, S = g[G_COLS], g[G_S]
    kind = g[G_KIND]
    _row_scales(raw, g, lut, r, A, B)
    _levels_row(raw, g, r, out)
    if kind == K_Q8 or kind == K_Q6 or kind == K_T1:
        for col in range(cols):
            out[col] = A[col // S] * out[col]
    else:
        for col in range(cols):
            out[col] = A[col // S] * out[col] + B[col // S]
    k = g[G_K]
    for i in range(k):
        o = g[G_OFFOCOL] + 2 * (r * k + i)
        col = np.int64(raw[o]) | (np.int64(raw[o + 1]) << 8)
        out[col] = _f16(raw, g[G_OFFOVAL] + 2 * (r * k + i), lut)


@njit(parallel=True, cache=True)
def _dequantize(raw, g, lut, out):
    rows = g[G_ROWS]
    nb = (rows + 15) // 16
    for bi in prange(nb):
        A = np.empty(g[G_NSUB], np.float32)
        B = np.empty(g[G_NSUB], np.float32)
        for r in range(bi * 16, min(rows, bi * 16 + 16)):
            _deq_row(raw, g, lut, r, out[r], A, B)


# ----------------------------------------------------------------------------------------------- matvec (T = 1)

@njit(cache=True, fastmath=True)
def _row_dot(raw, g, x, xs, As, Bs, acc):
    """Sum over the full-chunk part of row codes: sum_span As[span] * sum(level * x) + Bs[span] * xs[span].
    As, Bs are per 32-weight span; acc is 32 lanes of scratch. Returns (sum, first column not covered)."""
    cols, kind, p = g[G_COLS], g[G_KIND], g[G_PB0]
    base = np.uint64(0)
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
        for c in range(nspan):
            src, xo, a0 = np.uint64(32 * c), np.uint64(32 * c), As[c]
            for j in range(32):
                uj = np.uint64(j)
                b = np.int32(raw[src + uj])
                acc[uj] += a0 * np.float32(b - ((b & 128) << 1)) * x[xo + uj]
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
                acc[uj] += (a0 * np.float32(b & 3) * x[xo + uj] + a1 * np.float32((b >> 2) & 3) * x[xo + np.uint64(32) + uj]) + \
                    (a2 * np.float32((b >> 4) & 3) * x[xo + np.uint64(64) + uj] + a3 * np.float32(b >> 6) * x[xo + np.uint64(96) + uj])
    elif kind == K_T1:
        nspan = (cols // 160) * 5
        for c in range(nspan // 5):
            src, xo = np.uint64(32 * c), np.uint64(160 * c)
            a0, a1, a2, a3, a4 = As[5 * c], As[5 * c + 1], As[5 * c + 2], As[5 * c + 3], As[5 * c + 4]
            for j in range(32):
                uj = np.uint64(j)
                b = np.int32(raw[src + uj])
                t0 = ((b * 3) >> 8) - 1
                t1 = ((((b * 3) & 255) * 3) >> 8) - 1
                t2 = ((((b * 9) & 255) * 3) >> 8) - 1
                t3 = ((((b * 27) & 255) * 3) >> 8) - 1
                t4 = ((((b * 81) & 255) * 3) >> 8) - 1
                acc[uj] += (a0 * np.float32(t0) * x[xo + uj] + a1 * np.float32(t1) * x[xo + np.uint64(32) + uj]) + \
                    (a2 * np.float32(t2) * x[xo + np.uint64(64) + uj] + a3 * np.float32(t3) * x[xo + np.uint64(96) + uj]) + \
                    a4 * np.float32(t4) * x[xo + np.uint64(128) + uj]
    else:  # q1
        nspan = (cols // 256) * 8
        for c in range(nspan // 8):
            src, xo = np.uint64(32 * c), np.uint64(256 * c)
            for j in range(32):
                uj = np.uint64(j)
                b = np.int32(raw[src + uj])
                s = np.float32(0)
                for k in range(8):
                    s += As[8 * c + k] * np.float32(2 * ((b >> k) & 1) - 1) * x[xo + np.uint64(32 * k) + uj]
                acc[uj] += s
    tot = np.float32(0)
    for j in range(32):
        tot += acc[j]
    for i in range(nspan):
        tot += Bs[i] * xs[i]
    return tot, 32 * nspan


@njit(parallel=True, fastmath=True, cache=True)
def _matvec(raw, g, lut, x, xs, y):
    rows, cols, S = g[G_ROWS], g[G_COLS], g[G_S]
    nsub, per_sub = g[G_NSUB], S // 32
    k_out = g[G_K]
    nb = (rows + 7) // 8
    for bi in prange(nb):
        A = np.empty(nsub, np.float32)
        B = np.empty(nsub, np.float32)
        As = np.empty(cols // 32, np.float32)
        Bs = np.empty(cols // 32, np.float32)
        acc = np.empty(32, np.float32)
        for r in range(bi * 8, min(rows, bi * 8 + 8)):
            _row_scales(raw, g, lut, r, A, B)
            for i in range(cols // 32):
                As[i] = A[i // per_sub]
                Bs[i] = B[i // per_sub]
            base = g[G_OFFCODE] + r * g[G_CODEROW]
            tot, done = _row_dot(raw[base:base + g[G_CODEROW]], g, x, xs, As, Bs, acc)
            for col in range(done, cols):        # tail chunk: element by element
                tot += _value(raw, g, lut, r, col) * x[col]
            for i in range(k_out):
                o = g[G_OFFOCOL] + 2 * (r * k_out + i)
                col = np.int64(raw[o]) | (np.int64(raw[o + 1]) << 8)
                v = _f16(raw, g[G_OFFOVAL] + 2 * (r * k_out + i), lut)
                tot += (v - _value(raw, g, lut, r, col)) * x[col]
            y[r] = tot


# ----------------------------------------------------------------------------------------------- T > 1

@njit(cache=True, fastmath=True)
def _dot(a, b, n):
    acc = np.float32(0)
    for j in range(n):
        acc += a[j] * b[j]
    return acc


@njit(parallel=True, cache=True)
def _matmat(raw, g, lut, x, y):
    rows, cols = g[G_ROWS], g[G_COLS]
    nblk = (rows + 15) // 16
    for bi in prange(nblk):
        buf = np.empty(cols, np.float32)
        A = np.empty(g[G_NSUB], np.float32)
        B = np.empty(g[G_NSUB], np.float32)
        for r in range(bi * 16, min(rows, bi * 16 + 16)):
            _deq_row(raw, g, lut, r, buf, A, B)
            for t in range(x.shape[0]):
                y[t, r] = _dot(x[t], buf, cols)


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
        ocol = raw[g[G_OFFOCOL]:g[G_OFFOCOL] + 2 * rows * k].view("<u2")
        if int(ocol.max()) >= g[G_COLS]:
            raise CodecError(f"{codec_name}: corrupt data: outlier column out of range")
    return codec, g, raw


def dequantize(codec: str, raw, shape) -> np.ndarray:
    """Float32 weight from the codec's bytes; equal to the reference decoder bit for bit."""
    _, g, raw = _prepare(codec, raw, shape)
    out = np.empty(tuple(shape), np.float32)
    if out.size:
        _dequantize(raw, g, _F16_TO_F32, out)
    return out


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
        if T == 1:
            xs = x2[0].reshape(-1, 32).sum(axis=1, dtype=np.float32)
            _matvec(raw, g, _F16_TO_F32, x2[0], xs, y[0])
        else:
            _matmat(raw, g, _F16_TO_F32, x2, y)
    return y[0] if squeeze else y
