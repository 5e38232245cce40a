"""The one memory planner. A plan is a function of the model's config, its footprint (what its
weights lay out: resident bytes, the float32 copies the model keeps, experts, header, scratch) and
the flags. The footprint comes from a weight file's header (kimi-run, --dry-run) or from a config and
a precision preset laid out as the converter would (--plan-config), by the same rules, so a config
and the file converted from it get the same plan."""

from __future__ import annotations

import json

from kimistream.formats import memplan
from kimistream.formats.codecs import is_float_codec
from kimistream.formats.config import ModelConfig
from kimistream.formats.memplan import Footprint

from . import budget as B
from .errors import RunError


def of_file(wf) -> Footprint:
    """A converted weight file's footprint, from its header."""
    return memplan.footprint([(n, t.cls, t.codec, t.shape) for n, t in wf.tensors.items()],
                             [(e.kind, e.nbytes) for e in wf.extents], len(json.dumps(wf.header)),
                             sum(e.nbytes for e in wf.extents if e.kind == "blob"))


def plan(cfg: ModelConfig, fp: Footprint, args, baseline: int, max_ctx: int, chunk: int,
         recorded: bool = False, window: int | None = None) -> B.MemoryPlan:
    """The plan under args.budget for a context of max_ctx, prefill chunks of `chunk` tokens and prompt
    windows of `window` (default: args.prompt_window, once chosen); `recorded`: the baseline is the
    recorded one, not this process's."""
    window = getattr(args, "prompt_window", None) if window is None else window
    guesses = args.prefetch == "next-layer" or getattr(args, "guess_room", False)      # (see auto_fit)
    return memplan.plan_for(cfg, fp, budget=args.budget, baseline=baseline, max_context=max_ctx, chunk=chunk,
                            prefetch=guesses, kv_itemsize=2 if args.kv_dtype == "f16" else 4,
                            baseline_recorded=recorded, window=window or 0)


def describe_plan(plan: B.MemoryPlan, log) -> None:
    log(f"memory plan for a budget of {B.fmt(plan.budget)}:")
    for label, n in plan.rows():
        log(f"  {label:<58} {B.fmt(n):>12}")
    used = plan.fixed + plan.cache_experts * plan.expert_bytes
    log(f"  {'total planned':<58} {B.fmt(used):>12}")


def _largest_fitting(lo: int, hi: int, fits) -> int | None:
    """The largest n in [lo, hi] with fits(n), for a monotone predicate; None if even lo fails."""
    if not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def context_length(args, cfg, log) -> int:
    """--max-context, checked: at least 1, and a warning past the positions the model was trained on;
    by default 4096 or the model's own limit if lower."""
    if args.max_context is None:
        return memplan.default_context(cfg)
    if args.max_context < 1:
        raise RunError("--max-context must be at least 1")
    if args.max_context > cfg.max_position_embeddings:
        log(f"warning: --max-context {args.max_context} is past the model's max_position_embeddings "
            f"({cfg.max_position_embeddings}); positions beyond it were never trained")
    return args.max_context


MIN_AUTO_CONTEXT = 64      # a default context shortened to fit the budget is never shorter than this
MIN_PREFILL_BATCH = 64     # the prompt chunk planned for before the default one is chosen
MIN_FIT_CHUNK = memplan.MIN_FIT_CHUNK     # the smallest default prompt chunk auto_fit plans for


def default_kv_dtype(args, experts_codec: str, log) -> None:
    """Without --kv-dtype, a file whose routed experts are quantized keeps its KV cache in f16 (half
    the memory, logits within ~1e-3, llama.cpp's default too); a float file keeps f32, exact."""
    if args.kv_dtype is None and not is_float_codec(experts_codec):
        args.kv_dtype = "f16"
        log(f"KV cache: f16 (experts at {experts_codec}; --kv-dtype f32 for an exact cache)")


def auto_fit(args, replan, log) -> None:
    """Defaults that fit a tight budget. When the plan does not fit and the user left these flags
    alone: the KV cache in float16 (half the memory, logits within ~1e-3), then the longest context of
    at least MIN_AUTO_CONTEXT tokens that fits. Each choice is said in one line. Flags the user gave
    are never changed, and when even this does not fit, nothing is: refuse_if_unfit then advises.
    --prefetch auto plans, as next-layer does, room for the next layer's guessed experts beside a
    layer's own while that fits at all (a cache of one layer's experts leaves a guess no slot; at a
    quarter of the bench model's file the room for guesses costs half the context); where it does not,
    room for a layer's own, and auto then makes no guesses. Nor where it would halve the default
    prompt window (default_prompt_window)."""
    args.guess_room = getattr(args, "prefetch", None) == "auto"
    if not _fit(args, replan, log) and args.guess_room:
        args.guess_room = False
        _fit(args, replan, log)


def _fit(args, replan, log) -> bool:
    # with the prompt chunk still to choose (auto_prefill_batch, after), it may shrink to MIN_FIT_CHUNK
    chunk = args.prefill_batch_size or MIN_FIT_CHUNK

    def fits(ctx=None):
        return replan(ctx, chunk).fits
    if fits():
        return True
    saved = (args.kv_dtype, args.max_ctx)
    said = []
    if args.kv_dtype is None:
        args.kv_dtype = "f16"
        said.append("KV cache: f16 (f32 does not fit the budget; --kv-dtype to choose)")
    if not fits() and args.max_context is not None:
        args.kv_dtype, args.max_ctx = saved
        return False
    if not fits():
        ctx = _largest_fitting(MIN_AUTO_CONTEXT, args.max_ctx - 1, fits)
        if ctx is None:
            args.kv_dtype, args.max_ctx = saved
            return False
        said.append(f"max context: {ctx} tokens ({args.max_ctx} does not fit the budget; --max-context to choose)")
        args.max_ctx = ctx
    for line in said:
        log(line)
    return True


def auto_prefill_batch(plan_with) -> int:
    """The default prompt chunk: 256 tokens, else 128, when that costs the expert cache at most a tenth
    of what it holds at 64 (larger chunks let each expert's rows serve more tokens: 75 against 45 tok/s
    of prefill in benchmarks/RESULTS.md), else 64, else the largest that fits."""
    base = plan_with(MIN_PREFILL_BATCH)
    for b in (256, 128):
        p = plan_with(b)
        if p.fits and p.cache_experts >= 0.9 * base.cache_experts:
            return b
    if base.fits:
        return MIN_PREFILL_BATCH
    return _largest_fitting(1, MIN_PREFILL_BATCH - 1, lambda b: plan_with(b).fits) or MIN_PREFILL_BATCH


def auto_prompt_window(plan_with, chunk: int, max_ctx: int, k: int) -> int:
    """The default prompt window: the most prompt tokens (whole chunks, up to the context) that go
    through the model a layer at a time, each layer's routed experts read once for all of them. Their
    residual stream takes only memory the expert cache leaves unused, where that cache holds a token's
    experts over all its layers (decode steps find them again); where it holds fewer (Kimi K2 in
    8.24 GB: decode finds none of them again), it may take all of the cache but one layer's k experts
    and the pager's read-ahead. Where the cache holds every expert a window saves no read (and ran at
    0.8-0.9x the chunks' speed on the 0.8 GB bench model): one chunk, the chunk-by-chunk prefill.
    `plan_with(window)` is the plan with that window."""
    base = plan_with(0)
    if base.total_experts and base.cache_experts >= base.total_experts:
        return chunk        # every expert stays cached: a window saves no read (and measured slower)
    floor = base.cache_experts
    if base.token_experts and base.cache_experts < base.token_experts:
        floor = min(floor, max(base.min_cache_experts, k + 4))
    chunks = _largest_fitting(1, -(-max_ctx // chunk), lambda n: (
        (p := plan_with(min(max_ctx, n * chunk))).fits and p.cache_experts >= floor))
    return min(max_ctx, (chunks or 1) * chunk)


def default_prompt_window(args, replan, k: int, log) -> None:
    """--prompt-window, checked, or the default (auto_prompt_window; k: experts a token routes to in a
    layer), said in one line.
    `replan(max_context, prefill_batch_size, window)` recomputes the plan with other flags unchanged."""
    if args.prompt_window is not None and args.prompt_window < 1:
        raise RunError("--prompt-window must be >= 1")
    room = getattr(args, "guess_room", False)
    if args.prompt_window is None:
        def window(guess_room: bool) -> int:
            args.guess_room = guess_room            # (replan reads it)
            return auto_prompt_window(lambda w: replan(args.max_ctx, args.prefill_batch_size, w),
                                      args.prefill_batch_size, args.max_ctx, k)
        alone = window(False)
        with_room = window(True) if room else alone
        # auto's room for guesses stays unless it would halve the window: a long prompt's experts would
        # then be read twice as often (Kimi K2 in 8.24 GB: 704 tokens without it, 192 with it)
        room = room and 2 * max(with_room, args.prefill_batch_size) >= alone
        args.prompt_window = with_room if room else alone
        log(f"prompt window: {args.prompt_window} tokens through each layer in turn (--prompt-window to choose)"
            if args.prompt_window > args.prefill_batch_size else
            "prompt window: none, the prompt goes chunk by chunk (every expert stays cached; --prompt-window to choose)")
    args.guess_room = room                  # (replan reads it)
    args.guess_room = room and replan(args.max_ctx, args.prefill_batch_size).fits


def refuse_if_unfit(plan: B.MemoryPlan, replan, args) -> None:
    """Refuse an unfit plan, naming each flag that alone would make it fit and the value to use.
    `replan(max_context, prefill_batch_size[, window])` recomputes the plan with other flags unchanged."""
    if plan.fits:
        return
    # a second file opened beside a first (--kl-reference) plans with what the first leaves of the budget
    reserved, why = getattr(args, "reserved", (0, ""))
    tips = [f"raise --memory-budget to at least {B.fmt(reserved + plan.budget + plan.shortfall())}"]
    ctx = _largest_fitting(1, args.max_ctx - 1, lambda c: replan(c, args.prefill_batch_size).fits)
    if ctx is not None:
        tips.append(f"lower --max-context from {args.max_ctx} to {ctx}")
    batch = _largest_fitting(1, args.prefill_batch_size - 1, lambda b: replan(args.max_ctx, b).fits)
    if batch is not None:
        tips.append(f"lower --prefill-batch-size from {args.prefill_batch_size} to {batch}")
    window = getattr(args, "prompt_window", None) or 0
    if window > args.prefill_batch_size and replan(args.max_ctx, args.prefill_batch_size, 0).fits:
        tips.append(f"lower --prompt-window from {window} to "
                    f"{_largest_fitting(1, window - 1, lambda n: replan(args.max_ctx, args.prefill_batch_size, n).fits)}")
    if plan.resident > plan.budget // 2:
        tips.append(f"convert with a lower-precision --quant (resident weights alone take {B.fmt(plan.resident)})")
    raise RunError(f"a budget of {B.fmt(plan.budget)}{why} cannot hold the minimum ({B.fmt(plan.fixed)} fixed + "
                   f"{plan.min_cache_experts} experts × {B.fmt(plan.expert_bytes)}; short by "
                   f"{B.fmt(plan.shortfall())}): " + "; or ".join(tips))
