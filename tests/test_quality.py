"""Quality tools: perplexity equals the reference's (transformers' own loss on the same windows),
KL of a model against itself is zero, importance matrices match the squared inputs transformers sees,
and bad calibration input is refused clearly."""

import json
import subprocess
import sys

import numpy as np
import pytest

from kimistream.formats.imatrix import ImatrixError, load_imatrix
from kimistream.formats.layout import model_shapes
from kimistream.formats.config import ModelConfig
from kimistream.formats.weightfile import WeightFile

TEXT = ("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
        "The quick brown fox jumps over the lazy dog.\n") * 6


def kimi_run(*args):
    return subprocess.run([sys.executable, "-m", "kimistream.runtime.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def test_perplexity_matches_transformers_loss(tiny_ckpt, tiny_kst, tmp_path):
    import torch
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    rep = json.loads(kimi_run("--weights", tiny_kst, "--perplexity", text, "--max-context", 48, "--json",
                              "--kl-reference", tiny_kst).stdout)["quality"]
    ids = AutoTokenizer.from_pretrained(tiny_ckpt)(TEXT)["input_ids"]
    model = DeepseekV3ForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    nll, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(ids), 48):
            w = ids[s:s + 48]
            if len(w) < 2:
                continue
            loss = model(torch.tensor([w]), labels=torch.tensor([w])).loss.item()
            nll += loss * (len(w) - 1)
            n += len(w) - 1
    assert rep["tokens"] == n
    assert rep["perplexity"] == pytest.approx(np.exp(nll / n), rel=1e-4)
    assert rep["kl_mean"] == pytest.approx(0.0, abs=1e-9) and rep["top1_agreement"] == 1.0


def test_imatrix_matches_inputs_seen_by_transformers(tiny_ckpt, tiny_kst, tmp_path):
    import torch
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM
    text, out = tmp_path / "cal.txt", tmp_path / "im.npz"
    text.write_text(TEXT)
    proc = kimi_run("--weights", tiny_kst, "--calibration", text, "--imatrix-out", out, "--max-context", 64)
    assert proc.returncode == 0, proc.stderr
    with WeightFile(tiny_kst) as wf:
        cfg_dict = wf.header["config"]
    cfg = ModelConfig.from_dict(cfg_dict)
    im = load_imatrix(out, cfg_dict, model_shapes(cfg))

    ids = AutoTokenizer.from_pretrained(tiny_ckpt)(TEXT)["input_ids"]
    model = DeepseekV3ForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    seen = {}

    def hook(name):
        def f(mod, inputs):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
            s, xx, c = seen.get(name, (0, 0, 0))
            seen[name] = (s + (x * x).sum(0), xx + x.T @ x, c + x.shape[0])
        return f
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and "self_attn" in name or name.endswith("shared_experts.down_proj"):
            mod.register_forward_pre_hook(hook(name + ".weight"))
    with torch.no_grad():
        for s in range(0, len(ids), 64):
            if len(ids[s:s + 64]) >= 2:
                model(torch.tensor([ids[s:s + 64]]))
    checked = 0
    for name, (s, xx, c) in seen.items():
        if name in im:
            np.testing.assert_allclose(im[name], (s / c).numpy(), rtol=1e-3, atol=1e-7)
            # the full second moment too (the default budget holds every matrix of this model)
            np.testing.assert_allclose(im.moment(name), (xx / c).numpy(), rtol=1e-3, atol=1e-6)
            checked += 1
    assert checked >= 10
    assert any(".mlp.experts." in n for n in im)          # routed experts get importances too
    # a layer's routed experts share one gate/up moment; each expert has its own down_proj moment
    assert "model.layers.1.mlp.experts.gate_up" in im.moment_keys
    assert im.moment("model.layers.1.mlp.experts.0.up_proj.weight") is im.moment("model.layers.1.mlp.experts.3.gate_proj.weight")
    assert im.moment("model.layers.1.mlp.experts.0.down_proj.weight").shape[0] == cfg.moe_intermediate_size


def test_moment_plan_puts_routed_experts_first_within_the_budget():
    from kimistream.formats.imatrix import moment_plan
    shapes = {"model.layers.0.self_attn.o_proj.weight": (64, 128),
              "model.layers.1.mlp.experts.0.gate_proj.weight": (32, 64),
              "model.layers.1.mlp.experts.0.up_proj.weight": (32, 64),
              "model.layers.1.mlp.experts.0.down_proj.weight": (64, 32),
              "model.layers.1.mlp.experts.1.down_proj.weight": (64, 32),
              "model.layers.1.input_layernorm.weight": (64,),
              "model.layers.1.mlp.gate.weight": (2, 64),              # a router: never quantized
              "model.layers.2.self_attn.q_a_proj.weight": (16, 64),   # both read the same input
              "model.layers.2.self_attn.kv_a_proj_with_mqa.weight": (24, 64),
              "model.embed_tokens.weight": (100, 64)}
    gate_up = "model.layers.1.mlp.experts.gate_up"
    downs = {f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in (0, 1)}
    assert moment_plan(shapes, 0) == set()
    assert moment_plan(shapes, 64 * 64 * 4) == {gate_up}
    assert moment_plan(shapes, 64 * 64 * 4 + 2 * 32 * 32 * 4) == {gate_up} | downs
    assert moment_plan(shapes, 1 << 30) == {gate_up} | downs | {"model.layers.0.self_attn.o_proj.weight",
                                                                "model.layers.2.self_attn.input"}


def test_moment_budget_zero_keeps_only_the_diagonal(tiny_kst, tmp_path):
    text, out = tmp_path / "cal.txt", tmp_path / "im.npz"
    text.write_text(TEXT)
    proc = kimi_run("--weights", tiny_kst, "--calibration", text, "--imatrix-out", out, "--max-context", 64,
                    "--moment-budget", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["imatrix"]["moments"] == 0
    with np.load(out) as z:
        assert not [k for k in z.files if k.startswith("moment:")]
    bad = kimi_run("--weights", tiny_kst, "--calibration", text, "--imatrix-out", out, "--moment-budget", "lots")
    assert bad.returncode != 0 and "--moment-budget" in bad.stderr


def test_imatrix_of_another_model_is_refused(tiny_kst, tmp_path):
    text, out = tmp_path / "cal.txt", tmp_path / "im.npz"
    text.write_text(TEXT)
    kimi_run("--weights", tiny_kst, "--calibration", text, "--imatrix-out", out, "--max-context", 64)
    with WeightFile(tiny_kst) as wf:
        other = dict(wf.header["config"])
    other["hidden_size"] += 1
    with pytest.raises(ImatrixError, match="another model"):
        load_imatrix(out, other, {})


def test_empty_calibration_file(tiny_kst, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    proc = kimi_run("--weights", tiny_kst, "--calibration", empty, "--imatrix-out", tmp_path / "x.npz")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].endswith("empty.txt: the file is empty")
    assert not (tmp_path / "x.npz").exists()


def test_convert_refuses_a_bad_calibration_file_before_converting(tiny_ckpt, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    for path, msg in ((empty, "empty.txt: the calibration file is empty"),
                      (tmp_path / "missing.txt", "missing.txt: cannot read the calibration text")):
        proc = subprocess.run([sys.executable, "-m", "kimistream.convert.cli", str(tiny_ckpt), "-o",
                               str(tmp_path / "q.kst"), "--quant", "q2", "--calibration", str(path)],
                              capture_output=True, text=True)
        assert proc.returncode == 1
        assert msg in proc.stderr.strip().splitlines()[-1]
        assert not list(tmp_path.glob("q.kst*"))            # nothing converted, nothing left behind
    text = tmp_path / "cal.txt"
    text.write_text(TEXT)
    proc = subprocess.run([sys.executable, "-m", "kimistream.convert.cli", str(tiny_ckpt), "-o",
                           str(tmp_path / "q.kst"), "--quant", "q2", "--calibration", str(text),
                           "--moment-budget", "2X"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--moment-budget" in proc.stderr and not list(tmp_path.glob("q.kst*"))


def _sha16(path):
    import hashlib
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def test_convert_with_calibration_and_reuse(tiny_ckpt, tmp_path):
    text = tmp_path / "cal.txt"
    text.write_text(TEXT)
    out = tmp_path / "q.kst"
    conv = [sys.executable, "-m", "kimistream.convert.cli", str(tiny_ckpt), "--quant", "q4", "--quiet", "--json"]
    proc = subprocess.run(conv + ["-o", str(out), "--calibration", str(text)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    im = tmp_path / "q.kst.imatrix.npz"
    assert im.exists() and not list(tmp_path.glob("*.calib*"))
    with WeightFile(out) as wf:
        assert wf.header["imatrix"]["tensors"] > 10 and wf.header["imatrix"]["moments"] > 10
    again = tmp_path / "again.kst"
    proc = subprocess.run(conv + ["-o", str(again), "--imatrix", str(im)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    with WeightFile(out) as a, WeightFile(again) as b:         # the same importance gives the same tensors
        assert a.header["imatrix"]["calibration"] == f"text cal.txt (sha256 {_sha16(text)}), moment budget 2G"
        assert b.header["imatrix"]["calibration"] == f"imatrix q.kst.imatrix.npz (sha256 {_sha16(im)})"
        assert all(bytes(a.raw(n)) == bytes(b.raw(n)) for n in a.tensors)
    # --moment-budget 0: importance only, a different (round-to-nearest on the fitted grid) encoding
    diag = tmp_path / "diag.kst"
    proc = subprocess.run(conv + ["-o", str(diag), "--calibration", str(text), "--moment-budget", "0"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    with WeightFile(diag) as wf:
        assert wf.header["imatrix"]["moments"] == 0
    assert diag.read_bytes() != out.read_bytes()


def test_imatrix_with_a_bad_moment_is_refused(tiny_kst, tmp_path):
    from kimistream.formats.imatrix import save_imatrix
    with WeightFile(tiny_kst) as wf:
        cfg_dict = wf.header["config"]
    shapes = model_shapes(ModelConfig.from_dict(cfg_dict))
    name = "model.layers.0.self_attn.o_proj.weight"
    cols = shapes[name][1]
    for moment, msg in ((np.eye(cols + 1), "has shape"), (np.full((cols, cols), np.inf), "non-finite")):
        path = tmp_path / "im.npz"
        save_imatrix(path, {}, cfg_dict, 10, {}, {name: moment}, {name: 10})
        with pytest.raises(ImatrixError, match=msg):
            load_imatrix(path, cfg_dict, shapes)
    save_imatrix(path, {}, cfg_dict, 10, {}, {"model.layers.0.nope.weight": np.eye(cols)}, {})
    with pytest.raises(ImatrixError, match="not for a weight of this model"):
        load_imatrix(path, cfg_dict, shapes)
    # a file of the previous format (no "format" field) with moments: written before keys were shared
    from kimistream.formats.imatrix import config_digest
    meta = {"config_digest": config_digest(cfg_dict), "tokens": 10, "counts": {}}
    np.savez(path, __meta__=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
             **{"moment:" + name: np.eye(cols, dtype=np.float32)})
    with pytest.raises(ImatrixError, match="older kimi-stream"):
        load_imatrix(path, cfg_dict, shapes)


def test_experts_calibration_never_saw_fall_back(tiny_ckpt, tiny_kst, tmp_path):
    # An expert with no importance and no moment of its own (never routed to): its down_proj is
    # encoded exactly as without calibration; its gate/up still use the layer's shared moment.
    text, im = tmp_path / "cal.txt", tmp_path / "im.npz"
    text.write_text(TEXT)
    assert kimi_run("--weights", tiny_kst, "--calibration", text, "--imatrix-out", im,
                    "--max-context", 64).returncode == 0
    down = "model.layers.1.mlp.experts.5.down_proj.weight"
    with np.load(im) as z:
        arrays = {k: z[k] for k in z.files if not k.endswith("experts.5.down_proj.weight")
                  and not k.endswith("experts.5.gate_proj.weight") and not k.endswith("experts.5.up_proj.weight")}
    np.savez(im, **arrays)
    outs = {}
    for name, extra in (("cal", ["--imatrix", str(im)]), ("free", [])):
        outs[name] = tmp_path / f"{name}.kst"
        proc = subprocess.run([sys.executable, "-m", "kimistream.convert.cli", str(tiny_ckpt), "-o", str(outs[name]),
                               "--quant", "q2", "--quiet", *(extra or ["--calibration", "none"])],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    with WeightFile(outs["cal"]) as a, WeightFile(outs["free"]) as b:
        assert bytes(a.raw(down)) == bytes(b.raw(down))
        gate = down.replace("down_proj", "gate_proj")
        assert bytes(a.raw(gate)) != bytes(b.raw(gate))
        other = "model.layers.1.mlp.experts.4.down_proj.weight"
        assert bytes(a.raw(other)) != bytes(b.raw(other))


def test_self_calibration_samples_its_own_text(tiny_kst, tmp_path):
    outs = []
    for seed in (3, 3, 4):
        out = tmp_path / f"self{len(outs)}.npz"
        proc = kimi_run("--weights", tiny_kst, "--calibration", "self", "--self-tokens", 150, "--seed", seed,
                        "--imatrix-out", out, "--max-context", 64, "--json")
        assert proc.returncode == 0, proc.stderr
        rep = json.loads(proc.stdout)["imatrix"]
        assert 150 <= rep["tokens"] <= 150 and rep["moments"] > 10          # exactly what was asked
        with np.load(out) as z:
            outs.append({k: z[k] for k in z.files if k != "__meta__"})
    same, other = outs[0], outs[2]
    assert all(np.array_equal(same[k], outs[1][k]) for k in same)           # the seed decides the text
    assert any(not np.array_equal(same[k], other[k]) for k in same if k in other)


def test_convert_with_self_calibration(tiny_ckpt, tmp_path):
    out = tmp_path / "q.kst"
    conv = [sys.executable, "-m", "kimistream.convert.cli", str(tiny_ckpt), "-o", str(out), "--quant", "q2",
            "--calibration", "self", "--self-tokens"]
    proc = subprocess.run(conv + ["200"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "q.kst.imatrix.npz").exists() and not list(tmp_path.glob("*.calib*"))
    with WeightFile(out) as wf:
        assert wf.header["imatrix"]["moments"] > 10
    bad = subprocess.run(conv + ["1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--self-tokens" in bad.stderr
    bad = subprocess.run(conv + ["200", "--seed", "-1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--seed" in bad.stderr


def test_calibration_keeps_the_source_when_deleting_it_after(tiny_ckpt, tmp_path):
    # --delete-source applies to the real conversion, never to calibration's data-free pass
    import shutil
    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt, src)
    out = tmp_path / "q.kst"
    proc = subprocess.run([sys.executable, "-m", "kimistream.convert.cli", str(src), "-o", str(out), "--quant", "q2",
                           "--calibration", "self", "--self-tokens", "100", "--delete-source", "--quiet"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert out.exists() and not list(src.glob("*.safetensors"))
    with WeightFile(out) as wf:
        assert wf.header["imatrix"]["moments"] > 10


def test_low_bit_presets_self_calibrate_by_default(tiny_ckpt, tmp_path):
    conv = [sys.executable, "-m", "kimistream.convert.cli", str(tiny_ckpt), "--quant", "t1", "--self-tokens", "120"]
    proc = subprocess.run(conv + ["-o", str(tmp_path / "d.kst")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "calibration: self: 120 sampled tokens, seed 0" in proc.stdout
    with WeightFile(tmp_path / "d.kst") as wf:
        assert wf.header["imatrix"]["calibration"].startswith("self: 120 sampled tokens, seed 0")
        assert wf.header["imatrix"]["moments"] > 10
    assert not list(tmp_path.glob("*.calib*"))          # the measured data-free file is gone
    # the same as asking for it
    proc = subprocess.run(conv + ["-o", str(tmp_path / "s.kst"), "--calibration", "self"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    with WeightFile(tmp_path / "d.kst") as a, WeightFile(tmp_path / "s.kst") as b:
        assert all(bytes(a.raw(n)) == bytes(b.raw(n)) for n in a.tensors)
    # --calibration none: the data-free fit, with a note saying what it costs
    proc = subprocess.run(conv + ["-o", str(tmp_path / "n.kst"), "--calibration", "none", "--json"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "data-free fit" in proc.stderr and json.loads(proc.stdout)["calibration"] == "none (data-free)"
    assert not (tmp_path / "n.kst.imatrix.npz").exists()
    with WeightFile(tmp_path / "n.kst") as wf:
        assert "imatrix" not in wf.header
    # presets above 2 bits are not calibrated unless asked
    proc = subprocess.run([*conv[:4], "--quant", "q4", "-o", str(tmp_path / "q4.kst"), "--json"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["calibration"] == "none (data-free)"


def test_interrupted_calibrated_conversion_reuses_its_calibration(tiny_ckpt, tmp_path, monkeypatch, capsys):
    # Interrupted during the final pass with --delete-source (a shard already gone): the rerun cannot
    # measure again, and need not: it reuses OUT.imatrix.npz and resumes. (A hard kill of the
    # converter itself is test_resume's.)
    from test_sources import _reshard
    src = _reshard(tiny_ckpt, tmp_path / "src", lambda i, n: f"model-{i:05d}-of-{n:05d}.safetensors", 3)
    out = tmp_path / "q.kst"
    args = (src, "-o", out, "--quant", "q2", "--self-tokens", 100, "--delete-source")
    restore = _interrupt_final_pass(monkeypatch, after=40)
    assert convert_main(*args, "--quiet") == 130
    restore()
    assert len(list(src.glob("*.safetensors"))) < 3 and (tmp_path / "q.kst.imatrix.npz").exists()
    capsys.readouterr()
    assert convert_main(*args) == 0
    assert "reusing the calibration of the interrupted conversion" in capsys.readouterr().err
    assert not list(src.glob("*.safetensors")) and not list(tmp_path.glob("*.partial*"))
    # the same tensors as a conversion from a fresh copy with that importance file
    ref = tmp_path / "ref.kst"
    assert convert_main(tiny_ckpt, "-o", ref, "--quant", "q2", "--imatrix", tmp_path / "q.kst.imatrix.npz",
                        "--quiet") == 0
    with WeightFile(out) as a, WeightFile(ref) as b:
        assert a.header["imatrix"]["calibration"].startswith("self: 100 sampled tokens")
        assert all(bytes(a.raw(n)) == bytes(b.raw(n)) for n in a.tensors)


def test_calibration_interrupted_after_its_data_free_pass_measures_that_file(tiny_ckpt, tmp_path):
    # Ctrl-C while sampling keeps OUT.calib.kst: the rerun measures it instead of converting again.
    out = tmp_path / "q.kst"
    conv = [sys.executable, "-m", "kimistream.convert.cli", str(tiny_ckpt), "--quant", "q2"]
    proc = subprocess.run(conv + ["-o", str(tmp_path / "q.kst.calib.kst"), "--calibration", "none", "--quiet"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run(conv + ["-o", str(out), "--self-tokens", "100"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "reusing" in proc.stderr and "data-free conversion of an interrupted run" in proc.stderr
    assert not list(tmp_path.glob("*.calib*"))
    # a leftover in another preset is not what this conversion measures: converted again
    proc = subprocess.run([*conv[:5], "t1", "-o", str(tmp_path / "t.kst.calib.kst"), "--calibration", "none",
                           "--quiet"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run(conv + ["-o", str(tmp_path / "t.kst"), "--self-tokens", "100"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "reusing" not in proc.stderr and not list(tmp_path.glob("*.calib*"))


# --- calibration inside kimi-convert: disk, failures, interruptions, and what may be reused -------------

def convert_main(*argv):
    from kimistream.convert import cli
    return cli.main([str(a) for a in argv])


def last_error(capsys):
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_calibration_checks_disk_and_creates_the_output_directory(tiny_ckpt, tmp_path, monkeypatch, capsys):
    import shutil
    out = tmp_path / "new" / "dir" / "q.kst"
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    assert convert_main(tiny_ckpt, "-o", out, "--quant", "q2", "--quiet") == 1
    msg = last_error(capsys)
    assert msg.startswith(f"kimi-convert: error: {out.parent}: calibration needs ") and "1000 B are" in msg
    assert not list(out.parent.iterdir())                               # nothing written
    monkeypatch.setattr(shutil, "disk_usage", real)
    assert convert_main(tiny_ckpt, "-o", out, "--quant", "q2", "--self-tokens", 60, "--quiet") == 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["q.kst", "q.kst.imatrix.npz"]


def test_failed_or_interrupted_measurement_keeps_the_data_free_file(tiny_ckpt, tmp_path, monkeypatch, capsys):
    out = tmp_path / "q.kst"
    ref = tmp_path / "q.kst.calib.kst"
    args = (tiny_ckpt, "-o", out, "--quant", "q2", "--self-tokens", 60)
    real = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, stderr="kimi-run: error: model.kst: out of memory\n"))
    assert convert_main(*args, "--quiet") == 1
    assert last_error(capsys) == ("kimi-convert: error: model.kst: out of memory (q.kst.calib.kst is kept: the same "
                                  "command measures it without converting again)")
    assert ref.exists() and not out.exists()

    def interrupt(cmd, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(subprocess, "run", interrupt)
    assert convert_main(*args) == 130
    assert ref.exists()
    monkeypatch.setattr(subprocess, "run", real)
    assert convert_main(*args) == 0
    assert "reusing" in capsys.readouterr().err
    assert not ref.exists() and out.exists()


def _interrupt_final_pass(monkeypatch, after=30):
    from kimistream.convert import commands
    real = commands.convert_checkpoint

    def dying(src, out, plan, alignment, progress, **kw):
        n = [0]

        def cb(kind, **info):
            progress(kind, **info)
            n[0] += kind == "tensor"
            if n[0] == after and not str(out).endswith(".calib.kst"):
                raise KeyboardInterrupt
        return real(src, out, plan, alignment, cb, **kw)
    monkeypatch.setattr(commands, "convert_checkpoint", dying)
    return lambda: monkeypatch.setattr(commands, "convert_checkpoint", real)


def test_what_an_interrupted_calibrated_conversion_may_reuse(tiny_ckpt, tmp_path, monkeypatch, capsys):
    from refmodels import make_checkpoint
    from test_sources import _reshard
    other = tmp_path / "other"
    make_checkpoint(other, seed=2)                                      # same config, other weights
    out = tmp_path / "q.kst"
    restore = _interrupt_final_pass(monkeypatch)
    assert convert_main(other, "-o", out, "--quant", "q2", "--self-tokens", 60) == 130
    restore()
    capsys.readouterr()
    # another checkpoint into the same output: measured again, never the other model's importances
    assert convert_main(tiny_ckpt, "-o", out, "--quant", "q2", "--self-tokens", 60) == 0
    assert "reusing" not in capsys.readouterr().err
    fresh = tmp_path / "fresh.kst"
    assert convert_main(tiny_ckpt, "-o", fresh, "--quant", "q2", "--self-tokens", 60, "--quiet") == 0
    with WeightFile(out) as a, WeightFile(fresh) as b:
        assert all(bytes(a.raw(n)) == bytes(b.raw(n)) for n in a.tensors)
    # a data-free file left from another checkpoint is not measured either
    other_ref = tmp_path / "x.kst.calib.kst"
    assert convert_main(other, "-o", other_ref, "--quant", "q2", "--calibration", "none", "--quiet") == 0
    assert convert_main(tiny_ckpt, "-o", tmp_path / "x.kst", "--quant", "q2", "--self-tokens", 60) == 0
    assert "reusing" not in capsys.readouterr().err
    # --delete-source, interrupted, rerun with other calibration flags: said, not a missing-shard error
    src = _reshard(tiny_ckpt, tmp_path / "src", lambda i, n: f"model-{i:05d}-of-{n:05d}.safetensors", 3)
    restore = _interrupt_final_pass(monkeypatch, after=60)
    args = (src, "-o", tmp_path / "d.kst", "--quant", "q2", "--delete-source")
    assert convert_main(*args, "--self-tokens", 60) == 130
    restore()
    assert len(list(src.glob("*.safetensors"))) < 3
    capsys.readouterr()
    assert convert_main(*args, "--self-tokens", 61) == 1
    assert "was calibrated with 'self: 60 sampled tokens, seed 0, moment budget 2G'" in last_error(capsys)
    assert convert_main(*args, "--self-tokens", 60) == 0


def test_calibration_none_and_imatrix_together_are_refused(tiny_ckpt, tmp_path, capsys):
    assert convert_main(tiny_ckpt, "-o", tmp_path / "q.kst", "--quant", "q2", "--calibration", "none",
                        "--imatrix", tmp_path / "im.npz") == 2
    assert "give --calibration none or --imatrix, not both" in last_error(capsys)


def test_importance_by_layer_equals_the_token_major_pass_and_reads_each_expert_once(tmp_path):
    """Layer-major calibration (every window through a layer before the next, each routed expert once
    on all the tokens routed to it) measures the same importance and second moments as the
    token-major pass, to float rounding, and reads each routed expert once per pass where the
    token-major pass, with a cache of 4 of the file's 64 experts, reads them again for every chunk."""
    import subprocess
    import sys
    from pathlib import Path

    from kimistream.runtime import kernels
    from kimistream.runtime.model import Model
    from kimistream.runtime.quality import collect_importance, collect_importance_by_layer, windows
    from kimistream.runtime.tokenizer import Tokenizer
    from kimistream.runtime.weights import ModelWeights
    repo = Path(__file__).resolve().parent.parent
    kst = tmp_path / "q2.kst"
    subprocess.run([sys.executable, "-m", "kimistream.convert.cli", str(repo / "models" / "stdlib-moe"), "-o", str(kst),
                    "--quant", "q2", "--calibration", "none", "--quiet"], check=True, capture_output=True)
    w = ModelWeights(kst, cache_bytes=4 * max(e.nbytes for e in _experts(kst)))
    w.load_resident()
    meta = w.header["tokenizer"]
    tok = Tokenizer(meta["kind"], {n: w.file.blob(n) for n in meta["files"]})
    chunks = list(windows(tok.encode((repo / "data" / "stdlib-heldout.txt").read_text()[:6000]), 256))
    m = Model(w, 256)
    reads, cols = [], []
    for collect, kw in ((collect_importance, {}), (collect_importance_by_layer, {}),
                        (collect_importance_by_layer, {"state_ram": 0, "state_dir": tmp_path})):
        kernels.set_decoding(True)         # as after a decode step: each pass must choose prefill's inputs
        before = w.pager.stats.bytes_read
        cols.append(collect(m, chunks, 64, moment_budget=1 << 30, **kw))
        reads.append(w.pager.stats.bytes_read - before)
    ref, got, on_disk = cols
    # the residual stream kept in files instead of RAM: the same numbers, and nothing left behind
    assert all(np.array_equal(on_disk.sums[n], got.sums[n]) for n in got.sums)
    assert all(np.array_equal(on_disk.moments[n], got.moments[n]) for n in got.moments)
    assert list(tmp_path.glob("kimi-calibration-*")) == [] and reads[2] == reads[1]
    expert_bytes = sum(e.nbytes for e in _experts(kst))
    w.close()
    assert got.tokens == ref.tokens and got.counts == ref.counts
    assert set(got.sums) == set(ref.sums) and set(got.moments) == set(ref.moments) and ref.moments
    for n in ref.sums:
        np.testing.assert_allclose(got.sums[n], ref.sums[n], rtol=2e-4, atol=2e-4 * np.abs(ref.sums[n]).max())
    for n in ref.moments:
        np.testing.assert_allclose(got.moments[n], ref.moments[n], rtol=2e-4, atol=2e-4 * np.abs(ref.moments[n]).max())
    assert reads[1] <= 1.2 * expert_bytes < reads[0], (reads, expert_bytes)


def _experts(kst):
    from kimistream.formats.weightfile import WeightFile
    with WeightFile(kst) as wf:
        return [e for e in wf.extents if e.kind == "expert"]


def test_calibration_under_a_tight_budget_reads_each_expert_once(tmp_path):
    """kimi-run --calibration with an expert cache of about a quarter of the file's experts: the pass
    goes layer by layer, reads the file's expert bytes once, says so, and caps the second moments to
    what the budget leaves."""
    from pathlib import Path
    repo = Path(__file__).resolve().parent.parent
    kst = tmp_path / "q2.kst"
    subprocess.run([sys.executable, "-m", "kimistream.convert.cli", str(repo / "models" / "stdlib-moe"), "-o", str(kst),
                    "--quant", "q2", "--calibration", "none", "--quiet"], check=True, capture_output=True)
    text = tmp_path / "cal.txt"
    text.write_text((repo / "data" / "stdlib-heldout.txt").read_text()[:3000])

    def run(*a):
        return subprocess.run([sys.executable, "-m", "kimistream.runtime.cli", "--weights", str(kst), "--max-context",
                               "256", "--prefill-batch-size", "64", *map(str, a)], capture_output=True, text=True)
    plan = json.loads(run("--dry-run", "--json", "--memory-budget", "8G").stdout)["memory_plan"]
    # room for a quarter of the experts, + 512 KiB: the baseline measured by two processes drifts
    tight = plan["budget"] - plan["expert_cache"] + plan["total_experts"] // 4 * plan["expert_bytes"] + (512 << 10)
    proc = run("--calibration", text, "--imatrix-out", tmp_path / "im.npz", "--memory-budget", tight, "--json")
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)["imatrix"]
    assert rep["expert_bytes_read"] <= 1.2 * rep["file_expert_bytes"], rep
    assert "calibration layer by layer" in proc.stderr and "each expert read once" in proc.stderr
    assert "second moments:" in proc.stderr and rep["tensors"] > 0


def test_kl_reference_with_another_tokenizer_of_the_same_size_is_refused(tiny_ckpt, tiny_kst, tmp_path):
    """KL compares two models' distributions token by token: a reference whose tokenizer differs (here
    two tokens' ids swapped, the vocabulary's size the same) is refused, not scored against the wrong
    ids; its tokenizer files' bytes are compared, not only their names."""
    import shutil
    from kimistream.convert.converter import convert_checkpoint
    from kimistream.formats.presets import PrecisionPlan
    other = tmp_path / "other"
    shutil.copytree(tiny_ckpt, other)
    tj = json.loads((other / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tj))
    ref = tmp_path / "other.kst"
    convert_checkpoint(other, ref, PrecisionPlan.from_preset("f32"))
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    proc = kimi_run("--weights", tiny_kst, "--perplexity", text, "--max-context", 48, "--kl-reference", ref)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].endswith(f"{ref}: the reference has another tokenizer or vocabulary")
