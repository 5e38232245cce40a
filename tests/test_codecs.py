"""Codecs (formats/codecs.py) and the FP8 E4M3 source table (formats/safetensors.py).

References: torch 2.13 for bfloat16 rounding and FP8 E4M3FN decoding, numpy ``astype`` for float16.
Tests whose name ends in ```` document a defect in formats/ and are expected to FAIL until
the defect is fixed (see the docstring of each)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kimistream.convert.encoder import encode
from kimistream.formats.codecs import CODECS, CodecError, get_codec
from kimistream.formats.safetensors import E4M3_TABLE

F32, F16, BF16 = get_codec("f32"), get_codec("f16"), get_codec("bf16")
ALL = ("f32", "f16", "bf16")
ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2}
F16_MAX = 65504.0
BF16_MAX = float(torch.finfo(torch.bfloat16).max)          # 0x7F7F


# ----------------------------------------------------------------------------------- helpers

def f32_from_bits(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def torch_bf16_bits(x: np.ndarray) -> np.ndarray:
    """The reference: torch's float32 -> bfloat16 conversion, as little-endian uint16 bit patterns."""
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16).copy()


def torch_bf16_finite(x: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16)
    return torch.isfinite(t).numpy()


def encode_bits_u16(codec, x) -> np.ndarray:
    out = encode(codec, x)
    assert out.dtype == np.uint8 and out.ndim == 1
    return out.view("<u2")


def random_finite_f32(rng, n) -> np.ndarray:
    """Uniformly random float32 bit patterns (all exponents, subnormals, both signs), finite only."""
    x = f32_from_bits(rng.integers(0, 2 ** 32, size=n, dtype=np.uint64).astype(np.uint32))
    return x[np.isfinite(x)]


def bf16_edge_values() -> np.ndarray:
    bits = []
    # Exact ties (low half 0x8000) with even and odd kept mantissa, normal and subnormal, both signs.
    for hi in (0x3F80, 0x3F81, 0x3FFF, 0x0000, 0x0001, 0x0002, 0x007F, 0x0080, 0x4B7F, 0x7F7E, 0x7F00):
        for sign in (0, 0x8000):
            h = hi | sign
            bits += [(h << 16) | 0x8000, (h << 16) | 0x7FFF, (h << 16) | 0x8001, (h << 16) | 0x0001,
                     (h << 16) | 0xFFFF, h << 16]
    # Subnormals: smallest, largest, around the subnormal/normal boundary; signed zeros.
    bits += [0x00000001, 0x00007FFF, 0x00008000, 0x00008001, 0x0000FFFF, 0x00010000, 0x007FFFFF,
             0x007F8000, 0x007F7FFF, 0x00800000, 0x80000001, 0x807FFFFF, 0x00000000, 0x80000000]
    # Large values that still round to a finite bfloat16 (max is 0x7F7F; 0x7F7F8000 ties up to inf).
    bits += [0x7F7F0000, 0x7F7F7FFF, 0x7F7E8000, 0x7F7EFFFF, 0xFF7F7FFF, 0xFF7F0000, 0x7F000000,
             0x7EFFFFFF, 0x7F7E7FFF]
    # Mantissa carry into the exponent (1.9999 -> 2.0).
    bits += [0x3FFFFFFF, 0x3FFF8000, 0xBFFFFFFF, 0x407FFFFF]
    x = f32_from_bits(np.array(bits, dtype=np.uint64).astype(np.uint32))
    assert np.isfinite(x).all()
    return x


# ----------------------------------------------------------------------------------- registry, sizes

def test_registry_and_unknown_codec():
    assert set(ALL) <= set(CODECS)
    for name in ALL:
        assert get_codec(name).name == name
    with pytest.raises(CodecError, match="unknown codec"):
        get_codec("f8_nonexistent")


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (1,), (0,), (0, 9), ()])
def test_nbytes_and_bits_per_weight(name, shape):
    codec = get_codec(name)
    n = math.prod(shape)
    assert codec.nbytes(shape) == n * ITEMSIZE[name]
    assert codec.nbytes(list(shape)) == n * ITEMSIZE[name]
    expected_bpw = 8.0 * ITEMSIZE[name] if n else 0.0
    assert codec.bits_per_weight(shape) == expected_bpw


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("shape", [(13,), (4, 9), (2, 3, 5), (0, 4)])
def test_encode_size_dtype_and_roundtrip_shape(name, shape):
    codec = get_codec(name)
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    enc = encode(codec, x)
    assert enc.dtype == np.uint8 and enc.ndim == 1
    assert enc.nbytes == codec.nbytes(shape)
    dec = codec.decode(enc, shape)
    assert dec.dtype == np.float32 and dec.shape == shape
    # decode accepts any bytes-like object
    assert np.array_equal(codec.decode(enc.tobytes(), shape), dec)
    assert np.array_equal(codec.decode(bytearray(enc.tobytes()), shape), dec)


@pytest.mark.parametrize("name", ALL)
def test_encode_noncontiguous_input(name):
    codec = get_codec(name)
    x = np.random.default_rng(2).standard_normal((6, 10)).astype(np.float32)
    xt = x.T                     # Fortran-ordered view
    assert not xt.flags.c_contiguous
    assert np.array_equal(encode(codec, xt), encode(codec, np.ascontiguousarray(xt)))
    assert np.array_equal(codec.decode(encode(codec, xt), xt.shape), codec.decode(encode(codec, xt.copy()), xt.shape))


# ----------------------------------------------------------------------------------- f32

def test_f32_exact_bit_patterns():
    rng = np.random.default_rng(3)
    x = random_finite_f32(rng, 100_000)
    x = np.concatenate([x, f32_from_bits([0, 0x80000000, 1, 0x7F7FFFFF, 0xFF7FFFFF, 0x00800000])])
    enc = encode(F32, x)
    assert enc.tobytes() == x.astype("<f4").tobytes()
    dec = F32.decode(enc, x.shape)
    assert np.array_equal(dec.view(np.uint32), x.view(np.uint32))      # bit-exact incl. -0.0


def test_f32_layout_is_little_endian_row_major():
    x = np.arange(6, dtype=np.float32).reshape(2, 3) + 0.5
    enc = encode(F32, x)
    assert enc.tobytes() == b"".join(np.float32(v).astype("<f4").tobytes() for v in x.ravel())


# ----------------------------------------------------------------------------------- f16

def test_f16_matches_numpy_astype_random_bits():
    rng = np.random.default_rng(4)
    x = random_finite_f32(rng, 400_000)
    x = x[np.abs(x) <= F16_MAX]               # everything in range (most of this set is tiny: -> 0/subnormal)
    # and a dense sample of the f16 range itself
    y = (rng.standard_normal(200_000) * rng.choice([1e-7, 1e-5, 1e-2, 1.0, 1e2, 1e4], 200_000)).astype(np.float32)
    y = np.clip(y, -F16_MAX, F16_MAX)
    for v in (x, y):
        enc = encode(F16, v)
        ref = v.astype("<f2")
        assert np.array_equal(enc.view("<u2"), ref.view("<u2"))
        dec = F16.decode(enc, v.shape)
        assert np.array_equal(dec.view(np.uint32), ref.astype(np.float32).view(np.uint32))


def test_f16_edge_values_match_numpy_astype():
    tiny = float(np.finfo(np.float16).smallest_subnormal)          # 2**-24
    vals = [0.0, -0.0, 1.0, -1.0, F16_MAX, -F16_MAX, 65503.0, 65488.0, 65472.0,
            tiny, -tiny, tiny / 2, tiny / 2 * 1.0001, tiny * 1.5, tiny * 2.5, tiny / 4,
            float(np.finfo(np.float16).tiny), 6.1e-5, 1e-8, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11,
            2049.0, 2051.0, 4097.0, 1e-30, -1e-30]
    x = np.array(vals, dtype=np.float32)
    enc = encode(F16, x)
    assert np.array_equal(enc.view("<u2"), x.astype("<f2").view("<u2"))
    # also the same as torch's conversion
    t = torch.from_numpy(x).to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(enc.view("<u2"), t)


@pytest.mark.parametrize("v", [65520.0, 70000.0, -65520.0, 1e5, -1e6, 3.0e38, float(np.finfo(np.float32).max)])
def test_f16_overflow_raises(v):
    x = np.array([0.0, 1.0, v, 2.0], dtype=np.float32)
    with pytest.raises(CodecError):
        encode(F16, x)


def test_f16_values_that_round_to_max_encode():
    """BUG (formats/codecs.py, _Float.encode, the `np.abs(values).max() > limit` check):
    float32 values with 65504 < |x| < 65520 round (nearest-even) to the finite float16 max 65504 under
    numpy's astype (and torch's .to(float16)); they do not overflow. The encoder rejects them as
    'out of float16 range', unlike the bf16 encoder, which checks the *rounded* result.
    Fix: check the encoded result instead, e.g. `h = values.astype(np.float16)` then raise if
    `not np.isfinite(h).all()` (silence numpy's overflow warning with np.errstate(over='ignore'))."""
    x = np.array([65505.0, 65510.0, 65519.0, -65519.99], dtype=np.float32)
    ref = x.astype("<f2")
    assert np.isfinite(ref).all() and (np.abs(ref.astype(np.float32)) == F16_MAX).all()
    enc = encode(F16, x)
    assert np.array_equal(enc.view("<u2"), ref.view("<u2"))


# ----------------------------------------------------------------------------------- bf16

def test_bf16_matches_torch_on_random_bit_patterns():
    rng = np.random.default_rng(5)
    x = random_finite_f32(rng, 1_000_000)
    fin = torch_bf16_finite(x)
    assert (~fin).sum() < 100            # only the few huge values rounding to inf are dropped
    x = x[fin]
    assert np.array_equal(encode_bits_u16(BF16, x), torch_bf16_bits(x))


def test_bf16_matches_torch_on_random_normal_values():
    rng = np.random.default_rng(6)
    x = (rng.standard_normal(300_000) * rng.choice([1e-38, 1e-20, 1e-3, 1.0, 1e10, 1e37], 300_000)).astype(np.float32)
    assert np.array_equal(encode_bits_u16(BF16, x), torch_bf16_bits(x))


def test_bf16_matches_torch_on_edge_values():
    x = bf16_edge_values()
    assert torch_bf16_finite(x).all()
    got, ref = encode_bits_u16(BF16, x), torch_bf16_bits(x)
    bad = np.nonzero(got != ref)[0]
    assert bad.size == 0, [(hex(int(x.view(np.uint32)[i])), hex(int(got[i])), hex(int(ref[i]))) for i in bad[:10]]


def test_bf16_ties_round_to_even():
    # 1 + 2^-8 is exactly halfway between 1.0 (0x3F80, even) and 1+2^-7 (0x3F81, odd) -> 0x3F80
    # 1 + 3*2^-8 is halfway between 0x3F81 (odd) and 0x3F82 (even) -> 0x3F82
    x = np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8)], dtype=np.float32)
    assert encode_bits_u16(BF16, x).tolist() == [0x3F80, 0x3F82, 0xBF80]


def test_bf16_decode_is_upper_half_of_float32():
    rng = np.random.default_rng(7)
    x = random_finite_f32(rng, 200_000)
    x = x[torch_bf16_finite(x)]
    enc = encode(BF16, x)
    dec = BF16.decode(enc, x.shape)
    ref = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    assert np.array_equal(dec.view(np.uint32), ref.view(np.uint32))
    # already-bf16 values survive a round trip unchanged
    assert np.array_equal(encode(BF16, dec), enc)


@pytest.mark.parametrize("bits", [0x7F7F8000, 0x7F7FFFFF, 0xFF7F8000, 0xFF7FFFFF, 0x7F7FC000])
def test_bf16_values_rounding_to_inf_raise(bits):
    x = f32_from_bits([0x3F800000, bits])
    assert not torch_bf16_finite(x)[1]                       # torch rounds it to +-inf
    with pytest.raises(CodecError):
        encode(BF16, x)


# ----------------------------------------------------------------------------------- non-finite input

@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, "nan_payload"])
def test_non_finite_input_raises(name, bad):
    x = np.linspace(-1, 1, 17, dtype=np.float32).reshape(1, 17).repeat(3, axis=0)
    if bad == "nan_payload":
        x[1, 5] = f32_from_bits([0xFFC00001])[0]         # negative NaN with a payload
    else:
        x[1, 5] = bad
    with pytest.raises(CodecError, match="(?i)nan|inf|finite"):
        encode(name, x)


# ----------------------------------------------------------------------------------- decode_rows

@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("rows", [[0], [4, 0, 4, 2], np.array([9, 1, 3], dtype=np.int64),
                                  np.array([], dtype=np.int64), 3, [-1],
                                  np.arange(10)])
def test_decode_rows_equals_decode_indexed(name, rows):
    codec = get_codec(name)
    shape = (10, 7)
    x = np.random.default_rng(8).standard_normal(shape).astype(np.float32) * 3
    enc = encode(codec, x)
    full = codec.decode(enc, shape)
    got = codec.decode_rows(enc, shape, rows)
    want = full[np.asarray(rows)]
    assert got.dtype == np.float32
    assert got.shape == want.shape
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # from a bytes object as well (as read from a file)
    assert np.array_equal(codec.decode_rows(enc.tobytes(), shape, rows), want)


# ----------------------------------------------------------------------------------- FP8 E4M3 table

def test_e4m3_table_matches_torch():
    ref = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    table = np.asarray(E4M3_TABLE)
    assert table.shape == (256,) and table.dtype == np.float32
    nan_t, nan_r = np.isnan(table), np.isnan(ref)
    assert np.array_equal(nan_t, nan_r)
    assert sorted(np.nonzero(nan_r)[0].tolist()) == [0x7F, 0xFF]
    # bit-exact (so -0.0 at 0x80 is checked too)
    bad = np.nonzero(table[~nan_r].view(np.uint32) != ref[~nan_r].view(np.uint32))[0]
    assert bad.size == 0, bad
    # a few anchor values
    assert table[0x7E] == 448.0 and table[0xFE] == -448.0
    assert table[0x01] == 2.0 ** -9 and table[0x38] == 1.0
