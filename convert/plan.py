"""Precision plans: which codec each tensor class gets, named presets for `--quant`, and per-tensor
overrides by regular expression (first match wins)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kimistream.formats.codecs import get_codec
from kimistream.formats.constants import EMBEDDINGS, NORMS, ROUTED_EXPERTS, ROUTER, TENSOR_CLASSES


def _uniform(codec: str) -> dict[str, str]:
    # Norms and routers are tiny and decide routing; they never go below f32 in any preset.
    plan = {c: codec for c in TENSOR_CLASSES}
    plan[NORMS] = plan[ROUTER] = "f32"
    return plan


def _mixed(experts: str, resident: str, embeddings: str) -> dict[str, str]:
    plan = _uniform(resident)
    plan[ROUTED_EXPERTS] = experts
    plan[EMBEDDINGS] = embeddings
    return plan


PRESETS: dict[str, dict[str, str]] = {
    "f32": _uniform("f32"),
    "f16": _uniform("f16"),
    "bf16": _uniform("bf16"),
    "q8": _uniform("q8"),
    "q4": _mixed("q4", "q8", "q8"),
    "q2-rtn": _mixed("q2", "q8", "q8"),
}


@dataclass
class PrecisionPlan:
    preset: str
    classes: dict[str, str]
    overrides: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def from_preset(cls, name: str, overrides=()) -> "PrecisionPlan":
        if name not in PRESETS:
            raise ValueError(f"unknown --quant preset {name!r} (choose from {', '.join(PRESETS)})")
        parsed = []
        for ov in overrides:
            pattern, sep, codec = ov.rpartition("=")
            if not sep or not pattern:
                raise ValueError(f"--override {ov!r}: expected 'REGEX=CODEC'")
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"--override {ov!r}: bad regular expression ({e})") from None
            get_codec(codec)
            parsed.append((pattern, codec))
        return cls(name, dict(PRESETS[name]), parsed)

    def codec_for(self, name: str, cls: str, shape=None) -> str:
        # The router's correction bias is added to sigmoid scores to pick experts: keep it exact.
        if name.endswith("e_score_correction_bias"):
            return "f32"
        codec = self.classes[cls]
        for pattern, c in self.overrides:
            if re.search(pattern, name):
                codec = c
                break
        # A group codec needs whole groups along the input dimension; a tensor without them (and
        # every 1-D tensor) falls back to f16, or f32 when the plan asked for a float codec.
        if shape is not None and not get_codec(codec).supports(shape):
            codec = "f16" if get_codec("f16").supports(shape) else "f32"
        return codec

    def to_json(self) -> dict:
        return {"preset": self.preset, "classes": self.classes, "overrides": [list(o) for o in self.overrides]}


