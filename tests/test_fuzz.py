"""A seeded fuzzer over the inputs the tools take from disk. Each case mutates a small weight file
(prefix bytes, header JSON values re-digested so that only the semantic checks can catch them,
extent bytes, the file's length) or a small checkpoint's config.json, then runs what a user would:
open the weight file as kimi-run does (reader, model check, resident load, one decode step that
reads experts) and verify its extents as kimi-verify does; or open the checkpoint as kimi-convert
does. A case passes if it is refused with one of the project's own errors, or accepted with the
same logits as the intact file. Any other exception, or a changed result accepted silently, fails.
Fixed seeds; the case count is set by KIMI_FUZZ_CASES (default 2000)."""

import json
import os
import shutil

import numpy as np
import pytest

from kimistream.convert.source import HFCheckpoint, SourceError
from kimistream.formats import weightfile as W
from kimistream.formats.checksum import header_digest
from kimistream.formats.codecs import CodecError
from kimistream.formats.config import ConfigError
from kimistream.formats.weightfile import WeightFile, WeightFileError
from kimistream.runtime.model import Model
from kimistream.runtime.pager import ExpertReadError
from kimistream.runtime.weights import ModelWeights

OWN_ERRORS = (WeightFileError, ConfigError, CodecError, ExpertReadError, SourceError)
CASES = int(os.environ.get("KIMI_FUZZ_CASES", "2000"))


def logits_of(path):
    """kimi-run's path through a weight file: open and check it, load the resident set, run one
    token (its routed experts are read); and every extent checked as kimi-verify does."""
    w = ModelWeights(path)
    try:
        w.load_resident()
        out = Model(w, 8).forward([1])
    finally:
        w.close()
    with WeightFile(path) as wf:
        bad = [e.name for e in wf.extents if not wf.verify_extent(e)]
    return out, bad


def random_value(rng):
    return [None, True, -1, 0, 3, 2 ** 40, 1.5, "x", "", [], [1, "a"], {}, {"k": 1}][rng.integers(13)]


def mutate_json(doc, rng, depth=0):
    """Replace one value somewhere in doc (a dict or list) with a random one."""
    keys = list(doc.keys()) if isinstance(doc, dict) else list(range(len(doc)))
    if not keys:
        return
    k = keys[rng.integers(len(keys))]
    child = doc[k]
    if isinstance(child, (dict, list)) and child and depth < 4 and rng.random() < 0.7:
        mutate_json(child, rng, depth + 1)
    else:
        doc[k] = random_value(rng)


@pytest.fixture(scope="module")
def subject(tiny_kst, tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    clean, bad = logits_of(tiny_kst)
    assert not bad
    raw = tiny_kst.read_bytes()
    prefix = W._PREFIX.unpack(raw[:W.PREFIX_SIZE])
    return d, raw, prefix, clean


def weight_file_case(rng, raw, prefix):
    """Bytes of one mutated weight file and whether the change can be harmless (header edits may be)."""
    magic, version, alignment, hoff, hlen, data_start, size, _ = prefix
    kind = rng.integers(4)
    if kind == 0:                                   # prefix bytes
        b = bytearray(raw)
        for _ in range(rng.integers(1, 4)):
            b[rng.integers(W.PREFIX_SIZE)] ^= 1 << int(rng.integers(8))
        return bytes(b), False
    if kind == 1:                                   # a header value, re-digested
        header = json.loads(raw[hoff:hoff + hlen])
        mutate_json(header, rng)
        hb = json.dumps(header).encode()
        if hoff + len(hb) > data_start:
            return raw[:len(raw) // 2], False
        p = W._PREFIX.pack(magic, version, alignment, hoff, len(hb), data_start, size, header_digest(hb))
        return p + raw[W.PREFIX_SIZE:hoff] + hb + b" " * (data_start - hoff - len(hb)) + raw[data_start:], True
    if kind == 2:                                   # extent bytes
        b = bytearray(raw)
        for _ in range(rng.integers(1, 4)):
            b[data_start + rng.integers(len(raw) - data_start)] ^= 1 << int(rng.integers(8))
        return bytes(b), True                       # a flip in alignment padding changes nothing
    cut = int(rng.integers(len(raw)))               # truncated or extended
    return (raw[:cut] if rng.random() < 0.5 else raw + bytes(cut % 4096 + 1)), False


def test_fuzz_weight_files(subject):
    d, raw, prefix, clean = subject
    rng = np.random.default_rng(20261130)
    path = d / "case.kst"
    accepted = 0
    for case in range(CASES * 3 // 4):
        data, may_be_harmless = weight_file_case(rng, raw, prefix)
        path.write_bytes(data)
        try:
            out, bad = logits_of(path)
        except OWN_ERRORS:
            continue
        except Exception as e:          # noqa: BLE001 — this is the finding
            pytest.fail(f"case {case}: {type(e).__name__}: {e}")
        if bad:
            continue                    # kimi-verify reports it
        accepted += 1
        assert may_be_harmless and np.array_equal(out, clean), f"case {case}: a changed file was accepted"
    assert accepted < CASES              # most mutations are caught


def test_fuzz_checkpoint_configs(tiny_ckpt, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, ck)
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    rng = np.random.default_rng(7)
    for case in range(CASES // 4):
        doc = json.loads(json.dumps(cfg))
        for _ in range(rng.integers(1, 3)):
            mutate_json(doc, rng)
        (ck / "config.json").write_text(json.dumps(doc))
        try:
            HFCheckpoint(ck).close()
        except OWN_ERRORS:
            pass
        except Exception as e:          # noqa: BLE001 — this is the finding
            pytest.fail(f"case {case}: config {doc}: {type(e).__name__}: {e}")
