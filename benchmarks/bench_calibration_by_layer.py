"""Calibration layer by layer against the token-major pass it replaced, on the trained bundled
models. For each model, its q2 data-free conversion is measured over the same calibration text
(training split, windows of --context, chunks of 64 tokens), with an expert cache of a quarter of the
file's experts: token-major and layer by layer in this process with the default moment budget (the
comparison of the two passes), and with kimi-run --calibration under a memory budget of that size
(which also caps the second moments to what the budget leaves). Each importance matrix converts the
model at q2, and the files are scored against the f32 conversion on held-out text. Printed as a
markdown table: expert bytes read per pass (and as a multiple of the file's expert bytes), seconds,
and the KL of the resulting files.

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


def in_process(kst: Path, text: Path, window: int, cache_experts: int, out: Path, by_layer: bool) -> dict:
    """One pass in this process with an expert cache of `cache_experts` experts and the default moment
    budget: token-major (`collect_importance`, what every calibration ran before) or layer by layer;
    its imatrix saved to `out`."""
    from kimistream.runtime.model import Model
    from kimistream.runtime.quality import collect_importance, collect_importance_by_layer, windows
    from kimistream.runtime.tokenizer import Tokenizer
    from kimistream.runtime.weights import ModelWeights
    w = ModelWeights(kst)
    eb = max(e.nbytes for e in w.file.extents if e.kind == "expert")
    w.close()
    w = ModelWeights(kst, cache_bytes=cache_experts * eb)
    w.load_resident()
    meta = w.header["tokenizer"]
    tok = Tokenizer(meta["kind"], {n: w.file.blob(n) for n in meta["files"]})
    chunks = list(windows(tok.encode(text.read_text()), window))
    col = (collect_importance_by_layer if by_layer else collect_importance)(Model(w, window), chunks, 64)
    col.save(out, w.header["config"])
    rep = {"expert_bytes_read": w.pager.stats.bytes_read,
           "file_expert_bytes": sum(e.nbytes for e in w.file.extents if e.kind == "expert")}
    w.close()
    return rep


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
            fixed = plan["budget"] - plan["expert_cache"]
            tight = fixed + plan["total_experts"] // 4 * plan["expert_bytes"]
            quarter = plan["total_experts"] // 4
            for label in ("token-major", "layer by layer", "kimi-run, budget"):
                im = tmp / f"{model}-{label[:5]}.npz"
                t0 = time.perf_counter()
                if label != "kimi-run, budget":
                    rep = in_process(df, cal, args.context, quarter, im, by_layer=label == "layer by layer")
                else:     # a quarter's room under a memory budget (+512 KiB: the measured baseline drifts)
                    rep = json.loads(run("kimistream.runtime.cli", "--weights", df, "--calibration", cal, "--imatrix-out",
                                         im, "--memory-budget", tight + (512 << 10), *window, "--prefill-batch-size",
                                         64, "--json", "--quiet"))["imatrix"]
                secs = time.perf_counter() - t0
                cache = quarter if label != "kimi-run, budget" else f"room for {quarter}"
                out = tmp / f"{model}-{label[:5]}.kst"
                run("kimistream.convert.cli", src, "-o", out, "--quant", "q2", "--imatrix", im, "--quiet")
                q = json.loads(run("kimistream.runtime.cli", "--weights", out, "--perplexity", held, "--kl-reference",
                                   ref, *window, "--json", "--quiet"))["quality"]
                read, whole = rep["expert_bytes_read"], rep["file_expert_bytes"]
                print(f"| {model} | {label} | {cache} of {plan['total_experts']} | {read / 2**20:.1f} MiB | "
                      f"{read / whole:.2f} | {secs:.1f} | {q['kl_mean']:.5f} |", flush=True)


if __name__ == "__main__":
    main()
