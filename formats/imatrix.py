"""Importance matrices: per-input-channel mean squared activation of every weight, measured by
running a model over calibration text. Written by `kimi-run --calibration`, read by
`kimi-convert --imatrix`. An .npz holding one float32 vector per tensor name plus `__meta__`
(JSON: the model config's digest, tokens seen, tokens per tensor)."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np


class ImatrixError(ValueError):
    pass


def config_digest(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def save_imatrix(path, vectors: dict[str, np.ndarray], config: dict, tokens: int, counts: dict[str, int]) -> None:
    meta = {"config_digest": config_digest(config), "tokens": tokens, "counts": counts}
    path = Path(path)
    tmp = path.with_name(path.name + ".partial.npz")
    np.savez(tmp, __meta__=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
             **{n: np.asarray(v, dtype=np.float32) for n, v in vectors.items()})
    tmp.replace(path)


def load_imatrix(path, config: dict, shapes: dict[str, tuple]) -> dict[str, np.ndarray]:
    """Vectors by tensor name, checked against the model they will quantize."""
    path = Path(path)
    try:
        with np.load(path) as z:
            meta = json.loads(bytes(z["__meta__"]).decode())
            vectors = {k: z[k] for k in z.files if k != "__meta__"}
    except (OSError, KeyError, ValueError, zipfile.BadZipFile, json.JSONDecodeError) as e:
        raise ImatrixError(f"{path}: not an importance matrix ({e})") from None
    if meta.get("config_digest") != config_digest(config):
        raise ImatrixError(f"{path}: importance matrix of another model (config digest "
                           f"{meta.get('config_digest')} != {config_digest(config)})")
    for name, v in vectors.items():
        if name not in shapes:
            raise ImatrixError(f"{path}: tensor {name} is not in this model")
        if v.shape != (shapes[name][-1],):
            raise ImatrixError(f"{path}: {name} has {v.shape} importances, the weight has "
                               f"{shapes[name][-1]} input channels")
        if not np.isfinite(v).all() or (v < 0).any():
            raise ImatrixError(f"{path}: {name} has negative or non-finite importances")
    return vectors
