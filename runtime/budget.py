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


# Below this share of the routed experts' bytes held by all the memory the process and the page cache
# can use, evicted experts' pages cannot pay: routing spread over the experts finds about that share of
# re-reads cached, and mapping costs compute at every read (Kimi K2's synthetic file on 24 GiB, memory
# for 8 % of its experts: decode 0.74 s of compute a token with O_DIRECT, 1.04-1.47 s mapped; at 3 GB/s a
# read, hits below about 15 % save less disk time than that). The 0.8 GB bench model under caps of
# ¼ to ½ of its file has memory for 30-60 % and is left to measurement.
PAGE_CACHE_MIN_SHARE = 0.15


def process_memory(limit: int | None = None) -> int | None:
    """What this process and the page cache may hold between them: MemAvailable plus this process's
    RSS, no more than its cgroup's memory limit (None where /proc/meminfo says nothing)."""
    try:
        memory = mem_available() + current_rss()
    except OSError:
        return None
    return min(memory, limit) if limit is not None else memory


def limit_leaves_no_room(plan: MemoryPlan, limit: int | None) -> str | None:
    """no_page_cache_room's first case (a cgroup `limit` that leaves the page cache no room and a cache
    shorter than a token's experts), in words; None where it does not hold."""
    token = plan.token_experts or plan.min_cache_experts + 1       # (a plan that does not say: one layer's)
    if limit is None or plan.cache_experts >= token or limit - plan.budget >= plan.min_cache_experts * plan.expert_bytes:
        return None
    return (f"the memory limit of {fmt(limit)} leaves {fmt(max(limit - plan.budget, 0))} beside the budget for the "
            "page cache, " + (f"and the cache holds {plan.cache_experts} experts, fewer than the {token} a token routes to"
                              if plan.token_experts else f"and the cache holds only one layer's {plan.cache_experts} experts"))


def no_page_cache_room(plan: MemoryPlan, limit: int | None = None, memory: int | None = None,
                       experts: int | None = None) -> str | None:
    """Why evicted experts' pages cannot stay in the page cache to any use, known before the run; None
    where the pager's page-cache policy is left to decide by measuring. Two cases:
    - this process's cgroup has a memory limit (it counts the page cache) that leaves less than one
      layer's experts beside the budget, and the cache holds fewer experts than one token routes to
      over all its layers, so that (a token visiting the layers in turn, least recently used first
      out) every expert is read again at every token. Kimi K2 under a limit of its 8.24 GB budget (30
      of a token's 480 experts cached) spent 1.5 s of compute per token after measuring its way
      there, its resident pages reclaimed meanwhile, against 0.75 s reading with O_DIRECT from the
      start (benchmarks/bench_k2.py --cap);
    - the memory the process and the page cache may use at all (process_memory) holds less than
      PAGE_CACHE_MIN_SHARE of the routed experts (a file far larger than RAM, limit or none: Kimi K2 on
      a PC of 8 or 24 GB). The measurement would misjudge it: its first re-reads are of experts read
      moments before, still cached, while a long run re-reads experts from all over the file.
    `limit`: the cgroup's, read here when not given; `memory`: process_memory(limit) when not given;
    `experts`: the routed experts' bytes in the file (when not given, the plan's count of the largest)."""
    limit = procfs.cgroup_memory_limit() if limit is None else limit
    why = limit_leaves_no_room(plan, limit)
    if why:
        return why
    memory = process_memory(limit) if memory is None else memory
    experts = plan.total_experts * plan.expert_bytes if experts is None else experts
    if memory is not None and experts and memory < PAGE_CACHE_MIN_SHARE * experts:
        return (f"{fmt(memory)} of memory holds {memory / experts:.0%} of the routed experts' {fmt(experts)}, "
                f"too little for the page cache to find many of them again; keeping them pays from "
                f"{PAGE_CACHE_MIN_SHARE:.0%}")
    return None
