"""Calibration of a model whose experts do not fit: layer-major against token-major, on the trained
bundled models. For each model, its q2 data-free conversion is measured over the same calibration
text (training split) twice with kimi-run --calibration: with room for every expert (token-major,
as before), and under a budget whose expert cache holds about a quarter of the file's experts (the
layer-by-layer pass). Each importance matrix then converts the model at q2, and both files are scored
against the f32 conversion on held-out text. Printed as a markdown table: expert bytes read per
pass (and as a multiple of the file's expert bytes), seconds, and the KL of the resulting files.

    python benchmarks/bench_calibration_by_layer.py [--models stdlib-moe manpages-moe] [--cal-chars 60000]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_quality import prepare, quality_arguments, run  # noqa: E402  (shared with the quality table)


def main():
    args = quality_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0])).parse_args()
    print("| model | pass | expert cache | experts read per pass | × file's expert bytes | seconds | mean KL of the q2 file |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for model in args.models:
            src, held, cal, ref = prepare(model, tmp, args)
            df = tmp / f"{model}-df.kst"
            run("kimistream.convert.cli", src, "-o", df, "--quant", "q2", "--calibration", "none", "--quiet")
            window = ["--max-context", args.context]
            plan = json.loads(run("kimistream.runtime.cli", "--weights", df, "--dry-run", "--json", "--memory-budget",
                                  "8G", *window, "--prefill-batch-size", 64))["memory_plan"]
            # a budget whose expert cache holds a quarter of the experts (the by-layer pass then gives
            # half of what is above the minimum to the residual stream)
            tight = plan["fixed"] + plan["total_experts"] // 4 * plan["expert_bytes"]
            for label, budget in (("token-major", "8G"), ("layer by layer", str(tight))):
                im = tmp / f"{model}-{label[:5]}.npz"
                t0 = time.perf_counter()
                rep = json.loads(run("kimistream.runtime.cli", "--weights", df, "--calibration", cal, "--imatrix-out", im,
                                     "--memory-budget", budget, *window, "--prefill-batch-size", 64, "--json",
                                     "--quiet"))["imatrix"]
                secs = time.perf_counter() - t0
                cache = json.loads(run("kimistream.runtime.cli", "--weights", df, "--dry-run", "--json", "--memory-budget",
                                       budget, *window, "--prefill-batch-size", 64))["memory_plan"]["cache_experts"]
                out = tmp / f"{model}-{label[:5]}.kst"
                run("kimistream.convert.cli", src, "-o", out, "--quant", "q2", "--imatrix", im, "--quiet")
                q = json.loads(run("kimistream.runtime.cli", "--weights", out, "--perplexity", held, "--kl-reference",
                                   ref, *window, "--json", "--quiet"))["quality"]
                read, whole = rep["expert_bytes_read"], rep["file_expert_bytes"]
                print(f"| {model} | {label} | {cache} of {plan['total_experts']} | {read / 2**20:.1f} MiB | "
                      f"{read / whole:.2f} | {secs:.1f} | {q['kl_mean']:.5f} |", flush=True)


if __name__ == "__main__":
    main()
