"""A clear exit when a memory-mapped file fails under us. Reading a mapped page that no longer exists
(the file was truncated by another program while in use) or that the disk cannot return raises SIGBUS,
which would end the process with no message. Every reader that maps a file registers it here; on such
a fault the process prints one line naming the mapped files and exits with status 1 (the handler is in
_mapguard.c)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from . import _mapguard

_watched: dict[str, int] = {}


def _update() -> None:
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "kimi-stream"
    names = ", ".join(sorted(_watched)) or "(none)"
    _mapguard.set_message(
        f"{prog}: error: a memory-mapped file could not be read (truncated or replaced while in use, or a "
        f"disk error): {names}; check it with kimi-verify\n".encode("utf-8", "replace"))


def watch(path) -> None:
    """A mapping of `path` is now in use."""
    key = str(Path(path))
    _watched[key] = _watched.get(key, 0) + 1
    _update()


def unwatch(path) -> None:
    """One mapping of `path` is gone."""
    key = str(Path(path))
    if _watched.get(key, 0) > 1:
        _watched[key] -= 1
    else:
        _watched.pop(key, None)
    _update()
