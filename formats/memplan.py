"""The arithmetic of a memory plan, shared by the runtime (which plans a file it is about to run) and
the converter (which picks resident precisions so that the file it writes will fit a budget):

- a model's *footprint*: what its weights lay out (resident bytes and the float32 copies the runtime
  keeps of some, routed experts, header, scratch), from a file's header or from a config and a
  precision plan laid out as the converter would;
- the *plan*: that footprint plus baseline, KV cache and activations against a budget, and the expert
  cache left over;
- `fit_resident`: resident classes lowered one step at a time, cheapest measured KL per byte first,
  until a plan fits.

Nothing here looks at the running process; the runtime measures its own baseline and passes it in."""

from __future__ import annotations

import math
import mmap
from dataclasses import asdict, dataclass, replace

from .codecs import get_codec, is_float_codec
from .config import ModelConfig
from .constants import (ATTENTION, DEFAULT_ALIGNMENT, DENSE_MLP, EXTENT_EXPERT, EXTENT_RESIDENT, LM_HEAD, PREFIX_SIZE,
                        ROUTER, SHARED_EXPERTS)
from .layout import EXPERT_PROJS, expert_entries, plan_extents, split_kv_b_names
from .sizes import align_up, fmt

PAGE = mmap.PAGESIZE

# The baseline a plan assumes when it is made outside the process that will run (kimi-convert
# --memory-budget, kimi-run --plan-config): kimi-run's own RSS before its first weight plus the
# runtime's slack, as --dry-run reports it (x86-64 Linux, Python 3.11, this project's kernels
# loaded), for the bundled model (54 MiB) and for the Kimi K2 geometry (141 MiB): a fixed part and a
# part per routed expert, the parsed header's directory entries.
RECORDED_BASELINE = 54 << 20
RECORDED_BASELINE_PER_EXPERT = 3980

MIN_FIT_CHUNK = 16           # the smallest default prompt chunk kimi-run plans for when the budget is tight
DEFAULT_CONTEXT = 4096       # kimi-run's default context, or the model's own limit if lower


def recorded_baseline(total_experts: int) -> int:
    return RECORDED_BASELINE + total_experts * RECORDED_BASELINE_PER_EXPERT


def default_context(cfg: ModelConfig) -> int:
    return min(DEFAULT_CONTEXT, cfg.max_position_embeddings)


# A header's JSON for a config that has not been converted: bytes per tensor entry and per extent
# entry, measured on converted files (Kimi K2: 15.2 MB for 69 975 tensors and 23 105 extents), and
# the tokenizer files assumed (Kimi's tiktoken.model is 2.8 MB, DeepSeek's tokenizer.json 7.8 MB).
HEADER_BYTES_PER_TENSOR = 175
HEADER_BYTES_PER_EXTENT = 120
TOKENIZER_ALLOWANCE = 8 << 20

# Attention projections and routers used at every token, and lm_head, are decoded once to float32 and
# kept by the runtime when they are stored as floats other than f32 (f32 is a view); plans count the
# copies. Stored in a block codec (a router at q8, say) they stay packed and run fused.
DECODED_SUFFIXES = ("kv_a_proj_with_mqa.weight", "o_proj.weight", "q_a_proj.weight", "q_b_proj.weight",
                    "q_proj.weight", "mlp.gate.weight")


@dataclass
class Footprint:
    resident: int            # resident extents plus the float32 copies the model keeps of some
    expert_bytes: int        # the largest routed expert (one extent), in whole pages
    total_experts: int
    metadata: int            # the parsed header and tokenizer, as Python objects
    scratch: int             # the largest transient decode buffer
    routed_bytes: int = 0    # all the routed experts' extents together


def footprint(tensors, extents, header_bytes: int, blob_bytes: int) -> Footprint:
    """tensors: (name, class, codec, shape); extents: (kind, bytes)."""
    copies = scratch = 0
    tensors = list(tensors)
    head = "lm_head.weight" if any(t[0] == "lm_head.weight" for t in tensors) else "model.embed_tokens.weight"
    for name, cls, codec, shape in tensors:
        n = 4 * math.prod(shape)
        float_copy = is_float_codec(codec) and codec != "f32"
        if float_copy and (name.endswith(DECODED_SUFFIXES) or name == head):      # a tied embedding is the head
            copies += n                                   # decoded once and kept
        if float_copy and cls in ("routed_experts", "shared_experts", "dense_mlp"):
            scratch = max(scratch, 2 * n)                 # decoded one projection at a time
        elif not is_float_codec(codec) and len(shape) == 2:
            # block codecs (llama.cpp's too) run fused; many tokens dequantize blocks of rows
            scratch = max(scratch, 4 * 64 * shape[1])
        if name.endswith(("kv_b_proj.weight", ".k_b_proj.weight", ".v_b_proj.weight")) and codec != "f32":
            scratch = max(scratch, n)                     # decoded per use
    experts = [nb for kind, nb in extents if kind == EXTENT_EXPERT]
    # an expert in memory takes whole pages (a mapping's, a read pool's slot): the cache counts those
    return Footprint(resident=sum(nb for kind, nb in extents if kind == EXTENT_RESIDENT) + copies,
                     expert_bytes=align_up(max(experts, default=0), PAGE), total_experts=len(experts),
                     metadata=4 * header_bytes + 8 * blob_bytes, scratch=scratch, routed_bytes=sum(experts))


def _expert_part(cfg: ModelConfig, precision) -> tuple[list, list]:
    """The routed experts' (representative tensors, extents). The experts of a layer differ only by an
    --override naming some of them: without one, expert 0 stands for all (a 2.78 T-parameter config has
    62 880), else each expert's codecs are looked up and experts with the same codecs sized once."""
    tensors, extents = [], []
    for i in cfg.moe_layers:
        first = expert_entries(cfg, i, 0, precision.codec_for)
        every = ([first] * cfg.n_routed_experts if not precision.overrides else
                 [expert_entries(cfg, i, e, precision.codec_for) for e in range(cfg.n_routed_experts)])
        sized: dict = {}
        for ts in every:
            key = tuple((codec, shape) for _, _, codec, shape in ts)
            if key not in sized:
                sized[key] = sum(get_codec(codec).nbytes(shape) for codec, shape in key)
                tensors += ts
            extents.append((EXTENT_EXPERT, sized[key]))
    return tensors, extents


def of_config(cfg: ModelConfig, precision, experts=None, tokenizer_bytes: int = TOKENIZER_ALLOWANCE,
              alignment: int = DEFAULT_ALIGNMENT) -> tuple[Footprint, int]:
    """The footprint of `cfg` converted with `precision` (a PrecisionPlan for this model), and the
    file's size, laid out as the converter would (extents on `alignment` boundaries). `experts`: the routed experts' part when the caller
    already has it for the same routed-expert codecs and overrides (fit_resident changes neither);
    `tokenizer_bytes`: the tokenizer files' size when known (an allowance otherwise)."""
    # kv_b as the two halves a GGUF keeps when the plan names them (--quant keep), as the converter lays it out
    split = cfg.num_hidden_layers > 0 and split_kv_b_names(0)[0] in getattr(precision, "tensors", {})
    layout = plan_extents(cfg, precision.codec_for, experts=False, split_kv_b=split)
    tensors = [t for _, _, ts in layout for t in ts]
    extents = [(kind, sum(get_codec(codec).nbytes(shape) for _, _, codec, shape in ts)) for _, kind, ts in layout]
    n_tensors = len(tensors) + len(EXPERT_PROJS) * len(cfg.moe_layers) * cfg.n_routed_experts
    et, ee = experts or _expert_part(cfg, precision)
    tensors, extents = tensors + et, extents + ee
    header = HEADER_BYTES_PER_TENSOR * n_tensors + HEADER_BYTES_PER_EXTENT * len(extents)
    # the file as the writer lays it out: the header, then every extent (the tokenizer's too) on an
    # alignment boundary (a small model's padding is several per cent of it)
    file_bytes = (align_up(PREFIX_SIZE + header, alignment) + sum(align_up(nb, alignment) for _, nb in extents)
                  + align_up(tokenizer_bytes, alignment))
    return footprint(tensors, extents, header, tokenizer_bytes), file_bytes


def kv_bytes(cfg: ModelConfig, max_context: int, itemsize: int = 4) -> int:
    return itemsize * max_context * cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)


def activation_bytes(cfg: ModelConfig, chunk: int, max_context: int, expert_scratch: int, window: int = 0) -> int:
    """Peak working memory of one forward chunk (float32): the residual stream and its temporaries,
    attention scores/probabilities for the chunk against the whole context, MoE intermediates,
    logits, plus scratch for decoding one weight when its codec has no fused kernel; and with a prompt
    window of more tokens than the chunk, the window's own stream (window_bytes_per_token)."""
    H, nh = cfg.hidden_size, cfg.num_attention_heads
    inter = max(cfg.intermediate_size, cfg.moe_intermediate_size * max(1, cfg.n_shared_experts))
    q = nh * (cfg.qk_head_dim + cfg.kv_lora_rank + cfg.v_head_dim)
    per_token = 4 * (8 * H + 3 * q + 4 * inter + cfg.vocab_size)
    scores = 4 * 3 * nh * chunk * max_context
    kv_copy = 4 * max_context * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)   # one layer's f16 cache, as f32
    extra = 0
    if window > chunk:
        extra = ((window - chunk) * window_bytes_per_token(cfg)
                 + (projection_block(chunk, window) - chunk) * projection_bytes_per_token(cfg))
    return chunk * per_token + scores + kv_copy + expert_scratch + extra


PROJECTION_TOKENS = 256      # a prompt window's attention projections take this many tokens at once


def projection_block(chunk: int, window: int) -> int:
    """How many tokens of a prompt window go through the attention's projections at once: whole
    chunks, about PROJECTION_TOKENS (BLAS's products on weights decoded once for all of them; a
    16 to 64-token chunk decodes every weight again for few tokens), never more than the window."""
    return min(window, max(chunk, PROJECTION_TOKENS // chunk * chunk))


def projection_bytes_per_token(cfg: ModelConfig) -> int:
    """What each token of a projection block holds beyond a chunk's (float32): its normalised input,
    queries, q LoRA and KV latent, the heads' outputs and the output projection."""
    nh = cfg.num_attention_heads
    return 4 * (2 * cfg.hidden_size + nh * (cfg.qk_head_dim + cfg.v_head_dim) + (cfg.q_lora_rank or 0)
                + cfg.kv_lora_rank + cfg.qk_rope_head_dim)


def window_bytes_per_token(cfg: ModelConfig) -> int:
    """What each token of a prompt window holds while the window goes through the model a layer at a
    time (runtime Model.prefill): its residual stream, the MoE half's normalised input and output, the
    shared experts' intermediates and the router's scores (float32); the attention half and the dense
    layers go a chunk at a time, inside the chunk's own room."""
    shared = 4 * cfg.moe_intermediate_size * max(1, cfg.n_shared_experts)
    return 4 * (3 * cfg.hidden_size + shared + 2 * cfg.n_routed_experts)


@dataclass
class MemoryPlan:
    budget: int
    baseline: int            # interpreter + libraries: measured at start, or recorded
    resident: int            # attention, norms, routers, shared experts, dense layers, lm_head
    metadata: int            # embedding rows in flight, routers' working copies, header, tokenizer
    kv_cache: int
    activations: int
    expert_cache: int        # what is left for resident copies of routed experts
    expert_bytes: int        # the largest routed expert (one extent), in whole pages
    cache_experts: int
    min_cache_experts: int
    total_experts: int
    baseline_recorded: bool = False
    token_experts: int = 0   # one token's routed experts over every MoE layer (0: not known)

    @property
    def fixed(self) -> int:
        return self.baseline + self.resident + self.metadata + self.kv_cache + self.activations

    @property
    def fits(self) -> bool:
        return (self.cache_experts >= self.min_cache_experts
                and self.fixed + self.min_cache_experts * self.expert_bytes <= self.budget)

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
              prefetch: bool, kv_itemsize: int = 4, baseline_recorded: bool = False, window: int = 0) -> MemoryPlan:
    kv = kv_bytes(cfg, max_context, kv_itemsize)
    act = activation_bytes(cfg, min(chunk, max_context), max_context, expert_scratch, min(window, max_context))
    fixed = baseline + resident + metadata + kv + act
    left = budget - fixed
    k = max(1, cfg.num_experts_per_tok)
    # One token's experts of a layer must fit, plus the next layer's predicted set when prefetching.
    min_cache = min(total_experts, (2 if prefetch else 1) * k) if total_experts else 0
    cache = min(total_experts, max(0, left) // expert_bytes) if expert_bytes else 0
    moe_layers = total_experts // cfg.n_routed_experts if cfg.n_routed_experts else 0
    return MemoryPlan(budget, baseline, resident, metadata, kv, act, max(0, left), expert_bytes, int(cache),
                      min_cache, total_experts, baseline_recorded, min(total_experts, k * moe_layers))


def plan_for(cfg: ModelConfig, fp: Footprint, *, budget: int, baseline: int, max_context: int, chunk: int,
             prefetch: bool = False, kv_itemsize: int = 4, baseline_recorded: bool = False,
             window: int = 0) -> MemoryPlan:
    """make_plan for a footprint: its metadata plus the embedding rows of a prompt chunk in flight;
    `window`: prompt tokens that go through the model a layer at a time (0: a chunk at a time)."""
    return make_plan(cfg, budget=budget, baseline=baseline, resident=fp.resident,
                     metadata=fp.metadata + 4 * cfg.hidden_size * chunk, expert_bytes=fp.expert_bytes,
                     total_experts=fp.total_experts, max_context=max_context, chunk=chunk,
                     expert_scratch=fp.scratch, prefetch=prefetch, kv_itemsize=kv_itemsize,
                     baseline_recorded=baseline_recorded, window=window)


# ------------------------------------------------------------------------- resident precision to fit

# How far each resident class may go down, in order. Routers stop at q8 (they choose the experts);
# a router at bf16 would be decoded to a float32 copy and save nothing. Dense layers and lm_head stop
# at q4: they are the most sensitive per weight (see RESIDENT_STEP_KL). A float codec steps to the
# first rung of its class.
RESIDENT_LADDER = {ROUTER: ("q8",), ATTENTION: ("q8", "q6", "q4", "q2"), SHARED_EXPERTS: ("q8", "q6", "q4", "q2"),
                   DENSE_MLP: ("q8", "q6", "q4"), LM_HEAD: ("q8", "q6", "q4")}

# Tensor names of each class, as --override patterns (what a plan prints so that a user can write the
# same file by hand). Norms are excluded: an override on a 1-D tensor would turn it into f16.
CLASS_PATTERNS = {ROUTER: r"mlp\.gate\.weight$", ATTENTION: r"\.self_attn\.[a-z_]*proj[a-z_]*\.weight$",
                  SHARED_EXPERTS: r"\.mlp\.shared_experts\.", DENSE_MLP: r"\.mlp\.(gate|up|down)_proj\.weight$",
                  LM_HEAD: r"^lm_head\.weight$"}

# What one step down costs, measured: the increase in mean KL against f32 on held-out text when the
# class alone goes down this step from the q2 preset (data-free), mean of the two trained bundled
# models, by benchmarks/bench_resident_sensitivity.py (table in benchmarks/RESULTS.md). A step's cost
# is the class's KL per bit removed times the bits it removes; fit_resident takes the step of least
# cost per byte saved in the model being planned.
RESIDENT_STEP_KL = {ROUTER: ("f32", "q8", 1.0e-4), ATTENTION: ("q4", "q2", 1.172e-2),
                    SHARED_EXPERTS: ("q4", "q2", 3.67e-3), DENSE_MLP: ("q6", "q4", 1.335e-3),
                    LM_HEAD: ("q6", "q4", 1.285e-3)}
_PROBE = (1024, 1024)          # the shape bits per weight are compared at


def _bits_per_weight(codec: str, shape=_PROBE) -> float:
    return 8 * get_codec(codec).nbytes(shape) / math.prod(shape)


def kl_per_bit(cls: str) -> float:
    frm, to, kl = RESIDENT_STEP_KL[cls]
    return kl / (_bits_per_weight(frm) - _bits_per_weight(to))


def next_rung(cls: str, codec: str) -> str | None:
    ladder = RESIDENT_LADDER.get(cls, ())
    if codec in ladder:
        i = ladder.index(codec)
        return ladder[i + 1] if i + 1 < len(ladder) else None
    return ladder[0] if ladder and is_float_codec(codec) else None


@dataclass
class ResidentStep:
    cls: str
    frm: str
    to: str
    saved: int               # resident bytes saved by this step

    def override(self) -> str:
        return f"{CLASS_PATTERNS[self.cls]}={self.to}"

    def to_json(self) -> dict:
        return {"class": self.cls, "from": self.frm, "to": self.to, "saved_bytes": self.saved}

    def describe(self) -> str:
        return f"{self.cls} {self.frm} → {self.to} ({fmt(self.saved)} less resident)"


def fit_resident(cfg: ModelConfig, precision, fits, tokenizer_bytes: int = TOKENIZER_ALLOWANCE) -> list[ResidentStep]:
    """Lower resident classes of `precision` (a PrecisionPlan for cfg, changed in place) one rung at a
    time, the step with the least measured KL per byte saved first, until `fits(footprint)` holds or
    no step is left. Explicit overrides keep winning over the class codecs (codec_for applies them
    last). Returns the steps taken; the caller tells whether the result fits."""
    steps: list[ResidentStep] = []
    experts = _expert_part(cfg, precision)          # unchanged by any step below
    fp, _ = of_config(cfg, precision, experts, tokenizer_bytes)
    while not fits(fp):
        best = None
        for cls in RESIDENT_LADDER:
            frm = precision.classes[cls]
            to = next_rung(cls, frm)
            if to is None:
                continue
            trial = replace(precision, classes={**precision.classes, cls: to})
            tfp, _ = of_config(cfg, trial, experts, tokenizer_bytes)
            saved = fp.resident - tfp.resident
            if saved <= 0:
                continue
            cost = kl_per_bit(cls) * max(0.0, _bits_per_weight(frm) - _bits_per_weight(to)) / saved
            if best is None or cost < best[0]:
                best = (cost, ResidentStep(cls, frm, to, saved), trial, tfp)
        if best is None:
            break
        _, step, trial, fp = best
        precision.classes = trial.classes
        steps.append(step)
    return steps
