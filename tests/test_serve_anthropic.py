"""glm-serve's Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`), driven by the official
`anthropic` client against a real server: the same text as the OpenAI route for the same conversation, Anthropic's
event stream, stop sequences, tools with a tool_result round trip, thinking blocks, and Anthropic-shaped errors."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import jsonschema
import pytest

from glmkit.cli.serve import build_app, build_parser
from glmkit.serve.app import Loaded, ServeConfig, create_app
from tests.test_serve import API_KEY, SCRIPTED, WEATHER_TOOL, ScriptedScheduler, ServerThread, raw, serve_args

GREEDY = {"temperature": 0}  # the current client sends no sampling fields: greedy through the body
WEATHER = {"name": "get_weather", "description": WEATHER_TOOL["function"]["description"],
           "input_schema": WEATHER_TOOL["function"]["parameters"]}


@pytest.fixture(scope="module")
def server(snapshot, tmp_path_factory):
    srv = ServerThread(build_app(serve_args(snapshot, tmp_path_factory.mktemp("anthropic-cache")))).start()
    yield srv
    srv.stop()


def messages_client(server: ServerThread, api_key: str = API_KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return messages_client(server)


@pytest.fixture(scope="module")
def model(snapshot) -> str:
    return snapshot.name


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def test_a_message_is_the_chat_completion_of_the_same_conversation(server, client, model, engine):
    """Greedy, thinking off (Anthropic's default): the text the OpenAI route gives for the system prompt and turn;
    usage splits the prompt into fresh and prefix-cached tokens."""
    reply = client.messages.create(model=model, max_tokens=12, system="Be brief.", extra_body=GREEDY,
                                   messages=[user("Hello there")])
    chat = server.client().chat.completions.create(
        model=model, max_tokens=12, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}])
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert [block.type for block in reply.content] == ["text"]
    assert reply.content[0].text == chat.choices[0].message.content
    assert reply.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    prompt = engine.tokenizer.encode(engine.tokenizer.render_chat(
        [{"role": "system", "content": "Be brief."}, user("Hello there")], False))
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == len(prompt)
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    again = client.messages.create(model=model, max_tokens=12, system=[{"type": "text", "text": "Be brief."}],
                                   extra_body=GREEDY, messages=[{"role": "user", "content": [
                                       {"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}])
    assert again.content[0].text == reply.content[0].text  # system and content as blocks: the same prompt
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == len(prompt)
    counted = client.messages.count_tokens(model=model, system="Be brief.", messages=[user("Hello there")])
    assert counted.input_tokens == len(prompt)


def test_a_thinking_budget_closes_the_thinking_block(client, model):
    """`thinking.budget_tokens`: the reply thinks at most that many tokens, then its text starts; within the budget
    it is the reply without one (greedy). A budget that is no positive integer is a 400 naming it."""
    kwargs = dict(model=model, max_tokens=24, extra_body=GREEDY, messages=[user("Tell me a story")])
    free = client.messages.create(thinking={"type": "enabled", "budget_tokens": 1024}, **kwargs)
    budgeted = client.messages.create(thinking={"type": "enabled", "budget_tokens": 5}, **kwargs)
    assert [b.type for b in free.content] == ["thinking"] and free.stop_reason == "max_tokens"  # never closed
    assert [b.type for b in budgeted.content] == ["thinking", "text"] and budgeted.usage.output_tokens == 24
    longer = client.messages.create(thinking={"type": "enabled", "budget_tokens": 10}, **kwargs)
    thoughts = [budgeted.content[0].thinking, longer.content[0].thinking, free.content[0].thinking]
    assert thoughts[1].startswith(thoughts[0]) and thoughts[2].startswith(thoughts[1])
    assert 0 < len(thoughts[0]) < len(thoughts[1]) < len(thoughts[2])
    with client.messages.stream(thinking={"type": "enabled", "budget_tokens": 5}, **kwargs) as stream:
        assert [b.model_dump() for b in stream.get_final_message().content] == [b.model_dump()
                                                                                 for b in budgeted.content]
    for bad in (0, 2.5, "5", True):
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(thinking={"type": "enabled", "budget_tokens": bad}, **kwargs)
        assert "thinking.budget_tokens" in error_of(info.value)["message"]

def test_a_thinking_budget_past_the_context_is_capped_to_it(client, model):
    """A budget larger than the context is the context's: with a strict tool (whose grammar holds the thinking
    block) the reply is the one a budget the reply never reaches gives, not a 400 blamed on `tools`."""
    kwargs = dict(model=model, max_tokens=6, extra_body=GREEDY, messages=[user("Tell me a story")],
                  tools=[{"name": "f", "strict": True, "input_schema": {"type": "object"}}])
    huge = client.messages.create(thinking={"type": "enabled", "budget_tokens": 2**70}, **kwargs)
    within = client.messages.create(thinking={"type": "enabled", "budget_tokens": 1024}, **kwargs)
    assert [b.model_dump() for b in huge.content] == [b.model_dump() for b in within.content]
    assert huge.content[0].type == "thinking"


def test_streaming_gives_the_same_message_as_anthropics_events(server, client, model):
    kwargs = dict(model=model, max_tokens=16, extra_body=GREEDY, messages=[user("Tell me a story")])
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        names = [event.type for event in stream]
        final = stream.get_final_message()
    assert [block.model_dump() for block in final.content] == [block.model_dump() for block in whole.content]
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert names[0] == "message_start" and names[-1] == "message_stop" and names[-2] == "message_delta"
    assert names.count("content_block_start") == names.count("content_block_stop") == len(whole.content)
    # the raw stream: named server-sent events, no OpenAI `[DONE]`
    status, text = raw(server, "POST", "/v1/messages", headers={"x-api-key": API_KEY, "Authorization": ""},
                       body=b'{"max_tokens": 4, "stream": true, "messages": [{"role": "user", "content": "Hi"}]}')
    assert status == 200 and text.startswith("event: message_start\ndata: ") and "[DONE]" not in text


def test_stop_sequences_end_the_message(client, model):
    kwargs = dict(model=model, max_tokens=40, extra_body={**GREEDY, "ignore_eos": True},
                  messages=[user("Count with me")])
    text = client.messages.create(**kwargs).content[0].text
    at = next(i for i in range(4, len(text) - 2) if text.find(text[i:i + 2]) == i and "\ufffd" not in text[i:i + 2])
    stop = text[at:at + 2]
    cut = client.messages.create(**kwargs, stop_sequences=["never-appears", stop])
    assert cut.content[0].text == text[:at]
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    with client.messages.stream(**kwargs, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == text[:at] and final.stop_sequence == stop


def test_tool_use_thinking_and_the_tool_result_round_trip(engine):
    """A reply with thinking and two tool calls (a scripted worker) as thinking and tool_use blocks, whole and
    streamed; the assistant's tool_use and the user's tool_result sent back reach the prompt as the OpenAI
    route's tool_calls and tool messages do."""
    config = ServeConfig("m")
    srv = ServerThread(create_app(config, lambda: Loaded(engine, ScriptedScheduler(SCRIPTED)))).start()
    try:
        client = messages_client(srv)
        kwargs = dict(model="m", max_tokens=64, tools=[WEATHER], messages=[user("Weather?")],
                      thinking={"type": "enabled", "budget_tokens": 1024})
        reply = client.messages.create(**kwargs)
        assert [block.type for block in reply.content] == ["thinking", "text", "tool_use", "tool_use"]
        assert reply.content[0].thinking == "I will check." and reply.content[1].text == "Let me look that up."
        calls = [(block.name, block.input) for block in reply.content[2:]]
        assert calls == [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Rome"})]
        assert reply.stop_reason == "tool_use" and all(b.id.startswith("toolu_") for b in reply.content[2:])
        with client.messages.stream(**kwargs) as stream:
            final = stream.get_final_message()
        assert [b.model_dump(exclude={"id"}) for b in final.content] == \
            [b.model_dump(exclude={"id"}) for b in reply.content]
        assert final.stop_reason == "tool_use"

        # without tools in the request the text is passed through untouched
        plain = client.messages.create(model="m", max_tokens=64, messages=[user("Weather?")])
        assert [b.type for b in plain.content] == ["text"] and "<tool_call>" in plain.content[0].text

        follow_up = [user("Weather in Paris?"),
                     {"role": "assistant", "content": [
                         {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                          "input": {"city": "Paris", "days": 2}}]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": "toolu_1", "content": '{"temp": 21}'}]}]
        counted = client.messages.count_tokens(model="m", tools=[WEATHER], messages=follow_up)
        chat = srv.client().chat.completions.create(
            model="m", tools=[WEATHER_TOOL], extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            messages=[{"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"id": "toolu_1", "type": "function",
                           "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
                      {"role": "tool", "tool_call_id": "toolu_1", "content": '{"temp": 21}'}])
        assert counted.input_tokens == chat.usage.prompt_tokens
    finally:
        srv.stop()


def error_of(exc: anthropic.APIStatusError) -> dict[str, Any]:
    return body_error(exc.response.json())


def body_error(body: Any) -> dict[str, Any]:
    """The error of an Anthropic-shaped error body (asserts the shape)."""
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    return body["error"]


def test_errors_take_anthropics_shape(server, client, model):
    with pytest.raises(anthropic.AuthenticationError) as info:
        messages_client(server, "wrong").messages.create(model=model, max_tokens=2, messages=[user("Hi")])
    assert error_of(info.value)["type"] == "authentication_error"
    status, body = raw(server, "POST", "/v1/messages", b"{}", headers={"Authorization": ""})
    assert status == 401 and body["error"]["type"] == "authentication_error"
    # the key as a bearer token (OpenAI's way) is taken too
    assert raw(server, "POST", "/v1/messages/count_tokens", b'{"messages": [{"role": "user", "content": "Hi"}]}'
               )[0] == 200
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=2, messages=[user("Hi")])
    assert error_of(info.value)["type"] == "not_found_error"
    bad: list[tuple[dict[str, Any], str]] = [
        ({"messages": [user("Hi")]}, "max_tokens"),
        ({"max_tokens": 0, "messages": [user("Hi")]}, "max_tokens"),
        ({"max_tokens": 2, "messages": []}, "messages"),
        ({"max_tokens": 2, "messages": [{"role": "system", "content": "Hi"}]}, "messages.0.role"),
        ({"max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
         "messages.0.content.0.type"),
        ({"max_tokens": 2, "temperature": 1.5, "messages": [user("Hi")]}, "temperature"),
        ({"max_tokens": 2, "stop_sequences": "x", "messages": [user("Hi")]}, "stop_sequences"),
        ({"max_tokens": 2, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
          "messages": [user("Hi")]}, "tools.0.type"),
        ({"max_tokens": 2, "thinking": {"type": "sometimes"}, "messages": [user("Hi")]}, "thinking"),
    ]
    for body, field in bad:
        with pytest.raises(anthropic.BadRequestError) as info:
            client.post("/v1/messages", body=body, cast_to=object)
        error = error_of(info.value)
        assert error["type"] == "invalid_request_error" and field in error["message"], (body, error)
    status, body = raw(server, "POST", "/v1/messages", b"{not json", headers={"x-api-key": API_KEY})
    assert status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    status, body = raw(server, "GET", "/v1/messages")
    assert status == 405 and body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("fields, said", [
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "properties": "abc"}}],
      "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}, "'tools.0.input_schema.properties'"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": [{}]}}}}]},
     "'tools.0.input_schema.properties.a.type'"),
    ({"tools": [{"name": "f"}], "tool_choice": {"type": "tool", "name": ["f"]}}, "'tool_choice.name'"),
    ({"tools": [{"name": "f"}], "tool_choice": {"type": "tool", "name": {}}}, "'tool_choice.name'"),
    ({"tools": [{"name": "f", "strict": True, "input_schema": {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": [{}]}}]}, "required an array"),
], ids=["properties string", "property type", "tool name list", "tool name object", "strict required object"])
def test_malformed_tools_and_tool_choice_are_400s_naming_the_field(server, fields, said):
    """Checked when the request arrives, in Anthropic's shape."""
    body = {"max_tokens": 40, "temperature": 0, "messages": [user("Hi")], **fields}
    status, error = raw(server, "POST", "/v1/messages", json.dumps(body).encode())
    assert status == 400, error
    error = body_error(error)
    assert error["type"] == "invalid_request_error" and said in error["message"], error


def test_output_config_format_constrains_the_reply(client, model):
    """Anthropic's structured output: the reply's text is JSON matching the schema (the random fixture writes none
    unconstrained); a schema the grammar library refuses is a 400."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "days"], "additionalProperties": False}
    reply = client.messages.create(model=model, max_tokens=120, messages=[user("Plan a trip")], extra_body=GREEDY,
                                   output_config={"format": {"type": "json_schema", "schema": schema}})
    assert reply.stop_reason == "end_turn"
    jsonschema.validate(json.loads(reply.content[0].text), schema)
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=model, max_tokens=4, messages=[user("Hi")], output_config={
            "format": {"type": "json_schema", "schema": {"type": "string", "pattern": "(?<=a)b"}}})
    assert "output_config.format" in error_of(info.value)["message"]


@pytest.mark.parametrize("aliases", [("claude-sonnet-4-5", "claude-haiku-4-5"), ("*",)], ids=["named", "any"])
def test_model_aliases_answer_to_the_ids_an_agent_sends(engine, aliases):
    """`--model-alias`: an agent that sends its own model ids (a main and a small model) is served under them on
    both APIs, replies naming the served model; both APIs' model listings name them; ids outside the aliases stay a
    404, unless "*" is one of them."""
    args = build_parser().parse_args(["unused", "--model-name", "m", *[f"--model-alias={a}" for a in aliases]])
    config = ServeConfig("m", model_aliases=tuple(args.model_alias))
    srv = ServerThread(create_app(config, lambda: Loaded(engine, ScriptedScheduler("Hello there")))).start()
    try:
        client = messages_client(srv)
        for name in ("m", "claude-sonnet-4-5", "claude-haiku-4-5"):
            reply = client.messages.create(model=name, max_tokens=8, messages=[user("Hi")])
            assert reply.content[0].text == "Hello there" and reply.model == "m"
        chat = srv.client().chat.completions.create(model="claude-haiku-4-5", messages=[user("Hi")], max_tokens=8)
        assert chat.choices[0].message.content == "Hello there" and chat.model == "m"
        named = ["m", *(a for a in aliases if a != "*")]  # the listings: the model, then each alias but "*"
        assert [m.id for m in srv.client().models.list().data] == named
        assert [(m.id, m.type, m.display_name) for m in client.models.list().data] == [(n, "model", n) for n in named]
        assert srv.client().models.retrieve("claude-sonnet-4-5").id == "claude-sonnet-4-5"
        card = client.models.retrieve("claude-haiku-4-5")
        assert (card.id, card.max_input_tokens) == ("claude-haiku-4-5", engine.config.max_position_embeddings)
        if "*" in aliases:
            assert client.messages.create(model="gpt-4o", max_tokens=8, messages=[user("Hi")]).model == "m"
        else:
            with pytest.raises(anthropic.NotFoundError):
                client.messages.create(model="gpt-4o", max_tokens=8, messages=[user("Hi")])
            with pytest.raises(anthropic.NotFoundError) as info:  # in Anthropic's error shape off /v1/messages too
                client.models.retrieve("gpt-4o")
            assert error_of(info.value)["type"] == "not_found_error"
    finally:
        srv.stop()
