"""Group codecs (q8, q4, q2): the bit layout written in formats/quants.py, decoded here by an
independent spec-following decoder; encoder behaviour on adversarial data; plans fall back for
tensors without whole groups; a quantized model still runs and stays close to f32."""

import numpy as np
import pytest

from kimistream.formats.codecs import CodecError, get_codec


def spec_decode(buf, shape, bits, group, symmetric):
    """Decode straight from the layout description: codes plane, then f16 params plane."""
    rows, cols = shape
    groups, per_byte = cols // group, 8 // bits
    codes_len = rows * cols * bits // 8
    raw = np.frombuffer(bytes(buf), dtype=np.uint8)
    params = raw[codes_len:].view("<f2").astype(np.float32)
    out = np.empty(shape, np.float32)
    lane = group // per_byte
    for r in range(rows):
        for g in range(groups):
            base = (r * groups + g) * lane
            for j in range(group):
                byte = raw[base + j % lane]
                code = (int(byte) >> (bits * (j // lane))) & ((1 << bits) - 1)
                pi = (r * groups + g) * (1 if symmetric else 2)
                if symmetric:
                    code = code - 256 if code > 127 else code
                    out[r, g * group + j] = code * params[pi]
                else:
                    out[r, g * group + j] = code * params[pi] + params[pi + 1]
    return out


SPECS = {"q8": (8, 32, True), "q4": (4, 32, False), "q2": (2, 64, False)}


@pytest.mark.parametrize("name", list(SPECS))
def test_reference_decoder_follows_the_layout(name):
    x = np.random.default_rng(1).standard_normal((3, 128)).astype(np.float32)
    c = get_codec(name)
    buf = c.encode(x)
    assert buf.size == c.nbytes(x.shape)
    np.testing.assert_array_equal(c.decode(buf, x.shape), spec_decode(buf, x.shape, *SPECS[name]))
    np.testing.assert_array_equal(c.decode_rows(buf, x.shape, [2, 0]), c.decode(buf, x.shape)[[2, 0]])


@pytest.mark.parametrize("name,bpw,tol", [("q8", 8.5, 0.01), ("q4", 5.0, 0.12), ("q2", 2.5, 0.45)])
def test_error_and_bits(name, bpw, tol):
    x = np.random.default_rng(2).standard_normal((64, 256)).astype(np.float32)
    c = get_codec(name)
    assert c.bits_per_weight(x.shape) == bpw
    err = np.sqrt(np.mean((c.decode(c.encode(x), x.shape) - x) ** 2))
    assert err < tol


@pytest.mark.parametrize("name", list(SPECS))
def test_adversarial_groups(name):
    c = get_codec(name)
    const = np.full((2, 64), 0.37, np.float32)
    np.testing.assert_allclose(c.decode(c.encode(const), const.shape), const, rtol=1e-3)
    zeros = np.zeros((2, 64), np.float32)
    np.testing.assert_array_equal(c.decode(c.encode(zeros), zeros.shape), zeros)
    spike = np.random.default_rng(3).standard_normal((2, 64)).astype(np.float32) * 0.01
    spike[0, 5] = 500.0
    dec = c.decode(c.encode(spike), spike.shape)
    assert np.isfinite(dec).all() and abs(dec[0, 5] - 500.0) < 0.1 * 500
    for bad in (np.nan, np.inf):
        y = spike.copy()
        y[1, 1] = bad
        with pytest.raises(CodecError, match="non-finite"):
            c.encode(y)
    with pytest.raises(CodecError, match="multiple of the group size"):
        c.encode(np.zeros((2, 48), np.float32))


def test_importance_weighting_lowers_weighted_error():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((32, 128)).astype(np.float32)
    imp = np.ones(128, np.float32)
    imp[:8] = 100.0
    c = get_codec("q2")
    plain = c.decode(c.encode(x), x.shape)
    weighted = c.decode(c.encode(x, importance=imp), x.shape)
    werr = lambda y: float((imp * (y - x) ** 2).sum())  # noqa: E731
    assert werr(weighted) < werr(plain)


def test_plan_falls_back_for_partial_groups():
    from kimistream.convert.plan import PrecisionPlan
    plan = PrecisionPlan.from_preset("q2-rtn")
    assert plan.codec_for("model.layers.1.mlp.experts.0.gate_proj.weight", "routed_experts", (32, 128)) == "q2"
    assert plan.codec_for("model.layers.1.mlp.experts.0.down_proj.weight", "routed_experts", (128, 32)) == "f16"
    assert plan.codec_for("model.norm.weight", "norms", (64,)) == "f32"


def test_q8_model_close_to_f32(tiny_ckpt, tiny_kst, tmp_path):
    from kimistream.convert.converter import convert_checkpoint
    from kimistream.convert.plan import PrecisionPlan
    from kimistream.runtime.model import Model
    from kimistream.runtime.weights import ModelWeights
    ids = list(np.random.default_rng(5).integers(0, 320, 32))
    ref = Model(ModelWeights(tiny_kst), 64).prefill(ids, 8, all_logits=True)

    def logp(z):
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    kl = {}
    for preset in ("q8", "q4"):
        out = tmp_path / f"{preset}.kst"
        convert_checkpoint(tiny_ckpt, out, PrecisionPlan.from_preset(preset))
        got = Model(ModelWeights(out), 64).prefill(ids, 8, all_logits=True)
        kl[preset] = float((np.exp(logp(ref)) * (logp(ref) - logp(got))).sum(-1).mean())
    assert 0 < kl["q8"] < kl["q4"] and kl["q8"] < 1e-2
