"""Sizes as people write and read them: "600M", "8.24G", "8GiB" to bytes, and bytes to "1.50 GiB"
(both commands' flags and reports); and rounding up to an alignment."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """'600M', '8.24G', '8GiB', '123456' -> bytes (K/M/G/T are powers of 1000, KiB/MiB/GiB of 1024)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read size {text!r} (examples: 600M, 8.24G, 8GiB, 123456)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def align_up(n: int, a: int) -> int:
    """n rounded up to a multiple of a (the file's extents start on alignment boundaries)."""
    return (n + a - 1) // a * a
