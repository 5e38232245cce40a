"""The on-disk contract of kimi-stream: the weight file (spec, reader, writer), the codecs that
define how a tensor's values are laid out as bytes, the model config schema, tensor naming, and
readers for the source formats we convert from (safetensors). Both convert and runtime import
this package; it imports neither."""

import os
import sys

# Ctrl-C from this project's first line on: each command's package imports this one first, so the
# console script's import of the command is the first Python this project runs. When the process is
# one of the commands, SIGINT is only noted from here until the command's main takes over
# (formats/interrupts.py); a library import changes nothing. `_signal`, not `signal`: the latter
# imports enum, whose class building was most of the window a Ctrl-C still ended with a traceback.
EARLY_INTERRUPTS: list = []
if sys.argv and os.path.basename(sys.argv[0]) in ("kimi-run", "kimi-convert", "kimi-verify"):
    import _signal

    try:
        _signal.signal(_signal.SIGINT, lambda signum, frame: EARLY_INTERRUPTS.append(signum))
    except ValueError:               # not the main thread: nothing to hold
        pass

# numpy's OpenBLAS keeps each worker spinning for 2^28 cycles (~0.1 s) after a product. In prefill
# this project's own kernels run between BLAS calls, and a spinning worker takes a core from them
# (measured on the 2.4 B bench model, 256-token prefill on two cores: 131 -> 140 tok/s with 2^4).
# OpenBLAS reads the variable once, when numpy loads it: this package is imported first.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
