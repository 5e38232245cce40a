"""One decode token's absorbed attention over the latent cache: the C kernel (`kernels.attend`, the
cache read once for all heads, split over positions on the kernel's threads) against the batched
numpy products it replaced (one mat-vec per head, so the cache is read once per head), at several
cache lengths, with Kimi K2's per-layer shape by default (64 heads, kv_lora_rank 512, rope 64).

    python benchmarks/bench_attention.py [--heads 64] [--positions 256,1024,4096] [--threads 1,2]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from kimistream.formats import blas
from kimistream.runtime import kernels


def best_ms(fn, seconds: float = 1.0) -> float:
    fn()
    best, t_end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--rank", type=int, default=512)
    ap.add_argument("--rope", type=int, default=64)
    ap.add_argument("--positions", default="256,1024,4096")
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    nh, r, dr = args.heads, args.rank, args.rope
    q, qr = rng.standard_normal((nh, r)).astype(np.float32), rng.standard_normal((nh, dr)).astype(np.float32)
    print(f"{nh} heads, latent {r}, rope {dr}, cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}\n")
    print("| positions | threads | C kernel ms | numpy ms | speed-up |")
    print("| --- | --- | --- | --- | --- |")
    for S in (int(v) for v in args.positions.split(",")):
        C, K = rng.standard_normal((S, r)).astype(np.float32), rng.standard_normal((S, dr)).astype(np.float32)

        def numpy_path():
            s = (q[:, None, :] @ C.T[None] + qr[:, None, :] @ K.T[None])[:, 0] * 0.1
            p = np.exp(s - s.max(-1, keepdims=True))
            return (p / p.sum(-1, keepdims=True)) @ C
        for t in (int(v) for v in args.threads.split(",")):
            kernels.set_threads(t)
            blas.set_threads(t)
            c_ms = best_ms(lambda: kernels.attend(q, qr, C, K, S, 0.1))
            n_ms = best_ms(numpy_path)
            print(f"| {S} | {t} | {c_ms:.2f} | {n_ms:.2f} | {n_ms / c_ms:.2f}x |")


if __name__ == "__main__":
    main()
