"""Publishing a converted weight file as a release others can fetch piece by piece: the file is cut
into chunks (a few GB by default), each zstd-compressed, with a manifest giving every chunk's raw and
compressed size and SHA-256 and the whole file's SHA-256. `assemble` rebuilds the file from a
release directory, checking every hash, and resumes: chunks already in place are verified, not
decompressed again."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import zstandard

from kimistream.formats.checksum import sha256_file

RELEASE_SUFFIX = ".release.json"
SUMS_NAME = "SHA256SUMS"
DEFAULT_CHUNK = 2 << 30
READ_BLOCK = 16 << 20


class PublishError(ValueError):
    pass


def _chunk_name(name: str, i: int) -> str:
    return f"{name}.part{i:04d}.zst"


def publish(path, outdir, chunk_bytes: int = DEFAULT_CHUNK, level: int = 3, progress=None, check=None) -> dict:
    """Cut `path` into zstd chunks with a manifest in `outdir`. The release is built in a hidden
    folder inside `outdir` and moved into place only once complete, so an interrupted or failed
    publish leaves a release already there as it was; the new one then replaces it, and chunks of the
    previous release of the same file (NAME.partNNNN.zst, and .partial ones of an interrupted run) not
    in the new manifest are removed. Nothing else in `outdir` is touched. `check`: an object whose
    feed(block) sees every byte of the file in order and whose finish() runs before the release is
    moved into place; either may raise to stop the publish (e.g. verify.ExtentChecker)."""
    path, outdir = Path(path), Path(outdir)
    if chunk_bytes < READ_BLOCK:
        raise PublishError(f"chunk size must be at least {READ_BLOCK} bytes")
    outdir.mkdir(parents=True, exist_ok=True)
    problem = other_release(outdir, path.name)
    if problem:
        raise PublishError(problem)
    stage = outdir / f".{path.name}.publishing"
    _remove_stage(stage)                       # left by a publish that was killed
    stage.mkdir()
    try:
        manifest = _build(path, stage, chunk_bytes, level, progress, check)
        if check is not None:
            check.finish()
        _swap_in(stage, outdir, path.name, manifest)
    finally:
        _remove_stage(stage)
    return manifest


def other_release(outdir, name: str) -> str | None:
    """Why `name` cannot be published into `outdir`: it holds another file's release (assembly takes
    the one *.release.json of a directory, and SHA256SUMS lists one release)."""
    outdir = Path(outdir)
    others = sorted(p.name for p in outdir.glob("*" + RELEASE_SUFFIX) if p.name != name + RELEASE_SUFFIX) \
        if outdir.is_dir() else []
    if others:
        return (f"{outdir}: holds the release of another file ({others[0]}); a release directory holds one "
                f"file's release: publish {name} into a directory of its own")
    return None


def _build(path: Path, stage: Path, chunk_bytes: int, level: int, progress, check) -> dict:
    size = path.stat().st_size
    whole = hashlib.sha256()
    chunks = []
    cctx = zstandard.ZstdCompressor(level=level, threads=-1)
    with open(path, "rb") as src:
        i = 0
        while src.tell() < size:
            start = src.tell()
            name = _chunk_name(path.name, i)
            raw_h, comp_h = hashlib.sha256(), hashlib.sha256()
            raw_n = 0
            with open(stage / name, "wb") as f:
                with cctx.stream_writer(_Hashing(f, comp_h), closefd=False) as z:
                    while raw_n < chunk_bytes:
                        block = src.read(min(READ_BLOCK, chunk_bytes - raw_n, size - src.tell()))
                        if not block:
                            break
                        if check is not None:
                            check.feed(block)
                        raw_h.update(block)
                        whole.update(block)
                        z.write(block)
                        raw_n += len(block)
                        if progress:
                            progress(len(block))
            if raw_n == 0:                     # the file shrank while it was read
                raise PublishError(f"{path}: ended at {start:,} bytes while being read, {size:,} expected")
            chunks.append({"file": name, "offset": start, "size": raw_n, "sha256": raw_h.hexdigest(),
                           "compressed_size": (stage / name).stat().st_size, "compressed_sha256": comp_h.hexdigest()})
            i += 1
    manifest = {"file": path.name, "size": size, "sha256": whole.hexdigest(), "compression": f"zstd-{level}",
                "chunks": chunks,
                "compression_ratio": round(size / max(1, sum(c["compressed_size"] for c in chunks)), 4)}
    mpath = stage / (path.name + RELEASE_SUFFIX)
    mpath.write_text(json.dumps(manifest, indent=1))
    (stage / SUMS_NAME).write_text("".join(f"{c['compressed_sha256']}  {c['file']}\n" for c in chunks)
                                   + f"{hashlib.sha256(mpath.read_bytes()).hexdigest()}  {mpath.name}\n")
    return manifest


def _swap_in(stage: Path, outdir: Path, name: str, manifest: dict) -> None:
    """Move a complete release from `stage` into `outdir`: the old manifest goes first (a directory
    caught half-way holds no manifest, never one that does not describe its chunks), then the new
    chunks, manifest and SHA256SUMS, then the old release's chunks the new one does not have."""
    mname = name + RELEASE_SUFFIX
    (outdir / mname).unlink(missing_ok=True)
    keep = {c["file"] for c in manifest["chunks"]}
    for c in manifest["chunks"]:
        os.replace(stage / c["file"], outdir / c["file"])
    os.replace(stage / mname, outdir / mname)
    os.replace(stage / SUMS_NAME, outdir / SUMS_NAME)
    for p in stale_chunks(outdir, name, keep):
        p.unlink(missing_ok=True)


def stale_chunks(outdir: Path, name: str, keep) -> list[Path]:
    """Chunk files of a release of `name` in `outdir` (NAME.partNNNN.zst, or .partial) not in `keep`."""
    pattern = re.compile(re.escape(name) + r"\.part\d{4,}\.zst(\.partial)?")
    return sorted(p for p in outdir.iterdir()
                  if pattern.fullmatch(p.name) and p.name not in keep and (p.is_symlink() or p.is_file()))


def _remove_stage(stage: Path) -> None:
    if stage.is_symlink() or stage.is_file():
        stage.unlink()
    elif stage.is_dir():
        shutil.rmtree(stage)


class _Hashing:
    """A file wrapper that hashes what is written through it."""

    def __init__(self, f, h):
        self.f, self.h = f, h

    def write(self, b):
        self.h.update(b)
        return self.f.write(b)

    def flush(self):
        self.f.flush()


_HEX64 = re.compile(r"[0-9a-fA-F]{64}")


def load_manifest(path) -> dict:
    """A *.release.json, every key assembly uses checked (types, ranges, plain file names, chunks that
    cover the file end to end) before any byte is written; PublishError naming the file otherwise."""
    path = Path(path)
    try:
        m = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise PublishError(f"{path}: not a release manifest ({e})") from None
    problem = _manifest_problem(m)
    if problem:
        raise PublishError(f"{path}: not a release manifest ({problem})")
    return m


def _manifest_problem(m) -> str | None:
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    def name_problem(v, what):
        if not isinstance(v, str) or not v:
            return f"{what} must be a file name"
        if v in (".", "..") or any(c in v for c in "/\\\0") or Path(v).name != v:
            return f"{what} {v!r}: file names must not contain directories"
        return None

    if not isinstance(m, dict):
        return "not a JSON object"
    for key in ("file", "size", "sha256", "chunks"):
        if key not in m:
            return f"no {key!r}"
    if (problem := name_problem(m["file"], "'file'")):
        return problem
    if not is_int(m["size"]) or m["size"] < 0:
        return f"'size' must be a non-negative integer, not {m['size']!r}"
    if not isinstance(m["sha256"], str) or not _HEX64.fullmatch(m["sha256"]):
        return "'sha256' must be 64 hex digits"
    m["sha256"] = m["sha256"].lower()
    if not isinstance(m["chunks"], list):
        return "'chunks' must be a list"
    end, seen = 0, set()
    for i, c in enumerate(m["chunks"]):
        where = f"chunk {i}"
        if not isinstance(c, dict):
            return f"{where} is not a JSON object"
        for key in ("file", "offset", "size", "sha256", "compressed_sha256"):
            if key not in c:
                return f"{where} has no {key!r}"
        if (problem := name_problem(c["file"], f"{where} 'file'")):
            return problem
        if c["file"] in seen or c["file"] == m["file"]:
            return f"{where}: file {c['file']!r} is named twice"
        seen.add(c["file"])
        for key in ("offset", "size") + (("compressed_size",) if "compressed_size" in c else ()):
            if not is_int(c[key]) or c[key] < 0:
                return f"{where} '{key}' must be a non-negative integer, not {c[key]!r}"
        for key in ("sha256", "compressed_sha256"):
            if not isinstance(c[key], str) or not _HEX64.fullmatch(c[key]):
                return f"{where} '{key}' must be 64 hex digits"
            c[key] = c[key].lower()
        if c["offset"] != end:
            return f"{where} starts at byte {c['offset']}, the chunks before it end at {end}"
        end += c["size"]
    if end != m["size"]:
        return f"the chunks hold {end} bytes, 'size' says {m['size']}"
    return None


def find_manifest(release_dir) -> tuple[Path, dict]:
    """The one *.release.json of a release directory, loaded and checked."""
    release_dir = Path(release_dir)
    found = sorted(release_dir.glob("*" + RELEASE_SUFFIX))
    if len(found) != 1:
        raise PublishError(f"{release_dir}: expected one *{RELEASE_SUFFIX} manifest, found {len(found)}")
    return found[0], load_manifest(found[0])


ASSEMBLING = ".assembling"        # an assembly's output until every chunk is in and checked


def assemble(release_dir, out=None, progress=None) -> Path:
    """Rebuild the published file from `release_dir` (its *.release.json and chunks)."""
    release_dir = Path(release_dir)
    _, m = find_manifest(release_dir)
    out = Path(out) if out else release_dir / m["file"]
    out.parent.mkdir(parents=True, exist_ok=True)      # as a conversion's output does
    # not OUT.partial: a conversion to the same OUT keeps its resumable output under that name
    tmp = out.with_name(out.name + ASSEMBLING)
    mode = "r+b" if tmp.exists() and tmp.stat().st_size == m["size"] else "w+b"
    dctx = zstandard.ZstdDecompressor()
    with open(tmp, mode) as f:
        f.truncate(m["size"])
        for c in m["chunks"]:
            if mode == "r+b" and _region_sha256(f, c["offset"], c["size"]) == c["sha256"]:
                if progress:
                    progress(c["size"])
                continue                                   # already assembled by an earlier run
            part = release_dir / c["file"]
            if not part.is_file():
                raise PublishError(f"{part}: chunk missing")
            if _file_sha256(part) != c["compressed_sha256"]:
                raise PublishError(f"{part}: SHA-256 of the compressed chunk does not match the manifest")
            f.seek(c["offset"])
            h, n = hashlib.sha256(), 0
            with open(part, "rb") as src, dctx.stream_reader(src) as z:
                while block := z.read(READ_BLOCK):
                    h.update(block)
                    f.write(block)
                    n += len(block)
                    if progress:
                        progress(len(block))
            if n != c["size"] or h.hexdigest() != c["sha256"]:
                raise PublishError(f"{part}: decompressed bytes do not match the manifest")
        f.flush()
        f.seek(0)
        whole = hashlib.sha256()
        while block := f.read(READ_BLOCK):
            whole.update(block)
    if whole.hexdigest() != m["sha256"]:
        raise PublishError(f"{tmp}: SHA-256 of the assembled file does not match the manifest")
    os.replace(tmp, out)
    return out


def _region_sha256(f, offset: int, size: int) -> str:
    h = hashlib.sha256()
    f.seek(offset)
    left = size
    while left:
        block = f.read(min(READ_BLOCK, left))
        if not block:
            break
        h.update(block)
        left -= len(block)
    return h.hexdigest()


def _file_sha256(path: Path) -> str:
    return sha256_file(path, chunk=READ_BLOCK)
