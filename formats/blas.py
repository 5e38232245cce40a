"""BLAS thread count, set from inside the process. At run time a decode step multiplies only small
matrices with numpy, and an OpenBLAS worker spinning on the second core after each of them takes
that core from the mat-vec kernel's own thread; prefill's large products want every core. So the
model asks for one BLAS thread per decode step and for all of them in prefill. The encoder asks for
one thread always: OpenBLAS's results can depend on its thread count, and a file must be the same
bytes whether it was encoded here or on a cluster worker. Works with the OpenBLAS numpy ships (or
any OpenBLAS loaded in the process); elsewhere it does nothing. How long an idle OpenBLAS worker
spins is set once, before numpy loads (formats/__init__.py)."""

from __future__ import annotations

import ctypes
import functools

_NAMES = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads64_",
          "openblas_set_num_threads")


@functools.lru_cache(maxsize=1)
def _setter():
    import numpy  # noqa: F401  (loads numpy's BLAS)
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _NAMES:
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.argtypes, fn.restype = [ctypes.c_int], None
                return fn
    return None


_current: list = [None]


def set_threads(n: int) -> bool:
    """Ask BLAS for n threads (a no-op when it already has them); False when there is no OpenBLAS."""
    fn = _setter()
    if fn is None:
        return False
    if _current[0] != n:
        fn(int(n))
        _current[0] = n
    return True
