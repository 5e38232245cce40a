"""The runtime's view of a weight file: the memory map, the resident set (touched once at start and
kept), the embedding table (rows gathered on demand) and routed experts (touched only when a token
is routed to them). Expert accesses are counted here."""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

from kimistream.formats.codecs import get_codec
from kimistream.formats.config import ModelConfig
from kimistream.formats.constants import EXTENT_EXPERT, EXTENT_RESIDENT
from kimistream.formats.layout import EXPERT_PROJS, expert_extent, expert_tensor
from kimistream.formats.weightfile import WeightFile

PAGE = mmap.PAGESIZE


@dataclass
class Weight:
    """A 2-D weight in some codec; `dense()` gives float32 [out, in] (a zero-copy view for f32)."""
    name: str
    codec: str
    shape: tuple
    raw: np.ndarray
    _dense: np.ndarray | None = None

    def dense(self) -> np.ndarray:
        if self._dense is not None:
            return self._dense
        return get_codec(self.codec).decode(self.raw, self.shape)

    def keep_dense(self) -> int:
        """Decode once and keep (resident non-f32 weights); returns the extra bytes held."""
        if self.codec == "f32":
            self._dense = self.dense()
            return 0
        self._dense = np.ascontiguousarray(self.dense())
        return self._dense.nbytes


class ModelWeights:
    def __init__(self, path):
        self.file = WeightFile(path)
        self.header = self.file.header
        self.config = ModelConfig.from_dict(self.header["config"])
        self.experts_touched: set[tuple[int, int]] = set()
        self.expert_bytes_touched = 0
        self._expert_cache: dict[tuple[int, int], tuple[Weight, Weight, Weight]] = {}
        self.resident_bytes = 0
        self.decoded_bytes = 0
        self._advise_experts_random()

    def _advise_experts_random(self) -> None:
        # Default readahead pulls megabytes around every fault in a randomly-accessed expert region;
        # MADV_RANDOM limits each fault to its page (see DESIGN 5b).
        exps = [e for e in self.file.extents if e.kind == EXTENT_EXPERT]
        if exps and hasattr(mmap, "MADV_RANDOM"):
            lo = min(e.offset for e in exps) // PAGE * PAGE
            hi = max(e.offset + e.nbytes for e in exps)
            self.file.mm.madvise(mmap.MADV_RANDOM, lo, hi - lo)

    def load_resident(self) -> int:
        """Fault in every resident extent (WILLNEED, then touch each page); returns bytes."""
        total = 0
        for ext in self.file.extents:
            if ext.kind != EXTENT_RESIDENT or not ext.nbytes:
                continue
            if hasattr(mmap, "MADV_WILLNEED"):
                self.file.mm.madvise(mmap.MADV_WILLNEED, ext.offset, ext.nbytes)
            view = self.file.extent_bytes(ext)
            int(view[::PAGE].sum())       # one byte per page: the pages are now mapped
            total += ext.nbytes
        self.resident_bytes = total
        return total

    def weight(self, name: str) -> Weight:
        t = self.file.tensors[name]
        return Weight(name, t.codec, t.shape, self.file.raw(name))

    def vector(self, name: str) -> np.ndarray:
        return self.file.decode(name).astype(np.float32, copy=False)

    def has(self, name: str) -> bool:
        return name in self.file.tensors

    def embed_rows(self, ids) -> np.ndarray:
        t = self.file.tensors["model.embed_tokens.weight"]
        return get_codec(t.codec).decode_rows(self.file.raw(t.name), t.shape, ids).astype(np.float32, copy=False)

    def expert(self, layer: int, e: int) -> tuple[Weight, Weight, Weight]:
        key = (layer, e)
        w = self._expert_cache.get(key)
        if w is None:
            w = tuple(self.weight(expert_tensor(layer, e, p)) for p in EXPERT_PROJS)
            self._expert_cache[key] = w
        if key not in self.experts_touched:
            self.experts_touched.add(key)
            self.expert_bytes_touched += self.file.extent_by_name[expert_extent(layer, e)].nbytes
        return w

    def close(self):
        self._expert_cache.clear()
        self.file.close()
