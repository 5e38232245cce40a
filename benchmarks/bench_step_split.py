"""Where a warm decode step and a prefill spend their time, on any weight file: tokens/s, then the
decode time split by part of the model (routed experts, attention, lm_head and other linears,
routing, the rest = Python and numpy glue), from Python's profiler over the decode steps; then split
by C kernel (`runtime/_qdot.c`, each call timed, a few hundred ns apiece), the rest being the Python
between the calls (the unprofiled step less the kernels); last, in alternating rounds, decode steps
with each layer's attention half in one call (`Layer.step`) against the modules' calls, and with
each MoE half's call running on the thread pool while the interpreter goes on (launched by the
attention call, collected by the next) against without. The splits are measured without that
overlap: with it, a MoE call's time would show up in the next layer's attention call.

    python benchmarks/bench_step_split.py WEIGHTS.kst [--steps 32] [--prompt-tokens 256]
                                          [--prefill-batch 256] [--threads 2] [--gguf-inputs llama.cpp|f32]
                                          [--no-keep-heap] [--rounds 8] [--other-build OTHER_QDOT.so]

With --other-build, last, decode steps with this checkout's kernels against another build of
runtime/_qdot.c (e.g. an older commit's: `git worktree add /tmp/old COMMIT && (cd /tmp/old && python
setup.py build_ext --inplace)`), alternating rounds in the same process.

The prefill is timed after a warm-up prefill in the same process (as `kimi-run --warm-up`), with its
minor page faults and kernel CPU seconds; freed temporaries are kept mapped as kimi-run keeps them
(`kernels.keep_heap` with the memory plan's room for one chunk's temporaries) unless --no-keep-heap.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import resource
import statistics
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("weights")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--prefill-batch", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8, help="alternating rounds of the one-call comparison")
    ap.add_argument("--gguf-inputs", default="llama.cpp", choices=("llama.cpp", "f32"),
                    help="as kimi-run's flag: how products by llama.cpp's blocks take their input")
    ap.add_argument("--no-keep-heap", action="store_true", help="leave glibc's allocator thresholds alone")
    ap.add_argument("--other-build", metavar="SO", help="another build's compiled _qdot extension to compare steps with")
    args = ap.parse_args()
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "KIMI_STREAM_THREADS"):
        os.environ[var] = str(args.threads)
    import kimistream.runtime  # noqa: F401  (first, as kimi-run: it sets OpenBLAS's spin before numpy loads)
    import numpy as np
    from kimistream.runtime import kernels
    from kimistream.runtime.model import Attention, Model, MoE
    from kimistream.runtime.weights import ModelWeights

    kernels.set_gguf_inputs(args.gguf_inputs)
    w = ModelWeights(args.weights)
    w.load_resident()
    context = args.prompt_tokens + 3 * args.steps + 16          # three passes of decode steps
    m = Model(w, context)
    if not args.no_keep_heap:
        from kimistream.formats.memplan import activation_bytes
        kernels.keep_heap(activation_bytes(m.cfg, min(args.prefill_batch, context), context, 0))
    ids = [int(i) for i in np.random.default_rng(0).integers(0, m.cfg.vocab_size, args.prompt_tokens)]
    m.prefill(ids, args.prefill_batch)           # warm: every expert and kernel touched once
    m.forward([1])
    m.reset()
    r0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    m.prefill(ids, args.prefill_batch)
    prefill = args.prompt_tokens / (time.perf_counter() - t)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    faults, system = r1.ru_minflt - r0.ru_minflt, r1.ru_stime - r0.ru_stime

    def decode():
        for _ in range(args.steps):
            m.forward([5])
    moes = [layer.mlp for layer in m.layers if isinstance(layer.mlp, MoE)]
    specs = [moe.launch_spec for moe in moes]           # (kept from the warm-up steps; None: never launched)

    def overlap(on: bool):
        for moe, spec in zip(moes, specs):
            moe.launch_spec = spec if on else None
    t = time.perf_counter()
    decode()
    dt_overlap = (time.perf_counter() - t) / args.steps
    overlap(False)
    t = time.perf_counter()
    decode()
    dt = (time.perf_counter() - t) / args.steps
    prof = cProfile.Profile()
    prof.runcall(decode)
    st = pstats.Stats(prof)

    def cum(fn):
        code = fn.__code__
        return sum(v[3] for (f, line, name), v in st.stats.items()
                   if (f, line, name) == (code.co_filename, code.co_firstlineno, code.co_name))
    total = st.total_tt
    # a decode token's attention half is one call where the weights allow (Layer.step), the modules' otherwise
    moe, route = cum(MoE.forward), cum(MoE.route)
    attention = cum(Attention.forward) + cum(kernels.AttentionStep.__call__)
    parts = {"routed and shared experts (MoE.forward, less routing)": moe - route,
             "routing (router product, top-k)": route,
             "attention (its norms, projections, kv_b, scores, residual)": attention,
             "dense layer, lm_head, norms, embedding, Python glue": total - moe - attention}
    print(f"{args.weights}: prefill {args.prompt_tokens} tokens in batches of {args.prefill_batch}: "
          f"{prefill:.1f} tok/s ({faults} minor page faults, {system:.3f} s of kernel CPU time"
          f"{', freed heap not kept' if args.no_keep_heap else ''}); "
          f"decode {1 / dt_overlap:.2f} tok/s ({dt_overlap * 1e3:.1f} ms/token; {dt * 1e3:.1f} without the MoE calls "
          f"overlapping the interpreter), {args.threads} threads (split below from a profiled pass without that "
          f"overlap: {total / args.steps * 1e3:.1f} ms/token)")
    print("| part of a decode step | ms/token | share |\n| --- | --- | --- |")
    for k, v in parts.items():
        print(f"| {k} | {v / args.steps * 1e3:.1f} | {v / total:.0%} |")

    # the prefill: the same parts, and the products through dequantized blocks + BLAS apart
    m.reset()
    prof = cProfile.Profile()
    prof.runcall(m.prefill, ids, args.prefill_batch)
    m.reset()
    m.prefill(ids, args.prefill_batch)         # (leave the cache as the decode passes below expect)
    st = pstats.Stats(prof)
    total = st.total_tt
    moe, route, attention, blas = (cum(MoE.forward), cum(MoE.route), cum(Attention.forward),
                                   cum(kernels._dequantized_matmul))
    print(f"\n| part of a {args.prompt_tokens}-token prefill (profiled: {total:.2f} s) | s | share |\n| --- | --- | --- |")
    for k, v in {"routed and shared experts (MoE.forward, less routing)": moe - route,
                 "routing": route, "attention (projections, scores over the prompt)": attention,
                 "dense layer, norms, embedding, lm_head, Python glue": total - moe - attention,
                 "(of all the above: products through dequantized blocks + BLAS)": blas}.items():
        print(f"| {k} | {v:.3f} | {v / total:.0%} |")

    spent = {}
    qdot = kernels._qdot
    kernels._qdot = _Timed(qdot, spent)
    try:
        decode()
    finally:
        kernels._qdot = qdot
    ms = {k: v / args.steps * 1e3 for k, v in spent.items() if v / args.steps >= 5e-6}
    print("\n| C kernel | ms/token |\n| --- | --- |")
    for k, v in sorted(ms.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {v:.2f} |")
    c = sum(ms.values())
    print(f"| all kernels | {c:.2f} |\n| Python between the calls (the unprofiled step less the kernels) "
          f"| {dt * 1e3 - c:.2f} |")

    # the attention half in one call against the modules' calls, alternating rounds
    steps = [layer.step for layer in m.layers]
    if any(s is not None for s in steps):
        rounds, base = {True: [], False: []}, m.cache.length
        for _ in range(args.rounds):
            for fused in (True, False):
                for layer, s in zip(m.layers, steps):
                    layer.step = s if fused else None
                m.cache.length = base                  # every round decodes the same positions
                t = time.perf_counter()
                decode()
                rounds[fused].append((time.perf_counter() - t) / args.steps * 1e3)
        for layer, s in zip(m.layers, steps):
            layer.step = s
        a, b = statistics.median(rounds[True]), statistics.median(rounds[False])
        print(f"\nA decode step with each layer's attention half in one call (Layer.step) against the modules' "
              f"calls, medians of {args.rounds} alternating rounds of {args.steps} steps: {a:.2f} against "
              f"{b:.2f} ms ({b / a:.3f}x)")
    if any(spec is not None for spec in specs):
        rounds, base = {True: [], False: []}, m.cache.length
        for _ in range(args.rounds):
            for on in (True, False):
                overlap(on)
                m.cache.length = base
                t = time.perf_counter()
                decode()
                rounds[on].append((time.perf_counter() - t) / args.steps * 1e3)
        a, b = statistics.median(rounds[True]), statistics.median(rounds[False])
        print(f"A decode step with each MoE half's call on the thread pool while the interpreter goes on "
              f"({sum(spec is not None for spec in specs)} of {len(moes)} MoE layers) against without, medians "
              f"of {args.rounds} alternating rounds: {a:.2f} against {b:.2f} ms ({b / a:.3f}x)")
    overlap(True)
    if args.other_build:
        compare_builds(m, decode, args.other_build, args.rounds, args.steps, args.prompt_tokens)


def compare_builds(m, decode, path: str, rounds: int, steps: int, base: int) -> None:
    """Decode steps with this checkout's kernels against another build's, alternating rounds."""
    from bench_kernel_ab import load_other     # (this directory is on sys.path when run as a script)
    from kimistream.formats.codecs import get_codec
    from kimistream.runtime import kernels
    other = load_other(path)
    other.set_x8(sum(1 << get_codec(c).kind for c in kernels._x8_codecs()))
    mine = kernels._qdot
    times = {"this checkout": [], "other": []}
    builds = [("this checkout", mine), ("other", other)]
    try:
        for r in range(rounds + 1):
            for name, mod in builds if r % 2 == 0 else builds[::-1]:
                kernels._qdot = mod        # (between steps: no MoE call is left launched in either)
                mod.set_spin_us(kernels.SPIN_US)
                m.cache.length = base
                t = time.perf_counter()
                decode()
                if r:                       # (the first round warms the other build's pool and scratch)
                    times[name].append((time.perf_counter() - t) * 1e3)
    finally:
        kernels._qdot = mine
    a, b = statistics.median(times["this checkout"]), statistics.median(times["other"])
    print(f"A decode step with this checkout's kernels against {path}'s, medians of {rounds} alternating "
          f"rounds: {a / steps:.2f} against {b / steps:.2f} ms ({b / a:.3f}x)")


class _Timed:
    """The kernel module with every function timed into `spent`."""

    def __init__(self, module, spent: dict):
        self._module, self._spent = module, spent

    def __getattr__(self, name):
        f = getattr(self._module, name)
        if not callable(f):
            return f

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                self._spent[name] = self._spent.get(name, 0.0) + time.perf_counter() - t
        return timed


if __name__ == "__main__":
    main()
