"""Constants of the kimi-stream weight file and of DeepseekV3 tensor naming."""

import re

MAGIC = b"KIMISTRM"
VERSION = 2                    # 2: outliers stored as corrections to their digits' values (1: the values)
PREFIX_SIZE = 64
DEFAULT_ALIGNMENT = 4096
MAX_ALIGNMENT = 2 * 1024 * 1024
TENSOR_ALIGNMENT = 64          # tensors inside an extent start on a 64-byte boundary (SIMD loads)
MAX_HEADER_BYTES = 1 << 30     # the header is untrusted input; refuse absurd lengths early
FILE_SUFFIX = ".kst"

# Tensor classes: the unit of a precision plan and of the converter's summary.
ROUTED_EXPERTS = "routed_experts"
SHARED_EXPERTS = "shared_experts"
DENSE_MLP = "dense_mlp"
ATTENTION = "attention"
ROUTER = "router"
NORMS = "norms"
EMBEDDINGS = "embeddings"
LM_HEAD = "lm_head"
TENSOR_CLASSES = (ROUTED_EXPERTS, SHARED_EXPERTS, DENSE_MLP, ATTENTION, ROUTER, NORMS, EMBEDDINGS, LM_HEAD)

# Extent kinds: what the runtime does with a byte range.
EXTENT_RESIDENT = "resident"     # loaded at start and kept
EXTENT_EMBEDDING = "embedding"   # left on disk, rows gathered on demand
EXTENT_EXPERT = "expert"         # one routed expert: paged in when a token is routed to it
EXTENT_BLOB = "blob"             # an embedded file (tokenizer files)
EXTENT_KINDS = (EXTENT_RESIDENT, EXTENT_EMBEDDING, EXTENT_EXPERT, EXTENT_BLOB)

EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def classify(name: str) -> str:
    """The tensor class of a DeepseekV3 / Kimi-K2 tensor name (Hugging Face naming)."""
    if name == "model.embed_tokens.weight":
        return EMBEDDINGS
    if name == "lm_head.weight":
        return LM_HEAD
    if ".mlp.experts." in name:
        return ROUTED_EXPERTS
    if ".mlp.shared_experts." in name:
        return SHARED_EXPERTS
    if ".mlp.gate." in name:
        return ROUTER
    if name.endswith("norm.weight"):
        return NORMS
    if ".self_attn." in name:
        return ATTENTION
    if re.search(r"\.mlp\.(gate|up|down)_proj\.weight$", name):
        return DENSE_MLP
    raise ValueError(f"unknown tensor name {name!r}: not part of the DeepseekV3 architecture")

# Files of a checkpoint that make up its tokenizer; embedded in the weight file as blobs.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tiktoken.model", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")
