"""Two builds of the C kernels (runtime/_qdot.c) on the same weight in one process: this checkout's
and another compiled extension (e.g. built from an older commit), called in alternation so that the
machine's drift between minutes falls on both alike. Prints each build's median time per call and
the speed ratio. Only speed is compared: builds of different weight-file formats read the same
bytes differently.

    python benchmarks/bench_kernel_ab.py OTHER_QDOT.so [--codec q2] [--shape 2048x7168] [--tokens 1]
                                         [--threads 2] [--rounds 20] [--heads NH:NOPE:V]
                                         [--attend NH:R:DR:S]

--heads NH:NOPE:V times the transposed product of absorbed attention instead (`heads_t`: each
head's NOPE query values times its NOPE key rows of kv_b, a weight of NH * (NOPE + V) rows; the
columns are --shape's, e.g. `--codec q4 --shape 0x512 --heads 64:128:128` for Kimi K2's kv_b).
--attend NH:R:DR:S times one decode token's attention over S positions of binary16 caches instead
(`attend`: NH heads, a latent of R and rotated keys of DR values per position); every call reads
another copy of the caches, as a decode step finds a layer's rows after the whole model went by.

To build the other side: `git worktree add /tmp/old COMMIT && (cd /tmp/old && python setup.py
build_ext --inplace)`, then pass /tmp/old/runtime/_qdot.*.so.
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import kimistream.runtime  # noqa: F401  (first: it sets OpenBLAS's spin before numpy loads)
import numpy as np

from kimistream.convert.encoder import encode
from kimistream.formats.codecs import get_codec
from kimistream.runtime import _qdot, kernels


def load_other(path: str):
    spec = importlib.util.spec_from_file_location("_qdot", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("other", help="the other build's compiled _qdot extension")
    ap.add_argument("--codec", default="q2")
    ap.add_argument("--shape", default="2048x7168")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--heads", default=None, metavar="NH:NOPE:V",
                    help="time heads_t on a kv_b of NH heads (the rows of --shape are ignored)")
    ap.add_argument("--attend", default=None, metavar="NH:R:DR:S",
                    help="time one token's attention over S positions instead (--codec, --shape ignored)")
    a = ap.parse_args()
    other = load_other(a.other)
    if a.attend:
        return attend_ab(other, a)
    rows, cols = (int(v) for v in a.shape.split("x"))
    if a.heads:
        nh, nope, vdim = (int(v) for v in a.heads.split(":"))
        rows = nh * (nope + vdim)
    rng = np.random.default_rng(0)
    _, g, raw = kernels._prepare(a.codec, encode(get_codec(a.codec), (rng.standard_t(4, size=(rows, cols)) * 0.02)
                                                 .astype(np.float32)), (rows, cols))
    jobs = kernels._linear_jobs(rows, cols)
    kernels.set_threads(a.threads)
    kernels.set_decoding(a.tokens == 1)
    int8 = sum(1 << get_codec(c).kind for c in kernels._x8_codecs())
    for mod in (other, _qdot):
        try:
            mod.set_x8(int8)
        except ValueError:                 # an older build without this codec's int8 kernel: its 16-bit one
            print(f"(the other build has no int8 kernel for {a.codec}: it runs its 16-bit one)")
            mod.set_x8(int8 & ~(1 << get_codec(a.codec).kind))
        mod.set_spin_us(kernels.SPIN_US if a.tokens == 1 else 0)
    # one token: cycle copies of the weight so that every call reads memory, not the cache
    copies = [raw.copy() for _ in range(max(1, (256 << 20) // raw.nbytes))] if a.tokens == 1 else [raw]
    x = rng.standard_normal((a.tokens, cols)).astype(np.float32)
    y = np.empty(a.tokens * rows, np.float32)
    if a.heads:
        v = rng.standard_normal((nh, nope)).astype(np.float32)
        y = np.empty((nh, cols), np.float32)

        def call(mod, w):
            mod.heads_t(w, g, v, nope + vdim, y, a.threads)
    else:
        def call(mod, w):
            mod.rows(w, g[None, :], x, jobs, y, a.threads, a.tokens, rows)
    times = alternate(other, lambda mod, k: call(mod, copies[k % len(copies)]), a.rounds, 3 * len(copies))
    what = f"heads_t of {nh} heads x {nope} rows" if a.heads else f"{a.tokens} token(s)"
    print(f"{a.codec} {rows}x{cols}, {what}, {a.threads} threads, {a.rounds} alternating rounds")
    flops = 2 * nh * nope * cols if a.heads else 2 * a.tokens * rows * cols
    for name, t in times.items():
        print(f"  {name}: {t * 1e3:.3f} ms per call, {raw.nbytes / t / 1e9:.2f} GB/s of packed weights "
              f"(the whole tensor), {flops / t / 1e9:.1f} GFLOP/s")
    print(f"  speed, this checkout / other: {times['other'] / times['this checkout']:.3f}")


def alternate(other, call, rounds: int, n: int) -> dict:
    """Each build's median seconds per call(mod, k): rounds alternating which build goes first, each
    build's turn at least n calls and 0.15 s."""
    times = {"this checkout": [], "other": []}
    builds = [("this checkout", _qdot), ("other", other)]
    for r in range(rounds):
        for name, mod in builds if r % 2 == 0 else builds[::-1]:
            k, t0 = 0, time.perf_counter()
            while k < n or time.perf_counter() - t0 < 0.15:
                call(mod, k)
                k += 1
            times[name].append((time.perf_counter() - t0) / k)
    return {name: float(np.median(ts)) for name, ts in times.items()}


def attend_ab(other, a) -> None:
    nh, r, dr, S = (int(v) for v in a.attend.split(":"))
    rng = np.random.default_rng(0)
    q, qr = rng.standard_normal((nh, r)).astype(np.float32), rng.standard_normal((nh, dr)).astype(np.float32)
    C, K = rng.standard_normal((S, r)).astype(np.float16), rng.standard_normal((S, dr)).astype(np.float16)
    n = max(2, (128 << 20) // (C.nbytes + K.nbytes))          # copies past the last-level cache
    copies = [(C.copy(), K.copy()) for _ in range(n)]
    out = np.empty((nh, r), np.float32)
    for mod in (other, _qdot):
        mod.set_spin_us(kernels.SPIN_US)           # (a decode step's setting)
    times = alternate(other, lambda mod, k: mod.attend(q, qr, *copies[k % n], S, nh, True, 0.05, out, a.threads),
                      a.rounds, n)
    print(f"attend: {nh} heads, latent {r}, rope {dr}, {S} positions (binary16), {a.threads} threads, "
          f"{a.rounds} alternating rounds")
    flops = 2 * nh * S * (2 * r + dr)
    for name, t in times.items():
        print(f"  {name}: {t * 1e6:.1f} us per call, {flops / t / 1e9:.1f} GFLOP/s")
    print(f"  speed, this checkout / other: {times['other'] / times['this checkout']:.3f}")


if __name__ == "__main__":
    main()
