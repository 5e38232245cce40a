"""Precision plans: which codec each tensor class gets, named presets for `--quant`, and per-tensor
overrides by regular expression (first match wins)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kimistream.formats.codecs import get_codec
from kimistream.formats.constants import NORMS, ROUTER, TENSOR_CLASSES


def _uniform(codec: str) -> dict[str, str]:
    # Norms and routers are tiny and decide routing; they never go below f32 in any preset.
    plan = {c: codec for c in TENSOR_CLASSES}
    plan[NORMS] = plan[ROUTER] = "f32"
    return plan


PRESETS: dict[str, dict[str, str]] = {
    "f32": _uniform("f32"),
    "f16": _uniform("f16"),
    "bf16": _uniform("bf16"),
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

    def codec_for(self, name: str, cls: str) -> str:
        # The router's correction bias is added to sigmoid scores to pick experts: keep it exact.
        if name.endswith("e_score_correction_bias"):
            return "f32"
        for pattern, codec in self.overrides:
            if re.search(pattern, name):
                return codec
        return self.classes[cls]

    def to_json(self) -> dict:
        return {"preset": self.preset, "classes": self.classes, "overrides": [list(o) for o in self.overrides]}


