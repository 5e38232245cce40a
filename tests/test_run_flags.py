"""Every kimi-run flag works in the mode it is given in, or is refused in one line before the model
is read: a flag the mode would ignore, two modes at once, an empty value, a value that is not a
number, a file to read that is missing or a directory, an image name without a format."""

import json
import subprocess
import sys

import pytest

from kimistream.convert.synthetic import write_synthetic
from kimistream.formats.presets import PrecisionPlan
from kimistream.runtime import cli
from test_streaming import GEOMETRY


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("flags")
    (d / "config.json").write_text(json.dumps(GEOMETRY))
    (d / "text.txt").write_text("the quick brown fox jumps over the lazy dog " * 20)
    write_synthetic(d / "config.json", d / "q2.kst", PrecisionPlan.from_preset("q2"), seed=3)
    return d


def run(capsys, *args):
    """kimi-run in this process: (exit code, stdout, stderr)."""
    rc = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def refused(capsys, *args):
    """The one error line of a run refused before its model is read."""
    rc, out, err = run(capsys, *args)
    lines = err.strip().splitlines()
    assert rc == 1 and out == "" and len(lines) == 1 and lines[0].startswith("kimi-run: error: "), (rc, out, err)
    return lines[0]


@pytest.mark.parametrize("flags, message", [
    (("--plan-config", "CONFIG", "--weights", "WEIGHTS"), "--plan-config takes no --weights (it plans from"),
    (("--plan-config", "CONFIG", "--prompt", "hi"), "--plan-config takes no --prompt"),
    (("--plan-config", "CONFIG", "--io", "pread"), "--plan-config takes no --io"),
    (("--plot-trace", "TEXT", "-o", "PNG", "--dry-run"), "--plot-trace takes no --dry-run"),
    (("--plot-trace", "TEXT", "-o", "PNG", "--weights", "WEIGHTS"), "--plot-trace takes no --weights"),
    (("--weights", "WEIGHTS", "--serve", "--temperature", "0.5"), "--serve takes no --temperature (each request"),
    (("--weights", "WEIGHTS", "--serve", "--max-tokens", "5"), "--serve takes no --max-tokens"),
    (("--weights", "WEIGHTS", "--serve", "--chat"), "--serve takes no --chat"),
    (("--weights", "WEIGHTS", "--perplexity", "TEXT", "--prompt", "hi"), "--perplexity takes no --prompt"),
    (("--weights", "WEIGHTS", "--perplexity", "TEXT", "--seed", "3"), "--perplexity takes no --seed"),
    (("--weights", "WEIGHTS", "--perplexity", "TEXT", "--moment-budget", "1G"), "--perplexity takes no --moment-budget"),
    (("--weights", "WEIGHTS", "--calibration", "TEXT", "--imatrix-out", "IMATRIX", "--seed", "3"),
     "--calibration takes no --seed (it applies to --calibration self)"),
    (("--weights", "WEIGHTS", "--prompt", "hi", "--host", "0.0.0.0"), "a run of one --prompt takes no --host"),
    (("--weights", "WEIGHTS", "--prompt", "hi", "--no-prompt-cache"), "a run of one --prompt takes no --no-prompt-cache"),
    (("--weights", "WEIGHTS", "--prompt", "hi", "--self-tokens", "5"), "a run of one --prompt takes no --self-tokens"),
])
def test_a_flag_the_mode_does_not_read_is_refused(model, capsys, flags, message):
    names = {"CONFIG": model / "config.json", "WEIGHTS": model / "q2.kst", "TEXT": model / "text.txt",
             "IMATRIX": model / "refused.npz", "PNG": model / "refused.png"}
    line = refused(capsys, *(names.get(f, f) for f in flags))
    assert message in line, line
    assert not (model / "refused.npz").exists()


def test_the_flags_a_mode_reads_still_run(model, capsys):
    rc, out, _ = run(capsys, "--plan-config", model / "config.json", "--dry-run", "--prefetch", "off", "--json")
    assert rc == 0 and json.loads(out)["memory_plan"]["fits"]
    rc, out, _ = run(capsys, "--weights", model / "q2.kst", "--calibration", "self", "--perplexity",
                     model / "text.txt", "--imatrix-out", model / "im.npz", "--self-tokens", 40, "--seed", 1,
                     "--max-context", 64, "--json", "--quiet")
    assert rc == 0 and set(json.loads(out)) == {"imatrix", "quality", "peak_rss_bytes"}


@pytest.mark.parametrize("flags, message", [
    (("--plan-config", "CONFIG", "--serve"), "--plan-config and --serve cannot be combined"),
    (("--plan-config", "CONFIG", "--perplexity", "TEXT"), "--plan-config and --perplexity cannot be combined"),
    (("--weights", "WEIGHTS", "--serve", "--perplexity", "TEXT"), "--serve and --perplexity cannot be combined"),
    (("--plot-trace", "TEXT", "-o", "PNG", "--plan-config", "CONFIG"), "--plot-trace and --plan-config cannot"),
])
def test_two_modes_at_once_are_refused(model, capsys, flags, message):
    names = {"CONFIG": model / "config.json", "WEIGHTS": model / "q2.kst", "TEXT": model / "text.txt",
             "PNG": model / "refused.png"}
    line = refused(capsys, *(names.get(f, f) for f in flags))
    assert message in line, line


@pytest.mark.parametrize("flag", ["--weights", "--memory-budget", "--plan-config", "--perplexity", "--trace",
                                  "--host"])
def test_an_empty_value_is_refused(model, capsys, flag):
    """An empty value (an unset shell variable) had meant the default: the bundled model, 80 % of
    memory, every network interface for --serve, or another mode altogether."""
    base = {"--host": ("--weights", model / "q2.kst", "--serve"),
            "--perplexity": ("--weights", model / "q2.kst"),
            "--plan-config": ()}.get(flag, ("--weights", model / "q2.kst", "--prompt", "hi"))
    if flag == "--weights":
        base = ("--prompt", "hi")
    line = refused(capsys, *base, flag, "")
    assert line == f"kimi-run: error: {flag}: the value is empty", line


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_temperature_that_is_not_a_finite_number_is_refused(model, capsys, value):
    line = refused(capsys, "--weights", model / "q2.kst", "--prompt", "hi", "--temperature", value)
    assert "--temperature must be a number >= 0" in line, line


def test_plan_config_checks_the_prefill_batch(model, capsys):
    line = refused(capsys, "--plan-config", model / "config.json", "--prefill-batch-size", 0)
    assert line == "kimi-run: error: --prefill-batch-size must be >= 1"


@pytest.mark.parametrize("flag", ["--perplexity", "--calibration", "--kl-reference", "--plot-trace"])
def test_a_file_to_read_is_checked_before_loading(model, capsys, tmp_path, flag):
    extra = {"--calibration": ("--imatrix-out", tmp_path / "im.npz"),
             "--kl-reference": ("--perplexity", model / "text.txt"),
             "--plot-trace": ("-o", tmp_path / "p.png")}.get(flag, ())
    weights = () if flag == "--plot-trace" else ("--weights", model / "q2.kst")
    line = refused(capsys, *weights, flag, tmp_path, *extra)
    assert line == f"kimi-run: error: {flag} {tmp_path}: is a directory, not a file", line
    line = refused(capsys, *weights, flag, tmp_path / "missing", *extra)
    assert line == f"kimi-run: error: {flag} {tmp_path / 'missing'}: no such file", line


def test_plot_trace_writes_the_image_it_names(model, capsys, tmp_path):
    """matplotlib adds .png to a name without a format suffix: it had written `p.png` for -o p and
    said "wrote p"."""
    trace = tmp_path / "t.jsonl"
    assert run(capsys, "--weights", model / "q2.kst", "--prompt", "hi", "--max-tokens", 2, "--trace", trace,
               "--quiet")[0] == 0
    for name in ("p", "p.txt"):
        line = refused(capsys, "--plot-trace", trace, "-o", tmp_path / name)
        assert f"-o {tmp_path / name}: the name must end in an image format's suffix" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]
    assert run(capsys, "--plot-trace", trace, "-o", tmp_path / "p.svg")[0] == 0 and (tmp_path / "p.svg").is_file()


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "not a JSON config (a config.json is an object, this is a list)"),
    ('"deepseek"', "not a JSON config (a config.json is an object, this is a str)"),
    (b"\xff\xfe{}", "not a JSON config (not UTF-8 text at byte 0)"),
    ("{,}", "not a JSON config (Expecting property name enclosed in double quotes at line 1 column 2)"),
])
def test_plan_config_that_is_not_a_config_is_one_line(capsys, tmp_path, content, message):
    path = tmp_path / "config.json"
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    assert refused(capsys, "--plan-config", path) == f"kimi-run: error: {path}: {message}"


def test_text_windows_of_one_token_name_the_flag(model, capsys):
    """Windows of one token score nothing: --perplexity had said the text was too short, after loading."""
    line = refused(capsys, "--weights", model / "q2.kst", "--perplexity", model / "text.txt", "--max-context", 1)
    assert line == "kimi-run: error: --max-context 1: windows of text need at least 2 tokens"


def test_self_calibration_token_count_is_checked_before_loading(model, capsys, tmp_path):
    line = refused(capsys, "--weights", model / "q2.kst", "--calibration", "self", "--self-tokens", 1,
                   "--imatrix-out", tmp_path / "im.npz")
    assert line == "kimi-run: error: --calibration self needs --self-tokens of at least 2"


def test_gguf_inputs_on_a_file_without_llama_cpp_blocks_is_refused(model, capsys):
    """It changes nothing there: the run had gone ahead as if the flag were not given."""
    line = refused(capsys, "--weights", model / "q2.kst", "--prompt", "hi", "--gguf-inputs", "f32")
    assert line == (f"kimi-run: error: {model / 'q2.kst'}: --gguf-inputs f32 applies to llama.cpp blocks, and this "
                    "file keeps none (they come from a GGUF converted with --quant keep)")


def kimi_run(*args):
    return subprocess.run([sys.executable, "-m", "kimistream.runtime.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def test_threads_beyond_the_pool_are_refused(model):
    """The kernels' pool has 255 workers beside the caller: more threads were taken and reported,
    never started."""
    proc = kimi_run("--weights", model / "q2.kst", "--prompt", "hi", "--threads", 100000)
    assert proc.returncode == 1 and proc.stderr.strip() == "kimi-run: error: --threads must be 1..256, got 100000"


def test_quiet_hides_the_summary_as_its_help_says(model):
    proc = kimi_run("--weights", model / "q2.kst", "--prompt", "hi", "--max-tokens", 2, "--quiet")
    assert proc.returncode == 0 and proc.stderr == ""
    help_text = " ".join(kimi_run("--help").stdout.split())
    assert "--quiet no log on stderr: start-up, warnings, progress and the run summary" in help_text


@pytest.mark.parametrize("flags", [("--warm-up",), ("--trace", "T.jsonl"), ("--dump-logits", "L.npy"),
                                   ("--trace", "T.jsonl", "--warm-up")])
def test_dry_run_refuses_what_only_a_run_does(model, capsys, tmp_path, flags):
    """--dry-run plans and stops: a warm-up, a trace or dumped logits would come from a run that never
    happens, so they are refused, and nothing is written."""
    flags = [str(tmp_path / f) if f.endswith((".jsonl", ".npy")) else f for f in flags]
    line = refused(capsys, "--weights", model / "q2.kst", "--prompt", "hi", "--dry-run", *flags)
    assert line.startswith("kimi-run: error: --dry-run plans without running: ") and \
        line.endswith("would measure or write nothing")
    assert not list(tmp_path.iterdir())
    rc, _, _ = run(capsys, "--weights", model / "q2.kst", "--prompt", "hi", "--dry-run")
    assert rc == 0
