"""Fused kernels (runtime/kernels.py) against the numpy reference decoders (formats/quants.py):
`dequantize` bit for bit, `linear` to float32 rounding, for every block codec, full and tail chunks,
rows with outliers, T = 1, a few tokens (mat-vec each) and more (row blocks + BLAS); float codecs
fall back to numpy; corrupt bytes are refused."""

import numpy as np
import pytest

from kimistream.formats.codecs import CodecError, get_codec
from kimistream.runtime import kernels

NAMES = ("q8", "q6", "q4", "q2", "q2rtn", "t1", "q1")
# full chunks only, tails after full chunks, tail only, outliers in q2/t1/q1, > 64 rows (row blocks)
SHAPES = [(9, 256), (7, 192), (5, 1088), (3, 2048), (70, 224)]


def weight(shape, seed):
    rng = np.random.default_rng(seed)
    w = (rng.standard_t(3, size=shape) * 0.02).astype(np.float32)
    w[0] = 0.0                                  # an all-zero row
    if shape[0] > 2:
        w[2, : shape[1] // 2] = 0.37            # constant groups
    return w


def rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("name", NAMES)
def test_has_kernel(name):
    assert kernels.has_kernel(name)


@pytest.mark.parametrize("name,shape", [(n, s) for n in NAMES for s in SHAPES if get_codec(n).supports(s)])
@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
def test_dequantize_bit_exact_and_linear_matches(name, shape, parallel, monkeypatch):
    # the parallel variants run only for weights of PARALLEL_MIN_WEIGHTS or more: lower it to test them
    monkeypatch.setattr(kernels, "PARALLEL_MIN_WEIGHTS", 0 if parallel else 1 << 40)
    c = get_codec(name)
    w = weight(shape, seed=shape[1])
    raw = c.encode(w)
    ref = c.decode(raw, shape)
    got = kernels.dequantize(name, raw, shape)
    assert got.dtype == np.float32 and got.shape == shape
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
    rng = np.random.default_rng(1)
    for T in (1, 3, 7):
        x = rng.standard_normal((T, shape[1])).astype(np.float32)
        y = kernels.linear(x, name, raw, shape)
        assert y.shape == (T, shape[0]) and y.dtype == np.float32
        assert rel(y, x @ ref.T) < 1e-5
    x1 = rng.standard_normal(shape[1]).astype(np.float32)
    assert kernels.linear(x1, name, raw.tobytes(), shape).shape == (shape[0],)
    assert rel(kernels.linear(x1, name, raw, shape), ref @ x1) < 1e-5


@pytest.mark.parametrize("name", ["q2", "t1", "q1"])
def test_outlier_rows(name):
    shape = (6, 2048)
    w = weight(shape, seed=9)
    w[3, 100] = 300.0
    w[4, 2047] = -700.0
    c = get_codec(name)
    assert c.geometry(shape).k > 0
    raw = c.encode(w)
    ref = c.decode(raw, shape)
    np.testing.assert_array_equal(kernels.dequantize(name, raw, shape), ref)
    assert ref[3, 100] == 300.0 and ref[4, 2047] == -700.0
    x = np.random.default_rng(2).standard_normal((1, shape[1])).astype(np.float32)
    assert rel(kernels.linear(x, name, raw, shape), x @ ref.T) < 1e-5


@pytest.mark.parametrize("name", ["f32", "f16", "bf16"])
def test_float_codecs_fall_back_to_numpy(name):
    assert not kernels.has_kernel(name)
    w = weight((5, 40), seed=3)
    c = get_codec(name)
    raw = c.encode(w)
    x = np.random.default_rng(3).standard_normal((2, 40)).astype(np.float32)
    np.testing.assert_allclose(kernels.linear(x, name, raw, (5, 40)), x @ c.decode(raw, (5, 40)).T, rtol=1e-6)


def test_bad_input_is_refused():
    c = get_codec("q2")
    shape = (4, 1024)
    raw = c.encode(weight(shape, 4)).copy()
    x = np.ones((1, 1024), np.float32)
    with pytest.raises(CodecError, match="bytes"):
        kernels.linear(x, "q2", raw[:-1], shape)
    with pytest.raises(ValueError, match="features"):
        kernels.linear(np.ones((1, 512), np.float32), "q2", raw, shape)
    g = c.geometry(shape)
    raw[g.off_ocol:g.off_ocol + 2] = [0x00, 0x04]          # column 1024 == cols
    with pytest.raises(CodecError, match="outlier"):
        kernels.linear(x, "q2", raw, shape)
    with pytest.raises(CodecError, match="outlier"):
        kernels.dequantize("q2", raw, shape)
    with pytest.raises(CodecError):
        kernels.dequantize("f16", np.zeros(8, np.uint8), (2, 2))
    with pytest.raises(CodecError, match="2-D"):
        kernels.dequantize("q2", raw, (2, 2, 1024))


def test_empty():
    c = get_codec("t1")
    raw = c.encode(np.zeros((0, 256), np.float32))
    assert kernels.linear(np.ones((3, 256), np.float32), "t1", raw, (0, 256)).shape == (3, 0)
    assert kernels.dequantize("t1", raw, (0, 256)).shape == (0, 256)
