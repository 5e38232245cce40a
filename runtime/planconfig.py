"""`kimi-run --plan-config config.json --quant PRESET`: the memory plan for a model that has not been
downloaded — sizes come from the config's geometry and the preset's codecs, exactly as the
converter would lay them out, planned by runtime/planner.py as a converted file would be."""

from __future__ import annotations

import json
from pathlib import Path

from kimistream.formats.codecs import CodecError
from kimistream.formats.config import ConfigError, ModelConfig
from kimistream.formats.presets import PRESETS, PrecisionPlan

from . import budget as B
from . import planner
from .errors import RunError


def plan_config(args, log) -> int:
    path = Path(args.plan_config)
    try:
        cfg = ModelConfig.from_hf(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError, ConfigError) as e:
        raise RunError(f"{path}: {e}") from None
    if args.quant not in PRESETS:
        raise RunError(f"unknown --quant {args.quant!r} (choose from {', '.join(PRESETS)})")
    try:
        precision = PrecisionPlan.from_preset(args.quant, args.override)
    except (ValueError, CodecError) as e:
        raise RunError(str(e)) from None
    precision.for_model(cfg.first_k_dense_replace, cfg.num_hidden_layers)
    footprint, total = planner.of_config(cfg, precision)
    args.budget = B.parse_size(args.memory_budget) if args.memory_budget else int(B.DEFAULT_FRACTION * B.mem_available())
    args.max_ctx = planner.context_length(args, cfg, log)
    # Not this process's RSS: the plan is for a kimi-run that has not started (maybe on another machine)
    baseline = B.RECORDED_BASELINE + footprint.total_experts * B.RECORDED_BASELINE_PER_EXPERT

    def replan(ctx, chunk):
        return planner.plan(cfg, footprint, args, baseline, ctx or args.max_ctx,
                            chunk or args.prefill_batch_size or planner.MIN_PREFILL_BATCH, recorded=True)
    def fits_now():                               # with the smallest prompt chunk the default may pick
        return replan(None, args.prefill_batch_size or planner.MIN_FIT_CHUNK).fits
    planner.auto_fit(args, replan, log)           # the same defaults kimi-run would choose
    if not fits_now() and not args.override:
        # Routers in float32 are a large part of the resident set when experts are many (1.8 GB of
        # a K2-style model with 1 048): at q8 they run fused like any weight. Offered when it is what fits.
        pattern, codec = planner.ROUTER_FIT
        alt = PrecisionPlan.from_preset(args.quant, [f"{pattern}={codec}"])
        alt.for_model(cfg.first_k_dense_replace, cfg.num_hidden_layers)
        kept = footprint, total
        footprint, total = planner.of_config(cfg, alt)
        said = []
        planner.auto_fit(args, replan, said.append)
        if fits_now():
            precision = alt
            log(f"routers: {codec} ({B.fmt(kept[0].resident - footprint.resident)} less resident; f32 ones do not "
                f"fit the budget): convert with --override '{pattern}={codec}'")
            for line in said:
                log(line)
        else:
            footprint, total = kept          # auto_fit undid its own choices
    if args.prefill_batch_size is None:
        args.prefill_batch_size = planner.auto_prefill_batch(lambda b: replan(args.max_ctx, b))
        log(f"prefill batch: {args.prefill_batch_size} tokens (--prefill-batch-size to choose)")
    plan = replan(args.max_ctx, args.prefill_batch_size)
    log(f"{path}: {cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts × {len(cfg.moe_layers)} MoE layers, "
        f"preset {args.quant}: file {B.fmt(total)}, resident {B.fmt(footprint.resident)} (float32 copies included), "
        f"one expert {B.fmt(footprint.expert_bytes)}")
    planner.describe_plan(plan, log)
    verdict = "fits" if plan.fits else "does not fit"
    log(f"verdict: {verdict} — expert cache of {plan.cache_experts} experts "
        f"({plan.cache_experts / max(1, footprint.total_experts):.2%} of all)")
    if args.json:
        print(json.dumps({"config": str(path), "quant": args.quant, "overrides": [list(o) for o in precision.overrides],
                          "file_bytes": total, "memory_plan": plan.to_json()}))
    planner.refuse_if_unfit(plan, replan, args)
    return 0
