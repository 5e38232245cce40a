"""The C decoders and products of llama.cpp's block types (runtime/_ggml.c), for every type a GGUF file
can keep: decoding equals the gguf package's dequantizer bit for bit, and a product equals that
dequantized weight times x in float64, to float32 rounding, for one token, a few, and many (BLAS) --
x as it is (--gguf-inputs f32), or rounded to 8 bits as llama.cpp rounds it (the default; the rule
written out again below in numpy from llama.cpp's description, and checked against the gguf package's
own Q8_0 quantizer)."""

import contextlib

import gguf
import numpy as np
import pytest

from kimistream.formats.codecs import CodecError, get_codec
from kimistream.formats.ggufcodecs import BLOCK_SIZES, codec_name
from kimistream.runtime import _qdot, kernels

# byte offsets of each type's binary16 fields (scales), set to ordinary values in random blocks
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,), "Q2_K": (80, 82),
              "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ2_XXS": (0,), "IQ2_XS": (0,),
              "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ1_S": (0,), "IQ1_M": (), "IQ4_XS": (0,),
              "TQ1_0": (52,), "TQ2_0": (64,)}


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid blocks of `qtype`: random bytes with finite, varied binary16 scales."""
    block, size = BLOCK_SIZES[qtype]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        b[..., off:off + 2] = rng.uniform(-0.02, 0.02, b.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    if qtype == "IQ1_M":      # its scale is spread over the top nibbles of the four 16-bit sub-scales
        d = rng.uniform(0.001, 0.02, b.shape[:2]).astype(np.float16).view(np.uint16)
        for i in range(4):
            hi = b[..., 49 + 2 * i] & 0x0F
            b[..., 49 + 2 * i] = hi | (((d >> (4 * i)) & 0xF) << 4).astype(np.uint8)
    return b.reshape(rows, -1)


OFFSET_TYPES = ("Q4_1", "Q5_1")       # llama.cpp multiplies these by Q8_1 inputs, which carry a block sum


@contextlib.contextmanager
def gguf_inputs(mode: str):
    before = "llama.cpp" if kernels._llama_inputs else "f32"
    kernels.set_gguf_inputs(mode)
    try:
        yield
    finally:
        kernels.set_gguf_inputs(before)


def llama_input(qtype: str, x: np.ndarray):
    """x rounded as llama.cpp's CPU backend rounds the input of a `qtype` weight, in numpy: Q8_K per
    256 values for k-, i- and ternary types (scale -127 / the value of largest magnitude, codes capped
    at 127), Q8_0 per 32 for the legacy types (binary16 scale amax / 127, codes round(x * 127 / amax),
    ties to even); for Q8_1 (OFFSET_TYPES) also the block sum's error, binary16(amax / 127 * sum q)
    minus the sum of the rounded values, which llama.cpp's dot multiplies by each weight block's offset."""
    block = 256 if BLOCK_SIZES[qtype][0] == 256 else 32
    xb = np.asarray(x, np.float32).reshape(-1, block)
    y, fix = np.zeros_like(xb), np.zeros(len(xb), np.float32)
    for i, b in enumerate(xb):
        j = int(np.argmax(np.abs(b)))
        amax = np.abs(b[j])
        if amax == 0:
            continue
        if block == 256:
            iscale = np.float32(-127) / b[j]
            y[i] = (np.float32(1) / iscale) * np.minimum(np.rint(iscale * b), 127)
        else:
            d = np.float32(np.float16(amax / np.float32(127)))
            q = np.rint(b * (np.float32(127) / amax))
            y[i] = d * q
            fix[i] = np.float32(np.float16(amax / np.float32(127) * q.sum())) - d * q.sum()
    y = y.reshape(np.shape(x))
    return y, (fix.reshape(np.shape(x)[:-1] + (-1,)) if qtype in OFFSET_TYPES else None)


def block_offsets(qtype: str, raw: np.ndarray, rows: int) -> np.ndarray:
    """Each 32-weight block's binary16 offset (bytes 2..3) of a Q4_1 / Q5_1 weight, [rows, blocks]."""
    size = BLOCK_SIZES[qtype][1]
    b = np.ascontiguousarray(raw.reshape(rows, -1, size)[..., 2:4])
    return b.view(np.float16)[..., 0].astype(np.float64)


def test_every_block_type_has_a_case():
    assert set(F16_FIELDS) == set(BLOCK_SIZES)


@pytest.mark.parametrize("isa", ["avx2", "generic"])
@pytest.mark.parametrize("qtype", sorted(BLOCK_SIZES))
def test_decoding_equals_the_gguf_dequantizer(qtype, isa):
    if isa == "avx2" and kernels.isa() != "avx2":
        pytest.skip("no AVX2 here")
    before = kernels.isa()
    _qdot.set_isa(isa)
    try:
        block = BLOCK_SIZES[qtype][0]
        raw = random_blocks(qtype, 37, 3 * block, seed=len(qtype))
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
        got = kernels.dequantize(codec_name(qtype), raw, (37, 3 * block))
        assert np.isfinite(want).all() and np.abs(want).max() > 0
        assert np.array_equal(got, want), np.argwhere(got != want)[:4]
    finally:
        _qdot.set_isa(before)


@pytest.mark.parametrize("mode", ["f32", "llama.cpp"])
@pytest.mark.parametrize("qtype", sorted(BLOCK_SIZES))
def test_products_equal_the_dequantized_weight_times_x(qtype, mode):
    block = BLOCK_SIZES[qtype][0]
    rows, cols = 67, (2048 if block == 256 else 1056)          # 8 blocks of 256, or 33 of 32
    raw = random_blocks(qtype, rows, cols, seed=3)
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float64)
    rng = np.random.default_rng(1)
    with gguf_inputs(mode):
        for T in (1, 5, 40):                                   # one token, a few, many (dequantize + BLAS)
            x = rng.standard_normal((T, cols)).astype(np.float32)
            x[0, :block] = 0                                   # an all-zero input block
            xr, fix = (x, None) if mode == "f32" else llama_input(qtype, x)
            want = xr.astype(np.float64) @ w.T
            if fix is not None:
                want += fix.astype(np.float64) @ block_offsets(qtype, raw, rows).T
            got = kernels.linear(x, codec_name(qtype), raw, (rows, cols))
            tol = 2e-6 * np.sqrt(cols) * (np.abs(x).max() * np.abs(w).max())
            assert got.shape == (T, rows) and np.abs(got - want).max() <= tol, (T, np.abs(got - want).max(), tol)
            if mode != "f32":      # the rounding is seen: far from the product by x as it is
                exact = x.astype(np.float64) @ w.T
                assert np.abs(got - exact).max() > 20 * tol
        single = kernels.linear(x[0], codec_name(qtype), raw, (rows, cols))
        assert single.shape == (rows,)


@pytest.mark.parametrize("qtype", ["Q5_0", "Q2_K", "Q4_1", "IQ4_NL", "TQ1_0"])
def test_input_rounding_follows_llama_cpp(qtype):
    block = 256 if BLOCK_SIZES[qtype][0] == 256 else 32
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((3, 4 * block)) * rng.uniform(0.01, 50, (3, 4 * block))).astype(np.float32)
    x[1, block:2 * block] = 0
    x[2, 5] = -400                      # a block whose largest magnitude is negative
    want, want_fix = llama_input(qtype, x)
    got, fix = kernels.gguf_input(codec_name(qtype), x)
    np.testing.assert_array_equal(got, want)
    if want_fix is None:
        assert fix is None
    else:
        np.testing.assert_allclose(fix, want_fix, rtol=0, atol=1e-6 * np.abs(x).max())
    with gguf_inputs("f32"):
        same, none = kernels.gguf_input(codec_name(qtype), x)
        assert same is x and none is None
    assert kernels.gguf_input("q2", x)[0] is x           # our own codecs take float32 inputs


def test_q8_0_input_rounding_matches_the_gguf_quantizer():
    """The legacy types' inputs (here Q4_0's) against the gguf package's Q8_0 (quantize then dequantize). Its
    reference rounds halves away from zero and scales by 1 / d, llama.cpp's AVX2 path rounds halves to
    even and scales by 127 / amax: the same values but for rare ties, never more than one step apart."""
    x = np.random.default_rng(3).standard_normal((64, 1024)).astype(np.float32)
    got = kernels.gguf_input("gguf-q4_0", x)[0]
    ref = gguf.quants.dequantize(gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                                 gguf.GGMLQuantizationType.Q8_0)
    step = np.repeat(np.abs(x).reshape(64, -1, 32).max(-1) / 127, 32, axis=1) * 1.01
    assert np.mean(got == ref) > 0.999 and np.all(np.abs(got - ref) <= step)


def test_gguf_inputs_mode_is_checked():
    with pytest.raises(ValueError, match="not one of"):
        kernels.set_gguf_inputs("int8")


def test_iq1_m_and_iq1_s_share_one_codebook():
    for cls in (gguf.quants.IQ1_S, gguf.quants.IQ1_M):
        cls.init_grid()
    assert np.array_equal(gguf.quants.IQ1_S.grid, gguf.quants.IQ1_M.grid)


def test_bad_buffers_are_refused():
    raw = random_blocks("Q2_K", 4, 256)
    with pytest.raises(CodecError, match="need 336 bytes"):
        kernels.linear(np.zeros(256, np.float32), "gguf-q2_k", raw.reshape(-1)[:300], (4, 256))
    with pytest.raises(CodecError, match="not whole blocks"):
        get_codec("gguf-q2_k").nbytes((4, 100))
    with pytest.raises(ValueError, match="no kernel"):
        _qdot.ggml_rows(raw, 99, 4, 256, np.zeros((1, 256), np.float32), np.zeros((1, 4), np.float32), 1)
    with pytest.raises(ValueError, match="do not match"):
        _qdot.ggml_rows(raw, gguf.GGMLQuantizationType.Q2_K.value, 5, 256, np.zeros((1, 256), np.float32),
                        np.zeros((1, 5), np.float32), 1)


@pytest.mark.parametrize("mode", ["f32", "llama.cpp"])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_1", "IQ4_NL", "Q4_K", "Q6_K"])
def test_head_products_use_each_heads_input(qtype, mode):
    """kernels.heads on llama.cpp blocks (MLA's k_b / v_b halves): rows h*stride+first .. +n-1 times
    x[h], for whole heads (one C call) and for part of each head's rows; and the several-token form
    (gguf_heads_matmul) the prefill uses."""
    block = BLOCK_SIZES[qtype][0]
    nh, per, cols = 3, 16, 2 * block
    raw = random_blocks(qtype, nh * per, cols, seed=5)
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float64).reshape(nh, per, cols)
    x = np.random.default_rng(2).standard_normal((nh, cols)).astype(np.float32)
    xr, fix = (x, None) if mode == "f32" else llama_input(qtype, x)
    mins = block_offsets(qtype, raw, nh * per).reshape(nh, per, -1) if fix is not None else None
    tol = 2e-6 * np.sqrt(cols) * np.abs(x).max() * np.abs(w).max()
    with gguf_inputs(mode):
        for first, n in ((0, per), (4, 8)):
            got = kernels.heads(codec_name(qtype), raw, (nh * per, cols), x, per, first, n)
            want = np.einsum("hrc,hc->hr", w[:, first:first + n], xr.astype(np.float64))
            if fix is not None:
                want += np.einsum("hrb,hb->hr", mins[:, first:first + n], fix.astype(np.float64))
            assert got.shape == (nh, n) and np.abs(got - want).max() <= tol
        xs = np.random.default_rng(4).standard_normal((1, nh, 5, cols)).astype(np.float32)
        got = kernels.gguf_heads_matmul(codec_name(qtype), raw, (nh * per, cols), xs,
                                        w.transpose(0, 2, 1).astype(np.float32))
    xsr, sfix = (xs, None) if mode == "f32" else llama_input(qtype, xs)
    want = np.einsum("hrc,bhtc->bhtr", w, xsr.astype(np.float64))
    if sfix is not None:
        want += np.einsum("hrk,bhtk->bhtr", mins, sfix.astype(np.float64))
    assert got.shape == (1, nh, 5, per) and np.abs(got - want).max() <= 2 * tol * np.abs(xs).max() / np.abs(x).max()


@pytest.mark.parametrize("mode", ["f32", "llama.cpp"])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("types", [("IQ2_XXS", "Q4_K"), ("Q5_1", "Q4_1"), ("Q2_K", "Q3_K"), ("Q3_K", "Q6_K"), ("IQ1_S", "IQ2_XXS")])
def test_experts_in_one_call_equal_their_products(T, types, mode):
    """kernels.ggml_moe_decode (routed experts in llama.cpp's blocks, one C call) against each expert's
    three products (kernels.linear, held to the reference above) and SwiGLU in numpy; each product's
    input rounded for its own weight's type."""
    hidden, inter, E, k = 256, 512, 4, 2
    gt, dt = types
    gu = [random_blocks(gt, inter, hidden, seed=10 + i) for i in range(2 * E)]
    dn = [random_blocks(dt, hidden, inter, seed=30 + i) for i in range(E)]
    parts, offs = [], []
    for e in range(E):
        o = sum(p.nbytes for p in parts)
        parts += [gu[2 * e], gu[2 * e + 1], dn[e]]
        offs.append((o, o + gu[2 * e].nbytes, o + 2 * gu[2 * e].nbytes))
    base = np.concatenate([p.reshape(-1) for p in parts])
    rng = np.random.default_rng(T)
    x = rng.standard_normal((T, hidden)).astype(np.float32)
    idx = np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
    wts = rng.uniform(0.1, 1, (T, k)).astype(np.float32)
    out = np.zeros((T, hidden), np.float32)
    gate, down = (codec_name(gt), (inter, hidden)), (codec_name(dt), (hidden, inter))
    routes = np.array([[offs[e] for e in row] for row in idx])
    want = np.zeros((T, hidden))
    with gguf_inputs(mode):
        kernels.ggml_moe_decode(base, routes, gate, down, x, wts, out)
        for t in range(T):
            for j, e in enumerate(idx[t]):
                g = kernels.linear(x[t], gate[0], gu[2 * e], gate[1])
                u = kernels.linear(x[t], gate[0], gu[2 * e + 1], gate[1])
                a = g / (np.float32(1) + np.exp(-g)) * u
                want[t] += wts[t, j] * kernels.linear(a, down[0], dn[e], down[1])
    assert np.abs(out - want).max() <= 1e-5 * np.abs(want).max(), np.abs(out - want).max() / np.abs(want).max()
    with pytest.raises(CodecError, match="outside"):
        kernels.ggml_moe_decode(base[:1000], routes, gate, down, x, wts, out)
