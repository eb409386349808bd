"""Continuous batching: `GlmMoeDsaModel.decode_batch` and glm-serve's worker decoding every request in one forward."""

from __future__ import annotations

import copy
import gc
import itertools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from glmkit.backends.opencl import decode_graph
from glmkit.backends.opencl.backend import OpenCLBackend, Placement
from glmkit.backends.opencl.ops import Kernels
from glmkit.cache.session import Session
from glmkit.cli.serve import build_app
from glmkit.cli.serve import main as serve_main
from glmkit.errors import GlmkitError
from glmkit.generate.engine import Engine
from glmkit.generate.generator import Generator
from glmkit.generate.sampling import Sampler, SamplingParams
from glmkit.generate.tokenizer import StreamDecoder
from glmkit.model.expert_cache import ExpertCache
from glmkit.model.glm5 import GlmMoeDsaModel
from glmkit.model.kv_cache import LayerKV
from glmkit.serve import scheduler as scheduler_module
from glmkit.serve.scheduler import Done, GenerationJob, GenRequest, Scheduler, Text
from tests.runtime_support import opencl_test_device
from tests.test_device_sampling import defer_draws
from tests.test_serve import ServerThread, concurrent_chats, serve_args, stats, user

STEPS = 10
BASE = [374, 376, 379, 198, 54, 368, 266, 295, 82, 220, 345, 307, 282, 271, 291, 284, 81, 78, 86, 280]  # 20 tokens


def prompts(count: int, shared: bool) -> list[list[int]]:
    """`count` prompts of different lengths (3 to 29 tokens: below and above the fixture's DSA top-k of 8); `shared`:
    all but the first start with the same 12 tokens."""
    rng = np.random.default_rng(count + 10 * shared)
    out = []
    for i, n in enumerate((3, 29, 14, 9)[:count]):
        own = [int(t) for t in rng.integers(0, 370, n)]
        out.append(BASE[:12] + own[:max(n - 12, 1)] if shared and i else own)
    return out


def greedy_alone(model: GlmMoeDsaModel, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """n greedy tokens of `prompt` decoded alone, one `forward` per token, with the logits each was chosen from."""
    cache = model.new_cache()
    logits, _ = model.forward(np.array(prompt), cache, last_logits_only=True)
    tokens, rows = [], []
    for _ in range(n):
        rows.append(logits[-1])
        tokens.append(int(np.argmax(logits[-1])))
        logits, _ = model.forward(np.array(tokens[-1:]), cache)
    return tokens, rows


def greedy_batched(model: GlmMoeDsaModel, batch: list[list[int]], n: int) -> tuple[list[list[int]], list[list]]:
    """The same, all prompts decoded together through `decode_batch`."""
    caches = [model.new_cache() for _ in batch]
    last = [model.forward(np.array(p), c, last_logits_only=True)[0][-1] for p, c in zip(batch, caches, strict=True)]
    tokens: list[list[int]] = [[] for _ in batch]
    rows: list[list[np.ndarray]] = [[] for _ in batch]
    for _ in range(n):
        for i, logits in enumerate(last):
            rows[i].append(logits)
            tokens[i].append(int(np.argmax(logits)))
        last = list(model.decode_batch(np.array([t[-1] for t in tokens]), caches)[0])
    return tokens, rows


@pytest.mark.parametrize("count,shared", [(1, False), (2, False), (3, True), (4, False), (4, True)])
def test_batched_decode_gives_each_request_its_logits_alone(engine, count, shared):
    """NumPy, up to GEMV_ROWS rows: every product of the batch runs row by row, so each row's logits are bit for bit
    those of its sequence decoded alone."""
    model = engine.model
    batch = prompts(count, shared)
    tokens, rows = greedy_batched(model, batch, STEPS)
    for i, prompt in enumerate(batch):
        alone, alone_rows = greedy_alone(model, prompt, STEPS)
        assert tokens[i] == alone
        np.testing.assert_array_equal(np.array(rows[i]), np.array(alone_rows))


def test_batched_decode_through_an_expert_cache_matches_the_mapping(engine, snapshot):
    """Out of core: an expert cache of two slots per MoE layer, far fewer than a batch of four rows routes to (the
    union's experts take each other's slots as they run); every row's logits bit for bit the mapping's."""
    cfg = engine.config
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers_with_mtp))
    slot = ExpertCache(engine.container, 1 << 30).slot_bytes
    streamed = Engine(snapshot, load_tokenizer=False, expert_cache=2 * moe_layers * slot)
    try:
        batch = prompts(4, True)
        tokens, rows = greedy_batched(streamed.model, batch, 6)
        ram_tokens, ram_rows = greedy_batched(engine.model, batch, 6)
        assert tokens == ram_tokens
        np.testing.assert_array_equal(np.array(rows), np.array(ram_rows))
        stats = streamed.experts.stats
        assert stats.misses > 0 and stats.evictions > 0
    finally:
        streamed.close()


def test_batched_moe_reads_each_routed_expert_once(engine, monkeypatch):
    """The batch's routed experts run once each on the rows routed to them: the union of the rows' experts."""
    model = engine.model
    batch = prompts(4, False)
    caches = [model.new_cache() for _ in batch]
    for p, c in zip(batch, caches, strict=True):
        model.forward(np.array(p), c)
    routed: list[np.ndarray] = []
    runs: list[int] = []
    monkeypatch.setattr(model, "route_hook", lambda layer, ids, u: routed.append(ids))
    backend_mlp = model.backend.expert_mlp
    monkeypatch.setattr(model.backend, "expert_mlp", lambda x, *w: (runs.append(len(x)), backend_mlp(x, *w))[1])
    model.decode_batch(np.array([5, 6, 7, 8]), caches)
    moe_layers = len(routed)
    assert moe_layers == model.config.num_hidden_layers - model.config.first_k_dense_replace
    unions = sum(len(np.unique(ids)) for ids in routed)
    dense, shared = model.config.first_k_dense_replace, moe_layers
    assert len(runs) == unions + dense + shared  # one call per routed expert in the union, not one per row
    assert all(ids.shape[0] == 4 for ids in routed)  # routed on the 4 rows at once


def test_batched_decode_refuses_a_cache_twice(engine):
    model = engine.model
    cache = model.new_cache()
    model.forward(np.array([1, 2, 3]), cache)
    with pytest.raises(ValueError, match="distinct"):
        model.decode_batch(np.array([4, 5]), [cache, cache])


@pytest.fixture(scope="module")
def cl_engine(snapshot: Path) -> Engine:
    """The fixture on OpenCL (PoCL's CPU device): single tokens decode on the device step."""
    engine = Engine(snapshot, device="opencl")
    assert engine.model.decodes_on_device()
    return engine


@pytest.fixture
def cl_model(cl_engine: Engine) -> GlmMoeDsaModel:
    return cl_engine.model


def discrete_model(engine: Engine, kv_dtype: str = "f32", split: bool = False) -> GlmMoeDsaModel:
    """The engine's model on the test device driven as a discrete GPU is (device buffers and copies, the GPU build of
    the kernels: work-group top-k), KV rows at kv_dtype; `split`: that GPU holding half the container, the routed
    experts over it run on the CPU device beside (the split step)."""
    kernels = Kernels(opencl_test_device(), lanes=8, red_lanes=8, direct=False, cpu_loads=False)
    nbytes = engine.container.nbytes
    if split:
        spill = OpenCLBackend(Kernels(opencl_test_device(), lanes=8, red_lanes=8, cpu_loads=False),
                              Placement.all_cl(True))
        backend = OpenCLBackend(kernels, Placement(spill_experts=True), int8_activations=True, unified=False,
                                model_bytes=nbytes, budget=nbytes // 2, spill=spill)
    else:
        backend = OpenCLBackend(kernels, Placement(), int8_activations=True, unified=False, model_bytes=nbytes)
    return GlmMoeDsaModel(engine.config, engine.experts, backend, kv_dtype=kv_dtype)


@pytest.fixture(scope="module")
def cl_discrete_model(cl_engine: Engine) -> GlmMoeDsaModel:
    return discrete_model(cl_engine)


@pytest.fixture(scope="module")
def cl_split_model(cl_engine: Engine) -> GlmMoeDsaModel:
    if opencl_test_device().kind != "cpu":
        pytest.skip("the split step's CPU side is a CPU OpenCL device")
    return discrete_model(cl_engine, split=True)


@pytest.fixture(params=["direct", "discrete", "split"])
def any_cl_model(request, cl_engine: Engine) -> GlmMoeDsaModel:
    """Each test that takes it runs on the direct device (PoCL's CPU device), on it driven as a discrete GPU, and on
    the split step (that GPU holding half the model)."""
    return cl_engine.model if request.param == "direct" else request.getfixturevalue(f"cl_{request.param}_model")


@pytest.mark.parametrize("count", [2, 3, 4])
def test_batched_decode_on_opencl_is_each_sequence_on_the_device_step_alone(any_cl_model, monkeypatch, count):
    """OpenCL: B sequences of different lengths (below and past the DSA top-k: with and without the indexer's
    selection) decode in one forward of the step over B sequences, each row's logits bit for bit those of its
    sequence alone on the single-row step; no per-operation product runs. On a discrete device too (each row's KV
    rows read back into its own cache), and on the split step (each row's experts over the GPU's budget on the CPU
    device)."""
    batch = prompts(count, True)
    alone = [greedy_alone(any_cl_model, prompt, 6) for prompt in batch]
    step = any_cl_model.sequences_step(count)
    assert step is not None and (step.spill is not None) == (any_cl_model.backend.spill is not None)
    decode_batch = any_cl_model.decode_batch

    def on_the_step(token_ids: np.ndarray, caches: list) -> tuple[np.ndarray, np.ndarray]:
        with monkeypatch.context() as m:
            m.setattr(any_cl_model.backend, "linear", lambda *a: pytest.fail("a per-operation product ran"))
            return decode_batch(token_ids, caches)

    monkeypatch.setattr(any_cl_model, "decode_batch", on_the_step)
    tokens, rows = greedy_batched(any_cl_model, batch, 6)
    for i, (alone_tokens, alone_rows) in enumerate(alone):
        assert tokens[i] == alone_tokens
        np.testing.assert_array_equal(np.array(rows[i]), np.array(alone_rows))


def test_opencl_batch_takes_requests_that_join_and_leave(any_cl_model):
    """The batch changes as requests end and others join (steps over 4, 3 and 2 sequences in turn, caches of varied
    lengths, one of them new): each row stays its sequence alone on the single-row step (a discrete device's copy of
    a row's cache follows the sequence that row takes)."""
    batch = prompts(4, False) + [BASE[:5]]
    alone = [greedy_alone(any_cl_model, prompt, 9)[1] for prompt in batch]
    caches = [any_cl_model.new_cache() for _ in batch]
    rows: list[list[np.ndarray]] = [[] for _ in batch]
    for i in (0, 1, 2, 3):
        rows[i].append(any_cl_model.forward(np.array(batch[i]), caches[i], last_logits_only=True)[0][-1])
    for live in ([0, 1, 2, 3], [0, 1, 2, 3], [0, 2, 3], [0, 2, 3], [2, 3, 4], [2, 4], [2, 4], [2, 4]):
        if not caches[4].length and 4 in live:
            rows[4].append(any_cl_model.forward(np.array(batch[4]), caches[4], last_logits_only=True)[0][-1])
        logits = any_cl_model.decode_batch(np.array([int(np.argmax(rows[i][-1])) for i in live]),
                                       [caches[i] for i in live])[0]
        for i, row in zip(live, logits, strict=True):
            rows[i].append(row)
    for i, got in enumerate(rows):
        np.testing.assert_array_equal(np.array(got), np.array(alone[i][:len(got)]))
    assert any_cl_model.batch_pays()
    if not any_cl_model.backend.k.direct:  # one device copy of each sequence's rows, whatever steps ran them
        mirrors = any_cl_model.backend.kv_mirrors
        gc.collect()
        assert {id(kv) for kv in mirrors.layers()} == {id(kv) for cache in caches for kv in cache.layers if kv.length}
        del caches
        gc.collect()
        assert not mirrors  # freed with the rows


def kv_rows(cache) -> list[np.ndarray]:
    """Every layer's cache rows, as stored (each field up to the layer's length)."""
    return [np.asarray(kv.storage(name)[:kv.length]) for kv in cache.layers for name in ("kv_lat", "k_rot")]


def test_pipelined_batch_is_decode_batch_and_the_argmax(any_cl_model):
    """The batch decoded greedily with its next forward queued ahead (`pipelined_batch`): the tokens of decode_batch
    and the argmax, step after step, and once closed every cache holds bit for bit the rows decode_batch wrote, its
    last token's row left out; a decode_batch on the same step closes a pipeline in flight the same way. Not on the
    split step (its layers wait for the host)."""
    batch = prompts(3, True)
    tokens, _ = greedy_batched(any_cl_model, batch, 7)
    caches = [any_cl_model.new_cache() for _ in batch]
    first = [int(np.argmax(any_cl_model.forward(np.array(p), c, last_logits_only=True)[0][-1]))
             for p, c in zip(batch, caches, strict=True)]
    pipe = any_cl_model.pipelined_batch(first, caches)
    if any_cl_model.backend.spill is not None:
        assert pipe is None
        return
    got = [first] + [pipe.advance() for _ in range(5)]
    assert pipe.running
    pipe.close()
    assert not pipe.running and [[row[i] for row in got] for i in range(3)] == [t[:6] for t in tokens]
    want = [any_cl_model.new_cache() for _ in batch]
    for p, c in zip(batch, want, strict=True):
        any_cl_model.forward(np.array(p), c)
    for step in range(5):
        any_cl_model.decode_batch(np.array([t[step] for t in tokens]), want)
    for cache, other in zip(caches, want, strict=True):
        assert cache.length == other.length
        for a, b in zip(kv_rows(cache), kv_rows(other), strict=True):
            np.testing.assert_array_equal(a, b)
    pipe = any_cl_model.pipelined_batch([t[5] for t in tokens], caches)
    assert pipe.advance() == [t[6] for t in tokens]
    lengths = [cache.length for cache in caches]
    logits, _ = any_cl_model.decode_batch(np.array([5, 6, 7]), caches)  # the same step: the pipeline closes first
    assert not pipe.running and [cache.length for cache in caches] == lengths


def test_pipelined_batch_lets_the_forward_in_flight_finish_before_a_cache_grows(any_cl_model, monkeypatch):
    """A batch whose next forward outgrows a cache's arrays (reallocated: the forward in flight writes the old ones)
    queues it only once that forward has finished; its tokens and rows are decode_batch's across the growth."""
    if any_cl_model.backend.spill is not None:
        pytest.skip("the split step does not pipeline its batch")
    rng = np.random.default_rng(1)
    batch = [[int(t) for t in rng.integers(0, 370, 252)], prompts(1, False)[0]]
    tokens, _ = greedy_batched(any_cl_model, batch, 9)
    caches = [any_cl_model.new_cache() for _ in batch]
    for p, c in zip(batch, caches, strict=True):
        any_cl_model.forward(np.array(p), c)
    assert caches[0].capacity == 256  # the first sequence's arrays grow at its 257th row
    pipe = None
    resize = LayerKV._resize

    def checked(self, name: str, rows: int) -> None:
        assert pipe is None or pipe.pending is None or pipe.pending[0].command_execution_status == 0, \
            "a cache array reallocated under a forward in flight"
        resize(self, name, rows)

    monkeypatch.setattr(LayerKV, "_resize", checked)
    pipe = any_cl_model.pipelined_batch([t[0] for t in tokens], caches)
    got = [[t[0]] for t in tokens]
    for _ in range(8):
        for row, token in zip(got, pipe.advance(), strict=True):
            row.append(token)
    pipe.close()
    assert got == tokens and caches[0].capacity > 256


ROW_SETTINGS = [SamplingParams(seed=4), SamplingParams(0.9, top_p=0.9, seed=1), SamplingParams(1.1, top_k=20, seed=2),
                SamplingParams(1.0, seed=3)]  # greedy, top-p alone, top-k, temperature alone


def sampled_rows(model: GlmMoeDsaModel, batch: list[list[int]], n: int, pipelined: bool
                 ) -> tuple[list[list[int]], list[float], Any]:
    """n tokens of each prompt decoded together, row i drawn by a Sampler of ROW_SETTINGS[i]: through decode_batch
    and the host samplers, or `pipelined` (the device drawing each row from its sampler's stream). Returns each
    row's tokens, each sampler's next uniform once the pipeline is closed, and the pipeline."""
    samplers = [Sampler(params) for params in ROW_SETTINGS[:len(batch)]]
    caches = [model.new_cache() for _ in batch]
    tokens = [[s(model.forward(np.array(p), c, last_logits_only=True)[0][-1])]
              for p, c, s in zip(batch, caches, samplers, strict=True)]
    pipe = None
    if pipelined:
        pipe = model.pipelined_batch([t[-1] for t in tokens], caches, [None if s.greedy else s for s in samplers])
        for _ in range(n - 1):
            for row, token in zip(tokens, pipe.advance(), strict=True):
                row.append(token)
        pipe.close()
    else:
        for _ in range(n - 1):
            logits = model.decode_batch(np.array([t[-1] for t in tokens]), caches)[0]
            for row, s, r in zip(tokens, samplers, logits, strict=True):
                row.append(s(r))
    return tokens, [s.rng.random() for s in samplers], pipe


def test_pipelined_batch_draws_each_row_as_its_sampler(any_cl_model, monkeypatch):
    """Sampled rows in the batch's pipeline: each row drawn on the device from its own sampler's seeded stream gives
    the host's tokens (top-p alone, top-k, temperature alone, beside a greedy row) and leaves each stream where the
    host leaves it; where the device leaves a draw to the host, the pipeline drops the forward queued on it, goes on
    from the host's tokens and gives the same; where it leaves every draw, it stops after the second forward."""
    batch = prompts(4, False)
    want, want_next, _ = sampled_rows(any_cl_model, batch, 8, pipelined=False)
    got, got_next, pipe = sampled_rows(any_cl_model, batch, 8, pipelined=True) if any_cl_model.backend.spill is None \
        else (want, want_next, None)
    assert (got, got_next) == (want, want_next) and len({tuple(t) for t in want}) == 4
    if pipe is None:
        assert any_cl_model.pipelined_batch([1, 2], [any_cl_model.new_cache() for _ in range(2)]) is None
        return
    assert pipe.decided == 7 and pipe.fallbacks == 0
    draws = itertools.count()
    with monkeypatch.context() as m:
        defer_draws(m, lambda u: next(draws) == 7)  # a draw of the third forward
        got, got_next, pipe = sampled_rows(any_cl_model, batch, 8, pipelined=True)
    assert (got, got_next) == (want, want_next) and pipe.fallbacks == 1 and pipe.decided == 7
    with monkeypatch.context() as m:
        defer_draws(m, lambda u: True)
        samplers = [Sampler(params) for params in ROW_SETTINGS]
        caches = [any_cl_model.new_cache() for _ in batch]
        for p, c in zip(batch, caches, strict=True):
            any_cl_model.forward(np.array(p), c)
        pipe = any_cl_model.pipelined_batch([5, 6, 7, 8], caches, [None if s.greedy else s for s in samplers])
        pipe.advance()
        assert pipe.running
        pipe.advance()
        assert not pipe.running and pipe.fallbacks == 2


def test_discrete_device_kv_copies_stay_within_the_room_its_weights_leave(cl_engine):
    """A discrete device's copies of the KV rows stay within the room (`OpenCLBackend.kv_room`): with room for one
    sequence's copies and a half, two sequences decoded in turn drop each other's (the least recently used) and send
    the rows again, each logit bit for bit its sequence's with no bound. A sequence whose own copies outgrow the room
    is a GlmkitError naming the device, its cache left at its length, and it decodes on once the room allows."""
    model = discrete_model(cl_engine)
    mirrors = model.backend.kv_mirrors
    batch = prompts(2, False)
    alone = [greedy_alone(model, prompt, 7)[1] for prompt in batch]
    gc.collect()
    assert 0 < model.backend.memory.used <= model.backend.memory.device_bytes
    assert 0 < model.backend.kv_room() < model.backend.k.info.global_mem - model.backend.memory.device_bytes
    caches = [model.new_cache() for _ in batch]
    rows = [[model.forward(np.array(p), c, last_logits_only=True)[0][-1]] for p, c in zip(batch, caches, strict=True)]
    rows[0].append(model.forward(np.array([int(np.argmax(rows[0][-1]))]), caches[0])[0][-1])
    one = mirrors.held_bytes()  # one sequence's copies (a prompt runs operation by operation: none)
    assert one > 0 and {id(kv) for kv in mirrors.layers()} <= {id(kv) for kv in caches[0].layers}
    mirrors.room = lambda: one * 3 // 2
    for _ in range(4):
        for i, cache in enumerate(caches):
            rows[i].append(model.forward(np.array([int(np.argmax(rows[i][-1]))]), cache)[0][-1])
            assert mirrors.held_bytes() <= one * 3 // 2
            held = {id(kv) for kv in mirrors.layers()}
            assert {id(kv) for kv in cache.layers if kv.length} <= held  # this sequence's copies all kept
            assert len(held) < 2 * len(cache.layers)  # the other's dropped, as many as the room asked for
    for i, got in enumerate(rows):
        np.testing.assert_array_equal(np.array(got), np.array(alone[i][:len(got)]))
    mirrors.room = lambda: one // 2
    length = caches[0].length
    with pytest.raises(GlmkitError, match=f"{model.backend.device}: the KV rows .* more than the"):
        model.forward(np.array([int(np.argmax(rows[0][-1]))]), caches[0])
    assert caches[0].length == length
    mirrors.room = None
    rows[0].append(model.forward(np.array([int(np.argmax(rows[0][-1]))]), caches[0])[0][-1])
    np.testing.assert_array_equal(rows[0][-1], alone[0][len(rows[0]) - 1])


def test_a_batch_the_device_cannot_hold_goes_on_in_smaller_batches(cl_engine):
    """A discrete GPU whose room for the KV rows' copies holds three short sequences' but not three long ones: the
    batch of three long requests fails to bind its rows (DeviceMemoryError), is rolled back, and the scheduler goes
    on with batches of one (each request decoding alone) while the requests hold as much room: every request gets
    the tokens it gets served one by one, none fails. Three short requests after them batch again, whole."""
    model = discrete_model(cl_engine)
    mirrors = model.backend.kv_mirrors
    cache = model.new_cache()
    token = int(model.forward(np.array(BASE[:5]), cache, last_logits_only=True)[0][-1].argmax())
    model.forward(np.array([token]), cache)
    one = mirrors.held_bytes()  # one short sequence's copies
    del cache
    gc.collect()
    engine = copy.copy(cl_engine)
    engine.model = model
    rng = np.random.default_rng(5)
    long = [GenRequest([int(t) for t in rng.integers(0, 370, 600 + 9 * i)], 6, ignore_eos=True,
                       request_id=f"long {i}") for i in range(3)]
    short = [GenRequest(BASE[i:i + 3], 4, ignore_eos=True, request_id=f"short {i}") for i in range(3)]
    alone = serve(engine, long + short, 1)
    mirrors.room = lambda: one * 7 // 2
    shrunk = serve(engine, long, 3, then=short)  # in the long ones' Sessions, fitted to them (`KVCache.fit`)
    assert serve.stats["batch_shrunk"] == 1 and serve.stats["failed"] == 0
    assert serve.stats["batched_forwards"] >= 4  # the failed one, then the short requests' (3 tokens after the first)
    assert_same_requests(shrunk, alone)
    assert mirrors.held_bytes() <= one * 7 // 2


@pytest.mark.parametrize("count", [2, 4])
def test_opencl_batch_over_an_expert_cache_is_each_sequence_alone(cl_engine, snapshot, count):
    """Out of core on OpenCL: the step over B sequences reads the routed experts from an expert cache's slots (as many
    as the B rows route to: the rows' union is read, an expert several rows route to once, each layer waiting for
    its misses); each row's logits bit for bit those of its sequence alone on the mapping's single-row step."""
    cfg, cl_model = cl_engine.config, cl_engine.model
    batch = prompts(count, True)
    alone = [greedy_alone(cl_model, prompt, 6) for prompt in batch]
    slot = ExpertCache(cl_engine.container, 1 << 30).slot_bytes
    streamed = Engine(snapshot, device="opencl", load_tokenizer=False,
                      expert_cache=count * cfg.num_experts_per_tok * slot)
    try:
        tokens, rows = greedy_batched(streamed.model, batch, 6)
        step = streamed.model.sequences_step(count)
        assert step is not None and step.experts is streamed.experts
        for i, (alone_tokens, alone_rows) in enumerate(alone):
            assert tokens[i] == alone_tokens
            np.testing.assert_array_equal(np.array(rows[i]), np.array(alone_rows))
        assert streamed.experts.stats.misses > 0 and streamed.experts.stats.evictions > 0
    finally:
        streamed.close()


@pytest.mark.parametrize("discrete", [False, True])
def test_opencl_batch_stores_lower_precision_rows_as_each_sequence_alone(snapshot, discrete):
    """Cache rows kept at fp8 with their scales (each row's new rows stored by its own kv_store_rows launch): each
    row of a batch of three still its sequence alone on the single-row step, on a discrete device too."""
    engine = Engine(snapshot, device="opencl", load_tokenizer=False, kv_dtype="fp8")
    model = discrete_model(engine, "fp8") if discrete else engine.model
    batch = prompts(3, False)
    alone = [greedy_alone(model, prompt, 4) for prompt in batch]
    tokens, rows = greedy_batched(model, batch, 4)
    assert model.sequences_step(3) is not None
    for i, (alone_tokens, alone_rows) in enumerate(alone):
        assert tokens[i] == alone_tokens
        np.testing.assert_array_equal(np.array(rows[i]), np.array(alone_rows))


def test_opencl_batch_selects_from_the_shadows_as_each_sequence_alone(cl_model, monkeypatch):
    """Past SHADOW_MIN_PER_KEPT x index_topk keys (SHADOW_MIN_KEYS lowered to 0) a row's indexer selects through the
    shadows, its neighbours in the batch in one stage or not at all: each row still its sequence alone."""
    monkeypatch.setattr(decode_graph, "SHADOW_MIN_KEYS", 0)
    topk = cl_model.config.index_topk
    rng = np.random.default_rng(3)
    batch = [[int(t) for t in rng.integers(0, 370, n)] for n in (decode_graph.SHADOW_MIN_PER_KEPT * topk, 20, 4)]
    alone = [greedy_alone(cl_model, prompt, 4) for prompt in batch]
    selections: list[int] = []
    bind_cache = decode_graph.DeviceDecodeStep._bind_cache

    def counted(step, layer, *args):
        chosen = bind_cache(step, layer, *args)
        selections.append(step.sequences and bool(chosen) and chosen == layer.shadowed)
        return chosen

    monkeypatch.setattr(decode_graph.DeviceDecodeStep, "_bind_cache", counted)
    tokens, rows = greedy_batched(cl_model, batch, 4)
    assert any(selections)
    for i, (alone_tokens, alone_rows) in enumerate(alone):
        assert tokens[i] == alone_tokens
        np.testing.assert_array_equal(np.array(rows[i]), np.array(alone_rows))


# ---- the scheduler -------------------------------------------------------------------------------------------

class MultiplesOf:
    """A constraint: only token ids divisible by `k` (a grammar's mask, as `LogitsConstraint` sees it)."""

    def __init__(self, k: int):
        self.k, self.accepted = k, []

    def mask(self, logits: np.ndarray) -> np.ndarray:
        return np.where(np.arange(len(logits)) % self.k == 0, logits, -np.inf)

    def accept(self, token: int) -> None:
        assert token % self.k == 0
        self.accepted.append(token)


def mixed_requests(shared: bool) -> list[GenRequest]:
    """Four requests of different prompt lengths and sampling settings (greedy, seeded top-p with penalties and
    logprobs, a constraint, a stop sequence) and lengths."""
    p = prompts(4, shared)
    return [GenRequest(p[0], 12, ignore_eos=True, request_id="greedy"),
            GenRequest(p[1], 9, SamplingParams(0.9, top_p=0.9, seed=7, presence_penalty=0.5), ignore_eos=True,
                       logprobs=3, request_id="sampled"),
            GenRequest(p[2], 14, SamplingParams(0.7, seed=3), ignore_eos=True, constraint=MultiplesOf(3),
                       request_id="constrained"),
            GenRequest(p[3], 7, ignore_eos=True, stop=(" of", "hi"), logprobs=0, request_id="stopped")]


def serve(engine: Engine, requests: list[GenRequest], max_batch: int | None, cancel_after: dict[str, int] | None = None,
          join_at: int = 0, then: list[GenRequest] = (), first: int = 1, **kwargs: Any
          ) -> dict[str, tuple[list[int], list[Text], Done]]:
    """Run `requests` through a Scheduler (all queued before it starts, or with `join_at` the `first` ones and the
    others once the first has that many tokens), then `then` once they all ended: each request's (tokens, Text events,
    Done).
    cancel_after: request id -> cancel it once it has emitted that many Texts."""
    scheduler = Scheduler(engine, max_active=4, max_batch=max_batch, **kwargs)
    events: dict[str, list[Any]] = {r.request_id: [] for r in [*requests, *then]}
    jobs: dict[str, GenerationJob] = {}
    finished = threading.Semaphore(0)

    later = requests[first:] if join_at else []

    def emitter(request_id: str):
        def emit(event: Text | Done) -> None:
            events[request_id].append(event)
            if isinstance(event, Done):
                finished.release()
            elif cancel_after and len(events[request_id]) == cancel_after.get(request_id):
                scheduler.cancel(jobs[request_id])
            if later and request_id == requests[0].request_id and len(jobs[request_id].tokens) >= join_at:
                for r in later:  # on the worker thread, between two of the first request's decode steps
                    jobs[r.request_id] = scheduler.submit(r, emitter(r.request_id))
                later.clear()
        return emit

    for r in requests[:first] if join_at else requests:
        jobs[r.request_id] = scheduler.submit(r, emitter(r.request_id))
    scheduler.start()
    try:
        for _ in requests:
            assert finished.acquire(timeout=120), "a request never finished"
        for r in then:
            jobs[r.request_id] = scheduler.submit(r, emitter(r.request_id))
        for _ in then:
            assert finished.acquire(timeout=120), "a request never finished"
    finally:
        scheduler.stop()
    out = {}
    for request_id, got in events.items():
        assert isinstance(got[-1], Done) and all(isinstance(e, Text) for e in got[:-1])
        out[request_id] = (jobs[request_id].tokens, got[:-1], got[-1])
    serve.stats = scheduler.counters  # type: ignore[attr-defined]
    return out


def assert_same_requests(batched: dict, alone: dict, skip: tuple[str, ...] = ()) -> None:
    for request_id, (tokens, texts, done) in alone.items():
        if request_id in skip:
            continue
        b_tokens, b_texts, b_done = batched[request_id]
        assert b_tokens == tokens, request_id
        assert "".join(t.text for t in b_texts) == "".join(t.text for t in texts), request_id
        assert (b_done.finish_reason, b_done.stop_sequence, b_done.completion_tokens) == (
            done.finish_reason, done.stop_sequence, done.completion_tokens), request_id
        b_lp = [lp for t in b_texts for lp in t.logprobs]
        lp = [lp for t in texts for lp in t.logprobs]
        assert [x.token for x in b_lp] == [x.token for x in lp]
        np.testing.assert_allclose([x.logprob for x in b_lp], [x.logprob for x in lp], atol=1e-4)


@pytest.mark.parametrize("shared", [False, True])
def test_scheduler_batches_decoding_requests_with_their_own_settings(engine, shared):
    """Four requests with different prompts, samplers, constraints, stops and lengths give what each gives when the
    worker decodes them one by one (max_batch 1: today's round robin, each through its Generator)."""
    requests = mixed_requests(shared)
    alone = serve(engine, requests, 1)
    assert serve.stats["batched_forwards"] == 0
    batched = serve(engine, mixed_requests(shared), 4)
    assert serve.stats["max_batch_seen"] == 4 and serve.stats["batched_forwards"] >= 6
    assert_same_requests(batched, alone)
    assert alone["stopped"][2].finish_reason == "stop"  # the stop sequence is hit (while batched)
    assert all(t % 3 == 0 for t in batched["constrained"][0])


def test_scheduler_batches_on_opencl_by_default_and_each_request_gets_its_tokens_alone(cl_engine, monkeypatch):
    """OpenCL: where the step over several sequences binds and its forward of two costs less per token than single
    tokens (the measurement is set here: a timing would make the test depend on the machine's load), batching is the
    default (--max-batch unset); four requests (greedy, seeded sampling, a constraint, a stop) get what each gets
    decoded on its own."""
    monkeypatch.setattr(cl_engine, "batch_costs", lambda: {"token": 8.0, "batch": 6.5})
    alone = serve(cl_engine, mixed_requests(False), 1)
    batched = serve(cl_engine, mixed_requests(False), None)
    assert serve.stats["max_batch_seen"] == 4 and serve.stats["batched_forwards"] >= 6
    assert_same_requests(batched, alone)


def greedy_requests() -> list[GenRequest]:
    """Five greedy requests of different prompts and lengths, one ending at a stop sequence; with four at a time, the
    fifth waits for the first to end and takes its Session."""
    p = prompts(4, False)
    return [GenRequest(p[0], 14, ignore_eos=True, request_id="long"),
            GenRequest(p[1], 5, ignore_eos=True, request_id="short"),
            GenRequest(p[2], 9, ignore_eos=True, request_id="middle"),
            GenRequest(p[3], 12, ignore_eos=True, stop=(" of", "hi"), request_id="stopped"),
            GenRequest(BASE[:7], 8, ignore_eos=True, request_id="fifth")]


def test_greedy_batches_on_opencl_keep_their_next_forward_queued(cl_engine, monkeypatch):
    """Where every request of the batch is greedy, its forwards are pipelined (the next one queued before the worker
    takes the tokens): each request still gets its tokens decoded alone, as requests end (a short one, a stop
    sequence, a cancelled one) and join (a fifth one, in the Session of the first to end; three while the first two
    decode as a batch). A batch holding a sampled request runs decode_batch."""
    monkeypatch.setattr(cl_engine, "batch_costs", lambda: {"token": 8.0, "batch": 6.5})
    alone = serve(cl_engine, greedy_requests(), 1)
    batched = serve(cl_engine, greedy_requests(), None)
    assert serve.stats["pipelined_forwards"] >= 6 and serve.stats["batched_forwards"] >= 6
    assert_same_requests(batched, alone)
    assert alone["stopped"][2].finish_reason == "stop" and len(alone["short"][0]) == 5
    joined = serve(cl_engine, greedy_requests(), None, join_at=3, first=2, cancel_after={"middle": 4})
    assert serve.stats["pipelined_forwards"] > 0 and joined["middle"][2].finish_reason == "cancelled"
    assert_same_requests(joined, alone, skip=("middle",))
    assert joined["middle"][0] == alone["middle"][0][:len(joined["middle"][0])]
    serve(cl_engine, mixed_requests(False), None)
    assert serve.stats["pipelined_forwards"] == 0 and serve.stats["batched_forwards"] >= 6


def test_sampled_batches_on_opencl_keep_their_next_forward_queued(cl_engine, monkeypatch):
    """Seeded sampled requests (top-p alone, top-k, temperature alone, beside a greedy one) batch with their next
    forward queued too, the device drawing each from its own seeded stream: each gets the tokens it gets decoded on
    its own, as requests end and one joins."""
    monkeypatch.setattr(cl_engine, "batch_costs", lambda: {"token": 8.0, "batch": 6.5})

    def requests() -> list[GenRequest]:
        p = prompts(4, True)
        return [GenRequest(p[i], n, params, ignore_eos=True, request_id=f"row {i}")
                for i, (n, params) in enumerate(zip((12, 6, 9, 11), ROW_SETTINGS, strict=True))]

    alone = serve(cl_engine, requests(), 1)
    batched = serve(cl_engine, requests(), None, join_at=2, first=3)
    assert serve.stats["pipelined_forwards"] >= 4 and serve.stats["max_batch_seen"] == 4
    assert_same_requests(batched, alone)
    assert len({tuple(tokens) for tokens, _, _ in alone.values()}) == 4


def test_batch_costs_are_measured_once_per_device_and_model(snapshot, monkeypatch, tmp_path):
    """`Engine.batch_costs`: ms per token of single tokens and of two sequences' forward on the step, measured on the
    first call (positive times) and kept in the device profile: a second engine reads them, measuring nothing."""
    from glmkit.generate import engine as engine_module

    monkeypatch.setenv("GLMKIT_DEVICE_CACHE_DIR", str(tmp_path))  # a profile without this measurement
    measure = engine_module.measure_batch_costs
    calls = []
    monkeypatch.setattr(engine_module, "measure_batch_costs", lambda model: calls.append(model) or measure(model))
    first = Engine(snapshot, "opencl", load_tokenizer=False).batch_costs()
    assert first["token"] > 0 and first["batch"] > 0
    assert Engine(snapshot, "opencl", load_tokenizer=False).batch_costs() == first
    assert len(calls) == 1


def test_opencl_batches_by_default_only_where_measured_faster(cl_engine, monkeypatch):
    """The default follows the measurement: a device where two sequences' forward costs more per token than single
    tokens keeps one request per forward (an explicit --max-batch still batches)."""
    def started(max_batch: int | None = None) -> int:
        scheduler = Scheduler(cl_engine, max_active=4, max_batch=max_batch)
        scheduler.start()
        scheduler.stop()
        return scheduler.max_batch

    monkeypatch.setattr(cl_engine, "batch_costs", lambda: {"token": 8.0, "batch": 6.5})
    assert started() == 4
    monkeypatch.setattr(cl_engine, "batch_costs", lambda: {"token": 8.0, "batch": 9.0})
    assert (started(), started(3)) == (1, 3)


def test_requests_join_and_leave_the_batch_of_a_request_decoding_alone(engine, monkeypatch):
    """The first request decodes alone (MTP drafts, all accepted) until the others arrive, is batched with them, and
    decodes alone again once they end (their max_tokens are shorter): every request gets its tokens alone."""
    first = prompts(1, False)[0]
    sequence = first + greedy_alone(engine.model, first, 61)[0]
    mtp_step = Generator._mtp_step

    def perfect_drafts(self, hidden, next_ids, cache):  # the first request's true next token: accepted
        draft = mtp_step(self, hidden, next_ids, cache)
        position = cache.layer(self.model.config.num_hidden_layers).length + 1
        return sequence[position] if position < len(sequence) else draft

    monkeypatch.setattr(Generator, "_mtp_step", perfect_drafts)
    requests = [GenRequest(first, 60, ignore_eos=True, request_id="long")] + mixed_requests(True)[1:]
    alone = serve(engine, requests, 1)
    joined = []
    for join_at in (9, 10):  # the first request between two tokens of one verified forward, and after both
        joined.append(serve(engine, [GenRequest(r.prompt_ids, r.max_tokens, r.params, r.stop, r.ignore_eos,
                                                r.request_id, MultiplesOf(3) if r.constraint else None, r.logprobs)
                                     for r in requests], 4, join_at=join_at))
        assert serve.stats["max_batch_seen"] == 4
    for batched in joined:
        assert batched["long"][0] == sequence[len(first):len(first) + 60]
        assert_same_requests(batched, alone)


def test_a_cancelled_request_leaves_the_others_undisturbed(engine):
    alone = serve(engine, mixed_requests(False), 1)
    batched = serve(engine, mixed_requests(False), 4, cancel_after={"constrained": 2})
    assert batched["constrained"][2].finish_reason == "cancelled"
    assert 2 <= len(batched["constrained"][0]) < 14
    assert batched["constrained"][0] == alone["constrained"][0][:len(batched["constrained"][0])]
    assert serve.stats["max_batch_seen"] == 4
    assert_same_requests(batched, alone, skip=("constrained",))


def test_batched_requests_commit_their_sessions(engine):
    """With Session reuse, each batched request's follow-up turn finds its own conversation's rows (its prompt and
    reply) and continues as it does without batching."""
    first = [GenRequest(p, 8, ignore_eos=True, request_id=name) for p, name in zip(prompts(2, False), "ab",
                                                                                     strict=True)]
    replies = serve(engine, first, 1)
    follow = [GenRequest(r.prompt_ids + replies[r.request_id][0] + [7, 8], 8, ignore_eos=True,
                         request_id=r.request_id + "2") for r in first]
    runs = {max_batch: serve(engine, first, max_batch, then=follow, reuse=True) for max_batch in (1, 2)}
    assert serve.stats["batched_forwards"] >= 2 * 7  # both turns batched
    assert_same_requests(runs[2], runs[1])
    for r in first:
        done = runs[2][r.request_id + "2"][2]
        assert done.cached_tokens == len(r.prompt_ids) + 8 - 1  # all but its last token, which was never forwarded


def test_requests_wait_for_room_in_the_engine_s_kv_budget(engine, monkeypatch):
    """Where the engine budgets its KV rows (an expert cache sized from the RAM), the Sessions never hold more rows
    than the budget at any step: a request whose prompt and max_tokens would not fit waits, idle Sessions give up
    their rows first (the next turn of their conversation then comes from the prefix cache, here from nothing); each
    request still gets its tokens alone. Without the budget the same requests run at once, past it."""
    requests = [GenRequest(p, 16, ignore_eos=True, request_id=name) for p, name in zip(prompts(4, False), "abcd",
                                                                                      strict=True)]
    most = [min(len(r.prompt_ids) + r.max_tokens, 64) for r in requests]  # 19, 45, 30, 25 rows
    peak: dict[str, int] = {}
    step = Scheduler._step

    def counted(self: Scheduler, job: GenerationJob) -> None:
        step(self, job)
        held = sum(session.kv.length for session in self._sessions)
        peak["rows"] = max(peak.get("rows", 0), held)

    monkeypatch.setattr(Scheduler, "_step", counted)
    alone = serve(engine, requests, 1, reuse=True)
    assert peak["rows"] > 64  # no budget: all four at once
    peak.clear()
    monkeypatch.setattr(engine, "kv_budget_tokens", 64, raising=False)
    budgeted = serve(engine, requests, 1, reuse=True)
    assert max(most) <= peak["rows"] <= 64
    assert_same_requests(budgeted, alone)
    waited = [budgeted[r.request_id][2].queue_s for r in requests]
    assert max(waited) > min(waited) + 0.01  # some request waited for another to end

def test_a_prompt_s_span_is_lengthened_only_by_kv_room_no_session_may_take(engine, monkeypatch):
    """Under a budget of KV rows each prefill step asks the model for its span with the rows the Sessions may come to
    hold (`GlmMoeDsaModel.prompt_chunk`'s held_rows): the active requests' most and the idle Sessions' rows; the
    request's Generator tells the model nothing of its own (`hold_kv_rows`: one sequence's rows are not all)."""
    requests = [GenRequest(p, 16, ignore_eos=True, request_id=name) for p, name in zip(prompts(4, False), "abcd",
                                                                                      strict=True)]
    monkeypatch.setattr(engine, "kv_budget_tokens", 64, raising=False)
    asked: list[tuple[int | None, int]] = []  # per prefill step: (held_rows the model was given, what was held)
    step, chunk, hold = Scheduler._prefill_step, engine.model.prompt_chunk, engine.model.hold_kv_rows

    def prefill_step(self: Scheduler, job: GenerationJob) -> None:
        held = sum(min(len(j.request.prompt_ids) + j.request.max_tokens, 64) for j in self._active)
        held += sum(session.kv.length for session in self._idle)
        calls: list[int | None] = []  # the step's own call, then its Generator's (its one sequence's rows)
        holds: list[int] = []
        monkeypatch.setattr(engine.model, "prompt_chunk", lambda c, rows=None: (calls.append(rows), chunk(c, rows))[1])
        monkeypatch.setattr(engine.model, "hold_kv_rows", lambda rows: (holds.append(rows), hold(rows)))
        step(self, job)
        assert holds == []
        asked.append((calls[0], held))

    monkeypatch.setattr(Scheduler, "_prefill_step", prefill_step)
    late = GenRequest(BASE[:5], 4, ignore_eos=True, request_id="late")  # comes once the others' Sessions are idle
    serve(engine, requests, 1, then=[late], reuse=True)
    assert asked and all(given == held for given, held in asked)
    assert asked[-1][1] > len(late.prompt_ids) + late.max_tokens  # idle Sessions' rows count too


def test_the_rows_held_out_of_a_lending_cache_cover_every_step_and_grow_with_the_replies(engine, monkeypatch):
    """Under a budget of KV rows the worker tells the model, every pass before its steps, the rows the Sessions may
    hold by its end (`hold_kv_rows`, so that an expert cache lending their room gives it back first): a request in
    its prefill its most, a decoding one its rows and KV_HOLD_AHEAD more, the idle Sessions their rows. The Sessions'
    rows never pass the last hold, and a reply's rows are held as it grows, not its whole max_tokens at once."""
    requests = [GenRequest(p, 24, ignore_eos=True, request_id=name) for p, name in zip(prompts(4, False), "abcd",
                                                                                      strict=True)]
    monkeypatch.setattr(engine, "kv_budget_tokens", 256, raising=False)
    monkeypatch.setattr(scheduler_module, "KV_HOLD_AHEAD", 4)
    holds: list[int] = []
    hold = engine.model.hold_kv_rows
    monkeypatch.setattr(engine.model, "hold_kv_rows", lambda rows: (holds.append(rows), hold(rows)))
    over: list[tuple[int, int]] = []  # (rows, the hold) after a step whose rows passed the hold
    below: list[bool] = []  # after each step with every active request decoding: was the hold below their most?

    def checked(step: Callable) -> Callable:
        def run(self: Scheduler, jobs: Any) -> None:
            step(self, jobs)
            rows = sum(session.kv.length for session in self._sessions)
            if rows > holds[-1]:
                over.append((rows, holds[-1]))
            if self._active and all(j.iterator is not None or j.batched for j in self._active):
                below.append(holds[-1] < sum(len(j.request.prompt_ids) + 24 for j in self._active))
        return run

    monkeypatch.setattr(Scheduler, "_step", checked(Scheduler._step))
    monkeypatch.setattr(Scheduler, "_batch_step", checked(Scheduler._batch_step))
    serve(engine, requests, 1, reuse=True)
    assert holds and not over and any(below)


def test_a_request_not_yet_prepared_holds_its_session_s_rows_beside_its_most(engine, monkeypatch):
    """Before its Session is prepared, a request holds its most and the rows its Session has: a restore from the
    prefix cache builds its own beside them. Once prepared, its most alone."""
    monkeypatch.setattr(engine, "kv_budget_tokens", 256, raising=False)
    holds: list[int] = []
    monkeypatch.setattr(engine.model, "hold_kv_rows", holds.append)
    prompt = prompts(2, False)[1]
    job = GenerationJob(GenRequest(prompt, 8, ignore_eos=True), lambda event: None)
    job.session = Session(engine.model, None)
    engine.model.forward(np.array(prompt[:5]), job.session.kv)  # the rows an earlier turn left
    scheduler = Scheduler(engine, max_active=2)
    scheduler._active.append(job)
    scheduler._hold_pass_rows()
    job.decoder = StreamDecoder(engine.tokenizer)
    scheduler._hold_pass_rows()
    assert holds[-2:] == [len(prompt) + 8 + 5, len(prompt) + 8]


def test_the_batch_size_is_decided_by_the_model(engine, monkeypatch):
    """Default: --parallel where batching pays (NumPy; OpenCL's step over several sequences: the test above), one
    request per forward on a device decode step without that form (there a step per request is faster) or on a model
    whose forwards take one sequence (a Ray pipeline's)."""
    def started(max_batch: int | None = None) -> int:
        scheduler = Scheduler(engine, max_active=4, max_batch=max_batch)
        scheduler.start()
        scheduler.stop()
        return scheduler.max_batch

    assert (started(), started(1), started(3), started(9)) == (4, 1, 3, 4)
    monkeypatch.setattr(engine.model, "decodes_on_device", lambda: True)
    assert (started(), started(3)) == (1, 3)
    monkeypatch.setattr(engine.model, "batches_sequences", False)
    assert (started(), started(3)) == (1, 1)
    with pytest.raises(GlmkitError, match="one sequence per forward"):
        engine.model.decode_batch(np.array([1, 2]), [engine.model.new_cache(), engine.model.new_cache()])


# ---- through the server ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["numpy", "opencl"])
def server(snapshot: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest):
    """glm-serve with --parallel 4, on NumPy (the default --max-batch) and on OpenCL (PoCL's CPU device: the device
    decode step over the batch's sequences; --max-batch 4, as its default follows a timing of this machine)."""
    srv = ServerThread(build_app_for(snapshot, tmp_path_factory.mktemp("batch-cache"), request.param)).start()
    yield srv
    srv.stop()


def build_app_for(snapshot: Path, cache_dir: Path, device: str):
    batch = ("--max-batch", "4") if device == "opencl" else ()
    return build_app(serve_args(snapshot, cache_dir, "--parallel", "4", "--device", device, *batch))


def test_concurrent_openai_clients_are_batched_and_get_their_replies_alone(server):
    """Greedy replies to four concurrent clients, batched, are each client's reply served alone."""
    client = server.client()
    model = client.models.list().data[0].id
    questions = ["Tell me a story about the sea.", "Tell me a story about the mountains and the sky.",
                 "Why?", "Tell me a story about the sea, and then another one."]
    alone = {q: client.chat.completions.create(model=model, messages=[user(q)], max_tokens=48, temperature=0,
                                               extra_body={"ignore_eos": True}).choices[0].message.content
             for q in questions}
    before = stats(server)["batched_forwards"]
    assert concurrent_chats(server, model, questions, 48, ignore_eos=True) == alone
    after = stats(server)
    assert after["batched_forwards"] > before and after["max_batch_seen"] >= 2


@pytest.mark.parametrize("flag, value, message", [
    ("--max-batch", "0", "--max-batch: must be >= 1"),
    ("--max-queue", "-1", "--max-queue: must be >= 0, got -1"),
    ("--max-request-size", "0", "--max-request-size: must be >= 1 byte, got 0"),
])
def test_a_bad_server_number_is_refused_naming_its_flag(snapshot, capsys, flag, value, message):
    assert serve_main([str(snapshot), flag, value]) == 1
    assert capsys.readouterr().err == f"glm-serve: error: {message}\n"
