"""Importance matrices: what calibration measured about the inputs of every weight. Written by
`kimi-run --calibration`, read by `kimi-convert --imatrix`. An .npz holding
- one float32 vector per tensor name: the per-input-channel mean squared activation (the diagonal);
- `moment:KEY` float32 [cols, cols] matrices: the full second moment E[x xᵀ] of a weight's inputs, for
  the weights a size budget allows (see `moment_plan`) — the quantizer then rounds with error
  feedback (GPTQ-style) instead of channel by channel. Weights that read the same input share one
  (`moment_key`): e.g. a layer's routed experts' gate_proj/up_proj, `model.layers.L.mlp.experts.gate_up`;
- `__meta__` (JSON: format 2, the model config's digest, tokens seen, tokens per tensor and per
  moment). A file without a `format` field loads if it holds vectors only (as written before
  moments existed); with moments it is refused as out of date."""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from .constants import EMBEDDINGS, NORMS, ROUTER, classify

SELF_CALIBRATION = "self"     # `--calibration self`: measure on text the model samples itself
FORMAT = 2            # 1: vectors only (no "format" field); 2: + moments under shared keys
MOMENT = "moment:"
DEFAULT_MOMENT_BUDGET = 2 << 30       # bytes of float32 accumulators while collecting
# Weights that read the same input share one moment: (pattern, shared key, the member that records it).
_SHARED = ((re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.\d+\.(?:gate|up)_proj\.weight$"), "gate_up", "gate_proj"),
           (re.compile(r"^(model\.layers\.\d+\.mlp\.shared_experts)\.(?:gate|up)_proj\.weight$"), "gate_up", "gate_proj"),
           (re.compile(r"^(model\.layers\.\d+\.mlp)\.(?:gate|up)_proj\.weight$"), "gate_up", "gate_proj"),
           (re.compile(r"^(model\.layers\.\d+\.self_attn)\.(?:q_a_proj|q_proj|kv_a_proj_with_mqa)\.weight$"),
            "input", "kv_a_proj_with_mqa"))
_EXPERT_DOWN = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.down_proj\.weight$")


class ImatrixError(ValueError):
    pass


def config_digest(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def moment_key(name: str) -> str:
    """The second-moment matrix a weight's inputs are described by: weights that read the same
    input share one (a layer's routed experts' gate/up — they see the same hidden states — a dense
    or shared MLP's gate/up, attention's input projections)."""
    for pattern, suffix, _ in _SHARED:
        m = pattern.match(name)
        if m:
            return f"{m.group(1)}.{suffix}"
    return name


def records_moment(name: str) -> bool:
    """Whether `name`'s inputs are added to its moment (one member of a sharing group records)."""
    for pattern, _, owner in _SHARED:
        if pattern.match(name):
            return f".{owner}." in name
    return True


def moment_plan(shapes: dict[str, tuple], budget_bytes: int) -> set[str]:
    """Which moment keys get a full matrix within `budget_bytes` (float32 accumulators). Only weights
    that get quantized count (not routers, norms, embeddings). Priority: routed experts' shared
    gate/up matrices, then their down projections (the low-bit weights), then everything else,
    each group in model order; a key that does not fit is skipped."""
    keys: dict[str, int] = {}
    for name, shape in shapes.items():
        if len(shape) == 2 and classify(name) not in (ROUTER, NORMS, EMBEDDINGS):
            keys.setdefault(moment_key(name), int(shape[1]))

    def rank(k):
        return 0 if ".mlp.experts.gate_up" in k else 1 if _EXPERT_DOWN.match(k) else 2
    chosen, used = set(), 0
    for k in sorted(keys, key=lambda k: (rank(k), _natural(k))):
        cost = keys[k] ** 2 * 4
        if used + cost <= budget_bytes:
            chosen.add(k)
            used += cost
    return chosen


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


class Imatrix(Mapping):
    """Per-channel importance vectors by tensor name (a read-only mapping), plus `moment(name)`.
    Moments are read from the file when asked for (a few are kept: a layer's experts share one),
    so a conversion holds a few matrices, not all of them."""

    CACHED = 3

    def __init__(self, vectors: dict[str, np.ndarray], moments: dict[str, np.ndarray] | None = None,
                 path=None, moment_keys=()):
        self.vectors = vectors
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict(moments or {})
        self.moment_keys = set(moment_keys) | set(self._cache)
        self.path = path

    def __getitem__(self, name):
        return self.vectors[name]

    def __iter__(self):
        return iter(self.vectors)

    def __len__(self):
        return len(self.vectors)

    def moment(self, name: str) -> np.ndarray | None:
        key = moment_key(name)
        if key not in self.moment_keys:
            return None
        if key not in self._cache:
            try:
                with np.load(self.path) as z:
                    self._cache[key] = z[MOMENT + key]
            except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
                raise ImatrixError(f"{self.path}: cannot read second moment {key} ({e})") from None
            while len(self._cache) > self.CACHED:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return self._cache[key]


def save_imatrix(path, vectors: dict[str, np.ndarray], config: dict, tokens: int, counts: dict[str, int],
                 moments: dict[str, np.ndarray] | None = None, moment_counts: dict[str, int] | None = None) -> None:
    """Write an importance file (to a temporary name, renamed when complete). Arrays are converted to
    float32 one at a time, so saving holds one extra matrix, not a copy of them all."""
    meta = {"format": FORMAT, "config_digest": config_digest(config), "tokens": tokens, "counts": counts,
            "moment_counts": moment_counts or {}}
    path = Path(path)
    tmp = path.with_name(path.name + ".partial.npz")
    entries = [("__meta__", lambda: np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))]
    entries += [(n, lambda v=v: np.asarray(v, dtype=np.float32)) for n, v in vectors.items()]
    entries += [(MOMENT + k, lambda v=v: np.asarray(v, dtype=np.float32)) for k, v in (moments or {}).items()]
    try:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name, make in entries:
                with zf.open(name + ".npy", "w", force_zip64=True) as f:
                    np.lib.format.write_array(f, make(), allow_pickle=False)
        tmp.replace(path)
    except BaseException:            # failed or interrupted (Ctrl-C): no half-written file left behind
        tmp.unlink(missing_ok=True)
        raise


def load_imatrix(path, config: dict, shapes: dict[str, tuple]) -> Imatrix:
    """Vectors and moments by tensor name, checked against the model they will quantize."""
    path = Path(path)
    if not zipfile.is_zipfile(path):
        raise ImatrixError(f"{path}: not an importance matrix (a .npz written by kimi-run --imatrix-out)")
    try:
        with np.load(path) as z:
            meta = json.loads(bytes(z["__meta__"]).decode())
            if not isinstance(meta, dict):
                raise ImatrixError(f"{path}: not an importance matrix (its __meta__ is not a JSON object)")
            vectors = {k: z[k] for k in z.files if k != "__meta__" and not k.startswith(MOMENT)}
            keys = [k[len(MOMENT):] for k in z.files if k.startswith(MOMENT)]
            version = meta.get("format", 1)
            if type(version) is not int:
                raise ImatrixError(f"{path}: not an importance matrix (format {version!r} is not a number)")
            if version > FORMAT:
                raise ImatrixError(f"{path}: importance file format {version} is newer than this kimi-stream "
                                   f"reads ({FORMAT}); upgrade")
            if version < FORMAT and keys:
                raise ImatrixError(f"{path}: written by an older kimi-stream (format {version}, moments keyed "
                                   f"differently): run the calibration again")
            if meta.get("config_digest") != config_digest(config):
                raise ImatrixError(f"{path}: importance matrix of another model (config digest "
                                   f"{meta.get('config_digest')} != {config_digest(config)})")
            cols = {moment_key(n): s[-1] for n, s in shapes.items() if len(s) == 2}
            for key in keys:               # checked one at a time, not kept
                if key not in cols:
                    raise ImatrixError(f"{path}: second moment {key} is not for a weight of this model")
                m = z[MOMENT + key]
                if m.shape != (cols[key], cols[key]):
                    raise ImatrixError(f"{path}: second moment {key} has shape {list(m.shape)}, the weight "
                                       f"has {cols[key]} input channels")
                if not _real(m) or not np.isfinite(m).all():
                    raise ImatrixError(f"{path}: second moment {key} has non-finite or non-numeric values")
                if (np.diagonal(m) < 0).any():       # E[x²] of a channel is never negative
                    raise ImatrixError(f"{path}: second moment {key} has negative values on its diagonal")
                del m
    except (OSError, KeyError, ValueError, zipfile.BadZipFile, json.JSONDecodeError) as e:
        if isinstance(e, ImatrixError):
            raise
        raise ImatrixError(f"{path}: not an importance matrix ({e})") from None
    if not vectors and not keys:
        raise ImatrixError(f"{path}: the importance matrix holds no importances (calibration measured nothing)")
    for name, v in vectors.items():
        if name not in shapes:
            raise ImatrixError(f"{path}: tensor {name} is not in this model")
        if v.shape != (shapes[name][-1],):
            raise ImatrixError(f"{path}: {name} has {v.shape} importances, the weight has "
                               f"{shapes[name][-1]} input channels")
        if not _real(v) or not np.isfinite(v).all() or (v < 0).any():
            raise ImatrixError(f"{path}: {name} has negative, non-finite or non-numeric importances")
    return Imatrix(vectors, path=path, moment_keys=keys)


def _real(a: np.ndarray) -> bool:
    """Whether an array holds real numbers (not strings, booleans or complex values)."""
    return a.dtype.kind in "fiu"
