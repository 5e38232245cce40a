"""Tokenizers embedded in a weight file: Hugging Face `tokenizer.json` (via the `tokenizers`
library) or Kimi's `tiktoken.model` + `tokenizer_config.json` (via `tiktoken`, with the model's own
split pattern and special tokens), plus chat-template rendering in a jinja2 sandbox."""

from __future__ import annotations

import base64
import json
import re

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
# Kimi's encode() cuts text into <=400k-char windows, then each window wherever a run of whitespace or of
# non-whitespace exceeds 25k chars (tiktoken's regex slows down badly on very long runs), and encodes
# the pieces separately.
KIMI_MAX_ENCODE_CHARS = 400_000
KIMI_MAX_RUN_CHARS = 25_000
# Named special tokens transformers hands to a chat template (`special_tokens_map`).
_TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerError(ValueError):
    pass


def _json_file(files, name):
    if name not in files:
        return {}
    try:
        doc = json.loads(files[name])
    except ValueError as e:
        raise TokenizerError(f"{name}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise TokenizerError(f"{name}: not a JSON object")
    return doc


def _generation_stop_ids(files) -> set[int]:
    """generation_config.json's eos_token_id: what transformers' generate() stops at. A chat model's
    end of turn may be named only there (Kimi K2 Instruct ends a turn with <|im_end|>, while its
    config.json's eos_token_id is [EOS])."""
    eos = _json_file(files, "generation_config.json").get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise TokenizerError("generation_config.json: eos_token_id must be a token id or a list of token ids")
    return set(ids)


def _token_content(tok):
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class Tokenizer:
    """encode/decode/chat for one model; built from the tokenizer files' bytes."""

    def __init__(self, kind: str, files: dict[str, bytes]):
        self.kind = kind
        self.config = _json_file(files, "tokenizer_config.json")
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
        named = dict(self.config)
        if "added_tokens_decoder" not in named and "special_tokens_map.json" in files:
            named.update(_json_file(files, "special_tokens_map.json"))  # legacy files, as transformers reads them
        self.named_tokens = {k: t for k in _TEMPLATE_TOKENS if (t := _token_content(named.get(k))) is not None}
        self.bos_token = self.named_tokens.get("bos_token")
        self.eos_token = self.named_tokens.get("eos_token")
        self.chat_template = _default_template(self.config.get("chat_template"))
        self._generation_stops = _generation_stop_ids(files)
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
                got = line[:60].decode(errors="replace")
                raise TokenizerError(f"tiktoken.model line {n}: expected 'BASE64 RANK', got {got!r}") from None
        if sorted(ranks.values()) != list(range(len(ranks))):
            raise TokenizerError(f"tiktoken.model: ranks are not 0..{len(ranks) - 1}, each once")
        n_base = len(ranks)
        named = {int(i): _token_content(t) for i, t in self.config.get("added_tokens_decoder", {}).items()}
        n_special = max(KIMI_RESERVED_SPECIAL, max(named, default=0) - n_base + 1)
        special = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n_base, n_base + n_special)}
        try:
            self._tt = tiktoken.Encoding(name="kimi", pat_str=self.config.get("pat_str", KIMI_PATTERN),
                                         mergeable_ranks=ranks, special_tokens=special)
        except ValueError as e:
            raise TokenizerError(f"tiktoken.model: {e}") from None
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

    @property
    def stop_ids(self) -> set[int]:
        """The ids that end generation: the eos token's and generation_config.json's."""
        return {i for i in (self.eos_id, *self._generation_stops) if i is not None}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids as the reference tokenizer gives them; special tokens in the text are recognised."""
        if self.kind == "hf":
            return self._hf.encode(text, add_special_tokens=add_special_tokens).ids
        ids = [i for piece in _kimi_pieces(text) for i in self._tt.encode(piece, allowed_special="all")]
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

    def chat_markers(self) -> dict[str, int | None]:
        """The chat template's role markers (<|im_start|>, DeepSeek's <｜User｜>, ...) and the one token
        each is in this vocabulary, or None where the tokenizer splits it (a template the model cannot
        have been trained on)."""
        found = set(re.findall(r"<\|[^|<>\s]{1,40}\|>|<\uff5c[^\uff5c<>\s]{1,40}\uff5c>", self.chat_template or ""))
        out = {}
        for m in sorted(found):
            ids = self.encode(m, add_special_tokens=False)
            out[m] = ids[0] if len(ids) == 1 else None
        return out

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text, rendered as transformers' `apply_chat_template(..., tokenize=False)` does."""
        if not self.chat_template:
            raise TokenizerError("this model's tokenizer has no chat template (drop --chat)")
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        limit = TEMPLATE_MAX_CHARS + 4 * sum(len(str(m.get("content", ""))) for m in messages)
        try:
            template = _chat_env(limit).from_string(self.chat_template)
            pieces, size = [], 0
            with _deadline(TEMPLATE_SECONDS):
                for piece in template.generate(messages=messages, tools=None, documents=None,
                                               add_generation_prompt=add_generation_prompt, **self.named_tokens):
                    size += len(piece)
                    if size > limit:
                        raise TokenizerError(f"chat template: output exceeds {limit} characters")
                    pieces.append(piece)
            return "".join(pieces)
        except TokenizerError:
            raise
        except _TemplateTimeout:
            raise TokenizerError(f"chat template: rendering took longer than {TEMPLATE_SECONDS} s") from None
        except RecursionError:
            raise TokenizerError("chat template: recursion too deep") from None
        except Exception as e:       # a template is untrusted code: whatever it raises is its error
            msg = " ".join(str(e).split())[:200]
            raise TokenizerError(f"chat template: {type(e).__name__}: {msg}") from None


def _default_template(template):
    """tokenizer_config.json may hold several named templates ([{name, template}] or {name: template})."""
    if isinstance(template, list):
        template = {t["name"]: t["template"] for t in template}
    if isinstance(template, dict):
        return template.get("default")
    return template


# A chat template is code from the model's files: it runs in a sandbox, and also within bounds of
# time and of the size of anything it builds.
TEMPLATE_SECONDS = 2.0
TEMPLATE_MAX_CHARS = 1 << 20


class _TemplateTimeout(Exception):
    pass


class _deadline:
    """Raise _TemplateTimeout in the rendering code once `seconds` have passed: a trace function,
    so it works on any thread and interrupts loops that print nothing."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __enter__(self):
        import sys
        import time
        end = time.monotonic() + self.seconds

        def tracer(frame, event, arg):
            if time.monotonic() > end:
                raise _TemplateTimeout
            return tracer
        self.previous = sys.gettrace()
        sys.settrace(tracer)

    def __exit__(self, *exc):
        import sys
        sys.settrace(self.previous)


def _chat_env(limit: int = TEMPLATE_MAX_CHARS):
    """A jinja2 sandbox with the filters and globals transformers gives chat templates, where no
    string or list a template builds may exceed `limit` items."""
    from datetime import datetime

    import jinja2.ext
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "+"])

        def call_binop(self, context, operator, left, right):
            sized = (str, list, tuple)
            if operator == "*" and (isinstance(left, sized) or isinstance(right, sized)):
                seq, n = (left, right) if isinstance(left, sized) else (right, left)
                if isinstance(n, int) and len(seq) * max(n, 0) > limit:
                    raise TemplateError(f"a template value would exceed {limit} items")
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > 1024:
                raise TemplateError("a template exponent is too large")
            if operator == "+" and isinstance(left, sized) and isinstance(right, sized):
                if len(left) + len(right) > limit:
                    raise TemplateError(f"a template value would exceed {limit} items")
            return super().call_binop(context, operator, left, right)

    def raise_exception(msg):
        raise TemplateError(msg)

    def tojson(v, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(v, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _kimi_pieces(text: str):
    """Kimi's encode-time split (KIMI_MAX_ENCODE_CHARS windows, runs capped at KIMI_MAX_RUN_CHARS)."""
    if len(text) <= KIMI_MAX_RUN_CHARS:
        yield text
        return
    for start in range(0, len(text), KIMI_MAX_ENCODE_CHARS):
        window = text[start:start + KIMI_MAX_ENCODE_CHARS]
        cut, run, space = 0, 0, window[:1].isspace()
        for i, ch in enumerate(window):
            if ch.isspace() != space:
                run, space = 1, not space
            else:
                run += 1
                if run > KIMI_MAX_RUN_CHARS:
                    yield window[cut:i]
                    cut, run = i, 1
        yield window[cut:]
