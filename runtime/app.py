"""What `kimi-run` does once its flags are parsed: open the weights, report, generate, stream the
text, and emit the stats (text or JSON)."""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

import numpy as np

from kimistream.formats.weightfile import WeightFileError

from .bundled import BundledModelError, default_weights
from .generate import GenerationStats, generate
from .model import ContextFull, KVCache, Model
from .sampler import Sampler
from .tokenizer import Tokenizer, TokenizerError
from .weights import ModelWeights


def _log(msg: str) -> None:
    print(f"kimi-run: {msg}", file=sys.stderr, flush=True)


def _fail(msg: str) -> int:
    print(f"kimi-run: error: {msg}", file=sys.stderr, flush=True)
    return 1


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _TextStream:
    """Decode the growing id list and write only the new, complete characters."""

    def __init__(self, tok: Tokenizer, out):
        self.tok, self.out, self.ids, self.done = tok, out, [], ""

    def push(self, tid: int) -> None:
        self.ids.append(tid)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return   # an incomplete UTF-8 sequence: wait for the next token
        if self.out is not None:
            self.out.write(text[len(self.done):])
            self.out.flush()
        self.done = text

    def finish(self) -> None:
        """Write whatever is left, even an incomplete character, when generation ends."""
        text = self.tok.decode(self.ids)
        if self.out is not None and text != self.done:
            self.out.write(text[len(self.done):])
        self.done = text


def run(args) -> int:
    log = (lambda m: None) if args.quiet else _log
    if args.prompt is None:
        return _fail("--prompt is required")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    for flag in ("max_tokens", "prefill_batch_size"):
        if getattr(args, flag) < (0 if flag == "max_tokens" else 1):
            return _fail(f"--{flag.replace('_', '-')} must be {'>= 0' if flag == 'max_tokens' else '>= 1'}")
    try:
        sampler = Sampler(args.temperature, args.top_p, args.seed)
        path = Path(args.weights) if args.weights else default_weights(log)
        weights = ModelWeights(path)
    except (WeightFileError, BundledModelError, ValueError) as e:
        return _fail(str(e))
    cfg, header = weights.config, weights.header
    try:
        tok_meta = header.get("tokenizer") or {}
        tok = Tokenizer(tok_meta.get("kind", ""), {n: weights.file.blob(n) for n in tok_meta.get("files", [])})
        if args.chat:
            text = tok.render_chat([{"role": "user", "content": prompt}])
            prompt_ids = tok.encode(text, add_special_tokens=False)
        else:
            prompt_ids = tok.encode(prompt)
    except (TokenizerError, KeyError) as e:
        return _fail(f"{path}: tokenizer: {e}")

    max_ctx = args.max_context or min(4096, cfg.max_position_embeddings)
    resident = weights.load_resident()
    try:
        model = Model(weights, max_ctx)
    except ValueError as e:
        return _fail(str(e))
    codecs = sorted({t.codec for t in weights.file.tensors.values()})
    plan = header.get("plan", {}).get("classes", {})
    log(f"{path.name}: {cfg.num_hidden_layers} layers ({len(cfg.moe_layers)} MoE), "
        f"{cfg.n_routed_experts} routed experts top-{cfg.num_experts_per_tok}, "
        f"{cfg.n_shared_experts} shared, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}")
    log(f"codecs: {', '.join(codecs)}; plan: " + ", ".join(f"{k}={v}" for k, v in plan.items()))
    log(f"tokenizer: {tok.kind}, {tok.vocab_size} tokens; prompt {len(prompt_ids)} tokens")
    log(f"resident {resident / 2**20:.1f} MiB (+{(weights.decoded_bytes + model.decoded_resident_bytes) / 2**20:.1f} MiB "
        f"decoded), KV cache {KVCache.bytes_for(cfg, max_ctx) / 2**20:.1f} MiB for {max_ctx} tokens")
    log("mmap weight file: OK")

    stats = GenerationStats()
    dump = None
    if args.dump_logits:
        def dump(all_logits):
            target = Path(args.dump_logits)
            tmp = target.with_name(target.name + ".partial.npy")
            np.save(tmp, np.ascontiguousarray(all_logits, dtype=np.float32))
            os.replace(tmp, target)

    stop_ids = {i for i in (tok.eos_id, *cfg.eos_token_ids) if i is not None}
    stream = _TextStream(tok, None if args.json else sys.stdout)
    try:
        for tid in generate(model, prompt_ids, args.max_tokens, sampler, args.prefill_batch_size,
                            stop_ids, stats, dump):
            stream.push(tid)
    except ContextFull as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        log("interrupted")
    stream.finish()
    if not args.json:
        sys.stdout.write("\n")
    report = {
        "prefill_tokens_per_s": round(stats.prefill_tokens_per_s, 3),
        "decode_tokens_per_s": round(stats.decode_tokens_per_s, 3),
        "peak_rss_bytes": peak_rss_bytes(),
        "resident_bytes": resident,
        "experts_touched": len(weights.experts_touched),
        "experts_total": cfg.n_routed_experts * len(cfg.moe_layers),
        "expert_bytes_touched": weights.expert_bytes_touched,
        "prefill_seconds": round(stats.prefill_seconds, 4),
        "decode_seconds": round(stats.decode_seconds, 4),
        "stop_reason": stats.stop_reason,
    }
    if args.json:
        print(json.dumps({"prompt_tokens": prompt_ids, "tokens": stream.ids,
                          "text": tok.decode(stream.ids), "stats": report}))
    else:
        log(f"{stats.prompt_tokens} prompt tokens at {report['prefill_tokens_per_s']:.1f} tok/s, "
            f"{stats.generated_tokens} generated at {report['decode_tokens_per_s']:.1f} tok/s ({stats.stop_reason}); "
            f"experts touched {report['experts_touched']}/{report['experts_total']}; "
            f"peak RSS {report['peak_rss_bytes'] / 2**20:.1f} MiB")
    weights.close()
    return 0
