"""Block codecs for the weights that dominate the file: q8, q6, q4 (resident parts), q2, t1, q1, q1t
(routed experts), and q2rtn (the round-to-nearest baseline). SPEC.md, section "Codecs", is the
contract; this module is that contract in code: each codec's definition (one `BlockCodec(...)` built
with keywords, in `_DEFS` below), its geometry, how its bytes are packed and unpacked, its value
formula and the numpy reference decoder. Fitting values to the layout (the encoder) is
convert/encoder.py; runtime/kernels.py decodes the same bytes fused with the matrix product.

A weight [rows, cols] is quantised along cols. Every row is cut into 32-weight sub-blocks (64 for
q2rtn) and 256-weight super-blocks (the last one of a row may be shorter). A tensor is five planes,
each row-major: f16 block parameters, outlier columns (u16), outlier corrections (f16), sub-block
parameters (u8) and codes. Codes are packed in chunks of 32 bytes: byte j, field k holds weight
j + 32k of the chunk, so one SIMD register of 32 bytes yields 32 consecutive weights per shift.

Every codec's value is one formula, A · (mul · code − zero) + B, with A = d (times the sub-block
scale where the codec has one) and B = m (times the sub-block min where it has one) or nothing.

q1t holds exactly q1's values in another order: 32 rows side by side, so that one byte of a register
indexes the same four columns in 32 rows and the kernel looks sums up instead of multiplying
(TiledQ1Codec; it converts to and from q1's bytes without loss).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .codecs import CODECS, Codec, CodecError

SUPER = 256                 # weights per super-block (f16 parameters)
F16_MAX = 65504.0
POW3 = np.array([1, 3, 9, 27, 81], dtype=np.uint16)

# kind ids shared with runtime/_qdot.c (its per-codec fast paths)
K_Q8, K_Q6, K_Q4, K_Q2, K_Q2RTN, K_T1, K_Q1, K_Q1T = range(8)

# Sub-block parameter layouts: bytes per sub-block, and whether they hold a scale and a min.
SUB_LAYOUTS = {
    "none": (0, False, False),         # parameters per block only
    "u8": (1, True, False),            # a u8 scale
    "u8x2": (2, True, True),           # a u8 scale, then a u8 min
    "nibble_pair": (1, True, True),    # a 4-bit scale (low nibble) and a 4-bit min (high nibble)
    "nibbles": (0.5, True, False),     # 4-bit scales, two sub-blocks per byte (low nibble first)
}


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



def to_subs(blk_vals: np.ndarray, per_blk: int, nsub: int) -> np.ndarray:
    """[rows, nblk] block values -> [rows, nsub] (each sub-block gets its block's value)."""
    return np.repeat(blk_vals, per_blk, axis=1)[:, :nsub]


def _pack_nibbles(v: np.ndarray, nbytes: int) -> np.ndarray:
    rows, n = v.shape
    if n % 2:
        v = np.concatenate([v, np.zeros((rows, 1), np.uint8)], axis=1)
    v = v.reshape(rows, -1, 2)
    return (v[..., 0] | (v[..., 1] << 4)).astype(np.uint8)[:, :nbytes]


# ----------------------------------------------------------------------------------------------- codec

class BlockCodec(Codec):
    """One block codec: its layout and its value formula (see the module docstring and SPEC.md)."""

    def __init__(self, name: str, *, kind: int, sub: int, blk: int, params: int, sub_layout: str,
                 planes: list, codes: tuple, mul: int = 1, zero: int = 0, budget: tuple | None = None,
                 description: str):
        self.name, self.kind, self.sub, self.blk, self.npar = name, kind, sub, blk, params
        self.sub_layout = sub_layout
        self.sub_bytes, self.has_sub_scale, self.has_sub_min = SUB_LAYOUTS[sub_layout]
        self.sub_levels = 15 if self.sub_bytes in (0.5,) or sub_layout == "nibble_pair" else 255
        self.code_planes = planes             # [(bits, or None for trits; fields per byte)]
        self.codes = codes                    # (lowest, highest) stored code; negative: signed bytes
        self.levels = codes[1]
        self.mul, self.zero = mul, zero       # the level of a code: mul * code - zero
        self.budget = budget                  # (num, den): outliers fill the row up to num/den bits per weight
        self.description = description

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

    def pack(self, g: Geometry, par, ocol, oval, sub, digits) -> np.ndarray:
        """The tensor's bytes from its planes: par [rows, nblk, npar] (float32, stored f16), ocol and
        the outliers' corrections oval [rows, k], sub [rows, sub_row] (bytes, see pack_sub) and the
        digit planes [rows, cols]."""
        code_bytes = [pack_fields(d, p, bits) for d, (bits, p) in zip(digits, self.code_planes)]
        buf = np.concatenate([par.astype("<f2").reshape(-1).view(np.uint8),
                              ocol.astype("<u2").reshape(-1).view(np.uint8),
                              oval.astype("<f2").reshape(-1).view(np.uint8),
                              sub.reshape(-1),
                              np.concatenate(code_bytes, axis=1).reshape(-1)])
        assert buf.size == g.nbytes
        return buf

    def code_of(self, digits: list[np.ndarray]) -> np.ndarray:
        """The stored codes (int) from the digit planes: plane 0 holds the low bits."""
        code = digits[0].astype(np.int32)
        if len(digits) > 1:
            code |= digits[1].astype(np.int32) << self.code_planes[0][0]
        if self.codes[0] < 0:
            code = code.astype(np.uint8).view(np.int8).astype(np.int32)
        return code

    def digits_of(self, code: np.ndarray) -> list[np.ndarray]:
        """The digit planes (uint8) of stored codes: the inverse of code_of."""
        if self.codes[0] < 0:
            return [code.astype(np.int8).view(np.uint8)]
        u = code.astype(np.uint8)
        if len(self.code_planes) == 1:
            return [u]
        bits = self.code_planes[0][0]
        return [u & np.uint8((1 << bits) - 1), u >> np.uint8(bits)]

    def _digits(self, codes: np.ndarray, cols: int) -> list[np.ndarray]:
        out, pos = [], 0
        for bits, p in self.code_planes:
            nb = chunk_bytes(cols, p)
            out.append(unpack_fields(codes[:, pos:pos + nb], cols, p, bits))
            pos += nb
        return out

    def sub_params(self, sub: np.ndarray, nsub: int):
        """-> (scale, min) sub-block parameters as float32 [rows, nsub] (None where the codec has none)."""
        layout = self.sub_layout
        if layout == "nibbles":
            lo, hi = sub & 15, sub >> 4
            return np.stack([lo, hi], axis=-1).reshape(sub.shape[0], -1)[:, :nsub].astype(np.float32), None
        if layout == "nibble_pair":
            return (sub & 15).astype(np.float32), (sub >> 4).astype(np.float32)
        if layout == "u8":
            return sub.astype(np.float32), None
        if layout == "u8x2":
            s = sub.reshape(sub.shape[0], nsub, 2)
            return s[..., 0].astype(np.float32), s[..., 1].astype(np.float32)
        return None, None

    def pack_sub(self, g: Geometry, scale, minimum=None) -> np.ndarray:
        """Sub-block parameter bytes [rows, sub_row] from integer scales (and mins) [rows, nsub]."""
        layout = self.sub_layout
        if layout == "none":
            return np.zeros((g.rows, 0), np.uint8)
        sc = scale.astype(np.uint8)
        if layout == "nibbles":
            return _pack_nibbles(sc, g.sub_row)
        if layout == "u8":
            return sc
        mc = minimum.astype(np.uint8)
        if layout == "nibble_pair":
            return sc | (mc << 4)
        return np.stack([sc, mc], -1).reshape(g.rows, -1)

    def scale_offset(self, par, sub, g: Geometry):
        """A and B of the value formula per sub-block [rows, nsub] (B None when the codec has none)."""
        per_blk = self.blk // self.sub
        s1, s2 = self.sub_params(sub, g.nsub)
        A = to_subs(par[..., 0], per_blk, g.nsub)
        if self.has_sub_scale:
            A = A * s1
        B = None
        if self.npar == 2:
            B = to_subs(par[..., 1], per_blk, g.nsub)
            if self.has_sub_min:
                B = B * s2
        return A, B

    def values_at(self, par, sub, g: Geometry, digits: list, cols: np.ndarray) -> np.ndarray:
        """What the digits at columns cols [rows, n] decode to before outliers, exactly as decode
        computes it (par as stored: binary16 values in float32)."""
        A, B = self.scale_offset(par, sub, g)
        idx = cols.astype(np.int64)
        s = idx // self.sub
        level = np.take_along_axis(self.code_of(digits), idx, axis=1).astype(np.float32)
        if self.mul != 1:
            level = level * np.float32(self.mul)
        if self.zero:
            level = level - np.float32(self.zero)
        v = np.take_along_axis(A, s, axis=1) * level
        return v + np.take_along_axis(B, s, axis=1) if B is not None else v

    def affine(self, par, sub, g: Geometry):
        """The value as A·c + B with an integer c in lo..hi, per sub-block: (A, B, lo, hi). c is the
        level (mul·code − zero) where mul is 1, the code itself otherwise."""
        A, B = self.scale_offset(par, sub, g)
        if self.mul == 1:
            return A, (B if B is not None else np.zeros_like(A)), self.codes[0] - self.zero, self.codes[1] - self.zero
        return np.float32(self.mul) * A, B - np.float32(self.zero) * A, self.codes[0], self.codes[1]

    def code_from_level(self, c: np.ndarray) -> np.ndarray:
        """Stored codes from affine's integers c."""
        return c + self.zero if self.mul == 1 else c

    # ----- decode
    def decode(self, buf, shape):
        g = self.geometry(shape)
        raw = np.frombuffer(buf, dtype=np.uint8, count=g.nbytes)
        if g.rows == 0:
            return np.zeros(shape, np.float32)
        par, ocol, oval, sub, codes = self._planes(raw, g)
        if g.k and not outlier_columns_valid(ocol, g.cols):
            raise CodecError(f"{self.name}: corrupt data: outlier columns out of range or not increasing")
        rows, cols, S = g.rows, g.cols, self.sub
        A, B = self.scale_offset(par, sub, g)
        level = self.code_of(self._digits(codes, cols)).reshape(rows, g.nsub, S).astype(np.float32)
        if self.mul != 1:
            level = level * np.float32(self.mul)
        if self.zero:
            level = level - np.float32(self.zero)
        v = A[..., None] * level
        if B is not None:
            v = v + B[..., None]
        v = np.ascontiguousarray(v, dtype=np.float32).reshape(rows, cols)
        if g.k:
            v[np.arange(rows)[:, None], ocol] += oval          # plane 3 holds corrections (SPEC.md)
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


# ----------------------------------------------------------------------------------------------- registry

_DEFS = (
    BlockCodec("q8", kind=K_Q8, sub=32, blk=32, params=1, sub_layout="none", planes=[(8, 1)], codes=(-127, 127),
               description="8-bit symmetric, f16 scale per 32: 8.5 bpw"),
    BlockCodec("q6", kind=K_Q6, sub=32, blk=SUPER, params=1, sub_layout="u8", planes=[(4, 2), (2, 4)],
               codes=(0, 63), zero=32,
               description="6-bit symmetric, u8 scale per 32 under f16 per 256: 6.3125 bpw"),
    BlockCodec("q4", kind=K_Q4, sub=32, blk=SUPER, params=2, sub_layout="u8x2", planes=[(4, 2)], codes=(0, 15),
               description="4-bit asymmetric, u8 scale+min per 32 under f16 scale+min per 256: 4.625 bpw"),
    BlockCodec("q2", kind=K_Q2, sub=32, blk=SUPER, params=2, sub_layout="nibble_pair", planes=[(2, 4)],
               codes=(0, 3), budget=(49, 20),
               description="2-bit asymmetric, 4-bit scale+min per 32 under f16 per 256, outliers up to 2.45 bpw"),
    BlockCodec("q2rtn", kind=K_Q2RTN, sub=64, blk=64, params=2, sub_layout="none", planes=[(2, 4)], codes=(0, 3),
               description="2-bit round-to-nearest min-max, f16 scale+offset per 64 (baseline): 2.5 bpw"),
    BlockCodec("t1", kind=K_T1, sub=32, blk=SUPER, params=1, sub_layout="nibbles", planes=[(None, 5)],
               codes=(0, 2), zero=1, budget=(46, 25),
               description="ternary, 5 trits per byte, 4-bit scale per 32 under f16 per 256, outliers up to "
                           "1.84 bpw"),
    BlockCodec("q1", kind=K_Q1, sub=32, blk=SUPER, params=2, sub_layout="nibbles", planes=[(1, 8)], codes=(0, 1),
               mul=2, zero=1, budget=(67, 50),
               description="binary, 4-bit scale per 32 under f16 scale+offset per 256, outliers up to 1.34 bpw"),
)
for _c in _DEFS:
    CODECS[_c.name] = _c
QUANT_CODECS = tuple(c.name for c in _DEFS)


# ----------------------------------------------------------------------------------------------- q1 in tiles

TILE_ROWS = 32
TILE_SUPER_BYTES = 128 + 4 * (32 + 8 * 32)     # one tile's bytes per super-block (SPEC.md, "q1t")
# The row held at each position of a tile's d and m (and of the kernel's outputs): AVX2's byte
# interleaves keep 128-bit lanes apart and the word products split even and odd rows.
TILE_ORDER = np.array([r + lane for half in (0, 8) for parity in (0, 1) for lane in (0, 16)
                       for r in range(half + parity, half + 8, 2)])


class TiledQ1Codec(Codec):
    """q1's values with 32 rows side by side (SPEC.md, "q1t"): outlier columns and corrections per row
    as in q1, then tiles of 32 rows (the last padded with zero rows), each a run of super-blocks of
    TILE_SUPER_BYTES: the 32 rows' d then m (binary16, in TILE_ORDER), then for each pair of
    sub-blocks 32 bytes of their two 4-bit scales and 8 x 32 bytes of codes, where byte r of group g
    holds row r's four codes of columns 4g .. 4g+3 of the first sub-block in its low nibble (bit i:
    column 4g+i) and of the second in its high nibble. Needs whole super-blocks (cols % 256 == 0);
    elsewhere a plan falls back to q1, which holds the same values row by row."""

    name, kind = "q1t", K_Q1T
    sub, blk, npar, code_planes = 32, SUPER, 2, [(1, 8)]
    fallback = "q1"
    description = "binary as q1, 32 rows side by side for table-lookup products, outliers up to 1.34 bpw"

    def __init__(self, q1: BlockCodec):
        self.q1 = q1

    def geometry(self, shape) -> Geometry:
        shape = tuple(int(s) for s in shape)
        g = self.q1.geometry(shape)
        if g.cols % SUPER:
            raise CodecError(f"q1t: input dimension {g.cols} is not a multiple of {SUPER}")
        off_oval = g.rows * g.k * 2
        off_tiles = -(-(2 * off_oval) // 32) * 32
        ntiles = -(-g.rows // TILE_ROWS)
        tile_row = g.cols // SUPER * TILE_SUPER_BYTES // TILE_ROWS
        return Geometry(g.rows, g.cols, g.nsub, g.nblk, g.k, 0, 0, tile_row, off_tiles, 0, off_oval, off_tiles,
                        off_tiles, off_tiles + ntiles * TILE_ROWS * tile_row)

    def nbytes(self, shape) -> int:
        return self.geometry(shape).nbytes

    def supports(self, shape) -> bool:
        """Whole super-blocks and whole tiles: padding rows would cost bits no plan wants (q1 holds
        those weights at the same values); the layout itself takes any row count."""
        return len(shape) == 2 and int(shape[0]) % TILE_ROWS == 0 and super().supports(shape)

    def from_q1(self, buf, shape) -> np.ndarray:
        """q1t's bytes holding the same values as q1's `buf`."""
        g, q = self.geometry(shape), self.q1.geometry(shape)
        raw = np.frombuffer(buf, dtype=np.uint8, count=q.nbytes)
        out = np.zeros(g.nbytes, np.uint8)
        rows, nsb, nt = g.rows, g.cols // SUPER, -(-g.rows // TILE_ROWS)
        if rows == 0:
            return out
        par, ocol, oval, sub, codes = self.q1._planes(raw, q)
        out[:g.off_oval] = raw[q.off_ocol:q.off_oval]
        out[g.off_oval:g.off_oval + (q.off_sub - q.off_oval)] = raw[q.off_oval:q.off_sub]
        bits = self.q1._digits(codes, g.cols)[0].reshape(rows, g.nsub, 8, 4).astype(np.uint8)
        nib = bits[..., 0] | bits[..., 1] << 1 | bits[..., 2] << 2 | bits[..., 3] << 3      # [rows, nsub, 8]
        nib = nib.reshape(rows, nsb, 4, 2, 8)
        body = np.concatenate([sub.reshape(rows, nsb, 4, 1), nib[:, :, :, 0] | nib[:, :, :, 1] << 4], axis=3)
        pad = nt * TILE_ROWS - rows
        body = np.pad(body, ((0, pad), (0, 0), (0, 0), (0, 0)))
        dm = np.pad(raw[q.off_par:q.off_ocol].view("<f2").reshape(rows, nsb, 2), ((0, pad), (0, 0), (0, 0)))
        dm = dm.reshape(nt, TILE_ROWS, nsb, 2)[:, TILE_ORDER].transpose(0, 2, 3, 1)     # [nt, nsb, 2, 32]
        body = body.reshape(nt, TILE_ROWS, nsb, 4, 9).transpose(0, 2, 3, 4, 1)          # [nt, nsb, 4, 9, 32]
        tiles = out[g.off_code:].reshape(nt, nsb, TILE_SUPER_BYTES)
        tiles[:, :, :128] = np.ascontiguousarray(dm).view(np.uint8).reshape(nt, nsb, 128)
        tiles[:, :, 128:] = body.reshape(nt, nsb, -1)
        return out

    def to_q1(self, buf, shape) -> np.ndarray:
        """q1's bytes holding the same values as q1t's `buf` (the inverse of from_q1)."""
        g, q = self.geometry(shape), self.q1.geometry(shape)
        raw = np.frombuffer(buf, dtype=np.uint8, count=g.nbytes)
        rows, nsb, nt = g.rows, g.cols // SUPER, -(-g.rows // TILE_ROWS)
        out = np.zeros(q.nbytes, np.uint8)
        if rows == 0:
            return out
        tiles = raw[g.off_code:].reshape(nt, nsb, TILE_SUPER_BYTES)
        dm = tiles[:, :, :128].copy().view("<f2").reshape(nt, nsb, 2, TILE_ROWS)
        inv = np.empty(TILE_ROWS, np.int64)
        inv[TILE_ORDER] = np.arange(TILE_ROWS)
        dm = dm[..., inv].transpose(0, 3, 1, 2).reshape(nt * TILE_ROWS, nsb, 2)[:rows]
        body = tiles[:, :, 128:].reshape(nt, nsb, 4, 9, TILE_ROWS).transpose(0, 4, 1, 2, 3)
        body = body.reshape(nt * TILE_ROWS, nsb, 4, 9)[:rows]
        sub = body[..., 0].reshape(rows, -1)
        nib = np.stack([body[..., 1:] & 15, body[..., 1:] >> 4], axis=3)                 # [rows, nsb, 4, 2, 8]
        bits = (nib.reshape(rows, g.nsub, 8)[..., None] >> np.arange(4, dtype=np.uint8)) & 1
        codes = pack_fields(bits.reshape(rows, g.cols), 8, 1)
        out[q.off_par:q.off_ocol] = np.ascontiguousarray(dm).view(np.uint8).reshape(-1)
        out[q.off_ocol:q.off_oval] = raw[:g.off_oval]
        out[q.off_oval:q.off_sub] = raw[g.off_oval:g.off_oval + (q.off_sub - q.off_oval)]
        out[q.off_sub:q.off_code] = sub.reshape(-1)
        out[q.off_code:] = codes.reshape(-1)
        return out

    def decode(self, buf, shape):
        return self.q1.decode(self.to_q1(buf, shape), shape)

    def decode_rows(self, buf, shape, rows_idx):
        return self.q1.decode_rows(self.to_q1(buf, shape), shape, rows_idx)


CODECS["q1t"] = TiledQ1Codec(CODECS["q1"])
QUANT_CODECS = QUANT_CODECS + ("q1t",)
