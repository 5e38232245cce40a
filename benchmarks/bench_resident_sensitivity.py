"""What each step down of a resident class costs in quality: the measurements behind
`formats/memplan.py`'s RESIDENT_STEP_KL (the order in which `--memory-budget` lowers resident
classes to make a plan fit). For each trained bundled model, the q2 preset converted data-free, then
the same with one resident class one step lower (the first step of its ladder in
formats/memplan.py), each scored against the f32 conversion on held-out text; printed as a markdown
table of mean KL and its increase over the preset.

    python benchmarks/bench_resident_sensitivity.py [--models stdlib-moe manpages-moe] [--chars 30000]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from kimistream.formats.memplan import CLASS_PATTERNS, RESIDENT_LADDER, next_rung
from kimistream.formats.presets import PRESETS

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_quality import prepare, quality_arguments, run  # noqa: E402  (shared with the quality table)


def main():
    args = quality_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]),
                             calibration=False).parse_args()
    preset = PRESETS["q2"]
    steps = [("preset", None, None)]
    for cls in RESIDENT_LADDER:
        if next_rung(cls, preset[cls]):
            steps.append((cls, preset[cls], next_rung(cls, preset[cls])))
    print("| model | class | step | mean KL | KL increase | p99 KL | top-1 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for model in args.models:
            src, held, _, ref = prepare(model, tmp, args)
            base = None
            for cls, frm, to in steps:
                out = tmp / f"{model}-{cls}.kst"
                over = [] if cls == "preset" else ["--override", f"{CLASS_PATTERNS[cls]}={to}"]
                run("kimistream.convert.cli", src, "-o", out, "--quant", "q2", "--calibration", "none", "--quiet", *over)
                q = json.loads(run("kimistream.runtime.cli", "--weights", out, "--perplexity", held, "--kl-reference",
                                   ref, "--max-context", args.context, "--json", "--quiet"))["quality"]
                base = q["kl_mean"] if base is None else base
                step = "q2 preset, data-free" if cls == "preset" else f"{frm} → {to}"
                print(f"| {model} | {cls if frm else '—'} | {step} | {q['kl_mean']:.5f} | {q['kl_mean'] - base:+.5f} | "
                      f"{q['kl_p99']:.4f} | {q['top1_agreement']:.2%} |", flush=True)


if __name__ == "__main__":
    main()
