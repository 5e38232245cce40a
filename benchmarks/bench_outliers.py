"""Reconstruction error of the outlier-carrying codecs (q2, t1, q1) on heavy-tailed weights of Kimi
K2's expert shape, data-free: the whole weight, its outliers alone, and the products with random
inputs, each relative. Run it under another build (PYTHONPATH pointing at an older checkout's
packages) to compare weight-file formats on the same weights.

    python benchmarks/bench_outliers.py [--shape 256x7168] [--df 3] [--seed 0]
"""

from __future__ import annotations

import argparse

import kimistream.runtime  # noqa: F401  (first: it sets OpenBLAS's spin before numpy loads)
import numpy as np

from kimistream.convert.encoder import encode
from kimistream.formats.codecs import get_codec


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="256x7168")
    ap.add_argument("--df", type=float, default=3.0, help="student-t degrees of freedom of the weights")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    shape = tuple(int(v) for v in a.shape.split("x"))
    rng = np.random.default_rng(a.seed)
    print("| codec | outliers per row | weight | outliers | outputs |\n| --- | --- | --- | --- | --- |")
    for name in ("q2", "t1", "q1"):
        c = get_codec(name)
        w = (rng.standard_t(a.df, size=shape) * 0.02).astype(np.float32)
        raw = encode(c, w)
        g = c.geometry(shape)
        d = c.decode(raw, shape)
        ocol = np.asarray(raw[g.off_ocol:g.off_oval]).view("<u2").reshape(g.rows, g.k).astype(np.int64)
        x = rng.standard_normal((64, shape[1])).astype(np.float32)
        print(f"| {name} | {g.k} | {rel(d, w):.5f} | {rel(np.take_along_axis(d, ocol, 1), np.take_along_axis(w, ocol, 1)):.2e} "
              f"| {rel(x @ d.T, x @ w.T):.5f} |")


if __name__ == "__main__":
    main()
