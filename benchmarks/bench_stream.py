"""Streaming benchmarks, each printing one JSON object (figures go to RESULTS.md):

  cold     cold-cache decode of an I/O-bound synthetic model against the bound
           bytes_missed_per_token / sequential_read_bandwidth, both measured in this run; prefetch
           off vs next-layer vs auto (the default, which times the two).
  big      a sparse synthetic file larger than this machine's RAM, run under a 4 GiB budget:
           peak RSS (VmHWM) against the budget.
  trained  next-layer prefetch on the trained bundled model: recall and tokens/s vs prefetch off.

    python benchmarks/bench_stream.py cold [--dir /var/tmp/kimi-bench] [--tokens 16]
    python benchmarks/bench_stream.py big  [--dir /var/tmp/kimi-bench] [--size-gib 30]
    python benchmarks/bench_stream.py trained [--model stdlib-moe|manpages-moe] [--quant q2] [--tokens 48]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from kimistream.formats.presets import PrecisionPlan
from kimistream.convert.synthetic import write_synthetic
from kimistream.runtime.pager import read_buffer


def geometry(hidden: int, inter: int, layers: int, experts: int, topk: int) -> dict:
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 512,
            "hidden_size": hidden, "intermediate_size": 2 * hidden, "moe_intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": 8, "kv_lora_rank": 64, "q_lora_rank": 128,
            "qk_rope_head_dim": 32, "v_head_dim": 64, "qk_nope_head_dim": 64, "n_routed_experts": experts,
            "num_experts_per_tok": topk, "n_shared_experts": 1, "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5, "max_position_embeddings": 4096}


def make(dirpath: Path, name: str, geom: dict, sparse: bool) -> Path:
    out = dirpath / f"{name}.kst"
    if out.exists():
        return out
    cfg = dirpath / f"{name}.json"
    cfg.write_text(json.dumps(geom))
    t = time.perf_counter()
    write_synthetic(cfg, out, PrecisionPlan.from_preset("f32"), sparse=sparse)
    print(f"# wrote {out} ({out.stat().st_size / 2**30:.1f} GiB) in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    return out


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def seq_read_bw(path: Path, nbytes: int, block: int = 8 << 20) -> float:
    """Sequential O_DIRECT read bandwidth (bytes/s) over the file's last `nbytes` (the expert region):
    what the disk gives, with no page cache in the way."""
    size = path.stat().st_size
    start = max(0, size - nbytes) // 4096 * 4096
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = read_buffer(block)          # as the pager's pool (huge pages: see read_buffer)
    t, got = time.perf_counter(), 0
    while got < nbytes:
        n = os.preadv(fd, [buf], start + got)
        if n <= 0:
            break
        got += n
    dt = time.perf_counter() - t
    os.close(fd)
    return got / dt


def kimi_run(path: Path, *args) -> dict:
    cmd = [sys.executable, "-m", "kimistream.runtime.cli", "--weights", str(path), "--json", "--quiet", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr)
    return json.loads(proc.stdout)


def cold(args):
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    # Experts of 3 x 1024 x 4096 f32 = 48 MiB: reading one costs far more than computing with it.
    path = make(d, "cold", geometry(1024, 4096, 5, 16, 2), sparse=False)
    results = {"model": str(path), "file_bytes": path.stat().st_size}
    # O_DIRECT expert reads: every miss really goes to the disk, as when the model is far larger
    # than RAM (here the page cache would otherwise hold this whole 3 GiB file after one pass).
    for prefetch in ("off", "next-layer", "auto"):
        evict(path)
        bw = seq_read_bw(path, 1 << 30)
        rep = kimi_run(path, "--prompt", "x", "--max-tokens", args.tokens, "--memory-budget", args.budget,
                       "--prefetch", prefetch, "--max-context", 256, "--io", "pread", "--direct")
        st = rep["stats"]
        missed = st["decode_bytes_read_per_token"]
        bound_s = missed / bw
        actual_s = 1.0 / st["decode_tokens_per_s"] if st["decode_tokens_per_s"] else float("inf")
        results[f"prefetch_{prefetch}"] = {
            "seq_read_bytes_per_s": round(bw), "decode_tokens_per_s": st["decode_tokens_per_s"], "bytes_missed_per_token": missed,
            "bound_tokens_per_s": round(1 / bound_s, 3) if bound_s else None,
            "fraction_of_bound": round(bound_s / actual_s, 3) if bound_s else None,
            "hit_rate": st["hit_rate"], "prefetch_recall": st["prefetch_recall"],
            "io_wait_s_per_token": st["decode_io_wait_s_per_token"],
            "compute_s_per_token": st["decode_compute_s_per_token"], "peak_rss_bytes": st["peak_rss_bytes"]}
        if prefetch == "auto":
            results["prefetch_auto"]["policy"] = st.get("prefetch_policy")
    off, on = results["prefetch_off"]["decode_tokens_per_s"], results["prefetch_next-layer"]["decode_tokens_per_s"]
    results["prefetch_speedup"] = round(on / off, 3) if off else None
    auto = results["prefetch_auto"]["decode_tokens_per_s"]
    results["auto_over_best"] = round(auto / max(off, on), 3) if max(off, on) else None
    print(json.dumps(results, indent=2))


def trained(args):
    """Prefetch on the trained bundled model: recall, and tokens/s against --prefetch off, with the
    expert cache a quarter of the experts and every miss an O_DIRECT read."""
    import tempfile
    repo = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        kst = Path(tmp) / "stdlib.kst"
        subprocess.run([sys.executable, "-m", "kimistream.convert.cli", str(repo / "models" / args.model), "-o",
                        str(kst), "--quant", args.quant, "--quiet", "--json"], check=True, capture_output=True)
        plan = kimi_run(kst, "--dry-run", "--memory-budget", "10G", "--max-context", 512)["memory_plan"]
        target = max(plan["total_experts"] // 4, 2 * plan["min_cache_experts"])
        budget = (plan["baseline"] + plan["resident"] + plan["metadata"] + plan["kv_cache"] + plan["activations"]
                  + target * plan["expert_bytes"] + (4 << 20))
        # A run's own baseline differs from the dry run's by a few MiB, more than a small model's
        # whole expert set: correct the budget until a real run plans the target cache.
        for _ in range(4):
            got = kimi_run(kst, "--prompt", "x", "--max-tokens", 1, "--memory-budget", budget, "--max-context", 512,
                           "--io", "pread", "--direct")["stats"]["expert_cache_experts"]
            if got == target:
                break
            budget -= (got - target) * plan["expert_bytes"]
        prompt = (repo / "data" / f"{args.model.split('-')[0]}-heldout.txt").read_text()[:400]
        out = {"model": args.model, "quant": args.quant, "budget_bytes": budget}
        for prefetch in ("off", "next-layer"):
            best = None
            for _ in range(3):
                evict(kst)
                st = kimi_run(kst, "--prompt", prompt, "--max-tokens", args.tokens, "--memory-budget", budget,
                              "--max-context", 512, "--io", "pread", "--direct", "--prefetch", prefetch)["stats"]
                if best is None or st["decode_tokens_per_s"] > best["decode_tokens_per_s"]:
                    best = st
            out[prefetch] = {k: best[k] for k in ("decode_tokens_per_s", "hit_rate", "prefetch_recall",
                                                  "decode_bytes_read_per_token", "decode_io_wait_s_per_token",
                                                  "decode_compute_s_per_token", "expert_cache_experts")}
        out["prefetch_speedup"] = round(out["next-layer"]["decode_tokens_per_s"] / out["off"]["decode_tokens_per_s"], 3)
    print(json.dumps(out, indent=2))


def big(args):
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    # 64 experts x 12 MoE layers x 3 x 1536 x 6144 f32 (108 MiB) ~= size-gib: holes, not bytes on disk.
    experts = max(8, int(args.size_gib * 2**30 / (12 * 3 * 1536 * 6144 * 4)))
    path = make(d, f"big-{experts}", geometry(1536, 6144, 13, experts, 2), sparse=True)
    budget = 4 * 2**30
    evict(path)
    rep = kimi_run(path, "--prompt", "hello world", "--max-tokens", args.tokens, "--memory-budget", budget,
                   "--max-context", 512)
    st = rep["stats"]
    print(json.dumps({"model": str(path), "file_bytes": path.stat().st_size, "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                      "budget_bytes": budget, "peak_rss_bytes": st["peak_rss_bytes"],
                      "within_budget": st["peak_rss_bytes"] <= budget, "decode_tokens_per_s": st["decode_tokens_per_s"],
                      "experts_touched": st["experts_touched"], "expert_cache_experts": st["expert_cache_experts"],
                      "hit_rate": st["hit_rate"], "bytes_read": st["bytes_read"]}, indent=2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("which", choices=("cold", "big", "trained"))
    ap.add_argument("--quant", default="q2", help="trained: the preset to convert the model with")
    ap.add_argument("--model", default="stdlib-moe", help="trained: stdlib-moe or manpages-moe")
    ap.add_argument("--dir", default="/var/tmp/kimi-bench")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--budget", default="600M", help="cold: the memory budget (small, so experts miss)")
    ap.add_argument("--size-gib", type=float, default=30)
    args = ap.parse_args()
    {"cold": cold, "big": big, "trained": trained}[args.which](args)


if __name__ == "__main__":
    main()
