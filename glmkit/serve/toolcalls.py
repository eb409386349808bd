"""GLM tool calls: OpenAI `tools` / `tool_calls` <-> the text GLM-4.5+ / GLM-5 models read and write.

GLM emits one block per call, the function name first, then key/value pairs (string values raw, others
as JSON); GLM-4.5 puts newlines between the parts, later templates none:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

The snapshot's chat template renders `tools`, assistant `tool_calls` and `tool` messages itself when it
knows them (real GLM templates do). For a template that does not (the test fixtures'),
`prepare_messages` folds them into plain message text in the same format, so the model sees the same
thing either way.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta

from glmkit.generate.tokenizer import BoundedSandbox

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
ARG_KEY_OPEN, ARG_KEY_CLOSE = "<arg_key>", "</arg_key>"
ARG_VALUE_OPEN, ARG_VALUE_CLOSE = "<arg_value>", "</arg_value>"
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.S)
_ARG = re.compile(f"{ARG_KEY_OPEN}(.*?){ARG_KEY_CLOSE}\\s*{ARG_VALUE_OPEN}(.*?){ARG_VALUE_CLOSE}", re.S)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = "call_" + uuid.uuid4().hex[:24]

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's `tool_calls[]` entry (arguments as a JSON string); with `index` a streaming delta."""
        entry: dict[str, Any] = {"id": self.id, "type": "function",
                                 "function": {"name": self.name,
                                              "arguments": json.dumps(self.arguments, ensure_ascii=False)}}
        return entry if index is None else {"index": index, **entry}


# ---- model text -> calls ------------------------------------------------------------------------

def parse_tool_calls(text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str, list[ToolCall]]:
    """Split generated text into (the text outside complete `<tool_call>` blocks, the calls).

    A value becomes JSON (number, object, ...) unless the tool's JSON schema says the parameter is a
    string or it does not parse as JSON. A block without a name, or an unclosed one (generation cut
    off), stays in the text.
    """
    schemas = _parameter_schemas(tools or [])
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    for match in _BLOCK.finditer(text):
        body = match.group(1)
        cut = body.find(ARG_KEY_OPEN)
        name = (body if cut < 0 else body[:cut]).strip()
        if not name or "<" in name:
            continue
        properties = schemas.get(name, {})
        arguments = {key.strip(): _value(value, properties.get(key.strip())) for key, value in _ARG.findall(body)}
        kept.append(text[pos:match.start()])
        pos = match.end()
        calls.append(ToolCall(name, arguments))
    kept.append(text[pos:])
    return "".join(kept).strip(), calls


def _parameter_schemas(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{function name: {parameter: its JSON schema}} (the schemas of `parameters.properties`)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        out[function["name"]] = {key: spec for key, spec in (properties or {}).items() if isinstance(spec, dict)}
    return out


def raw_string(schema: dict[str, Any] | None) -> bool:
    """Whether a parameter's value is written as its bare text (its schema's `type` is "string", or a list of types
    with "string" and neither "object" nor "array"), not as JSON."""
    kind = (schema or {}).get("type")
    return kind == "string" or (isinstance(kind, list) and "string" in kind and not {"object", "array"} & set(kind))


def _value(raw: str, schema: dict[str, Any] | None) -> Any:
    if raw_string(schema):
        return raw
    try:
        return json.loads(raw.strip())
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's recursion limit: kept as text
        return raw


# ---- calls -> model text (for templates that do not render tools themselves) ---------------------

def render_tool_call(name: str, arguments: dict[str, Any]) -> str:
    parts = [TOOL_CALL_OPEN + name]
    for key, value in arguments.items():
        shown = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        parts.append(f"\n<arg_key>{key}</arg_key>\n<arg_value>{shown}</arg_value>")
    return "".join(parts) + "\n" + TOOL_CALL_CLOSE


def tools_system_text(tools: list[dict[str, Any]]) -> str:
    """The tool list as GLM's templates present it in the system turn."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, output the function name and arguments within the following XML format:\n"
            "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n"
            "<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>")


@dataclass(frozen=True)
class TemplateSupport:
    tools: bool  # reads the `tools` variable
    tool_calls: bool  # renders assistant messages' `tool_calls`

    @classmethod
    def of(cls, template: str | None) -> TemplateSupport:
        if not template:
            return cls(False, False)
        try:
            # the bounded sandbox: its intercepted operators are never folded, so analysing a hostile template's
            # constants (e.g. 'x' * 10 ** 10) builds nothing
            names = jinja2.meta.find_undeclared_variables(BoundedSandbox().parse(template))
        except jinja2.TemplateError:
            names = set()
        return cls("tools" in names, "tool_calls" in template)


def prepare_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     support: TemplateSupport) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages (already normalized: string content, tool-call arguments as dicts) and the `tools` value
    for the template. What the template cannot render is folded into message text in GLM's format."""
    out = [dict(m) for m in messages]
    if tools and not support.tools:
        text = tools_system_text(tools)
        if out and out[0].get("role") == "system":
            out[0]["content"] = (out[0].get("content") or "") + "\n\n" + text
        else:
            out.insert(0, {"role": "system", "content": text})
        tools = None
    if not support.tool_calls:
        for m in out:
            calls = m.pop("tool_calls", None)
            if calls:
                rendered = "".join(render_tool_call(c["function"]["name"], c["function"]["arguments"]) for c in calls)
                m["content"] = ((m.get("content") or "") + "\n" + rendered).lstrip("\n")
        for m in out:
            if m.get("role") == "tool":
                m["content"] = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
    return out, tools
