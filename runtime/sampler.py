"""Choosing the next token from logits: greedy at temperature 0, else temperature + nucleus (top-p)."""

from __future__ import annotations

import numpy as np


class Sampler:
    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None):
        if temperature < 0:
            raise ValueError("--temperature must be >= 0")
        if not 0 < top_p <= 1:
            raise ValueError("--top-p must be in (0, 1]")
        self.temperature, self.top_p = temperature, top_p
        self.rng = np.random.default_rng(seed)

    def __call__(self, logits: np.ndarray) -> int:
        logits = np.asarray(logits, dtype=np.float64).reshape(-1)
        if self.temperature == 0:
            return int(np.argmax(logits))
        # the largest logit is taken off before dividing: a tiny temperature (1e-308) then sends the
        # others to -inf (probability 0) rather than every logit to +-inf (inf - inf = NaN)
        with np.errstate(over="ignore", under="ignore"):
            z = (logits - logits.max()) / self.temperature
            p = np.exp(z)
        p /= p.sum()
        if self.top_p < 1:
            order = np.argsort(-p, kind="stable")
            cum = np.cumsum(p[order])
            keep = order[: int(np.searchsorted(cum, self.top_p) + 1)]
            q = np.zeros_like(p)
            q[keep] = p[keep]
            p = q / q.sum()
        return int(self.rng.choice(p.size, p=p))
