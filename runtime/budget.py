"""The memory budget as this process sees it: the default budget, the process's own memory (its
baseline is measured, not assumed), what a memory limit leaves the page cache. The plan's arithmetic
(footprint, KV cache, activations, the expert cache left over) is formats/memplan.py, shared with
the converter; its names are re-exported here for the runtime's modules."""

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


def no_page_cache_room(plan: MemoryPlan, limit: int | None = None) -> str | None:
    """Why evicted experts' pages cannot stay in the page cache, known before the run: this process's
    cgroup has a memory limit (it counts the page cache) that leaves less than one layer's experts
    beside the budget, and the cache holds fewer experts than one token routes to over all its layers,
    so that (a token visiting the layers in turn, least recently used first out) every expert is read
    again at every token. None where either does not hold: the pager's page-cache policy then decides
    by measuring (a budget on a machine with memory to spare leaves the page cache all of it; a cache
    of a token's experts has hits of its own). Kimi K2 under a limit of its 8.24 GB budget (30 of a
    token's 480 experts cached) spent 1.5 s of compute per token after measuring its way there, its
    resident pages reclaimed meanwhile, against 0.75 s reading with O_DIRECT from the start
    (benchmarks/bench_k2.py --cap).
    `limit`: the cgroup's, read here when not given."""
    limit = procfs.cgroup_memory_limit() if limit is None else limit
    token = plan.token_experts or plan.min_cache_experts + 1       # (a plan that does not say: one layer's)
    if limit is None or plan.cache_experts >= token:
        return None
    room = limit - plan.budget
    if room >= plan.min_cache_experts * plan.expert_bytes:
        return None
    return (f"the memory limit of {fmt(limit)} leaves {fmt(max(room, 0))} beside the budget for the page cache, "
            + (f"and the cache holds {plan.cache_experts} experts, fewer than the {token} a token routes to"
               if plan.token_experts else f"and the cache holds only one layer's {plan.cache_experts} experts"))
