"""One model answering a sequence of requests (the server, the interactive chat): the KV cache of the
last conversation is kept, and a request whose prompt starts with the same tokens only computes the
rest (prefix caching). Text comes out incrementally, whole characters only, with stop strings held
back until they can be ruled out. Counters for /metrics and /stats."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .generate import GenerationStats, generate
from .model import Model
from .sampler import Sampler
from .telemetry import Telemetry, proc_status
from .tokenizer import Tokenizer

_STARTED = time.monotonic()
# TextStream decodes the ids after a cut at each token and the head before it once: every FREEZE_EVERY
# tokens it tries to move the cut to FREEZE_KEEP tokens before the end (decoding the whole text anew
# every token had cost 0.4 ms a token at 4000 tokens of the bundled tokenizer, against a 10 ms step)
FREEZE_EVERY = 64
FREEZE_KEEP = 8


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    cancelled: object = None          # a callable: True once the caller no longer wants tokens


@dataclass
class Result:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0            # prompt tokens whose keys and values were already in the cache
    finish_reason: str = ""           # "stop" (end of sequence or a stop string), "length", "cancelled"
    stats: GenerationStats = field(default_factory=GenerationStats)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Counters:
    requests: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0          # prompt tokens run through the model
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0


class TextStream:
    """Generated ids → text: only complete characters, and never a tail that might begin a stop
    string. `push` returns the new text that is safe to show; `stopped` is set once a stop string
    appears (the text is cut before it). Each push searches for the stop strings only where the new
    text could hold one (the new characters, and as far back before them as a stop string reaches),
    and for the held-back tail compares only the candidate lengths ending in the text's last
    character: a long stop string costs about its length per token, not its square."""

    def __init__(self, tok: Tokenizer, stop: tuple[str, ...] = (), skip: set[int] = frozenset()):
        self.tok, self.stop, self.skip = tok, tuple(s for s in stop if s), skip
        self.ids: list[int] = []
        self.text = ""           # the text so far (up to a stop string)
        self.shown = 0           # how much of it has been handed out
        self.stopped = False
        self._searched = ""      # the text last searched for stop strings (none was found in it)
        self._frozen, self._head = 0, ""   # decode(ids[:_frozen]), kept (_decoded)
        self._next = FREEZE_EVERY + FREEZE_KEEP     # the length at which to try moving the cut

    def _decoded(self) -> str:
        """decode(ids), in time that does not grow with the text: the head before the cut decoded once,
        the ids after it each time. The cut moves only where the whole text decoded anew equals the two
        parts joined: a character split between two tokens, or a decoder that joins tokens with
        context (a leading-space rule), leaves it where it was."""
        n = len(self.ids)
        if n < self._next:
            return self._head + self.tok.decode(self.ids[self._frozen:])
        whole, c = self.tok.decode(self.ids), n - FREEZE_KEEP
        head = self._head + self.tok.decode(self.ids[self._frozen:c])
        if whole == head + self.tok.decode(self.ids[c:]):
            self._frozen, self._head = c, head
        self._next = n + FREEZE_EVERY
        return whole

    def push(self, tid: int) -> str:
        if tid not in self.skip:
            self.ids.append(tid)
        text = self._decoded()
        if text.endswith("\ufffd"):
            # an incomplete UTF-8 sequence: the characters before it are final, so a stop string
            # completed there ends the text now; the rest waits for the next token
            if self._cut(text.rstrip("\ufffd")):
                return self._flush(len(self.text))
            return ""
        if self._cut(text):
            return self._flush(len(self.text))
        self.text = text
        return self._flush(len(text) - max((_held(text, s) for s in self.stop), default=0))

    def finish(self) -> str:
        """The rest, even an incomplete character, once generation has ended (cut at a stop string
        if one is there: `stopped` is then set)."""
        if not self.stopped:
            text = self._decoded()
            if not self._cut(text):
                self.text = text
        return self._flush(len(self.text))

    def _cut(self, text: str) -> bool:
        """Whether a stop string occurs in `text`; if so the text is cut before the first one and
        `stopped` set. Only the part that is new since the last search is looked at (with the
        characters before it that a stop string reaching into the new part may start on)."""
        if not self.stop:
            return False
        old = self._searched
        grown = text.startswith(old)        # else (a decoder that rewrote its tail) search it all
        cut = -1
        for s in self.stop:
            i = text.find(s, max(0, len(old) - len(s) + 1) if grown else 0)
            if i >= 0 and (cut < 0 or i < cut):
                cut = i
        if cut < 0:
            self._searched = text
            return False
        self.text, self.stopped = text[:cut], True
        return True

    def _flush(self, upto: int) -> str:
        out = self.text[self.shown:upto] if upto > self.shown else ""
        self.shown = max(self.shown, upto)
        return out


def _held(text: str, s: str) -> int:
    """The length of the longest end of `text` that begins the stop string `s` (less than len(s)):
    only lengths whose last character is text's last one are compared."""
    if not text:
        return 0
    last = text[-1]
    k = min(len(s) - 1, len(text))
    while k > 0:
        k = s.rfind(last, 0, k) + 1         # the longest candidate <= k ending in `last`
        if k and text.endswith(s[:k]):
            return k
        k -= 1
    return 0


class Engine:
    def __init__(self, model: Model, tok: Tokenizer, stop_ids: set[int], prefill_batch: int, pager,
                 prefix_cache: bool = True, tuner=None, prompt_window: int | None = None):
        """tuner: a threadtune.ThreadTuner timing every request's decode steps (or None); prompt_window:
        prompts go that many tokens a layer at a time (generate's window)."""
        self.model, self.tok, self.stop_ids, self.prefill_batch, self.pager = model, tok, stop_ids, prefill_batch, pager
        self.prompt_window = prompt_window
        self.prefix_cache, self.tuner = prefix_cache, tuner
        self.ids: list[int] = []           # the tokens whose keys and values the cache holds, in order
        self.counters = Counters()
        self.last: Result | None = None

    @property
    def max_context(self) -> int:
        return self.model.cache.max_context

    def reset(self) -> None:
        """Forget the kept conversation."""
        self.ids = []
        self.model.reset()

    def _reuse(self, prompt_ids: list[int]) -> int:
        # At least the prompt's last token is run again: its logits choose the first new token.
        n = min(common_prefix(self.ids, prompt_ids), len(prompt_ids) - 1) if self.prefix_cache else 0
        self.ids = self.ids[:n]
        self.model.cache.length = n
        return n

    def run(self, req: Request, result: Result | None = None):
        """Generate for `req`, yielding pieces of text as they become final; `result` (returned by
        the generator too) holds the counts and the finish reason."""
        res = result if result is not None else Result()
        res.prompt_tokens = len(req.prompt_ids)
        c = self.counters
        c.requests += 1
        c.prompt_tokens += len(req.prompt_ids)
        cached = self._reuse(req.prompt_ids)
        res.cached_tokens = cached
        c.cached_tokens += cached
        sampler = Sampler(req.temperature, req.top_p, req.seed)
        text = TextStream(self.tok, req.stop, self.stop_ids)
        suffix = req.prompt_ids[cached:]
        telemetry = Telemetry(self.pager, tuner=self.tuner)
        fed = list(req.prompt_ids)         # what the cache holds once each step is done
        try:
            for tid in generate(self.model, suffix, req.max_tokens, sampler, self.prefill_batch,
                                self.stop_ids, res.stats, None, telemetry, req.cancelled, self.prompt_window):
                res.token_ids.append(tid)
                fed.append(tid)
                piece = text.push(tid)
                if piece:
                    yield piece
                if text.stopped:
                    res.finish_reason = "stop"
                    break
            tail = text.finish()            # a stop string may end there (one before an incomplete character)
            if not res.finish_reason:
                res.finish_reason = {"eos": "stop", "cancelled": "cancelled"}.get(res.stats.stop_reason, "length")
                if text.stopped and res.finish_reason != "cancelled":
                    res.finish_reason = "stop"
                c.cancelled += res.finish_reason == "cancelled"
            if tail:
                yield tail
        finally:
            # whatever happened (an interrupt in the middle of a step too), the kept ids match the cache
            self.ids = fed[:self.model.cache.length]
            c.computed_tokens += max(0, min(len(req.prompt_ids), self.model.cache.length) - cached)
            telemetry.close()
            res.text = text.text
            c.generated_tokens += len(res.token_ids)
            c.prefill_seconds += res.stats.prefill_seconds
            c.decode_seconds += res.stats.decode_seconds
            c.decode_steps += len(res.stats.token_seconds)
            self.last = res
        return res

    def complete(self, req: Request) -> Result:
        res = Result()
        for _ in self.run(req, res):
            pass
        return res

    def metrics(self) -> dict:
        """Counters since start, the expert cache's and the process's memory figures."""
        c, s = self.counters, self.pager.stats
        mem = proc_status()
        return {
            "requests": c.requests, "requests_cancelled": c.cancelled,
            "prompt_tokens": c.prompt_tokens, "prompt_tokens_cached": c.cached_tokens,
            "prompt_tokens_computed": c.computed_tokens, "generated_tokens": c.generated_tokens,
            "prefill_seconds": round(c.prefill_seconds, 6), "decode_seconds": round(c.decode_seconds, 6),
            "decode_tokens_per_second": round(c.decode_steps / c.decode_seconds, 3) if c.decode_seconds else 0.0,
            "prefill_tokens_per_second": round(c.computed_tokens / c.prefill_seconds, 3) if c.prefill_seconds else 0.0,
            "kept_tokens": len(self.ids),
            "expert_cache_hits": s.hits, "expert_cache_misses": s.misses,
            "expert_cache_hit_rate": round(s.hit_rate, 4), "expert_bytes_read": s.bytes_read,
            "expert_cache_evictions": s.evictions, "io_wait_seconds": round(s.io_wait_s, 6),
            "rss_bytes": mem.get("VmRSS", 0), "peak_rss_bytes": mem.get("VmHWM", 0),
            "uptime_seconds": round(time.monotonic() - _STARTED, 3),
        }

