"""kimi-run: generate text from a kimi-stream weight file over mmap. Routed experts are touched only
when a token is routed to them; everything else is resident. Logs go to stderr, text to stdout."""

from __future__ import annotations

import argparse
import os
import sys

from kimistream.formats import interrupts

interrupts.hold_from_import("kimi-run", __name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kimi-run", description=__doc__)
    p.add_argument("--weights", help="weight file from kimi-convert (default: the bundled model)")
    p.add_argument("--prompt", help="prompt text ('-' reads standard input)")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the model's chat template; without --prompt, on a "
                        "terminal: an interactive chat that keeps the conversation (and its KV cache) between turns")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="tokens to generate (default 64; in the interactive chat: up to the end of the context)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--threads", type=int, default=None,
                   help="compute threads (default: all cores, and one while decode steps show that another "
                        "program holds a core and one thread is faster)")
    p.add_argument("--gguf-inputs", choices=("llama.cpp", "f32"), default="llama.cpp",
                   help="weights kept in llama.cpp's blocks (a GGUF converted with --quant keep) multiply their "
                        "input rounded to 8 bits as llama.cpp does, so the file gives llama.cpp's logits "
                        "(llama.cpp, the default), or the float32 input as it is (f32: the weights' exact product)")
    p.add_argument("--activations", choices=("auto", "int8", "int16"), default="auto",
                   help="how the integer kernels round a product's input (decode steps, and prompt products "
                        "of fewer than 320 tokens, 192 for t1; more multiply exactly): "
                        "auto (the default) rounds it to int8 per 128 values for q2, q1 and t1 weights (routed "
                        "experts; one t1 token: 7 bits) and to 16 bits per 32 values elsewhere; int8 "
                        "also for q4/q6 weights (faster, a little more KL); int16 everywhere")
    p.add_argument("--max-context", type=int, default=None,
                   help="KV cache length in tokens (default: min(4096, the model's maximum), shortened when "
                        "that does not fit --memory-budget)")
    p.add_argument("--prefill-batch-size", type=int, default=None,
                   help="prompt tokens per forward chunk (default: 256, else 128, when the budget has room "
                        "for it without shrinking the expert cache by more than a tenth, else 64 or the "
                        "largest that fits)")
    p.add_argument("--prompt-window", type=int, default=None, metavar="TOKENS",
                   help="prompt tokens that go through the model one layer at a time, each layer's routed "
                        "experts read once for all of them (attention still a chunk at a time); a window of "
                        "one chunk or less feeds the prompt chunk by chunk (default: chunk by chunk where "
                        "every expert stays cached, else the most whole chunks, up to the context, that fit "
                        "beside the expert cache; where that cache holds fewer experts than a token uses over "
                        "all layers, it gives up all but one layer's and the read-ahead's)")
    p.add_argument("--json", action="store_true", help="print one JSON object with ids, text and stats")
    p.add_argument("--warm-up", action="store_true",
                   help="run the prompt and one token through the model first, untimed and unprinted, so "
                        "the reported speeds are warm (every expert and kernel touched once, as "
                        "llama-bench measures); the output is the same")
    p.add_argument("--dump-logits", metavar="PATH", help="save the prompt's logits [n_prompt, vocab] as float32 .npy")
    p.add_argument("--quiet", action="store_true",
                   help="no log on stderr: start-up, warnings, progress and the run summary (errors still show)")
    m = p.add_argument_group("memory and I/O")
    m.add_argument("--memory-budget", metavar="SIZE",
                   help="hard budget for the whole process, e.g. 600M, 8.24G, 8GiB (default: 80%% of MemAvailable)")
    m.add_argument("--io", choices=("auto", "mmap", "pread"), default="auto",
                   help="how routed experts are read: mmap (views of the file mapping), pread (a pool of "
                        "buffers), or auto (the default: mmap, then pread with O_DIRECT once evicted experts' "
                        "pages are to be dropped from the page cache, which O_DIRECT reads never enter); the "
                        "run summary says what it chose")
    m.add_argument("--direct", action="store_true", help="with --io pread: O_DIRECT reads (bypass the page cache)")
    m.add_argument("--prefetch", choices=("auto", "off", "next-layer"), default="auto",
                   help="speculative reads of the next layer's experts, guessed by its router from the current "
                        "hidden state: auto (the default) guesses while most guesses are used and reads go "
                        "to the disk; the run summary says what it chose")
    m.add_argument("--page-cache", choices=("auto", "keep", "drop"), default="auto",
                   help="an evicted expert's pages in the OS page cache: keep (a later miss may find them there), "
                        "drop (when memory outside the budget cannot hold them, keeping them only makes the "
                        "kernel reclaim), or auto (the default: keep, and drop once most evicted experts turn "
                        "out to be gone when needed again); the run summary says what it chose")
    m.add_argument("--cache-policy", choices=("lru", "lfru"), default="lru",
                   help="expert cache eviction: lru, or lfru (least frequently routed among the older half)")
    m.add_argument("--kv-dtype", choices=("f32", "f16"), default=None,
                   help="KV cache precision: f32 (exact; the default for a float file) or f16 (half the memory; "
                        "the default for a file with quantized experts, and when f32 does not fit --memory-budget)")
    m.add_argument("--dry-run", action="store_true", help="print the memory plan and exit")
    m.add_argument("--plan-config", metavar="CONFIG_JSON",
                   help="plan memory for a Hugging Face config.json alone (with --quant), before any download")
    m.add_argument("--quant", default=None, help="with --plan-config: the precision preset to plan for (default q2)")
    m.add_argument("--override", action="append", default=[], metavar="REGEX=CODEC",
                   help="with --plan-config: a per-tensor codec, as kimi-convert takes it (repeatable)")
    v = p.add_argument_group("server (OpenAI API; needs the serve extra: pip install 'kimi-stream[serve]')")
    v.add_argument("--serve", action="store_true",
                   help="serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics)")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    v.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080; 0 picks a free one)")
    # an empty key is no key (an exported but empty KIMI_STREAM_API_KEY, a script's --api-key "$UNSET"):
    # requiring an empty bearer token would protect nothing, and the warning for a public host must show
    v.add_argument("--api-key", default=os.environ.get("KIMI_STREAM_API_KEY") or None, type=lambda v: v or None,
                   metavar="KEY", help="require 'Authorization: Bearer KEY' (default: $KIMI_STREAM_API_KEY, else "
                                       "none; an empty KEY is none)")
    v.add_argument("--max-queue", type=int, default=16, metavar="N",
                   help="requests that may wait while one generates; more get 503 (default 16)")
    v.add_argument("--max-body", default="4M", metavar="SIZE", help="largest request body (default 4M)")
    v.add_argument("--no-prompt-cache", action="store_true",
                   help="compute every prompt in full instead of reusing the KV cache of the previous request's "
                        "shared prefix (for measurements, or outputs independent of earlier requests)")
    q = p.add_argument_group("quality")
    q.add_argument("--perplexity", metavar="TEXT_FILE", help="perplexity over the file in windows of --max-context")
    q.add_argument("--kl-reference", metavar="REF_WEIGHTS",
                   help="with --perplexity: mean / p99 KL(ref || this) and top-1 agreement against REF_WEIGHTS")
    q.add_argument("--calibration", metavar="TEXT_FILE",
                   help="collect an importance matrix over the file; 'self': over text the model samples itself "
                        "(temperature 1 from BOS, --self-tokens, --seed), when there is no calibration text")
    q.add_argument("--self-tokens", type=int, default=16384, metavar="N",
                   help="with --calibration self: tokens to sample (default 16384)")
    q.add_argument("--imatrix-out", metavar="PATH", help="with --calibration: where to save it (.npz)")
    q.add_argument("--moment-budget", default="2G", metavar="SIZE",
                   help="with --calibration: memory for full input second moments (GPTQ-style rounding in "
                        "kimi-convert), routed experts first; 0 = per-channel importance only (default 2G)")
    t = p.add_argument_group("telemetry")
    t.add_argument("--trace", metavar="FILE.jsonl", help="write one telemetry record per step")
    t.add_argument("--plot-trace", metavar="FILE.jsonl", help="draw a trace (memory over time, I/O per token) and exit")
    t.add_argument("-o", "--output", metavar="FILE.png", help="with --plot-trace: the image to write")
    return p


MAX_THREADS = 256      # runtime/_qdot.c's pool: 255 workers beside the calling thread


def _set_threads(n: int | None) -> None:
    # BLAS reads these when numpy is first imported, so this runs before any numpy import.
    if n is not None:
        if not 1 <= n <= MAX_THREADS:
            raise SystemExit(f"kimi-run: error: --threads must be 1..{MAX_THREADS}, got {n}")
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "KIMI_STREAM_THREADS"):
            os.environ[var] = str(n)


def main(argv=None) -> int:
    # Parsing and imports run with Ctrl-C held (it acts once they are done): one line at any point.
    def start():
        args = build_parser().parse_args(argv)
        _set_threads(args.threads)
        from .app import run
        return lambda: _run(run, args)
    return interrupts.command("kimi-run", start, "interrupted")


def _run(run, args) -> int:
    try:
        return run(args)
    except BrokenPipeError:
        # stdout closed early (e.g. piped into `head`): stop quietly like other Unix tools.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
