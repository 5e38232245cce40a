"""Shared fixtures: tiny reference checkpoints are built once per session."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import refmodels  # noqa: E402


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    refmodels.make_checkpoint(d, seed=1)
    return d


@pytest.fixture(scope="session")
def tiny_kst(tiny_ckpt, tmp_path_factory):
    from kimistream.convert.converter import convert_checkpoint
    from kimistream.formats.presets import PrecisionPlan
    out = tmp_path_factory.mktemp("tinykst") / "tiny.kst"
    convert_checkpoint(tiny_ckpt, out, PrecisionPlan.from_preset("f32"))
    return out
