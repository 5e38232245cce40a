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
