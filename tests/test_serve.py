"""glm-serve: a real uvicorn server on 127.0.0.1 (in a thread) driven by the official `openai` client."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import uvicorn

from glmkit.cli.run import main as run_main
from glmkit.cli.serve import build_app, build_parser
from glmkit.generate.engine import Engine
from glmkit.generate.generator import Generator
from glmkit.generate.sampling import Sampler, SamplingParams
from glmkit.model.expert_cache import ExpertCache
from glmkit.serve.app import Loaded, ServeConfig, create_app
from glmkit.serve.scheduler import Done, GenRequest, Text

API_KEY = "test-key"
MAX_BODY = 64 << 10
IGNORE_EOS = {"ignore_eos": True}


class ServerThread:
    """A uvicorn server for `app` on a free loopback port, run in a daemon thread."""

    def __init__(self, app: Any):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait_ready: bool = True) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)
        while wait_ready and raw(self, "GET", "/health")[0] != 200:
            assert time.monotonic() < deadline, "model did not load"
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def client(self, api_key: str = API_KEY, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=api_key, max_retries=0, timeout=60, **kwargs)


def raw(server: ServerThread, method: str, path: str, body: bytes | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """One plain HTTP request: (status, parsed JSON body or text)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers={"Authorization": f"Bearer {API_KEY}", **(headers or {})})
        response = conn.getresponse()
        data = response.read().decode()
    finally:
        conn.close()
    try:
        return response.status, json.loads(data)
    except ValueError:
        return response.status, data


def serve_args(snapshot: Path, cache_dir: Path, *extra: str, prefill_chunk: int = 64):
    return build_parser().parse_args([str(snapshot), "--cache-dir", str(cache_dir), "--api-key", API_KEY,
                                      "--max-request-size", str(MAX_BODY), "--prefill-chunk", str(prefill_chunk),
                                      "--log-level", "warning", *extra])


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve-cache")


@pytest.fixture(scope="module")
def server(snapshot, cache_dir):
    srv = ServerThread(build_app(serve_args(snapshot, cache_dir))).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def model(snapshot) -> str:
    return snapshot.name  # the default model id: the snapshot directory's name


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def glm_run(capsys: pytest.CaptureFixture[str], snapshot: Path, prompt: str, max_tokens: int, *flags: str) -> str:
    capsys.readouterr()
    assert run_main([str(snapshot), "-p", prompt, "--max-tokens", str(max_tokens), "--no-cache", *flags]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n")
    return out[:-1]


def stats(server: ServerThread) -> dict[str, Any]:
    status, body = raw(server, "GET", "/stats")
    assert status == 200
    return body


def recent(server: ServerThread, request_id: str, timeout: float = 20) -> dict[str, Any]:
    """The finished request's /stats record (waits for it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for record in stats(server)["recent"]:
            if record["id"] == request_id:
                return record
        time.sleep(0.02)
    raise AssertionError(f"{request_id} never finished")


# ---- basics -----------------------------------------------------------------------------------------

def test_health_and_models(server, client, model):
    assert raw(server, "GET", "/health", headers={"Authorization": ""}) == (200, {"status": "ok", "model": model})
    assert [m.id for m in client.models.list().data] == [model]
    assert client.models.retrieve(model).owned_by == "glmkit"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


LONG_PROMPT = "Summarize: the quick brown fox jumps over the lazy dog, twice, and then once more for luck."


@pytest.mark.parametrize("flags", [[], ["--no-mtp"]], ids=["mtp", "no-mtp"])
def test_greedy_chat_equals_glm_run(snapshot, cache_dir, capsys, model, flags):
    """Same prompt, same template, greedy: the same text as glm-run prints (the prompt is longer than
    --prefill-chunk 16, so the server prefills it in chunks)."""
    expected = glm_run(capsys, snapshot, LONG_PROMPT, 24, *flags)
    srv = ServerThread(build_app(serve_args(snapshot, cache_dir, *flags, prefill_chunk=16))).start()
    try:
        reply = srv.client().chat.completions.create(model=model, messages=[user(LONG_PROMPT)], max_tokens=24,
                                                     temperature=0)
    finally:
        srv.stop()
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= 24 and reply.usage.prompt_tokens > 16


def test_chat_and_streaming_agree(client, model, engine):
    messages = [{"role": "system", "content": "Be brief."}, user("Hello there")]
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    choice = full.choices[0]
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.tool_calls is None
    prompt_ids = engine.tokenizer.encode_chat(messages)
    assert full.usage.prompt_tokens == len(prompt_ids)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again


def test_thinking_is_switched_as_glm_s_api_and_the_templates_kwargs_switch_it(client, model, engine):
    """Thinking is off by `chat_template_kwargs.enable_thinking` (vLLM's way), a top-level `enable_thinking`, or GLM's
    own API's `thinking: {"type": "disabled"}`, in that order of precedence; on by default. `thinking.budget_tokens`
    closes the thinking block past that many tokens, as on the Anthropic route."""
    messages = [user("Hello there")]
    off, on = (len(engine.tokenizer.encode_chat(messages, enable_thinking=t)) for t in (False, True))
    assert off != on

    def prompt_tokens(**extra) -> int:
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0,
                                               extra_body=extra)
        return reply.usage.prompt_tokens

    assert prompt_tokens() == prompt_tokens(thinking={"type": "enabled"}) == on
    assert prompt_tokens(thinking={"type": "disabled"}) == prompt_tokens(enable_thinking=False) == off
    assert prompt_tokens(thinking={"type": "disabled"}, enable_thinking=True) == on
    assert prompt_tokens(enable_thinking=False, chat_template_kwargs={"enable_thinking": True}) == on
    free = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
    held = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0,
                                          extra_body={"thinking": {"type": "enabled", "budget_tokens": 5}})
    thought, closed, _ = held.choices[0].message.content.partition("</think>")
    assert "</think>" not in free.choices[0].message.content and closed  # the budget closed the block
    assert free.choices[0].message.content.startswith(thought) and held.usage.completion_tokens == 24
    for bad in ({"thinking": {"type": "auto"}}, {"thinking": True}, {"enable_thinking": "no"},
                {"thinking": {"type": "enabled", "budget_tokens": 0}}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=model, messages=messages, max_tokens=1, extra_body=bad)

def test_completions_equal_glm_run_raw_prompt(snapshot, client, model, capsys):
    expected = glm_run(capsys, snapshot, "def main():", 10, "--raw-prompt")
    reply = client.completions.create(model=model, prompt="def main():", max_tokens=10, temperature=0)
    assert reply.object == "text_completion" and reply.choices[0].text == expected
    streamed = list(client.completions.create(model=model, prompt="def main():", max_tokens=10, temperature=0,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected
    assert streamed[-1].choices[0].finish_reason == reply.choices[0].finish_reason
    ids = client.completions.create(model=model, prompt=[10, 20, 30, 40], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 4


def test_seeded_sampling_is_reproducible(client, model):
    def sample(seed: int) -> str:
        return client.chat.completions.create(model=model, messages=[user("Hi")], max_tokens=16, temperature=1.0,
                                              top_p=0.9, seed=seed, extra_body={"top_k": 50}).choices[0].message.content
    assert sample(7) == sample(7)


def test_penalties_reach_the_sampler(client, model, engine):
    """A strong frequency penalty under greedy decoding: no token repeats more than the logits allow, the reply
    differs from the plain one (whose greedy tokens repeat on this random model), and it is reproducible."""
    def reply(**extra) -> list[int]:
        text = client.completions.create(model=model, prompt="Hello", max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True}, **extra).choices[0].text
        return engine.tokenizer.encode(text)

    plain, penalized = reply(), reply(frequency_penalty=2.0)
    assert len(set(plain)) < len(plain)  # the case is exercised: greedy repeats itself here
    assert penalized != plain and penalized == reply(frequency_penalty=2.0)
    assert len(set(penalized)) > len(set(plain))
    forced = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0,
                                       logit_bias={"77": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == engine.tokenizer.decode([77] * 4)  # +100: nothing else is ever chosen


# ---- the prefill cache --------------------------------------------------------------------------------

def test_follow_up_turn_reuses_the_conversation(server, client, model, engine, snapshot, cache_dir):
    history = [user("Tell me about caches.")]
    first = client.chat.completions.create(model=model, messages=history, max_tokens=8, temperature=0)
    first_ids = engine.tokenizer.encode_chat(history)
    history += [{"role": "assistant", "content": first.choices[0].message.content}, user("And then?")]
    second = client.chat.completions.create(model=model, messages=history, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details.cached_tokens <= 4  # at most the template's '[gMASK]<sop><|user|>\n'
    assert len(first_ids) <= cached < second.usage.prompt_tokens
    assert second.model_extra["timings"]["prefill_tokens"] == second.usage.prompt_tokens - cached

    # a new server process (same cache directory) finds the conversation on disk
    srv = ServerThread(build_app(serve_args(snapshot, cache_dir))).start()
    try:
        again = srv.client().chat.completions.create(model=model, messages=history, max_tokens=8, temperature=0)
    finally:
        srv.stop()
    assert again.choices[0].message.content == second.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= cached
    assert again.model_extra["timings"]["cached_from"]["disk"] > 0


def test_interleaved_conversations_keep_their_own_sessions(snapshot, tmp_path, model, engine):
    """Two conversations sharing a system prompt, turns interleaved, two Sessions: each follow-up turn finds
    its history in its own Session's KV rows (cached from the process, not restored from the cache)."""
    srv = ServerThread(build_app(serve_args(snapshot, tmp_path, "--parallel", "2"))).start()
    system = {"role": "system", "content": "You are a helpful assistant."}
    histories = {name: [system, user(f"Conversation {name} starts here.")] for name in "AB"}
    try:
        client = srv.client()
        for name in "AB":
            reply = client.chat.completions.create(model=model, messages=histories[name], max_tokens=4, temperature=0)
            histories[name] += [{"role": "assistant", "content": reply.choices[0].message.content}, user("More.")]
        for name in "AB":
            first_prompt = len(engine.tokenizer.encode_chat(histories[name][:2]))
            reply = client.chat.completions.create(model=model, messages=histories[name], max_tokens=4, temperature=0)
            assert reply.model_extra["timings"]["cached_from"]["process"] >= first_prompt, name
        assert stats(srv)["sessions"] == 2
    finally:
        srv.stop()


def test_no_cache_server_prefills_everything(snapshot, tmp_path, model):
    srv = ServerThread(build_app(serve_args(snapshot, tmp_path, "--no-cache"))).start()
    try:
        client = srv.client()
        for _ in range(2):
            reply = client.chat.completions.create(model=model, messages=[user("Hello")], max_tokens=4, temperature=0)
            assert reply.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        srv.stop()
    assert not list(tmp_path.glob("*"))  # nothing written


# ---- stop sequences -------------------------------------------------------------------------------------

def test_stop_sequences(client, model):
    kwargs = dict(model=model, prompt="The answer is", max_tokens=40, temperature=0, extra_body=IGNORE_EOS)
    text = client.completions.create(**kwargs).choices[0].text
    # a two-character stop sequence that first occurs a few characters in
    at = next(i for i in range(4, len(text) - 2) if text.find(text[i:i + 2]) == i and "\ufffd" not in text[i:i + 2])
    stop = text[at:at + 2]
    cut = client.completions.create(**kwargs, stop=[stop, "never-appears"])
    assert cut.choices[0].text == text[:at] and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 40
    streamed = list(client.completions.create(**kwargs, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text[:at]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_chat_logprobs_are_the_models(client, model, engine):
    """`logprobs` / `top_logprobs`: one entry per generated token, its log-probability the model's (NumPy's forward
    over the prompt and the reply, within float noise of the server's kernels), the greedy choice the likeliest;
    streamed, the same entries."""
    messages = [user("Hello there")]
    kwargs = dict(model=model, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    reply = client.chat.completions.create(**kwargs)
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens
    prompt = engine.tokenizer.encode_chat(messages)
    tokens = list(Generator(engine.model, engine.eos_token_ids, use_mtp=False).generate(
        prompt, 8, Sampler(SamplingParams())))  # the same greedy reply, here
    logits, _ = engine.model.forward(np.array(prompt + tokens), engine.model.new_cache())
    z = logits[len(prompt) - 1:-1].astype(np.float64)  # [n, V]: the logits that chose each reply token
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    assert [e.token for e in entries] == [engine.tokenizer.decode([t]) for t in tokens]
    for i, entry in enumerate(entries):
        assert abs(entry.logprob - logp[i, tokens[i]]) < 1e-3
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == entry.logprob  # greedy
        assert entry.bytes == list(entry.token.encode())
    streamed = [e for c in client.chat.completions.create(**kwargs, stream=True) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]  # the prompt now cached: float noise apart
    assert np.allclose([e.logprob for e in streamed], [e.logprob for e in entries], atol=1e-4)
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == reply.choices[0].message.content
    for bad, param in (({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model, messages=messages, max_tokens=2, **bad)
        assert error_of(info.value)["param"] == param


def test_completion_logprobs(client, model, engine):
    """/v1/completions' `logprobs: N`: per token its text, log-probability (greedy: the likeliest's), the N
    likeliest by text and its offset in the completion; streamed alike."""
    kwargs = dict(model=model, prompt="def main():", max_tokens=8, temperature=0, logprobs=2,
                  extra_body=IGNORE_EOS)
    reply = client.completions.create(**kwargs)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == reply.usage.completion_tokens
    assert "".join(lp.tokens) == reply.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 2 and max(top.values()) == logprob and top[token] == logprob  # greedy: the likeliest
    streamed = [c.choices[0].logprobs for c in client.completions.create(**kwargs, stream=True)]
    tokens = [t for part in streamed if part for t in part.tokens]
    offsets = [o for part in streamed if part for o in part.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset
    assert np.allclose([v for part in streamed if part for v in part.token_logprobs], lp.token_logprobs, atol=1e-4)
    for bad in (6, -1, "2"):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=model, prompt="Hi", max_tokens=2, logprobs=bad)
        assert error_of(info.value)["param"] == "logprobs"


# ---- errors -----------------------------------------------------------------------------------------------

def error_of(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_auth(server, model):
    with pytest.raises(openai.AuthenticationError) as info:
        server.client(api_key="wrong").chat.completions.create(model=model, messages=[user("Hi")], max_tokens=2)
    assert info.value.status_code == 401 and error_of(info.value)["code"] == "invalid_api_key"
    status, body = raw(server, "POST", "/v1/completions", b'{"prompt": "Hi"}', headers={"Authorization": ""})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert raw(server, "GET", "/v1/models", headers={"Authorization": "Bearer nope"})[0] == 401
    assert raw(server, "GET", "/stats", headers={"Authorization": ""})[0] == 401


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=[user("Hi")], max_tokens=2)
    assert error_of(info.value)["code"] == "model_not_found"


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": "lots"}, "frequency_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": [5]}, "logit_bias"),
    ({"stream": "yes"}, "stream"),
    ({"stop": 42}, "stop"),
    ({"n": 2}, "n"),
    ({"seed": 1.5}, "seed"),
    ({"messages": "Hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "Hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"tools": {"name": "f"}}, "tools"),
])
def test_bad_fields_are_400(client, model, body, param):
    request = {"model": model, "messages": [user("Hi")], "max_tokens": 2, **body}
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/chat/completions", body=request, cast_to=object)
    error = error_of(info.value)
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_bad_json_and_missing_fields(server):
    status, body = raw(server, "POST", "/v1/chat/completions", b'{"messages": [', {"Content-Type": "application/json"})
    assert status == 400 and body["error"]["code"] == "invalid_json"
    status, body = raw(server, "POST", "/v1/chat/completions", b"[1, 2]")
    assert status == 400 and body["error"]["code"] == "invalid_json"
    status, body = raw(server, "POST", "/v1/completions", b"{}")
    assert status == 400 and body["error"]["param"] == "prompt"
    status, body = raw(server, "GET", "/v1/nothing-here")
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}


def test_context_overflow_is_400(client, model):
    long_text = " ".join(str(i) for i in range(1500))  # well over the fixture's 2048-token context
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=[user(long_text)], max_tokens=2)
    assert error_of(info.value)["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=long_text, max_tokens=2)
    assert error_of(info.value)["code"] == "context_length_exceeded"


def test_oversized_body_is_413(client, model, server):
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=model, messages=[user("x" * (2 * MAX_BODY))], max_tokens=2)
    assert info.value.status_code == 413 and error_of(info.value)["code"] == "request_too_large"
    assert raw(server, "GET", "/health")[0] == 200  # still serving


def test_503_while_loading(snapshot):
    release = threading.Event()

    def load() -> Loaded:
        release.wait(30)
        raise RuntimeError("no model today")

    srv = ServerThread(create_app(ServeConfig("m"), load)).start(wait_ready=False)
    try:
        assert raw(srv, "GET", "/health") == (503, {"status": "loading"})
        with pytest.raises(openai.InternalServerError) as info:
            srv.client().chat.completions.create(model="m", messages=[user("Hi")])
        assert info.value.status_code == 503 and error_of(info.value)["code"] == "model_loading"
        release.set()
        deadline = time.monotonic() + 10
        while raw(srv, "GET", "/health")[0] == 503 and time.monotonic() < deadline:
            time.sleep(0.02)
        status, body = raw(srv, "GET", "/health")
        assert status == 500 and "no model today" in body["message"]
    finally:
        srv.stop()


# ---- cancellation, fairness, concurrency --------------------------------------------------------------------

def test_streaming_client_that_leaves_cancels_its_generation(server, client, model):
    stream = client.chat.completions.create(model=model, messages=[user("Count forever")], max_tokens=1500,
                                            temperature=0, stream=True, extra_body=IGNORE_EOS)
    request_id = None
    for i, chunk in enumerate(stream):
        request_id = chunk.id
        if i == 3:
            break
    stream.close()
    record = recent(server, request_id)
    assert record["finish_reason"] == "cancelled"
    assert 3 <= record["completion_tokens"] < 1000


def test_non_streaming_client_that_leaves_cancels_its_generation(server, model):
    before = stats(server)["cancelled"]
    body = json.dumps({"model": model, "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True})
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("POST", "/v1/completions", body=body, headers={"Authorization": f"Bearer {API_KEY}"})
    time.sleep(0.3)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.monotonic() + 20
    while stats(server)["cancelled"] == before:
        assert time.monotonic() < deadline, "the generation was not cancelled"
        time.sleep(0.05)
    record = stats(server)["recent"][-1]
    assert record["finish_reason"] == "cancelled" and record["completion_tokens"] < 1000


def test_requests_are_interleaved_and_health_stays_responsive(server, client, model):
    """Two long streams at once: the second one's first token comes before the first one ends."""
    times: dict[int, list[float]] = {0: [], 1: []}

    def consume(index: int) -> None:
        for chunk in client.completions.create(model=model, prompt=f"Story {index}:", max_tokens=150, temperature=0,
                                               stream=True, extra_body=IGNORE_EOS):
            if chunk.choices and chunk.choices[0].text:
                times[index].append(time.monotonic())

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    health_s = []
    while any(t.is_alive() for t in threads):
        start = time.monotonic()
        assert raw(server, "GET", "/health")[0] == 200
        health_s.append(time.monotonic() - start)
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert times[0] and times[1]
    assert max(times[0][0], times[1][0]) < min(times[0][-1], times[1][-1])
    assert stats(server)["max_active_seen"] >= 2
    assert max(health_s) < 1.0


def test_a_slow_disk_never_stalls_health(snapshot, tmp_path, model, monkeypatch):
    """glm-serve over an expert cache whose every read takes 0.05 s: the reads (seconds of them in all) hold up the
    request's tokens, not /health."""
    read = ExpertCache._read_into
    monkeypatch.setattr(ExpertCache, "_read_into", lambda self, key, data: (time.sleep(0.05), read(self, key, data))[1])
    engine = Engine(snapshot)
    budget = 2 * engine.config.num_experts_per_tok * ExpertCache(engine.container, 1 << 30).slot_bytes
    srv = ServerThread(build_app(serve_args(snapshot, tmp_path, "--expert-cache", str(budget)))).start()
    try:
        done: list[Any] = []
        worker = threading.Thread(target=lambda: done.append(srv.client().completions.create(
            model=model, prompt="Story:", max_tokens=6, temperature=0, extra_body=IGNORE_EOS)))
        worker.start()
        health_s = []
        while worker.is_alive():
            start = time.monotonic()
            assert raw(srv, "GET", "/health")[0] == 200
            health_s.append(time.monotonic() - start)
            time.sleep(0.05)
        worker.join()
        assert done and done[0].usage.completion_tokens == 6
        assert len(health_s) >= 5 and max(health_s) < 1.0  # the request took seconds of reads
        assert sum(health_s) + 0.05 * len(health_s) > 1.0
    finally:
        srv.stop()


def test_max_context_bounds_the_server_s_requests(snapshot, tmp_path, model):
    srv = ServerThread(build_app(serve_args(snapshot, tmp_path, "--max-context", "16"))).start()
    try:
        client = srv.client()
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=model, prompt=list(range(1, 21)), max_tokens=2)
        assert error_of(info.value)["code"] == "context_length_exceeded" and "is 16 tokens" in str(info.value)
        reply = client.completions.create(model=model, prompt=list(range(1, 11)), max_tokens=50, temperature=0,
                                          extra_body=IGNORE_EOS)
        assert reply.usage.prompt_tokens + reply.usage.completion_tokens <= 16
    finally:
        srv.stop()

def test_full_queue_is_429(snapshot, tmp_path, model):
    srv = ServerThread(build_app(serve_args(snapshot, tmp_path, "--parallel", "1", "--max-queue", "0"))).start()
    try:
        client = srv.client()
        stream = client.completions.create(model=model, prompt="Long story", max_tokens=1500, stream=True,
                                           extra_body=IGNORE_EOS)
        next(iter(stream))  # it is running
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model=model, prompt="Me too", max_tokens=2)
        assert error_of(info.value)["code"] == "server_busy"
        stream.close()
        deadline = time.monotonic() + 20
        while stats(srv)["active"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert client.completions.create(model=model, prompt="Now", max_tokens=2).choices[0].finish_reason
    finally:
        srv.stop()


def concurrent_chats(server: ServerThread, model: str, prompts: list[str], max_tokens: int,
                     **extra: Any) -> dict[str, str]:
    """Each prompt's greedy chat reply, all requested at once from their own clients (every other one streamed)."""
    results: dict[str, str] = {}
    errors: list[BaseException] = []

    def worker(prompt: str, stream: bool) -> None:
        try:
            c = server.client()
            if stream:
                chunks = list(c.chat.completions.create(model=model, messages=[user(prompt)], max_tokens=max_tokens,
                                                        temperature=0, stream=True, extra_body=extra))
                assert chunks[-1].choices[0].finish_reason in ("stop", "length")
                results[prompt] = "".join(ch.choices[0].delta.content or "" for ch in chunks)
            else:
                reply = c.chat.completions.create(model=model, messages=[user(prompt)], max_tokens=max_tokens,
                                                  temperature=0, extra_body=extra)
                results[prompt] = reply.choices[0].message.content
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(p, i % 2 == 0)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    return results


def test_concurrent_clients_all_complete(server, client, model):
    prompts = [f"Question number {i}?" for i in range(6)]
    expected = {p: client.chat.completions.create(model=model, messages=[user(p)], max_tokens=16,
                                                  temperature=0).choices[0].message.content for p in prompts}
    assert concurrent_chats(server, model, prompts, 16) == expected


# ---- tools ----------------------------------------------------------------------------------------------------

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}


def test_tools_and_tool_messages_reach_the_prompt(client, model, engine):
    messages = [user("Weather in Paris?"),
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    reply = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER_TOOL], max_tokens=4,
                                           temperature=0)
    # the fixture's template knows no tools: they are folded into the text in GLM's own format
    text = engine.tokenizer.render_chat([
        {"role": "system", "content": reply_system_text()}, user("Weather in Paris?"),
        {"role": "assistant", "content": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
                                         "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"},
        {"role": "tool", "content": '<tool_response>\n{"temp": 21}\n</tool_response>'}])
    assert reply.usage.prompt_tokens == len(engine.tokenizer.encode(text))
    assert "<|observation|>\n<tool_response>" in text and "<tools>\n" in text


def reply_system_text() -> str:
    from glmkit.serve.toolcalls import tools_system_text

    return tools_system_text([WEATHER_TOOL])


class ScriptedScheduler:
    """Stands in for the generation worker: every request 'generates' `text` in small pieces."""

    def __init__(self, text: str):
        self.text = text

    def submit(self, request: GenRequest, emit):
        pieces = [self.text[i:i + 3] for i in range(0, len(self.text), 3)]
        for piece in pieces:
            emit(Text(piece))
        emit(Done("stop", len(request.prompt_ids), 0, len(pieces), {"process": 0, "ram": 0, "disk": 0},
                  0.0, 0.01, 0.01, 0.01))
        return object()

    def cancel(self, job) -> None:
        pass

    def stop(self) -> None:
        pass


SCRIPTED = ("I will check.</think>Let me look that up.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
            "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
            "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>")


def test_tool_calls_in_the_reply_become_openai_tool_calls(engine):
    config = ServeConfig("m", split_reasoning=True)
    srv = ServerThread(create_app(config, lambda: Loaded(engine, ScriptedScheduler(SCRIPTED)))).start()
    try:
        client = srv.client()
        reply = client.chat.completions.create(model="m", messages=[user("Weather?")], tools=[WEATHER_TOOL])
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls"
        assert message.content == "Let me look that up."
        assert message.model_extra["reasoning_content"] == "I will check."
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
        assert calls == [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Rome"})]
        assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls)

        chunks = list(client.chat.completions.create(model="m", messages=[user("Weather?")], tools=[WEATHER_TOOL],
                                                     stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks)
        streamed = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
        assert (content, reasoning) == ("Let me look that up.", "I will check.")
        assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in streamed] == \
            [(0, "get_weather", {"city": "Paris", "days": 3}), (1, "get_weather", {"city": "Rome"})]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

        # without tools in the request the text is passed through untouched
        plain = client.chat.completions.create(model="m", messages=[user("Weather?")])
        assert plain.choices[0].message.content.startswith("Let me look") and not plain.choices[0].message.tool_calls
    finally:
        srv.stop()


# ---- the command line -----------------------------------------------------------------------------------------

def test_cli_serves_and_refuses_bad_snapshots(snapshot, tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([sys.executable, "-m", "glmkit.cli.serve", str(snapshot), "--port", str(port),
                             "--cache-dir", str(tmp_path / "cache"), "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.05)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)  # no --api-key: no auth
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "Hi", "max_tokens": 3}))
        assert conn.getresponse().status == 200
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    bad = subprocess.run([sys.executable, "-m", "glmkit.cli.serve", str(tmp_path)], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 1 and bad.stderr.startswith("glm-serve: error: ") and len(bad.stderr.splitlines()) == 1
