"""kimi-verify's work once its arguments are parsed (convert/verify_cli.py): where the expected hashes
come from (a manifest, the project's checksums/, the hub's listing), the checks, and the report table."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table
from rich.text import Text

from kimistream.formats.gguffile import is_gguf
from kimistream.formats.interrupts import say

from . import hub as H
from . import verify as V
from .converter import MANIFEST_NAME
from .source import INDEX_FILE


class Expect:
    """What a directory (or a weight file's sources) should hold, and where that came from."""

    def __init__(self, sha256=None, sizes=None, git_blobs=None, sources=(), meta=None):
        self.sha256, self.sizes, self.git_blobs = sha256, sizes, git_blobs
        self.sources, self.meta = list(sources), dict(meta or {})


def _checksums_for(meta: dict, checksums_dir) -> Path | None:
    repo, rev = meta.get("repo"), (meta.get("revision") or "").lower()
    if repo and H.COMMIT_RE.match(rev):
        return H.find_checksums(repo, rev, checksums_dir)
    return None


def _from_manifests(directory: Path | None, args) -> Expect | None:
    """--manifest FILE, else DIR/kimi-stream.sha256 (its '# repo:' / '# revision:' also select
    checksums/ORG--NAME@COMMIT.sha256, which wins where both list a file), else checksums/DIRNAME.sha256
    (DIRNAME: the directory's own name, also when it is given as '.' or 'sub/..')."""
    if args.manifest:
        m = Path(args.manifest)
        return Expect(V.read_manifest(m), sources=[str(m)], meta=V.read_manifest_meta(m))
    if directory is None:
        return None
    local = directory / MANIFEST_NAME
    if local.is_file():
        hashes, meta, sources = V.read_manifest(local), V.read_manifest_meta(local), [str(local)]
        named = _checksums_for(meta, args.checksums)
        if named:
            hashes.update(V.read_manifest(named))
            sources.append(str(named))
        return Expect(hashes, sources=sources, meta=meta)
    # the directory's own name also for '.' or 'a/..' (Path('.').name is ''); a symlink keeps its name
    named = Path(args.checksums or H.CHECKSUMS_DIR) / f"{Path(os.path.abspath(directory)).name}.sha256"
    if named.is_file():
        return Expect(V.read_manifest(named), sources=[str(named)], meta=V.read_manifest_meta(named))
    return None


def _from_hub(snap, directory: Path | None, checksums_dir) -> Expect:
    """Expectations from a hub listing: for a directory, the small files it has and the shards named by
    the local index (or all top-level *.safetensors); for a weight file's sources, every file listed.
    LFS SHA-256 and git blob ids; a checksums/ manifest for the commit adds SHA-256 for files the hub
    has no SHA-256 of."""
    if directory is None:
        names = list(snap.files)
    else:
        names = [n for n in H.SMALL_FILES if n in snap.files] + _hub_shards(snap, directory)
    sha = {n: snap.files[n].sha256 for n in names if snap.files[n].sha256}
    sources = [f"{snap.spec} at {snap.endpoint}"]
    named = H.find_checksums(snap.repo_id, snap.commit, checksums_dir)
    if named:
        for n, h in V.read_manifest(named).items():
            sha.setdefault(n, h)
        sources.append(str(named))
    return Expect(sha, {n: snap.files[n].size for n in names if snap.files[n].size is not None},
                  {n: snap.files[n].git_sha1 for n in names if snap.files[n].git_sha1}, sources,
                  {"repo": snap.repo_id, "revision": snap.commit})


def _hub_shards(snap, directory: Path) -> list[str]:
    """Shards the hub has that the local index names (the index itself is checked as a file)."""
    index = None
    if INDEX_FILE in snap.files and (directory / INDEX_FILE).is_file():
        index = (directory / INDEX_FILE).read_bytes()
    try:
        shards = snap.shard_names(index) if (index is not None or INDEX_FILE not in snap.files) else []
    except H.HubError:
        shards = []                     # the index row reports a malformed index
    return [n for n in shards if n in snap.files]


def run(args) -> int:
    err = Console(stderr=True)
    all_rows, sources = [], []
    if args.jobs < 1:
        say("kimi-verify: error: --jobs must be >= 1")
        return 2
    if args.write_manifest and not any(Path(p).is_dir() for p in args.paths):
        say("kimi-verify: error: --write-manifest records a checkpoint directory's files: none of the paths is a directory")
        return 2
    dirs = [p for p in args.paths if Path(p).is_dir()]
    if args.write_manifest and len(dirs) > 1:
        say(f"kimi-verify: error: --write-manifest records one checkpoint directory's files (names relative to it): "
            f"{len(dirs)} directories given ({', '.join(dirs[:3])}{', ...' if len(dirs) > 3 else ''}); "
            f"write one manifest per directory")
        return 2
    progress = Progress(TextColumn("[bold]hashing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                        console=err, transient=True)
    try:
        snap = None
        if args.hub:
            repo_id, rev = H.parse_spec(args.hub)
            snap = H.list_snapshot(repo_id, rev, args.endpoint)
        # --manifest with --hub: a file must match both (a mismatch against either is corrupt)
        also = _from_manifests(None, args) if snap and args.manifest else None
        with progress:
            for raw in args.paths:
                path = Path(raw)
                task = progress.add_task(raw, total=None)
                adv = lambda n, t=task: progress.update(t, advance=n)   # noqa: E731
                if path.is_dir():
                    exp = _from_hub(snap, path, args.checksums) if snap else _from_manifests(path, args)
                    rows = V.verify_directory(path, exp and exp.sha256, args.jobs, adv,
                                              exp and exp.sizes, exp and exp.git_blobs,
                                              also and also.sha256, also and also.sources[0])
                    if args.write_manifest:
                        meta = {k: exp.meta[k] for k in ("repo", "revision") if exp and k in exp.meta}
                        V.write_manifest(Path(args.write_manifest),
                                         {r.file: r.sha256 for r in rows
                                          if r.status in (V.OK, V.UNVERIFIABLE) and r.sha256},
                                         [f"{k}: {v}" for k, v in meta.items()]
                                         + [f"kimi-verify manifest of {path.resolve()}"])
                    for r in rows:
                        r.file = f"{raw.rstrip('/')}/{r.file}"
                elif is_gguf(path):
                    exp = _from_manifests(None, args)
                    rows = V.verify_gguf(path, exp and exp.sha256, adv)
                else:
                    exp = _from_hub(snap, None, args.checksums) if snap else _from_manifests(None, args)
                    rows = V.verify_weight_file(path, args.jobs, adv, exp and exp.sha256,
                                                " and ".join(exp.sources) if exp else "",
                                                [(also.sha256, also.sources[0])] if also else ())
                for e in (exp, also):
                    if e:
                        sources += [s for s in e.sources if s not in sources]
                all_rows += rows
    except (ValueError, OSError) as e:
        say(f"kimi-verify: error: {e}")
        return 2
    code = V.exit_code(all_rows)
    if args.json:
        print(json.dumps({"ok": code == 0, "exit_code": code, "expected_from": sources,
                          "rows": V.rows_json(all_rows)}))
        return code
    # Text, not markup: file names and details may hold '[...]'
    t = Table(title="kimi-verify", caption=Text("expected hashes from " + ", ".join(sources)) if sources else None)
    for c in ("file", "size", "expected", "actual", "status"):
        t.add_column(c, overflow="fold")
    colors = {V.OK: "green", V.MISSING: "red", V.CORRUPT: "red", V.UNVERIFIABLE: "yellow", V.EXTRA: "yellow"}
    for r in all_rows:
        status = r.status + (f": {r.detail}" if r.detail else "")
        t.add_row(Text(r.file), "" if r.size is None else f"{r.size:,}", Text(r.expected[:16]), Text(r.actual[:16]),
                  Text(status, style=colors[r.status]))
    Console().print(t)
    return code

