"""Calibration and quality inputs: a malformed importance file is refused in one line (a __meta__
that is not an object, a format that is not a number, non-numeric or complex importances, a second
moment with a negative diagonal, a file with no importances at all); saving one that fails or is
interrupted leaves nothing behind; an input of no rows is not saved as NaN; perplexity and KL are
scored a chunk of logits at a time (not a whole window's, several times over in float64) with
progress after each chunk, and windows of one token are refused; self-calibration's progress reaches
the tokens it samples; kimi-convert passes kimi-run only the calibration flags it reads."""

import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from kimistream.formats import imatrix as I
from kimistream.formats.imatrix import ImatrixError, load_imatrix, save_imatrix

REPO = Path(__file__).resolve().parent.parent
CONFIG = {"hidden_size": 4}
SHAPES = {"model.layers.0.mlp.gate_proj.weight": (8, 4), "model.layers.0.mlp.up_proj.weight": (8, 4)}
GATE = "model.layers.0.mlp.gate_proj.weight"
MOMENT = I.MOMENT + "model.layers.0.mlp.gate_up"


def write(path, arrays: dict, meta=None):
    """An .npz as save_imatrix writes it, with `arrays` (and `meta`, raw bytes or an object) as given."""
    base = {"format": I.FORMAT, "config_digest": I.config_digest(CONFIG), "tokens": 2, "counts": {}}
    raw = meta if isinstance(meta, bytes) else json.dumps(base if meta is None else base | meta).encode()
    np.savez(path, __meta__=np.frombuffer(raw, np.uint8), **arrays)
    return path


def good():
    return {GATE: np.ones(4, np.float32), MOMENT: np.eye(4, dtype=np.float32)}


def test_a_good_file_loads(tmp_path):
    im = load_imatrix(write(tmp_path / "im.npz", good()), CONFIG, SHAPES)
    assert list(im) == [GATE] and im.moment(GATE).shape == (4, 4)


BAD = {
    "meta a list": (lambda: good(), b"[1, 2]", "not a JSON object"),
    "format a string": (lambda: good(), {"format": "two"}, "is not a number"),
    "string importances": (lambda: good() | {GATE: np.array(["1", "2", "3", "4"])}, None, "non-numeric"),
    "complex importances": (lambda: good() | {GATE: np.ones(4, np.complex64)}, None, "non-numeric"),
    "string moment": (lambda: good() | {MOMENT: np.full((4, 4), "x")}, None, "non-numeric"),
    "negative moment diagonal": (lambda: good() | {MOMENT: -np.eye(4, dtype=np.float32)}, None, "negative"),
    "no importances": (lambda: {}, None, "holds no importances"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_importance_file_is_refused(tmp_path, case):
    arrays, meta, words = BAD[case]
    path = write(tmp_path / "im.npz", arrays(), meta)
    with pytest.raises(ImatrixError, match=words) as e:
        load_imatrix(path, CONFIG, SHAPES)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_malformed_importance_file_is_one_line_from_kimi_convert(tmp_path):
    path = write(tmp_path / "im.npz", good(), b'{"format": [2]}')
    out = tmp_path / "m.kst"
    proc = subprocess.run([sys.executable, "-m", "kimistream.convert.cli", str(REPO / "models" / "stdlib-moe"),
                           "-o", str(out), "--quant", "q2", "--imatrix", str(path), "--quiet"],
                          capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("kimi-convert: error:") and "im.npz" in lines[0], proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("stop", [KeyboardInterrupt, OSError])
def test_saving_that_fails_leaves_no_partial_file(tmp_path, monkeypatch, stop):
    calls = []
    real = np.lib.format.write_array

    def write_array(f, a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise stop("stopped")
        return real(f, a, **kw)
    monkeypatch.setattr(np.lib.format, "write_array", write_array)
    vectors = {f"t{i}": np.ones(4) for i in range(4)}
    with pytest.raises(stop):
        save_imatrix(tmp_path / "im.npz", vectors, CONFIG, 2, {n: 2 for n in vectors})
    assert list(tmp_path.iterdir()) == []


def test_an_input_of_no_rows_is_not_saved_as_nan(tmp_path):
    from kimistream.runtime.quality import ImportanceCollector
    col = ImportanceCollector()
    col(GATE, np.ones((3, 4), np.float32))
    col("model.layers.0.mlp.up_proj.weight", np.zeros((0, 4), np.float32))
    col.tokens = 3
    with np.errstate(invalid="raise"):
        col.save(tmp_path / "im.npz", CONFIG)
    im = load_imatrix(tmp_path / "im.npz", CONFIG, SHAPES)
    assert list(im) == [GATE]


@pytest.fixture(scope="module")
def bundled():
    from kimistream.runtime.bundled import default_weights
    from kimistream.runtime.model import Model
    from kimistream.runtime.weights import ModelWeights
    w = ModelWeights(default_weights(lambda m: None), cache_bytes=64 << 20)
    w.load_resident()
    yield Model(w, 1024), Model(w, 1024)       # scored and reference, each with its own cache
    w.close()


def test_perplexity_scores_a_chunk_of_logits_at_a_time(bundled):
    from kimistream.runtime.quality import evaluate, log_softmax
    m, ref = bundled
    ids = list(np.random.default_rng(0).integers(5, m.cfg.vocab_size, 700))
    window, batch = 600, 64
    calls = []
    tracemalloc.start()
    try:
        rep = evaluate(m, ids, window, batch, reference=ref, progress=calls.append)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # a whole window's logits would be 600 x vocab x 4 bytes, and three float64 copies of them
    whole = window * m.cfg.vocab_size * 4
    assert peak < 2 * whole, (peak, whole)
    assert calls == [batch] * 9 + [600 - 9 * batch] + [batch, 100 - batch], calls
    # the same numbers as scoring each window's logits at once
    nll, n = 0.0, 0
    for s in (0, 600):
        m.reset()
        w = ids[s:s + window]
        lp = log_softmax(m.prefill(w, batch, all_logits=True))[:-1]
        nll -= lp[np.arange(len(w) - 1), w[1:]].sum()
        n += len(w) - 1
    assert rep.tokens == n == 698 and rep.windows == 2
    assert rep.nll == pytest.approx(nll / n, rel=1e-9)
    assert rep.kl_mean == pytest.approx(0, abs=1e-12) and rep.top1_agreement == 1.0


def test_self_sampling_progress_counts_every_token_it_returns(bundled):
    from kimistream.runtime.quality import sample_sequences
    done = []
    for lanes in (1, 3):
        seqs = sample_sequences(bundled[0], [1], set(), 70, 16, 64, seed=3, progress=done.append, lanes=lanes)
        assert sum(done) == sum(map(len, seqs)) >= 70
        done.clear()



def test_windows_of_one_token_are_refused_not_called_a_short_text(bundled):
    from kimistream.runtime.quality import evaluate
    with pytest.raises(ValueError, match="--max-context 1"):
        evaluate(bundled[0], [1, 5, 9, 3, 2], 1, 64)


def test_convert_passes_kimi_run_only_the_flags_its_calibration_reads(tmp_path):
    from argparse import Namespace

    from kimistream.convert.calibration import run_command
    args = Namespace(moment_budget="2G", self_tokens=100, seed=3, max_context=None, memory_budget=None,
                     kv_dtype=None, quiet=True)
    text = run_command(args, tmp_path / "r.kst", tmp_path / "im.npz", str(tmp_path / "cal.txt"))
    assert "--self-tokens" not in text and "--seed" not in text and text[-1] == "--quiet"
    sampled = run_command(args, tmp_path / "r.kst", tmp_path / "im.npz", "self")
    assert sampled[sampled.index("--self-tokens") + 1] == "100" and sampled[sampled.index("--seed") + 1] == "3"
