"""Publishing: a weight file split into zstd chunks with a manifest reassembles to the same bytes;
a corrupted or missing chunk is named; an interrupted assembly resumes; manifests cannot name paths
outside the release."""

import json

import pytest

from kimistream.convert.publish import PublishError, assemble, publish

CHUNK = 16 << 20


@pytest.fixture
def big_file(tmp_path):
    # 40 MiB of low-entropy "weights" (bf16-like: low halves zero) so there are three chunks.
    import numpy as np
    a = np.random.default_rng(0).standard_normal(10 << 20).astype(np.float32)
    a.view(np.uint32)[:] &= 0xFFFF0000
    p = tmp_path / "m.kst"
    p.write_bytes(a.tobytes())
    return p


def test_round_trip(big_file, tmp_path):
    m = publish(big_file, tmp_path / "rel", chunk_bytes=CHUNK)
    assert len(m["chunks"]) == 3 and m["compression_ratio"] > 1.3
    out = assemble(tmp_path / "rel", tmp_path / "out.kst")
    assert out.read_bytes() == big_file.read_bytes()
    sums = (tmp_path / "rel" / "SHA256SUMS").read_text().splitlines()
    assert len(sums) == 4


def test_corrupt_and_missing_chunks(big_file, tmp_path):
    publish(big_file, tmp_path / "rel", chunk_bytes=CHUNK)
    part = tmp_path / "rel" / "m.kst.part0001.zst"
    data = bytearray(part.read_bytes())
    data[100] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(PublishError, match=r"m\.kst\.part0001\.zst: SHA-256 of the compressed chunk"):
        assemble(tmp_path / "rel", tmp_path / "out.kst")
    assert not (tmp_path / "out.kst").exists()
    part.unlink()
    with pytest.raises(PublishError, match=r"part0001\.zst: chunk missing"):
        assemble(tmp_path / "rel", tmp_path / "out.kst")


def test_assembly_resumes(big_file, tmp_path):
    publish(big_file, tmp_path / "rel", chunk_bytes=CHUNK)
    (tmp_path / "rel" / "m.kst.part0002.zst").rename(tmp_path / "held")
    with pytest.raises(PublishError):
        assemble(tmp_path / "rel", tmp_path / "out.kst")
    (tmp_path / "held").rename(tmp_path / "rel" / "m.kst.part0002.zst")
    # a conversion's resumable output to the same name is not the assembly's to take
    (tmp_path / "out.kst.partial").write_bytes(b"a conversion under way")
    written = []
    assemble(tmp_path / "rel", tmp_path / "out.kst", progress=written.append)
    assert (tmp_path / "out.kst").read_bytes() == big_file.read_bytes()
    assert (tmp_path / "out.kst.partial").read_bytes() == b"a conversion under way"
    assert not (tmp_path / "out.kst.assembling").exists()


def test_manifest_cannot_escape(big_file, tmp_path):
    publish(big_file, tmp_path / "rel", chunk_bytes=CHUNK)
    mpath = tmp_path / "rel" / "m.kst.release.json"
    m = json.loads(mpath.read_text())
    m["chunks"][0]["file"] = "../../etc/passwd"
    mpath.write_text(json.dumps(m))
    with pytest.raises(PublishError, match="must not contain directories"):
        assemble(tmp_path / "rel")


def _convert(*args):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "kimistream.convert.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def test_cli_synthetic_sparse_publish_assemble(tmp_path):
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 300, "hidden_size": 64,
           "intermediate_size": 128, "moe_intermediate_size": 2048, "num_hidden_layers": 3, "num_attention_heads": 2,
           "kv_lora_rank": 32, "q_lora_rank": None, "qk_rope_head_dim": 16, "v_head_dim": 32, "qk_nope_head_dim": 32,
           "n_routed_experts": 32, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    out = tmp_path / "s.kst"
    proc = _convert("--synthetic", tmp_path / "c.json", "-o", out, "--sparse", "--quant", "f32", "--quiet")
    assert proc.returncode == 0, proc.stderr
    st = out.stat()
    assert st.st_blocks * 512 < st.st_size / 5            # the experts are holes on disk
    proc = _convert(out, "--publish", tmp_path / "rel", "--chunk-size", "16MiB", "--quiet", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["release"]["compression_ratio"] > 10      # holes compress
    back = tmp_path / "new" / "back.kst"             # a folder not there yet, made as a conversion makes one
    proc = _convert("--assemble", tmp_path / "rel", "-o", back, "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert back.read_bytes() == out.read_bytes()


def test_ctrl_c_names_the_runs_own_partial_output(tmp_path):
    """Ctrl-C names the file the same command resumes from: with a conversion's out.kst.partial and an
    assembly's out.kst.assembling both there, an assembly names the latter, a conversion the former."""
    from kimistream.convert.cli import build_parser, kept_output
    out = tmp_path / "out.kst"
    (tmp_path / "out.kst.partial").write_bytes(b"a conversion")
    assembling = tmp_path / "out.kst.assembling"
    assembling.write_bytes(b"an assembly")
    assert kept_output(build_parser().parse_args(["--assemble", str(tmp_path / "rel"), "-o", str(out)])) == assembling
    assert kept_output(build_parser().parse_args([str(tmp_path / "ckpt"), "-o", str(out)])) == tmp_path / "out.kst.partial"
    (tmp_path / "out.kst.partial").unlink()
    assert kept_output(build_parser().parse_args([str(tmp_path / "ckpt"), "-o", str(out)])) == assembling
    assembling.unlink()
    assert kept_output(build_parser().parse_args(["--assemble", str(tmp_path / "rel"), "-o", str(out)])) is None


def test_republishing_replaces_the_release_and_removes_only_its_stale_chunks(big_file, tmp_path):
    """A second publish into the same directory (fewer, larger chunks) leaves exactly the new release:
    the old release's extra chunks and an interrupted run's .partial chunk go, files that are not this
    release's chunks stay."""
    rel = tmp_path / "rel"
    publish(big_file, rel, chunk_bytes=CHUNK)
    assert len(list(rel.glob("m.kst.part*.zst"))) == 3
    (rel / "m.kst.part0007.zst.partial").write_bytes(b"an interrupted publish")
    keep = {"notes.txt": b"mine", "m.kst.part0002.zst.bak": b"a backup", "other.kst.part0000.zst": b"not ours",
            "m.kst": b"not a chunk"}
    for n, b in keep.items():
        (rel / n).write_bytes(b)
    m = publish(big_file, rel, chunk_bytes=2 * CHUNK)
    assert [c["file"] for c in m["chunks"]] == ["m.kst.part0000.zst", "m.kst.part0001.zst"]
    assert sorted(p.name for p in rel.iterdir()) == sorted(
        ["SHA256SUMS", "m.kst.release.json", "m.kst.part0000.zst", "m.kst.part0001.zst", *keep])
    assert all((rel / n).read_bytes() == b for n, b in keep.items())
    sums = [line.split()[1] for line in (rel / "SHA256SUMS").read_text().splitlines()]
    assert sums == ["m.kst.part0000.zst", "m.kst.part0001.zst", "m.kst.release.json"]
    assert assemble(rel, tmp_path / "out.kst").read_bytes() == big_file.read_bytes()


def test_a_failed_publish_leaves_the_release_there_as_it_was(big_file, tmp_path):
    rel = tmp_path / "rel"
    publish(big_file, rel, chunk_bytes=CHUNK)
    before = {p.name: p.read_bytes() for p in rel.iterdir()}

    class Refuse:
        seen = 0

        def feed(self, block):
            self.seen += len(block)
            if self.seen > 2 * CHUNK:
                raise ValueError("damaged")

        def finish(self):
            pass

    with pytest.raises(ValueError, match="damaged"):
        publish(big_file, rel, chunk_bytes=CHUNK // 2 * 3, check=Refuse())
    assert {p.name: p.read_bytes() for p in rel.iterdir()} == before       # no staging folder left either
    assert assemble(rel, tmp_path / "out.kst").read_bytes() == big_file.read_bytes()


def test_a_release_directory_holds_one_files_release(big_file, tmp_path):
    rel = tmp_path / "rel"
    publish(big_file, rel, chunk_bytes=CHUNK)
    other = tmp_path / "n.kst"
    other.write_bytes(b"x" * 1000)
    with pytest.raises(PublishError, match=r"holds the release of another file \(m\.kst\.release\.json\)"):
        publish(other, rel, chunk_bytes=CHUNK)
    assert not list(rel.glob("n.kst*")) and not list(rel.glob(".*"))


@pytest.mark.parametrize("label,edit,message", [
    ("no size", lambda m: m.pop("size"), "no 'size'"),
    ("no sha256", lambda m: m.pop("sha256"), "no 'sha256'"),
    ("string offset", lambda m: m["chunks"][0].__setitem__("offset", "0"), "chunk 0 'offset' must be a non-negative"),
    ("negative size", lambda m: m.__setitem__("size", -1), "'size' must be a non-negative integer"),
    ("bool size", lambda m: m["chunks"][1].__setitem__("size", True), "chunk 1 'size' must be a non-negative"),
    ("short hash", lambda m: m["chunks"][2].__setitem__("sha256", "ab"), "chunk 2 'sha256' must be 64 hex digits"),
    ("gap", lambda m: m["chunks"][1].__setitem__("offset", m["chunks"][1]["offset"] + 1), "chunk 1 starts at byte"),
    ("size beyond chunks", lambda m: m.__setitem__("size", m["size"] + 1), "the chunks hold"),
    ("chunk twice", lambda m: m["chunks"][1].__setitem__("file", m["chunks"][0]["file"]), "is named twice"),
    ("chunk not an object", lambda m: m["chunks"].__setitem__(0, 7), "chunk 0 is not a JSON object"),
    ("dot-dot name", lambda m: m.__setitem__("file", ".."), "must not contain directories"),
    ("empty name", lambda m: m.__setitem__("file", ""), "'file' must be a file name"),
    ("not an object", lambda m: m.clear() or m.update({"x": 1}), "no 'file'"),
])
def test_a_malformed_release_manifest_is_named_before_anything_is_written(big_file, tmp_path, label, edit, message):
    publish(big_file, tmp_path / "rel", chunk_bytes=CHUNK)
    mpath = tmp_path / "rel" / "m.kst.release.json"
    m = json.loads(mpath.read_text())
    edit(m)
    mpath.write_text(json.dumps(m))
    with pytest.raises(PublishError) as e:
        assemble(tmp_path / "rel", tmp_path / "out.kst")
    assert str(e.value).startswith(f"{mpath}: not a release manifest (") and message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
    assert not list(tmp_path.glob("out.kst*"))


def test_extent_checker_finds_the_damaged_extent_in_one_pass(tiny_kst, tmp_path):
    from kimistream.convert.verify import ExtentChecker
    from kimistream.formats.weightfile import WeightFile, WeightFileError
    with WeightFile(tiny_kst) as wf:
        extents = list(wf.extents)
        ext = next(e for e in wf.extents if e.name == "expert.2.5")
    data = tiny_kst.read_bytes()
    for block in (4096, 7777, len(data)):                  # block boundaries anywhere in or between extents
        c = ExtentChecker(tiny_kst, extents)
        for i in range(0, len(data), block):
            c.feed(data[i:i + block])
        c.finish()
        assert c.checked == len(extents)
    bad = bytearray(data)
    bad[ext.offset + 123] ^= 0xFF
    c = ExtentChecker(tiny_kst, extents)
    with pytest.raises(WeightFileError, match=r"extent expert\.2\.5 \(expert\) checksum mismatch"):
        for i in range(0, len(bad), 7777):
            c.feed(bytes(bad[i:i + 7777]))
    c = ExtentChecker(tiny_kst, extents)
    c.feed(data[:max(e.offset + e.nbytes for e in extents) - 1])     # the file shrank while it was read
    with pytest.raises(WeightFileError, match="was not read to its end"):
        c.finish()
