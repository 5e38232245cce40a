"""Downloading a checkpoint (from a hub repo at a pinned commit, or from a list of plain URLs) so that
nothing unverified ever gets a final name. Owns: HTTP Range resume into `NAME.partial`, SHA-256 (and
git blob id) computed while bytes arrive, several files in parallel with retries and exponential
back-off, the rich progress display, refusing server-given names that would leave the directory, and
the `kimi-stream.sha256` manifest (with `# repo:` / `# revision:`) that a finished download leaves.
A rerun hashes a file already in place again unless it is provably the file a run verified: its size,
modification and change times and inode as recorded then (`.kimi-stream.sha256.stat`)."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import random
import re
import shutil
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx2
from huggingface_hub.utils import build_hf_headers
from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)

from kimistream.formats.progress import Phase
from kimistream.formats.sizes import fmt as fmt_bytes

from . import hub as H
from .converter import MANIFEST_NAME
from .source import INDEX_FILE, has_control_chars
from .verify import read_manifest, read_manifest_meta, write_manifest

JOURNAL_NAME = MANIFEST_NAME + ".partial"    # the manifest while the download is still going on
# What each verified file's stat was when it was hashed (a hidden file: kimi-verify lists the other
# files it does not know as extra).
STATE_NAME = "." + MANIFEST_NAME + ".stat"
INTERRUPT_GRACE_S = 1.0                      # how long Ctrl-C waits for the transfers to wind down
MAX_HASH_RESTARTS = 2                        # full downloads of one file whose hash came out wrong


class FetchError(Exception):
    """A problem with one file (or the whole job), reported as 'PATH: problem'."""

    def __init__(self, path, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = str(path), problem


class DownloadFailed(Exception):
    def __init__(self, errors: list[FetchError], directory: Path | None = None):
        super().__init__("; ".join(map(str, errors)))
        self.errors, self.directory = errors, directory


class Interrupted(Exception):
    pass


class _Retry(Exception):
    """A fault worth another attempt. `discard`: the partial's bytes cannot be trusted."""

    def __init__(self, problem: str, discard: bool = False, retry_after: float | None = None):
        super().__init__(problem)
        self.discard, self.retry_after = discard, retry_after


class _Fatal(Exception):
    pass


def _version() -> str:
    try:
        return version("kimi-stream")
    except PackageNotFoundError:
        return "0"


# ---------------------------------------------------------------------------------------------- names

def safe_relpath(name: str, directory: Path) -> str:
    """`name` if it is a plain relative path that stays inside `directory`, else ValueError saying why."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise ValueError(f"file name {name!r} is empty or not text")
    if has_control_chars(name):                 # a newline would forge lines of the manifest
        raise ValueError(f"file name {name!r} contains a control character (a newline, tab or the like)")
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        raise ValueError(f"file name {name!r} is an absolute path")
    if "\\" in name:
        raise ValueError(f"file name {name!r} contains a backslash")
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"file name {name!r} would escape the target directory ('..', '.' or empty part)")
    if parts[0].startswith((MANIFEST_NAME, STATE_NAME)) or name.endswith(".partial"):
        raise ValueError(f"file name {name!r} collides with kimi-stream's own bookkeeping files")
    root = Path(directory).resolve()
    if not (root / name).resolve().is_relative_to(root):
        raise ValueError(f"file name {name!r} would escape the target directory (through a symlink)")
    return name


def default_dirname(repo_id: str, commit: str) -> str:
    return H.manifest_filename(repo_id, commit).removesuffix(".sha256")


# -------------------------------------------------------------------------------------------- targets

@dataclass
class Target:
    """One file to fetch and what it must turn out to be."""
    name: str                     # relative path inside the directory (already checked safe)
    url: str
    size: int | None = None       # expected size in bytes (None: as the server says)
    sha256: str | None = None     # expected SHA-256
    sha256_from: str = ""         # where that expectation comes from, for messages
    git_sha1: str | None = None   # expected git blob id (hub files stored in git, not LFS)
    commit: str | None = None     # the X-Repo-Commit the hub must report
    auth: bool = False            # send the hub token (only ever to the hub endpoint)
    estimate: int | None = None   # a size hint (a HEAD answer) for totals and the free-space check only


@dataclass
class Result:
    name: str
    size: int
    sha256: str
    status: str                   # "downloaded", "present" or "consumed" (see Downloader)
    resumed_from: int = 0         # bytes already in NAME.partial when this run started on it
    transferred: int = 0          # bytes received over the network for it in this run
    attempts: int = 0
    # "hashed": its size and hash checked in this run; "unchanged": present, hashed by an earlier run
    # and provably not written since (same size, mtime, ctime and inode); "": consumed (not here)
    checked: str = "hashed"


class _Hashes:
    """SHA-256 (and the git blob id when one is expected) of the bytes so far, updated as they arrive."""

    def __init__(self, t: Target):
        self.t = t
        self.reset()

    def reset(self):
        self.offset = 0
        self.sha256 = hashlib.sha256()
        self.git = hashlib.sha1(b"blob %d\0" % self.t.size) if self.t.git_sha1 and self.t.size is not None else None

    def update(self, block: bytes):
        self.sha256.update(block)
        if self.git is not None:
            self.git.update(block)
        self.offset += len(block)


# ------------------------------------------------------------------------------------------- progress

class TransferProgress:
    """One bar per active file and a total with rate and ETA (rich; transient, on stderr); when stderr
    is not a terminal, the total as plain lines instead (formats/progress.py). Set `failed` to the
    number of errors (files or list lines) before the block ends: the last line then says the
    download stopped, not that it is done."""

    def __init__(self, console: Console, enabled: bool = True):
        self.console = console
        self.lines = enabled and not console.is_terminal
        self.p = Progress(TextColumn("{task.description}", justify="left"), BarColumn(), DownloadColumn(),
                          TransferSpeedColumn(), TimeRemainingColumn(), console=console, transient=True,
                          disable=not enabled or self.lines)
        self.total = None
        self.phase = None
        self._lock = threading.Lock()
        self.files_done = self.files_total = 0
        self.bytes_total = 0
        self.failed = 0

    def __enter__(self):
        self.p.start()
        return self

    def __exit__(self, kind, value, tb):
        self.p.stop()
        with self._lock:                       # a worker still winding down prints no more lines
            phase, self.phase = self.phase, None
        if phase is None:
            return
        if kind is None and self.failed:
            # Phase's own last line says "done" whenever the bytes counted reach the total (sizes
            # unknown: a total of 0); a failed download says it stopped, and Phase stays silent.
            pct = f" ({min(phase.done / phase.total, 1.0):.0%})" if phase.total else ""
            of = f" of {fmt_bytes(phase.total)}{pct}" if phase.total else ""
            phase.note(f"{phase.label}: stopped at {fmt_bytes(phase.done)}{of}, with {self.failed} "
                       f"error{'s' if self.failed != 1 else ''}")
            phase.__exit__(DownloadFailed, None, None)
        else:
            phase.__exit__(kind, value, tb)

    def begin(self, nfiles: int, nbytes: int):
        with self._lock:
            self.files_done, self.files_total, self.bytes_total = 0, nfiles, nbytes
            if self.total is None:
                self.total = self.p.add_task(self._desc(), total=nbytes)
            else:
                self.p.reset(self.total, total=nbytes, description=self._desc())
            if self.lines and self.phase is None:
                self.phase = Phase("downloading", nbytes, "bytes", terminal=False).__enter__()
            elif self.phase is not None:
                self.phase.total = nbytes

    def _desc(self) -> str:
        return f"[bold]total[/] {self.files_done}/{self.files_total} files"

    def add_file(self, desc: str, size: int | None):
        return self.p.add_task(desc, total=size)

    def update_file(self, task, **kw):
        self.p.update(task, **kw)

    def transferred(self, task, n: int):
        self.p.update(task, advance=n)
        self.p.update(self.total, advance=n)
        with self._lock:
            if self.phase is not None:
                self.phase.advance(n)

    def not_needed(self, n: int):
        """`n` bytes need no transfer (a file found complete, or a partial already on disk); negative:
        bytes to transfer again (a partial discarded)."""
        with self._lock:
            self.bytes_total = max(0, self.bytes_total - n)
            self.p.update(self.total, total=self.bytes_total)
            if self.phase is not None:
                self.phase.total = self.bytes_total

    def remove_file(self, task):
        self.p.remove_task(task)

    def file_done(self):
        with self._lock:
            self.files_done += 1
            self.p.update(self.total, description=self._desc())

    def warn(self, msg: str):
        self.console.print(f"[yellow]kimi-convert: warning:[/] {escape(msg)}", highlight=False, soft_wrap=True)


# -------------------------------------------------------------------------------------------- journal

def _stat_key(st: os.stat_result) -> list[int]:
    """What must stay the same for a file to be the one hashed before: rewriting it in place changes
    the modification time (and the change time, which no tool sets back), replacing it the inode."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


class Journal:
    """The verified files of one download (`NAME.partial` of the manifest), appended as each file is
    renamed into place; `finish` turns it into `kimi-stream.sha256`. Entries survive an interrupted
    run. Beside it, `.kimi-stream.sha256.stat` records each verified file's size, mtime, ctime and
    inode as they were when it was hashed: a re-run trusts a final file without hashing it again only
    if all of them are unchanged (`unchanged`); any file without such a record is hashed again."""

    def __init__(self, directory: Path, meta: dict[str, str]):
        self.dir = directory
        self.meta = meta
        self.final = directory / MANIFEST_NAME
        self.path = directory / JOURNAL_NAME
        self.state = directory / STATE_NAME
        self.hashes: dict[str, str] = {}
        self.stats: dict[str, list] = {}       # name -> [sha256, *_stat_key] when it was hashed
        self._lock = threading.Lock()
        for p in (self.final, self.path):
            if p.is_file():
                try:
                    found = read_manifest_meta(p)
                    if all(found.get(k) == meta.get(k) for k in (*meta, "repo", "revision", "urls")):
                        self.hashes.update(read_manifest(p))
                except (ValueError, UnicodeDecodeError, OSError):
                    pass
        try:
            for line in self.state.read_text().splitlines():     # later lines override earlier ones
                try:
                    e = json.loads(line)
                    name = e["name"]
                    if not isinstance(name, str):
                        continue
                except (ValueError, KeyError, TypeError):
                    continue
                try:
                    rec = [e["sha256"], *(int(e[k]) for k in ("size", "mtime_ns", "ctime_ns", "ino"))]
                except (ValueError, KeyError, TypeError):
                    rec = None                   # forgotten, or a torn line: that file is hashed again
                if rec is not None and self.hashes.get(name) == rec[0]:
                    self.stats[name] = rec
                else:
                    self.stats.pop(name, None)
        except (OSError, UnicodeDecodeError):
            pass
        directory.mkdir(parents=True, exist_ok=True)
        lines = [f"# {k}: {v}" for k, v in meta.items()] + [f"{h}  {n}" for n, h in sorted(self.hashes.items())]
        tmp = directory / (JOURNAL_NAME + ".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(self.path)
        self._write_state(self.stats)

    def _write_state(self, stats: dict):
        tmp = self.dir / (STATE_NAME + ".tmp")
        tmp.write_text("".join(_state_line(n, rec) for n, rec in sorted(stats.items())))
        tmp.replace(self.state)

    def get(self, name: str) -> str | None:
        return self.hashes.get(name)

    def unchanged(self, name: str, path: Path) -> str | None:
        """The SHA-256 this download recorded for `name` if `path` is still the very file it hashed
        (same size, mtime, ctime and inode as then), else None."""
        sha, rec = self.hashes.get(name), self.stats.get(name)
        if sha is None or rec is None or rec[0] != sha:
            return None
        try:
            return sha if rec[1:] == _stat_key(path.stat()) else None
        except OSError:
            return None

    def add(self, name: str, sha256: str, stat: os.stat_result | None = None):
        """`name` verified with `sha256`; `stat`: the file's stat when it had those bytes (None: the
        file is not here, or may have changed while it was hashed)."""
        with self._lock:
            self.hashes[name] = sha256
            with open(self.path, "a") as f:
                f.write(f"{sha256}  {name}\n")
                f.flush()
                os.fsync(f.fileno())
            if stat is None and name not in self.stats:
                return
            rec = [sha256, *_stat_key(stat)] if stat is not None else None
            if rec is None:
                del self.stats[name]
            else:
                self.stats[name] = rec
            with open(self.state, "a") as f:     # a lost line costs one more hashing, nothing else
                f.write(_state_line(name, rec))

    def finish(self, names, extra_comments=()) -> Path:
        comments = [f"{k}: {v}" for k, v in self.meta.items()] + list(extra_comments)
        write_manifest(self.final, {n: self.hashes[n] for n in names}, comments)
        self.path.unlink(missing_ok=True)
        with self._lock:
            kept = set(names)
            self._write_state({n: rec for n, rec in self.stats.items() if n in kept})
        _fsync_dir(self.dir)
        return self.final


def _state_line(name: str, rec: list | None) -> str:
    if rec is None:                              # forget the file's record
        return json.dumps({"name": name}) + "\n"
    return json.dumps({"name": name, "sha256": rec[0], **dict(zip(("size", "mtime_ns", "ctime_ns", "ino"),
                                                                  rec[1:]))}) + "\n"


def _fsync_dir(d: Path):
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _norm_etag(v: str | None) -> str:
    v = (v or "").strip()
    if v.startswith("W/"):
        v = v[2:]
    return v.strip('"').lower()


def _content_range(v: str | None):
    m = re.match(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$", v or "")
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), (None if m.group(3) == "*" else int(m.group(3)))


def _retry_after(r) -> float | None:
    try:
        return min(300.0, float(r.headers.get("Retry-After", "")))
    except ValueError:
        return None


def _looks_like_html(block: bytes) -> bool:
    head = block[:256].lstrip().lower()
    return head.startswith((b"<!doctype html", b"<html"))


# ----------------------------------------------------------------------------------------- downloader

class Downloader:
    """Fetches Targets into a directory: several at once, each with its own Range resume and retries.
    `consumed` ({name: SHA-256}) names files an interrupted `--delete-source` conversion already wrote
    out and deleted: such a file, absent and expected with that very hash, is not fetched again.
    The transfers run on daemon threads: on Ctrl-C (`interrupt`) the connections being read are cut
    and the command ends within about a second, even when a server has stopped sending."""

    def __init__(self, directory: Path, journal: Journal, progress: TransferProgress, *, jobs: int = 4,
                 retries: int = 5, retry_wait: float = 2.0, timeout: float = 60.0, consumed: dict | None = None):
        self.dir = Path(directory)
        self.consumed = consumed or {}
        self.journal = journal
        self.progress = progress
        self.jobs, self.retries, self.retry_wait = max(1, jobs), max(1, retries), max(0.0, retry_wait)
        self.hub_headers = build_hf_headers(library_name="kimi-stream", library_version=_version())
        self.client = httpx2.Client(follow_redirects=True, timeout=httpx2.Timeout(timeout, connect=30.0),
                                    headers={"Accept-Encoding": "identity",
                                             "User-Agent": self.hub_headers.get("user-agent", "kimi-stream")})
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._futures: list[Future] = []
        self._active: set = set()           # responses being read (their sockets are cut on interrupt)
        self._counted: dict[str, int] = {}  # bytes each target adds to the progress total

    def close(self):
        try:
            self.client.close()
        except Exception:                   # noqa: BLE001  (a worker cut off mid-request after Ctrl-C)
            if not self.stop.is_set():
                raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- threads ----
    def gather(self, fn, items, keep=(FetchError,)) -> tuple[list, list]:
        """fn(item) for every item, `jobs` at a time on daemon threads: (results, the exceptions of
        the `keep` types), in item order; any other exception, or an interrupt (KeyboardInterrupt in
        this thread), stops every transfer (`interrupt`) and is raised."""
        work: queue.SimpleQueue = queue.SimpleQueue()
        futures = [Future() for _ in items]
        for pair in zip(items, futures):
            work.put(pair)

        def worker():
            while True:
                try:
                    item, fut = work.get_nowait()
                except queue.Empty:
                    return
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(fn(item))
                except BaseException as e:  # noqa: BLE001  (handed to the waiting thread)
                    fut.set_exception(e)

        threads = [threading.Thread(target=worker, name=f"fetch-{i}", daemon=True)
                   for i in range(min(self.jobs, len(items)))]
        with self._lock:
            self._futures += futures
            self._threads += threads
        results, kept = [], []
        try:
            for th in threads:
                th.start()
            for fut in futures:
                try:
                    results.append(fut.result())
                except keep as e:
                    kept.append(e)
        except BaseException:
            self.interrupt()
            raise
        return results, kept

    def interrupt(self, grace: float = INTERRUPT_GRACE_S):
        """Stop every transfer: nothing new starts, the responses being read have their connection cut
        (a read blocked on a silent server returns at once), and the workers get `grace` seconds to
        wind down. Whenever a worker stops, its NAME.partial is a prefix of the file (a rerun hashes it
        and resumes) and the journal holds whole entries; one still running after that is a daemon
        thread and does not hold up the exit."""
        self.stop.set()
        with self._lock:
            futures, threads, active = list(self._futures), list(self._threads), list(self._active)
        for fut in futures:
            fut.cancel()
        for r in active:
            _cut(r)
        deadline = time.monotonic() + grace
        for th in threads:
            if th.ident is not None:            # started
                th.join(max(0.0, deadline - time.monotonic()))

    # ---- the whole set ----
    def run(self, targets: list[Target]) -> tuple[list[Result], list[FetchError]]:
        """Fetch all targets; returns results and per-file errors (a failed file never stops the others)."""
        if not targets:
            return [], []
        need = 0
        for t in targets:
            dest, part = self._paths(t)
            self._counted[t.name] = t.size if t.size is not None else (t.estimate or 0)
            if self._is_consumed(t) or dest.is_file() and (t.size is None or dest.stat().st_size == t.size):
                continue
            have = part.stat().st_size if part.is_file() else 0
            need += max(0, self._counted[t.name] - have)
        free = shutil.disk_usage(self.dir).free
        if need > free:
            raise DownloadFailed([FetchError(self.dir, f"needs {need:,} more bytes, only {free:,} free")], self.dir)
        self.progress.begin(len(targets), sum(self._counted[t.name] for t in targets))
        return self.gather(self.fetch, targets)

    def _paths(self, t: Target) -> tuple[Path, Path]:
        dest = self.dir / t.name
        return dest, dest.with_name(dest.name + ".partial")

    def _is_consumed(self, t: Target) -> bool:
        return (t.sha256 is not None and self.consumed.get(t.name) == t.sha256
                and not (self.dir / t.name).exists())

    # ---- one file ----
    def fetch(self, t: Target) -> Result:
        dest, part = self._paths(t)
        if self.stop.is_set():
            raise Interrupted()
        try:
            if self._is_consumed(t):
                part.unlink(missing_ok=True)
                self.journal.add(t.name, t.sha256)
                self.progress.not_needed(self._counted.get(t.name, 0))
                return Result(t.name, t.size or 0, t.sha256, "consumed", checked="")
            dest.parent.mkdir(parents=True, exist_ok=True)
            if dest.is_file():
                found = self._check_existing(t, dest)
                if found:
                    sha, how = found
                    part.unlink(missing_ok=True)
                    size = dest.stat().st_size
                    self.progress.not_needed(self._counted.get(t.name, size))
                    return Result(t.name, size, sha, "present", checked=how)
            return self._download(t, dest, part)
        except OSError as e:
            raise FetchError(dest, f"cannot write: {e.strerror or e}") from None
        finally:
            self.progress.file_done()

    def _download(self, t: Target, dest: Path, part: Path) -> Result:
        st = _Hashes(t)
        task = self.progress.add_file(t.name, t.size if t.size is not None else t.estimate)
        try:
            if part.is_file():
                have = part.stat().st_size
                if t.size is not None and have > t.size:
                    part.unlink()
                elif have:
                    self._hash_file(part, st, task, f"{t.name} [dim](hashing partial)[/]")
                    self.progress.update_file(task, description=t.name)
                    self.progress.not_needed(have)
            resumed_from = st.offset
            received = [0]
            last, restarts, attempt = None, 0, 0
            while attempt < self.retries:
                attempt += 1
                try:
                    self._transfer(t, part, st, task, received)
                    sha = self._finish(t, dest, part, st)
                    return Result(t.name, st.offset, sha, "downloaded", resumed_from, received[0], attempt)
                except _Retry as e:
                    last = e
                    if e.discard:
                        restarts += 1
                        part.unlink(missing_ok=True)
                        self.progress.update_file(task, completed=0)
                        self.progress.not_needed(-st.offset)
                        st.reset()
                        if restarts >= MAX_HASH_RESTARTS:
                            break
                    if attempt < self.retries:
                        self._sleep(attempt, e.retry_after)
                except _Fatal as e:
                    raise FetchError(dest, str(e)) from None
            if self.stop.is_set():
                raise Interrupted()
            tries = f"after {attempt} attempt{'s' if attempt > 1 else ''}"
            kept = f"; {part.name} kept to resume" if part.is_file() and part.stat().st_size else ""
            raise FetchError(dest, f"{last} ({tries}{kept})")
        finally:
            self.progress.remove_file(task)

    def _sleep(self, attempt: int, retry_after: float | None):
        wait = min(60.0, self.retry_wait * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
        if retry_after is not None:
            wait = max(wait, retry_after)
        if self.stop.wait(wait):
            raise Interrupted()

    def _hash_file(self, path: Path, hashes: _Hashes, task, desc: str):
        self.progress.update_file(task, description=desc)
        with open(path, "rb") as f:
            while block := f.read(8 << 20):
                if self.stop.is_set():
                    raise Interrupted()
                hashes.update(block)
                self.progress.update_file(task, advance=len(block))

    def _check_existing(self, t: Target, dest: Path) -> tuple[str, str] | None:
        """(SHA-256, how it was checked) of an already present final file if it is the one expected,
        else None (and it will be replaced when a verified copy has been downloaded). It is hashed
        again unless the journal proves it unchanged since a run of this download hashed it."""
        size = dest.stat().st_size
        if t.size is not None and size != t.size:
            self.progress.warn(f"{dest}: has {size:,} bytes, expected {t.size:,}; downloading it again")
            return None
        known = self.journal.unchanged(t.name, dest)
        if known and (t.sha256 is None or known == t.sha256):
            return known, "unchanged"
        before = dest.stat()
        st = _Hashes(Target(t.name, t.url, size, t.sha256, git_sha1=t.git_sha1))
        task = self.progress.add_file(t.name, size)
        try:
            self._hash_file(dest, st, task, f"{t.name} [dim](checking existing file)[/]")
        finally:
            self.progress.remove_file(task)
        if st.offset != size:
            self.progress.warn(f"{dest}: changed while it was being checked; downloading it again")
            return None
        problem = self._mismatch(t, st)
        if problem:
            self.progress.warn(f"{dest}: {problem}; downloading it again")
            return None
        sha = st.sha256.hexdigest()
        after = dest.stat()
        self.journal.add(t.name, sha, after if _stat_key(after) == _stat_key(before) else None)
        return sha, "hashed"

    @staticmethod
    def _mismatch(t: Target, st: _Hashes) -> str | None:
        sha = st.sha256.hexdigest()
        if t.sha256 and sha != t.sha256:
            return f"SHA-256 mismatch: got {sha}, expected {t.sha256} ({t.sha256_from})"
        if t.git_sha1 and st.git is not None and st.git.hexdigest() != t.git_sha1:
            return f"git blob id mismatch: got {st.git.hexdigest()}, expected {t.git_sha1} (hub listing)"
        return None

    def _check_headers(self, t: Target, r) -> None:
        for h in (*r.history, r):
            commit = (h.headers.get("X-Repo-Commit") or "").lower()
            if t.commit and commit and commit != t.commit:
                raise _Fatal(f"the server resolved the file at commit {commit}, expected {t.commit}")
            linked = _norm_etag(h.headers.get("X-Linked-Etag"))
            if t.sha256 and H.SHA256_RE.match(linked) and linked != t.sha256:
                raise _Fatal(f"the hub's X-Linked-Etag says SHA-256 {linked}, expected {t.sha256} ({t.sha256_from})")
            lsize = h.headers.get("X-Linked-Size")
            if t.size is not None and lsize and lsize.isdigit() and int(lsize) != t.size:
                raise _Fatal(f"the hub's X-Linked-Size says {int(lsize):,} bytes, expected {t.size:,}")

    def _learned_size(self, t: Target, size: int, task):
        """The server told the size of a file that had none (or only a HEAD estimate): the totals
        follow. The file is still checked by its hash; the size only bounds what is accepted."""
        with self._lock:
            counted, self._counted[t.name] = self._counted.get(t.name, 0), size
        self.progress.not_needed(counted - size)
        self.progress.update_file(task, total=size)

    def _transfer(self, t: Target, part: Path, st: _Hashes, task, received: list) -> None:
        """One GET from st.offset to the end, appending to the partial and hashing as bytes arrive."""
        if t.size is not None and st.offset == t.size:
            return                                   # a complete partial (died before the rename)
        headers = dict(self.hub_headers) if t.auth else {}
        headers.pop("user-agent", None)
        if st.offset:
            headers["Range"] = f"bytes={st.offset}-"
        size = t.size
        try:
            with self.client.stream("GET", t.url, headers=headers) as r:
                with self._lock:
                    self._active.add(r)
                try:
                    if self.stop.is_set():
                        raise Interrupted()
                    size = self._receive(t, r, part, st, task, received)
                finally:
                    with self._lock:
                        self._active.discard(r)
        except httpx2.TimeoutException as e:
            raise _Retry(f"timed out after {st.offset:,} of {_fmt(size)} bytes ({type(e).__name__})") from None
        except httpx2.UnsupportedProtocol as e:      # e.g. a redirect to ftp://: asking again cannot help
            raise _Fatal(f"cannot fetch {H.url_of(e) or t.url}: {e}") from None
        except httpx2.TransportError as e:
            raise _Retry(f"connection lost after {st.offset:,} of {_fmt(size)} bytes ({e})") from None
        except httpx2.TooManyRedirects:
            raise _Fatal(f"redirect loop: {t.url} still redirects after {self.client.max_redirects} "
                         f"redirects") from None
        except (httpx2.HTTPError, httpx2.InvalidURL) as e:
            raise _Fatal(f"cannot fetch {H.url_of(e) or t.url}: {e}") from None
        if t.size is None:
            t.size = size
        if size is not None and st.offset < size:
            raise _Retry(f"truncated: the body ended after {st.offset:,} of {size:,} bytes")

    def _receive(self, t: Target, r, part: Path, st: _Hashes, task, received: list) -> int | None:
        """The body of one GET into the partial; the file's size as the server gave it (or None)."""
        self._check_headers(t, r)
        status = r.status_code
        if status in (401, 403):
            raise _Fatal(f"HTTP {status}: access denied at {r.url}" + (" (set HF_TOKEN?)" if t.auth else ""))
        if status == 404 or status == 410:
            raise _Fatal(f"HTTP {status}: not found at {r.url}")
        if status == 416:
            cr = re.match(r"^\s*bytes\s+\*/(\d+)\s*$", r.headers.get("Content-Range") or "")
            if t.size is None and st.offset and cr and int(cr.group(1)) == st.offset:
                return st.offset                     # the partial already holds the whole file
            raise _Retry(f"the server refused to resume at byte {st.offset:,} (HTTP 416)", discard=True)
        if status == 429 or status >= 500:
            raise _Retry(f"HTTP {status} from {r.url}", retry_after=_retry_after(r))
        if status not in (200, 206):
            raise _Fatal(f"unexpected HTTP {status} from {r.url}")
        ctype = r.headers.get("Content-Type", "")
        if "text/html" in ctype.lower() and not t.name.lower().endswith((".html", ".htm")):
            raise _Retry(f"the server sent an HTML page (HTTP {status}, {ctype.split(';')[0]}) "
                         f"instead of the file")
        enc = r.headers.get("Content-Encoding", "identity").lower()
        if enc not in ("identity", ""):
            raise _Retry(f"the server sent the file {enc}-encoded although asked for identity")
        if status == 206:
            cr = _content_range(r.headers.get("Content-Range"))
            if cr is None or cr[0] != st.offset:
                raise _Retry(f"the server answered a resume at byte {st.offset:,} with Content-Range "
                             f"{r.headers.get('Content-Range')!r}")
            total = cr[2]
        else:
            if st.offset:                    # Range ignored: the body starts at byte 0
                self.progress.not_needed(-st.offset)
                st.reset()
                self.progress.update_file(task, completed=0)
            cl = r.headers.get("Content-Length")
            total = int(cl) if cl and cl.isdigit() else None
        size = t.size
        if size is not None and total is not None and total != size:
            raise _Retry(f"truncated or different file: the server offers {total:,} bytes, "
                         f"expected {size:,}")
        if size is None:
            size = total
            if total is not None and self._counted.get(t.name) != total:
                self._learned_size(t, total, task)
        with open(part, "ab" if st.offset else "wb", buffering=0) as f:
            for block in r.iter_raw():
                if self.stop.is_set():
                    raise Interrupted()
                if not block:
                    continue
                if st.offset == 0 and _looks_like_html(block) and not t.name.lower().endswith(".html"):
                    raise _Retry(f"the server sent an HTML page (HTTP {status}) instead of the file")
                if size is not None and st.offset + len(block) > size:
                    raise _Retry(f"the server sent more than the file's {size:,} bytes", discard=True)
                view = memoryview(block)
                while view:
                    view = view[f.write(view):]
                st.update(block)
                received[0] += len(block)
                self.progress.transferred(task, len(block))
        return size

    def _finish(self, t: Target, dest: Path, part: Path, st: _Hashes) -> str:
        """Rename the partial into place only if its size and hashes are the expected ones."""
        if t.size is not None and st.offset != t.size:
            raise _Retry(f"truncated: {st.offset:,} of {t.size:,} bytes")
        if st.git is None and t.git_sha1:            # size unknown until now (not for hub files)
            raise _Fatal("cannot check the git blob id without the file size")
        problem = self._mismatch(t, st)
        if problem:
            raise _Retry(problem, discard=True)
        with open(part, "rb") as f:
            os.fsync(f.fileno())
        os.replace(part, dest)
        _fsync_dir(dest.parent)
        sha = st.sha256.hexdigest()
        self.journal.add(t.name, sha, dest.stat())
        return sha


def _cut(r) -> None:
    """Shut the connection of a response down from another thread: a read blocked in it returns."""
    try:
        sock = r.extensions["network_stream"].get_extra_info("socket")
        socket.socket.shutdown(sock, socket.SHUT_RDWR)   # not SSLSocket's: its TLS state stays intact
    except (KeyError, AttributeError, TypeError, OSError):
        pass


def _fmt(n) -> str:
    return "?" if n is None else f"{n:,}"


# ------------------------------------------------------------------------------------------- planning

@dataclass
class Report:
    directory: Path
    source: str                   # REPO@COMMIT or the URL list
    manifest: Path
    checked_against: list
    results: list
    elapsed: float

    def to_json(self) -> dict:
        return {"directory": str(self.directory), "source": self.source, "manifest": str(self.manifest),
                "checked_against": self.checked_against, "elapsed_s": round(self.elapsed, 3),
                "transferred_bytes": sum(r.transferred for r in self.results),
                "files": [asdict(r) for r in sorted(self.results, key=lambda r: r.name)]}

    def describe(self) -> str:
        down = [r for r in self.results if r.status == "downloaded"]
        resumed = [r for r in down if r.resumed_from]
        consumed = sum(r.status == "consumed" for r in self.results)
        moved = sum(r.transferred for r in self.results)
        rate = moved / self.elapsed / 1e6 if self.elapsed > 0 else 0.0
        gone = f", {consumed} already converted and deleted (not fetched again)" if consumed else ""
        hashed = sum(r.checked == "hashed" for r in self.results)
        unchanged = sum(r.checked == "unchanged" for r in self.results)
        against = ", ".join(self.checked_against)
        checked = (f"every file's size and hash checked against {against}" if hashed == len(self.results) else
                   f"{hashed} file{'s' if hashed != 1 else ''}' size and hash checked against {against}")
        if unchanged:
            checked += (f"; {unchanged} present file{'s' if unchanged != 1 else ''} not hashed again: unchanged "
                        f"(size, times, inode) since a run of this download checked "
                        f"{'them' if unchanged != 1 else 'it'} (kimi-verify hashes every file)")
        return (f"{self.source}: {len(self.results)} files in {self.directory} "
                f"({len(down)} downloaded, {len(resumed)} of them resumed, "
                f"{len(self.results) - len(down) - consumed} already present{gone}); {moved:,} bytes in "
                f"{self.elapsed:.1f} s ({rate:.1f} MB/s); {checked}; manifest {self.manifest}")


MAX_LISTED = 5          # unmatched manifest entries named one by one before "and N more"


def _expectations(manifests: list[tuple[Path, str]], given: Path | None = None, files=(),
                  source: str = "") -> dict[str, list[tuple[str, str]]]:
    """{name: [(SHA-256, label)]} from the manifests. Every entry of `given` (the user's --manifest)
    must name one of `files` (what `source` has): an entry that matches none would check nothing, so
    the download stops before it starts (DownloadFailed naming the manifest and the entries)."""
    out: dict[str, list[tuple[str, str]]] = {}
    unmatched = []
    files = set(files)
    for path, label in manifests:
        for name, sha in read_manifest(path).items():
            out.setdefault(name, []).append((sha, label))
            if given is not None and path == given and name not in files:
                unmatched.append(name)
    if unmatched:
        errors = [FetchError(given, f"entry {n!r} matches no file of {source}: it would check nothing "
                                    f"(names are paths inside the download directory)")
                  for n in unmatched[:MAX_LISTED]]
        if len(unmatched) > MAX_LISTED:
            errors.append(FetchError(given, f"and {len(unmatched) - MAX_LISTED} more entries that match no "
                                            f"file of {source}"))
        raise DownloadFailed(errors)
    return out


def _hub_target(snap: H.Snapshot, name: str, directory: Path, extra: dict) -> Target:
    f = snap.files[name]
    sha, label = f.sha256, ("the hub's LFS SHA-256" if f.sha256 else "")
    for s, lab in extra.get(name, []):
        if sha and s != sha:
            raise FetchError(directory / name, f"{label or 'the expected SHA-256'} {sha} differs from {lab} "
                                               f"({s}); not downloaded")
        sha, label = s, (f"{label} and {lab}" if label else lab)
    if f.size is None:
        raise FetchError(directory / name, f"the hub gives no size for this file in {snap.spec}")
    if not sha and not f.git_sha1:
        raise FetchError(directory / name, "neither the hub nor a manifest gives a hash for this file; "
                                           "cannot verify it")
    return Target(name, snap.url(name), f.size, sha, label, f.git_sha1, snap.commit, auth=True)


def download_repo(spec: str, directory: Path | None = None, base: Path | None = None, *,
                  endpoint: str | None = None, jobs: int = 4, retries: int = 5, retry_wait: float = 2.0,
                  checksums_dir: Path | None = None, manifest: Path | None = None,
                  console: Console | None = None, quiet: bool = False, consumed=None) -> Report:
    """Download the files a conversion needs from a hub repo at REVISION (pinned to its commit) into
    `directory` (default: BASE/ORG--NAME@COMMIT). Raises DownloadFailed listing every file that failed.
    `consumed` names files not to fetch again (see Downloader)."""
    t0 = time.monotonic()
    repo_id, revision = H.parse_spec(spec)
    snap = H.list_snapshot(repo_id, revision, endpoint)
    directory = Path(directory) if directory else Path(base or ".") / default_dirname(repo_id, snap.commit)
    manifests = []
    cpath = H.find_checksums(repo_id, snap.commit, checksums_dir)
    if cpath:
        manifests.append((cpath, f"checksums/{cpath.name}"))
    if manifest:
        manifests.append((Path(manifest), str(manifest)))
    extra = _expectations(manifests, Path(manifest) if manifest else None, snap.files, snap.spec)
    directory.mkdir(parents=True, exist_ok=True)
    journal = Journal(directory, {"repo": repo_id, "revision": snap.commit})
    console = console or Console(stderr=True)
    results, errors, planned = [], [], []

    def plan(names):
        targets = []
        for n in names:
            try:
                targets.append(_hub_target(snap, n, directory, extra))
            except FetchError as e:
                errors.append(e)
        planned.extend(targets)
        return targets

    try:
        with TransferProgress(console, not quiet) as prog, Downloader(
                directory, journal, prog, jobs=jobs, retries=retries, retry_wait=retry_wait,
                consumed=consumed) as dl:
            _fetch_snapshot(snap, directory, dl, plan, results, errors)
            prog.failed = len(errors)
    except (KeyboardInterrupt, Interrupted):
        raise Interrupted(str(directory)) from None
    if errors:
        raise DownloadFailed(errors, directory)
    checked = sorted({lab for t in planned for lab in t.sha256_from.split(" and ") if lab}
                     | ({"git blob ids from the hub listing"} if any(t.git_sha1 for t in planned) else set()))
    man = journal.finish([r.name for r in results], [f"{len(results)} files, each checked (size and hash) "
                                                     f"against {', '.join(checked)}"])
    return Report(directory, snap.spec, man, checked, results, time.monotonic() - t0)


def _fetch_snapshot(snap: H.Snapshot, directory: Path, dl: Downloader, plan, results: list, errors: list):
    """The small files first (the index says which shards are needed), then the shards."""
    small = snap.small_files()
    r, e = dl.run(plan(small))
    results += r
    errors += e
    index_bytes = None
    if INDEX_FILE in small:
        if not (directory / INDEX_FILE).is_file():
            return                            # its error is in `errors`; the shards are unknown
        index_bytes = (directory / INDEX_FILE).read_bytes()
    try:
        raw = snap.shard_names(index_bytes)
    except H.HubError as ex:
        errors.append(FetchError(directory / INDEX_FILE if index_bytes is not None else directory,
                                 str(ex).split(": ", 1)[-1]))
        return
    shards = []
    where = directory / INDEX_FILE if index_bytes is not None else directory
    for n in raw:
        try:
            safe_relpath(n, directory)
        except ValueError as ex:
            errors.append(FetchError(where, f"shard {ex}; refused"))
            continue
        if n not in snap.files:
            errors.append(FetchError(directory / n, f"named in {INDEX_FILE} but {snap.spec} has no such file"))
            continue
        shards.append(n)
    r, e = dl.run(plan(shards))
    results += r
    errors += e


def read_url_list(path: Path, directory: Path) -> tuple[list[tuple[str, str, str | None]], list[FetchError]]:
    """Lines 'URL [SHA256]' ('#' comments) -> [(name, url, sha256)], with per-line errors."""
    out, errors, seen = [], [], {}
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise DownloadFailed([FetchError(path, f"cannot read URL list ({e})")]) from None
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        where = f"{path}:{n}"
        if len(parts) > 2 or (len(parts) == 2 and not H.SHA256_RE.match(parts[1].lower())):
            errors.append(FetchError(where, "expected 'URL [SHA256]' (64 hex digits)"))
            continue
        url = parts[0]
        try:
            u = urlsplit(url)
            u.port                                  # ValueError for a port that is not a number in range
            httpx2.URL(url)                         # what the client will make of it
        except (ValueError, httpx2.InvalidURL) as e:
            errors.append(FetchError(where, f"invalid URL {url} ({e})"))
            continue
        if u.scheme not in ("https", "http") or not u.hostname:
            errors.append(FetchError(where, f"not an http(s) URL: {url}"))
            continue
        name = unquote(u.path.rsplit("/", 1)[-1])
        try:
            safe_relpath(name, directory)
        except ValueError as e:
            errors.append(FetchError(where, f"{e} (from the URL); refused"))
            continue
        if name in seen:
            errors.append(FetchError(where, f"file name {name!r} already comes from line {seen[name]}"))
            continue
        seen[name] = n
        out.append((name, url, parts[1].lower() if len(parts) == 2 else None))
    if not out and not errors:
        errors.append(FetchError(path, "no URLs in the list"))
    return out, errors


def download_urls(url_file: Path, directory: Path, *, jobs: int = 4, retries: int = 5, retry_wait: float = 2.0,
                  manifest: Path | None = None, console: Console | None = None, quiet: bool = False,
                  consumed=None) -> Report:
    """Download plain http(s) URLs (release assets, mirrors) with the same resume, hashing and rules:
    every file needs an expected SHA-256, on its line or in `manifest`."""
    t0 = time.monotonic()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    entries, errors = read_url_list(url_file, directory)
    extra = _expectations([(Path(manifest), str(manifest))] if manifest else [], Path(manifest) if manifest else None,
                          [name for name, _, _ in entries], f"the URL list {url_file}")
    targets = []
    for name, url, sha in entries:
        label = "the URL list" if sha else ""
        for s, lab in extra.get(name, []):
            if sha and s != sha:
                errors.append(FetchError(directory / name, f"{label} says SHA-256 {sha}, {lab} says {s}; "
                                                           f"not downloaded"))
                break
            sha, label = s, (f"{label} and {lab}" if label else lab)
        else:
            if not sha:
                errors.append(FetchError(directory / name, "no expected SHA-256 (put it after the URL in the "
                                                           "list, or pass --manifest)"))
            else:
                targets.append(Target(name, url, None, sha, label))
    journal = Journal(directory, {"urls": str(Path(url_file).resolve())})
    console = console or Console(stderr=True)
    try:
        results = _fetch_urls(targets, directory, journal, console, quiet, jobs, retries, retry_wait, errors,
                              consumed)
    except (KeyboardInterrupt, Interrupted):
        raise Interrupted(str(directory)) from None
    if errors:
        raise DownloadFailed(errors, directory)
    checked = sorted({t.sha256_from for t in targets})
    man = journal.finish([r.name for r in results], [f"{len(results)} files, each checked (size and SHA-256) "
                                                     f"against {', '.join(checked)}"])
    return Report(directory, str(url_file), man, checked, results, time.monotonic() - t0)


def _fetch_urls(targets, directory, journal, console, quiet, jobs, retries, retry_wait, errors,
                consumed) -> list[Result]:
    with TransferProgress(console, not quiet) as prog, Downloader(directory, journal, prog, jobs=jobs, retries=retries,
                                                                  retry_wait=retry_wait, consumed=consumed) as dl:
        def head(t: Target):
            # Sizes up front, for the totals and the free-space check only: a HEAD answer may say 0
            # (presigned or dynamic URLs) or be stale; the GET's own answer and the hash decide.
            try:
                r = dl.client.head(t.url)
                cl = r.headers.get("Content-Length")
                if r.status_code == 200 and cl and cl.isdigit() and int(cl) > 0:
                    t.estimate = int(cl)
            except (httpx2.HTTPError, httpx2.InvalidURL):
                pass                    # the GET reports what is wrong
        dl.gather(head, targets)
        results, e = dl.run(targets)
        errors += e
        prog.failed = len(errors)
    return results
