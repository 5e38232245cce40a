"""The C decoders and products of llama.cpp's block types (runtime/_ggml.c), for every type a GGUF file
can keep: decoding equals the gguf package's dequantizer bit for bit, and a product equals that
dequantized weight times x in float64, to float32 rounding, for one token, a few, and many (BLAS)."""

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


@pytest.mark.parametrize("qtype", sorted(BLOCK_SIZES))
def test_products_equal_the_dequantized_weight_times_x(qtype):
    block = BLOCK_SIZES[qtype][0]
    rows, cols = 67, (2048 if block == 256 else 1056)          # 8 blocks of 256, or 33 of 32
    raw = random_blocks(qtype, rows, cols, seed=3)
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float64)
    rng = np.random.default_rng(1)
    for T in (1, 5, 40):                                       # one token, a few, many (dequantize + BLAS)
        x = rng.standard_normal((T, cols)).astype(np.float32)
        want = x.astype(np.float64) @ w.T
        got = kernels.linear(x, codec_name(qtype), raw, (rows, cols))
        tol = 2e-6 * np.sqrt(cols) * (np.abs(x).max() * np.abs(w).max())
        assert got.shape == (T, rows) and np.abs(got - want).max() <= tol, (T, np.abs(got - want).max(), tol)
    single = kernels.linear(x[0], codec_name(qtype), raw, (rows, cols))
    assert single.shape == (rows,)


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


@pytest.mark.parametrize("qtype", ["Q4_0", "IQ4_NL", "Q4_K"])
def test_head_products_use_each_heads_input(qtype):
    """kernels.heads on llama.cpp blocks (MLA's k_b / v_b halves): rows h*stride+first .. +n-1 times
    x[h], for whole heads (one C call) and for part of each head's rows."""
    block = BLOCK_SIZES[qtype][0]
    nh, per, cols = 3, 16, 2 * block
    raw = random_blocks(qtype, nh * per, cols, seed=5)
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float64).reshape(nh, per, cols)
    x = np.random.default_rng(2).standard_normal((nh, cols)).astype(np.float32)
    tol = 2e-6 * np.sqrt(cols) * np.abs(x).max() * np.abs(w).max()
    for first, n in ((0, per), (4, 8)):
        got = kernels.heads(codec_name(qtype), raw, (nh * per, cols), x, per, first, n)
        want = np.einsum("hrc,hc->hr", w[:, first:first + n], x.astype(np.float64))
        assert got.shape == (nh, n) and np.abs(got - want).max() <= tol


@pytest.mark.parametrize("T", [1, 3])
def test_experts_in_one_call_equal_their_products(T):
    """kernels.ggml_moe_decode (routed experts in llama.cpp's blocks, one C call) against each expert's
    three products and SwiGLU in numpy."""
    hidden, inter, E, k = 256, 512, 4, 2
    gu = [random_blocks("IQ2_XXS", inter, hidden, seed=10 + i) for i in range(2 * E)]
    dn = [random_blocks("Q4_K", hidden, inter, seed=30 + i) for i in range(E)]
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
    kernels.ggml_moe_decode(base, np.array([[offs[e] for e in row] for row in idx]), ("gguf-iq2_xxs", (inter, hidden)),
                            ("gguf-q4_k", (hidden, inter)), x, wts, out)
    want = np.zeros((T, hidden))
    for t in range(T):
        for j, e in enumerate(idx[t]):
            g = kernels.linear(x[t], "gguf-iq2_xxs", gu[2 * e], (inter, hidden)).astype(np.float64)
            u = kernels.linear(x[t], "gguf-iq2_xxs", gu[2 * e + 1], (inter, hidden)).astype(np.float64)
            a = (g / (1 + np.exp(-g)) * u).astype(np.float32)
            want[t] += wts[t, j] * kernels.linear(a, "gguf-q4_k", dn[e], (hidden, inter))
    assert np.abs(out - want).max() <= 1e-5 * np.abs(want).max()
    with pytest.raises(CodecError, match="outside"):
        kernels.ggml_moe_decode(base[:1000], np.array([[offs[e] for e in row] for row in idx]),
                                ("gguf-iq2_xxs", (inter, hidden)), ("gguf-q4_k", (hidden, inter)), x, wts, out)
