"""kimi-convert --ray: a conversion encoded on a Ray cluster (two workers, started here on 127.0.0.1)
is byte for byte the single-process one, for both bundled models at q2 with an importance matrix and
second moments; a worker killed in the middle of the run has its task run again and the file is still
the same; a bad address is one line. Skipped, saying why, only where Ray is not installed or cannot
start."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[test,cluster,serve]')")

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"stdlib-moe": "stdlib-heldout.txt", "manpages-moe": "manpages-heldout.txt"}


def run(*args, check=True):
    proc = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=900)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def convert(*args, check=True):
    return run("-m", "kimistream.convert.cli", *args, "--quiet", check=check)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A Ray head on 127.0.0.1 with two CPUs: two workers run tasks side by side."""
    exe = shutil.which("ray", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if exe is None:
        pytest.skip("the ray command is not on PATH")
    port = free_port()
    tmp = tmp_path_factory.mktemp("ray")
    # a test cluster on loopback: no token (Ray 2.5x enables token auth unless told otherwise, and a
    # driver finds the token only when the same mode is set on its side)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    start = subprocess.run([exe, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                            "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats",
                            f"--temp-dir={tmp}"], capture_output=True, text=True, env=env, timeout=180)
    if start.returncode:
        pytest.skip(f"Ray cannot start here: {start.stderr.strip().splitlines()[-1:]}")
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([exe, "stop", "--force"], capture_output=True, env=env, timeout=180)


@pytest.fixture(scope="module")
def imatrices(tmp_path_factory):
    """Each bundled model's importance matrix with second moments, from a slice of its held-out text."""
    d = tmp_path_factory.mktemp("imx")
    out = {}
    for model, text in MODELS.items():
        ref = d / f"{model}-f32.kst"
        convert(ROOT / "models" / model, "-o", ref, "--quant", "f32")
        sample = d / f"{model}.txt"
        sample.write_text((ROOT / "data" / text).read_text()[:6000])
        out[model] = d / f"{model}.npz"
        run("-m", "kimistream.runtime.cli", "--weights", ref, "--calibration", sample, "--imatrix-out", out[model],
            "--max-context", 256, "--quiet")
    return out


@pytest.fixture(scope="module")
def local_q2(imatrices, tmp_path_factory):
    """Each bundled model converted at q2 with its importance matrix, in one process."""
    d = tmp_path_factory.mktemp("local")
    out = {}
    for model in MODELS:
        out[model] = d / f"{model}-q2.kst"
        convert(ROOT / "models" / model, "-o", out[model], "--quant", "q2", "--imatrix", imatrices[model])
    return out


def _ray_workers_running_tasks() -> list[int]:
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if b"_encode_task" in (p / "cmdline").read_bytes():
                    pids.append(int(p.name))
            except OSError:
                pass
    return pids


@pytest.mark.parametrize("model", sorted(MODELS))
def test_ray_conversion_is_byte_identical(cluster, imatrices, local_q2, tmp_path, model):
    remote = tmp_path / "ray.kst"
    convert(ROOT / "models" / model, "-o", remote, "--quant", "q2", "--imatrix", imatrices[model], "--ray", cluster)
    assert local_q2[model].read_bytes() == remote.read_bytes()


def test_an_interrupted_ray_conversion_resumes_to_the_same_file(cluster, imatrices, local_q2, tmp_path):
    out = tmp_path / "ray.kst"
    journal = Path(str(out) + ".partial.journal")
    cmd = [sys.executable, "-m", "kimistream.convert.cli", ROOT / "models" / "manpages-moe", "-o", out, "--quant", "q2",
           "--imatrix", imatrices["manpages-moe"], "--ray", cluster, "--quiet"]
    proc = subprocess.Popen(list(map(str, cmd)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if journal.exists() and journal.read_text().count("\n") >= 8:      # some tensors written, not all
            proc.kill()
            break
        time.sleep(0.02)
    proc.wait()
    assert not out.exists() and journal.exists(), "the conversion ended before it could be interrupted"
    convert(*cmd[3:-1])
    assert local_q2["manpages-moe"].read_bytes() == out.read_bytes()


def test_a_killed_worker_has_its_task_run_again(cluster, imatrices, local_q2, tmp_path):
    src = ROOT / "models" / "stdlib-moe"
    local, remote = local_q2["stdlib-moe"], tmp_path / "ray.kst"
    killed = []
    done = threading.Event()

    def killer():
        while not done.is_set() and not killed:
            for pid in _ray_workers_running_tasks():
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    continue
                break
            time.sleep(0.05)
    t = threading.Thread(target=killer)
    t.start()
    try:
        convert(src, "-o", remote, "--quant", "q2", "--imatrix", imatrices["stdlib-moe"], "--ray", cluster)
    finally:
        done.set()
        t.join()
    assert killed, "no worker was seen running a task"
    assert local.read_bytes() == remote.read_bytes()


def test_bad_cluster_address_is_one_line(tmp_path):
    proc = convert(ROOT / "models" / "stdlib-moe", "-o", tmp_path / "m.kst", "--quant", "q2", "--calibration", "none",
                   "--ray", f"127.0.0.1:{free_port()}", check=False)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--ray 127.0.0.1" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not list(tmp_path.iterdir())         # not even an empty .partial and its journal


def test_a_tensor_a_worker_cannot_encode_is_one_line(cluster, tmp_path):
    """An error inside a Ray task (here a NaN in a source tensor) reaches the user as the same one-line
    error a local conversion gives, naming the file and the tensor; no output is left behind."""
    from safetensors.torch import load_file, save_file      # the checkpoint is bf16, which numpy lacks
    src = tmp_path / "src"
    shutil.copytree(ROOT / "models" / "stdlib-moe", src)
    tensors = load_file(src / "model.safetensors")
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    tensors[name][2, 5] = float("nan")
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    local = convert(src, "-o", tmp_path / "local.kst", "--quant", "q2", "--calibration", "none", check=False)
    remote = convert(src, "-o", tmp_path / "ray.kst", "--quant", "q2", "--calibration", "none", "--ray", cluster,
                     check=False)
    assert local.returncode != 0 and remote.returncode == local.returncode
    lines = remote.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in remote.stderr, remote.stderr
    assert lines == local.stderr.strip().splitlines()
    assert name in lines[0] and "model.safetensors" in lines[0] and "NaN" in lines[0]
    assert not (tmp_path / "ray.kst").exists()


def test_a_gguf_source_converts_on_ray_to_the_same_file(cluster, tmp_path):
    """Workers open a GGUF source themselves (the same path on every node): --ray writes the file a
    local conversion writes, byte for byte, for kept Q8_0 blocks and for a requantizing preset."""
    import gguf

    from ggufmodels import write_gguf
    src = write_gguf(ROOT / "models" / "stdlib-moe", tmp_path / "m.gguf", gguf.GGMLQuantizationType.Q8_0)
    for quant in ("keep", "q2"):
        local, remote = tmp_path / f"local-{quant}.kst", tmp_path / f"ray-{quant}.kst"
        flags = ["--quant", quant] + (["--calibration", "none"] if quant == "q2" else [])
        convert(src, "-o", local, *flags)
        convert(src, "-o", remote, *flags, "--ray", cluster)
        assert local.read_bytes() == remote.read_bytes(), quant
