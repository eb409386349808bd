"""OpenAI's wire format for glm-serve: errors, the request body, the fields both completion routes share, and
the pieces of a response (usage, timings, server-sent events).

Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`. Request bodies are parsed and
checked by hand (no schema library): a wrong type is a 400 naming the field.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from glmkit.format.files import MAX_JSON_DEPTH
from glmkit.generate.engine import Engine
from glmkit.generate.sampling import SamplingParams, TokenLogprob
from glmkit.serve.scheduler import Done

MAX_STOP_SEQUENCES = 16
MAX_TOP_LOGPROBS = 20  # OpenAI's bound (chat)
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound (/v1/completions)
MAX_STOP_CHARS = 1024  # each generated token is checked against every prefix of every stop sequence
MAX_LOGIT_BIAS = 1024  # tokens one request may bias
ANY_MODEL = "*"  # a model alias that answers to every model id (`glm-serve --model-alias`)
GREEDY_BELOW = 1e-5  # a lower temperature is greedy decoding (and logits / T would overflow near 1e-300)
# No natural text averages more characters a token: a prompt longer than the context times this cannot fit,
# and is refused without being tokenized (tokenizing takes about 2 s a megabyte).
PROMPT_CHARS_PER_TOKEN = 16


@dataclass
class SamplingDefaults:
    """Used when a request leaves a field out (glm-serve reads them from generation_config.json)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code)

    def to_json(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _ErrorJSON(JSONResponse):
    """An error body in ASCII: whatever an error message quotes from the request, it encodes."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return _ErrorJSON({"error": {"message": message, "type": type_, "param": param, "code": code}},
                      status_code=status)


def internal_error() -> ApiError:
    """A server bug: the client learns only that (the details go to the server's log)."""
    return ApiError(500, "internal server error (see the server log)", "server_error", code="internal_error")


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; retry on another instance or later", "server_error",
                    code="server_shutting_down")


def unknown_model(name: str) -> ApiError:
    return ApiError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


# ---- the request body -----------------------------------------------------------------------------

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
    try:
        async for chunk in request.stream():
            received += len(chunk)
            if received > drain_limit:
                raise too_large
            if received <= limit:
                body += chunk
    except ClientDisconnect:
        raise ApiError(400, "the client went away while sending the body", code="client_disconnected") from None
    if received > limit:
        raise too_large
    return parse_json_object(body)


def parse_json_object(text: str | bytes, name: str | None = None) -> dict[str, Any]:
    """JSON text from the client as an object: the request body, or the string field `name` that holds JSON. A 400
    naming it for text that is not JSON, holds no object, or fails `check_json_values` (MAX_JSON_DEPTH)."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _json_error(name, f"is not valid JSON ({e})") from None
    except ValueError:  # the only other error json.loads raises: Python's cap on an integer's digits
        raise _json_error(name, f"is not valid JSON (an integer has more than {sys.get_int_max_str_digits()} "
                                "digits)") from None
    except RecursionError:  # nested past the parser's own recursion limit
        raise _too_deep(name, MAX_JSON_DEPTH) from None
    if not isinstance(data, dict):
        raise _json_error(name, "must be a JSON object")
    check_json_values(data, MAX_JSON_DEPTH, name)
    return data


def check_json_values(data: dict[str, Any], max_depth: int, name: str | None = None) -> None:
    """400 for a JSON object (the request body, or the string field `name` decoded) nested deeper than `max_depth`
    objects and arrays or holding a string with an unpaired UTF-16 surrogate escape (valid JSON, but no Unicode
    text: nothing downstream can encode it)."""
    level: list[Any] = [data]
    for _ in range(max_depth):
        nested: list[Any] = []
        for value in level:
            items = value.values() if isinstance(value, dict) else value
            for item in items:
                if isinstance(item, dict | list):
                    nested.append(item)
                elif isinstance(item, str) and not item.isascii():
                    _check_text(item, name)
            if isinstance(value, dict):
                for key in value:
                    if not key.isascii():
                        _check_text(key, name)
        if not nested:
            return
        level = nested
    raise _too_deep(name, max_depth)


def _json_error(name: str | None, problem: str) -> ApiError:
    """A 400 for JSON from the client: the request body's, or that of the string field `name`."""
    subject = "the request body" if name is None else f"'{name}'"
    return ApiError(400, f"{subject} {problem}", param=name, code="invalid_json")


def _too_deep(name: str | None, max_depth: int) -> ApiError:
    return _json_error(name, f"is nested more than {max_depth} levels deep")


def _check_text(text: str, name: str | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _json_error(name, "holds a string with an unpaired UTF-16 surrogate escape (\\ud800-\\udfff)"
                          ) from None


_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
               dict: "an object", type(None): "null"}


def type_error(name: str, expected: str, value: Any) -> ApiError:
    got = _TYPE_NAMES.get(type(value), type(value).__name__)
    return ApiError(400, f"Invalid type for '{name}': expected {expected}, but got {got} instead.", param=name,
                    code="invalid_type")


def value_error(name: str, message: str) -> ApiError:
    return ApiError(400, f"Invalid value for '{name}': {message}", param=name, code="invalid_value")


def opt_int(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise type_error(name, "an integer", value)
    return value


def opt_number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise type_error(name, "a number", value)
    return float(value)


def opt_bool(body: dict, name: str, default: bool = False, where: str | None = None) -> bool:
    """`body[name]` as a boolean (`default` when absent); `where`: the field's full name in errors (default `name`)."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise type_error(where or name, "a boolean", value)
    return value


# ---- what chat and plain completions share -----------------------------------------------------------

@dataclass
class Common:
    """What chat and plain completions share."""

    stream: bool
    include_usage: bool
    max_tokens: int | None
    params: SamplingParams
    stop: tuple[str, ...]
    ignore_eos: bool
    logprobs: int | None = None  # chat: report each token's logprob and this many likeliest (None: not asked)


def check_model(body: dict, model_names: frozenset[str]) -> None:
    """404 for a request naming a model not in `model_names` (naming none is fine; "*" among them: any name)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise type_error("model", "a string", model)
    if model and model not in model_names and ANY_MODEL not in model_names:
        raise unknown_model(model)


def parse_thinking_budget(thinking: dict) -> int | None:
    """`thinking.budget_tokens`: the most tokens a reply may think (an integer of at least 1), or None."""
    budget = thinking.get("budget_tokens")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)):
        raise type_error("thinking.budget_tokens", "an integer", budget)
    if budget is not None and budget < 1:
        raise value_error("thinking.budget_tokens", f"must be at least 1, got {budget}")
    return budget


def parse_logit_bias(body: dict, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """`logit_bias`: an object of token ids (as strings) to biases in [-100, 100], at most MAX_LOGIT_BIAS of them."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise type_error("logit_bias", "an object", value)
    if len(value) > MAX_LOGIT_BIAS:
        raise value_error("logit_bias", f"at most {MAX_LOGIT_BIAS} tokens, got {len(value)}")
    out = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 9 and int(key) < vocab_size):
            raise value_error("logit_bias", f"{key[:20]!r} is not a token id of this model (0-{vocab_size - 1})")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise value_error("logit_bias", f"the bias of token {key} must be a number in [-100, 100]")
        out.append((int(key), float(bias)))
    return tuple(out)


def parse_common(body: dict, model_names: frozenset[str], defaults: SamplingDefaults, vocab_size: int,
                 chat: bool = False) -> Common:
    """The shared fields of a request to a model of `model_names` (`vocab_size` token ids); `defaults` fill in the
    sampling fields it omits. chat: `logprobs` is a boolean with `top_logprobs` beside it; else /v1/completions'
    `logprobs` count."""
    check_model(body, model_names)
    stream = opt_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise type_error("stream_options", "an object", options)
    include_usage = opt_bool(options or {}, "include_usage", where="stream_options.include_usage")
    n = opt_int(body, "n")
    if n is not None and n != 1:
        raise value_error("n", "only n=1 is supported")
    for name in ("best_of",):
        if (opt_int(body, name) or 1) != 1:
            raise value_error(name, "only 1 is supported")
    max_tokens = opt_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = opt_int(body, "max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise value_error("max_tokens", f"must be at least 1, got {max_tokens}")
    temperature = opt_number(body, "temperature")
    temperature = defaults.temperature if temperature is None else temperature
    if not 0 <= temperature <= 2:
        raise value_error("temperature", f"must be between 0 and 2, got {temperature}")
    if temperature < GREEDY_BELOW:
        temperature = 0.0
    top_p = opt_number(body, "top_p")
    top_p = defaults.top_p if top_p is None else top_p
    if not 0 < top_p <= 1:
        raise value_error("top_p", f"must be in (0, 1], got {top_p}")
    top_k = opt_int(body, "top_k")
    top_k = defaults.top_k if top_k is None else max(top_k, 0) if top_k >= -1 else None
    if top_k is None:
        raise value_error("top_k", "must be >= 0 (or -1 for off)")
    seed = opt_int(body, "seed")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = opt_number(body, name)
        if value is not None and not -2 <= value <= 2:
            raise value_error(name, f"must be between -2 and 2, got {value}")
        penalties[name] = value or 0.0
    params = SamplingParams(temperature, top_p, top_k, None if seed is None else seed % (1 << 63), **penalties,
                            logit_bias=parse_logit_bias(body, vocab_size))
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = stop
    else:
        raise type_error("stop", "a string or an array of strings", stop)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise value_error("stop", f"at most {MAX_STOP_SEQUENCES} sequences")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise value_error("stop", f"a stop sequence may be at most {MAX_STOP_CHARS} characters long")
    logprobs = _chat_logprobs(body) if chat else _completion_logprobs(body)
    for name in ("echo",) if chat else ("top_logprobs", "echo"):
        value = body.get(name)
        if value not in (None, False, 0):
            raise value_error(name, "not supported by this server")
    if body.get("suffix") not in (None, ""):
        raise value_error("suffix", "not supported by this server")
    return Common(stream, include_usage, max_tokens, params, tuple(s for s in stops if s),
                  opt_bool(body, "ignore_eos"), logprobs)


def _chat_logprobs(body: dict) -> int | None:
    """`logprobs: true` with `top_logprobs` (0-20): how many likeliest tokens to report; None when not asked."""
    top = opt_int(body, "top_logprobs")
    if not opt_bool(body, "logprobs"):
        if top is not None:
            raise value_error("top_logprobs", "needs logprobs: true")
        return None
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise value_error("top_logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}, got {top}")
    return top or 0


def _completion_logprobs(body: dict) -> int | None:
    """/v1/completions' `logprobs` (0-5): how many likeliest tokens to report with each one; None when not asked."""
    value = body.get("logprobs")
    if value is None or value is False:
        return None
    top = opt_int(body, "logprobs")
    if top is None or not 0 <= top <= MAX_COMPLETION_LOGPROBS:
        raise value_error("logprobs", f"must be an integer between 0 and {MAX_COMPLETION_LOGPROBS}, got {value!r}")
    return top


def completion_logprobs(chosen: list[TokenLogprob], decode: Callable[[list[int]], str], offset: int
                        ) -> dict[str, Any]:
    """/v1/completions' `logprobs` object for these tokens, their text starting at character `offset` of the
    completion: tokens, their log-probabilities, the likeliest tokens' by text, each token's text offset."""
    texts = [decode([c.token]) for c in chosen]
    offsets = list(accumulate((len(t) for t in texts[:-1]), initial=offset)) if texts else []
    tops: list[dict[str, float]] = []
    for c in chosen:
        top: dict[str, float] = {}
        for t, lp in c.top:  # likeliest first: a text several tokens decode to (a partial character) keeps the best
            top.setdefault(decode([t]), lp)
        tops.append(top)
    return {"tokens": texts, "token_logprobs": [c.logprob for c in chosen], "top_logprobs": tops,
            "text_offset": offsets}


def logprobs_content(chosen: list[TokenLogprob], decode: Callable[[list[int]], str]) -> list[dict[str, Any]]:
    """OpenAI's `logprobs.content`: per token its text, log-probability, UTF-8 bytes and the likeliest tokens'."""
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [{**entry(c.token, c.logprob), "top_logprobs": [entry(t, lp) for t, lp in c.top]} for c in chosen]


def parse_prompt(body: dict, engine: Engine) -> list[int] | str:
    """/v1/completions' `prompt`: text, or token ids checked against the vocabulary."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise value_error("prompt", "must not be empty")
        check_prompt_chars(engine, len(prompt), "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        check_prompt_tokens(engine, len(prompt), "prompt")
        vocab = engine.config.vocab_size
        if not all(0 <= t < vocab for t in prompt):
            raise value_error("prompt", f"token ids must be in [0, {vocab})")
        return list(prompt)
    if prompt is None:
        raise ApiError(400, "Missing required parameter: 'prompt'.", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) > 1:
        raise value_error("prompt", "one prompt per request (batches are not supported)")
    raise type_error("prompt", "a string, an array of token ids, or an array of one of them", prompt)


def check_prompt_tokens(engine: Engine, n_tokens: int, where: str) -> None:
    """400 when a prompt of `n_tokens` leaves no room in the model's context."""
    limit = engine.config.max_position_embeddings
    if n_tokens >= limit:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, your {where} "
                       f"resulted in {n_tokens} tokens.", param=where, code="context_length_exceeded")


def check_prompt_chars(engine: Engine, n_chars: int, where: str) -> None:
    """400, before any tokenizing, for a prompt of `n_chars` characters that cannot fit the context."""
    limit = engine.config.max_position_embeddings
    if n_chars > limit * PROMPT_CHARS_PER_TOKEN:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, your {where} is "
                       f"{n_chars} characters, more than {limit} tokens can hold (at most {PROMPT_CHARS_PER_TOKEN} "
                       "characters a token).", param=where, code="context_length_exceeded")


# ---- pieces of a response ---------------------------------------------------------------------------

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
    """One server-sent event: a JSON payload, or a bare word such as `[DONE]`."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


def generation_failed(done: Done) -> ApiError:
    return ApiError(500, f"generation failed: {done.error}", "server_error", code="generation_failed")


def sse_error(error: ApiError) -> str:
    return sse(error.to_json())
