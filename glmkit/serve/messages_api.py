"""Anthropic's Messages API for glm-serve (`POST /v1/messages`, `POST /v1/messages/count_tokens`): a request's system
prompt, content blocks, tools and thinking into the chat template's messages (`parse_messages_request`), and a
reply's text back into content blocks, whole (`message_body`) or as Anthropic's stream of events
(`MessageEvents`: `message_start`, `content_block_start` / `_delta` / `_stop` per block, `message_delta` with the
stop reason and usage, `message_stop`).

Errors on these routes use Anthropic's shape `{"type": "error", "error": {"type", "message"}}` (`error_body`).
Content blocks: `text`, `tool_use` and `thinking` (assistant turns), `tool_result` (user turns); images and
documents are refused with a 400. `tool_choice` `any` and `tool` hold the reply to a call (of that tool), and a tool
with `strict: true` to arguments that match its `input_schema` (tool_grammar.py), as on the OpenAI route; with
thinking on, a forced call is a 400, as Anthropic's API answers. `output_config.format` (a JSON schema) constrains
the reply as `response_format` does on the OpenAI route. The sampling fields (`temperature`, `top_p`, `top_k`),
which Anthropic's current clients no longer send, are taken when given; otherwise the model's
generation_config.json decides.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

from glmkit.generate.sampling import SamplingParams
from glmkit.serve.chat import check_tool_parameters, text_content
from glmkit.serve.protocol import (
    GREEDY_BELOW,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    ApiError,
    Common,
    SamplingDefaults,
    check_model,
    opt_bool,
    opt_int,
    opt_number,
    parse_thinking_budget,
    type_error,
    value_error,
)
from glmkit.serve.scheduler import Done
from glmkit.serve.tool_grammar import ToolChoice
from glmkit.serve.toolcalls import ToolCall

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 499: "invalid_request_error", 503: "overloaded_error"}


OPENAI_ROUTES = ("/v1/chat/completions", "/v1/completions")  # OpenAI's own: its shape whatever the headers


def speaks_anthropic(scope: dict) -> bool:
    """Whether an ASGI request speaks this API (its errors and listings take Anthropic's shape): one of its routes,
    or off OpenAI's own routes (on those both APIs share, as `/v1/models`) the `anthropic-version` header
    Anthropic's clients send."""
    path = scope["path"]
    return path.startswith("/v1/messages") or (
        path not in OPENAI_ROUTES and any(name == b"anthropic-version" for name, _ in scope["headers"]))


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error object for an HTTP status (any other status: `api_error`)."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def anthropic_error(status: int, message: str) -> JSONResponse:
    """An error response in Anthropic's shape."""
    return JSONResponse(error_body(status, message), status_code=status)


# ---- request -> template messages -------------------------------------------------------------------

@dataclass
class MessagesRequest:
    """A `/v1/messages` body as the chat route's pieces: shared settings, template messages, OpenAI-style tools
    (None: no tools), and whether the reply starts with thinking (and the most tokens it may think)."""

    common: Common
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    thinking: bool
    output_schema: dict[str, Any] | None  # `output_config.format`'s JSON schema: the reply is constrained to it
    tool_choice: ToolChoice = ToolChoice()
    thinking_budget: int | None = None  # `thinking.budget_tokens`: the thinking block is closed past it


def parse_messages_request(body: dict, model_names: frozenset[str], defaults: SamplingDefaults, count_only: bool = False
                           ) -> MessagesRequest:
    """Check and convert a Messages API body (`count_only`: a count_tokens body, which has no `max_tokens`)."""
    check_model(body, model_names)
    max_tokens = opt_int(body, "max_tokens")
    if max_tokens is None and not count_only:
        raise ApiError(400, "max_tokens: Field required", param="max_tokens", code="missing_required_parameter")
    if max_tokens is not None and max_tokens < 1:
        raise value_error("max_tokens", f"must be at least 1, got {max_tokens}")
    temperature = opt_number(body, "temperature")
    temperature = min(defaults.temperature, 1.0) if temperature is None else temperature
    if not 0 <= temperature <= 1:
        raise value_error("temperature", f"must be between 0 and 1, got {temperature}")
    top_p = opt_number(body, "top_p")
    top_p = defaults.top_p if top_p is None else top_p
    if not 0 < top_p <= 1:
        raise value_error("top_p", f"must be in (0, 1], got {top_p}")
    top_k = opt_int(body, "top_k")
    top_k = defaults.top_k if top_k is None else top_k
    if top_k < 0:
        raise value_error("top_k", f"must be >= 0, got {top_k}")
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise type_error("stop_sequences", "an array of strings", stops)
    if len(stops) > MAX_STOP_SEQUENCES or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise value_error("stop_sequences", f"at most {MAX_STOP_SEQUENCES} sequences of at most {MAX_STOP_CHARS} "
                                            "characters")
    params = SamplingParams(0.0 if temperature < GREEDY_BELOW else temperature, top_p, top_k, None)
    common = Common(opt_bool(body, "stream"), False, max_tokens, params, tuple(s for s in stops if s),
                    opt_bool(body, "ignore_eos"))  # ignore_eos: glm-serve's extension, as on the OpenAI routes
    messages = _system(body.get("system")) + _turns(body)
    tools, (thinking, budget) = _tools(body), _thinking(body.get("thinking"))
    choice = _tool_choice(body, tools)
    if choice.required and thinking:
        raise value_error("tool_choice", "thinking may not be enabled when tool_choice forces tool use")
    return MessagesRequest(common, messages, tools, thinking, _output_schema(body), choice, budget)


def _output_schema(body: dict) -> dict[str, Any] | None:
    """`output_config.format` {"type": "json_schema", "schema": {...}}: the schema the reply must match."""
    config = body.get("output_config")
    if config is None:
        return None
    if not isinstance(config, dict):
        raise type_error("output_config", "an object", config)
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise value_error("output_config.format", "expected {'type': 'json_schema', 'schema': {...}}")
    return fmt["schema"]


def _system(system: Any) -> list[dict[str, Any]]:
    """`system`: a string or text blocks, as the first template message (none when empty)."""
    text = text_content(system, "system")
    return [{"role": "system", "content": text}] if text else []


def _turns(body: dict) -> list[dict[str, Any]]:
    """`messages`: alternating user and assistant turns of a string or content blocks, as template messages (a
    user turn's `tool_result` blocks become `tool` messages, ahead of its text)."""
    turns = body.get("messages")
    if not isinstance(turns, list):
        if "messages" not in body:
            raise ApiError(400, "messages: Field required", param="messages", code="missing_required_parameter")
        raise type_error("messages", "an array", turns)
    if not turns:
        raise value_error("messages", "must not be empty")
    out: list[dict[str, Any]] = []
    for i, turn in enumerate(turns):
        where = f"messages.{i}"
        if not isinstance(turn, dict):
            raise type_error(where, "an object", turn)
        role = turn.get("role")
        if role not in ("user", "assistant"):
            raise value_error(f"{where}.role", f"must be 'user' or 'assistant', got {role!r}")
        content = turn.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise type_error(f"{where}.content", "a string or an array of content blocks", content)
        out += _user_turn(blocks, where) if role == "user" else [_assistant_turn(blocks, where)]
    return out


def _block(block: Any, where: str, kinds: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(block, dict):
        raise type_error(where, "a content block object", block)
    kind = block.get("type")
    if kind not in kinds:
        raise value_error(f"{where}.type", f"{kind!r} blocks are not supported here (supported: {', '.join(kinds)})")
    return block


def _string(block: dict, key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise type_error(f"{where}.{key}", "a string", value)
    return value


def _user_turn(blocks: list, where: str) -> list[dict[str, Any]]:
    results, text = [], []
    for j, raw in enumerate(blocks):
        at = f"{where}.content.{j}"
        block = _block(raw, at, ("text", "tool_result"))
        if block["type"] == "text":
            text.append(_string(block, "text", at))
            continue
        result = text_content(block.get("content"), f"{at}.content")
        if block.get("is_error") is True:
            result = f"Error: {result}"
        results.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id", at), "content": result})
    return results + ([{"role": "user", "content": "".join(text)}] if text or not results else [])


def _assistant_turn(blocks: list, where: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    calls, text, thinking = [], [], []
    for j, raw in enumerate(blocks):
        at = f"{where}.content.{j}"
        block = _block(raw, at, ("text", "tool_use", "thinking", "redacted_thinking"))
        if block["type"] == "text":
            text.append(_string(block, "text", at))
        elif block["type"] == "thinking":
            thinking.append(_string(block, "thinking", at))
        elif block["type"] == "tool_use":
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise type_error(f"{at}.input", "an object", arguments)
            calls.append({"id": _string(block, "id", at), "type": "function",
                          "function": {"name": _string(block, "name", at), "arguments": arguments}})
    message["content"] = "".join(text)
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _tools(body: dict) -> list[dict[str, Any]] | None:
    """`tools` (name, description, input_schema) as OpenAI function schemas; None without tools or with
    `tool_choice` `none`."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise type_error("tools", "an array", tools)
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise value_error(f"tools.{i}", "expected {'name': ..., 'input_schema': {...}}")
        if tool.get("type") not in (None, "custom"):
            raise value_error(f"tools.{i}.type", f"server tools ({tool['type']!r}) are not supported")
        schema = tool.get("input_schema", {"type": "object"})
        check_tool_parameters(schema, f"tools.{i}.input_schema")
        function = {"name": tool["name"], "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        if tool.get("strict") is True:
            function["strict"] = True
        out.append({"type": "function", "function": function})
    if _tool_choice_type(body) == "none":
        return None
    return out or None


def _tool_choice_type(body: dict) -> str:
    """`tool_choice`'s type ("auto" when absent)."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto"
    if not (isinstance(choice, dict) and choice.get("type") in ("auto", "any", "tool", "none")):
        raise value_error("tool_choice", "expected {'type': 'auto' | 'any' | 'tool' | 'none'}")
    return choice["type"]


def _tool_choice(body: dict, tools: list[dict[str, Any]] | None) -> ToolChoice:
    """`tool_choice` {"type": "auto" | "any" | "tool" (with its `name`) | "none"} and its
    `disable_parallel_tool_use`."""
    kind = _tool_choice_type(body)
    choice = body.get("tool_choice") or {}
    disable = choice.get("disable_parallel_tool_use", False)
    if not isinstance(disable, bool):
        raise type_error("tool_choice.disable_parallel_tool_use", "a boolean", disable)
    parallel = not disable
    if kind in ("auto", "none"):
        return ToolChoice(parallel=parallel)
    if not tools:
        raise value_error("tool_choice", "asks for a tool call, but the request has no tools")
    name = choice.get("name") if kind == "tool" else None
    if kind == "tool" and not isinstance(name, str):
        raise type_error("tool_choice.name", "a string", name)
    if kind == "tool" and name not in {t["function"]["name"] for t in tools}:
        raise value_error("tool_choice.name", f"{name!r} is not among the tools")
    return ToolChoice(required=True, name=name, parallel=parallel)


THINKING_ON = ("enabled", "adaptive", "between_tools")  # `thinking` types that turn GLM's thinking on


def _thinking(thinking: Any) -> tuple[bool, int | None]:
    """`thinking`: {"type": "enabled" | "adaptive" | "between_tools"} turns GLM's thinking on, `budget_tokens` (an
    integer of at least 1, optional) the most tokens it may think before the block is closed; absent or
    {"type": "disabled"}: off. (on, budget)."""
    if thinking is None:
        return False, None
    if not isinstance(thinking, dict) or thinking.get("type") not in (*THINKING_ON, "disabled"):
        raise value_error("thinking", f"expected {{'type': {' | '.join(repr(t) for t in THINKING_ON)} | 'disabled'}}")
    on = thinking["type"] in THINKING_ON
    return on, parse_thinking_budget(thinking) if on else None


# ---- reply -> content blocks -------------------------------------------------------------------------

def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": call.arguments}


def stop_reason(done: Done, calls: list[ToolCall]) -> str:
    """Anthropic's `stop_reason` for how generation ended."""
    if calls:
        return "tool_use"
    if done.stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if done.finish_reason == "length" else "end_turn"


def usage_of(done: Done) -> dict[str, int]:
    """Anthropic's usage: `input_tokens` excludes the prompt tokens read from the prefix cache."""
    return {"input_tokens": done.prompt_tokens - done.cached_tokens, "output_tokens": done.completion_tokens,
            "cache_read_input_tokens": done.cached_tokens, "cache_creation_input_tokens": 0}


def message_body(message_id: str, model: str, pieces: list[tuple[str, str]], content: str, calls: list[ToolCall],
                 done: Done) -> dict[str, Any]:
    """A whole reply: its thinking (from ChatText's `reasoning` pieces), text and tool_use blocks."""
    blocks: list[dict[str, Any]] = []
    thinking = "".join(text for kind, text in pieces if kind == "reasoning")
    if thinking:
        blocks.append({"type": "thinking", "thinking": thinking, "signature": ""})
    if content:
        blocks.append({"type": "text", "text": content})
    blocks += [tool_use_block(call) for call in calls]
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": stop_reason(done, calls), "stop_sequence": done.stop_sequence, "usage": usage_of(done)}


def event(name: str, payload: dict[str, Any]) -> str:
    """One server-sent event of Anthropic's stream (named, its type repeated in the data)."""
    return f"event: {name}\ndata: {json.dumps({'type': name, **payload}, ensure_ascii=False)}\n\n"


class MessageEvents:
    """A streamed reply as Anthropic's events: a block opens when its kind of text first arrives (thinking, then
    text) and closes when another kind starts; tool calls, parsed at the end, are one block each."""

    def __init__(self, message_id: str, model: str, prompt_tokens: int) -> None:
        self.message_id, self.model, self.prompt_tokens = message_id, model, prompt_tokens
        self.index = -1
        self.open: str | None = None  # the kind of the open block: reasoning | content

    def start(self) -> str:
        message = {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}
        return event("message_start", {"message": message})

    def text(self, kind: str, text: str) -> list[str]:
        """Events for a piece of `kind` (reasoning | content) of the reply."""
        out = []
        if self.open != kind:
            out += self._close()
            self.index += 1
            self.open = kind
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "reasoning" else \
                {"type": "text", "text": ""}
            out.append(event("content_block_start", {"index": self.index, "content_block": block}))
        delta = {"type": "thinking_delta", "thinking": text} if kind == "reasoning" else \
            {"type": "text_delta", "text": text}
        out.append(event("content_block_delta", {"index": self.index, "delta": delta}))
        return out

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        out = []
        if self.open == "reasoning":  # GLM's thinking carries no signature; Anthropic's stream always sends one
            out.append(event("content_block_delta", {"index": self.index,
                                                     "delta": {"type": "signature_delta", "signature": ""}}))
        self.open = None
        return out + [event("content_block_stop", {"index": self.index})]

    def finish(self, calls: list[ToolCall], done: Done) -> list[str]:
        """The closing events: the open block's stop, a block per tool call, the stop reason and usage."""
        out = self._close()
        for call in calls:
            self.index += 1
            block = {**tool_use_block(call), "input": {}}
            out.append(event("content_block_start", {"index": self.index, "content_block": block}))
            partial = json.dumps(call.arguments, ensure_ascii=False)
            out.append(event("content_block_delta", {"index": self.index,
                                                     "delta": {"type": "input_json_delta", "partial_json": partial}}))
            out.append(event("content_block_stop", {"index": self.index}))
        out.append(event("message_delta", {"delta": {"stop_reason": stop_reason(done, calls),
                                                     "stop_sequence": done.stop_sequence},
                                           "usage": usage_of(done)}))
        return out + [event("message_stop", {})]


def error_event(error: ApiError) -> str:
    """A failure mid-stream, as Anthropic's `error` event."""
    return f"event: error\ndata: {json.dumps(error_body(error.status, error.message))}\n\n"
