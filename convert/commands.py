"""kimi-convert's work once its arguments are parsed (convert/cli.py): download, calibrate, convert,
publish or assemble, with progress bars and the summary table; every expected failure ends as one
line on standard error and an exit code."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from kimistream.formats.constants import DEFAULT_ALIGNMENT, MAGIC, MAX_ALIGNMENT, ROUTED_EXPERTS
from kimistream.formats.gguffile import is_gguf
from kimistream.formats.imatrix import SELF_CALIBRATION
from kimistream.formats.interrupts import say
from kimistream.formats.progress import Phase

from . import fetch as F
from . import hub as H
from . import calibration as C
from .converter import ConversionError, check_output_apart, consumed_shards, convert_checkpoint
from kimistream.formats.presets import PrecisionPlan
from .source import open_checkpoint


def run(args) -> int:
    err = Console(stderr=True)
    try:
        return _main(args, err)
    except (ConversionError, ValueError, OSError) as e:
        return _error(e)


def print_summary(console: Console, summary) -> None:
    data = summary.to_json()
    t = Table(title=Text(f"kimi-convert → {data['output']}"))
    for col in ("class", "tensors", "params", "bytes", "bits/weight"):
        t.add_column(col, justify="left" if col == "class" else "right")
    for cls, s in data["classes"].items():
        if s["tensors"]:
            t.add_row(cls, str(s["tensors"]), f"{s['params']:,}", f"{s['bytes']:,}", f"{s['bpw']:.3f}")
    tot = data["total"]
    t.add_row("total", str(tot["tensors"]), f"{tot['params']:,}", f"{tot['bytes']:,}", f"{tot['bpw']:.3f}",
              style="bold")
    console.print(t)
    console.print(f"file size {tot['file_bytes']:,} bytes")
    thr = data["throughput"]
    if thr["params_per_s"]:
        console.print(f"converted {thr['params']:,} parameters in {thr['seconds']:.1f} s "
                      f"({thr['params_per_s'] / 1e6:.2f} M/s)")
    mem = data["memory"]
    console.print(f"peak RSS {mem['peak_rss_bytes'] / 2**20:.1f} MiB (largest tensor as float32: "
                  f"{mem['largest_tensor_f32_bytes'] / 2**20:.1f} MiB)")
    if data["skipped_source_tensors"]:
        console.print(f"[yellow]skipped {len(data['skipped_source_tensors'])} source tensor(s) the runtime does not "
                      f"use, e.g. {escape(data['skipped_source_tensors'][0])}[/]", highlight=False, soft_wrap=True)


def _note(console: Console, text: str) -> None:
    """A message as it is: file names may hold '[...]' (rich markup) and are not wrapped at 80
    columns when the output is not a terminal."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def _error(msg, code: int = 1) -> int:
    # Plain print: one line, never wrapped to a terminal width.
    say(f"kimi-convert: error: {msg}")
    return code


def _download(args, err: Console, out: Path | None):
    """Fetch the checkpoint named by SOURCE or --urls; the Report, or an exit code after the errors."""
    # Shards an interrupted --delete-source conversion to `out` already consumed are not fetched again.
    consumed = consumed_shards(out) if args.delete_source and out is not None else None
    try:
        if args.urls:
            return F.download_urls(args.urls, args.dir, jobs=args.jobs, retries=args.retries,
                                   retry_wait=args.retry_wait, manifest=args.manifest, console=err, quiet=args.quiet,
                                   consumed=consumed)
        base = out.parent if out is not None else Path(".")
        return F.download_repo(args.source, args.dir, base, endpoint=args.endpoint, jobs=args.jobs,
                               retries=args.retries, retry_wait=args.retry_wait, checksums_dir=args.checksums,
                               manifest=args.manifest, console=err, quiet=args.quiet, consumed=consumed)
    except F.DownloadFailed as e:
        for fe in e.errors:
            _error(fe)
        return 1
    except H.HubError as e:
        local = Path(H.split_spec(args.source or "")[0])
        typo = local.parent.is_dir() and str(local.parent) != "."      # e.g. models/nmae: a local path?
        return _error(f"{e} (nor is there a local directory {local})" if typo else e)
    except (F.FetchError, ValueError, OSError) as e:
        return _error(e)
    except (KeyboardInterrupt, F.Interrupted) as e:
        where = (e.args[0] if isinstance(e, F.Interrupted) and e.args else None) or args.dir or "."
        return _error(f"{where}: interrupted; partial downloads kept as *.partial, run the same command to resume",
                      130)


def _run_with_progress(err: Console, label: str, quiet: bool, work, out: Path | None = None):
    """Call work(on_progress) with the converter's progress events shown as a phase on stderr (a bar
    on a terminal, lines otherwise: formats/progress.py)."""
    phase = None

    def on_progress(kind, **info):
        nonlocal phase
        if kind == "hashing":
            phase = Phase("hashing sources", info["total_bytes"], "bytes", quiet=quiet).__enter__()
        elif kind == "hashed" and phase is not None:
            phase.advance(info["nbytes"], info["name"])
        elif kind == "start":
            if phase is not None:
                phase.__exit__(None, None, None)
            phase = Phase(label, info["total_bytes"], "bytes", quiet=quiet).__enter__()
            if info.get("resumed"):
                phase.note(f"resuming {out}: {info['resumed']} of {info['tensors']} tensors already written")
        elif kind == "tensor" and phase is not None:
            phase.advance(info["nbytes"], info["name"])
        elif kind == "shard-done" and phase is not None:
            phase.note(f"consumed and deleted {info['path']}")

    try:
        result = work(on_progress)
    except BaseException as e:
        if phase is not None:
            phase.__exit__(type(e), e, e.__traceback__)
        raise
    if phase is not None:
        phase.__exit__(None, None, None)
    return result


def _converting(args, err: Console, out: Path, plan, imatrix=None, delete_source=None, calibration=None):
    """Run the converter with a progress bar; returns the summary."""
    delete = args.delete_source if delete_source is None else delete_source
    return _run_with_progress(err, "converting", args.quiet, lambda cb: convert_checkpoint(
        args.source, out, plan, args.alignment, cb, delete_source=delete, imatrix=imatrix,
        calibration=calibration, ray=args.ray), out)


def _publish(args, err: Console, path: Path, extents=None) -> dict:
    """Publish the weight file `path` into --publish DIR, every extent's checksum checked on the way
    (a damaged file is not published: the old release in DIR, if any, stays as it was)."""
    from kimistream.formats.sizes import parse_size
    from kimistream.formats.weightfile import WeightFile

    from .publish import publish
    from .verify import ExtentChecker
    if extents is None:
        with WeightFile(path) as wf:
            extents = list(wf.extents)
    checker = ExtentChecker(path, extents)
    with Phase("publishing", path.stat().st_size, "bytes", quiet=args.quiet) as phase:
        m = publish(path, args.publish, parse_size(args.chunk_size), progress=phase.advance, check=checker)
    _note(err, f"published {path} as {len(m['chunks'])} chunk(s) in {args.publish}, compression ratio "
               f"{m['compression_ratio']:.3f} (all {checker.checked} extent checksums checked)")
    return m


def _assemble(args, err: Console, release_dir: Path, out: Path, what: str, report=None) -> int:
    """Rebuild a release's weight file into `out`; with --json the result on stdout."""
    from .publish import assemble, find_manifest
    path = assemble(release_dir, out)
    _note(err, f"assembled {path} from {what} (every chunk's SHA-256 checked)")
    if args.json:
        _, m = find_manifest(release_dir)
        data = {"output": str(path), "file_bytes": path.stat().st_size, "sha256": m["sha256"],
                "assembled_from": str(release_dir), "release": m}
        if report is not None:
            data["download"] = report.to_json()
        sys.stdout.write(json.dumps(data) + "\n")
    return 0


def _all_float(plan) -> bool:
    """Whether a plan (preset classes and overrides) stores every tensor as floats."""
    from kimistream.formats.codecs import is_float_codec
    return plan.preset != "keep" and all(is_float_codec(c) for c in [*plan.classes.values(),
                                                                      *(c for _, c in plan.overrides)])


def _conversion_flags(args, quant_given: bool, given_flags: set = frozenset()) -> list[str]:
    """Flags given that only a conversion uses (not the assembly of a published release)."""
    return [f for f, v in (("--publish", args.publish), ("--quant", quant_given), ("--override", args.override),
                           ("--calibration", args.calibration), ("--imatrix", args.imatrix),
                           ("--memory-budget", args.memory_budget), ("--kv-dtype", args.kv_dtype),
                           ("--max-context", args.max_context is not None), ("--delete-source", args.delete_source),
                           ("--dry-run", args.dry_run), ("--synthetic", args.synthetic)) if v] + \
        [f for f in ("--alignment", "--self-tokens", "--moment-budget", "--seed") if f in given_flags]


def _lists_release(url_file) -> str | None:
    """The *.release.json a URL list names (it downloads a published release), if any."""
    from urllib.parse import unquote, urlsplit
    try:
        lines = Path(url_file).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None                       # the download says what is wrong with the list
    for line in lines:
        parts = line.split()
        if parts and not parts[0].startswith("#"):
            try:
                name = unquote(urlsplit(parts[0]).path.rsplit("/", 1)[-1])
            except ValueError:
                continue
            if name.endswith(".release.json"):
                return name
    return None


def _release_refusal(source, manifest_name: str, given: list[str]) -> str:
    return (f"{source}: is a published release ({manifest_name}): it is assembled into -o as it is; "
            f"{', '.join(given)} apply to a conversion")


def _fit(args, err: Console, cfg, plan, tokenizer_bytes: int | None = None) -> dict | int | None:
    """--memory-budget / --dry-run: choose resident precisions (in `plan`) and say what was chosen; with
    --dry-run the plan is printed and the exit code returned instead."""
    from kimistream.formats import memplan
    from kimistream.formats.sizes import fmt

    from .fitting import FitError, fit_to_budget
    fit = None
    if args.memory_budget:
        try:
            fit = fit_to_budget(cfg, plan, args.memory_budget, args.max_context, args.kv_dtype,
                                **({"tokenizer_bytes": tokenizer_bytes} if tokenizer_bytes is not None else {}))
        except FitError as e:
            return _error(e, 2)
        if not args.json or args.dry_run:
            for line in fit.lines():
                err.print(line, highlight=False, markup=False, soft_wrap=True)
    if not args.dry_run:
        return fit.to_json() if fit else None
    plan.for_model(cfg.first_k_dense_replace, cfg.num_hidden_layers)
    fp, file_bytes = memplan.of_config(cfg, plan, alignment=args.alignment,
                                       **({"tokenizer_bytes": tokenizer_bytes} if tokenizer_bytes is not None else {}))
    data = {"classes": plan.classes, "file_bytes": file_bytes, "resident_bytes": fp.resident,
            "expert_bytes": fp.expert_bytes, "experts": fp.total_experts}
    if fit:
        data["memory_fit"] = fit.to_json()
    if args.json:
        sys.stdout.write(json.dumps(data) + "\n")
        return 0
    con = Console(soft_wrap=True, highlight=False)
    if plan.tensors:                         # --quant keep: each tensor's own type
        from collections import Counter
        con.print(f"preset {args.quant}: " + ", ".join(f"{n} tensors {codec}" for codec, n in
                                                      Counter(plan.tensors.values()).most_common()))
    else:
        con.print(f"preset {args.quant}: " + ", ".join(f"{cls} {codec}" for cls, codec in plan.classes.items()))
    con.print(f"file {fmt(file_bytes)}, resident {fmt(fp.resident)} (float32 copies included), "
                    f"{fp.total_experts} experts of {fmt(fp.expert_bytes)}")
    if fit:
        con.print(f"memory plan for a budget of {fmt(fit.budget)}:")
        for label, n in fit.rows():
            con.print(f"  {label:<58} {fmt(n):>12}")
    return 0


def _misplaced(args, quant_given: bool, given_flags: set = frozenset()) -> str | None:
    """A flag the chosen job would not use, or an output that cannot be one (one line, before any work)."""
    if args.output and (args.output.endswith(("/", os.sep)) or Path(args.output).is_dir()):
        return f"{args.output}: is a directory (-o names the weight file to write)"
    if (wrong := _bad_number(args)) is not None:
        return wrong
    if args.sparse and not args.synthetic:
        return "--sparse applies to --synthetic"
    if args.kv_dtype and not args.memory_budget:
        return "--kv-dtype applies to --memory-budget (the KV cache the memory plan holds)"
    if "--alignment" in given_flags and (args.assemble or args.download_only or (args.publish and args.source and Path(
            args.source).is_file() and not is_gguf(args.source))):
        return "--alignment applies to a conversion (a published or assembled file keeps its own)"
    if args.publish:
        from kimistream.formats.sizes import fmt, parse_size

        from .publish import READ_BLOCK
        try:
            chunk = parse_size(args.chunk_size)
        except ValueError as e:
            return f"--chunk-size: {e}"
        if chunk < READ_BLOCK:
            return f"--chunk-size must be at least {fmt(READ_BLOCK)} ({READ_BLOCK} bytes), got {args.chunk_size}"
        from .publish import other_release
        kst = args.source and Path(args.source).is_file() and not is_gguf(args.source)
        name = Path(args.source).name if kst else Path(args.output).name if args.output else None
        if name and (problem := other_release(args.publish, name)):
            return f"--publish {problem}"
    if args.publish and args.source and Path(args.source).is_file() and not is_gguf(args.source):
        given = [f for f, v in (("-o", args.output), ("--quant", quant_given), ("--override", args.override),
                                ("--calibration", args.calibration), ("--imatrix", args.imatrix),
                                ("--memory-budget", args.memory_budget), ("--synthetic", args.synthetic)) if v]
        if given:
            return (f"--publish {args.source}: publishes that weight file as it is; {', '.join(given)} "
                    f"apply to a conversion (give the checkpoint to convert and publish)")
    if args.quant == "keep" and not args.override and (args.calibration not in (None, "none") or args.imatrix):
        return ("--quant keep keeps the GGUF file's own values: --calibration and --imatrix would change "
                "none of them (give an --override to re-encode tensors with them)")
    if args.synthetic:
        given = [f for f, v in (("a source", args.source), ("--urls", args.urls),
                                ("--calibration", args.calibration), ("--imatrix", args.imatrix),
                                ("--delete-source", args.delete_source),
                                ("--self-tokens", "--self-tokens" in given_flags),
                                ("--moment-budget", "--moment-budget" in given_flags),
                                ("--max-context", args.max_context is not None and not args.memory_budget))
                 if v]
        if given:
            return f"--synthetic writes random weights: {', '.join(given)} do not apply"
    return None


# Flags whose default is filled in only after the job is known: given, they must apply to it.
DEFAULTS = {"alignment": DEFAULT_ALIGNMENT, "self_tokens": 16384, "seed": 0, "moment_budget": "2G"}


def _given(args) -> set[str]:
    """The DEFAULTS flags given on the command line ('--self-tokens'...); fills in the others."""
    given = set()
    for key, default in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, default)
        else:
            given.add("--" + key.replace("_", "-"))
    return given


def _foreign_output(out: Path | None) -> str | None:
    """Why -o must not be written: an existing non-empty file that is not a kimi-stream weight file
    (overwriting it would lose something no conversion made)."""
    try:
        with open(out, "rb") as f:
            head = f.read(len(MAGIC))
    except (TypeError, OSError):
        return None                   # none, or unreadable: the writer says why
    if head and head != MAGIC:
        return f"{out}: exists and is not a kimi-stream weight file (-o would overwrite it: remove it or choose another -o)"
    return None


def _bad_number(args) -> str | None:
    """A numeric flag out of its range, named (one line, before any work)."""
    a = args.alignment
    if a < 4096 or a > MAX_ALIGNMENT or a & (a - 1):
        return f"--alignment must be a power of two in 4096..{MAX_ALIGNMENT}, got {a}"
    if args.seed < 0:
        return f"--seed must not be negative, got {args.seed}"
    return None


def _unused_calibration_flags(args, calibration, given_flags: set) -> str | None:
    """Calibration's flags given to a conversion that runs no calibration (or not the one they tune).
    An explicit --calibration none switches calibration off and lets its flags stay on the line."""
    if calibration is None and args.calibration is None:
        unused = sorted(f for f in ("--self-tokens", "--moment-budget", "--seed") if f in given_flags)
        if args.max_context is not None and not args.memory_budget:
            unused.append("--max-context")
        if unused:
            why = "--imatrix gives the importances measured already" if args.imatrix else \
                f"--quant {args.quant} is not self-calibrated by default; give --calibration self or TEXT_FILE"
            return (f"{', '.join(unused)} tune{'s' if len(unused) == 1 else ''} a calibration, and this conversion "
                    f"runs none ({why})")
    elif calibration is not None and calibration != SELF_CALIBRATION:
        unused = [f for f in ("--self-tokens", "--seed") if f in given_flags]
        if unused:
            return f"{', '.join(unused)} tune{'s' if len(unused) == 1 else ''} self-calibration, not calibration over a text file"
    return None


def _main(args, err: Console) -> int:
    quant_given = args.quant is not None
    args.quant = args.quant or "bf16"
    given_flags = _given(args)
    if (wrong := _misplaced(args, quant_given, given_flags)) is not None:
        return _error(wrong, 2)
    out = Path(args.output) if args.output else None
    if args.ray and (args.assemble or args.synthetic or args.download_only):
        return _error("--ray encodes a checkpoint's tensors: it does not apply to --assemble, --synthetic or "
                      "--download-only", 2)
    if args.assemble:
        given = [f for f, v in (("a source", args.source), ("--urls", args.urls),
                                ("--download-only", args.download_only), ("--dir", args.dir),
                                ("--manifest", args.manifest)) if v]
        given += _conversion_flags(args, quant_given, given_flags)
        if given:
            return _error(f"--assemble rebuilds a published release as it is: {', '.join(given)} do not apply", 2)
        if out is None:
            return _error("--assemble needs -o OUT", 2)
        if (wrong := _foreign_output(out)) is not None:
            return _error(wrong, 2)
        return _assemble(args, err, args.assemble, out, str(args.assemble))
    if args.publish and args.source and Path(args.source).is_file() and not is_gguf(args.source):
        from kimistream.formats.weightfile import WeightFile, WeightFileError
        try:
            with WeightFile(args.source) as wf:  # a release is of a weight file: its header checked first
                extents = list(wf.extents)
        except WeightFileError as e:
            return _error(e, 2)
        m = _publish(args, err, Path(args.source), extents)
        if args.json:
            sys.stdout.write(json.dumps({"release": m}) + "\n")
        return 0
    if args.synthetic:
        from .synthetic import SyntheticError, synthetic_config, write_synthetic
        if out is None and not args.dry_run:
            return _error("--synthetic needs -o OUT", 2)
        if args.quant == "keep":
            return _error("--quant keep keeps a GGUF file's own block types: not for --synthetic (choose a preset)", 2)
        if not args.dry_run and (wrong := _foreign_output(out)) is not None:
            return _error(wrong, 2)
        try:
            plan = PrecisionPlan.from_preset(args.quant, args.override)
        except ValueError as e:
            return _error(e, 2)
        fit = None
        if args.memory_budget or args.dry_run:
            try:
                fit = _fit(args, err, synthetic_config(args.synthetic), plan)
            except SyntheticError as e:
                return _error(e, 2)
            if isinstance(fit, int):
                return fit
        path = _run_with_progress(err, "writing synthetic", args.quiet, lambda cb: write_synthetic(
            args.synthetic, out, plan, sparse=args.sparse, seed=args.seed, progress=cb, alignment=args.alignment))
        _note(err, f"wrote {path} ({path.stat().st_size:,} bytes{', experts sparse' if args.sparse else ''})")
        if args.json:
            sys.stdout.write(json.dumps({"output": str(path), "file_bytes": path.stat().st_size, "sparse": args.sparse,
                                         "classes": plan.classes, "memory_fit": fit}) + "\n")
        return 0
    local = args.source is not None and (Path(args.source).is_dir() or Path(args.source).is_file())
    remote = args.urls is not None or (args.source is not None and not local
                                       and H.is_repo_spec(args.source))
    if args.source is None and args.urls is None:
        return _error("give a checkpoint directory, a REPO_ID[@REVISION] or --urls FILE", 2)
    if args.source is not None and args.urls is not None:
        return _error("give either a source or --urls, not both", 2)
    if args.urls is not None and args.dir is None:
        return _error("--urls needs --dir (where the files go)", 2)
    if args.download_only and not remote:
        return _error(f"{args.source}: --download-only needs a REPO_ID[@REVISION] or --urls", 2)
    if not args.download_only and not args.output and not args.dry_run:
        return _error("-o/--output is required (or use --download-only)", 2)
    if args.dry_run and (remote or not local):
        return _error(f"{args.source or args.urls}: --dry-run plans a local checkpoint (directory or GGUF) or --synthetic CONFIG "
                      "(for a model on the hub: kimi-run --plan-config its config.json)", 2)
    if args.jobs < 1 or args.retries < 1 or args.retry_wait < 0:
        return _error("--jobs and --retries must be at least 1, --retry-wait not negative", 2)
    try:
        plan = PrecisionPlan.from_preset(args.quant, args.override)
    except ValueError as e:
        return _error(e, 2)
    if args.quant == "keep" and not (local and is_gguf(args.source)):
        return _error(f"{args.source or args.urls}: --quant keep keeps a GGUF file's own block types; this source is "
                      f"not a GGUF file (choose a preset)", 2)
    calibration, problem = C.resolve(args, plan)
    if problem:
        return _error(*problem)
    if (unused := _unused_calibration_flags(args, calibration, given_flags)) is not None:
        return _error(unused, 2)
    report = None
    given = _conversion_flags(args, quant_given, given_flags)
    if args.urls is not None and not args.download_only and given and (name := _lists_release(args.urls)):
        return _error(_release_refusal(args.urls, name, given), 2)       # before downloading it
    if remote and not args.download_only and (wrong := _foreign_output(out)) is not None:
        return _error(wrong, 2)                                           # before downloading
    if args.download_only and (given or args.output):
        flags = given + (["-o"] if args.output else [])
        return _error(f"--download-only fetches and checks files only: {', '.join(flags)} "
                      f"{'applies' if len(flags) == 1 else 'apply'} to a conversion (drop --download-only to "
                      f"convert as well)", 2)
    if remote:
        report = _download(args, err, out)
        if isinstance(report, int):
            return report
        releases = sorted(Path(report.directory).glob("*.release.json"))
        if releases and not args.download_only:
            if given:
                return _error(_release_refusal(args.source or args.urls, releases[0].name, given), 2)
            return _assemble(args, err, Path(report.directory), out, "the downloaded release", report)
        if args.download_only:
            if args.json:
                sys.stdout.write(json.dumps({"download": report.to_json()}) + "\n")
            else:
                err.print(report.describe(), highlight=False, soft_wrap=True, markup=False)
            return 0
        if not args.json:
            err.print(report.describe(), highlight=False, soft_wrap=True, markup=False)
        args.source = str(report.directory)
    fit = None
    if Path(args.source).is_dir() or Path(args.source).is_file():
        # before anything is written: -o must not be any file the conversion reads
        ckpt = open_checkpoint(args.source, allow_missing_shards=True)
        try:
            if out is not None:
                check_output_apart(ckpt, out, [args.imatrix] if args.imatrix else [])
                if not args.dry_run and (wrong := _foreign_output(out)) is not None:
                    return _error(wrong, 2)
            if (calibration not in (None, C.NO_CALIBRATION) or args.imatrix) and _all_float(plan):
                flag = "--imatrix" if args.imatrix else f"--calibration {calibration}"
                return _error(f"{flag}: --quant {args.quant} stores every tensor as floats, which no importance "
                              f"weighs (it applies to block codecs: q8 .. q1)", 2)
            if args.quant == "keep":             # before planning: every tensor's own codec, not the preset's
                plan.tensors = ckpt.keep_codecs()
            if args.memory_budget or args.dry_run:
                fit = _fit(args, err, ckpt.config, plan, sum(map(len, ckpt.tokenizer_files().values())))
            stacked = getattr(ckpt, "quantized_types", lambda: [])()
            if stacked and args.quant != "keep" and not args.quiet:
                err.print(f"[yellow]warning:[/] {escape(str(args.source))} holds {', '.join(stacked)} blocks: "
                          f"--quant {args.quant} "
                          f"quantizes their dequantized values again (two quantizations stacked)", highlight=False,
                          soft_wrap=True)
        finally:
            ckpt.close()
        if isinstance(fit, int):
            return fit
    imatrix = None
    described = C.describe(args, calibration)
    if calibration:
        imatrix = C.importance_for(args, err, out, plan, calibration, described,
                                  lambda ref, p: _converting(args, err, ref, p, delete_source=False))
    elif args.imatrix:
        imatrix = C.load(args.imatrix, args.source)
    elif plan.classes[ROUTED_EXPERTS] in C.LOW_BIT and not args.quiet:
        err.print("[yellow]note:[/] data-free fit: 1-2-bit experts lose 1.3-2x more KL than calibrated ones "
                  "(benchmarks/RESULTS.md); the default, self-calibration, needs no data", highlight=False,
                  soft_wrap=True)
    summary = _converting(args, err, out, plan, imatrix, calibration=described)
    data = summary.to_json()
    data["calibration"] = described
    if fit:
        data["memory_fit"] = fit
    if report is not None:
        data["download"] = report.to_json()
    if args.publish:
        data["release"] = _publish(args, err, out)
    if args.json:
        sys.stdout.write(json.dumps(data) + "\n")
    else:
        print_summary(Console(), summary)
        _note(Console(), f"calibration: {described}")
    return 0

