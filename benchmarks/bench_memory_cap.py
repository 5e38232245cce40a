"""kimi-run under a hard memory cap that includes the page cache (a cgroup v1 memory limit, as on a PC
whose RAM is smaller than the model): decode and prefill tok/s of the default flags against every
explicit pager/prefetch combination, at caps given as fractions of the weight file, the default's
ratio to the best combination of each cap, and to the disk bound (the disk's sequential read
bandwidth in 8 MiB O_DIRECT reads, measured before each round of the cap in the same run, median,
over the expert bytes a token needs). Needs root and cgroup v1's memory controller.

    sudo python benchmarks/bench_memory_cap.py WEIGHTS.kst [--caps 0.5,256M,0.25] [--repeats 2]
                                               [--tokens 32] [--llama-bench BIN --gguf MODEL.gguf]
                                               [--llama-tokens N] [--configs NAME,...] [--json]
                                               [--pairs CONFIG] [--trace-dir DIR]

Each run starts with the page cache dropped (so every expert read is a real read), the budget equal
to the cap, and a 26-letter prompt; rounds alternate the configurations so drift falls on all alike,
each round starting one configuration further on than the one before. A second table gives each
configuration's lowest and highest run, the noise a ratio between two columns sits in.
With --pairs CONFIG, each cap instead runs --repeats pairs of the default and CONFIG back to back
(order alternating, so the disk's drift falls on both alike) and gives each pair's ratio of decode
tok/s, their median, and each run's compute and wait on reads per token. --trace-dir keeps every
run's `kimi-run --trace` (one record per step) as DIR/CAP-CONFIG-N.jsonl.
With --llama-bench and --gguf (llama.cpp's own file of the same weights, e.g. the Q2_K that
benchmarks/bench_llamacpp.py makes), llama.cpp runs under the same caps in the same rounds:
`llama-bench -p 0 -n TOKENS -r 1 --repack 0` (its decode tok/s, weights memory-mapped as it does by
default; without --repack 0 it copies about 480 MiB of them into anonymous memory for its AVX2 layouts
on the 0.8 GB model, which no cap below that survives).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from kimistream.formats.sizes import fmt, parse_size
from kimistream.runtime.pager import read_buffer

CGROUP = Path("/sys/fs/cgroup/memory/kimi-bench-cap")
CONFIGS = {"default": [], "--prefetch next-layer": ["--prefetch", "next-layer"], "--prefetch off": ["--prefetch", "off"],
           "--io mmap": ["--io", "mmap"], "--io mmap --page-cache drop": ["--io", "mmap", "--page-cache", "drop"],
           "--io pread": ["--io", "pread"], "--io pread --direct": ["--io", "pread", "--direct"],
           "--page-cache keep": ["--page-cache", "keep"], "--page-cache drop": ["--page-cache", "drop"]}
LLAMA = "llama.cpp"


def enter_cgroup(cap: int):
    """The cap set, the page cache dropped; returns the preexec_fn that puts a child in the cgroup."""
    CGROUP.mkdir(exist_ok=True)
    (CGROUP / "memory.limit_in_bytes").write_text(str(cap))
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")

    def enter():
        (CGROUP / "tasks").write_text(str(os.getpid()))
    return enter


def run_capped(weights: str, cap: int, tokens: int, extra: list[str]) -> dict:
    exe = shutil.which("kimi-run") or sys.exit("kimi-run is not on PATH")
    cmd = [exe, "--weights", weights, "--memory-budget", str(cap), "--prompt", "abcdefghijklmnopqrstuvwxyz",
           "--max-tokens", str(tokens), "--json", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=enter_cgroup(cap), timeout=1800)
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout)["stats"]


def llama_capped(bench: str, gguf: str, cap: int, tokens: int) -> dict:
    """llama.cpp's decode under the cap: llama-bench's tg test alone, one repetition, two threads."""
    cmd = [bench, "-m", gguf, "-t", "2", "-p", "0", "-n", str(tokens), "-r", "1", "--repack", "0", "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=enter_cgroup(cap), timeout=7200)
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    tg = [r for r in json.loads(proc.stdout) if r.get("n_gen")]
    return {"decode_tokens_per_s": tg[0]["avg_ts"]} if tg else {"error": "llama-bench gave no tg result"}


def disk_read_bandwidth(path: str, nbytes: int = 1 << 30, buf=None) -> float:
    """Sequential read bandwidth of the file's disk in bytes/s: up to `nbytes` read from the start of
    the file in 8 MiB O_DIRECT requests (buffered reads, split by the kernel's readahead, measured as
    little as a third of this on the same disk minutes apart, and below what the pagers' reads of
    single experts reached: a bound they beat says nothing), into `buf` (8 MiB; by default one made
    as the pager's pool is, see read_buffer: into scattered 4 KiB pages it read half as fast)."""
    import time
    own = buf is None
    buf = read_buffer(8 << 20) if own else buf
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        done, t = 0, time.perf_counter()
        while done < nbytes:
            n = os.preadv(fd, [buf], done)
            if n <= 0:
                break
            done += n
        return done / (time.perf_counter() - t)
    finally:
        os.close(fd)
        if own:
            buf.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("weights")
    ap.add_argument("--caps", default="0.5,256M,0.25", help="fractions of the file or sizes (default 0.5,256M,0.25)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--llama-bench", metavar="BIN", help="llama.cpp's llama-bench, to run under the same caps")
    ap.add_argument("--gguf", metavar="MODEL", help="with --llama-bench: llama.cpp's file of the same weights")
    ap.add_argument("--llama-tokens", type=int, help="tokens per llama.cpp run (default --tokens; under a cap it "
                                                      "decodes at about 1 tok/s)")
    ap.add_argument("--configs", help="a comma-separated subset of the configurations to run (default all; "
                                      "'default' always runs): " + ", ".join(CONFIGS))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--pairs", metavar="CONFIG", help="the default against CONFIG in back-to-back pairs")
    ap.add_argument("--trace-dir", metavar="DIR", help="keep each run's step trace in DIR")
    a = ap.parse_args()
    if a.pairs is not None and a.pairs not in CONFIGS:
        sys.exit(f"--pairs: unknown configuration {a.pairs!r} (known: {', '.join(CONFIGS)})")
    if a.trace_dir:
        Path(a.trace_dir).mkdir(parents=True, exist_ok=True)
    runs = [0]

    def run(cap: int, name: str) -> dict:
        extra = list(CONFIGS[name])
        if a.trace_dir:
            runs[0] += 1
            tag = name.replace("--", "").replace(" ", "_") or "default"
            extra += ["--trace", str(Path(a.trace_dir) / f"{cap}-{tag}-{runs[0]}.jsonl")]
        return run_capped(a.weights, cap, a.tokens, extra)
    if bool(a.llama_bench) != bool(a.gguf):
        sys.exit("--llama-bench and --gguf go together")
    configs = CONFIGS
    if a.configs:
        names = ["default"] + [c.strip() for c in a.configs.split(",") if c.strip() and c.strip() != "default"]
        unknown = [c for c in names if c not in CONFIGS]
        if unknown:
            sys.exit(f"--configs: unknown configuration {unknown[0]!r} (known: {', '.join(CONFIGS)})")
        configs = {c: CONFIGS[c] for c in names}
    if not (CGROUP.parent / "memory.limit_in_bytes").exists():
        sys.exit(f"{CGROUP.parent}: no cgroup v1 memory controller here")
    size = Path(a.weights).stat().st_size
    caps = [int(float(c) * size) if "." in c and not c[-1].isalpha() else parse_size(c) for c in a.caps.split(",")]
    if a.pairs is not None:
        return pairs(a, caps, run)
    results, disks = {}, {}
    for cap in caps:
        for i in range(a.repeats):
            # this disk's speed drifts 2-4x within minutes: measured before each round, and each cap's
            # bound taken from the median of its rounds
            disks.setdefault(cap, []).append(disk_read_bandwidth(a.weights))
            # each round starts one configuration further on, so that none always runs first after the
            # disk's measurement or last before llama.cpp
            order = list(configs.items())
            for name, extra in order[i % len(order):] + order[:i % len(order)]:
                st = run(cap, name)
                results.setdefault((cap, name), []).append(st)
            if a.llama_bench:
                results.setdefault((cap, LLAMA), []).append(llama_capped(a.llama_bench, a.gguf, cap,
                                                                         a.llama_tokens or a.tokens))
    rows = []
    for cap in caps:
        med = {}
        for name in configs:
            runs = [r for r in results[(cap, name)] if "error" not in r]
            if runs:
                med[name] = {k: statistics.median(r[k] for r in runs) for k in
                             ("decode_tokens_per_s", "prefill_tokens_per_s", "peak_rss_bytes",
                              "decode_bytes_read_per_token", "prefetch_wasted_bytes")}
                med[name]["decode_samples"] = [r["decode_tokens_per_s"] for r in runs]
                med[name]["policy"] = f"prefetch {runs[-1].get('prefetch_policy')}; page cache: " \
                                      f"{runs[-1].get('page_cache_policy')}; reads: {runs[-1].get('io')}"
            else:
                med[name] = {"error": results[(cap, name)][-1]["error"]}
        best = max((v["decode_tokens_per_s"] for v in med.values() if "error" not in v), default=0)
        default = med["default"].get("decode_tokens_per_s")
        need = med["default"].get("decode_bytes_read_per_token")
        disk = statistics.median(disks[cap])
        bound = disk / need if need else None           # tok/s if every needed expert byte came off the disk
        row = {"cap": cap, "configs": med, "best_decode": best, "disk_bound_tok_s": bound,
               "disk_bytes_per_s": disks[cap],
               "default_over_disk_bound": default / bound if bound and default else None,
               "default_over_best": default / best if best and default else None}
        if a.llama_bench:
            llama = [r["decode_tokens_per_s"] for r in results[(cap, LLAMA)] if "error" not in r]
            row["llama_decode"] = statistics.median(llama) if llama else None
            row["default_over_llama"] = default / row["llama_decode"] if default and llama else None
        rows.append(row)
    if a.json:
        print(json.dumps(rows))
        return
    print(f"{a.weights}: {fmt(size)}, {a.tokens} tokens per run, median of {a.repeats}, page cache dropped before each; "
          f"disk read bandwidth measured before each round: " +
          ", ".join(f"{fmt(c)} " + "/".join(f"{d / 1e6:.0f}" for d in disks[c]) for c in caps) + " MB/s\n")
    llama_cols = [LLAMA, "default / llama.cpp"] if a.llama_bench else []
    print("| cap | " + " | ".join(list(configs) + llama_cols) + " | default / best | default / disk bound |")
    print("| --- |" + " --- |" * (len(configs) + len(llama_cols) + 2))

    def num(v, f=".2f"):
        return "—" if v is None else format(v, f)
    for r in rows:
        cells = [("refused" if "error" in v else f"{v['decode_tokens_per_s']:.2f}") for v in r["configs"].values()]
        if a.llama_bench:
            cells += [num(r["llama_decode"]), num(r["default_over_llama"], ".1f") + ("x" if r["default_over_llama"] else "")]
        print(f"| {fmt(r['cap'])} | " + " | ".join(cells) +
              f" | {num(r['default_over_best'])} | {num(r['default_over_disk_bound'])} |")
    # the spread of each configuration's runs: the noise any ratio between two columns sits in
    print("\nlowest - highest decode tok/s of each configuration's runs:\n")
    print("| cap | " + " | ".join(configs) + " |")
    print("| --- |" + " --- |" * len(configs))
    for r in rows:
        print(f"| {fmt(r['cap'])} | " + " | ".join(
            "refused" if "error" in v else f"{min(v['decode_samples']):.2f} - {max(v['decode_samples']):.2f}"
            for v in r["configs"].values()) + " |")
    print("\ndecode tok/s; default's choices: " + "; ".join(
        f"{fmt(r['cap'])}: {r['configs']['default'].get('policy')}" for r in rows))
    print("peak RSS of the default: " + ", ".join(
        f"{fmt(r['cap'])}: {fmt(r['configs']['default']['peak_rss_bytes'])}" for r in rows if "error" not in r['configs']['default']))


def pairs(a, caps, run) -> None:
    """--pairs: the default and one configuration back to back, order alternating, per cap."""
    out = []
    for cap in caps:
        ratios, lines = [], []
        for i in range(a.repeats):
            order = ["default", a.pairs] if i % 2 == 0 else [a.pairs, "default"]
            got = {name: run(cap, name) for name in order}
            if any("error" in r for r in got.values()):
                lines.append(f"| {i + 1} | " + " | ".join(got[n].get("error", "") for n in ("default", a.pairs)) + " | |")
                continue
            ratios.append(got["default"]["decode_tokens_per_s"] / got[a.pairs]["decode_tokens_per_s"])
            lines.append(f"| {i + 1} | " + " | ".join(
                f"{got[n]['decode_tokens_per_s']:.2f} ({got[n]['decode_compute_s_per_token'] * 1e3:.1f} / "
                f"{got[n]['decode_io_wait_s_per_token'] * 1e3:.1f} ms)" for n in ("default", a.pairs)) +
                f" | {ratios[-1]:.3f} |")
        med = statistics.median(ratios) if ratios else None
        out.append({"cap": cap, "ratios": ratios, "median": med})
        if not a.json:
            print(f"\n{fmt(cap)}: default against {a.pairs}, {a.tokens} tokens a run; decode tok/s (compute / "
                  f"wait on reads, per token)\n")
            print(f"| pair | default | {a.pairs} | default / {a.pairs} |\n| --- | --- | --- | --- |")
            print("\n".join(lines))
            print(f"\nmedian ratio {med:.3f}" if med is not None else "\nno pair completed")
    if a.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
