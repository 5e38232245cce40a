"""kimi-run: the mmap runtime. The model's forward pass in numpy, the C kernels (runtime/_qdot.c), the
expert pager under a memory budget, the planner, sampling, tokenizers and telemetry. Depends on
kimistream.formats only, never on kimistream.convert."""

import kimistream.formats  # noqa: F401,E402  (before numpy: it sets how long OpenBLAS's workers spin)
