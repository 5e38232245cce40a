"""Fused kernels (runtime/kernels.py) against the numpy reference decoders (formats/quants.py), for
every block codec, full and tail chunks, rows with outliers, 1-row weights:
- `dequantize` bit for bit;
- the integer mat-vec (one token, or several through the same rows: T < BLAS_MIN_TOKENS, or any T
  where the codec takes int8) equals the reference weight times x in float64 to within the rounding
  of x it takes (int8 per 128 values where `kernels.takes_int8`, else 16 bits per 32, in every
  `--activations` mode):
  |y - W x| <= sum_j |D_j - O_j| |x_j - x^_j| + 1e-5 |W| |x|, where x^ is the
  rounded activation, D_j what column j's digit decodes to (W_j but at an outlier, whose stored
  correction multiplies the exact x_j) and O_j, with 16-bit inputs, the value the weight would have
  with code 0 (the part of each weight that multiplies exact span sums; int8 inputs' offsets take the
  rounded sums, so O_j = 0 there);
- more tokens on 16-bit inputs (row blocks + BLAS) to float32 rounding;
- the fused routed-expert step equals the same experts run one linear at a time;
float codecs fall back to numpy; corrupt bytes are refused."""

import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest

from kimistream.convert.encoder import encode
from kimistream.formats.codecs import CodecError, get_codec
from kimistream.runtime import _qdot, kernels

NAMES = ("q8", "q6", "q4", "q2", "q2rtn", "t1", "q1")
# full chunks only, tails after full chunks, tail only, outliers in q2/t1/q1, > 64 rows (row blocks),
# whole 128-column blocks with a q1 tail
SHAPES = [(9, 256), (7, 192), (5, 1088), (3, 2048), (70, 224), (1, 7168), (1, 32), (4, 384)]


@pytest.fixture(params=["avx2", "generic"])
def isa(request):
    """Run a test on each instruction-set path of the C kernel this machine has."""
    before = _qdot.isa()
    try:
        _qdot.set_isa(request.param)
    except ValueError:
        pytest.skip(f"no {request.param} on this machine")
    yield request.param
    _qdot.set_isa(before)


@pytest.fixture(autouse=True)
def decode_steps():
    """Products are called as a decode step calls them (a model test run before may have left
    prefill's choice of inputs set)."""
    before = kernels.decoding()
    kernels.set_decoding(True)
    yield
    kernels.set_decoding(before)


@pytest.fixture(params=kernels.ACTIVATIONS)
def activations(request):
    """Run a test with each rounding of the one-token products' inputs."""
    before = kernels.activations()
    kernels.set_activations(request.param)
    yield request.param
    kernels.set_activations(before)


def test_activations_mode_is_checked():
    with pytest.raises(ValueError, match="activations"):
        kernels.set_activations("int4")


@contextlib.contextmanager
def activations_mode(mode):
    before = kernels.activations()
    kernels.set_activations(mode)
    try:
        yield
    finally:
        kernels.set_activations(before)


@pytest.mark.parametrize("name", kernels.X8_CODECS)
def test_int8_activations_round_inputs_per_128(name):
    """With int8 activations a q2/q1/t1/q4/q6 product, of one token or several (through the same rows,
    and past BLAS_MIN_TOKENS), is within int8's rounding bound and not within int16's (so the int8
    route really ran); from X8_BLAS_MIN_TOKENS tokens on it is exact (BLAS); q8 keeps int16; "auto"
    takes int8 for q2 and q1 only."""
    if kernels.isa() != "avx2":
        pytest.skip("int8 activations are an AVX2 route")
    with activations_mode("auto"):
        assert kernels.takes_int8("q2") and kernels.takes_int8("q1") and not kernels.takes_int8("q4")
        assert not kernels.takes_int8("q1", cols=384) and kernels.takes_int8("q1", cols=512)
        assert kernels.takes_int8("t1") and kernels.takes_int8("t1", 1024, 2)
        assert not kernels.takes_int8("t1", 1088)                  # whole blocks of 128 inputs only
        T1 = kernels.T1_BLAS_MIN_TOKENS                 # ... and BLAS sooner than the others
        assert kernels.takes_int8("t1", 1024, T1 - 1) and not kernels.takes_int8("t1", 1024, T1)
        assert kernels.takes_int8("q2", 1024, T1) and T1 < kernels.X8_BLAS_MIN_TOKENS
    shape = (16, 1024)
    raw = encode(name, weight(shape, seed=3))
    # 34 tokens: a tile of 32 and one of 2 (q2 and q1 multiply a row's digits and scales apart below
    # three tokens a tile, as bytes of digit x scale from three on)
    xs = np.random.default_rng(3).standard_normal((kernels.BLAS_MIN_TOKENS + 2, shape[1])).astype(np.float32)
    ref = get_codec(name).decode(raw, shape).astype(np.float64)
    with activations_mode("int8"):
        r8 = kernels.rounded_input(name, xs[0], 2)
        assert np.abs(r8 - xs[0]).max() > 100 * np.abs(kernels.rounded_input("q8", xs[0]) - xs[0]).max()
        for x in (xs[:1], xs[:2], xs[:3], xs):
            T = x.shape[0]
            y = kernels.linear(x, name, raw, shape)
            for t in range(T):
                assert_int8_close(y[t], name, raw, shape, x[t], T)
            assert kernels.takes_int8(name, shape[1], T)
            with activations_mode("int16"):
                assert any((np.abs(y[t] - ref @ x[t]) > int8_bound(name, raw, shape, x[t], T)).any()
                           for t in range(T))
        xb = np.random.default_rng(4).standard_normal((kernels.X8_BLAS_MIN_TOKENS, shape[1])).astype(np.float32)
        assert not kernels.takes_int8(name, shape[1], xb.shape[0])
        assert rel(kernels.linear(xb, name, raw, shape), xb @ ref.T) < 1e-5


@pytest.mark.parametrize("name", ["q2", "q1"])
def test_x8_levels_round_inputs_coarser(name):
    """set_x8_levels(31) rounds int8 inputs to -31 .. 31 (what a table-lookup kernel would take): one
    token's and several tokens' products stay within that rounding's bound, and their error is several
    times the -127 .. 127 rounding's (so the coarser rounding really ran); set back, the products are as
    before; n outside 1 .. 127 is refused."""
    if kernels.isa() != "avx2":
        pytest.skip("int8 activations are an AVX2 route")
    shape = (64, 1024)
    raw = encode(name, weight(shape, seed=5))
    ref = get_codec(name).decode(raw, shape).astype(np.float64)
    xs = np.random.default_rng(5).standard_normal((5, shape[1])).astype(np.float32)
    exact = xs.astype(np.float64) @ ref.T
    with activations_mode("auto"):
        before = kernels.linear(xs, name, raw, shape)
        assert kernels.set_x8_levels(31) == 127
        try:
            for x in (xs[:1], xs):
                T = x.shape[0]
                y = kernels.linear(x, name, raw, shape)
                for t in range(T):
                    assert_int8_close(y[t], name, raw, shape, x[t], T)
                assert np.abs(y - exact[:T]).mean() > 2 * np.abs(before[:T] - exact[:T]).mean()
        finally:
            assert kernels.set_x8_levels(127) == 31
        np.testing.assert_array_equal(kernels.linear(xs, name, raw, shape), before)
    for bad in (0, 128):
        with pytest.raises(ValueError, match="set_x8_levels"):
            kernels.set_x8_levels(bad)


@pytest.mark.parametrize("cols", [128, 256, 512, 1024, 1280, 1408, 7168])
def test_one_t1_token_is_exact_on_its_input_grid(cols):
    """One t1 token multiplies its trits' bytes without taking the trits out (256 d = 3 y - y', y' = 3 y
    mod 256) by x rounded to -21 .. 21 per 128 values: given an x already on that grid the product is
    the reference weight times x to float rounding, for rows of whole 640-column groups, leftover
    chunks, a last shorter super-block, a tail chunk of each length (512: 32 columns, 1024: 64, 256: 96,
    1408 and 7168: 128, 128: a tail alone) and outliers; and an x off the grid is rounded that way (to 21 steps, not int8's 127)."""
    if kernels.isa() != "avx2":
        pytest.skip("an AVX2 route")
    shape = (24, cols)
    raw = encode("t1", weight(shape, seed=cols))
    ref = get_codec("t1").decode(raw, shape).astype(np.float64)
    x = np.random.default_rng(cols).standard_normal(cols).astype(np.float32)
    with activations_mode("auto"):
        assert kernels.takes_int8("t1", cols, 1)
        xg = kernels.rounded_input("t1", x, 1).astype(np.float32)
        assert np.array_equal(kernels.rounded_input("t1", xg, 1).astype(np.float32), xg)
        steps = np.abs(xg.reshape(-1, 128)).max(axis=1) / 21
        assert np.allclose(xg.reshape(-1, 128) / steps[:, None], np.rint(xg.reshape(-1, 128) / steps[:, None]),
                           atol=1e-3)
        y = kernels.linear(xg[None], "t1", raw, shape)[0]
        assert rel(y, ref @ xg.astype(np.float64)) < 1e-5
        y7 = kernels.linear(x[None], "t1", raw, shape)[0]
        assert_int8_close(y7, "t1", raw, shape, x, 1)
    with activations_mode("int16"):
        assert rel(y7, kernels.linear(x[None], "t1", raw, shape)[0]) > 1e-4     # the t1 route ran


@pytest.mark.parametrize("byte", [0xFF, 0xFE, 0xF3, 0x00])
def test_one_t1_token_at_its_largest_bytes_and_inputs(byte):
    """Every code byte the same (0xFF: every trit 2, bytes up to 255 along the 3 y mod 256 chain) times
    inputs all at the top of their grid, of one sign and alternating: a product by 3x or by x whose pair
    sums saturated, or a difference of the two outside 16 bits, would show here."""
    if kernels.isa() != "avx2":
        pytest.skip("an AVX2 route")
    shape, cols = (8, 1408), 1408
    raw = np.array(encode("t1", weight(shape, seed=5)), copy=True)
    g = get_codec("t1").geometry(shape)
    raw[g.off_code:g.nbytes] = byte
    ref = get_codec("t1").decode(raw, shape).astype(np.float64)
    with activations_mode("auto"):
        for x in (np.full(cols, 3.0, np.float32), np.where(np.arange(cols) % 2, -3.0, 3.0).astype(np.float32),
                  np.where(np.arange(cols) % 4 < 2, -3.0, 3.0).astype(np.float32)):
            assert np.array_equal(kernels.rounded_input("t1", x, 1), x)
            assert rel(kernels.linear(x[None], "t1", raw, shape)[0], ref @ x.astype(np.float64)) < 1e-5


@pytest.mark.parametrize("name", kernels.X8_CODECS + ("q8", "q2rtn"))
def test_vnni_equals_the_avx2_sequence_bit_for_bit(name):
    """Every VNNI form the CPU runs (1: AVX-VNNI, 2: AVX512-VNNI on 256-bit registers, 3: and 512-bit
    ones for several tokens) gives the very integers of the vpmaddubsw + vpmaddwd sequences, and so the
    very floats: one token, two, three (one row at a time), 8 and 34 (eight or sixteen rows at a time,
    a whole tile and a ragged one), outliers included, equal to the last bit; rows 40, so that a group
    of rows is cut short. One token with 16-bit inputs too (vpdpwssd in place of vpmaddwd + add), and
    several tokens on AMX tiles where the CPU has them."""
    if kernels.isa() != "avx2" or _qdot.vnni() == 0:
        pytest.skip("no VNNI on this machine")
    shape = (40, 1024)
    raw = encode(name, weight(shape, seed=5))
    xs = np.random.default_rng(5).standard_normal((34, shape[1])).astype(np.float32)
    default = _qdot.vnni()
    levels = []
    for level in (0, 1, 2, 3):
        try:
            _qdot.set_vnni(level)
            levels.append(level)
        except ValueError:
            pass
    _qdot.set_vnni(default)
    assert default in levels and len(levels) >= 2
    with activations_mode("int8"):
        for T in (1, 2, 3, 8, 34):
            if not kernels.takes_int8(name, shape[1], T):
                continue
            got = {}
            try:
                for level in levels:
                    _qdot.set_vnni(level)
                    got[level] = kernels.linear(xs[:T], name, raw, shape)
            finally:
                _qdot.set_vnni(default)
            for level in levels[1:]:
                np.testing.assert_array_equal(got[level], got[0], err_msg=f"level {level}, {T} tokens")
    if 3 in levels and _qdot.amx():          # AMX tiles against 512-bit VNNI: the same sums, the same bits
        try:
            for T in (8, 17, 34):
                if kernels.takes_int8(name, shape[1], T):
                    tiles = kernels.linear(xs[:T], name, raw, shape)
                    _qdot.set_amx(False)
                    np.testing.assert_array_equal(tiles, kernels.linear(xs[:T], name, raw, shape),
                                                  err_msg=f"AMX, {T} tokens")
                    _qdot.set_amx(True)
        finally:
            _qdot.set_amx(True)
    with activations_mode("int16"):
        got = {}
        try:
            for level in levels:
                _qdot.set_vnni(level)
                got[level] = kernels.linear(xs[:1], name, raw, shape)
        finally:
            _qdot.set_vnni(default)
        for level in levels[1:]:
            np.testing.assert_array_equal(got[level], got[0], err_msg=f"level {level}, one token, 16-bit inputs")
    with pytest.raises(ValueError, match="VNNI level 4"):
        _qdot.set_vnni(4)


@pytest.mark.parametrize("T,n,k", [(256, 100, 1024), (37, 33, 64), (1, 17, 32), (16, 16, 7168)])
def test_amx_float_products_match_float64_and_leave_other_columns(T, n, k):
    """amx_matmul (bf16 pairs on AMX tiles, three products a block) equals the float64 product to
    2e-5 of its size, on ragged tokens and rows, into a strided block of a wider output it leaves
    alone past its columns; with AMX off it declines and writes nothing."""
    if not _qdot.amx():
        pytest.skip("no AMX on this machine")
    rng = np.random.default_rng(T + n)
    x = rng.standard_normal((T, k)).astype(np.float32)
    w = (rng.standard_t(3, (n, k)) * 0.02).astype(np.float32)
    out = np.full((T, n + 5), np.nan, np.float32)
    assert _qdot.amx_matmul(x, w, out[:, 2:2 + n], 2)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    assert np.abs(out[:, 2:2 + n] - ref).max() < 2e-5 * np.abs(ref).max()
    assert np.isnan(out[:, :2]).all() and np.isnan(out[:, 2 + n:]).all()
    try:
        _qdot.set_amx(False)
        fresh = np.full((T, n), np.nan, np.float32)
        assert not _qdot.amx_matmul(x, w, fresh, 2) and np.isnan(fresh).all()
    finally:
        _qdot.set_amx(True)
    if T > 1:                            # rows of the output must not overlap
        with pytest.raises(ValueError, match="rows of contiguous floats"):
            _qdot.amx_matmul(x, w, np.lib.stride_tricks.as_strided(out, (T, n), (4, 4)), 2)
    with pytest.raises(ValueError, match="multiple of 32"):
        _qdot.amx_matmul(np.ascontiguousarray(x[:, :k - 16]), np.ascontiguousarray(w[:, :k - 16]), out[:, :n], 2)


def weight(shape, seed):
    rng = np.random.default_rng(seed)
    w = (rng.standard_t(3, size=shape) * 0.02).astype(np.float32)
    w[0] = 0.0                                  # an all-zero row
    if shape[0] > 2:
        w[2, : shape[1] // 2] = 0.37            # constant groups
    return w


def rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def int8_bound(name, raw, shape, x, tokens=1):
    """Per-row bound on |y - W x| from the rounding of x in a product of `tokens` tokens (see the
    module docstring)."""
    c = get_codec(name)
    g = c.geometry(shape)
    ref = c.decode(raw, shape).astype(np.float64)
    digits = np.array(raw, copy=True)
    digits[g.off_oval:g.off_sub] = 0                # no corrections: what every digit decodes to
    dec = c.decode(digits, shape).astype(np.float64)
    off = 0.0
    if not kernels.takes_int8(name, shape[1], tokens):
        digits[g.off_code:g.nbytes] = 0             # every code 0
        off = c.decode(digits, shape).astype(np.float64)
    xq = kernels.rounded_input(name, x, tokens)
    return np.abs(dec - off) @ np.abs(x - xq) + 1e-5 * (np.abs(ref) @ np.abs(x)) + 1e-30


def assert_int8_close(y, name, raw, shape, x, tokens=1):
    ref = get_codec(name).decode(raw, shape).astype(np.float64)
    err = np.abs(y - ref @ x.astype(np.float64))
    bound = int8_bound(name, raw, shape, x, tokens)
    assert (err <= bound).all(), (name, shape, float((err / bound).max()))


@pytest.mark.parametrize("name", NAMES)
def test_has_kernel(name):
    assert kernels.has_kernel(name)


@pytest.mark.parametrize("name,shape", [(n, s) for n in NAMES for s in SHAPES if get_codec(n).supports(s)])
@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
def test_dequantize_bit_exact_and_linear_matches(name, shape, parallel, isa, activations, monkeypatch):
    # weights of PARALLEL_MIN_WEIGHTS or more run on every thread: lower it to test that, with more
    # threads than this machine may have cores
    monkeypatch.setattr(kernels, "PARALLEL_MIN_WEIGHTS", 0 if parallel else 1 << 40)
    monkeypatch.setattr(kernels, "_threads", 3)
    c = get_codec(name)
    w = weight(shape, seed=shape[1])
    raw = encode(c, w)
    ref = c.decode(raw, shape)
    got = kernels.dequantize(name, raw, shape)
    assert got.dtype == np.float32 and got.shape == shape
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
    rng = np.random.default_rng(1)
    for T in (1, 3, 7):                                 # integer mat-vecs, one or several tokens
        x = rng.standard_normal((T, shape[1])).astype(np.float32)
        y = kernels.linear(x, name, raw, shape)
        assert y.shape == (T, shape[0]) and y.dtype == np.float32
        for t in range(T):
            assert_int8_close(y[t], name, raw, shape, x[t], T)
        assert rel(y, x @ ref.T) < 0.05                 # and the bound is not vacuous
    x = rng.standard_normal((kernels.BLAS_MIN_TOKENS, shape[1])).astype(np.float32)
    y = kernels.linear(x, name, raw, shape)
    if kernels.takes_int8(name, shape[1], x.shape[0]):  # the int8 kernel holds out longer than BLAS_MIN_TOKENS
        for t in range(x.shape[0]):
            assert_int8_close(y[t], name, raw, shape, x[t], x.shape[0])
    else:                                               # row blocks + BLAS
        assert rel(y, x @ ref.T) < 1e-5
    x1 = rng.standard_normal(shape[1]).astype(np.float32)
    assert kernels.linear(x1, name, raw.tobytes(), shape).shape == (shape[0],)
    assert_int8_close(kernels.linear(x1, name, raw, shape), name, raw, shape, x1)


@pytest.mark.parametrize("name", NAMES)
def test_dequantize_rows_equals_the_reference_rows(name, isa):
    """An embedding lookup: rows in any order, repeated, with outliers, bit for bit as the reference
    decoder's decode_rows; a row outside the weight is refused."""
    shape = (7, 2048)
    w = weight(shape, seed=11)
    w[3, 100] = 300.0
    c = get_codec(name)
    raw = encode(c, w)
    ids = [6, 3, 0, 3]
    got = kernels.dequantize_rows(name, raw, shape, ids)
    np.testing.assert_array_equal(got.view(np.uint32), np.asarray(c.decode_rows(raw, shape, ids), np.float32).view(np.uint32))
    assert kernels.dequantize_rows(name, raw, shape, []).shape == (0, shape[1])
    with pytest.raises(CodecError, match="row 7 outside"):
        kernels.dequantize_rows(name, raw, shape, [1, 7])


@pytest.mark.parametrize("name", ["q2", "t1", "q1"])
def test_outlier_rows(name, isa, activations):
    shape = (6, 2048)
    w = weight(shape, seed=9)
    w[3, 100] = 300.0
    w[4, 2047] = -700.0
    c = get_codec(name)
    assert c.geometry(shape).k > 0
    raw = encode(c, w)
    ref = c.decode(raw, shape)
    np.testing.assert_array_equal(kernels.dequantize(name, raw, shape), ref)
    # an outlier decodes to its digit's value plus its stored binary16 correction: its value up to
    # half a binary16 step of the correction
    assert abs(ref[3, 100] - 300.0) <= np.spacing(np.float16(300.0)) / 2
    assert abs(ref[4, 2047] + 700.0) <= np.spacing(np.float16(700.0)) / 2
    x = np.random.default_rng(2).standard_normal(shape[1]).astype(np.float32)
    x[100] = 40.0                    # the outliers' inputs dominate: their products must be exact
    y = kernels.linear(x, name, raw, shape)
    assert_int8_close(y, name, raw, shape, x)
    assert abs(y[3] - ref[3] @ x) < 1e-3 * abs(ref[3, 100] * x[100])


@pytest.mark.parametrize("name", ["q2", "t1", "q1"])
@pytest.mark.parametrize("at", [3, 9, -1])
def test_kernels_refuse_corrupt_outlier_columns_themselves(name, at, isa, activations):
    """Bytes that reach the C kernel unchecked (an expert read from disk): a column that does not
    increase, in the first eight outliers, the next eight or the last few, is refused whatever the
    route (one token or several); the same bytes intact pass."""
    shape = (3, 7168)
    c = get_codec(name)
    raw = encode(c, weight(shape, seed=5)).copy()
    g = c.geometry(shape)
    at = at % g.k
    assert g.k >= 11 and at > 0
    _, geom, _ = kernels._prepare(name, raw, shape)
    jobs = kernels._linear_jobs(*shape)
    for T in (1, 3):
        x = np.random.default_rng(T).standard_normal((T, shape[1])).astype(np.float32)
        kernels._run(raw, geom[None, :], x, jobs, np.empty(T * shape[0], np.float32), 0, name, T, shape[0])
    ocol = raw[g.off_ocol:g.off_oval].view("<u2").reshape(g.rows, g.k)
    ocol[1, at] = ocol[1, at - 1]
    for T in (1, 3):
        x = np.random.default_rng(T).standard_normal((T, shape[1])).astype(np.float32)
        with pytest.raises(CodecError, match="outlier"):
            kernels._run(raw, geom[None, :], x, jobs, np.empty(T * shape[0], np.float32), 0, name, T, shape[0])


@pytest.mark.parametrize("name", ["q2", "t1", "q1"])
def test_kernels_refuse_corrupt_outlier_columns_of_rows_with_few(name, isa, activations):
    """Rows of eight outliers or fewer (summed one by one, not gathered): a column that does not
    increase, or one past the row, is refused on every route; intact, the product is the reference's."""
    shape = (3, 2048)
    c = get_codec(name)
    g = c.geometry(shape)
    assert 2 <= g.k <= 8
    for at, col in ((1, None), (g.k - 1, shape[1])):
        raw = encode(c, weight(shape, seed=6)).copy()
        _, geom, _ = kernels._prepare(name, raw, shape)
        jobs = kernels._linear_jobs(*shape)
        x1 = np.random.default_rng(0).standard_normal((1, shape[1])).astype(np.float32)
        assert_int8_close(kernels.linear(x1[0], name, raw, shape), name, raw, shape, x1[0])
        ocol = raw[g.off_ocol:g.off_oval].view("<u2").reshape(g.rows, g.k)
        ocol[2, at] = ocol[2, at - 1] if col is None else col
        for T in (1, 3):
            x = np.random.default_rng(T).standard_normal((T, shape[1])).astype(np.float32)
            with pytest.raises(CodecError, match="outlier"):
                kernels._run(raw, geom[None, :], x, jobs, np.empty(T * shape[0], np.float32), 0, name, T, shape[0])


@pytest.mark.parametrize("name", ["f32", "f16", "bf16"])
def test_float_codecs_fall_back_to_numpy(name):
    assert not kernels.has_kernel(name)
    w = weight((5, 40), seed=3)
    c = get_codec(name)
    raw = encode(c, w)
    x = np.random.default_rng(3).standard_normal((2, 40)).astype(np.float32)
    np.testing.assert_allclose(kernels.linear(x, name, raw, (5, 40)), x @ c.decode(raw, (5, 40)).T, rtol=1e-6)


def test_bad_input_is_refused():
    c = get_codec("q2")
    shape = (4, 1024)
    raw = encode(c, weight(shape, 4)).copy()
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


def heads_t_bound(name, raw, shape, v, stride):
    """Bound on |heads_t - v W| per head and column. Whole 32-column spans take 16-bit integer
    coefficients (all but t1, whose spans keep float ones): each row's coefficient of a span rounds to
    a multiple of alpha = (largest of the span's n rows) / A, A = min(32767, (2^31 - 1) / (n' 512)) with
    n' = n rounded up to even, so a column's error is at most n alpha / 2 times a digit; bounded by
    n / (2A) * max_j |v_j| F_j, F_j the span's full-scale level (every digit at its largest, less the
    level of digit 0) and 1.01 for q8's -128. Plus float summation, 1e-5 |v| |W|."""
    c = get_codec(name)
    g = c.geometry(shape)
    nh, n = v.shape
    digits = np.array(raw, copy=True)
    digits[g.off_oval:g.off_sub] = 0                 # outliers are exact corrections: digits alone
    top, zero = digits.copy(), digits.copy()
    top[g.off_code:g.nbytes] = 0x7F if name == "q8" else 0xFF
    zero[g.off_code:g.nbytes] = 0
    full = np.abs(c.decode(top, shape).astype(np.float64) - c.decode(zero, shape).astype(np.float64))
    ref = c.decode(raw, shape).astype(np.float64)
    A = min(32767, (2 ** 31 - 1) // ((n + n % 2) * 512))
    out = np.zeros((nh, shape[1]))
    whole = shape[1] // 32 * 32 if name != "t1" else 0
    for h in range(nh):
        rows = slice(h * stride, h * stride + n)
        out[h] = 1e-5 * (np.abs(v[h]).astype(np.float64) @ np.abs(ref[rows])) + 1e-30
        span_full = full[rows, :whole].reshape(n, -1, 32).max(axis=2)          # [n, spans]
        scale = (np.abs(v[h])[:, None] * span_full).max(axis=0) * n / (2 * A) * 1.01
        out[h, :whole] += np.repeat(scale, 32)
    return out


@pytest.mark.parametrize("name", ["q2", "q4", "q6", "q8", "q1"])
def test_heads_t_equals_across_vnni_levels(name):
    """heads_t's integer sums with vpdpwssd (each VNNI form the CPU runs) are vpmaddwd + add's: the same
    floats to the last bit, outliers and a second span group included."""
    if kernels.isa() != "avx2" or _qdot.vnni() == 0:
        pytest.skip("no VNNI on this machine")
    nh, nope, vdim, cols = 4, 24, 8, 640
    shape = (nh * (nope + vdim), cols)
    w = weight(shape, seed=13)
    w[3, 70] = 7.0
    raw = encode(name, w)
    v = np.random.default_rng(13).standard_normal((nh, nope)).astype(np.float32)
    default, got = _qdot.vnni(), {}
    try:
        for level in (0, 1, 2, 3):
            try:
                _qdot.set_vnni(level)
            except ValueError:
                continue
            got[level] = kernels.heads_t(name, raw, shape, v, nope + vdim)
    finally:
        _qdot.set_vnni(default)
    assert len(got) >= 2
    for level, y in got.items():
        np.testing.assert_array_equal(y, got[0], err_msg=f"VNNI level {level}")


@pytest.mark.parametrize("name", NAMES)
def test_heads_of_kv_b(name, isa, monkeypatch):
    """heads_t (per head, v times a block of rows, transposed) and heads (per head, a block of rows
    times x) against the reference weight in float64, on a weight with outliers and, for t1, a tail."""
    monkeypatch.setattr(kernels, "PARALLEL_MIN_WEIGHTS", 0)
    monkeypatch.setattr(kernels, "_threads", 3)
    nh, nope, vdim, cols = 3, 16, 8, 512 if name != "t1" else 544
    shape = (nh * (nope + vdim), cols)
    c = get_codec(name)
    w = weight(shape, seed=11)
    w[5, 7] = 9.0
    raw = encode(c, w)
    ref = c.decode(raw, shape).astype(np.float64)
    rng = np.random.default_rng(4)
    v = rng.standard_normal((nh, nope)).astype(np.float32)
    got = kernels.heads_t(name, raw, shape, v, nope + vdim)
    want = np.stack([v[h] @ ref[h * (nope + vdim):h * (nope + vdim) + nope] for h in range(nh)])
    assert got.shape == (nh, cols)
    bound = heads_t_bound(name, raw, shape, v, nope + vdim)
    assert (np.abs(got - want) <= bound).all(), float((np.abs(got - want) / bound).max())
    assert rel(got, want) < (1e-4 if name != "t1" else 1e-5)
    x = rng.standard_normal((nh, cols)).astype(np.float32)
    got = kernels.heads(name, raw, shape, x, nope + vdim, nope, vdim)
    rows = [slice(h * (nope + vdim) + nope, (h + 1) * (nope + vdim)) for h in range(nh)]
    want = np.stack([ref[rows[h]] @ x[h] for h in range(nh)])
    bound = np.stack([int8_bound(name, raw, shape, x[h])[rows[h]] for h in range(nh)])
    assert (np.abs(got - want) <= bound).all()
    assert rel(got, want) < (0.05 if kernels.takes_int8(name) else 1e-4)


@pytest.mark.parametrize("name,dtype,interleave", [("q4", np.float32, False), ("q2", np.float16, True),
                                                    ("t1", np.float16, False), ("q8", np.float32, True)])
@pytest.mark.parametrize("threads", [1, 2])
def test_latent_attention_equals_its_steps(name, dtype, interleave, threads, isa, activations, monkeypatch):
    """One decode step's attention in one call (kernels.LatentAttention) gives the bits of its steps
    run one by one (rms_norm, rope, the cache rows written, heads_t, attend, heads), and writes the
    same cache rows."""
    monkeypatch.setattr(kernels, "PARALLEL_MIN_WEIGHTS", 0 if threads > 1 else 1 << 62)
    monkeypatch.setattr(kernels, "_threads", threads)
    nh, nope, vdim, r, dr, context, pos = 4, 16, 24, 512 if name != "t1" else 544, 8, 40, 29
    shape = (nh * (nope + vdim), r)
    w = weight(shape, seed=12)
    w[3, 9] = 7.0
    raw = encode(get_codec(name), w)
    rng = np.random.default_rng(5)
    q = rng.standard_normal((nh, nope + dr)).astype(np.float32)
    ckv = rng.standard_normal(r + dr).astype(np.float32)
    kv_ln = rng.uniform(0.5, 1.5, r).astype(np.float32)
    ang = rng.uniform(0, 6, dr // 2)
    cos, sin = np.cos(ang).astype(np.float32)[None], np.sin(ang).astype(np.float32)[None]
    caches = [(rng.standard_normal((context, r)).astype(dtype), rng.standard_normal((context, dr)).astype(dtype))]
    caches.append((caches[0][0].copy(), caches[0][1].copy()))

    latent, k_rot = caches[0]
    latent[pos] = kernels.rms_norm(ckv[None, :r], kv_ln, 1e-6)[0]
    k_rot[pos] = kernels.rope(ckv[None, None, r:], cos, sin, interleave)[0, 0]
    q_rot = kernels.rope(q[None, :, nope:], cos, sin, interleave)[0]
    q_lat = kernels.heads_t(name, raw, shape, q[:, :nope], nope + vdim)
    o_lat = kernels.attend(q_lat, q_rot, latent, k_rot, pos + 1, 0.3)
    want = kernels.heads(name, raw, shape, o_lat, nope + vdim, nope, vdim)

    mla = kernels.LatentAttention(name, raw, shape, nope, vdim)
    got = mla(q, ckv, kv_ln, 1e-6, cos, sin, interleave, *caches[1], pos, 0.3)
    assert got.shape == (nh, vdim)
    np.testing.assert_array_equal(got, want)
    for a, b in zip(caches[0], caches[1]):
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory):
    """A small synthetic DeepseekV3 file with q LoRA at the q2 preset (attention on q4, the block kernels)."""
    import json
    from kimistream.convert.synthetic import write_synthetic
    from kimistream.formats.presets import PrecisionPlan
    d = tmp_path_factory.mktemp("lora")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 512,
        "hidden_size": 256, "intermediate_size": 256, "moe_intermediate_size": 256, "num_hidden_layers": 3,
        "num_attention_heads": 4, "kv_lora_rank": 64, "q_lora_rank": 96, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "qk_nope_head_dim": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "max_position_embeddings": 256}))
    return write_synthetic(d / "config.json", d / "m.kst", PrecisionPlan.from_preset("q2"), seed=3)


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_attention_step_equals_the_modules(lora_model, kv_dtype, threads, isa, activations, monkeypatch):
    """A decode token's attention half in one call (kernels.AttentionStep, Layer.step), the next half's
    routing included, gives the bits of the modules' calls one by one: the logits of a prompt and six
    decode steps, and every cache row."""
    from kimistream.runtime.model import Model
    from kimistream.runtime.weights import ModelWeights
    monkeypatch.setattr(kernels, "PARALLEL_MIN_WEIGHTS", 0 if threads > 1 else 1 << 62)
    monkeypatch.setattr(kernels, "_threads", threads)
    w = ModelWeights(lora_model)
    w.load_resident()
    runs = []
    for fused in (True, False):
        m = Model(w, 32, kv_dtype)
        assert all(layer.step is not None for layer in m.layers)
        assert all(layer.step.router is not None for layer in m.layers[1:])       # the MoE layers route there
        if not fused:
            for layer in m.layers:
                layer.step = None
        logits = [m.prefill(list(range(5, 12)), 7)] + [m.forward([t]) for t in (3, 9, 1, 4, 4, 8)]
        runs.append((np.stack(logits), [c.copy() for c in m.cache.latent + m.cache.k_rot]))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    for a, b in zip(runs[0][1], runs[1][1]):
        np.testing.assert_array_equal(a, b)
    w.close()


def test_attention_step_refuses_mismatched_buffers(lora_model):
    from kimistream.runtime.model import Model
    from kimistream.runtime.weights import ModelWeights
    w = ModelWeights(lora_model)
    w.load_resident()
    m = Model(w, 8)
    step, x = m.layers[1].step, np.zeros((1, m.cfg.hidden_size), np.float32)
    latent, k_rot = m.cache.latent[1][0], m.cache.k_rot[1][0]
    cos, sin = m.rope.tables(0, 1, 1)
    with pytest.raises(ValueError, match="attn_step"):              # x of another width
        step(np.zeros((1, 7), np.float32), 0, latent, k_rot, cos, sin)
    with pytest.raises(ValueError, match="attn_step"):              # the row to write lies past the cache
        step(x, 8, latent, k_rot, cos, sin)
    with pytest.raises(ValueError):                                 # the caches' dtypes differ
        step(x, 0, latent, k_rot.astype(np.float16), cos, sin)
    x_out, h, (idx, wts), launched = step(x, 0, latent, k_rot, cos, sin)
    assert not launched                                              # no launch asked for
    assert x_out.shape == h.shape == x.shape and np.isfinite(h).all()
    np.testing.assert_array_equal(idx, m.layers[1].mlp.route(h)[0])         # routed as MoE.route routes
    np.testing.assert_array_equal(wts, m.layers[1].mlp.route(h)[1])
    w.close()


def test_matvec_is_the_float_product():
    rng = np.random.default_rng(9)
    W, x = rng.standard_normal((40, 96)).astype(np.float32), rng.standard_normal((3, 96)).astype(np.float32)
    assert rel(kernels.matvec(x, W), x.astype(np.float64) @ W.T.astype(np.float64)) < 1e-6
    with pytest.raises(ValueError, match="matvec"):
        _qdot.matvec(W, x, np.empty((3, 39), np.float32), 96)


def test_matvec_gives_the_same_bits_on_any_number_of_threads():
    """A router's product shared out by rows (E not a multiple of a job's rows) is each row's sum as one
    thread forms it: the same bits on 1, 2 and 3 threads."""
    rng = np.random.default_rng(10)
    W, x = rng.standard_normal((101, 1000)).astype(np.float32), rng.standard_normal((2, 1000)).astype(np.float32)
    outs = []
    for threads in (1, 2, 3):
        out = np.full((2, 101), np.nan, np.float32)
        _qdot.matvec(W, x, out, 1000, threads)
        outs.append(out)
    assert rel(outs[0], x.astype(np.float64) @ W.T.astype(np.float64)) < 1e-6
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


def test_latent_attention_rounds_cache_rows_as_numpy():
    """Rows written to a binary16 cache are numpy's conversion of the float32 values: ties to even,
    subnormals, the largest finite value, overflow to infinity, signed zeros, infinities, NaNs."""
    nope, vdim, r, dr = 16, 8, 32, 64
    raw = encode(get_codec("q8"), weight((nope + vdim, r), seed=3))
    mla = kernels.LatentAttention("q8", raw, (nope + vdim, r), nope, vdim)
    special = np.array([0.0, -0.0, 1.0, 65504, 65519.99, 65520, -1e6, 6.1e-5, 6.0e-5, 2.98e-8, 2.99e-8, 5.96e-8,
                        1e-10, 1.00048828125, 1.000732421875, 1.0009765625 + 2 ** -12, -3.14159, 2 ** -24 * 1.5,
                        2 ** -24 * 2.5, 1e-40, 7.0e4, 0.1, np.inf, -np.inf], np.float32)
    k = np.random.default_rng(2).standard_normal(dr).astype(np.float32) * np.float32(1e-5)
    k[:special.size] = special
    nans = np.array([0x7fc00000, 0xffc00001, 0x7f800001, 0x7fbfe000], np.uint32).view(np.float32)
    k[special.size:special.size + nans.size] = nans            # quiet, payloads, signalling
    ckv = np.concatenate([np.ones(r, np.float32), k])
    cos, sin = np.ones((1, dr // 2), np.float32), np.zeros((1, dr // 2), np.float32)  # keys pass unrotated
    latent, k_rot = np.zeros((4, r), np.float16), np.zeros((4, dr), np.float16)
    mla(np.zeros((1, nope + dr), np.float32), ckv, np.ones(r, np.float32), 1e-6, cos, sin, False, latent, k_rot, 2, 1.0)
    with np.errstate(over="ignore"):
        want = kernels.rope(k[None, None], cos, sin, False)[0, 0].astype(np.float16)
    np.testing.assert_array_equal(k_rot[2].view(np.uint16), want.view(np.uint16))


def test_latent_attention_refuses_mismatched_buffers():
    nope, vdim, r, dr = 16, 8, 32, 8
    raw = encode(get_codec("q8"), weight((2 * (nope + vdim), r), seed=3))
    mla = kernels.LatentAttention("q8", raw, (2 * (nope + vdim), r), nope, vdim)
    q, ckv, ln = np.zeros((2, nope + dr), np.float32), np.zeros(r + dr, np.float32), np.ones(r, np.float32)
    cs = np.ones((1, dr // 2), np.float32)
    with pytest.raises(ValueError):                 # the row to write lies past the cache
        mla(q, ckv, ln, 1e-6, cs, cs, False, np.zeros((3, r), np.float32), np.zeros((3, dr), np.float32), 3, 1.0)
    with pytest.raises(ValueError):                 # the caches' dtypes differ
        mla(q, ckv, ln, 1e-6, cs, cs, False, np.zeros((4, r), np.float32), np.zeros((4, dr), np.float16), 1, 1.0)
    with pytest.raises(ValueError):                 # more heads than kv_b holds
        mla(np.zeros((3, nope + dr), np.float32), ckv, ln, 1e-6, cs, cs, False, np.zeros((4, r), np.float32),
            np.zeros((4, dr), np.float32), 1, 1.0)


def test_c_kernel_refuses_jobs_outside_its_buffers():
    c = get_codec("q2")
    shape = (4, 256)
    raw = encode(c, weight(shape, 4))
    g = kernels._geometry_vector(c, shape)[None, :]
    x = np.ones((1, 256), np.float32)
    out = np.empty(4, np.float32)
    ok = np.array([[0, 0, 0, 4, 0, 0]], np.int64)
    assert _qdot.rows(raw, g, x, ok, out, 1) == 0
    for bad in ([1, 0, 0, 4, 0, 0], [0, 1, 0, 4, 0, 0], [0, 0, 0, 5, 0, 0], [0, 0, 0, 4, 1, 0],
                [0, 0, 0, 4, 0, 1], [0, 0, 3, 2, 0, 0], [-1, 0, 0, 4, 0, 0]):
        with pytest.raises(ValueError, match="job|geometry"):
            _qdot.rows(raw, g, x, np.array([bad], np.int64), out, 1)
    with pytest.raises(ValueError):
        _qdot.rows(raw, g, np.ones((1, 128), np.float32), ok, out, 1)


def test_kernel_refuses_a_layout_it_was_not_built_for():
    """The C kernels' per-codec paths check each geometry against the layout they were written for:
    a codec redefined in formats/quants.py without them fails loudly instead of decoding wrongly."""
    c = get_codec("q2")
    shape = (4, 256)
    raw = encode(c, weight(shape, 4))
    g = kernels._geometry_vector(c, shape).copy()
    x = np.ones((1, 256), np.float32)
    out = np.empty(4, np.float32)
    jobs = np.array([[0, 0, 0, 4, 0, 0]], np.int64)
    assert _qdot.rows(raw, g[None, :], x, jobs, out, 1) == 0
    for field, value in ((kernels.G_PB0, 2), (kernels.G_P, 128), (kernels.G_BITS0, 4)):
        bad = g.copy()
        bad[field] = value
        with pytest.raises(ValueError, match="known codec"):
            _qdot.rows(raw, bad[None, :], x, jobs, out, 1)


def test_empty():
    c = get_codec("t1")
    raw = encode(c, np.zeros((0, 256), np.float32))
    assert kernels.linear(np.ones((3, 256), np.float32), "t1", raw, (0, 256)).shape == (3, 0)
    assert kernels.dequantize("t1", raw, (0, 256)).shape == (0, 256)


def _expert_buffer(rng, n, gu, dn, hidden, inter):
    """n random experts (gate and up in codec gu, down in dn) in one buffer, at offsets with odd gaps
    between them (the kernels need no alignment): (buffer, offsets [n, 3], the tensors' bytes)."""
    blobs, offs, parts, pos = [], [], [], 0
    for e in range(n):
        row = []
        for codec, shape in ((gu, (inter, hidden)), (gu, (inter, hidden)), (dn, (hidden, inter))):
            raw = encode(codec, (rng.standard_normal(shape) * 0.05).astype(np.float32))
            pad = (-pos) % 64 + 7
            blobs.append(np.zeros(pad, np.uint8))
            pos += pad
            row.append(pos)
            blobs.append(raw)
            pos += raw.size
            parts.append(raw)
        offs.append(row)
    return np.concatenate(blobs), np.array(offs, np.int64), parts


@pytest.mark.parametrize("gu,dn", [("q2", "q2"), ("t1", "q4"), ("q1", "q6"), ("q8", "q2rtn"), ("q4", "t1")])
def test_fused_experts_equal_linear_calls(gu, dn, isa, activations):
    """kernels.moe_decode (all routed experts of a token in one call) against the same experts run
    through linear() one at a time: the same integer arithmetic, so float32 rounding apart (t1 down
    projections: each expert's activations rounded for one t1 token, side by side in one buffer)."""
    hidden, inter, n = 256, 192 if dn not in ("q2rtn", "t1") else 256, 3
    rng = np.random.default_rng(5)
    base, offs, parts = _expert_buffer(rng, n, gu, dn, hidden, inter)
    x = rng.standard_normal(hidden).astype(np.float32)
    w = np.array([0.5, 1.25, -0.75], np.float32)
    out = np.full(hidden, 0.5, np.float32)
    kernels.moe_decode(base, offs, (gu, (inter, hidden)), (dn, (hidden, inter)), x, w, out)
    want = np.full(hidden, 0.5, np.float64)
    for e in range(n):
        g = kernels.linear(x, gu, parts[3 * e], (inter, hidden))
        u = kernels.linear(x, gu, parts[3 * e + 1], (inter, hidden))
        a = (g / (1 + np.exp(-g)) * u).astype(np.float32)
        want += w[e] * kernels.linear(a, dn, parts[3 * e + 2], (hidden, inter))
    np.testing.assert_allclose(out, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
    with pytest.raises(CodecError, match="outside"):
        kernels.moe_decode(base[:-1], offs, (gu, (inter, hidden)), (dn, (hidden, inter)), x, w, out)



def test_fused_experts_for_several_tokens(isa, activations):
    """moe_decode with T tokens, each with its own k experts (shared between tokens, repeated, in any
    order): every token's output is what its experts give through linear() one at a time."""
    hidden, inter, n_experts, T, k = 256, 192, 4, 5, 3
    rng = np.random.default_rng(8)
    base, where, mats = _expert_buffer(rng, n_experts, "q2", "q2", hidden, inter)
    choice = np.array([[0, 1, 2], [3, 2, 1], [1, 1, 0], [2, 3, 0], [0, 3, 1]])
    offs = where[choice]                                                       # [T, k, 3]
    x = rng.standard_normal((T, hidden)).astype(np.float32)
    w = rng.standard_normal((T, k)).astype(np.float32)
    out = np.full((T, hidden), 0.25, np.float32)
    kernels.moe_decode(base, offs, ("q2", (inter, hidden)), ("q2", (hidden, inter)), x, w, out)
    for t in range(T):
        want = np.full(hidden, 0.25, np.float64)
        for j, e in enumerate(choice[t]):
            g = kernels.linear(x[t], "q2", mats[3 * e], (inter, hidden))
            u = kernels.linear(x[t], "q2", mats[3 * e + 1], (inter, hidden))
            a = (g / (1 + np.exp(-g)) * u).astype(np.float32)
            want += w[t, j] * kernels.linear(a, "q2", mats[3 * e + 2], (hidden, inter))
        np.testing.assert_allclose(out[t], want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
    with pytest.raises(ValueError, match="offsets"):
        kernels.moe_decode(base, offs[:4], ("q2", (inter, hidden)), ("q2", (hidden, inter)), x, w, out)

def test_fused_experts_with_a_shared_expert(isa):
    """moe_decode's `shared` expert (another codec, same shapes) goes through every token with weight 1
    in the same call: the output is the routed experts' plus the shared expert's, as linear() gives."""
    hidden, inter, T, k = 256, 192, 3, 2
    rng = np.random.default_rng(9)
    base_r, where, mats = _expert_buffer(rng, 3, "q2", "q2", hidden, inter)
    base_s, where_s, mats_s = _expert_buffer(rng, 1, "q4", "q6", hidden, inter)
    base = np.concatenate([base_r, base_s])
    choice = np.array([[0, 2], [1, 1], [2, 0]])
    x = rng.standard_normal((T, hidden)).astype(np.float32)
    w = rng.standard_normal((T, k)).astype(np.float32)
    out = np.zeros((T, hidden), np.float32)
    shared = (where_s[0] + base_r.size, ("q4", (inter, hidden)), ("q6", (hidden, inter)))
    kernels.moe_decode(base, where[choice], ("q2", (inter, hidden)), ("q2", (hidden, inter)), x, w, out, shared)

    def expert(xt, codecs, m):
        g = kernels.linear(xt, codecs[0], m[0], (inter, hidden))
        u = kernels.linear(xt, codecs[0], m[1], (inter, hidden))
        return kernels.linear((g / (1 + np.exp(-g)) * u).astype(np.float32), codecs[1], m[2], (hidden, inter))
    for t in range(T):
        want = expert(x[t], ("q4", "q6"), mats_s).astype(np.float64)
        for j, e in enumerate(choice[t]):
            want += w[t, j] * expert(x[t], ("q2", "q2"), mats[3 * e:3 * e + 3])
        np.testing.assert_allclose(out[t], want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
    with pytest.raises(ValueError, match="chain"):
        kernels.moe_decode(base, where[choice], ("q2", (inter, hidden)), ("q2", (hidden, inter)), x, w, out,
                           (shared[0], ("q4", (inter + 32, hidden)), ("q6", (hidden, inter + 32))))


def test_a_launched_moe_call_equals_the_call_made_at_once(isa):
    """_qdot.moe_launch hands the call to the thread pool and returns; moe_join collects it: the bits of
    moe() itself, whether the caller joins at once, after another use of the pool (which waits for the
    launched call first), or launches again without joining (the first call is dropped)."""
    hidden, inter, k = 256, 192, 3
    rng = np.random.default_rng(21)
    base, where, _ = _expert_buffer(rng, 4, "q2", "q4", hidden, inter)
    geoms = kernels._moe_geometries((("q2", (inter, hidden)), ("q4", (hidden, inter))))
    pick, tok = kernels._moe_pairs(1, k, False)
    offs, wts = where[[2, 0, 3]], np.array([0.5, -1.25, 2.0], np.float32)
    x = rng.standard_normal((1, hidden)).astype(np.float32)
    want = np.zeros((1, hidden), np.float32)
    _qdot.moe(base, geoms, offs, pick, tok, wts, x, want, 2)
    assert np.abs(want).max() > 0

    def joined(launch_more=False, use_pool=False):
        _qdot.moe_launch(base, geoms, offs, pick, tok, wts, x, 2)
        if launch_more:
            _qdot.moe_launch(base, geoms, offs, pick, tok, wts, x * 0, 2)
        if use_pool:
            kernels.linear(x, "q2", base[where[1, 0]:], (inter, hidden))
        out = np.zeros((1, hidden), np.float32)
        assert _qdot.moe_join(out) == 0
        return out
    np.testing.assert_array_equal(joined(), want)
    np.testing.assert_array_equal(joined(use_pool=True), want)
    np.testing.assert_array_equal(joined(launch_more=True), np.zeros_like(want))     # the second call's x is 0
    with pytest.raises(ValueError, match="no call launched"):
        _qdot.moe_join(np.zeros((1, hidden), np.float32))
    with pytest.raises(ValueError, match="two threads"):
        _qdot.moe_launch(base, geoms, offs, pick, tok, wts, x, 1)
    with pytest.raises(ValueError, match="outside"):
        _qdot.moe_launch(base[:-1], geoms, where[[3, 3, 3]], pick, tok, wts, x, 2)


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
def test_decode_overlapping_the_moe_call_gives_the_same_bits(lora_model, kv_dtype, monkeypatch):
    """A warm decode step hands each MoE half's call to the thread pool from the attention half's call
    (its experts' offsets known from earlier steps, the mapping never evicting) and the next layer's
    attention call collects it, the interpreter's bookkeeping in between: the logits and cache rows of
    a prompt and eight decode steps are those of steps that never launch."""
    from kimistream.runtime.model import Model, MoE
    from kimistream.runtime.weights import ModelWeights
    monkeypatch.setattr(kernels, "PARALLEL_MIN_WEIGHTS", 0)
    monkeypatch.setattr(kernels, "_threads", 2)
    launches = []
    call = kernels.AttentionStep.__call__

    def counted(self, *a):
        got = call(self, *a)
        launches.append(got[3])
        return got
    monkeypatch.setattr(kernels.AttentionStep, "__call__", counted)
    w = ModelWeights(lora_model)
    w.load_resident()
    assert w.offsets_stay
    runs = []
    for overlap in (True, False):
        w.offsets_stay = overlap
        m = Model(w, 32, kv_dtype)
        launches.clear()
        logits = [m.prefill(list(range(5, 12)), 7)] + [m.forward([t]) for t in (3, 9, 1, 4, 4, 8, 2, 6)]
        runs.append((np.stack(logits), [c.copy() for c in m.cache.latent + m.cache.k_rot], sum(launches)))
        assert all((layer.mlp.launch_spec is not None) == overlap for layer in m.layers if type(layer.mlp) is MoE)
    assert runs[0][2] > 0 and runs[1][2] == 0
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    for a, b in zip(runs[0][1], runs[1][1]):
        np.testing.assert_array_equal(a, b)
    w.close()


# ----------------------------------------------------------------------------------- decode attention

def _attention_f64(q, q_rot, latent, k_rot, length, scale):
    c, k = latent[:length].astype(np.float64), k_rot[:length].astype(np.float64)
    s = (q.astype(np.float64) @ c.T + q_rot.astype(np.float64) @ k.T) * scale
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ c


@pytest.mark.parametrize("nh,r,dr,length,context,dtype", [
    (16, 512, 64, 300, 320, np.float32),      # the usual MLA shape: whole blocks of 16 columns and 4 heads
    (5, 40, 8, 1, 3, np.float32),             # one position; heads and columns past the blocks
    (7, 48, 12, 33, 40, np.float16),          # binary16 caches, an odd length
    (3, 13, 3, 70, 70, np.float16),           # the whole context, columns not a multiple of 8
    (4, 64, 16, 600, 700, np.float32),        # several mix blocks
    (8, 64, 16, 300, 310, np.float16),        # binary16 rows through the 4-head tiles, a softmax tail
    (4, 32, 8, 90, 90, "peaked"),             # scores far apart: most e^(s - max) underflow to 0
])
def test_attend_matches_float64(isa, nh, r, dr, length, context, dtype):
    rng = np.random.default_rng(nh * 1000 + length)
    q, q_rot = rng.standard_normal((nh, r)).astype(np.float32), rng.standard_normal((nh, dr)).astype(np.float32)
    if dtype == "peaked":
        q, dtype = q * 400, np.float32
    latent = rng.standard_normal((context, r)).astype(dtype)
    k_rot = rng.standard_normal((context, dr)).astype(dtype)
    latent[length:] = 1e4                   # rows past `length` must not be read into the result
    want = _attention_f64(q, q_rot, latent, k_rot, length, 0.07)
    before = kernels._threads
    try:
        for threads in (1, 2):
            kernels.set_threads(threads)
            got = kernels.attend(q, q_rot, latent, k_rot, length, 0.07)
            assert got.shape == (nh, r)
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
    finally:
        kernels.set_threads(before)


@pytest.mark.parametrize("length", [1, 3, 29, 257, 1000, 3000])
def test_attend_gives_the_same_bits_on_any_number_of_threads(length, monkeypatch):
    """The positions' partial sums are split by the cache's length alone, so a decode step's attention
    is bit for bit the same on 1, 2, 3 or 16 threads (the thread tuner changes the count during a
    run; the split had followed it, and the result moved by about 1e-6)."""
    monkeypatch.setattr(kernels, "PARALLEL_MIN_WEIGHTS", 0)
    rng = np.random.default_rng(length)
    nh, r, dr = 16, 64, 16
    q, q_rot = rng.standard_normal((nh, r)).astype(np.float32), rng.standard_normal((nh, dr)).astype(np.float32)
    latent = rng.standard_normal((length, r)).astype(np.float16)
    k_rot = rng.standard_normal((length, dr)).astype(np.float16)
    before = kernels._threads
    try:
        outs = []
        for threads in (1, 2, 3, 16):
            kernels.set_threads(threads)
            outs.append(kernels.attend(q, q_rot, latent, k_rot, length, 0.07))
    finally:
        kernels.set_threads(before)
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


@pytest.mark.parametrize("R,T,S,start", [(16, 64, 64, 0), (3, 5, 9, 4), (2, 7, 40, 33), (1, 1, 1, 0), (4, 33, 70, 37)])
def test_causal_softmax_matches_float64(isa, R, T, S, start, monkeypatch):
    """A prompt chunk's scores: row t of each block sees positions 0 .. start + t (scaled, softmax),
    the rest become 0; on one thread and on several."""
    rng = np.random.default_rng(R * 100 + S)
    x = (rng.standard_normal((R, T, S)) * 4).astype(np.float32)
    want = x.astype(np.float64) * 0.3
    want[:, np.arange(S)[None, :] > (start + np.arange(T))[:, None]] = -np.inf
    want = np.exp(want - want.max(axis=-1, keepdims=True))
    want /= want.sum(axis=-1, keepdims=True)
    monkeypatch.setattr(kernels, "PARALLEL_MIN_WEIGHTS", 0)          # the pool even for small ones
    before = kernels._threads
    try:
        for threads in (1, 2):
            kernels.set_threads(threads)
            got = x.copy()
            kernels.causal_softmax(got, start, 0.3)
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
            assert (got[:, np.arange(S)[None, :] > (start + np.arange(T))[:, None]] == 0).all()
    finally:
        kernels.set_threads(before)
    with pytest.raises(ValueError):
        kernels.causal_softmax(x.astype(np.float64), start, 0.3)


def test_swiglu_matches_float64(isa):
    """silu(g) * u within float32 rounding, also where e^-g over- or underflows; mismatched shapes refused."""
    rng = np.random.default_rng(8)
    g = (rng.standard_normal((5, 203)) * 8).astype(np.float32)
    g[0, :6] = [0.0, -0.0, 100.0, -100.0, 1e-30, -90.0]
    u = rng.standard_normal((5, 203)).astype(np.float32)
    want = g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64))) * u
    got = kernels.swiglu(g, u)
    assert got.shape == g.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)
    with pytest.raises(ValueError):
        kernels.swiglu(g, u[:, :200])


def test_attend_refuses_mismatched_buffers():
    q, q_rot = np.zeros((4, 32), np.float32), np.zeros((4, 8), np.float32)
    with pytest.raises(ValueError):
        kernels.attend(q, q_rot, np.zeros((10, 32), np.float32), np.zeros((10, 8), np.float16), 5, 1.0)
    with pytest.raises(ValueError):                 # more positions than the cache holds
        kernels.attend(q, q_rot, np.zeros((10, 32), np.float32), np.zeros((10, 8), np.float32), 11, 1.0)


def _route_numpy(scores, bias, k, G, KG, norm, scale):
    """DeepSeek-V3 noaux_tc routing written with numpy sorts (the formulation kernels.route replaced)."""
    E = scores.shape[1]
    choice = scores + bias
    if G > 1:
        gs = np.sort(choice.reshape(-1, G, E // G), axis=-1)[..., -2:].sum(axis=-1)
        keep = np.argsort(-gs, axis=-1, kind="stable")[:, :KG]
        mask = np.zeros_like(gs, dtype=bool)
        np.put_along_axis(mask, keep, True, axis=-1)
        choice = np.where(np.repeat(mask, E // G, axis=-1), choice, -np.inf)
    idx = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(scores, idx, axis=-1)
    if norm:
        w = w / (w.sum(axis=-1, keepdims=True) + 1e-20)
    return idx, (w * scale).astype(np.float32)


@pytest.mark.parametrize("E,G,KG,k", [(64, 1, 1, 6), (64, 8, 3, 6), (384, 1, 1, 8), (256, 8, 4, 8), (16, 4, 2, 3),
                                      (32, 1, 1, 12), (160, 8, 3, 20)])
def test_route_equals_numpy_sorts_bit_for_bit(E, G, KG, k):
    rng = np.random.default_rng(E + k)
    for trial in range(60):
        T = 1 + trial % 5
        logits = (rng.standard_normal((T, E)) * 3).astype(np.float32)
        if trial % 3 == 0:
            logits = np.round(logits, 1)                  # ties between experts and between groups
        scores = (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
        bias = np.zeros(E, np.float32) if trial % 4 == 0 else (rng.standard_normal(E) * 0.1).astype(np.float32)
        norm, scale = bool(trial % 2), [1.0, 2.5, 2.827][trial % 3]
        want_i, want_w = _route_numpy(scores, bias, k, G, KG, norm, scale)
        got_i, got_w = kernels.route(scores, bias, k, G, KG, norm, scale)
        np.testing.assert_array_equal(got_i, want_i)
        np.testing.assert_array_equal(got_w.view(np.int32), want_w.view(np.int32))


def test_route_from_logits_takes_their_sigmoids():
    """route(..., logits=True) takes the router's outputs: the choice of the float32 sigmoids' route
    (1 / (1 + e^-z), e^x within an ulp of numpy's) and weights to float32 rounding."""
    rng = np.random.default_rng(9)
    for E, G, KG, k in [(64, 1, 1, 6), (256, 8, 4, 8)]:
        logits = (rng.standard_normal((3, E)) * 3).astype(np.float32)
        bias = (rng.standard_normal(E) * 0.1).astype(np.float32)
        scores = (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
        want_i, want_w = kernels.route(scores, bias, k, G, KG, True, 2.5)
        got_i, got_w = kernels.route(logits, bias, k, G, KG, True, 2.5, logits=True)
        np.testing.assert_array_equal(got_i, want_i)
        np.testing.assert_allclose(got_w, want_w, rtol=1e-6)
        assert not np.allclose(kernels.route(logits, bias, k, G, KG, True, 2.5)[1], want_w)   # without the flag


def test_route_refuses_bad_shapes():
    with pytest.raises(ValueError, match="route"):
        kernels.route(np.zeros((1, 10), np.float32), np.zeros(10, np.float32), 11)
    with pytest.raises(ValueError, match="route"):
        kernels.route(np.zeros((1, 10), np.float32), np.zeros(10, np.float32), 2, n_group=3)


@pytest.mark.parametrize("n", [7, 64, 129, 576, 1024, 7168, 333])
def test_rms_norm_rounds_as_llama_cpp(n):
    # ggml's rule: float32 squares, summed in order in double, mean to float32, 1/sqrtf, (x*s)*w
    rng = np.random.default_rng(n)
    for T in (1, 3):
        x = (rng.standard_normal((T, n)) * 7).astype(np.float32)
        w = rng.standard_normal(n).astype(np.float32)
        want = np.empty_like(x)
        for t in range(T):
            total = 0.0
            for v in (x[t] * x[t]).tolist():
                total += v
            mean = np.float32(total / n)
            scale = np.float32(1.0) / np.sqrt(mean + np.float32(1e-6))
            want[t] = (x[t] * scale) * w
        got = kernels.rms_norm(x, w, 1e-6)
        np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))
        plain = w * (x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6))
        np.testing.assert_allclose(got, plain, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("T", [1, 3])
def test_stacked_weights_equal_their_own_products(T):
    """Two weights sharing an input and a buffer (MLA's q_a and kv_a in the file's mapping) in one
    call: each output equals that weight's own product bit for bit; weights it cannot take together
    (another column count, another buffer, a float codec) give None."""
    rng = np.random.default_rng(3)
    a = encode(get_codec("q4"), (rng.standard_normal((96, 256)) * 0.02).astype(np.float32))
    b = encode(get_codec("q6"), (rng.standard_normal((72, 256)) * 0.02).astype(np.float32))
    c = encode(get_codec("q4"), (rng.standard_normal((40, 128)) * 0.02).astype(np.float32))
    buf = bytearray(a.nbytes + 64 + b.nbytes + c.nbytes)       # one mapping, tensors at their offsets
    for off, arr in ((0, a), (a.nbytes + 64, b), (a.nbytes + 64 + b.nbytes, c)):
        buf[off:off + arr.nbytes] = arr.tobytes()
    view = memoryview(buf)
    ra = np.frombuffer(view, np.uint8, a.nbytes, 0)
    rb = np.frombuffer(view, np.uint8, b.nbytes, a.nbytes + 64)
    rc = np.frombuffer(view, np.uint8, c.nbytes, a.nbytes + 64 + b.nbytes)
    x = rng.standard_normal((T, 256)).astype(np.float32)
    st = kernels.stacked([("q4", ra, (96, 256)), ("q6", rb, (72, 256))])
    ya, yb = st(x)
    assert np.array_equal(ya, kernels.linear(x, "q4", ra, (96, 256)))
    assert np.array_equal(yb, kernels.linear(x, "q6", rb, (72, 256)))
    assert kernels.stacked([("q4", ra, (96, 256)), ("q4", rc, (40, 128))]) is None
    assert kernels.stacked([("q4", ra, (96, 256)), ("q6", b, (72, 256))]) is None
    f = np.frombuffer(view, np.uint8, 256 * 4, 0)
    assert kernels.stacked([("q4", ra, (96, 256)), ("f32", f, (1, 256))]) is None


@pytest.mark.parametrize("T", [1, 2, 24])
def test_expert_mlp_with_gate_and_up_in_one_call_equals_three_products(T):
    """An expert's SwiGLU over several tokens takes gate and up in one call (DenseMLP._gate_up): the
    same bits as gate, up and down multiplied one by one, and the stacked call is kept on the gate's
    Weight; one token keeps the separate products."""
    from kimistream.runtime.model import DenseMLP
    from kimistream.runtime.weights import Weight
    rng = np.random.default_rng(4)
    parts = [encode(get_codec("q2"), (rng.standard_normal(sh) * 0.02).astype(np.float32))
             for sh in ((256, 512), (256, 512), (512, 256))]
    buf = bytearray(sum(p.nbytes for p in parts))
    view, off, raws = memoryview(buf), 0, []
    for p in parts:
        buf[off:off + p.nbytes] = p.tobytes()
        raws.append(np.frombuffer(view, np.uint8, p.nbytes, off))
        off += p.nbytes
    gate, up, down = (Weight(n, "q2", sh, r) for n, sh, r in
                      zip(("gate", "up", "down"), ((256, 512), (256, 512), (512, 256)), raws))
    x = rng.standard_normal((T, 512)).astype(np.float32)
    want = kernels.linear(kernels.swiglu(kernels.linear(x, "q2", raws[0], (256, 512)),
                                         kernels.linear(x, "q2", raws[1], (256, 512))), "q2", raws[2], (512, 256))
    assert np.array_equal(DenseMLP(gate, up, down).forward(x), want)
    assert (gate._with_up is not None) == (T > 1)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("shape", [(1, 4, 16), (5, 2, 64), (3, 8)])
def test_rope_equals_the_numpy_form_bit_for_bit(shape, interleave):
    rng = np.random.default_rng(len(shape) + interleave)
    x = rng.standard_normal(shape).astype(np.float32)
    T, d = shape[0], shape[-1]
    ang = rng.uniform(0, 6, (T, d // 2))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :d // 2], x[..., d // 2:])
    b = (T,) + (1,) * (x.ndim - 2) + (d // 2,)
    want = np.concatenate([x1 * cos.reshape(b) - x2 * sin.reshape(b), x2 * cos.reshape(b) + x1 * sin.reshape(b)], -1)
    got = kernels.rope(x, cos, sin, interleave)
    assert got.shape == x.shape and np.array_equal(got, want)
    view = np.concatenate([x, x], -1)[..., :d]                 # a strided view, as q's rotary part is
    assert np.array_equal(kernels.rope(view, cos, sin, interleave), want)


_HEAP_PROBE = """
import resource, sys
import kimistream.runtime
import numpy as np
from kimistream.runtime import kernels
applied = kernels.keep_heap(int(sys.argv[1]))
a = np.ones(3 << 20, np.float32); del a       # 12 MiB, freed once: glibc's own threshold rises past it
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    a = np.ones(3 << 20, np.float32)
    b = np.ones(3 << 20, np.float32)          # two live: the heap's top is freed past twice the largest
    del a, b
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                    reason="glibc's allocator")
def test_keep_heap_stops_temporaries_faulting_in_fresh_pages():
    """Without keep_heap, two 12 MiB temporaries allocated and freed ten times fault in fresh pages
    each time (about 10 000 faults here); with it, their pages are reused."""
    def faults(n):
        out = subprocess.run([sys.executable, "-c", _HEAP_PROBE, str(n)], capture_output=True, text=True,
                             check=True).stdout.split()
        return int(out[0]), int(out[1])
    assert kernels.keep_heap(1000) == 0
    applied, kept = faults(32 << 20)
    unchanged, default = faults(0)
    assert applied == 32 << 20 and unchanged == 0
    assert default > 5000 and kept * 5 < default, (default, kept)


@pytest.mark.parametrize("name", ["q2", "q1"])
@pytest.mark.parametrize("rows,cols,tokens", [(40, 1024, 19), (24, 2048, 37), (8, 7168, 9)])
def test_several_tokens_equal_one_token_at_a_time(name, rows, cols, tokens):
    """With int8 inputs the several-token kernel (rows as bytes of digit x scale, outlier corrections
    from a transposed copy of the inputs, tiles of 32 with a ragged last one) gives each token what
    the one-token kernel gives it, to float32 summation order: same rounding, same corrections."""
    if kernels.isa() != "avx2":
        pytest.skip("int8 activations are an AVX2 route")
    rng = np.random.default_rng(rows + tokens)
    raw = encode(name, (rng.standard_t(2.5, size=(rows, cols)) * 0.02).astype(np.float32))
    assert get_codec(name).geometry((rows, cols)).k > 0           # rows with outliers
    x = (rng.standard_normal((tokens, cols)) * 3).astype(np.float32)
    with activations_mode("auto"):
        several = kernels.linear(x, name, raw, (rows, cols))
        one = np.stack([kernels.linear(x[t], name, raw, (rows, cols)) for t in range(tokens)])
    assert np.abs(several - one).max() <= 2e-6 * np.abs(one).max()


@pytest.mark.parametrize("rows", [300, 8])
def test_every_job_runs_once_on_any_thread_count(rows, monkeypatch):
    """Jobs are split in one contiguous range per thread and the threads help with each other's: on
    any thread count (more than there are ranges, more than there are jobs) every row is computed
    once, with the same bits as on one thread."""
    monkeypatch.setattr(kernels, "PARALLEL_MIN_WEIGHTS", 0)
    shape = (rows, 4096)                     # 8 rows a job: 38 jobs, or one
    raw = encode(get_codec("q2"), weight(shape, seed=5))
    x = np.random.default_rng(2).standard_normal((1, shape[1])).astype(np.float32)
    before = kernels._threads
    try:
        kernels.set_threads(1)
        want = kernels.linear(x, "q2", raw, shape)
        for threads in (2, 3, 17):
            kernels.set_threads(threads)
            for _ in range(3):
                np.testing.assert_array_equal(kernels.linear(x, "q2", raw, shape), want)
    finally:
        kernels.set_threads(before)
