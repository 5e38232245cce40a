"""What the integer kernels' activation rounding costs in quality: on each bundled model and low-bit
preset, the logits of one-token decode steps (integer kernels) against the logits of the same
positions computed with exactly dequantized weights (a prompt of 96 tokens with 16-bit inputs: row
blocks + BLAS, no rounding of x), over held-out text, for each rounding of the products' inputs
(`kimi-run --activations`): auto (int8 per 128 values for q2/q1 weights, the default), int8 (q4/q6
too) or int16 (16 bits per 32 values everywhere); with --x8-levels N,... also auto and int8 with the
int8 inputs rounded to -N .. N instead of -127 .. 127 (`kernels.set_x8_levels`: what a kernel that
looks up sums of four inputs in byte tables, the q1t codec, costs at N = 31).

Reported per rounding: mean KL(exact || decode path), the largest relative logit difference and
top-1 agreement; then the decode path's KL against the f32 model's logits (what a user gets), and the
prompt path's (one 96-token prefill with that rounding, which products of fewer than
`kernels.X8_BLAS_MIN_TOKENS` tokens take, as in `kimi-run --perplexity`), next to the exact KL
against f32, for scale.

    python benchmarks/bench_activation_rounding.py [--presets q2,t1,q1] [--tokens 96] [--x8-levels 31]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from kimistream.runtime import kernels
from kimistream.runtime.model import Model
from kimistream.runtime.tokenizer import Tokenizer
from kimistream.runtime.weights import ModelWeights

REPO = Path(__file__).resolve().parent.parent
MODELS = {"stdlib-moe": "data/stdlib-heldout.txt", "manpages-moe": "data/manpages-heldout.txt"}


def log_softmax(a: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64)
    a = a - a.max(-1, keepdims=True)
    return a - np.log(np.exp(a).sum(-1, keepdims=True))


def kl(p_logits, q_logits) -> float:
    p, q = log_softmax(p_logits), log_softmax(q_logits)
    return float((np.exp(p) * (p - q)).sum(-1).mean())


def logits_both_ways(path: Path, ids: list[int], modes=(("int8", 127),)):
    """(exact prefill logits, {mode: one-token decode logits}, {mode: prefill logits}) at positions
    8 .. len(ids) - 1; a mode is (activations, int8 levels)."""
    w = ModelWeights(path)
    w.load_resident()
    m = Model(w, len(ids) + 1)
    steps, prompts = {}, {}
    before = kernels.activations()
    try:
        kernels.set_activations("int16")
        exact = m.prefill(ids, len(ids), all_logits=True)    # one chunk, 16-bit inputs: dequantized weights
        for mode in modes:
            kernels.set_activations(mode[0])
            kernels.set_x8_levels(mode[1])
            m.reset()
            prompts[mode] = m.prefill(ids, len(ids), all_logits=True)[8:]
            m.reset()
            m.prefill(ids[:8], 8)
            steps[mode] = np.array([m.forward([t])[0] for t in ids[8:]])   # integer kernels
    finally:
        kernels.set_activations(before)
        kernels.set_x8_levels(127)
    w.close()
    return exact[8:], steps, prompts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="q2,t1,q1")
    ap.add_argument("--tokens", type=int, default=96, help="held-out tokens per model")
    ap.add_argument("--x8-levels", default="", metavar="N,...",
                    help="also round int8 inputs to -N .. N (1-127) with auto and int8 activations")
    args = ap.parse_args()
    try:
        levels = [int(n) for n in args.x8_levels.split(",") if n]
    except ValueError:
        ap.error(f"--x8-levels: {args.x8_levels!r} is not a list of integers")
    if any(not 1 <= n <= 127 for n in levels):
        ap.error("--x8-levels: each N from 1 to 127")
    modes = [(m, 127) for m in kernels.ACTIVATIONS] + [(m, n) for n in levels if n != 127 for m in ("auto", "int8")]
    print("| model | preset | activations | KL(exact ‖ decode kernels) | max relative logit difference "
          "| top-1 agreement | decode path's KL against f32 | prompt path's KL against f32 "
          "| exact KL against f32 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for model, text in MODELS.items():
            src = REPO / "models" / model
            files = {}
            for preset in ["f32"] + args.presets.split(","):
                out = Path(tmp) / f"{model}-{preset}.kst"
                cmd = [sys.executable, "-m", "kimistream.convert.cli", str(src), "-o", str(out), "--quant", preset,
                       "--quiet"] + (["--calibration", "none"] if preset in ("q2", "t1", "q1") else [])
                subprocess.run(cmd, check=True, capture_output=True)
                files[preset] = out
            ids = _ids(files["f32"], REPO / text, args.tokens)
            ref, _, _ = logits_both_ways(files["f32"], ids, ())
            for preset in args.presets.split(","):
                exact, steps, prompts = logits_both_ways(files[preset], ids, modes)
                for mode in modes:
                    got = steps[mode]
                    name = mode[0] if mode[1] == 127 else f"{mode[0]}, int8 to ±{mode[1]}"
                    rel = np.abs(got - exact).max(-1) / np.abs(exact).max(-1)
                    agree = float((got.argmax(-1) == exact.argmax(-1)).mean())
                    print(f"| {model} | {preset} (data-free) | {name} | {kl(exact, got):.2e} | {rel.max():.2e} "
                          f"| {agree:.3f} | {kl(ref, got):.4f} | {kl(ref, prompts[mode]):.4f} | {kl(ref, exact):.4f} |",
                          flush=True)


def _ids(weights: Path, text_path: Path, n: int) -> list[int]:
    """The first n tokens of the held-out text, with the tokenizer embedded in the weight file."""
    w = ModelWeights(weights)
    meta = w.header["tokenizer"]
    tok = Tokenizer(meta.get("kind", ""), {f: w.file.blob(f) for f in meta.get("files", [])})
    w.close()
    return tok.encode(text_path.read_text()[:20000])[:n]


if __name__ == "__main__":
    main()
