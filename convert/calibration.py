"""Calibration inside kimi-convert: which calibration a conversion gets (the 1-2-bit presets measure
themselves by default), how it is described in the file's header, and measuring it — a data-free
conversion in the requested plan beside the output, kimi-run over text (or text it samples itself),
then the importance file — with what an interrupted run may reuse."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console

from kimistream.formats.constants import ROUTED_EXPERTS
from kimistream.formats.imatrix import SELF_CALIBRATION
from kimistream.formats.weightfile import WeightFileWriter

from .converter import ConversionError, same_sources

LOW_BIT = ("q2", "t1", "q1", "q1t")       # expert codecs whose quality depends on calibration: self-calibrated by default
NO_CALIBRATION = "none"


def _sha256_16(path: Path) -> str:
    from kimistream.formats.checksum import sha256_file
    return sha256_file(path, chunk=1 << 20)[:16]


def describe(args, calibration) -> str:
    """How the importances were obtained, as recorded in the file's header and the summary."""
    if calibration == SELF_CALIBRATION:
        how = f"self: {args.self_tokens} sampled tokens, seed {args.seed}"
        if args.max_context:
            how += f", windows of {args.max_context}"
    elif calibration:
        how = f"text {Path(calibration).name} (sha256 {_sha256_16(Path(calibration))})"
        if args.max_context:
            how += f" in windows of {args.max_context}"
    elif args.imatrix:
        try:
            return f"imatrix {args.imatrix.name} (sha256 {_sha256_16(args.imatrix)})"
        except OSError as e:
            raise ConversionError(f"{args.imatrix}: cannot read the importance file ({e.strerror})") from None
    else:
        return "none (data-free)"
    return f"{how}, moment budget {args.moment_budget}"


def resolve(args, plan):
    """(calibration, None) — TEXT_FILE, 'self' or None for no calibration run — or (None, (error, code)).
    Checked before hours of conversion, not after."""
    calibration = args.calibration
    if calibration is None and args.imatrix is None and plan.classes[ROUTED_EXPERTS] in LOW_BIT:
        calibration = SELF_CALIBRATION        # 1-2-bit experts need activation statistics (RESULTS.md)
    if calibration is not None and args.imatrix:
        return None, (f"give --calibration {calibration} or --imatrix, not both", 2)
    if calibration in (None, NO_CALIBRATION):
        return None, None
    from kimistream.formats.sizes import parse_size
    try:
        parse_size(args.moment_budget)
    except ValueError as e:
        return None, (f"--moment-budget: {e}", 2)
    if args.self_tokens < 2 or args.seed < 0:
        return None, ("--self-tokens must be at least 2 and --seed not negative", 2)
    if args.max_context is not None and args.max_context < 8:
        return None, ("--max-context must be at least 8", 2)
    if calibration != SELF_CALIBRATION:
        try:
            if not Path(calibration).read_text(encoding="utf-8").strip():
                return None, (f"{calibration}: the calibration file is empty", 1)
        except (OSError, UnicodeDecodeError) as e:
            return None, (f"{calibration}: cannot read the calibration text ({e})", 1)
    return calibration, None


def _made_from(header: dict, plan, ckpt) -> bool:
    """Whether a file's header (or an interrupted conversion's journal) comes from this checkpoint and
    plan: same config.json, every source file still present with its recorded size and SHA-256,
    same plan."""
    return (header.get("plan") == plan.to_json() and header.get("hf_config") == ckpt.hf_config
            and same_sources(ckpt, header))


def _measures(ref: Path, plan, ckpt) -> bool:
    """Whether `ref` is a complete data-free conversion of this checkpoint in `plan` (left by an
    interrupted calibration)."""
    from kimistream.formats.weightfile import WeightFile, WeightFileError
    try:
        with WeightFile(ref) as wf:
            return "imatrix" not in wf.header and _made_from(wf.header, plan, ckpt)
    except WeightFileError:
        return False


def _check_disk(ref: Path, plan, cfg) -> int:
    """Bytes the data-free conversion will write; an error if its filesystem has not that much free."""
    import shutil

    from kimistream.formats.codecs import get_codec
    from kimistream.formats.layout import plan_extents
    from kimistream.formats.sizes import fmt
    need = sum(get_codec(codec).nbytes(shape) for _, _, tensors in plan_extents(cfg, plan.codec_for)
               for _, _, codec, shape in tensors)
    partial = ref.with_name(ref.name + ".partial")
    have = partial.stat().st_blocks * 512 if partial.exists() else 0        # resumed, not rewritten
    ref.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(ref.parent).free
    if need - have > free:
        raise ConversionError(f"{ref.parent}: calibration needs {fmt(need - have)} free for its data-free "
                              f"conversion ({ref.name}), {fmt(free)} are: free space there, or pass "
                              f"--imatrix PATH or --calibration none")
    return need


def _calibrate(args, err: Console, out: Path, plan, calibration: str, ckpt, convert) -> Path:
    """Importance matrix for calibration: convert data-free in the requested plan beside the output,
    run kimi-run over the text (or `self`: text it samples), then delete that file. Interrupted or
    failed, it is kept (or its .partial), and the same command goes on from there.

    Measuring the data-free conversion rather than a bf16 copy costs little (stdlib-moe q2, self:
    KL 0.00432 against 0.00422 at 4096 tokens) and is what makes it practical at Kimi K2's scale: the
    file is the output's size (297 GiB, not 2 TB of bf16) and each sampled token reads about 6.5x fewer
    expert bytes."""
    import subprocess

    from kimistream.formats.sizes import fmt
    ref = out.with_name(out.name + ".calib.kst")
    im = out.with_name(out.name + ".imatrix.npz")
    say = (lambda m: None) if args.quiet else err.print
    if _measures(ref, plan, ckpt):
        say(f"calibration: reusing {ref}, the data-free conversion of an interrupted run")
    else:
        need = _check_disk(ref, plan, ckpt.config)
        say(f"calibration: data-free {plan.preset} conversion to measure ({ref}, {fmt(need)}, deleted after)")
        convert(ref, plan)
    what = (f"{args.self_tokens} tokens it samples itself (seed {args.seed})" if calibration == SELF_CALIBRATION
            else calibration)
    say(f"calibration: running it over {what}")
    # kimi-run draws its own progress bars on our stderr; quiet, its stderr is kept for the error.
    proc = subprocess.run(run_command(args, ref, im, calibration), stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE if args.quiet else None, text=True)
    if proc.returncode != 0:
        lines = (proc.stderr or "").strip().splitlines()
        why = (lines[-1].removeprefix("kimi-run: error: ") if lines
               else f"calibration run failed (kimi-run exit {proc.returncode}, its error is above)")
        raise ConversionError(f"{why} ({ref.name} is kept: the same command measures it without converting again)")
    ref.unlink()
    return im


def run_command(args, ref: Path, im: Path, calibration: str) -> list[str]:
    """The kimi-run command that measures `ref` into `im`, with only the flags this calibration reads
    (--self-tokens and --seed shape self-calibration alone)."""
    cmd = [sys.executable, "-m", "kimistream.runtime.cli", "--weights", str(ref), "--calibration",
           calibration, "--imatrix-out", str(im), "--moment-budget", str(args.moment_budget)]
    if calibration == SELF_CALIBRATION:
        cmd += ["--self-tokens", str(args.self_tokens), "--seed", str(args.seed)]
    if args.max_context is not None:
        cmd += ["--max-context", str(args.max_context)]
    if args.memory_budget:          # measured as it will run: layer by layer when its experts do not fit
        cmd += ["--memory-budget", str(args.memory_budget)] + (["--kv-dtype", args.kv_dtype] if args.kv_dtype else [])
    return cmd + (["--quiet"] if args.quiet else [])


def importance_for(args, err: Console, out: Path, plan, calibration: str, described: str, convert):
    """The Imatrix for this conversion: measured now, or the one an interrupted run of the same
    conversion already measured (its sources may be gone with --delete-source, and measuring can
    take hours). `convert(out, plan)` writes the data-free conversion."""
    from .source import open_checkpoint
    ckpt = open_checkpoint(args.source, allow_missing_shards=True)
    plan.for_model(ckpt.config.first_k_dense_replace, ckpt.config.num_hidden_layers)
    saved = out.with_name(out.name + ".imatrix.npz")
    journal = WeightFileWriter(out, args.alignment).journaled_meta()
    if journal and "imatrix" in journal and _made_from(journal, plan, ckpt):
        before = journal["imatrix"].get("calibration")
        if before == described and saved.exists():
            if not args.quiet:
                err.print(f"resuming {out}: reusing the calibration of the interrupted conversion ({saved})")
            return load(saved, args.source)
        if ckpt.missing_shards:
            raise ConversionError(f"{out}.partial: the interrupted conversion was calibrated with '{before}' and "
                                  f"has deleted source shards: rerun it with the same calibration flags, or "
                                  f"restore the checkpoint")
    return load(_calibrate(args, err, out, plan, calibration, ckpt, convert), args.source)


def load(path: Path, source: str):
    """An importance file, checked against the checkpoint's config and shapes."""
    from kimistream.formats.imatrix import load_imatrix
    from kimistream.formats.layout import model_shapes

    from .source import open_checkpoint
    ckpt = open_checkpoint(source, allow_missing_shards=True)
    return load_imatrix(path, ckpt.config.to_dict(), model_shapes(ckpt.config))
