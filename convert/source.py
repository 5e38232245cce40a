"""Checkpoints as sources of tensors, read one at a time (memory is bounded by the largest tensor):
a Hugging Face checkpoint directory (config.json, one or many safetensors shards with
model.safetensors.index.json, tokenizer files; FP8 (e4m3) weights dequantized with their 128x128
block `weight_scale_inv`, as in the DeepSeek-V3 and Kimi K2 releases), or a llama.cpp GGUF file
(formats/gguffile.py: its tensors dequantized by the `gguf` package, its tokenizer rebuilt).
`open_checkpoint` picks the reader."""

from __future__ import annotations

import json
import math
import unicodedata
from pathlib import Path

import numpy as np

from kimistream.formats.config import ConfigError, ModelConfig
from kimistream.formats.constants import TOKENIZER_FILES
from kimistream.formats.safetensors import SafetensorsError, SafetensorsFile

INDEX_FILE = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"


class SourceError(ValueError):
    pass


def read_index(path: Path) -> dict[str, str]:
    """The weight_map of a model.safetensors.index.json: tensor name -> shard file, every shard a
    relative path that stays inside the index's directory (no absolute path, no '..'): a conversion
    reads those files and, with --delete-source, deletes them. SourceError (one line) otherwise."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise SourceError(f"{path}: not readable JSON ({e})") from None
    wmap = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wmap, dict):
        raise SourceError(f"{path}: malformed index (no weight_map object)")
    for tensor, shard in wmap.items():
        shown = repr(tensor) if has_control_chars(tensor) else tensor      # the message stays one line
        if not isinstance(shard, str):
            raise SourceError(f"{path}: malformed index (shard of {shown} is not a file name)")
        problem = shard_name_problem(shard)
        if problem:
            raise SourceError(f"{path}: shard {shard!r} of {shown} {problem}")
    return wmap


def has_control_chars(text: str) -> bool:
    """`text` holds a control character (newline, tab, DEL, C1) or a Unicode line or paragraph
    separator: anything that would break a name out of its line (str.splitlines splits on all of
    them) in a manifest, a journal or a message."""
    return any(unicodedata.category(c) in ("Cc", "Zl", "Zp") for c in text)


def shard_name_problem(name: str) -> str | None:
    """Why `name` cannot be a shard path relative to its checkpoint directory, or None."""
    if not name or "\0" in name:
        return "is empty or not text"
    if has_control_chars(name):
        return "contains a control character (a newline, tab or the like)"
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        return "is an absolute path (shards must lie inside the checkpoint directory)"
    if "\\" in name or any(p in ("", ".", "..") for p in name.split("/")):
        return "leaves the checkpoint directory ('..', '.', an empty part or a backslash)"
    return None


class HFCheckpoint:
    def __init__(self, directory, allow_missing_shards: bool = False):
        """`allow_missing_shards`: shards named by the index may be gone (deleted by a conversion
        that is being resumed); their tensors are known by name only (`missing_shards`)."""
        self.dir = Path(directory)
        self.allow_missing_shards = allow_missing_shards
        if not self.dir.is_dir():
            raise SourceError(f"{self.dir}: not a directory")
        cfg_path = self.dir / "config.json"
        try:
            self.hf_config = json.loads(cfg_path.read_text())
        except FileNotFoundError:
            raise SourceError(f"{cfg_path}: missing (not a Hugging Face checkpoint directory?)") from None
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise SourceError(f"{cfg_path}: not valid JSON ({type(e).__name__})") from None
        if not isinstance(self.hf_config, dict):
            raise SourceError(f"{cfg_path}: not a JSON object")
        try:
            self.config = ModelConfig.from_hf(self.hf_config)
        except ConfigError as e:
            raise SourceError(f"{cfg_path}: {e}") from None
        self.shard_names = self._find_shards()
        self.shards: dict[str, SafetensorsFile] = {}
        for name in self.shard_names:
            if name in self.missing_shards:
                continue
            try:
                self.shards[name] = SafetensorsFile(self.dir / name)
            except SafetensorsError as e:
                raise SourceError(str(e)) from None
        self.location: dict[str, str] = {}
        for name, st in self.shards.items():
            for t in st.keys():
                if t in self.location:
                    raise SourceError(f"{self.dir / name}: tensor {t} also in {self.location[t]}")
                self.location[t] = name
        if self.index_map is not None:
            for t, shard in self.index_map.items():
                if shard in self.missing_shards:
                    self.location[t] = shard
                elif self.location.get(t) != shard:
                    raise SourceError(f"{self.dir / shard}: lacks tensor {t} that {INDEX_FILE} places there")

    def _find_shards(self) -> list[str]:
        idx = self.dir / INDEX_FILE
        self.index_map = None
        if idx.exists():
            self.index_map = read_index(idx)
            names = sorted(set(self.index_map.values()), key=_shard_key)
            missing = [n for n in names if not (self.dir / n).is_file()]
            self.missing_shards = set(missing) if self.allow_missing_shards else set()
            if missing and not self.allow_missing_shards:
                raise SourceError(f"{self.dir / missing[0]}: shard named in {INDEX_FILE} is missing"
                                  + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
            return names
        self.missing_shards = set()
        names = sorted((p.name for p in self.dir.glob("*.safetensors")), key=_shard_key)
        if not names:
            raise SourceError(f"{self.dir}: no *.safetensors files and no {INDEX_FILE}")
        return names

    def has(self, name: str) -> bool:
        return name in self.location

    def shape(self, name: str) -> tuple | None:
        shard = self.location[name]
        return None if shard in self.missing_shards else tuple(self.shards[shard].entries[name]["shape"])

    def offset(self, name: str) -> int:
        shard = self.location[name]
        return 0 if shard in self.missing_shards else self.shards[shard].entries[name]["begin"]

    def dtype(self, name: str) -> str:
        return self.shards[self.location[name]].entries[name]["dtype"]

    def read(self, name: str) -> np.ndarray:
        """Tensor `name` as float32, FP8 block scales applied."""
        st = self.shards[self.location[name]]
        arr = st.read(name)
        if st.entries[name]["dtype"] == "F8_E4M3":
            scale_name = name + SCALE_SUFFIX
            if scale_name not in self.location:
                raise SourceError(f"{st.path}: FP8 tensor {name} has no {scale_name}")
            arr = dequantize_fp8_blocks(arr, self.shards[self.location[scale_name]].read(scale_name), name)
        if not np.isfinite(arr).all():
            raise SourceError(f"{st.path}: tensor {name} holds NaN or Inf values")
        return arr

    def tokenizer_files(self) -> dict[str, bytes]:
        return {n: (self.dir / n).read_bytes() for n in TOKENIZER_FILES if (self.dir / n).is_file()}

    def source_files(self) -> list[str]:
        """The files (relative to `dir`) the conversion reads."""
        return ["config.json", *([INDEX_FILE] if self.index_map is not None else []), *self.shard_names,
                *self.tokenizer_files().keys()]

    @property
    def path(self) -> Path:
        return self.dir

    def close(self):
        for st in self.shards.values():
            st.close()


class GGUFCheckpoint:
    """A llama.cpp GGUF file (all its split files) with HFCheckpoint's interface: tensors under their
    Hugging Face names, as float32 (requantizing them stacks a second quantization on the first)."""

    def __init__(self, path, allow_missing_shards: bool = False):
        from kimistream.formats.gguffile import GGUFError, GGUFModel
        self._error = GGUFError
        try:
            self.model = GGUFModel(path)
            self.config = ModelConfig.from_hf(self.model.config)
            self._tokenizer = self.model.tokenizer_files()[1]
        except (GGUFError, ConfigError) as e:
            raise SourceError(str(e) if isinstance(e, GGUFError) else f"{path}: {e}") from None
        self.hf_config = self.model.config
        self.dir = self.model.path.parent
        self.shard_names = [p.name for p in self.model.paths]
        self.location = {n: self.model.shard_of(n) for n in self.model.names()}
        self.missing_shards: set[str] = set()
        self.index_map = None
        # --delete-source closes a shard before deleting it; the files stay mapped until the end
        self.shards = {n: _Mapped() for n in self.shard_names}

    @property
    def path(self) -> Path:
        return self.model.path

    def has(self, name: str) -> bool:
        return self.model.has(name)

    def shape(self, name: str) -> tuple:
        return self.model.shape(name)

    def offset(self, name: str) -> int:
        return self.model.offset(name)

    def read(self, name: str) -> np.ndarray:
        try:
            arr = self.model.read(name)
        except self._error as e:
            raise SourceError(str(e)) from None
        if not np.isfinite(arr).all():
            raise SourceError(f"{self.dir / self.location[name]}: tensor {name} holds NaN or Inf values")
        return arr

    def tokenizer_files(self) -> dict[str, bytes]:
        return dict(self._tokenizer)

    def source_files(self) -> list[str]:
        return list(self.shard_names)

    def keep_codecs(self) -> dict[str, str]:
        try:
            return self.model.keep_codecs()
        except self._error as e:
            raise SourceError(str(e)) from None

    def kept_bytes(self, name: str, codec: str):
        return self.model.kept_bytes(name, codec)

    def quantized_types(self) -> list[str]:
        """The GGUF block types of its tensors other than plain floats (F32, F16, BF16)."""
        return sorted({self.model.quant_type(n) for n in self.model.names()} - {"F32", "F16", "BF16"})

    def close(self):
        self.model.close()


class _Mapped:
    def close(self):
        pass


def open_checkpoint(path, allow_missing_shards: bool = False):
    """The reader for `path`: a GGUF file, or a Hugging Face checkpoint directory."""
    from kimistream.formats.gguffile import is_gguf
    if is_gguf(path):
        return GGUFCheckpoint(path, allow_missing_shards)
    return HFCheckpoint(path, allow_missing_shards)


def dequantize_fp8_blocks(w: np.ndarray, scale_inv: np.ndarray, name: str = "", block: int = 128) -> np.ndarray:
    """w[i, j] * scale_inv[i // block, j // block], exactly (both already float32)."""
    if w.ndim != 2 or scale_inv.ndim != 2:
        raise SourceError(f"{name}: FP8 block scaling needs 2-D weight and scale")
    rows, cols = w.shape
    if scale_inv.shape != (math.ceil(rows / block), math.ceil(cols / block)):
        raise SourceError(f"{name}: weight_scale_inv shape {scale_inv.shape} does not match weight {w.shape} "
                          f"with {block}x{block} blocks")
    full = np.repeat(np.repeat(scale_inv, block, axis=0), block, axis=1)[:rows, :cols]
    return w * full


def _shard_key(name: str):
    """Order shards by their number ('model-00002-of-00062', 'model-2-of-61'), else by name."""
    import re
    m = re.search(r"-(\d+)-of-(\d+)", name)
    return (0, int(m.group(1)), name) if m else (1, 0, name)
