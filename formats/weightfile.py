"""The kimi-stream weight file: writer and reader (layout in SPEC.md).

The writer is given the whole layout up front (every extent and the tensors inside it), reserves the
header, lets the caller write tensors in any order, hashes each extent once its last tensor is in,
then writes the final header and renames the temporary file into place. The reader maps the file,
treats the header as untrusted input and checks every offset before anything is used.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import mmap
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import checksum, mapguard
from .config import ConfigError, ModelConfig
from .layout import model_shapes, split_kv_b_names
from .codecs import CodecError, get_codec
from .sizes import align_up
from .constants import (DEFAULT_ALIGNMENT, EXTENT_KINDS, MAGIC, MAX_ALIGNMENT, MAX_HEADER_BYTES,
                        PREFIX_SIZE, TENSOR_ALIGNMENT, TENSOR_CLASSES, VERSION)

_PREFIX = struct.Struct("<8sIIQQQQ16s")
assert _PREFIX.size == PREFIX_SIZE


class WeightFileError(ValueError):
    """A weight file is malformed, truncated, changed, or of an unknown version."""


class ResumeRefused(WeightFileError):
    """An interrupted write that must go on (its sources are partly gone) cannot: nothing was touched."""


def file_version(path) -> int | None:
    """The format version in a weight file's prefix, or None if `path` is not one (or unreadable):
    lets a cache tell a copy written by an older build from a broken file."""
    try:
        with open(path, "rb") as f:
            head = f.read(12)
    except OSError:
        return None
    if len(head) < 12 or head[:8] != MAGIC:
        return None
    return int.from_bytes(head[8:12], "little")


@dataclass
class TensorEntry:
    name: str
    cls: str
    codec: str
    shape: tuple
    offset: int = 0        # absolute offset in the file
    nbytes: int = 0
    extent: int = -1       # index into the extent list
    rel: int = 0           # offset inside the extent (writer only)

    def to_json(self):
        return {"class": self.cls, "codec": self.codec, "shape": list(self.shape),
                "extent": self.extent, "offset": self.offset, "nbytes": self.nbytes}


@dataclass
class Extent:
    name: str
    kind: str
    offset: int = 0
    nbytes: int = 0
    checksum: str = checksum.PLACEHOLDER
    tensors: list = field(default_factory=list)   # tensor names, in layout order

    def to_json(self):
        return {"name": self.name, "kind": self.kind, "offset": self.offset, "nbytes": self.nbytes,
                "checksum": self.checksum}


# --------------------------------------------------------------------------------------- writer

class WeightFileWriter:
    """Plan a layout, then fill it.

        w = WeightFileWriter(path)
        w.add_extent("layers.0", "resident", [(name, cls, codec, shape), ...])
        w.add_blob("tokenizer.json", data)
        w.begin(meta)                      # meta: config, tokenizer, plan, source ...
        w.write_tensor(name, encoded)      # any order
        w.finish()                         # hashes, header, atomic rename
    """

    def __init__(self, path, alignment: int = DEFAULT_ALIGNMENT):
        if alignment < 4096 or alignment > MAX_ALIGNMENT or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two in 4096..{MAX_ALIGNMENT}")
        self.path = Path(path)
        self.tmp_path = self.path.with_name(self.path.name + ".partial")
        self.alignment = alignment
        self.extents: list[Extent] = []
        self._extent_index: dict[str, int] = {}     # name -> position (files with 60 000+ extents)
        self.tensors: dict[str, TensorEntry] = {}
        self._blobs: dict[str, bytes] = {}
        self._pending: list[int] = []
        self._file = None
        self._header_len = 0
        self.meta: dict = {}

    # -- planning
    def add_extent(self, name: str, kind: str, tensors) -> Extent:
        assert kind in EXTENT_KINDS, kind
        ext = Extent(name, kind)
        idx = len(self.extents)
        size = 0
        for tname, cls, codec, shape in tensors:
            if tname in self.tensors:
                raise ValueError(f"tensor {tname} placed twice")
            nb = get_codec(codec).nbytes(shape)
            size = align_up(size, TENSOR_ALIGNMENT)
            self.tensors[tname] = TensorEntry(tname, cls, codec, tuple(int(s) for s in shape),
                                              nbytes=nb, extent=idx, rel=size)
            ext.tensors.append(tname)
            size += nb
        ext.nbytes = size
        self._extent_index[name] = idx
        self.extents.append(ext)
        return ext

    def add_blob(self, name: str, data: bytes) -> None:
        ext = self.add_extent(f"blob:{name}", "blob", [])
        ext.nbytes = len(data)
        self._blobs[ext.name] = bytes(data)

    def _header_bytes(self) -> bytes:
        header = dict(self.meta)
        header.update(format="kimi-stream", version=VERSION, alignment=self.alignment,
                      checksum=checksum.EXTENT_ALGORITHM,
                      extents=[e.to_json() for e in self.extents],
                      tensors={n: t.to_json() for n, t in self.tensors.items()})
        return json.dumps(header, separators=(",", ":"), sort_keys=False).encode()

    # -- filling
    @property
    def journal_path(self) -> Path:
        return self.tmp_path.with_name(self.tmp_path.name + ".journal")

    def journaled_meta(self) -> dict | None:
        """The meta of an interrupted write of this file, if its journal survives."""
        try:
            with open(self.journal_path) as f:
                return json.loads(f.readline())["meta"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def journaled_notes(self, key: str) -> list[dict]:
        """The records of an interrupted write's journal that carry `key` (see `note`)."""
        try:
            lines = self.journal_path.read_text().splitlines()[1:]
        except (OSError, UnicodeDecodeError):
            return []
        out = []
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                break                          # a torn last line
            if isinstance(rec, dict) and key in rec:
                out.append(rec)
        return out

    def note(self, rec: dict) -> None:
        """Journal a caller's record durably (fsync) before the caller acts on it, e.g. deletes the
        source a tensor came from. Resuming ignores such records; `journaled_notes` reads them."""
        self._log(rec)
        os.fsync(self._journal.fileno())

    def begin(self, meta: dict, resume: bool = True, require_resume: bool = False) -> int:
        """Lay out the file and open `NAME.partial`. With `resume`, an interrupted write of the same
        layout (same header before checksums) continues: its journal says which tensors and extent
        checksums are done. Returns the number of tensors already written. With `require_resume`
        (its sources are partly gone), a write that cannot go on raises ResumeRefused before the
        .partial and its journal are touched."""
        self.meta = meta
        # Offsets and checksums are fixed-width in the JSON, so a header written with placeholder
        # values has the same length as the final one: lay out extents after a provisional header.
        data_start = align_up(PREFIX_SIZE + len(self._header_bytes()), self.alignment)
        while True:
            pos = data_start
            for e in self.extents:
                e.offset = pos
                pos = align_up(pos + e.nbytes, self.alignment)
            for t in self.tensors.values():
                t.offset = self.extents[t.extent].offset + t.rel
            self._header_len = len(self._header_bytes())
            if PREFIX_SIZE + self._header_len <= data_start:
                break
            data_start = align_up(PREFIX_SIZE + self._header_len, self.alignment)
        self._data_start = data_start
        self._file_size = pos
        self._pending = [len(e.tensors) for e in self.extents]
        self._written: set[str] = set()
        self._zero_digests: dict[int, str] = {}
        fingerprint = hashlib.sha256(self._header_bytes()).hexdigest()
        self.tmp_path.parent.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        resumed = resume and self._resume(fingerprint)
        if require_resume and not resumed:
            raise ResumeRefused(f"{self.tmp_path}: its journal is for another layout of the file")
        if not resumed:
            self._file = open(self.tmp_path, "w+b")
            self._file.truncate(self._file_size)
            self._journal = open(self.journal_path, "w")
            self._log({"fingerprint": fingerprint, "meta": meta})
        for ext in self.extents:
            if not ext.tensors and ext.name not in self._blobs:
                ext.checksum = checksum.extent_digest(b"")
        for name, data in self._blobs.items():
            ext = self.extents[self._extent_index[name]]
            self._file.seek(ext.offset)
            self._file.write(data)
            ext.checksum = checksum.extent_digest(data)
        return len(self._written)

    @property
    def lock_path(self) -> Path:
        return self.path.with_name(self.path.name + ".lock")

    def _take_lock(self) -> None:
        """One writer per output: a second conversion to the same file (which would interleave
        writes into one .partial) is refused while the first runs. The kernel drops the lock when
        its holder exits, however it exits."""
        self._lock_fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise WeightFileError(f"{self.path}: another conversion is writing this file (lock {self.lock_path})") from None

    def _drop_lock(self) -> None:
        fd = getattr(self, "_lock_fd", None)
        if fd is not None:
            self.lock_path.unlink(missing_ok=True)
            os.close(fd)
            self._lock_fd = None

    def _resume(self, fingerprint: str) -> bool:
        try:
            lines = self.journal_path.read_text().splitlines()
            if json.loads(lines[0]).get("fingerprint") != fingerprint:
                return False
            if self.tmp_path.stat().st_size != self._file_size:
                return False
        except (OSError, ValueError, IndexError, AttributeError):
            return False
        index = {e.name: i for i, e in enumerate(self.extents)}
        extent_sums = {}
        with open(self.tmp_path, "rb") as part:
            for line in lines[1:]:
                try:
                    rec = json.loads(line)
                except ValueError:
                    break                      # a torn last line: everything before it holds
                name = rec.get("t") if isinstance(rec, dict) else None
                if name in self.tensors and name not in self._written:
                    # kept only if the .partial still holds the bytes the journal vouches for
                    t = self.tensors[name]
                    if rec.get("c") == checksum.extent_digest(os.pread(part.fileno(), t.nbytes, t.offset)):
                        self._written.add(name)
                        self._pending[t.extent] -= 1
                elif isinstance(rec, dict) and rec.get("e") in index:
                    extent_sums[index[rec["e"]]] = rec.get("c")
        for i, c in extent_sums.items():
            if not self._pending[i] and isinstance(c, str):
                self.extents[i].checksum = c
        self._file = open(self.tmp_path, "r+b")
        self._zero_gaps()
        self._journal = open(self.journal_path, "a")
        for ext, pending in zip(self.extents, self._pending):
            # Interrupted between an extent's last tensor and its checksum line: hash it now.
            if ext.tensors and not pending and ext.checksum == checksum.PLACEHOLDER:
                self._hash_extent(ext)
        return True

    def _zero_gaps(self) -> None:
        """Zeros over the bytes of a resumed .partial that no tensor or blob holds (alignment padding,
        between extents and inside them): no checksum vouches for them, and the finished file must be
        the bytes an uninterrupted write gives."""
        held = sorted([(t.offset, t.offset + t.nbytes) for t in self.tensors.values()] +
                      [(e.offset, e.offset + e.nbytes) for e in self.extents if e.name in self._blobs])
        pos = self._data_start
        for start, end in held + [(self._file_size, self._file_size)]:
            if start > pos:
                os.pwrite(self._file.fileno(), bytes(start - pos), pos)
            pos = max(pos, end)

    def _log(self, rec: dict) -> None:
        self._journal.write(json.dumps(rec, separators=(",", ":")) + "\n")
        self._journal.flush()

    def is_written(self, name: str) -> bool:
        return name in self._written

    def write_tensor(self, name: str, encoded) -> None:
        t = self.tensors[name]
        if name in self._written:
            raise WeightFileError(f"{self.tmp_path}: tensor {name} written twice")
        self._written.add(name)
        buf = memoryview(np.ascontiguousarray(encoded)).cast("B")
        if buf.nbytes != t.nbytes:
            raise CodecError(f"{name}: encoded {buf.nbytes} bytes, layout expects {t.nbytes}")
        self._file.seek(t.offset)
        self._file.write(buf)
        self._file.flush()
        os.fdatasync(self._file.fileno())     # on disk before the journal says so
        self._log({"t": name, "c": checksum.extent_digest(buf)})
        self._pending[t.extent] -= 1
        if self._pending[t.extent] == 0:
            self._hash_extent(self.extents[t.extent])
            self._log({"e": self.extents[t.extent].name, "c": self.extents[t.extent].checksum})

    def leave_hole(self, extent_name: str) -> None:
        """Leave an extent unwritten: a sparse hole that reads as zeros (synthetic models far larger
        than the disk). Its checksum is that of its zero bytes, so verification still holds."""
        idx = self._extent_index[extent_name]
        ext = self.extents[idx]
        for name in ext.tensors:
            if name in self._written:
                raise WeightFileError(f"{self.tmp_path}: extent {extent_name} is partly written")
            self._written.add(name)
        self._pending[idx] = 0
        if ext.nbytes not in self._zero_digests:
            h = checksum.new_extent_hasher()
            zeros = bytes(min(ext.nbytes, 16 << 20))
            left = ext.nbytes
            while left:
                h.update(zeros[:min(left, len(zeros))])
                left -= min(left, len(zeros))
            self._zero_digests[ext.nbytes] = h.hexdigest()
        ext.checksum = self._zero_digests[ext.nbytes]
        for name in ext.tensors:
            self._log({"t": name})
        self._log({"e": ext.name, "c": ext.checksum})

    def _hash_extent(self, ext: Extent) -> None:
        self._file.flush()
        h = checksum.new_extent_hasher()
        remaining, pos = ext.nbytes, ext.offset
        while remaining:
            n = min(remaining, 16 << 20)
            chunk = os.pread(self._file.fileno(), n, pos)
            h.update(chunk)
            remaining -= len(chunk)
            pos += len(chunk)
        ext.checksum = h.hexdigest()

    def finish(self) -> Path:
        unwritten = [e.name for e, p in zip(self.extents, self._pending) if p]
        if unwritten:
            raise WeightFileError(f"{self.tmp_path}: {len(unwritten)} extent(s) never written, e.g. {unwritten[0]}")
        header = self._header_bytes()
        assert len(header) == self._header_len, "header length changed between begin and finish"
        prefix = _PREFIX.pack(MAGIC, VERSION, self.alignment, PREFIX_SIZE, len(header), self._data_start,
                              self._file_size, checksum.header_digest(header))
        self._file.seek(0)
        self._file.write(prefix + header)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        os.replace(self.tmp_path, self.path)
        self._journal.close()
        self.journal_path.unlink(missing_ok=True)
        self._drop_lock()
        return self.path

    def abort(self) -> None:
        """Stop writing; NAME.partial and its journal stay so that a later run resumes."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if getattr(self, "_journal", None) is not None:
            self._journal.close()
        self._drop_lock()


# --------------------------------------------------------------------------------------- reader

class WeightFile:
    """A read-only, memory-mapped weight file whose header has been validated."""

    def __init__(self, path):
        self.path = Path(path)
        try:
            # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer
            self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as e:
            raise WeightFileError(f"{self.path}: cannot open: {e.strerror}") from None
        try:
            st = os.fstat(self._fd)
            if not stat.S_ISREG(st.st_mode):
                raise WeightFileError(f"{self.path}: not a regular file")
            self.size = st.st_size
            self._parse_prefix_and_header()
            self.mm = mmap.mmap(self._fd, self.size, access=mmap.ACCESS_READ) if self.size else None
            if self.mm is not None:
                mapguard.watch(self.path)
        except Exception:
            os.close(self._fd)
            raise

    def _fail(self, msg: str):
        raise WeightFileError(f"{self.path}: {msg}")

    def _parse_prefix_and_header(self) -> None:
        raw = os.pread(self._fd, PREFIX_SIZE, 0)
        if len(raw) < PREFIX_SIZE:
            self._fail(f"too short to be a kimi-stream weight file ({self.size} bytes)")
        magic, version, alignment, hoff, hlen, data_start, file_size, hdigest = _PREFIX.unpack(raw)
        if magic != MAGIC:
            self._fail(f"not a kimi-stream weight file (magic {magic!r})")
        if 0 < version < VERSION:
            self._fail(f"written by an older kimi-stream (format version {version}; this build reads {VERSION}): "
                       f"re-convert it with kimi-convert")
        if version != VERSION:
            self._fail(f"unsupported format version {version} (this build reads version {VERSION})")
        if alignment < 4096 or alignment > MAX_ALIGNMENT or alignment & (alignment - 1):
            self._fail(f"invalid alignment {alignment}")
        if hoff != PREFIX_SIZE or hlen > MAX_HEADER_BYTES or hoff + hlen > data_start or data_start % alignment:
            self._fail(f"invalid header placement (offset {hoff}, length {hlen}, data at {data_start})")
        if file_size != self.size:
            what = "truncated" if self.size < file_size else "longer than written"
            self._fail(f"{what}: {self.size} bytes on disk, header says {file_size}")
        header = os.pread(self._fd, hlen, hoff)
        if len(header) != hlen or checksum.header_digest(header) != hdigest:
            self._fail("header checksum mismatch (file changed or corrupted since it was written)")
        try:
            self.header = json.loads(header)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            self._fail(f"header is not valid JSON: {type(e).__name__}")
        self.alignment = alignment
        self.data_start = data_start
        self.header_digest = hdigest.hex()
        self._validate_directory()

    def _validate_directory(self) -> None:
        h = self.header
        if not isinstance(h, dict) or h.get("format") != "kimi-stream":
            self._fail("header does not describe a kimi-stream file")
        exts, tens = h.get("extents"), h.get("tensors")
        if not isinstance(exts, list) or not isinstance(tens, dict):
            self._fail("header lacks the extent list or tensor directory")
        self.extents: list[Extent] = []
        for i, e in enumerate(exts):
            try:
                ext = Extent(str(e["name"]), e["kind"], _int(e["offset"]), _int(e["nbytes"]), str(e["checksum"]))
            except (KeyError, TypeError, ValueError):
                self._fail(f"extent #{i} is malformed")
            if ext.nbytes < 0:
                self._fail(f"extent {ext.name}: negative size {ext.nbytes}")
            if ext.kind not in EXTENT_KINDS:
                self._fail(f"extent {ext.name}: unknown kind {ext.kind!r}")
            if ext.offset < self.data_start or ext.offset % self.alignment or ext.nbytes < 0:
                self._fail(f"extent {ext.name}: offset {ext.offset} is not an aligned data offset")
            if ext.offset + ext.nbytes > self.size:
                self._fail(f"extent {ext.name}: bytes {ext.offset}..{ext.offset + ext.nbytes} lie past the "
                           f"end of the file ({self.size} bytes)")
            self.extents.append(ext)
        order = sorted(self.extents, key=lambda x: x.offset)
        for a, b in zip(order, order[1:]):
            if a.offset + a.nbytes > b.offset:
                self._fail(f"extents {a.name} and {b.name} overlap")
        self.extent_by_name = {e.name: e for e in self.extents}
        self.tensors: dict[str, TensorEntry] = {}
        sizes = {}      # (codec, shape) -> bytes: Kimi K2's 70 000 tensors have a handful of shapes
        for name, t in tens.items():
            try:
                if not isinstance(t["codec"], str) or not isinstance(t["shape"], list):
                    raise TypeError
                ent = TensorEntry(name, t["class"], t["codec"], tuple(_int(s) for s in t["shape"]),
                                  _int(t["offset"]), _int(t["nbytes"]), _int(t["extent"]))
            except (KeyError, TypeError, ValueError):
                self._fail(f"tensor {name}: malformed directory entry")
            if any(s < 0 for s in ent.shape):
                self._fail(f"tensor {name}: negative dimension in shape {list(ent.shape)}")
            if ent.cls not in TENSOR_CLASSES:
                self._fail(f"tensor {name}: unknown class {ent.cls!r}")
            expected = sizes.get((ent.codec, ent.shape))
            if expected is None:
                try:
                    expected = sizes[ent.codec, ent.shape] = get_codec(ent.codec).nbytes(ent.shape)
                except CodecError as e:
                    self._fail(f"tensor {name}: {e}")
            if ent.nbytes != expected:
                self._fail(f"tensor {name}: {ent.nbytes} bytes recorded, codec {ent.codec} of shape "
                           f"{list(ent.shape)} needs {expected}")
            if not 0 <= ent.extent < len(self.extents):
                self._fail(f"tensor {name}: extent index {ent.extent} out of range")
            ext = self.extents[ent.extent]
            if ent.offset < ext.offset or ent.offset + ent.nbytes > ext.offset + ext.nbytes:
                self._fail(f"tensor {name}: bytes lie outside its extent {ext.name}")
            ext.tensors.append(name)
            self.tensors[name] = ent

    # -- access
    @property
    def meta(self) -> dict:
        return self.header

    def raw(self, name: str) -> np.ndarray:
        """Zero-copy uint8 view of a tensor's bytes in the mapping."""
        t = self.tensors[name]
        return np.frombuffer(self.mm, dtype=np.uint8, count=t.nbytes, offset=t.offset)

    def decode(self, name: str) -> np.ndarray:
        """Reference decode of a whole tensor to float32 (zero-copy for f32)."""
        t = self.tensors[name]
        return get_codec(t.codec).decode(self.raw(name), t.shape)

    def extent_bytes(self, ext: Extent) -> np.ndarray:
        return np.frombuffer(self.mm, dtype=np.uint8, count=ext.nbytes, offset=ext.offset)

    def blob(self, name: str) -> bytes:
        ext = self.extent_by_name.get(f"blob:{name}")
        if ext is None:
            raise KeyError(name)
        return bytes(self.extent_bytes(ext))

    def verify_extent(self, ext: Extent) -> bool:
        return checksum.extent_digest(self.extent_bytes(ext)) == ext.checksum

    def close(self) -> None:
        if self.mm is not None:
            try:
                self.mm.close()
                mapguard.unwatch(self.path)
            except BufferError:
                pass   # numpy views still alive; the mapping (and its watch) goes when they do
            self.mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def fileno(self) -> int:
        return self._fd

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _int(v) -> int:
    """Header integers must be JSON integers: no floats, strings, booleans or Infinity."""
    if type(v) is not int:
        raise TypeError(f"not an integer: {v!r}")
    return v


def check_model(wf: WeightFile) -> ModelConfig:
    """A weight file as a model: its header's documents are what the runtime needs, and its config
    agrees with the tensor directory (every tensor the config implies is there, with that shape).
    The container checks of WeightFile come first; kimi-run and kimi-verify both call this."""
    h = wf.header
    if not isinstance(h.get("config"), dict):
        wf._fail("the header's config is not an object")
    try:
        cfg = ModelConfig.from_dict(h["config"])
    except ConfigError as e:
        wf._fail(f"the header's config: {e}")
    for key in ("tokenizer", "plan"):
        if key in h and not isinstance(h[key], dict):
            wf._fail(f"the header's {key} is not an object")
    split = cfg.num_hidden_layers > 0 and split_kv_b_names(0)[0] in wf.tensors
    for name, shape in model_shapes(cfg, split).items():
        t = wf.tensors.get(name)
        if t is None:
            wf._fail(f"tensor {name}, which the header's config requires, is not in the file")
        if tuple(t.shape) != tuple(shape):
            wf._fail(f"tensor {name} has shape {list(t.shape)}, the header's config implies {list(shape)}")
    return cfg
