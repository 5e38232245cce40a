"""Interrupted conversions resume where they stopped and finish with a file identical, byte for byte,
to an uninterrupted conversion — after an exception, after the process is killed outright, and with
--delete-source removing each shard once it is consumed."""

import subprocess
import sys
import textwrap

import pytest

from kimistream.convert.converter import convert_checkpoint
from kimistream.formats.presets import PrecisionPlan
from test_sources import _reshard

PLAN = PrecisionPlan.from_preset("bf16")


class Stop(Exception):
    pass


def _stop_after(n):
    seen = {"n": 0}

    def progress(kind, **info):
        if kind == "tensor":
            seen["n"] += 1
            if seen["n"] == n:
                raise Stop
    return progress


@pytest.fixture(scope="module")
def reference(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "ref.kst"
    convert_checkpoint(tiny_ckpt, out, PLAN)
    return out.read_bytes()


def test_resume_after_exception(tiny_ckpt, reference, tmp_path):
    out = tmp_path / "m.kst"
    with pytest.raises(Stop):
        convert_checkpoint(tiny_ckpt, out, PLAN, progress=_stop_after(30))
    assert not out.exists() and (tmp_path / "m.kst.partial").exists()
    events = []
    convert_checkpoint(tiny_ckpt, out, PLAN, progress=lambda k, **i: events.append((k, i)))
    assert events[0][1]["resumed"] == 30              # progress is reported after each write
    assert out.read_bytes() == reference
    assert not list(tmp_path.glob("*.partial*"))


def test_resume_after_kill(tiny_ckpt, reference, tmp_path):
    out = tmp_path / "m.kst"
    script = textwrap.dedent(f"""
        import os
        from kimistream.convert.converter import convert_checkpoint
        from kimistream.formats.presets import PrecisionPlan
        n = 0
        def progress(kind, **info):
            global n
            n += kind == "tensor"
            if n == 50:
                os._exit(9)          # no cleanup at all, like SIGKILL or a power cut of the process
        convert_checkpoint({str(tiny_ckpt)!r}, {str(out)!r}, PrecisionPlan.from_preset("bf16"), progress=progress)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    with open(tmp_path / "m.kst.partial.journal", "a") as f:
        f.write('{"t": "model.layers.1.mlp.exp')        # a torn last line
    proc = subprocess.run([sys.executable, "-m", "kimistream.convert.cli", str(tiny_ckpt), "-o", str(out),
                           "--quant", "bf16", "--quiet", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == reference


def test_delete_source_resumes_without_consumed_shards(tiny_ckpt, reference, tmp_path):
    src = _reshard(tiny_ckpt, tmp_path / "src", lambda i, n: f"model-{i:05d}-of-{n:05d}.safetensors", 3)
    out = tmp_path / "m.kst"
    deleted = []

    def progress(kind, **info):
        if kind == "shard-done":
            deleted.append(info["path"])
            raise Stop                     # interrupt right after the first shard is consumed
    with pytest.raises(Stop):
        convert_checkpoint(src, out, PLAN, progress=progress, delete_source=True)
    assert len(deleted) == 1 and not (src / "model-00001-of-00003.safetensors").exists()
    convert_checkpoint(src, out, PLAN, delete_source=True)
    assert not list(src.glob("*.safetensors"))
    # Same tensors and values; the source record is the one taken before any shard was deleted.
    from kimistream.formats.weightfile import WeightFile
    ref_path = tmp_path / "ref.kst"
    ref_path.write_bytes(reference)
    with WeightFile(out) as a, WeightFile(ref_path) as b:
        assert set(a.tensors) == set(b.tensors)
        for n in a.tensors:
            assert bytes(a.raw(n)) == bytes(b.raw(n)), n
        assert set(a.header["source"]["files"]) >= {"model-00001-of-00003.safetensors"}


@pytest.mark.parametrize("change", ["plan", "shard", "alignment"])
def test_delete_source_run_that_cannot_resume_says_why(tiny_ckpt, reference, tmp_path, change):
    """After an interrupted --delete-source run, a rerun with another plan, with a source shard that is
    no longer the file it read (a repaired copy), or with another --alignment (the journal had been
    emptied by it, and even the original command could no longer resume), cannot use the journal and
    cannot start over: one line names the output, the reason and the deleted shard, and the journal is
    left as it was. Fetching the shard again recovers."""
    import shutil
    src = _reshard(tiny_ckpt, tmp_path / "src", lambda i, n: f"model-{i:05d}-of-{n:05d}.safetensors", 3)
    keep = tmp_path / "copy"
    shutil.copytree(src, keep)
    out = tmp_path / "m.kst"

    def stop_at_first_shard(kind, **info):
        if kind == "shard-done":
            raise Stop
    with pytest.raises(Stop):
        convert_checkpoint(src, out, PLAN, progress=stop_at_first_shard, delete_source=True)
    quant, extra = "bf16", []
    journal = (tmp_path / "m.kst.partial.journal").read_bytes()
    if change == "plan":
        quant = "f32"
    elif change == "alignment":
        extra = ["--alignment", "8192"]
    else:
        last = src / "model-00003-of-00003.safetensors"
        data = bytearray(last.read_bytes())
        data[-1] ^= 1                                   # same size, other bytes: not the file it read
        last.write_bytes(bytes(data))
    argv = [sys.executable, "-m", "kimistream.convert.cli", str(src), "-o", str(out), "--quant", quant,
            "--calibration", "none", "--delete-source", "--quiet"] + extra
    proc = subprocess.run(argv, capture_output=True, text=True)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.splitlines()
    why = {"plan": "it used another precision plan", "alignment": "it laid the file out otherwise (another --alignment)",
           "shard": f"{src / 'model-00003-of-00003.safetensors'} is not the file it read"}[change]
    assert line.startswith(f"kimi-convert: error: {out}: cannot resume the interrupted conversion: {why}")
    assert "already deleted model-00001-of-00003.safetensors (--delete-source)" in line
    assert (tmp_path / "m.kst.partial.journal").read_bytes() == journal       # nothing thrown away
    shutil.copy(keep / "model-00001-of-00003.safetensors", src)     # fetched again: starts over
    proc = subprocess.run(argv, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert not list(src.glob("*.safetensors"))
    if change == "plan":
        ref = tmp_path / "ref.kst"
        convert_checkpoint(keep, ref, PrecisionPlan.from_preset("f32"))
        assert out.read_bytes() == ref.read_bytes()


def test_missing_shard_without_journal_is_an_error(tiny_ckpt, tmp_path):
    from kimistream.convert.converter import ConversionError
    src = _reshard(tiny_ckpt, tmp_path / "src", lambda i, n: f"model-{i:05d}-of-{n:05d}.safetensors", 3)
    (src / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ConversionError, match="no interrupted conversion"):
        convert_checkpoint(src, tmp_path / "m.kst", PLAN, delete_source=True)


def test_resume_rewrites_what_the_partial_no_longer_holds(tiny_ckpt, reference, tmp_path):
    """A resumed conversion keeps only the journaled tensors whose bytes in the .partial still match
    the checksum the journal recorded; a damaged one is written again, and the result is the same
    file as an uninterrupted conversion."""
    import json
    from kimistream.formats.weightfile import WeightFile
    out = tmp_path / "m.kst"
    with pytest.raises(Stop):
        convert_checkpoint(tiny_ckpt, out, PLAN, progress=_stop_after(30))
    part, journal = tmp_path / "m.kst.partial", tmp_path / "m.kst.partial.journal"
    first = next(json.loads(line)["t"] for line in journal.read_text().splitlines()[1:] if '"t"' in line)
    (tmp_path / "ref.kst").write_bytes(reference)              # the same layout: find the tensor's bytes
    with WeightFile(tmp_path / "ref.kst") as wf:
        t = wf.tensors[first]
    with open(part, "r+b") as f:
        f.seek(t.offset + t.nbytes // 2)
        b = f.read(1)[0]
        f.seek(t.offset + t.nbytes // 2)
        f.write(bytes([b ^ 0xFF]))
    events = []
    convert_checkpoint(tiny_ckpt, out, PLAN, progress=lambda k, **i: events.append((k, i)))
    assert events[0][1]["resumed"] == 29                       # the damaged tensor was not kept
    assert any(k == "tensor" and i.get("name") == first for k, i in events)
    assert out.read_bytes() == reference


def test_throughput_counts_what_this_run_converted(tiny_ckpt, tmp_path):
    """The summary's parameters per second are over the tensors this run read, encoded and wrote:
    all of them for a fresh conversion, fewer for one resumed from its journal."""
    fresh = convert_checkpoint(tiny_ckpt, tmp_path / "a.kst", PLAN).to_json()
    assert fresh["throughput"]["params"] == fresh["total"]["params"] and fresh["throughput"]["params_per_s"] > 0
    with pytest.raises(Stop):
        convert_checkpoint(tiny_ckpt, tmp_path / "b.kst", PLAN, progress=_stop_after(30))
    resumed = convert_checkpoint(tiny_ckpt, tmp_path / "b.kst", PLAN).to_json()
    assert 0 < resumed["throughput"]["params"] < resumed["total"]["params"]



def test_a_resumed_file_has_zeros_where_no_tensor_lies(tiny_ckpt, reference, tmp_path):
    """Bytes of an interrupted .partial that no checksum covers (the padding between extents) are
    written again as zeros on resume: the finished file is the uninterrupted one, byte for byte (a
    damaged gap had been kept, and kimi-verify could not tell)."""
    from kimistream.formats.weightfile import WeightFile
    out = tmp_path / "m.kst"
    with pytest.raises(Stop):
        convert_checkpoint(tiny_ckpt, out, PLAN, progress=_stop_after(30))
    ref = tmp_path / "ref.kst"
    ref.write_bytes(reference)
    wf = WeightFile(ref)
    ext = sorted(wf.extents, key=lambda e: e.offset)
    gap = next(a.offset + a.nbytes for a, b in zip(ext, ext[1:]) if b.offset > a.offset + a.nbytes)
    wf.close()
    with open(f"{out}.partial", "r+b") as f:
        f.seek(gap)
        f.write(b"\xff" * 16)
    convert_checkpoint(tiny_ckpt, out, PLAN)
    assert out.read_bytes() == reference
