"""Several tokens through one weight: the integer kernel (each chunk's digits taken out once and
multiplied by every token), with int8 inputs (q2, q1, q4, q6) and with 16-bit ones, against
dequantizing blocks of rows and numpy's BLAS, in one run, to choose `kernels.BLAS_MIN_TOKENS` and
which codecs take int8 at every token count; and the BLAS itself against torch's CPU matmul (the same dequantized blocks
through `torch.matmul`, and one float32 product of the whole weight through each), to choose the
library prefill multiplies with.

    python benchmarks/bench_prefill_kernel.py [--codec q2] [--shape 2048x7168] [--tokens 2,8,24,48,96,256]
                                              [--threads 2] [--no-torch]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from kimistream.convert.encoder import encode
from kimistream.formats import blas
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
    ap.add_argument("--no-torch", action="store_true", help="leave torch out (it takes a few seconds to import)")
    args = ap.parse_args()
    rows, cols = (int(v) for v in args.shape.split("x"))
    rng = np.random.default_rng(0)
    c = get_codec(args.codec)
    _, g, raw = kernels._prepare(args.codec, encode(c, (rng.standard_t(4, size=(rows, cols)) * 0.02).astype(np.float32)),
                                 (rows, cols))
    jobs = kernels._linear_jobs(rows, cols)
    blas.set_threads(args.threads)
    kernels.set_threads(args.threads)
    kernels.set_decoding(False)
    torch = None
    if not args.no_torch:
        import torch
        torch.set_num_threads(args.threads)
    dense = kernels.dequantize(args.codec, raw, (rows, cols))

    def torch_blocks(x, y):
        """kernels._dequantized_matmul with torch.matmul in numpy's place"""
        step = max(kernels.MIN_BLOCK_ROWS, kernels.BLOCK_BYTES // (4 * cols) // 8 * 8)
        buf = np.empty((min(step, rows), cols), np.float32)
        tx, ty = torch.from_numpy(x), torch.from_numpy(y)
        for r0 in range(0, rows, step):
            blk = buf[:min(step, rows - r0)]
            _qdot.dequantize(raw, g, r0, blk, 1)
            ty[:, r0:r0 + blk.shape[0]] = tx @ torch.from_numpy(blk).T

    print(f"{args.codec} {rows}x{cols}, {args.threads} threads, instruction set {kernels.isa()}, "
          f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}"
          + (f", torch {torch.__version__} (MKL: {torch.backends.mkl.is_available()})"
             if torch else "") + "\n")
    head = ("| tokens | integer kernel, int8 inputs, ms (GFLOP/s) | integer kernel, 16-bit inputs | dequantize + numpy BLAS "
            "| dequantize + torch | f32 numpy | f32 torch |")
    print(head + "\n" + "| --- " * 7 + "|")

    def integer(x, y, T, mode):
        kernels.set_activations(mode)
        try:
            return timed(lambda: _qdot.rows(raw, g[None, :], x, jobs, y.reshape(-1), args.threads, T, rows))
        finally:
            kernels.set_activations("auto")
    int8 = args.codec in kernels.X8_CODECS and cols % (256 if args.codec == "q1" else kernels.X8_BLOCK) == 0
    for T in (int(t) for t in args.tokens.split(",")):
        x = rng.standard_normal((T, cols)).astype(np.float32)
        y = np.empty((T, rows), np.float32)
        flop = 2 * T * rows * cols
        cells = [integer(x, y, T, "int8") if int8 else None, integer(x, y, T, "int16"),
                 timed(lambda: kernels._dequantized_matmul(x, raw, g, rows, cols, y, args.codec))]
        if torch:
            tx, td = torch.from_numpy(x), torch.from_numpy(dense)
            cells += [timed(lambda: torch_blocks(x, y)), timed(lambda: np.matmul(x, dense.T, out=y)),
                      timed(lambda: tx @ td.T)]
        print(f"| {T} | " + " | ".join("n/a" if t is None else f"{t * 1e3:.2f} ({flop / t / 1e9:.1f})" for t in cells)
              + " |", flush=True)

if __name__ == "__main__":
    main()
