"""What `kimi-run` does once its flags are parsed: plan memory, open the weights, report, generate,
stream the text, and emit the stats (text or JSON)."""

from __future__ import annotations

import json
import math
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kimistream.formats import procfs
from kimistream.formats.constants import ROUTED_EXPERTS
from kimistream.formats.imatrix import SELF_CALIBRATION
from kimistream.formats.interrupts import say
from kimistream.formats.weightfile import WeightFile, WeightFileError, check_model

from . import budget as B
from . import kernels
from .bundled import BundledModelError, default_weights
from .engine import TextStream
from .generate import GenerationStats, generate
from . import planner
from .errors import RunError
from .planner import MIN_PREFILL_BATCH, auto_fit, auto_prefill_batch, context_length, describe_plan, refuse_if_unfit
from .model import ContextFull, Model
from .pager import ExpertReadError
from .sampler import Sampler
from .telemetry import Telemetry, plot_trace, vm_hwm
from .threadtune import ThreadTuner
from .tokenizer import Tokenizer, TokenizerError
from .weights import ModelWeights

SAMPLING_LANES = 8      # --calibration self: sequences sampled side by side at most
CALIBRATION_HOLD_BACK = 0.5   # calibration: share of the room beyond the minimum expert cache for moments and states


def _log(msg: str) -> None:
    say(f"kimi-run: {msg}")


def _fail(msg: str) -> int:
    say(f"kimi-run: error: {msg}")
    return 1


def peak_rss_bytes() -> int:
    # VmHWM, not getrusage's ru_maxrss: the latter keeps the parent's peak across fork+exec.
    return vm_hwm()


# ------------------------------------------------------------------------------------ memory plan

def untrained_chat_markers(tok: Tokenizer, weights: ModelWeights) -> list[str]:
    """The chat template's markers the model was evidently never trained on: those its vocabulary
    splits into several tokens, and those whose embedding row is smaller than 95 % of a sample of the
    vocabulary's rows (a row no training step ever reached only shrinks under weight decay: the
    bundled base models' <|im_start|> sits at the 1st percentile)."""
    markers = tok.chat_markers()
    out = sorted(m for m, i in markers.items() if i is None)
    single = {m: i for m, i in markers.items() if i is not None}
    if single:
        vocab = weights.config.vocab_size
        sample = np.random.default_rng(0).choice(vocab, size=min(1024, vocab), replace=False)
        floor = np.percentile(np.linalg.norm(weights.embed_rows(sample), axis=1), 5)
        norms = np.linalg.norm(weights.embed_rows(list(single.values())), axis=1)
        out += sorted(m for m, n in zip(single, norms) if n < floor)
    return out


# ------------------------------------------------------------------------------------ run

def run(args) -> int:
    log = (lambda m: None) if args.quiet else _log
    kernels.set_gguf_inputs(args.gguf_inputs)
    kernels.set_activations(args.activations)
    try:
        _check_flags(args)
        if args.plot_trace:
            if not args.output:
                raise RunError("--plot-trace needs -o FILE.png")
            _check_image_name(args.output)
            plot_trace(args.plot_trace, args.output)
            log(f"wrote {args.output}")
            return 0
        if args.plan_config:
            from .planconfig import plan_config
            return plan_config(args, log)
        if args.perplexity or args.calibration:
            return _quality(args, log)
        if args.serve or (args.chat and args.prompt is None and not args.dry_run):
            return _interactive(args, log)
        return _generate(args, log)
    except (RunError, WeightFileError, BundledModelError, TokenizerError, ExpertReadError, ContextFull,
            ValueError, OSError) as e:
        return _fail(str(e))


def _check_flags(args) -> None:
    """Flags the chosen mode would not use and values that are wrong, refused in one line each before
    the model is read (a --dump-logits path that cannot be written had failed only after the prompt ran)."""
    _check_values(args)
    one_prompt = not (args.plan_config or args.perplexity or args.calibration or args.serve or args.prompt is None)
    for flag, value in (("--warm-up", args.warm_up), ("--trace", args.trace), ("--dump-logits", args.dump_logits)):
        if value and not one_prompt:
            raise RunError(f"{flag} applies to a run of one --prompt")
    if args.dry_run:
        runs = [f for f, v in (("--warm-up", args.warm_up), ("--trace", args.trace),
                               ("--dump-logits", args.dump_logits), ("--imatrix-out", args.imatrix_out)) if v]
        if runs:
            raise RunError(f"--dry-run plans without running: {', '.join(runs)} would measure or write nothing")
    if args.json and not (one_prompt or args.plan_config or args.perplexity or args.calibration or args.dry_run):
        raise RunError("--json applies to a run of one --prompt, --perplexity, --calibration, --plan-config or --dry-run")
    if args.kl_reference and not args.perplexity:
        raise RunError("--kl-reference needs --perplexity")
    if args.imatrix_out and not args.calibration:
        raise RunError("--imatrix-out applies to --calibration")
    if args.imatrix_out:
        # the importances replace whatever is at that path: never the weights or the text being read
        target = Path(args.imatrix_out).resolve()
        for flag, path in (("--weights", args.weights), ("--calibration", args.calibration)):
            if path and Path(path).exists() and Path(path).resolve() == target:
                raise RunError(f"--imatrix-out {args.imatrix_out}: is the {flag} file this run reads")
    if args.output and not args.plot_trace:
        raise RunError("-o applies to --plot-trace (the image it writes)")
    for flag, value in (("--perplexity", args.perplexity), ("--calibration", args.calibration),
                        ("--plan-config", args.plan_config)):
        if args.chat and value:
            raise RunError(f"--chat applies to a --prompt or a conversation, not to {flag}")
    if (args.quant is not None or args.override) and not args.plan_config:
        raise RunError("--quant and --override apply with --plan-config (kimi-convert chooses a file's precision)")
    _check_mode(args)
    _check_inputs(args)
    for flag, path in (("--trace", args.trace), ("--dump-logits", args.dump_logits), ("-o", args.output),
                       ("--imatrix-out", args.imatrix_out)):
        if path:
            target = Path(path)
            if target.is_dir():
                raise RunError(f"{flag} {path}: is a directory, not a file")
            folder = target.resolve().parent
            if not folder.is_dir() or not os.access(folder, os.W_OK):
                raise RunError(f"{flag} {path}: cannot write in {folder}")


def _check_image_name(path: str) -> None:
    """-o names its image's format by its suffix (matplotlib would add .png to a name without one,
    writing another file than the one asked for)."""
    from matplotlib.figure import Figure
    formats = Figure().canvas.get_supported_filetypes()
    if Path(path).suffix[1:].lower() not in formats:
        raise RunError(f"-o {path}: the name must end in an image format's suffix, e.g. .png "
                       f"({', '.join(sorted(formats))})")


# flags whose value names a file, a size or an address: an empty one (an unset shell variable) is
# refused, not taken for the default (an empty --host listened on every interface)
VALUE_FLAGS = ("weights", "plan_config", "plot_trace", "output", "perplexity", "kl_reference", "calibration",
               "imatrix_out", "trace", "dump_logits", "memory_budget", "moment_budget", "max_body", "host")


def _flag(dest: str) -> str:
    return "-o" if dest == "output" else "--" + dest.replace("_", "-")


def _check_values(args) -> None:
    """Values that are wrong in any mode."""
    for dest in VALUE_FLAGS:
        if getattr(args, dest) is not None and not str(getattr(args, dest)).strip():
            raise RunError(f"{_flag(dest)}: the value is empty")
    if args.seed is not None and args.seed < 0:
        raise RunError("--seed must be >= 0")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise RunError(f"--temperature must be a number >= 0 (0 = greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise RunError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.max_tokens is not None and args.max_tokens < 0:
        raise RunError("--max-tokens must be >= 0")
    if args.prefill_batch_size is not None and args.prefill_batch_size < 1:
        raise RunError("--prefill-batch-size must be >= 1")
    if (args.perplexity or args.calibration) and args.max_context is not None and args.max_context < 2:
        # a window's first token is scored by none: --perplexity had called any text too short
        raise RunError(f"--max-context {args.max_context}: windows of text need at least 2 tokens")
    if args.calibration == SELF_CALIBRATION and args.self_tokens < 2:
        raise RunError("--calibration self needs --self-tokens of at least 2")
    for dest in ("memory_budget", "moment_budget", "max_body"):
        if getattr(args, dest) is not None:
            try:
                B.parse_size(getattr(args, dest))
            except ValueError as e:
                raise RunError(f"{_flag(dest)}: {e}") from None


# the flags each mode reads (dests); any other flag given is refused rather than ignored
LOADS = {"weights", "quiet", "memory_budget", "io", "direct", "prefetch", "page_cache", "cache_policy", "kv_dtype",
         "max_context", "prefill_batch_size", "prompt_window", "threads", "gguf_inputs", "activations", "dry_run",
         "json"}
SAMPLES = {"chat", "max_tokens", "temperature", "top_p", "seed"}
MODE_FLAGS = {
    "--plot-trace": {"plot_trace", "output", "quiet"},
    "--plan-config": {"plan_config", "quant", "override", "memory_budget", "max_context", "prefill_batch_size",
                      "prompt_window", "kv_dtype", "prefetch", "json", "quiet", "dry_run"},
    "--perplexity": LOADS | {"perplexity", "kl_reference"},
    "--calibration": LOADS | {"calibration", "imatrix_out", "moment_budget"},
    "--calibration self": LOADS | {"calibration", "imatrix_out", "moment_budget", "self_tokens", "seed"},
    "--serve": LOADS | {"serve", "host", "port", "api_key", "max_queue", "max_body", "no_prompt_cache"},
    "--chat (a conversation)": LOADS | SAMPLES | {"no_prompt_cache"},
    "a run of one --prompt": LOADS | SAMPLES | {"prompt", "warm_up", "dump_logits", "trace"},
}
# why a mode ignores a flag, where it is not plain
REASONS = {("--plan-config", "weights"): "it plans from the config alone: --weights FILE --dry-run plans a file",
           ("--calibration", "self_tokens"): "it applies to --calibration self",
           ("--calibration", "seed"): "it applies to --calibration self",
           **{("--serve", d): "each request gives its own" for d in ("prompt", "max_tokens", "temperature",
                                                                      "top_p", "seed")}}


def _given(args) -> dict[str, str]:
    """The flags whose value is not the default (dest -> its name on the command line)."""
    from .cli import build_parser
    return {a.dest: _flag(a.dest) for a in build_parser()._actions
            if a.option_strings and a.dest != "help" and getattr(args, a.dest, a.default) != a.default}


def _modes(args) -> list[str]:
    """The modes the flags ask for, in the order run() takes them."""
    calibration = "--calibration self" if args.calibration == SELF_CALIBRATION else "--calibration"
    modes = [m for m, on in (("--plot-trace", args.plot_trace), ("--plan-config", args.plan_config),
                             ("--perplexity", args.perplexity), (calibration, args.calibration),
                             ("--serve", args.serve)) if on]
    if not modes:
        modes.append("--chat (a conversation)" if args.chat and args.prompt is None and not args.dry_run
                     else "a run of one --prompt")
    return modes


def _check_mode(args) -> None:
    """One mode at a time (--perplexity and --calibration may share a run), and no flag it would ignore."""
    modes = _modes(args)
    quality = {"--perplexity", "--calibration", "--calibration self"}
    if len(modes) > 1 and not set(modes) <= quality:
        first = next(m for m in modes if m not in quality)
        second = next(m for m in modes if m != first)
        raise RunError(f"{first} and {second} cannot be combined: give one of them")
    used = set().union(*(MODE_FLAGS[m] for m in modes))
    for dest, flag in _given(args).items():
        if dest not in used:
            why = REASONS.get((modes[0], dest))
            raise RunError(f"{' and '.join(modes)} takes no {flag}" + (f" ({why})" if why else ""))


def _check_inputs(args) -> None:
    """The files a run reads exist and are files, said before the model is read."""
    for dest in ("plan_config", "plot_trace", "perplexity", "kl_reference", "calibration"):
        path = getattr(args, dest)
        if path is None or (dest == "calibration" and path == SELF_CALIBRATION):
            continue
        if not Path(path).exists():
            raise RunError(f"{_flag(dest)} {path}: no such file")
        if Path(path).is_dir():
            raise RunError(f"{_flag(dest)} {path}: is a directory, not a file")


def _warm_up(codecs=()) -> None:
    """Load the libraries a run uses, initialise BLAS and run the fused kernels the
    file's codecs need, so the measured baseline includes them."""
    import tokenizers  # noqa: F401
    a = np.ones((8, 8), np.float32)
    a @ a
    from kimistream.formats.ggufcodecs import is_gguf_codec
    from .weights import has_fused_kernel
    for codec in sorted(c for c in set(codecs) if has_fused_kernel(c) or is_gguf_codec(c)):
        from . import kernels
        kernels.warm_up(codec)


@dataclass
class Session:
    path: Path
    cfg: object
    plan: B.MemoryPlan
    weights: ModelWeights
    model: Model
    tok: Tokenizer
    resident: int
    held_back: int = 0       # bytes of the expert cache's room left to the caller (calibration)


def open_session(args, log, weights_path=None, describe: bool = True, hold_back: float = 0.0) -> Session | None:
    """Plan memory for a weight file under the flags, refuse if it cannot fit, then open it (None
    with --dry-run). Everything a run needs is checked before the first weight is touched.
    `hold_back`: this share of the memory the plan leaves beyond the minimum expert cache is left to
    the caller (Session.held_back); the expert cache takes at most the rest."""
    if args.direct and args.io != "pread":
        raise RunError("--direct needs --io pread")
    path = Path(weights_path or args.weights) if (weights_path or args.weights) else default_weights(log)
    # opened once (Kimi K2's header takes half a second to check) and handed to ModelWeights below
    wf = WeightFile(path)
    try:
        if weights_path is None:        # the file run; a --kl-reference beside it may differ
            _check_gguf_inputs(args, path, wf)
        return _open_session(args, log, path, wf, describe, hold_back)
    except BaseException:
        wf.close()
        raise


def _check_gguf_inputs(args, path: Path, wf: WeightFile) -> None:
    """--gguf-inputs other than the default changes only llama.cpp blocks: refused for a file without any."""
    from kimistream.formats.ggufcodecs import is_gguf_codec
    if args.gguf_inputs != "llama.cpp" and not any(is_gguf_codec(t.codec) for t in wf.tensors.values()):
        raise RunError(f"{path}: --gguf-inputs {args.gguf_inputs} applies to llama.cpp blocks, and this file keeps "
                       f"none (they come from a GGUF converted with --quant keep)")


def _open_session(args, log, path: Path, wf: WeightFile, describe: bool, hold_back: float) -> Session | None:
    _warm_up({t.codec for t in wf.tensors.values()})
    baseline = B.current_rss() + B.RUNTIME_SLACK
    if not hasattr(args, "budget"):
        if args.memory_budget:
            args.budget = B.parse_size(args.memory_budget)
            memory = B.process_memory(procfs.cgroup_memory_limit())
            if memory is not None and args.budget > memory:
                log(f"warning: --memory-budget {B.fmt(args.budget)} is more than this process can have "
                    f"({B.fmt(memory)}: available memory and its own, within any cgroup limit): the plan counts on "
                    f"memory the machine may not give")
        else:
            args.budget = int(B.DEFAULT_FRACTION * B.mem_available())
            log(f"no --memory-budget: using {int(B.DEFAULT_FRACTION * 100)}% of available memory")
    cfg = check_model(wf)
    footprint = planner.of_file(wf)
    experts_codec = next((t.codec for t in wf.tensors.values() if t.cls == ROUTED_EXPERTS), "f32")
    args.max_ctx = context_length(args, cfg, log)
    # each session (a --kl-reference one too) starts from the user's flag, not the last session's choice
    if not hasattr(args, "kv_dtype_flag"):
        args.kv_dtype_flag = args.kv_dtype
    args.kv_dtype = args.kv_dtype_flag
    planner.default_kv_dtype(args, experts_codec, log)

    def replan(ctx, chunk, window=None):
        return planner.plan(cfg, footprint, args, baseline, ctx or args.max_ctx,
                            chunk or args.prefill_batch_size or MIN_PREFILL_BATCH, window=window)
    # each session starts from the user's flag, as with --kv-dtype
    if not hasattr(args, "prompt_window_flag"):
        args.prompt_window_flag = getattr(args, "prompt_window", None)
    args.prompt_window = args.prompt_window_flag
    auto_fit(args, replan, log)
    args.kv_dtype = args.kv_dtype or "f32"
    if args.prefill_batch_size is None:
        args.prefill_batch_size = auto_prefill_batch(lambda b: replan(None, b))
        log(f"prefill batch: {args.prefill_batch_size} tokens (--prefill-batch-size to choose)")
    planner.default_prompt_window(args, replan, cfg.num_experts_per_tok, log)
    plan = replan(None, None)
    page_cache, tight = args.page_cache, None
    if args.io == "auto" and page_cache == "auto" and (
            tight := B.no_page_cache_room(plan, experts=footprint.routed_bytes)):
        page_cache = "drop"             # O_DIRECT reads from the start (make_pager), no trial of keeping pages
    # under a memory limit O_DIRECT is timed against the mapping (pager.IoTrial); a file far larger than
    # memory is left to O_DIRECT (a mapping read from all over it costs 1.4-2x the compute)
    trial = bool(tight) and B.limit_leaves_no_room(plan, procfs.cgroup_memory_limit()) is not None
    if describe:
        describe_plan(plan, log)
        if tight:
            timed = "; timed against reads through the mapping in the first decode steps" if trial else ""
            log(f"expert reads: O_DIRECT from the start, evicted experts not kept in the page cache ({tight}){timed}")
    if args.dry_run and args.json:
        print(json.dumps({"memory_plan": plan.to_json()}))
    refuse_if_unfit(plan, replan, args)
    if args.dry_run:
        wf.close()
        return None
    kernels.keep_heap(plan.activations)     # freed temporaries stay mapped, inside the plan's room for them
    # the room beyond the minimum cache: all of it for experts, or a share left to the caller
    free = plan.expert_cache - plan.min_cache_experts * plan.expert_bytes
    held_back = int(max(0, free) * hold_back)
    cache_bytes = min(plan.cache_experts * plan.expert_bytes, plan.expert_cache - held_back)
    weights = ModelWeights(wf, io=args.io, cache_bytes=cache_bytes,
                           policy=args.cache_policy, direct=args.direct, prefetch=args.prefetch,
                           page_cache=page_cache)
    if tight:
        weights.pager.page_cache_policy = f"drop evicted experts (auto: {tight})"
        if not trial:
            weights.pager.io_trial = None
    tok_meta = weights.header.get("tokenizer") or {}
    try:
        tok = Tokenizer(tok_meta.get("kind", ""), {n: weights.file.blob(n) for n in tok_meta.get("files", [])})
    except KeyError as e:
        raise RunError(f"{path}: tokenizer file {e} missing from the weight file") from None
    if getattr(args, "chat", False) and not args.serve and not tok.chat_template:     # said before the load
        raise RunError(f"{path}: this model's tokenizer has no chat template (drop --chat)")
    resident = weights.load_resident()
    model = Model(weights, args.max_ctx, kv_dtype=args.kv_dtype)
    codecs = sorted({t.codec for t in weights.file.tensors.values()})
    plan_classes = weights.header.get("plan", {}).get("classes", {})
    log(f"{path.name}: {cfg.num_hidden_layers} layers ({len(cfg.moe_layers)} MoE), "
        f"{cfg.n_routed_experts} routed experts top-{cfg.num_experts_per_tok}, "
        f"{cfg.n_shared_experts} shared, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}")
    log(f"codecs: {', '.join(codecs)}; plan: " + ", ".join(f"{k}={v}" for k, v in plan_classes.items()))
    log(f"tokenizer: {tok.kind}, {tok.vocab_size} tokens")
    log(f"resident {B.fmt(resident)}; expert cache {plan.cache_experts} experts ({weights.io_policy}, {args.cache_policy}, "
        f"prefetch {weights.prefetch_policy})")
    log(f"weight file: OK (header checked, resident extents verified; experts through {weights.pager.mode})")
    return Session(path, cfg, plan, weights, model, tok, resident, held_back)


def _interactive(args, log) -> int:
    """--serve and the interactive --chat: one engine that keeps the conversation's KV cache."""
    from .engine import Engine
    if not args.serve and not sys.stdin.isatty():
        raise RunError("--chat without --prompt needs a terminal on standard input (or give --prompt TEXT / -)")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise RunError("--max-tokens must be >= 1")
    if args.serve:
        try:
            from . import server
        except ImportError:
            raise RunError("--serve needs the serve extra: pip install 'kimi-stream[serve]'") from None
        server.warm_up()      # before the plan measures the process: the server's libraries are part of it
        if not 0 <= args.port <= 65535:
            raise RunError(f"--port must be 0..65535, got {args.port}")
        if args.max_queue < 0:
            raise RunError("--max-queue must be >= 0")
        try:
            max_body = B.parse_size(args.max_body)
        except ValueError as e:
            raise RunError(f"--max-body: {e}") from None
        if max_body < server.MIN_BODY:
            raise RunError(f"--max-body must be at least {server.MIN_BODY} bytes (a smaller limit refuses every request)")
    Sampler(args.temperature, args.top_p, args.seed)      # flag errors before loading
    sock = server.listen(args.host, args.port) if args.serve and not args.dry_run else None
    try:
        s = open_session(args, log)
    except BaseException:
        if sock is not None:
            sock.close()
        raise
    if s is None:
        return 0
    untrained = untrained_chat_markers(s.tok, s.weights)
    if untrained:
        log(f"warning: this model looks untrained on its chat template's markers ({', '.join(untrained)}): "
            f"a base model continues the text rather than answering")
    stop_ids = s.tok.stop_ids | set(s.cfg.eos_token_ids)
    engine = Engine(s.model, s.tok, stop_ids, args.prefill_batch_size, s.weights.pager,
                    prefix_cache=not args.no_prompt_cache, tuner=_thread_tuner(args), prompt_window=args.prompt_window)
    try:
        if args.serve:
            cfg = server.ServerConfig(model_id=s.path.stem, api_key=args.api_key, max_body=max_body,
                               max_queue=args.max_queue, memory_budget=s.plan.budget,
                               created=int(s.path.stat().st_mtime))
            return server.serve(engine, cfg, sock, args.host, log)
        from .chat import repl
        return repl(engine, args)
    finally:
        s.weights.close()
        if sock is not None:
            sock.close()


def _generate(args, log) -> int:
    if args.prompt is None and not args.dry_run:
        raise RunError("--prompt is required (or --chat on a terminal, --serve, --perplexity FILE, --calibration FILE)")
    if args.max_tokens is None:
        args.max_tokens = 64
    if args.max_tokens < 0:
        raise RunError("--max-tokens must be >= 0")
    sampler = Sampler(args.temperature, args.top_p, args.seed)
    s = open_session(args, log)
    if s is None:
        return 0
    cfg, plan, weights, model, tok, resident = s.cfg, s.plan, s.weights, s.model, s.tok, s.resident
    prompt = _prompt_text(args.prompt)
    if args.chat:
        untrained = untrained_chat_markers(tok, weights)
        if untrained:
            log(f"warning: --chat: this model looks untrained on its chat template's markers "
                f"({', '.join(untrained)}): a base model continues the text rather than answering")
        prompt_ids = tok.encode(tok.render_chat([{"role": "user", "content": prompt}]), add_special_tokens=False)
    else:
        prompt_ids = tok.encode(prompt)
    log(f"prompt {len(prompt_ids)} tokens")

    stats = GenerationStats()
    dump = None
    if args.dump_logits and args.prompt_window and args.prompt_window > args.prefill_batch_size:
        # every position's logits are planned for a chunk at a time (generate), not for a window's
        if args.prompt_window_flag:
            log(f"--dump-logits: the prompt runs in chunks of {args.prefill_batch_size} tokens, not in windows "
                f"of {args.prompt_window} (--prompt-window)")
        args.prompt_window = args.prefill_batch_size
    if args.dump_logits:
        def dump(all_logits):
            target = Path(args.dump_logits)
            tmp = target.with_name(target.name + ".partial.npy")
            try:
                np.save(tmp, np.ascontiguousarray(all_logits, dtype=np.float32))
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)

    stop_ids = tok.stop_ids | set(cfg.eos_token_ids)
    if args.warm_up:            # greedy, its own sampler: the measured run's draws stay as without it
        for _ in generate(model, prompt_ids, 1, Sampler(0.0, 1.0, None), args.prefill_batch_size, stop_ids,
                          window=args.prompt_window):
            pass
        model.reset()
        log("warmed up: the prompt and one token ran once, untimed")
    tuner = _thread_tuner(args)
    telemetry = Telemetry(weights.pager, args.trace, tuner)
    stream = TextStream(tok)
    out = None if args.json else sys.stdout
    interrupted = False
    try:
        for tid in generate(model, prompt_ids, args.max_tokens, sampler, args.prefill_batch_size,
                            stop_ids, stats, dump, telemetry, window=args.prompt_window):
            piece = stream.push(tid)
            if piece and out:
                out.write(piece)
                out.flush()
    except KeyboardInterrupt:           # what was generated, and the summary, still come; exit 130
        log("interrupted")
        interrupted, stats.stop_reason = True, "interrupted"
    finally:
        telemetry.close()
    tail = stream.finish()
    if tail and out:
        out.write(tail)
    if not args.json:
        sys.stdout.write("\n")
    tele = telemetry.summary()
    report = {
        "prefill_tokens_per_s": round(stats.prefill_tokens_per_s, 3),
        "decode_tokens_per_s": round(stats.decode_tokens_per_s, 3),
        "peak_rss_bytes": peak_rss_bytes(),
        "resident_bytes": resident,
        "experts_touched": len(weights.experts_touched),
        "experts_total": cfg.n_routed_experts * len(cfg.moe_layers),
        "expert_bytes_touched": weights.expert_bytes_touched,
        "prefill_seconds": round(stats.prefill_seconds, 4),
        "prefill_batch": args.prefill_batch_size,
        "prompt_window": args.prompt_window,
        "decode_seconds": round(stats.decode_seconds, 4),
        "stop_reason": stats.stop_reason,
        "memory_budget_bytes": plan.budget,
        "expert_cache_experts": plan.cache_experts,
        "prefetch_policy": weights.prefetch_policy,
        "page_cache_policy": weights.pager.page_cache_policy,
        "io": weights.io_policy,
        "activations": kernels.activations(),
        "threads": tuner.policy if tuner is not None else f"{kernels.threads()} (--threads)",
        "moe_overlap": moe_overlap(model, weights),
        "warm_up": bool(args.warm_up),
        **tele,
    }
    if args.json:
        print(json.dumps({"prompt_tokens": prompt_ids, "tokens": stream.ids,
                          "text": tok.decode(stream.ids), "stats": report, "memory_plan": plan.to_json()}))
    else:
        if not args.quiet:
            print_summary(stats, report, tele, plan)
    weights.close()
    return 130 if interrupted else 0


def moe_overlap(model: Model, weights: ModelWeights) -> str:
    """How many decode steps' MoE calls ran on the thread pool beside the interpreter, or why none did."""
    launched, calls = model.moe_overlap()
    if launched:
        return f"{launched} of {calls} decode MoE calls beside the interpreter"
    if not weights.offsets_stay:
        return "none: the expert cache may evict (it holds fewer than every expert, or reads into a pool)"
    if kernels.threads() < 2:
        return "none: one thread"
    return f"none of {calls} decode MoE calls (experts too small to share, or none known yet)"


def _tokenizer_files(s) -> dict:
    """A session's tokenizer as the kind and bytes of the files its weight file embeds."""
    meta = s.weights.header.get("tokenizer") or {}
    return {"kind": meta.get("kind"), **{n: s.weights.file.blob(n) for n in meta.get("files", [])}}


def _thread_tuner(args) -> ThreadTuner | None:
    """Without --threads, the decode steps' time decides between all cores and one (runtime/threadtune.py)."""
    return ThreadTuner(kernels.threads(), kernels.set_threads, kernels.pool_wait) if args.threads is None else None


def print_summary(stats: GenerationStats, report: dict, tele: dict, plan: B.MemoryPlan) -> None:
    """The closing table on stderr: where time, I/O and memory went."""
    from rich.console import Console
    from rich.table import Table
    t = Table(title="kimi-run summary", show_header=False, min_width=60)
    t.add_column("", style="bold")
    t.add_column("", justify="right")
    na = "—"
    decoded = stats.generated_tokens > 1            # the first generated token belongs to the prompt

    def per_token(text: str) -> str:
        return text if decoded else na
    rows = [
        ("prompt", f"{stats.prompt_tokens} tokens at {report['prefill_tokens_per_s']:.1f} tok/s"),
        ("prompt: how", (f"up to {report['prompt_window']} tokens a layer at a time "
                         f"(attention: {report['prefill_batch']} at a time)" if report["prompt_window"] > report["prefill_batch"]
                         else f"chunks of {report['prefill_batch']} tokens")),
        ("prompt: expert bytes read", f"{B.fmt(tele['prefill_bytes_read'])} ({tele['prefill_io_wait_s']:.2f} s waiting)"),
        ("generated", f"{stats.generated_tokens} tokens" + (f" at {report['decode_tokens_per_s']:.1f} tok/s" if decoded else "")
                      + f" ({stats.stop_reason})"),
        ("per decoded token: compute", per_token(f"{tele['decode_compute_s_per_token'] * 1000:.1f} ms")),
        ("per decoded token: waiting on I/O", per_token(f"{tele['decode_io_wait_s_per_token'] * 1000:.1f} ms")),
        ("per decoded token: CPU of expert reads", per_token(f"{tele['decode_read_cpu_s_per_token'] * 1000:.1f} ms "
                                                              "(copies and checksums, on any thread)")),
        ("per decoded token: expert bytes read", per_token(B.fmt(tele["decode_bytes_read_per_token"]))),
        ("experts touched", f"{report['experts_touched']} of {report['experts_total']}"),
        ("expert cache", f"{plan.cache_experts} experts, hit rate {tele['hit_rate']:.1%}, {tele['evictions']} evictions"),
        ("expert bytes read", B.fmt(tele["bytes_read"])),
        ("prefetch", report["prefetch_policy"]),
        ("page cache", report["page_cache_policy"]),
        ("expert reads", report["io"]),
        ("threads", report["threads"]),
        ("MoE calls overlapped", report["moe_overlap"]),
        ("prefetch recall / wasted",
         na if tele["prefetch_recall"] is None else f"{tele['prefetch_recall']:.1%} / {B.fmt(tele['prefetch_wasted_bytes'])}"),
        ("major faults", str(tele["major_faults"])),
        ("peak RSS (VmHWM)", f"{B.fmt(report['peak_rss_bytes'])} of {B.fmt(plan.budget)} budget"),
        ("  anonymous / file-backed", f"{B.fmt(tele['peak_rss_anon_bytes'])} / {B.fmt(tele['peak_rss_file_bytes'])}"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    Console(stderr=True, width=100).print(t)


# ------------------------------------------------------------------------------------ quality

def _prompt_text(arg: str) -> str:
    """--prompt TEXT, or standard input for "-": valid UTF-8 or a one-line error (the command line
    carries undecodable bytes as lone surrogates, which no tokenizer can take)."""
    if arg == "-":
        data = sys.stdin.buffer.read()
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RunError(f"standard input is not valid UTF-8 (byte {e.start})") from None
    try:
        arg.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RunError(f"--prompt is not valid UTF-8 (character {e.start})") from None
    return arg


def _read_text(path: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise RunError(f"{path}: cannot read text ({e})") from None
    if not text.strip():
        raise RunError(f"{path}: the file is empty")
    return text


@contextmanager
def _token_progress(label: str, total: int, quiet: bool):
    """The phase's progress over the text's tokens on stderr (formats/progress.py); yields advance(n)."""
    from kimistream.formats.progress import Phase
    with Phase(label, total, "tokens", quiet=quiet) as phase:
        yield phase.advance


def _open_reference(args, log, s: Session) -> Session:
    """--kl-reference's file, opened beside the scored one under the same --memory-budget (which held
    back part of its expert cache's room for it): its plan gets the budget less what the first
    session will still add to memory (its KV cache, activations and expert cache, untouched so far);
    its baseline, measured now, holds the rest of the first."""
    p = s.plan
    later = p.kv_cache + p.activations + s.weights.pager.capacity
    budget = args.budget
    args.budget = budget - later
    args.reserved = (later, f" (--memory-budget less {B.fmt(later)} that {s.path.name} will still take)")
    try:
        return open_session(args, log, weights_path=args.kl_reference, describe=False)
    finally:
        args.budget = budget
        del args.reserved


def _quality(args, log) -> int:
    """--perplexity FILE [--kl-reference REF] and --calibration FILE --imatrix-out PATH."""
    from rich.console import Console
    from rich.table import Table

    from .quality import collect_importance_by_layer, evaluate, sample_sequences, windows
    if args.calibration and not args.imatrix_out:
        raise RunError("--calibration needs --imatrix-out PATH")
    # calibrating: half the expert cache's room above its minimum holds the second moments and the
    # residual stream of the layer-by-layer pass instead (it reads each expert once anyway)
    # the same share, when scoring against --kl-reference, is the reference file's room
    s = open_session(args, log, hold_back=CALIBRATION_HOLD_BACK if args.calibration or args.kl_reference else 0.0)
    if s is None:
        return 0
    out = {}
    if args.calibration:
        try:
            moment_budget = B.parse_size(args.moment_budget)
        except ValueError as e:
            raise RunError(f"--moment-budget: {e}") from None
        if args.calibration == SELF_CALIBRATION:
            start = [s.tok.bos_id] if s.tok.bos_id is not None else s.tok.encode("\n", add_special_tokens=False)[:1]
            if not start:
                raise RunError("--calibration self: the tokenizer has no BOS token to start sampling from")
            if args.self_tokens < 2 or args.max_ctx < 8:
                raise RunError("--calibration self needs --self-tokens of at least 2 and --max-context of at least 8")
            stop = s.tok.stop_ids | set(s.cfg.eos_token_ids)
            # several sequences side by side, as many as the budget holds the KV cache of (up to 8):
            # each forward step then serves them all
            per_seq = B.kv_bytes(s.cfg, args.max_ctx, 2 if args.kv_dtype == "f16" else 4)
            spare = s.held_back           # the expert cache has the rest
            lanes = int(max(1, min(SAMPLING_LANES, spare // max(per_seq, 1))))
            with _token_progress("sampling", args.self_tokens, args.quiet) as advance:
                chunks = sample_sequences(s.model, start, stop, args.self_tokens, args.max_ctx,
                                          args.prefill_batch_size, args.seed or 0, progress=advance, lanes=lanes)
        else:
            chunks = list(windows(s.tok.encode(_read_text(args.calibration)), args.max_ctx))
        tokens, read0 = sum(map(len, chunks)), s.weights.pager.stats.bytes_read
        if not tokens:
            raise RunError(f"{args.calibration}: no calibration text left to measure (at least one token is needed)")
        # Layer by layer: every window through a layer before the next, each expert read once per pass
        # (the same importance as running window by window, to float rounding). The room held back
        # from the expert cache holds the second moments first (better rounding), then the residual
        # stream of every token; what does not fit there goes to files next to the imatrix.
        # (half of it at most: each update also needs a product as large as the moment it adds to)
        if moment_budget > s.held_back // 2:
            log(f"second moments: {B.fmt(s.held_back // 2)} (--moment-budget {args.moment_budget} is more than the "
                f"memory budget leaves for them)")
            moment_budget = s.held_back // 2
        states = 2 * 4 * tokens * s.cfg.hidden_size
        state_ram = max(0, s.held_back - 2 * moment_budget)   # a moment's update needs a product as large
        cached = min(s.plan.total_experts, s.weights.pager.capacity // max(s.plan.expert_bytes, 1))
        log(f"calibration layer by layer ({cached} of {s.plan.total_experts} experts cached): each expert read once; the residual stream of {tokens} tokens "
            f"({B.fmt(states)}) " + ("in memory" if states <= state_ram else f"on disk next to {args.imatrix_out}"))
        with _token_progress("calibrating", tokens * len(s.model.layers), args.quiet) as advance:
            col = collect_importance_by_layer(s.model, chunks, args.prefill_batch_size, progress=advance,
                                              moment_budget=moment_budget, state_ram=state_ram,
                                              state_dir=Path(args.imatrix_out).resolve().parent)
        read = s.weights.pager.stats.bytes_read - read0
        file_experts = sum(e.nbytes for e in s.weights.file.extents if e.kind == "expert")
        col.save(args.imatrix_out, s.weights.header["config"])
        log(f"importance of {len(col.sums)} weights, {len(col.moments)} full second moments, from {col.tokens} "
            f"tokens → {args.imatrix_out}; experts read {B.fmt(read)} ({read / max(file_experts, 1):.2f}x the "
            f"file's expert bytes)")
        out["imatrix"] = {"path": args.imatrix_out, "tokens": col.tokens, "tensors": len(col.sums),
                          "moments": len(col.moments), "expert_bytes_read": read,
                          "file_expert_bytes": file_experts}
    if args.perplexity:
        ids = s.tok.encode(_read_text(args.perplexity))
        ref = None
        if args.kl_reference:
            r = _open_reference(args, log, s)
            # the files themselves, not their names: two models' tokenizer.json share a name
            if r.cfg.vocab_size != s.cfg.vocab_size or _tokenizer_files(r) != _tokenizer_files(s):
                raise RunError(f"{args.kl_reference}: the reference has another tokenizer or vocabulary")
            ref = r.model
        with _token_progress("scoring", len(ids), args.quiet) as advance:
            rep = evaluate(s.model, ids, args.max_ctx, args.prefill_batch_size, ref, progress=advance)
        out["quality"] = {"text": args.perplexity, "weights": str(s.path), "reference": args.kl_reference,
                          **rep.to_json()}
        t = Table(title=f"quality of {s.path.name} on {Path(args.perplexity).name}")
        for c in ("tokens", "perplexity", "ref. perplexity", "mean KL", "p99 KL", "top-1 agreement"):
            t.add_column(c, justify="right")
        na = "—"
        t.add_row(str(rep.tokens), f"{rep.perplexity:.4f}",
                  f"{rep.reference_perplexity:.4f}" if rep.reference_perplexity else na,
                  f"{rep.kl_mean:.5f}" if rep.kl_mean is not None else na,
                  f"{rep.kl_p99:.5f}" if rep.kl_p99 is not None else na,
                  f"{rep.top1_agreement:.2%}" if rep.top1_agreement is not None else na)
        if not args.json:
            Console().print(t)
    if args.json:
        print(json.dumps(out | {"peak_rss_bytes": peak_rss_bytes()}))
    return 0
