"""Tool calls held to their schemas (glmkit.serve.tool_grammar): a forced call (`tool_choice` "required", a named
function; Anthropic's `any` / `tool`) and strict tools' arguments. The grammar alone, token by token, over the
fixture's vocabulary and over one where the markers are added tokens (as GLM-5's are); generation on the random
fixture, whose free output never calls a tool, where every forced reply parses into calls whose arguments validate
(jsonschema), greedy and sampled; and both APIs through glm-serve with the official clients."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import jsonschema
import llguidance
import llguidance.numpy
import numpy as np
import openai
import pytest
from tokenizers import AddedToken, Tokenizer

from glmkit.generate.constraint import GrammarTokenizer
from glmkit.generate.generator import Generator
from glmkit.generate.sampling import Sampler, SamplingParams
from glmkit.serve.tool_grammar import MARKERS, ToolChoice, needs_grammar, tool_call_grammar
from glmkit.serve.toolcalls import parse_tool_calls
from tests.runtime_support import FIXTURES
from tests.test_serve import API_KEY, ServerThread, build_app, raw, serve_args

# every value bounded: a random model inside an open string or array may not close it within any budget of tokens
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 9},
    "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}
BOOKING = {"type": "object", "properties": {
    "guest": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                               "vip": {"type": "boolean"}},
              "required": ["id", "vip"], "additionalProperties": False},
    "rooms": {"type": "array", "items": {"$ref": "#/$defs/room"}, "minItems": 1, "maxItems": 2},
    "note": {"type": ["string", "null"], "minLength": 1, "maxLength": 6}},
    "required": ["guest", "rooms", "note"], "additionalProperties": False,
    "$defs": {"room": {"enum": ["single", "double"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": WEATHER}},
         {"type": "function", "function": {"name": "book", "strict": True, "parameters": BOOKING}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
FREE_TOOL = {"type": "function", "function": {"name": "note", "parameters": {"type": "object"}}}


def marker_tokenizer() -> Tokenizer:
    """The fixture's tokenizer with the tool-call markers as added tokens of their own (as GLM-5's vocabulary)."""
    tok = Tokenizer.from_file(str(FIXTURES / "tiny-trained" / "tokenizer.json"))
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS if m != "</think>"])
    return tok


@pytest.fixture(scope="module", params=["text markers", "token markers"])
def vocab(request) -> tuple[Tokenizer, GrammarTokenizer]:
    tok = (Tokenizer.from_file(str(FIXTURES / "tiny-trained" / "tokenizer.json")) if request.param == "text markers"
           else marker_tokenizer())
    return tok, GrammarTokenizer(tok, tok.get_vocab_size(), (tok.token_to_id("<|endoftext|>"),))


def accepts(vocab, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` (as the tokenizer splits it) whole."""
    tok, grammar_tokenizer = vocab
    matcher = llguidance.LLMatcher(grammar_tokenizer.ll, grammar)
    return all(matcher.consume_token(i) for i in tok.encode(text, add_special_tokens=False).ids) and \
        matcher.is_accepting()


def grammar(vocab, choice: ToolChoice, reasoning: bool = False, tools=(*TOOLS, FREE_TOOL)) -> str:
    text = tool_call_grammar(list(tools), choice, reasoning, vocab[1].added_token_ids(MARKERS))
    vocab[1].constraint(text)  # the library compiles it
    return text


def call(name: str, *pairs: tuple[str, str], newlines: bool = False) -> str:
    sep = "\n" if newlines else ""
    args = "".join(f"{sep}<arg_key>{k}</arg_key>{sep}<arg_value>{v}</arg_value>" for k, v in pairs)
    return f"<tool_call>{name}{args}{sep}</tool_call>"


def test_the_markers_are_added_tokens_only_where_the_vocabulary_says(vocab):
    ids = vocab[1].added_token_ids(MARKERS)
    assert ids["</think>"] == vocab[0].token_to_id("</think>")
    assert ("<tool_call>" in ids) == (vocab[0].get_vocab_size() > 384)


def test_a_forced_call_follows_its_schema(vocab):
    forced = grammar(vocab, ToolChoice(required=True))
    good = call("get_weather", ("city", "Paris"), ("days", "3"))
    assert accepts(vocab, forced, good) and accepts(vocab, forced, call("get_weather", ("city", "P"), newlines=True))
    assert accepts(vocab, forced, good + "\n" + call("note", ("any", "thing")))  # parallel calls; a free tool
    assert accepts(vocab, forced, call("book", ("guest", '{"id":7,"vip":true}'), ("rooms", '["single"]'),
                                       ("note", "hi")))
    bad = [("text first", "Sure. " + good), ("no call", ""), ("unknown tool", call("get_time")),
           ("required key missing", call("get_weather", ("days", "3"))),
           ("out of range", call("get_weather", ("city", "P"), ("days", "10"))),
           ("not in the enum", call("get_weather", ("city", "P"), ("unit", "k"))),
           ("string too long", call("get_weather", ("city", "P" * 13))),
           ("keys out of order", call("get_weather", ("days", "3"), ("city", "P"))),
           ("undeclared key", call("get_weather", ("city", "P"), ("zone", "x"))),
           ("a $ref's enum", call("book", ("guest", '{"id":7,"vip":true}'), ("rooms", '["triple"]'), ("note", "a"))),
           ("nested key missing", call("book", ("guest", '{"id":7}'), ("rooms", '["single"]'), ("note", "a"))),
           ("unclosed", good[:-len("</tool_call>")])]
    for what, text in bad:
        assert not accepts(vocab, forced, text), what
    one = grammar(vocab, ToolChoice(required=True, name="get_weather", parallel=False))
    assert accepts(vocab, one, good) and not accepts(vocab, one, good + good)
    assert not accepts(vocab, one, call("book", ("guest", '{"id":7,"vip":true}'), ("rooms", '["single"]'),
                                        ("note", "hi")))


def test_strict_tools_leave_text_free_and_hold_every_call(vocab):
    auto = grammar(vocab, ToolChoice(), reasoning=True)
    good = call("get_weather", ("city", "Paris"))
    for text in ["Plain words only.", "Let me check. " + good, f"{good} and {good} done"]:
        assert accepts(vocab, auto, "thinking</think>" + text), text
    # thinking may mention the marker as text; where the marker is an added token, free text holds no added token
    mention = "the <tool_call> format</think>" + good
    assert accepts(vocab, auto, mention) == ("<tool_call>" not in vocab[1].added_token_ids(MARKERS))
    for text in [good,  # the thinking block missing
                 "x</think>I will. " + call("get_weather", ("city", "P"), ("days", "0")),
                 "x</think>a <tool_call>get_time</tool_call>"]:
        assert not accepts(vocab, auto, text), text
    single = grammar(vocab, ToolChoice(parallel=False))
    assert accepts(vocab, single, "ok " + good) and not accepts(vocab, single, good + good)


def test_strict_tools_with_a_thinking_budget_close_the_block_past_it(vocab):
    """With a budget the thinking block takes at most that many tokens, then only `</think>` may come; the model
    may close it sooner. (`</think>` is one added token of both vocabularies here.)"""
    tok, grammar_tokenizer = vocab
    budgeted = tool_call_grammar([*TOOLS, FREE_TOOL], ToolChoice(), True, grammar_tokenizer.added_token_ids(MARKERS), 4)
    close = tok.token_to_id("</think>")
    words = tok.encode("one two three four five six", add_special_tokens=False).ids
    matcher = llguidance.LLMatcher(grammar_tokenizer.ll, budgeted)
    assert all(matcher.consume_token(i) for i in words[:4])
    bits = np.zeros((1, -(-grammar_tokenizer.ll.vocab_size // 32)), np.int32)
    llguidance.numpy.fill_next_token_bitmask(matcher, bits, 0)
    assert list(np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))) == [close]
    assert matcher.consume_token(close) and not matcher.is_error()
    assert accepts(vocab, budgeted, "one two</think>Done.")
    assert not accepts(vocab, budgeted, "one two three four five six seven eight nine</think>Done.")

def test_names_and_keys_are_literal_text(vocab):
    name, key = 'wé"ird', 'k"ü\\'
    tools = [{"type": "function", "function": {"name": name, "strict": True, "parameters": {
        "type": "object", "properties": {key: {"type": "string", "maxLength": 3}}, "required": [key]}}}]
    forced = grammar(vocab, ToolChoice(required=True), tools=tools)
    assert accepts(vocab, forced, call(name, (key, "ab")))
    assert not accepts(vocab, forced, call("weird", (key, "ab"))) and not accepts(vocab, forced, call(name, ("k", "a")))


def test_what_needs_a_grammar_and_what_cannot_be_enforced(vocab):
    free = [FREE_TOOL]
    assert not needs_grammar(free, ToolChoice()) and needs_grammar(free, ToolChoice(required=True))
    assert needs_grammar(TOOLS, ToolChoice()) and not needs_grammar(None, ToolChoice(required=True))
    ids = vocab[1].added_token_ids(MARKERS)
    cases = [({"type": "object", "properties": {"z": {"type": "string", "pattern": "^[0-9]+$"}}}, "'z'", "pattern"),
             ({"type": "object", "properties": {}, "required": ["q"]}, "'q'", "not among its properties"),
             ({"anyOf": [{"type": "object"}]}, "'t'", "object schema"),
             ({"type": "object", "properties": {"e": {"type": "string", "enum": [1, 2]}}}, "'e'", "no string")]
    for parameters, named, said in cases:
        tool = {"type": "function", "function": {"name": "t", "strict": True, "parameters": parameters}}
        with pytest.raises(ValueError, match=said) as info:
            tool_call_grammar([tool], ToolChoice(), False, ids)
        assert named in str(info.value) and "'t'" in str(info.value)
    with pytest.raises(ValueError, match="not among the tools"):
        tool_call_grammar(TOOLS, ToolChoice(required=True, name="nope"), False, ids)


def strict_tool(schema: dict[str, Any], required: Any = None) -> dict[str, Any]:
    """A strict tool 't' whose one parameter 'a' is a string with these keywords, and `required` where given."""
    parameters: dict[str, Any] = {"type": "object", "properties": {"a": {"type": "string", **schema}}}
    if required is not None:
        parameters["required"] = required
    return {"type": "function", "function": {"name": "t", "strict": True, "parameters": parameters}}


TOOL_T, PARAMETER_A = "tool 't': ", "tool 't', parameter 'a': "
MALFORMED_STRICT = {  # a strict tool's schema, and how the error about it starts
    "required holds an array": (strict_tool({}, required=[[1]]), TOOL_T + "parameters.properties must be an object "
                                                                          "and required an array of strings"),
    "required holds an object": (strict_tool({}, required=[{}]), TOOL_T + "parameters.properties must be an object "
                                                                          "and required an array of strings"),
    "enum a number": (strict_tool({"enum": 5}), PARAMETER_A + "enum must be an array"),
    "enum a string": (strict_tool({"enum": "ab"}), PARAMETER_A + "enum must be an array"),
    "minLength infinite": (strict_tool({"minLength": float("inf")}), PARAMETER_A + "minLength must be an integer"),
    "minLength -infinite": (strict_tool({"minLength": float("-inf")}), PARAMETER_A + "minLength must be an integer"),
    "minLength fractional": (strict_tool({"minLength": 2.7}), PARAMETER_A + "minLength must be an integer"),
    "minLength a boolean": (strict_tool({"minLength": True}), PARAMETER_A + "minLength must be an integer"),
    "minLength a string": (strict_tool({"minLength": "x"}), PARAMETER_A + "minLength must be an integer"),
    "maxLength an array": (strict_tool({"maxLength": [1]}), PARAMETER_A + "maxLength must be an integer"),
    "maxLength negative": (strict_tool({"maxLength": -5}), PARAMETER_A + "maxLength must be an integer"),
    "maxLength 1e30": (strict_tool({"maxLength": 1e30}), PARAMETER_A + "maxLength must be an integer"),
    "maxLength past u32": (strict_tool({"maxLength": 2**32}), PARAMETER_A + "maxLength must be an integer"),
    "minLength over maxLength": (strict_tool({"minLength": 5, "maxLength": 2}),
                                 PARAMETER_A + "minLength 5 is more than maxLength 2"),
}


@pytest.mark.parametrize("tool, said", MALFORMED_STRICT.values(), ids=MALFORMED_STRICT.keys())
def test_a_malformed_strict_schema_is_a_value_error_naming_it(tool, said):
    """What the grammar reads of a strict tool's schema is checked before the grammar library sees it."""
    with pytest.raises(ValueError) as info:
        tool_call_grammar([tool], ToolChoice(), False, {})
    assert str(info.value).startswith(said)


# ---- generation on the random fixture ----------------------------------------------------------------------

def generate(engine, grammar_text: str, params: SamplingParams, max_tokens: int = 200) -> tuple[str, bool]:
    """(the reply's text, whether it ended with end of sequence)."""
    gt = GrammarTokenizer(engine.tokenizer.tokenizer, engine.config.vocab_size, tuple(engine.eos_token_ids))
    gen = Generator(engine.model, tuple(engine.eos_token_ids), use_mtp=False)
    sampler = Sampler(params, gt.constraint(grammar_text))
    tokens = list(gen.generate(engine.tokenizer.encode("Book a room:"), max_tokens, sampler))
    ended = tokens[-1] in engine.eos_token_ids
    return engine.tokenizer.decode(tokens[:-1] if ended else tokens), ended


def check_calls(text: str, tools=TOOLS) -> list:
    rest, calls = parse_tool_calls(text, tools)
    assert calls and rest == "", text
    for c in calls:
        jsonschema.validate(c.arguments, SCHEMAS[c.name])
    return calls


@pytest.mark.parametrize("name", [None, "get_weather", "book"])
@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 1), (1.0, 2)])
def test_forced_calls_on_the_random_fixture_validate(engine, name, temperature, seed):
    ids = GrammarTokenizer(engine.tokenizer.tokenizer, engine.config.vocab_size,
                           tuple(engine.eos_token_ids)).added_token_ids(MARKERS)
    text, ended = generate(engine, tool_call_grammar(TOOLS, ToolChoice(True, name, parallel=False), False, ids),
                           SamplingParams(temperature, seed=seed))
    assert ended, "one call, then the grammar allows only the end of sequence"
    calls = check_calls(text)
    assert len(calls) == 1 and (name is None or calls[0].name == name)


def test_free_output_of_the_fixture_calls_no_tool(engine):
    """The constraint is what makes the replies above calls: the same model and prompt without it make none."""
    gen = Generator(engine.model, tuple(engine.eos_token_ids), use_mtp=False)
    tokens = list(gen.generate(engine.tokenizer.encode("Book a room:"), 60, Sampler(SamplingParams())))
    assert parse_tool_calls(engine.tokenizer.decode(tokens), TOOLS)[1] == []


# ---- through glm-serve ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(snapshot, tmp_path_factory):
    srv = ServerThread(build_app(serve_args(snapshot, tmp_path_factory.mktemp("tool-grammar-cache")))).start()
    yield srv
    srv.stop()


def openai_call(client: openai.OpenAI, model: str, **kwargs: Any):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Book a room."}],
                                          max_tokens=200, tools=TOOLS, **kwargs)


def test_tool_choice_through_the_openai_route(server, snapshot):
    client = server.client()
    named = {"type": "function", "function": {"name": "book"}}
    for temperature in (0, 1.0):
        reply = openai_call(client, snapshot.name, tool_choice=named, temperature=temperature, seed=3,
                            parallel_tool_calls=False)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        entry = choice.message.tool_calls[0].function
        assert entry.name == "book"
        jsonschema.validate(json.loads(entry.arguments), BOOKING)
    chunks = list(openai_call(client, snapshot.name, tool_choice="required", temperature=0, stream=True,
                              parallel_tool_calls=False))
    calls = [c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or []]
    assert len(calls) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS[calls[0].function.name])

    strict_pattern = [{"type": "function", "function": {"name": "t", "strict": True, "parameters": {
        "type": "object", "properties": {"z": {"type": "string", "pattern": "^a$"}}}}}]
    bad = [({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among"),
           ({"tool_choice": "always"}, "tool_choice", "required"),
           ({"tool_choice": "required", "extra_body": {"ignore_eos": True}}, "ignore_eos", "forced"),
           ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "combined"),
           ({"tools": strict_pattern}, "tools", "pattern"),  # strict tools in auto mode build the grammar too
           ({"tool_choice": "required", "parallel_tool_calls": "no"}, "parallel_tool_calls", "boolean")]
    for kwargs, param, said in bad:
        args = {"model": snapshot.name, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                "tools": TOOLS, **kwargs}
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**args)
        error = info.value.response.json()["error"]
        assert error["param"] == param and said in error["message"], error
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=snapshot.name, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=4, tool_choice="required")
    assert "no tools" in info.value.response.json()["error"]["message"]


@pytest.mark.parametrize("name", ["required holds an array", "enum a number", "minLength infinite",
                                  "maxLength an array", "maxLength negative"])
def test_a_malformed_strict_schema_is_a_400_on_both_routes(server, name):
    """A 400 naming the tool, parameter and keyword, not a 500 or the grammar library's internals."""
    tool, said = MALFORMED_STRICT[name]
    function = tool["function"]
    anthropic_tool = {"name": function["name"], "strict": True, "input_schema": function["parameters"]}
    for path, tools in (("/v1/chat/completions", [tool]), ("/v1/messages", [anthropic_tool])):
        body = {"max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "tools": tools}
        status, error = raw(server, "POST", path, json.dumps(body).encode())
        assert status == 400 and error["error"]["message"].startswith("tools: " + said), (path, error)
        assert path == "/v1/messages" or error["error"]["param"] == "tools"


def test_tool_choice_through_the_anthropic_route(server, snapshot):
    client = anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"], "strict": True}
             for t in TOOLS]
    kwargs = dict(model=snapshot.name, max_tokens=200, tools=tools, extra_body={"temperature": 0},
                  messages=[{"role": "user", "content": "Weather?"}])
    reply = client.messages.create(**kwargs, tool_choice={"type": "tool", "name": "get_weather",
                                                          "disable_parallel_tool_use": True})
    assert reply.stop_reason == "tool_use" and [b.type for b in reply.content] == ["tool_use"]
    assert reply.content[0].name == "get_weather"
    jsonschema.validate(reply.content[0].input, WEATHER)
    with client.messages.stream(**kwargs, tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        final = stream.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and len(uses) == 1
    jsonschema.validate(uses[0].input, SCHEMAS[uses[0].name])
    for extra, said in [({"tool_choice": {"type": "any"}, "thinking": {"type": "enabled", "budget_tokens": 1024}},
                         "thinking may not be enabled"),
                        ({"tool_choice": {"type": "tool", "name": "nope"}}, "not among the tools"),
                        ({"tools": None, "tool_choice": {"type": "any"}}, "no tools"),
                        ({"tools": None, "tool_choice": "always"}, "'auto' | 'any'"),
                        ({"tool_choice": {"type": "any", "disable_parallel_tool_use": 1}}, "a boolean")]:
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(**{**kwargs, **extra})
        assert said in info.value.body["error"]["message"]
