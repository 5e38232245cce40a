"""llama.cpp's GGUF files of DeepSeek-V3-family models (architecture `deepseek2`) as a source: the
model config rebuilt from the file's metadata in Hugging Face naming, and every tensor under its
Hugging Face name, dequantized to float32 by the `gguf` package. Merged expert tensors
(`ffn_*_exps`, experts on the outer axis) are read one expert at a time; MLA's `attn_k_b`/`attn_v_b`
pair (the layout llama.cpp writes now) is put back together as `kv_b_proj`, and the older whole
`attn_kv_b` is read as it is. Split files (`NAME-00001-of-0000N.gguf`) are one source.

The `gguf` package is imported on first use: the runtime never needs it."""

from __future__ import annotations

import contextlib

import json
import mmap
import os
import re
import struct
from pathlib import Path

import numpy as np

from .layout import split_kv_b_names

ARCH = "deepseek2"
SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
GATING = {1: "softmax", 2: "sigmoid"}       # llama.cpp's expert_gating_func values
GATING_NONE, GATING_SOFTMAX, GATING_SIGMOID = 0, 1, 2

# per-layer GGUF tensor -> Hugging Face suffix under model.layers.N. (routed experts and MLA's kv_b apart)
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}
EXPERT_TENSORS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj", "ffn_down_exps.weight": "down_proj"}


TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4     # tokenizer.ggml.token_type values
# The split patterns llama.cpp applies before byte-level BPE, by tokenizer.ggml.pre (src/llama-vocab.cpp),
# one Split step each; an empty list is GPT-2's own pattern inside the byte-level step.
PRE_SPLITS = {
    "gpt2": [], "default": [],
    "deepseek-v3": [r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
                    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "llama3": [r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
}
PRE_SPLITS["llama-bpe"] = PRE_SPLITS["llama-v3"] = PRE_SPLITS["llama3"]
PRE_SPLITS["gpt-2"] = PRE_SPLITS["gpt2"]          # llama.cpp's converter writes "gpt-2" for GPT-2's own split
IGNORE_MERGES = ("llama3", "llama-bpe", "llama-v3")


# GGUF types a kimi-stream codec holds exactly (the same values; Q8_0's blocks are q8's scales and
# codes interleaved), for `kimi-convert --quant keep`
EXACT_CODECS = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8"}
FLOAT_TYPES = ("F32", "F16", "BF16")
Q8_0_BLOCK = 34                  # f16 scale + 32 int8 codes


class GGUFError(ValueError):
    pass


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def _tiktoken_model(tokens, types) -> bytes:
    """Kimi's tiktoken.model: every ordinary token's bytes (base64) and rank, the rank being its id."""
    import base64
    dec, lines = _byte_decoder(), []
    for i, (tok, ty) in enumerate(zip(tokens, types)):
        if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
            break
        lines.append(base64.b64encode(bytes(dec[c] for c in tok)).decode() + f" {i}")
    return ("\n".join(lines) + "\n").encode()


def _post_processor(config: dict, bos) -> dict | None:
    if not config["add_bos_token"] or config["bos_token"] is None:
        return None
    b = config["bos_token"]
    return {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 0}}],
            "special_tokens": {b: {"id": b, "ids": [int(bos)], "tokens": [b]}}}


def _f32(x) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99999997e-07)."""
    return float(f"{float(x):.7g}")


def is_gguf(path) -> bool:
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def shard_paths(path: Path) -> list[Path]:
    """Every file of a split GGUF given any of them (or the one file of an unsplit one)."""
    m = SPLIT_RE.match(path.name)
    if not m:
        return [path]
    count = int(m.group("count"))
    paths = [path.with_name(f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise GGUFError(f"{path}: split file(s) missing: {', '.join(missing)}")
    return paths


# ---------------------------------------------------------------------- the header, bounded
# GGUF's value types (gguf.GGUFValueType): the bytes of each scalar one; 8 is a string, 9 an array
VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
VALUE_NAMES = {0: "UINT8", 1: "INT8", 2: "UINT16", 3: "INT16", 4: "UINT32", 5: "INT32", 6: "FLOAT32", 7: "BOOL",
               8: "STRING", 9: "ARRAY", 10: "UINT64", 11: "INT64", 12: "FLOAT64"}
V_UINT32, V_STRING, V_ARRAY = 4, 8, 9
GGUF_VERSIONS = (2, 3)              # those gguf.GGUFReader reads (1 had 32-bit counts)
GGML_MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32
MIN_KV_BYTES = 8 + 1 + 4 + 1        # key length, a non-empty key, value type, the smallest value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8       # name length, n_dims, type, offset


def _align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


class _Header:
    """A GGUF file's header walked the way llama.cpp's gguf_init_from_file reads it: every string
    length, array count and tensor size checked against the bytes the file has left before anything
    is read or looped over, and the tensors laid out as llama.cpp requires. gguf.GGUFReader checks
    none of it: it loops once per element an array claims (reading past the end gives it empty
    arrays, not an error), so a count of 2**40 in a 49-byte file, or one byte of a real file's
    tokenizer.ggml.token_type count damaged, ran for ever with memory growing; and it reads a tensor
    wherever its offset points, another tensor's bytes included."""

    def __init__(self, path: Path, buf, size: int):
        self.path, self.buf, self.size, self.pos = path, buf, size, 0
        self.order = "<"
        self.alignment = DEFAULT_ALIGNMENT
        self.after = ""                     # " (after metadata key K)": where a bad name or type was met

    def fail(self, what: str):
        raise GGUFError(f"{self.path}: not a readable GGUF file: {what}")

    def need(self, n: int, what: str) -> None:
        left = self.size - self.pos
        if n > left:
            self.fail(f"{what} needs {n} bytes at offset {self.pos}, but the file has {left} left")

    def unpack(self, fmt: str, what: str) -> tuple:
        st = struct.Struct(self.order + fmt)
        self.need(st.size, what)
        values = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return values

    def one(self, fmt: str, what: str) -> int:
        return self.unpack(fmt, what)[0]

    def string(self, what: str) -> str:
        n = self.one("Q", f"{what}'s length")
        self.need(n, f"{what}: a string of {n} bytes")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", "replace")

    def walk(self) -> None:
        self.need(24, "the header (magic, version, tensor and key counts)")
        if bytes(self.buf[:4]) != b"GGUF":
            self.fail("no GGUF magic")
        version = struct.unpack_from("<I", self.buf, 4)[0]
        if version & 0xFFFF == 0:           # written on a machine of the other byte order (as gguf reads it)
            self.order, version = ">", struct.unpack_from(">I", self.buf, 4)[0]
        if version not in GGUF_VERSIONS:
            self.fail(f"GGUF version {version} (readable: {', '.join(map(str, GGUF_VERSIONS))})")
        self.pos = 8
        n_tensors, n_kv = self.unpack("QQ", "the tensor and key counts")
        left = self.size - self.pos
        if n_kv * MIN_KV_BYTES > left:
            self.fail(f"{n_kv} metadata keys claimed, more than the {left} bytes left can hold")
        if n_tensors * MIN_TENSOR_INFO_BYTES > left:
            self.fail(f"{n_tensors} tensors claimed, more than the {left} bytes left can hold")
        keys = set()
        for i in range(n_kv):
            key = self.string(f"metadata key #{i}'s name{self.after}")
            if not key:
                self.fail(f"metadata key #{i} has an empty name{self.after}")
            if key in keys:
                self.fail(f"metadata key {key} appears twice")
            keys.add(key)
            self.value(key)
            # a length or count damaged but inside the file sends the walk on into other bytes: what
            # it meets there is named with the key it came from
            self.after = f" (after metadata key {key})"
        self.tensors(n_tensors)

    def value(self, key: str) -> None:
        """Steps over one key's value; general.alignment's is kept."""
        what = f"metadata key {key}"
        vtype = self.one("I", f"{what}'s type")
        if vtype == V_ARRAY:
            itype, count = self.unpack("IQ", f"{what}'s array type and count")
            if itype == V_ARRAY:            # llama.cpp reads no nested arrays
                self.fail(f"{what}: an array of arrays{self.after}")
            if itype not in VALUE_NAMES:
                self.fail(f"{what}: an array of unknown type {itype}{self.after}")
            size = VALUE_SIZES.get(itype, 8)    # a string is at least its 8-byte length
            self.need(count * size, f"{what}: an array of {count} {VALUE_NAMES[itype]} values"
                                    + (" (each at least its 8-byte length)" if itype == V_STRING else ""))
            if itype != V_STRING:
                self.pos += count * size
                return
            self.strings(what, count)
            return
        if vtype == V_STRING:
            self.string(what)
            return
        if vtype not in VALUE_SIZES:
            self.fail(f"{what} has unknown type {vtype}{self.after}")
        if key == "general.alignment":
            if vtype != V_UINT32:
                self.fail(f"{what} is a {VALUE_NAMES[vtype]}, not a UINT32")
            self.alignment = self.one("I", what)
            if self.alignment == 0 or self.alignment & (self.alignment - 1):
                self.fail(f"{what} is {self.alignment}, not a power of two")
            return
        self.need(VALUE_SIZES[vtype], what)
        self.pos += VALUE_SIZES[vtype]

    def strings(self, what: str, count: int) -> None:
        """Steps over an array of `count` strings, each length checked before it is stepped over. A
        damaged count sends the walk on into the bytes after the array, where a run of zeros (padding,
        a sparse or zeroed region) reads as empty strings: those are stepped over by numpy, a run at a
        time, not one Python step per 8 bytes (minutes for the gigabytes a huge count spans)."""
        buf, pos, end, j = self.buf, self.pos, self.size, 0
        length = struct.Struct(self.order + "Q")
        while j < count:
            if end - pos < 8:
                self.pos = pos
                self.need(8, f"{what}: the length of string {j} of {count}")
            n = length.unpack_from(buf, pos)[0]
            pos += 8
            j += 1
            if n > end - pos:
                self.pos = pos
                self.need(n, f"{what}: string {j - 1} of {count} ({n} bytes)")
            pos += n
            if n == 0:
                run = self.zero_words(pos, min(count - j, (end - pos) // 8))
                j, pos = j + run, pos + 8 * run
        self.pos = pos

    def zero_words(self, pos: int, most: int) -> int:
        """How many zero 8-byte words (empty strings) start at `pos`, up to `most`: counted by numpy in
        chunks growing from 64 words, not one Python step per word."""
        run, chunk = 0, 64
        while run < most:
            k = min(most - run, chunk)
            words = np.frombuffer(self.buf, np.uint64, k, pos + 8 * run)
            zeros = int(np.argmax(words != 0)) if words.any() else k
            del words                        # no view of the mapping left behind (it could not be closed)
            run += zeros
            if zeros < k:
                break
            chunk = min(chunk * 4, 1 << 20)
        return run

    def tensors(self, count: int) -> None:
        """The tensor infos, then llama.cpp's layout rule: the data section starts at the first
        multiple of general.alignment after them, and each tensor exactly where the one before it
        (in file order) ends, padded to the alignment; every tensor inside the file."""
        import gguf
        sizes = {int(t): s for t, s in gguf.GGML_QUANT_SIZES.items()}
        names, infos = set(), []
        for i in range(count):
            name = self.string(f"tensor #{i}'s name")
            what = f"tensor {name}"
            if name in names:
                self.fail(f"{what} appears twice")
            names.add(name)
            n_dims = self.one("I", f"{what}'s dimension count")
            if n_dims > GGML_MAX_DIMS:
                self.fail(f"{what} has {n_dims} dimensions (at most {GGML_MAX_DIMS})")
            dims = self.unpack(f"{n_dims}Q", f"{what}'s dimensions")
            if any(d >= 1 << 63 for d in dims):
                self.fail(f"{what} has a negative dimension ({list(dims)})")
            ttype = self.one("I", f"{what}'s type")
            if ttype not in sizes:
                self.fail(f"{what} has unknown type {ttype}")
            block, type_size = sizes[ttype]
            row = dims[0] if dims else 1
            if row % block:
                self.fail(f"{what} has rows of {row} values, not a multiple of its type's block ({block})")
            n = 1
            for d in dims:
                n *= d
            offset = self.one("Q", f"{what}'s offset")
            infos.append((what, n // block * type_size, offset))
        if not infos:
            return
        start = _align_up(self.pos, self.alignment)
        expected = 0
        for what, nbytes, offset in infos:
            if start + offset + nbytes > self.size:
                self.fail(f"{what} ({nbytes} bytes at data offset {offset}) ends past the end of the file "
                          f"({self.size} bytes, data from byte {start})")
            if offset != expected:
                how = ("overlaps the tensor before it" if offset < expected else
                       f"is not aligned to {self.alignment}" if offset % self.alignment else
                       "leaves a gap after the tensor before it")
                self.fail(f"{what} at data offset {offset} {how} (llama.cpp requires offset {expected}: where "
                          f"the one before it ends, padded to the alignment {self.alignment})")
            expected += _align_up(nbytes, self.alignment)


def check_header(path) -> None:
    """GGUFError (one line naming the file and the key or tensor) unless the file's header can be
    read without running past its end and its tensors are laid out as llama.cpp requires. Reads the
    header only, through a mapping: fast on files of hundreds of GB."""
    from . import mapguard
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                _Header(path, b"", size).walk()
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                mapguard.watch(path)         # a file truncated under the walk: one line, not a silent SIGBUS
                try:
                    _Header(path, buf, size).walk()
                finally:
                    mapguard.unwatch(path)
    except OSError as e:
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


class GGUFModel:
    """One GGUF model (all its split files): `config` (a Hugging Face-style config dict), `names()`
    (Hugging Face tensor names), `shape(name)`, `read(name)` (float32), `quant_type(name)`."""

    def __init__(self, path):
        self.path = Path(path)
        self.paths = shard_paths(self.path)
        self._readers, self.fields, self._tensors, self._shard = [], {}, {}, {}
        self._watched: list[Path] = []       # files whose mapping mapguard names if it faults
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        import gguf

        from . import mapguard
        for p in self.paths:
            check_header(p)                  # before GGUFReader, which trusts every count and offset
            try:
                r = gguf.GGUFReader(p)
            except Exception as e:           # the reader's own checks: magic, version, bounds, types
                raise GGUFError(f"{p}: not a readable GGUF file ({type(e).__name__}: {e})") from None
            # the reader maps the whole file: truncated while a conversion reads it, one line, not a
            # silent SIGBUS
            mapguard.watch(p)
            self._watched.append(p)
            self._readers.append(r)
            for key, field in r.fields.items():
                if not key.startswith("GGUF.") and key not in self.fields:
                    self.fields[key] = field
            for t in r.tensors:
                if t.name in self._tensors:
                    raise GGUFError(f"{p}: tensor {t.name} appears twice")
                self._tensors[t.name] = t
                self._shard[t.name] = p.name
        arch = self._get("general.architecture")
        if arch != ARCH:
            raise GGUFError(f"{self.path}: architecture {arch!r}; kimi-stream reads {ARCH!r} files (DeepSeek-V3, Kimi K2)")
        self._key = None                     # the metadata key being read (named when its value is wrong)
        with self._typed():
            self.config = self._config()
            self._check_config()
        self._map = self._names()

    @contextlib.contextmanager
    def _typed(self):
        """A metadata value of the wrong type or range, met while reading it: one error naming the key."""
        try:
            yield
        except GGUFError:
            raise
        except (TypeError, ValueError, IndexError, AttributeError, OverflowError, KeyError) as e:
            raise GGUFError(f"{self.path}: metadata key {self._key}: a value of the wrong type or range "
                            f"({type(e).__name__}: {e})") from None

    def _check_config(self) -> None:
        """What the rest relies on: a layer count the tensors have (a huge one made the name map loop
        for ever), token ids inside the vocabulary."""
        layers = {int(n.split(".")[1]) for n in self._tensors if n.startswith("blk.") and n.split(".")[1].isdigit()}
        n = self.config["num_hidden_layers"]
        if n < 1 or n > max(layers, default=-1) + 1:
            raise GGUFError(f"{self.path}: metadata key {ARCH}.block_count is {n}, but the file holds tensors of "
                            f"{max(layers, default=-1) + 1} layers")
        tokens = self._get("tokenizer.ggml.tokens") or []
        for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
            i = self._get(key)
            if i is not None and tokens and not 0 <= int(i) < len(tokens):
                raise GGUFError(f"{self.path}: metadata key {key} is {i}, outside the {len(tokens)} tokens")

    # ------------------------------------------------------------------ metadata
    def _get(self, key: str, default=None, required: bool = False):
        self._key = key
        f = self.fields.get(key)
        if f is None:
            if required:
                raise GGUFError(f"{self.path}: metadata key {key} missing")
            return default
        try:
            return f.contents()
        except Exception as e:
            raise GGUFError(f"{self.path}: metadata key {key} unreadable ({e})") from None

    def _arch(self, key: str, default=None, required: bool = False):
        return self._get(f"{ARCH}.{key}", default, required)

    def _default_gating(self, tokens) -> int:
        """llama.cpp's deepseek2 loader (src/models/deepseek2.cpp) when expert_gating_func is missing
        or 0, as in DeepSeek V2 / V2.5 files, which predate the key: softmax, but sigmoid for GLM 4.7
        Lite (47 or 48 layers besides the MTP ones, a vocabulary of 154880)."""
        a = self._arch
        layers = int(a("block_count", required=True)) - int(a("nextn_predict_layers", 0))
        vocab = int(a("vocab_size", len(tokens) if tokens else 0))
        return GATING_SIGMOID if layers in (47, 48) and vocab == 154880 else GATING_SOFTMAX

    def _config(self) -> dict:
        a = self._arch
        n_head = int(a("attention.head_count", required=True))
        rope = int(a("rope.dimension_count", required=True))
        key_mla, value_mla = a("attention.key_length_mla"), a("attention.value_length_mla")
        if key_mla is None or value_mla is None:     # the older layout: per-head sizes in key/value_length
            key_mla, value_mla = a("attention.key_length", required=True), a("attention.value_length", required=True)
        tokens = self._get("tokenizer.ggml.tokens")
        gating = int(a("expert_gating_func", GATING_NONE))
        if gating == GATING_NONE:
            gating = self._default_gating(tokens)
        if gating not in GATING:
            raise GGUFError(f"{self.path}: expert_gating_func {gating} is not softmax (1) or sigmoid (2)")
        cfg = {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "vocab_size": int(a("vocab_size", len(tokens) if tokens else 0)),
            "hidden_size": int(a("embedding_length", required=True)),
            "intermediate_size": int(a("feed_forward_length", required=True)),
            "moe_intermediate_size": int(a("expert_feed_forward_length", required=True)),
            "num_hidden_layers": int(a("block_count", required=True)),
            "num_attention_heads": n_head, "num_key_value_heads": n_head,
            "n_routed_experts": int(a("expert_count", required=True)),
            "n_shared_experts": int(a("expert_shared_count", 0)),
            "num_experts_per_tok": int(a("expert_used_count", required=True)),
            "n_group": int(a("expert_group_count", 1) or 1), "topk_group": int(a("expert_group_used_count", 1) or 1),
            "first_k_dense_replace": int(a("leading_dense_block_count", 0)),
            "q_lora_rank": int(a("attention.q_lora_rank")) if a("attention.q_lora_rank") else None,
            "kv_lora_rank": int(a("attention.kv_lora_rank", required=True)),
            "qk_rope_head_dim": rope, "qk_nope_head_dim": int(key_mla) - rope, "v_head_dim": int(value_mla),
            "rms_norm_eps": _f32(a("attention.layer_norm_rms_epsilon", required=True)),
            "rope_theta": _f32(a("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(a("context_length", required=True)),
            "routed_scaling_factor": _f32(a("expert_weights_scale", 1.0) or 1.0),
            "norm_topk_prob": bool(a("expert_weights_norm", False)),
            "scoring_func": GATING[gating], "topk_method": "noaux_tc",
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "hidden_act": "silu", "rope_interleave": True,
        }
        for key, name in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id")):
            if self._get(key) is not None:
                cfg[name] = int(self._get(key))
        if a("rope.scaling.type") == "yarn":
            factor = _f32(a("rope.scaling.factor", required=True))
            ys = {"type": "yarn", "factor": factor,
                  "original_max_position_embeddings": int(a("rope.scaling.original_context_length", required=True))}
            # llama.cpp stores 0.1 x mscale_all_dim and not mscale, which DeepSeek-V3 and Kimi K2 set
            # equal to it; its loader ignores the betas it writes, which are taken here as written
            log_mul = a("rope.scaling.yarn_log_multiplier")
            if log_mul is not None:
                ys["mscale_all_dim"] = ys["mscale"] = _f32(float(log_mul) / 0.1)
            for key, name in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
                if a(key) is not None:
                    ys[name] = _f32(a(key))
            cfg["rope_scaling"] = ys
        return cfg

    # ------------------------------------------------------------------ tensors
    def _names(self) -> dict:
        """Hugging Face name -> how to read it: ("whole", tensor) | ("expert", tensor, e) | ("kv_b", k_b, v_b) |
        ("split", tensor) for k_b_proj / v_b_proj, the same two tensors as they are (formats/layout.py)."""
        out, cfg = {}, self.config
        for g, hf in GLOBAL_TENSORS.items():
            if g in self._tensors:
                out[hf] = ("whole", self._tensors[g])
        for i in range(cfg["num_hidden_layers"]):
            p = f"blk.{i}."
            for g, hf in LAYER_TENSORS.items():
                if p + g in self._tensors:
                    out[f"model.layers.{i}.{hf}"] = ("whole", self._tensors[p + g])
            k_b, v_b = self._tensors.get(p + "attn_k_b.weight"), self._tensors.get(p + "attn_v_b.weight")
            if (k_b is None) != (v_b is None):
                raise GGUFError(f"{self.path}: layer {i} has only one of attn_k_b and attn_v_b")
            if k_b is not None:
                out[f"model.layers.{i}.self_attn.kv_b_proj.weight"] = ("kv_b", k_b, v_b)
                k_name, v_name = split_kv_b_names(i)
                out[k_name], out[v_name] = ("split", k_b), ("split", v_b)
            for g, proj in EXPERT_TENSORS.items():
                t = self._tensors.get(p + g)
                if t is None:
                    continue
                n = int(t.shape[-1])
                if n != cfg["n_routed_experts"]:
                    raise GGUFError(f"{self.path}: {t.name} holds {n} experts, the metadata says {cfg['n_routed_experts']}")
                for e in range(n):
                    out[f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"] = ("expert", t, e)
        return out

    def names(self) -> list[str]:
        return list(self._map)

    def _first(self, name: str):
        return self._map[name][1]

    def shard_of(self, name: str) -> str:
        """The file (of a split GGUF) holding the tensor, or the first of kv_b's two."""
        return self._shard[self._first(name).name]

    def offset(self, name: str) -> int:
        """Where the tensor's data starts in its file (the order to read a file front to back)."""
        t, how = self._first(name), self._map[name]
        step = int(t.n_bytes) // int(t.shape[-1]) if how[0] == "expert" else 0
        return int(t.data_offset) + step * (how[2] if how[0] == "expert" else 0)

    def has(self, name: str) -> bool:
        return name in self._map

    def quant_type(self, name: str) -> str:
        return self._map[name][1].tensor_type.name

    def shape(self, name: str) -> tuple:
        how = self._map[name]
        if how[0] == "kv_b":
            k_b, v_b = how[1], how[2]            # ne: k_b {nope, kvL, H}, v_b {kvL, v, H}
            nope, kvl, h = (int(d) for d in k_b.shape)
            return (h * (nope + int(v_b.shape[1])), kvl)
        dims = tuple(int(d) for d in reversed(how[1].shape))
        if how[0] == "split":                    # [H, rows, cols] -> [H x rows, cols]
            return (dims[0] * dims[1], dims[2])
        return dims[1:] if how[0] == "expert" else dims

    def read(self, name: str) -> np.ndarray:
        """The tensor as float32 in Hugging Face layout (the `gguf` package's dequantizer)."""
        how = self._map[name]
        if how[0] == "whole":
            return self._dequantize(how[1], how[1].data)
        if how[0] == "split":
            return self._dequantize(how[1], how[1].data).reshape(self.shape(name))
        if how[0] == "expert":
            t, e = how[1], how[2]
            return self._dequantize(t, t.data[e])
        k_b = self._dequantize(how[1], how[1].data)             # [H, kvL, nope]
        v_b = self._dequantize(how[2], how[2].data)             # [H, v, kvL]
        kvl = k_b.shape[1]
        return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, kvl)

    def _dequantize(self, t, data) -> np.ndarray:
        from gguf.quants import dequantize
        try:
            return np.ascontiguousarray(dequantize(np.asarray(data), t.tensor_type), dtype=np.float32)
        except (NotImplementedError, ValueError) as e:
            raise GGUFError(f"{self.path}: tensor {t.name} ({t.tensor_type.name}) cannot be decoded: {e}") from None

    # ------------------------------------------------------------------ blocks kept as they are
    def split_kv_b(self) -> bool:
        """Whether --quant keep keeps MLA's attn_k_b / attn_v_b as they are (k_b_proj / v_b_proj): when
        they hold quantized blocks, which kv_b_proj's layout (k_b transposed) cannot hold unchanged.
        Float ones are put back together as kv_b_proj, the same values."""
        return any(how[0] == "kv_b" and {how[1].tensor_type.name, how[2].tensor_type.name} - set(FLOAT_TYPES)
                   for how in self._map.values())

    def keep_codecs(self) -> dict[str, str]:
        """Every tensor's codec holding its GGUF values exactly: a native one (F32, F16, BF16, Q8_0 as
        q8, with fused kernels), else llama.cpp's blocks as they are (formats/ggufcodecs.py); MLA's
        kv_b in the form split_kv_b() says. GGUFError naming the types neither holds."""
        from .ggufcodecs import BLOCK_SIZES, codec_name
        out, other = {}, set()
        split = self.split_kv_b()
        for name, how in self._map.items():
            t = how[1].tensor_type.name
            if how[0] == ("split" if not split else "kv_b"):
                continue                         # the other form of the same values
            if how[0] == "kv_b":
                out[name] = EXACT_CODECS[t]
            elif t in EXACT_CODECS:
                out[name] = EXACT_CODECS[t]
            elif t in BLOCK_SIZES:
                out[name] = codec_name(t)
            else:
                other.add(t)
        if other:
            raise GGUFError(f"{self.path}: --quant keep: no kimi-stream codec holds {', '.join(sorted(other))} blocks "
                            f"as they are; choose a --quant preset to requantize")
        return out

    def kept_bytes(self, name: str, codec: str) -> np.ndarray | None:
        """The tensor in `codec`'s layout straight from its blocks, when they hold the same values
        (Q8_0 as q8: each row's scales, then its codes); None otherwise."""
        from .ggufcodecs import BLOCK_SIZES, codec_name, finite_scales
        how = self._map[name]
        if how[0] == "kv_b":
            return None
        t = how[1].tensor_type.name
        data = how[1].data if how[0] in ("whole", "split") else how[1].data[how[2]]
        kept = codec == codec_name(t) or (codec == "q8" and t == "Q8_0")
        if kept and not finite_scales(t, np.ascontiguousarray(data).view(np.uint8),
                                      Q8_0_BLOCK if t == "Q8_0" else BLOCK_SIZES[t][1]):
            raise GGUFError(f"{self.path}: tensor {how[1].name}: a block's scale is NaN or Inf")
        if codec == codec_name(t):                     # llama.cpp's blocks, row after row, unchanged
            return np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        if not kept:
            return None
        data = np.asarray(data, dtype=np.uint8)
        blocks = data.reshape(-1, data.shape[-1] // Q8_0_BLOCK, Q8_0_BLOCK)        # rows, sub-blocks, block
        return np.concatenate([blocks[:, :, :2].reshape(-1), blocks[:, :, 2:].reshape(-1)])

    # ------------------------------------------------------------------ tokenizer
    def tokenizer_files(self) -> tuple[str, dict[str, bytes]]:
        with self._typed():
            return self._tokenizer_files()

    def _tokenizer_files(self) -> tuple[str, dict[str, bytes]]:
        """The embedded tokenizer rebuilt as the files the runtime reads: ("hf", tokenizer.json and
        tokenizer_config.json) for byte-level BPE with a pre-tokenizer llama.cpp names (gpt2,
        deepseek-v3, llama3), ("tiktoken", tiktoken.model and tokenizer_config.json) for kimi-k2."""
        model = self._get("tokenizer.ggml.model")
        tokens = self._get("tokenizer.ggml.tokens")
        if model != "gpt2" or not tokens:
            raise GGUFError(f"{self.path}: tokenizer {model!r}: kimi-stream rebuilds byte-level BPE ('gpt2') tokenizers")
        types = list(self._get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
        if len(types) != len(tokens):
            raise GGUFError(f"{self.path}: metadata key tokenizer.ggml.token_type: {len(types)} entries for "
                            f"{len(tokens)} tokens")
        pre = self._get("tokenizer.ggml.pre") or "default"
        bos, eos = self._get("tokenizer.ggml.bos_token_id"), self._get("tokenizer.ggml.eos_token_id")
        config = {"bos_token": tokens[bos] if bos is not None else None,
                  "eos_token": tokens[eos] if eos is not None else None,
                  "add_bos_token": bool(self._get("tokenizer.ggml.add_bos_token", False)),
                  "add_eos_token": bool(self._get("tokenizer.ggml.add_eos_token", False)),
                  "model_max_length": self.config["max_position_embeddings"]}
        if self._get("tokenizer.chat_template"):
            config["chat_template"] = self._get("tokenizer.chat_template")
        special = [i for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
        config["added_tokens_decoder"] = {str(i): {"content": tokens[i], "special": types[i] == TOKEN_CONTROL}
                                          for i in special}
        extra = self._generation_config(tokens, eos)
        if pre == "kimi-k2":
            return "tiktoken", {"tiktoken.model": _tiktoken_model(tokens, types),
                                "tokenizer_config.json": json.dumps(config).encode(), **extra}
        if pre not in PRE_SPLITS:
            raise GGUFError(f"{self.path}: pre-tokenizer {pre!r} is not one kimi-stream rebuilds "
                            f"({', '.join(sorted(PRE_SPLITS))}, kimi-k2)")
        merges = [m.split(" ") for m in (self._get("tokenizer.ggml.merges") or [])]
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
        if PRE_SPLITS[pre]:
            pre_tok = {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": rx}, "behavior": "Isolated", "invert": False}
                for rx in PRE_SPLITS[pre]] + [{**byte_level, "use_regex": False}]}
        else:
            pre_tok = byte_level
        tj = {"version": "1.0", "truncation": None, "padding": None, "normalizer": None, "pre_tokenizer": pre_tok,
              "added_tokens": [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
                                "normalized": False, "special": types[i] == TOKEN_CONTROL} for i in special],
              "post_processor": _post_processor(config, bos), "decoder": {**byte_level, "add_prefix_space": True},
              "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                        "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                        "ignore_merges": pre in IGNORE_MERGES, "vocab": {t: i for i, t in enumerate(tokens)},
                        "merges": merges}}
        return "hf", {"tokenizer.json": json.dumps(tj, ensure_ascii=False).encode(),
                      "tokenizer_config.json": json.dumps(config, ensure_ascii=False).encode(), **extra}

    def _generation_config(self, tokens, eos) -> dict[str, bytes]:
        """generation_config.json naming every id that ends generation when the metadata names more than
        the eos token: llama.cpp also stops at tokenizer.ggml.eot_token_id and eom_token_id (a chat
        model's end of turn, e.g. <|im_end|>)."""
        ids = []
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            i = self._get(key)
            if i is None:
                continue
            if not isinstance(i, int) or not 0 <= i < len(tokens):
                raise GGUFError(f"{self.path}: metadata key {key}: {i!r} is not a token id (0..{len(tokens) - 1})")
            if i not in ids:
                ids.append(i)
        if ids == ([eos] if eos is not None else []):
            return {}
        return {"generation_config.json": json.dumps({"eos_token_id": ids}).encode()}

    def close(self) -> None:
        from . import mapguard
        self._readers.clear()
        self._tensors.clear()
        while self._watched:
            mapguard.unwatch(self._watched.pop())
