"""Where a warm decode step goes: the step's wall time, the time inside each C kernel it calls
(`runtime/_qdot.c`), and what is left (Python between the calls), on a weight file whose experts all
fit in memory. A prompt fills the cache first, so attention runs at depth --prompt-tokens and up.

    python benchmarks/bench_decode_step.py --weights FILE.kst [--prompt-tokens 256] [--steps 100]
                                           [--activations auto] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

from kimistream.runtime import _qdot, kernels
from kimistream.runtime.model import Model
from kimistream.runtime.weights import ModelWeights


class _Timed:
    """_qdot with every function timed into `spent` (a few hundred ns of overhead per call)."""

    def __init__(self, spent: dict):
        self._spent = spent

    def __getattr__(self, name):
        f = getattr(_qdot, name)
        if not callable(f):
            return f

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                self._spent[name] = self._spent.get(name, 0.0) + time.perf_counter() - t
        return timed


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--activations", default="auto", choices=kernels.ACTIVATIONS)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    kernels.set_threads(args.threads)
    kernels.set_activations(args.activations)
    w = ModelWeights(args.weights, prefetch="off")
    w.load_resident()
    vocab = w.config.vocab_size
    m = Model(w, args.prompt_tokens + 2 * args.steps + 32, "f16")
    m.prefill([(i * 7919) % (vocab - 200) + 100 for i in range(args.prompt_tokens)], args.prompt_tokens)
    for i in range(16):                                  # warm-up: every expert a step needs is mapped
        m.forward([5 + i % 7])
    plain = time.perf_counter()
    for i in range(args.steps):
        m.forward([5 + i % 7])
    plain = (time.perf_counter() - plain) / args.steps
    spent: dict = {}
    kernels._qdot = _Timed(spent)
    try:
        t = time.perf_counter()
        for i in range(args.steps):
            m.forward([5 + i % 7])
        step = (time.perf_counter() - t) / args.steps
    finally:
        kernels._qdot = _qdot
    w.close()
    ms = {k: v / args.steps * 1e3 for k, v in spent.items()}
    print(f"decode step {plain * 1e3:.2f} ms untimed, {step * 1e3:.2f} ms with the kernels timed "
          f"({args.steps} steps at depth {args.prompt_tokens}+, {args.threads} threads, activations {args.activations})\n")
    print("| kernel | ms per step |\n| --- | --- |")
    for k, v in sorted(ms.items(), key=lambda kv: -kv[1]):
        if v >= 0.005:
            print(f"| {k} | {v:.2f} |")
    c = sum(ms.values())
    print(f"| all kernels | {c:.2f} |\n| outside the kernels (Python): the untimed step less the kernels "
          f"| {plain * 1e3 - c:.2f} |")


if __name__ == "__main__":
    main()
