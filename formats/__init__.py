"""The on-disk contract of kimi-stream: the weight file (spec, reader, writer), the codecs that
define how a tensor's values are laid out as bytes, the model config schema, tensor naming, and
readers for the source formats we convert from (safetensors). Both convert and runtime import
this package; it imports neither."""

import os

# numpy's OpenBLAS keeps each worker spinning for 2^28 cycles (~0.1 s) after a product. In prefill
# this project's own kernels run between BLAS calls, and a spinning worker takes a core from them
# (measured on the 2.4 B bench model, 256-token prefill on two cores: 131 -> 140 tok/s with 2^4).
# OpenBLAS reads the variable once, when numpy loads it: this package is imported first.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
