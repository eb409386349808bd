"""Output constrained by a JSON schema (glmkit.generate.constraint, glm-serve's `response_format`): on the random
fixture, whose free output is gibberish, every constrained reply parses and validates against its schema (checked
by the jsonschema library), greedy and sampled; schemas the grammar library cannot compile are refused."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import openai
import pytest

from glmkit.errors import GlmkitError
from glmkit.generate.constraint import GrammarError, GrammarTokenizer, ThinkingBudget, json_grammar
from glmkit.generate.generator import Generator
from glmkit.generate.sampling import Sampler, SamplingParams
from tests.test_serve import ServerThread, build_app, serve_args

# Every string, number and array bounded: a random model inside an open one may not close it within any budget of
# tokens, and a bounded schema makes the grammar end the reply.
SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 150}},
             "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                                  "admin": {"type": "boolean"}},
                 "required": ["id", "admin"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        "score": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["user", "tags"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}}, "required": ["answer"],
             "additionalProperties": False},
}


@pytest.fixture(scope="module")
def grammar_tokenizer(engine) -> GrammarTokenizer:
    return GrammarTokenizer(engine.tokenizer.tokenizer, engine.config.vocab_size, tuple(engine.eos_token_ids))


def generate(engine, sampler: Sampler, max_tokens: int = 160) -> str:
    gen = Generator(engine.model, tuple(engine.eos_token_ids), use_mtp=False)
    tokens = list(gen.generate(engine.tokenizer.encode("Describe the user:"), max_tokens, sampler))
    assert tokens[-1] in engine.eos_token_ids, "the grammar completed: end of sequence is all it allows"
    return engine.tokenizer.decode(tokens[:-1])


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 1), (1.0, 2)])
def test_constrained_output_validates(engine, grammar_tokenizer, name, temperature, seed):
    schema = SCHEMAS[name]
    constraint = grammar_tokenizer.constraint(json_grammar(schema))
    text = generate(engine, Sampler(SamplingParams(temperature, seed=seed), constraint))
    jsonschema.validate(json.loads(text), schema)


def test_free_output_of_the_fixture_is_not_json(engine):
    """The constraint is what makes the replies above JSON: the same model and prompt without it write none."""
    gen = Generator(engine.model, tuple(engine.eos_token_ids), use_mtp=False)
    tokens = list(gen.generate(engine.tokenizer.encode("Describe the user:"), 40, Sampler(SamplingParams())))
    with pytest.raises(ValueError):
        json.loads(engine.tokenizer.decode(tokens))


def test_any_json_object_and_the_mask(engine, grammar_tokenizer):
    constraint = grammar_tokenizer.constraint(json_grammar(None))
    logits = np.zeros(engine.config.vocab_size, np.float32)
    allowed = np.isfinite(constraint.mask(logits))
    assert 0 < allowed.sum() < len(logits) and not allowed[list(engine.eos_token_ids)].any()  # nothing is JSON yet
    text = generate(engine, Sampler(SamplingParams(1.0, seed=4), constraint))  # a seed whose object closes
    assert isinstance(json.loads(text), dict)


def test_end_ids_outside_the_tokenizer_are_refused(engine):
    """A model whose end-of-sequence ids its tokenizer does not have (a synthetic model with a borrowed tokenizer)
    gets a clear error, not the library's."""
    tok = engine.tokenizer.tokenizer
    with pytest.raises(GlmkitError, match=f"end-of-sequence id {tok.get_vocab_size()} .* not a token"):
        GrammarTokenizer(tok, engine.config.vocab_size, (tok.get_vocab_size(),))


def test_schemas_the_library_cannot_compile_are_refused(grammar_tokenizer):
    with pytest.raises(GrammarError) as info:
        grammar_tokenizer.constraint(json_grammar({"type": "string", "pattern": "(?=a)b"}))
    assert "look-around" in info.value.reason and "\n" not in info.value.reason  # one line
    grammar_tokenizer.constraint(json_grammar(SCHEMAS["nested"]))


# ---- through glm-serve ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(snapshot, tmp_path_factory):
    srv = ServerThread(build_app(serve_args(snapshot, tmp_path_factory.mktemp("constrained-cache")))).start()
    yield srv.client()
    srv.stop()


def test_response_format_through_the_server(client, snapshot):
    schema = SCHEMAS["nested"]
    fmt = {"type": "json_schema", "json_schema": {"name": "user", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "Describe the user."}]
    for temperature in (0, 1.0):
        reply = client.chat.completions.create(model=snapshot.name, messages=messages, max_tokens=200,
                                               temperature=temperature, seed=7, response_format=fmt)
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    chunks = client.chat.completions.create(model=snapshot.name, messages=messages, max_tokens=200, temperature=0,
                                            response_format=fmt, stream=True)
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), schema)
    loose = client.chat.completions.create(model=snapshot.name, messages=messages, max_tokens=200, temperature=0,
                                           response_format={"type": "json_object"})
    assert isinstance(json.loads(loose.choices[0].message.content), dict)

    bad = [({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?=a)"}}},
            "look-around"),
           ({"type": "xml"}, "response_format.type"),
           ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "response_format.json_schema.schema")]
    for fmt_bad, said in bad:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=snapshot.name, messages=messages, max_tokens=4,
                                           response_format=fmt_bad)
        assert said in info.value.response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=snapshot.name, messages=messages, max_tokens=4,
                                       response_format={"type": "json_object"}, extra_body={"ignore_eos": True})
    assert info.value.response.json()["error"]["param"] == "ignore_eos"


def test_a_thinking_budget_forces_the_closing_token_and_takes_tokens_back():
    budget = ThinkingBudget(close_id=40, budget=3, vocab_size=70)

    def allowed() -> list[int]:
        return list(np.flatnonzero(np.unpackbits(budget.allowed_bits().view(np.uint8), bitorder="little")))

    assert allowed() == list(range(70))
    for token in (5, 6, 7):
        budget.accept(token)
    logits = np.arange(70, dtype=np.float32)
    assert allowed() == [40] and np.flatnonzero(np.isfinite(budget.mask(logits))).tolist() == [40]
    with pytest.raises(GlmkitError, match="after 3 thinking tokens"):
        budget.accept(8)
    budget.rollback(1)  # an MTP draft taken back: one more thinking token allowed
    assert allowed() == list(range(70))
    budget.accept(9)
    budget.accept(40)  # closed: free from here on, and again after a rollback into the thinking
    assert allowed() == list(range(70)) and budget.mask(logits) is logits
    budget.accept(12)
    budget.rollback(2)
    assert allowed() == [40]
    early = ThinkingBudget(close_id=40, budget=3, vocab_size=70)
    early.accept(40)  # the model closed it itself
    for token in (1, 2, 3, 4):
        early.accept(token)
    assert not early.forcing
