"""The precision plans kimi-convert applies (defined in kimistream.formats.presets, which the
runtime's memory planner shares)."""

from kimistream.formats.presets import PRESETS, PrecisionPlan  # noqa: F401
