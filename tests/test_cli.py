"""The three commands as a user runs them: kimi-convert's summary, kimi-run's streaming text, JSON
report and logit dump, lazy expert paging (measured by the OS in /proc/self/smaps), and clear
one-line errors with a non-zero exit for bad input."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

import refmodels

CLASSES = {"routed_experts", "shared_experts", "dense_mlp", "attention", "router", "norms", "embeddings", "lm_head"}


def run(module, *args, check=True):
    proc = subprocess.run([sys.executable, "-m", f"kimistream.{module}", *map(str, args)],
                          capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {proc.stderr}")
    return proc


def convert(*args, **kw):
    return run("convert.cli", *args, **kw)


def kimi_run(*args, **kw):
    return run("runtime.cli", *args, **kw)


def test_console_scripts_installed():
    for name in ("kimi-convert", "kimi-verify", "kimi-run"):
        assert shutil.which(name), f"{name} not on PATH"


@pytest.mark.parametrize("quant,expert_bpw", [("f32", 32.0), ("bf16", 16.0), ("f16", 16.0)])
def test_convert_json_summary(tiny_ckpt, tmp_path, quant, expert_bpw):
    out = tmp_path / "m.kst"
    proc = convert(tiny_ckpt, "-o", out, "--quant", quant, "--json", "--quiet")
    summary = json.loads(proc.stdout)
    assert set(summary["classes"]) == CLASSES
    for c, s in summary["classes"].items():
        assert s["params"] > 0 and s["bytes"] > 0, c
    assert summary["classes"]["routed_experts"]["bpw"] == expert_bpw
    assert summary["classes"]["norms"]["bpw"] == 32.0
    total = summary["total"]
    assert total["params"] == sum(s["params"] for s in summary["classes"].values())
    assert total["file_bytes"] == out.stat().st_size
    assert not list(tmp_path.glob("*.partial"))


def test_run_json_stream_and_logits(tiny_ckpt, tiny_kst, tmp_path):
    dump = tmp_path / "logits.npy"
    prompt = "def main(argv):\n    return"
    proc = kimi_run("--weights", tiny_kst, "--prompt", prompt, "--max-tokens", 12, "--json",
                    "--dump-logits", dump, "--prefill-batch-size", 3, "--threads", 1)
    rep = json.loads(proc.stdout)
    assert "weight file: OK" in proc.stderr
    ids = rep["prompt_tokens"]
    from transformers import AutoTokenizer
    assert ids == AutoTokenizer.from_pretrained(tiny_ckpt)(prompt)["input_ids"]
    assert len(rep["tokens"]) == 12
    assert rep["tokens"] == refmodels.reference_greedy(tiny_ckpt, ids, 12)
    for k in ("prefill_tokens_per_s", "decode_tokens_per_s", "peak_rss_bytes", "resident_bytes", "experts_touched"):
        assert rep["stats"][k] > 0, k
    logits = np.load(dump)
    assert logits.dtype == np.float32 and logits.shape == (len(ids), 320)
    ref = refmodels.reference_logits(tiny_ckpt, ids)
    assert np.abs(logits - ref).max() <= 1e-4 * np.abs(ref).max()

    plain = kimi_run("--weights", tiny_kst, "--prompt", prompt, "--max-tokens", 12, "--quiet")
    assert plain.stdout.rstrip("\n") == rep["text"]


def test_a_run_reads_and_checks_the_header_once(tiny_kst, monkeypatch, capsys):
    """kimi-run plans and runs on one opened weight file (Kimi K2's header takes about half a second to
    check: it was read three times), and with --dry-run closes it before returning."""
    from kimistream.formats import weightfile
    from kimistream.runtime import cli
    opened, parsed = [], []
    real_init, real_parse = weightfile.WeightFile.__init__, weightfile.WeightFile._parse_prefix_and_header

    def init(self, path):
        opened.append(self)
        real_init(self, path)

    def parse(self):
        parsed.append(self)
        real_parse(self)
    monkeypatch.setattr(weightfile.WeightFile, "__init__", init)
    monkeypatch.setattr(weightfile.WeightFile, "_parse_prefix_and_header", parse)
    assert cli.main(["--weights", str(tiny_kst), "--prompt", "def f(x):", "--max-tokens", "2", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"]) == 2
    assert len(opened) == 1 and len(parsed) == 1
    opened.clear()
    assert cli.main(["--weights", str(tiny_kst), "--dry-run"]) == 0
    assert len(opened) == 1 and opened[0].mm is None          # closed: nothing of it outlives the plan


def test_warm_up_leaves_the_output_and_its_seeded_draws_alone(tiny_kst, tmp_path):
    args = ("--weights", tiny_kst, "--prompt", "def f(x):", "--max-tokens", 8, "--temperature", 1.0,
            "--seed", 3, "--json")
    cold, warm = kimi_run(*args), kimi_run(*args, "--warm-up")
    rc, rw = json.loads(cold.stdout), json.loads(warm.stdout)
    assert rw["tokens"] == rc["tokens"] and len(rw["tokens"]) == 8
    assert rw["stats"]["warm_up"] is True and rc["stats"]["warm_up"] is False
    assert "warmed up" in warm.stderr and "warmed up" not in cold.stderr
    text = tmp_path / "t.txt"
    text.write_text("some text to score\n")
    bad = kimi_run("--weights", tiny_kst, "--warm-up", "--perplexity", text, check=False)
    assert bad.returncode != 0 and bad.stderr.strip() == "kimi-run: error: --warm-up applies to a run of one --prompt"


def test_chat_uses_template(tiny_kst):
    rep = json.loads(kimi_run("--weights", tiny_kst, "--prompt", "hi", "--chat", "--max-tokens", 2, "--json").stdout)
    assert rep["prompt_tokens"][0] == 2  # <|im_start|>


def test_sampling_is_seeded(tiny_kst):
    a = kimi_run("--weights", tiny_kst, "--prompt", "x", "--temperature", 1.0, "--top-p", 0.9, "--seed", 7,
                 "--max-tokens", 16, "--json")
    b = kimi_run("--weights", tiny_kst, "--prompt", "x", "--temperature", 1.0, "--top-p", 0.9, "--seed", 7,
                 "--max-tokens", 16, "--json")
    c = kimi_run("--weights", tiny_kst, "--prompt", "x", "--temperature", 1.0, "--top-p", 0.9, "--seed", 8,
                 "--max-tokens", 16, "--json")
    ta, tb, tc = (json.loads(p.stdout)["tokens"] for p in (a, b, c))
    assert ta == tb and ta != tc


def test_activations_flag(tiny_kst):
    """--activations is reported in the run summary, and a bad value is one line on stderr."""
    for mode in ("auto", "int8", "int16"):
        rep = json.loads(kimi_run("--weights", tiny_kst, "--prompt", "x", "--max-tokens", 3, "--json",
                                  "--activations", mode).stdout)
        assert rep["stats"]["activations"] == mode and len(rep["tokens"]) == 3
    proc = kimi_run("--weights", tiny_kst, "--prompt", "x", "--activations", "int4", check=False)
    assert proc.returncode == 2 and "--activations" in proc.stderr and "Traceback" not in proc.stderr


def _one_line_error(proc, *needles):
    assert proc.returncode != 0
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    errors = [l for l in lines if ": error: " in l]
    assert len(errors) == 1 and lines[-1] == errors[0], proc.stderr   # one error line, last
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in errors[0], errors[0]


def test_run_errors(tiny_kst, tmp_path):
    _one_line_error(kimi_run("--weights", tmp_path / "nope.kst", "--prompt", "x", check=False), "nope.kst", "cannot open")
    bad = tmp_path / "trunc.kst"
    bad.write_bytes(tiny_kst.read_bytes()[:-5000])
    _one_line_error(kimi_run("--weights", bad, "--prompt", "x", check=False), "trunc.kst", "truncated")
    _one_line_error(kimi_run("--weights", tiny_kst, "--prompt", "a b c d e f g h", "--max-context", 3, "--quiet",
                             check=False), "--max-context")
    _one_line_error(kimi_run("--weights", tiny_kst, "--prompt", "x", "--top-p", 0, "--quiet", check=False), "--top-p")


def test_flags_a_mode_would_ignore_or_cannot_use_are_refused_before_loading(tiny_kst, tmp_path):
    """Each gives one line naming the flag, before the model is read, and writes nothing (a --dump-logits
    directory had left `DIR.partial.npy` beside it after running the prompt)."""
    text = tmp_path / "t.txt"
    text.write_text("some text to score\n")
    cases = [
        (("--seed", -1, "--prompt", "x"), "--seed must be >= 0"),
        (("--trace", tmp_path / "t.jsonl", "--perplexity", text), "--trace applies to a run of one --prompt"),
        (("--dump-logits", tmp_path / "l.npy", "--perplexity", text), "--dump-logits applies to a run of one --prompt"),
        (("--kl-reference", tiny_kst, "--prompt", "x"), "--kl-reference needs --perplexity"),
        (("--quant", "q1", "--prompt", "x"), "--quant and --override apply with --plan-config"),
        (("--memory-budget", "5X", "--prompt", "x"), "--memory-budget: cannot read size '5X'"),
        (("--dump-logits", tmp_path, "--prompt", "x"), "is a directory"),
        (("--trace", tmp_path / "no" / "t.jsonl", "--prompt", "x"), "--trace"),
        (("--json", "--serve"), "--json applies to"),
        (("--imatrix-out", tmp_path / "i.npz", "--prompt", "x"), "--imatrix-out applies to --calibration"),
        (("--calibration", text, "--imatrix-out", tiny_kst), "is the --weights file this run reads"),
        (("--calibration", text, "--imatrix-out", text), "is the --calibration file this run reads"),
        (("--calibration", text, "--imatrix-out", tmp_path), "--imatrix-out"),
        (("--prompt", "x", "-o", tmp_path / "x.png"), "-o applies to --plot-trace"),
        (("--chat", "--perplexity", text), "--chat applies to a --prompt or a conversation, not to --perplexity"),
        (("--chat", "--calibration", text), "--chat applies to a --prompt or a conversation, not to --calibration"),
    ]
    before = sorted(tmp_path.parent.iterdir())
    for flags, message in cases:
        r = kimi_run("--weights", tiny_kst, *flags, check=False)
        _one_line_error(r, message)
        assert "memory plan" not in r.stderr and "weight file" not in r.stderr, flags     # nothing loaded
    assert sorted(tmp_path.parent.iterdir()) == before and sorted(tmp_path.iterdir()) == [text]


def test_a_budget_beyond_the_machine_is_warned_about(tiny_kst):
    big = kimi_run("--weights", tiny_kst, "--dry-run", "--memory-budget", "1000T")
    assert "warning: --memory-budget" in big.stderr and "is more than this process can have" in big.stderr, big.stderr
    assert "warning" not in kimi_run("--weights", tiny_kst, "--dry-run", "--memory-budget", "1G").stderr


def test_plot_trace_names_the_line_that_is_not_a_record(tmp_path):
    for content, message in [("{}\n", "line 1: not a kimi-run --trace record (no 'step')"),
                             ('{"step": 0}\n[1, 2]\n', "line 1: not a kimi-run --trace record"),
                             ("root:x:0:0\n", "line 1: not JSON")]:
        trace = tmp_path / "t.jsonl"
        trace.write_text(content)
        _one_line_error(kimi_run("--plot-trace", trace, "-o", tmp_path / "p.png", check=False), "t.jsonl", message)
        assert not (tmp_path / "p.png").exists()


def test_a_run_with_no_decode_step_shows_no_decode_speed(tiny_kst):
    r = kimi_run("--weights", tiny_kst, "--prompt", "hello", "--max-tokens", 1)
    row = next(line for line in r.stderr.splitlines() if "generated" in line)
    assert "1 tokens (" in row and "tok/s" not in row, row
    assert all("—" in line for line in r.stderr.splitlines() if "per decoded token" in line)


def test_dump_logits_reports_the_chunks_it_ran_not_a_window(tiny_kst, tmp_path):
    prompt = "".join(chr(97 + i % 26) for i in range(40))
    r = kimi_run("--weights", tiny_kst, "--prompt", prompt, "--max-tokens", 2, "--json", "--prefill-batch-size", 8,
                 "--prompt-window", 32, "--dump-logits", tmp_path / "l.npy")
    assert json.loads(r.stdout)["stats"]["prompt_window"] == 8
    assert "--dump-logits: the prompt runs in chunks of 8 tokens, not in windows of 32" in r.stderr
    assert np.load(tmp_path / "l.npy").shape[0] == len(json.loads(r.stdout)["prompt_tokens"])


def test_convert_errors(tiny_ckpt, tmp_path):
    _one_line_error(convert(tmp_path / "missing", "-o", tmp_path / "x.kst", check=False), "missing")
    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt, src)
    (src / "config.json").write_text("{not json")
    _one_line_error(convert(src, "-o", tmp_path / "x.kst", check=False), "config.json", "not valid JSON")
    _one_line_error(convert(tiny_ckpt, "-o", tmp_path / "x.kst", "--override", "((=f32", check=False), "--override")
    assert not (tmp_path / "x.kst").exists()


def test_convert_refuses_flags_its_job_would_not_use_before_any_work(tiny_ckpt, tiny_kst, tmp_path):
    """One line and exit 2, nothing written: an -o that is a directory (a conversion had run to its end
    and failed on the rename, leaving a full-size .partial), flags a --synthetic or a --publish of a
    weight file would silently ignore, a --publish of a file that is no weight file."""
    geo = tmp_path / "geo.json"
    geo.write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                               "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                               "moe_intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                               "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 16, "v_head_dim": 16,
                               "qk_nope_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                               "n_shared_experts": 1, "first_k_dense_replace": 1}))
    (tmp_path / "adir").mkdir()
    cases = [
        ((tiny_ckpt, "-o", tmp_path / "adir", "--quant", "f32"), "adir: is a directory"),
        ((tiny_ckpt, "-o", f"{tmp_path}/newdir/", "--quant", "f32"), "newdir/: is a directory"),
        ((tiny_ckpt, "-o", tmp_path / "s.kst", "--sparse"), "--sparse applies to --synthetic"),
        (("--synthetic", geo, "-o", tmp_path / "s.kst", "--calibration", "self"), "--calibration do not apply"),
        (("--synthetic", geo, "-o", tmp_path / "s.kst", "--imatrix", tmp_path / "x.npz", "--delete-source"),
         "--imatrix, --delete-source do not apply"),
        ((tiny_kst, "-o", tmp_path / "other.kst", "--quant", "q4", "--publish", tmp_path / "rel"),
         "-o, --quant apply to a conversion"),
        ((geo, "--publish", tmp_path / "rel"), "geo.json"),
        ((tiny_kst, "--publish", tmp_path / "rel", "--chunk-size", "16M"), "--chunk-size must be at least 16.00 MiB"),
        ((tmp_path / "m.gguf", "-o", tmp_path / "k.kst", "--quant", "keep", "--calibration", "self"),
         "--quant keep keeps the GGUF file's own values"),
    ]
    for flags, message in cases:
        r = convert(*flags, "--quiet", check=False)
        _one_line_error(r, message)
        assert r.returncode == 2, flags
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "geo.json"]
    assert not any((tmp_path / "adir").iterdir())


def test_verify_flags_it_cannot_use_are_one_line_errors(tiny_kst, tmp_path):
    r = run("convert.verify_cli", tiny_kst, "--write-manifest", tmp_path / "m.sha256", check=False)
    assert r.returncode == 2 and "--write-manifest records a checkpoint directory's files" in r.stderr
    assert not (tmp_path / "m.sha256").exists()
    r = run("convert.verify_cli", tiny_kst, "--jobs", 0, check=False)
    assert r.returncode == 2 and r.stderr.strip() == "kimi-verify: error: --jobs must be >= 1"


def _mapped_rss(path) -> int:
    """Resident bytes of this process's mappings of `path`, as the kernel accounts them."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not line.startswith(("Rss", "Size")):
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(head[1]) * 1024
    return total


def test_experts_are_paged_in_only_when_routed(tmp_path):
    from kimistream.convert.converter import convert_checkpoint
    from kimistream.formats.presets import PrecisionPlan
    from kimistream.runtime.model import Model
    from kimistream.runtime.weights import ModelWeights
    ckpt = tmp_path / "big-experts"
    refmodels.make_checkpoint(ckpt, seed=5, moe_intermediate_size=1024, n_routed_experts=16)
    out = tmp_path / "m.kst"
    convert_checkpoint(ckpt, out, PrecisionPlan.from_preset("f32"))
    weights = ModelWeights(out)
    expert_bytes = sum(e.nbytes for e in weights.file.extents if e.kind == "expert")
    assert _mapped_rss(out) < 64 * 1024                       # opening maps nothing
    resident = weights.load_resident()
    model = Model(weights, 16)
    model.forward([5])
    touched = weights.expert_bytes_touched
    assert len(weights.experts_touched) == 2 * 2               # top-2 in each of 2 MoE layers
    rss = _mapped_rss(out)
    embed_page_slack = 2 * 65536
    assert touched <= rss <= resident + touched + embed_page_slack + 4 * 65536
    assert rss < expert_bytes / 3


def test_conversion_memory_is_bounded_by_a_tensor_not_the_checkpoint(tiny_ckpt, tmp_path):
    # ~170 MB of float32 routed experts whose largest tensor is 0.6 MB: the converter's peak RSS
    # (the kernel's VmHWM, reported in its summary) stays within a few MB of a tiny model's.
    from refmodels import make_checkpoint
    big = tmp_path / "big"
    make_checkpoint(big, hidden_size=384, moe_intermediate_size=384, n_routed_experts=32, num_hidden_layers=4)
    source_bytes = sum(f.stat().st_size for f in big.glob("*.safetensors"))
    assert source_bytes > 150e6
    mem = {}
    for name, src in (("tiny", tiny_ckpt), ("big", big)):
        proc = convert(src, "-o", tmp_path / f"{name}.kst", "--quant", "f16", "--json", "--quiet")
        mem[name] = json.loads(proc.stdout)["memory"]
    assert mem["big"]["largest_tensor_f32_bytes"] < 2e6
    assert mem["big"]["peak_rss_bytes"] - mem["tiny"]["peak_rss_bytes"] < 32e6, (mem, source_bytes)


def test_long_phases_print_lines_when_stderr_is_not_a_terminal(tiny_ckpt, tmp_path):
    """Piped or logged, a long phase says when it starts, how far it is (rate, time left) and when it
    is done, in plain lines: no bar that vanishes, no silence."""
    out = tmp_path / "m.kst"
    proc = convert(tiny_ckpt, "-o", out, "--quant", "bf16")
    lines = [l for l in proc.stderr.splitlines() if l.startswith("kimi-convert: converting: ")]
    assert lines[0].startswith("kimi-convert: converting: started, ") and lines[0].endswith("B")
    assert any("%)" in l and "/s" in l for l in lines[1:-1]), lines
    assert lines[-1].startswith("kimi-convert: converting: done, ") and "/s)" in lines[-1]
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 40)
    proc = kimi_run("--weights", out, "--perplexity", text, "--max-context", 64)
    lines = [l for l in proc.stderr.splitlines() if l.startswith("kimi-run: scoring: ")]
    assert lines[0].startswith("kimi-run: scoring: started, ") and lines[-1].startswith("kimi-run: scoring: done, ")
    quiet = convert(tiny_ckpt, "-o", tmp_path / "q.kst", "--quant", "bf16", "--quiet")
    assert "converting" not in quiet.stderr


def test_chat_on_a_base_model_warns():
    """The bundled model is a base model trained on code: its template's markers are tokens, but
    their embedding rows were never trained, so --chat says what to expect."""
    proc = kimi_run("--chat", "--prompt", "hi", "--max-tokens", "1")
    warning = [l for l in proc.stderr.splitlines() if "warning: --chat" in l]
    assert len(warning) == 1 and "<|im_start|>" in warning[0], proc.stderr
    proc = kimi_run("--prompt", "hi", "--max-tokens", "1")
    assert "warning: --chat" not in proc.stderr


# ---- kimi-verify and kimi-convert --publish/--assemble: manifests, releases, file names ----

def _hub_env(tmp_path):
    import os
    return {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_DISABLE_TELEMETRY": "1"}


def _verify_json(*args, cwd=None, env=None):
    proc = subprocess.run([sys.executable, "-m", "kimistream.convert.verify_cli", *map(str, args), "--json"],
                          capture_output=True, text=True, timeout=300, cwd=cwd, env=env)
    return proc.returncode, json.loads(proc.stdout) if proc.stdout.strip() else None, proc.stderr


def _sha(path) -> str:
    import hashlib
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_sha256sum_manifests_of_dot_slash_names_apply(tiny_ckpt, tmp_path):
    """`sha256sum ./*` writes './NAME' (and '*./NAME' in binary mode): the names are the directory's files,
    so a correct manifest verifies every one and a wrong one fails them (they were ignored, and each
    './NAME' was a corrupt row of its own)."""
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, d)
    files = sorted(p for p in d.iterdir() if p.is_file())
    good = tmp_path / "good.sha256"
    good.write_text("".join(f"{_sha(p)}  ./{p.name}\n" if i % 2 else f"{_sha(p)} *./{p.name}\n"
                            for i, p in enumerate(files)))
    code, rep, _ = _verify_json(d, "--manifest", good)
    assert code == 0, rep
    assert sorted(r["file"] for r in rep["rows"]) == sorted(f"{d}/{p.name}" for p in files)
    wrong = tmp_path / "wrong.sha256"
    wrong.write_text("".join(f"{'0' * 64}  ./{p.name}\n" for p in files))
    code, rep, _ = _verify_json(d, "--manifest", wrong)
    assert code == 4 and {r["status"] for r in rep["rows"]} == {"corrupt"}
    assert all(r["detail"] == "SHA-256 mismatch" for r in rep["rows"])


def test_a_dot_slash_manifest_applies_to_a_download(tiny_ckpt, tmp_path):
    from hubserver import HubServer
    files = {p.name: p.read_bytes() for p in tiny_ckpt.iterdir() if p.is_file()}
    wrong = tmp_path / "wrong.sha256"
    wrong.write_text("".join(f"{'0' * 64}  ./{n}\n" for n in files))
    good = tmp_path / "good.sha256"
    good.write_text("".join(f"{_sha(tiny_ckpt / n)}  ./{n}\n" for n in files))
    with HubServer() as hub:
        hub.add_repo("o/r", files)
        cmd = [sys.executable, "-m", "kimistream.convert.cli", "--download-only", "o/r", "--endpoint", hub.url,
               "--retry-wait", "0", "--retries", "1", "--quiet"]
        p = subprocess.run([*cmd, "--dir", str(tmp_path / "bad"), "--manifest", str(wrong)], capture_output=True,
                           text=True, timeout=300, env=_hub_env(tmp_path))
        assert p.returncode != 0 and "wrong.sha256" in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert not (tmp_path / "bad" / "model.safetensors").exists()
        p = subprocess.run([*cmd, "--dir", str(tmp_path / "ok"), "--manifest", str(good), "--json"],
                           capture_output=True, text=True, timeout=300, env=_hub_env(tmp_path))
        assert p.returncode == 0, p.stderr
        assert str(good) in json.loads(p.stdout)["download"]["checked_against"]


def test_verify_with_hub_and_manifest_checks_both(tiny_ckpt, tmp_path):
    """--hub REPO --manifest M: a file must match the hub's listing and M (M was ignored: a manifest
    contradicting every file gave exit 0)."""
    from hubserver import HubServer
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, d)
    files = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}
    wrong = tmp_path / "wrong.sha256"
    wrong.write_text("".join(f"{'0' * 64}  {n}\n" for n in files))
    one_wrong = tmp_path / "one_wrong.sha256"
    one_wrong.write_text("".join(f"{'0' * 64 if n == 'config.json' else _sha(d / n)}  {n}\n" for n in files))
    good = tmp_path / "good.sha256"
    good.write_text("".join(f"{_sha(d / n)}  {n}\n" for n in files))
    env = _hub_env(tmp_path)
    with HubServer() as hub:
        commit = hub.add_repo("o/r", files)
        hub_args = ("--hub", f"o/r@{commit}", "--endpoint", hub.url)
        code, rep, err = _verify_json(d, *hub_args, env=env)
        assert code == 0, (rep, err)
        code, rep, _ = _verify_json(d, *hub_args, "--manifest", good, env=env)
        assert code == 0 and str(good) in rep["expected_from"] and len(rep["expected_from"]) >= 2
        code, rep, _ = _verify_json(d, *hub_args, "--manifest", wrong, env=env)
        assert code == 4 and str(wrong) in rep["expected_from"]
        assert {r["status"] for r in rep["rows"]} == {"corrupt"}
        code, rep, _ = _verify_json(d, *hub_args, "--manifest", one_wrong, env=env)
        bad = [r for r in rep["rows"] if r["status"] != "ok"]
        assert code == 4 and [r["file"] for r in bad] == [f"{d}/config.json"], bad
        assert "SHA-256 mismatch" in bad[0]["detail"]


def test_verify_dot_finds_the_checksums_of_the_directory_it_is(tiny_ckpt, tmp_path):
    """`kimi-verify .` inside DIR looks for checksums/DIR.sha256 as `kimi-verify DIR` does (it looked for
    checksums/.sha256: exit 5, nothing to compare against)."""
    d = tmp_path / "tiny-moe"
    shutil.copytree(tiny_ckpt, d)
    sums = tmp_path / "sums"
    sums.mkdir()
    (sums / "tiny-moe.sha256").write_text("".join(f"{_sha(p)}  {p.name}\n" for p in sorted(d.iterdir())))
    for path, cwd in ((".", d), ("tiny-moe", tmp_path), ("tiny-moe/", tmp_path), (f"{d}/../tiny-moe", None)):
        code, rep, _ = _verify_json(path, "--checksums", sums, cwd=cwd)
        assert code == 0 and rep["expected_from"] == [str(sums / "tiny-moe.sha256")], (path, rep)


def test_write_manifest_records_one_directory(tiny_ckpt, tmp_path):
    man = tmp_path / "m.sha256"
    r = run("convert.verify_cli", tiny_ckpt, tiny_ckpt.parent, "--write-manifest", man, check=False)
    _one_line_error(r, "--write-manifest records one checkpoint directory's files", "2 directories given")
    assert r.returncode == 2 and not man.exists() and r.stdout == ""


def _damaged_copy(tiny_kst, path, extent="expert.2.5"):
    from kimistream.formats.weightfile import WeightFile
    shutil.copy(tiny_kst, path)
    with WeightFile(path) as wf:
        pos = wf.extent_by_name[extent].offset + 123
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0xFF]))
    return path


def test_a_damaged_weight_file_is_not_published(tiny_kst, tmp_path):
    """--publish checks every extent's checksum on the way (it checked the header only: a file kimi-verify
    calls corrupt was published and assembled 'OK'); the release already in DIR stays as it was."""
    rel = tmp_path / "rel"
    convert(tiny_kst, "--publish", rel, "--chunk-size", "16MiB", "--quiet")
    before = {p.name: p.read_bytes() for p in rel.iterdir()}
    bad = _damaged_copy(tiny_kst, tmp_path / "tiny.kst")
    r = convert(bad, "--publish", rel, "--chunk-size", "16MiB", "--quiet", check=False)
    _one_line_error(r, str(bad), "extent expert.2.5", "checksum mismatch")
    assert {p.name: p.read_bytes() for p in rel.iterdir()} == before
    r = convert(bad, "--publish", tmp_path / "new", "--chunk-size", "16MiB", "--quiet", check=False)
    _one_line_error(r, "checksum mismatch")
    assert not any((tmp_path / "new").iterdir())


def test_file_names_with_brackets_are_printed_as_they_are(tiny_kst, tiny_ckpt, tmp_path):
    """Paths are not rich markup: '[v2]' was swallowed from messages and '[/b]' raised MarkupError after
    the work was done (exit 1); messages are not wrapped at 80 columns when piped."""
    for name in ("rel[v2]", "a[/b]"):
        rel = tmp_path / name
        r = convert(tiny_kst, "--publish", rel, "--chunk-size", "16MiB", "--quiet")
        line = next(line for line in r.stderr.splitlines() if line.startswith("published "))
        assert f"published {tiny_kst} as " in line and f" in {rel}, compression ratio " in line, r.stderr
        assert (rel / "tiny.kst.release.json").is_file()
        out = tmp_path / f"out[{name}].kst"
        r = convert("--assemble", rel, "-o", out, "--quiet")
        assert f"assembled {out} from {rel} (" in r.stderr, r.stderr
    import os
    wide = {**os.environ, "COLUMNS": "400"}
    odd = tmp_path / "w[red]x.kst"
    shutil.copy(tiny_kst, odd)
    r = subprocess.run([sys.executable, "-m", "kimistream.convert.verify_cli", str(odd)], capture_output=True,
                       text=True, timeout=300, env=wide)
    assert r.returncode == 0 and "w[red]x.kst [header]" in r.stdout and "Traceback" not in r.stderr, r.stdout
    d = tmp_path / "x[" / "b]"                   # the directory x[/b]
    shutil.copytree(tiny_ckpt, d)
    r = subprocess.run([sys.executable, "-m", "kimistream.convert.verify_cli", str(d)], capture_output=True,
                       text=True, timeout=300, env=wide)
    assert r.returncode == 5 and f"{d}/config.json" in r.stdout and "Traceback" not in r.stderr, r.stderr


def test_assemble_gives_json_and_refuses_flags_it_would_ignore(tiny_kst, tmp_path):
    rel = tmp_path / "rel"
    convert(tiny_kst, "--publish", rel, "--chunk-size", "16MiB", "--quiet")
    out = tmp_path / "out.kst"
    r = convert("--assemble", rel, "-o", out, "--json", "--quiet")
    data = json.loads(r.stdout)
    assert data["output"] == str(out) and data["file_bytes"] == tiny_kst.stat().st_size
    assert data["sha256"] == _sha(tiny_kst) and data["assembled_from"] == str(rel)
    assert data["release"]["file"] == "tiny.kst"
    for flags, message in [(("--quant", "q4"), "--quant do not apply"),
                           (("--publish", tmp_path / "rel2"), "--publish do not apply"),
                           (("--dry-run",), "--dry-run do not apply"),
                           ((tiny_kst,), "a source do not apply")]:
        r = convert("--assemble", rel, "-o", tmp_path / "x.kst", *flags, "--quiet", check=False)
        _one_line_error(r, "--assemble rebuilds a published release as it is", message)
        assert r.returncode == 2 and not (tmp_path / "x.kst").exists() and not (tmp_path / "rel2").exists()


def test_a_release_from_urls_gives_json_and_refuses_conversion_flags(tiny_kst, tmp_path):
    """A URL list of a published release is assembled into -o: --json prints the result (stdout was
    empty), and --publish/--quant/--override, which only a conversion uses, are refused before the
    download (they were ignored)."""
    from hubserver import HubServer
    rel = tmp_path / "rel"
    convert(tiny_kst, "--publish", rel, "--chunk-size", "16MiB", "--quiet")
    env = _hub_env(tmp_path)
    with HubServer() as hub:
        lst = tmp_path / "urls.txt"
        lst.write_text("".join(f"{hub.add_plain(f.name, f.read_bytes())} {_sha(f)}\n"
                               for f in sorted(rel.iterdir()) if f.name != "SHA256SUMS"))
        base = [sys.executable, "-m", "kimistream.convert.cli", "--urls", str(lst), "--dir", str(tmp_path / "d"),
                "-o", str(tmp_path / "out.kst"), "--quiet", "--retry-wait", "0"]
        for flags, message in [(("--publish", tmp_path / "rel2"), "--publish apply to a conversion"),
                               (("--quant", "q4", "--override", "x=f32"), "--quant, --override apply to a conversion")]:
            r = subprocess.run([*base, *map(str, flags)], capture_output=True, text=True, timeout=300, env=env)
            _one_line_error(r, str(lst), "is a published release (tiny.kst.release.json)", message)
            assert r.returncode == 2 and not (tmp_path / "d").exists() and not (tmp_path / "rel2").exists()
        r = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr
        data = json.loads(r.stdout)
        assert data["output"] == str(tmp_path / "out.kst") and data["sha256"] == _sha(tiny_kst)
        assert data["assembled_from"] == str(tmp_path / "d")
        assert len(data["download"]["files"]) == len(lst.read_text().splitlines())
    assert (tmp_path / "out.kst").read_bytes() == tiny_kst.read_bytes()


def test_publishing_into_another_files_release_is_refused_before_any_work(tiny_ckpt, tiny_kst, tmp_path):
    """A release directory holds one file's release (assembly takes its one *.release.json): publishing
    another file into it is refused with one line before anything is converted or written."""
    rel = tmp_path / "rel"
    convert(tiny_kst, "--publish", rel, "--chunk-size", "16MiB", "--quiet")
    before = {p.name: p.read_bytes() for p in rel.iterdir()}
    other = tmp_path / "other.kst"
    shutil.copy(tiny_kst, other)
    for flags in ((other,), (tiny_ckpt, "-o", tmp_path / "conv.kst", "--quant", "f32")):
        r = convert(*flags, "--publish", rel, "--quiet", check=False)
        _one_line_error(r, f"--publish {rel}: holds the release of another file (tiny.kst.release.json)")
        assert r.returncode == 2
    assert {p.name: p.read_bytes() for p in rel.iterdir()} == before and not (tmp_path / "conv.kst").exists()
