"""GLM tool calls as a grammar: what a request's `tool_choice` and strict tools hold a reply to.

A reply that must call a tool (OpenAI's `tool_choice` "required" or a named function; Anthropic's `any` or `tool`)
is one call from its first token, or several where parallel calls are allowed. A reply with strict tools
(`strict: true`) and no forced call is free text in which every `<tool_call>` block is a well-formed call of a listed
tool. The arguments of a strict tool follow its `parameters` schema in toolcalls.py's format: its declared keys in
their order, the required ones always, a string parameter's bare text (`raw_string`) and any other value as JSON
that matches its schema; a tool that is not strict takes any keys and values. With `reasoning` the reply starts
inside the thinking block: any text up to `</think>` comes first (with a thinking budget: at most that many tokens
of it, where `</think>` is one added token).

The grammar is llguidance's Lark dialect, each JSON value's schema inlined (`%json`). A marker that is one added
token of the vocabulary (as GLM-5's `</think>` is) is written as that token: llguidance matches an added token only
as itself, never as the bytes of its text, and free text (thinking included) then holds no added token.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from glmkit.generate.tokenizer import THINK_CLOSE
from glmkit.serve.toolcalls import (
    ARG_KEY_CLOSE,
    ARG_KEY_OPEN,
    ARG_VALUE_CLOSE,
    ARG_VALUE_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    raw_string,
)

MARKERS = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, ARG_KEY_OPEN, ARG_KEY_CLOSE, ARG_VALUE_OPEN, ARG_VALUE_CLOSE, THINK_CLOSE)
ANY_TEXT = "(?s:.*)"
SEP = '"\\n"?'  # GLM-4.5 writes a newline between a call's parts, later templates none
# a raw string's largest minLength / maxLength: past any context's reach, within the grammar library's u32 counts
MAX_STRING_LENGTH = 10**9


@dataclass(frozen=True)
class ToolChoice:
    """A request's `tool_choice`: whether the reply must start with a call (`required`), of which tool (`name`; None:
    any listed one), and whether it may make several (`parallel`)."""

    required: bool = False
    name: str | None = None
    parallel: bool = True


def needs_grammar(tools: list[dict[str, Any]] | None, choice: ToolChoice) -> bool:
    """Whether the reply is constrained: a forced call, or a strict tool among `tools`."""
    return bool(tools) and (choice.required or any(_function(t).get("strict") is True for t in tools or []))


def tool_call_grammar(tools: list[dict[str, Any]], choice: ToolChoice, reasoning: bool,
                      token_ids: dict[str, int], thinking_budget: int | None = None) -> str:
    """The Lark grammar of a reply to a request with these `tools` (OpenAI function entries) and `choice`.
    token_ids: the markers (MARKERS) that are one added token each, and its id; thinking_budget: with `reasoning`,
    the most tokens of thinking (where `</think>` is one of those tokens; else not held). Raises ValueError naming
    the tool and parameter when a strict tool's schema holds what the format cannot enforce (a raw string's
    `pattern`) or is malformed (`required` not an array of its properties' names; a raw string's `enum` not an
    array, its `minLength` / `maxLength` not integers from 0 to MAX_STRING_LENGTH)."""
    lark = _Lark(token_ids)
    functions = [_function(t) for t in tools]
    if choice.name is not None:
        functions = [f for f in functions if f.get("name") == choice.name]
        if not functions:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools")
    body = lark.rule(" | ".join(lark.call_body(f) for f in functions))  # a call past its opening marker
    if choice.required:
        call = f"{lark.marker(TOOL_CALL_OPEN)} {body}"
        answer = f"{SEP} {call}" + (f" ({SEP} {call})*" if choice.parallel else "")
    else:  # free text; past each opening marker, a call
        head = lark.until(TOOL_CALL_OPEN)
        if TOOL_CALL_OPEN in token_ids:
            tail = lark.terminal(f"/{ANY_TEXT}/")
        else:  # text that does not open a call (else a call could hide in it, unchecked)
            tail = lark.terminal(f"/{ANY_TEXT}/ & ~/{ANY_TEXT}{_regex(TOOL_CALL_OPEN)}{ANY_TEXT}/")
        answer = f"({head} {body}){'*' if choice.parallel else '?'} {tail}"
    start = f"{lark.until(THINK_CLOSE, max_tokens=thinking_budget)} {answer}" if reasoning else answer
    return "\n".join([f"start: {start}", *lark.rules])


def _function(tool: Any) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) else None
    return function if isinstance(function, dict) else {}


def _regex(text: str) -> str:
    """`text` as a regex inside Lark's /.../ (its slashes escaped too)."""
    return re.escape(text).replace("/", "\\/")


class _Lark:
    """The rules of one grammar as they are made (`r0`, `r1`, ...; terminals `T0`, ...)."""

    def __init__(self, token_ids: dict[str, int]) -> None:
        self.token_ids = token_ids
        self.rules: list[str] = []

    def rule(self, body: str, options: str = "") -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}{options}: {body}")
        return name

    def terminal(self, body: str) -> str:
        name = f"T{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def marker(self, text: str) -> str:
        return f"<[{self.token_ids[text]}]>" if text in self.token_ids else json.dumps(text)

    def until(self, marker: str, text: str = ANY_TEXT, max_tokens: int | None = None) -> str:
        """Text matching the regex `text`, then `marker`, the first time it comes; with `max_tokens` and a marker
        that is one token, at most that many tokens of text (then the marker)."""
        if marker in self.token_ids:  # the token ends the text: it has no bytes to match
            options = f"[max_tokens={max_tokens}]" if max_tokens else ""
            return f"{self.rule(f'/{text}/', options)} {self.marker(marker)}"
        return self.rule(f"/{text}{_regex(marker)}/", "[lazy]")

    def call_body(self, function: dict[str, Any]) -> str:
        """A call of `function` past its opening marker: the name, the arguments, the closing marker."""
        name = function.get("name")
        if function.get("strict") is True:
            arguments = self._strict_arguments(name, function.get("parameters"))
        else:  # any keys, any values
            key = self.until(ARG_KEY_CLOSE, "[^<]*")
            arguments = f"({self._argument_head()} {key} {SEP} {self.marker(ARG_VALUE_OPEN)} " \
                        f"{self.until(ARG_VALUE_CLOSE)})*"
        return self.rule(f"{json.dumps(name)} {arguments} {SEP} {self.marker(TOOL_CALL_CLOSE)}")

    def _argument_head(self) -> str:
        return f"{SEP} {self.marker(ARG_KEY_OPEN)}"

    def _strict_arguments(self, name: str, parameters: Any) -> str:
        where = f"tool {name!r}"
        parameters = {"type": "object"} if parameters is None else parameters
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object" or \
                {"anyOf", "oneOf", "allOf", "$ref", "not"} & set(parameters):
            raise ValueError(f"{where}: a strict tool's parameters must be an object schema with properties")
        properties, required = parameters.get("properties") or {}, parameters.get("required") or []
        if not isinstance(properties, dict) or not isinstance(required, list) or \
                not all(isinstance(key, str) for key in required):
            raise ValueError(f"{where}: parameters.properties must be an object and required an array of strings")
        missing = [key for key in required if key not in properties]
        if missing:
            raise ValueError(f"{where}: required {missing[0]!r} is not among its properties")
        defs = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}  # what a value's $ref names
        parts = []
        for key, schema in properties.items():
            if not isinstance(schema, dict):
                raise ValueError(f"{where}: parameter {key!r} has no schema object")
            value = self._value(schema, defs, f"{where}, parameter {key!r}")
            argument = self.rule(f"{self._argument_head()} {json.dumps(key)} {self.marker(ARG_KEY_CLOSE)} {SEP} "
                                 f"{self.marker(ARG_VALUE_OPEN)} {value}")
            parts.append(argument if key in required else f"{argument}?")
        return " ".join(parts)

    def _value(self, schema: dict[str, Any], defs: dict[str, Any], where: str) -> str:
        """One argument's value and the closing marker."""
        close = self.marker(ARG_VALUE_CLOSE)
        if not raw_string(schema):
            compact = {**defs, **schema, "x-guidance": {"whitespace_flexible": False}}  # as json_grammar's
            return f"{self.rule('%json ' + json.dumps(compact))} {close}"
        if "pattern" in schema:
            raise ValueError(f"{where}: a string argument's pattern cannot be enforced (it is written as bare text)")
        choices = [schema["const"]] if "const" in schema else schema.get("enum")
        if choices is not None:
            if not isinstance(choices, list):
                raise ValueError(f"{where}: enum must be an array")
            texts = [c for c in choices if isinstance(c, str)]
            if not texts:
                raise ValueError(f"{where}: no string among its enum")
            return f"({' | '.join(json.dumps(t) for t in texts)}) {close}"
        least, most = _string_length(schema, "minLength", where) or 0, _string_length(schema, "maxLength", where)
        if most is not None and least > most:
            raise ValueError(f"{where}: minLength {least} is more than maxLength {most}")
        length = "" if least == 0 and most is None else f"{{{least},{'' if most is None else most}}}"
        return self.until(ARG_VALUE_CLOSE, f"(?s:.){length}" if length else ANY_TEXT)


def _string_length(schema: dict[str, Any], keyword: str, where: str) -> int | None:
    """A raw string's `minLength` or `maxLength` (None: not given); a ValueError naming it unless it is an integer
    from 0 to MAX_STRING_LENGTH."""
    value = schema.get(keyword)
    length = int(value) if isinstance(value, float) and value.is_integer() else value
    if length is not None and (isinstance(length, bool) or not isinstance(length, int)
                               or not 0 <= length <= MAX_STRING_LENGTH):
        raise ValueError(f"{where}: {keyword} must be an integer from 0 to {MAX_STRING_LENGTH}, got {value!r}")
    return length
