"""kimi-verify finds each kind of damage and says so with its own status and exit code."""

import json
import shutil
import subprocess
import sys

import pytest


def verify(*args):
    proc = subprocess.run([sys.executable, "-m", "kimistream.convert.verify_cli", *map(str, args), "--json"],
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, json.loads(proc.stdout)


@pytest.fixture
def ckpt_with_manifest(tiny_ckpt, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, d)
    man = tmp_path / "m.sha256"
    code, _ = verify(d, "--write-manifest", man)
    assert code == 5                      # nothing to compare against yet: unverifiable, not ok
    return d, man


def _status(rows, suffix):
    return next(r["status"] for r in rows if r["file"].endswith(suffix))


def test_clean_directory_passes(ckpt_with_manifest):
    d, man = ckpt_with_manifest
    code, rep = verify(d, "--manifest", man)
    assert code == 0 and rep["ok"]
    assert _status(rep["rows"], "model.safetensors") == "ok"


def test_missing_shard(ckpt_with_manifest):
    d, man = ckpt_with_manifest
    (d / "model.safetensors").unlink()
    code, rep = verify(d, "--manifest", man)
    assert code == 3 and _status(rep["rows"], "model.safetensors") == "missing"


def test_flipped_byte(ckpt_with_manifest):
    d, man = ckpt_with_manifest
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-100] ^= 0x01
    f.write_bytes(bytes(data))
    code, rep = verify(d, "--manifest", man)
    assert code == 4 and _status(rep["rows"], "model.safetensors") == "corrupt"


def test_truncated_shard_and_tensor_past_end(ckpt_with_manifest):
    d, man = ckpt_with_manifest
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    code, rep = verify(d)                 # no manifest: the header check alone finds it
    row = next(r for r in rep["rows"] if r["file"].endswith("model.safetensors"))
    assert code == 4 and row["status"] == "corrupt" and "past the end" in row["detail"]


def test_converted_file_with_corrupt_expert(tiny_kst, tmp_path):
    from kimistream.formats.weightfile import WeightFile
    bad = tmp_path / "bad.kst"
    shutil.copy(tiny_kst, bad)
    with WeightFile(bad) as wf:
        ext = next(e for e in wf.extents if e.name == "expert.2.5")
        pos = ext.offset + 123
    data = bytearray(bad.read_bytes())
    data[pos] ^= 0xFF
    bad.write_bytes(bytes(data))
    code, rep = verify(tiny_kst)
    assert code == 0
    code, rep = verify(bad)
    assert code == 4
    assert [r["file"] for r in rep["rows"] if r["status"] == "corrupt"] == ["bad.kst [expert.2.5]"]


def test_converted_file_truncated(tiny_kst, tmp_path):
    bad = tmp_path / "short.kst"
    bad.write_bytes(tiny_kst.read_bytes()[:-4096])
    code, rep = verify(bad)
    assert code == 4 and "truncated" in rep["rows"][0]["detail"]
