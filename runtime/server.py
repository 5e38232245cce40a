"""`kimi-run --serve`: the OpenAI HTTP API over one model (starlette + uvicorn, server-sent events for
streams). One generation runs at a time on a worker thread; later requests wait in arrival order, at
most --max-queue of them. Prefix caching is the engine's (runtime/engine.py): a conversation's next
turn only computes its new tokens. Errors have OpenAI's shape and status codes."""

from __future__ import annotations

import asyncio
import hmac
import json
import queue
import signal
import threading
import time
import uuid
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from .engine import Engine, Request, Result
from .model import ContextFull
from .tokenizer import TokenizerError

LOOPBACK = ("127.0.0.1", "localhost", "::1")
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 1024          # the longest stop string: each token's search for them costs about this much
ROLES = ("system", "developer", "user", "assistant", "tool")    # the chat roles OpenAI's API takes
MIN_BODY = 1024                # --max-body below this would refuse every request
MAX_JSON_DEPTH = 64
DRAIN_LIMIT = 16        # an oversized body is read (and dropped) up to this many times --max-body


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, type_: str = "invalid_request_error",
                 param: str | None = None):
        message, param = _printable(message), None if param is None else _printable(param)
        super().__init__(message)
        self.status, self.message, self.code, self.type, self.param = status, message, code, type_, param

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


def _printable(text: str) -> str:
    """`text` as UTF-8 can carry it: a lone surrogate (valid in JSON, "\\ud800") becomes its escape."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _shown(text: str, limit: int = 80) -> str:
    """A client's string quoted in a message: cut to `limit` characters, lone surrogates escaped."""
    return _printable(text if len(text) <= limit else text[:limit] + "...")


def _shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; the request was not completed", "server_shutting_down",
                    "server_error")


# ------------------------------------------------------------------------------------ the queue

class _Job:
    """A request handed to the worker thread; its events come back on the event loop's queue."""

    def __init__(self, req: Request, loop: asyncio.AbstractEventLoop):
        self.req, self.loop = req, loop
        self.finished = 0                   # the worker's count of generations when this one ended (1, 2, ...)
        self.events: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()
        req.cancelled = self._cancelled.is_set

    def cancel(self) -> None:
        self._cancelled.set()

    def emit(self, kind: str, value=None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:       # the event loop is closed: the server has stopped and no one listens
            pass


class Scheduler:
    """One generation at a time on one worker thread; the others wait in arrival order."""

    def __init__(self, engine: Engine, max_queue: int, log):
        self.engine, self.max_queue, self.log = engine, max_queue, log
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self.waiting = 0
        self.running = 0
        self.rejected = 0
        self.generations = 0                # generations the worker has finished
        self._current: _Job | None = None
        self._live: list[_Job] = []         # submitted and not yet answered: the one running, those waiting
        self._stopping = False
        self._thread = threading.Thread(target=self._work, name="kimi-generate", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """On the event loop, as the HTTP server begins to stop: every request that runs or waits is
        cancelled and answered at once with a 503 error (a stream: an error event and [DONE]), so that
        no handler is still waiting when the server's grace period ends."""
        with self._lock:
            self._stopping = True
            jobs = list(self._live)
        for job in jobs:
            job.cancel()
            job.events.put_nowait(("error", _shutting_down()))

    def stop(self) -> None:
        """Cancel what runs and waits (each stops at its next step) and wait for the worker to end,
        so the weights can be closed under no one."""
        with self._lock:
            self._stopping = True
            for job in self._live:
                job.cancel()
        self._jobs.put(None)
        self._thread.join()

    def submit(self, job: _Job) -> bool:
        with self._lock:
            if self._stopping:
                raise _shutting_down()
            if self.waiting + self.running > self.max_queue:     # one runs, max_queue wait
                self.rejected += 1
                return False
            self.waiting += 1
            self._live.append(job)
        self._jobs.put(job)
        return True

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                self.waiting -= 1
                self.running = 1
                self._current = job
                if self._stopping:
                    job.cancel()
            final = self._run(job)
            # the slot is free before the client hears the end: a client that sends its next request
            # as soon as it has this answer must not find the queue full
            with self._lock:
                self.running = 0
                self._current = None
                self._live.remove(job)
            job.emit(*final)

    def _run(self, job: _Job) -> tuple[str, object]:
        """Run one job, its text going out as it comes; the final event: ("done", Result, or None
        when its client left while it waited) or ("error", ApiError)."""
        try:
            if job.req.cancelled():          # its client left while it waited, or the server stops
                self.engine.counters.cancelled += 1
                return ("error", _shutting_down()) if self._stopping else ("done", None)
            res = Result()
            for piece in self.engine.run(job.req, res):
                job.emit("text", piece)
            self.generations += 1
            job.finished = self.generations
            if res.finish_reason == "cancelled" and self._stopping:
                return "error", _shutting_down()
            return "done", res
        except ContextFull as e:
            return "error", ApiError(400, str(e), "context_length_exceeded")
        except Exception as e:               # an unreadable expert, a kernel error: the request fails, the server stays
            self.log(f"error: generation failed: {type(e).__name__}: {e}")
            return "error", ApiError(500, f"generation failed: {e}", "generation_failed", "server_error")


# ------------------------------------------------------------------------------------ requests

@dataclass
class ServerConfig:
    model_id: str
    api_key: str | None
    max_body: int
    max_queue: int
    memory_budget: int
    created: int


async def _json_body(request: HttpRequest, limit: int) -> dict:
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n <= limit:
            chunks.append(chunk)
        elif n > DRAIN_LIMIT * limit:
            break           # past this the connection is closed unread: the client may not see the answer
    if n > limit:
        # the rest of a moderately oversized body is read and dropped, so the client, still sending,
        # gets the 413 rather than a reset connection
        raise ApiError(413, f"request body exceeds the server's limit of {limit} bytes (--max-body)",
                       "request_too_large")
    raw = b"".join(chunks)
    if _nesting(raw) > MAX_JSON_DEPTH:
        raise ApiError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels", "invalid_json")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"request body is not valid JSON ({e})", "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", "invalid_json")
    for key, value in body.items():
        where = key if _unencodable(key) else _lone_surrogate(value, key)
        if where is not None:
            raise ApiError(400, f"'{_shown(where)}' holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
                                f"without its pair): not text", "invalid_value", param=_shown(key))
    return body


def _unencodable(text: str) -> bool:
    """Whether `text` holds a lone surrogate, which JSON's \\u escapes allow but UTF-8 cannot carry
    (the tokenizer and the response would fail on it)."""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _lone_surrogate(value, where: str) -> str | None:
    """Where in a parsed JSON value a string or a key holds a lone surrogate; None if nowhere."""
    if isinstance(value, str):
        return where if _unencodable(value) else None
    if isinstance(value, dict):
        for k, v in value.items():
            path = f"{where}.{k}"
            found = path if _unencodable(k) else _lone_surrogate(v, path)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if isinstance(v, (str, dict, list)):          # not a path for each of a prompt's token ids
                found = _lone_surrogate(v, f"{where}[{i}]")
                if found is not None:
                    return found
    return None


def _nesting(raw: bytes) -> int:
    """Deepest bracket nesting, strings skipped (json.loads would recurse that deep)."""
    depth = top = 0
    in_str = esc = False
    for b in raw:
        if in_str:
            if esc:
                esc = False
            elif b == 0x5C:
                esc = True
            elif b == 0x22:
                in_str = False
        elif b == 0x22:
            in_str = True
        elif b in (0x5B, 0x7B):
            depth += 1
            top = max(top, depth)
        elif b in (0x5D, 0x7D):
            depth -= 1
    return top


def _number(body: dict, key: str, default, lo: float, hi: float, integer: bool = False):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise ApiError(400, f"'{key}' must be {'an integer' if integer else 'a number'}", "invalid_type", param=key)
    if not lo <= v <= hi:
        raise ApiError(400, f"'{key}' must be between {lo} and {hi}, got {v}", "invalid_value", param=key)
    return v


def _unsupported(body: dict, checks: dict) -> None:
    for key, ok in checks.items():
        if key in body and body[key] is not None and not ok(body[key]):
            raise ApiError(400, f"'{key}' = {json.dumps(body[key])[:60]} is not supported by this server",
                           "unsupported_parameter", param=key)


def _sampling(body: dict, n_prompt: int, max_context: int, prompt_param: str) -> tuple[Request, bool, bool]:
    """The request's generation parameters; (request, stream, include_usage). `prompt_param`: the field
    a prompt too long for the context is blamed on ('messages' or 'prompt')."""
    _unsupported(body, {"n": lambda v: v == 1, "logprobs": lambda v: v is False or v == 0,
                        "tools": lambda v: v == [], "echo": lambda v: v is False, "best_of": lambda v: v == 1,
                        "suffix": lambda v: v == "", "frequency_penalty": lambda v: v == 0,
                        "presence_penalty": lambda v: v == 0, "logit_bias": lambda v: v == {},
                        "response_format": lambda v: isinstance(v, dict) and v.get("type") == "text"})
    room = max_context - n_prompt
    if room <= 0:
        raise ApiError(400, f"the prompt has {n_prompt} tokens; this server's context is {max_context} tokens",
                       "context_length_exceeded", param=prompt_param)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, key, room, 1, 1 << 31, integer=True)
    if n_prompt + max_tokens > max_context:
        raise ApiError(400, f"the prompt has {n_prompt} tokens and {key} is {max_tokens}: more than this server's "
                            f"context of {max_context} tokens (--max-context)", "context_length_exceeded", param=key)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise ApiError(400, f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings",
                       "invalid_type", param="stop")
    for s in stop:
        if len(s) > MAX_STOP_CHARS:
            raise ApiError(400, f"a stop string may be at most {MAX_STOP_CHARS} characters long; one has {len(s)}",
                           "invalid_value", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", "invalid_type", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "'stream_options' must be an object", "invalid_type", param="stream_options")
    req = Request([], max_tokens,
                  temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
                  top_p=float(_number(body, "top_p", 1.0, 1e-9, 1.0)),
                  seed=_number(body, "seed", None, 0, (1 << 63) - 1, integer=True),
                  stop=tuple(stop))
    return req, stream, bool(opts.get("include_usage"))


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list", "invalid_type", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role'", "invalid_type", param="messages")
        if m["role"] not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m['role'][:40]!r}",
                           "invalid_value", param="messages")
        if "content" not in m and m["role"] != "assistant":     # an assistant's turn may hold only tool calls
            raise ApiError(400, f"messages[{i}] has no 'content'", "invalid_type", param="messages")
        content = m.get("content")
        if isinstance(content, list):             # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"messages[{i}]: only text content parts are supported", "unsupported_content",
                                   param="messages")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", "invalid_type",
                           param="messages")
        out.append({"role": m["role"], "content": content})
    return out


def _prompt_ids(body: dict, tok) -> list[int]:
    """/v1/completions' prompt: a string or a list of token ids (or a list holding one of either)."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        ids = tok.encode(p)
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        if not all(0 <= t < tok.vocab_size for t in p):
            raise ApiError(400, f"'prompt' has token ids outside the vocabulary (0..{tok.vocab_size - 1})",
                           "invalid_value", param="prompt")
        ids = list(p)
    else:
        raise ApiError(400, "'prompt' must be a string, a list of token ids, or a list of one of either",
                       "invalid_type", param="prompt")
    if not ids:
        raise ApiError(400, "'prompt' is empty after tokenisation", "invalid_value", param="prompt")
    return ids


def _usage(res: Result) -> dict:
    return {"prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
            "total_tokens": res.prompt_tokens + res.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": res.cached_tokens}}


# ------------------------------------------------------------------------------------ the app

class _EventStream:
    """A server-sent event stream of a job's frames; a client that leaves cancels the job at its next token."""

    def __init__(self, job: _Job, frames):
        self.job, self.frames = job, frames

    async def __call__(self, scope, receive, send):
        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            self.job.cancel()
        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            async for frame in self.frames:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass                                   # the client went away
        except asyncio.CancelledError:
            # the server stops and its grace period is over (Scheduler.shutdown normally ended the
            # stream before): an error event and [DONE] if they can still go out at once (uvicorn's
            # send writes without waiting unless the client's window is full; the loop's own
            # cleanup cancels this task again if it is)
            err = _shutting_down()
            end = _sse({"error": {"message": err.message, "type": err.type, "param": None, "code": err.code}}) \
                + _sse(b"[DONE]")
            try:
                await send({"type": "http.response.body", "body": end, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except (OSError, asyncio.CancelledError):
                pass
        finally:
            self.job.cancel()
            watcher.cancel()
            await self.frames.aclose()


def _sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj, ensure_ascii=False).encode()) + b"\n\n"


def build_app(engine: Engine, cfg: ServerConfig, log) -> Starlette:
    tok = engine.tok
    sched = Scheduler(engine, cfg.max_queue, log)

    def authorise(request: HttpRequest) -> None:
        if not cfg.api_key:                        # no key (an empty one is none: see cli's --api-key)
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), cfg.api_key.encode()):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')", "invalid_api_key")

    def check_model(body: dict) -> None:
        name = body.get("model")
        if not isinstance(name, str):
            raise ApiError(400, "'model' must be a string", "invalid_type", param="model")
        if name != cfg.model_id:
            raise ApiError(404, f"the model '{_shown(name)}' does not exist; this server has '{cfg.model_id}'",
                           "model_not_found", param="model")

    async def answer(request: HttpRequest, req: Request, stream: bool, include_usage: bool, chat: bool):
        loop = asyncio.get_running_loop()
        job = _Job(req, loop)
        if not sched.submit(job):
            raise ApiError(503, f"the server is busy: {sched.waiting} requests already wait (--max-queue "
                                f"{cfg.max_queue}); try again later", "queue_full", "server_error")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        if stream:
            return _EventStream(job, _frames(job, rid, created, kind, include_usage, chat, cfg.model_id))
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        try:
            pieces = []
            while True:
                what, value = await job.events.get()
                if what == "text":
                    pieces.append(value)
                elif what == "error":
                    raise value
                else:
                    res = value
                    break
        except asyncio.CancelledError:
            # the server stops and its grace period is over (Scheduler.shutdown normally answered first)
            return _shutting_down().response()
        finally:
            watcher.cancel()
            job.cancel()
        if res is None or res.finish_reason == "cancelled":
            # its client left, while the request waited or ran: no one reads an answer
            return Response(status_code=499)
        text = "".join(pieces)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                   "finish_reason": res.finish_reason} if chat else
                  {"index": 0, "text": text, "logprobs": None, "finish_reason": res.finish_reason})
        # x-kimi-generation: the order in which the worker finished this generation among all of them,
        # as the server saw it (a client's own clock cannot tell: two answers may arrive in either order)
        return JSONResponse({"id": rid, "object": kind, "created": created, "model": cfg.model_id,
                             "choices": [choice], "usage": _usage(res), "system_fingerprint": None},
                            headers={"x-kimi-generation": str(job.finished)})

    async def chat_completions(request: HttpRequest):
        authorise(request)
        body = await _json_body(request, cfg.max_body)
        check_model(body)
        messages = _messages(body)
        try:
            ids = tok.encode(tok.render_chat(messages), add_special_tokens=False)
        except TokenizerError as e:
            raise ApiError(400, str(e), "template_error", param="messages") from None
        req, stream, usage = _sampling(body, len(ids), engine.max_context, "messages")
        req.prompt_ids = ids
        return await answer(request, req, stream, usage, chat=True)

    async def completions(request: HttpRequest):
        authorise(request)
        body = await _json_body(request, cfg.max_body)
        check_model(body)
        ids = _prompt_ids(body, tok)
        req, stream, usage = _sampling(body, len(ids), engine.max_context, "prompt")
        req.prompt_ids = ids
        return await answer(request, req, stream, usage, chat=False)

    async def models(request: HttpRequest):
        authorise(request)
        return JSONResponse({"object": "list", "data": [_model_card(cfg)]})

    async def model(request: HttpRequest):
        authorise(request)
        if request.path_params["name"] != cfg.model_id:
            raise ApiError(404, f"the model '{_shown(request.path_params['name'])}' does not exist", "model_not_found")
        return JSONResponse(_model_card(cfg))

    async def health(request: HttpRequest):
        return JSONResponse({"status": "ok", "model": cfg.model_id})

    async def metrics(request: HttpRequest):
        authorise(request)
        m = engine.metrics()
        m.update({"queue_waiting": sched.waiting, "queue_running": sched.running, "requests_rejected": sched.rejected,
                  "memory_budget_bytes": cfg.memory_budget, "context_tokens": engine.max_context})
        return PlainTextResponse(_prometheus(m), media_type="text/plain; version=0.0.4")

    async def on_error(request, exc):
        if isinstance(exc, ApiError):
            return exc.response()
        status = getattr(exc, "status_code", 400)
        code = {404: "not_found", 405: "method_not_allowed"}.get(status, "invalid_request")
        return ApiError(status, f"{request.method} {request.url.path}: {getattr(exc, 'detail', '')}", code).response()

    def endpoint(fn):
        """An unexpected exception becomes a 500 in OpenAI's shape and one log line, not a traceback."""
        async def wrapped(request: HttpRequest):
            try:
                return await fn(request)
            except ApiError as e:
                return e.response()
            except Exception as e:
                log(f"error: {request.url.path}: {type(e).__name__}: {e}")
                return ApiError(500, f"internal error: {type(e).__name__}: {e}", "internal_error",
                                "server_error").response()
        return wrapped

    routes = [Route("/v1/chat/completions", endpoint(chat_completions), methods=["POST"]),
              Route("/v1/completions", endpoint(completions), methods=["POST"]),
              Route("/v1/models", endpoint(models), methods=["GET"]),
              Route("/v1/models/{name:path}", endpoint(model), methods=["GET"]),
              Route("/health", endpoint(health), methods=["GET"]),
              Route("/metrics", endpoint(metrics), methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={ApiError: on_error, 404: on_error, 405: on_error})
    app.state.scheduler = sched
    return app


class _Quiet:
    """The app, with a cancellation (the server stopping after its grace period, or Python's own
    cleanup of the tasks left) ending a request quietly rather than as a traceback in the log."""

    def __init__(self, app: Starlette):
        self.app = app

    async def __call__(self, scope, receive, send):
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            pass


async def _watch_disconnect(request: HttpRequest, job: _Job) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel()


async def _frames(job: _Job, rid: str, created: int, kind: str, include_usage: bool, chat: bool, model_id: str):
    """The stream's events: a role delta first (chat), then text deltas, the finish reason, usage when
    asked for, and [DONE]. An error after the stream started ends it with an error event."""
    head = {"id": rid, "object": kind + ".chunk" if chat else kind, "created": created, "model": model_id}

    def chunk(delta_or_text, finish=None):
        choice = ({"index": 0, "delta": delta_or_text, "logprobs": None, "finish_reason": finish} if chat else
                  {"index": 0, "text": delta_or_text, "logprobs": None, "finish_reason": finish})
        return _sse({**head, "choices": [choice]})

    if chat:
        yield chunk({"role": "assistant", "content": ""})
    while True:
        what, value = await job.events.get()
        if what == "text":
            yield chunk({"content": value} if chat else value)
        elif what == "error":
            yield _sse({"error": {"message": value.message, "type": value.type, "param": None, "code": value.code}})
            break
        else:
            res = value
            if res is None or res.finish_reason == "cancelled":
                return
            yield chunk({} if chat else "", res.finish_reason)
            if include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(res)})
            break
    yield _sse(b"[DONE]")


def _model_card(cfg: ServerConfig) -> dict:
    return {"id": cfg.model_id, "object": "model", "created": cfg.created, "owned_by": "kimi-stream"}


_METRIC_HELP = {
    "requests": ("counter", "requests run or cancelled"),
    "requests_cancelled": ("counter", "requests whose client left before the end"),
    "requests_rejected": ("counter", "requests refused because the queue was full"),
    "prompt_tokens": ("counter", "prompt tokens received"),
    "prompt_tokens_cached": ("counter", "prompt tokens found in the kept KV cache (not computed)"),
    "prompt_tokens_computed": ("counter", "prompt tokens run through the model"),
    "generated_tokens": ("counter", "tokens generated"),
    "prefill_seconds": ("counter", "time spent on prompts"),
    "decode_seconds": ("counter", "time spent on decode steps"),
    "io_wait_seconds": ("counter", "time spent waiting on expert reads"),
    "expert_cache_hits": ("counter", "routed expert uses served from the expert cache"),
    "expert_cache_misses": ("counter", "routed expert uses read from the weight file"),
    "expert_cache_evictions": ("counter", "experts evicted from the expert cache"),
    "expert_bytes_read": ("counter", "bytes of experts read from the weight file"),
}


def _prometheus(m: dict) -> str:
    """The metrics in Prometheus' text format, each named kimi_<key> (counters with _total)."""
    lines = []
    for key, value in m.items():
        kind, help_ = _METRIC_HELP.get(key, ("gauge", key.replace("_", " ")))
        name = f"kimi_{key}_total" if kind == "counter" else f"kimi_{key}"
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return "\n".join(lines) + "\n"


def _config(app):
    import uvicorn
    return uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=2)


def warm_up() -> None:
    """Import what serving loads lazily (uvicorn's protocol classes), so the memory plan, which
    measures the process before the first weight, counts it."""
    _config(Starlette()).load()


def listen(host: str, port: int):
    """The server's socket, bound and listening: taken before the model loads, so that a port in use
    is said at once, not after the weights of a large model have been read."""
    import socket
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(128)
    return sock


def serve(engine: Engine, cfg: ServerConfig, sock, host: str, log) -> int:
    """Say where, and serve on `sock` (listen's) until interrupted."""
    import uvicorn
    if host not in LOOPBACK and not cfg.api_key:
        log(f"warning: serving on {host} without --api-key: anyone who can reach this port can use the model")
    app = build_app(engine, cfg, log)
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            # the requests in flight are answered (503, or an error event and [DONE]) before uvicorn
            # waits for its connections to end: none is left to be cut off when its grace period ends
            app.state.scheduler.shutdown()
            await super().shutdown(sockets=sockets)
    server = Server(_config(_Quiet(app)))
    # Ctrl-C from here on stops the server through uvicorn's own exit flag. Left to Python's default
    # handler, an interrupt arriving before uvicorn takes the signal over can be raised inside a
    # garbage collector's callback, where Python drops it, and the server would keep running.
    interrupted = []

    def stop(signum, frame):
        interrupted.append(signum)
        server.should_exit = True
    previous = signal.signal(signal.SIGINT, stop) if threading.current_thread() is threading.main_thread() else None
    log(f"serving {cfg.model_id} at http://{shown}:{bound}/v1 (OpenAI API; /health, /metrics); Ctrl-C stops")
    try:
        server.run(sockets=[sock])      # uvicorn hands an interrupt it caught back to `stop` as it exits
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        app.state.scheduler.stop()
    if interrupted:
        raise KeyboardInterrupt
    log("server stopped")
    return 0
