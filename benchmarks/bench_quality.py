"""Quality per bit: every low-bit preset against the f32 conversion of each trained
model, on held-out text, converted by kimi-convert as a user runs it: self-calibrated (the default
for 1-2-bit presets: text the model samples itself), calibrated on training-split text
(`--calibration FILE`) and data-free (`--calibration none`); printed as a markdown table.

    python benchmarks/bench_quality.py [--models stdlib-moe manpages-moe] [--chars 30000] [--cal-chars 60000]
                                       [--presets q2 t1 ...] [--fits data-free calibrated ...] [--ablation]
                                       [--activations auto int16 ...] [--prefill-batch-size N]

--prefill-batch-size 1 scores every held-out token as a decode step (the one-token kernels and their
input rounding); by default the text goes through in prompt chunks. Each --activations setting (kimi-run's
flag) gives a row of its own.

Calibration text comes from the models' training split (never the held-out files), built by
training/train.py's own corpus functions.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "training"))

PRESETS = ["q2rtn-baseline", "q2", "t1", "q1"]
FITS = ["self-calibrated", "calibrated", "data-free"]


def run(*args) -> str:
    proc = subprocess.run([sys.executable, "-m", *map(str, args)], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(map(str, args))}\n{proc.stderr}")
    return proc.stdout


def quality_arguments(ap: argparse.ArgumentParser, calibration: bool = True) -> argparse.ArgumentParser:
    """The flags every quality benchmark shares: models, held-out and calibration text, window."""
    ap.add_argument("--models", nargs="+", default=["stdlib-moe", "manpages-moe"])
    ap.add_argument("--chars", type=int, default=30000, help="held-out characters scored")
    if calibration:
        ap.add_argument("--cal-chars", type=int, default=60000, help="calibration characters")
    ap.add_argument("--context", type=int, default=256, help="window; the models were trained on 257 tokens")
    return ap


def prepare(model: str, tmp: Path, args):
    """A model's source directory, its held-out text (and calibration text, with --cal-chars) in tmp,
    and its f32 conversion, the reference every KL is taken against."""
    src, corpus = REPO / "models" / model, model.split("-")[0]
    held = tmp / f"{model}-heldout.txt"
    held.write_text((REPO / "data" / f"{corpus}-heldout.txt").read_text()[:args.chars])
    cal = None
    if getattr(args, "cal_chars", None):
        cal = tmp / f"{model}-cal.txt"
        cal.write_text(calibration_text(corpus, args.cal_chars))
    ref = tmp / f"{model}-f32.kst"
    run("kimistream.convert.cli", src, "-o", ref, "--quant", "f32", "--quiet")
    return src, held, cal, ref


def calibration_text(corpus: str, chars: int) -> str:
    import train
    docs = train.build_corpus(corpus)[0]          # the training split only
    stride = max(1, len(docs) // max(1, chars // 2000))
    out, n = [], 0
    for name, text in docs[::stride]:              # spread over the corpus, 2000 characters a file
        piece = text[:2000]
        out.append(piece)
        n += len(piece)
        if n >= chars:
            break
    return "".join(out)[:chars]


def main():
    ap = quality_arguments(argparse.ArgumentParser())
    ap.add_argument("--self-tokens", type=int, default=16384,
                    help="tokens the model samples for --calibration self (default 16384)")
    ap.add_argument("--presets", nargs="+", default=PRESETS, choices=PRESETS, help="presets to convert (default: all)")
    ap.add_argument("--fits", nargs="+", default=FITS, choices=FITS,
                    help="how each preset is fitted (default: all three; self-calibration is the slowest)")
    ap.add_argument("--ablation", action="store_true",
                    help="also: importance-only calibration (--moment-budget 0) for q2 and t1, and q2 on the "
                         "routed experts alone (everything else f32) data-free / importance only / calibrated")
    ap.add_argument("--activations", nargs="+", default=["auto"], choices=["auto", "int8", "int16"],
                    help="kimi-run --activations settings to score each conversion with (default: auto)")
    ap.add_argument("--prefill-batch-size", type=int, default=None,
                    help="kimi-run --prefill-batch-size (1: every token a decode step)")
    args = ap.parse_args()
    scoring = ["--prefill-batch-size", args.prefill_batch_size] if args.prefill_batch_size else []
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for model in args.models:
            src, held, cal, ref = prepare(model, tmp, args)
            window = ["--max-context", args.context]
            flags = {"data-free": ["--calibration", "none"],
                     "calibrated": ["--calibration", cal, *window],
                     "self-calibrated": ["--self-tokens", args.self_tokens, *window],        # the default
                     "importance only": ["--calibration", cal, *window, "--moment-budget", "0"]}
            jobs = [(p, m, []) for p in args.presets for m in args.fits
                    if not (p == "q2rtn-baseline" and m != "data-free")]    # round-to-nearest fits nothing
            if args.ablation:
                experts_only = ["--override", r"^(?!.*mlp\.experts\.).*=f32"]
                jobs += [("q2", "importance only", []), ("t1", "importance only", []),
                         ("q2", "data-free, experts only", experts_only),
                         ("q2", "importance only, experts only", experts_only),
                         ("q2", "calibrated, experts only", experts_only)]
            for preset, mode, over in jobs:
                out = tmp / f"{model}-{preset}-{len(rows)}.kst"
                extra = flags[mode.split(",")[0]] + over
                s = json.loads(run("kimistream.convert.cli", src, "-o", out, "--quant", preset, "--quiet",
                                   "--json", *extra))
                for act in args.activations:
                    q = json.loads(run("kimistream.runtime.cli", "--weights", out, "--perplexity", held,
                                       "--kl-reference", ref, "--max-context", args.context, "--json",
                                       "--quiet", "--activations", act, *scoring))["quality"]
                    rows.append({"model": model, "preset": preset, "mode": mode, "activations": act,
                                 "expert_bpw": s["classes"]["routed_experts"]["bpw"], "file_bpw": s["total"]["bpw"],
                                 "tokens": q["tokens"], "perplexity": q["perplexity"],
                                 "f32_perplexity": q["reference_perplexity"], "kl_mean": q["kl_mean"],
                                 "kl_p99": q["kl_p99"], "top1": q["top1_agreement"]})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    several = len(args.activations) > 1
    print("| model | preset | fit | " + ("activations | " if several else "") +
          "routed-expert bpw | file bpw | perplexity (f32) | mean KL | p99 KL | top-1 |")
    print("| --- " * (9 + several) + "|")
    for r in rows:
        print(f"| {r['model']} | {r['preset']} | {r['mode']} | " + (f"{r['activations']} | " if several else "") +
              f"{r['expert_bpw']:.3f} | {r['file_bpw']:.3f} | "
              f"{r['perplexity']:.3f} ({r['f32_perplexity']:.3f}) | {r['kl_mean']:.5f} | {r['kl_p99']:.4f} | "
              f"{r['top1']:.2%} |")


if __name__ == "__main__":
    main()
