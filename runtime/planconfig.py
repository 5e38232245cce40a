"""`kimi-run --plan-config config.json --quant PRESET`: the memory plan for a model that has not been
downloaded — sizes come from the config's geometry and the preset's codecs, exactly as the
converter would lay them out, planned by runtime/planner.py as a converted file would be."""

from __future__ import annotations

import json
from pathlib import Path

from kimistream.formats.codecs import CodecError
from kimistream.formats import memplan
from kimistream.formats.config import ConfigError, ModelConfig
from kimistream.formats.constants import ROUTED_EXPERTS
from kimistream.formats.presets import PRESETS, PrecisionPlan

from . import budget as B
from . import planner
from .errors import RunError


def read_config(path: Path) -> ModelConfig:
    """A Hugging Face config.json, or a one-line error naming the file and what is wrong with it."""
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise RunError(f"{path}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise RunError(f"{path}: not a JSON config (not UTF-8 text at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise RunError(f"{path}: not a JSON config ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(hf, dict):
        raise RunError(f"{path}: not a JSON config (a config.json is an object, this is a {type(hf).__name__})")
    try:
        return ModelConfig.from_hf(hf)
    except ConfigError as e:
        raise RunError(f"{path}: {e}") from None


def plan_config(args, log) -> int:
    path = Path(args.plan_config)
    cfg = read_config(path)
    args.quant = args.quant or "q2"
    if args.quant == "keep":
        raise RunError("--quant keep keeps a GGUF file's own types: convert it, then plan the file with --weights "
                       "FILE --dry-run")
    if args.quant not in PRESETS:
        raise RunError(f"unknown --quant {args.quant!r} (choose from {', '.join(PRESETS)})")
    try:
        precision = PrecisionPlan.from_preset(args.quant, args.override)
    except (ValueError, CodecError) as e:
        raise RunError(str(e)) from None
    precision.for_model(cfg.first_k_dense_replace, cfg.num_hidden_layers)
    footprint, total = memplan.of_config(cfg, precision)
    args.budget = B.parse_size(args.memory_budget) if args.memory_budget else int(B.DEFAULT_FRACTION * B.mem_available())
    args.max_ctx = planner.context_length(args, cfg, log)
    planner.default_kv_dtype(args, precision.classes[ROUTED_EXPERTS], log)
    # Not this process's RSS: the plan is for a kimi-run that has not started (maybe on another machine)
    baseline = memplan.recorded_baseline(footprint.total_experts)

    def replan(ctx, chunk, window=None, fp=None):
        return planner.plan(cfg, fp or footprint, args, baseline, ctx or args.max_ctx,
                            chunk or args.prefill_batch_size or planner.MIN_PREFILL_BATCH, recorded=True,
                            window=window)
    # Too big at the preset: resident classes one rung lower each, the least KL per byte first, as
    # kimi-convert --memory-budget does: planned with the smallest prompt chunk the default may pick and
    # the KV cache in f16 unless --kv-dtype says otherwise (kimi-run takes f16 when f32 does not fit)
    chunk, kv = args.prefill_batch_size or planner.MIN_FIT_CHUNK, args.kv_dtype
    args.kv_dtype = kv or "f16"
    preset_classes = dict(precision.classes)
    steps = memplan.fit_resident(cfg, precision, lambda fp: replan(None, chunk, fp=fp).fits)
    if steps and not replan(None, chunk, fp=memplan.of_config(cfg, precision)[0]).fits:
        log("resident: even with every resident class at its lowest rung the plan does not fit")
        precision.classes, steps = preset_classes, []
    args.kv_dtype = kv
    if steps:
        footprint, total = memplan.of_config(cfg, precision)
        for st in steps:
            log(f"resident: {st.describe()}")
        final = {st.cls: memplan.ResidentStep(st.cls, "", precision.classes[st.cls], 0) for st in steps}
        log(f"convert with --memory-budget '{args.memory_budget or B.fmt(args.budget)}'"
            + (f" --max-context {args.max_context}" if args.max_context else "")
            + (" --kv-dtype f32" if args.kv_dtype == "f32" else "")
            + " to choose the same, or --override " + " --override ".join(f"'{st.override()}'" for st in final.values()))
    planner.auto_fit(args, replan, log)           # the same defaults kimi-run would choose
    if args.prefill_batch_size is None:
        args.prefill_batch_size = planner.auto_prefill_batch(lambda b: replan(args.max_ctx, b))
        log(f"prefill batch: {args.prefill_batch_size} tokens (--prefill-batch-size to choose)")
    planner.default_prompt_window(args, replan, cfg.num_experts_per_tok, log)
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
                          "resident_steps": [st.to_json() for st in steps], "classes": precision.classes,
                          "file_bytes": total, "memory_plan": plan.to_json()}))
    planner.refuse_if_unfit(plan, replan, args)
    return 0
