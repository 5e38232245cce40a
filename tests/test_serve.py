"""kimi-run --serve driven by the real `openai` client on the bundled model: the same tokens as
kimi-run --prompt at temperature 0, usage counts, prefix caching seen in the server's counters, the
queue (order, 503 when full), a client that leaves mid-stream, OpenAI-shaped errors; and the
interactive --chat on a pseudo-terminal."""

import http.client
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from kimistream.runtime.engine import Engine, Request, TextStream
from kimistream.runtime.sampler import Sampler

KEY = "test-key-123"
CONTEXT = 1024


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The bundled model, converted once into a cache of this module's own."""
    e = dict(os.environ, KIMI_STREAM_CACHE=str(tmp_path_factory.mktemp("cache")))
    proc = subprocess.run([shutil.which("kimi-run"), "--dry-run", "--quiet"], env=e, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    return e


class Server:
    def __init__(self, env, *flags):
        self.proc = subprocess.Popen([shutil.which("kimi-run"), "--serve", "--port", "0", "--max-context", str(CONTEXT),
                                      *flags], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise AssertionError(f"the server ended: {''.join(self.log)}")
            self.log.append(line)
            m = re.search(r"serving (\S+) at (http://[\d.]+:\d+)/v1", line)
            if m:
                self.model, self.url = m.group(1), m.group(2)
                break
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()

    def client(self, key=KEY, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **kw)

    def raw(self, method, path, body=None, key=KEY, headers=None):
        """(status, decoded JSON or text) of one request."""
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        h = {"Authorization": f"Bearer {key}", "Content-Type": "application/json", **(headers or {})}
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=h)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                status, text = r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode()
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def metrics(self) -> dict:
        status, text = self.raw("GET", "/metrics")
        assert status == 200, text
        return {k: float(v) for k, v in re.findall(r"^(kimi_\w+) (\S+)$", text, re.M)}

    def wait_for(self, cond, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.metrics()
            if cond(m):
                return m
            time.sleep(0.01)
        raise AssertionError(f"timed out; metrics {self.metrics()}")

    def stop(self):
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


@pytest.fixture(scope="module")
def server(env):
    s = Server(env, "--api-key", KEY, "--max-queue", "2", "--max-body", "256K")
    yield s
    s.stop()


def kimi_run_json(env, prompt, max_tokens, chat):
    cmd = [shutil.which("kimi-run"), "--prompt", prompt, "--max-tokens", str(max_tokens), "--temperature", "0",
           "--max-context", str(CONTEXT), "--json", "--quiet"] + (["--chat"] if chat else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def expected_text(env, ref):
    """kimi-run's tokens as text, less an end-of-sequence token (the API's content never shows it)."""
    from kimistream.runtime.tokenizer import Tokenizer
    from kimistream.runtime.weights import ModelWeights
    path = next(p for p in (os.path.join(env["KIMI_STREAM_CACHE"], f) for f in os.listdir(env["KIMI_STREAM_CACHE"]))
                if p.endswith(".kst"))
    w = ModelWeights(path)
    tok = Tokenizer(w.header["tokenizer"]["kind"], {n: w.file.blob(n) for n in w.header["tokenizer"]["files"]})
    ids = [t for t in ref["tokens"] if t != tok.eos_id]
    w.close()
    return tok.decode(ids)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_same_tokens_as_kimi_run(env, server, chat):
    prompt = "def parse_args(argv):" if chat else "class Reader:\n    def __init__(self, path):"
    ref = kimi_run_json(env, prompt, 40, chat)
    want = expected_text(env, ref)
    c = server.client()
    if chat:
        msgs = [{"role": "user", "content": prompt}]
        r = c.chat.completions.create(model=server.model, messages=msgs, temperature=0, max_tokens=40)
        got, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
        stream = c.chat.completions.create(model=server.model, messages=msgs, temperature=0, max_tokens=40,
                                           stream=True, stream_options={"include_usage": True})
    else:
        r = c.completions.create(model=server.model, prompt=prompt, temperature=0, max_tokens=40)
        got, finish = r.choices[0].text, r.choices[0].finish_reason
        stream = c.completions.create(model=server.model, prompt=prompt, temperature=0, max_tokens=40, stream=True,
                                      stream_options={"include_usage": True})
    assert got == want
    assert finish == ("stop" if ref["stats"]["stop_reason"] == "eos" else "length")
    assert r.usage.prompt_tokens == len(ref["prompt_tokens"])
    assert r.usage.completion_tokens == len(ref["tokens"])
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    pieces, finishes, usage = [], [], None
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for choice in ch.choices:
            pieces.append((choice.delta.content or "") if chat else choice.text)
            finishes.append(choice.finish_reason)
    assert "".join(pieces) == want
    assert len(pieces) > 3                                  # streamed piece by piece, not in one event
    assert [f for f in finishes if f] == [finish] and finishes[-1] == finish
    assert usage.prompt_tokens == len(ref["prompt_tokens"]) and usage.completion_tokens == len(ref["tokens"])
    # the same prompt again: all of it but its last token comes from the kept cache
    assert usage.prompt_tokens_details.cached_tokens == len(ref["prompt_tokens"]) - 1


def test_second_turn_computes_only_new_tokens(server):
    c = server.client()
    turn1 = [{"role": "user", "content": "import json\nimport sys"}]
    r1 = c.chat.completions.create(model=server.model, messages=turn1, temperature=0, max_tokens=24)
    before = server.metrics()
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "def load(path):"}]
    r2 = c.chat.completions.create(model=server.model, messages=turn2, temperature=0, max_tokens=8)
    after = server.metrics()
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= r1.usage.prompt_tokens                 # at least the whole first prompt was kept
    assert cached < r2.usage.prompt_tokens
    computed = after["kimi_prompt_tokens_computed_total"] - before["kimi_prompt_tokens_computed_total"]
    assert computed == r2.usage.prompt_tokens - cached
    assert after["kimi_prompt_tokens_cached_total"] - before["kimi_prompt_tokens_cached_total"] == cached


def _long_prompt(seed: str) -> str:
    return seed + "\n" + "\n".join(f"    value_{i} = compute({i}, {seed!r})" for i in range(40))


def test_queue_order_and_overflow(server):
    """One generation at a time, the others answered in arrival order (the order the server finished
    them in, from its x-kimi-generation header: the answers themselves may reach the client threads in
    either order); past --max-queue (2), 503."""
    c = server.client()
    done, errors = [], []

    def ask(name, prompt, max_tokens):
        try:
            raw = c.completions.with_raw_response.create(model=server.model, prompt=prompt, temperature=0,
                                                         max_tokens=max_tokens)
            r = raw.parse()
            done.append((int(raw.headers["x-kimi-generation"]), name, r.usage.completion_tokens))
        except Exception as e:                              # noqa: BLE001 - reported by the assertion below
            errors.append((name, e))

    threads = [threading.Thread(target=ask, args=("A", _long_prompt("first"), 480))]
    threads[0].start()
    server.wait_for(lambda m: m["kimi_queue_running"] == 1)
    for i, name in enumerate("BC"):
        threads.append(threading.Thread(target=ask, args=(name, f"def {name.lower()}():", 5)))
        threads[-1].start()
        server.wait_for(lambda m, n=i + 1: m["kimi_queue_waiting"] == n)
    with pytest.raises(openai.APIStatusError) as e:
        c.completions.create(model=server.model, prompt="x = 1", max_tokens=2)
    assert e.value.status_code == 503 and e.value.body["code"] == "queue_full"
    assert server.metrics()["kimi_queue_running"] == 1     # A was still generating when D was refused
    for t in threads:
        t.join(120)
    assert not errors, errors
    finished = sorted(done)
    assert [(name, n) for _, name, n in finished] == [("A", 480), ("B", 5), ("C", 5)]
    assert [g for g, _, _ in finished] == list(range(finished[0][0], finished[0][0] + 3))   # one after another


def test_disconnected_stream_stops_generating(server):
    before = server.wait_for(lambda m: m["kimi_queue_running"] == 0)
    c = server.client()
    stream = c.completions.create(model=server.model, prompt="import os", temperature=0, max_tokens=900, stream=True)
    it = iter(stream)
    for _ in range(3):
        next(it)
    stream.close()
    after = server.wait_for(lambda m: m["kimi_queue_running"] == 0
                            and m["kimi_requests_cancelled_total"] > before["kimi_requests_cancelled_total"])
    generated = after["kimi_generated_tokens_total"] - before["kimi_generated_tokens_total"]
    assert 3 <= generated < 900                       # kimi-run generates all 900 for this prompt (no end token)
    assert after["kimi_requests_cancelled_total"] - before["kimi_requests_cancelled_total"] == 1


def test_stop_strings(env, server):
    prompt = "import os"
    full = server.client().completions.create(model=server.model, prompt=prompt, temperature=0, max_tokens=60)
    text = full.choices[0].text
    stop = text.strip()[6:9]
    assert stop and stop in text
    r = server.client().completions.create(model=server.model, prompt=prompt, temperature=0, max_tokens=60, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:text.find(stop)]
    pieces = [ch.choices[0].text for ch in server.client().completions.create(
        model=server.model, prompt=prompt, temperature=0, max_tokens=60, stop=stop, stream=True) if ch.choices]
    assert "".join(pieces) == text[:text.find(stop)]


def test_stop_strings_at_the_limit_cost_little(server):
    """Four stop strings of the longest length taken: a request is not much slower than without
    (the hold-back was O(len(stop)^2) per token: 4 stop strings of 300k characters took 68 s for
    3 tokens, and every other request waited behind it)."""
    body = {"model": server.model, "prompt": "import os", "temperature": 0, "max_tokens": 200}
    t = time.perf_counter()
    plain = server.raw("POST", "/v1/completions", body)[1]["choices"][0]["text"]
    alone = time.perf_counter() - t
    t = time.perf_counter()
    status, r = server.raw("POST", "/v1/completions", {**body, "stop": ["x" * 1024, "import os\n" * 102, " " * 1024,
                                                                      "ab" * 512]})
    assert status == 200 and r["choices"][0]["text"] == plain
    assert time.perf_counter() - t < 2 * alone + 2


def test_text_stream_work_does_not_grow_with_stop_strings():
    """TextStream alone (no limit of its own): stop strings of 100k characters, compared only where
    they can matter (the old hold-back tried every prefix of each: hours for this)."""
    class Chars:
        def decode(self, ids):
            return "".join(ids)
    ts = TextStream(Chars(), ("a" * 100_000 + "b", "x" * 100_000, "ab" * 50_000, "zz"))
    t = time.perf_counter()
    out = [ts.push(c) for c in "ab" * 150 + "a" * 300 + "zz" + "tail"]
    assert time.perf_counter() - t < 2
    assert ts.stopped and "".join(out) + ts.finish() == "ab" * 150 + "a" * 300


@pytest.mark.parametrize("decoder", ["bytes", "leading space"])
def test_text_stream_decodes_a_long_text_in_time_that_does_not_grow_with_it(decoder):
    """2000 tokens, some of them halves of a character: the text shown, and each push's text, are what
    decoding all ids at once gives, while the ids decoded per token stay bounded (each push had decoded
    the whole text: a million ids here). A decoder that drops the text's leading space (as
    SentencePiece's do) is not a sum of its parts at any cut: its text is right all the same."""
    pieces = [b" the", b" \xe4\xb8", b"\xad", b"ab", b"\n", b" \xf0\x9f", b"\x98\x80", b"."]

    class Tok:
        decoded = 0

        def decode(self, ids):
            Tok.decoded += len(ids)
            text = b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")
            return text[1:] if decoder == "leading space" and text.startswith(" ") else text
    ids = random.Random(3).choices(range(len(pieces)), k=2000)
    tok = Tok()
    ts = TextStream(tok)
    out = []
    for k, i in enumerate(ids):
        out.append(ts.push(i))
        if k % 97 == 0:
            whole = Tok().decode(ids[:k + 1])
            Tok.decoded -= k + 1
            assert "".join(out) == whole.rstrip("\ufffd")[:len("".join(out))]
    out.append(ts.finish())
    assert "".join(out) == b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")[
        1 if decoder == "leading space" and pieces[ids[0]].startswith(b" ") else 0:]
    if decoder == "bytes":
        assert Tok.decoded < 100 * len(ids), Tok.decoded      # (about 60; the whole text each push: 1000)


class _ByteTok:
    """A byte-level tokenizer: id -> bytes, decoded with errors="replace" (a token such as b" \xe4\xb8"
    both completes a stop string and begins a character)."""
    vocab = {0: b"Answer", 1: b":", 2: b" \xe4\xb8", 3: b"\xad", 9: b""}
    eos_id = 9

    def decode(self, ids):
        return b"".join(self.vocab[i] for i in ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("tokens", [[0, 1, 2, 3], [0, 1, 2], [0, 1, 2, 9]], ids=["more", "max_tokens", "eos"])
def test_a_stop_string_before_an_incomplete_character_is_cut(tokens):
    ts = TextStream(_ByteTok(), (": ",), {9})
    out = []
    for t in tokens:
        out.append(ts.push(t))
        if ts.stopped:
            break
    out.append(ts.finish())
    assert ("".join(out), ts.stopped) == ("Answer", True)      # was 'Answer: \ufffd', not stopped


@pytest.mark.parametrize("stop_reason,tokens", [("max tokens", [0, 1]), ("eos", [0, 1, 9])])
def test_a_stop_string_found_at_the_end_makes_finish_reason_stop(monkeypatch, stop_reason, tokens):
    """The engine's finish reason when generation ends (max_tokens, end of sequence) just as the
    stop string's last character is still incomplete: finish() finds it, the reason is "stop"."""
    from types import SimpleNamespace

    import kimistream.runtime.engine as engine_mod
    tok = _ByteTok()
    tok.vocab = {0: b"Answer", 1: b": \xe4\xb8", 9: b""}

    def fake_generate(model, prompt, max_tokens, sampler, prefill_batch, stop_ids, stats, *rest):
        for t in tokens:
            model.cache.length += 1
            yield t
        stats.stop_reason = stop_reason
    monkeypatch.setattr(engine_mod, "generate", fake_generate)
    monkeypatch.setattr(engine_mod, "Telemetry", lambda pager, tuner=None: SimpleNamespace(close=lambda: None))
    model = SimpleNamespace(cache=SimpleNamespace(length=0, max_context=64))
    e = Engine(model, tok, {9}, 16, pager=None)
    res = e.complete(Request([5], len(tokens), stop=(": ",)))
    assert (res.text, res.finish_reason) == ("Answer", "stop")
    res = e.complete(Request([5], len(tokens)))                       # no stop string: the reason is kept
    assert res.finish_reason == ("stop" if stop_reason == "eos" else "length")


def test_a_tiny_temperature_is_greedy(server):
    """Temperatures inside the accepted range but so small that logits / T overflow (1e-308 gave 500
    "Probabilities contain NaN") sample the most likely token."""
    import numpy as np
    logits = np.random.default_rng(0).normal(size=512)
    for t in (1e-308, 5e-324, 1e-300, 1e-12):
        assert Sampler(t, 1.0, 1)(logits) == Sampler(t, 0.5, 1)(logits) == int(np.argmax(logits))
    body = {"model": server.model, "prompt": "import os", "max_tokens": 6}
    want = server.raw("POST", "/v1/completions", {**body, "temperature": 0})[1]["choices"][0]["text"]
    for t in (1e-308, 5e-324):
        status, r = server.raw("POST", "/v1/completions", {**body, "temperature": t})
        assert status == 200 and r["choices"][0]["text"] == want, r


def test_a_waiting_request_whose_client_leaves_is_dropped_quietly(server):
    """A non-stream request whose client leaves while it waits: skipped, counted as cancelled, and no
    error in the log (answer() read the finish reason of no result)."""
    before = server.wait_for(lambda m: m["kimi_queue_running"] == 0 and m["kimi_queue_waiting"] == 0)
    seen = len(server.log)
    c = server.client()
    a = threading.Thread(target=lambda: c.completions.create(model=server.model, prompt=_long_prompt("left"),
                                                             temperature=0, max_tokens=480))
    a.start()
    server.wait_for(lambda m: m["kimi_queue_running"] == 1)
    host, port = server.url[len("http://"):].rsplit(":", 1)
    body = json.dumps({"model": server.model, "prompt": "import sys", "max_tokens": 5}).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (KEY.encode(), len(body), body))
        server.wait_for(lambda m: m["kimi_queue_waiting"] == 1)
    a.join(120)
    after = server.wait_for(lambda m: m["kimi_queue_running"] == 0 and m["kimi_queue_waiting"] == 0
                            and m["kimi_requests_cancelled_total"] > before["kimi_requests_cancelled_total"])
    assert after["kimi_generated_tokens_total"] - before["kimi_generated_tokens_total"] == 480   # A's only
    time.sleep(0.2)
    assert not [line for line in server.log[seen:] if "error" in line or "Traceback" in line], server.log[seen:]


def test_errors_have_openai_shape(server):
    def shape(body):
        assert set(body) == {"error"} and isinstance(body["error"]["message"], str)
        assert {"message", "type", "code"} <= set(body["error"])
        return body["error"]["code"]

    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        (("POST", "/v1/chat/completions", b"{not json"), 400, "invalid_json"),
        (("POST", "/v1/chat/completions", b"[1, 2]"), 400, "invalid_json"),
        (("POST", "/v1/chat/completions", b"[" * 100000 + b"]" * 100000), 400, "invalid_json"),
        (("POST", "/v1/chat/completions", {"model": "no-such-model", "messages": msgs}), 404, "model_not_found"),
        (("POST", "/v1/chat/completions", {"model": server.model, "messages": msgs, "max_tokens": CONTEXT}), 400,
         "context_length_exceeded"),
        (("POST", "/v1/completions", {"model": server.model, "prompt": "x " * (2 * CONTEXT)}), 400,
         "context_length_exceeded"),
        (("POST", "/v1/chat/completions", {"model": server.model, "messages": msgs, "n": 2}), 400,
         "unsupported_parameter"),
        (("POST", "/v1/chat/completions", {"model": server.model, "messages": "hi"}), 400, "invalid_type"),
        (("POST", "/v1/chat/completions", {"model": server.model, "messages": [{"role": "user"}]}), 400,
         "invalid_type"),
        (("POST", "/v1/chat/completions", {"model": server.model, "messages": [{"role": "wizard", "content": "hi"}]}),
         400, "invalid_value"),
        (("POST", "/v1/chat/completions", {"model": server.model, "messages": msgs, "temperature": "hot"}), 400,
         "invalid_type"),
        (("POST", "/v1/chat/completions", b'{"model": "x", "pad": "' + b"a" * (300 << 10) + b'"}'), 413,
         "request_too_large"),
        (("GET", "/v1/nothing-here", None), 404, "not_found"),
        # lone surrogates: valid JSON escapes, not text (they were a 500 with a traceback)
        (("POST", "/v1/completions", b'{"model": "%s", "prompt": "hi \\ud800", "max_tokens": 2}' % server.model.encode()),
         400, "invalid_value"),
        (("POST", "/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "\\udc00"}]}'
          % server.model.encode()), 400, "invalid_value"),
        (("POST", "/v1/completions", b'{"model": "x\\ud800", "prompt": "hi"}'), 400, "invalid_value"),
        (("POST", "/v1/completions", b'{"model": "x", "\\ud800": 1}'), 400, "invalid_value"),
        # a stop string longer than the server takes
        (("POST", "/v1/completions", {"model": server.model, "prompt": "hi", "stop": ["x" * 1025]}), 400,
         "invalid_value"),
        (("GET", "/v1/chat/completions", None), 405, "method_not_allowed"),
    ]
    for (method, path, body), status, code in cases:
        got_status, got = server.raw(method, path, body)
        assert (got_status, shape(got)) == (status, code), (path, body if not isinstance(body, bytes) else body[:40], got)
    status, body = server.raw("POST", "/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", '
                              b'"content": "\\ud800"}]}' % server.model.encode())
    assert body["error"]["param"] == "messages" and "messages[0].content" in body["error"]["message"]
    assert "\\ud800" in body["error"]["message"]                  # named by its escape
    assert "1024" in server.raw("POST", "/v1/completions", {"model": server.model, "prompt": "hi",
                                                           "stop": "y" * 5000})[1]["error"]["message"]
    # a surrogate pair is one character: taken
    assert server.raw("POST", "/v1/completions", b'{"model": "%s", "prompt": "hi \\ud83d\\ude00", "max_tokens": 1}'
                      % server.model.encode())[0] == 200
    # the field a too-long prompt is blamed on is the one that holds it
    for path, body, param in [("/v1/completions", {"model": server.model, "prompt": "x " * (2 * CONTEXT)}, "prompt"),
                              ("/v1/chat/completions", {"model": server.model, "messages": [
                                  {"role": "user", "content": "x " * (2 * CONTEXT)}]}, "messages")]:
        assert server.raw("POST", path, body)[1]["error"]["param"] == param
    for path in ("/v1/models", "/metrics"):
        status, body = server.raw("GET", path, key="wrong")
        assert (status, shape(body)) == (401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="nope", messages=msgs)
    assert server.raw("GET", "/health", key="")[0] == 200          # health needs no key
    assert [m.id for m in server.client().models.list()] == [server.model]
    assert server.proc.poll() is None                               # still serving
    assert not any("Traceback" in line for line in server.log), "".join(server.log)


def test_listening_elsewhere_without_key_warns(env):
    s = Server(env, "--host", "0.0.0.0", "--max-queue", "0")
    try:
        assert any("warning: serving on 0.0.0.0 without --api-key" in line for line in s.log), s.log
        assert s.raw("GET", "/health")[0] == 200
        assert s.client(key="anything").models.list().data[0].id == s.model
    finally:
        s.stop()
    assert "Traceback" not in "".join(s.log)


@pytest.mark.parametrize("how", ["environment", "flag"])
def test_an_empty_api_key_is_no_key(env, how):
    """KIMI_STREAM_API_KEY="" (exported but empty) or --api-key "": no key, so the warning for a
    public host shows and clients need none (an empty key had required an empty bearer token)."""
    e = dict(env, KIMI_STREAM_API_KEY="") if how == "environment" else {k: v for k, v in env.items()
                                                                         if k != "KIMI_STREAM_API_KEY"}
    s = Server(e, "--host", "0.0.0.0", *(["--api-key", ""] if how == "flag" else []))
    try:
        assert any("warning: serving on 0.0.0.0 without --api-key" in line for line in s.log), s.log
        assert s.raw("GET", "/v1/models", key="unused")[0] == 200            # the README's client example
        req = urllib.request.Request(s.url + "/v1/models")                    # no Authorization header at all
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
    finally:
        s.stop()


def test_one_request_after_another_never_finds_the_queue_full(env):
    """--max-queue 0 and a client that sends its next request once it has the answer: never 503 (the
    worker used to hand out the answer before it freed the slot: 71 of 300 were refused)."""
    s = Server(env, "--max-queue", "0")
    try:
        statuses = [s.raw("POST", "/v1/completions", {"model": s.model, "prompt": "x", "max_tokens": 1})[0]
                    for _ in range(100)]
        assert statuses == [200] * 100, statuses
        c = s.client()
        for _ in range(30):                                   # streams: the next one as soon as [DONE] is read
            assert len(list(c.completions.create(model=s.model, prompt="x", max_tokens=1, stream=True))) >= 1
        assert s.metrics()["kimi_requests_rejected_total"] == 0
    finally:
        s.stop()


def test_ctrl_c_answers_the_requests_in_flight(env):
    """Ctrl-C while a stream generates and two requests wait: the stream ends with an error event and
    [DONE], the others get a 503 in OpenAI's shape, and the log holds no traceback (there were
    CancelledError tracebacks, and "Event loop is closed" in the generating thread)."""
    s = Server(env, "--max-queue", "4")
    host, port = s.url[len("http://"):].rsplit(":", 1)
    got = {}

    def ask(name, body):
        c = http.client.HTTPConnection(host, int(port), timeout=120)
        c.request("POST", "/v1/completions", json.dumps({"model": s.model, **body}),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        got[name] = (r.status, r.read().decode())

    threads = [threading.Thread(target=ask, args=("stream", {"prompt": "import os", "max_tokens": 900,
                                                               "temperature": 0, "stream": True}))]
    try:
        threads[0].start()
        s.wait_for(lambda m: m["kimi_queue_running"] == 1)
        for name, body in [("plain", {"prompt": "import sys", "max_tokens": 5}),
                           ("waiting stream", {"prompt": "import re", "max_tokens": 5, "stream": True})]:
            threads.append(threading.Thread(target=ask, args=(name, body)))
            threads[-1].start()
            s.wait_for(lambda m, n=len(threads) - 1: m["kimi_queue_waiting"] == n)
        assert s.metrics()["kimi_queue_running"] == 1               # the stream still generates
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(timeout=60) == 130
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    for t in threads:
        t.join(60)
    for name in ("stream", "waiting stream"):
        status, text = got[name]
        events = [e[len("data: "):] for e in text.split("\n\n") if e.startswith("data: ")]
        assert status == 200 and events[-1] == "[DONE]", (name, text[-300:])
        assert json.loads(events[-2])["error"]["code"] == "server_shutting_down", (name, text[-300:])
    status, body = got["plain"]
    assert status == 503 and json.loads(body)["error"]["code"] == "server_shutting_down", body
    time.sleep(0.2)
    log = "".join(s.log)
    assert "Traceback" not in log and "ERROR" not in log and "error" not in log, log
    assert log.endswith("kimi-run: interrupted\n"), log[-500:]


def test_default_host_is_loopback(env):
    s = Server(env)
    try:
        assert s.url.startswith("http://127.0.0.1:")
    finally:
        s.stop()


# ------------------------------------------------------------------------------------ --chat on a terminal

class Terminal:
    """kimi-run --chat on a pseudo-terminal, as a user at a keyboard sees it."""

    def __init__(self, env, *flags):
        import pty
        pid, fd = pty.fork()
        if pid == 0:
            try:
                os.execve(shutil.which("kimi-run"), ["kimi-run", "--chat", "--max-context", str(CONTEXT), *flags], env)
            finally:
                os._exit(127)
        self.pid, self.fd, self.seen, self.pos = pid, fd, "", 0

    def read_until(self, marker: str, timeout=120) -> str:
        """The output from the end of the last marker found to the end of this one."""
        import select
        start, deadline = self.pos, time.monotonic() + timeout
        while marker not in self.seen[start:]:
            if time.monotonic() > deadline:
                raise AssertionError(f"no {marker!r} in {self.seen[start:]!r}")
            if select.select([self.fd], [], [], 0.5)[0]:
                try:
                    data = os.read(self.fd, 4096)
                except OSError:
                    raise AssertionError(f"the chat ended: {self.seen!r}") from None
                self.seen += data.decode(errors="replace")
        self.pos = self.seen.index(marker, start) + len(marker)
        return self.seen[start:self.pos]

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def exit_status(self, timeout=60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            try:
                self.seen += os.read(self.fd, 4096).decode(errors="replace")
            except OSError:
                time.sleep(0.05)
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError("the chat did not end")


def _stats(text: str) -> tuple[int, int, int]:
    m = re.search(r"turns (\d+); prompt tokens (\d+) \((\d+) from the kept cache", text)
    assert m, text
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def test_interactive_chat(env):
    t = Terminal(env, "--max-tokens", "16")
    t.read_until("Ctrl-D or /exit quits")
    t.read_until("> ")
    t.type("def main():\n")
    t.read_until("> ")
    t.type("/stats\n")
    assert _stats(t.read_until("> "))[:1] == (1,)
    t.type("import sys\n")                                   # the second turn reuses the first one's cache
    t.read_until("> ")
    t.type("/stats\n")
    turns, _, cached = _stats(t.read_until("> "))
    assert turns == 2 and cached > 10
    t.type("/reset\n")
    assert "(conversation forgotten)" in t.read_until("> ")
    t.type("/stats\n")
    t.read_until("> ")
    t.type("\x04")                                           # Ctrl-D
    assert t.exit_status() == 0


def test_interactive_chat_takes_a_message_of_several_lines_and_one_starting_with_a_slash(env):
    t = Terminal(env, "--max-tokens", "4")
    t.read_until("> ")
    t.type("def main(): \\\n")                             # a trailing backslash: the message goes on
    t.read_until(". ")
    t.type("    return 1\n")
    t.read_until("> ")
    t.type("/stats\n")
    assert _stats(t.read_until("> "))[0] == 1                 # one turn, not two
    t.type("//tmp\n")                                         # text, not an unknown command
    assert "unknown command" not in t.read_until("> ")
    t.type("/stats\n")
    assert _stats(t.read_until("> "))[0] == 2
    t.type("\x04")
    assert t.exit_status() == 0


def test_interactive_chat_ctrl_c_stops_the_answer_only(env):
    t = Terminal(env)                                        # answers run to the end of the context
    t.read_until("> ")
    t.type("import os\n")
    t.read_until("\n", timeout=60)                           # the echoed line
    time.sleep(0.5)                                          # the answer is streaming
    t.type("\x03")                                           # Ctrl-C
    assert "[stopped]" in t.read_until("> ")
    t.type("/stats\n")
    turns, _, _ = _stats(t.read_until("> "))
    assert turns == 1
    t.type("/exit\n")
    assert t.exit_status() == 0
    assert "Traceback" not in t.seen


def test_chat_without_terminal_is_one_line_error(env):
    proc = subprocess.run([shutil.which("kimi-run"), "--chat"], env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("kimi-run: error: --chat without --prompt needs a terminal")


def test_readme_client_example(server):
    """The README's client example, pointed at this server, gets an answer."""
    import pathlib
    readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    code = code.replace("http://127.0.0.1:8080", server.url).replace('"MODEL"', repr(server.model))
    code = code.replace('api_key="unused"', f"api_key={KEY!r}")
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["reply"].choices[0].message.content


def test_no_prompt_cache_computes_every_prompt(env):
    s = Server(env, "--no-prompt-cache")
    try:
        c = s.client()
        for _ in range(2):
            r = c.completions.create(model=s.model, prompt="import os", temperature=0, max_tokens=4)
            assert r.usage.prompt_tokens_details.cached_tokens == 0
        m = s.metrics()
        assert m["kimi_prompt_tokens_computed_total"] == 2 * r.usage.prompt_tokens
    finally:
        s.stop()


def test_bad_server_flags_are_one_line_errors(env):
    import socket
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        for flags, message in [(["--port", "70000"], "--port must be 0..65535"),
                               (["--max-queue", "-1"], "--max-queue must be >= 0"),
                               (["--max-body", "lots"], "--max-body"),
                               (["--max-body", "0"], "--max-body must be at least 1024 bytes"),
                               (["--prompt", "hi"], "--serve takes no --prompt"),
                               (["--port", str(port)], f"cannot listen on 127.0.0.1:{port}")]:
            proc = subprocess.run([shutil.which("kimi-run"), "--serve", "--max-context", "64", *flags], env=env,
                                  capture_output=True, text=True, timeout=120)
            last = proc.stderr.strip().splitlines()[-1]
            assert proc.returncode == 1 and last.startswith("kimi-run: error: ") and message in last, proc.stderr
            assert "Traceback" not in proc.stderr
            assert "memory plan" not in proc.stderr          # said before the model loads
    finally:
        taken.close()


def test_server_keeps_the_memory_budget(env):
    """Under a budget that holds a quarter of the experts (planned with the server's libraries
    loaded), a conversation stays within it: VmHWM as /metrics reports it."""
    proc = subprocess.run([shutil.which("kimi-run"), "--serve", "--dry-run", "--json", "--quiet", "--max-context",
                           str(CONTEXT)], env=env, capture_output=True, text=True, timeout=120)
    p = json.loads(proc.stdout)["memory_plan"]
    budget = sum(p[k] for k in ("baseline", "resident", "metadata", "kv_cache", "activations")) \
        + p["total_experts"] // 4 * p["expert_bytes"]
    s = Server(env, "--memory-budget", str(budget))
    try:
        c = s.client()
        msgs = [{"role": "user", "content": _long_prompt("budget")}]
        r = c.chat.completions.create(model=s.model, messages=msgs, temperature=0, max_tokens=64)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "x = 1"}]
        c.chat.completions.create(model=s.model, messages=msgs, temperature=0, max_tokens=64, stream=True).close()
        m = s.wait_for(lambda m: m["kimi_queue_running"] == 0)
        assert m["kimi_memory_budget_bytes"] == budget
        assert m["kimi_expert_cache_evictions_total"] > 0          # the experts did not fit
        assert m["kimi_peak_rss_bytes"] <= budget
    finally:
        s.stop()


def test_ctrl_c_as_the_server_starts_stops_it(env):
    """An interrupt the moment the server says where it listens (before its HTTP loop has taken the
    signal over) stops it with the one-line message and exit 130; it used to be lost at times, in a
    garbage collector's callback, and the server kept running."""
    for _ in range(4):
        s = Server(env)
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(timeout=60) == 130
        time.sleep(0.2)                       # the log thread reads what is left
        assert "kimi-run: interrupted\n" in s.log, s.log[-3:]


def test_a_chat_message_may_end_in_a_backslash():
    """A line ending in one backslash goes on on the next; one ending in two ends the message with
    one backslash (a Windows folder, a C macro's last line)."""
    from kimistream.runtime.chat import read_message

    def lines(*ls):
        it = iter(ls)
        return lambda prompt: next(it)
    assert read_message(lines("cd C:\\dir\\\\")) == "cd C:\\dir\\"
    assert read_message(lines("def f(): \\", "    return 1")) == "def f(): \n    return 1"
    assert read_message(lines("#define A 1 \\", "  + 2\\\\")) == "#define A 1 \n  + 2\\"
    assert read_message(lines("plain")) == "plain"
