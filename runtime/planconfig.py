"""`kimi-run --plan-config config.json --quant PRESET`: the memory plan for a model that has not been
downloaded — sizes come from the config's geometry and the preset's codecs, exactly as the
converter would lay them out."""

from __future__ import annotations

import json
import math
from pathlib import Path

from kimistream.formats.codecs import get_codec, is_float_codec
from kimistream.formats.config import ConfigError, ModelConfig
from kimistream.formats.constants import EXTENT_EXPERT, EXTENT_RESIDENT
from kimistream.formats.layout import plan_extents
from kimistream.formats.presets import PRESETS, PrecisionPlan

from . import budget as B


def plan_config(args, log) -> int:
    from .app import RunError, describe_plan, refuse_if_unfit
    path = Path(args.plan_config)
    try:
        cfg = ModelConfig.from_hf(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError, ConfigError) as e:
        raise RunError(f"{path}: {e}") from None
    if args.quant not in PRESETS:
        raise RunError(f"unknown --quant {args.quant!r} (choose from {', '.join(PRESETS)})")
    precision = PrecisionPlan.from_preset(args.quant).for_model(cfg.first_k_dense_replace, cfg.num_hidden_layers)
    layout = plan_extents(cfg, precision.codec_for)
    size = {}
    resident = expert = 0
    n_experts = 0
    for name, kind, tensors in layout:
        nb = sum(get_codec(codec).nbytes(shape) for _, _, codec, shape in tensors)
        size[name] = nb
        if kind == EXTENT_RESIDENT:
            resident += nb
        elif kind == EXTENT_EXPERT:
            expert = max(expert, nb)
            n_experts += 1
    # The runtime's float32 copies of resident tensors that are used at every token.
    from .model import _DECODED_SUFFIXES
    copies = 0
    for name, kind, tensors in layout:
        for tname, _, codec, shape in tensors:
            if is_float_codec(codec) and codec != "f32" and (tname.endswith(_DECODED_SUFFIXES) or tname == "lm_head.weight"):
                copies += 4 * math.prod(shape)
    # kv_b_proj is decoded per use when packed: one layer's worth of scratch.
    scratch = max((4 * math.prod(shape) for _, _, tensors in layout for tname, _, codec, shape in tensors
                   if tname.endswith("kv_b_proj.weight") and codec != "f32"), default=0)
    args.budget = B.parse_size(args.memory_budget) if args.memory_budget else int(B.DEFAULT_FRACTION * B.mem_available())
    from .app import context_length
    args.max_ctx = context_length(args, cfg, log)
    # Not this process's RSS: the plan is for a kimi-run that has not started (maybe on another machine)
    baseline = B.RECORDED_BASELINE + n_experts * B.RECORDED_BASELINE_PER_EXPERT

    def replan(ctx, chunk):
        metadata = 4 * cfg.hidden_size * chunk + 16 * 2 ** 20   # header, tokenizer, rows in flight
        return B.make_plan(cfg, budget=args.budget, baseline=baseline, resident=resident + copies,
                           metadata=metadata, expert_bytes=expert, total_experts=n_experts, max_context=ctx,
                           chunk=chunk, expert_scratch=scratch, prefetch=args.prefetch != "off",
                           kv_itemsize=2 if args.kv_dtype == "f16" else 4, baseline_recorded=True)
    if args.prefill_batch_size is None:
        from .app import _auto_prefill_batch
        args.prefill_batch_size = _auto_prefill_batch(lambda b: replan(args.max_ctx, b))
        log(f"prefill batch: {args.prefill_batch_size} tokens (--prefill-batch-size to choose)")
    plan = replan(args.max_ctx, args.prefill_batch_size)
    total = sum(size.values())
    log(f"{path}: {cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts × {len(cfg.moe_layers)} MoE layers, "
        f"preset {args.quant}: file {B.fmt(total)}, resident {B.fmt(resident)} (+{B.fmt(copies)} float32 copies), "
        f"one expert {B.fmt(expert)}")
    describe_plan(plan, log)
    verdict = "fits" if plan.fits else "does not fit"
    log(f"verdict: {verdict} — expert cache of {plan.cache_experts} experts "
        f"({plan.cache_experts / max(1, n_experts):.2%} of all)")
    if args.json:
        print(json.dumps({"config": str(path), "quant": args.quant, "file_bytes": total, "memory_plan": plan.to_json()}))
    refuse_if_unfit(plan, replan, args)
    return 0
