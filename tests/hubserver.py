"""A small threaded HTTP server on 127.0.0.1 that behaves like the Hugging Face Hub for the calls
huggingface_hub 2.4 and kimi-stream's downloader make, with fault injection and a request log.

Endpoints (as the real hub serves them):
- `GET /api/models/{repo}[/revision/{rev}]` (`HfApi.model_info`; `?blobs=True` adds size, blobId, lfs)
- `POST /api/models/{repo}/paths-info/{rev}` (`HfApi.get_paths_info`; form fields `paths`)
- `GET|HEAD /{repo}/resolve/{rev}/{file}`: a git file is served directly with `ETag` = its git blob
  id; an LFS file answers 302 to `/cdn/{sha256}` on a second origin (another port, as the hub's CDN is
  another host) with `X-Linked-Etag` (its SHA-256), `X-Linked-Size`.
  Both carry `X-Repo-Commit`. 401 with `X-Error-Code: RepoNotFound` for an unknown or private repo,
  404 `RevisionNotFound` / `EntryNotFound` as the hub does.
- `GET|HEAD /cdn/{sha256}` and `/files/{name}` (plain URLs): bytes with `Content-Length`, `Range`
  (206 + `Content-Range`, 416), `If-Range`.

Faults (`server.fault(name, kind, times, at)`), applied to GETs that send a file's bytes:
`cut` drops the connection after `at` body bytes; `stall` sends `at` bytes and then waits until
`server.release()` (so a test can kill the client mid-file); `wrong` flips the byte at `at`;
`short` serves the file without its last `at` bytes (headers consistent with the short body);
`html` answers 200 with an HTML error page; `error500` answers 500.

Every request is logged (`server.log`: method, path, file name, Range header, status, body bytes
actually written to the socket, whether an Authorization header came along)."""

from __future__ import annotations

import hashlib
import json
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlsplit

HTML_PAGE = (b"<!DOCTYPE html>\n<html><head><title>503 Service Unavailable</title></head>"
             b"<body><h1>We'll be right back</h1><p>The service is under maintenance.</p></body></html>\n")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def default_lfs(name: str) -> bool:
    """What the hub's default .gitattributes stores in LFS (for the files our tests use)."""
    return name.endswith((".safetensors", ".bin", ".model")) or name == "tokenizer.json"


@dataclass
class Repo:
    files: dict            # name -> bytes
    lfs: set
    commit: str
    refs: dict             # branch name -> commit
    token: str | None = None   # required bearer token (private repo)


@dataclass
class Fault:
    kind: str
    times: int
    at: int


@dataclass(eq=False)
class LogEntry:
    method: str
    path: str
    name: str | None
    range: str | None
    status: int
    sent: int = 0
    auth: bool = False


@dataclass
class _Served:
    data: bytes
    name: str
    etag: str
    content_type: str = "application/octet-stream"
    extra: dict = field(default_factory=dict)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):   # clients we cut off
            super().handle_error(request, client_address)


class HubServer:
    def __init__(self, omit_blobs: bool = False):
        self.repos: dict[str, Repo] = {}
        self.plain: dict[str, bytes] = {}
        self.faults: dict[str, Fault] = {}
        self.log: list[LogEntry] = []
        self.omit_blobs = omit_blobs          # a mirror that ignores ?blobs=True (forces paths-info)
        self.rate: float | None = None        # bytes/s per response (to watch progress bars by hand)
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._httpd = _Server(("127.0.0.1", 0), _make_handler(self))
        self._cdn = _Server(("127.0.0.1", 0), _make_handler(self))
        self._threads = [threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
                         for s in (self._httpd, self._cdn)]

    # -- set-up -------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    @property
    def cdn_url(self) -> str:
        return f"http://127.0.0.1:{self._cdn.server_address[1]}"

    def add_repo(self, repo_id: str, files: dict, lfs=default_lfs, token: str | None = None) -> str:
        """Publish `files` (name -> bytes) as one commit on branch main; returns the commit id."""
        h = hashlib.sha1(repo_id.encode())
        for n in sorted(files):
            h.update(n.encode() + b"\0" + hashlib.sha256(files[n]).digest())
        commit = h.hexdigest()
        self.repos[repo_id] = Repo(dict(files), {n for n in files if lfs(n)}, commit, {"main": commit}, token)
        return commit

    def add_plain(self, name: str, data: bytes) -> str:
        """Serve `data` at /files/NAME (a release asset or mirror URL, no hub headers)."""
        self.plain[name] = data
        return f"{self.url}/files/{quote(name, safe='')}"

    def fault(self, name: str, kind: str, times: int = 1, at: int = 0) -> None:
        assert kind in ("cut", "stall", "wrong", "short", "html", "error500"), kind
        self.faults[name] = Fault(kind, times, at)

    def clear_faults(self) -> None:
        self.faults.clear()

    def release(self) -> None:
        """Let stalled responses finish (they then drop the connection)."""
        self._release.set()

    # -- inspection ---------------------------------------------------------------------------
    def gets(self, name: str) -> list[LogEntry]:
        """GET requests that sent (or should have sent) the bytes of file `name`."""
        return [e for e in self.log if e.name == name and e.method == "GET" and e.status in (200, 206, 500)]

    def bytes_sent(self, name: str) -> int:
        return sum(e.sent for e in self.gets(name))

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "HubServer":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._release.set()
        for s in (self._httpd, self._cdn):
            s.shutdown()
            s.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- behaviour ----------------------------------------------------------------------------
    def _take_fault(self, name: str) -> Fault | None:
        with self._lock:
            f = self.faults.get(name)
            if f is None or f.times <= 0:
                return None
            f.times -= 1
            return f


def _make_handler(server: HubServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):      # quiet
            pass

        # ---- plumbing ----
        def _entry(self, status: int, name: str | None = None) -> LogEntry:
            e = LogEntry(self.command, self.path, name, self.headers.get("Range"), status,
                         auth=self.headers.get("Authorization") is not None)
            with server._lock:
                server.log.append(e)
            return e

        def _send(self, status: int, body: bytes = b"", headers: dict | None = None, name: str | None = None):
            entry = self._entry(status, name)
            self.send_response(status)
            hdrs = {"Content-Length": str(len(body)), **(headers or {})}
            for k, v in hdrs.items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD" and body:
                self.wfile.write(body)
                entry.sent = len(body)

        def _json(self, obj, status=200):
            self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json"})

        def _hub_error(self, status: int, code: str, message: str):
            self._send(status, json.dumps({"error": message}).encode(),
                       {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": message})

        def _authorised(self, repo: Repo) -> bool:
            return repo.token is None or self.headers.get("Authorization") == f"Bearer {repo.token}"

        def _repo_rev(self, repo_id: str, rev: str):
            """(repo, commit) or None after sending the hub's error."""
            repo = server.repos.get(repo_id)
            if repo is None or not self._authorised(repo):
                self._hub_error(401, "RepoNotFound", "Repository not found")
                return None
            commit = repo.refs.get(rev, rev if rev == repo.commit else None)
            if commit is None:
                self._hub_error(404, "RevisionNotFound", "Invalid rev id: " + rev)
                return None
            return repo, commit

        # ---- routes ----
        def do_GET(self):
            self._route()

        def do_HEAD(self):
            self._route()

        def do_POST(self):
            self._route()

        def _route(self):
            try:
                parts = urlsplit(self.path)
                path = parts.path
                if path.startswith("/api/models/"):
                    return self._api(path[len("/api/models/"):], parse_qs(parts.query))
                if (self.server is server._cdn) != path.startswith("/cdn/"):
                    return self._send(404, b"not found")
                if path.startswith("/cdn/"):
                    sha = path[len("/cdn/"):]
                    for repo in server.repos.values():
                        for n, data in repo.files.items():
                            if n in repo.lfs and hashlib.sha256(data).hexdigest() == sha:
                                return self._serve(_Served(data, n, f'"{sha}"'))
                    return self._send(404, b"no such object")
                if path.startswith("/files/"):
                    name = unquote(path[len("/files/"):])
                    if name not in server.plain:
                        return self._send(404, b"not found", name=name)
                    data = server.plain[name]
                    return self._serve(_Served(data, name, '"%s"' % hashlib.md5(data).hexdigest()))
                if "/resolve/" in path:
                    return self._resolve(path)
                self._send(404, b"not found")
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

        def _api(self, rest: str, query: dict):
            if self.command == "POST" and "/paths-info/" in rest:
                repo_id, rev = rest.split("/paths-info/", 1)
                found = self._repo_rev(repo_id, unquote(rev))
                if not found:
                    return
                repo, _ = found
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
                paths = parse_qs(body).get("paths", [])
                return self._json([_tree_entry(repo, p) for p in paths if p in repo.files])
            if "/revision/" in rest:
                repo_id, rev = rest.split("/revision/", 1)
                rev = unquote(rev)
            else:
                repo_id, rev = rest, "main"
            found = self._repo_rev(repo_id, rev)
            if not found:
                return
            repo, commit = found
            blobs = query.get("blobs", ["False"])[0].lower() == "true" and not server.omit_blobs
            siblings = []
            for n, data in sorted(repo.files.items()):
                s = {"rfilename": n}
                if blobs:
                    s.update(size=len(data), blobId=git_blob_id(data) if n not in repo.lfs else
                             hashlib.sha1(_pointer(data)).hexdigest())
                    if n in repo.lfs:
                        s["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                                    "pointerSize": len(_pointer(data))}
                siblings.append(s)
            self._json({"_id": "0" * 24, "id": repo_id, "modelId": repo_id, "sha": commit,
                        "private": repo.token is not None, "siblings": siblings, "tags": []})

        def _resolve(self, path: str):
            repo_id, rest = path.lstrip("/").split("/resolve/", 1)
            rev, _, fname = rest.partition("/")
            found = self._repo_rev(repo_id, unquote(rev))
            if not found:
                return
            repo, commit = found
            fname = unquote(fname)
            if fname not in repo.files:
                return self._hub_error(404, "EntryNotFound", f"{fname} does not exist on {rev}")
            data = repo.files[fname]
            hub = {"X-Repo-Commit": commit}
            if fname in repo.lfs:
                sha = hashlib.sha256(data).hexdigest()
                return self._send(302, b"", {**hub, "Location": f"{server.cdn_url}/cdn/{sha}?name={quote(fname)}",
                                             "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(data)),
                                             "ETag": f'"{sha}"'}, name=fname)
            self._serve(_Served(data, fname, f'"{git_blob_id(data)}"', "application/json"
                                if fname.endswith(".json") else "text/plain; charset=utf-8", hub))

        def _serve(self, s: _Served):
            data, size = s.data, len(s.data)
            fault = server._take_fault(s.name) if self.command == "GET" else None
            if fault and fault.kind == "error500":
                return self._send(500, b"Internal Server Error", name=s.name)
            if fault and fault.kind == "html":
                return self._send(200, HTML_PAGE, {"Content-Type": "text/html; charset=utf-8", **s.extra},
                                  name=s.name)
            if fault and fault.kind == "short":
                data = data[:size - fault.at]
                size = len(data)
            if fault and fault.kind == "wrong":
                b = bytearray(data)
                b[fault.at] ^= 0x5A
                data = bytes(b)
            start, end, status = 0, size - 1, 200
            rng = self.headers.get("Range")
            if_range = self.headers.get("If-Range")
            if rng and (if_range is None or if_range == s.etag):
                try:
                    unit, spec = rng.split("=", 1)
                    a, b = spec.split("-", 1)
                    start = int(a)
                    end = min(int(b), size - 1) if b else size - 1
                    if unit.strip() != "bytes" or start < 0:
                        raise ValueError
                except ValueError:
                    return self._send(400, b"bad range", name=s.name)
                if start >= size or start > end:
                    return self._send(416, b"", {"Content-Range": f"bytes */{size}"}, name=s.name)
                status = 206
            body = data[start:end + 1]
            headers = {"Content-Type": s.content_type, "ETag": s.etag, "Accept-Ranges": "bytes", **s.extra}
            if status == 206:
                headers["Content-Range"] = f"bytes {start}-{end}/{size}"
            entry = self._entry(status, s.name)
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            if self.command == "HEAD":
                return
            limit = len(body)
            if fault and fault.kind in ("cut", "stall"):
                limit = min(limit, fault.at)
            pos = 0
            while pos < limit:
                n = min(16384, limit - pos)
                self.wfile.write(body[pos:pos + n])
                pos += n
                entry.sent = pos
                if server.rate:
                    time.sleep(n / server.rate)
            if limit < len(body):             # drop the connection mid-body
                self.wfile.flush()
                if fault.kind == "stall":
                    server._release.wait(60)
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    return Handler


def _pointer(data: bytes) -> bytes:
    return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\n"
            f"size {len(data)}\n").encode()


def _tree_entry(repo: Repo, name: str) -> dict:
    data = repo.files[name]
    if name in repo.lfs:
        return {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(_pointer(data)).hexdigest(),
                "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                        "pointerSize": len(_pointer(data))}}
    return {"type": "file", "path": name, "size": len(data), "oid": git_blob_id(data)}
