"""Text <-> token ids, the snapshot's chat template, and streaming detokenization."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer

from glmkit.errors import GlmkitError


class ChatTokenizer:
    """The snapshot's `tokenizer.json` plus its jinja2 chat template (from tokenizer_config.json)."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise GlmkitError(f"{path}: tokenizer missing from the snapshot")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise GlmkitError(f"{path}: cannot load tokenizer ({e})") from None
        self.chat_template = _load_chat_template(directory)

    def encode(self, text: str) -> list[int]:
        """Plain text (special-token strings like `<|user|>` become their ids)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def render_chat(self, messages: list[dict[str, Any]], enable_thinking: bool = True,
                    add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None,
                    **template_kwargs: Any) -> str:
        """`tools` (OpenAI function schemas) and `template_kwargs` are template variables, as in transformers."""
        if self.chat_template is None:
            raise GlmkitError("this snapshot has no chat template (tokenizer_config.json 'chat_template')")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_template_error
        env.filters["tojson"] = _tojson  # transformers' version: GLM templates call tojson(ensure_ascii=False)
        variables = {**template_kwargs, "messages": messages, "add_generation_prompt": add_generation_prompt,
                     "enable_thinking": enable_thinking, "tools": tools}
        try:
            return env.from_string(self.chat_template).render(**variables)
        except jinja2.TemplateError as e:
            raise GlmkitError(f"chat template failed: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as e:  # e.g. a filter given the wrong type
            raise GlmkitError(f"chat template failed: {type(e).__name__}: {e}") from None

    def encode_chat(self, messages: list[dict[str, Any]], enable_thinking: bool = True, **kwargs: Any) -> list[int]:
        return self.encode(self.render_chat(messages, enable_thinking, **kwargs))


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _load_chat_template(directory: Path) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        template = json.loads(config.read_text()).get("chat_template")
    except (json.JSONDecodeError, AttributeError):
        raise GlmkitError(f"{config}: not a valid JSON object") from None
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


class StreamDecoder:
    """Turns a growing list of token ids into text pieces without ever emitting broken UTF-8.

    Decodes a short window of recent tokens and emits only the new suffix once it no longer ends in
    a replacement character (an incomplete multi-byte sequence split across tokens).
    """

    def __init__(self, tokenizer: ChatTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_start = 0  # window start: decoding from here gives stable text
        self.emitted_upto = 0  # tokens whose text has been emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_start:self.emitted_upto])
        text = self.tokenizer.decode(self.ids[self.prefix_start:])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self.prefix_start = self.emitted_upto
        self.emitted_upto = len(self.ids)
        return text[len(prefix):]

    def flush(self) -> str:
        """Whatever is left at the end of generation (may contain a replacement character)."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_start:self.emitted_upto])
        text = self.tokenizer.decode(self.ids[self.prefix_start:])
        self.prefix_start = self.emitted_upto = len(self.ids)
        return text[len(prefix):]
