"""kimi-run against the reference: transformers' DeepseekV3ForCausalLM in fp32. For several random
tiny configs covering every architectural switch, the logits at every prompt position match to
1e-4 of the logits' scale and 32 greedy tokens are identical, the prompt fed chunk by chunk or in
windows a layer at a time."""

import zlib

import numpy as np
import pytest

import refmodels
from kimistream.convert.converter import convert_checkpoint
from kimistream.formats.presets import PrecisionPlan
from kimistream.runtime.generate import generate
from kimistream.runtime.model import Model
from kimistream.runtime.sampler import Sampler
from kimistream.runtime.weights import ModelWeights

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}

CONFIGS = {
    "base": {},
    "yarn": {"rope_parameters": YARN},
    "yarn-mscale-only": {"rope_parameters": {**YARN, "mscale": 0.707, "mscale_all_dim": 0.0}},
    "no-q-lora": {"q_lora_rank": None},
    "groups-4-2": {"n_group": 4, "topk_group": 2, "num_experts_per_tok": 3},
    "two-dense": {"num_hidden_layers": 4, "first_k_dense_replace": 2},
    "no-norm-topk": {"norm_topk_prob": False, "routed_scaling_factor": 1.0},
    "no-interleave": {"rope_interleave": False, "n_shared_experts": 2},
    "kimi-like": {"rope_parameters": YARN, "n_routed_experts": 16, "num_experts_per_tok": 4,
                  "routed_scaling_factor": 2.827, "num_hidden_layers": 4},
}


def _prompt(n, vocab, seed):
    return [int(i) for i in np.random.RandomState(seed).randint(0, vocab, n)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_greedy_match_transformers(name, tmp_path):
    ckpt = tmp_path / "ckpt"
    refmodels.make_checkpoint(ckpt, seed=zlib.crc32(name.encode()) % 1000, **CONFIGS[name])
    out = tmp_path / "m.kst"
    convert_checkpoint(ckpt, out, PrecisionPlan.from_preset("f32"))
    ids = _prompt(48, 320, seed=len(name))

    ref = refmodels.reference_logits(ckpt, ids)
    model = Model(ModelWeights(out), max_context=128)
    got = model.prefill(ids, batch=13, all_logits=True)       # uneven chunks on purpose
    scale = np.abs(ref).max()
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= 1e-4 * scale

    # windows of 20 tokens a layer at a time, attention in chunks of 6 (20 = 6 + 6 + 6 + 2; 48 = 20 + 20 + 8)
    model.reset()
    windows = model.prefill(ids, batch=6, all_logits=True, window=20)
    assert np.abs(windows - ref).max() <= 1e-4 * scale

    greedy = refmodels.reference_greedy(ckpt, ids[:16], 32)
    model.reset()
    ours = list(generate(model, ids[:16], 32, Sampler(0.0), prefill_batch=5))
    assert ours == greedy
    model.reset()
    assert list(generate(model, ids[:16], 32, Sampler(0.0), prefill_batch=3, window=7)) == greedy


def _prefill_against_reference(tmp_path, ids, batch, **checkpoint):
    """(transformers' logits, ours from an f32 conversion, prefilled in chunks of `batch`) of a random
    checkpoint made with `checkpoint` (refmodels.make_checkpoint's arguments)."""
    ckpt = tmp_path / "ckpt"
    refmodels.make_checkpoint(ckpt, **checkpoint)
    out = tmp_path / "m.kst"
    convert_checkpoint(ckpt, out, PrecisionPlan.from_preset("f32"))
    return refmodels.reference_logits(ckpt, ids), Model(ModelWeights(out), 64).prefill(ids, batch, all_logits=True)


def test_bf16_checkpoint_converts_exactly(tmp_path):
    """A bf16 source at --quant f32 holds exactly the bf16 values the reference computes with."""
    ref, got = _prefill_against_reference(tmp_path, _prompt(20, 320, seed=9), 8, seed=3, dtype="bfloat16")
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


def test_sequences_side_by_side_equal_one_at_a_time(tiny_kst):
    """Model.sequences(B): B sequences advancing together (self-calibration samples this way) give
    each sequence the logits it gets alone; sample_sequences with lanes fills n_tokens in windows."""
    from kimistream.runtime.quality import sample_sequences
    w = ModelWeights(tiny_kst)
    w.load_resident()
    m = Model(w, 32)
    seqs = [[1, 5, 9, 3, 2], [2, 7, 7, 1, 4], [4, 4, 8, 6, 6]]
    alone = []
    for s in seqs:
        m.reset()
        m.forward(s[:2])
        alone.append([m.forward([t])[0] for t in s[2:]])
    with m.sequences(3) as mb:
        mb.reset()
        mb.forward(np.array([s[:2] for s in seqs]))
        side = [mb.forward(np.array([[s[j]] for s in seqs])) for j in range(2, 5)]
    assert m.cache.batch == 1                              # the single-sequence cache is back
    for i in range(3):
        for j in range(3):
            np.testing.assert_allclose(side[j][i], alone[i][j], rtol=1e-4, atol=1e-5)
    out = sample_sequences(m, [1], set(), 50, 16, 8, seed=3, lanes=4)
    assert sum(map(len, out)) == 50 and all(len(s) <= 16 and s[0] == 1 for s in out)
    assert out == sample_sequences(m, [1], set(), 50, 16, 8, seed=3, lanes=4)     # reproducible


@pytest.mark.parametrize("expand", [True, False])
def test_prefill_attention_matches_transformers_either_way(expand, tmp_path, monkeypatch):
    """Several new tokens: kv_b applied to the cached latents (keys and values per head) or folded into
    the queries and outputs, whichever the model picks by multiply-adds; both forced here."""
    from kimistream.runtime.model import Attention
    monkeypatch.setattr(Attention, "_expand_keys", lambda self, T, S: expand)
    ref, got = _prefill_against_reference(tmp_path, _prompt(40, 320, seed=4), 16, seed=11, **CONFIGS["yarn"])
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
