"""The Hugging Face Hub side of fetching and verifying: `REPO_ID[@REVISION]` specs, listing a repository
at one pinned commit with huggingface_hub (sizes, git blob ids, LFS SHA-256), choosing the files a
conversion needs, and the `checksums/ORG--NAME@COMMIT.sha256` manifest for a repo and commit."""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx2
from huggingface_hub import HfApi, hf_hub_url
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError, RepositoryNotFoundError,
                                    RevisionNotFoundError)

from kimistream.formats.bundled_data import root
from kimistream.formats.constants import TOKENIZER_FILES

from .source import INDEX_FILE

REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
# Everything a conversion reads besides the shards (formats/constants.TOKENIZER_FILES: tokenizer.json,
# tokenizer_config.json, tiktoken.model, special_tokens_map.json, chat_template.jinja, generation_config.json).
SMALL_FILES = ("config.json", INDEX_FILE, *TOKENIZER_FILES)
CHECKSUMS_DIR = root() / "checksums"


class HubError(ValueError):
    pass


def split_spec(spec: str) -> tuple[str, str | None]:
    """'org/name@rev' -> ('org/name', 'rev'); 'org/name' -> ('org/name', None)."""
    repo, _, rev = spec.partition("@")
    return repo, (rev or None)


def is_repo_spec(spec: str) -> bool:
    return bool(REPO_RE.match(split_spec(spec)[0]))


def parse_spec(spec: str) -> tuple[str, str]:
    repo, rev = split_spec(spec)
    if not REPO_RE.match(repo):
        raise HubError(f"{spec}: not a repository id (ORG/NAME[@REVISION])")
    return repo, rev or "main"


def manifest_filename(repo_id: str, commit: str) -> str:
    """Name of the checksums/ manifest for a repo at a commit: ORG--NAME@COMMIT.sha256."""
    return f"{repo_id.replace('/', '--')}@{commit}.sha256"


def find_checksums(repo_id: str, commit: str, checksums_dir: Path | None = None) -> Path | None:
    p = Path(checksums_dir or CHECKSUMS_DIR) / manifest_filename(repo_id, commit)
    return p if p.is_file() else None


def resolve_endpoint(endpoint: str | None) -> str:
    """--endpoint, else HF_ENDPOINT (read by huggingface_hub), else the public hub; HubError (one line
    naming it) unless it is an http(s) URL the HTTP client accepts."""
    given = endpoint
    endpoint = (endpoint or hf_constants.ENDPOINT).rstrip("/")
    origin = "--endpoint" if given else "HF_ENDPOINT" if os.environ.get("HF_ENDPOINT") else "hub endpoint"
    try:
        u = urlsplit(endpoint)
        u.port                                       # ValueError for a port that is not a number in range
        httpx2.URL(endpoint)
        problem = None if u.scheme in ("http", "https") and u.hostname else "not an http(s) URL"
    except (ValueError, httpx2.InvalidURL) as e:
        problem = f"not a valid URL ({e})"
    if problem:
        raise HubError(f"{origin} {endpoint}: {problem}")
    return endpoint


@dataclass
class HubFile:
    name: str
    size: int | None
    blob_id: str | None           # git object id (of the file, or of its LFS pointer)
    sha256: str | None            # LFS SHA-256 of the content; None for a plain git file

    @property
    def git_sha1(self) -> str | None:
        """The git blob id of the content itself (only for files stored in git, not LFS)."""
        return None if self.sha256 else self.blob_id


@dataclass
class Snapshot:
    """A repository at one commit: every file's size and content hash, as the hub reports them."""
    repo_id: str
    revision: str                 # as requested (branch, tag or commit)
    commit: str                   # the 40-hex commit it resolved to; all downloads use this
    endpoint: str
    files: dict = field(default_factory=dict)   # name -> HubFile

    @property
    def spec(self) -> str:
        return f"{self.repo_id}@{self.commit}"

    def url(self, name: str) -> str:
        return hf_hub_url(self.repo_id, name, revision=self.commit, endpoint=self.endpoint)

    def small_files(self) -> list[str]:
        names = [n for n in SMALL_FILES if n in self.files]
        if "config.json" not in names:
            raise HubError(f"{self.spec}: has no config.json (not a model checkpoint)")
        return names

    def shard_names(self, index_bytes: bytes | None) -> list[str]:
        """Shards a conversion needs: those named by the index, else the top-level *.safetensors.
        Names are returned as the server gave them; the caller checks that they are safe paths."""
        if index_bytes is not None:
            try:
                names = sorted(set(json.loads(index_bytes)["weight_map"].values()))
                if not all(isinstance(n, str) for n in names):
                    raise TypeError("non-string shard name")
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
                raise HubError(f"{INDEX_FILE}: malformed index ({e})") from None
            return names
        names = sorted(n for n in self.files if n.endswith(".safetensors") and "/" not in n)
        if not names:
            raise HubError(f"{self.spec}: no {INDEX_FILE} and no *.safetensors files")
        return names


def _describe(e: Exception, repo_id: str, revision: str, endpoint: str) -> str:
    if isinstance(e, GatedRepoError):
        return f"{repo_id}: gated repository at {endpoint}: accept its terms and set HF_TOKEN"
    if isinstance(e, RevisionNotFoundError):
        return f"{repo_id}@{revision}: revision not found at {endpoint}"
    if isinstance(e, RepositoryNotFoundError):
        return (f"{repo_id}: repository not found at {endpoint} "
                f"(private or gated? set HF_TOKEN to a token with access)")
    if isinstance(e, HfHubHTTPError):
        return f"{repo_id}@{revision}: hub API error at {endpoint}: {str(e).splitlines()[0]}"
    if isinstance(e, HFValidationError):
        return f"{repo_id}: {e}"
    if isinstance(e, httpx2.TooManyRedirects):
        return f"{repo_id}@{revision}: redirect loop at {endpoint} ({url_of(e) or e})"
    if isinstance(e, (httpx2.InvalidURL, httpx2.UnsupportedProtocol)):
        return f"{repo_id}@{revision}: cannot request {url_of(e) or endpoint}: {e}"
    return f"{repo_id}@{revision}: cannot reach {endpoint}: {e}"


def url_of(e: Exception) -> str:
    """The URL of the request an httpx error is about, or ''."""
    try:
        return str(e.request.url)        # RuntimeError when the error carries no request
    except (AttributeError, RuntimeError):
        return ""


def list_snapshot(repo_id: str, revision: str = "main", endpoint: str | None = None,
                  token: str | None = None, attempts: int = 3) -> Snapshot:
    """List a repository at `revision` (resolved to a commit) with huggingface_hub: one model-info call
    with file metadata; files lacking sizes or hashes (a mirror that ignores `blobs`) are filled in
    from paths-info at the pinned commit."""
    endpoint = resolve_endpoint(endpoint)
    api = HfApi(endpoint=endpoint, token=token)
    last = None
    for attempt in range(attempts):
        if attempt:
            time.sleep(2.0 * attempt)
        try:
            info = api.model_info(repo_id, revision=revision, files_metadata=True, timeout=60)
            break
        except (HfHubHTTPError, HFValidationError) as e:
            resp = getattr(e, "response", None)
            if resp is not None and resp.status_code >= 500:
                last = e
                continue
            raise HubError(_describe(e, repo_id, revision, endpoint)) from None
        except (httpx2.UnsupportedProtocol, httpx2.InvalidURL, httpx2.TooManyRedirects) as e:
            raise HubError(_describe(e, repo_id, revision, endpoint)) from None   # no use asking again
        except (httpx2.TransportError, OSError) as e:
            last = e
        except httpx2.HTTPError as e:
            raise HubError(_describe(e, repo_id, revision, endpoint)) from None
    else:
        raise HubError(_describe(last, repo_id, revision, endpoint))
    commit = (info.sha or "").lower()
    if not COMMIT_RE.match(commit):
        raise HubError(f"{repo_id}@{revision}: the hub at {endpoint} gave no commit id for the revision")
    if COMMIT_RE.match(revision.lower()) and revision.lower() != commit:
        raise HubError(f"{repo_id}@{revision}: the hub at {endpoint} answered for commit {commit}")
    snap = Snapshot(repo_id, revision, commit, endpoint)
    for s in info.siblings or []:
        lfs = s.lfs
        snap.files[s.rfilename] = HubFile(s.rfilename, s.size, s.blob_id,
                                          (lfs.sha256 if lfs else None))
    wanted = [n for n in SMALL_FILES if n in snap.files] + [n for n in snap.files if n.endswith(".safetensors")]
    incomplete = [n for n in wanted if snap.files[n].size is None or snap.files[n].blob_id is None]
    if incomplete:
        try:
            for f in api.get_paths_info(repo_id, incomplete, revision=commit):
                if hasattr(f, "blob_id"):
                    snap.files[f.path] = HubFile(f.path, f.size, f.blob_id, f.lfs.sha256 if f.lfs else None)
        except (HfHubHTTPError, httpx2.HTTPError, httpx2.InvalidURL, OSError) as e:
            raise HubError(_describe(e, repo_id, commit, endpoint)) from None
    for f in snap.files.values():
        if f.sha256 is not None:
            f.sha256 = f.sha256.lower()
            if not SHA256_RE.match(f.sha256):
                raise HubError(f"{snap.spec}: the hub gave a malformed LFS SHA-256 for {f.name}")
    return snap
