"""Several tokens through one weight: the integer kernel (each chunk's digits taken out once and
multiplied by every token) against dequantizing 64-row blocks and numpy's BLAS, in one run, to choose
`kernels.BLAS_MIN_TOKENS`.

    python benchmarks/bench_prefill_kernel.py [--codec q2] [--shape 2048x7168] [--tokens 2,8,24,48,96,256]
                                              [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kimistream.convert.encoder import encode
from kimistream.formats.codecs import get_codec
from kimistream.runtime import _qdot, kernels


def timed(f, seconds: float = 0.5) -> float:
    f()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        f()
        n += 1
    return (time.perf_counter() - t0) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--codec", default="q2")
    ap.add_argument("--shape", default="2048x7168")
    ap.add_argument("--tokens", default="2,8,24,48,96,256")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    rows, cols = (int(v) for v in args.shape.split("x"))
    rng = np.random.default_rng(0)
    c = get_codec(args.codec)
    _, g, raw = kernels._prepare(args.codec, encode(c, (rng.standard_t(4, size=(rows, cols)) * 0.02).astype(np.float32)),
                                 (rows, cols))
    jobs = kernels._linear_jobs(rows, cols)
    print(f"{args.codec} {rows}x{cols}, {args.threads} threads, instruction set {kernels.isa()}\n")
    print("| tokens | integer kernel ms | GFLOP/s | dequantize + BLAS ms | GFLOP/s |\n| --- | --- | --- | --- | --- |")
    for T in (int(t) for t in args.tokens.split(",")):
        x = rng.standard_normal((T, cols)).astype(np.float32)
        y = np.empty((T, rows), np.float32)
        a = timed(lambda: _qdot.rows(raw, g[None, :], x, jobs, y.reshape(-1), args.threads, T, rows))
        b = timed(lambda: kernels._dequantized_matmul(x, raw, g, rows, cols, y, args.codec))
        flop = 2 * T * rows * cols
        print(f"| {T} | {a * 1e3:.2f} | {flop / a / 1e9:.1f} | {b * 1e3:.2f} | {flop / b / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
