"""The bundled default model: a small DeepseekV3 MoE trained in this repository (models/stdlib-moe),
converted once into a cache directory the first time `kimi-run` is called without --weights.

The runtime does not import the converter: it runs `kimi-convert` as a separate process."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from kimistream.formats.bundled_data import root
from kimistream.formats.checksum import sha256_file
from kimistream.formats.constants import VERSION
from kimistream.formats.weightfile import file_version

DEFAULT_MODEL = "stdlib-moe"


class BundledModelError(RuntimeError):
    pass


def cache_dir() -> Path:
    base = os.environ.get("KIMI_STREAM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kimi-stream")
    return Path(base)


def checkpoint_dir(name: str = DEFAULT_MODEL) -> Path:
    return root() / "models" / name


def manifest_path(name: str = DEFAULT_MODEL) -> Path:
    return root() / "checksums" / f"{name}.sha256"


def verify_checkpoint(name: str = DEFAULT_MODEL) -> str:
    """Check the bundled checkpoint against its manifest; returns the manifest's own hash."""
    src, man = checkpoint_dir(name), manifest_path(name)
    if not man.is_file():
        raise BundledModelError(f"{man}: manifest of the bundled model is missing")
    text = man.read_text()
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        digest, fname = line.split(None, 1)
        path = src / fname.lstrip("*").strip()
        if not path.is_file():
            raise BundledModelError(f"{path}: missing (bundled model incomplete)")
        if sha256_file(path, chunk=1 << 20) != digest:
            raise BundledModelError(f"{path}: SHA-256 does not match {man}")
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def default_weights(log) -> Path:
    """Path of the converted bundled model, converting it first if needed. The name carries the
    weight file's format version: after an upgrade that changes it the model is converted again, and
    the copies in older formats (which this build refuses to read) are removed."""
    tag = verify_checkpoint()
    out = cache_dir() / f"{DEFAULT_MODEL}-f32-v{VERSION}-{tag}.kst"
    if out.is_file():
        return out
    log(f"first run: converting the bundled model {checkpoint_dir()} → {out} (once)")
    out.parent.mkdir(parents=True, exist_ok=True)
    for old in out.parent.glob(f"{DEFAULT_MODEL}-f32-*.kst"):
        version = file_version(old)
        if version is not None and version < VERSION:
            old.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "kimistream.convert.cli", str(checkpoint_dir()), "-o", str(out),
           "--quant", "f32", "--quiet"]
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0 or not out.is_file():
        raise BundledModelError(f"converting the bundled model failed: {proc.stderr.strip()}")
    return out

