"""Decode with another program busy on one core: kimi-run's default thread choice (runtime/threadtune.py)
against --threads N (all cores) and --threads 1, on an idle machine and with one busy-looping process,
in alternating rounds. Prints decode tok/s (median of the rounds) and what the default chose.

    python benchmarks/bench_busy_core.py WEIGHTS.kst [--rounds 3] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys


def busy_loop() -> subprocess.Popen:
    """A process that keeps one core busy (what another program on the machine does)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def decode(weights: str, tokens: int, extra: list[str]) -> dict:
    exe = shutil.which("kimi-run") or sys.exit("kimi-run is not on PATH")
    proc = subprocess.run([exe, "--weights", weights, "--prompt", "a" * 64, "--max-tokens", str(tokens), "--json",
                           "--quiet", "--warm-up", *extra], capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        sys.exit(f"kimi-run failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
    return json.loads(proc.stdout)["stats"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("weights")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    configs = {"default": [], f"--threads {cores}": ["--threads", str(cores)], "--threads 1": ["--threads", "1"]}
    print(f"{args.weights}: {cores} cores, {args.tokens} tokens, median of {args.rounds} alternating rounds\n")
    print("| machine | " + " | ".join(configs) + " | default / best | default chose |")
    print("| --- | " + " | ".join("---" for _ in configs) + " | --- | --- |")
    for busy in (False, True):
        hog = busy_loop() if busy else None
        try:
            speeds, chose = {k: [] for k in configs}, []
            for _ in range(args.rounds):
                for name, extra in configs.items():
                    s = decode(args.weights, args.tokens, extra)
                    speeds[name].append(s["decode_tokens_per_s"])
                    if name == "default":
                        chose.append(s["threads"])
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()
        med = {k: statistics.median(v) for k, v in speeds.items()}
        print(f"| {'one core busy' if busy else 'idle'} | " + " | ".join(f"{v:.2f}" for v in med.values())
              + f" | {med['default'] / max(med.values()):.2f} | {'; '.join(chose)} |", flush=True)


if __name__ == "__main__":
    main()
