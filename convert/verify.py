"""Checking a checkpoint directory or a converted weight file: what is there, what should be, and
whether the bytes are the ones expected (SHA-256 from a manifest, or the hub's sizes, LFS SHA-256 and
git blob ids), including the source hashes a weight file records. One row per file (or extent)."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from kimistream.formats.checksum import extent_digest, new_extent_hasher, sha256_file
from kimistream.formats.constants import TOKENIZER_FILES
from kimistream.formats.safetensors import SafetensorsError, SafetensorsFile
from kimistream.formats.weightfile import WeightFile, WeightFileError, check_model

from .converter import MANIFEST_NAME
from .source import INDEX_FILE, SourceError, read_index, shard_name_problem

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
    sha256: str = ""          # the file's SHA-256 when it was computed


def exit_code(rows) -> int:
    statuses = {r.status for r in rows}
    for status, code in EXIT_CODES.items():
        if status in statuses:
            return code
    return 0


HEX64_RE = re.compile(r"^[0-9a-fA-F]{64}$")


def manifest_name(name: str) -> str:
    """A manifest's file name as a checkpoint directory's: `sha256sum ./*` writes './NAME'."""
    while name.startswith("./"):
        name = name[2:].lstrip("/")
    return name


def read_manifest(path: Path) -> dict[str, str]:
    """sha256sum format: 'HEX  NAME' (or 'HEX *NAME', './NAME' as `sha256sum ./*` writes it, and
    sha256sum's '\\HEX  NAME' lines whose NAME escapes a backslash or newline); '#' lines are
    comments. A name listed twice with different hashes is an error."""
    out = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        escaped = line.startswith("\\")
        parts = line[escaped:].split(None, 1)
        if len(parts) != 2 or not HEX64_RE.match(parts[0]):
            raise ValueError(f"{path}:{n}: not a sha256sum line")
        name = parts[1].strip()
        name = name[1:] if name.startswith("*") else name
        if escaped:
            name = re.sub(r"\\(.)", lambda m: {"n": "\n", "r": "\r"}.get(m.group(1), m.group(1)), name)
        name, sha = manifest_name(name), parts[0].lower()
        if out.get(name, sha) != sha:
            raise ValueError(f"{path}:{n}: {name} is listed twice with different SHA-256")
        out[name] = sha
    return out


META_RE = re.compile(r"^#\s*([a-z][a-z_-]*):\s*(.*?)\s*$")


def read_manifest_meta(path: Path) -> dict[str, str]:
    """The '# key: value' comment lines of a manifest (kimi-stream writes '# repo:' and '# revision:')."""
    out = {}
    for line in Path(path).read_text().splitlines():
        m = META_RE.match(line)
        if m:
            out.setdefault(m.group(1), m.group(2))
    return out


def write_manifest(path: Path, hashes: dict[str, str], comments=()) -> None:
    tmp = Path(str(path) + ".partial")
    lines = [f"# {c}" for c in comments] + [_manifest_line(h, n) for n, h in sorted(hashes.items())]
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)


def _manifest_line(sha: str, name: str) -> str:
    if "\\" in name or "\n" in name:            # as sha256sum writes such a name
        return "\\" + f"{sha}  " + name.replace("\\", "\\\\").replace("\n", "\\n")
    return f"{sha}  {name}"


def expected_files(directory: Path) -> list[str]:
    """The files a checkpoint directory must hold: config, index and every shard it names."""
    names = ["config.json"]
    idx = directory / INDEX_FILE
    if idx.is_file():
        names.append(INDEX_FILE)
        try:
            names += sorted(set(read_index(idx).values()))
        except SourceError:
            pass                       # reported on the index's own row
    else:
        names += sorted(p.name for p in directory.glob("*.safetensors"))
    return names + [n for n in TOKENIZER_FILES if (directory / n).is_file()]


def verify_directory(directory: Path, manifest: dict[str, str] | None, workers: int = 2, on_bytes=None,
                     sizes: dict[str, int] | None = None, git_blobs: dict[str, str] | None = None,
                     more_sha256: dict[str, str] | None = None, more_from: str = ""):
    """Rows for every expected file (and every extra one); hashes computed in parallel. `manifest`:
    expected SHA-256 by name; `sizes` and `git_blobs` (git blob ids): what a hub listing says;
    `more_sha256`: SHA-256 from a second source (`more_from`, e.g. a --manifest given with --hub) that
    a file must match as well."""
    directory = Path(directory)
    sizes, git_blobs, more = sizes or {}, git_blobs or {}, more_sha256 or {}
    names = expected_files(directory)
    idx_problem = None
    if (directory / INDEX_FILE).is_file():
        try:
            read_index(directory / INDEX_FILE)
        except SourceError as e:
            idx_problem = str(e).removeprefix(f"{directory / INDEX_FILE}: ")
    manifest = manifest or {}
    for extra in (manifest, sizes, git_blobs, more):
        names += [n for n in extra if n not in names]

    def check(name: str) -> Row:
        exp = manifest.get(name, "") or more.get(name, "")
        problem = shard_name_problem(name)
        if problem:                    # a name from a manifest or listing: never read outside the directory
            return Row(name, None, exp, "", CORRUPT, f"file name {problem}")
        p = directory / name
        blob = git_blobs.get(name, "")
        if not p.is_file():
            return Row(name, None, exp or blob, "", MISSING, "file not found")
        size = p.stat().st_size
        if name in sizes and size != sizes[name]:
            kind = "truncated" if size < sizes[name] else "too long"
            return Row(name, size, exp or blob, "", CORRUPT, f"{kind}: {size:,} bytes, expected {sizes[name]:,}")
        if name == INDEX_FILE and idx_problem:
            return Row(name, size, exp, "", CORRUPT, idx_problem)
        if name.endswith(".safetensors"):
            try:
                SafetensorsFile(p).close()
            except SafetensorsError as e:
                return Row(name, size, exp, "", CORRUPT, str(e).removeprefix(f"{p}: "))
        actual, git = sha256_file(p, on_bytes, git=True)
        if not exp and not blob:
            return Row(name, size, "", actual, UNVERIFIABLE, "no expected hash", actual)
        if exp and actual != exp:
            return Row(name, size, exp, actual, CORRUPT, "SHA-256 mismatch", actual)
        if more.get(name, actual) != actual:
            return Row(name, size, more[name], actual, CORRUPT,
                       f"SHA-256 mismatch ({more_from or 'second manifest'})", actual)
        if blob and git != blob:
            return Row(name, size, blob, git, CORRUPT, "git blob id mismatch (hub listing)", actual)
        if exp:
            return Row(name, size, exp, actual, OK, "", actual)
        return Row(name, size, blob, git, OK, "git blob id matches", actual)

    with ThreadPoolExecutor(workers) as pool:
        rows = list(pool.map(check, names))
    known = set(names) | {MANIFEST_NAME}
    for p in sorted(directory.iterdir()):
        if p.is_file() and p.name not in known and not p.name.startswith("."):
            rows.append(Row(p.name, p.stat().st_size, "", "", EXTRA, "not part of the checkpoint"))
    return rows


def verify_weight_file(path: Path, workers: int = 2, on_bytes=None, sources: dict[str, str] | None = None,
                       sources_from: str = "", more_sources=()):
    """Rows: the header, then one per extent whose checksum does not match (or one 'ok' summary), then
    the recorded source files: well-formed, and (given `sources`, expected SHA-256 by name, e.g. from a
    manifest or a hub listing) the very files expected; `more_sources`: further (expected, from)
    pairs the recorded sources are checked against as well (a --manifest given with --hub)."""
    try:
        wf = WeightFile(path)
    except WeightFileError as e:
        missing = not Path(path).exists()
        return [Row(str(path), None, "", "", MISSING if missing else CORRUPT, str(e).removeprefix(f"{path}: "))]
    try:
        check_model(wf)                # the header as a model, not only as a container
    except WeightFileError as e:
        wf.close()
        return [Row(str(path), wf.size, "", "", CORRUPT, str(e).removeprefix(f"{path}: "))]
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
    rows += _source_rows(Path(path).name, wf.header.get("source"), sources, sources_from)
    for more, more_from in more_sources:
        rows += _source_rows(Path(path).name, wf.header.get("source"), more, more_from)
    wf.close()
    return rows


class ExtentChecker:
    """A weight file's extent checksums checked from its bytes as they are read, in order from the
    start (as publishing reads them: one pass over the file): `feed(block)` raises WeightFileError at
    the end of the first extent whose bytes do not match, `finish()` once the whole file was fed."""

    def __init__(self, path: Path, extents):
        self.path = Path(path)
        self.todo = sorted(extents, key=lambda e: e.offset)
        self.i, self.pos = 0, 0
        self.h = new_extent_hasher()
        self.checked = 0

    def feed(self, block) -> None:
        start, end = self.pos, self.pos + len(block)
        self.pos = end
        view = memoryview(block)
        while self.i < len(self.todo):
            e = self.todo[self.i]
            a, b = max(start, e.offset), min(end, e.offset + e.nbytes)
            if a < b:
                self.h.update(view[a - start:b - start])
            if e.offset + e.nbytes > end:
                break
            if self.h.hexdigest() != e.checksum:
                raise WeightFileError(f"{self.path}: extent {e.name} ({e.kind}) checksum mismatch: the weight "
                                      f"file is damaged (kimi-verify {self.path} lists every damaged extent)")
            self.h.reset()
            self.i += 1
            self.checked += 1

    def finish(self) -> None:
        if self.i < len(self.todo):
            e = self.todo[self.i]
            raise WeightFileError(f"{self.path}: extent {e.name} was not read to its end ({self.pos:,} bytes "
                                  f"read): the file changed while it was read")


def verify_gguf(path: Path, expected: dict[str, str] | None, on_bytes=None) -> list[Row]:
    """Rows for a llama.cpp GGUF file (each of a split one): readable, a deepseek2 model whose
    tensors lie inside the file with the sizes their types imply, whose config and tokenizer can be
    rebuilt and whose tensors have the shapes that config implies (as a conversion checks them); then
    its SHA-256 against `expected` (by file name, e.g. from --manifest)."""
    from kimistream.formats.gguffile import GGUFError, GGUFModel, shard_paths
    path = Path(path)
    try:
        paths = shard_paths(path)
    except GGUFError as e:
        return [Row(str(path), None, "", "", MISSING, str(e).removeprefix(f"{path}: "))]
    from kimistream.formats.config import ConfigError, ModelConfig
    from kimistream.formats.layout import model_shapes
    try:
        model = GGUFModel(path)
        try:
            cfg = ModelConfig.from_hf(model.config)       # what a conversion rebuilds, checked the same way
            shapes = model_shapes(cfg)
            missing = [n for n in shapes if not model.has(n)]
            if missing:
                raise GGUFError(f"{path}: lacks {len(missing)} tensor(s) its metadata requires, e.g. {missing[0]}")
            for n, shape in shapes.items():
                if tuple(model.shape(n)) != tuple(shape):
                    raise GGUFError(f"{path}: tensor {n} has shape {list(model.shape(n))}, its metadata implies "
                                    f"{list(shape)}")
            model.tokenizer_files()
        finally:
            model.close()
    except ConfigError as e:
        return [Row(str(path), path.stat().st_size, "", "", CORRUPT, f"metadata: {e}")]
    except GGUFError as e:
        return [Row(str(path), path.stat().st_size, "", "", CORRUPT, str(e).removeprefix(f"{path}: "))]
    rows = []
    for p in paths:
        actual = sha256_file(p, on_bytes)
        exp = (expected or {}).get(p.name, "")
        status = OK if exp and actual == exp else CORRUPT if exp else UNVERIFIABLE
        detail = {OK: "", CORRUPT: "SHA-256 mismatch", UNVERIFIABLE: "structure ok; no expected hash"}[status]
        rows.append(Row(str(p), p.stat().st_size, exp, actual, status, detail, actual))
    return rows


def _source_rows(fname: str, record, expected: dict[str, str] | None, expected_from: str) -> list[Row]:
    label = f"{fname} [sources]"
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, dict) or not files or not all(
            isinstance(v, dict) and isinstance(v.get("sha256"), str) and len(v["sha256"]) == 64
            and isinstance(v.get("size"), int) for v in files.values()):
        return [Row(label, None, "", "", UNVERIFIABLE, "no well-formed record of the source files")]
    if expected is None:
        return [Row(label, sum(v["size"] for v in files.values()), "", f"{len(files)} files", OK,
                    f"{len(files)} source files recorded with SHA-256")]
    rows = []
    for name, v in sorted(files.items()):
        exp = expected.get(name)
        if exp is None:
            continue
        if v["sha256"] != exp:
            rows.append(Row(f"{fname} [source {name}]", v["size"], exp, v["sha256"], CORRUPT,
                            f"built from a different {name} than {expected_from}"))
    compared = sum(1 for n in files if n in expected)
    if not compared:
        return [Row(label, None, "", "", UNVERIFIABLE, f"no recorded source file is listed in {expected_from}")]
    if not rows:
        rows.append(Row(label, sum(v["size"] for v in files.values()), expected_from, "match", OK,
                        f"{compared} of {len(files)} source files match {expected_from}"))
    return rows


def rows_json(rows) -> list[dict]:
    return [asdict(r) for r in rows]
