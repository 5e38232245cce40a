"""kimi-convert: turn a Hugging Face DeepseekV3/Kimi-K2 checkpoint into one kimi-stream weight file,
with a rich progress bar and a summary of bytes and bits per weight by tensor class. The checkpoint is
a local directory, or REPO_ID[@REVISION] on the hub (or a mirror), or a list of URLs: downloaded first,
resumably and hash-checked, into a directory that kimi-verify can check later."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from kimistream.formats.constants import DEFAULT_ALIGNMENT, MAX_ALIGNMENT

from . import fetch as F
from . import hub as H
from .converter import ConversionError, convert_checkpoint
from .plan import PRESETS, PrecisionPlan


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kimi-convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", nargs="?",
                   help="checkpoint directory (config.json, *.safetensors, tokenizer files), or REPO_ID[@REVISION] "
                        "to download from the hub first (REVISION: branch, tag or commit; default main)")
    p.add_argument("-o", "--output", help="weight file to write (e.g. model.kst)")
    g = p.add_argument_group("downloading")
    g.add_argument("--download-only", action="store_true", help="download and verify the checkpoint, do not convert")
    g.add_argument("--dir", type=Path, help="download directory (default: ORG--NAME@COMMIT next to the output, "
                                            "or in the current directory with --download-only)")
    g.add_argument("--urls", type=Path, metavar="FILE", help="download the checkpoint from plain http(s) URLs: "
                                                             "one 'URL [SHA256]' per line (needs --dir)")
    g.add_argument("--endpoint", help="hub endpoint or mirror (default: $HF_ENDPOINT or the public hub); "
                                      "the token comes from $HF_TOKEN or a saved login")
    g.add_argument("--jobs", type=int, default=4, help="files downloaded in parallel (default 4)")
    g.add_argument("--retries", type=int, default=5, help="attempts per file before giving up (default 5)")
    g.add_argument("--retry-wait", type=float, default=2.0, metavar="SECONDS",
                   help="first back-off between attempts, doubled each time (default 2)")
    g.add_argument("--checksums", type=Path, metavar="DIR",
                   help="folder of ORG--NAME@COMMIT.sha256 manifests (default: this project's checksums/)")
    g.add_argument("--manifest", type=Path, metavar="FILE",
                   help="sha256sum-format manifest the downloaded files must also match")
    p.add_argument("--quant", default="bf16", choices=sorted(PRESETS), help="precision preset (default bf16)")
    p.add_argument("--override", action="append", default=[], metavar="REGEX=CODEC",
                   help="codec for tensors whose name matches REGEX (repeatable, first match wins)")
    p.add_argument("--alignment", type=int, default=DEFAULT_ALIGNMENT,
                   help=f"extent alignment in bytes, power of two 4096..{MAX_ALIGNMENT} (default 4096)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def print_summary(console: Console, summary) -> None:
    data = summary.to_json()
    t = Table(title=f"kimi-convert → {data['output']}")
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
    if data["skipped_source_tensors"]:
        console.print(f"[yellow]skipped {len(data['skipped_source_tensors'])} source tensor(s) the runtime does not "
                      f"use, e.g. {data['skipped_source_tensors'][0]}[/]")


def _error(msg, code: int = 1) -> int:
    # Plain print: one line, never wrapped to a terminal width.
    print(f"kimi-convert: error: {msg}", file=sys.stderr, flush=True)
    return code


def _download(args, err: Console, out: Path | None):
    """Fetch the checkpoint named by SOURCE or --urls; the Report, or an exit code after the errors."""
    try:
        if args.urls:
            return F.download_urls(args.urls, args.dir, jobs=args.jobs, retries=args.retries,
                                   retry_wait=args.retry_wait, manifest=args.manifest, console=err, quiet=args.quiet)
        base = out.parent if out is not None else Path(".")
        return F.download_repo(args.source, args.dir, base, endpoint=args.endpoint, jobs=args.jobs,
                               retries=args.retries, retry_wait=args.retry_wait, checksums_dir=args.checksums,
                               manifest=args.manifest, console=err, quiet=args.quiet)
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


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    err = Console(stderr=True)
    remote = args.urls is not None or (args.source is not None and not Path(args.source).is_dir()
                                       and H.is_repo_spec(args.source))
    if args.source is None and args.urls is None:
        return _error("give a checkpoint directory, a REPO_ID[@REVISION] or --urls FILE", 2)
    if args.source is not None and args.urls is not None:
        return _error("give either a source or --urls, not both", 2)
    if args.urls is not None and args.dir is None:
        return _error("--urls needs --dir (where the files go)", 2)
    if args.download_only and not remote:
        return _error(f"{args.source}: --download-only needs a REPO_ID[@REVISION] or --urls", 2)
    if not args.download_only and not args.output:
        return _error("-o/--output is required (or use --download-only)", 2)
    if args.jobs < 1 or args.retries < 1 or args.retry_wait < 0:
        return _error("--jobs and --retries must be at least 1, --retry-wait not negative", 2)
    try:
        plan = PrecisionPlan.from_preset(args.quant, args.override)
    except ValueError as e:
        return _error(e, 2)
    out = Path(args.output) if args.output else None
    report = None
    if remote:
        report = _download(args, err, out)
        if isinstance(report, int):
            return report
        if args.download_only:
            if args.json:
                sys.stdout.write(json.dumps({"download": report.to_json()}) + "\n")
            else:
                err.print(report.describe(), highlight=False, soft_wrap=True, markup=False)
            return 0
        if not args.json:
            err.print(report.describe(), highlight=False, soft_wrap=True, markup=False)
        args.source = str(report.directory)
    progress = Progress(TextColumn("[bold]converting"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                        TimeRemainingColumn(), TextColumn("{task.fields[tensor]}"), console=err,
                        disable=args.quiet)
    task = None

    def on_progress(kind, **info):
        nonlocal task
        if kind == "start":
            task = progress.add_task("convert", total=info["total_bytes"], tensor="")
        elif kind == "tensor":
            progress.update(task, advance=info["nbytes"], tensor=info["name"][-48:])

    try:
        with progress:
            summary = convert_checkpoint(args.source, out, plan, args.alignment, on_progress)
    except (ConversionError, ValueError, OSError) as e:
        return _error(e)
    except KeyboardInterrupt:
        return _error(f"interrupted; nothing written to {out}", 130)
    if args.json:
        data = summary.to_json()
        if report is not None:
            data["download"] = report.to_json()
        sys.stdout.write(json.dumps(data) + "\n")
    else:
        print_summary(Console(), summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
