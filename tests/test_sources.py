"""Source checkpoints: FP8 block-scaled weights convert to exactly their dequantized values (torch's
float8_e4m3fn is the reference), sharded checkpoints with padded or unpadded shard names convert to
the same file content as a single-file one, and broken sources give one clear error."""

import json
import shutil

import numpy as np
import pytest

from kimistream.convert.converter import ConversionError, convert_checkpoint
from kimistream.formats.presets import PrecisionPlan
from kimistream.formats.weightfile import WeightFile

F32 = PrecisionPlan.from_preset("f32")


def _state(ckpt):
    from safetensors.numpy import load_file
    return load_file(str(ckpt / "model.safetensors"))


def _reshard(ckpt, dest, names_fmt, n_shards):
    """Split a single-file checkpoint into n shards named by names_fmt(i, n), with an index."""
    from safetensors.torch import load_file, save_file
    dest.mkdir()
    for f in ckpt.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dest / f.name)
    state = load_file(str(ckpt / "model.safetensors"))
    names = sorted(state)
    weight_map = {}
    for i in range(n_shards):
        part = names[i::n_shards]
        fname = names_fmt(i + 1, n_shards)
        save_file({k: state[k].contiguous() for k in part}, str(dest / fname))
        weight_map.update({k: fname for k in part})
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dest


def _all_tensors(path):
    with WeightFile(path) as wf:
        return {n: np.array(wf.decode(n)) for n in wf.tensors}


@pytest.mark.parametrize("fmt", [lambda i, n: f"model-{i:05d}-of-{n:05d}.safetensors",
                                 lambda i, n: f"model-{i}-of-{n}.safetensors"], ids=["padded", "unpadded"])
def test_sharded_equals_single_file(tiny_ckpt, tiny_kst, tmp_path, fmt):
    sharded = _reshard(tiny_ckpt, tmp_path / "sharded", fmt, 3)
    out = tmp_path / "s.kst"
    convert_checkpoint(sharded, out, F32)
    a, b = _all_tensors(tiny_kst), _all_tensors(out)
    assert a.keys() == b.keys()
    for n in a:
        np.testing.assert_array_equal(a[n], b[n])


def test_fp8_block_source_converts_to_dequantized_values(tiny_ckpt, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file
    src = tmp_path / "fp8"
    shutil.copytree(tiny_ckpt, src)
    state = load_file(str(src / "model.safetensors"))
    expected = {}
    for name in list(state):
        w = state[name]
        if w.dim() == 2 and ".mlp." in name and "gate.weight" not in name:
            rows, cols = w.shape
            fp8 = (w * 40).clamp(-440, 440).to(torch.float8_e4m3fn)           # a real FP8 weight
            scale = torch.rand((rows + 127) // 128, (cols + 127) // 128) * 0.05 + 0.01
            state[name] = fp8
            state[name + "_scale_inv"] = scale
            full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
            expected[name] = (fp8.float() * full).numpy()
    save_file(state, str(src / "model.safetensors"))
    out = tmp_path / "fp8.kst"
    convert_checkpoint(src, out, F32)
    got = _all_tensors(out)
    assert len(expected) > 10
    for name, ref in expected.items():
        np.testing.assert_array_equal(got[name], ref)


def test_missing_shard_is_named(tiny_ckpt, tmp_path):
    sharded = _reshard(tiny_ckpt, tmp_path / "s", lambda i, n: f"model-{i:05d}-of-{n:05d}.safetensors", 3)
    (sharded / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ConversionError, match=r"model-00002-of-00003\.safetensors: shard named in"):
        convert_checkpoint(sharded, tmp_path / "x.kst", F32)
    assert not (tmp_path / "x.kst").exists()


def test_truncated_shard_is_named(tiny_ckpt, tmp_path):
    src = tmp_path / "t"
    shutil.copytree(tiny_ckpt, src)
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(ConversionError, match=r"model\.safetensors: tensor .* past the end of the file"):
        convert_checkpoint(src, tmp_path / "x.kst", F32)


def test_nan_weight_is_refused(tiny_ckpt, tmp_path):
    from safetensors.torch import load_file, save_file
    src = tmp_path / "nan"
    shutil.copytree(tiny_ckpt, src)
    state = load_file(str(src / "model.safetensors"))
    state["model.layers.1.self_attn.o_proj.weight"][0, 0] = float("nan")
    save_file(state, str(src / "model.safetensors"))
    with pytest.raises(ConversionError, match=r"o_proj\.weight.*NaN"):
        convert_checkpoint(src, tmp_path / "x.kst", F32)
    assert not (tmp_path / "x.kst").exists()


def test_unsupported_architecture(tiny_ckpt, tmp_path):
    src = tmp_path / "llama"
    shutil.copytree(tiny_ckpt, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=r"config\.json: unsupported model"):
        convert_checkpoint(src, tmp_path / "x.kst", F32)


def test_kimi_k2_spelling_of_config(tiny_ckpt, tmp_path):
    """Kimi K2 ships model_type kimi_k2, rope_theta + rope_scaling{type: yarn}, no rope_interleave."""
    src = tmp_path / "k2"
    shutil.copytree(tiny_ckpt, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.pop("rope_interleave", None)
    cfg.update(model_type="kimi_k2", rope_theta=50000.0,
               rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                             "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    (src / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "k2.kst"
    convert_checkpoint(src, out, F32)
    with WeightFile(out) as wf:
        rope = wf.header["config"]["rope"]
    assert rope["type"] == "yarn" and rope["theta"] == 50000.0 and rope["factor"] == 32.0
    assert rope["interleave"] is True
