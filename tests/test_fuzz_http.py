"""A seeded, bounded fuzz of glm-serve's completion routes over real HTTP (a uvicorn server on 127.0.0.1, the
tiny fixture model): OpenAI's two and Anthropic's Messages route, random JSON types in every field, deep nesting,
huge numbers, NaN, wrong content types, invalid UTF-8, oversized and chunked bodies, streaming and not.

Every answer must be a 2xx with a well-formed response of the route's API (or event stream: OpenAI's ending in
`[DONE]`, Anthropic's from `message_start` to `message_stop`) or a 4xx whose body is a JSON error of that API's
shape; never a 5xx (every input here is the client's doing), a plain-text error or traceback, a hang, or a dead
server (/health is asked after every case). Run with -s for the tables.
"""

from __future__ import annotations

import http.client
import json
import random
import time
from collections import Counter
from typing import Any

import pytest

from glmkit.cli.serve import build_app
from tests.test_serve import API_KEY, MAX_BODY, ServerThread, serve_args

SEED = 20240611
CASES = 2000
MESSAGES_SEED, MESSAGES_CASES = 20261205, 600
REQUEST_TIMEOUT_S = 30.0
CHAT, COMPLETIONS, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/messages"
BAD = ("5xx", "malformed", "hang", "server died")

FIELDS = {
    CHAT: ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "n",
           "stop", "stream", "stream_options", "tools", "tool_choice", "chat_template_kwargs", "ignore_eos",
           "logprobs", "best_of"],
    COMPLETIONS: ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop", "stream",
                  "stream_options", "echo", "suffix", "ignore_eos", "logprobs", "best_of"],
    MESSAGES: ["model", "messages", "max_tokens", "system", "temperature", "top_p", "top_k", "stop_sequences",
               "stream", "tools", "tool_choice", "thinking", "metadata", "ignore_eos"],
}
BLOCKS = [{"type": "text", "text": "Hi"}, {"type": "tool_use", "id": "t1", "name": "lookup", "input": {"q": "x"}},
          {"type": "tool_result", "tool_use_id": "t1", "content": "found"}, {"type": "thinking", "thinking": "hm"},
          {"type": "image", "source": {"type": "base64", "data": "AA"}}, {"type": "tool_use", "input": "x"}]
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}}}}


def nested(depth: int) -> Any:
    value: Any = 0
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


class Fuzzer:
    def __init__(self, seed: int, paths: tuple[str, ...] = (CHAT, COMPLETIONS)):
        self.rng, self.seed = random.Random(seed), seed
        self.paths = paths

    def scalar(self) -> Any:
        return self.rng.choice([
            None, True, False, 0, -1, 1, 7, 2 ** 31, 2 ** 63, -(2 ** 63), 10 ** 30, float("nan"), float("inf"),
            float("-inf"), 1e308, 5e-324, -0.0, 0.5, 1.5, 2.0000001, "", "x", "hé 日本 🙂", "\x00\x1b", "<tool_call>",
            "</think>", "<|user|>", "%s%s{0}{}", "x" * self.rng.choice([100, 5000, 30000])])

    def value(self, depth: int = 0) -> Any:
        kind = self.rng.random()
        if kind < 0.55 or depth > 3:
            return self.scalar()
        if kind < 0.7:
            return [self.value(depth + 1) for _ in range(self.rng.randint(0, 4))]
        if kind < 0.85:
            keys = ["role", "content", "type", "text", "function", "name", "arguments", "self", "messages", "x"]
            return {self.rng.choice(keys): self.value(depth + 1) for _ in range(self.rng.randint(0, 4))}
        return nested(self.rng.choice([10, 70, 500]))  # deeper: the raw mangles in case()

    def message(self, path: str) -> Any:
        if self.rng.random() < 0.2:
            return self.value()
        if path == MESSAGES:
            content = self.rng.choice(["Hi", "", None, self.value(), [self.rng.choice(BLOCKS + [self.value()])
                                                                      for _ in range(self.rng.randint(0, 3))]])
            return {"role": self.rng.choice(["user", "assistant", "system", None]), "content": content}
        role = self.rng.choice(["system", "developer", "user", "assistant", "tool", "wizard", None, 3])
        message: dict[str, Any] = {"role": role, "content": self.rng.choice(
            ["Hi", "", None, [{"type": "text", "text": "Hi"}], [{"type": "image_url"}], self.value()])}
        if role == "assistant" and self.rng.random() < 0.5:
            message["tool_calls"] = self.rng.choice([
                [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}],
                [{"function": {"name": "lookup", "arguments": "not json"}}], self.value()])
        if role == "tool":
            message["tool_call_id"] = self.value()
        return message

    def valid(self, path: str) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": self.rng.randint(1, 6), "temperature": self.rng.choice([0, 0.7]),
                                "stream": self.rng.random() < 0.4}
        if path in (CHAT, MESSAGES):
            body["messages"] = [{"role": "user", "content": "Hello"}]
            if self.rng.random() < 0.3:
                body["tools"] = [TOOL if path == CHAT else {"name": "lookup", "input_schema": TOOL["function"][
                    "parameters"]}]
        else:
            body["prompt"] = self.rng.choice(["def main():", [10, 20, 30], ["Once"]])
        if body["stream"] and path != MESSAGES and self.rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        return body

    def case(self) -> tuple[str, bytes, dict[str, str], bool]:
        """(path, body bytes, extra headers, send chunked)."""
        path = self.rng.choice(self.paths)
        body = self.valid(path)
        for _ in range(self.rng.choice([0, 0, 1, 1, 2, 3])):  # some requests stay valid: replies get checked too
            field = self.rng.choice(FIELDS[path])
            if field == "messages" and self.rng.random() < 0.6:
                body[field] = [self.message(path) for _ in range(self.rng.randint(0, 3))]
            else:
                body[field] = self.value()
        raw = json.dumps(body, allow_nan=True).encode()
        headers = {"Content-Type": self.rng.choice(["application/json", "text/plain", "multipart/form-data",
                                                    "application/x-www-form-urlencoded", ""])}
        mangle = self.rng.random()
        if mangle < 0.06:
            raw = raw[: self.rng.randint(0, len(raw))]  # truncated
        elif mangle < 0.12:
            at = self.rng.randint(0, len(raw))
            raw = raw[:at] + self.rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00"]) + raw[at:]
        elif mangle < 0.17:
            depth = self.rng.choice([100, 1000, 20000])
            raw = b'{"messages": ' + b"[" * depth + b"]" * depth + b', "prompt": "x"}'
        elif mangle < 0.22:
            raw = raw.replace(b'"max_tokens": ', self.rng.choice(
                [b'"max_tokens": 1e400, "x": ', b'"max_tokens": -Infinity, "x": ', b'"max_tokens": ' + b"9" * 5000
                 + b', "x": ', b'"max_tokens": NaN, "x": ']), 1)
        elif mangle < 0.26:
            raw = raw + b" " * (MAX_BODY + 10)  # over --max-request-size
        elif mangle < 0.29:
            raw = self.rng.choice([b"", b"null", b"[]", b'"text"', b"123", b"\xef\xbb\xbf{}", b'{"prompt": "a", '
                                   b'"prompt": [1]}'])
        elif mangle < 0.32:
            raw = raw.replace(b'"Hello"', b'"\\ud800 lone"').replace(b'"def main():"', b'"\\udfff"')
        return path, raw, headers, self.rng.random() < 0.1


def is_error(body: Any, path: str = CHAT) -> bool:
    """An error body of the route's API: OpenAI's `{"error": {...}}` or Anthropic's `{"type": "error", ...}`."""
    shape = ({"type", "error"}, {"type", "message"}) if path == MESSAGES else ({"error"}, {"message", "type", "param",
                                                                                         "code"})
    return (isinstance(body, dict) and set(body) == shape[0] and isinstance(body["error"], dict)
            and set(body["error"]) == shape[1] and isinstance(body["error"]["message"], str)
            and "Traceback" not in body["error"]["message"])


def is_reply(path: str, body: Any) -> bool:
    """A non-streaming OpenAI reply of route `path`."""
    if path == MESSAGES:
        usage = body.get("usage") if isinstance(body, dict) else None
        return (isinstance(usage, dict) and body.get("type") == "message" and isinstance(body.get("content"), list)
                and body.get("stop_reason") in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
                and all(isinstance(usage.get(k), int) for k in ("input_tokens", "output_tokens")))
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list) or len(body["choices"]) != 1:
        return False
    choice, usage = body["choices"][0], body.get("usage") or {}
    if choice.get("finish_reason") not in ("stop", "length", "tool_calls"):
        return False
    if not all(isinstance(usage.get(k), int) for k in ("prompt_tokens", "completion_tokens", "total_tokens")):
        return False
    if path == CHAT:
        message = choice.get("message") or {}
        return (body.get("object") == "chat.completion" and message.get("role") == "assistant"
                and (isinstance(message.get("content"), str) or message.get("tool_calls")))
    return body.get("object") == "text_completion" and isinstance(choice.get("text"), str)


def is_stream(path: str, events: list[str]) -> bool:
    """A well-formed event stream: chunks of the route's kind, at most one error event just before `[DONE]`;
    Anthropic's: from `message_start` to `message_stop`, or to one error event."""
    if path == MESSAGES:
        try:
            data = [json.loads(event) for event in events]
        except ValueError:
            return False
        types = [d.get("type") if isinstance(d, dict) else None for d in data]
        return (len(types) >= 2 and types[0] == "message_start" and None not in types
                and (types[-1] == "message_stop" or is_error(data[-1], path)) and "error" not in types[:-1])
    if not events or events[-1] != "[DONE]":
        return False
    kind = "chat.completion.chunk" if path == CHAT else "text_completion"
    for i, event in enumerate(events[:-1]):
        try:
            data = json.loads(event)
        except ValueError:
            return False
        if is_error(data):
            if i != len(events) - 2:
                return False
        elif data.get("object") != kind or not isinstance(data.get("choices"), list):
            return False
    return True


def send(port: int, path: str, raw: bytes, headers: dict[str, str], chunked: bool) -> str:
    """One request; the outcome: "2xx", "4xx", "5xx", "malformed" or "hang"."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    try:
        headers = {"Authorization": f"Bearer {API_KEY}", **{k: v for k, v in headers.items() if v}}
        if chunked:
            conn.request("POST", path, body=iter([raw[:len(raw) // 2], raw[len(raw) // 2:]]), headers=headers,
                         encode_chunked=True)
        else:
            conn.request("POST", path, body=raw, headers=headers)
        response = conn.getresponse()
        streaming = response.getheader("content-type", "").startswith("text/event-stream")
        lines = []
        for line in response if streaming else []:
            lines.append(line)
            if time.monotonic() > deadline:
                return "hang"
        data = b"" if streaming else response.read()
    except TimeoutError:
        return "hang"
    except (ConnectionError, http.client.HTTPException):
        return "malformed"  # the server reset the connection or broke HTTP
    finally:
        conn.close()
    status = response.status
    if streaming:
        events = [line[6:].decode().strip() for line in lines if line.startswith(b"data: ")]
        return "2xx" if status == 200 and is_stream(path, events) else "malformed"
    try:
        body = json.loads(data)
    except ValueError:
        return "malformed"  # a plain-text answer
    if 200 <= status < 300:
        return "2xx" if is_reply(path, body) else "malformed"
    if not is_error(body, path):
        return "malformed"
    return "4xx" if status < 500 else "5xx"


def healthy(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(snapshot, tmp_path_factory):
    args = serve_args(snapshot, tmp_path_factory.mktemp("fuzz-cache"), "--default-max-tokens", "6")
    srv = ServerThread(build_app(args)).start()
    yield srv
    srv.stop()


def run_fuzz(server: ServerThread, fuzzer: Fuzzer, cases: int, title: str) -> Counter[str]:
    """Send `cases` of the fuzzer's requests, checking /health after each; print the outcome table."""
    outcomes: Counter[str] = Counter()
    bad_cases: list[str] = []
    start = time.monotonic()
    for index in range(cases):
        path, raw, headers, chunked = fuzzer.case()
        outcome = send(server.port, path, raw, headers, chunked)
        outcomes["tried"] += 1
        outcomes[outcome] += 1
        if not healthy(server.port):
            outcomes["server died"] += 1
        if outcome in BAD or not healthy(server.port):
            bad_cases.append(f"case {index} {outcome}: {path} {raw[:300]!r}")
        if outcomes["server died"]:
            break
    elapsed = time.monotonic() - start
    columns = {"tried": "tried", "2xx": "2xx reply", "4xx": "clean 4xx error", "5xx": "JSON 5xx",
               "malformed": "plain-text / traceback / malformed", "hang": "hang", "server died": "server died"}
    print(f"\n{title} (seed {fuzzer.seed}, {elapsed:.1f} s)")
    print("| " + " | ".join(columns.values()) + " |")
    print("|" + "---|" * len(columns))
    print("| " + " | ".join(str(outcomes[c]) for c in columns) + " |")
    assert outcomes["tried"] == cases
    assert not any(outcomes[c] for c in BAD), "\n".join(bad_cases[:20])
    assert outcomes["2xx"] >= cases // 10 and outcomes["4xx"] >= cases // 4  # both kinds were exercised
    return outcomes


def test_fuzzed_requests_get_openai_answers(server):
    run_fuzz(server, Fuzzer(SEED), CASES, "glm-serve HTTP fuzz, OpenAI routes")


def test_fuzzed_messages_requests_get_anthropic_answers(server):
    run_fuzz(server, Fuzzer(MESSAGES_SEED, (MESSAGES,)), MESSAGES_CASES, "glm-serve HTTP fuzz, Anthropic's route")
