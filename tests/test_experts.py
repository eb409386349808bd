"""Expert streaming over the mapping: hit/miss counting, prefetch, RAM pinning (glmkit.model.expert_stream)."""

from __future__ import annotations

import mmap
import os
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from glmkit.backends.numpy_backend import NumpyBackend
from glmkit.format.reader import Container
from glmkit.format.schema import EXPERT_PROJECTIONS, expert_weight_name
from glmkit.format.tensors import QuantWeight
from glmkit.model.expert_stream import ExpertStreamer, resident_fraction
from glmkit.model.glm5 import GlmMoeDsaModel
from tests.runtime_support import Snapshots, oracle

VARIANT = "tiny-fp8"


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory: pytest.TempPathFactory) -> Snapshots:
    return Snapshots(tmp_path_factory)


def tokens() -> np.ndarray:
    return np.asarray(oracle(VARIANT)["full_ids"])


def streamed_model(snapshot, **kwargs) -> tuple[GlmMoeDsaModel, ExpertStreamer]:
    streamer = ExpertStreamer(Container(snapshot), **kwargs)
    return GlmMoeDsaModel(streamer.config, streamer, NumpyBackend(), route_hook=streamer.on_route), streamer


def run(model: GlmMoeDsaModel, with_mtp: bool = True) -> np.ndarray:
    """Teacher-forced main logits (and the MTP head's, concatenated) over the oracle sequence."""
    ids = tokens()
    logits, hidden = model.forward(ids, model.new_cache())
    if not with_mtp:
        return logits
    mtp_logits, _ = model.mtp_forward(hidden[:-1], ids[1:], model.new_cache())
    return np.concatenate([logits, mtp_logits])


def routed_experts(snapshot) -> dict[int, list[set[int]]]:
    """Per MoE layer, the unique experts each forward routed to (from a plain model's route hook)."""
    seen: dict[int, list[set[int]]] = {}
    container = Container(snapshot)

    def hook(layer: int, ids: np.ndarray, normed: np.ndarray) -> None:
        seen.setdefault(layer, []).append(set(ids.ravel().tolist()))

    model = GlmMoeDsaModel(container.config, container, NumpyBackend(), route_hook=hook)
    run(model)
    return seen


@pytest.mark.parametrize("preset", ["f32", "q4"])
def test_hits_plus_misses_count_unique_experts_per_layer_per_forward(snapshots, preset):
    snapshot = snapshots(VARIANT, preset)
    expected = routed_experts(snapshot)
    config = Container(snapshot).config
    assert sorted(expected) == list(range(config.first_k_dense_replace, config.num_layers_with_mtp))

    model, streamer = streamed_model(snapshot)
    run(model)
    stats = streamer.stats
    unique_total = sum(len(s) for per_forward in expected.values() for s in per_forward)
    assert stats.hits + stats.misses == unique_total
    assert stats.usage == Counter({(layer, e): sum(e in s for s in per_forward)
                                   for layer, per_forward in expected.items() for s in per_forward for e in s})
    run(model)  # everything was just read: now resident in the page cache
    assert stats.hits + stats.misses == 2 * unique_total
    assert stats.hits >= unique_total


def test_pinning_copies_the_hottest_experts(snapshots):
    snapshot = snapshots(VARIANT, "q4")
    reference = run(streamed_model(snapshot, prefetch=False)[0])

    model, streamer = streamed_model(snapshot, pin_after_tokens=10**9)  # pin by hand below
    run(model)
    usage = streamer.stats.usage
    one_expert = streamer.container.expert_range(1, 0).nbytes
    streamer.ram_budget = 5 * one_expert + one_expert // 2
    streamer.pin_hottest()
    assert streamer.stats.pinned == 5 and streamer.stats.pinned_bytes == 5 * one_expert

    pinned = {(layer, expert) for layer in range(streamer.config.num_layers_with_mtp)
              for expert in range(streamer.config.n_routed_experts)
              if expert_weight_name(layer, expert, "gate_proj") in streamer._pinned}
    assert len(pinned) == 5
    assert min(usage[k] for k in pinned) >= max(v for k, v in usage.items() if k not in pinned)
    for layer, expert in pinned:
        for proj in EXPERT_PROJECTIONS:
            name = expert_weight_name(layer, expert, proj)
            copy, mapped = streamer.weight(name), streamer.container.weight(name)
            assert isinstance(copy, QuantWeight)
            for a, b in ((copy.packed, mapped.packed), (copy.scales, mapped.scales)):
                assert a.flags.owndata and not np.shares_memory(a, b)
                np.testing.assert_array_equal(a, b)
    unpinned = expert_weight_name(*next(k for k in usage if k not in pinned), "up_proj")
    assert np.shares_memory(streamer.weight(unpinned).packed, streamer.container.weight(unpinned).packed)

    np.testing.assert_array_equal(run(model), reference)  # the same numbers from the copies


def test_budget_pins_automatically_once_enough_tokens_routed(snapshots):
    snapshot = snapshots(VARIANT, "f32")
    reference = run(streamed_model(snapshot)[0])
    first_moe = Container(snapshot).config.first_k_dense_replace
    used_first = routed_experts(snapshot)[first_moe][0]
    model, streamer = streamed_model(snapshot, ram_budget_bytes=1 << 30, pin_after_tokens=16)
    np.testing.assert_array_equal(run(model), reference)  # pins mid-forward: same output
    # the first MoE layer routes all 45 tokens at once: the 1 GiB budget then pins every expert it used
    pinned = {(first_moe, e) for e in used_first}
    assert streamer.stats.pinned == len(pinned)
    assert streamer.stats.pinned_bytes == sum(streamer.container.expert_range(*k).nbytes for k in pinned)
    for layer, expert in pinned:
        for proj in EXPERT_PROJECTIONS:
            name = expert_weight_name(layer, expert, proj)
            assert streamer.weight(name).flags.owndata
            np.testing.assert_array_equal(streamer.weight(name), streamer.container.weight(name))


def test_a_budget_below_one_expert_pins_nothing_and_stops_trying(snapshots, monkeypatch):
    snapshot = snapshots(VARIANT, "q4")
    model, streamer = streamed_model(snapshot, ram_budget_bytes=64, pin_after_tokens=1)
    calls = []
    original = streamer.pin_hottest
    monkeypatch.setattr(streamer, "pin_hottest", lambda: (calls.append(1), original())[1])
    reference = run(streamed_model(snapshot)[0])
    np.testing.assert_array_equal(run(model), reference)
    assert streamer.stats.pinned == 0 and streamer.stats.pinned_bytes == 0
    assert len(calls) == 1


def test_prefetch_advises_the_next_layers_predicted_experts(snapshots, monkeypatch):
    snapshot = snapshots(VARIANT, "q4")
    model, streamer = streamed_model(snapshot)
    advised: list[tuple[int, list[int], int]] = []
    original = streamer.container.advise_experts

    def spy(layer, experts, advice=mmap.MADV_WILLNEED):
        advised.append((layer, list(experts), advice))
        original(layer, experts, advice)  # the real madvise runs and must not fail

    monkeypatch.setattr(streamer.container, "advise_experts", spy)
    # the freshly written container is fully in the page cache: pretend it is not, so every prediction is advised
    monkeypatch.setattr("glmkit.model.expert_stream.resident_fraction", lambda view: 0.0)
    run(model, with_mtp=False)
    config = streamer.config
    # every MoE layer but the first is prefetched for, once per forward, by its predecessor
    assert [layer for layer, _, _ in advised] == list(range(config.first_k_dense_replace + 1,
                                                            config.num_hidden_layers))
    assert all(advice == mmap.MADV_WILLNEED for _, _, advice in advised)
    assert all(0 < len(e) <= config.n_routed_experts and all(0 <= x < config.n_routed_experts for x in e)
               for _, e, _ in advised)
    assert streamer.stats.prefetched == sum(len(e) for _, e, _ in advised) > 0

    model, streamer = streamed_model(snapshot, prefetch=False)
    run(model)
    assert streamer.stats.prefetched == 0

    monkeypatch.undo()
    model, streamer = streamed_model(snapshot)
    run(model)
    assert streamer.stats.prefetched == 0  # everything is resident: nothing to advise


def test_advise_every_expert_range(snapshots):
    container = Container(snapshots(VARIANT, "q4"))
    config = container.config
    for layer in range(config.first_k_dense_replace, config.num_layers_with_mtp):
        for advice in (mmap.MADV_WILLNEED, mmap.MADV_NORMAL):
            container.advise_experts(layer, list(range(config.n_routed_experts)), advice)
    container.advise_experts(1, [config.n_routed_experts + 5])  # unknown experts are skipped


def test_resident_fraction(snapshots):
    container = Container(snapshots(VARIANT, "q4"))
    view = container.weight(expert_weight_name(2, 3, "gate_proj")).packed
    fraction = resident_fraction(view)
    assert 0.0 <= fraction <= 1.0
    int(view.sum())  # touch every page
    assert resident_fraction(view) == 1.0
    whole = container.raw("model.embed_tokens.weight")
    assert 0.0 <= resident_fraction(whole) <= 1.0
    assert resident_fraction(np.ones(10_000, np.float32)) == 1.0  # anonymous memory just written
    assert resident_fraction(view[:0]) == 1.0  # no pages at all
    anonymous = mmap.mmap(-1, mmap.PAGESIZE)
    assert resident_fraction(np.frombuffer(anonymous, np.uint8)[:0]) == 1.0  # page-aligned and empty


def drop_from_page_cache(snapshot: Path) -> None:
    """The container's data files dropped from the page cache."""
    for path in snapshot.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # a file just written has dirty pages, which are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def test_warming_reads_the_whole_container_into_the_page_cache(snapshots):
    """Dropped from the page cache, the container is back in it once the background warm-up has run (and once it
    is advised in chunks of a few pages): every expert's pages resident."""
    snapshot = snapshots(VARIANT, "q4")
    streamer = ExpertStreamer(Container(snapshot))
    config, container = streamer.config, streamer.container
    experts = [(layer, e) for layer in range(config.first_k_dense_replace, config.num_hidden_layers)
               for e in range(config.n_routed_experts)]

    def least_resident() -> float:
        return min(resident_fraction(container.expert_bytes(*key)) for key in experts)

    for warm in (lambda: streamer.warm_in_background().join(), lambda: container.advise_all(chunk=4 * mmap.PAGESIZE)):
        drop_from_page_cache(snapshot)
        assert least_resident() < 1.0  # really dropped
        warm()
        deadline = time.monotonic() + 20
        while least_resident() < 1.0:
            assert time.monotonic() < deadline, "the advice did not bring every expert in"
            time.sleep(0.05)


def test_advised_tensors_and_their_scales_come_into_the_page_cache(snapshots):
    """`advise_tensors` (WILLNEED before the expert cache copies the non-expert weights) reads the named tensors'
    ranges, their scales' too, into the page cache from a cold start."""
    snapshot = snapshots(VARIANT, "q4")
    container = Container(snapshot)
    names = [n for n, e in container.manifest.tensors.items() if e.quant is not None and ".experts." not in n]
    arrays = [a for n in names for a in (container.weight(n).packed, container.weight(n).scales)]
    drop_from_page_cache(snapshot)
    assert names and min(resident_fraction(a) for a in arrays) < 1.0  # really dropped
    container.advise_tensors(names)
    deadline = time.monotonic() + 20
    while min(resident_fraction(a) for a in arrays) < 1.0:
        assert time.monotonic() < deadline, "the advice did not bring every tensor in"
        time.sleep(0.05)
