"""Checking a checkpoint directory or a converted weight file: what is there, what should be, and
whether the bytes are the ones expected. Produces one row per file (or per extent) with a status."""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from kimistream.formats.checksum import extent_digest
from kimistream.formats.constants import TOKENIZER_FILES
from kimistream.formats.safetensors import SafetensorsError, SafetensorsFile
from kimistream.formats.weightfile import WeightFile, WeightFileError

from .converter import MANIFEST_NAME
from .source import INDEX_FILE

OK, MISSING, CORRUPT, UNVERIFIABLE, EXTRA = "ok", "missing", "corrupt", "unverifiable", "extra"
EXIT_CODES = {MISSING: 3, CORRUPT: 4, UNVERIFIABLE: 5}   # checked in this order


@dataclass
class Row:
    file: str
    size: int | None
    expected: str
    actual: str
    status: str
    detail: str = ""


def exit_code(rows) -> int:
    statuses = {r.status for r in rows}
    for status, code in EXIT_CODES.items():
        if status in statuses:
            return code
    return 0


def read_manifest(path: Path) -> dict[str, str]:
    """sha256sum format: 'HEX  NAME' (or 'HEX *NAME'); '#' lines are comments."""
    out = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split(None, 1)
        if len(parts) != 2 or len(parts[0]) != 64:
            raise ValueError(f"{path}:{n}: not a sha256sum line")
        out[parts[1].strip().lstrip("*")] = parts[0].lower()
    return out


def write_manifest(path: Path, hashes: dict[str, str], comments=()) -> None:
    tmp = Path(str(path) + ".partial")
    lines = [f"# {c}" for c in comments] + [f"{h}  {n}" for n, h in sorted(hashes.items())]
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)


def sha256_file(path: Path, on_bytes=None, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            if on_bytes:
                on_bytes(len(block))
    return h.hexdigest()


def expected_files(directory: Path) -> list[str]:
    """The files a checkpoint directory must hold: config, index and every shard it names."""
    names = ["config.json"]
    idx = directory / INDEX_FILE
    if idx.is_file():
        names.append(INDEX_FILE)
        try:
            names += sorted(set(json.loads(idx.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
            pass
    else:
        names += sorted(p.name for p in directory.glob("*.safetensors"))
    return names + [n for n in TOKENIZER_FILES if (directory / n).is_file()]


def verify_directory(directory: Path, manifest: dict[str, str] | None, workers: int = 2, on_bytes=None):
    """Rows for every expected file (and every extra one); hashes computed in parallel."""
    directory = Path(directory)
    names = expected_files(directory)
    idx_ok = True
    if (directory / INDEX_FILE).is_file():
        try:
            json.loads((directory / INDEX_FILE).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
            idx_ok = False
    manifest = manifest or {}
    names += [n for n in manifest if n not in names]

    def check(name: str) -> Row:
        p = directory / name
        exp = manifest.get(name, "")
        if not p.is_file():
            return Row(name, None, exp, "", MISSING, "file not found")
        size = p.stat().st_size
        if name == INDEX_FILE and not idx_ok:
            return Row(name, size, exp, "", CORRUPT, "index is not valid JSON with a weight_map")
        if name.endswith(".safetensors"):
            try:
                SafetensorsFile(p).close()
            except SafetensorsError as e:
                return Row(name, size, exp, "", CORRUPT, str(e).removeprefix(f"{p}: "))
        actual = sha256_file(p, on_bytes)
        if not exp:
            return Row(name, size, "", actual, UNVERIFIABLE, "no expected hash")
        if actual != exp:
            return Row(name, size, exp, actual, CORRUPT, "SHA-256 mismatch")
        return Row(name, size, exp, actual, OK)

    with ThreadPoolExecutor(workers) as pool:
        rows = list(pool.map(check, names))
    known = set(names) | {MANIFEST_NAME}
    for p in sorted(directory.iterdir()):
        if p.is_file() and p.name not in known and not p.name.startswith("."):
            rows.append(Row(p.name, p.stat().st_size, "", "", EXTRA, "not part of the checkpoint"))
    return rows


def verify_weight_file(path: Path, workers: int = 2, on_bytes=None):
    """Rows: the header, then one per extent whose checksum does not match (or one 'ok' summary)."""
    try:
        wf = WeightFile(path)
    except WeightFileError as e:
        missing = not Path(path).exists()
        return [Row(str(path), None, "", "", MISSING if missing else CORRUPT, str(e).removeprefix(f"{path}: "))]
    rows = [Row(f"{Path(path).name} [header]", wf.size, "", wf.header_digest, OK)]

    def check(ext):
        good = wf.verify_extent(ext)
        if on_bytes:
            on_bytes(ext.nbytes)
        return ext, good

    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(check, wf.extents))
    bad = [(e, g) for e, g in results if not g]
    for ext, _ in bad:
        rows.append(Row(f"{Path(path).name} [{ext.name}]", ext.nbytes, ext.checksum,
                        extent_digest(wf.extent_bytes(ext)), CORRUPT, f"{ext.kind} extent checksum mismatch"))
    if not bad:
        rows.append(Row(f"{Path(path).name} [{len(results)} extents]", sum(e.nbytes for e in wf.extents),
                        "xxh3_64", "match", OK))
    wf.close()
    return rows


def rows_json(rows) -> list[dict]:
    return [asdict(r) for r in rows]
