"""kimi-run: the mmap runtime. The model's forward pass in numpy, the C kernels (runtime/_qdot.c), the
expert pager under a memory budget, the planner, sampling, tokenizers and telemetry. Depends on
kimistream.formats only, never on kimistream.convert."""
