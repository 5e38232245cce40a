"""Every command in the README's `sh` blocks runs as written and exits 0: from the repository's root
(here: a scratch directory that links the root's `models`, `data` and `tests/data`, so outputs land
outside the checkout), one line at a time. A leading `pip install ... &&` is what this test
environment already did; the README's own test command is not run from inside the tests."""

import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEST_COMMAND = "python -m pytest -q"


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            line = re.sub(r"^pip install [^&]*&&\s*", "", line)
            if line != TEST_COMMAND:
                commands.append(line)
    return commands


def test_readme_has_runnable_commands():
    cmds = readme_commands()
    assert any(c.startswith("kimi-run --plan-config") and "8.24G" in c for c in cmds)
    assert any(c.startswith("kimi-convert") for c in cmds) and any(c.startswith("kimi-verify") for c in cmds)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("readme")
    for name in ("models", "data"):
        (d / name).symlink_to(ROOT / name)
    (d / "tests").mkdir()
    (d / "tests" / "data").symlink_to(ROOT / "tests" / "data")
    return d


def test_readme_commands_run_as_written(workdir):
    for cmd in readme_commands():
        proc = subprocess.run(["bash", "-c", cmd], cwd=workdir, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{cmd}\n{proc.stderr[-2000:]}"
        assert "Traceback" not in proc.stderr, cmd
        assert shlex.split(cmd)                       # a command, not prose
