"""Publishing a converted weight file as a release others can fetch piece by piece: the file is cut
into chunks (a few GB by default), each zstd-compressed, with a manifest giving every chunk's raw and
compressed size and SHA-256 and the whole file's SHA-256. `assemble` rebuilds the file from a
release directory, checking every hash, and resumes: chunks already in place are verified, not
decompressed again."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import zstandard

from kimistream.formats.checksum import sha256_file

RELEASE_SUFFIX = ".release.json"
DEFAULT_CHUNK = 2 << 30
READ_BLOCK = 16 << 20


class PublishError(ValueError):
    pass


def _chunk_name(name: str, i: int) -> str:
    return f"{name}.part{i:04d}.zst"


def publish(path, outdir, chunk_bytes: int = DEFAULT_CHUNK, level: int = 3, progress=None) -> dict:
    path, outdir = Path(path), Path(outdir)
    if chunk_bytes < READ_BLOCK:
        raise PublishError(f"chunk size must be at least {READ_BLOCK} bytes")
    outdir.mkdir(parents=True, exist_ok=True)
    size = path.stat().st_size
    whole = hashlib.sha256()
    chunks = []
    cctx = zstandard.ZstdCompressor(level=level, threads=-1)
    with open(path, "rb") as src:
        i = 0
        while src.tell() < size:
            start = src.tell()
            name = _chunk_name(path.name, i)
            tmp = outdir / (name + ".partial")
            raw_h, comp_h = hashlib.sha256(), hashlib.sha256()
            raw_n = 0
            with open(tmp, "wb") as f:
                with cctx.stream_writer(_Hashing(f, comp_h), closefd=False) as z:
                    while raw_n < chunk_bytes:
                        block = src.read(min(READ_BLOCK, chunk_bytes - raw_n))
                        if not block:
                            break
                        raw_h.update(block)
                        whole.update(block)
                        z.write(block)
                        raw_n += len(block)
                        if progress:
                            progress(len(block))
            os.replace(tmp, outdir / name)
            chunks.append({"file": name, "offset": start, "size": raw_n, "sha256": raw_h.hexdigest(),
                           "compressed_size": (outdir / name).stat().st_size, "compressed_sha256": comp_h.hexdigest()})
            i += 1
    manifest = {"file": path.name, "size": size, "sha256": whole.hexdigest(), "compression": f"zstd-{level}",
                "chunks": chunks,
                "compression_ratio": round(size / max(1, sum(c["compressed_size"] for c in chunks)), 4)}
    mpath = outdir / (path.name + RELEASE_SUFFIX)
    tmp = mpath.with_name(mpath.name + ".partial")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, mpath)
    sums = outdir / "SHA256SUMS"
    sums.write_text("".join(f"{c['compressed_sha256']}  {c['file']}\n" for c in chunks)
                    + f"{hashlib.sha256(mpath.read_bytes()).hexdigest()}  {mpath.name}\n")
    return manifest


class _Hashing:
    """A file wrapper that hashes what is written through it."""

    def __init__(self, f, h):
        self.f, self.h = f, h

    def write(self, b):
        self.h.update(b)
        return self.f.write(b)

    def flush(self):
        self.f.flush()


def load_manifest(path) -> dict:
    path = Path(path)
    try:
        m = json.loads(path.read_text())
        for c in m["chunks"]:
            for k in ("file", "offset", "size", "sha256", "compressed_sha256"):
                c[k]
        if Path(m["file"]).name != m["file"] or any(Path(c["file"]).name != c["file"] for c in m["chunks"]):
            raise PublishError(f"{path}: file names must not contain directories")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PublishError(f"{path}: not a release manifest ({e})") from None
    return m


ASSEMBLING = ".assembling"        # an assembly's output until every chunk is in and checked


def assemble(release_dir, out=None, progress=None) -> Path:
    """Rebuild the published file from `release_dir` (its *.release.json and chunks)."""
    release_dir = Path(release_dir)
    found = sorted(release_dir.glob("*" + RELEASE_SUFFIX))
    if len(found) != 1:
        raise PublishError(f"{release_dir}: expected one *{RELEASE_SUFFIX} manifest, found {len(found)}")
    m = load_manifest(found[0])
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
