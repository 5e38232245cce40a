"""Codecs: how a tensor's values are laid out as bytes in a weight file, and the numpy reference
decoders that read them back (tests hold the runtime's kernels to them). The float codecs are here;
the block codecs are formats/quants.py. Encoding (fitting values to a layout) is the converter's:
convert/encoder.py. All codecs give float32 arrays; a 2-D weight has shape [out_features,
in_features] (row-major).
"""

from __future__ import annotations

import math

import numpy as np


class CodecError(ValueError):
    """The values cannot be encoded (non-finite input, out of range, wrong shape)."""


class Codec:
    name: str = ""
    description: str = ""

    def nbytes(self, shape) -> int:
        raise NotImplementedError

    def supports(self, shape) -> bool:
        """Whether this codec can hold a tensor of `shape` (group codecs need whole groups)."""
        try:
            self.nbytes(shape)
            return True
        except CodecError:
            return False

    def decode(self, buf, shape) -> np.ndarray:
        """Reference decoder: float32 array of `shape` from the codec's bytes."""
        raise NotImplementedError

    def decode_rows(self, buf, shape, rows) -> np.ndarray:
        """Reference decode of the given rows of a 2-D tensor (embedding gathers)."""
        return self.decode(buf, shape)[np.asarray(rows)]

    def bits_per_weight(self, shape) -> float:
        n = math.prod(shape)
        return 8.0 * self.nbytes(shape) / n if n else 0.0


class _Float(Codec):
    """IEEE little-endian floats, row-major."""

    def __init__(self, name: str, dtype: str, description: str):
        self.name, self.dtype, self.description = name, np.dtype(dtype), description

    def nbytes(self, shape) -> int:
        return math.prod(shape) * self.dtype.itemsize

    def decode(self, buf, shape):
        arr = np.frombuffer(buf, dtype=self.dtype, count=math.prod(shape)).reshape(shape)
        return arr if self.dtype == np.float32 else arr.astype(np.float32)

    def decode_rows(self, buf, shape, rows):
        arr = np.frombuffer(buf, dtype=self.dtype, count=math.prod(shape)).reshape(shape)
        return arr[np.asarray(rows)].astype(np.float32)


class _BFloat16(Codec):
    """bfloat16: the upper 16 bits of a float32, rounded to nearest even; little-endian."""

    name = "bf16"
    description = "bfloat16"

    def nbytes(self, shape) -> int:
        return math.prod(shape) * 2

    def decode(self, buf, shape):
        raw = np.frombuffer(buf, dtype="<u2", count=math.prod(shape))
        return (raw.astype(np.uint32) << 16).view(np.float32).reshape(shape)

    def decode_rows(self, buf, shape, rows):
        raw = np.frombuffer(buf, dtype="<u2", count=math.prod(shape)).reshape(shape)[np.asarray(rows)]
        return (raw.astype(np.uint32) << 16).view(np.float32)


CODECS: dict[str, Codec] = {
    c.name: c
    for c in (
        _Float("f32", "<f4", "float32"),
        _Float("f16", "<f2", "float16"),
        _BFloat16(),
    )
}
FLOAT_CODECS = tuple(CODECS)        # the values themselves; every other codec is a block codec


def is_float_codec(name: str) -> bool:
    return name in FLOAT_CODECS


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise CodecError(f"unknown codec {name!r} (known: {', '.join(sorted(CODECS))})") from None


from . import quants  # noqa: E402,F401  (the block codecs register themselves in CODECS)
from . import ggufcodecs  # noqa: E402,F401  (and llama.cpp's block types, kept from GGUF files)
