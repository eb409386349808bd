"""The expert cache (glmkit.model.expert_cache): routed experts in slots read with pread, evicted by frequency with
aging, read ahead by the next layer's router, their scores persisted. Out-of-core runs must give the in-RAM logits
bit for bit."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from glmkit.errors import GlmkitError
from glmkit.format.schema import EXPERT_PROJECTIONS, expert_weight_name
from glmkit.generate import engine as engine_module
from glmkit.generate import generator as generator_module
from glmkit.generate.engine import Engine
from glmkit.generate.generator import Generator
from glmkit.generate.sampling import Sampler, SamplingParams
from glmkit.model import expert_cache
from glmkit.model.expert_cache import (
    READ_AHEAD_PROBE,
    ExpertCache,
    ExpertScores,
    auto_cache_bytes,
    expert_slot_bytes,
    read_usage,
    usage_path,
    write_usage,
)
from glmkit.model.expert_stream import (
    anonymous_bytes,
    anonymous_resident_bytes,
    memory_limit_bytes,
    release_pages,
    resident_fraction,
)
from glmkit.model.glm5 import SPAN_ROW_FLOATS, prefill_bytes, span_rows_within
from glmkit.model.kv_cache import kv_bytes_per_token
from glmkit.model.ops import likely_experts
from glmkit.units import format_size
from tests.runtime_support import HUGE_INTEGER, Snapshots


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    return Snapshots(tmp_path_factory)


def slot_bytes(engine: Engine) -> int:
    return ExpertCache(engine.container, 1 << 30).slot_bytes


def logits_of(engine: Engine, prompt: list[int], steps: int) -> list[np.ndarray]:
    """The prompt's logits at every position, then `steps` greedy tokens' logits one at a time."""
    model, cache = engine.model, engine.model.new_cache()
    logits, _ = model.forward(np.array(prompt), cache)
    out = [logits]
    token = int(logits[-1].argmax())
    for _ in range(steps):
        logits, _ = model.forward(np.array([token]), cache)
        out.append(logits)
        token = int(logits[-1].argmax())
    return out


@pytest.mark.parametrize("preset,device", [("q4", "numpy"), ("f32", "numpy"), ("q4", "opencl")])
def test_out_of_core_logits_are_bit_identical(snapshots, preset, device):
    """Two slots per MoE layer (experts miss and are evicted all the time), a prompt past the indexer's top-k (DSA
    selection on), on NumPy and on OpenCL (every product on the device; single tokens run on the device decode step).
    The prompt's experts of a layer outnumber the slots: each one's slot is taken over by a later one once it ran."""
    snap = snapshots("tiny-trained", preset)
    ram = Engine(snap, device, load_tokenizer=False, expert_cache=0)
    cfg = ram.config
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers_with_mtp))
    budget = max(2 * moe_layers, cfg.num_experts_per_tok) * slot_bytes(ram)
    streamed = Engine(snap, device, load_tokenizer=False, expert_cache=budget)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, cfg.index_topk + 8).tolist()
    for a, b in zip(logits_of(ram, prompt, 6), logits_of(streamed, prompt, 6), strict=True):
        assert np.array_equal(a, b)
    stats = streamed.experts.stats
    assert stats.misses > 0 and stats.evictions >= stats.misses and stats.reads > 0 and stats.bounced == 0
    assert (device == "opencl") == streamed.model.decodes_on_device()
    # nothing read twice while cached: every read is a miss or a read ahead
    assert stats.reads <= stats.misses + stats.predicted
    streamed.close()


def test_the_first_moe_layer_is_read_ahead_from_the_dense_layer_before_it(snapshots):
    """No MoE layer routes before the first one: the dense layer before it starts reading its likely experts, with
    its own normed MLP input, while its MLP runs."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False, expert_cache=64 << 20)
    cache, model, first = engine.experts, engine.model, engine.config.first_k_dense_replace
    started: dict[int, int] = {}

    def ahead(layer: int, u: np.ndarray) -> None:
        before = cache.stats.read_ahead
        cache.read_ahead(layer, u)
        started[layer] = started.get(layer, 0) + cache.stats.read_ahead - before

    model.ahead_hook = ahead
    model.forward(np.arange(5, 37), model.new_cache())
    assert set(started) == set(range(first)) and started[first - 1] > 0
    assert all(started[layer] == 0 for layer in range(first - 1))  # the next layer is dense: nothing to read
    assert cache.stats.predicted_used > 0  # the first MoE layer then routed to some of them
    engine.close()


def test_generation_with_mtp_matches(snapshots):
    snap = snapshots("tiny-trained", "q4")
    ram = Engine(snap, "numpy", load_tokenizer=False)
    streamed = Engine(snap, "numpy", load_tokenizer=False, expert_cache=8 * slot_bytes(ram))
    prompt = list(range(5, 45))
    runs = [list(Generator(e.model, eos_token_ids=(), use_mtp=True).generate(prompt, 12, Sampler(SamplingParams())))
            for e in (ram, streamed)]
    assert runs[0] == runs[1] and len(runs[0]) == 12


def test_the_auto_size_leaves_what_the_process_holds_and_a_quarter_of_the_limit(snapshots, monkeypatch):
    """The cache gets the memory the process may use less the pinned non-expert weights, what the process already
    holds (its heap, a device runtime), a quarter of the limit for activations and a sixteenth for what the process
    comes to hold later: never what the process needs."""
    container = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False).container
    experts = sum(r.nbytes for r in container.manifest.experts)
    limit, held = 8 << 20, 1 << 20
    monkeypatch.setattr(expert_cache, "memory_limit_bytes", lambda: limit)
    monkeypatch.setattr(expert_cache, "anonymous_resident_bytes", lambda: held)
    size, why = auto_cache_bytes(container)
    assert size == min(experts, limit - (container.nbytes - experts) - held - limit // 4 - limit // 16) > 0
    assert "holds now" in why
    # beside a discrete GPU holding the other weights (the split step's CPU side) none are copied into RAM
    small = held + experts  # a quarter and a sixteenth of it kept: the experts do not all fit
    monkeypatch.setattr(expert_cache, "memory_limit_bytes", lambda: small)
    assert auto_cache_bytes(container, pinned=False)[0] == small - held - small // 4 - small // 16
    assert auto_cache_bytes(container)[0] == max(0, small - held - small // 4 - small // 16
                                                 - (container.nbytes - experts))
    monkeypatch.setattr(expert_cache, "memory_limit_bytes", lambda: limit)
    monkeypatch.setattr(expert_cache, "anonymous_resident_bytes", lambda: limit)  # it holds all of it already
    assert auto_cache_bytes(container)[0] == 0


def test_where_the_experts_will_live_is_announced_before_the_cache_takes_its_memory(snapshots, monkeypatch):
    """`Engine(announce=...)` hears the auto size's reason before the cache allocates its slots and copies the other
    weights (a long wait at GLM-5's size): here the cache's construction fails, and the line was said already."""
    snap = snapshots("tiny-trained", "q4")
    monkeypatch.setattr(expert_cache, "memory_limit_bytes", lambda: 8 << 20)
    monkeypatch.setattr(expert_cache, "anonymous_resident_bytes", lambda: 0)

    def refuse(*args, **kwargs):
        raise GlmkitError("no slots")

    monkeypatch.setattr(ExpertCache, "__init__", refuse)
    said: list[str] = []
    with pytest.raises(GlmkitError, match="no slots"):
        Engine(snap, "numpy", load_tokenizer=False, expert_cache="auto", announce=said.append)
    assert len(said) == 1 and said[0].startswith("expert cache ") and "holds now" in said[0]


def test_the_auto_size_keeps_room_for_the_kv_rows_of_the_context(snapshots, monkeypatch):
    """An auto-sized cache keeps room for the KV rows of `max_context` positions (the model's whole context by
    default), so a long prompt's rows do not take the process past its limit: slots it may only borrow while the rows
    leave them empty (`lendable_slots`); the context is then the engine's (its config) and the budget of KV rows all
    its sequences share (`kv_budget_tokens`: glm-serve's sessions), refused past the model's own. A cache sized by
    hand lends nothing and leaves the KV rows what the limit leaves beside the process (its slots among it), the
    activations' quarter and the sixteenth for later growth; without a cache there is no budget."""
    snapshot = snapshots("tiny-trained", "q4")
    plain = Engine(snapshot, "numpy", load_tokenizer=False)
    cfg, experts = plain.config, sum(r.nbytes for r in plain.container.manifest.experts)
    per_token = kv_bytes_per_token(cfg, "f32")
    held = 1 << 20  # a limit that leaves half the experts beside the whole context's rows:
    limit = (per_token * cfg.max_position_embeddings + experts // 2 + plain.container.nbytes - experts + held)
    limit = limit * 16 // 11
    monkeypatch.setattr(expert_cache, "memory_limit_bytes", lambda: limit)
    monkeypatch.setattr(expert_cache, "anonymous_resident_bytes", lambda: held)
    free = limit - (plain.container.nbytes - experts) - held - limit // 4 - limit // 16  # the cache without KV rows

    def cache_bytes(**kwargs) -> tuple[int, int]:
        """(the slots never lent, the context)"""
        engine = Engine(snapshot, "numpy", load_tokenizer=False, expert_cache="auto", **kwargs)
        engine.close()
        assert engine.kv_budget_tokens == engine.config.max_position_embeddings
        assert engine.experts.n_slots == min(free, experts) // slot  # with the room lent: every byte left
        return engine.experts.n_slots - engine.experts.lendable_slots, engine.config.max_position_embeddings

    slot = expert_slot_bytes(plain.container)
    assert 0 < free - per_token * cfg.max_position_embeddings < experts < free  # slots of its own and lent ones
    assert cache_bytes() == (min(free - per_token * cfg.max_position_embeddings, experts) // slot,
                             cfg.max_position_embeddings)
    assert cache_bytes(max_context=64) == (min(free - per_token * 64, experts) // slot, 64)
    assert cache_bytes(max_context=64, kv_dtype="fp8")[0] == min(free - kv_bytes_per_token(cfg, "fp8") * 64,
                                                                  experts) // slot
    assert plain.kv_budget_tokens is None
    # sized by hand: the KV rows get what the limit leaves beside it (the process, the slots no read has filled
    # yet), a quarter and a sixteenth
    monkeypatch.setattr(engine_module, "memory_limit_bytes", lambda: limit)
    for rest in (3 * per_token * cfg.max_position_embeddings // 2, per_token * cfg.max_position_embeddings // 2):
        limit = (rest + held) * 16 // 11  # `rest` left beside what the process holds
        sized = Engine(snapshot, "numpy", load_tokenizer=False, expert_cache=1 << 20)
        arena = sized.experts.arena
        unread = round(arena.nbytes * (1 - resident_fraction(arena)))
        assert unread >= sized.experts.n_slots * slot  # no slot read yet
        left = limit - held - unread - limit // 4 - limit // 16
        assert sized.kv_budget_tokens == sized.model.kv_room_tokens == min(left // per_token,
                                                                           cfg.max_position_embeddings)
        assert sized.experts.lendable_slots == 0
    assert sized.kv_budget_tokens < cfg.max_position_embeddings
    for bad in (0, cfg.max_position_embeddings + 1):
        with pytest.raises(GlmkitError, match=f"--max-context {bad}: must be in 1..{cfg.max_position_embeddings}"):
            Engine(snapshot, "numpy", load_tokenizer=False, max_context=bad)

def test_where_the_whole_context_s_rows_leave_no_room_the_context_is_what_fits(snapshots, monkeypatch):
    """An auto-sized cache whose RAM cannot keep room for the KV rows of the model's whole context beside two
    layers' routed experts shortens the context to the positions it can (said in the log; glm-run's and glm-serve's
    context checks follow `config`) and lends their room to the cache. A context asked for is kept: there, as where
    the RAM holds not even the experts, no cache is sized."""
    snapshot = snapshots("tiny-trained", "q4")
    plain = Engine(snapshot, "numpy", load_tokenizer=False)
    cfg, container = plain.config, plain.container
    whole, per_token = cfg.max_position_embeddings, kv_bytes_per_token(cfg)
    two_layers = 2 * cfg.num_experts_per_tok * expert_slot_bytes(container)
    pinned = container.nbytes - sum(r.nbytes for r in container.manifest.experts)
    held = 1 << 20
    limit = (per_token * whole // 2 + two_layers + pinned + held) * 16 // 11
    monkeypatch.setattr(expert_cache, "memory_limit_bytes", lambda: limit)
    monkeypatch.setattr(expert_cache, "anonymous_resident_bytes", lambda: held)
    fits = (limit - pinned - held - limit // 4 - limit // 16 - two_layers) // per_token
    assert 0 < fits < whole
    short = Engine(snapshot, "numpy", load_tokenizer=False, expert_cache="auto")
    assert short.config.max_position_embeddings == short.kv_budget_tokens == fits
    assert f"; context {fits:,} positions of the model's {whole:,}" in short.expert_cache_reason
    assert short.experts.lendable_slots > 0
    assert short.experts.n_slots - short.experts.lendable_slots >= 2 * cfg.num_experts_per_tok
    with pytest.raises(GlmkitError, match="--expert-cache auto: no RAM left for experts"):
        Engine(snapshot, "numpy", load_tokenizer=False, expert_cache="auto", max_context=whole)
    limit = (two_layers // 2 + pinned + held) * 16 // 11
    with pytest.raises(GlmkitError, match="--expert-cache auto: no RAM left for experts"):
        Engine(snapshot, "numpy", load_tokenizer=False, expert_cache="auto")


def test_the_memory_limit_is_the_lowest_of_the_cgroup_and_those_above_it(tmp_path):
    """cgroup v1 and v2: a limit set on a cgroup above the process's counts; v2's "max" and v1's huge root value
    mean no limit (the machine's RAM)."""
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    proc, sysfs = tmp_path / "cgroup", tmp_path / "sys"
    proc.write_text("5:cpu,cpuacct:/a\n4:memory:/outer/inner\n")
    v1 = sysfs / "memory"
    (v1 / "outer" / "inner").mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (v1 / "outer" / "memory.limit_in_bytes").write_text(f"{1 << 30}\n")
    (v1 / "outer" / "inner" / "memory.limit_in_bytes").write_text(f"{3 << 30}\n")
    assert memory_limit_bytes(proc, sysfs) == min(machine, 1 << 30)
    proc.write_text("0::/slice/leaf\n")
    (sysfs / "slice" / "leaf").mkdir(parents=True)
    (sysfs / "slice" / "leaf" / "memory.max").write_text("max\n")
    (sysfs / "slice" / "memory.max").write_text(f"{2 << 30}\n")
    assert memory_limit_bytes(proc, sysfs) == min(machine, 2 << 30)
    (sysfs / "slice" / "memory.max").write_text("max\n")
    assert memory_limit_bytes(proc, sysfs) == machine


def test_an_expert_cache_runs_a_long_prompt_layer_by_layer_in_spans_that_fit_its_allowance(snapshots, monkeypatch):
    """Under an expert cache the Engine leaves `activation_allowance` for activations: a prompt then goes in spans of
    `span_rows_within` rows, lengthened by the room kept for the context's KV rows that the sequence will not fill,
    each run layer by layer with its attention in blocks (the same tokens as one whole forward without a cache)."""
    snap = snapshots("tiny-trained", "q4")
    whole = Engine(snap, "numpy", load_tokenizer=False)
    limit = 8 << 20
    monkeypatch.setattr(expert_cache, "memory_limit_bytes", lambda: limit)
    monkeypatch.setattr(expert_cache, "anonymous_resident_bytes", lambda: 0)
    monkeypatch.setattr(engine_module, "memory_limit_bytes", lambda: limit)
    cut = Engine(snap, "numpy", load_tokenizer=False, expert_cache="auto")
    model, context = cut.model, cut.config.max_position_embeddings
    span, block = model.span_rows, model.prefill_rows
    assert (span, block) == span_rows_within(cut.config, expert_cache.activation_allowance(limit))
    assert block < span < 500 and model.kv_room_tokens == context
    assert model.prompt_chunk(2048) == model.prompt_chunk(2048, context) == span  # no room left over: the span
    room = (context - 1000) * kv_bytes_per_token(cut.config) // (cut.config.hidden_size * 4 * SPAN_ROW_FLOATS)
    assert model.prompt_chunk(2048, 1000) == span + room > span
    prompt = np.random.default_rng(1).integers(0, cut.config.vocab_size, 1500).tolist()
    chunk = model.prompt_chunk(2048, len(prompt) + 8)
    sizes: list[int] = []
    blocks: list[int] = []
    forward, by_layer = model.forward, model.layers_by_layer
    monkeypatch.setattr(model, "forward", lambda ids, *a, **k: (sizes.append(len(ids)), forward(ids, *a, **k))[1])
    monkeypatch.setattr(model, "layers_by_layer", lambda *a: (blocks.append(a[-1]), by_layer(*a))[1])
    runs = [list(Generator(e.model, eos_token_ids=(), use_mtp=False).generate(prompt, 8, Sampler(SamplingParams())))
            for e in (whole, cut)]
    assert runs[0] == runs[1]
    spans = [chunk] * ((len(prompt) - 1) // chunk)  # the last, at most a span, comes with the first token
    spans.append(len(prompt) - sum(spans))
    assert len(spans) > 2 and [s for s in sizes if s > 1] == spans and blocks == [block] * len(spans)
    cut.close()


def test_pages_given_back_leave_the_process_s_memory_and_read_as_zeros():
    block = anonymous_bytes(64 << 20)
    block[:] = 1
    before = anonymous_resident_bytes()
    release_pages(block[:32 << 20])
    assert before - anonymous_resident_bytes() >= 30 << 20
    assert not block[:32 << 20].any() and (block[32 << 20:] == 1).all()


def test_a_cache_s_slots_take_memory_only_as_reads_fill_them(snapshots):
    """Opening a cache takes no page of its routed experts' slots: each slot's pages are taken as a read fills it, so
    slots lent to KV rows before any read never take memory; `untaken_bytes` counts the pages still to be taken."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    cfg, container, k = engine.config, engine.container, engine.config.num_experts_per_tok
    slot = slot_bytes(engine)
    cache = ExpertCache(container, (k + 3) * slot, readahead=False, lendable_bytes=3 * slot)
    routed = cache.arena[:cache.n_slots * slot]
    assert cache.n_slots == k + 3 and resident_fraction(routed) == 0
    untaken = cache.untaken_bytes()
    assert untaken >= routed.nbytes
    cache.lend(3 * slot)
    layer = cfg.first_k_dense_replace
    cache.on_route(layer, np.array([list(range(k))]))
    for e in range(k):
        cache.expert(layer, e)
    expert = max(r.nbytes for r in container.manifest.experts)
    read = round(routed.nbytes * resident_fraction(routed))
    assert k * expert <= read <= k * slot and len(cache._lent) == 3
    assert all(resident_fraction(cache._slot_data(s)) == 0 for s in cache._lent)
    assert cache.untaken_bytes() == untaken - read
    cache.close()


def test_slots_lent_to_kv_rows_are_emptied_and_taken_back(snapshots):
    """`lend(n)` takes n bytes of slots (at most the lendable ones) out of use, free slots first, then the least used
    experts' but never one the layer being computed routed to and has not run (those once the next layer routes),
    their pages given back; `lend(0)` puts them back in use, read into again."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    cfg, container, k = engine.config, engine.container, engine.config.num_experts_per_tok
    slot = slot_bytes(engine)
    cache = ExpertCache(container, (k + 2) * slot, readahead=False, lendable_bytes=3 * slot)
    assert cache.lendable_slots == 2  # a layer's k slots are never lent
    cache = ExpertCache(container, (k + 2) * slot, readahead=False, lendable_bytes=2 * slot)
    layer = cfg.first_k_dense_replace
    cache.on_route(layer, np.array([list(range(k))]))
    for e in range(k):
        cache.expert(layer, e)
    cache.lend(slot + 1)  # two slots: both free ones
    assert len(cache._lent) == 2 and all(cache.resident(layer, e) for e in range(k))
    cache.lend(0)
    for e in (k, k + 1):  # every slot now holds an expert the layer uses
        cache.expert(layer, e)
    cache.lend(2 * slot)
    assert cache._lent == [] and all(cache.resident(layer, e) for e in range(k + 2))
    cache.on_route(layer, np.array([list(range(1, k + 1))]))  # experts 0 and k + 1 let go: lent now
    assert len(cache._lent) == 2 and not cache.resident(layer, 0) and not cache.resident(layer, k + 1)
    assert all(cache.resident(layer, e) for e in range(1, k + 1)) and cache.stats.lent_most == 2
    assert not any(cache._slot_data(s).any() for s in cache._lent)  # their pages given back
    cache.lend(3 * slot)  # at most the lendable slots
    assert len(cache._lent) == 2
    cache.lend(0)
    cache.on_route(layer + 1, np.array([list(range(k))]))  # the next layer's k experts, read into the lent slots
    for e in range(k):
        views = cache.expert(layer + 1, e)
        for view, projection in zip(views, EXPERT_PROJECTIONS, strict=True):
            mapped = container.weight(expert_weight_name(layer + 1, e, projection))
            assert np.array_equal(view.packed, mapped.packed) and np.array_equal(view.scales, mapped.scales)
    assert cache.stats.bounced == 0
    cache.close()


def test_an_auto_sized_cache_lends_the_kv_rows_room_to_a_generation_and_its_spans(snapshots, monkeypatch):
    """An auto-sized cache holds experts in the room kept for the KV rows until they need it: a forward whose caller
    said nothing has its own sequence's rows lent; a generation first has its prompt's and max_tokens' rows lent out
    of the cache (`hold_kv_rows`); a span lengthened by the room left (`prompt_chunk`) borrows that for its forward
    and gives it back. The tokens are a run's without a cache."""
    snap = snapshots("tiny-trained", "q4")
    whole = Engine(snap, "numpy", load_tokenizer=False)
    cfg, container = whole.config, whole.container
    experts = sum(r.nbytes for r in container.manifest.experts)
    per_token = kv_bytes_per_token(cfg)
    limit = (per_token * cfg.max_position_embeddings + experts // 2 + container.nbytes - experts) * 16 // 11
    monkeypatch.setattr(expert_cache, "memory_limit_bytes", lambda: limit)
    monkeypatch.setattr(expert_cache, "anonymous_resident_bytes", lambda: 0)
    monkeypatch.setattr(engine_module, "memory_limit_bytes", lambda: limit)
    cut = Engine(snap, "numpy", load_tokenizer=False, expert_cache="auto")
    cache, model = cut.experts, cut.model
    assert cache.lendable_slots > 0 and "lent to the cache" in cut.expert_cache_reason
    asked: list[int] = []
    lend = cache.lend
    monkeypatch.setattr(model, "lend_hook", lambda nbytes: (asked.append(nbytes), lend(nbytes))[1])
    prompt = np.random.default_rng(2).integers(0, cfg.vocab_size, 1200).tolist()
    model.forward(np.array(prompt[:100]), model.new_cache())
    assert asked == [100 * per_token]
    held, chunk = (len(prompt) + 8) * per_token, model.prompt_chunk(2048, len(prompt) + 8)
    runs = [list(Generator(e.model, eos_token_ids=(), use_mtp=False).generate(prompt, 8, Sampler(SamplingParams())))
            for e in (whole, cut)]
    assert runs[0] == runs[1]
    spans = [chunk] * ((len(prompt) - 1) // chunk) + [len(prompt) - (len(prompt) - 1) // chunk * chunk]
    longer = [(s - model.span_rows) * cfg.hidden_size * 4 * SPAN_ROW_FLOATS for s in spans if s > model.span_rows]
    assert len(longer) >= 2 and asked == [100 * per_token, held] + [n for e in longer for n in (held + e, held)]
    slot = cache.slot_bytes
    assert cache.stats.lent_most == min(cache.lendable_slots, -(-(held + max(longer)) // slot))
    assert len(cache._lent) == min(cache.lendable_slots, -(-held // slot))
    cut.close()


def test_a_reply_s_rows_are_held_as_it_grows(snapshots, monkeypatch):
    """A generation holds its prompt's rows and KV_HOLD_AHEAD more (`hold_kv_rows`), and KV_HOLD_AHEAD past its rows
    again whenever the next forward's would pass those held, at most its prompt and max_tokens: a cache lending the
    rows' room gives a long reply's back as it is written, and no forward has to ask for its own rows."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    monkeypatch.setattr(generator_module, "KV_HOLD_AHEAD", 4)
    holds: list[int] = []
    hold = engine.model.hold_kv_rows
    monkeypatch.setattr(engine.model, "hold_kv_rows", lambda rows: (holds.append(rows), hold(rows)))
    prompt = list(range(10, 30))
    out = list(Generator(engine.model, eos_token_ids=(), use_mtp=False).generate(prompt, 12, Sampler(SamplingParams())))
    assert len(out) == 12 and holds == [24, 26, 28, 30, 32]


@pytest.mark.parametrize("device", ["numpy", "opencl"])
def test_a_prompt_run_layer_by_layer_reads_each_routed_expert_once_a_layer(snapshots, device):
    """A prompt past the indexer's top-k run layer by layer (attention in blocks of 16, DSA selection on, 'shared'
    layers reusing each block's) gives one whole forward's logits within f32 rounding, and with two slots per MoE
    layer reads each (layer, expert) its rows route to once, where chunks of 16 rows read them again per chunk."""
    snap = snapshots("tiny-trained", "q4")
    ram = Engine(snap, device, load_tokenizer=False, expert_cache=0)
    cfg = ram.config
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    budget = max(2 * moe_layers, cfg.num_experts_per_tok) * slot_bytes(ram)
    prompt = np.array(np.random.default_rng(2).integers(0, cfg.vocab_size, 3 * cfg.index_topk + 5))
    reference, _ = ram.model.forward(prompt, ram.model.new_cache())

    def prefill(by_layer: bool) -> int:
        """The prompt through an engine of two slots per MoE layer (no read-ahead): the experts it read."""
        streamed = Engine(snap, device, load_tokenizer=False, expert_cache=budget, prefetch=False)
        routed: set[tuple[int, int]] = set()
        hook, model, cache = streamed.model.route_hook, streamed.model, streamed.model.new_cache()
        model.route_hook = lambda layer, ids, u: (routed.update((layer, e) for e in ids.ravel().tolist()),
                                                  hook(layer, ids, u))
        model.prefill_rows = 16
        if by_layer:
            model.span_rows = len(prompt)
            attended: list[int] = []  # the rows of each attention call: blocks of 16
            attention = model.attention
            model.attention = lambda layer, u, *a, **k: (attended.append(len(u)), attention(layer, u, *a, **k))[1]
            logits, _ = model.forward(prompt, cache)
            assert max(attended) == 16 and sum(attended) == cfg.num_hidden_layers * len(prompt)
            assert np.abs(logits - reference).max() <= 1e-5 * np.abs(reference).max()
            assert np.array_equal(logits.argmax(-1), reference.argmax(-1))
        else:
            for start in range(0, len(prompt), 16):
                model.forward(prompt[start:start + 16], cache)
        reads = streamed.experts.stats.reads
        assert cache.length == len(prompt)
        assert not by_layer or reads <= len(routed)  # each routed (layer, expert) at most once, the cached not at all
        streamed.close()
        return reads

    reads = {"by layer": prefill(True), "chunks": prefill(False)}
    assert reads["chunks"] > 2 * reads["by layer"]


def test_a_budget_below_one_layer_is_refused(snapshots):
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    with pytest.raises(GlmkitError, match="layer routes to 4"):
        ExpertCache(engine.container, 3 * slot_bytes(engine))



def test_a_budget_past_every_expert_holds_every_expert_and_one_past_the_ram_is_refused(snapshots, monkeypatch):
    """Slots past the container's routed experts would sit empty: the arena holds every expert at most. A cache that
    with the weights it pins outgrows the RAM the process may use, or whose pages cannot be had, is a one-line
    error naming --expert-cache (not an allocation failure, nor a process killed for memory later)."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    experts = len(engine.container.manifest.experts)
    cache = ExpertCache(engine.container, 1 << 40)
    assert cache.n_slots == experts and len(cache.arena) == cache.slot_count * cache.slot_bytes
    assert cache.slot_count < experts + engine.config.num_hidden_layers + 1  # the shared experts' slots beside
    cache.close()
    monkeypatch.setattr(expert_cache, "memory_limit_bytes", lambda: len(cache.arena))  # no room for the rest
    with pytest.raises(GlmkitError, match=r"^--expert-cache 1\.1 TB: its slots take .* more than the"):
        ExpertCache(engine.container, 1 << 40)
    assert ExpertCache(engine.container, 1 << 40, pin_weights=False).n_slots == experts  # the GPU holds the rest

    def no_pages(nbytes: int, populate: bool = True) -> np.ndarray:
        raise OSError(12, "Cannot allocate memory")
    monkeypatch.setattr(expert_cache, "anonymous_bytes", no_pages)
    monkeypatch.setattr(expert_cache, "memory_limit_bytes", lambda: 1 << 50)
    with pytest.raises(GlmkitError, match=r"^--expert-cache .* could not be had \(Cannot allocate memory\)$"):
        ExpertCache(engine.container, 8 * cache.slot_bytes)

def test_eviction_keeps_the_frequent_and_never_the_layer_in_use(snapshots):
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    cache = ExpertCache(engine.container, 5 * slot_bytes(engine), readahead=False)
    layer = next(i for i in range(engine.config.num_hidden_layers) if engine.config.is_moe_layer(i))
    for _ in range(3):  # expert 0 becomes hot
        cache.on_route(layer, np.array([[0, 1, 2, 3]]))
        for e in range(4):
            cache.expert(layer, e)
    cache.on_route(layer, np.array([[0, 4, 5, 6]]))  # 3 new experts, one free slot: two evictions among 1, 2, 3
    for e in (0, 4, 5, 6):
        cache.expert(layer, e)
    assert cache.resident(layer, 0) and all(cache.resident(layer, e) for e in (4, 5, 6))
    assert sum(cache.resident(layer, e) for e in (1, 2, 3)) == 1 and cache.stats.evictions == 2
    cache.close()


def test_a_prompt_s_rows_each_count_in_an_expert_s_frequency(snapshots):
    """Experts that several of a prompt's rows routed to outscore those one row routed to: they stay when the next
    routing needs the slots."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    cache = ExpertCache(engine.container, 5 * slot_bytes(engine), readahead=False)
    layer = next(i for i in range(engine.config.num_hidden_layers) if engine.config.is_moe_layer(i))
    cache.on_route(layer, np.array([[0, 1, 2, 3], [0, 1, 2, 4]]))  # 0, 1, 2 twice; 3 and 4 (routed last) once
    for e in range(5):
        cache.expert(layer, e)
    cache.on_route(layer, np.array([[7, 8, 9, 10]]))  # four slots wanted: one of the five stays
    for e in (7, 8, 9, 10):
        cache.expert(layer, e)
    assert sum(cache.resident(layer, e) for e in (0, 1, 2)) == 1 and not any(cache.resident(layer, e) for e in (3, 4))
    cache.close()


def test_a_miss_with_every_slot_in_use_is_read_into_a_buffer_of_its_own(snapshots):
    """Every slot holds an expert the layer routed to and has not run: another expert is read, not cached."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    cfg, container, k = engine.config, engine.container, engine.config.num_experts_per_tok
    cache = ExpertCache(container, k * slot_bytes(engine), readahead=False)
    layer = cfg.first_k_dense_replace
    cache.on_route(layer, np.array([list(range(k))]))
    for e in range(k):
        cache.expert(layer, e)  # read (and waited for), not run
    views = cache.expert(layer, k)
    for view, projection in zip(views, EXPERT_PROJECTIONS, strict=True):
        mapped = container.weight(expert_weight_name(layer, k, projection))
        assert np.array_equal(view.packed, mapped.packed) and np.array_equal(view.scales, mapped.scales)
    assert cache.stats.bounced == 1 and not cache.resident(layer, k) and all(cache.resident(layer, e) for e in range(k))
    cache.ran(layer, 0)  # once one has run, its slot takes the next miss
    cache.expert(layer, k + 1)
    assert cache.stats.bounced == 1 and cache.resident(layer, k + 1) and not cache.resident(layer, 0)
    cache.close()


def test_read_ahead_waiting_for_slots_continues_as_the_layer_s_experts_run(snapshots):
    """With slots for one layer's experts only, the next layer's read-ahead finds none while the layer is routed; as
    each expert of the layer has run its slot goes to the read-ahead, never to an expert read-ahead already named."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    c, k = engine.config, engine.config.num_experts_per_tok
    cache = ExpertCache(engine.container, 2 * k * slot_bytes(engine))
    first = c.first_k_dense_replace
    r = cache.moe[first + 1].router
    normed = np.random.default_rng(1).standard_normal((2, c.hidden_size)).astype(np.float32)
    named = likely_experts(normed, np.asarray(cache.weight(r.weight)), cache.weight(r.bias), r.top_k)
    assert len(named) <= 2 * k
    routed = list(range(2 * k))  # the layer's prompt rows reach twice the top-k: every slot
    cache.on_route(first, np.array([routed[:k], routed[k:]]))
    cache.read_ahead(first, normed)
    assert cache.stats.read_ahead == 0
    for e in routed:
        cache.expert(first, e)
        cache.ran(first, e)
    for future in list(cache._loading.values()):
        future.result()
    assert cache.stats.read_ahead == len(named) and all(cache.resident(first + 1, e) for e in named)
    assert cache.stats.bounced == 0
    cache.close()


def test_read_ahead_reads_only_while_it_is_right(snapshots):
    """Named experts that the next layer does not route to make the read-ahead stop reading (it keeps naming them
    and measuring); right guesses make it read again."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    c, k = engine.config, engine.config.num_experts_per_tok
    cache = ExpertCache(engine.container, 2 * k * slot_bytes(engine))  # the routed ones' slots, and no spare
    first = c.first_k_dense_replace
    r = cache.moe[first + 1].router
    rng = np.random.default_rng(0)

    def named_by(normed: np.ndarray) -> set[int]:
        return set(likely_experts(normed, np.asarray(cache.weight(r.weight)), cache.weight(r.bias), r.top_k))

    normed = rng.standard_normal((1, c.hidden_size)).astype(np.float32)
    named = named_by(normed)
    others = [e for e in range(c.n_routed_experts) if e not in named][:k]

    def token(routed: list[int], normed: np.ndarray = normed) -> int:
        """Layer `first` routes to experts 0..k-1, then the next one to `routed`; the reads the read-ahead started."""
        cache.on_route(first, np.array([list(range(k))]))
        before = cache.stats.read_ahead
        cache.read_ahead(first, normed)
        started = cache.stats.read_ahead - before
        cache.on_route(first + 1, np.array([routed]))
        cache.wait_places(first + 1, routed)
        for future in list(cache._loading.values()):
            future.result()
        return started

    assert token(others) == len(named)  # trusted at first
    wrong = [token(others) for _ in range(30)]
    assert wrong[-1] == 0 and cache.ahead_precision < 0.5
    trusted = next(i for i, started in enumerate(wrong) if started == 0)  # guesses until it stopped reading
    probes = (30 - trusted) // READ_AHEAD_PROBE
    assert probes > 0 and cache.stats.predicted == (1 + trusted + probes) * len(named)  # still named now and then
    turns = 0
    while cache.ahead_precision < 0.5 and turns < 30 * READ_AHEAD_PROBE:
        token(sorted(named))
        turns += 1
    assert cache.ahead_precision >= 0.5 and turns > READ_AHEAD_PROBE
    fresh = next(n for n in (rng.standard_normal((1, c.hidden_size)).astype(np.float32) for _ in range(100))
                 if not all(cache.resident(first + 1, e) for e in named_by(n)))
    assert token(sorted(named), fresh) > 0
    cache.close()


def test_scores_age_by_half_per_half_life():
    scores = ExpertScores(half_life=10)
    scores.use((1, 0), 4)  # four uses at t=0
    scores.tick(10)
    scores.use((1, 1), 2)  # two uses one half-life later weigh as much as four then
    assert scores.score((1, 0)) == pytest.approx(scores.score((1, 1)))
    scores.tick(10 * 600)  # the sums are rescaled before they overflow
    scores.use((1, 2))
    assert np.isfinite(list(scores.scores.values())).all() and scores.score((1, 2)) > scores.score((1, 1))
    assert scores.normalized()[(1, 2)] == pytest.approx(1.0)


def test_usage_persists_and_a_corrupt_file_is_ignored(snapshots, tmp_path, monkeypatch):
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    c, h = engine.config, engine.container.model_hash
    path = usage_path(tmp_path, h)
    cache = ExpertCache(engine.container, 6 * slot_bytes(engine), usage_file=path)
    layer = c.first_k_dense_replace
    cache.on_route(layer, np.array([[3, 5, 7, 9]]))
    cache.close()
    saved = read_usage(path, h, c.num_layers_with_mtp, c.n_routed_experts)
    assert set(saved) == {(layer, e) for e in (3, 5, 7, 9)}
    warm = ExpertCache(engine.container, 6 * slot_bytes(engine), usage_file=path)
    assert warm.preloader is not None
    warm.preloader.join(timeout=30)
    assert all(warm.resident(layer, e) for e in (3, 5, 7, 9)) and warm.stats.preloaded == 4
    for bad in ("{", json.dumps({"version": 1, "model_hash": h, "scores": [[layer, 10_000, 1.0]]}),
                json.dumps({"version": 1, "model_hash": "other", "scores": [[layer, 1, 1.0]]}),
                f'{{"version": 1, "model_hash": "{h}", "scores": [[{layer}, 1, 1e999]]}}',
                json.dumps({"version": 1, "model_hash": h, "scores": [[True, 1, 1.0]]}),
                # valid, but longer than any file of this model's experts can be: not parsed
                json.dumps({"version": 1, "model_hash": h, "scores": [[layer, 1, 1.0]]}) + " " * 8192):
        path.write_text(bad)
        assert read_usage(path, h, c.num_layers_with_mtp, c.n_routed_experts) == {}
    write_usage(path, h, {(layer, 1): 2.0})
    assert read_usage(path, h, c.num_layers_with_mtp, c.n_routed_experts) == {(layer, 1): 2.0}

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError):
        write_usage(path, h, {(layer, 2): 1.0})
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [path.name]  # no partial file left
    assert read_usage(path, h, c.num_layers_with_mtp, c.n_routed_experts) == {(layer, 1): 2.0}


def test_engine_keeps_the_split_steps_usage_from_process_to_process(snapshots, tmp_path):
    """The usage scores an engine hands its backend (what a split step uploads experts by and counts its decoded
    tokens' routes into) are read from the usage file and saved on close once tokens were counted; an engine that
    counted none leaves the file as it was; only routed experts of this model are taken."""
    snap = snapshots("tiny-trained", "q4")
    first = Engine(snap, "numpy", load_tokenizer=False, expert_usage_dir=tmp_path)
    c, h = first.config, first.model_hash
    path, layer = usage_path(tmp_path, h), c.first_k_dense_replace
    assert first.expert_usage.scores == {}
    first.close()
    assert not path.exists()  # nothing counted: nothing saved
    first.expert_usage.tick()
    for e in (2, 4, 4):
        first.expert_usage.use((layer, e))
    first.close()
    second = Engine(snap, "numpy", load_tokenizer=False, expert_usage_dir=tmp_path)
    assert second.expert_usage.scores == pytest.approx({(layer, 2): 1.0, (layer, 4): 2.0})
    write_usage(path, h, {(layer, 2): 1.0, (0, 3): 5.0})  # layer 0 is dense: no routed expert 3 there
    third = Engine(snap, "numpy", load_tokenizer=False, expert_usage_dir=tmp_path)
    assert third.expert_usage.scores == {(layer, 2): 1.0}
    assert Engine(snap, "numpy", load_tokenizer=False).expert_usage.scores == {}  # no directory: none read


@pytest.mark.parametrize("score", ["1" + "0" * 400, HUGE_INTEGER, "1e999", "-1.0", '"1.0"', "true"])
def test_a_damaged_usage_file_is_said_and_removed_and_the_engine_opens(snapshots, tmp_path, capsys, score):
    """A score no save writes (an integer past a float's range or past the digit limit, infinite, negative,
    not a number): the engine opens without the scores, says so in one line, and the file goes."""
    snap = snapshots("tiny-trained", "q4")
    plain = Engine(snap, "numpy", load_tokenizer=False)
    path, layer = usage_path(tmp_path, plain.model_hash), plain.config.first_k_dense_replace
    write_usage(path, plain.model_hash, {(layer, 1): 2.0, (layer, 2): 1.0})
    path.write_text(path.read_text().replace("1.0", score))
    capsys.readouterr()
    engine = Engine(snap, "numpy", load_tokenizer=False, expert_usage_dir=tmp_path)
    err = capsys.readouterr().err
    assert engine.expert_usage.scores == {} and not path.exists()
    assert err.startswith(f"glmkit: warning: expert usage file {path} is damaged (") and err.count("\n") == 1
    assert err.endswith("); removed\n"), err
    write_usage(path, plain.model_hash, {(layer, 1): 2.0})
    assert Engine(snap, "numpy", load_tokenizer=False, expert_usage_dir=tmp_path).expert_usage.scores
    assert capsys.readouterr().err == ""


def takes_direct_io(path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("direct", [True, False])
def test_direct_and_buffered_reads_give_the_containers_bytes(snapshots, direct):
    """O_DIRECT reads whole pages into a slot and the expert lies at its offset within its first page; buffered
    reads lie alike: either way every expert's arrays are the container's, wherever its range starts."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    cfg, container = engine.config, engine.container
    cache = ExpertCache(container, 6 * slot_bytes(engine), readahead=False, direct=direct)
    (fd, is_direct), = cache._fds.values()
    assert is_direct == (direct and takes_direct_io(container.directory / container.manifest.experts[0].file))
    layer = cfg.first_k_dense_replace
    shifts = {container.expert_range(layer, e).offset % 4096 for e in range(cfg.n_routed_experts)}
    assert len(shifts) > 1  # experts start at several offsets within a page
    for e in range(cfg.n_routed_experts):
        cache.on_route(layer, np.array([[e]]))
        views = cache.expert(layer, e)
        for view, projection in zip(views, EXPERT_PROJECTIONS, strict=True):
            mapped = container.weight(expert_weight_name(layer, e, projection))
            assert np.array_equal(view.packed, mapped.packed) and np.array_equal(view.scales, mapped.scales)
    assert cache.stats.reads == cfg.n_routed_experts and cache.stats.evictions == cfg.n_routed_experts - 6
    cache.close()


@pytest.mark.parametrize("direct", [True, False])
def test_a_file_truncated_under_the_cache_is_an_error_naming_it(snapshots, tmp_path, direct):
    import shutil

    snap = tmp_path / "snap"
    shutil.copytree(snapshots("tiny-trained", "q4"), snap)
    engine = Engine(snap, "numpy", load_tokenizer=False)
    cache = ExpertCache(engine.container, 4 * slot_bytes(engine), readahead=False, direct=direct)
    layer = engine.config.first_k_dense_replace
    r = engine.container.expert_range(layer, 15)
    os.truncate(snap / r.file, r.offset + 10)
    with pytest.raises(GlmkitError, match=r.file):
        cache.expert(layer, 15)


def test_experts_held_elsewhere_are_never_read_here(snapshots):
    """Beside a discrete device holding some routed experts (the split step), the cache frees the slots of those it
    had preloaded, and neither its read-ahead nor a later preload reads them; a cache that pins no weights reads
    every other tensor from the container, copying nothing."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    container, cfg = engine.container, engine.config
    scores = ExpertScores()
    scores.scores.update({(1, e): 10.0 - e for e in range(8)})  # the saved hot set: layer 1's experts 0..7
    cache = ExpertCache(container, 16 * slot_bytes(engine), scores=scores, pin_weights=False)
    cache.preloader.join()
    assert all(cache.resident(1, e) for e in range(8))
    cache.hold_elsewhere([(1, e) for e in range(4)] + [(2, e) for e in range(cfg.n_routed_experts)])
    assert [cache.resident(1, e) for e in range(8)] == [False] * 4 + [True] * 4
    normed = np.random.default_rng(0).standard_normal((2, cfg.hidden_size)).astype(np.float32)
    cache.read_ahead(1, normed)  # layer 2's likely experts: all of them held elsewhere
    assert cache.stats.read_ahead == 0 and not any(cache.resident(2, e) for e in range(cfg.n_routed_experts))
    cache.read_ahead(2, normed)  # layer 3's: read as usual
    assert cache.stats.read_ahead > 0
    again = ExpertCache(container, 16 * slot_bytes(engine), scores=scores, pin_weights=False)
    again.hold_elsewhere([(1, e) for e in range(8)])
    again.preloader.join()
    assert not any(again.resident(1, e) for e in range(8))  # whatever the preload had reached is given back
    name = next(n for n in container.manifest.tensors if n.endswith("input_layernorm.weight"))
    assert np.shares_memory(cache.weight(name), container.weight(name))  # the mapping's, not a copy
    cache.close()
    again.close()


def test_a_cache_over_some_layers_holds_and_sizes_for_them_only(snapshots, monkeypatch):
    """A pipeline stage's cache (`layers`): only those layers' routed experts are cached and only their other weights
    copied into RAM (nothing of the layers before or after, nor the embedding or lm_head); auto-sizing counts their
    bytes alone, and a stage whose part fits the RAM keeps the page cache (`stage_expert_cache`)."""
    container = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False).container
    part = range(2, 4)
    ours = [r for r in container.manifest.experts if r.layer in part]
    theirs = [r for r in container.manifest.experts if r.layer not in part]
    assert ours and theirs
    weights = sum(e.nbytes for n, e in container.manifest.tensors.items() if n.startswith(("model.layers.2.",
                                                                                          "model.layers.3.")))
    assert container.layers_nbytes(part) == weights
    assert expert_cache.non_expert_bytes(container, part) == weights - sum(r.nbytes for r in ours) > 0
    cache = ExpertCache(container, 1 << 30, readahead=False, layers=part)
    assert cache.n_slots == len(ours)  # room for every expert of the part, none of the others
    assert cache._pinned and all(name.startswith(("model.layers.2.", "model.layers.3.")) for name in cache._pinned)
    cache.close()
    limit, held = 8 << 20, 1 << 20
    monkeypatch.setattr(expert_cache, "memory_limit_bytes", lambda: limit)
    monkeypatch.setattr(expert_cache, "anonymous_resident_bytes", lambda: held)
    size = auto_cache_bytes(container, layers=part)[0]
    assert size == min(sum(r.nbytes for r in ours),
                       limit - expert_cache.non_expert_bytes(container, part) - held - limit // 4 - limit // 16)
    assert size < sum(r.nbytes for r in container.manifest.experts)
    # the stage's default: the page cache where its part (and a GB for the process) fits the RAM, else a cache
    from glmkit.generate import pipeline

    monkeypatch.setattr(engine_module, "outgrows_memory", lambda container, **k: False)
    size, why = pipeline.stage_expert_cache(container, part, None, "f32", 64, 16)
    assert size == 0 and why.startswith(f"routed experts in the page cache: layers 2-3 ({format_size(weights)})")
    monkeypatch.setattr(engine_module, "outgrows_memory", lambda container, **k: True)
    monkeypatch.setattr(expert_cache, "memory_limit_bytes", lambda: 2 << 20)  # the room binds, not the experts
    size, why = pipeline.stage_expert_cache(container, part, None, "f32", 64, 16)
    kv = kv_bytes_per_token(container.config, "f32", part) * 64
    assert f"{format_size(kv)} for KV rows" in why and kv < kv_bytes_per_token(container.config, "f32") * 64
    # the temporaries of the head's pieces of 16 rows kept, not a quarter of the limit
    pieces = prefill_bytes(container.config, 16)
    assert pieces < (2 << 20) // 4
    assert size == auto_cache_bytes(container, kv_bytes=kv, layers=part, activations=pieces)[0] > 0
    assert size == (2 << 20) - expert_cache.non_expert_bytes(container, part) - held - pieces - (2 << 20) // 16 - kv
    assert why.startswith("expert cache")
    assert pipeline.stage_expert_cache(container, range(0, 1), "auto", "f32", 64, 16) == (
        0, "no routed experts in its layers")  # layer 0 is dense
