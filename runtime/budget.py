"""The memory budget: parse sizes, account for every part of the process's memory before anything is
loaded, size the expert cache from what is left, and refuse — saying which flag to change and by
how much — when the budget cannot hold the minimum."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kimistream.formats import procfs
from kimistream.formats.config import ModelConfig
from kimistream.formats.sizes import fmt, parse_size  # noqa: F401  (the runtime's callers use B.fmt, B.parse_size)

DEFAULT_FRACTION = 0.8       # default budget: this share of MemAvailable
RUNTIME_SLACK = 12 << 20     # prefetch threads' stacks, allocator fragmentation, Python objects of a run
# The baseline --plan-config assumes, since the planning process is not the one that will run: kimi-run's
# own RSS before its first weight plus RUNTIME_SLACK, as --dry-run reports it (x86-64 Linux, Python
# 3.11, this project's kernels loaded), for the bundled model (54 MiB) and for the Kimi K2 geometry
# (141 MiB): a fixed part and a part per routed expert, the parsed header's directory entries.
RECORDED_BASELINE = 54 << 20
RECORDED_BASELINE_PER_EXPERT = 3980


def mem_available() -> int:
    n = procfs.meminfo("MemAvailable")
    if not n:
        raise OSError("MemAvailable not in /proc/meminfo")
    return n


def current_rss() -> int:
    return procfs.status().get("VmRSS", 0)


def kv_bytes(cfg: ModelConfig, max_context: int, itemsize: int = 4) -> int:
    return itemsize * max_context * cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)


def activation_bytes(cfg: ModelConfig, chunk: int, max_context: int, expert_scratch: int) -> int:
    """Peak working memory of one forward chunk (float32): the residual stream and its temporaries,
    attention scores/probabilities for the chunk against the whole context, MoE intermediates,
    logits, plus scratch for decoding one weight when its codec has no fused kernel."""
    H, nh = cfg.hidden_size, cfg.num_attention_heads
    inter = max(cfg.intermediate_size, cfg.moe_intermediate_size * max(1, cfg.n_shared_experts))
    q = nh * (cfg.qk_head_dim + cfg.kv_lora_rank + cfg.v_head_dim)
    per_token = 4 * (8 * H + 3 * q + 4 * inter + cfg.vocab_size)
    scores = 4 * 3 * nh * chunk * max_context
    kv_copy = 4 * max_context * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)   # one layer's f16 cache, as f32
    return chunk * per_token + scores + kv_copy + expert_scratch


@dataclass
class MemoryPlan:
    budget: int
    baseline: int            # interpreter + libraries: measured at start, or recorded (--plan-config)
    resident: int            # attention, norms, routers, shared experts, dense layers, lm_head
    metadata: int            # embedding rows in flight, routers' working copies, header, tokenizer
    kv_cache: int
    activations: int
    expert_cache: int        # what is left for resident copies of routed experts
    expert_bytes: int        # the largest routed expert (one extent)
    cache_experts: int
    min_cache_experts: int
    total_experts: int
    baseline_recorded: bool = False

    @property
    def fixed(self) -> int:
        return self.baseline + self.resident + self.metadata + self.kv_cache + self.activations

    @property
    def fits(self) -> bool:
        return self.cache_experts >= self.min_cache_experts

    def shortfall(self) -> int:
        return max(0, self.fixed + self.min_cache_experts * self.expert_bytes - self.budget)

    def rows(self):
        return [("baseline (interpreter, libraries" + (", recorded)" if self.baseline_recorded else ")"), self.baseline),
                ("resident weights", self.resident),
                ("metadata, embeddings in flight, routers", self.metadata),
                ("KV cache", self.kv_cache),
                ("activations and buffers", self.activations),
                (f"expert cache ({self.cache_experts} of {self.total_experts} experts "
                 f"× {fmt(self.expert_bytes)})", self.cache_experts * self.expert_bytes)]

    def to_json(self) -> dict:
        d = asdict(self)
        d["fits"] = self.fits
        return d


def make_plan(cfg: ModelConfig, *, budget: int, baseline: int, resident: int, metadata: int,
              expert_bytes: int, total_experts: int, max_context: int, chunk: int, expert_scratch: int,
              prefetch: bool, kv_itemsize: int = 4, baseline_recorded: bool = False) -> MemoryPlan:
    kv = kv_bytes(cfg, max_context, kv_itemsize)
    act = activation_bytes(cfg, min(chunk, max_context), max_context, expert_scratch)
    fixed = baseline + resident + metadata + kv + act
    left = budget - fixed
    k = max(1, cfg.num_experts_per_tok)
    # One token's experts of a layer must fit, plus the next layer's predicted set when prefetching.
    min_cache = min(total_experts, (2 if prefetch else 1) * k) if total_experts else 0
    cache = min(total_experts, max(0, left) // expert_bytes) if expert_bytes else 0
    return MemoryPlan(budget, baseline, resident, metadata, kv, act, max(0, left), expert_bytes, int(cache),
                      min_cache, total_experts, baseline_recorded)
