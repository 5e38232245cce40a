"""Bandwidth of the fused kernels (runtime/kernels.py) at T = 1, in GB/s of packed weight bytes, next to
memcpy bandwidth (np.copyto of a large buffer) measured in the same run, and their ratio.

Each codec's weight (default 2048 x 7168, a Kimi K2 expert's gate projection) is encoded once and its
bytes copied into enough separate buffers (--working-set MiB) that every call reads from DRAM, not
from a cache, as an expert read from the page cache would.

    python benchmarks/bench_kernels.py [--rows 2048] [--cols 7168] [--working-set 512] [--seconds 2]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from kimistream.formats.codecs import get_codec
from kimistream.runtime import kernels

CODECS = ("q2", "q2rtn", "t1", "q1", "q4", "q6", "q8")


def memcpy_gbps(nbytes: int, seconds: float) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        np.copyto(dst, src)
        n += 1
    return n * nbytes / (time.perf_counter() - t0) / 1e9


def kernel_gbps(raw: np.ndarray, name: str, shape, copies, seconds: float):
    x = np.random.default_rng(1).standard_normal((1, shape[1])).astype(np.float32)
    kernels.linear(x, name, raw, shape)          # compile (or load from the cache)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for c in copies:
            kernels.linear(x, name, c, shape)
        n += len(copies)
    dt = (time.perf_counter() - t0) / n
    return raw.nbytes / dt / 1e9, dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=7168)
    ap.add_argument("--working-set", type=int, default=512, help="MiB of weight copies cycled through")
    ap.add_argument("--seconds", type=float, default=2.0, help="time per measurement")
    ap.add_argument("--codecs", default=",".join(CODECS))
    args = ap.parse_args()
    import numba
    nthreads = numba.get_num_threads()
    rng = np.random.default_rng(0)
    shape = (args.rows, args.cols)
    w = (rng.standard_t(4, size=shape) * 0.02).astype(np.float32)
    ws = args.working_set << 20
    print(f"weight {args.rows} x {args.cols}, T = 1, numba {numba.__version__} (threads 1 and {nthreads}), "
          f"cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}, working set {args.working_set} MiB;\n"
          f"memcpy = np.copyto of {args.working_set} MiB, one thread\n")
    print(f"| codec | bits/weight | packed MB | ms, 1 thread | GB/s, 1 thread | ms, {nthreads} threads "
          f"| GB/s, {nthreads} threads | memcpy GB/s | 1 thread / memcpy | {nthreads} threads / memcpy |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.codecs.split(","):
        raw = get_codec(name).encode(w)
        copies = [raw.copy() for _ in range(max(1, ws // raw.nbytes))]
        mc = memcpy_gbps(ws, args.seconds / 2)   # next to each kernel: the machine drifts
        numba.set_num_threads(1)
        g1, t1 = kernel_gbps(raw, name, shape, copies, args.seconds)
        numba.set_num_threads(nthreads)
        gn, tn = kernel_gbps(raw, name, shape, copies, args.seconds)
        mc = (mc + memcpy_gbps(ws, args.seconds / 2)) / 2
        bpw = get_codec(name).bits_per_weight(shape)
        print(f"| {name} | {bpw:.4f} | {raw.nbytes / 1e6:.2f} | {t1 * 1e3:.2f} | {g1:.2f} | {tn * 1e3:.2f} | {gn:.2f} "
              f"| {mc:.2f} | {g1 / mc:.3f} | {gn / mc:.3f} |", flush=True)


if __name__ == "__main__":
    main()
