"""Quantization quality on the bundled trained model, scaled down for CI (a slice of its held-out
text), through kimi-convert as a user runs it: every preset keeps its routed-expert bit budget, more
bits give lower KL, and q2 / t1 meet the project's quality targets against the round-to-nearest baseline by
default (self-calibration: text the model samples itself) and with training-split text, both lower
than the data-free fit (`--calibration none`). The full table for both trained models is
benchmarks/bench_quality.py's (RESULTS.md)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "stdlib-moe"
BUDGET = {"q2": 2.5, "t1": 1.85, "q1": 1.35}


def run(*args):
    proc = subprocess.run([sys.executable, "-m", *map(str, args)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    sys.path.insert(0, str(REPO / "training"))
    import train
    d = tmp_path_factory.mktemp("quality")
    docs = train.build_corpus("stdlib")[0]
    (d / "cal.txt").write_text("".join(text[:1500] for _, text in docs[::100])[:16000])
    (d / "held.txt").write_text((REPO / "data" / "stdlib-heldout.txt").read_text()[:8000])
    run("kimistream.convert.cli", MODEL, "-o", d / "f32.kst", "--quant", "f32", "--quiet", "--json")
    return d


# kimi-convert as a user runs it: the 1-2-bit presets self-calibrate unless told otherwise
CALIBRATION = {"default": ["--self-tokens", 4096, "--max-context", 256], "none": ["--calibration", "none"],
               "text": ["--calibration", "cal.txt", "--max-context", 256]}


def quality(d, preset, calibration):
    out = d / f"{preset}-{calibration}.kst"
    flags = [d / f if f == "cal.txt" else f for f in CALIBRATION[calibration]]
    summary = json.loads(run("kimistream.convert.cli", MODEL, "-o", out, "--quant", preset, "--quiet", "--json",
                             *flags))
    q = json.loads(run("kimistream.runtime.cli", "--weights", out, "--perplexity", d / "held.txt",
                       "--kl-reference", d / "f32.kst", "--max-context", 256, "--json", "--quiet"))["quality"]
    return summary["classes"]["routed_experts"]["bpw"], q


def test_presets_bits_kl_and_calibration(setup):
    free = {}
    for preset in ("q2", "t1", "q1"):
        bpw, q = quality(setup, preset, "none")
        assert bpw <= BUDGET[preset], (preset, bpw)
        assert q["kl_mean"] > 0 and q["perplexity"] > 1
        free[preset] = q["kl_mean"]
    assert free["q2"] < free["t1"] < free["q1"]
    _, base = quality(setup, "q2rtn-baseline", "none")
    # data-free q2 beats round-to-nearest at fewer bits (the gain correction; before it, 1.4x worse)
    assert free["q2"] < 0.8 * base["kl_mean"], (free["q2"], base["kl_mean"])
    # the default (self-calibration) for both, training-split text for q2
    kl = {(p, c): quality(setup, p, c)[1]["kl_mean"] for p, c in (("q2", "default"), ("t1", "default"),
                                                                   ("q2", "text"))}
    print(json.dumps({"data-free": free, "baseline": base["kl_mean"], "calibrated": {" ".join(k): v
                                                                                    for k, v in kl.items()}}))
    for (preset, calibration), got in kl.items():
        # calibration lowers KL, and the project's quality targets against round-to-nearest 2-bit (all else f32)
        assert got < free[preset], (preset, calibration, got, free)
        assert got <= (0.5 if preset == "q2" else 1.0) * base["kl_mean"], (preset, calibration, got, base)
