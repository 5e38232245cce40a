"""What checking each expert's checksum on its first read costs kimi-run on a cold cache: decode
tokens/s with the check (the default) against the same runs with it switched off in-process,
alternating, on bench_stream's I/O-bound synthetic model (48 MiB f32 experts, O_DIRECT reads, a
budget that makes experts miss).

    python benchmarks/bench_verify.py [--dir /var/tmp/kimi-bench] [--tokens 8] [--rounds 3] [--budget 600M]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_stream import evict, geometry, make  # noqa: E402

# kimi-run with the pager's first-read check replaced by a no-op (the only difference)
UNCHECKED = ("import sys; from kimistream.runtime.pager import ExpertPager; "
             "ExpertPager._verify = lambda self, key, data: None; "
             "from kimistream.runtime.cli import main; sys.exit(main(sys.argv[1:]))")


def run(check: bool, path: Path, args) -> dict:
    flags = ["--weights", str(path), "--json", "--quiet", "--prompt", "x", "--max-tokens", str(args.tokens),
             "--memory-budget", args.budget, "--prefetch", "off", "--max-context", "256", "--io", "pread", "--direct"]
    cmd = [sys.executable, "-m", "kimistream.runtime.cli", *flags] if check else [sys.executable, "-c", UNCHECKED, *flags]
    evict(path)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr)
    return json.loads(proc.stdout)["stats"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp/kimi-bench")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", default="600M")
    args = ap.parse_args()
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    path = make(d, "cold", geometry(1024, 4096, 5, 16, 2), sparse=False)
    tps = {True: [], False: []}
    for _ in range(args.rounds):
        for check in (True, False):
            tps[check].append(run(check, path, args)["decode_tokens_per_s"])
    on, off = statistics.median(tps[True]), statistics.median(tps[False])
    print(json.dumps({"model": str(path), "decode_tokens_per_s_checked": tps[True],
                      "decode_tokens_per_s_unchecked": tps[False], "median_ratio": round(on / off, 4)}, indent=2))


if __name__ == "__main__":
    main()
