"""kimi-run checks what it reads: every resident extent against its checksum when it is loaded, and
every expert extent the first time its bytes are read (mmap and pread alike). A flipped byte stops
the run with one line naming the file and the extent, a non-zero exit and no traceback, before the
bytes are used; an intact file runs as before. Odd inputs get the same treatment: a FIFO given as a
weight file or a shard (it would block), --max-context 0, a second conversion to the same output."""

import fcntl
import json
import os
import re
import shutil

import pytest

from kimistream.formats.constants import EXTENT_EXPERT, EXTENT_RESIDENT
from kimistream.formats.weightfile import WeightFile
from test_cli import convert, kimi_run


def corrupt(src, dst, kind):
    """A copy of src with one byte flipped in the middle of every extent of `kind`; their names."""
    shutil.copy(src, dst)
    with WeightFile(dst) as wf:
        targets = [(e.name, e.offset + e.nbytes // 2) for e in wf.extents if e.kind == kind and e.nbytes]
    with open(dst, "r+b") as f:
        for _, at in targets:
            f.seek(at)
            b = f.read(1)[0]
            f.seek(at)
            f.write(bytes([b ^ 0x5A]))
    return [n for n, _ in targets]


def one_line_error(proc, *words):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, proc.stderr
    for w in words:
        assert w in errors[0], errors[0]


@pytest.mark.parametrize("io", ["mmap", "pread"])
def test_corrupted_expert_is_caught_before_use(tiny_kst, tmp_path, io):
    bad = tmp_path / "bad.kst"
    names = corrupt(tiny_kst, bad, EXTENT_EXPERT)
    assert names
    proc = kimi_run("--weights", bad, "--prompt", "hello world", "--max-tokens", "2", "--io", io, check=False)
    one_line_error(proc, str(bad), "fails its checksum", "kimi-verify")
    assert any(n in proc.stderr for n in names)


def test_experts_read_ahead_are_checked_on_the_read_thread(tiny_kst, tmp_path):
    """The mmap pager hashes an expert it reads ahead of certain use on the read's own thread (off the
    computing thread); a corrupted one read that way still stops get() before its bytes are used."""
    from kimistream.runtime.pager import ExpertReadError, MmapPager
    from kimistream.runtime.weights import ModelWeights
    bad = tmp_path / "bad.kst"
    names = corrupt(tiny_kst, bad, EXTENT_EXPERT)
    layer, e = (int(v) for v in names[0].split(".")[1:])
    for path, intact in ((tiny_kst, True), (bad, False)):
        w = ModelWeights(path)
        p = w.pager
        assert isinstance(p, MmapPager)
        p.fetch_ahead(layer, [e])
        p._inflight[(layer, e)].ready.wait()
        assert ((layer, e) in p._verified) == intact
        if intact:
            p.get(layer, e)
        else:
            with pytest.raises(ExpertReadError, match=f"expert.{layer}.{e} fails its checksum"):
                p.get(layer, e)
        w.close()


def test_corrupted_resident_extent_is_caught_at_load(tiny_kst, tmp_path):
    bad = tmp_path / "bad.kst"
    names = corrupt(tiny_kst, bad, EXTENT_RESIDENT)
    proc = kimi_run("--weights", bad, "--prompt", "hello", "--max-tokens", "1", check=False)
    one_line_error(proc, str(bad), "fails its checksum")
    assert any(n in proc.stderr for n in names)


def test_intact_file_runs(tiny_kst):
    proc = kimi_run("--weights", tiny_kst, "--prompt", "hello world", "--max-tokens", "2", "--io", "pread")
    assert proc.returncode == 0


def test_fifo_weight_file_is_refused(tmp_path):
    fifo = tmp_path / "w.kst"
    os.mkfifo(fifo)
    proc = kimi_run("--weights", fifo, "--prompt", "x", check=False)    # returns: nothing waits on the FIFO
    one_line_error(proc, str(fifo), "not a regular file")


def test_fifo_shard_is_refused(tiny_ckpt, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, ck)
    (ck / "model.safetensors").unlink()
    os.mkfifo(ck / "model.safetensors")
    proc = convert(ck, "-o", tmp_path / "m.kst", "--quant", "f32", "--calibration", "none", check=False)
    one_line_error(proc, "model.safetensors", "not a regular file")


def test_max_context_is_checked(tiny_kst):
    proc = kimi_run("--weights", tiny_kst, "--prompt", "x", "--max-context", "0", check=False)
    one_line_error(proc, "--max-context")
    with WeightFile(tiny_kst) as wf:
        limit = wf.header["config"]["max_position_embeddings"]
    proc = kimi_run("--weights", tiny_kst, "--prompt", "x", "--max-tokens", "1", "--max-context", limit + 1)
    assert "past the model's max_position_embeddings" in proc.stderr


def test_second_conversion_to_one_output_is_refused(tiny_ckpt, tmp_path):
    out = tmp_path / "m.kst"
    fd = os.open(tmp_path / "m.kst.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)                 # as a first conversion still running would hold it
    try:
        proc = convert(tiny_ckpt, "-o", out, "--quant", "f32", "--calibration", "none", check=False)
        one_line_error(proc, str(out), "another conversion")
    finally:
        os.close(fd)
    proc = convert(tiny_ckpt, "-o", out, "--quant", "f32", "--calibration", "none", "--json")
    assert json.loads(proc.stdout)["total"] and out.exists() and not (tmp_path / "m.kst.lock").exists()



def test_prompt_that_is_not_utf8(tiny_kst):
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "kimistream.runtime.cli", "--weights", str(tiny_kst), "--max-tokens", "1"]
    for args, stdin in (([b"--prompt", b"\xff\xfe abc"], None), ([b"--prompt", b"-"], b"ok \xff\xfe")):
        proc = subprocess.run([c.encode() for c in cmd] + args, input=stdin, capture_output=True, timeout=300)
        err = proc.stderr.decode(errors="replace")
        assert proc.returncode != 0 and "Traceback" not in err and "not valid UTF-8" in err, err


@pytest.mark.parametrize("reader", ["kimi-run", "kimi-verify"])
def test_weight_file_truncated_while_mapped(tiny_kst, tmp_path, reader):
    """Pages lost under a mapping (the file truncated by another program while in use) end the process
    with one line naming the file and exit status 1, not a silent SIGBUS."""
    import subprocess
    import sys
    import textwrap
    victim = tmp_path / "victim.kst"
    shutil.copy(tiny_kst, victim)
    read = ("from kimistream.runtime.weights import ModelWeights\nw = ModelWeights(path)\n"
            "os.truncate(path, 4096)\nw.load_resident()" if reader == "kimi-run" else
            "from kimistream.convert.verify import verify_weight_file\nfrom kimistream.formats.weightfile import WeightFile\n"
            "wf = WeightFile(path)\nos.truncate(path, 4096)\n[wf.verify_extent(e) for e in wf.extents]")
    script = f"import os, sys\nsys.argv = [{reader!r}]\npath = {str(victim)!r}\n" + read + "\nprint('no fault')\n"
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    one_line_error(proc, reader, str(victim), "truncated", "kimi-verify")


@pytest.mark.parametrize("module,prog", [("kimistream.runtime.cli", "kimi-run"),
                                         ("kimistream.convert.cli", "kimi-convert"),
                                         ("kimistream.convert.verify_cli", "kimi-verify")])
def test_ctrl_c_between_import_and_main(module, prog):
    """The console script's own lines after it imports the command and before it calls main() (pip's
    wrapper rewrites argv[0] with a regex there): an interrupt then is held from the import on and
    ends with the command's one line and 130, not a traceback. A library import holds nothing."""
    import subprocess
    import sys
    script = (f"import os, signal, sys, time\nsys.argv = [{prog!r}, '--help']\nfrom {module} import main\n"
              "os.kill(os.getpid(), signal.SIGINT)\ntime.sleep(0.2)\nsys.exit(main())\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, (proc.returncode, proc.stderr)
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"{prog}: ") and "interrupted" in line, proc.stderr
    # Python's own handler first: a test run started in the background inherits SIGINT ignored
    library = (f"import os, signal, sys, time\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
               f"sys.argv = ['pytest']\nimport {module}\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(5)\n")
    proc = subprocess.run([sys.executable, "-c", library], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "KeyboardInterrupt" in proc.stderr     # Python's own Ctrl-C, untouched


@pytest.mark.parametrize("module,prog", [("kimistream.runtime.cli", "kimi-run"),
                                         ("kimistream.convert.cli", "kimi-convert"),
                                         ("kimistream.convert.verify_cli", "kimi-verify")])
def test_ctrl_c_from_the_projects_first_line(module, prog):
    """The console script's import of the command runs this project's first line (the package
    kimistream.formats, imported first by every command's package) long before the command's module:
    an interrupt right after that line, while the rest of the command is imported (argparse, enum,
    the command's own modules), is held from there and ends with the command's one line and 130.
    A library import of the package holds nothing."""
    import subprocess
    import sys
    script = (f"import os, sys\nsys.argv = ['/usr/local/bin/{prog}', '--help']\nimport kimistream.formats\n"
              "os.kill(os.getpid(), 2)\nimport signal, time\ntime.sleep(0.2)\n"
              f"from {module} import main\nsys.exit(main())\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, (proc.returncode, proc.stderr)
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"{prog}: ") and "interrupted" in line, proc.stderr
    library = ("import os, signal, sys, time\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
               "sys.argv = ['pytest']\nimport kimistream.formats\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(5)\n")
    proc = subprocess.run([sys.executable, "-c", library], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "KeyboardInterrupt" in proc.stderr     # Python's own Ctrl-C, untouched


def test_an_interrupted_convert_claims_no_partial_it_did_not_leave(tmp_path):
    """Ctrl-C before kimi-convert did anything (here: before it parsed its arguments) says only that
    it was interrupted (it had said "partial output kept as *.partial" whatever the moment, a dry run
    included); one during a conversion names the OUT.partial it left (test_fetch)."""
    import subprocess
    import sys
    script = (f"import os, signal, sys, time\nsys.argv = ['kimi-convert', {str(tmp_path)!r}, '-o', "
              f"{str(tmp_path / 'm.kst')!r}, '--dry-run']\nfrom kimistream.convert.cli import main\n"
              "os.kill(os.getpid(), signal.SIGINT)\ntime.sleep(0.2)\nsys.exit(main())\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130 and proc.stderr.strip() == "kimi-convert: error: interrupted", proc.stderr


@pytest.mark.parametrize("delay", [0.0, 0.01, 0.03, 0.06, 0.1, 0.2])
def test_ctrl_c_during_start_up(tiny_kst, delay):
    """Ctrl-C at any moment once kimi-run's own code runs (here: from the moment its kernels are
    loaded, through loading, planning and the first tokens) ends with one line, never a traceback or
    death by SIGINT: exit 130 "interrupted" during start-up, or the generation summary after it."""
    import signal
    import subprocess
    import time
    proc = subprocess.Popen([shutil.which("kimi-run"), "--weights", str(tiny_kst), "--prompt", "hello",
                             "--max-tokens", "400"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:      # our code is running once _qdot is mapped
        try:
            if "_qdot" in open(f"/proc/{proc.pid}/maps").read():
                break
        except OSError:
            pass
        time.sleep(0.002)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert "Traceback" not in err, err
    assert proc.returncode == 130, (proc.returncode, err)
    assert err.strip().splitlines()[-1] == "kimi-run: interrupted" or re.search(r"generated .*\(interrupted\)", err), err


def test_ctrl_c_during_generation_keeps_the_text_and_summary_and_exits_130(tiny_kst):
    """Ctrl-C while tokens stream: the text so far and the run's summary come out, then exit 130 (it
    exited 0, as if the run had ended by itself)."""
    import signal
    import subprocess
    proc = subprocess.Popen([shutil.which("kimi-run"), "--weights", str(tiny_kst), "--prompt", "hello",
                             "--max-tokens", "100000", "--max-context", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.read(1)                  # a token's text: generation is under way
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert first and proc.returncode == 130, (proc.returncode, err)
    assert "Traceback" not in err and "interrupted" in err, err
    assert re.search(r"generated .*\(interrupted\)", err), err       # the summary's row
