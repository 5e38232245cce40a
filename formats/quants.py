"""Block codecs for the weights that dominate the file: q8, q6, q4 (resident parts), q2, t1, q1
(routed experts), and q2rtn (the round-to-nearest baseline). The byte layout is in SPEC.md, section
"Codecs"; this module is its encoder and numpy reference decoder, and runtime/kernels.py decodes the
same bytes fused with the matrix product.

A weight [rows, cols] is quantised along cols. Every row is cut into 32-weight sub-blocks (64 for
q2rtn) and 256-weight super-blocks (the last one of a row may be shorter). A tensor is five planes,
each row-major: f16 block parameters, outlier columns (u16), outlier values (f16), sub-block
parameters (u8) and codes. Codes are packed in chunks of 32 bytes: byte j, field k holds weight
j + 32k of the chunk, so one SIMD register of 32 bytes yields 32 consecutive weights per shift.
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from .codecs import CODECS, Codec, CodecError, _check_finite

SUPER = 256                 # weights per super-block (f16 parameters)
FIT_BLOCK = 1 << 18         # weights fitted per numpy pass in the encoder
F16_MAX = 65504.0
POW3 = np.array([1, 3, 9, 27, 81], dtype=np.uint16)

# kind ids shared with runtime/kernels.py
K_Q8, K_Q6, K_Q4, K_Q2, K_Q2RTN, K_T1, K_Q1 = range(7)


@dataclass(frozen=True)
class Geometry:
    """Sizes (bytes per row) and plane offsets (bytes from the tensor start) of one tensor."""
    rows: int
    cols: int
    nsub: int          # sub-blocks per row
    nblk: int          # f16-parameter blocks per row
    k: int             # outliers per row
    par_row: int
    sub_row: int
    code_row: int
    off_par: int
    off_ocol: int
    off_oval: int
    off_sub: int
    off_code: int
    nbytes: int

    def as_array(self) -> np.ndarray:
        return np.array([self.rows, self.cols, self.nsub, self.nblk, self.k, self.par_row, self.sub_row,
                         self.code_row, self.off_par, self.off_ocol, self.off_oval, self.off_sub,
                         self.off_code, self.nbytes], dtype=np.int64)


# ----------------------------------------------------------------------------------------------- packing

def outlier_columns_valid(ocol: np.ndarray, cols: int) -> bool:
    """Each row's outlier columns are strictly increasing and < cols — or all zero: an all-zero
    tensor (a sparse hole in a synthetic file) is a valid encoding of zeros."""
    if (ocol >= cols).any():
        return False
    bad = (np.diff(ocol.astype(np.int64), axis=1) <= 0).any(axis=1)
    return not (bad & ocol.any(axis=1)).any()


def chunk_bytes(n: int, per_byte: int) -> int:
    """Bytes used by n codes packed per_byte per byte: full 32-byte chunks, then a shorter tail."""
    full, tail = divmod(n, 32 * per_byte)
    return 32 * full + -(-tail // per_byte)


def pack_fields(digits: np.ndarray, per_byte: int, bits: int | None) -> np.ndarray:
    """digits [rows, n] (uint8) -> [rows, chunk_bytes(n)]; bits=None packs base-3 digits (trits)."""
    rows, n = digits.shape
    chunk = 32 * per_byte
    full = n // chunk
    parts = []
    tail = n - full * chunk
    for start, width, lane in ((0, full * chunk, 32), (full * chunk, tail, -(-tail // per_byte))):
        if width == 0:
            continue
        d = digits[:, start:start + width]
        pad = -width % (lane * per_byte)
        if pad:       # padding digits hold value 0 (trit digit 1)
            d = np.concatenate([d, np.full((rows, pad), 0 if bits else 1, np.uint8)], axis=1)
        d = d.reshape(rows, -1, per_byte, lane)
        if bits:
            out = np.zeros(d.shape[:2] + d.shape[3:], np.uint8)
            for k in range(per_byte):
                out |= d[:, :, k, :] << np.uint8(k * bits)
        else:
            v = np.zeros(d.shape[:2] + d.shape[3:], np.uint16)
            for k in range(per_byte):
                v = v * 3 + d[:, :, k, :]
            out = ((v * 256 + 242) // 243).astype(np.uint8)   # ceil(v * 256 / 243), see SPEC
        parts.append(out.reshape(rows, -1))
    return np.concatenate(parts, axis=1) if parts else np.zeros((rows, 0), np.uint8)


def unpack_fields(packed: np.ndarray, n: int, per_byte: int, bits: int | None) -> np.ndarray:
    """Inverse of pack_fields: [rows, chunk_bytes(n)] -> digits [rows, n] (uint8)."""
    rows = packed.shape[0]
    chunk = 32 * per_byte
    full, tail = divmod(n, chunk)
    parts = []
    for pos, nb, lane, width in ((0, 32 * full, 32, full * chunk),
                                 (32 * full, -(-tail // per_byte), -(-tail // per_byte), tail)):
        if width == 0:
            continue
        b = packed[:, pos:pos + nb]
        b = b.reshape(rows, -1, 1, lane)
        if bits:
            mask = np.uint8((1 << bits) - 1)
            ks = np.arange(per_byte, dtype=np.uint8).reshape(1, 1, per_byte, 1) * np.uint8(bits)
            d = (b >> ks) & mask
        else:
            t = (b.astype(np.uint16) * POW3.reshape(1, 1, 5, 1)) & 0xFF
            d = ((t * 3) >> 8).astype(np.uint8)
        parts.append(d.reshape(rows, -1)[:, :width])
    return np.concatenate(parts, axis=1) if parts else np.zeros((rows, 0), np.uint8)


# ----------------------------------------------------------------------------------------------- helpers

def _f16(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


def _safe(a: np.ndarray) -> np.ndarray:
    return np.where(a == 0, np.float32(1), a)


def _wsum(v: np.ndarray, w: np.ndarray) -> np.ndarray:
    return (v * w).sum(axis=-1)


def _blocks_view(a: np.ndarray, per_blk: int, nblk: int, fill) -> np.ndarray:
    """[rows, nsub] sub-block values -> [rows, nblk, per_blk] (padding the last block with fill)."""
    rows, nsub = a.shape
    pad = nblk * per_blk - nsub
    if pad:
        a = np.concatenate([a, np.full((rows, pad), fill, a.dtype)], axis=1)
    return a.reshape(rows, nblk, per_blk)


def _to_subs(blk_vals: np.ndarray, per_blk: int, nsub: int) -> np.ndarray:
    """[rows, nblk] block values -> [rows, nsub] (each sub-block gets its block's value)."""
    return np.repeat(blk_vals, per_blk, axis=1)[:, :nsub]


# ----------------------------------------------------------------------------------------------- codec

class BlockCodec(Codec):
    """One of the block codecs; `kind` selects the value formula (see SPEC.md)."""

    def __init__(self, name, kind, sub, blk, npar, sub_bytes, budget, code_planes, description,
                 levels=None, sub_levels=15):
        self.name, self.kind, self.sub, self.blk, self.npar = name, kind, sub, blk, npar
        self.sub_bytes = sub_bytes            # bytes of sub-block parameters per sub-block (0, 0.5, 1, 2)
        self.budget = budget                  # (num, den): outliers fill the row up to num/den bits per weight
        self.code_planes = code_planes        # [(bits or None for trits, per_byte)]
        self.description = description
        self.levels = levels
        self.sub_levels = sub_levels

    # ----- geometry
    def geometry(self, shape) -> Geometry:
        shape = tuple(int(s) for s in shape)
        if len(shape) != 2:
            raise CodecError(f"{self.name} needs a 2-D weight, got shape {list(shape)}")
        rows, cols = shape
        if cols <= 0 or cols % self.sub:
            raise CodecError(f"{self.name}: input dimension {cols} is not a multiple of the group size {self.sub}")
        nsub = cols // self.sub
        nblk = -(-cols // self.blk)
        par_row = nblk * self.npar * 2
        sub_row = math.ceil(nsub * self.sub_bytes)
        code_row = sum(chunk_bytes(cols, p) for _, p in self.code_planes)
        k = 0
        if self.budget:
            # as many 32-bit outliers as fit the codec's bits-per-weight budget for this row length
            num, den = self.budget
            k = max(0, (num * cols - den * 8 * (par_row + sub_row + code_row)) // (den * 32))
            if k and cols > 65536:
                raise CodecError(f"{self.name}: input dimension {cols} exceeds the u16 outlier column range")
        off_par = 0
        off_ocol = off_par + rows * par_row
        off_oval = off_ocol + rows * k * 2
        off_sub = off_oval + rows * k * 2
        off_code = off_sub + rows * sub_row
        nbytes = off_code + rows * code_row
        return Geometry(rows, cols, nsub, nblk, k, par_row, sub_row, code_row, off_par, off_ocol, off_oval,
                        off_sub, off_code, nbytes)

    def nbytes(self, shape) -> int:
        return self.geometry(shape).nbytes

    # ----- planes
    def _planes(self, raw: np.ndarray, g: Geometry):
        r = g.rows
        par = raw[g.off_par:g.off_ocol].view("<f2").astype(np.float32).reshape(r, g.nblk, self.npar)
        ocol = raw[g.off_ocol:g.off_oval].view("<u2").reshape(r, g.k)
        oval = raw[g.off_oval:g.off_sub].view("<f2").astype(np.float32).reshape(r, g.k)
        sub = raw[g.off_sub:g.off_code].reshape(r, g.sub_row)
        codes = raw[g.off_code:g.nbytes].reshape(r, g.code_row)
        return par, ocol, oval, sub, codes

    def _digits(self, codes: np.ndarray, cols: int) -> list[np.ndarray]:
        out, pos = [], 0
        for bits, p in self.code_planes:
            nb = chunk_bytes(cols, p)
            out.append(unpack_fields(codes[:, pos:pos + nb], cols, p, bits))
            pos += nb
        return out

    def _sub_params(self, sub: np.ndarray, nsub: int):
        """-> (first, second) sub-block parameters as float32 [rows, nsub] (second may be None)."""
        if self.sub_bytes == 0.5:
            lo, hi = sub & 15, sub >> 4
            return np.stack([lo, hi], axis=-1).reshape(sub.shape[0], -1)[:, :nsub].astype(np.float32), None
        if self.sub_bytes == 1 and self.kind == K_Q2:
            return (sub & 15).astype(np.float32), (sub >> 4).astype(np.float32)
        if self.sub_bytes == 1:
            return sub.astype(np.float32), None
        if self.sub_bytes == 2:
            s = sub.reshape(sub.shape[0], nsub, 2)
            return s[..., 0].astype(np.float32), s[..., 1].astype(np.float32)
        return None, None

    # ----- decode
    def decode(self, buf, shape):
        g = self.geometry(shape)
        raw = np.frombuffer(buf, dtype=np.uint8, count=g.nbytes)
        if g.rows == 0:
            return np.zeros(shape, np.float32)
        par, ocol, oval, sub, codes = self._planes(raw, g)
        if g.k and not outlier_columns_valid(ocol, g.cols):
            raise CodecError(f"{self.name}: corrupt data: outlier columns out of range or not increasing")
        dig = self._digits(codes, g.cols)
        rows, cols, S = g.rows, g.cols, self.sub
        per_blk = self.blk // S
        s1, s2 = self._sub_params(sub, g.nsub)
        # parameters per sub-block [rows, nsub, 1], combined exactly as SPEC.md writes them
        p0 = _to_subs(par[..., 0], per_blk, g.nsub)[..., None]
        p1 = _to_subs(par[..., 1], per_blk, g.nsub)[..., None] if self.npar == 2 else None
        q = dig[0].reshape(rows, g.nsub, S)
        kind = self.kind
        if kind == K_Q8:
            v = p0 * q.view(np.int8).astype(np.float32)
        elif kind == K_Q6:
            code = (q | (dig[1].reshape(rows, g.nsub, S) << 4)).astype(np.float32)
            v = (p0 * s1[..., None]) * (code - np.float32(32))
        elif kind in (K_Q4, K_Q2):
            v = (p0 * s1[..., None]) * q.astype(np.float32) + p1 * s2[..., None]
        elif kind == K_Q2RTN:
            v = p0 * q.astype(np.float32) + p1
        elif kind == K_T1:
            v = (p0 * s1[..., None]) * (q.astype(np.float32) - np.float32(1))
        elif kind == K_Q1:
            v = (p0 * s1[..., None]) * (q.astype(np.float32) * np.float32(2) - np.float32(1)) + p1
        else:  # pragma: no cover
            raise AssertionError(kind)
        v = np.ascontiguousarray(v, dtype=np.float32).reshape(rows, cols)
        if g.k:
            v[np.arange(rows)[:, None], ocol] = oval
        return v.reshape(shape)

    def decode_rows(self, buf, shape, rows_idx):
        g = self.geometry(shape)
        idx = np.asarray(rows_idx)
        flat = idx.reshape(-1).astype(np.int64)
        if flat.size and (flat.min() < -g.rows or flat.max() >= g.rows):
            raise IndexError(f"row index out of range for {g.rows} rows")
        flat = np.where(flat < 0, flat + g.rows, flat)
        raw = np.frombuffer(buf, dtype=np.uint8, count=g.nbytes)
        parts = []
        for off, per in ((g.off_par, g.par_row), (g.off_ocol, 2 * g.k), (g.off_oval, 2 * g.k),
                         (g.off_sub, g.sub_row), (g.off_code, g.code_row)):
            parts.append(raw[off:off + g.rows * per].reshape(g.rows, per)[flat].reshape(-1))
        out = self.decode(np.concatenate(parts), (flat.size, g.cols))
        return out.reshape(idx.shape + (g.cols,))

    # ----- encode
    def encode(self, values, importance: np.ndarray | None = None, moment: np.ndarray | None = None):
        """`importance` (optional, [in_features], >= 0) weights the squared error of each input channel.
        `moment` (optional, [in_features, in_features]: the inputs' second moment E[x xᵀ]) switches
        the rounding to error feedback: codes are chosen column by column on the fitted grid and each
        column's error is pushed onto the columns not yet rounded (GPTQ), so what is minimised is the
        output error E[(x·(w − v))²] rather than the weight error; without `importance` its diagonal
        weights the grid fit."""
        x = np.ascontiguousarray(values, dtype=np.float32)
        g = self.geometry(x.shape)
        _check_finite(x)
        if x.size and np.abs(x).max() > F16_MAX:
            raise CodecError(f"{self.name}: |value| > {F16_MAX:g} does not fit the float16 parameters")
        rows, cols = x.shape
        if rows == 0:
            return np.zeros(0, np.uint8)
        H = None
        if moment is not None and self.kind != K_Q2RTN:       # the baseline stays round-to-nearest
            H = _check_moment(self.name, moment, cols)
            if importance is None:
                importance = np.maximum(np.diag(H), 0)
        w = self._importance(importance, cols)
        # rows in blocks whose temporaries stay cache-sized (about 2x faster than all at once), on
        # every core: numpy releases the GIL inside each operation
        step = max(1, FIT_BLOCK // cols)
        parts = _map_rows(lambda i: self._encode_rows(x[i:i + step], w, g.k), range(0, rows, step))
        ocol, oval, par, sub = (np.concatenate([p[j] for p in parts]) for j in range(4))
        digits = [np.concatenate([p[4][j] for p in parts]) for j in range(len(parts[0][4]))]
        if H is not None:
            par, digits = self._round_with_feedback(x, par, sub, g, H, ocol)
        code_bytes = [pack_fields(d, p, bits) for d, (bits, p) in zip(digits, self.code_planes)]
        out = [par.astype("<f2").reshape(-1).view(np.uint8),
               ocol.astype("<u2").reshape(-1).view(np.uint8),
               oval.astype("<f2").reshape(-1).view(np.uint8),
               sub.reshape(-1),
               np.concatenate(code_bytes, axis=1).reshape(-1)]
        buf = np.concatenate(out)
        assert buf.size == g.nbytes
        return buf

    def _encode_rows(self, x, w, k):
        """Outliers (the k weights of each row with the largest |x|·sqrt(w), excluded from the fit),
        then the fit: (ocol, oval, par, sub, digit planes) of these rows."""
        rows, cols = x.shape
        wt = np.broadcast_to(w, x.shape).copy()
        ocol = np.zeros((rows, 0), np.uint16)
        oval = np.zeros((rows, 0), np.float32)
        if k:
            top = np.argpartition(-(np.abs(x) * np.sqrt(w)), k - 1, axis=1)[:, :k]
            top.sort(axis=1)
            ocol = top.astype(np.uint16)
            oval = np.take_along_axis(x, top, axis=1)
            np.put_along_axis(wt, top, 0.0, axis=1)
        par, sub, digits = self._fit(x, wt, self.geometry((rows, cols)))
        return ocol, oval, par, sub, digits

    # ----- error-feedback rounding (with a second moment)
    def _affine(self, par, sub, g):
        """Every codec's value as A·c + B with an integer c in lo..hi: (A, B per sub-block, lo, hi)."""
        per_blk = self.blk // self.sub
        s1, s2 = self._sub_params(sub, g.nsub)
        p0 = _to_subs(par[..., 0], per_blk, g.nsub)
        p1 = _to_subs(par[..., 1], per_blk, g.nsub) if self.npar == 2 else None
        zero = np.zeros_like(p0)
        kind = self.kind
        if kind == K_Q8:
            return p0, zero, -127, 127
        if kind == K_Q6:
            return p0 * s1, zero, -32, 31
        if kind in (K_Q4, K_Q2):
            return p0 * s1, p1 * s2, 0, self.levels
        if kind == K_T1:
            return p0 * s1, zero, -1, 1
        if kind == K_Q1:                        # a·(2b − 1) + m
            return np.float32(2) * p0 * s1, p1 - p0 * s1, 0, 1
        raise AssertionError(kind)  # pragma: no cover

    def _digits_of(self, c: np.ndarray) -> list[np.ndarray]:
        kind = self.kind
        if kind == K_Q8:
            return [c.astype(np.int8).view(np.uint8)]
        if kind == K_Q6:
            u = (c + 32).astype(np.uint8)
            return [u & 15, u >> 4]
        if kind == K_T1:
            return [(c + 1).astype(np.uint8)]
        return [c.astype(np.uint8)]

    def _round_with_feedback(self, x, par, sub, g, H, ocol):
        A, B, lo, hi = self._affine(par, sub, g)
        A, B = np.repeat(A, self.sub, axis=1), np.repeat(B, self.sub, axis=1)
        exact = np.zeros(x.shape, bool)
        if g.k:
            np.put_along_axis(exact, ocol.astype(np.int64), True, axis=1)
        c = _gptq(x, A, B, lo, hi, _inverse_factor(H), exact)
        v = np.where(exact, 0, A * c + B)
        # The gain correction again, now in the output metric and per row (error feedback moves
        # error between super-blocks, so only the whole row's gain is meaningful): every block of
        # the row scaled by rho with wᵀH(w − outliers) = rho·wᵀH v.
        wh = x @ np.asarray(H, dtype=np.float32)           # float32 product, float64 sums
        num = (wh * (x - np.where(exact, x, 0))).sum(1, dtype=np.float64)
        den = (wh * v).sum(1, dtype=np.float64)
        ok = den > 0
        rho = np.clip(np.where(ok, num / np.where(ok, den, 1), 1), 0.5, 2).astype(np.float32)
        par = _scale_params(par, rho[:, None, None])
        return par, [d.reshape(g.rows, g.cols) for d in self._digits_of(c)]

    def _importance(self, importance, cols) -> np.ndarray:
        if importance is None:
            return np.ones(cols, np.float32)
        imp = np.asarray(importance, dtype=np.float32).reshape(-1)
        if imp.size != cols:
            raise CodecError(f"{self.name}: importance has {imp.size} values for {cols} input channels")
        if not np.isfinite(imp).all() or (imp < 0).any():
            raise CodecError(f"{self.name}: importance must be finite and non-negative")
        mean = float(imp.mean())
        if mean <= 0:
            return np.ones(cols, np.float32)
        # a small floor keeps channels never seen in calibration weakly fitted
        return (imp / mean + np.float32(1e-3)).astype(np.float32)

    # ----- fitting: returns (f16 params [rows, nblk, npar] float32, sub bytes [rows, sub_row] uint8,
    #       [digit planes [rows, cols] uint8])
    def _fit(self, x, wt, g):
        rows, cols, S = g.rows, g.cols, self.sub
        X = x.reshape(rows, g.nsub, S)
        W = wt.reshape(rows, g.nsub, S)
        kind = self.kind
        if kind == K_Q2RTN:
            lo, hi = X.min(-1), X.max(-1)
            s, o = _f16((hi - lo) / 3), _f16(lo)
            q = np.clip(np.rint((X - o[..., None]) / _safe(s)[..., None]), 0, 3).astype(np.uint8)
            return np.stack([s, o], -1), np.zeros((rows, 0), np.uint8), [q.reshape(rows, cols)]
        if kind == K_Q8:
            a = _fit_sym(X, W, -127, 127)
            s = _f16(a)
            q = np.clip(np.rint(X / _safe(s)[..., None]), -127, 127).astype(np.int8).view(np.uint8)
            return s[..., None], np.zeros((rows, 0), np.uint8), [q.reshape(rows, cols)]
        per_blk = self.blk // S
        if kind in (K_Q4, K_Q2):
            a, b = _fit_affine(X, W, self.levels)
            d, m, sc, mc = _quant_affine(X, W, a, b, self.levels, self.sub_levels, per_blk, g.nblk)
            A = (_to_subs(d, per_blk, g.nsub) * sc)[..., None]
            B = (_to_subs(m, per_blk, g.nsub) * mc)[..., None]
            q = np.clip(np.rint((X - B) / _safe(A)), 0, self.levels).astype(np.uint8)
            q = np.where(A == 0, np.uint8(0), q)
            d, m = _unshrink(X, W, A * q + B, per_blk, g.nblk, d, m)
            sc8, mc8 = sc.astype(np.uint8), mc.astype(np.uint8)
            if kind == K_Q2:
                sub = sc8 | (mc8 << 4)
            else:
                sub = np.stack([sc8, mc8], -1).reshape(rows, -1)
            return np.stack([d, m], -1), sub, [q.reshape(rows, cols)]
        if kind in (K_T1, K_Q6):
            lo, hi = (-1, 1) if kind == K_T1 else (-32, 31)
            a = _fit_sym(X, W, lo, hi)
            d, sc = _quant_scale(X, W, a, lo, hi, self.sub_levels, per_blk, g.nblk)
            A = (_to_subs(d, per_blk, g.nsub) * sc)[..., None]
            t = np.clip(np.rint(X / _safe(A)), lo, hi)
            t = np.where(A == 0, 0, t)
            d, = _unshrink(X, W, A * t, per_blk, g.nblk, d)
            if kind == K_T1:
                digits = [(t + 1).astype(np.uint8).reshape(rows, cols)]
                sub = _pack_nibbles(sc.astype(np.uint8), g.sub_row)
            else:
                c = (t + 32).astype(np.uint8).reshape(rows, cols)
                digits = [c & 15, c >> 4]
                sub = sc.astype(np.uint8)
            return d[..., None], sub, digits
        if kind == K_Q1:
            d, m, sc = _fit_q1(X, W, self.sub_levels, per_blk, g.nblk)
            ms = _to_subs(m, per_blk, g.nsub)[..., None]
            bit = (X >= ms).astype(np.uint8)
            A = (_to_subs(d, per_blk, g.nsub) * sc)[..., None]
            d, m = _unshrink(X, W, A * (bit * np.float32(2) - 1) + ms, per_blk, g.nblk, d, m)
            return np.stack([d, m], -1), _pack_nibbles(sc.astype(np.uint8), g.sub_row), [bit.reshape(rows, cols)]
        raise AssertionError(kind)  # pragma: no cover


_POOL: list = []


def _map_rows(fn, starts):
    """fn over row-block starts, on every core — unless there is one block, or this is already a
    pool thread (an encode called from inside one would wait on itself)."""
    if len(starts) < 2 or threading.current_thread().name.startswith("kimi-fit"):
        return [fn(i) for i in starts]
    if not _POOL:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        _POOL.append(ThreadPoolExecutor(max(1, min(8, cores)), thread_name_prefix="kimi-fit"))
    return list(_POOL[0].map(fn, starts))


os.register_at_fork(after_in_child=_POOL.clear)       # a forked child has none of the pool's threads


GPTQ_DAMP = 0.01          # ridge added to the second moment, as a fraction of its mean diagonal
GPTQ_BLOCK = 128          # columns per lazy update of the error feedback
_FACTORS: OrderedDict = OrderedDict()   # (id, fingerprint) -> (moment, factor), least recent first
FACTORS_KEPT = 2                          # a layer's shared gate/up factor and the current down_proj's


def _check_moment(name, moment, cols) -> np.ndarray:
    H = np.asarray(moment)
    if H.shape != (cols, cols):
        raise CodecError(f"{name}: second moment has shape {list(H.shape)} for {cols} input channels")
    if not np.isfinite(H).all():
        raise CodecError(f"{name}: second moment has non-finite values")
    return H


def _inverse_factor(H: np.ndarray) -> np.ndarray:
    """Upper Cholesky factor U of (H + damping)⁻¹ (so H⁻¹ = Uᵀ U), cached for the moment object."""
    # The same moment object recurs for every expert of a layer; the fingerprint catches one that
    # was edited in place since its factor was computed.
    key = (id(H), H.shape, float(np.sum(H, dtype=np.float64)), float(np.sum(H[::7, ::5], dtype=np.float64)))
    hit = _FACTORS.get(key)
    if hit is not None and hit[0] is H:
        _FACTORS.move_to_end(key)
        return hit[1]
    M = np.array(H, dtype=np.float64)
    M = (M + M.T) / 2
    diag = np.diag(M).copy()
    dead = diag <= 0                 # channels calibration never saw: any value is as good
    M[dead, :] = 0
    M[:, dead] = 0
    M[dead, dead] = 1
    mean = float(diag[~dead].mean()) if (~dead).any() else 1.0
    damp = GPTQ_DAMP
    while True:
        try:
            inv = np.linalg.inv(M + np.eye(len(M)) * damp * mean)
            U = np.ascontiguousarray(np.linalg.cholesky((inv + inv.T) / 2).T, dtype=np.float32)
            del inv
            break
        except np.linalg.LinAlgError:
            damp *= 10
            if damp > 1e3:
                raise CodecError("second moment is not positive definite even with damping") from None
    _FACTORS[key] = (H, U)
    while len(_FACTORS) > FACTORS_KEPT:
        _FACTORS.popitem(last=False)
    return U


def clear_factor_cache() -> None:
    """Drop the cached factors (and the moments they pin): call when a conversion is done."""
    _FACTORS.clear()


def _gptq(x, A, B, lo, hi, U, exact):
    """Integer codes c [rows, cols] for values A·c + B, chosen column by column; each column's
    rounding error (scaled by U) is subtracted from the columns to its right. `exact` marks
    outliers: their value is x itself, so their only error is what earlier columns pushed onto them.
    Works on transposed copies so that a column is contiguous."""
    rows, cols = x.shape
    Wt = np.ascontiguousarray(x.T)           # float32, as U: the updates are far above its rounding
    At, Bt, Xt, Et = (np.ascontiguousarray(a.T) for a in (A, B, x, exact))
    ct = np.zeros((cols, rows), np.float32)
    for i0 in range(0, cols, GPTQ_BLOCK):
        i1 = min(i0 + GPTQ_BLOCK, cols)
        err = np.zeros((i1 - i0, rows), np.float32)
        for j in range(i0, i1):
            w, a, b = Wt[j], At[j], Bt[j]
            cj = np.clip(np.rint((w - b) / np.where(a == 0, 1, a)), lo, hi)
            cj[a == 0] = 0
            v = np.where(Et[j], Xt[j], a * cj + b)
            e = (w - v) / U[j, j]
            Wt[j + 1:i1] -= np.outer(U[j, j + 1:i1], e)
            err[j - i0] = e
            ct[j] = cj
        if i1 < cols:
            Wt[i1:] -= U[i0:i1, i1:].T @ err
    return np.ascontiguousarray(ct.T)


def _pack_nibbles(v: np.ndarray, nbytes: int) -> np.ndarray:
    rows, n = v.shape
    if n % 2:
        v = np.concatenate([v, np.zeros((rows, 1), np.uint8)], axis=1)
    v = v.reshape(rows, -1, 2)
    return (v[..., 0] | (v[..., 1] << 4)).astype(np.uint8)[:, :nbytes]


# ----------------------------------------------------------------------------------------------- fits

def _fit_affine(X, W, levels):
    """Per sub-block continuous (scale a >= 0, offset b) minimising sum W (a q + b - X)^2, q in 0..levels:
    a grid of clipped ranges, each refitted by weighted least squares on its codes."""
    has = W > 0
    inf = np.float32(np.inf)
    lo = np.where(has, X, inf).min(-1)
    hi = np.where(has, X, -inf).max(-1)
    empty = ~has.any(-1)
    lo, hi = np.where(empty, 0, lo), np.where(empty, 0, hi)
    span = hi - lo
    sw = W.sum(-1)
    sx = _wsum(X, W)
    best = None
    grid = (0.0, 0.08, 0.16)
    for al in grid:
        for be in grid:
            mn = lo + np.float32(al) * span
            a = np.maximum(hi - np.float32(be) * span - mn, 0) / levels
            q = np.clip(np.rint((X - mn[..., None]) / _safe(a)[..., None]), 0, levels)
            sq, sqq, sqx = _wsum(q, W), _wsum(q * q, W), _wsum(q * X, W)
            det = sw * sqq - sq * sq
            ok = det > 1e-12 * np.maximum(sw * sqq, 1e-30)
            a2 = np.where(ok, (sw * sqx - sq * sx) / np.where(ok, det, 1), a)
            a2 = np.maximum(a2, 0)
            b2 = np.where(ok, (sqq * sx - sq * sqx) / np.where(ok, det, 1),
                          (sx - a2 * sq) / np.where(sw > 0, sw, 1))
            q = np.clip(np.rint((X - b2[..., None]) / _safe(a2)[..., None]), 0, levels)
            err = _wsum((a2[..., None] * q + b2[..., None] - X) ** 2, W)
            if best is None:
                best = [a2, b2, err]
            else:
                bt = err < best[2]
                best = [np.where(bt, a2, best[0]), np.where(bt, b2, best[1]), np.where(bt, err, best[2])]
    return best[0].astype(np.float32), best[1].astype(np.float32)


def _fit_sym(X, W, lo, hi):
    """Per sub-block scale a >= 0 minimising sum W (a q - X)^2 with q in lo..hi."""
    amax = np.where(W > 0, np.abs(X), 0).max(-1)
    best = None
    top = float(max(-lo, hi))
    fracs = (0.35, 0.5, 0.65, 0.8, 1.0) if hi == 1 else (0.75, 0.85, 0.92, 1.0)
    for f in fracs:
        a = amax * np.float32(f) / np.float32(top if hi > 1 else 1.0)
        for _ in range(2):
            q = np.clip(np.rint(X / _safe(a)[..., None]), lo, hi)
            den = _wsum(q * q, W)
            a = np.where(den > 0, _wsum(q * X, W) / np.where(den > 0, den, 1), a)
            a = np.maximum(a, 0)
        q = np.clip(np.rint(X / _safe(a)[..., None]), lo, hi)
        err = _wsum((a[..., None] * q - X) ** 2, W)
        if best is None:
            best = [a, err]
        else:
            bt = err < best[1]
            best = [np.where(bt, a, best[0]), np.where(bt, err, best[1])]
    return best[0].astype(np.float32)


def _quant_affine(X, W, a, b, levels, smax, per_blk, nblk):
    """Quantise sub-block (a, b) to sc * d, mc * m with sc, mc in 0..smax and d, m f16 per block,
    choosing d, m and each sub-block's (sc, mc) from a few candidates by weighted error."""
    rows, nsub = a.shape
    ab = _blocks_view(a, per_blk, nblk, 0)
    bb = _blocks_view(b, per_blk, nblk, 0)
    amax = ab.max(-1)
    ext = np.take_along_axis(bb, np.abs(bb).argmax(-1)[..., None], -1)[..., 0]   # signed extreme offset
    d = _f16(amax / smax)
    m = _f16(ext / smax)
    ds, ms = _to_subs(d, per_blk, nsub), _to_subs(m, per_blk, nsub)
    sc0 = np.clip(np.rint(a / _safe(ds)), 0, smax)
    mc0 = np.clip(np.rint(b / _safe(ms)), 0, smax)
    sb = None
    for dsc in (-1, 0, 1):
        for dmc in (-1, 0, 1):
            sc = np.clip(sc0 + dsc, 0, smax)
            mc = np.clip(mc0 + dmc, 0, smax)
            A, B = (ds * sc)[..., None], (ms * mc)[..., None]
            q = np.clip(np.rint((X - B) / _safe(A)), 0, levels)
            q = np.where(A == 0, 0, q)
            err = _wsum((A * q + B - X) ** 2, W)
            sb = _keep_lower(sb, [sc, mc, err])
    return d, m, sb[0], sb[1]


def _unshrink(X, W, V, per_blk, nblk, *params):
    """Scale each super-block's f16 parameters (so its reconstruction V) by rho = <X, X> / <X, V>
    (weighted by W). A least-squares fit leaves its error orthogonal to V, so V is X shrunk by the
    relative error (8-10 % at 2 bits, more at 1); every expert's output then shrinks the same way
    and the shrinkage adds up layer after layer. With rho the error is orthogonal to X instead: a few
    per cent more squared error, no systematic loss of gain (KL halves at 2 bits, see RESULTS.md)."""
    num = _blocks_view(_wsum(X * X, W), per_blk, nblk, 0).sum(-1)
    den = _blocks_view(_wsum(X * V, W), per_blk, nblk, 0).sum(-1)
    rho = np.where(den > 0, num / np.where(den > 0, den, 1), 1).astype(np.float32)
    rho = np.clip(rho, np.float32(0.5), np.float32(2))
    scaled = _scale_params(np.stack(params, -1), rho[..., None])
    return [scaled[..., i] for i in range(len(params))]


def _scale_params(par: np.ndarray, rho: np.ndarray) -> np.ndarray:
    """par [rows, nblk, npar] times rho (broadcast), rounded to f16; a block where any parameter
    would overflow f16 keeps all of its parameters (its gain stays consistent)."""
    scaled = _f16(par * rho)
    bad = ~np.isfinite(scaled).all(-1, keepdims=True)
    return np.where(bad, par, scaled)


def _keep_lower(best, cand):
    """Element-wise, the candidate [values..., err] with the lower error (the first one seen wins ties)."""
    if best is None:
        return cand
    better = cand[-1] < best[-1]
    return [np.where(better, c, b) for c, b in zip(cand, best)]


def _quant_scale(X, W, a, lo, hi, smax, per_blk, nblk):
    """Quantise sub-block scales a to sc * d (sc in 0..smax, d f16 per block) by weighted error."""
    def err(A):
        return _wsum((A * np.clip(np.rint(X / _safe(A)), lo, hi) - X) ** 2, W)
    return _pick_scales(a, smax, per_blk, nblk, err)


def _pick_scales(a, smax, per_blk, nblk, err):
    """Sub-block scales a as sc * d (sc in 0..smax, d f16 per block): per block d from its largest
    scale, per sub-block sc at the rounded value ±1, whichever gives the lower err(A [rows, nsub, 1])."""
    nsub = a.shape[1]
    d = _f16(_blocks_view(a, per_blk, nblk, 0).max(-1) / smax)
    ds = _to_subs(d, per_blk, nsub)
    sc0 = np.clip(np.rint(a / _safe(ds)), 0, smax)
    sb = None
    for dsc in (-1, 0, 1):
        sc = np.clip(sc0 + dsc, 0, smax)
        sb = _keep_lower(sb, [sc, err((ds * sc)[..., None])])
    return d, sb[0]


def _fit_q1(X, W, smax, per_blk, nblk):
    """Binary: value = a_sub * (+-1) + m_block; alternate the offset and the scales (weighted LS)."""
    rows, nsub, S = X.shape
    sw_sub = W.sum(-1)
    sx_sub = _wsum(X, W)
    swb = _blocks_view(sw_sub, per_blk, nblk, 0).sum(-1)
    m = _blocks_view(sx_sub, per_blk, nblk, 0).sum(-1) / np.where(swb > 0, swb, 1)
    for _ in range(3):
        ms = _to_subs(m, per_blk, nsub)[..., None]
        s = np.where(X >= ms, np.float32(1), np.float32(-1))
        a = np.maximum(_wsum((X - ms) * s, W) / np.where(sw_sub > 0, sw_sub, 1), 0)
        r = _wsum(X - a[..., None] * s, W)
        m = _blocks_view(r, per_blk, nblk, 0).sum(-1) / np.where(swb > 0, swb, 1)
    m = _f16(m)
    ms = _to_subs(m, per_blk, nsub)[..., None]
    s = np.where(X >= ms, np.float32(1), np.float32(-1))
    a = np.maximum(_wsum((X - ms) * s, W) / np.where(sw_sub > 0, sw_sub, 1), 0).astype(np.float32)
    d, sc = _pick_scales(a, smax, per_blk, nblk, lambda A: _wsum((A * s + ms - X) ** 2, W))
    return d, m, sc


# ----------------------------------------------------------------------------------------------- registry

_DEFS = (
    BlockCodec("q8", K_Q8, 32, 32, 1, 0, None, [(8, 1)],
               "8-bit symmetric, f16 scale per 32: 8.5 bpw"),
    BlockCodec("q6", K_Q6, 32, SUPER, 1, 1, None, [(4, 2), (2, 4)],
               "6-bit symmetric, u8 scale per 32 under f16 per 256: 6.3125 bpw", sub_levels=255),
    BlockCodec("q4", K_Q4, 32, SUPER, 2, 2, None, [(4, 2)],
               "4-bit asymmetric, u8 scale+min per 32 under f16 scale+min per 256: 4.625 bpw",
               levels=15, sub_levels=255),
    BlockCodec("q2", K_Q2, 32, SUPER, 2, 1, (49, 20), [(2, 4)],
               "2-bit asymmetric, 4-bit scale+min per 32 under f16 per 256, outliers up to 2.45 bpw",
               levels=3, sub_levels=15),
    BlockCodec("q2rtn", K_Q2RTN, 64, 64, 2, 0, None, [(2, 4)],
               "2-bit round-to-nearest min-max, f16 scale+offset per 64 (baseline): 2.5 bpw"),
    BlockCodec("t1", K_T1, 32, SUPER, 1, 0.5, (46, 25), [(None, 5)],
               "ternary, 5 trits per byte, 4-bit scale per 32 under f16 per 256, outliers up to 1.84 bpw"),
    BlockCodec("q1", K_Q1, 32, SUPER, 2, 0.5, (67, 50), [(1, 8)],
               "binary, 4-bit scale per 32 under f16 scale+offset per 256, outliers up to 1.34 bpw"),
)
for _c in _DEFS:
    CODECS[_c.name] = _c
QUANT_CODECS = tuple(c.name for c in _DEFS)
