"""Checksums: inside the weight file, xxh3-64 per extent (fast enough to verify a 500 GB file at disk
speed) and xxh3-128 over the header; for whole files (sources, downloads, releases), SHA-256 as the
hub and manifests give it, read in blocks."""

import hashlib
from pathlib import Path

import xxhash

EXTENT_ALGORITHM = "xxh3_64"
PLACEHOLDER = "0" * 16


def extent_digest(data) -> str:
    """Hex xxh3-64 of a bytes-like object (16 characters: fixed width, see writer)."""
    return xxhash.xxh3_64_hexdigest(data)


def header_digest(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


def new_extent_hasher():
    return xxhash.xxh3_64()


def sha256_file(path, on_bytes=None, chunk: int = 8 << 20, git: bool = False):
    """Hex SHA-256 of a file, read `chunk` bytes at a time (on_bytes(n) after each block); with
    git=True the pair (SHA-256, git blob id), computed in the same pass."""
    h = hashlib.sha256()
    g = hashlib.sha1(b"blob %d\0" % Path(path).stat().st_size) if git else None
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            if g is not None:
                g.update(block)
            if on_bytes:
                on_bytes(len(block))
    return (h.hexdigest(), g.hexdigest()) if git else h.hexdigest()
