"""Tokenizer test fixtures: small byte-level BPEs trained with `tokenizers`, written as an HF directory
or as a Kimi-style tiktoken directory, and the reference tokenizers transformers builds from them."""

from __future__ import annotations

import base64
import json
from pathlib import Path

# Copied from Moonshot's tokenization_kimi.py (TikTokenTokenizer.pat_str), independently of the runtime.
KIMI_PAT = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

SAMPLES = {
    "prose": "The quick brown fox jumps over the lazy dog. It's what they'd've said; WE'LL SEE, don't we?",
    "code": "def f(x):\n\tif x:\n\t\treturn x ** 2  # square\n    else:\n        pass\n\nprint(f(3))\n",
    "accents": "Ünïcödé café naïve façade Æsir Œuvre Ångström",
    "cjk": "日本語のテキスト、中文字符和汉字。한국어 텍스트 漢字abc中文DEF",
    "emoji": "emoji 🙂👍🏽 family 👨‍👩‍👧 flag 🇯🇵!",
    "rtl": "مرحبا بالعالم — שָׁלוֹם עולם",
    "combining": "e\u0301 a\u0308 n\u0303 Z\u0351\u0308\u0313 क्षि",
    "numbers": "1234567 3.14159 1,000,000 ٣٤٥ ²³ Ⅻ 0x1F",
    "whitespace": "a  b   c\t\t d \n\n\n   \n  end   ",
    "crlf": "line1\r\nline2\r\n\r\n  indented\r\n",
    "contractions": "I'M HERE, You'Re ſ'S it'S ok'd",
    "specials": "<|im_start|>user\nhi<|im_end|>\nx<|im_user|>y<|im_middle|>z[BOS]<|im_start",
    "empty": "",
}

CORPUS = list(SAMPLES.values()) * 8 + [
    "Pack my box with five dozen liquor jugs. Sphinx of black quartz, judge my vow!",
    "for i in range(10):\n\tprint(i * i)\n",
    "東京は日本の首都です。北京是中国的首都。Привет, мир! Γειά σου κόσμε.",
]

KIMI_NAMED = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
              6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
              17: "<|im_middle|>"}  # offsets from len(ranks), as in Kimi K2's tokenizer_config.json

CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools is not none %}TOOLS{% endif %}{% if pad_token is defined %}[{{ pad_token }}]{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and not loop.first %}{{ raise_exception('system message must come first') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.meta is defined %}{{ m.meta | tojson(separators=(',', ':')) }}{% endif %}"
    "{% if m.tool_calls is defined %}[calls]{% endif %}<|im_end|>\n"
    "{% if loop.index >= 8 %}{% break %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_bpe(vocab_size: int, specials=()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def write_hf_dir(out: Path) -> None:
    from tokenizers import processors
    tok = train_bpe(500, ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"])
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 0)])
    tok.save(str(out / "tokenizer.json"))
    # add_bos_token=false is overridden by tokenizer.json's post-processor in transformers; the runtime must agree
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False, "chat_template": CHAT_TEMPLATE}))
    # legacy file, read by transformers when the config has no added_tokens_decoder
    (out / "special_tokens_map.json").write_text(json.dumps({"pad_token": {"content": "<|eos|>", "lstrip": False}}))


def hf_ranks(tok) -> dict[bytes, int]:
    """tiktoken ranks from a byte-level BPE: the 256 bytes, then each merge's token in merge order."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    to_byte = {ch: b for b, ch in bytes_to_unicode().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for merge in json.loads(tok.to_str())["model"]["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        ranks[bytes(to_byte[c] for c in left + right)] = len(ranks)
    return ranks


def write_tiktoken_dir(out: Path, **config) -> int:
    """Writes tiktoken.model + tokenizer_config.json; returns the number of ranks."""
    ranks = hf_ranks(train_bpe(1200))
    (out / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    n = len(ranks)
    decoder = {str(n + k): {"content": c, "special": True} for k, c in KIMI_NAMED.items()}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": decoder, "bos_token": "[BOS]", "eos_token": "[EOS]", **config}))
    return n


def kimi_special_names(n_base: int) -> list[str]:
    """Kimi's 256 special tokens in id order: named from added_tokens_decoder, else <|reserved_token_{id}|>."""
    return [KIMI_NAMED.get(i - n_base, f"<|reserved_token_{i}|>") for i in range(n_base, n_base + 256)]


def tiktoken_reference(out: Path, n_base: int):
    """transformers' own tiktoken conversion (a `tokenizers` BPE) with Kimi's pattern and special tokens,
    wrapped as a transformers fast tokenizer."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter
    backend = TikTokenConverter(vocab_file=str(out / "tiktoken.model"), pattern=KIMI_PAT,
                                extra_special_tokens=kimi_special_names(n_base)).converted()
    config = json.loads((out / "tokenizer_config.json").read_text())
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=config["bos_token"],
                                   eos_token=config["eos_token"], chat_template=config.get("chat_template"))


def kimi_chunks(s: str, window: int = 400_000, run: int = 25_000):
    """Moonshot's encode-time split (TIKTOKEN_MAX_ENCODE_CHARS, _split_whitespaces_or_nonwhitespaces)."""
    for i in range(0, len(s), window):
        part = s[i:i + window]
        length, is_space, start = 0, part[:1].isspace(), 0
        for j, ch in enumerate(part):
            if is_space ^ ch.isspace():
                length, is_space = 1, ch.isspace()
            else:
                length += 1
                if length > run:
                    yield part[start:j]
                    start, length = j, 1
        yield part[start:]
