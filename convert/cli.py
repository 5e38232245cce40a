"""kimi-convert: turn a Hugging Face DeepseekV3/Kimi-K2 checkpoint directory into one kimi-stream
weight file, with a rich progress bar and a summary of bytes and bits per weight by tensor class."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from kimistream.formats.constants import DEFAULT_ALIGNMENT, MAX_ALIGNMENT

from .converter import ConversionError, convert_checkpoint
from .plan import PRESETS, PrecisionPlan


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kimi-convert", description=__doc__)
    p.add_argument("source", help="checkpoint directory (config.json, *.safetensors, tokenizer files)")
    p.add_argument("-o", "--output", required=True, help="weight file to write (e.g. model.kst)")
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


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    err = Console(stderr=True)
    try:
        plan = PrecisionPlan.from_preset(args.quant, args.override)
    except ValueError as e:
        return _error(e, 2)
    out = Path(args.output)
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
        sys.stdout.write(json.dumps(summary.to_json()) + "\n")
    else:
        print_summary(Console(), summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
