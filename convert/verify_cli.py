"""kimi-verify: check checkpoint directories (every shard present, headers sane, SHA-256 against a
manifest) and converted weight files (header and every extent checksum). Exit 0 only when all is
verified; 3 = something missing, 4 = something corrupt, 5 = something could not be verified."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table

from . import verify as V
from .converter import MANIFEST_NAME

REPO_CHECKSUMS = Path(__file__).resolve().parent.parent / "checksums"


def build_parser():
    p = argparse.ArgumentParser(prog="kimi-verify", description=__doc__)
    p.add_argument("paths", nargs="+", help="checkpoint directories and/or .kst weight files")
    p.add_argument("--manifest", help="sha256sum-format manifest for a checkpoint directory")
    p.add_argument("--write-manifest", metavar="FILE", help="write the SHA-256 of a directory's files to FILE")
    p.add_argument("--jobs", type=int, default=2, help="files hashed in parallel (default 2)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    return p


def _find_manifest(directory: Path, explicit: str | None):
    if explicit:
        return V.read_manifest(Path(explicit)), explicit
    local = directory / MANIFEST_NAME
    if local.is_file():
        return V.read_manifest(local), str(local)
    named = REPO_CHECKSUMS / f"{directory.name}.sha256"
    if named.is_file():
        return V.read_manifest(named), str(named)
    return None, None


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    err = Console(stderr=True)
    all_rows = []
    progress = Progress(TextColumn("[bold]hashing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                        console=err, transient=True)
    try:
        with progress:
            for raw in args.paths:
                path = Path(raw)
                task = progress.add_task(raw, total=None)
                adv = lambda n, t=task: progress.update(t, advance=n)   # noqa: E731
                if path.is_dir():
                    manifest, source = _find_manifest(path, args.manifest)
                    rows = V.verify_directory(path, manifest, args.jobs, adv)
                    if args.write_manifest:
                        V.write_manifest(Path(args.write_manifest),
                                         {r.file: r.actual for r in rows if r.actual and r.status != V.EXTRA},
                                         [f"kimi-verify manifest of {path.resolve()}"])
                    for r in rows:
                        r.file = f"{raw.rstrip('/')}/{r.file}"
                else:
                    rows = V.verify_weight_file(path, args.jobs, adv)
                all_rows += rows
    except (ValueError, OSError) as e:
        print(f"kimi-verify: error: {e}", file=sys.stderr)
        return 2
    code = V.exit_code(all_rows)
    if args.json:
        print(json.dumps({"ok": code == 0, "exit_code": code, "rows": V.rows_json(all_rows)}))
        return code
    t = Table(title="kimi-verify")
    for c in ("file", "size", "expected", "actual", "status"):
        t.add_column(c, overflow="fold")
    colors = {V.OK: "green", V.MISSING: "red", V.CORRUPT: "red", V.UNVERIFIABLE: "yellow", V.EXTRA: "yellow"}
    for r in all_rows:
        status = r.status + (f": {r.detail}" if r.detail else "")
        t.add_row(r.file, "" if r.size is None else f"{r.size:,}", r.expected[:16], r.actual[:16],
                  f"[{colors[r.status]}]{status}[/]")
    Console().print(t)
    return code


if __name__ == "__main__":
    sys.exit(main())
