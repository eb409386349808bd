"""glm-serve against hostile input: every error is an OpenAI-shaped JSON body (a 4xx where the client is at
fault), a shutdown ends the requests in flight cleanly, oversized prompts are refused before they are tokenized,
and the snapshot's chat template and side files are bounded and checked."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from glmkit.cli.serve import build_app
from glmkit.errors import GlmkitError
from glmkit.generate.engine import Engine
from glmkit.generate.tokenizer import ChatTokenizer
from glmkit.serve.app import Loaded, ServeConfig, create_app
from glmkit.serve.scheduler import Done, GenRequest, Scheduler, Text
from glmkit.serve.toolcalls import parse_tool_calls
from tests.runtime_support import FIXTURES
from tests.test_serve import ServerThread, raw, serve_args

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]


def openai_error(status: int, body: Any) -> dict[str, Any]:
    """The error of an OpenAI-shaped JSON error body (asserts the shape)."""
    assert isinstance(body, dict) and set(body) == {"error"}, (status, body)
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert "Traceback" not in body["error"]["message"]
    return body["error"]


def sse_events(lines: list[bytes]) -> list[str]:
    return [line[len(b"data: "):].decode().strip() for line in lines if line.startswith(b"data: ")]


@pytest.fixture(scope="module")
def server(snapshot, tmp_path_factory):
    srv = ServerThread(build_app(serve_args(snapshot, tmp_path_factory.mktemp("defects-cache")))).start()
    yield srv
    srv.stop()


# ---- a. every error is JSON in OpenAI's shape ----------------------------------------------------

@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("depth", [1000, 30_000])  # 30,000: 60 KB, under the test server's 64 KB cap
def test_deeply_nested_json_is_a_json_400(server, path, depth):
    body = b'{"messages": ' + b"[" * depth + b"]" * depth + b', "prompt": "x"}'
    status, error = raw(server, "POST", path, body)
    assert status == 400 and openai_error(status, error)["code"] == "invalid_json"
    assert raw(server, "GET", "/health")[0] == 200


def test_a_template_variable_named_self_is_just_a_variable(server):
    body = {"messages": HI, "max_tokens": 2, "chat_template_kwargs": {"self": 1, "enable_thinking": False}}
    status, reply = raw(server, "POST", CHAT, json.dumps(body).encode())
    assert status == 200 and reply["object"] == "chat.completion", reply
    assert reply["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("path, body", [
    (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'),
    (CHAT, b'{"model": "\\udfff", "messages": [{"role": "user", "content": "Hi"}]}'),
    (COMPLETIONS, b'{"prompt": "ok \\ud83d", "max_tokens": 2}'),
], ids=["content", "model", "prompt"])
def test_unpaired_surrogates_are_a_json_400(server, path, body):
    status, error = raw(server, "POST", path, body)
    assert status == 400 and openai_error(status, error)["code"] == "invalid_json"


def test_a_paired_surrogate_escape_is_fine(server):
    status, reply = raw(server, "POST", COMPLETIONS, b'{"prompt": "ok \\ud83d\\ude00", "max_tokens": 2}')
    assert status == 200 and reply["usage"]["prompt_tokens"] > 1


def assistant_call(arguments: str) -> list[dict[str, Any]]:
    """A conversation whose assistant turn called a tool with these `arguments` (JSON text)."""
    return [*HI, {"role": "assistant", "content": "",
                  "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": arguments}}]}]


def tool_with(parameters: Any) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


FORCED = {"tool_choice": "required", "parallel_tool_calls": False, "temperature": 0, "max_tokens": 40}
ARGUMENTS = "messages[1].tool_calls[0].function.arguments"


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": {}, "content": "x"}]}, "messages[0].role"),
    ({"messages": assistant_call("[" * 5000 + "]" * 5000)}, ARGUMENTS),  # past the parser's recursion limit
    ({"messages": assistant_call('{"a": ' + "[" * 64 + "]" * 64 + "}")}, ARGUMENTS),  # past the body's 64 levels
    ({"messages": assistant_call('{"a": "\\ud800"}')}, ARGUMENTS),
    ({"messages": HI, "tools": tool_with({"type": "object", "properties": [1]}), **FORCED},
     "tools[0].function.parameters.properties"),
    ({"messages": HI, "tools": tool_with({"type": "object", "properties": [1]}), **FORCED, "stream": True},
     "tools[0].function.parameters.properties"),
    ({"messages": HI, "tools": tool_with({"type": "object", "properties": {"a": {"type": ["string", {}]}}}),
      **FORCED}, "tools[0].function.parameters.properties.a.type"),
    ({"messages": HI, "tools": tool_with("abc")}, "tools[0].function.parameters"),
], ids=["role list", "role object", "arguments 5000 deep", "arguments 65 deep", "arguments surrogate",
        "properties list", "properties list streamed", "property type list", "parameters string"])
def test_malformed_messages_and_tools_are_400s_naming_the_field(server, body, param):
    """Checked when the request arrives: a malformed tool schema is not found only when the reply's call is parsed,
    after the whole generation."""
    status, error = raw(server, "POST", CHAT, json.dumps({"max_tokens": 2, **body}).encode())
    assert status == 400 and openai_error(status, error)["param"] == param, error


@pytest.mark.parametrize("path, body, headers, param, said", [
    (CHAT, b"null", {}, None, "the request body must be a JSON object"),
    (CHAT, b'{"messages": [], "max_tokens": ' + b"9" * 5000 + b"}", {}, None,
     f"an integer has more than {sys.get_int_max_str_digits()} digits"),
    (CHAT, json.dumps({"messages": HI, "stream": True, "stream_options": {"include_usage": "yes"}}).encode(), {},
     "stream_options.include_usage", "'stream_options.include_usage'"),
    (CHAT, json.dumps({"messages": HI, "max_tokens": 0}).encode(), {"anthropic-version": "2023-06-01"},
     "max_tokens", "max_tokens"),
    (COMPLETIONS, json.dumps({"prompt": "Hi", "max_tokens": 0}).encode(), {"anthropic-version": "2023-06-01"},
     "max_tokens", "max_tokens"),
    (CHAT, b"{}", {"anthropic-version": "2023-06-01", "Authorization": "Bearer wrong"}, None, "Incorrect API key"),
], ids=["null body", "huge integer", "include_usage", "anthropic-version chat", "anthropic-version completions",
        "anthropic-version 401"])
def test_errors_name_the_field_in_openais_shape(server, path, body, headers, param, said):
    """An OpenAI route answers in OpenAI's shape whatever the headers, naming the field the error is about."""
    status, error = raw(server, "POST", path, body, headers)
    error = openai_error(status, error)
    assert 400 <= status < 500 and error["param"] == param and said in error["message"], error
    assert "sys.set_int_max_str_digits" not in error["message"]


class FailingScheduler:
    """Stands in for the generation worker: `submit` raises (a bug), or each job fails at once."""

    def __init__(self, raise_on_submit: bool):
        self.raise_on_submit = raise_on_submit

    def submit(self, request: GenRequest, emit):
        if self.raise_on_submit:
            raise RuntimeError("internal detail that must not reach the client")
        emit(Text("partial"))
        emit(Done("error", len(request.prompt_ids), 0, 1, {}, 0.0, None, None, 0.0, error="RuntimeError: disk"))
        return object()

    def cancel(self, job) -> None:
        pass

    def stop(self) -> None:
        pass


def test_an_unexpected_exception_is_a_json_500_without_details(engine):
    srv = ServerThread(create_app(ServeConfig("m"), lambda: Loaded(engine, FailingScheduler(True)))).start()
    try:
        for path, body in ((CHAT, {"messages": HI}), (COMPLETIONS, {"prompt": "Hi", "stream": True})):
            status, error = raw(srv, "POST", path, json.dumps(body).encode())
            error = openai_error(status, error)
            assert status == 500 and error["type"] == "server_error" and error["code"] == "internal_error"
            assert "internal detail" not in error["message"]
        assert raw(srv, "GET", "/health")[0] == 200
    finally:
        srv.stop()


@pytest.mark.parametrize("path, body", [(CHAT, {"messages": HI}), (COMPLETIONS, {"prompt": "Hi"})])
def test_a_failed_generation_ends_a_stream_with_an_error_then_done(engine, path, body):
    srv = ServerThread(create_app(ServeConfig("m"), lambda: Loaded(engine, FailingScheduler(False)))).start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        conn.request("POST", path, body=json.dumps({**body, "stream": True}))
        response = conn.getresponse()
        events = sse_events(list(response))
        assert response.status == 200 and events[-1] == "[DONE]", events
        assert openai_error(500, json.loads(events[-2]))["code"] == "generation_failed"
    finally:
        srv.stop()


def test_stop_sequences_are_length_capped(server):
    """Each generated token is checked against every stop sequence's prefixes: a huge one would stall the worker
    (every request's decoding) for seconds a token."""
    body = {"prompt": "Hi", "max_tokens": 2, "stop": ["x" * 5000]}
    status, error = raw(server, "POST", COMPLETIONS, json.dumps(body).encode())
    assert status == 400 and openai_error(status, error)["param"] == "stop"


def test_a_vanishing_temperature_samples_greedily(server):
    """logits / 5e-324 overflow to inf (NaN probabilities): such a temperature is greedy decoding."""
    greedy = {"prompt": "The answer is", "max_tokens": 8, "temperature": 0}
    status, expected = raw(server, "POST", COMPLETIONS, json.dumps(greedy).encode())
    status, reply = raw(server, "POST", COMPLETIONS, json.dumps({**greedy, "temperature": 5e-324}).encode())
    assert status == 200, reply
    assert reply["choices"][0]["text"] == expected["choices"][0]["text"]


def test_a_non_ascii_api_key_is_matched_as_utf8(engine):
    """The key from the command line is matched with the header's bytes as sent (UTF-8, as curl sends it typed)."""
    key = "kéy"
    srv = ServerThread(create_app(ServeConfig("m", api_key=key), lambda: Loaded(engine, FailingScheduler(False))))
    srv.start()
    try:
        for headers, status in [({"Authorization": b"Bearer " + key.encode()}, 200),
                                ({"Authorization": "", "x-api-key": key.encode()}, 200),
                                ({"Authorization": b"Bearer " + key.encode("latin-1")}, 401),
                                ({"Authorization": "", "x-api-key": key.encode("latin-1")}, 401)]:
            assert raw(srv, "GET", "/v1/models", headers=headers)[0] == status, headers
    finally:
        srv.stop()


def test_a_reply_argument_nested_past_the_parser_stays_text():
    """A model can be prompted to write any value: one nested past json's recursion limit is kept as its text."""
    value = "[" * 5000
    text = f"<tool_call>f<arg_key>a</arg_key><arg_value>{value}</arg_value></tool_call>"
    assert [(call.name, call.arguments) for call in parse_tool_calls(text)[1]] == [("f", {"a": value})]


# ---- b. a shutdown ends the requests in flight with OpenAI-shaped errors -------------------------

SLOW_SERVER = """
import sys, time
import glmkit.cli.serve as cli
from glmkit.serve.scheduler import Scheduler

class SlowScheduler(Scheduler):
    def _step(self, job):  # 20 ms a step: requests are still running when the server is told to stop
        time.sleep(0.02)
        super()._step(job)

cli.Scheduler = SlowScheduler
sys.exit(cli.main(sys.argv[1:]))
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get_json(port: int, path: str) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_sigterm_ends_requests_in_flight_with_openai_errors(snapshot, tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SERVER, str(snapshot), "--port", str(port), "--cache-dir",
                             str(tmp_path), "--parallel", "2", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results: dict[str, Any] = {}
    streamed: list[bytes] = []  # the stream's lines as they arrive

    def request(name: str, stream: bool) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {"prompt": f"Story {name}:", "max_tokens": 1500, "ignore_eos": True, "stream": stream}
        conn.request("POST", COMPLETIONS, body=json.dumps(body))
        response = conn.getresponse()
        for line in response if stream else ():
            streamed.append(line)
        results[name] = (response.status, streamed if stream else response.read())

    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            try:
                if get_json(port, "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.05)
        threads = [threading.Thread(target=request, args=(name, name == "stream")) for name in ("plain", "stream")]
        for t in threads:
            t.start()
        # both past their prefill and generating: the stream has sent text, the other request is active too
        while get_json(port, "/stats")[1]["active"] < 2 or len(sse_events(streamed)) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        status, body = results["plain"]
        error = openai_error(status, json.loads(body))
        assert status == 503 and error["code"] == "server_shutting_down"
        status, lines = results["stream"]
        events = sse_events(lines)
        assert status == 200 and events[-1] == "[DONE]", events[-3:]
        assert openai_error(503, json.loads(events[-2]))["code"] == "server_shutting_down"
        assert all("choices" in json.loads(e) for e in events[:-2]) and len(events) > 3
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- c. a prompt too long for the context is refused before it is tokenized ----------------------

@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_huge_prompt_is_refused_before_tokenizing(engine, monkeypatch, path):
    tokenized: list[int] = []
    encode = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text: tokenized.append(len(text)) or encode(text))
    scheduler = Scheduler(engine, reuse=False)
    scheduler.start()
    srv = ServerThread(create_app(ServeConfig("m", max_request_bytes=32 << 20),
                                  lambda: Loaded(engine, scheduler))).start()
    def body(text: str) -> bytes:
        field = {"messages": [{"role": "user", "content": text}]} if path == CHAT else {"prompt": text}
        return json.dumps({**field, "max_tokens": 2}).encode()

    try:
        start = time.monotonic()
        status, error = raw(srv, "POST", path, body("ab " * 5_000_000))  # 15 MB, ~10M tokens, 2048-token context
        elapsed = time.monotonic() - start
        assert status == 400 and openai_error(status, error)["code"] == "context_length_exceeded"
        assert tokenized == [], f"tokenized {tokenized} characters first ({elapsed:.1f} s)"
        status, reply = raw(srv, "POST", path, body("Hi"))  # a prompt that fits is still served
        assert status == 200 and tokenized, reply
    finally:
        srv.stop()
        scheduler.stop()


def test_a_body_larger_than_its_content_length_cap_is_413_before_it_is_read(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.putrequest("POST", COMPLETIONS)
    conn.putheader("Authorization", "Bearer test-key")
    conn.putheader("Content-Length", str(1 << 40))
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 413 and openai_error(413, json.loads(response.read()))["code"] == "request_too_large"


# ---- d. the chat template and the side files are untrusted ---------------------------------------

RENDER_IN_CHILD = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
from glmkit.errors import GlmkitError
from glmkit.generate.tokenizer import ChatTokenizer
try:
    text = ChatTokenizer(sys.argv[1]).render_chat([{"role": "user", "content": "Hi"}])
    print("rendered", len(text))
except GlmkitError as e:
    print("GlmkitError:", e)
"""

TEMPLATE_BOMBS = {
    "loops 10^10 times": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "a 10 GB string": "{{ 'x' * 10 ** 10 }}",
    "doubles a string": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}{{ ns.s|length }}",
    "repeats its output": "{% set s = 'x' * 100000 %}{% for i in range(100000) %}{{ s }}{% endfor %}",
    "prints a shared list": "{% set a = ['x' * 100] * 1000 %}{% set b = [a, a, a, a] %}{% set c = [b, b, b, b] %}"
                            "{% set d = [c, c, c, c] %}{% set e = [d, d, d, d] %}{% set f = [e, e, e, e] %}{{ f }}",
    "formats a huge width": "{{ '%10000000000d' % 1 }}",
    "a huge power": "{{ 10 ** (10 ** 10) }}",
    "recurses exponentially": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
                              "{{ f(60) }}",
    "a huge range": "{% for i in range(10 ** 10) %}x{% endfor %}",
    "divides by zero": "{{ 1 / 0 }}",
}


@pytest.mark.parametrize("template", TEMPLATE_BOMBS.values(), ids=TEMPLATE_BOMBS.keys())
def test_a_hostile_chat_template_is_bounded(tmp_path, template):
    shutil.copy(FIXTURES / "tiny-bf16" / "tokenizer.json", tmp_path)
    (tmp_path / "chat_template.jinja").write_text(template)
    start = time.monotonic()
    try:
        child = subprocess.run([sys.executable, "-c", RENDER_IN_CHILD, str(tmp_path)], capture_output=True,
                               text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    except subprocess.TimeoutExpired:
        pytest.fail("the render ran for more than 60 s")
    elapsed = time.monotonic() - start
    assert child.returncode == 0 and child.stdout.startswith("GlmkitError: chat template "), child.stderr[-2000:]
    assert len(child.stdout.splitlines()) == 1 and elapsed < 30


def test_a_chat_template_overrun_is_a_json_400(snapshot, tmp_path):
    copy = tmp_path / "snapshot"
    shutil.copytree(snapshot, copy)
    # 1 GB unbounded: a regression fails this test instead of exhausting the machine
    (copy / "chat_template.jinja").write_text("{{ 'x' * 10 ** 9 }}")
    srv = ServerThread(build_app(serve_args(copy, tmp_path / "cache"))).start()
    try:
        status, error = raw(srv, "POST", CHAT, json.dumps({"messages": HI}).encode())
        assert status == 400 and "chat template" in openai_error(status, error)["message"]
    finally:
        srv.stop()


def test_an_empty_chat_template_counts_as_none(tmp_path):
    shutil.copy(FIXTURES / "tiny-bf16" / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": ""}))
    (tmp_path / "chat_template.jinja").write_text(" \n")
    tok = ChatTokenizer(tmp_path)
    assert tok.chat_template is None
    with pytest.raises(GlmkitError, match="no chat template"):
        tok.render_chat(HI)


def bad_snapshot(snapshot: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "snapshot"
    shutil.copytree(snapshot, copy)
    return copy


@pytest.mark.parametrize("name", ["generation_config.json", "tokenizer_config.json", "chat_template.jinja"])
def test_a_side_file_that_is_not_utf8_is_a_one_line_error(snapshot, tmp_path, name):
    copy = bad_snapshot(snapshot, tmp_path)
    (copy / name).write_bytes(b'{"eos_token_id": 1, "note": "\xff\xfe"}')
    with pytest.raises(GlmkitError, match=f"{name}: not UTF-8") as info:
        Engine(copy)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["generation_config.json", "tokenizer_config.json", "chat_template.jinja"])
def test_side_files_are_size_capped_before_reading(snapshot, tmp_path, name):
    copy = bad_snapshot(snapshot, tmp_path)
    (copy / name).write_text(json.dumps({"eos_token_id": 1, "padding": "x" * (17 << 20)}))
    with pytest.raises(GlmkitError, match=f"{name}: .*more than"):
        Engine(copy)
