"""Tokenizers embedded in a weight file: Hugging Face `tokenizer.json` (via the `tokenizers`
library) or Kimi's `tiktoken.model` + `tokenizer_config.json` (via `tiktoken`, with the model's own
split pattern and special tokens), plus chat-template rendering in a jinja2 sandbox."""

from __future__ import annotations

import base64
import json

# Kimi K2's pre-tokenisation pattern (from its tokenizer definition): Han runs, cased words with
# optional English contractions, 1-3 digit numbers, punctuation runs, newlines and spaces.
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
KIMI_RESERVED_SPECIAL = 256


class TokenizerError(ValueError):
    pass


def _token_content(tok):
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class Tokenizer:
    """encode/decode/chat for one model; built from the tokenizer files' bytes."""

    def __init__(self, kind: str, files: dict[str, bytes]):
        self.kind = kind
        self.config = json.loads(files["tokenizer_config.json"]) if "tokenizer_config.json" in files else {}
        if kind == "hf":
            from tokenizers import Tokenizer as HFTokenizer
            try:
                self._hf = HFTokenizer.from_str(files["tokenizer.json"].decode())
            except Exception as e:
                raise TokenizerError(f"tokenizer.json: cannot load ({e})") from None
            self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
            self._special = {t.content: i for i, t in self._hf.get_added_tokens_decoder().items() if t.special}
        elif kind == "tiktoken":
            self._init_tiktoken(files)
        else:
            raise TokenizerError(f"unknown tokenizer kind {kind!r}")
        self.bos_token = _token_content(self.config.get("bos_token"))
        self.eos_token = _token_content(self.config.get("eos_token"))
        self.chat_template = self.config.get("chat_template")
        if "chat_template.jinja" in files:
            self.chat_template = files["chat_template.jinja"].decode()

    def _init_tiktoken(self, files):
        import tiktoken
        if "tiktoken.model" not in files:
            raise TokenizerError("tiktoken tokenizer without tiktoken.model")
        ranks = {}
        for n, line in enumerate(files["tiktoken.model"].splitlines(), 1):
            if not line.strip():
                continue
            try:
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
            except ValueError:
                raise TokenizerError(f"tiktoken.model line {n}: expected 'BASE64 RANK'") from None
        n_base = len(ranks)
        named = {int(i): _token_content(t) for i, t in self.config.get("added_tokens_decoder", {}).items()}
        n_special = max(KIMI_RESERVED_SPECIAL, max(named, default=0) - n_base + 1)
        special = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n_base, n_base + n_special)}
        self._tt = tiktoken.Encoding(name="kimi", pat_str=self.config.get("pat_str", KIMI_PATTERN),
                                     mergeable_ranks=ranks, special_tokens=special)
        self._special = special
        self.vocab_size = n_base + n_special

    # ----- ids
    def token_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        if self.kind == "hf":
            return self._hf.token_to_id(token)
        return self._special.get(token)

    @property
    def bos_id(self):
        return self.token_id(self.bos_token)

    @property
    def eos_id(self):
        return self.token_id(self.eos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids as the reference tokenizer gives them; special tokens in the text are recognised."""
        if self.kind == "hf":
            return self._hf.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self._tt.encode(text, allowed_special="all")
        if add_special_tokens and self.config.get("add_bos_token") and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if self.kind == "hf":
            return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)
        if skip_special_tokens:
            specials = set(self._special.values())
            ids = [i for i in ids if i not in specials]
        return self._tt.decode(ids)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise TokenizerError("this model's tokenizer has no chat template (drop --chat)")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg):
            raise TemplateError(msg)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as e:
            raise TokenizerError(f"chat template: {e}") from None
