"""AMX tiles on and off, in one process (`_qdot.set_amx`), where the CPU has them: the prompt's float
products of dequantized blocks (`_qdot.amx_matmul` against numpy's BLAS on the same arrays, with the
product's error against float64 for both), the several-token int8 rows (q2, sixteen-row groups) at a
few token counts, and, given a weight file, a whole prefill alternating the two settings.

    python benchmarks/bench_amx.py [--matmuls 256x512x1024,256x3072x512,256x1024x2048]
                                   [--tokens 16,24,48,128] [--threads 2] [--prefill WEIGHTS.kst]
                                   [--prompt-tokens 256] [--rounds 6]

Times are medians of alternating rounds; a product's shape is tokens x rows x columns.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def timed(fn, seconds: float = 0.3) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--matmuls", default="256x512x1024,256x3072x512,256x1024x2048")
    ap.add_argument("--tokens", default="16,24,48,128")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", help="a weight file: time a whole prefill with tiles on and off")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "KIMI_STREAM_THREADS"):
        os.environ[var] = str(args.threads)
    import kimistream.runtime  # noqa: F401  (first, as kimi-run: it sets OpenBLAS's spin before numpy loads)
    import numpy as np

    from kimistream.convert.encoder import encode
    from kimistream.runtime import _qdot, kernels

    if not _qdot.amx():
        sys.exit("bench_amx: this CPU (or its OS) has no AMX tiles")
    rng = np.random.default_rng(0)
    print(f"threads {args.threads}, VNNI level {_qdot.vnni()}\n")
    print("| float product (tokens x rows x columns) | AMX ms | BLAS ms | speed-up | error AMX | error BLAS |")
    print("| --- | --- | --- | --- | --- | --- |")
    for spec in args.matmuls.split(","):
        T, n, k = (int(v) for v in spec.split("x"))
        x = rng.standard_normal((T, k)).astype(np.float32)
        w = (rng.standard_t(3, (n, k)) * 0.02).astype(np.float32)
        out = np.empty((T, n), np.float32)
        ref = x.astype(np.float64) @ w.astype(np.float64).T
        _qdot.amx_matmul(x, w, out, args.threads)
        err_amx = float(np.abs(out - ref).max() / np.abs(ref).max())
        err_blas = float(np.abs(x @ w.T - ref).max() / np.abs(ref).max())
        amx, blas = [], []
        for _ in range(args.rounds):
            amx.append(timed(lambda: _qdot.amx_matmul(x, w, out, args.threads)))
            blas.append(timed(lambda: np.matmul(x, w.T, out=out)))
        a, b = statistics.median(amx), statistics.median(blas)
        print(f"| {spec} | {a * 1e3:.3f} | {b * 1e3:.3f} | {b / a:.2f}x | {err_amx:.1e} | {err_blas:.1e} |")

    shape = (1024, 1024)
    raw = encode("q2", (rng.standard_t(3, shape) * 0.02).astype(np.float32))
    lin = kernels.Linear("q2", raw, shape)
    print("\n| q2 1024x1024, tokens | tiles ms | 512-bit loop ms | speed-up | same bits |")
    print("| --- | --- | --- | --- | --- |")
    for T in (int(v) for v in args.tokens.split(",")):
        x = rng.standard_normal((T, shape[1])).astype(np.float32)
        on, off = [], []
        try:
            for _ in range(args.rounds):
                _qdot.set_amx(True)
                on.append(timed(lambda: lin(x)))
                y_on = lin(x)
                _qdot.set_amx(False)
                off.append(timed(lambda: lin(x)))
                y_off = lin(x)
        finally:
            _qdot.set_amx(True)
        a, b = statistics.median(on), statistics.median(off)
        print(f"| {T} | {a * 1e3:.3f} | {b * 1e3:.3f} | {b / a:.2f}x | {np.array_equal(y_on, y_off)} |")

    if args.prefill:
        from kimistream.formats.memplan import activation_bytes
        from kimistream.runtime.model import Model
        from kimistream.runtime.weights import ModelWeights
        w = ModelWeights(args.prefill)
        w.load_resident()
        context = args.prompt_tokens + 16
        m = Model(w, context)
        kernels.keep_heap(activation_bytes(m.cfg, args.prompt_tokens, context, 0))
        ids = [int(i) for i in rng.integers(0, m.cfg.vocab_size, args.prompt_tokens)]
        m.prefill(ids, args.prompt_tokens)       # warm: every expert and kernel touched once
        m.reset()
        times = {True: [], False: []}
        try:
            for _ in range(args.rounds):
                for on in (False, True):
                    _qdot.set_amx(on)
                    t = time.perf_counter()
                    m.prefill(ids, args.prompt_tokens)
                    times[on].append(time.perf_counter() - t)
                    m.reset()
        finally:
            _qdot.set_amx(True)
        on, off = (args.prompt_tokens / statistics.median(times[v]) for v in (True, False))
        print(f"\n{args.prefill}: {args.prompt_tokens}-token prefill, tiles {on:.1f} tok/s, without {off:.1f} "
              f"tok/s ({on / off:.3f}x; medians of {args.rounds} alternating rounds)")


if __name__ == "__main__":
    main()
