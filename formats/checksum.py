"""Checksums used inside the weight file: xxh3-64 per extent (fast enough to verify a 500 GB file
at disk speed) and xxh3-128 over the header."""

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
