"""Precision plans: which codec each tensor class gets, named presets for `--quant`, and per-tensor
overrides by regular expression (first match wins). Shared by the converter (to write a file) and
the runtime's planner (to size a file before it exists)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from .codecs import CodecError, get_codec
from .constants import (ATTENTION, DENSE_MLP, EMBEDDINGS, EXPERT_RE, LM_HEAD, NORMS, ROUTED_EXPERTS,
                                          ROUTER, SHARED_EXPERTS, TENSOR_CLASSES)


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


def _lowbit(experts: str) -> dict[str, str]:
    # Routed experts carry ~99 % of the bytes; everything read for every token stays at 4-6 bits.
    # The dense layers before the first MoE layer get 6: the most sensitive weights of the trained
    # models (at q4 they alone cost 40 % of the q2 preset's KL) and 0.04 % of Kimi K2's parameters.
    plan = _uniform("q4")
    plan[ROUTED_EXPERTS] = experts
    plan[ATTENTION] = plan[SHARED_EXPERTS] = "q4"
    plan[DENSE_MLP] = "q6"
    plan[LM_HEAD] = "q6"
    plan[EMBEDDINGS] = "q6"
    return plan


PRESETS: dict[str, dict[str, str]] = {
    "f32": _uniform("f32"),
    "f16": _uniform("f16"),
    "bf16": _uniform("bf16"),
    "q8": _uniform("q8"),
    "q4": _mixed("q4", "q8", "q8"),
    "q2": _lowbit("q2"),
    "t1": _lowbit("t1"),
    "q1": _lowbit("q1t"),
    # The quality baseline: round-to-nearest 2-bit min-max on the routed experts, everything else f32.
    "q2rtn-baseline": _mixed("q2rtn", "f32", "f32"),
    # A GGUF source's own types, each tensor in the codec that holds it exactly (PrecisionPlan.tensors)
    "keep": _uniform("f32"),
}

# One step up the ladder for the down projections of the first MoE layer (the dynamic GGUF recipes
# found them the most sensitive); applied only by the presets listed in BOOST_FIRST_MOE_DOWN, and only
# to models with at least BOOST_MIN_MOE_LAYERS MoE layers, where it costs < 0.02 bits per routed weight
# and the routed experts stay within the preset's budget (q2 <= 2.5, t1 <= 1.85, q1 <= 1.35 bpw).
STEP_UP = {"q1t": "t1", "q1": "t1", "t1": "q2", "q2": "q4"}
BOOST_FIRST_MOE_DOWN = ("q2", "t1", "q1")
BOOST_MIN_MOE_LAYERS = 24


@dataclass
class PrecisionPlan:
    preset: str
    classes: dict[str, str]
    overrides: list[tuple[str, str]] = field(default_factory=list)
    # The first MoE layer whose down projections get one step up; None: no step-up. Set by for_model.
    first_moe_layer: int | None = None
    # Codecs of single tensors by name (the "keep" preset: a GGUF's own types); overrides still win.
    tensors: dict[str, str] = field(default_factory=dict)

    def for_model(self, first_k_dense_replace: int, num_hidden_layers: int) -> "PrecisionPlan":
        """Tell the plan the model's geometry (call before codec_for): enables the first-MoE-layer
        step-up when the model has enough MoE layers for it to fit the preset's bit budget."""
        moe_layers = num_hidden_layers - first_k_dense_replace
        self.first_moe_layer = first_k_dense_replace if moe_layers >= BOOST_MIN_MOE_LAYERS else None
        return self

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
            try:
                get_codec(codec)
            except CodecError as e:
                raise ValueError(f"--override {ov!r}: {e}") from None
            parsed.append((pattern, codec))
        return cls(name, dict(PRESETS[name]), parsed)

    def codec_for(self, name: str, cls: str, shape=None) -> str:
        # The router's correction bias is added to sigmoid scores to pick experts: keep it exact.
        if name.endswith("e_score_correction_bias"):
            return "f32"
        codec = self.tensors.get(name) or self.classes[cls]
        if cls == ROUTED_EXPERTS and self.preset in BOOST_FIRST_MOE_DOWN and self.first_moe_layer is not None:
            m = EXPERT_RE.match(name)
            if m and int(m.group(1)) == self.first_moe_layer and m.group(3) == "down_proj":
                codec = STEP_UP.get(codec, codec)
        for pattern, c in self.overrides:
            if re.search(pattern, name):
                codec = c
                break
        # A group codec needs whole groups along the input dimension; a tensor without them (and
        # every 1-D tensor) falls back to the codec's own fallback (q1t: q1, the same values row by
        # row), else to f16, or f32 when the plan asked for a float codec.
        fallback = getattr(get_codec(codec), "fallback", None)
        if fallback and cls != ROUTED_EXPERTS:      # q1t is a layout for the routed experts' kernel alone
            codec = fallback
        if shape is not None and fallback and not get_codec(codec).supports(shape):
            codec = fallback
        if shape is not None and not get_codec(codec).supports(shape):
            codec = "f16" if get_codec("f16").supports(shape) else "f32"
        return codec

    def to_json(self) -> dict:
        out = {"preset": self.preset, "classes": self.classes, "overrides": [list(o) for o in self.overrides]}
        if self.tensors:      # every tensor's codec is in the file's directory; a digest tells two plans apart
            import hashlib
            out["tensors"] = {"count": len(self.tensors), "sha256": hashlib.sha256(
                json.dumps(sorted(self.tensors.items())).encode()).hexdigest()}
        if self.preset in BOOST_FIRST_MOE_DOWN and self.first_moe_layer is not None:
            out["first_moe_down"] = {"layer": self.first_moe_layer,
                                     "codec": STEP_UP.get(self.classes[ROUTED_EXPERTS])}
        return out


