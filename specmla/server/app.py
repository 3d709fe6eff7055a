"""OpenAI-compatible HTTP API (`specmla serve`): /v1/completions, /v1/chat/completions (SSE
streaming, stream_options.include_usage), /v1/models, /health, /metrics (Prometheus).

Errors are OpenAI-shaped JSON ({"error": {"message", "type", "param", "code"}}) with the right
status; the server keeps serving after each. The model loads in the background: /health answers
503 until it is ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import hmac
import ipaddress
import json
import logging
import threading
import time
import uuid
from typing import Any

import jinja2
import jinja2.sandbox
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from specmla.sampling_params import SamplingParams
from specmla.server.async_engine import AsyncEngine
from specmla.server.protocol import (APIError, BodyLimits, ChatMessage, ChatRequest, CompletionRequest, _Common,
                                     error_response, parse_body, prompt_bound)

log = logging.getLogger("specmla.server")

DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


DEFAULT_MAX_BODY_BYTES = 16 * 2**20
DEFAULT_BODY_TIMEOUT_S = 20.0  # a request body must have arrived this long after its headers
TRIM_AFTER_BYTES = 1 << 20  # a request with a body this large gives the heap's free pages back when it ends
SMALL_BODY_BYTES, BIG_PARSES = 1 << 16, 2  # bodies of 64 KiB and more are parsed two at a time


def _raise_template_error(message: str):
    raise jinja2.TemplateError(message)


CHECK_CONVERSATION = [{"role": "system", "content": "You are a helpful assistant."},
                      {"role": "user", "content": "Hello!"}]


def compile_chat_template(source: str) -> jinja2.Template:
    """A model's chat template is code from its files: compiled in a sandbox, as transformers does."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_template_error
    return env.from_string(source)


def render_chat(template: jinja2.Template, messages: list[dict]) -> str:
    return template.render(messages=messages, add_generation_prompt=True, bos_token="", eos_token="")


def check_model_dir(llm) -> dict:
    """What could fail on every request because of the model directory, checked once at start: the context holds a
    prompt token and an answer, the tokenizer's ids fit the model and a text round-trips; the chat template compiles
    and renders a two-message conversation (else chat alone is unavailable, a 503 naming the cause, and completions
    still serve). Raises ValueError for what makes the model unusable; returns the app's state entries (the chat
    template or its error, the prompt bound, the body limits)."""
    ctx, tok = llm.engine.max_model_len, llm.tokenizer
    if ctx < 2:
        raise ValueError(f"the model's context is {ctx} tokens: a prompt and an answer need at least 2")
    out = {"chat_template": None, "chat_error": None, "chars_per_token": 1 << 30, "limits": None}
    if tok is None:  # token ids only: a byte bound as for one character a token
        return dict(out, limits=BodyLimits.for_context(ctx, 1))
    tok.check(llm.model.config.vocab_size)
    out["chars_per_token"] = tok.max_chars_per_token
    out["limits"] = BodyLimits.for_context(ctx, tok.max_chars_per_token)
    try:
        out["chat_template"] = template = compile_chat_template(tok.chat_template or DEFAULT_CHAT_TEMPLATE)
        if not render_chat(template, CHECK_CONVERSATION):
            raise jinja2.TemplateError("it renders a conversation as nothing")
    except jinja2.TemplateError as e:
        out["chat_template"], out["chat_error"] = None, f"the model's chat template does not work: {e.message or e}"
        log.warning("%s; /v1/chat/completions answers 503 (completions still serve)", out["chat_error"])
    return out


def body_schema(model) -> dict:
    """OpenAPI's requestBody for an endpoint that parses its own body (`parse_body`): the model's JSON schema with
    its $defs inlined."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.split("/")[-1]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


class BodyLimitMiddleware:
    """Reads a request body whole before anything parses it, and refuses, before it is kept:
    - a body over `max_bytes` with a 413, at once by its Content-Length (else once it passes), the connection
      closed unread;
    - a body under it but over `useful_bytes()`, the most any request the loaded model can run may hold, with a
      400 once the body has arrived (read and dropped as it comes, so the client reads the answer);
    - a body that has not arrived `timeout_s` after the request began (a stalled or trickling upload) with a 408,
      the connection closed.
    Plain ASGI, so the app still sees the client's disconnect."""

    def __init__(self, app, max_bytes: int, timeout_s: float = DEFAULT_BODY_TIMEOUT_S, useful_bytes=lambda: None):
        """useful_bytes(): see the class doc (None before the model loads)."""
        self.app, self.max_bytes, self.timeout_s, self.useful_bytes = app, max_bytes, timeout_s, useful_bytes

    @staticmethod
    async def _answer(scope, receive, send, status: int, message: str, code: str, close: bool = True):
        resp = error_response(status, message, code=code)
        if close:
            resp.headers["connection"] = "close"  # the rest of the body is not read
        await resp(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        too_large = (413, f"the request body is over {self.max_bytes} bytes", "request_too_large")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self._answer(scope, receive, send, *too_large)
        useful = self.useful_bytes()
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return await self._answer(scope, receive, send, 408, f"the request body did not arrive within "
                                          f"{self.timeout_s:g} s", "request_timeout")
            if message["type"] != "http.request":  # the client left before sending its body
                return
            part = message.get("body", b"")
            size += len(part)
            if size > self.max_bytes:
                return await self._answer(scope, receive, send, *too_large)
            if useful is None or size <= useful:
                chunks.append(part)
            elif chunks:
                chunks.clear()  # past any use: read on, keep nothing
            if not message.get("more_body", False):
                break
        if useful is not None and size > useful:
            return await self._answer(scope, receive, send, 400, f"the request body is over {useful} bytes, more than "
                                      "any request to this model can use (its prompt would exceed the context)",
                                      "context_length_exceeded", close=False)
        body, handed = b"".join(chunks), False
        del chunks  # one copy of a large body, not two, while the request runs

        async def replay():
            nonlocal handed, body
            if not handed:
                handed = True
                message, body = {"type": "http.request", "body": body, "more_body": False}, b""
                return message
            return await receive()

        try:
            return await self.app(scope, replay, send)
        finally:
            if size >= TRIM_AFTER_BYTES:
                await asyncio.to_thread(trim_heap)


class Logprobs:
    """The engine's logprob entries ({"token_id", "logprob", "top": {id: logprob}}) in OpenAI's shapes;
    keeps the text offset across the chunks of one stream."""

    FLOOR = -9999.0  # JSON has no -inf (a token masked out by top-k / top-p)

    def __init__(self, tokenizer):
        self.tokenizer, self.offset = tokenizer, 0

    def token(self, i: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{i}"
        return self.tokenizer.decode([i], skip_special_tokens=False)

    def _lp(self, x: float) -> float:
        return max(x, self.FLOOR) if x == x else self.FLOOR

    def completion(self, entries: list[dict]) -> dict:
        """`logprobs` of a completions choice: tokens, token_logprobs, top_logprobs, text_offset."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            tok = self.token(e["token_id"])
            out["tokens"].append(tok)
            out["token_logprobs"].append(self._lp(e["logprob"]))
            top = {tok: self._lp(e["logprob"])}  # as vLLM: the chosen token, then the most likely ones
            for i, lp in sorted(e.get("top", {}).items(), key=lambda kv: -kv[1]):
                top.setdefault(self.token(i), self._lp(lp))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(tok)
        return out

    def _chat_item(self, i: int, lp: float) -> dict:
        tok = self.token(i)
        raw = self.tokenizer.token_bytes(i) if self.tokenizer is not None else tok.encode()
        return {"token": tok, "logprob": self._lp(lp), "bytes": list(raw)}

    def chat(self, entries: list[dict]) -> dict:
        """`logprobs` of a chat choice: content[] of token, logprob, bytes, top_logprobs[]."""
        content = []
        for e in entries:
            item = self._chat_item(e["token_id"], e["logprob"])
            item["top_logprobs"] = [self._chat_item(i, lp)
                                    for i, lp in sorted(e.get("top", {}).items(), key=lambda kv: -kv[1])]
            content.append(item)
        return {"content": content}


class Metrics:
    """Prometheus metrics on a registry of the app's own (several apps can live in one process)."""

    def __init__(self, engine_getter):
        self.registry = r = CollectorRegistry()
        p = "specmla:"
        self.requests = Counter(p + "requests", "finished requests", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens processed", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "TTFT", registry=r,
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.tpot = Histogram(p + "time_per_output_token_seconds", "TPOT", registry=r,
                              buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1))
        self.spec_drafts = Counter(p + "spec_decode_num_drafts", "verify steps with drafts", registry=r)
        self.spec_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "draft tokens", registry=r)
        self.spec_accepted = Counter(p + "spec_decode_num_accepted_tokens", "accepted draft tokens", registry=r)
        self.spec_per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos", "accepted per draft position",
                                    ["position"], registry=r)
        get = engine_getter
        Gauge(p + "num_requests_running", "running", registry=r).set_function(
            lambda: len(get().running) if get() else 0)
        Gauge(p + "num_requests_waiting", "waiting", registry=r).set_function(
            lambda: len(get().waiting) if get() else 0)
        Gauge(p + "kv_pages_used", "KV cache pages in use", registry=r).set_function(
            lambda: get().pool.num_used_pages() if get() else 0)
        Gauge(p + "kv_pages_total", "KV cache pages", registry=r).set_function(
            lambda: get().pool.num_pages if get() else 0)
        Gauge(p + "num_preemptions", "requests preempted so far", registry=r).set_function(
            lambda: get().scheduler.num_preemptions if get() else 0)

    def finished(self, seq, reason: str) -> None:
        """Engine thread: count one finished (or aborted) request."""
        self.requests.labels(reason or "unknown").inc()
        self.prompt_tokens.inc(len(seq.prompt_ids))
        self.generation_tokens.inc(len(seq.output_ids))
        if seq.first_token_time is not None:
            self.ttft.observe(seq.first_token_time - seq.arrival)
            n = len(seq.output_ids)
            if n > 1:
                end = seq.finish_time or time.perf_counter()
                self.tpot.observe((end - seq.first_token_time) / (n - 1))
        st = seq.spec_stats
        self.spec_drafts.inc(st.num_drafts)
        self.spec_draft_tokens.inc(st.num_draft_tokens)
        self.spec_accepted.inc(st.num_accepted_tokens)
        for i, a in enumerate(st.accepted_per_position):
            self.spec_per_pos.labels(str(i)).inc(a)


OPEN_PATHS = ("/health", "/metrics")  # what answers without the API key; everything else needs it


class APIKeyMiddleware:
    """Every path but OPEN_PATHS (so /v1/*, /docs, /openapi.json, /redoc) needs `Authorization: Bearer
    <key>`, compared in constant time. Plain ASGI, so the app still sees the client's disconnect."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                resp = error_response(401, "invalid or missing API key", "authentication_error",
                                      code="invalid_api_key")
                return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_exposed(host: str | None, api_key: str | None) -> bool:
    """Log a warning when the server binds a non-loopback address without an API key; True if it did."""
    if host is None or api_key or is_loopback(host):
        return False
    log.warning("serving on %s without --api-key: anyone who can reach this address can use the model", host)
    return True


DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


def _log_load_error(e: Exception) -> None:
    log.error("the model failed to load: %s: %s", type(e).__name__, e)
    log.debug("the model failed to load", exc_info=e)


def create_app(load_llm, model_name: str, api_key: str | None = None, host: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, on_load_error=_log_load_error,
               body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> FastAPI:
    """`load_llm()` builds the LLM (called in a background thread, so /health can say 503 first); if it raises,
    `on_load_error(exception)` reports it (default: the log) and the server stops (`build_server`).
    `host`, when given, is the address the server binds: a public one without `api_key` logs a warning.
    A request body over `max_body_bytes` is a 413, one not arrived `body_timeout_s` after its headers a 408."""
    warn_if_exposed(host, api_key)
    # phase: "loading" the weights, then "warming up" (compiling kernels, capturing graphs; set by the loader)
    state: dict[str, Any] = {"llm": None, "engine": None, "error": None, "phase": "loading", "chat_error": None}
    metrics = Metrics(lambda: state["llm"].engine if state["llm"] else None)

    def load():
        try:
            llm = load_llm()
            state.update(check_model_dir(llm))
            engine = AsyncEngine(llm.engine, on_finish=metrics.finished)
            gc.collect()  # the start-up heap (modules, graphs, kernels) leaves the collector's view: a full
            gc.freeze()  # collection over it would stall every stream at once
            state["engine"], state["llm"] = engine, llm  # ready (/health 200) only once frozen
        except Exception as e:  # /health reports that it failed; the reason (which may name paths) is reported
            on_load_error(e)
            state["error"] = "the model failed to load; see the server log"

    @contextlib.asynccontextmanager
    async def lifespan(app):
        threading.Thread(target=load, daemon=True).start()
        yield
        if state["engine"]:
            state["engine"].shutdown()
        if state["llm"]:
            state["llm"].shutdown()  # tensor parallelism: the other ranks stop with this one

    app = FastAPI(title="specmla", lifespan=lifespan)
    app.state.specmla = state
    app.state.api_key = api_key
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", []) if x != "body")
        if first.get("type") == "json_invalid":
            return error_response(400, "malformed JSON body")
        return error_response(400, f"invalid request: {loc}: {first.get('msg', 'bad value')}", param=loc or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        kind = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
                413: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        message = {404: f"no route {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}",
                   413: "the request body is too large"}.get(exc.status_code, str(exc.detail))
        if exc.status_code == 400 and "parsing the body" in message:
            message = "malformed JSON body (it must be UTF-8 JSON)"
        resp = error_response(exc.status_code, message, kind)
        if exc.headers:
            resp.headers.update(exc.headers)
        return resp

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, "internal server error", "server_error")

    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes, timeout_s=body_timeout_s,
                       useful_bytes=lambda: state["limits"].max_bytes if state.get("limits") else None)
    if api_key:  # outermost: a request without the key is turned away before its body is read
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    def ready():
        if state["llm"] is None:
            raise APIError(503, state["error"] or f"the server is not ready yet ({state['phase']})", "server_error")
        return state["llm"], state["engine"]

    @app.get("/health")
    async def health():
        if state["llm"] is None:
            return JSONResponse(status_code=503, content={"status": "error" if state["error"] else state["phase"],
                                                          "error": state["error"]})
        return {"status": "ok"}

    @app.get("/metrics")
    async def prom():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        ready()
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "specmla"}]}

    def check_model(req: _Common) -> None:
        if req.model != model_name:
            raise APIError(404, f"model {req.model!r} does not exist; this server serves {model_name!r}",
                           code="model_not_found", param="model")
        req.check_supported()

    def engine_logprobs(req: _Common) -> int | None:
        """The engine's `logprobs` (None: none; k: the chosen token's plus the k most likely)."""
        if isinstance(req, CompletionRequest):
            return req.logprobs
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None

    def sampling(req: _Common, prompt_len: int, llm, max_tokens: int | None) -> SamplingParams:
        engine = llm.engine
        ctx = engine.max_model_len
        if prompt_len >= ctx:
            raise APIError(400, f"the prompt has {prompt_len} tokens; the context is {ctx}",
                           param="messages" if isinstance(req, ChatRequest) else "prompt")
        # one request may hold the whole pool (others are preempted), never more: prompt + output + the
        # speculative lookahead must fit in it, or the request could never finish
        pool_tokens = engine.pool.num_pages * engine.pool.page_size - getattr(engine.scheduler, "lookahead", 0)
        room = min(ctx - 1, pool_tokens) - prompt_len
        if max_tokens is None:  # completions default to 16 tokens as OpenAI; chat to what is left of the context
            max_tokens = max(1, min(16 if isinstance(req, CompletionRequest) else room, room))
        param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
        if prompt_len + max_tokens >= ctx:
            raise APIError(400, f"prompt ({prompt_len}) + {param} ({max_tokens}) exceeds the context ({ctx})",
                           param=param)
        if max_tokens > room:
            raise APIError(400, f"prompt ({prompt_len}) + {param} ({max_tokens}) does not fit in the KV cache "
                           f"({pool_tokens} tokens)", param=param)
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
                seed=req.seed, stop=req.stop, ignore_eos=req.ignore_eos, logprobs=engine_logprobs(req))
        except ValueError as e:  # SamplingParams names the field first
            field = str(e).split(" ", 1)[0]
            raise APIError(400, str(e), param=field if field in type(req).model_fields else None) from e

    def encode_prompt(llm, prompt) -> list[int]:
        if isinstance(prompt, str):
            if llm.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send token ids", param="prompt")
            return llm.tokenizer.encode(prompt)
        vocab = llm.model.config.vocab_size
        if not prompt or any(t < 0 or t >= vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be a non-empty list of ints in [0, {vocab})", param="prompt")
        return list(prompt)

    def chat_prompt(llm, messages: list[ChatMessage]) -> list[int]:
        if llm.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        if state["chat_error"]:
            raise APIError(503, f"chat is unavailable: {state['chat_error']}", "server_error")
        try:
            text = render_chat(state["chat_template"], [m.model_dump() for m in messages])
        except jinja2.TemplateError as e:
            raise APIError(400, f"the chat template rejects these messages: {e.message}", param="messages") from e
        return llm.tokenizer.encode(text)

    def check_prompt_size(llm, text_len: int, param: str) -> None:
        """A text of text_len characters past the bound holds more tokens than the context: refused before it is
        tokenised (tokenising megabytes costs seconds and gigabytes)."""
        ctx = llm.engine.max_model_len
        if text_len > prompt_bound(ctx, state["chars_per_token"]):
            raise APIError(400, f"the prompt has {text_len} characters, so more than {ctx} tokens (a token covers at "
                           f"most {state['chars_per_token']} characters); the context is {ctx}", param=param)

    big_parses = asyncio.Semaphore(BIG_PARSES)

    async def parsed(request: Request, model):
        """The request's body as `model`, parsed off the event loop within the context's limits. Large bodies take
        turns, BIG_PARSES at a time: the parser holds the interpreter for tens of milliseconds a call, and a crowd
        of such threads would keep the event loop (/health, streams) from its turn."""
        llm, _ = ready()
        body = await request.body()
        if len(body) < SMALL_BODY_BYTES:
            req = await run_in_threadpool(parse_body, body, model, state["limits"])
        else:
            async with big_parses:
                req = await run_in_threadpool(parse_body, body, model, state["limits"])
        check_model(req)
        return llm, req

    async def run(kind: str, req: _Common, prompt_ids: list[int], params: SamplingParams, request: Request):
        llm, engine = ready()
        rid = ("cmpl-" if kind == "text_completion" else "chatcmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        stream = engine.generate(prompt_ids, params)
        lp = Logprobs(llm.tokenizer) if params.logprobs is not None else None

        def logprobs_of(entries: list) -> dict | None:
            if lp is None:
                return None
            return lp.completion(entries) if kind == "text_completion" else lp.chat(entries)

        if not req.stream:
            async def collect():
                text, entries, last = [], [], None
                async for u in stream:
                    if u.error:
                        status = u.status or (400 if u.finish_reason == "error" else 500)
                        raise APIError(status, u.error, "invalid_request_error" if status < 500 else "server_error")
                    text.append(u.text)
                    entries += u.logprobs or []
                    last = u
                return "".join(text), entries, last

            # the client may hang up while it waits: then the request is aborted (cancelling the task
            # closes the engine stream, which aborts it and frees its pages)
            task = asyncio.ensure_future(collect())
            while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
                if await request.is_disconnected():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    return Response(status_code=499)  # nobody reads it; uvicorn drops it
            text, entries, last = task.result()
            usage = {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
                     "total_tokens": last.prompt_tokens + last.completion_tokens}
            if kind == "text_completion":
                choice = {"index": 0, "text": text, "finish_reason": last.finish_reason,
                          "logprobs": logprobs_of(entries)}
            else:
                choice = {"index": 0, "message": {"role": "assistant", "content": text},
                          "finish_reason": last.finish_reason, "logprobs": logprobs_of(entries)}
            return {"id": rid, "object": kind, "created": created, "model": model_name, "choices": [choice],
                    "usage": usage}

        obj = "text_completion" if kind == "text_completion" else "chat.completion.chunk"
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(delta: str | None, finish=None, role=False, logprobs=None):
            if kind == "text_completion":
                choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": logprobs}
            else:
                d = {"role": "assistant"} if role else {}
                if delta:
                    d["content"] = delta
                choice = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": logprobs}
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model_name,
                                          "choices": [choice]}) + "\n\n"

        async def events():
            if kind != "text_completion":
                yield chunk(None, role=True)
            last = None
            async for u in stream:
                last = u
                if u.error:
                    payload = {"error": {"message": u.error, "type": "server_error" if u.finish_reason != "error"
                                         else "invalid_request_error", "param": None, "code": None}}
                    yield "data: " + json.dumps(payload) + "\n\n"
                    break
                if u.text or u.finished or u.logprobs:
                    yield chunk(u.text, u.finish_reason if u.finished else None,
                                logprobs=logprobs_of(u.logprobs) if u.logprobs else None)
            if include_usage and last is not None:
                usage = {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
                         "total_tokens": last.prompt_tokens + last.completion_tokens}
                yield "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model_name,
                                             "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
    async def completions(request: Request):
        llm, req = await parsed(request, CompletionRequest)
        if isinstance(req.prompt, str):
            check_prompt_size(llm, len(req.prompt), "prompt")
        ids = await run_in_threadpool(encode_prompt, llm, req.prompt)  # off the event loop: /health stays live
        return await run("text_completion", req, ids, sampling(req, len(ids), llm, req.max_tokens), request)

    @app.post("/v1/chat/completions", openapi_extra=body_schema(ChatRequest))
    async def chat(request: Request):
        llm, req = await parsed(request, ChatRequest)
        check_prompt_size(llm, sum(len(m.content) for m in req.messages), "messages")
        ids = await run_in_threadpool(chat_prompt, llm, req.messages)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return await run("chat.completion", req, ids, sampling(req, len(ids), llm, max_tokens), request)

    return app


DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
KEEP_ALIVE_S = 5


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


def trim_heap() -> None:
    """Give the heap's free pages back to the system (glibc's malloc_trim over every arena): a large body arrives
    in chunks of tens of kilobytes, which come from the worker threads' arenas and stay there once freed."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> int:
    """Run `app` under uvicorn until SIGINT / SIGTERM (see `build_server`). Returns the exit status: 1 after a
    failed model load, else 0."""
    server = build_server(app, host, port, log_level, shutdown_timeout)
    server.run()
    return 1 if server.load_failed else 0


def _header_deadline(timeout_s: float):
    """uvicorn's httptools protocol with a deadline on each request's headers: a connection that sends nothing, or
    its headers a few bytes at a time, is closed `timeout_s` after it opened or after its last response (uvicorn
    times only idle keep-alive connections). "auto" where httptools is missing."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "auto"

    class HeaderDeadlineProtocol(HttpToolsProtocol):
        _headers_due = None

        def _arm(self) -> None:
            self._disarm()
            self._headers_due = self.loop.call_later(timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._headers_due is not None:
                self._headers_due.cancel()
                self._headers_due = None

        def _headers_late(self) -> None:
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self.transport.close()

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderDeadlineProtocol


def build_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S, read_timeout_s: float = DEFAULT_BODY_TIMEOUT_S):
    """A uvicorn server for `app`. The first SIGINT / SIGTERM drains: no new connections, requests in flight go
    on for up to `shutdown_timeout` seconds, then end with a 503 error (an SSE error event on a stream) and the
    server exits. A second signal exits at once. A model that fails to load (its reason is logged) stops the
    server and sets its `load_failed`. A request's headers must arrive within `read_timeout_s` of the connection's
    start or its last response (`create_app`'s body_timeout_s bounds the body)."""
    import os
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        load_failed = False

        async def on_tick(self, counter):
            if app.state.specmla["error"] is not None and not self.should_exit:
                log.error("exiting: the model failed to load")
                self.load_failed = self.should_exit = True
            return await super().on_tick(counter)

        def handle_exit(self, sig, frame):
            if self.should_exit:
                log.warning("second %s: exiting now", signal.Signals(sig).name)
                os._exit(1)
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None):
            async def deadline():
                await asyncio.sleep(shutdown_timeout)
                engine = app.state.specmla["engine"]
                if engine is not None:
                    log.warning("shutdown timeout (%.0f s) passed: ending the requests in flight", shutdown_timeout)
                    engine.fail_all("the server is shutting down")

            timer = asyncio.ensure_future(deadline())
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    # uvicorn cancels what still runs a little after the deadline (the failed requests have then answered); an idle
    # keep-alive connection closes after KEEP_ALIVE_S, one whose request headers have not come after read_timeout_s
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=KEEP_ALIVE_S,
                            timeout_graceful_shutdown=shutdown_timeout + 2, http=_header_deadline(read_timeout_s))
    warn_if_exposed(host, getattr(app.state, "api_key", None))
    return Server(config)
