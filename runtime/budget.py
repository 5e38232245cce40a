"""The memory budget as this process sees it: the default budget, the process's own memory (its
baseline is measured, not assumed). The plan's arithmetic (footprint, KV cache, activations, the
expert cache left over) is formats/memplan.py, shared with the converter; its names are re-exported
here for the runtime's modules."""

from __future__ import annotations

from kimistream.formats import procfs
from kimistream.formats.memplan import (RECORDED_BASELINE, RECORDED_BASELINE_PER_EXPERT, MemoryPlan,  # noqa: F401
                                        kv_bytes, make_plan)
from kimistream.formats.sizes import fmt, parse_size  # noqa: F401  (the runtime's callers use B.fmt, B.parse_size)

DEFAULT_FRACTION = 0.8       # default budget: this share of MemAvailable
RUNTIME_SLACK = 12 << 20     # prefetch threads' stacks, allocator fragmentation, Python objects of a run


def mem_available() -> int:
    n = procfs.meminfo("MemAvailable")
    if not n:
        raise OSError("MemAvailable not in /proc/meminfo")
    return n


def current_rss() -> int:
    return procfs.status().get("VmRSS", 0)
