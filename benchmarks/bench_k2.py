"""Kimi K2's geometry on an 8.24 GB budget: decode compute seconds per token against the memory bound,
measured in one run.

    python benchmarks/bench_k2.py [--weights /var/tmp/kimi-bench/k2-q2.kst] [--config CONFIG.json]
                                  [--quant q2] [--budget 8.24G] [--tokens 8] [--prompt-tokens N]
                                  [--repeats 2] [--configs "default;--io pread --direct"] [--threads 2]
                                  [--cap] [--json]

The weight file is a sparse synthetic one (`kimi-convert --synthetic CONFIG --sparse`, made when it is
missing): real resident weights, routed experts that are holes, so their reads cost the kernel a
zero-fill instead of a disk read. Each round runs every configuration once (`kimi-run --prompt Hello
--max-tokens N --memory-budget B --max-context 4096 --kv-dtype f16 --prefill-batch-size 32 --json`
plus the configuration's flags; with --prompt-tokens N the prompt is N lowercase letters, N tokens of
the synthetic byte tokenizer, and the table gives the prompt's speed and the expert bytes it read,
e.g. `--prompt-tokens 256 --configs "default;--prompt-window 32"` for windows a layer at a time against
32-token chunks), then measures the memory read bandwidth on the same threads
(`_qdot.read_sum` over 512 MiB). kimi-run's compute per decode token is its wall time less the time
it waited for expert reads; "read CPU" is the CPU time the reads and their checksums took on any
thread (kimi-run's own account: with the computation on both cores, time the kernels did not get;
on this sparse file most of it is the kernel's zero-fill of holes, which a disk's DMA would not
cost, and the first-read checksums). For reads that cost what a disk read costs, point --weights at
a copy whose holes are shared blocks of zeros on the disk (`benchmarks/reflink_holes.py SPARSE.kst
/mnt/kx/k2-q2.kst`, on a filesystem with reflinks): the same bytes, the experts then read from the
device, so the I/O wait is the disk's and the zero-fill is gone from the cores. With --cap (root, cgroup v1's memory controller: as
benchmarks/bench_memory_cap.py), each run is under a memory limit equal to the budget that counts the
page cache, as on a machine whose RAM is the budget, with the page cache dropped before it.

Two bounds, from the file's tensor directory and the median bandwidth:
- resident: the weights every token reads that stay in memory (all but the routed experts and the
  embedding table, plus one row of that) / bandwidth;
- all: those plus the routed experts a token is routed to (k of E per MoE layer), which the kernels
  read from memory once their reads land / bandwidth.
Each configuration's median compute per token is given over each bound.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
K2_CONFIG = HERE.parent / "tests" / "data" / "kimi-k2-instruct-config.json"
STATS = ("decode_compute_s_per_token", "decode_io_wait_s_per_token", "decode_read_cpu_s_per_token", "decode_tokens_per_s",
         "decode_bytes_read_per_token", "vm_hwm_bytes", "major_faults", "prefill_tokens_per_s", "prefill_seconds",
         "prefill_bytes_read", "prefill_io_wait_s")


def kimi_run(weights: Path, a, flags: list[str], preexec=None) -> dict:
    prompt = "Hello" if not a.prompt_tokens else "".join(chr(97 + i % 26) for i in range(a.prompt_tokens))
    cmd = [sys.executable, "-m", "kimistream.runtime.cli", "--weights", str(weights), "--prompt", prompt,
           "--max-tokens", str(a.tokens), "--memory-budget", a.budget, "--max-context", "4096",
           "--kv-dtype", "f16", "--prefill-batch-size", "32", "--threads", str(a.threads), "--json", "--quiet",
           *flags]
    p = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=preexec)
    if p.returncode != 0:
        raise SystemExit(f"bench_k2: {shlex.join(cmd)} failed: {p.stderr.strip().splitlines()[-1:]}")
    stats = json.loads(p.stdout)["stats"]
    return {k: stats[k] for k in STATS} | {"io": stats["io"], "page_cache_policy": stats["page_cache_policy"],
                                           "prompt_window": stats["prompt_window"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", type=Path, default=Path("/var/tmp/kimi-bench/k2-q2.kst"))
    ap.add_argument("--config", type=Path, default=K2_CONFIG)
    ap.add_argument("--quant", default="q2")
    ap.add_argument("--budget", default="8.24G")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=0, help="a prompt of this many tokens (default: Hello)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--configs", default="default;--io pread --direct",
                    help="kimi-run flag sets separated by ';' ('default' = no flags)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cap", action="store_true", help="each run under a cgroup memory limit of the budget")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(HERE))
    from bench_llamacpp import kst_bytes_split, read_bandwidth
    from bench_memory_cap import enter_cgroup

    from kimistream.formats.sizes import parse_size

    if not a.weights.exists():
        a.weights.parent.mkdir(parents=True, exist_ok=True)
        print(f"bench_k2: converting {a.config} to {a.weights} (sparse)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "kimistream.convert.cli", "--synthetic", str(a.config), "-o",
                        str(a.weights), "--sparse", "--quant", a.quant, "--quiet"], check=True)
    cfg = json.loads(a.config.read_text())
    resident, routed = kst_bytes_split(a.weights, cfg)
    configs = {c.strip(): ([] if c.strip() == "default" else shlex.split(c)) for c in a.configs.split(";")}
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    bandwidth = []
    for i in range(a.repeats):
        for name, flags in configs.items():
            r = kimi_run(a.weights, a, flags, enter_cgroup(parse_size(a.budget)) if a.cap else None)
            runs[name].append(r)
            print(f"bench_k2: round {i + 1}/{a.repeats} {name}: prompt {r['prefill_tokens_per_s']:.2f} tok/s; decode "
                  f"compute {r['decode_compute_s_per_token']:.3f} s/token, I/O wait {r['decode_io_wait_s_per_token']:.3f}, "
                  f"{r['decode_tokens_per_s']:.3f} tok/s ({r['io']})", file=sys.stderr)
        bandwidth.append(read_bandwidth(a.threads))
        print(f"bench_k2: round {i + 1}/{a.repeats} memory read {bandwidth[-1]:.2f} GB/s", file=sys.stderr)
    bw = statistics.median(bandwidth) * 1e9
    bound_res, bound_all = resident / bw, (resident + routed) / bw
    rows = {}
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in STATS}
        med["compute_over_resident_bound"] = med["decode_compute_s_per_token"] / bound_res
        med["compute_over_all_bound"] = med["decode_compute_s_per_token"] / bound_all
        med["samples"] = [r["decode_compute_s_per_token"] for r in rs]
        med["io"], med["page_cache_policy"] = rs[-1]["io"], rs[-1]["page_cache_policy"]
        med["prompt_window"] = rs[-1]["prompt_window"]
        rows[name] = med
    out = {"weights": str(a.weights), "budget": a.budget, "cap": a.cap, "threads": a.threads, "tokens": a.tokens,
           "prompt_tokens": a.prompt_tokens,
           "resident_bytes_per_token": resident, "routed_bytes_per_token": routed,
           "read_gb_s": bandwidth, "bound_resident_s": bound_res, "bound_all_s": bound_all, "configs": rows}
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{a.weights.name}, budget {a.budget}{' under a cgroup limit of the budget' if a.cap else ''}, {a.threads} threads, {a.tokens} tokens, median of {a.repeats}; "
          f"read bandwidth {statistics.median(bandwidth):.2f} GB/s ({', '.join(f'{b:.1f}' for b in bandwidth)})")
    print(f"bytes per decode token: resident {resident / 1e9:.2f} GB, routed experts {routed / 1e9:.2f} GB; "
          f"bounds: resident {bound_res:.3f} s, all {bound_all:.3f} s\n")
    print("| flags | prompt window | prompt tok/s | prompt s | prompt expert GB read | compute s/token (samples) "
          "| I/O wait s/token | read CPU s/token | tok/s | VmHWM GB | major faults | compute / resident bound "
          "| compute / all bound |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, m in rows.items():
        print(f"| {name} | {m['prompt_window']} | {m['prefill_tokens_per_s']:.3f} | {m['prefill_seconds']:.1f} "
              f"| {m['prefill_bytes_read'] / 1e9:.1f} "
              f"| {m['decode_compute_s_per_token']:.3f} ({', '.join(f'{s:.3f}' for s in m['samples'])}) "
              f"| {m['decode_io_wait_s_per_token']:.3f} | {m['decode_read_cpu_s_per_token']:.3f} "
              f"| {m['decode_tokens_per_s']:.3f} | {m['vm_hwm_bytes'] / 1e9:.2f} "
              f"| {m['major_faults']:.0f} "
              f"| {m['compute_over_resident_bound']:.2f} | {m['compute_over_all_bound']:.2f} |")
    for name, m in rows.items():
        print(f"\n{name}: {m['io']}; page cache: {m['page_cache_policy']}")
    print(f"\ncommand: {shlex.join([sys.executable, *sys.argv])}\nload average {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
