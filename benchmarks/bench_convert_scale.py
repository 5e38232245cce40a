"""Conversion throughput at scale: parameters/s of one random DeepseekV3 checkpoint converted at q2
(data-free) in one process, and through Ray with one and with two workers (a head started here on
127.0.0.1 with that many CPUs; each worker encodes with the threads of its CPUs), every Ray output
checked byte for byte against the single-process file; then the wall time those rates project for
Kimi K2 (1.03 T parameters) on one 16-core box and on 16 such nodes.

    python benchmarks/bench_convert_scale.py [--workdir DIR] [--hidden 768 --layers 8 --experts 32 ...]

The checkpoint is made with transformers (bench_llamacpp.make_checkpoint; cached in --workdir by
geometry). Needs the test and cluster extras (torch, transformers, ray).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_llamacpp as BL                                    # noqa: E402  (the checkpoint builder)

K2_PARAMS = 1_026_470_000_000          # Kimi K2's parameters with its 384 routed experts per layer
CORES_PER_NODE = 16


def convert(src: Path, out: Path, *extra) -> float:
    """Wall seconds of one conversion (its own report's encode time is in the JSON too)."""
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "kimistream.convert.cli", str(src), "-o", str(out), "--quant", "q2",
                           "--calibration", "none", "--json", "--quiet", *extra], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"bench_convert_scale: conversion failed: {proc.stderr.strip()[-2000:]}")
    wall = time.perf_counter() - t
    return wall, json.loads(proc.stdout)["throughput"]


def ray_head(cpus: int) -> tuple[str, dict, str]:
    """A head on 127.0.0.1 with `cpus` CPUs. Its session folder is a short one under /tmp: Ray puts unix
    sockets in it, whose paths may not pass 107 bytes (a folder under a deep --workdir failed to start)."""
    exe = shutil.which("ray", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if exe is None:
        raise SystemExit("bench_convert_scale: the ray command is not installed (pip install '.[cluster]')")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    port = 46000 + cpus
    subprocess.run([exe, "stop", "--force"], capture_output=True, env=env)
    tmp = tempfile.mkdtemp(prefix="kray", dir="/tmp")
    proc = subprocess.run([exe, "start", "--head", "--port", str(port), "--num-cpus", str(cpus), "--include-dashboard",
                           "false", "--disable-usage-stats", f"--temp-dir={tmp}"], capture_output=True, text=True,
                          env=env)
    if proc.returncode:
        shutil.rmtree(tmp, ignore_errors=True)
        last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["no output"]
        raise SystemExit(f"bench_convert_scale: ray start failed: {last[0]}")
    return f"127.0.0.1:{port}", env, tmp


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "kimi-bench-convert"))
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--moe-intermediate", type=int, default=768)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    geo = argparse.Namespace(**{**vars(BL.build_parser().parse_args([])), "hidden": a.hidden, "layers": a.layers,
                                "experts": a.experts, "moe_intermediate": a.moe_intermediate,
                                "dense_intermediate": 4 * a.hidden, "vocab": 32000})
    cfg = BL.hf_config(geo)
    work = Path(a.workdir) / BL.cache_key(cfg, geo.seed)
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "hf"
    if not ckpt.exists():
        BL.make_checkpoint(cfg, ckpt, geo.seed)
    params = BL.param_count(cfg)["total"]
    rows = {}
    wall, tp = convert(ckpt, work / "local.kst")
    rows["one process (encoder threads on every core)"] = (wall, tp)
    reference = (work / "local.kst").read_bytes()
    for cpus in (1, 2):
        address, env, tmp = ray_head(cpus)
        try:
            out = work / f"ray{cpus}.kst"
            wall, tp = convert(ckpt, out, "--ray", address)
            if out.read_bytes() != reference:
                raise SystemExit(f"bench_convert_scale: {out} differs from the single-process file")
            rows[f"Ray, {cpus} worker{'s' if cpus > 1 else ''}"] = (wall, tp)
        finally:
            subprocess.run(["ray", "stop", "--force"], capture_output=True, env=env)
            shutil.rmtree(tmp, ignore_errors=True)
    one = rows["Ray, 1 worker"][1]["params_per_s"]
    two = rows["Ray, 2 workers"][1]["params_per_s"]
    per_core = two / 2
    result = {"params": params, "runs": {k: {"wall_s": round(w, 2), **t} for k, (w, t) in rows.items()},
              "ray_two_over_one": round(two / one, 3),
              "projected_k2_hours": {"one 16-core box": round(K2_PARAMS / (per_core * CORES_PER_NODE) / 3600, 1),
                                     "16 nodes of 16 cores": round(K2_PARAMS / (per_core * CORES_PER_NODE * 16) / 3600, 2)}}
    if a.json:
        print(json.dumps(result))
        return
    print(f"random DeepseekV3 checkpoint, {params:,} parameters, q2 data-free; every Ray file byte-identical to "
          f"the single-process one\n")
    print("| run | wall s | encode s | parameters/s |")
    print("| --- | --- | --- | --- |")
    for k, (w, t) in rows.items():
        print(f"| {k} | {w:.1f} | {t['seconds']:.1f} | {t['params_per_s'] / 1e6:.2f} M |")
    print(f"\nRay, two workers over one: {two / one:.2f}x")
    print(f"per core (two-worker rate / 2): {per_core / 1e6:.2f} M parameters/s; Kimi K2 at q2 data-free: "
          f"{result['projected_k2_hours']['one 16-core box']} h on one 16-core box, "
          f"{result['projected_k2_hours']['16 nodes of 16 cores']} h on 16 such nodes (linear in cores)")


if __name__ == "__main__":
    main()
