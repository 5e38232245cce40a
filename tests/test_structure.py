"""The package's shape, as docs/DESIGN.md states it: data flows convert → formats ← runtime (runtime
never imports convert, convert never imports runtime, formats imports neither), formats/ holds the
on-disk contract and no encoder or worker pool, and runtime/model.py is only the model."""

import ast
from pathlib import Path

import pytest

import kimistream.convert
import kimistream.formats
import kimistream.runtime

DIRS = {name: Path(getattr(kimistream, name).__file__).resolve().parent for name in ("convert", "formats", "runtime")}


def _imports(path: Path, package_name: str) -> set[str]:
    """Absolute names of the kimistream modules a file imports (relative imports resolved)."""
    package = ["kimistream", package_name]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names}
    return {m for m in found if m.startswith("kimistream")}


@pytest.mark.parametrize("package,forbidden", [("runtime", ("kimistream.convert",)),
                                               ("convert", ("kimistream.runtime",)),
                                               ("formats", ("kimistream.convert", "kimistream.runtime"))])
def test_data_flows_one_way(package, forbidden):
    files = sorted(DIRS[package].glob("*.py"))
    assert files
    bad = {f.name: sorted(m for m in _imports(f, package) if m.startswith(forbidden)) for f in files}
    assert not {k: v for k, v in bad.items() if v}


def test_formats_holds_no_encoder_or_pool():
    for f in sorted(DIRS["formats"].glob("*.py")):
        text = f.read_text()
        assert "ThreadPoolExecutor" not in text and "def encode" not in text, f.name


def test_model_is_only_the_model():
    """No paging, observing or memory accounting in the forward pass: those go through the expert
    provider interface, module wrappers (calibration) and the weights' loader."""
    tree = ast.parse((DIRS["runtime"] / "model.py").read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for word in ("pager", "observer", "decoded_bytes", "keep_dense", "note_routed", "fetch_ahead", "prefetch"):
        assert not any(word in n for n in names), word


@pytest.mark.parametrize("entry", ["kimistream.runtime.cli", "kimistream.convert.cli"])
@pytest.mark.parametrize("given", [None, "12"])
def test_openblas_workers_stop_spinning_unless_the_user_says(entry, given):
    """Each command's package sets OPENBLAS_THREAD_TIMEOUT before numpy (and its OpenBLAS, which reads
    it once) loads, and leaves a value the user gave alone."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    if given:
        env["OPENBLAS_THREAD_TIMEOUT"] = given
    code = ("import os, sys\nseen = []\n"
            "class Watch:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'numpy' and not seen:\n"
            "            seen.append(os.environ.get('OPENBLAS_THREAD_TIMEOUT'))\n"
            "sys.meta_path.insert(0, Watch())\n"
            f"import {entry}\nimport numpy\nprint(seen[0])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [given or "4"]         # as numpy was first imported
