"""kimi-convert and kimi-verify: read a Hugging Face checkpoint (local directory), apply a precision
plan and write one kimi-stream weight file; check checkpoints and weight files. Depends on
kimistream.formats only."""

import kimistream.formats  # noqa: F401,E402  (before numpy: it sets how long OpenBLAS's workers spin)
