"""The bundled model (models/stdlib-moe, trained here): its files match their manifest, it runs
exactly like transformers on held-out text, and `kimi-run` without --weights converts it once."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import refmodels
from kimistream.formats.constants import MAGIC, VERSION
from kimistream.runtime import bundled
from kimistream.runtime.generate import generate
from kimistream.runtime.model import Model
from kimistream.runtime.sampler import Sampler
from kimistream.runtime.tokenizer import Tokenizer
from kimistream.runtime.weights import ModelWeights

REPO = Path(__file__).resolve().parent.parent
HELDOUT = REPO / "data" / "stdlib-heldout.txt"


@pytest.fixture(scope="module")
def bundled_kst(tmp_path_factory):
    from kimistream.convert.converter import convert_checkpoint
    from kimistream.formats.presets import PrecisionPlan
    out = tmp_path_factory.mktemp("bundled") / "stdlib.kst"
    convert_checkpoint(bundled.checkpoint_dir(), out, PrecisionPlan.from_preset("f32"))
    return out


def test_manifest_matches():
    bundled.verify_checkpoint()


def test_bundled_matches_transformers(bundled_kst):
    w = ModelWeights(bundled_kst)
    tok = Tokenizer("hf", {n: w.file.blob(n) for n in w.header["tokenizer"]["files"]})
    text = HELDOUT.read_text()[:2000]
    ids = tok.encode(text)[:96]
    ref = refmodels.reference_logits(bundled.checkpoint_dir(), ids)
    model = Model(w, 256)
    got = model.prefill(ids, 32, all_logits=True)
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
    model.reset()
    ours = list(generate(model, ids[:40], 32, Sampler(0.0), 16))
    assert ours == refmodels.reference_greedy(bundled.checkpoint_dir(), ids[:40], 32)


def test_kimi_run_without_weights_converts_once(tmp_path):
    """Converted once into the cache; a copy left there by a build with an older weight-file format
    (which this one refuses to read) is converted again and the stale copy removed; files it does not
    recognise are left alone."""
    env = dict(os.environ, KIMI_STREAM_CACHE=str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    stale = tmp_path / "cache" / f"{bundled.DEFAULT_MODEL}-f32-0123456789ab.kst"
    stale.write_bytes(MAGIC + (VERSION - 1).to_bytes(4, "little") + bytes(52))
    mine = tmp_path / "cache" / f"{bundled.DEFAULT_MODEL}-f32-mine.kst"
    mine.write_bytes(b"not a weight file")
    cmd = [sys.executable, "-m", "kimistream.runtime.cli", "--prompt", "import os\n", "--max-tokens", "8", "--json"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "first run: converting the bundled model" in first.stderr
    second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert second.returncode == 0 and "converting" not in second.stderr
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert a["tokens"] == b["tokens"] and len(a["tokens"]) == 8
    assert not stale.exists() and mine.exists()
    assert len(list((tmp_path / "cache").glob("*.kst"))) == 2
