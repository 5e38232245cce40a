"""q1t: q1's values with 32 rows side by side, multiplied by table lookups (formats/quants.py
TiledQ1Codec, runtime/_qdot.c q1t_*). Held to q1's reference decoder, and the kernel to the float64
product of the decoded weight with its input rounded as stated (-31 .. 31 per 128 values; the
offsets' and outliers' parts with the exact input), on both instruction sets and on odd shapes."""

import numpy as np
import pytest

from kimistream.convert.encoder import encode
from kimistream.formats.codecs import CodecError, get_codec
from kimistream.formats.presets import PrecisionPlan
from kimistream.formats.quants import TILE_SUPER_BYTES
from kimistream.runtime import _qdot, kernels

Q1, Q1T = get_codec("q1"), get_codec("q1t")
SHAPES = [(32, 256), (70, 512), (1, 768), (192, 256), (96, 2048), (33, 1024)]
TOL = 2e-6          # of the largest output: float32 rounding of the same integer sums


def weight(shape, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_t(4, size=shape) * 0.02).astype(np.float32)
    q = encode(Q1, w)
    return q, Q1T.from_q1(q, shape)


def scale_part(t, shape):
    """The decoded weight without its offsets m and outlier corrections: the part whose product takes
    the rounded input."""
    g = Q1T.geometry(shape)
    z = t.copy()
    z[g.off_oval:g.off_oval + 2 * g.rows * g.k] = 0
    z[g.off_code:].reshape(-1, TILE_SUPER_BYTES)[:, 64:128] = 0
    return Q1T.decode(z, shape).astype(np.float64)


def expected(t, shape, x):
    full, a = Q1T.decode(t, shape).astype(np.float64), scale_part(t, shape)
    xr = np.stack([kernels.rounded_input("q1t", row) for row in x])
    return xr @ a.T + x.astype(np.float64) @ (full - a).T


@pytest.fixture(params=["avx2", "generic"])
def isa(request):
    if request.param == "avx2" and _qdot.isa() != "avx2":
        pytest.skip("no AVX2 here")
    old = _qdot.isa()
    _qdot.set_isa(request.param)
    yield request.param
    _qdot.set_isa(old)


@pytest.mark.parametrize("shape", SHAPES)
def test_tiles_hold_q1s_bytes_exactly(shape):
    q, t = weight(shape)
    assert t.size == Q1T.nbytes(shape)
    assert np.array_equal(Q1T.to_q1(t, shape), q)
    assert np.array_equal(Q1T.decode(t, shape), Q1.decode(q, shape))
    assert np.array_equal(kernels.dequantize("q1t", t, shape), Q1.decode(q, shape))
    rows = [0, shape[0] - 1]
    assert np.array_equal(kernels.dequantize_rows("q1t", t, shape, rows), Q1.decode(q, shape)[rows])


def test_outliers_and_bits_per_weight_are_q1s():
    shape = (64, 2048)
    q, t = weight(shape)
    assert Q1T.geometry(shape).k == Q1.geometry(shape).k > 0
    assert Q1T.bits_per_weight(shape) == pytest.approx(Q1.bits_per_weight(shape), abs=0.01)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tokens", [1, 2, 5, 40])
def test_kernel_equals_the_reference_with_rounded_inputs(isa, shape, tokens):
    _, t = weight(shape, seed=tokens)
    x = np.random.default_rng(tokens).standard_normal((tokens, shape[1])).astype(np.float32)
    x[0, :128] = 0                     # a block of zeros: step 0
    y = kernels.linear(x, "q1t", t, shape)
    ref = expected(t, shape, x)
    assert np.abs(y - ref).max() <= TOL * np.abs(ref).max()


def test_many_tokens_multiply_the_dequantized_weight():
    shape = (64, 512)
    q, t = weight(shape)
    x = np.random.default_rng(3).standard_normal((kernels.X8_BLAS_MIN_TOKENS, 512)).astype(np.float32)
    ref = x.astype(np.float64) @ Q1.decode(q, shape).astype(np.float64).T
    y = kernels.linear(x, "q1t", t, shape)
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()


def test_moe_with_tiled_gate_up_and_q1_down(isa):
    hidden, inter = 512, 96
    rng = np.random.default_rng(5)
    gu, dn = (inter, hidden), (hidden, inter)
    experts = []
    for e in range(3):
        w = [(rng.standard_normal(s) * 0.05).astype(np.float32) for s in (gu, gu, dn)]
        experts.append((Q1T.from_q1(encode(Q1, w[0]), gu), Q1T.from_q1(encode(Q1, w[1]), gu), encode(Q1, w[2])))
    base = np.concatenate([b for ex in experts for b in ex])
    sizes = [b.size for ex in experts for b in ex]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).reshape(3, 3)
    x = rng.standard_normal((2, hidden)).astype(np.float32)
    pick = np.array([[0, 2], [1, 2]])
    wts = np.array([[0.7, 0.3], [0.4, 0.6]], np.float32)
    out = np.zeros((2, hidden), np.float32)
    kernels.moe_decode(base, starts[pick], ("q1t", gu), ("q1", dn), x, wts, out)
    ref = np.zeros((2, hidden), np.float32)
    for tk in range(2):
        for j, e in enumerate(pick[tk]):
            g_, u_, d_ = experts[e]
            h = kernels.swiglu(kernels.linear(x[tk], "q1t", g_, gu), kernels.linear(x[tk], "q1t", u_, gu))
            ref[tk] += wts[tk, j] * kernels.linear(h, "q1", d_, dn)
    assert np.abs(out - ref).max() <= 1e-4 * np.abs(ref).max()


def test_corrupt_outlier_columns_are_refused():
    shape = (64, 2048)
    _, t = weight(shape)
    g = Q1T.geometry(shape)
    t[g.off_ocol:g.off_ocol + 2] = 0xFF          # column 65535 of 2048
    with pytest.raises(CodecError, match="outlier columns"):
        kernels.linear(np.ones(2048, np.float32), "q1t", t, shape)
    with pytest.raises(CodecError, match="outlier"):
        Q1T.decode(t, shape)


def test_jobs_go_in_whole_tiles():
    shape = (64, 256)
    _, t = weight(shape)
    g = kernels._geometry_vector(Q1T, shape)
    jobs = np.array([[0, 0, 8, 40, 0, 0]], np.int64)
    with pytest.raises(ValueError, match="whole tiles"):
        _qdot.rows(t, g[None, :], np.ones((1, 256), np.float32), jobs, np.zeros(32, np.float32), 1)


def test_attention_heads_refuse_the_tiled_layout():
    _, t = weight((64, 256))
    with pytest.raises(CodecError, match="kv_b takes q1"):
        kernels.heads("q1t", t, (64, 256), np.ones((2, 256), np.float32), 32, 0, 32)


def test_plans_use_tiles_only_where_they_fit():
    plan = PrecisionPlan.from_preset("q1")
    gate = "model.layers.1.mlp.experts.0.gate_proj.weight"
    assert plan.codec_for(gate, "routed_experts", (2048, 7168)) == "q1t"
    assert plan.codec_for(gate, "routed_experts", (256, 192)) == "q1"       # no whole super-block
    assert plan.codec_for(gate, "routed_experts", (40, 256)) == "q1"        # no whole tile
    over = PrecisionPlan.from_preset("q4", ["self_attn=q1t"])
    assert over.codec_for("model.layers.0.self_attn.o_proj.weight", "attention", (256, 256)) == "q1"


@pytest.mark.parametrize("shape", [(1024, 1024), (352, 2048)])
def test_a_synthetic_q1t_weight_repeats_its_block_of_rows(shape):
    from kimistream.convert import synthetic
    name = "model.layers.1.mlp.experts.0.up_proj.weight"
    got = synthetic._encoded(np.random.default_rng(0), name, shape, "q1t", None)
    block = synthetic._values(np.random.default_rng(0), name, (synthetic.TILE_ROWS, shape[1]), None)
    want = np.resize(Q1T.decode(encode(Q1T, block), (synthetic.TILE_ROWS, shape[1])), shape)
    assert got.size == Q1T.nbytes(shape)
    assert np.array_equal(Q1T.decode(got, shape), want)
