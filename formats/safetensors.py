"""Reading safetensors files without torch: parse the header, map the file, and turn one tensor at a
time into float32. BF16 is a 16-bit shift, F8_E4M3 a 256-entry table — both exact.

Format: 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets:
[begin, end]}, "__metadata__": {...}}, then the data buffer that the offsets index into."""

from __future__ import annotations

import json
import math
import mmap
import os
import stat
import struct
from pathlib import Path

import numpy as np

from . import mapguard

MAX_HEADER = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    pass


def _e4m3fn_table() -> np.ndarray:
    """float32 value of every FP8 E4M3FN byte (bias 7, no infinities, S.1111.111 is NaN)."""
    table = np.empty(256, dtype=np.float32)
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        exp, man = (b >> 3) & 0xF, b & 0x7
        if exp == 0xF and man == 0x7:
            table[b] = np.nan
        elif exp == 0:
            table[b] = sign * man * 2.0 ** -9          # subnormal: man/8 * 2^-6
        else:
            table[b] = sign * (1 + man / 8.0) * 2.0 ** (exp - 7)
    return table


E4M3_TABLE = _e4m3fn_table()

_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "I64": 8, "I32": 4, "I16": 2,
             "I8": 1, "U8": 1, "BOOL": 1}


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class SafetensorsFile:
    """One .safetensors file: header parsed and checked; tensors read lazily."""

    def __init__(self, path):
        self.path = Path(path)
        self._mm = None
        try:
            st = self.path.stat()
            if not stat.S_ISREG(st.st_mode):
                self._fail("not a regular file")      # a FIFO or a device would block or never end
            self.size = st.st_size
            with open(self.path, "rb") as f:
                raw = f.read(8)
                if len(raw) < 8:
                    self._fail(f"too short for a safetensors file ({self.size} bytes)")
                (n,) = struct.unpack("<Q", raw)
                if n > MAX_HEADER or 8 + n > self.size:
                    self._fail(f"header length {n} does not fit in the file ({self.size} bytes)")
                try:
                    header = json.loads(f.read(n))
                except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
                    self._fail(f"header is not valid JSON ({e})")
        except OSError as e:
            raise SafetensorsError(f"{self.path}: cannot read: {e.strerror}") from None
        if not isinstance(header, dict):
            self._fail("header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        if not isinstance(self.metadata, dict) or not all(isinstance(v, str) for v in self.metadata.values()):
            self._fail("__metadata__ is not an object of strings")
        self.data_start = 8 + n
        self.entries: dict[str, dict] = {}
        for name, e in header.items():
            dtype = e.get("dtype") if isinstance(e, dict) else None
            shape = e.get("shape") if isinstance(e, dict) else None
            offs = e.get("data_offsets") if isinstance(e, dict) else None
            if (not isinstance(dtype, str) or not isinstance(shape, list) or not all(_is_count(d) for d in shape)
                    or not isinstance(offs, list) or len(offs) != 2 or not all(_is_count(o) for o in offs)):
                self._fail(f"tensor {name}: malformed header entry (dtype, shape of non-negative integers, "
                           f"data_offsets [begin, end])")
            if dtype not in _ITEMSIZE:
                self._fail(f"tensor {name}: unsupported dtype {dtype}")
            b, end = offs
            expect = math.prod(shape) * _ITEMSIZE[dtype]
            if end < b or end - b != expect:
                self._fail(f"tensor {name}: data_offsets [{b}, {end}] do not match {dtype}{shape} ({expect} bytes)")
            if self.data_start + end > self.size:
                self._fail(f"tensor {name}: data ends at byte {self.data_start + end}, past the end of the "
                           f"file ({self.size} bytes) — truncated download?")
            self.entries[name] = {"dtype": dtype, "shape": shape, "begin": b, "end": end}
        # As the format requires (and the safetensors library checks): the tensors tile the data
        # buffer exactly, in offset order, with no overlap, gap or trailing bytes.
        at = 0
        for name, e in sorted(self.entries.items(), key=lambda kv: (kv[1]["begin"], kv[1]["end"])):
            if e["begin"] != at:
                what = "overlaps the tensor before it" if e["begin"] < at else f"leaves a gap after byte {at}"
                self._fail(f"tensor {name}: data_offsets [{e['begin']}, {e['end']}] {what}")
            at = e["end"]
        if self.data_start + at != self.size:
            self._fail(f"the tensors cover {at} bytes of data but the file holds {self.size - self.data_start}")
        self._mm = None

    def _fail(self, msg):
        raise SafetensorsError(f"{self.path}: {msg}")

    def keys(self):
        return self.entries.keys()

    def _map(self):
        if self._mm is None:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            mapguard.watch(self.path)
        return self._mm

    def raw(self, name: str) -> np.ndarray:
        e = self.entries[name]
        return np.frombuffer(self._map(), dtype=np.uint8, count=e["end"] - e["begin"],
                             offset=self.data_start + e["begin"])

    def read(self, name: str) -> np.ndarray:
        """The tensor as a new float32 array (exact for every float dtype)."""
        e = self.entries[name]
        raw, shape, dt = self.raw(name), e["shape"], e["dtype"]
        if dt == "F32":
            out = raw.view("<f4").copy()
        elif dt == "F16":
            out = raw.view("<f2").astype(np.float32)
        elif dt == "BF16":
            out = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
        elif dt == "F8_E4M3":
            out = E4M3_TABLE[raw]
        elif dt == "F64":
            out = raw.view("<f8").astype(np.float32)
        else:
            out = raw.view({"I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1",
                            "BOOL": "u1"}[dt]).astype(np.float32)
        self._release(e)
        return out.reshape(shape)

    def _release(self, e) -> None:
        """Drop the source pages just copied from this process's RSS, so converting a shard of any
        size holds about one tensor (the page cache keeps them if memory allows)."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = (self.data_start + e["begin"]) // mmap.PAGESIZE * mmap.PAGESIZE
        end = self.data_start + e["end"]
        if end > start:
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self):
        if self._mm is not None:
            try:
                self._mm.close()
                mapguard.unwatch(self.path)
            except BufferError:
                pass               # numpy views still alive: the mapping (and its watch) stays with them
            self._mm = None

    def __del__(self):
        self.close()


def write_safetensors(path, tensors: dict, metadata: dict | None = None) -> None:
    """Minimal writer (F32/F16/BF16-as-uint16 via explicit dtype) used by tests and tools.

    `tensors` maps name -> (dtype_string, numpy array of matching itemsize)."""
    header, offset, blobs = {}, 0, []
    for name, (dtype, arr) in tensors.items():
        data = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    if metadata:
        header["__metadata__"] = metadata
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    tmp = str(path) + ".partial"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)
