"""glm-serve's HTTP app: OpenAI- and Anthropic-compatible routes on Starlette; generation runs in `scheduler`.

Routes: `GET /health` (no auth), `GET /v1/models[/{id}]`, `POST /v1/chat/completions`,
`POST /v1/completions`, `POST /v1/messages`, `POST /v1/messages/count_tokens`, `GET /stats` (counters and the
last requests' numbers). OpenAI's wire format (errors, field checks) is `protocol`'s, Anthropic's
`messages_api`'s; chat messages and replies are `chat`'s, the worker channel `bridge`'s.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from types import FrameType
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from glmkit.errors import GlmkitError
from glmkit.generate.constraint import TokenConstraint
from glmkit.generate.sampling import LogitsConstraint, TokenLogprob
from glmkit.generate.tokenizer import replies_in_thinking
from glmkit.serve.auth import AuthMiddleware
from glmkit.serve.bridge import Channel, ClientGone, collect, events, submit_job
from glmkit.serve.chat import (
    ChatText,
    chat_parts,
    closing_pieces,
    parse_messages,
    parse_response_format,
    parse_tool_choice,
    parse_tools,
    template_variables,
)
from glmkit.serve.config import Loaded, ServeConfig, State
from glmkit.serve.messages_api import (
    MessageEvents,
    anthropic_error,
    error_event,
    message_body,
    new_message_id,
    parse_messages_request,
    speaks_anthropic,
)
from glmkit.serve.protocol import (
    ANY_MODEL,
    ApiError,
    Common,
    SamplingDefaults,
    check_model,
    check_prompt_chars,
    check_prompt_tokens,
    completion_logprobs,
    error_response,
    internal_error,
    logprobs_content,
    parse_common,
    parse_prompt,
    read_json,
    sse,
    sse_error,
    timings,
    usage,
    value_error,
)
from glmkit.serve.scheduler import Done, GenerationJob, GenRequest, Text
from glmkit.serve.tool_grammar import ToolChoice, needs_grammar
from glmkit.serve.toolcalls import ToolCall, prepare_messages

# the names glm-serve's command line builds the app from
__all__ = ["Loaded", "SamplingDefaults", "ServeConfig", "create_app"]

log = logging.getLogger("glmkit.serve")
SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def create_app(config: ServeConfig, load: Callable[[], Loaded],
               on_load_error: Callable[[str], None] | None = None) -> AuthMiddleware:
    """The ASGI app. `load` runs on a background thread at startup; until it returns, model routes
    answer 503 (and /health says "loading"); if it fails they answer 500 and `on_load_error` is called."""
    state = State(config, load, on_load_error)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        threading.Thread(target=state.run_load, name="glm-serve-load", daemon=True).start()
        restore_signals = _chain_shutdown_signals(state)
        yield
        restore_signals()
        state.begin_shutdown()
        if state.loaded is not None:
            await run_in_threadpool(state.loaded.scheduler.stop)
            await run_in_threadpool(state.loaded.engine.close)  # the routed experts' usage scores

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model_info, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/messages", anthropic_messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", anthropic_count_tokens, methods=["POST"]),
        Route("/stats", stats, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _internal_error})
    app.state.serve = state
    return AuthMiddleware(app, config.api_key)


def _chain_shutdown_signals(state: State) -> Callable[[], None]:
    """Run state.begin_shutdown() on SIGINT / SIGTERM ahead of the server's own handler (uvicorn's waits for the
    requests in flight, then cancels them mid-response). Returns the undo. Only the main thread's handlers see
    signals: a server run on another thread (as in the tests) keeps its handlers as they are."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous: dict[int, Callable[[int, FrameType | None], Any]] = {}
    for sig in SHUTDOWN_SIGNALS:
        handler = signal.getsignal(sig)
        if callable(handler):  # not SIG_DFL / SIG_IGN: a server's handler to hand the signal on to
            previous[sig] = handler
            signal.signal(sig, functools.partial(_on_shutdown_signal, state, handler))

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


def _on_shutdown_signal(state: State, handler: Callable[[int, FrameType | None], Any], signum: int,
                        frame: FrameType | None) -> None:
    state.begin_shutdown()
    handler(signum, frame)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    if speaks_anthropic(request.scope):
        return anthropic_error(exc.status, exc.message)
    return exc.response()


async def _internal_error(request: Request, exc: Exception) -> Response:
    """Anything no route handled (a bug): a JSON 500, the traceback only in the server's log (Starlette re-raises
    the exception to the server, which logs it)."""
    return await _api_error(request, internal_error())


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    if speaks_anthropic(request.scope):
        return anthropic_error(exc.status_code, message)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(exc.status_code, message, param=None, code=code)


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


def _model_card(state: State, model_id: str, anthropic: bool) -> dict[str, Any]:
    """The model `model_id` as OpenAI's model object, or Anthropic's (`anthropic`: the request speaks that API)."""
    if not anthropic:
        return {"id": model_id, "object": "model", "created": int(state.started), "owned_by": "glmkit"}
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(state.started))
    return {"type": "model", "id": model_id, "display_name": model_id, "created_at": created, "lifecycle": "active",
            "max_input_tokens": state.ready().engine.config.max_position_embeddings}


async def models(request: Request) -> Response:
    """The served model's name, then each alias (but ANY_MODEL) as its own model."""
    state = serve_state(request)
    state.ready()
    anthropic = speaks_anthropic(request.scope)
    ids = [state.config.model_name, *(a for a in state.config.model_aliases if a != ANY_MODEL)]
    cards = [_model_card(state, model_id, anthropic) for model_id in dict.fromkeys(ids)]
    if anthropic:
        return JSONResponse({"data": cards, "has_more": False, "first_id": cards[0]["id"], "last_id": cards[-1]["id"]})
    return JSONResponse({"object": "list", "data": cards})


async def model_info(request: Request) -> Response:
    state = serve_state(request)
    state.ready()
    model_id = request.path_params["model_id"]
    check_model({"model": model_id}, state.config.model_names)
    return JSONResponse(_model_card(state, model_id, speaks_anthropic(request.scope)))


async def stats(request: Request) -> Response:
    state = serve_state(request)
    loaded = state.ready()
    engine = loaded.engine
    return JSONResponse({"model": state.config.model_name, "model_hash": engine.model_hash,
                         "uptime_s": round(time.time() - state.started, 3), **loaded.scheduler.stats(),
                         "experts": engine.expert_stats.to_json()})


def _fingerprint(loaded: Loaded) -> str:
    return "glmkit-" + loaded.engine.model_hash[:12]


def _start_generation(state: State, loaded: Loaded, ids: list[int], common: Common, request_id: str,
                      constraint: LogitsConstraint | None = None) -> tuple[GenerationJob, Channel]:
    """Submit the prompt `ids` with the request's settings (and the constraint on its tokens); the job and the
    channel its events come back on."""
    request = GenRequest(ids, state.max_tokens(common.max_tokens, len(ids)), common.params, common.stop,
                         common.ignore_eos, request_id, constraint, common.logprobs)
    return submit_job(loaded.scheduler, state.channels, request)


def _event_stream(body: AsyncIterator[str], error_event: Callable[[ApiError], str] = sse_error,
                  last: str | None = sse("[DONE]")) -> StreamingResponse:
    """A streaming response of `body`'s server-sent events. However it ends, a failure (generation failed, the
    server shut down, a bug) becomes one `error_event`, and `last` (OpenAI's `[DONE]`; Anthropic's: none) closes
    the stream."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async for event in body:
                yield event
        except ApiError as e:
            yield error_event(e)
        except Exception:
            log.exception("a stream failed")
            yield error_event(internal_error())
        if last is not None:
            yield last

    return StreamingResponse(guarded(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# ---- /v1/chat/completions -------------------------------------------------------------------------

async def _render_chat(loaded: Loaded, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       thinking: bool, kwargs: dict[str, Any]) -> tuple[str, list[int]]:
    """The chat template's prompt for these messages and tools, and its token ids (400s: too long, a template
    error, an empty prompt)."""
    check_prompt_chars(loaded.engine, sum(len(m["content"]) for m in messages), "messages")
    tok = loaded.engine.tokenizer
    template_messages, template_tools = prepare_messages(messages, tools, loaded.support)

    def render() -> tuple[str, list[int]]:
        text = tok.render_chat(template_messages, thinking, tools=template_tools, **kwargs)
        check_prompt_chars(loaded.engine, len(text), "messages")
        return text, tok.encode(text)

    try:
        prompt_text, ids = await run_in_threadpool(render)
    except GlmkitError as e:
        raise ApiError(400, str(e), param="messages", code="invalid_messages") from None
    if not ids:
        raise ApiError(400, "the chat template rendered an empty prompt", param="messages", code="invalid_messages")
    check_prompt_tokens(loaded.engine, len(ids), "messages")
    return prompt_text, ids


async def _json_constraint(loaded: Loaded, common: Common, schema: dict[str, Any] | None, field: str
                           ) -> TokenConstraint:
    """The constraint to JSON matching `schema` (None: any object) asked for in `field`; 400 with `ignore_eos` (the
    JSON's end is the reply's)."""
    if common.ignore_eos:
        raise value_error("ignore_eos", f"cannot be used with {field} (the JSON ends the reply)")
    return await run_in_threadpool(loaded.json_constraint, schema, field)


async def _reply_constraint(loaded: Loaded, common: Common, tools: list[dict[str, Any]] | None, choice: ToolChoice,
                            prompt_text: str, json_field: str | None, json_constraint: TokenConstraint | None,
                            thinking_budget: int | None) -> LogitsConstraint | None:
    """The constraint on a reply to `prompt_text`: the one a forced call or strict tools ask for, else the JSON reply
    format's (`json_constraint`, asked for in `json_field`), else a thinking budget's; its thinking held to
    `thinking_budget` tokens (at most the context's) where the reply starts inside a thinking block. 400 for a forced
    call or strict tools with `ignore_eos`, or beside a JSON reply format."""
    budget = None
    if thinking_budget is not None and replies_in_thinking(prompt_text):
        # a budget past the context is never reached: capped, as max_tokens is
        budget = min(thinking_budget, loaded.engine.config.max_position_embeddings)
    if needs_grammar(tools, choice):
        assert tools is not None
        if json_field is not None:
            raise value_error(json_field, "cannot be combined with a forced tool call or strict tools")
        if common.ignore_eos:
            raise value_error("ignore_eos", "cannot be used with a forced tool call or strict tools")
        return await run_in_threadpool(loaded.tool_constraint, tools, choice, replies_in_thinking(prompt_text),
                                       "tools", budget)
    if json_constraint is not None or budget is None:
        return json_constraint
    return loaded.thinking_budget(budget)


async def _whole_reply(request: Request, state: State, loaded: Loaded, job: GenerationJob, channel: Channel,
                       router: ChatText, tools: list[dict[str, Any]] | None
                       ) -> tuple[list[tuple[str, str]], str, list[ToolCall], Done, list[TokenLogprob]] | None:
    """A non-streaming chat reply once generation ends: (ChatText's pieces, the content, the tool calls, how it
    ended, the tokens' logprobs when asked for); None when the client went away."""
    try:
        text, logprobs, done = await collect(request, loaded.scheduler, state.channels, job, channel)
    except ClientGone:
        return None
    pieces = router.push(text)
    rest, tool_text = router.finish()
    content, calls = chat_parts(pieces + rest, tool_text, tools)
    return pieces + rest, content, calls, done, logprobs


async def chat_completions(request: Request) -> Response:
    state = serve_state(request)
    loaded = state.ready()
    body = await read_json(request, state.config.max_request_bytes)
    common = parse_common(body, state.config.model_names, state.defaults, loaded.engine.config.vocab_size, chat=True)
    messages = parse_messages(body)
    tools = parse_tools(body)
    choice = parse_tool_choice(body, tools)
    thinking, kwargs, budget = template_variables(body)
    constrained, schema = parse_response_format(body)
    json_constraint = await _json_constraint(loaded, common, schema, "response_format") if constrained else None
    # the JSON, or a forced call, starts at the first generated token: no thinking before
    thinking = thinking and json_constraint is None and not choice.required
    prompt_text, ids = await _render_chat(loaded, messages, tools, thinking, kwargs)
    constraint = await _reply_constraint(loaded, common, tools, choice, prompt_text,
                                         "response_format" if constrained else None, json_constraint, budget)
    request_id = "chatcmpl-" + uuid.uuid4().hex[:24]
    job, channel = _start_generation(state, loaded, ids, common, request_id, constraint)
    decode = loaded.engine.tokenizer.decode

    def logprobs_of(chosen: list[TokenLogprob]) -> dict[str, Any] | None:
        return None if common.logprobs is None else {"content": logprobs_content(chosen, decode)}

    reasoning = state.config.split_reasoning and replies_in_thinking(prompt_text)
    router = ChatText(reasoning, tools is not None)
    created = int(time.time())
    base = {"id": request_id, "object": "chat.completion", "created": created, "model": state.config.model_name,
            "system_fingerprint": _fingerprint(loaded)}

    if not common.stream:
        whole = await _whole_reply(request, state, loaded, job, channel, router, tools)
        if whole is None:
            return Response(status_code=499)
        pieces, content, calls, done, chosen = whole
        reasoning_text = "".join(t for kind, t in pieces if kind == "reasoning")
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if reasoning:
            message["reasoning_content"] = reasoning_text
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        finish = "tool_calls" if calls else done.finish_reason
        return JSONResponse({**base, "choices": [{"index": 0, "message": message, "logprobs": logprobs_of(chosen),
                                                  "finish_reason": finish}],
                             "usage": usage(done), "timings": timings(done)})

    chunk_base = {**base, "object": "chat.completion.chunk"}

    def chunk(delta: dict[str, Any], finish: str | None = None, chosen: list[TokenLogprob] | None = None) -> str:
        return sse({**chunk_base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs_of(chosen or []),
                                               "finish_reason": finish}]})

    def delta(kind: str, text: str) -> dict[str, Any]:
        return {"reasoning_content" if kind == "reasoning" else "content": text}

    async def stream() -> AsyncIterator[str]:
        yield chunk({"role": "assistant", "content": ""})
        async for event in events(loaded.scheduler, state.channels, job, channel):
            if isinstance(event, Text):
                pieces = router.push(event.text)
                for i, (kind, text) in enumerate(pieces):  # the event's logprobs go with its first chunk
                    yield chunk(delta(kind, text), chosen=event.logprobs if i == 0 else None)
                if event.logprobs and not pieces:
                    yield chunk({}, chosen=event.logprobs)
                continue
            rest, calls = closing_pieces(router, tools)
            for kind, text in rest:
                yield chunk(delta(kind, text))
            for index, call in enumerate(calls):
                yield chunk({"tool_calls": [call.to_openai(index)]})
            yield chunk({}, "tool_calls" if calls else event.finish_reason)
            if common.include_usage:
                yield sse({**chunk_base, "choices": [], "usage": usage(event), "timings": timings(event)})

    return _event_stream(stream())


# ---- /v1/completions ------------------------------------------------------------------------------

async def completions(request: Request) -> Response:
    state = serve_state(request)
    loaded = state.ready()
    body = await read_json(request, state.config.max_request_bytes)
    common = parse_common(body, state.config.model_names, state.defaults, loaded.engine.config.vocab_size)
    prompt = parse_prompt(body, loaded.engine)
    ids = await run_in_threadpool(loaded.engine.tokenizer.encode, prompt) if isinstance(prompt, str) else prompt
    if not ids:
        raise value_error("prompt", "encodes to no tokens")
    check_prompt_tokens(loaded.engine, len(ids), "prompt")
    request_id = "cmpl-" + uuid.uuid4().hex[:24]
    job, channel = _start_generation(state, loaded, ids, common, request_id)
    base = {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": state.config.model_name, "system_fingerprint": _fingerprint(loaded)}

    decode = loaded.engine.tokenizer.decode
    offset = 0  # characters of the completion's tokens reported so far (their logprobs' text offsets)

    def choice(text: str, finish: str | None, chosen: list[TokenLogprob] | None = None) -> dict[str, Any]:
        nonlocal offset
        logprobs = None
        if common.logprobs is not None:
            logprobs = completion_logprobs(chosen or [], decode, offset)
            offset += sum(len(t) for t in logprobs["tokens"])
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

    if not common.stream:
        try:
            text, chosen, done = await collect(request, loaded.scheduler, state.channels, job, channel)
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse({**base, "choices": [choice(text, done.finish_reason, chosen)], "usage": usage(done),
                             "timings": timings(done)})

    async def stream() -> AsyncIterator[str]:
        async for event in events(loaded.scheduler, state.channels, job, channel):
            if isinstance(event, Text):
                yield sse({**base, "choices": [choice(event.text, None, event.logprobs)]})
                continue
            yield sse({**base, "choices": [choice("", event.finish_reason)]})
            if common.include_usage:
                yield sse({**base, "choices": [], "usage": usage(event), "timings": timings(event)})

    return _event_stream(stream())


# ---- /v1/messages (Anthropic) ---------------------------------------------------------------------

async def anthropic_messages(request: Request) -> Response:
    state = serve_state(request)
    loaded = state.ready()
    body = await read_json(request, state.config.max_request_bytes)
    parsed = parse_messages_request(body, state.config.model_names, state.defaults)
    json_constraint = None if parsed.output_schema is None else await _json_constraint(
        loaded, parsed.common, parsed.output_schema, "output_config.format")
    thinking = parsed.thinking and json_constraint is None  # the JSON starts at the first generated token
    prompt_text, ids = await _render_chat(loaded, parsed.messages, parsed.tools, thinking, {})
    constraint = await _reply_constraint(loaded, parsed.common, parsed.tools, parsed.tool_choice, prompt_text,
                                         None if json_constraint is None else "output_config.format", json_constraint,
                                         parsed.thinking_budget)
    message_id = new_message_id()
    job, channel = _start_generation(state, loaded, ids, parsed.common, message_id, constraint)
    router = ChatText(replies_in_thinking(prompt_text), parsed.tools is not None)
    model = state.config.model_name

    if not parsed.common.stream:
        whole = await _whole_reply(request, state, loaded, job, channel, router, parsed.tools)
        if whole is None:
            return Response(status_code=499)
        return JSONResponse(message_body(message_id, model, *whole[:4]))

    async def stream() -> AsyncIterator[str]:
        out = MessageEvents(message_id, model, len(ids))
        yield out.start()
        async for event in events(loaded.scheduler, state.channels, job, channel):
            if isinstance(event, Text):
                for kind, text in router.push(event.text):
                    for line in out.text(kind, text):
                        yield line
                continue
            rest, calls = closing_pieces(router, parsed.tools)
            for kind, text in rest:
                for line in out.text(kind, text):
                    yield line
            for line in out.finish(calls, event):
                yield line

    return _event_stream(stream(), error_event, last=None)


async def anthropic_count_tokens(request: Request) -> Response:
    state = serve_state(request)
    loaded = state.ready()
    body = await read_json(request, state.config.max_request_bytes)
    parsed = parse_messages_request(body, state.config.model_names, state.defaults, count_only=True)
    _, ids = await _render_chat(loaded, parsed.messages, parsed.tools, parsed.thinking, {})
    return JSONResponse({"input_tokens": len(ids)})
