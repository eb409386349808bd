"""Sampling on the device (sample.cl, decode_graph.SampledChoice) against the host `Sampler`, on PoCL as the CPU
device and driven as a discrete one.

The rule the device keeps: for the same uniform it returns the host's token, or it leaves the choice to the host
(its flag; the pipeline then asks `Sampler.pick` with that uniform). It leaves it where it cannot decide (a tie at
the top-k boundary) and wherever a decision lies within SAMPLE_TOLERANCE (1e-9) of one of its float64 sums: the
uniform at a cdf boundary, top_p at a running sum. So every token a pipeline returns is exactly the host's, and
these tests require exact equality; what they bound is how often the device defers (never, on these logits)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pyopencl as cl
import pytest

from glmkit.backends.opencl import decode_graph
from glmkit.backends.opencl.backend import OpenCLBackend, Placement
from glmkit.backends.opencl.decode_graph import (
    DecodePipeline,
    DeviceDecodeStep,
    MaskedChoice,
    SampledChoice,
    SampleLaunches,
    SampleScratch,
)
from glmkit.backends.opencl.ops import Kernels
from glmkit.generate.constraint import GrammarTokenizer, ThinkingBudget, json_grammar
from glmkit.generate.engine import Engine
from glmkit.generate.generator import Generator
from glmkit.generate.sampling import Sampler, SamplingParams, token_probabilities
from glmkit.model.expert_cache import ExpertCache, expert_slot_bytes
from glmkit.model.glm5 import GlmMoeDsaModel
from glmkit.serve.tool_grammar import MARKERS, ToolChoice, tool_call_grammar
from glmkit.serve.toolcalls import parse_tool_calls
from tests.runtime_support import Snapshots, opencl_test_device, oracle


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    return Snapshots(tmp_path_factory)


@pytest.fixture(scope="module", params=["direct", "discrete"])
def kernels(request):
    """PoCL's device as it is (direct) and driven as a discrete GPU (device buffers, the GPU build: 8-item groups,
    topk_select_group)."""
    if request.param == "direct":
        return Kernels(opencl_test_device())
    return Kernels(opencl_test_device(), lanes=8, red_lanes=8, direct=False, cpu_loads=False)


def device_draw(k: Kernels, logits: np.ndarray, params: SamplingParams, uniforms: list[float]
                ) -> list[tuple[int, bool]]:
    """(token, whether the device decided it) of sample_token for each uniform, over these logits `[V]`."""
    scratch = SampleScratch(k.buffers, len(logits))
    row = k.buffers.filled(logits)
    launches = SampleLaunches(k, row.buffer, params, scratch)
    token = k.buffers.array(2, np.uint32)
    out = []
    for u in uniforms:
        launches.enqueue(u, token.buffer, scratch.held[0].buffer)
        k.buffers.to_host(token)
        k.finish()
        if token.host[1]:  # the logits kept for the host are these logits
            k.buffers.to_host(scratch.held[0])
            k.finish()
            np.testing.assert_array_equal(scratch.held[0].host, logits)
        out.append((int(token.host[0]), not token.host[1]))
    return out


def logits_fixture(kind: str, vocab: int) -> np.ndarray:
    rng = np.random.default_rng(7)
    if kind == "peaked":  # a trained model's: a few likely tokens
        z = rng.standard_normal(vocab) * 2.0
        z[rng.choice(vocab, 5, replace=False)] += 12.0
        return z.astype(np.float32)
    if kind == "flat":  # a random model's: nearly uniform
        return (rng.standard_normal(vocab) * 0.05).astype(np.float32)
    return (rng.standard_normal(vocab) * 3.0).astype(np.float32)  # "normal x3"


SETTINGS = [SamplingParams(temperature=0.7, top_p=0.95), SamplingParams(temperature=1.0, top_k=40),
            SamplingParams(temperature=0.8, top_k=50, top_p=0.9), SamplingParams(temperature=1.3),
            SamplingParams(temperature=0.6, top_k=1), SamplingParams(temperature=2.0, top_p=0.5)]


@pytest.mark.parametrize("kind", ["peaked", "normal", "flat"])
@pytest.mark.parametrize("vocab", [300, 5000])
def test_device_draw_is_the_host_samplers(kernels, kind, vocab):
    """Over 40 seeds per setting (temperature; top-k; both; top-p alone; top-k 1): the device decides every draw,
    and each is the host's token for the same uniform; top-p alone too where its nucleus holds most of a flat
    distribution over 5,000 tokens (sample_nucleus: no candidates to outgrow)."""
    logits = logits_fixture(kind, vocab)
    for params in SETTINGS:
        uniforms = [np.random.default_rng(seed).random() for seed in range(40)]
        want = [Sampler(params).pick(logits, u) for u in uniforms]
        assert device_draw(kernels, logits, params, uniforms) == [(w, True) for w in want], params
    if kind == "flat" and vocab == 5000:  # the case a nucleus of candidates could not hold
        assert SETTINGS[0].top_k == 0 and len(kept(logits, SETTINGS[0])) > 4 * decode_graph.SAMPLE_CANDIDATES


def test_nucleus_cut_inside_tied_tokens(kernels):
    """Top-p whose cut falls among tokens of equal logits: the host keeps the first of them by index (a stable
    sort), and so does the device, whichever of the tied tokens each uniform lands on."""
    logits = np.full(2000, -4.0, np.float32)
    logits[[1500, 7, 900, 42, 1999, 3]] = 1.0  # six tied tokens, scattered, after one more likely
    logits[600] = 2.0
    for top_p in (0.2, 0.3, 0.45):  # the cut after the 2nd, 4th and 6th... of the tied tokens, none at a boundary
        params = SamplingParams(temperature=1.0, top_p=top_p)
        n_kept = len(kept(logits, params))
        uniforms = [np.random.default_rng(seed).random() for seed in range(30)]
        want = [Sampler(params).pick(logits, u) for u in uniforms]
        assert device_draw(kernels, logits, params, uniforms) == [(w, True) for w in want], top_p
        assert 1 < n_kept < 2000 and set(want) <= set(kept(logits, params)), n_kept
    assert len({Sampler(SamplingParams(temperature=1.0, top_p=0.45)).pick(logits, u / 30) for u in range(30)}) > 3


def kept(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The tokens the host keeps (nonzero probability)."""
    return np.flatnonzero(token_probabilities(logits, params))


def test_device_defers_where_it_cannot_decide(kernels):
    """A tie at the top-k boundary (the host keeps every tied token), a uniform exactly at a cdf boundary and top_p
    exactly at a running sum: the device leaves each to the host, and decides the draws beside them."""
    tied = np.array([3.0, 1.0, 2.0, 2.0, 0.5, 2.0], np.float32)  # top-2: 3.0 and a tie among three 2.0s
    params = SamplingParams(temperature=1.0, top_k=2)
    assert len(kept(tied, params)) == 4
    assert [on for _, on in device_draw(kernels, tied, params, [0.1, 0.9])] == [False, False]
    assert device_draw(kernels, tied, SamplingParams(temperature=1.0, top_k=4), [0.9])[0][1]  # no tie at 4
    flat = np.zeros(8, np.float32)  # cdf 1/8, 2/8, ...: u = 0.5 is a boundary, 0.45 is not
    params = SamplingParams(temperature=1.0)
    got = device_draw(kernels, flat, params, [0.5, 0.45])
    assert got == [(got[0][0], False), (Sampler(params).pick(flat, 0.45), True)]
    params = SamplingParams(temperature=1.0, top_p=0.25)  # the running sums of 1/8 reach 0.25 exactly
    assert [on for _, on in device_draw(kernels, flat, params, [0.3])] == [False]


# ---- whole generations through the Generator ------------------------------------------------------

def models(engine: Engine, kernels: Kernels) -> GlmMoeDsaModel:
    backend = OpenCLBackend(kernels, Placement(), unified=None if kernels.direct else False,
                            model_bytes=engine.container.nbytes)
    return GlmMoeDsaModel(engine.config, engine.experts, backend)


def sampled_run(model: GlmMoeDsaModel, prompt: list[int], n: int, sampler: Sampler, eos=()):
    cache = model.new_cache()
    generator = Generator(model, eos, use_mtp=False)
    tokens = list(generator.generate(list(prompt), n, sampler, cache))
    return tokens, cache.length, sampler.rng.random()  # the stream's next draw: as many uniforms used


def host_only(monkeypatch) -> None:
    """Decode one token at a time (the host path) from here on."""
    monkeypatch.setattr(DeviceDecodeStep, "pipeline", lambda self, *a: None)


SAMPLED = [SamplingParams(temperature=0.8, top_p=0.9, seed=3), SamplingParams(temperature=1.0, top_k=20, seed=4),
           SamplingParams(temperature=0.7, top_k=30, top_p=0.95, seed=5), SamplingParams(temperature=1.2, seed=6)]


def in_turns(streams: list, tokens: int) -> list[list[int]]:
    """`tokens` tokens of each generator stream, taken in turns (as glm-serve's scheduler decodes requests), then
    every stream closed early."""
    got: list[list[int]] = [[] for _ in streams]
    for _ in range(tokens):
        for s, stream in enumerate(streams):
            got[s].append(next(stream))
    for stream in streams:
        stream.close()
    return got


def test_sampled_generation_is_the_host_paths(snapshots, kernels, monkeypatch):
    """Pipelined sampled decoding gives the tokens of the host path for the same seed (temperature, top-k, top-p,
    both, neither), the same cache length, and leaves the sampler's stream where the host path leaves it; a
    consumer that stops early gets the host path's first tokens."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    dev = models(engine, kernels)
    prompt = oracle("tiny-trained")["prompt_ids"]
    pipes = []
    pipeline = DeviceDecodeStep.pipeline
    monkeypatch.setattr(DeviceDecodeStep, "pipeline", lambda self, *a: pipes.append(pipeline(self, *a)) or pipes[-1])
    got = [sampled_run(dev, prompt, 30, Sampler(params)) for params in SAMPLED]
    # a sampled pipeline each, whose every token the device drew
    assert [isinstance(p.choice, SampledChoice) and p.decided == 29 and not p.fallbacks for p in pipes] == [
        True] * len(SAMPLED)
    stream = Generator(dev, (), use_mtp=False).generate(list(prompt), 40, Sampler(SAMPLED[0]))
    first = [next(stream) for _ in range(7)]
    stream.close()
    host_only(monkeypatch)
    want = [sampled_run(dev, prompt, 30, Sampler(params)) for params in SAMPLED]
    assert got == want
    assert first == want[0][0][:7]
    assert len({tuple(tokens) for tokens, _, _ in want}) == len(SAMPLED)  # the settings differ, and so do the runs


def defer_draws(monkeypatch, defer) -> None:
    """The device draws as before, but hands the draws whose uniform `defer(u)` names to the host, as it does at a
    float64 rounding boundary or a tie at the top-k boundary: its flag set, the logits kept for the host, token 0 in
    place of its token (what the forward queued after it looks up)."""
    enqueue = SampleLaunches.enqueue

    def deferring(self, u: float, token, held):
        event = enqueue(self, u, token, held)
        if not defer(u):
            return event
        launch = self.sample
        logits, n, row, rows = (launch.args[launch._index[name]] for name in ("logits", "n", "row", "rows"))
        at, size = 4 * int(row) * int(n), 4 * int(n)  # the row's logits, kept for the host
        cl.enqueue_copy(launch.queue, held, logits, src_offset=at, dst_offset=at, byte_count=size)
        cl.enqueue_copy(launch.queue, token, np.array([0], np.uint32), dst_offset=4 * int(row))  # a placeholder
        return cl.enqueue_copy(launch.queue, token, np.array([1], np.uint32), dst_offset=4 * (int(rows) + int(row)),
                               is_blocking=False)

    monkeypatch.setattr(SampleLaunches, "enqueue", deferring)


def test_fallback_to_the_host(snapshots, kernels, monkeypatch):
    """Where the device leaves some tokens to the host (every twelfth draw here) the host chooses those tokens and
    the pipeline goes on from them; where it leaves most (all of them), the pipeline stops and the host path takes
    over: the host path's tokens either way. Samplers that need the logits (logprobs, penalties) and a top-k larger
    than the sort never start a sampled pipeline."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    dev = models(engine, kernels)
    prompt = oracle("tiny-trained")["prompt_ids"]
    monkeypatch.setattr(decode_graph, "SAMPLE_CANDIDATES", 16)  # a sort smaller than the vocabulary
    pipes = []
    pipeline = DeviceDecodeStep.pipeline
    monkeypatch.setattr(DeviceDecodeStep, "pipeline", lambda self, *a: pipes.append(pipeline(self, *a)) or pipes[-1])
    some = SamplingParams(temperature=0.8, top_p=0.9, seed=11)
    most = SamplingParams(temperature=1.5, top_k=12, seed=12)
    others = [Sampler(SamplingParams(temperature=0.8, seed=1), logprobs=2),
              Sampler(SamplingParams(temperature=0.8, presence_penalty=0.5, seed=1)),
              Sampler(SamplingParams(temperature=0.8, top_k=decode_graph.SAMPLE_CANDIDATES, seed=1))]
    with monkeypatch.context() as m:
        draws = itertools.count()
        defer_draws(m, lambda u: next(draws) % 12 == 11)
        got = [sampled_run(dev, prompt, 40, Sampler(some))]
        defer_draws(m, lambda u: True)
        got.append(sampled_run(dev, prompt, 40, Sampler(most)))
    got_others = [sampled_run(dev, prompt, 12, sampler)[0] for sampler in others]
    assert [p is not None for p in pipes] == [True, True, False]  # logprobs, penalties, top-k 16 never ask
    assert 0 < pipes[0].fallbacks < pipes[0].decided and not pipes[0].stopped
    assert pipes[1].stopped and pipes[1].fallbacks == 2
    host_only(monkeypatch)
    assert got == [sampled_run(dev, prompt, 40, Sampler(params)) for params in (some, most)]
    others = [Sampler(SamplingParams(temperature=0.8, seed=1), logprobs=2),
              Sampler(SamplingParams(temperature=0.8, presence_penalty=0.5, seed=1)),
              Sampler(SamplingParams(temperature=0.8, top_k=decode_graph.SAMPLE_CANDIDATES, seed=1))]
    assert got_others == [sampled_run(dev, prompt, 12, sampler)[0] for sampler in others]


def test_no_device_sampling_without_float64(snapshots, kernels, monkeypatch):
    """A device without float64 samples one token at a time (greedy stays pipelined)."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    dev = models(engine, kernels)
    prompt = oracle("tiny-trained")["prompt_ids"]
    monkeypatch.setattr(kernels, "fp64", False)
    pipes = []
    pipeline = DeviceDecodeStep.pipeline
    monkeypatch.setattr(DeviceDecodeStep, "pipeline", lambda self, *a: pipes.append(pipeline(self, *a)) or pipes[-1])
    sampled = sampled_run(dev, prompt, 10, Sampler(SAMPLED[1]))
    sampled_run(dev, prompt, 10, Sampler(SamplingParams()))
    assert pipes[0] is None and isinstance(pipes[1], DecodePipeline)
    host_only(monkeypatch)
    assert sampled == sampled_run(dev, prompt, 10, Sampler(SAMPLED[1]))


def test_interleaved_sampled_pipelines(snapshots, kernels, monkeypatch):
    """Two sampled sequences and a greedy one decoded in turns on one step (as glm-serve's scheduler does): each
    pipeline lets the other finish its forward in flight first, and each gets the host path's tokens and leaves
    its sampler's stream where the host path does when the consumer stops early."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    dev = models(engine, kernels)
    ids = oracle("tiny-trained")["full_ids"]
    runs = [(ids[:20], SAMPLED[0]), (ids[5:40], SAMPLED[2]), (ids[3:30], SamplingParams(seed=9))]

    def turns() -> tuple[list[list[int]], list[float]]:
        """Each sequence's tokens, then each sampler's next uniform once its stream is closed (some while another
        pipeline holds the step: their next token is known, not used)."""
        samplers = [Sampler(params) for _, params in runs]
        streams = [Generator(dev, (), use_mtp=False).generate(list(p), 30, sampler)
                   for (p, _), sampler in zip(runs, samplers, strict=True)]
        return in_turns(streams, 20), [sampler.rng.random() for sampler in samplers]

    got = turns()
    host_only(monkeypatch)
    assert got == turns()


def test_constrained_generation_is_the_host_paths(snapshots, kernels, monkeypatch):
    """A constrained request (a JSON schema, a forced tool call) decodes pipelined on a CPU device, the device
    choosing among the tokens the grammar's bitmask allows (MaskedChoice): the host path's tokens, greedy and
    sampled, and the output parses. A discrete device, whose memory the host does not write in place, decodes
    it one token at a time."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy")
    dev = models(engine, kernels)
    eos = tuple(engine.eos_token_ids)
    grammar_tokenizer = GrammarTokenizer(engine.tokenizer.tokenizer, engine.config.vocab_size, eos)
    tool = {"type": "function", "function": {"name": "pick", "strict": True, "parameters": {"type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
            "required": ["n", "tags"]}}}
    grammars = [json_grammar({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
                              "minItems": 6, "maxItems": 6}),
                tool_call_grammar([tool], ToolChoice(required=True, parallel=False), False,
                                  grammar_tokenizer.added_token_ids(MARKERS))]
    settings = [SamplingParams(seed=4), SamplingParams(temperature=1.0, seed=5),
                SamplingParams(temperature=0.8, top_k=20, seed=6)]  # top-k past the allowed tokens: ties at -inf
    prompt = engine.tokenizer.encode("Numbers:")

    def runs() -> list:
        return [sampled_run(dev, prompt, 200, Sampler(params, grammar_tokenizer.constraint(g)), eos)
                for g in grammars for params in settings]

    pipes = []
    pipeline = DeviceDecodeStep.pipeline
    monkeypatch.setattr(DeviceDecodeStep, "pipeline", lambda self, *a: pipes.append(pipeline(self, *a)) or pipes[-1])
    got = runs()
    if kernels.direct:
        assert all(isinstance(p.choice, MaskedChoice) and p.decided > 10 and not p.fallbacks for p in pipes)
    else:
        assert pipes and all(p is None for p in pipes)
    host_only(monkeypatch)
    want = runs()
    assert got == want
    texts = [engine.tokenizer.decode(tokens[:-1]) for tokens, _, _ in want]
    assert all(tokens[-1] in eos for tokens, _, _ in want)  # every grammar completed
    assert all(len(json.loads(text)) == 6 for text in texts[:len(settings)])
    assert all(len(parse_tool_calls(text, [tool])[1]) == 1 for text in texts[len(settings):])

    def interleaved() -> list[list[int]]:
        """Two constrained sequences and a free one in turns on one step, as glm-serve's scheduler runs them."""
        samplers = [Sampler(settings[0], grammar_tokenizer.constraint(grammars[1])),
                    Sampler(settings[1], grammar_tokenizer.constraint(grammars[0])), Sampler(SamplingParams(seed=9))]
        return in_turns([Generator(dev, eos, use_mtp=False).generate(prompt, 40, s) for s in samplers], 12)

    monkeypatch.undo()
    turns = interleaved()
    host_only(monkeypatch)
    assert turns == interleaved()


def test_constrained_pipeline_over_the_expert_cache(snapshots, monkeypatch):
    """Over an expert cache's slots (each MoE layer waits for the host to place its experts) the masked choice's
    user event and the layers' waits interleave without a deadlock: the host path's tokens, greedy and sampled."""
    kernels = Kernels(opencl_test_device())
    if not kernels.direct:
        pytest.skip("the expert cache's step runs on CPU devices only (GLMKIT_TEST_DEVICE names a GPU)")
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy")
    cfg, eos = engine.config, tuple(engine.eos_token_ids)
    cache = ExpertCache(engine.container, 24 * expert_slot_bytes(engine.container))
    backend = OpenCLBackend(kernels, Placement(), model_bytes=engine.container.nbytes)
    model = GlmMoeDsaModel(cfg, cache, backend, route_hook=cache.on_route, step_experts=cache)
    grammar_tokenizer = GrammarTokenizer(engine.tokenizer.tokenizer, cfg.vocab_size, eos)
    grammar = json_grammar({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
                            "minItems": 6, "maxItems": 6})
    prompt = engine.tokenizer.encode("Numbers:")
    pipes = []
    pipeline = DeviceDecodeStep.pipeline
    monkeypatch.setattr(DeviceDecodeStep, "pipeline", lambda self, *a: pipes.append(pipeline(self, *a)) or pipes[-1])

    def runs() -> list:
        return [sampled_run(model, prompt, 60, Sampler(params, grammar_tokenizer.constraint(grammar)), eos)
                for params in (SamplingParams(seed=1), SamplingParams(temperature=1.0, seed=2))]

    try:
        got = runs()
        assert len(pipes) == 2 and all(isinstance(p.choice, MaskedChoice) for p in pipes)
        host_only(monkeypatch)
        assert got == runs()
    finally:
        cache.close()


def test_a_thinking_budget_closes_the_block_on_the_device_as_on_the_host(snapshots, kernels, monkeypatch):
    """A reply that starts inside a thinking block with a budget of 6 tokens: its 7th token is `</think>` (the model
    would not write it there), then it goes on freely; the device's pipelined choice among the allowed tokens gives
    the host path's tokens, greedy and sampled."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy")
    dev = models(engine, kernels)
    eos, vocab = tuple(engine.eos_token_ids), engine.config.vocab_size
    close = engine.tokenizer.tokenizer.token_to_id("</think>")
    prompt = engine.tokenizer.encode("def main():")
    settings = [SamplingParams(seed=4), SamplingParams(temperature=1.0, seed=5)]

    def runs(budget: int | None) -> list:
        return [sampled_run(dev, prompt, 16, Sampler(params, None if budget is None else
                                                     ThinkingBudget(close, budget, vocab)), eos)
                for params in settings]

    free = runs(None)
    assert all(close not in tokens for tokens, _, _ in free)
    pipes = []
    pipeline = DeviceDecodeStep.pipeline
    monkeypatch.setattr(DeviceDecodeStep, "pipeline", lambda self, *a: pipes.append(pipeline(self, *a)) or pipes[-1])
    got = runs(6)
    assert pipes and all(isinstance(p.choice, MaskedChoice) if kernels.direct else p is None for p in pipes)
    host_only(monkeypatch)
    want = runs(6)
    assert got == want
    for (tokens, _, _), (free_tokens, _, _) in zip(want, free, strict=True):
        assert tokens[:6] == free_tokens[:6] and tokens[6] == close and len(tokens) == 16
