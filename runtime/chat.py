"""`kimi-run --chat` on a terminal: a conversation in the model's chat template, streamed as it is
generated. The engine keeps the conversation's KV cache, so each turn computes only its new tokens.
/reset forgets the conversation, /stats shows the counters, Ctrl-C stops an answer (not the chat),
Ctrl-D or /exit quits."""

from __future__ import annotations

import sys

from kimistream.formats.sizes import fmt

from .engine import Engine, Request, Result
from .tokenizer import TokenizerError

HELP = ("/reset forgets the conversation, /stats shows counters, Ctrl-C stops an answer, Ctrl-D or /exit quits; "
        "a line ending in \\ goes on on the next (in \\\\: ends, with one \\), // starts a message with /")


def read_message(inp) -> str:
    """One message: a line ending in a backslash goes on on the next (the backslash dropped), one
    ending in two ends there with one of them kept (a path or code that ends in a backslash)."""
    line = inp("> ")
    while line.endswith("\\") and not line.endswith("\\\\"):
        line = line[:-1] + "\n" + inp(". ")
    return line[:-1] if line.endswith("\\\\") else line


def _stats(engine: Engine, out) -> None:
    m = engine.metrics()
    out.write(f"turns {m['requests']}; prompt tokens {m['prompt_tokens']} ({m['prompt_tokens_cached']} from the "
              f"kept cache, {m['prompt_tokens_computed']} computed); generated {m['generated_tokens']} at "
              f"{m['decode_tokens_per_second']:.1f} tok/s; context {m['kept_tokens']} of {engine.max_context} "
              f"tokens\nexpert cache hit rate {m['expert_cache_hit_rate']:.1%}, experts read "
              f"{fmt(m['expert_bytes_read'])}; RSS {fmt(m['rss_bytes'])}, peak {fmt(m['peak_rss_bytes'])}\n")


def repl(engine: Engine, args, inp=input, out=sys.stdout) -> int:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    tok = engine.tok
    messages: list[dict] = []
    out.write(f"kimi-run chat: {HELP}\n")
    while True:
        try:
            line = read_message(inp)
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:
            out.write("\n")
            continue
        cmd = line.strip()
        if not cmd:
            continue
        if cmd in ("/exit", "/quit"):
            return 0
        if cmd == "/reset":
            messages.clear()
            engine.reset()
            out.write("(conversation forgotten)\n")
            continue
        if cmd == "/stats":
            _stats(engine, out)
            continue
        if cmd.startswith("//"):                # text that starts with a slash, not a command
            line = line.replace("//", "/", 1)
        elif cmd.startswith("/") and " " not in cmd:
            out.write(f"unknown command {cmd}: {HELP}\n")
            continue
        messages.append({"role": "user", "content": line})
        try:
            ids = tok.encode(tok.render_chat(messages), add_special_tokens=False)
        except TokenizerError as e:
            messages.pop()
            out.write(f"error: {e}\n")
            continue
        room = engine.max_context - len(ids)
        if room < 1:
            messages.pop()
            out.write(f"the conversation ({len(ids)} tokens) fills the context of {engine.max_context}: /reset to "
                      f"start over, or a larger --max-context\n")
            continue
        req = Request(ids, min(args.max_tokens or room, room), args.temperature, args.top_p, args.seed)
        res = Result()
        pieces = engine.run(req, res)
        try:
            for piece in pieces:
                out.write(piece)
                out.flush()
            if res.finish_reason == "length":
                out.write(" [length]")
        except KeyboardInterrupt:
            out.write(" [stopped]")
        finally:
            pieces.close()         # the engine keeps only what the cache holds
        out.write("\n")
        messages.append({"role": "assistant", "content": res.text})
