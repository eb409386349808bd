"""Generation: greedy == greedy with MTP drafts, sampling, KV-cache reuse, stopping (glmkit.generate.generator)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from glmkit.errors import GlmkitError
from glmkit.generate.engine import Engine
from glmkit.generate.generator import Generator
from glmkit.generate.sampling import Sampler, SamplingParams, token_probabilities
from glmkit.model.glm5 import GlmMoeDsaModel
from glmkit.model.kv_cache import KVCache
from tests.runtime_support import VARIANTS, Snapshots, oracle

N_TOKENS = 40
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Engine]:
    snapshots = Snapshots(tmp_path_factory)
    return {v: Engine(snapshots(v, "f32"), load_tokenizer=False) for v in VARIANTS}


@pytest.fixture(scope="module")
def greedy_runs(engines) -> dict[str, list[int]]:
    """40 greedy tokens from each oracle prompt, without MTP and without stopping at eos."""
    return {v: generate(engines[v].model, oracle(v)["prompt_ids"], N_TOKENS, use_mtp=False) for v in VARIANTS}


def generate(model: GlmMoeDsaModel, prompt: list[int], n: int, params: SamplingParams = GREEDY,
             use_mtp: bool = True, cache: KVCache | None = None, generator: Generator | None = None) -> list[int]:
    generator = generator or Generator(model, (), use_mtp=use_mtp)
    return list(generator.generate(prompt, n, Sampler(params), cache))


class ScriptedDrafts(Generator):
    """Runs the real MTP layer (so its KV rows stay right) but drafts from a known token sequence.

    The MTP row at position i predicts the token at i + 2, so after a step that leaves the MTP layer with
    m rows the draft is for position m + 1. `wrong` drafts a different token every time instead.
    """

    def __init__(self, model: GlmMoeDsaModel, sequence: list[int], wrong: bool = False, **kwargs):
        super().__init__(model, **kwargs)
        self.sequence, self.wrong = sequence, wrong

    def _mtp_step(self, hidden, next_ids, cache):
        real = super()._mtp_step(hidden, next_ids, cache)
        position = cache.layer(self.model.config.num_hidden_layers).length + 1
        if position >= len(self.sequence):
            return real
        true = self.sequence[position]
        return (true + 1) % self.model.config.vocab_size if self.wrong else true


# ---- greedy is the same with and without MTP -----------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_is_identical_with_and_without_mtp(engines, greedy_runs, variant):
    model, ref = engines[variant].model, oracle(variant)
    plain = greedy_runs[variant]
    assert plain[:16] == ref["full_ids"][len(ref["prompt_ids"]):]  # the oracle's continuation

    generator = Generator(model, (), use_mtp=True)
    assert generator.use_mtp
    assert generate(model, ref["prompt_ids"], N_TOKENS, generator=generator) == plain
    stats = generator.stats
    assert stats.mtp_drafts > 0 and 0 <= stats.mtp_accepted <= stats.mtp_drafts
    assert stats.mtp_acceptance is not None and 0 <= stats.mtp_acceptance <= 1
    assert stats.tokens_per_forward is not None and 1 <= stats.tokens_per_forward <= 2
    assert (stats.decode_tokens, stats.stop_reason, stats.prompt_tokens) == (N_TOKENS, "length",
                                                                            len(ref["prompt_ids"]))

    generator = Generator(model, (), use_mtp=False)
    generate(model, ref["prompt_ids"], N_TOKENS, generator=generator)
    assert generator.stats.mtp_drafts == 0 and generator.stats.mtp_acceptance is None
    assert generator.stats.tokens_per_forward == 1.0


@pytest.mark.parametrize("use_mtp", [False, True], ids=["no-mtp", "mtp"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_prompt_prefilled_in_chunks_gives_the_same_tokens(engines, greedy_runs, variant, use_mtp):
    """Chunks of 7 tokens (a long prompt's temporaries bounded, chunk ends at multiples of 7) decode the same greedy
    tokens as the prompt in one forward; with MTP, every prompt position has its MTP row (drafts start at once)."""
    model, prompt = engines[variant].model, oracle(variant)["prompt_ids"]
    assert len(prompt) > 3 * 7
    generator = Generator(model, (), use_mtp=use_mtp, prefill_chunk=7)
    cache = model.new_cache()
    assert generate(model, prompt, N_TOKENS, cache=cache, generator=generator) == greedy_runs[variant]
    if use_mtp:
        assert generator.stats.mtp_drafts > 0
        main, mtp = cache.layer(0).length, cache.layer(model.config.num_hidden_layers).length
        assert mtp >= main - 2  # the MTP layer trails by at most its pending draft


@pytest.mark.parametrize("wrong", [False, True], ids=["right-drafts", "wrong-drafts"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_accepted_and_rejected_drafts_keep_greedy_output(engines, greedy_runs, variant, wrong):
    """A random model's MTP head is rarely right; scripted drafts exercise both verification branches."""
    model, prompt = engines[variant].model, oracle(variant)["prompt_ids"]
    plain = greedy_runs[variant]
    generator = ScriptedDrafts(model, prompt + plain, wrong=wrong)
    assert generate(model, prompt, N_TOKENS, generator=generator) == plain
    stats = generator.stats
    if wrong:
        assert stats.mtp_drafts == N_TOKENS - 1 and stats.mtp_accepted == 0
        assert stats.tokens_per_forward == 1.0
    else:
        assert stats.mtp_accepted == stats.mtp_drafts > 0
        assert stats.tokens_per_forward > 1.9  # two tokens per verification forward


@pytest.mark.parametrize("n", range(1, 8))
def test_max_tokens_is_exact_when_drafts_are_accepted(engines, greedy_runs, n):
    model, prompt = engines["tiny-bf16"].model, oracle("tiny-bf16")["prompt_ids"]
    generator = ScriptedDrafts(model, prompt + greedy_runs["tiny-bf16"])
    assert generate(model, prompt, n, generator=generator) == greedy_runs["tiny-bf16"][:n]
    assert generator.stats.stop_reason == "length" and generator.stats.decode_tokens == n


def test_max_tokens_zero_yields_nothing(engines):
    model, prompt = engines["tiny-bf16"].model, oracle("tiny-bf16")["prompt_ids"]
    generator = Generator(model, ())
    assert generate(model, prompt, 0, generator=generator) == []
    assert generator.stats.stop_reason == "length"


@pytest.mark.parametrize("room", range(1, 7))
def test_generation_stops_at_the_context_limit_with_and_without_mtp(engines, greedy_runs, room):
    """With `room` free positions after the prompt, exactly `room` tokens fit (prompt + reply = context)."""
    engine = engines["tiny-bf16"]
    prompt, plain = oracle("tiny-bf16")["prompt_ids"], greedy_runs["tiny-bf16"]
    config = dataclasses.replace(engine.config, max_position_embeddings=len(prompt) + room)
    model = GlmMoeDsaModel(config, engine.experts, engine.backend)
    for generator in (Generator(model, (), use_mtp=False), Generator(model, (), use_mtp=True),
                      ScriptedDrafts(model, prompt + plain)):
        assert generate(model, prompt, N_TOKENS, generator=generator) == plain[:room], type(generator).__name__
        assert generator.stats.stop_reason == "context"


# ---- stopping at eos -----------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_stops_after_yielding_an_eos_token(engines, greedy_runs, variant):
    model, prompt = engines[variant].model, oracle(variant)["prompt_ids"]
    plain = greedy_runs[variant]
    # the first token, and a later one that has not occurred before (so the stop is at that position)
    later = next(i for i in range(5, N_TOKENS) if plain[i] not in plain[:i])
    for stop_at in (0, later):
        eos = (plain[stop_at],)
        for generator in (Generator(model, eos, use_mtp=False), Generator(model, eos, use_mtp=True),
                          ScriptedDrafts(model, prompt + plain, eos_token_ids=eos)):
            assert generate(model, prompt, N_TOKENS, generator=generator) == plain[:stop_at + 1]
            assert generator.stats.stop_reason == "eos"
            assert generator.stats.decode_tokens == stop_at + 1


def test_stats_are_final_when_the_consumer_stops_at_eos(engines, greedy_runs):
    """glm-run breaks out of the loop at an eos token: the generator never resumes after that yield."""
    model, prompt = engines["tiny-fp8"].model, oracle("tiny-fp8")["prompt_ids"]
    plain = greedy_runs["tiny-fp8"]
    stop_at = next(i for i in range(3, N_TOKENS) if plain[i] not in plain[:i])
    eos = (plain[stop_at],)
    for generator in (Generator(model, eos, use_mtp=False), ScriptedDrafts(model, prompt + plain, eos_token_ids=eos)):
        seen = []
        for token in generator.generate(prompt, N_TOKENS, Sampler(GREEDY)):
            seen.append(token)
            if token in eos:
                break
        assert seen == plain[:stop_at + 1]
        assert (generator.stats.decode_tokens, generator.stats.stop_reason) == (stop_at + 1, "eos")


# ---- KV-cache reuse ------------------------------------------------------------------------------

@pytest.mark.parametrize("use_mtp", [False, True], ids=["no-mtp", "mtp"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_second_turn_on_a_reused_cache_matches_a_fresh_run(engines, variant, use_mtp):
    """Chat style: the cache holds turn 1 (prompt + reply but its last token); turn 2 extends it."""
    model = engines[variant].model
    prompt = oracle(variant)["prompt_ids"]
    cache = model.new_cache()
    reply = generate(model, prompt, 12, use_mtp=use_mtp, cache=cache)
    assert cache.length == len(prompt) + len(reply) - 1
    turn2 = prompt + reply + [379, 198, 54, 368, 380, 382, 383]  # <|user|>\n ... <|assistant|><think></think>

    generator = Generator(model, (), use_mtp=use_mtp)
    reused = generate(model, turn2, 16, cache=cache, generator=generator)
    assert generator.stats.cached_tokens == len(prompt) + len(reply) - 1
    assert generator.stats.prompt_tokens == len(turn2)
    if use_mtp:
        assert generator.stats.mtp_drafts > 0  # the MTP layer's rows were reused too
    assert reused == generate(model, turn2, 16, use_mtp=False)


@pytest.mark.parametrize("variant", VARIANTS)
def test_cache_truncated_to_a_common_prefix_matches_a_fresh_run(engines, variant):
    model = engines[variant].model
    prompt = oracle(variant)["prompt_ids"]
    cache = model.new_cache()
    generate(model, prompt, 6, cache=cache)
    edited = prompt[:20] + [266, 295, 82, 220] + prompt[-3:]  # diverges from turn 1 at position 20
    cache.truncate(20)
    generator = Generator(model, ())
    assert generate(model, edited, 10, cache=cache, generator=generator) == generate(model, edited, 10, use_mtp=False)
    assert generator.stats.cached_tokens == 20


@pytest.mark.parametrize("use_mtp", [False, True], ids=["no-mtp", "mtp"])
def test_fully_cached_prompt_recomputes_only_its_last_token(engines, greedy_runs, use_mtp):
    model, prompt = engines["tiny-fp8"].model, oracle("tiny-fp8")["prompt_ids"]
    cache = model.new_cache()
    model.forward(np.asarray(prompt), cache)
    assert generate(model, prompt, 10, use_mtp=use_mtp, cache=cache) == greedy_runs["tiny-fp8"][:10]


# ---- sampling ------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_seeded_sampling_is_reproducible_and_seeds_differ(engines, variant):
    model, prompt = engines[variant].model, oracle(variant)["prompt_ids"]
    runs = {seed: generate(model, prompt, N_TOKENS, SamplingParams(temperature=1.0, seed=seed), use_mtp=False)
            for seed in (1, 2)}
    assert generate(model, prompt, N_TOKENS, SamplingParams(temperature=1.0, seed=1), use_mtp=False) == runs[1]
    assert runs[1] != runs[2]
    # Each emitted token is drawn once, in order, from the main model's logits: MTP does not change the draws
    assert generate(model, prompt, N_TOKENS, SamplingParams(temperature=1.0, seed=1), use_mtp=True) == runs[1]


def test_top_k_one_is_greedy(engines, greedy_runs):
    model, prompt = engines["tiny-bf16"].model, oracle("tiny-bf16")["prompt_ids"]
    for use_mtp in (False, True):
        params = SamplingParams(temperature=1.5, top_k=1, seed=3)
        assert generate(model, prompt, N_TOKENS, params, use_mtp=use_mtp) == greedy_runs["tiny-bf16"]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=-0.1), SamplingParams(temperature=math.nan), SamplingParams(temperature=math.inf),
    SamplingParams(top_p=0.0), SamplingParams(top_p=-0.5), SamplingParams(top_p=1.01), SamplingParams(top_p=math.nan),
    SamplingParams(top_k=-1), SamplingParams(seed=-1), SamplingParams(presence_penalty=2.5),
    SamplingParams(frequency_penalty=-2.01), SamplingParams(frequency_penalty=math.nan),
    SamplingParams(logit_bias=((1, 100.5),)), SamplingParams(logit_bias=((-1, 1.0),)),
])
def test_sampling_params_check_rejects_invalid_values(params):
    with pytest.raises(GlmkitError):
        params.check()
    with pytest.raises(GlmkitError):
        Sampler(params)


def test_sampling_params_check_accepts_edges():
    for params in (SamplingParams(), SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=0),
                   SamplingParams(temperature=2.0, top_p=1e-9, top_k=1_000_000, seed=2**40)):
        assert params.check() is params


def test_penalties_lower_the_logits_of_tokens_already_chosen():
    """Greedy over fixed logits: with no penalty the same token every time; a frequency penalty lowers a token by
    its count, a presence penalty once, so the choice walks down the logits as OpenAI's definition says."""
    logits = np.array([3.0, 2.5, 2.0, 0.0], np.float32)
    plain = Sampler(SamplingParams())
    assert [plain(logits) for _ in range(4)] == [0, 0, 0, 0] and not plain.host_only
    frequency = Sampler(SamplingParams(frequency_penalty=0.75))
    # counts after each pick: 3-.75=2.25 < 2.5 -> 1; 2.5-.75=1.75 < 2.25 -> 0; 3-1.5=1.5 < 2 -> 2; ...
    assert [frequency(logits) for _ in range(5)] == [0, 1, 0, 2, 1] and frequency.host_only
    presence = Sampler(SamplingParams(presence_penalty=0.75))
    assert [presence(logits) for _ in range(4)] == [0, 1, 0, 0]  # penalized once only: 3 - .75 leads again
    negative = Sampler(SamplingParams(frequency_penalty=-1.0))  # rewards repeats
    assert [negative(np.array([2.0, 2.5], np.float32)) for _ in range(3)] == [1, 1, 1]
    biased = Sampler(SamplingParams(logit_bias=((3, 3.5), (0, -100.0))))
    assert [biased(logits) for _ in range(2)] == [3, 3] and biased.host_only  # 0 + 3.5 beats 2.5; 0 is banned
    chosen = Sampler(SamplingParams(frequency_penalty=2.0), logprobs=1)
    chosen(logits), chosen(logits)
    assert [c.token for c in chosen.chosen] == [0, 1] and chosen.chosen[1].top[0][0] == 0  # logprobs: raw logits


def test_token_probabilities_by_hand():
    logits = np.log(np.array([1.0, 2.0, 3.0, 4.0], np.float32))  # softmax: .1 .2 .3 .4

    def probs(**kwargs):
        return token_probabilities(logits, SamplingParams(**{"temperature": 1.0, **kwargs}))

    np.testing.assert_allclose(probs(), [0.1, 0.2, 0.3, 0.4], rtol=1e-6)
    np.testing.assert_allclose(probs(top_k=2), [0, 0, 3 / 7, 4 / 7], rtol=1e-6)
    np.testing.assert_allclose(probs(top_k=1), [0, 0, 0, 1])
    np.testing.assert_allclose(probs(top_k=4), probs(top_k=0))
    np.testing.assert_allclose(probs(top_k=100), probs(top_k=0))
    # top-p keeps the smallest most-likely set with mass >= p: .4 | .4+.3 | .4+.3+.2
    np.testing.assert_allclose(probs(top_p=0.35), [0, 0, 0, 1])
    np.testing.assert_allclose(probs(top_p=0.5), [0, 0, 3 / 7, 4 / 7], rtol=1e-6)
    np.testing.assert_allclose(probs(top_p=0.75), [0, 2 / 9, 3 / 9, 4 / 9], rtol=1e-6)
    np.testing.assert_allclose(probs(top_p=0.95), [0.1, 0.2, 0.3, 0.4], rtol=1e-6)
    # top-k first, then top-p over the renormalized rest: [2, 3, 4] / 9, then .44 + .33 >= .6
    np.testing.assert_allclose(probs(top_k=3, top_p=0.6), [0, 0, 3 / 7, 4 / 7], rtol=1e-6)
    # temperature 2 on logits log([1, 4]): p ~ [1, 2]
    two = token_probabilities(np.log(np.array([1.0, 4.0])), SamplingParams(temperature=2.0))
    np.testing.assert_allclose(two, [1 / 3, 2 / 3], rtol=1e-6)


def sorted_probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """token_probabilities as first written: a stable sort of the whole vocabulary for top-p."""
    z = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < len(z):
        z = np.where(z >= np.partition(z, -params.top_k)[-params.top_k], z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if params.top_p < 1:
        order = np.argsort(-p, kind="stable")
        keep = order[: int(np.searchsorted(np.cumsum(p[order]), params.top_p)) + 1]
        mask = np.zeros_like(p)
        mask[keep] = p[keep]
        p = mask / mask.sum()
    return p


@pytest.mark.parametrize("vocab", [7, 3000, 20000])
def test_sampling_is_the_sorted_reference_draw_for_draw(vocab):
    """token_probabilities sorts only top candidates and the sampler draws over the kept tokens only: bit-identical
    probabilities to a sort of the whole vocabulary, and the same tokens as `Generator.choice` on them, seed for
    seed. Peaky, flat (a top-p set beyond the first candidates, and beyond every candidate round) and tied logits
    (ties across the top-p cut: kept in index order)."""
    rng = np.random.default_rng(vocab)
    shapes = {"peaky": rng.standard_normal(vocab) * 6, "flat": rng.standard_normal(vocab) * 0.05,
              "tied": np.round(rng.standard_normal(vocab) * 2) / 2}
    for name, values in shapes.items():
        logits = values.astype(np.float32)
        for params in (SamplingParams(temperature=1.0, top_p=0.9, seed=5),
                       SamplingParams(temperature=0.7, top_p=0.5, top_k=50, seed=6),
                       SamplingParams(temperature=1.3, top_p=0.999999, seed=7),
                       SamplingParams(temperature=2.0, top_p=0.3, seed=8), SamplingParams(temperature=0.9, seed=9)):
            want = sorted_probabilities(logits, params)
            assert np.array_equal(token_probabilities(logits, params), want), (name, params)
            sampler, reference = Sampler(params), np.random.default_rng(params.seed)
            draws = [sampler(logits) for _ in range(30)]
            assert draws == [int(reference.choice(vocab, p=want)) for _ in range(30)], (name, params)
    for bad in (np.nan, np.inf):  # a broken forward pass: a clear error, not an index past the vocabulary
        with pytest.raises(GlmkitError, match="NaN or infinity"), np.errstate(invalid="ignore"):
            Sampler(SamplingParams(temperature=1.0, seed=1))(np.where(np.arange(vocab) == 3, bad, 0.0))
    # the flat shape's top-p sets outgrow the first candidates (a real test of the growth and the full sort)
    flat = sorted_probabilities(shapes["flat"].astype(np.float32), SamplingParams(temperature=1.0, top_p=0.9))
    assert vocab < 1000 or np.count_nonzero(flat) > 1024


def test_sampler_draws_follow_the_probabilities():
    logits = np.log(np.array([1.0, 2.0, 3.0, 4.0], np.float32))
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=3, seed=0))
    counts = np.bincount([sampler(logits) for _ in range(4000)], minlength=4) / 4000
    assert counts[0] == 0
    np.testing.assert_allclose(counts[1:], [2 / 9, 3 / 9, 4 / 9], atol=0.03)
    assert Sampler(GREEDY)(logits) == 3


def test_prefill_hands_its_memory_back_and_decode_does_not(engines, greedy_runs):
    """The model calls `release_memory` after each prefill-sized forward only (decode steps would pay ~1 ms)."""
    engine = engines["tiny-bf16"]
    calls = []
    backend = engine.model.backend

    class Counting:
        def __getattr__(self, name):
            return getattr(backend, name)

        def release_memory(self):
            calls.append(1)
            backend.release_memory()

    model = GlmMoeDsaModel(engine.config, engine.experts, Counting())  # type: ignore[arg-type]
    assert generate(model, oracle("tiny-bf16")["prompt_ids"], 6, use_mtp=False) == greedy_runs["tiny-bf16"][:6]
    assert len(calls) == 1  # the prompt; the 5 decode steps append one token each
