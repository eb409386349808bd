"""glm-serve's HTTP layer: OpenAI-compatible routes on Starlette; generation runs in `scheduler`.

Routes: `GET /health` (no auth), `GET /v1/models[/{id}]`, `POST /v1/chat/completions`,
`POST /v1/completions`, `GET /stats` (counters and the last requests' numbers). Errors use OpenAI's
shape `{"error": {"message", "type", "param", "code"}}`. Request bodies are parsed and checked here by
hand (no schema library): a wrong type is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from glmkit.errors import GlmkitError
from glmkit.generate.engine import Engine
from glmkit.generate.sampling import SamplingParams
from glmkit.serve.scheduler import Done, GenerationJob, GenRequest, QueueFull, Scheduler, Text
from glmkit.serve.toolcalls import TOOL_CALL_OPEN, TemplateSupport, ToolCall, parse_tool_calls, prepare_messages

log = logging.getLogger("glmkit.serve")

MAX_STOP_SEQUENCES = 16
DISCONNECT_POLL_S = 0.2  # how often a non-streaming request checks that its client is still there
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


@dataclass
class SamplingDefaults:
    """Used when a request leaves a field out (glm-serve reads them from generation_config.json)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


@dataclass
class ServeConfig:
    model_name: str
    api_key: str | None = None
    max_request_bytes: int = 16 << 20
    default_max_tokens: int = 4096  # when a request sets no max_tokens (also capped by the context)
    split_reasoning: bool = False  # chat: text before </think> goes to `reasoning_content`
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)


@dataclass
class Loaded:
    engine: Engine
    scheduler: Scheduler
    defaults: SamplingDefaults | None = None  # overrides ServeConfig.defaults (read from the snapshot)

    def __post_init__(self) -> None:
        self.support = TemplateSupport.of(self.engine.tokenizer.chat_template if self.engine.tokenizer else None)


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code)


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status)


# ---- app state ------------------------------------------------------------------------------------

class State:
    def __init__(self, config: ServeConfig, load: Callable[[], Loaded],
                 on_load_error: Callable[[str], None] | None = None):
        self.config = config
        self.load = load
        self.on_load_error = on_load_error
        self.loaded: Loaded | None = None
        self.load_error: str | None = None
        self.started = time.time()

    def run_load(self) -> None:
        try:
            self.loaded = self.load()
            log.info("model %s loaded in %.1fs", self.config.model_name, time.time() - self.started)
        except Exception as e:
            self.load_error = str(e) if isinstance(e, GlmkitError) else f"{type(e).__name__}: {e}"
            log.error("loading failed: %s", self.load_error)
            if self.on_load_error is not None:
                self.on_load_error(self.load_error)

    def ready(self) -> Loaded:
        if self.loaded is not None:
            return self.loaded
        if self.load_error is not None:
            raise ApiError(500, f"the model failed to load: {self.load_error}", "server_error", code="load_failed")
        raise ApiError(503, "the model is still loading; retry shortly", "server_error", code="model_loading")

    @property
    def defaults(self) -> SamplingDefaults:
        return (self.loaded.defaults if self.loaded and self.loaded.defaults else None) or self.config.defaults


def create_app(config: ServeConfig, load: Callable[[], Loaded],
               on_load_error: Callable[[str], None] | None = None) -> AuthMiddleware:
    """The ASGI app. `load` runs on a background thread at startup; until it returns, model routes
    answer 503 (and /health says "loading"); if it fails they answer 500 and `on_load_error` is called."""
    state = State(config, load, on_load_error)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        threading.Thread(target=state.run_load, name="glm-serve-load", daemon=True).start()
        yield
        if state.loaded is not None:
            await run_in_threadpool(state.loaded.scheduler.stop)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model_info, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/stats", stats, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={ApiError: _api_error, HTTPException: _http_error})
    app.state.serve = state
    return AuthMiddleware(app, config.api_key)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", param=None,
                          code=code)


class AuthMiddleware:
    """`Authorization: Bearer KEY` on every route but /health, when an API key is set."""

    def __init__(self, app: Starlette, api_key: str | None):
        self.app = app
        self.api_key = api_key
        self.state = app.state  # for tests and the CLI

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and self.api_key and scope["path"] != "/health":
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                message = "Incorrect API key provided." if header else "Missing API key (Authorization: Bearer KEY)."
                await error_response(401, message, code="invalid_api_key")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def serve_state(request: Request) -> State:
    return request.app.state.serve


# ---- small routes ---------------------------------------------------------------------------------

async def health(request: Request) -> Response:
    state = serve_state(request)
    if state.loaded is not None:
        return JSONResponse({"status": "ok", "model": state.config.model_name})
    if state.load_error is not None:
        return JSONResponse({"status": "error", "message": state.load_error}, status_code=500)
    return JSONResponse({"status": "loading"}, status_code=503)


def _model_card(state: State) -> dict[str, Any]:
    return {"id": state.config.model_name, "object": "model", "created": int(state.started), "owned_by": "glmkit"}


async def models(request: Request) -> Response:
    state = serve_state(request)
    state.ready()
    return JSONResponse({"object": "list", "data": [_model_card(state)]})


async def model_info(request: Request) -> Response:
    state = serve_state(request)
    state.ready()
    model_id = request.path_params["model_id"]
    if model_id != state.config.model_name:
        raise _unknown_model(model_id)
    return JSONResponse(_model_card(state))


async def stats(request: Request) -> Response:
    state = serve_state(request)
    loaded = state.ready()
    engine = loaded.engine
    return JSONResponse({"model": state.config.model_name, "model_hash": engine.model_hash,
                         "uptime_s": round(time.time() - state.started, 3), **loaded.scheduler.stats(),
                         "experts": engine.experts.stats.to_json()})


def _unknown_model(name: str) -> ApiError:
    return ApiError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


# ---- request parsing ------------------------------------------------------------------------------

async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object; 413 past `limit` bytes. An oversized body is read to its end (and
    dropped) up to a bound, so that the client, still sending, gets the 413 rather than a reset."""
    length = request.headers.get("content-length", "")
    too_large = ApiError(413, f"request body is larger than {limit} bytes", code="request_too_large")
    drain_limit = max(4 * limit, 64 << 20)
    if length.isdigit() and int(length) > drain_limit:
        raise too_large
    body = bytearray()
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > drain_limit:
            raise too_large
        if received <= limit:
            body += chunk
    if received > limit:
        raise too_large
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return data


_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
               dict: "an object", type(None): "null"}


def _type_error(name: str, expected: str, value: Any) -> ApiError:
    got = _TYPE_NAMES.get(type(value), type(value).__name__)
    return ApiError(400, f"Invalid type for '{name}': expected {expected}, but got {got} instead.", param=name,
                    code="invalid_type")


def _value_error(name: str, message: str) -> ApiError:
    return ApiError(400, f"Invalid value for '{name}': {message}", param=name, code="invalid_value")


def opt_int(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise _type_error(name, "an integer", value)
    return value


def opt_number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _type_error(name, "a number", value)
    return float(value)


def opt_bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _type_error(name, "a boolean", value)
    return value


@dataclass
class Common:
    """What chat and plain completions share."""

    stream: bool
    include_usage: bool
    max_tokens: int | None
    params: SamplingParams
    stop: tuple[str, ...]
    ignore_eos: bool


def parse_common(body: dict, state: State) -> Common:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _type_error("model", "a string", model)
    if model and model != state.config.model_name:
        raise _unknown_model(model)
    stream = opt_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _type_error("stream_options", "an object", options)
    include_usage = opt_bool(options or {}, "include_usage")
    n = opt_int(body, "n")
    if n is not None and n != 1:
        raise _value_error("n", "only n=1 is supported")
    for name in ("best_of",):
        if (opt_int(body, name) or 1) != 1:
            raise _value_error(name, "only 1 is supported")
    max_tokens = opt_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = opt_int(body, "max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise _value_error("max_tokens", f"must be at least 1, got {max_tokens}")
    defaults = state.defaults
    temperature = opt_number(body, "temperature")
    temperature = defaults.temperature if temperature is None else temperature
    if not 0 <= temperature <= 2:
        raise _value_error("temperature", f"must be between 0 and 2, got {temperature}")
    top_p = opt_number(body, "top_p")
    top_p = defaults.top_p if top_p is None else top_p
    if not 0 < top_p <= 1:
        raise _value_error("top_p", f"must be in (0, 1], got {top_p}")
    top_k = opt_int(body, "top_k")
    top_k = defaults.top_k if top_k is None else max(top_k, 0) if top_k >= -1 else None
    if top_k is None:
        raise _value_error("top_k", "must be >= 0 (or -1 for off)")
    seed = opt_int(body, "seed")
    params = SamplingParams(temperature, top_p, top_k, None if seed is None else seed % (1 << 63))
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = stop
    else:
        raise _type_error("stop", "a string or an array of strings", stop)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise _value_error("stop", f"at most {MAX_STOP_SEQUENCES} sequences")
    for name in ("logprobs", "top_logprobs", "echo"):
        value = body.get(name)
        if value not in (None, False, 0):
            raise _value_error(name, "not supported by this server")
    if body.get("suffix") not in (None, ""):
        raise _value_error("suffix", "not supported by this server")
    return Common(stream, include_usage, max_tokens, params, tuple(s for s in stops if s),
                  opt_bool(body, "ignore_eos"))


def text_content(value: Any, name: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _value_error(f"{name}[{i}]", "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise _type_error(name, "a string or an array of content parts", value)


def parse_messages(body: dict) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        if "messages" not in body:
            raise ApiError(400, "Missing required parameter: 'messages'.", param="messages",
                           code="missing_required_parameter")
        raise _type_error("messages", "an array", messages)
    if not messages:
        raise _value_error("messages", "must not be empty")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _type_error(where, "an object", m)
        role = m.get("role")
        if role not in ROLES:
            raise _value_error(f"{where}.role", f"unknown role {role!r}")
        message: dict[str, Any] = {"role": ROLES[role], "content": text_content(m.get("content"), f"{where}.content")}
        if role == "assistant":
            if isinstance(m.get("reasoning_content"), str):
                message["reasoning_content"] = m["reasoning_content"]
            if m.get("tool_calls"):
                message["tool_calls"] = _parse_tool_calls_in(m["tool_calls"], f"{where}.tool_calls")
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if isinstance(m.get(key), str):
                    message[key] = m[key]
        out.append(message)
    return out


def _parse_tool_calls_in(calls: Any, name: str) -> list[dict[str, Any]]:
    """Assistant `tool_calls` as templates expect them: `function.arguments` a dict, not a JSON string."""
    if not isinstance(calls, list):
        raise _type_error(name, "an array", calls)
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _value_error(f"{name}[{i}]", "expected {'type': 'function', 'function': {'name', 'arguments'}}")
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise _value_error(f"{name}[{i}].function.arguments", "not valid JSON") from None
        if not isinstance(arguments, dict):
            raise _value_error(f"{name}[{i}].function.arguments", "must be a JSON object")
        out.append({"id": call.get("id") or f"call_{i}", "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


def parse_tools(body: dict) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _type_error("tools", "an array", tools)
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _value_error(f"tools[{i}]", "expected {'type': 'function', 'function': {'name': ...}}")
    choice = body.get("tool_choice")
    if choice == "none":
        return None
    return tools or None


def _check_context(engine: Engine, n_tokens: int, where: str) -> None:
    limit = engine.config.max_position_embeddings
    if n_tokens >= limit:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, your {where} "
                       f"resulted in {n_tokens} tokens.", param=where, code="context_length_exceeded")


# ---- running a request ----------------------------------------------------------------------------

class Channel:
    """Carries the worker thread's events into this request's event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Text | Done] = asyncio.Queue()

    def emit(self, event: Text | Done) -> None:  # worker thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


def submit(loaded: Loaded, state: State, ids: list[int], common: Common, request_id: str
           ) -> tuple[GenerationJob, Channel]:
    remaining = loaded.engine.config.max_position_embeddings - len(ids)
    max_tokens = common.max_tokens or min(state.config.default_max_tokens, remaining)
    request = GenRequest(ids, max_tokens, common.params, common.stop, common.ignore_eos, request_id)
    channel = Channel()
    try:
        job = loaded.scheduler.submit(request, channel.emit)
    except QueueFull as e:
        raise ApiError(429, f"the server is busy ({e}); retry later", "server_error", code="server_busy") from None
    return job, channel


class ClientGone(Exception):
    pass


async def collect(request: Request, scheduler: Scheduler, job: GenerationJob, channel: Channel) -> tuple[str, Done]:
    """All of a request's text (non-streaming); cancels the job when the client disconnects (ClientGone)
    and raises the OpenAI-shaped 500 when generation failed."""
    parts: list[str] = []
    checked = time.monotonic()
    try:
        while True:
            try:
                event = await asyncio.wait_for(channel.queue.get(), timeout=DISCONNECT_POLL_S)
            except TimeoutError:
                event = None
            if time.monotonic() - checked >= DISCONNECT_POLL_S:
                checked = time.monotonic()
                if await request.is_disconnected():
                    raise ClientGone()
            if event is None:
                continue
            if isinstance(event, Done):
                if event.finish_reason == "error":
                    raise _failure(event)
                return "".join(parts), event
            parts.append(event.text)
    finally:
        scheduler.cancel(job)  # a no-op once the job is done


async def events(scheduler: Scheduler, job: GenerationJob, channel: Channel) -> AsyncIterator[Text | Done]:
    """The job's events (streaming). Starlette cancels this when the client disconnects: so is the job."""
    try:
        while True:
            event = await channel.queue.get()
            yield event
            if isinstance(event, Done):
                return
    finally:
        scheduler.cancel(job)


def usage(done: Done) -> dict[str, Any]:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


def timings(done: Done) -> dict[str, Any]:
    """Non-standard: server-side timings and where the cached prompt tokens came from."""
    return {"queue_s": round(done.queue_s, 6), "ttft_s": done.ttft_s and round(done.ttft_s, 6),
            "prefill_s": done.prefill_s and round(done.prefill_s, 6), "restore_s": round(done.restore_s, 6),
            "decode_s": round(done.decode_s, 6),
            "prefill_tokens": done.prompt_tokens - done.cached_tokens, "cached_from": done.cached_from}


def sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


def _failure(done: Done) -> ApiError:
    return ApiError(500, f"generation failed: {done.error}", "server_error", code="generation_failed")


def _sse_error(done: Done) -> str:
    error = _failure(done)
    return sse({"error": {"message": error.message, "type": error.type, "param": None, "code": error.code}})


def _fingerprint(loaded: Loaded) -> str:
    return "glmkit-" + loaded.engine.model_hash[:12]


# ---- /v1/chat/completions -------------------------------------------------------------------------

class ChatText:
    """Sorts a chat reply's text into reasoning, content and tool-call text as it streams.

    With `reasoning` the reply starts inside the thinking block (the prompt ended with `<think>`): text
    up to `</think>` is reasoning. With `tools`, everything from the first `<tool_call>` on is kept back
    and parsed at the end. Text that might be the start of a marker is held until it is decided.
    """

    def __init__(self, reasoning: bool, tools: bool):
        self.mode = "reasoning" if reasoning else "content"
        self.tools = tools
        self.pending = ""
        self.tool_text = ""
        self.content_started = False

    def push(self, text: str) -> list[tuple[str, str]]:
        self.pending += text
        out: list[tuple[str, str]] = []
        while self.pending:
            if self.mode == "tool":
                self.tool_text += self.pending
                self.pending = ""
                break
            marker = "</think>" if self.mode == "reasoning" else TOOL_CALL_OPEN if self.tools else None
            if marker is None:
                out.append(self._piece(self.pending))
                self.pending = ""
                break
            at = self.pending.find(marker)
            if at >= 0:
                out.append(self._piece(self.pending[:at].rstrip() if self.mode == "content" else self.pending[:at]))
                if self.mode == "reasoning":
                    self.pending, self.mode = self.pending[at + len(marker):], "content"
                else:
                    self.pending, self.mode = self.pending[at:], "tool"
                continue
            hold = max((k for k in range(1, len(marker)) if self.pending.endswith(marker[:k])), default=0)
            if self.mode == "content":  # whitespace before a tool call is dropped, as in the non-streaming reply
                rest = self.pending[:len(self.pending) - hold]
                hold += len(rest) - len(rest.rstrip())
            out.append(self._piece(self.pending[:len(self.pending) - hold]))
            self.pending = self.pending[len(self.pending) - hold:]
            break
        return [(kind, text) for kind, text in out if text]

    def _piece(self, text: str) -> tuple[str, str]:
        if self.mode == "content" and not self.content_started:
            text = text.lstrip("\n")  # "</think>\n" opens the answer
            self.content_started = bool(text)
        return self.mode, text

    def finish(self) -> tuple[list[tuple[str, str]], str]:
        """(the held-back text, the tool-call text to parse)."""
        if self.mode == "tool":
            self.tool_text += self.pending
            pending = []
        else:
            pending = [self._piece(self.pending)] if self.pending else []
        self.pending = ""
        return [(kind, text) for kind, text in pending if text], self.tool_text


async def chat_completions(request: Request) -> Response:
    state = serve_state(request)
    loaded = state.ready()
    body = await read_json(request, state.config.max_request_bytes)
    common = parse_common(body, state)
    messages = parse_messages(body)
    tools = parse_tools(body)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise _type_error("chat_template_kwargs", "an object", kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("messages", "tools", "add_generation_prompt")}
    thinking = kwargs.pop("enable_thinking", True)
    if not isinstance(thinking, bool):
        raise _type_error("chat_template_kwargs.enable_thinking", "a boolean", thinking)
    tok = loaded.engine.tokenizer
    template_messages, template_tools = prepare_messages(messages, tools, loaded.support)

    def render() -> tuple[str, list[int]]:
        text = tok.render_chat(template_messages, thinking, tools=template_tools, **kwargs)
        return text, tok.encode(text)

    try:
        prompt_text, ids = await run_in_threadpool(render)
    except GlmkitError as e:
        raise ApiError(400, str(e), param="messages", code="invalid_messages") from None
    _check_context(loaded.engine, len(ids), "messages")
    request_id = "chatcmpl-" + uuid.uuid4().hex[:24]
    job, channel = submit(loaded, state, ids, common, request_id)
    reasoning = state.config.split_reasoning and prompt_text.rstrip().endswith("<think>")
    router = ChatText(reasoning, tools is not None)
    created = int(time.time())
    base = {"id": request_id, "object": "chat.completion", "created": created, "model": state.config.model_name,
            "system_fingerprint": _fingerprint(loaded)}

    if not common.stream:
        try:
            text, done = await collect(request, loaded.scheduler, job, channel)
        except ClientGone:
            return Response(status_code=499)
        pieces = router.push(text)
        rest, tool_text = router.finish()
        content, calls = _chat_parts(pieces + rest, tool_text, tools)
        reasoning_text = "".join(t for kind, t in pieces + rest if kind == "reasoning")
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if reasoning:
            message["reasoning_content"] = reasoning_text
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        finish = "tool_calls" if calls else done.finish_reason
        return JSONResponse({**base, "choices": [{"index": 0, "message": message, "logprobs": None,
                                                  "finish_reason": finish}],
                             "usage": usage(done), "timings": timings(done)})

    chunk_base = {**base, "object": "chat.completion.chunk"}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return sse({**chunk_base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                               "finish_reason": finish}]})

    def delta(kind: str, text: str) -> dict[str, Any]:
        return {"reasoning_content" if kind == "reasoning" else "content": text}

    async def stream() -> AsyncIterator[str]:
        yield chunk({"role": "assistant", "content": ""})
        async for event in events(loaded.scheduler, job, channel):
            if isinstance(event, Text):
                for kind, text in router.push(event.text):
                    yield chunk(delta(kind, text))
                continue
            if event.finish_reason == "error":
                yield _sse_error(event)
                return
            rest, tool_text = router.finish()
            for kind, text in rest:
                yield chunk(delta(kind, text))
            leftover, calls = parse_tool_calls(tool_text, tools) if tool_text else ("", [])
            if leftover or (tool_text and not calls):
                yield chunk({"content": leftover if calls else tool_text})
            for index, call in enumerate(calls):
                yield chunk({"tool_calls": [call.to_openai(index)]})
            yield chunk({}, "tool_calls" if calls else event.finish_reason)
            if common.include_usage:
                yield sse({**chunk_base, "choices": [], "usage": usage(event), "timings": timings(event)})
        yield sse("[DONE]")

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _chat_parts(pieces: list[tuple[str, str]], tool_text: str, tools: list[dict[str, Any]] | None
                ) -> tuple[str, list[ToolCall]]:
    content = "".join(text for kind, text in pieces if kind == "content")
    if not tool_text:
        return content, []
    leftover, calls = parse_tool_calls(tool_text, tools)
    if not calls:
        return content + tool_text, []
    return (content + ("\n" if content and leftover else "") + leftover).strip(), calls


# ---- /v1/completions ------------------------------------------------------------------------------

def parse_prompt(body: dict, engine: Engine) -> list[int] | str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise _value_error("prompt", "must not be empty")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = engine.config.vocab_size
        if not all(0 <= t < vocab for t in prompt):
            raise _value_error("prompt", f"token ids must be in [0, {vocab})")
        return list(prompt)
    if prompt is None:
        raise ApiError(400, "Missing required parameter: 'prompt'.", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) > 1:
        raise _value_error("prompt", "one prompt per request (batches are not supported)")
    raise _type_error("prompt", "a string, an array of token ids, or an array of one of them", prompt)


async def completions(request: Request) -> Response:
    state = serve_state(request)
    loaded = state.ready()
    body = await read_json(request, state.config.max_request_bytes)
    common = parse_common(body, state)
    prompt = parse_prompt(body, loaded.engine)
    ids = await run_in_threadpool(loaded.engine.tokenizer.encode, prompt) if isinstance(prompt, str) else prompt
    if not ids:
        raise _value_error("prompt", "encodes to no tokens")
    _check_context(loaded.engine, len(ids), "prompt")
    request_id = "cmpl-" + uuid.uuid4().hex[:24]
    job, channel = submit(loaded, state, ids, common, request_id)
    base = {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": state.config.model_name, "system_fingerprint": _fingerprint(loaded)}

    def choice(text: str, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    if not common.stream:
        try:
            text, done = await collect(request, loaded.scheduler, job, channel)
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse({**base, "choices": [choice(text, done.finish_reason)], "usage": usage(done),
                             "timings": timings(done)})

    async def stream() -> AsyncIterator[str]:
        async for event in events(loaded.scheduler, job, channel):
            if isinstance(event, Text):
                yield sse({**base, "choices": [choice(event.text, None)]})
                continue
            if event.finish_reason == "error":
                yield _sse_error(event)
                return
            yield sse({**base, "choices": [choice("", event.finish_reason)]})
            if common.include_usage:
                yield sse({**base, "choices": [], "usage": usage(event), "timings": timings(event)})
        yield sse("[DONE]")

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
