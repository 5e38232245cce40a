"""kimi-convert's conversion flags as a first-time user tries them: each one either does what its help
says in the job at hand or is refused with one line and exit code 2 before any work, and long steps
show progress."""

import json

import pytest

from kimistream.convert import cli
from kimistream.formats.weightfile import WeightFile


def convert(*argv):
    return cli.main([str(a) for a in argv])


def last_error(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "nothing on stderr"
    return err[-1]


@pytest.fixture
def config(tiny_ckpt):
    return tiny_ckpt / "config.json"


def test_output_that_is_not_a_weight_file_is_not_overwritten(tiny_ckpt, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    assert convert(tiny_ckpt, "-o", notes, "--quant", "f32", "--quiet") == 2
    assert last_error(capsys) == (f"kimi-convert: error: {notes}: exists and is not a kimi-stream weight file "
                                  f"(-o would overwrite it: remove it or choose another -o)")
    assert notes.read_text() == "my notes\n" and not list(tmp_path.glob("notes.txt.*"))


def test_synthetic_and_assemble_do_not_overwrite_other_files(config, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    (tmp_path / "rel").mkdir()
    for argv in (("--synthetic", config), ("--assemble", tmp_path / "rel")):
        assert convert(*argv, "-o", notes, "--quiet") == 2
        assert last_error(capsys).endswith("notes.txt: exists and is not a kimi-stream weight file (-o would "
                                           "overwrite it: remove it or choose another -o)")
    assert notes.read_text() == "my notes\n" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "rel"]


def test_output_that_is_a_weight_file_or_empty_is_replaced(tiny_ckpt, tiny_kst, tmp_path):
    import shutil
    old = tmp_path / "old.kst"
    shutil.copy(tiny_kst, old)
    empty = tmp_path / "empty.kst"
    empty.touch()
    for out in (old, empty):
        assert convert(tiny_ckpt, "-o", out, "--quant", "bf16", "--quiet") == 0
        with WeightFile(out) as wf:
            assert wf.header["plan"]["preset"] == "bf16"


@pytest.mark.parametrize("value", [0, 1, 5000, 4 << 20])
@pytest.mark.parametrize("mode", ["convert", "dry-run", "synthetic"])
def test_bad_alignment_is_refused_before_any_work(tiny_ckpt, config, tmp_path, capsys, value, mode):
    out = tmp_path / "m.kst"
    argv = {"convert": (tiny_ckpt, "-o", out), "dry-run": (tiny_ckpt, "--dry-run"),
            "synthetic": ("--synthetic", config, "-o", out)}[mode]
    assert convert(*argv, "--quant", "f32", "--alignment", value, "--quiet") == 2
    assert last_error(capsys) == (f"kimi-convert: error: --alignment must be a power of two in 4096..2097152, "
                                  f"got {value}")
    assert not list(tmp_path.iterdir())


def test_synthetic_uses_alignment(config, tmp_path, capsys):
    out = tmp_path / "s.kst"
    assert convert("--synthetic", config, "-o", out, "--quant", "q4", "--alignment", 65536, "--quiet", "--json") == 0
    with WeightFile(out) as wf:
        assert wf.alignment == 65536
    assert json.loads(capsys.readouterr().out)["file_bytes"] == out.stat().st_size


@pytest.mark.parametrize("flags,refused", [
    (("--kv-dtype", "f32"), "--kv-dtype applies to --memory-budget (the KV cache the memory plan holds)"),
    (("--self-tokens", 100), "--self-tokens tunes a calibration, and this conversion runs none (--quant f32 is "
                             "not self-calibrated by default; give --calibration self or TEXT_FILE)"),
    (("--seed", 3), "--seed tunes a calibration"),
    (("--moment-budget", "1G"), "--moment-budget tunes a calibration"),
    (("--max-context", 64), "--max-context tunes a calibration"),
    (("--quant", "q4", "--imatrix", "im.npz", "--seed", 1), "(--imatrix gives the importances measured already)"),
])
def test_flags_that_tune_what_does_not_run_are_refused(tiny_ckpt, tmp_path, capsys, flags, refused):
    quant = () if "--quant" in flags else ("--quant", "f32")
    assert convert(tiny_ckpt, "-o", tmp_path / "m.kst", *quant, *flags, "--quiet") == 2
    assert refused in last_error(capsys)
    assert not list(tmp_path.iterdir())


def test_self_calibration_flags_with_a_text_file_are_refused(tiny_ckpt, tmp_path, capsys):
    text = tmp_path / "cal.txt"
    text.write_text("def main():\n    return 0\n" * 20)
    assert convert(tiny_ckpt, "-o", tmp_path / "m.kst", "--quant", "q2", "--calibration", text,
                   "--self-tokens", 100, "--seed", 2, "--quiet") == 2
    assert last_error(capsys) == ("kimi-convert: error: --self-tokens, --seed tune self-calibration, not "
                                  "calibration over a text file")
    assert [p.name for p in tmp_path.iterdir()] == ["cal.txt"]


def test_memory_budget_still_takes_max_context_and_kv_dtype(tiny_ckpt, capsys):
    assert convert(tiny_ckpt, "--dry-run", "--quant", "f32", "--memory-budget", "2G", "--max-context", 64,
                   "--kv-dtype", "f32", "--json") == 0
    fit = json.loads(capsys.readouterr().out)["memory_fit"]
    assert fit["max_context"] == 64 and fit["kv_dtype"] == "f32"


def test_synthetic_refuses_a_source_and_calibration_flags(tiny_ckpt, config, tmp_path, capsys):
    out = tmp_path / "s.kst"
    assert convert(tiny_ckpt, "--synthetic", config, "-o", out, "--quiet") == 2
    assert last_error(capsys) == "kimi-convert: error: --synthetic writes random weights: a source do not apply"
    assert convert("--synthetic", config, "-o", out, "--self-tokens", 10, "--moment-budget", "1G", "--quiet") == 2
    assert last_error(capsys).endswith("--self-tokens, --moment-budget do not apply")
    assert convert("--synthetic", config, "--dry-run", "--max-context", 64) == 2
    assert last_error(capsys).endswith("--max-context do not apply")
    assert not list(tmp_path.iterdir())


def test_negative_seed_names_the_flag(config, tmp_path, capsys):
    assert convert("--synthetic", config, "-o", tmp_path / "s.kst", "--seed", -1, "--quiet") == 2
    assert last_error(capsys) == "kimi-convert: error: --seed must not be negative, got -1"
    assert not list(tmp_path.iterdir())


def test_synthetic_bad_override_and_missing_config(config, tmp_path, capsys):
    assert convert("--synthetic", config, "-o", tmp_path / "s.kst", "--override", "mlp=q9", "--quiet") == 2
    assert last_error(capsys).startswith("kimi-convert: error: --override 'mlp=q9': unknown codec 'q9'")
    assert convert("--synthetic", tmp_path / "nope.json", "-o", tmp_path / "s.kst", "--quiet") == 1
    assert last_error(capsys) == (f"kimi-convert: error: {tmp_path / 'nope.json'}: cannot read the config "
                                  f"(No such file or directory)")
    assert not list(tmp_path.iterdir())


def test_unknown_override_codec_names_the_flag(tiny_ckpt, tmp_path, capsys):
    assert convert(tiny_ckpt, "-o", tmp_path / "m.kst", "--override", "experts=q3", "--quiet") == 2
    assert last_error(capsys).startswith("kimi-convert: error: --override 'experts=q3': unknown codec 'q3'")


def test_assemble_refuses_conversion_only_flags(tmp_path, capsys):
    (tmp_path / "rel").mkdir()
    for flags in (("--alignment", 8192), ("--seed", 1), ("--self-tokens", 100), ("--moment-budget", "1G")):
        assert convert("--assemble", tmp_path / "rel", "-o", tmp_path / "m.kst", *flags) == 2
        assert flags[0] in last_error(capsys)


def test_hashing_the_sources_shows_progress(tiny_ckpt, tmp_path):
    """Recording the sources' SHA-256 reads every shard before the first tensor (about 20 minutes for
    a terabyte): it is a phase of its own."""
    import shutil

    from kimistream.convert.converter import convert_checkpoint
    from kimistream.formats.presets import PrecisionPlan
    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt, src)             # files this process has not hashed yet
    events = []
    convert_checkpoint(src, tmp_path / "m.kst", PrecisionPlan.from_preset("f32"),
                       progress=lambda kind, **info: events.append((kind, info)))
    kinds = [k for k, _ in events]
    assert kinds[0] == "hashing" and kinds.index("start") > 1
    total = events[0][1]["total_bytes"]
    assert total >= sum(p.stat().st_size for p in src.glob("*.safetensors"))
    assert sum(i["nbytes"] for k, i in events if k == "hashed") == total


def test_hashing_progress_on_stderr(tiny_ckpt, tmp_path, capsys):
    import shutil
    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt, src)
    assert convert(src, "-o", tmp_path / "m.kst", "--quant", "f32", "--json") == 0
    captured = capsys.readouterr()
    assert "hashing sources: started" in captured.err and "hashing sources: done" in captured.err
    json.loads(captured.out)


@pytest.mark.parametrize("flags,named", [(["--quant", "q2"], "--quant applies"),
                                         (["-o", "x.kst", "--publish", "rel"], "--publish, -o apply"),
                                         (["--memory-budget", "1G", "--override", "x=q4"],
                                          "--override, --memory-budget apply")])
def test_download_only_refuses_conversion_flags(tmp_path, capsys, flags, named):
    """--download-only fetches and verifies: a conversion flag beside it would do nothing, so it is refused
    before anything is fetched (the list names a server that is not there)."""
    urls = tmp_path / "urls.txt"
    urls.write_text("http://127.0.0.1:9/model.safetensors\n")
    assert convert("--download-only", "--urls", urls, "--dir", tmp_path / "d", *flags) == 2
    err = last_error(capsys)
    assert err.startswith("kimi-convert: error: --download-only fetches and checks files only: ") and named in err, err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("flags,named", [(["--calibration", "self"], "--calibration self"),
                                         (["--imatrix", "IM"], "--imatrix")])
def test_importance_for_a_float_preset_is_refused(tiny_ckpt, tmp_path, capsys, flags, named):
    """A float preset stores values, which no importance weighs: a calibration or an importance matrix
    given for one would be recorded in the header and change nothing, so it is refused before any work
    (an override to a block codec makes it apply)."""
    im = tmp_path / "im.npz"
    im.write_bytes(b"")
    flags = [str(im) if f == "IM" else f for f in flags]
    out = tmp_path / "x.kst"
    assert convert(tiny_ckpt, "-o", out, "--quant", "f16", *flags, "--quiet") == 2
    err = last_error(capsys)
    assert err.startswith(f"kimi-convert: error: {named}: --quant f16 stores every tensor as floats"), err
    assert not out.exists() and not list(tmp_path.glob("x.kst*"))
    assert convert(tiny_ckpt, "-o", out, "--quant", "f16", "--override", "mlp.experts=q8", "--calibration", "self",
                   "--dry-run", "--quiet") == 0
