"""Group-wise integer codecs for the weights that dominate the file.

Every codec quantises along the input dimension in groups (a multiple of 32 weights), and stores a
tensor as two planes, each row-contiguous: first the packed codes of all rows, then the per-group
parameters of all rows (float16). Packing puts consecutive weights of a group in consecutive bytes'
same bit field, so a SIMD lane unpacks consecutive weights with one shift and mask:

    q8  symmetric   int8 codes,                    f16 scale per 32       8.5 bits/weight
    q4  asymmetric  4-bit codes, 2 per byte,      f16 scale+min per 32   5.0 bits/weight
    q2  asymmetric  2-bit codes, 4 per byte,      f16 scale+min per 64   2.5 bits/weight

For a group of g weights packed p per byte, byte j holds weights j, j + g/p, j + 2g/p, ... in bit
fields 0, b, 2b, ... (b = 8/p). Value = code * scale + min (asymmetric) or code * scale (q8).
"""

from __future__ import annotations

import math

import numpy as np

from .codecs import CODECS, Codec, CodecError, _check_finite


class GroupCodec(Codec):
    def __init__(self, name: str, bits: int, group: int, symmetric: bool, description: str):
        self.name, self.bits, self.group, self.symmetric, self.description = name, bits, group, symmetric, description
        self.per_byte = 8 // bits
        self.params = 1 if symmetric else 2          # f16 values per group

    def _geometry(self, shape):
        if len(shape) != 2:
            raise CodecError(f"{self.name} needs a 2-D weight, got shape {list(shape)}")
        rows, cols = shape
        if cols % self.group:
            raise CodecError(f"{self.name}: input dimension {cols} is not a multiple of the group size {self.group}")
        return rows, cols, cols // self.group

    def nbytes(self, shape) -> int:
        rows, cols, groups = self._geometry(shape)
        return rows * cols * self.bits // 8 + rows * groups * self.params * 2

    # ----- bit packing
    def _pack(self, codes: np.ndarray) -> np.ndarray:
        """codes [rows, groups, g] uint8 -> [rows, groups, g/p] bytes."""
        p, b = self.per_byte, self.bits
        if p == 1:
            return codes.astype(np.uint8)
        lanes = codes.reshape(codes.shape[0], codes.shape[1], p, self.group // p)
        out = np.zeros(lanes.shape[:2] + lanes.shape[3:], dtype=np.uint8)
        for k in range(p):
            out |= (lanes[:, :, k, :].astype(np.uint8) << (k * b))
        return out

    def _unpack(self, packed: np.ndarray, rows: int, groups: int) -> np.ndarray:
        p, b = self.per_byte, self.bits
        packed = packed.reshape(rows, groups, self.group // p)
        if p == 1:
            return packed
        mask = (1 << b) - 1
        return np.concatenate([(packed >> (k * b)) & mask for k in range(p)], axis=-1)

    # ----- fitting
    def _fit(self, x: np.ndarray, importance: np.ndarray | None):
        """Per-group (scale, min) minimising weighted squared error over a grid of clipped ranges."""
        levels = (1 << self.bits) - 1
        w = np.ones_like(x) if importance is None else np.broadcast_to(importance, x.shape)
        if self.symmetric:
            amax = np.abs(x).max(axis=-1, keepdims=True)
            half = levels // 2            # int8: [-127, 127]
            best_scale, best_err = None, None
            for shrink in (1.0, 0.95, 0.9, 0.85, 0.8):
                scale = (amax * shrink / half).astype(np.float16).astype(np.float32)
                safe = np.where(scale == 0, 1, scale)
                q = np.clip(np.rint(x / safe), -half, half)
                err = (w * (q * scale - x) ** 2).sum(axis=-1, keepdims=True)
                if best_err is None:
                    best_scale, best_err = scale, err
                else:
                    better = err < best_err
                    best_scale = np.where(better, scale, best_scale)
                    best_err = np.where(better, err, best_err)
            return best_scale, None
        lo, hi = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)
        best = None
        for a in np.linspace(0.0, 0.3, 7):
            for c in np.linspace(0.0, 0.3, 7):
                mn = lo + a * (hi - lo) * 0.5
                mx = hi - c * (hi - lo) * 0.5
                scale = ((mx - mn) / levels).astype(np.float16).astype(np.float32)
                mn16 = mn.astype(np.float16).astype(np.float32)
                safe = np.where(scale == 0, 1, scale)
                q = np.clip(np.rint((x - mn16) / safe), 0, levels)
                err = (w * (q * scale + mn16 - x) ** 2).sum(axis=-1, keepdims=True)
                if best is None:
                    best = [scale, mn16, err]
                else:
                    better = err < best[2]
                    best = [np.where(better, scale, best[0]), np.where(better, mn16, best[1]),
                            np.where(better, err, best[2])]
        return best[0], best[1]

    def encode(self, values, importance: np.ndarray | None = None):
        """`importance` (optional, [in_features]) weights the squared error of each input channel."""
        x = np.asarray(values, dtype=np.float32)
        rows, cols, groups = self._geometry(x.shape)
        _check_finite(x)
        if np.abs(x).max(initial=0) > 60000:
            raise CodecError(f"{self.name}: |value| > 60000 does not fit the float16 group parameters")
        g = x.reshape(rows, groups, self.group)
        imp = None
        if importance is not None:
            imp = np.asarray(importance, dtype=np.float32).reshape(1, groups, self.group)
        scale, mn = self._fit(g, imp)
        levels = (1 << self.bits) - 1
        safe = np.where(scale == 0, 1, scale)
        if self.symmetric:
            q = np.clip(np.rint(g / safe), -(levels // 2), levels // 2).astype(np.int8).view(np.uint8)
            params = scale[..., 0].astype("<f2")
        else:
            q = np.clip(np.rint((g - mn) / safe), 0, levels).astype(np.uint8)
            params = np.stack([scale[..., 0], mn[..., 0]], axis=-1).astype("<f2")
        codes = self._pack(q).reshape(-1)
        return np.concatenate([codes, params.reshape(-1).view(np.uint8)])

    def decode(self, buf, shape):
        rows, cols, groups = self._geometry(shape)
        raw = np.frombuffer(buf, dtype=np.uint8, count=self.nbytes(shape))
        ncode = rows * cols * self.bits // 8
        q = self._unpack(raw[:ncode], rows, groups)
        params = raw[ncode:].view("<f2").astype(np.float32).reshape(rows, groups, self.params)
        if self.symmetric:
            vals = q.view(np.int8).astype(np.float32) * params[..., :1]
        else:
            vals = q.astype(np.float32) * params[..., :1] + params[..., 1:2]
        return vals.reshape(rows, cols)

    def decode_rows(self, buf, shape, rows_idx):
        rows, cols, groups = self._geometry(shape)
        rows_idx = np.asarray(rows_idx).reshape(-1)
        raw = np.frombuffer(buf, dtype=np.uint8, count=self.nbytes(shape))
        row_code = cols * self.bits // 8
        row_par = groups * self.params * 2
        codes = raw[:rows * row_code].reshape(rows, row_code)[rows_idx]
        params = raw[rows * row_code:].reshape(rows, row_par)[rows_idx]
        sub = np.concatenate([codes.reshape(-1), params.reshape(-1)])
        return self.decode(sub, (len(rows_idx), cols))


for _c in (GroupCodec("q8", 8, 32, True, "8-bit symmetric, f16 scale per 32"),
           GroupCodec("q4", 4, 32, False, "4-bit asymmetric, f16 scale+min per 32"),
           GroupCodec("q2", 2, 64, False, "2-bit asymmetric, f16 scale+min per 64")):
    CODECS[_c.name] = _c
