"""Nothing outside the job is read, overwritten or deleted: shard paths from an index stay inside the
checkpoint directory (an absolute path or a '..' is refused before any file is opened, and
--delete-source never reaches outside), and -o never aliases a file the conversion reads (directly,
through a symlink or a hard link). Each case: a non-zero exit, one line naming the file and the
problem, no traceback, and the outside or source file unchanged."""

import hashlib
import json
import os
import shutil

import pytest

from kimistream.convert.converter import ConversionError, convert_checkpoint
from kimistream.formats.presets import PrecisionPlan
from kimistream.convert.source import SourceError, read_index
from kimistream.convert.verify import verify_directory
from test_cli import convert, run
from test_sources import _reshard

F32 = PrecisionPlan.from_preset("f32")


def digest(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()


def one_line_error(proc, *words):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for w in words:
        assert w in lines[0], lines[0]


@pytest.fixture()
def hostile(tiny_ckpt, tmp_path):
    """A two-shard checkpoint whose index sends one shard outside the directory (a victim file that
    must survive), in the two ways an index can: an absolute path and a climb with '..'."""
    def make(kind):
        ck = _reshard(tiny_ckpt, tmp_path / f"ck-{kind}", lambda i, n: f"model-{i}-of-{n}.safetensors", 2)
        victim_dir = tmp_path / f"outside-{kind}"
        victim_dir.mkdir()
        victim = victim_dir / "model-2-of-2.safetensors"
        shutil.move(ck / "model-2-of-2.safetensors", victim)
        idx = ck / "model.safetensors.index.json"
        doc = json.loads(idx.read_text())
        target = str(victim) if kind == "absolute" else f"../{victim_dir.name}/{victim.name}"
        doc["weight_map"] = {k: (target if v == "model-2-of-2.safetensors" else v) for k, v in doc["weight_map"].items()}
        idx.write_text(json.dumps(doc))
        return ck, victim
    return make


@pytest.mark.parametrize("kind", ["absolute", "dotdot"])
def test_index_cannot_reach_outside_the_checkpoint(hostile, tmp_path, kind):
    ck, victim = hostile(kind)
    before = digest(victim)
    with pytest.raises(SourceError, match="shard"):
        read_index(ck / "model.safetensors.index.json")
    proc = convert(ck, "-o", tmp_path / "m.kst", "--quant", "f32", "--calibration", "none", "--delete-source",
                   check=False)
    one_line_error(proc, "model.safetensors.index.json", "shard")
    assert victim.exists() and digest(victim) == before
    assert not (tmp_path / "m.kst").exists()
    rows = {r.file: r for r in verify_directory(ck, None)}
    assert rows["model.safetensors.index.json"].status != "OK"
    proc = run("convert.verify_cli", ck, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert victim.exists() and digest(victim) == before


def test_verify_never_reads_outside_for_manifest_names(tiny_ckpt, tmp_path):
    outside = tmp_path / "secret.txt"
    outside.write_text("not yours")
    rows = {r.file: r for r in verify_directory(tiny_ckpt, {"../secret.txt": "0" * 64})}
    assert rows["../secret.txt"].status != "OK" and "file name" in rows["../secret.txt"].detail


@pytest.mark.parametrize("how", ["same", "symlink", "hardlink"])
def test_output_never_overwrites_a_source(tiny_ckpt, tmp_path, how):
    ck = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, ck)
    shard = ck / "model.safetensors"
    before = digest(shard)
    out = {"same": shard, "symlink": tmp_path / "link.kst", "hardlink": tmp_path / "hard.kst"}[how]
    if how == "symlink":
        os.symlink(shard, out)
    elif how == "hardlink":
        os.link(shard, out)
    with pytest.raises(ConversionError, match="overwrite the source"):
        convert_checkpoint(ck, out, F32)
    proc = convert(ck, "-o", out, "--quant", "f32", check=False)     # default calibration: checked first too
    one_line_error(proc, str(out), "overwrite the source")
    assert digest(shard) == before
    assert not list(tmp_path.glob("**/*.partial*"))


def test_output_never_overwrites_the_config_or_the_imatrix(tiny_ckpt, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, ck)
    before = digest(ck / "config.json")
    proc = convert(ck, "-o", ck / "config.json", "--quant", "f32", "--calibration", "none", check=False)
    one_line_error(proc, "config.json", "overwrite the source")
    assert digest(ck / "config.json") == before
    imx = tmp_path / "imatrix.npz"
    imx.write_bytes(b"placeholder")
    proc = convert(ck, "-o", imx, "--quant", "f32", "--imatrix", imx, check=False)
    one_line_error(proc, "imatrix.npz", "overwrite the source")
    assert imx.read_bytes() == b"placeholder"
