"""Downloading checkpoints against a local server that behaves like the hub (tests/hubserver.py), with
the real huggingface_hub client and the real commands in subprocesses: Range resume (within a run and
after the process is killed) proven by the server's log of bytes sent, every kind of bad server,
manifests, path escapes, kimi-verify on the result, and kimi-convert REPO@REV end to end."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import refmodels
from hubserver import HubServer

REPO = "test-org/tiny-moe"
SHARDS = ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
          "model-00003-of-00003.safetensors"]
FAST = ["--retry-wait", "0.01"]


def sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A real tiny DeepseekV3 checkpoint saved by transformers in 3 shards with an index."""
    d = tmp_path_factory.mktemp("sharded")
    model = refmodels.make_checkpoint(d / "single", seed=2)
    model.save_pretrained(d / "ckpt", max_shard_size="300KB")
    for n in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(d / "single" / n, d / "ckpt" / n)
    files = {p.name: p.read_bytes() for p in (d / "ckpt").iterdir()}
    assert sorted(n for n in files if n.endswith(".safetensors")) == SHARDS
    assert set(json.loads(files["model.safetensors.index.json"])["weight_map"].values()) == set(SHARDS)
    return d / "ckpt", files


@pytest.fixture
def hub(ckpt):
    """The checkpoint published as REPO, plus files a conversion does not need (never to be fetched)."""
    _, files = ckpt
    with HubServer() as server:
        server.files = files
        server.commit = server.add_repo(REPO, {**files, "README.md": b"# tiny\n", ".gitattributes": b"*.st lfs\n",
                                               "consolidated.safetensors": b"\0" * 4096,
                                               "original/notes.txt": b"not needed\n"})
        yield server


@pytest.fixture(autouse=True, scope="module")
def hermetic_hf(tmp_path_factory):
    """huggingface_hub in the commands gets its own HF_HOME (no saved token) and no telemetry (which
    would otherwise fetch an agent registry from the default endpoint)."""
    global HF_ENV
    HF_ENV = {"HF_HOME": str(tmp_path_factory.mktemp("hf_home")), "HF_HUB_DISABLE_TELEMETRY": "1"}
    yield


HF_ENV = {}


def run(module, *args, env=None, timeout=120):
    full_env = {**os.environ, **HF_ENV, **(env or {})}
    return subprocess.run([sys.executable, "-m", f"kimistream.convert.{module}", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=full_env)


def fetch(hub, directory, *extra, spec=REPO, env=None):
    proc = run("cli", "--download-only", spec, "--dir", directory, "--endpoint", hub.url, *FAST, "--json",
               *extra, env=env)
    report = json.loads(proc.stdout)["download"] if proc.returncode == 0 else None
    return proc, report


def verify(*args):
    proc = run("verify_cli", *args, "--json")
    return proc.returncode, json.loads(proc.stdout)


def error_lines(proc) -> list[str]:
    # progress lines (stderr is a pipe here) aside, every line is an error
    lines = [l for l in proc.stderr.splitlines() if l.strip() and not l.startswith("kimi-convert: downloading: ")]
    assert "Traceback" not in proc.stderr, proc.stderr
    assert all(l.startswith("kimi-convert: error: ") for l in lines), proc.stderr
    return lines


def the_error(proc, path) -> str:
    """The one error line about `path` ('kimi-convert: error: PATH: problem')."""
    hits = [l for l in error_lines(proc) if l.startswith(f"kimi-convert: error: {path}: ")]
    assert len(hits) == 1, proc.stderr
    return hits[0]


def assert_complete(d: Path, files: dict):
    for name, data in files.items():
        assert (d / name).read_bytes() == data, name
    assert not list(d.rglob("*.partial"))


# ------------------------------------------------------------------------------------------------ tests

def test_download_pinned_revision_manifest_and_verify(hub, tmp_path):
    d = tmp_path / "dl"
    proc, rep = fetch(hub, d)
    assert proc.returncode == 0, proc.stderr
    # stderr is a pipe here: the transfer speaks in plain lines, not a vanishing bar
    lines = [l for l in proc.stderr.splitlines() if l.startswith("kimi-convert: downloading: ")]
    assert lines[0].startswith("kimi-convert: downloading: started, ") and lines[-1].startswith(
        "kimi-convert: downloading: done, "), proc.stderr
    assert rep["source"] == f"{REPO}@{hub.commit}"
    assert_complete(d, hub.files)
    # Only what a conversion needs: no README, .gitattributes, unindexed or nested safetensors.
    assert sorted(p.name for p in d.iterdir()) == sorted([*hub.files, "kimi-stream.sha256", ".kimi-stream.sha256.stat"])
    fetched = {e.name for e in hub.log if "/resolve/" in e.path}
    assert fetched == set(hub.files)
    # Pinned: listed once at "main", every file then resolved at the commit the listing returned.
    assert [e.path for e in hub.log if e.path.startswith("/api/")] == \
        [f"/api/models/{REPO}/revision/main?blobs=true"]
    assert all(f"/resolve/{hub.commit}/" in e.path for e in hub.log if "/resolve/" in e.path)
    man = (d / "kimi-stream.sha256").read_text().splitlines()
    assert f"# repo: {REPO}" in man and f"# revision: {hub.commit}" in man
    entries = dict(reversed(l.split("  ", 1)) for l in man if not l.startswith("#"))
    assert entries == {n: sha256(b) for n, b in hub.files.items()}
    assert set(rep["checked_against"]) == {"the hub's LFS SHA-256", "git blob ids from the hub listing"}

    code, out = verify(d)                      # the manifest in the directory is used by default
    assert code == 0, out
    assert out["expected_from"] == [str(d / "kimi-stream.sha256")]
    assert {r["status"] for r in out["rows"]} == {"ok"}

    # A second run finds everything in place and transfers nothing.
    n = len(hub.log)
    proc, rep = fetch(hub, d)
    assert proc.returncode == 0 and rep["transferred_bytes"] == 0
    assert {f["status"] for f in rep["files"]} == {"present"}
    assert not [e for e in hub.log[n:] if "/resolve/" in e.path or "/cdn/" in e.path]


def test_cut_mid_file_resumes_in_the_same_run(hub, tmp_path):
    name, K = SHARDS[0], 100_000
    size = len(hub.files[name])
    hub.fault(name, "cut", times=1, at=K)
    proc, rep = fetch(hub, tmp_path / "dl", "--jobs", "1")
    assert proc.returncode == 0, proc.stderr
    gets = hub.gets(name)
    assert [(g.range, g.sent) for g in gets] == [(None, K), (f"bytes={K}-", size - K)]
    f = next(f for f in rep["files"] if f["name"] == name)
    assert f["attempts"] == 2 and f["transferred"] == size
    assert f["sha256"] == sha256(hub.files[name])
    assert_complete(tmp_path / "dl", hub.files)


def test_killed_download_resumes_with_range_for_the_remainder_only(hub, tmp_path):
    d = tmp_path / "dl"
    name, K = SHARDS[1], 131_072
    size = len(hub.files[name])
    hub.fault(name, "stall", times=1, at=K)        # sends K bytes, then hangs until released
    cmd = [sys.executable, "-m", "kimistream.convert.cli", "--download-only", REPO, "--dir", str(d),
           "--endpoint", hub.url, "--jobs", "2", *FAST]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **HF_ENV})
    part = d / (name + ".partial")
    others = [d / n for n in hub.files if n != name]
    deadline = time.monotonic() + 30
    while not (part.is_file() and part.stat().st_size == K and all(p.is_file() for p in others)):
        assert time.monotonic() < deadline and proc.poll() is None, "download did not reach the stall"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    hub.release()
    assert not (d / name).exists() and part.stat().st_size == K
    assert not (d / "kimi-stream.sha256").exists()

    n = len(hub.log)
    proc2, rep = fetch(hub, d)
    assert proc2.returncode == 0, proc2.stderr
    resumed = [g for g in hub.log[n:] if g in hub.gets(name)]
    assert [(g.range, g.status, g.sent) for g in resumed] == [(f"bytes={K}-", 206, size - K)]
    f = next(f for f in rep["files"] if f["name"] == name)
    assert f["resumed_from"] == K and f["transferred"] == size - K
    assert f["sha256"] == sha256(hub.files[name])
    # Across both runs no byte of any file crossed the wire twice.
    for fname, data in hub.files.items():
        assert hub.bytes_sent(fname) == len(data), fname
    assert_complete(d, hub.files)
    assert verify(d)[0] == 0


def test_transient_faults_are_retried_in_the_same_run(hub, tmp_path):
    faults = {SHARDS[0]: ("cut", 50_000), SHARDS[1]: ("wrong", 12_345), SHARDS[2]: ("html", 0),
              "tokenizer.json": ("short", 100), "config.json": ("error500", 0)}
    for name, (kind, at) in faults.items():
        hub.fault(name, kind, times=1, at=at)
    proc, rep = fetch(hub, tmp_path / "dl")
    assert proc.returncode == 0, proc.stderr
    attempts = {f["name"]: f["attempts"] for f in rep["files"]}
    assert all(attempts[n] == 2 for n in faults), attempts
    # Wrong bytes: the partial is discarded and the file fetched again from byte 0.
    assert [g.range for g in hub.gets(SHARDS[1])] == [None, None]
    # An HTML page never reaches the partial: the second full GET is not a resume.
    assert [g.range for g in hub.gets(SHARDS[2])] == [None, None]
    assert_complete(tmp_path / "dl", hub.files)
    assert verify(tmp_path / "dl")[0] == 0


def test_bad_server_leaves_no_file_and_says_which_and_why(hub, tmp_path):
    d = tmp_path / "dl"
    for name, kind, at in [(SHARDS[0], "wrong", 777), (SHARDS[1], "short", 1000), (SHARDS[2], "html", 0),
                           ("generation_config.json", "error500", 0)]:
        hub.fault(name, kind, times=99, at=at)
    proc, _ = fetch(hub, d, "--retries", "3")
    assert proc.returncode == 1
    assert len(error_lines(proc)) == 4
    assert "downloading: done" not in proc.stderr and "kimi-convert: downloading: stopped at " in proc.stderr
    e = the_error(proc, d / SHARDS[0])
    assert "SHA-256 mismatch" in e and sha256(hub.files[SHARDS[0]]) in e and "LFS" in e
    assert len(hub.gets(SHARDS[0])) == 2           # a wrong hash costs at most one more full download
    assert "truncated" in the_error(proc, d / SHARDS[1])
    assert "HTML page" in the_error(proc, d / SHARDS[2])
    assert "HTTP 500" in the_error(proc, d / "generation_config.json")
    for name in (*SHARDS, "generation_config.json"):
        assert not (d / name).exists(), name
    assert [p.name for p in d.glob("*.partial")] == ["kimi-stream.sha256.partial"], "no unverifiable bytes kept"
    assert not (d / "kimi-stream.sha256").exists()
    assert (d / "config.json").read_bytes() == hub.files["config.json"]

    hub.clear_faults()                             # the fault was transient after all: run again
    proc, rep = fetch(hub, d)
    assert proc.returncode == 0, proc.stderr
    assert {f["name"] for f in rep["files"] if f["status"] == "downloaded"} == {*SHARDS, "generation_config.json"}
    assert_complete(d, hub.files)
    assert verify(d)[0] == 0


def test_checksums_manifest_must_agree(hub, tmp_path):
    sums = tmp_path / "checksums"
    sums.mkdir()
    man = sums / f"test-org--tiny-moe@{hub.commit}.sha256"
    good = {n: sha256(b) for n, b in hub.files.items()}
    bad = {**good, SHARDS[1]: "0" * 64, "config.json": "1" * 64}
    man.write_text("".join(f"{h}  {n}\n" for n, h in bad.items()))
    d = tmp_path / "dl"
    proc, _ = fetch(hub, d, "--checksums", sums)
    assert proc.returncode == 1
    e = the_error(proc, d / SHARDS[1])               # an LFS file: caught before any byte is fetched
    assert f"differs from checksums/{man.name}" in e and "not downloaded" in e
    assert hub.gets(SHARDS[1]) == []
    e = the_error(proc, d / "config.json")           # a git file: caught on its content
    assert "SHA-256 mismatch" in e and "1" * 64 in e and f"checksums/{man.name}" in e
    assert not (d / SHARDS[1]).exists() and not (d / "config.json").exists()

    man.write_text(f"# repo: {REPO}\n# revision: {hub.commit}\n" + "".join(f"{h}  {n}\n" for n, h in good.items()))
    proc, rep = fetch(hub, d, "--checksums", sums)
    assert proc.returncode == 0, proc.stderr
    assert f"checksums/{man.name}" in rep["checked_against"]
    code, out = verify(d, "--checksums", sums)
    assert code == 0 and out["expected_from"] == [str(d / "kimi-stream.sha256"), str(man)]


def test_verify_against_the_hub(hub, tmp_path):
    d = tmp_path / "dl"
    assert fetch(hub, d)[0].returncode == 0
    (d / "kimi-stream.sha256").unlink()             # the hub listing alone is enough
    spec = f"{REPO}@{hub.commit}"
    man = tmp_path / f"test-org--tiny-moe@{hub.commit}.sha256"     # as checksums/README.md says
    code, out = verify(d, "--hub", spec, "--endpoint", hub.url, "--write-manifest", man)
    assert code == 0, out
    rows = {Path(r["file"]).name: r for r in out["rows"]}
    assert set(rows) == set(hub.files)
    assert rows["config.json"]["detail"] == "git blob id matches"
    assert rows[SHARDS[0]]["expected"] == sha256(hub.files[SHARDS[0]])
    lines = man.read_text().splitlines()
    assert lines[:2] == [f"# repo: {REPO}", f"# revision: {hub.commit}"]
    assert {l.split("  ")[1]: l.split("  ")[0] for l in lines if not l.startswith("#")} == \
        {n: sha256(b) for n, b in hub.files.items()}

    cfg = bytearray((d / "config.json").read_bytes())
    cfg[cfg.index(b'"hidden_act"') + 2] ^= 0x20     # still valid JSON, different bytes
    (d / "config.json").write_bytes(bytes(cfg))
    shard = bytearray((d / SHARDS[0]).read_bytes())
    shard[-10] ^= 1
    (d / SHARDS[0]).write_bytes(bytes(shard))
    code, out = verify(d, "--hub", spec, "--endpoint", hub.url)
    rows = {Path(r["file"]).name: r for r in out["rows"]}
    assert code == 4
    assert rows["config.json"]["status"] == "corrupt" and "git blob id" in rows["config.json"]["detail"]
    assert rows[SHARDS[0]]["status"] == "corrupt" and rows[SHARDS[0]]["detail"] == "SHA-256 mismatch"

    (d / SHARDS[1]).write_bytes(hub.files[SHARDS[1]][:-7])
    (d / SHARDS[2]).unlink()
    code, out = verify(d, "--hub", spec, "--endpoint", hub.url)
    rows = {Path(r["file"]).name: r for r in out["rows"]}
    assert code == 3 and rows[SHARDS[2]]["status"] == "missing"
    assert rows[SHARDS[1]]["status"] == "corrupt" and rows[SHARDS[1]]["detail"].startswith("truncated")

    proc = run("verify_cli", d, "--hub", f"{REPO}@nope", "--endpoint", hub.url)
    assert proc.returncode == 2 and "revision not found" in proc.stderr


def test_server_paths_cannot_escape(ckpt, tmp_path):
    from kimistream.convert.fetch import safe_relpath
    _, files = ckpt
    d = tmp_path / "dl"
    d.mkdir()
    (d / "link").symlink_to(tmp_path)
    for bad in ("../x", "a/../../x", "/etc/passwd", "C:\\x", "a\\..\\x", "", ".", "a//b", "link/x",
                "kimi-stream.sha256", "x.safetensors.partial", ".kimi-stream.sha256.stat"):
        with pytest.raises(ValueError):
            safe_relpath(bad, d)
    assert safe_relpath("sub/model-1-of-2.safetensors", d) == "sub/model-1-of-2.safetensors"

    absolute = str(tmp_path / "abs.safetensors")
    index = json.loads(files["model.safetensors.index.json"])
    names = list(index["weight_map"])
    index["weight_map"][names[0]] = "../escape.safetensors"
    index["weight_map"][names[1]] = absolute
    evil = {**files, "model.safetensors.index.json": json.dumps(index).encode(),
            "../escape.safetensors": files[SHARDS[0]], absolute: files[SHARDS[0]]}
    with HubServer() as server:
        server.add_repo("evil/escape", evil)
        proc, _ = fetch(server, d, spec="evil/escape")
        assert proc.returncode == 1
        where = f"kimi-convert: error: {d}/model.safetensors.index.json: "
        errs = [l for l in error_lines(proc) if l.startswith(where)]
        assert len(errs) == 2
        assert any("'../escape.safetensors'" in e and "escape the target directory" in e for e in errs)
        assert any(repr(absolute) in e and "absolute path" in e for e in errs)
        assert not [e for e in server.log if "escape.safetensors" in e.path or "abs.safetensors" in e.path]

        url = server.add_plain("../escape.bin", b"x")
        lst = tmp_path / "urls.txt"
        lst.write_text(f"{url} {sha256(b'x')}\n")
        proc = run("cli", "--download-only", "--urls", lst, "--dir", d, *FAST)
        assert proc.returncode == 1
        assert "escape the target directory" in the_error(proc, f"{lst}:1")
    assert not (tmp_path / "escape.safetensors").exists() and not Path(absolute).exists()
    assert not (tmp_path / "escape.bin").exists()


def test_convert_repo_end_to_end(hub, ckpt, tmp_path):
    from kimistream.convert.converter import convert_checkpoint
    from kimistream.formats.presets import PrecisionPlan
    local_dir, _ = ckpt
    out = tmp_path / "out" / "model.kst"
    out.parent.mkdir()
    proc = run("cli", f"{REPO}@main", "-o", out, "--endpoint", hub.url, "--quant", "f32", "--json", *FAST)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    d = Path(summary["download"]["directory"])
    assert d == out.parent / f"test-org--tiny-moe@{hub.commit}"          # default: next to the output
    assert summary["total"]["file_bytes"] == out.stat().st_size
    code, rep = verify(out)
    assert code == 0, rep
    code, rep = verify(out, "--hub", f"{REPO}@{hub.commit}", "--endpoint", hub.url)
    assert code == 0 and rep["rows"][-1]["detail"].startswith("4 of 8 source files match")
    other = tmp_path / "other.sha256"                  # a manifest of a different release
    other.write_text(f"{'3' * 64}  {SHARDS[2]}\n{sha256(hub.files[SHARDS[0]])}  {SHARDS[0]}\n")
    code, rep = verify(out, "--manifest", other)
    bad = [r for r in rep["rows"] if r["status"] != "ok"]
    assert code == 4 and [(r["file"], r["status"]) for r in bad] == [(f"model.kst [source {SHARDS[2]}]", "corrupt")]
    assert bad[0]["detail"] == f"built from a different {SHARDS[2]} than {other}"
    # Built from the downloaded files exactly as from the original directory.
    ref = tmp_path / "ref.kst"
    convert_checkpoint(local_dir, ref, PrecisionPlan.from_preset("f32"))
    assert out.read_bytes() == ref.read_bytes()


def test_delete_source_interrupted_is_not_downloaded_again(hub, ckpt, tmp_path):
    """An interrupted `--delete-source` conversion from the hub: the rerun does not fetch the shard it
    already converted and deleted, resumes, and deletes a shard the user fetched again by hand."""
    out = tmp_path / "out" / "model.kst"
    out.parent.mkdir()
    args = [sys.executable, "-m", "kimistream.convert.cli", f"{REPO}@main", "-o", str(out), "--endpoint", hub.url,
            "--quant", "f32", "--delete-source", *FAST]
    env = {**os.environ, **HF_ENV}
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stderr:
        if "consumed and deleted" in line:
            proc.send_signal(signal.SIGINT)
            break
    rest = proc.stderr.read()
    assert proc.wait(60) == 130, rest
    assert f"interrupted; partial output kept as {out}.partial, run the same command to resume" in rest
    d = out.parent / f"test-org--tiny-moe@{hub.commit}"
    assert not (d / SHARDS[0]).exists() and (d / SHARDS[2]).exists()
    n = len(hub.log)
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "1 already converted and deleted (not fetched again)" in done.stderr
    assert "Traceback" not in done.stderr
    assert SHARDS[0] not in {e.name for e in hub.log[n:] if e.method == "GET"}
    assert not list(d.glob("*.safetensors")) and not list(out.parent.glob("*.partial*"))
    from kimistream.convert.converter import convert_checkpoint
    from kimistream.formats.presets import PrecisionPlan
    ref = tmp_path / "ref.kst"
    convert_checkpoint(ckpt[0], ref, PrecisionPlan.from_preset("f32"))
    assert out.read_bytes() == ref.read_bytes()


def test_refetched_shard_is_deleted_again_on_resume(ckpt, tmp_path):
    """A shard fetched again after an interrupted `--delete-source` run (all its tensors already
    written) is deleted when the conversion resumes, as the flag asks."""
    from kimistream.convert.converter import convert_checkpoint
    from kimistream.formats.presets import PrecisionPlan

    class Stop(Exception):
        pass

    def stop_after_first_shard(kind, **info):
        if kind == "shard-done":
            raise Stop
    src = tmp_path / "src"
    shutil.copytree(ckpt[0], src)
    out = tmp_path / "m.kst"
    with pytest.raises(Stop):
        convert_checkpoint(src, out, PrecisionPlan.from_preset("f32"), progress=stop_after_first_shard,
                           delete_source=True)
    gone = [n for n in SHARDS if not (src / n).exists()]
    assert len(gone) == 1
    shutil.copy(ckpt[0] / gone[0], src / gone[0])          # "repaired"
    convert_checkpoint(src, out, PrecisionPlan.from_preset("f32"), delete_source=True)
    assert not list(src.glob("*.safetensors"))


def test_hf_endpoint_token_and_bad_revision(ckpt, tmp_path):
    _, files = ckpt
    env = {"HF_TOKEN": ""}
    with HubServer() as server:
        server.add_repo("private-org/tiny", files, token="hf_secret")
        env["HF_ENDPOINT"] = server.url                # no --endpoint: the variable picks the mirror
        args = ["--download-only", "private-org/tiny", "--dir", tmp_path / "dl", *FAST]
        proc = run("cli", *args, env=env)
        assert proc.returncode == 1
        (line,) = error_lines(proc)
        assert "private-org/tiny: repository not found" in line and "HF_TOKEN" in line
        n = len(server.log)
        proc = run("cli", *args, env={**env, "HF_TOKEN": "hf_secret"})
        assert proc.returncode == 0, proc.stderr
        hub_calls = [e for e in server.log[n:] if e.path.startswith("/api/") or "/resolve/" in e.path]
        assert len(hub_calls) > len(files) and all(e.auth for e in hub_calls)
        cdn_calls = [e for e in server.log[n:] if e.path.startswith("/cdn/")]
        assert cdn_calls and not any(e.auth for e in cdn_calls)        # the token stays with the hub
        assert_complete(tmp_path / "dl", files)
        proc = run("cli", *args[:1], "private-org/tiny@v9", *args[2:], env={**env, "HF_TOKEN": "hf_secret"})
        (line,) = error_lines(proc)
        assert "private-org/tiny@v9: revision not found" in line


def test_paths_info_fallback(ckpt, tmp_path):
    """A mirror whose model-info ignores ?blobs=True: sizes and LFS hashes come from paths-info."""
    _, files = ckpt
    with HubServer(omit_blobs=True) as server:
        commit = server.add_repo(REPO, files)
        proc, rep = fetch(server, tmp_path / "dl")
        assert proc.returncode == 0, proc.stderr
        assert [e.path for e in server.log if e.method == "POST"] == [f"/api/models/{REPO}/paths-info/{commit}"]
        assert "the hub's LFS SHA-256" in rep["checked_against"]
    assert_complete(tmp_path / "dl", files)


def test_url_list_download_and_convert(ckpt, tmp_path):
    _, files = ckpt
    d = tmp_path / "dl"
    with HubServer() as server:
        urls = {n: server.add_plain(n, b) for n, b in files.items()}
        lst = tmp_path / "urls.txt"
        lst.write_text("# a mirror\n" + "".join(f"{urls[n]} {sha256(b)}\n" for n, b in files.items()))
        server.fault(SHARDS[2], "cut", times=1, at=70_000)
        out = tmp_path / "m.kst"
        proc = run("cli", "--urls", lst, "--dir", d, "-o", out, "--json", "--quant", "f32", *FAST,
                   env={"HF_TOKEN": "hf_never_sent"})
        assert proc.returncode == 0, proc.stderr
        assert [g.range for g in server.gets(SHARDS[2])] == [None, "bytes=70000-"]
        assert not [e for e in server.log if e.auth]         # the hub token stays with the hub
        assert verify(d)[0] == 0 and verify(out)[0] == 0
        assert f"# urls: {lst}" in (d / "kimi-stream.sha256").read_text()

        bad = tmp_path / "bad.txt"
        bad.write_text(f"{urls[SHARDS[0]]}\n{urls['config.json']} {'2' * 64}\nftp://x/y\n")
        proc = run("cli", "--download-only", "--urls", bad, "--dir", tmp_path / "dl2", *FAST, "--retries", "1")
        assert proc.returncode == 1
        assert "no expected SHA-256" in the_error(proc, tmp_path / "dl2" / SHARDS[0])
        assert "SHA-256 mismatch" in the_error(proc, tmp_path / "dl2" / "config.json")
        assert "not an http(s) URL" in the_error(proc, f"{bad}:3")
        assert not (tmp_path / "dl2" / "config.json").exists()


def test_server_is_a_hub_to_huggingface_hub(hub, tmp_path, monkeypatch):
    """The server's fidelity, checked with the official client in-process: listing, paths-info, the
    HEAD metadata call (X-Linked-Etag, X-Repo-Commit, size) and a plain hf_hub_download."""
    from huggingface_hub import HfApi, constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    api = HfApi(endpoint=hub.url, token=False)
    info = api.model_info(REPO, revision="main", files_metadata=True)
    assert info.sha == hub.commit
    sib = {s.rfilename: s for s in info.siblings}
    data = hub.files[SHARDS[0]]
    assert sib[SHARDS[0]].lfs.sha256 == sha256(data) and sib[SHARDS[0]].size == len(data)
    assert sib["config.json"].lfs is None
    assert sib["config.json"].blob_id == hashlib.sha1(b"blob %d\0" % len(hub.files["config.json"])
                                                      + hub.files["config.json"]).hexdigest()
    (pi,) = api.get_paths_info(REPO, [SHARDS[0]], revision=hub.commit)
    assert pi.lfs.sha256 == sha256(data)
    meta = get_hf_file_metadata(hf_hub_url(REPO, SHARDS[0], revision="main", endpoint=hub.url), token=False)
    assert (meta.etag, meta.commit_hash, meta.size) == (sha256(data), hub.commit, len(data))
    assert any(e.method == "HEAD" and e.status == 302 for e in hub.log)
    path = hf_hub_download(REPO, SHARDS[0], revision=hub.commit, cache_dir=tmp_path, endpoint=hub.url,
                           token=False)
    assert Path(path).read_bytes() == data


# ------------------------------------------------------------------- reruns, names, odd servers, Ctrl-C

def files_by_name(rep) -> dict:
    return {f["name"]: f for f in rep["files"]}


def test_rerun_hashes_again_a_file_changed_since_it_was_verified(hub, tmp_path):
    """A rerun of a finished download trusts a file without hashing it only while its size, mtime,
    ctime and inode are those recorded when it was verified: one flipped byte (same size), even with
    the old mtime put back, is found, fetched again, and nothing claims it was checked when it was not."""
    d = tmp_path / "dl"
    assert fetch(hub, d)[0].returncode == 0
    shard = d / SHARDS[0]
    b = bytearray(shard.read_bytes())
    b[1000] ^= 1
    shard.write_bytes(bytes(b))
    proc, rep = fetch(hub, d)
    assert proc.returncode == 0, proc.stderr
    files = files_by_name(rep)
    assert files[SHARDS[0]]["status"] == "downloaded" and files[SHARDS[0]]["checked"] == "hashed"
    assert f"{shard}: SHA-256 mismatch" in proc.stderr and "downloading it again" in proc.stderr
    assert {f["checked"] for n, f in files.items() if n != SHARDS[0]} == {"unchanged"}
    assert shard.read_bytes() == hub.files[SHARDS[0]]

    st = shard.stat()                               # changed in place, its mtime set back
    b = bytearray(shard.read_bytes())
    b[-5] ^= 0x40
    shard.write_bytes(bytes(b))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    n = len(hub.log)
    proc, rep = fetch(hub, d)
    assert proc.returncode == 0, proc.stderr
    assert files_by_name(rep)[SHARDS[0]]["status"] == "downloaded"
    assert [e.name for e in hub.log[n:] if e.method == "GET" and e.name and e.status in (200, 206)] == [SHARDS[0]]
    assert verify(d)[0] == 0

    # Unchanged files: not hashed again, and the summary says so rather than "every file ... checked".
    proc = run("cli", "--download-only", REPO, "--dir", d, "--endpoint", hub.url, *FAST)
    assert proc.returncode == 0, proc.stderr
    assert "every file's size and hash checked" not in proc.stderr
    assert "0 files' size and hash checked against" in proc.stderr
    assert f"{len(hub.files)} present files not hashed again: unchanged" in proc.stderr

    # A download without the record of what was hashed (an older kimi-stream's): everything is hashed
    # once, then recorded.
    (d / ".kimi-stream.sha256.stat").unlink()
    proc, rep = fetch(hub, d)
    assert proc.returncode == 0 and rep["transferred_bytes"] == 0
    assert {(f["status"], f["checked"]) for f in rep["files"]} == {("present", "hashed")}
    proc, rep = fetch(hub, d)
    assert {(f["status"], f["checked"]) for f in rep["files"]} == {("present", "unchanged")}


def test_control_characters_in_names_are_refused(ckpt, tmp_path):
    """A shard name with a newline (from the repo's index, or a URL) would forge lines in the
    download's kimi-stream.sha256: refused, in one line naming the index or the URL list's line."""
    from kimistream.convert.fetch import safe_relpath
    from kimistream.convert.source import SourceError, read_index, shard_name_problem
    for bad in ("a.safetensors\n" + "0" * 64 + "  config.json", "a\rb", "a\tb", "a\x7fb", "a\x85b", "a\u2028b"):
        with pytest.raises(ValueError, match="control character"):
            safe_relpath(bad, tmp_path)
        assert "control character" in shard_name_problem(bad)
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text(json.dumps({"weight_map": {"t\n0": "a\nb.safetensors"}}))
    with pytest.raises(SourceError) as e:
        read_index(idx)
    assert str(e.value).startswith(f"{idx}: shard 'a\\nb.safetensors' of 't\\n0' contains a control character")
    assert "\n" not in str(e.value)

    _, files = ckpt
    evil_name = "x.safetensors\n" + "0" * 64 + "  config.json"
    index = json.loads(files["model.safetensors.index.json"])
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = evil_name
    evil = {**files, "model.safetensors.index.json": json.dumps(index).encode(), evil_name: files[SHARDS[0]]}
    d = tmp_path / "dl"
    with HubServer() as server:
        server.add_repo("evil/newline", evil)
        proc, _ = fetch(server, d, spec="evil/newline")
        assert proc.returncode == 1
        assert "control character" in the_error(proc, d / "model.safetensors.index.json")
        assert not (d / "kimi-stream.sha256").exists()
        assert "0" * 64 not in (d / "kimi-stream.sha256.partial").read_text()

        lst = tmp_path / "urls.txt"
        url = server.add_plain("a\nb.bin", b"x")
        lst.write_text(f"{url} {sha256(b'x')}\n")
        proc = run("cli", "--download-only", "--urls", lst, "--dir", tmp_path / "dl2", *FAST)
        assert proc.returncode == 1 and "control character" in the_error(proc, f"{lst}:1")


class _OddServer:
    """A plain HTTP server on 127.0.0.1 whose handler answers by path (see `do_GET`)."""

    def __init__(self, data: bytes):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        self.data, self.gets = data, []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_HEAD(self):
                if self.path.startswith("/head0/"):          # a presigned URL's HEAD: "0 bytes"
                    return self._answer(200, {"Content-Length": "0"})
                if self.path.startswith("/stale/"):          # a HEAD from before the file changed
                    return self._answer(200, {"Content-Length": str(len(outer.data) // 3)})
                self.do_GET(head=True)

            def do_GET(self, head=False):
                if self.path.startswith("/loop/"):
                    return self._answer(302, {"Location": self.path, "Content-Length": "0"})
                if self.path.startswith("/ftp/"):
                    return self._answer(302, {"Location": "ftp://127.0.0.1/x.bin", "Content-Length": "0"})
                if not head:
                    outer.gets.append(self.path)
                self._answer(200, {"Content-Length": str(len(outer.data))}, b"" if head else outer.data)

            def _answer(self, status, headers, body=b""):
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_http_client_errors_are_one_line_per_file(tmp_path):
    """A redirect loop, a redirect to another scheme and malformed URLs (in the list or --endpoint):
    one line naming the URL, never a traceback; the other files still download."""
    data = os.urandom(50_000)
    srv = _OddServer(data)
    try:
        lst = tmp_path / "urls.txt"
        lst.write_text(f"{srv.url}/loop/a.bin {sha256(data)}\n{srv.url}/ftp/b.bin {sha256(data)}\n"
                       f"{srv.url}/ok/c.bin {sha256(data)}\nhttp://127.0.0.1:abc/d.bin {sha256(data)}\n"
                       f"http://[::1/e.bin {sha256(data)}\nhttp://127.0.0.1:99999/f.bin\n")
        d = tmp_path / "dl"
        proc = run("cli", "--download-only", "--urls", lst, "--dir", d, *FAST)
        assert proc.returncode == 1
        assert len(error_lines(proc)) == 5, proc.stderr
        e = the_error(proc, d / "a.bin")
        assert "redirect loop" in e and f"{srv.url}/loop/a.bin" in e
        assert "ftp://127.0.0.1/x.bin" in the_error(proc, d / "b.bin")
        assert "invalid URL http://127.0.0.1:abc/d.bin" in the_error(proc, f"{lst}:4")
        assert "invalid URL http://[::1/e.bin" in the_error(proc, f"{lst}:5")
        assert "invalid URL http://127.0.0.1:99999/f.bin" in the_error(proc, f"{lst}:6")
        assert (d / "c.bin").read_bytes() == data
        assert "downloading: done" not in proc.stderr and "kimi-convert: downloading: stopped at " in proc.stderr
    finally:
        srv.close()

    for ep in ("http://127.0.0.1:abc", "localhost:8080", "ftp://127.0.0.1"):
        t0 = time.monotonic()
        proc = run("cli", "--download-only", REPO, "--dir", tmp_path / "d2", "--endpoint", ep, "--quiet")
        (line,) = error_lines(proc)
        assert proc.returncode == 1 and f"--endpoint {ep}: not" in line
        proc = run("verify_cli", tmp_path, "--hub", f"{REPO}@main", "--endpoint", ep)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.strip() == line.replace("kimi-convert", "kimi-verify")
        assert time.monotonic() - t0 < 30                # no retries with back-off for a malformed URL


def test_head_size_is_only_an_estimate(tmp_path):
    """A HEAD answer saying 0 bytes (presigned URLs) or a stale length: the file is fetched all the
    same and checked against its GET and its hash; HEAD never stands in for either."""
    data = os.urandom(300_000)
    srv = _OddServer(data)
    try:
        lst = tmp_path / "urls.txt"
        lst.write_text(f"{srv.url}/head0/a.bin {sha256(data)}\n{srv.url}/stale/b.bin {sha256(data)}\n")
        d = tmp_path / "dl"
        proc = run("cli", "--download-only", "--urls", lst, "--dir", d, *FAST)
        assert proc.returncode == 0, proc.stderr
        assert sorted(srv.gets) == ["/head0/a.bin", "/stale/b.bin"]
        assert (d / "a.bin").read_bytes() == data and (d / "b.bin").read_bytes() == data
        assert proc.stderr.splitlines()[-2].startswith("kimi-convert: downloading: done, 585.94 KiB")
    finally:
        srv.close()


def test_failed_download_of_unknown_size_says_it_stopped(tmp_path):
    import socket
    with socket.socket() as s:                       # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lst = tmp_path / "urls.txt"
    lst.write_text(f"http://127.0.0.1:{port}/a.bin {'a' * 64}\n")
    proc = run("cli", "--download-only", "--urls", lst, "--dir", tmp_path / "dl", *FAST, "--retries", "1")
    assert proc.returncode == 1 and "connection lost" in the_error(proc, tmp_path / "dl" / "a.bin")
    assert "downloading: done" not in proc.stderr
    assert "kimi-convert: downloading: stopped at 0 B, with 1 error" in proc.stderr


def test_ctrl_c_during_a_stalled_transfer_ends_at_once_and_resumes(hub, tmp_path):
    d = tmp_path / "dl"
    name, K = SHARDS[1], 100_000
    size = len(hub.files[name])
    hub.fault(name, "stall", times=1, at=K)
    proc = subprocess.Popen([sys.executable, "-m", "kimistream.convert.cli", "--download-only", REPO, "--dir", str(d),
                             "--endpoint", hub.url, "--jobs", "2", *FAST], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **HF_ENV})
    part = d / (name + ".partial")
    deadline = time.monotonic() + 30
    while not (part.is_file() and part.stat().st_size == K):
        assert time.monotonic() < deadline and proc.poll() is None, "download did not reach the stall"
        time.sleep(0.02)
    time.sleep(0.3)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=60)[1]
    assert time.monotonic() - t0 < 5, "Ctrl-C waited for the read timeout"
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (f"kimi-convert: error: {d}: interrupted; partial downloads kept as "
                                            f"*.partial, run the same command to resume")
    assert part.stat().st_size == K and not (d / name).exists()
    hub.release()
    n = len(hub.log)
    proc, rep = fetch(hub, d)
    assert proc.returncode == 0, proc.stderr
    assert [(g.range, g.sent) for g in hub.log[n:] if g in hub.gets(name)] == [(f"bytes={K}-", size - K)]
    assert files_by_name(rep)[name]["resumed_from"] == K
    assert_complete(d, hub.files)


def test_manifest_entry_that_matches_no_file_is_an_error(hub, tmp_path):
    """A --manifest entry that names no file of the download would check nothing: the download stops
    before it starts, naming the manifest and the entry."""
    man = tmp_path / "SHA256SUMS"
    good = {n: sha256(b) for n, b in hub.files.items()}
    man.write_text("".join(f"{h}  {n}\n" for n, h in good.items()) + f"{'0' * 64}  model-typo.safetensors\n")
    d = tmp_path / "dl"
    proc, _ = fetch(hub, d, "--manifest", man)
    assert proc.returncode == 1
    (line,) = error_lines(proc)
    assert line.startswith(f"kimi-convert: error: {man}: entry 'model-typo.safetensors' matches no file of "
                           f"{REPO}@{hub.commit}")
    assert not [e for e in hub.log if "/resolve/" in e.path]
    # A file the repo has but a conversion does not need is an entry of the same release: allowed.
    readme = sha256(b"# tiny\n")
    man.write_text("".join(f"{h}  {n}\n" for n, h in good.items()) + f"{readme}  README.md\n")
    proc, rep = fetch(hub, d, "--manifest", man)
    assert proc.returncode == 0, proc.stderr
    assert str(man) in rep["checked_against"]

    with HubServer() as server:
        lst = tmp_path / "urls.txt"
        lst.write_text(f"{server.add_plain('c.bin', b'c')}\n")
        man.write_text(f"{sha256(b'c')}  c.bin\n{sha256(b'd')}  d.bin\n")
        proc = run("cli", "--download-only", "--urls", lst, "--dir", tmp_path / "dl2", "--manifest", man, *FAST)
        assert proc.returncode == 1
        assert "entry 'd.bin' matches no file of the URL list" in the_error(proc, man)
        assert not server.gets("c.bin")
