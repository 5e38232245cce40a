"""Synthetic weight files of any geometry: random weights in the layout the converter writes, for
tests and benchmarks that need models larger than RAM without a download. With `sparse`, routed
experts are left as holes in the file (they read as zeros and take no disk space)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from kimistream.formats.codecs import get_codec
from kimistream.formats.config import ConfigError, ModelConfig
from kimistream.formats.constants import DEFAULT_ALIGNMENT, EXTENT_EXPERT
from kimistream.formats.layout import plan_extents
from kimistream.formats.quants import TiledQ1Codec
from kimistream.formats.weightfile import WeightFileWriter

from .encoder import encode

from kimistream.formats.presets import PrecisionPlan


class SyntheticError(ValueError):
    pass


def byte_tokenizer(vocab_size: int) -> dict[str, bytes]:
    """A byte-level tokenizer.json (256 byte tokens + <s>/</s>), for configs that come without one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    if vocab_size < 258:
        raise SyntheticError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer (needs 258)")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}
    return {"tokenizer.json": tok.to_str().encode(), "tokenizer_config.json": json.dumps(cfg).encode()}


def _values(rng, name: str, shape, cfg: ModelConfig) -> np.ndarray:
    if name.endswith("norm.weight"):
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith("e_score_correction_bias"):
        return (0.01 * rng.standard_normal(shape)).astype(np.float32)
    fan_in = shape[-1]
    return (rng.standard_normal(shape, dtype=np.float32) / math.sqrt(fan_in)).astype(np.float32)


TILE_ROWS = 64


def _encoded(rng, name: str, shape, codec_name: str, cfg: ModelConfig) -> np.ndarray:
    """Encoded bytes of a random tensor. Large weights repeat a random block of TILE_ROWS rows: every
    plane of every codec is row-major, so tiling each plane's rows gives a valid encoding of the
    row-tiled matrix at memory speed (encoding a trillion-parameter geometry would take hours)."""
    codec = get_codec(codec_name)
    if len(shape) != 2 or shape[0] <= 4 * TILE_ROWS:
        return encode(codec, _values(rng, name, shape, cfg))
    rows, cols = shape
    block = encode(codec, _values(rng, name, (TILE_ROWS, cols), cfg))
    if isinstance(codec, TiledQ1Codec):
        # q1t: the outlier planes are row-major, and TILE_ROWS rows are whole tiles, so each part of
        # the layout repeats with the block as well
        g, gb = codec.geometry(shape), codec.geometry((TILE_ROWS, cols))
        out = np.zeros(g.nbytes, np.uint8)
        for (a, b), (c, d) in (((0, gb.off_oval), (0, g.off_oval)),
                               ((gb.off_oval, 2 * gb.off_oval), (g.off_oval, 2 * g.off_oval)),
                               ((gb.off_code, gb.nbytes), (g.off_code, g.nbytes))):
            out[c:d] = np.resize(block[a:b], d - c)
        return out
    per_row_total = codec.nbytes((1, cols))
    if codec.nbytes((TILE_ROWS, cols)) != TILE_ROWS * per_row_total:
        return encode(codec, _values(rng, name, shape, cfg))
    planes = _plane_rows(codec, cols)
    out, pos = [], 0
    for per_row in planes:
        plane = block[pos:pos + TILE_ROWS * per_row].reshape(TILE_ROWS, per_row)
        out.append(np.resize(plane, (rows, per_row)).reshape(-1))
        pos += TILE_ROWS * per_row
    return np.concatenate(out)


def _plane_rows(codec, cols: int) -> list[int]:
    """Bytes per row of each plane, in storage order (one plane for float codecs)."""
    geometry = getattr(codec, "geometry", None)
    if geometry is None:
        return [codec.nbytes((1, cols))]
    g = geometry((1, cols))
    return [g.par_row, 2 * g.k, 2 * g.k, g.sub_row, g.code_row]


def _read_config(config_path: Path) -> tuple[ModelConfig, dict]:
    try:
        hf = json.loads(config_path.read_text())
        return ModelConfig.from_hf(hf), hf
    except OSError as e:
        raise SyntheticError(f"{config_path}: cannot read the config ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError, ConfigError) as e:
        raise SyntheticError(f"{config_path}: {e}") from None


def synthetic_config(config_path) -> ModelConfig:
    """The ModelConfig of a config.json, or SyntheticError naming the file."""
    return _read_config(Path(config_path))[0]


def synthetic_tokenizer(config_path) -> dict[str, bytes]:
    """The tokenizer files a synthetic file of this config holds: those beside config.json, else a
    byte-level one."""
    config_path = Path(config_path)
    cfg = _read_config(config_path)[0]
    tok_dir = config_path.parent
    try:
        tok_files = {n: (tok_dir / n).read_bytes() for n in ("tokenizer.json", "tokenizer_config.json")
                     if (tok_dir / n).is_file()}
    except OSError as e:
        raise SyntheticError(f"{tok_dir}: cannot read the tokenizer ({e.strerror})") from None
    if "tokenizer.json" not in tok_files:
        tok_files = byte_tokenizer(cfg.vocab_size)
    return tok_files


def write_synthetic(config_path, out, plan: PrecisionPlan, sparse: bool = False, seed: int = 0,
                    progress=None, alignment: int = DEFAULT_ALIGNMENT) -> Path:
    progress = progress or (lambda *a, **k: None)
    config_path = Path(config_path)
    cfg, hf = _read_config(config_path)
    tok_files = synthetic_tokenizer(config_path)
    plan.for_model(cfg.first_k_dense_replace, cfg.num_hidden_layers)
    writer = WeightFileWriter(out, alignment)
    layout = plan_extents(cfg, plan.codec_for)
    for name, kind, tensors in layout:
        writer.add_extent(name, kind, tensors)
    for name, data in tok_files.items():
        writer.add_blob(name, data)
    writer.begin({"config": cfg.to_dict(), "hf_config": hf, "tokenizer": {"kind": "hf", "files": sorted(tok_files)},
                  "plan": plan.to_json(), "source": {"synthetic": {"seed": seed, "sparse": sparse}}})
    rng = np.random.default_rng(seed)
    total = sum(e.nbytes for e in writer.extents if not (sparse and e.kind == EXTENT_EXPERT))
    progress("start", total_bytes=total, tensors=len(writer.tensors))
    try:
        for name, kind, tensors in layout:
            if sparse and kind == EXTENT_EXPERT:
                writer.leave_hole(name)
                continue
            for tname, cls, codec, shape in tensors:
                writer.write_tensor(tname, _encoded(rng, tname, shape, codec, cfg))
                progress("tensor", name=tname, nbytes=writer.tensors[tname].nbytes)
        path = writer.finish()
    except BaseException:
        writer.abort()
        raise
    progress("done")
    return path
