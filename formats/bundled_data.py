"""Where the files shipped with kimi-stream live: the bundled models (`models/`), their SHA-256
manifests and the hub manifests (`checksums/`), and held-out text (`data/`). In a source tree (and
an editable install) they sit at its top level; a wheel carries them as package data of
kimistream.formats, found through importlib.resources, so the commands work from any directory."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

PACKAGED = "bundled"          # kimistream/formats/bundled/{models,checksums,data} in a wheel


def root() -> Path:
    packaged = Path(str(resources.files("kimistream.formats").joinpath(PACKAGED)))
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent
