"""Chat requests' own fields: `messages` and `tools` into what the chat template reads, and a chat reply's text
back into reasoning, content and tool calls."""

from __future__ import annotations

from typing import Any

from glmkit.generate.tokenizer import THINK_CLOSE
from glmkit.serve.protocol import (
    ApiError,
    opt_bool,
    parse_json_object,
    parse_thinking_budget,
    type_error,
    value_error,
)
from glmkit.serve.tool_grammar import ToolChoice
from glmkit.serve.toolcalls import TOOL_CALL_OPEN, ToolCall, parse_tool_calls

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


# ---- request -> template variables ----------------------------------------------------------------

def text_content(value: Any, name: str) -> str:
    """A message's `content`: a string, or an array of text parts joined."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise value_error(f"{name}[{i}]", "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise type_error(name, "a string or an array of content parts", value)


def parse_messages(body: dict) -> list[dict[str, Any]]:
    """`messages` normalized for the template: known roles, string content, tool-call arguments as dicts."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        if "messages" not in body:
            raise ApiError(400, "Missing required parameter: 'messages'.", param="messages",
                           code="missing_required_parameter")
        raise type_error("messages", "an array", messages)
    if not messages:
        raise value_error("messages", "must not be empty")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise type_error(where, "an object", m)
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise value_error(f"{where}.role", f"unknown role {role!r}")
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
        raise type_error(name, "an array", calls)
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise value_error(f"{name}[{i}]", "expected {'type': 'function', 'function': {'name', 'arguments'}}")
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            arguments = parse_json_object(arguments, f"{name}[{i}].function.arguments")
        elif not isinstance(arguments, dict):
            raise value_error(f"{name}[{i}].function.arguments", "must be a JSON object")
        out.append({"id": call.get("id") or f"call_{i}", "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


def parse_tools(body: dict) -> list[dict[str, Any]] | None:
    """`tools` (OpenAI function schemas), None when absent, empty or switched off by `tool_choice: "none"`."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise type_error("tools", "an array", tools)
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise value_error(f"tools[{i}]", "expected {'type': 'function', 'function': {'name': ...}}")
        if function.get("parameters") is not None:
            check_tool_parameters(function["parameters"], f"tools[{i}].function.parameters")
    choice = body.get("tool_choice")
    if choice == "none":
        return None
    return tools or None


def check_tool_parameters(parameters: Any, where: str) -> None:
    """400 naming the field for a tool's parameter schema (the field `where`) that its calls' arguments cannot be
    read against: not an object, `properties` not an object, or a property's `type` neither a string nor an array
    of strings."""
    if not isinstance(parameters, dict):
        raise type_error(where, "an object", parameters)
    properties = parameters.get("properties")
    if properties is None:
        return
    if not isinstance(properties, dict):
        raise type_error(f"{where}.properties", "an object", properties)
    for key, schema in properties.items():
        kind = schema.get("type") if isinstance(schema, dict) else None
        if not (kind is None or isinstance(kind, str) or
                (isinstance(kind, list) and all(isinstance(k, str) for k in kind))):
            raise value_error(f"{where}.properties.{key}.type", "must be a string or an array of strings")


def parse_tool_choice(body: dict, tools: list[dict[str, Any]] | None) -> ToolChoice:
    """`tool_choice` ("auto", "required" or {"type": "function", "function": {"name": ...}}; "none" is
    `parse_tools`' business) and `parallel_tool_calls` (default true)."""
    choice, parallel = body.get("tool_choice"), opt_bool(body, "parallel_tool_calls", True)
    if choice in (None, "auto", "none"):
        return ToolChoice(parallel=parallel)
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if choice != "required" and not isinstance(name, str):
        raise value_error("tool_choice", "expected 'none', 'auto', 'required' or "
                                         "{'type': 'function', 'function': {'name': ...}}")
    if not tools:
        raise value_error("tool_choice", "asks for a tool call, but the request has no tools")
    if name is not None and name not in {t["function"]["name"] for t in tools}:
        raise value_error("tool_choice", f"names {name!r}, which is not among the tools")
    return ToolChoice(required=True, name=name, parallel=parallel)


def parse_response_format(body: dict) -> tuple[bool, dict[str, Any] | None]:
    """`response_format`: (whether the reply is constrained to JSON, the JSON schema it must match; None: any JSON
    object). `text` or absent: not constrained."""
    fmt = body.get("response_format")
    if fmt is None:
        return False, None
    if not isinstance(fmt, dict):
        raise type_error("response_format", "an object", fmt)
    kind = fmt.get("type")
    if kind == "text":
        return False, None
    if kind == "json_object":
        return True, None
    if kind != "json_schema":
        raise value_error("response_format.type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise type_error("response_format.json_schema", "an object", spec)
    schema = spec.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise type_error("response_format.json_schema.schema", "an object", schema)
    return True, schema


def template_variables(body: dict) -> tuple[bool, dict[str, Any], int | None]:
    """(enable_thinking, the other variables for the template, the thinking budget): thinking from
    `chat_template_kwargs` (vLLM's and SGLang's way), else a top-level `enable_thinking`, else GLM's own API's
    `thinking: {"type": "enabled" | "disabled"}`, on by default; the budget from `thinking.budget_tokens` (glm-serve's
    extension, as Anthropic's API has it)."""
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise type_error("chat_template_kwargs", "an object", kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("messages", "tools", "add_generation_prompt")}
    glm = body.get("thinking")
    if glm is not None and not (isinstance(glm, dict) and glm.get("type") in ("enabled", "disabled")):
        raise value_error("thinking", "expected {'type': 'enabled' | 'disabled'}")
    budget = None if glm is None else parse_thinking_budget(glm)
    for name, thinking in (("chat_template_kwargs.enable_thinking", kwargs.pop("enable_thinking", None)),
                           ("enable_thinking", body.get("enable_thinking"))):
        if thinking is not None and not isinstance(thinking, bool):
            raise type_error(name, "a boolean", thinking)
        if thinking is not None:
            return thinking, kwargs, budget
    return glm is None or glm["type"] == "enabled", kwargs, budget


# ---- reply text -> message parts ----------------------------------------------------------------

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
            marker = THINK_CLOSE if self.mode == "reasoning" else TOOL_CALL_OPEN if self.tools else None
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


def closing_pieces(router: ChatText, tools: list[dict[str, Any]] | None
                   ) -> tuple[list[tuple[str, str]], list[ToolCall]]:
    """A streamed reply's end: the text ChatText held back (tool-call text that parsed into no call, or what is
    left around the calls, as content) and the tool calls."""
    rest, tool_text = router.finish()
    leftover, calls = parse_tool_calls(tool_text, tools) if tool_text else ("", [])
    if leftover or (tool_text and not calls):
        rest.append(("content", leftover if calls else tool_text))
    return rest, calls


def chat_parts(pieces: list[tuple[str, str]], tool_text: str, tools: list[dict[str, Any]] | None
               ) -> tuple[str, list[ToolCall]]:
    """A whole reply's (content, tool calls) from ChatText's pieces and tool-call text."""
    content = "".join(text for kind, text in pieces if kind == "content")
    if not tool_text:
        return content, []
    leftover, calls = parse_tool_calls(tool_text, tools)
    if not calls:
        return content + tool_text, []
    return (content + ("\n" if content and leftover else "") + leftover).strip(), calls
