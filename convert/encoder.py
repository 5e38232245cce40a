"""The encoder: float values -> a codec's bytes (the layouts are formats/codecs.py and
formats/quants.py). For the block codecs this is where the fitting lives: outliers chosen by
importance, per-sub-block grids of clipped ranges refined by weighted least squares, scales rounded
to the layout's integers, the gain correction, and error-feedback rounding (GPTQ) when calibration
measured the inputs' second moment. Rows are fitted in cache-sized blocks on every core.

`encode(codec, values, importance=None, moment=None)` is the one entry point; each block codec's
fitting strategy is one entry of `FITS`."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kimistream.formats import blas
from kimistream.formats.codecs import Codec, CodecError, get_codec
from kimistream.formats.quants import F16_MAX, BlockCodec, TiledQ1Codec, to_subs

FIT_BLOCK = 1 << 18         # weights fitted per numpy pass


def encode(codec: Codec | str, values: np.ndarray, importance: np.ndarray | None = None,
           moment: np.ndarray | None = None) -> np.ndarray:
    """Encode float values into a uint8 array of exactly codec.nbytes(values.shape). `importance`
    (per input channel, >= 0) weights the fitting error of codecs that fit anything, and `moment`
    (the inputs' second moment E[x xᵀ], [cols, cols]) makes them round with error feedback, so that
    what is minimised is the output error E[(x·(w − v))²] rather than the weight error; without
    `importance` its diagonal weights the grid fit. Codecs that fit nothing ignore both."""
    c = get_codec(codec) if isinstance(codec, str) else codec
    if isinstance(c, TiledQ1Codec):     # q1's fit, its bytes laid out in tiles
        return c.from_q1(encode(c.q1, values, importance, moment), np.shape(values))
    if isinstance(c, BlockCodec):
        blas.set_threads(1)     # same bytes on any thread count (formats/blas.py); rows run on every core anyway
        return _encode_block(c, values, importance, moment)
    return _encode_float(c, values)


def check_finite(values: np.ndarray) -> None:
    if not np.isfinite(values).all():
        bad = int(values.size - np.isfinite(values).sum())
        raise CodecError(f"{bad} non-finite value(s) (NaN or Inf) in the source tensor")


# ----------------------------------------------------------------------------------------------- floats

def _encode_float(c: Codec, values) -> np.ndarray:
    values = np.ascontiguousarray(values, dtype=np.float32)
    check_finite(values)
    if c.name == "bf16":
        # round to nearest even on the upper 16 bits
        bits = values.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        if (rounded & 0x7F80 == 0x7F80).any():
            raise CodecError("value out of bfloat16 range")
        return rounded.astype("<u2").view(np.uint8).reshape(-1)
    with np.errstate(over="ignore"):
        out = np.ascontiguousarray(values.astype(c.dtype))
    if c.dtype.itemsize == 2 and not np.isfinite(out).all():
        raise CodecError(f"value out of float16 range (|x| > {float(np.finfo(np.float16).max)})")
    return out.view(np.uint8).reshape(-1)


# ----------------------------------------------------------------------------------------------- blocks

def _encode_block(c: BlockCodec, values, importance, moment) -> np.ndarray:
    x = np.ascontiguousarray(values, dtype=np.float32)
    g = c.geometry(x.shape)
    check_finite(x)
    if x.size and np.abs(x).max() > F16_MAX:
        raise CodecError(f"{c.name}: |value| > {F16_MAX:g} does not fit the float16 parameters")
    rows, cols = x.shape
    if rows == 0:
        return np.zeros(0, np.uint8)
    H = None
    if moment is not None and c.name not in NO_FEEDBACK:
        H = _check_moment(c.name, moment, cols)
        if importance is None:
            importance = np.maximum(np.diag(H), 0)
    w = _importance(c, importance, cols)
    # rows in blocks whose temporaries stay cache-sized (about 2x faster than all at once), on
    # every core: numpy releases the GIL inside each operation
    step = max(1, FIT_BLOCK // cols)
    parts = _map_rows(lambda i: _encode_rows(c, x[i:i + step], w, g.k), range(0, rows, step))
    ocol, oval, par, sub = (np.concatenate([p[j] for p in parts]) for j in range(4))
    digits = [np.concatenate([p[4][j] for p in parts]) for j in range(len(parts[0][4]))]
    if H is not None:
        par, digits = _round_with_feedback(c, x, par, sub, g, H, ocol)
    if g.k:
        # plane 3 holds each outlier's correction to what its digit decodes to (SPEC.md, "Planes")
        stored = par.astype("<f2").astype(np.float32)
        oval = oval - c.values_at(stored, sub, g, digits, ocol)
    return c.pack(g, par, ocol, oval, sub, digits)


def _encode_rows(c: BlockCodec, x, w, k):
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
    g = c.geometry((rows, cols))
    X = x.reshape(rows, g.nsub, c.sub)
    W = wt.reshape(rows, g.nsub, c.sub)
    par, sub, digits = FITS[c.name](c, X, W, g)
    return ocol, oval, par, sub, digits


def _round_with_feedback(c: BlockCodec, x, par, sub, g, H, ocol):
    A, B, lo, hi = c.affine(par, sub, g)
    A, B = np.repeat(A, c.sub, axis=1), np.repeat(B, c.sub, axis=1)
    exact = np.zeros(x.shape, bool)
    if g.k:
        np.put_along_axis(exact, ocol.astype(np.int64), True, axis=1)
    code = _gptq(x, A, B, lo, hi, _inverse_factor(H), exact)
    v = np.where(exact, 0, A * code + B)
    # The gain correction again, now in the output metric and per row (error feedback moves
    # error between super-blocks, so only the whole row's gain is meaningful): every block of
    # the row scaled by rho with wᵀH(w − outliers) = rho·wᵀH v.
    wh = x @ np.asarray(H, dtype=np.float32)           # float32 product, float64 sums
    num = (wh * (x - np.where(exact, x, 0))).sum(1, dtype=np.float64)
    den = (wh * v).sum(1, dtype=np.float64)
    ok = den > 0
    rho = np.clip(np.where(ok, num / np.where(ok, den, 1), 1), 0.5, 2).astype(np.float32)
    par = _scale_params(par, rho[:, None, None])
    return par, [d.reshape(g.rows, g.cols) for d in c.digits_of(c.code_from_level(code))]


def _importance(c: BlockCodec, importance, cols) -> np.ndarray:
    if importance is None:
        return np.ones(cols, np.float32)
    imp = np.asarray(importance, dtype=np.float32).reshape(-1)
    if imp.size != cols:
        raise CodecError(f"{c.name}: importance has {imp.size} values for {cols} input channels")
    if not np.isfinite(imp).all() or (imp < 0).any():
        raise CodecError(f"{c.name}: importance must be finite and non-negative")
    mean = float(imp.mean())
    if mean <= 0:
        return np.ones(cols, np.float32)
    # a small floor keeps channels never seen in calibration weakly fitted
    return (imp / mean + np.float32(1e-3)).astype(np.float32)


# ----------------------------------------------------------------------------------------------- per codec
# Each returns (f16 params [rows, nblk, npar] float32, sub-block bytes [rows, sub_row], digit planes).

def _fit_rtn(c, X, W, g):
    """q2rtn: min and max of each sub-block, round to nearest (the baseline: no search)."""
    lo, hi = X.min(-1), X.max(-1)
    s, o = _f16((hi - lo) / 3), _f16(lo)
    q = np.clip(np.rint((X - o[..., None]) / _safe(s)[..., None]), 0, 3).astype(np.uint8)
    return np.stack([s, o], -1), c.pack_sub(g, None), [q.reshape(g.rows, g.cols)]


def _fit_q8(c, X, W, g):
    a = _fit_sym(X, W, -127, 127)
    s = _f16(a)
    q = np.clip(np.rint(X / _safe(s)[..., None]), -127, 127)
    return s[..., None], c.pack_sub(g, None), [d.reshape(g.rows, g.cols) for d in c.digits_of(q)]


def _fit_asym(c, X, W, g):
    """q4, q2: a scale and a min per sub-block, both as integers under f16 per super-block."""
    per_blk = c.blk // c.sub
    a, b = _fit_affine(X, W, c.levels)
    d, m, sc, mc = _quant_affine(X, W, a, b, c.levels, c.sub_levels, per_blk, g.nblk)
    A = (to_subs(d, per_blk, g.nsub) * sc)[..., None]
    B = (to_subs(m, per_blk, g.nsub) * mc)[..., None]
    q = np.clip(np.rint((X - B) / _safe(A)), 0, c.levels).astype(np.uint8)
    q = np.where(A == 0, np.uint8(0), q)
    d, m = _unshrink(X, W, A * q + B, per_blk, g.nblk, d, m)
    return np.stack([d, m], -1), c.pack_sub(g, sc, mc), [q.reshape(g.rows, g.cols)]


def _fit_scaled(c, X, W, g):
    """t1, q6: a symmetric integer grid, an integer scale per sub-block under f16 per super-block."""
    per_blk = c.blk // c.sub
    lo, hi = c.codes[0] - c.zero, c.codes[1] - c.zero
    a = _fit_sym(X, W, lo, hi)
    d, sc = _quant_scale(X, W, a, lo, hi, c.sub_levels, per_blk, g.nblk)
    A = (to_subs(d, per_blk, g.nsub) * sc)[..., None]
    t = np.clip(np.rint(X / _safe(A)), lo, hi)
    t = np.where(A == 0, 0, t)
    d, = _unshrink(X, W, A * t, per_blk, g.nblk, d)
    digits = [p.reshape(g.rows, g.cols) for p in c.digits_of(c.code_from_level(t))]
    return d[..., None], c.pack_sub(g, sc), digits


def _fit_sign(c, X, W, g):
    """q1: each weight a sub-block scale times ±1, plus an offset per super-block."""
    per_blk = c.blk // c.sub
    d, m, sc = _fit_q1(X, W, c.sub_levels, per_blk, g.nblk)
    ms = to_subs(m, per_blk, g.nsub)[..., None]
    bit = (X >= ms).astype(np.uint8)
    A = (to_subs(d, per_blk, g.nsub) * sc)[..., None]
    d, m = _unshrink(X, W, A * (bit * np.float32(2) - 1) + ms, per_blk, g.nblk, d, m)
    return np.stack([d, m], -1), c.pack_sub(g, sc), [bit.reshape(g.rows, g.cols)]


FITS = {"q8": _fit_q8, "q6": _fit_scaled, "q4": _fit_asym, "q2": _fit_asym, "q2rtn": _fit_rtn,
        "t1": _fit_scaled, "q1": _fit_sign}
NO_FEEDBACK = ("q2rtn",)      # the baseline stays round-to-nearest


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


_POOL: list = []
_THREADS: list = []      # set_threads' choice; else every core


def set_threads(n: int) -> None:
    """Encode with n threads (a cluster worker uses the CPUs it was given, not the whole node)."""
    n = max(1, int(n))
    if _THREADS != [n]:
        _THREADS[:] = [n]
        while _POOL:
            _POOL.pop().shutdown(wait=False)


def _map_rows(fn, starts):
    """fn over row-block starts, on every core — unless there is one block, or this is already a
    pool thread (an encode called from inside one would wait on itself)."""
    if len(starts) < 2 or threading.current_thread().name.startswith("kimi-fit"):
        return [fn(i) for i in starts]
    if not _POOL:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        _POOL.append(ThreadPoolExecutor(_THREADS[0] if _THREADS else max(1, min(8, cores)), thread_name_prefix="kimi-fit"))
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
    # The same moment recurs for every expert of a layer: as one object in a local conversion, as
    # equal copies on a cluster's workers. Keyed by a fingerprint of its values (which also catches
    # most edits in place), a copy checked in full.
    key = (H.shape, float(np.sum(H, dtype=np.float64)), float(np.sum(H[::7, ::5], dtype=np.float64)))
    hit = _FACTORS.get(key)
    if hit is not None and (hit[0] is H or np.array_equal(hit[0], H)):
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
    ds, ms = to_subs(d, per_blk, nsub), to_subs(m, per_blk, nsub)
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
    ds = to_subs(d, per_blk, nsub)
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
        ms = to_subs(m, per_blk, nsub)[..., None]
        s = np.where(X >= ms, np.float32(1), np.float32(-1))
        a = np.maximum(_wsum((X - ms) * s, W) / np.where(sw_sub > 0, sw_sub, 1), 0)
        r = _wsum(X - a[..., None] * s, W)
        m = _blocks_view(r, per_blk, nblk, 0).sum(-1) / np.where(swb > 0, swb, 1)
    m = _f16(m)
    ms = to_subs(m, per_blk, nsub)[..., None]
    s = np.where(X >= ms, np.float32(1), np.float32(-1))
    a = np.maximum(_wsum((X - ms) * s, W) / np.where(sw_sub > 0, sw_sub, 1), 0).astype(np.float32)
    d, sc = _pick_scales(a, smax, per_blk, nblk, lambda A: _wsum((A * s + ms - X) ** 2, W))
    return d, m, sc


