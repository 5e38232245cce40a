"""A non-editable install works from any directory: the wheel built from this tree carries the C
kernels, the bundled model, its manifest and the held-out text (kimistream/formats/bundled/), and
the default command run from elsewhere finds them through importlib.resources, converts the bundled
model once and generates."""

import subprocess
import sys
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_wheel_runs_the_default_command_from_another_directory(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(REPO)], check=True, capture_output=True, timeout=600)
    (wheel,) = wheels.glob("kimi_stream-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=True)   # dependencies from this environment
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True,
                   capture_output=True, timeout=600)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"PATH": f"{env_dir / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "KIMI_STREAM_CACHE": str(tmp_path / "cache")}
    where = subprocess.run([str(py), "-c", "import kimistream.formats.bundled_data as b, kimistream.runtime._qdot as q; "
                            "print(b.root()); print(q.__file__)"], cwd=elsewhere, env=env, capture_output=True,
                           text=True, check=True)
    assert str(env_dir) in where.stdout and str(REPO) not in where.stdout      # the installed copy, not this tree
    proc = subprocess.run([str(env_dir / "bin" / "kimi-run"), "--prompt", "def read_config(path):",
                           "--max-tokens", "4", "--json"], cwd=elsewhere, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert '"tokens"' in proc.stdout
    # and kimi-verify checks the bundled checkpoint the wheel carries, against the checksums it carries
    bundled = where.stdout.splitlines()[0]
    proc = subprocess.run([str(env_dir / "bin" / "kimi-verify"), f"{bundled}/models/stdlib-moe", "--json"],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert '"ok": true' in proc.stdout
