"""Prompt in, tokens out: the prompt (in chunks, or in windows a layer at a time), then one token at a
time until max tokens, an end-of-sequence token, or a full context. Timings are kept for the report."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .model import ContextFull, Model
from .sampler import Sampler


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    stop_reason: str = ""
    token_seconds: list = field(default_factory=list)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # The first generated token comes from the prefill's logits; decode steps are the rest.
        steps = len(self.token_seconds)
        return steps / self.decode_seconds if self.decode_seconds else 0.0


def generate(model: Model, prompt_ids: list[int], max_tokens: int, sampler: Sampler, prefill_batch: int,
             stop_ids=(), stats: GenerationStats | None = None, on_prefill_logits=None, telemetry=None,
             cancelled=None, window: int | None = None):
    """Yield generated token ids; the prompt goes in windows of `window` tokens a layer at a time
    (Model.prefill; None: chunk by chunk). `on_prefill_logits(all_logits)` gets every prompt position's
    logits when given (teacher-forced), at no extra cost. `telemetry.record(phase, n)` closes each step.
    `cancelled()`, when given, is asked before each prefill chunk, each layer of a window and each decode
    step: True stops there (stop reason "cancelled")."""
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt_ids)
    if not prompt_ids:
        raise ValueError("the prompt is empty after tokenisation")
    if len(prompt_ids) > model.cache.max_context:
        raise ContextFull(f"the prompt has {len(prompt_ids)} tokens but --max-context is {model.cache.max_context}")
    if prefill_batch < 1:
        raise ValueError("--prefill-batch-size must be at least 1")
    t0 = time.perf_counter()
    all_logits = on_prefill_logits is not None
    # every position's logits are planned for a chunk at a time, not a window's
    logits = model.prefill(prompt_ids, prefill_batch, all_logits, None if all_logits else window, cancelled,
                           (lambda n: telemetry.record("prefill", n)) if telemetry else None)
    if logits is None:
        stats.stop_reason = "cancelled"
        return
    if all_logits:
        on_prefill_logits(logits)
        logits = logits[-1:]
    stats.prefill_seconds = time.perf_counter() - t0
    stop = set(stop_ids)
    for i in range(max_tokens):
        tok = sampler(logits[-1])
        stats.generated_tokens += 1
        yield tok
        if tok in stop:
            stats.stop_reason = "eos"
            return
        if i + 1 == max_tokens:
            break
        if model.cache.length >= model.cache.max_context:
            stats.stop_reason = "context full"
            return
        if cancelled is not None and cancelled():
            stats.stop_reason = "cancelled"
            return
        t = time.perf_counter()
        logits = model.forward([tok])
        dt = time.perf_counter() - t
        if telemetry:
            telemetry.record("decode", 1)
        stats.token_seconds.append(dt)
        stats.decode_seconds += dt
    stats.stop_reason = "max tokens"
