"""Decode mat-vec speed of the fused kernels (runtime/kernels.py) against the memory read bandwidth
measured in the same run, per codec, shape and thread count.

GB/s counts the packed bytes of the weight (codes, scales, outliers). Every call reads a different
copy of the weight, cycling through --working-set MiB of copies, so the bytes come from DRAM and not
from a cache, as an expert read from the page cache would. Read bandwidth is a C loop summing the
same working set as uint64 words (what a kernel that did no arithmetic at all could reach), on the
same threads; the ratio column is kernel GB/s over that. q2, q4 and q6 are measured with each
rounding of the input in --activations (int8 per 128 values, the default, and int16 per 32); q1t
looks its products up in tables of inputs rounded to -31 .. 31 per 128; the other codecs take int16. Last, with --routers, a float32 router's product (`kernels.matvec`, a
decode step's routing) the same way, for each E x hidden given.

    python benchmarks/bench_kernels.py [--shapes 2048x7168,7168x2048,576x7168] [--threads 1,2]
                                       [--codecs q2,t1,...] [--activations int8,int16]
                                       [--working-set 512] [--seconds 1.5] [--routers 384x7168]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from kimistream.convert.encoder import encode
from kimistream.formats.codecs import get_codec
from kimistream.runtime import _qdot, kernels

CODECS = ("q2", "t1", "q1", "q4", "q6", "q8", "q2rtn")


def read_gbps(buf: np.ndarray, seconds: float, threads: int) -> float:
    _qdot.read_sum(buf, threads)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        _qdot.read_sum(buf, threads)
        n += 1
    return n * buf.nbytes / (time.perf_counter() - t0) / 1e9


def kernel_gbps(name: str, shape, copies, x, seconds: float) -> float:
    kernels.linear(x, name, copies[0], shape)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for c in copies:
            kernels.linear(x, name, c, shape)
        n += len(copies)
    return copies[0].nbytes * n / (time.perf_counter() - t0) / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="2048x7168,7168x2048,576x7168")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--activations", default="int8,int16",
                    help="input roundings to measure q2/q4/q6 with (default int8,int16)")
    ap.add_argument("--working-set", type=int, default=512, help="MiB of weight copies cycled through")
    ap.add_argument("--seconds", type=float, default=1.5, help="time per measurement")
    ap.add_argument("--routers", default="", help="float32 routers E x hidden to time too, e.g. 384x7168")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if args.working_set < 1:
        ap.error("--working-set: at least 1 MiB")
    ws = args.working_set << 20
    rng = np.random.default_rng(0)
    buf = np.ones(ws, np.uint8)
    print(f"kernel instruction set {kernels.isa()} (VNNI level {_qdot.vnni()}), cpus {os.cpu_count()}, "
          f"load average {os.getloadavg()[0]:.2f}, working set {args.working_set} MiB, "
          f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}\n")
    print("| codec | shape | bits/weight | activations | " + " | ".join(
        f"GB/s {t}T | read GB/s {t}T | ratio {t}T" for t in threads) + " |")
    print("| --- | --- | --- | --- | " + " | ".join("--- | --- | ---" for _ in threads) + " |")
    # warm-up: the first measurement of a run otherwise pays the thread pool's start and the clock's ramp
    # (measured: q2 2048x7168 on two threads 8.9 GB/s as the first row, 12.0 right after)
    warm = encode(get_codec("q4"), (rng.standard_normal((2048, 2048)) * 0.02).astype(np.float32))
    kernels.set_threads(max(threads))
    kernel_gbps("q4", (2048, 2048), [warm], rng.standard_normal(2048).astype(np.float32), args.seconds)
    for shape in shapes:
        w = (rng.standard_t(4, size=shape) * 0.02).astype(np.float32)
        x = rng.standard_normal(shape[1]).astype(np.float32)
        for name in args.codecs.split(","):
            codec = get_codec(name)
            if not codec.supports(shape):
                continue
            raw = encode(codec, w)
            copies = [raw.copy() for _ in range(max(1, ws // raw.nbytes))]
            modes = (args.activations.split(",") if name in kernels.X8_CODECS else
                     ["lookup (-31 .. 31)"] if name == "q1t" else ["int16"])
            for mode in modes:
                if mode in kernels.ACTIVATIONS:
                    kernels.set_activations(mode)
                cells = []
                for t in threads:
                    kernels.set_threads(t)
                    rd = read_gbps(buf, args.seconds / 2, t)     # next to each kernel: the machine drifts
                    k = kernel_gbps(name, shape, copies, x, args.seconds)
                    rd = (rd + read_gbps(buf, args.seconds / 2, t)) / 2
                    cells.append(f"{k:.2f} | {rd:.1f} | {k / rd:.3f}")
                print(f"| {name} | {shape[0]}x{shape[1]} | {codec.bits_per_weight(shape):.3f} | {mode} | "
                      + " | ".join(cells) + " |", flush=True)
            del copies
    if args.routers:
        routers(args, threads, buf, rng, ws)


def routers(args, threads, buf, rng, ws: int) -> None:
    """A float32 router's product through kernels.matvec (its rows shared out over the threads from
    kernels.PARALLEL_MIN_WEIGHTS on), in microseconds a call and GB/s, next to the read bandwidth."""
    print("\n| router (float32) | " + " | ".join(f"us {t}T | GB/s {t}T | read GB/s {t}T" for t in threads) + " |")
    print("| --- | " + " | ".join("--- | --- | ---" for _ in threads) + " |")
    for spec in args.routers.split(","):
        E, hidden = (int(v) for v in spec.split("x"))
        copies = [rng.standard_normal((E, hidden)).astype(np.float32) for _ in range(max(1, ws // (4 * E * hidden)))]
        x = rng.standard_normal((1, hidden)).astype(np.float32)
        cells = []
        for t in threads:
            kernels.set_threads(t)
            rd = read_gbps(buf, args.seconds / 2, t)
            kernels.matvec(x, copies[0])
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < args.seconds:
                for c in copies:
                    kernels.matvec(x, c)
                n += len(copies)
            dt = (time.perf_counter() - t0) / n
            rd = (rd + read_gbps(buf, args.seconds / 2, t)) / 2
            cells.append(f"{dt * 1e6:.0f} | {4 * E * hidden / dt / 1e9:.2f} | {rd:.1f}")
        print(f"| {E}x{hidden} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
