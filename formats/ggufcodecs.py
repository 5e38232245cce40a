"""llama.cpp's block types as codecs, for tensors kept from a GGUF file as they are (`kimi-convert
MODEL.gguf --quant keep`): codec `gguf-<type>` (e.g. `gguf-q2_k`) holds a tensor's rows of blocks
unchanged, in llama.cpp's own layout (one row after the other, each `cols / block` blocks of
`type_size` bytes; the layouts are llama.cpp's, see its ggml-common.h). Decoding is the `gguf`
package's dequantizer, imported on first use; the runtime has its own C decoders and products for
them (runtime/_ggml.c), equal to it bit for bit."""

from __future__ import annotations

import math

import numpy as np

from .codecs import CODECS, Codec, CodecError

# GGML type -> (weights per block, bytes per block), as llama.cpp defines them (checked against the
# gguf package's GGML_QUANT_SIZES in the tests)
BLOCK_SIZES = {
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "IQ4_NL": (32, 18),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
    "IQ1_S": (256, 50), "IQ1_M": (256, 56), "IQ2_XXS": (256, 66), "IQ2_XS": (256, 74), "IQ2_S": (256, 82),
    "IQ3_XXS": (256, 98), "IQ3_S": (256, 110), "IQ4_XS": (256, 136), "TQ1_0": (256, 54), "TQ2_0": (256, 66),
}
# GGML type -> byte offsets of its blocks' binary16 scales (d, and dmin where it has one), from the
# same layouts: kept blocks are checked for NaN and Inf there, as every encoder checks its input
# (IQ1_M has no binary16 of its own: finite_scales puts its d together from the scale words' nibbles)
SCALE_OFFSETS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "IQ4_NL": (0,), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ1_S": (0,), "IQ1_M": (), "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,),
    "IQ4_XS": (0,), "TQ1_0": (52,), "TQ2_0": (64,),
}
PREFIX = "gguf-"


def finite_scales(ggml_type: str, blocks: np.ndarray, type_size: int) -> bool:
    """Whether every block's binary16 scales in `blocks` (bytes, whole blocks of `type_size`) are finite."""
    b = np.asarray(blocks, np.uint8).reshape(-1, type_size)
    words = [b[:, off].astype(np.uint16) | (b[:, off + 1].astype(np.uint16) << 8)
             for off in SCALE_OFFSETS.get(ggml_type, ())]
    if ggml_type == "IQ1_M":
        # its d is spread over the top nibbles of the four u16 scale words at byte 48
        sc = [b[:, 48 + 2 * i].astype(np.uint16) | (b[:, 49 + 2 * i].astype(np.uint16) << 8) for i in range(4)]
        words.append((sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) | ((sc[2] >> 4) & 0x0F00) | (sc[3] & 0xF000))
    return not any(((w & 0x7C00) == 0x7C00).any() for w in words)     # exponent all ones: Inf or NaN


def codec_name(ggml_type: str) -> str:
    return PREFIX + ggml_type.lower()


def is_gguf_codec(name: str) -> bool:
    return name.startswith(PREFIX)


class GGUFBlockCodec(Codec):
    def __init__(self, ggml_type: str):
        self.ggml_type = ggml_type
        self.name = codec_name(ggml_type)
        self.block, self.type_size = BLOCK_SIZES[ggml_type]
        self.description = f"llama.cpp {ggml_type} blocks, unchanged"

    def nbytes(self, shape) -> int:
        if len(shape) < 1 or shape[-1] % self.block:
            raise CodecError(f"{self.name}: rows of {shape[-1] if shape else 0} weights are not whole "
                             f"blocks of {self.block}")
        return math.prod(shape) // self.block * self.type_size

    def decode(self, buf, shape) -> np.ndarray:
        import gguf
        raw = np.frombuffer(buf, np.uint8, count=self.nbytes(shape)).reshape(-1, shape[-1] // self.block * self.type_size)
        return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[self.ggml_type]).astype(np.float32).reshape(shape)

    def decode_rows(self, buf, shape, rows) -> np.ndarray:
        import gguf
        row_bytes = shape[-1] // self.block * self.type_size
        raw = np.frombuffer(buf, np.uint8, count=self.nbytes(shape)).reshape(-1, row_bytes)[np.asarray(rows)]
        return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[self.ggml_type]).astype(np.float32)


for _t in BLOCK_SIZES:
    CODECS[codec_name(_t)] = GGUFBlockCodec(_t)
