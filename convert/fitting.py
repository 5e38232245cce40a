"""kimi-convert --memory-budget: the precision of each resident class chosen so that the file about to
be written fits the budget as kimi-run will plan it (formats/memplan.py, the same arithmetic: a
recorded baseline, the KV cache of --max-context tokens, the smallest prompt chunk, at least one
token's experts cached). Classes go down one rung at a time, the least measured KL per byte saved
first; explicit --override patterns keep winning."""

from __future__ import annotations

from dataclasses import dataclass

from kimistream.formats import memplan
from kimistream.formats.config import ModelConfig
from kimistream.formats.presets import PrecisionPlan
from kimistream.formats.sizes import fmt, parse_size


class FitError(ValueError):
    pass


@dataclass
class Fit:
    budget: int
    max_context: int
    kv_dtype: str
    steps: list
    plan: memplan.MemoryPlan
    file_bytes: int

    def lines(self) -> list[str]:
        out = [f"resident: {st.describe()}" for st in self.steps]
        if not self.steps:
            out.append("resident: the preset's precisions fit the budget as they are")
        p = self.plan
        out.append(f"planned for a budget of {fmt(self.budget)} ({self.max_context}-token context, {self.kv_dtype} KV "
                   f"cache): resident {fmt(p.resident)}, expert cache {p.cache_experts} of {p.total_experts} experts; "
                   f"file {fmt(self.file_bytes)}")
        return out

    def rows(self):
        return self.plan.rows()

    def to_json(self) -> dict:
        return {"budget": self.budget, "max_context": self.max_context, "kv_dtype": self.kv_dtype,
                "steps": [st.to_json() for st in self.steps], "file_bytes": self.file_bytes,
                "memory_plan": self.plan.to_json()}


def fit_to_budget(cfg: ModelConfig, precision: PrecisionPlan, budget_text: str, max_context: int | None,
                  kv_dtype: str | None, tokenizer_bytes: int = memplan.TOKENIZER_ALLOWANCE) -> Fit:
    """Lower `precision`'s resident classes (in place) until a run of `cfg` fits; FitError (one line)
    when the budget cannot hold it even at every class's lowest rung."""
    try:
        budget = parse_size(budget_text)
    except ValueError as e:
        raise FitError(f"--memory-budget: {e}") from None
    if max_context is not None and max_context < 1:
        raise FitError("--max-context must be at least 1")
    ctx = max_context or memplan.default_context(cfg)
    kv = kv_dtype or "f16"
    precision.for_model(cfg.first_k_dense_replace, cfg.num_hidden_layers)

    def plan_of(fp):
        return memplan.plan_for(cfg, fp, budget=budget, baseline=memplan.recorded_baseline(fp.total_experts),
                                max_context=ctx, chunk=memplan.MIN_FIT_CHUNK, kv_itemsize=2 if kv == "f16" else 4,
                                baseline_recorded=True)
    steps = memplan.fit_resident(cfg, precision, lambda fp: plan_of(fp).fits, tokenizer_bytes)
    fp, file_bytes = memplan.of_config(cfg, precision, tokenizer_bytes=tokenizer_bytes)
    plan = plan_of(fp)
    if not plan.fits:
        lowest = " even with every resident class at its lowest rung" if steps else ""
        raise FitError(f"a budget of {fmt(budget)} cannot hold this model{lowest} ({fmt(plan.fixed)} fixed, of "
                       f"which resident weights {fmt(fp.resident)}, + {plan.min_cache_experts} experts × "
                       f"{fmt(fp.expert_bytes)}; short by {fmt(plan.shortfall())}): raise --memory-budget, lower "
                       f"--max-context ({ctx}) or choose a lower --quant")
    return Fit(budget, ctx, kv, steps, plan, file_bytes)
