"""Decode speed of kimi-run against plain transformers on the same checkpoint, measured in one run,
reported as a ratio; plus conversion peak RSS (OS-measured, getrusage of the child) against the
checkpoint's largest tensor and total size.

    python benchmarks/bench_decode.py [--model models/stdlib-moe] [--tokens 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def child_peak_rss(cmd, env=None) -> tuple[subprocess.CompletedProcess, int]:
    """Run cmd in a fresh process and return its peak RSS (bytes) from wait4's rusage."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    _, status, ru = os.wait4(p.pid, 0)
    out, err = p.stdout.read(), p.stderr.read()
    return subprocess.CompletedProcess(cmd, os.waitstatus_to_exitcode(status), out, err), ru.ru_maxrss * 1024


def transformers_tokens_per_s(model_dir: Path, ids, n: int, threads: int) -> float:
    import torch
    from transformers import DeepseekV3ForCausalLM
    torch.set_num_threads(threads)
    model = DeepseekV3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=4, do_sample=False, pad_token_id=0)
        t = time.perf_counter()
        model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
        return n / (time.perf_counter() - t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(REPO / "models" / "stdlib-moe"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", default="import os\nimport sys\n\n\ndef main(argv):\n")
    args = ap.parse_args()
    model_dir = Path(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        kst = Path(tmp) / "m.kst"
        conv, conv_rss = child_peak_rss([sys.executable, "-m", "kimistream.convert.cli", str(model_dir), "-o",
                                         str(kst), "--quant", "f32", "--json", "--quiet"])
        assert conv.returncode == 0, conv.stderr
        summary = json.loads(conv.stdout)
        run, run_rss = child_peak_rss([sys.executable, "-m", "kimistream.runtime.cli", "--weights", str(kst),
                                       "--prompt", args.prompt, "--max-tokens", str(args.tokens), "--json",
                                       "--threads", str(args.threads), "--quiet"])
        assert run.returncode == 0, run.stderr
        rep = json.loads(run.stdout)
    ours = rep["stats"]["decode_tokens_per_s"]
    theirs = transformers_tokens_per_s(model_dir, rep["prompt_tokens"], args.tokens, args.threads)
    from safetensors import safe_open
    largest = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "np") as st:
            for k in st.keys():
                sl = st.get_slice(k)
                n = 1
                for d in sl.get_shape():
                    n *= d
                largest = max(largest, n * 4)
    result = {
        "model": str(model_dir), "threads": args.threads, "tokens": args.tokens,
        "kimi_run_decode_tok_s": ours, "transformers_decode_tok_s": round(theirs, 2),
        "ratio_ours_over_transformers": round(ours / theirs, 2),
        "kimi_run_peak_rss_bytes": run_rss, "kimi_run_resident_bytes": rep["stats"]["resident_bytes"],
        "experts_touched": rep["stats"]["experts_touched"],
        "convert_peak_rss_bytes": conv_rss, "converted_bytes": summary["total"]["file_bytes"],
        "largest_tensor_f32_bytes": largest,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
