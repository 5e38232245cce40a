"""Named precision presets (tensor class -> codec) and the rule that applies one to a tensor. Shared
by the converter (to write a file) and the runtime's planner (to size a file before it exists)."""

from __future__ import annotations

from .codecs import get_codec
from .constants import EMBEDDINGS, NORMS, ROUTED_EXPERTS, ROUTER, TENSOR_CLASSES


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
    "q2": _mixed("q2", "q4", "q8"),
}


def codec_for(classes: dict[str, str], name: str, cls: str, shape=None, overrides=()) -> str:
    """The codec of one tensor: the router's correction bias is always f32 (it is added to sigmoid
    scores to pick experts); then the first matching override; then the class's codec. A group codec
    needs whole groups along the input dimension: a tensor without them (and every 1-D tensor)
    falls back to f16, or f32 when f16 cannot hold it."""
    import re
    if name.endswith("e_score_correction_bias"):
        return "f32"
    codec = classes[cls]
    for pattern, c in overrides:
        if re.search(pattern, name):
            codec = c
            break
    if shape is not None and not get_codec(codec).supports(shape):
        codec = "f16" if get_codec("f16").supports(shape) else "f32"
    return codec
