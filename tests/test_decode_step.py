"""The device decode step (glmkit.backends.opencl.decode_graph) on PoCL: a whole decoded token as one queue of kernels.

Checked against the NumPy reference token by token: logits, the KV rows the kernels write into the host cache,
the routed experts the route hook sees, across the indexer's switch to top-k selection (the fixtures have
'shared' indexer layers), cache and scratch growth, truncation, and a failure in the middle of a token."""

from __future__ import annotations

import copy
import json
import time
from collections import Counter

import numpy as np
import pytest

from glmkit.backends.devices import read_profile
from glmkit.backends.opencl import backend as backend_module
from glmkit.backends.opencl import decode_graph, weights
from glmkit.backends.opencl.backend import OpenCLBackend, Placement
from glmkit.backends.opencl.decode_graph import MAX_EXPERT_BUFFERS, DeviceDecodeStep
from glmkit.backends.opencl.ops import Kernels
from glmkit.backends.opencl.program import Launch
from glmkit.cli import run as cli_run
from glmkit.cli import serve as serve_cli
from glmkit.cli import validate as cli_validate
from glmkit.errors import GlmkitError
from glmkit.eval.metrics import kl_divergence, log_softmax
from glmkit.generate.engine import Engine
from glmkit.generate.generator import STEP_PREFILL_ROWS, Generator
from glmkit.generate.sampling import Sampler, SamplingParams
from glmkit.model import expert_cache, expert_stream
from glmkit.model.expert_cache import ExpertCache, ExpertScores, expert_slot_bytes
from glmkit.model.glm5 import VERIFY_ROWS, GlmMoeDsaModel
from tests.runtime_support import FIXTURES, Snapshots, convert, copy_with_config, opencl_test_device, oracle
from tools.quality_int8_activations import pad_experts


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    return Snapshots(tmp_path_factory)


@pytest.fixture(scope="module")
def direct_kernels():
    """The test device as it is (PoCL's CPU device by default: direct, its buffers are host memory)."""
    return Kernels(opencl_test_device())


@pytest.fixture(scope="module")
def discrete_kernels():
    """The test device driven as a discrete GPU is: device buffers, explicit copies (with `unified=False`
    backends: weights uploaded), and the GPU build of the kernels (8 work-items per matvec row, 8-item reductions,
    vloadn loads; test_kernels_cl's wide build)."""
    return Kernels(opencl_test_device(), lanes=8, red_lanes=8, direct=False, cpu_loads=False)


def in_place(kernels: Kernels) -> Kernels:
    """`kernels`, for a test of weights used in place from the mapping (skipped where GLMKIT_TEST_DEVICE names a
    GPU: it uploads them)."""
    if not kernels.direct:
        pytest.skip("weights are used in place on direct (CPU) devices only")
    return kernels


@pytest.fixture(params=["direct", "discrete"])
def kernels(request):
    """Each test that takes `kernels` runs on both kinds of device."""
    return request.getfixturevalue(f"{request.param}_kernels")


class Routes:
    """A route hook recording `(layer, sorted expert ids)` of single-token forwards (`seen`), and counting those of
    every row of forwards of up to VERIFY_ROWS rows (`rows`: a short prompt's forwards on the two-row step too)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, list[int]]] = []
        self.rows: Counter = Counter()

    def __call__(self, layer: int, ids: np.ndarray, normed: np.ndarray | None) -> None:
        if len(ids) == 1:
            self.seen.append((layer, sorted(ids[0].tolist())))
        if len(ids) <= VERIFY_ROWS:
            self.rows.update((layer, tuple(sorted(row.tolist()))) for row in ids)


def models(engine: Engine, kernels: Kernels, int8_activations: bool = False, kv_dtype: str = "f32"
           ) -> tuple[GlmMoeDsaModel, GlmMoeDsaModel]:
    """(NumPy reference, OpenCL with the device decode step), each with its own route recorder and KV rows at
    kv_dtype. The step's int4 experts take float inputs, the reference's arithmetic, unless int8_activations."""
    ref = GlmMoeDsaModel(engine.config, engine.experts, engine.backend, route_hook=Routes(), kv_dtype=kv_dtype)
    backend = OpenCLBackend(kernels, Placement(), int8_activations=int8_activations,
                            unified=None if kernels.direct else False, model_bytes=engine.container.nbytes)
    dev = GlmMoeDsaModel(engine.config, engine.experts, backend, route_hook=Routes(), kv_dtype=kv_dtype)
    return ref, dev


def decode_both(ref: GlmMoeDsaModel, dev: GlmMoeDsaModel, prompt: np.ndarray, tokens: np.ndarray,
                caches=None) -> tuple[np.ndarray, np.ndarray, tuple]:
    """Prefill `prompt` (or continue `caches`), then decode `tokens` one by one on both models."""
    if caches is None:
        caches = ref.new_cache(), dev.new_cache()
        ref.forward(prompt, caches[0])
        dev.forward(prompt, caches[1])
    want, got = [], []
    for token in tokens:
        want.append(ref.forward(np.array([token]), caches[0])[0])
        got.append(dev.forward(np.array([token]), caches[1])[0])
    return np.concatenate(want), np.concatenate(got), caches


def assert_same(want: np.ndarray, got: np.ndarray) -> None:
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max() * 4
    assert (got.argmax(-1) == want.argmax(-1)).all()


def assert_same_rows(caches) -> None:
    """The rows the kernels wrote into the host cache are the reference's rows."""
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        assert a.length == b.length
        for name in ("kv_lat", "k_rot", "index_k") if a.has_index else ("kv_lat", "k_rot"):
            np.testing.assert_allclose(b.rows(name), a.rows(name), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant,preset,grid", [("tiny-trained", "q4", "nl"), ("tiny-trained", "q4", "uniform"),
                                                 ("tiny-bf16", "f32", "nl"), ("tiny-fp8", "q2", "nl"),
                                                 ("tiny-trained", "q3", "nl")])
def test_decode_step_matches_numpy(snapshots, kernels, variant, preset, grid):
    """Before and after the indexer starts selecting (index_topk keys), f32 and quantized experts (4-bit: nl4 and
    uniform codes); q2's and q3's shared expert (nl4, routed int2 / int3) runs in a launch pair of its own."""
    engine = Engine(snapshots(variant, preset, *(["--grid", grid] if grid != "nl" else [])), "numpy",
                    load_tokenizer=False)
    ref, dev = models(engine, kernels)
    ids = np.array(oracle(variant)["full_ids"])
    topk = engine.config.index_topk
    prompt, tokens = ids[:topk - 3], ids[topk - 3:]  # crosses index_topk keys while decoding
    want, got, caches = decode_both(ref, dev, prompt, tokens)
    assert isinstance(dev._step, DeviceDecodeStep)  # the step ran, not the per-operation path
    assert_same(want, got)
    assert_same_rows(caches)
    assert dev.route_hook.seen == ref.route_hook.seen  # the same experts, reported per token and layer
    assert len(dev.route_hook.seen) == len(tokens) * (engine.config.num_hidden_layers
                                                     - engine.config.first_k_dense_replace)


@pytest.mark.parametrize("kv_dtype", ["bf16", "f16", "fp8"])
def test_decode_step_over_compact_kv_rows(snapshots, kernels, kv_dtype):
    """KV rows at bf16 / f16 / fp8: the step reads the stored codes (kv.cl built for them) and stores each new row as
    the host's `encode_kv_rows` would; logits as the NumPy model's over the same precision, across index_topk keys,
    a truncation and rows the host rewrote (a discrete device's mirror takes the codes and the scales)."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    ref, dev = models(engine, kernels, kv_dtype=kv_dtype)
    ids = np.array(oracle("tiny-trained")["full_ids"])
    topk = engine.config.index_topk
    want, got, caches = decode_both(ref, dev, ids[:topk - 3], ids[topk - 3:topk + 5])
    assert isinstance(dev._step, DeviceDecodeStep) and dev._step.kv_dtype == kv_dtype
    assert caches[1].layer(0).storage("kv_lat").dtype.itemsize == (1 if kv_dtype == "fp8" else 2)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()
    # a code may round the other way where the two paths' f32 rows differ in their last bits: one code's step
    tolerance = {"bf16": 2 ** -8, "f16": 2 ** -11, "fp8": 2 ** -3}[kv_dtype]
    for a, b in zip(caches[0].layers[:engine.config.num_hidden_layers], caches[1].layers, strict=False):
        for name in ("kv_lat", "k_rot", "index_k") if a.has_index else ("kv_lat", "k_rot"):
            rows_a, rows_b = a.rows(name), b.rows(name)
            scale = np.abs(rows_a).max(axis=-1, keepdims=True)
            assert (np.abs(rows_b - rows_a) <= tolerance * scale).all()
            # nearly every code is the same
            same = a.storage(name)[:a.length].view(np.uint8) == b.storage(name)[:b.length].view(np.uint8)
            assert same.mean() > 0.99
    rng = np.random.default_rng(5)
    chunk = rng.integers(0, engine.config.vocab_size, 3)
    for model, cache in zip((ref, dev), caches, strict=True):
        cache.truncate(topk - 1)
        model.forward(chunk, cache)  # rows rewritten by the host
    want, got, caches = decode_both(ref, dev, None, rng.integers(0, engine.config.vocab_size, 4), caches)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_steps_over_parts_chain_to_the_whole_step(snapshots, kernels):
    """A pipeline's parts of a decoded token as device steps: the steps over layers 0-1 and 2-3 (the hidden state and
    the selection layer 2 reuses handed from one to the next, `run_span`), then the final norm and lm_head (a step
    over no layers) give the whole step's logits, KV rows and routes bit for bit, across the indexer's switch to
    top-k selection."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    (_, whole), (_, parts) = models(engine, kernels, True), models(engine, kernels, True)
    cfg = engine.config
    assert cfg.indexer_type(2) == "shared"
    ids = np.array(oracle("tiny-trained")["full_ids"])
    caches = whole.new_cache(), parts.new_cache()
    for model, cache in zip((whole, parts), caches, strict=True):
        model.forward(ids[:cfg.index_topk - 3], cache)
    head = parts.part_step(range(0), True)
    for token in ids[cfg.index_topk - 3:cfg.index_topk + 3]:
        want = whole.forward(np.array([token]), caches[0])[0]
        x, chosen = parts.embed(np.array([token])), None
        for span in (range(0, 2), range(2, cfg.num_hidden_layers)):
            x, chosen = parts.step_layers(span, x, caches[1], chosen)
        assert np.array_equal(head(int(token), caches[1], x[0])[0], want)
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        assert a.length == b.length
        for name in ("kv_lat", "k_rot", "index_k") if a.has_index else ("kv_lat", "k_rot"):
            assert np.array_equal(a.rows(name), b.rows(name))
    assert parts.route_hook.seen == whole.route_hook.seen and parts.route_hook.seen


def launch_names(step: DeviceDecodeStep) -> set[str]:
    return {launch.kernel.function_name for layer in step.layers for launch in (*layer.head, *layer.tail)} | {
        step.lm_head.kernel.function_name}


def test_int8_activations_step(snapshots, kernels):
    """The default step: 4-bit products (q4's nl4) multiply int8-quantized inputs (exact kernels: test_kernels_cl),
    and a q4 model's int8 products too, a q8 model's not. Against the float reference it keeps nearly every greedy
    token of the trained fixture, within int8 rounding of the logits; f32 experts are not affected (x8 launches
    only for quantized weights)."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    ref, dev = models(engine, kernels, int8_activations=True)
    ids = np.array(oracle("tiny-trained")["full_ids"])
    want, got, caches = decode_both(ref, dev, ids[:20], ids[20:80])
    names = launch_names(dev._step)
    # the dense MLP (intermediate 384) takes int8 inputs; the routed experts' 96 rows are no whole 64-blocks; the
    # heads' 32 outputs neither (their codes: a quantize launch after the value product, not mvq);
    # int8 products (indexer, lm_head) too, the experts being 4-bit (nl4: q4's default grid)
    assert {"quantize_x8", "eg_q4nl_x8", "edp_q4nl_x8", "eg_q4nl", "mv_q4nl_x8", "mv_q8_x8", "mv2_q4nl_x8"} <= names
    assert "expert_sum" not in names  # the next norm adds the dense MLP's down rows itself
    q8 = Engine(snapshots("tiny-trained", "q8"), "opencl", load_tokenizer=False).model
    assert q8.decodes_on_device() and not any(n.endswith("_x8") for n in launch_names(q8._decode_step()))
    assert np.abs(got - want).max() > 1e-5 * np.abs(want).max()  # int8 rounding shows
    # and stays small: mean KL divergence here 0.0036 (one position near a tie 0.16; uniform int4 codes: 0.0002;
    # over 2,664 positions, tools/quality_int8_activations.py: 0.0018 and 0.0014)
    assert kl_divergence(log_softmax(want), log_softmax(got)).mean() < 0.01
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.95
    f32 = Engine(snapshots("tiny-bf16", "f32"), "numpy", load_tokenizer=False)
    ref, dev = models(f32, kernels, int8_activations=True)
    ids = np.array(oracle("tiny-bf16")["full_ids"])
    assert_same(*decode_both(ref, dev, ids[:20], ids[20:30])[:2])
    assert ref.backend.numerics != dev.backend.numerics != models(f32, kernels)[1].backend.numerics


def test_experts_across_files(tmp_path, direct_kernels):
    """A layer's experts spread over several data files (GLM-5's layers outgrow a 4 GB file): one fused launch
    pair per file, summed (direct devices: a discrete one uploads them into its own buffers)."""
    snap = convert(FIXTURES / "tiny-trained", tmp_path / "split", "q4", "--max-file-size", "300K")
    assert len(list(snap.glob("model-*.safetensors"))) > 4
    engine = Engine(snap, "numpy", load_tokenizer=False)
    ref, dev = models(engine, in_place(direct_kernels))
    ids = np.array(oracle("tiny-trained")["full_ids"])
    want, got, caches = decode_both(ref, dev, ids[:20], ids[20:50])
    assert isinstance(dev._step, DeviceDecodeStep)
    expert_launches = [sum(1 for launch in layer.tail if launch.kernel.function_name.startswith("eg_"))
                       for layer in dev._step.layers]
    assert max(expert_launches) > 1
    assert_same(want, got)
    assert_same_rows(caches)


def counted_misses(monkeypatch) -> list[bool]:
    """Per MoE layer the step ran over an expert cache, in order: whether its routing left slots for the host to
    place (experts not read when it ran)."""
    seen: list[bool] = []
    place_misses = DeviceDecodeStep._place_misses

    def counted(step: DeviceDecodeStep, layer, slot: int) -> list[int]:
        chunks = place_misses(step, layer, slot)
        seen.append(bool(chunks))
        return chunks

    monkeypatch.setattr(DeviceDecodeStep, "_place_misses", counted)
    return seen


@pytest.mark.parametrize("variant,preset,int8", [("tiny-trained", "q4", True), ("tiny-fp8", "q2", False)])
def test_step_reads_experts_from_cache_slots(snapshots, direct_kernels, monkeypatch, variant, preset, int8):
    """After the same prefill rows, the step over an expert cache's slots (top_k of them: nearly every expert
    misses, each layer waits for its reads) gives the logits of the step on the mapping bit for bit, across the
    indexer's switch to top-k selection, with int8 inputs and with q2's shared expert apart: the experts read
    already run first, the others once read; the cache sees every routed expert once. A short prompt queued on the
    step too."""
    kernels = in_place(direct_kernels)
    engine = Engine(snapshots(variant, preset), "numpy", load_tokenizer=False)
    cfg = engine.config

    def backend() -> OpenCLBackend:
        return OpenCLBackend(kernels, Placement(), int8_activations=int8, model_bytes=engine.container.nbytes)

    mapped = GlmMoeDsaModel(cfg, engine.experts, backend())
    slots = ExpertCache(engine.container, 1 << 30).slot_bytes * cfg.num_experts_per_tok
    cache = ExpertCache(engine.container, slots)
    cached = GlmMoeDsaModel(cfg, cache, backend(), route_hook=cache.on_route, step_experts=cache)
    unplaced = counted_misses(monkeypatch)
    ids = np.array(oracle(variant)["full_ids"])
    topk = cfg.index_topk
    tokens = ids[topk - 3:topk + 5]
    caches = mapped.new_cache(), cached.new_cache()
    mapped.forward(ids[:topk - 3], caches[0])
    for a, b in zip(*(c.layers for c in caches), strict=True):  # the same prefill rows for both
        b.append(**{name: a.rows(name) for name in ("kv_lat", "k_rot", "index_k")[:3 if a.has_index else 2]})
    before = cache.stats.misses + cache.stats.hits
    want, got, _ = decode_both(mapped, cached, None, tokens, caches)
    assert isinstance(cached._step, DeviceDecodeStep) and cached._step.experts is cache
    assert np.array_equal(want, got)
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    # per token and MoE layer: its top_k experts, each once (nothing reported twice through the route hook)
    assert cache.stats.misses + cache.stats.hits - before == len(tokens) * moe_layers * cfg.num_experts_per_tok
    assert cache.stats.misses > cache.stats.hits and cache.stats.evictions > 0
    # per token and MoE layer: the routing placed the experts read already, the host the others, once read
    assert len(unplaced) == len(tokens) * moe_layers and sum(unplaced) > len(unplaced) // 2
    # a short prompt queued on the step (`prefill_on_step`): its logits and hidden rows on the mapping bit for bit
    more = ids[topk + 5:topk + 11]
    queued = [model.prefill_on_step(more, c) for model, c in zip((mapped, cached), caches, strict=True)]
    assert np.array_equal(queued[0][0], queued[1][0]) and np.array_equal(queued[0][1], queued[1][1])
    cache.close()


@pytest.mark.parametrize("chunk_slots", [None, 5])
def test_step_over_resident_experts_places_them_itself(snapshots, direct_kernels, monkeypatch, chunk_slots):
    """Where every routed expert of a layer is already read (a roomy cache after the prompt), the routing kernel
    places them from the cache's place table and their launches run with no host placing: the logits stay those of
    the step on the mapping bit for bit, also where the arena lies in buffers of 5 slots (more buffers than the
    mapping's routing kernel takes: a launch set per buffer over the same slots, summed in slot order). An expert
    the table does not list yet (a read finishing as the routing runs) is placed by the host once read, with the
    same logits; the cache counts every routed expert."""
    kernels = in_place(direct_kernels)
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    cfg = engine.config

    def backend() -> OpenCLBackend:
        return OpenCLBackend(kernels, Placement(), model_bytes=engine.container.nbytes)

    mapped = GlmMoeDsaModel(cfg, engine.experts, backend())  # the mapping in one buffer
    if chunk_slots is not None:  # the arena in buffers of `chunk_slots` slots (a device's largest allocation)
        monkeypatch.setattr(kernels.buffers, "max_alloc", chunk_slots * expert_slot_bytes(engine.container))
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    cache = ExpertCache(engine.container, moe_layers * cfg.n_routed_experts * expert_slot_bytes(engine.container))
    cached = GlmMoeDsaModel(cfg, cache, backend(), route_hook=cache.on_route, step_experts=cache)
    unplaced = counted_misses(monkeypatch)
    ids = np.array(oracle("tiny-trained")["full_ids"])
    want, got, caches = decode_both(mapped, cached, ids[:40], ids[40:52])
    assert isinstance(cached._step, DeviceDecodeStep) and cached._step.experts is cache
    assert (len(cached._step.chunks) > MAX_EXPERT_BUFFERS) == (chunk_slots is not None)
    assert np.array_equal(want, got)
    assert len(unplaced) == 12 * moe_layers and sum(unplaced) <= len(unplaced) // 2  # most layers: all read
    hits = cache.stats.hits
    assert hits >= (len(unplaced) - sum(unplaced)) * cfg.num_experts_per_tok
    # every other expert hidden from the table while the routing runs: the host places those once "read"
    for layer in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):  # every expert read: the table stays
        cache.wait_places(layer, list(range(cfg.n_routed_experts)))
    table, hidden = cache.place_table.copy(), cache.place_table.copy()
    hidden[1::2] = -1
    place_misses = DeviceDecodeStep._place_misses

    def hiding(step: DeviceDecodeStep, layer, slot: int) -> list[int]:
        cache.place_table[:] = table  # the cache's own places back while the host places (nothing is evicted)
        out = place_misses(step, layer, slot)
        cache.place_table[:] = hidden  # for the next layer's routing
        return out

    monkeypatch.setattr(DeviceDecodeStep, "_place_misses", hiding)
    cache.place_table[:] = hidden
    more = ids[52:60]
    want, got, _ = decode_both(mapped, cached, None, more, caches)
    cache.place_table[:] = table
    assert np.array_equal(want, got)
    assert cache.stats.hits - hits == len(more) * moe_layers * cfg.num_experts_per_tok  # all read: none re-read
    cache.close()


@pytest.mark.parametrize("preset,split,grid,kind", [("q4", False, "nl", "q4nl"), ("q4", True, "uniform", "q4"),
                                                    ("q3", False, "nl", "q3")])
def test_int8_input_experts_step(tmp_path, direct_kernels, preset, split, grid, kind):
    """Routed experts that take int8 inputs (the trained fixture padded to 128 rows, tools/quality_int8_activations):
    in one file the next norm adds the slots' down rows itself (no expert_sum); across files each file's slots are
    summed into the FFN output first. Within int8 rounding of the float reference, nearly every greedy token kept; nl4,
    uniform int4 and int3 experts (q3) take the same int8 inputs."""
    padded = pad_experts(FIXTURES / "tiny-trained", tmp_path / "padded")
    snap = convert(padded, tmp_path / preset, preset, "--grid", grid, *(["--max-file-size", "300K"] if split else []))
    engine = Engine(snap, "numpy", load_tokenizer=False)
    ref, dev = models(engine, in_place(direct_kernels), int8_activations=True)
    ids = np.array(oracle("tiny-trained")["full_ids"])
    want, got, _ = decode_both(ref, dev, ids[:20], ids[20:60])
    moe = [[launch.kernel.function_name for launch in layer.tail] for layer in dev._step.layers
           if layer.route is not None]
    # q3's shared expert (int4) runs in a launch pair of its own, after the int3 experts' summed slots
    assert all(f"edp_{kind}_x8" in names and f"eg_{kind}_x8" in names
               and ("expert_sum" in names) == (split or preset == "q3") for names in moe)
    assert kl_divergence(log_softmax(want), log_softmax(got)).mean() < 0.01  # see test_int8_activations_step
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.95


def test_prompt_moe_int8_inputs(tmp_path, direct_kernels, monkeypatch):
    """Where a prompt's products run on the host (a CPU device's measured placement), its routed experts that take int8
    inputs run as the step's fused kernels over (row, expert) slots, a few slots per launch pair: each row's output is
    that row's MoE decoded alone through the same kernels (the sums in another order), not the float host path's;
    every routed expert is released once, after its launches; a prefill over an expert cache of a few slots gives the
    mapping's logits bit for bit."""
    kernels = in_place(direct_kernels)
    padded = pad_experts(FIXTURES / "tiny-trained", tmp_path / "padded")
    engine = Engine(convert(padded, tmp_path / "q4", "q4"), "numpy", load_tokenizer=False)
    cfg = engine.config

    def backend() -> OpenCLBackend:
        return OpenCLBackend(kernels, Placement(matmul="host", vector_prefill="host"), int8_activations=True,
                             model_bytes=engine.container.nbytes)

    dev, calls = backend(), []
    moe = dev.moe
    monkeypatch.setattr(dev, "moe", lambda *args: (calls.append(args), moe(*args))[1])
    ids = np.array(oracle("tiny-trained")["full_ids"])
    model = GlmMoeDsaModel(cfg, engine.experts, dev)
    model.forward(ids[:40], model.new_cache())
    x, route, gates, expert, _, _ = calls[0]
    monkeypatch.setattr(backend_module, "PROMPT_SLOTS", 16)  # several launch pairs per layer
    monkeypatch.setattr(backend_module, "PROMPT_EXPERTS", 3)
    launches, x8 = [], dev.k.experts_x8  # (slots, experts) per launch pair
    monkeypatch.setattr(dev.k, "experts_x8",
                        lambda *args: (launches.append((len(args[4]), len(np.unique(args[3], axis=0)))), x8(*args))[1])
    released: list[int] = []
    got = moe(x, route, gates, expert, None, released.append)
    assert len(launches) >= len(np.unique(route)) / 3 and sum(n for n, _ in launches) == route.size
    assert max(n for n, _ in launches) < 16 + len(x) and max(e for _, e in launches) <= 3
    assert released == sorted(set(route.ravel().tolist()))
    alone = np.concatenate([moe(x[i:i + 1], route[i:i + 1], gates[i:i + 1], expert, None) for i in range(len(x))])
    scale = np.abs(alone).max()
    assert np.abs(got - alone).max() <= 1e-5 * scale
    assert np.abs(dev.host.moe(x, route, gates, expert, None) - alone).max() > 1e-4 * scale  # float inputs differ

    mapped = GlmMoeDsaModel(cfg, engine.experts, backend())
    slots = 2 * cfg.num_experts_per_tok
    cache = ExpertCache(engine.container, slots * expert_cache.expert_slot_bytes(engine.container))
    cached = GlmMoeDsaModel(cfg, cache, backend(), route_hook=cache.on_route, step_experts=cache,
                            ahead_hook=cache.read_ahead, ran_hook=cache.ran)
    want = mapped.forward(ids[:40], mapped.new_cache())[0]
    assert np.array_equal(cached.forward(ids[:40], cached.new_cache())[0], want)
    assert cache.stats.misses > 0
    cache.close()


def test_cache_growth_and_truncation(snapshots, kernels, monkeypatch):
    """The cache arrays (capacity 256) and the step's per-key scratch grow under the kernels; a truncated
    cache continues with other tokens."""
    engine = Engine(snapshots("tiny-bf16", "q4"), "numpy", load_tokenizer=False)
    monkeypatch.setattr(decode_graph, "INITIAL_KEYS", 16)
    ref, dev = models(engine, kernels)
    rng = np.random.default_rng(3)
    vocab = engine.config.vocab_size
    want, got, caches = decode_both(ref, dev, rng.integers(0, vocab, 240), rng.integers(0, vocab, 24))
    assert caches[1].length == 264 and dev._step.capacity >= 264
    assert_same(want, got)
    assert_same_rows(caches)
    for cache in caches:
        cache.truncate(250)
    want, got, caches = decode_both(ref, dev, None, rng.integers(0, vocab, 6), caches)
    assert_same(want, got)
    assert_same_rows(caches)
    # rows rewritten by the host (a truncation, then a multi-token forward, as MTP's verification does): a
    # discrete device's copy of the cache takes them before its next token
    chunk = rng.integers(0, vocab, 3)
    for model, cache in zip((ref, dev), caches, strict=True):
        cache.truncate(252)
        model.forward(chunk, cache)
    want, got, caches = decode_both(ref, dev, None, rng.integers(0, vocab, 4), caches)
    assert_same(want, got)
    assert_same_rows(caches)


def test_failure_inside_a_token_leaves_the_cache_as_it_was(snapshots, kernels, monkeypatch):
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    _, dev = models(engine, kernels)
    cache = dev.new_cache()
    dev.forward(np.arange(5), cache)
    calls = []

    def fail(self):
        calls.append(1)
        if len(calls) == 7:
            raise RuntimeError("device lost")
        return enqueue(self)

    enqueue = Launch.enqueue
    monkeypatch.setattr(Launch, "enqueue", fail)
    with pytest.raises(RuntimeError, match="device lost"):
        dev.forward(np.array([9]), cache)
    assert [layer.length for layer in cache.layers[:-1]] == [5] * engine.config.num_hidden_layers


def test_where_the_step_runs(snapshots, direct_kernels, discrete_kernels):
    """Direct devices and discrete ones whose budget holds the model run the step; a discrete device with a smaller
    budget, an explicit per-operation placement and NumPy decode per operation."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    cfg, weight, size = engine.config, engine.experts.weight, engine.container.nbytes
    layers = engine.model.layers[:cfg.num_hidden_layers]
    assert OpenCLBackend(in_place(direct_kernels), Placement()).decode_step(cfg, layers, weight) is not None
    assert OpenCLBackend(direct_kernels, Placement(decode_step="host")).decode_step(cfg, layers, weight) is None
    discrete = OpenCLBackend(discrete_kernels, Placement(), unified=False, model_bytes=size)
    assert discrete.decode_step(cfg, layers, weight) is not None and discrete.memory.used > 0
    small = OpenCLBackend(discrete_kernels, Placement(), unified=False, model_bytes=size, budget=size // 2)
    assert small.decode_step(cfg, layers, weight) is None and small.memory.used == 0
    assert engine.backend.decode_step(cfg, layers, weight) is None  # NumPy


# ---- a discrete device smaller than the model: the split step ------------------------------------------

@pytest.fixture(scope="module")
def spill_kernels():
    """A CPU device beside the discrete one (the split step's CPU side), its kernels built as `discrete_kernels`'
    are (the same expert kernels on both sides: bit-identical per-slot rows)."""
    info = opencl_test_device()
    if info.kind != "cpu":
        pytest.skip("the split step's CPU side is a CPU OpenCL device")
    return Kernels(info, lanes=8, red_lanes=8, cpu_loads=False)


def discrete_model(engine: Engine, gpu: Kernels, spill: Kernels | None, budget: int | None, int8: bool,
                   usage: ExpertScores | None = None, step_experts: ExpertCache | None = None) -> GlmMoeDsaModel:
    """The model on `gpu` driven as a discrete device with a weight budget of `budget` bytes (None: the device's
    default, which holds the tiny models), routed experts over it on `spill` (uploaded by `usage` scores; the others
    read from `step_experts` where given)."""
    placement = Placement(spill_experts=spill is not None)
    backend = OpenCLBackend(gpu, placement, unified=False, model_bytes=engine.container.nbytes, budget=budget,
                            int8_activations=int8,
                            spill=None if spill is None else OpenCLBackend(spill, Placement.all_cl(True)),
                            expert_usage=usage)
    return GlmMoeDsaModel(engine.config, engine.experts, backend, route_hook=Routes(), step_experts=step_experts)


@pytest.mark.parametrize("int8", [False, True])
def test_split_step_reads_its_cpu_side_from_an_expert_cache(snapshots, discrete_kernels, spill_kernels, int8):
    """A discrete device smaller than the model in RAM smaller than it too: the routed experts the device does not hold
    run on the CPU device from an expert cache of two layers' slots (nearly every one misses), the device's own never
    read into it: the logits and KV rows bit for bit those of the step holding the whole model, and the cache hears
    of every CPU-side expert each decoded token routes to, of no other."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    cfg = engine.config
    whole = discrete_model(engine, discrete_kernels, None, None, int8)
    cache = ExpertCache(engine.container, 2 * cfg.num_experts_per_tok * expert_slot_bytes(engine.container),
                        pin_weights=False)
    assert not whole.backend.decode_step(cfg, whole.layers[:cfg.num_hidden_layers], whole._w, cache).experts
    split = discrete_model(engine, discrete_kernels, spill_kernels, int(engine.container.nbytes * 0.4), int8,
                           step_experts=cache)
    ids = np.array(oracle("tiny-trained")["full_ids"])
    topk = cfg.index_topk
    prompt, tokens = ids[:topk - 3], ids[topk - 3:topk + 5]
    caches = [whole.new_cache()]
    whole.forward(prompt, caches[0])
    caches.append(copy.deepcopy(caches[0]))
    heard = []
    on_route = cache.on_route
    cache.on_route = lambda layer, routed, *rest: heard.append((layer, routed.tolist())) or on_route(layer, routed)
    want, got, _ = decode_both(whole, split, prompt, tokens, caches)
    step = split._step
    assert step.spill is not None and step.experts is cache
    np.testing.assert_array_equal(got, want)
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        for name in ("kv_lat", "k_rot", "index_k") if a.has_index else ("kv_lat", "k_rot"):
            np.testing.assert_array_equal(b.rows(name), a.rows(name))
    gpu = {layer.split.layer: set(np.flatnonzero(layer.split.where >= 0).tolist()) for layer in step.layers
           if layer.split is not None}
    decoded = whole.route_hook.seen  # (layer, routed ids) of each decoded token, as the whole model routed them
    want_heard = [(layer, [e for e in routed if e not in gpu[layer]]) for layer, routed in decoded]
    assert [(layer, sorted(r[0])) for layer, r in heard] == [h for h in want_heard if h[1]]
    assert cache.stats.misses > 0 and cache.stats.evictions > 0
    assert cache.stats.predicted > 0  # read-ahead names the next layer's likely CPU-side experts, from the input
    assert not any(cache.resident(layer, e) for layer, own in gpu.items() for e in own)
    cache.close()


def test_split_step_verifies_drafts_over_an_expert_cache(snapshots, discrete_kernels, spill_kernels):
    """The split step's two-row form over an expert cache of two rows' slots (both rows' CPU-side experts at once,
    nearly every one missing): each draft verified with its next draft in one step, the MTP layer's CPU-side
    experts read into the cache too; MTP on keeps MTP off's greedy tokens."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    cfg = engine.config
    cache = ExpertCache(engine.container, 2 * cfg.num_experts_per_tok * expert_slot_bytes(engine.container),
                        pin_weights=False)
    split = discrete_model(engine, discrete_kernels, spill_kernels, int(engine.container.nbytes * 0.4), True,
                           step_experts=cache)
    prompt = oracle("tiny-trained")["prompt_ids"]
    off = list(Generator(split, (), use_mtp=False).generate(list(prompt), 24, Sampler(SamplingParams())))
    heard = []
    on_route = cache.on_route
    cache.on_route = lambda layer, routed, *rest: heard.append(layer) or on_route(layer, routed)
    gen = Generator(split, (), use_mtp=True)
    assert list(gen.generate(list(prompt), 24, Sampler(SamplingParams()))) == off
    step = split._verify
    assert split.drafts_on_device() and step.rows == 2 and step.spill is not None and step.experts is cache
    assert gen.stats.mtp_acceptance > 0.5
    assert cfg.num_hidden_layers in heard and cache.stats.misses > 0
    cache.close()


def test_split_step_batches_sequences_over_an_expert_cache(snapshots, discrete_kernels, spill_kernels):
    """The split step over 3 sequences, its CPU side reading an expert cache of three rows' slots (nearly every one
    missing): each row's logits bit for bit its sequence decoded alone on the single-row split step."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    cfg, count = engine.config, 3
    cache = ExpertCache(engine.container, count * cfg.num_experts_per_tok * expert_slot_bytes(engine.container),
                        pin_weights=False)
    split = discrete_model(engine, discrete_kernels, spill_kernels, int(engine.container.nbytes * 0.4), True,
                           step_experts=cache)
    ids = oracle("tiny-trained")["full_ids"]
    prompts = [ids[:5], ids[7:20], ids[3:14]]

    def decode(batched: bool) -> list[list[np.ndarray]]:
        caches = [split.new_cache() for _ in prompts]
        rows = [[split.forward(np.array(p), c, last_logits_only=True)[0][-1]] for p, c in zip(prompts, caches,
                                                                                               strict=True)]
        for _ in range(5):
            tokens = [int(r[-1].argmax()) for r in rows]
            if batched:
                out = split.decode_batch(np.array(tokens), caches)[0]
            else:
                out = [split.forward(np.array([t]), c)[0][-1] for t, c in zip(tokens, caches, strict=True)]
            for r, row in zip(rows, out, strict=True):
                r.append(row)
        return rows

    alone = decode(False)
    batched = decode(True)
    step = split.sequences_step(count)
    assert step is not None and step.spill is not None and step.experts is cache
    for a, b in zip(alone, batched, strict=True):
        np.testing.assert_array_equal(np.array(b), np.array(a))
    assert cache.stats.misses > 0
    cache.close()


def test_split_step_reads_ahead_from_its_int8_input(tmp_path, discrete_kernels, spill_kernels, monkeypatch):
    """Where the CPU side's experts take int8 inputs only their codes come to the host: read-ahead's estimate of the
    experts' input (from which it guesses the next layer's routing) is those codes times their block scales, the
    input within int8 rounding (the trained fixture padded to 128 rows, as test_int8_input_experts_step)."""
    padded = pad_experts(FIXTURES / "tiny-trained", tmp_path / "padded")
    engine = Engine(convert(padded, tmp_path / "q4", "q4"), "numpy", load_tokenizer=False)
    cache = ExpertCache(engine.container, 2 * engine.config.num_experts_per_tok * expert_slot_bytes(engine.container),
                        pin_weights=False)
    split = discrete_model(engine, discrete_kernels, spill_kernels, int(engine.container.nbytes * 0.4), True,
                           step_experts=cache)
    seen = []
    estimate = DeviceDecodeStep._split_input_rows

    def compared(step: DeviceDecodeStep) -> np.ndarray:
        rows, u = estimate(step), np.empty(step.u.host.size, np.float32)
        step.buffers.download(u, step.u.buffer).wait()
        seen.append((len(step.split_input), np.abs(rows - u).max() / np.abs(u).max()))
        return rows

    monkeypatch.setattr(DeviceDecodeStep, "_split_input_rows", compared)
    ids = np.array(oracle("tiny-trained")["full_ids"])
    kv = split.new_cache()
    split.forward(ids[:20], kv)
    for token in ids[20:24]:
        split.forward(np.array([token]), kv)
    assert seen and all(n == 3 and 0 < err <= 1 / 127 for n, err in seen)  # codes, scales and sums came over
    assert cache.stats.predicted > 0
    cache.close()


def test_engine_gives_the_split_step_an_expert_cache(snapshots, discrete_kernels, spill_kernels, monkeypatch):
    """The engine on a discrete device smaller than the model, in RAM smaller than the model too: by default (and
    with --expert-cache SIZE) the split step's CPU side reads an expert cache that copies no other weight; greedy
    tokens are NumPy's and `expert_stats` (what --stats-json reports) are the cache's. A discrete device holding the
    whole model refuses --expert-cache."""
    from glmkit.generate import engine as engine_module

    snap = snapshots("tiny-trained", "q4")
    ram = Engine(snap, "numpy", load_tokenizer=False)
    cfg, nbytes = ram.config, ram.container.nbytes

    def discrete(budget: int | None):  # make_backend's stand-in: PoCL driven as a GPU, PoCL's CPU device beside it
        return lambda device, container, int8, usage: (OpenCLBackend(
            discrete_kernels, Placement(spill_experts=True), unified=False, model_bytes=nbytes, budget=budget,
            int8_activations=False, spill=OpenCLBackend(spill_kernels, Placement.all_cl(True)),
            expert_usage=usage), "opencl")

    monkeypatch.setattr(engine_module, "make_backend", discrete(int(nbytes * 0.4)))
    monkeypatch.setattr(engine_module, "outgrows_memory", lambda container, **_: True)
    prompt = oracle("tiny-trained")["prompt_ids"]
    want, _ = greedy_run(ram.model, prompt, 16)
    for size in (None, 3 * cfg.num_experts_per_tok * expert_slot_bytes(ram.container)):
        engine = Engine(snap, "opencl", load_tokenizer=False, expert_cache=size)
        assert engine.step_cache is not None and engine.model._decode_step().experts is engine.step_cache
        assert isinstance(engine.experts, expert_stream.ExpertStreamer)  # the model's weights: the mapping's
        got, _ = greedy_run(engine.model, prompt, 16)
        assert got == want
        assert engine.expert_stats is engine.step_cache.stats and engine.expert_stats.hits + engine.expert_stats.misses
        assert (engine.expert_cache_reason != "") == (size is None)
        engine.close()
    monkeypatch.setattr(engine_module, "make_backend", discrete(None))
    with pytest.raises(GlmkitError, match="holds every weight"):
        Engine(snap, "opencl", load_tokenizer=False, expert_cache=1 << 20)
    assert Engine(snap, "opencl", load_tokenizer=False).step_cache is None


@pytest.mark.parametrize("int8", [False, True])
def test_split_step_matches_the_whole_model_step(snapshots, discrete_kernels, spill_kernels, int8):
    """At 40% of the model most routed experts run on the CPU device: the logits and KV rows are bit for bit those
    of the step holding the whole model (same kernels), across the indexer's switch to top-k selection."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    whole = discrete_model(engine, discrete_kernels, None, None, int8)
    split = discrete_model(engine, discrete_kernels, spill_kernels, int(engine.container.nbytes * 0.4), int8)
    ids = np.array(oracle("tiny-trained")["full_ids"])
    topk = engine.config.index_topk
    prompt, tokens = ids[:topk - 3], ids[topk - 3:topk + 5]
    caches = [whole.new_cache()]
    whole.forward(prompt, caches[0])
    caches.append(copy.deepcopy(caches[0]))  # the same prefilled rows (the split model prefills on the spill device)
    want, got, _ = decode_both(whole, split, prompt, tokens, caches)
    step = split._step
    assert isinstance(step, DeviceDecodeStep) and isinstance(whole._step, DeviceDecodeStep)
    assert whole._step.spill is None and step.spill is not None
    resident = [int((layer.split.where >= 0).sum()) for layer in step.layers if layer.split is not None]
    n_moe = engine.config.num_hidden_layers - engine.config.first_k_dense_replace
    assert len(resident) == n_moe and all(0 < r < engine.config.n_routed_experts // 2 for r in resident)
    assert max(resident) - min(resident) <= 1  # the same share per layer
    np.testing.assert_array_equal(got, want)
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        for name in ("kv_lat", "k_rot", "index_k") if a.has_index else ("kv_lat", "k_rot"):
            np.testing.assert_array_equal(b.rows(name), a.rows(name))
    assert split.route_hook.seen == whole.route_hook.seen


def test_split_step_uploads_the_most_used_experts_and_counts_its_routes(snapshots, discrete_kernels, spill_kernels):
    """Usage scores saved by earlier processes choose the routed experts the device holds: here each layer's highest
    expert ids, which the rank order would upload last. The logits stay bit for bit those of the step holding the
    whole model, and each decoded token counts once for every expert it routed to."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    cfg, n = engine.config, engine.config.n_routed_experts
    usage = ExpertScores(half_life=1e12)  # no aging within the test: a score is a count
    usage.scores.update({(layer, e): 1.0 + e for layer in range(cfg.num_hidden_layers) for e in range(n)})
    saved = dict(usage.scores)
    whole = discrete_model(engine, discrete_kernels, None, None, False)
    split = discrete_model(engine, discrete_kernels, spill_kernels, int(engine.container.nbytes * 0.4), False, usage)
    ids = np.array(oracle("tiny-trained")["full_ids"])
    prompt, tokens = ids[:20], ids[20:28]
    caches = [whole.new_cache()]
    whole.forward(prompt, caches[0])
    caches.append(copy.deepcopy(caches[0]))  # the same prefilled rows (the split model prefills on the spill device)
    want, got, _ = decode_both(whole, split, prompt, tokens, caches)
    np.testing.assert_array_equal(got, want)
    layers = [layer.split for layer in split._step.layers if layer.split is not None]
    resident = [np.flatnonzero(s.where >= 0) for s in layers]
    assert all(0 < len(r) < n // 2 for r in resident) and max(map(len, resident)) - min(map(len, resident)) <= 1
    for r in resident:  # the most used of each layer, with the budget shared alike (the scores are alike)
        np.testing.assert_array_equal(r, np.arange(n - len(r), n))
    decoded = split.route_hook.seen  # (layer, routed ids) of the single-token forwards: the decoded tokens
    assert len(decoded) == len(tokens) * len(layers)
    counts = Counter((layer, e) for layer, routed in decoded for e in routed)
    assert usage.tokens == len(tokens)
    for key, before in saved.items():
        assert usage.score(key) == pytest.approx(before + counts[key], abs=1e-6), key


def test_split_step_greedy_matches_numpy(snapshots, discrete_kernels, spill_kernels, monkeypatch):
    """With float activations the split step's greedy tokens (pipelined, as glm-run decodes) are NumPy's; a budget
    that cannot hold the non-expert weights leaves the per-operation path."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    ref = GlmMoeDsaModel(engine.config, engine.experts, engine.backend)
    split = discrete_model(engine, discrete_kernels, spill_kernels, int(engine.container.nbytes * 0.4), False)
    queued = []
    run_split = DeviceDecodeStep._run_split
    monkeypatch.setattr(DeviceDecodeStep, "_run_split", lambda self, *a: queued.append(1) or run_split(self, *a))
    prompt = oracle("tiny-trained")["prompt_ids"]
    want, _ = greedy_run(ref, prompt, 24)
    got, _ = greedy_run(split, prompt, 24)
    assert got == want and queued
    tight = discrete_model(engine, discrete_kernels, spill_kernels, engine.container.nbytes // 20, False)
    cfg = engine.config
    assert tight.backend.decode_step(cfg, tight.layers[:cfg.num_hidden_layers], tight._w) is None


def test_split_step_over_several_device_buffers(snapshots, discrete_kernels, spill_kernels, monkeypatch):
    """Resident experts in several upload arenas of the device: a launch set per buffer, each masked to its own
    slots, with the CPU device's slots beside them: NumPy's logits (float inputs) and greedy tokens."""
    monkeypatch.setattr(weights, "ARENA_BYTES", 1 << 16)
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    ref = GlmMoeDsaModel(engine.config, engine.experts, engine.backend, route_hook=Routes())
    split = discrete_model(engine, discrete_kernels, spill_kernels, int(engine.container.nbytes * 0.5), False)
    ids = np.array(oracle("tiny-trained")["full_ids"])
    topk = engine.config.index_topk
    want, got, caches = decode_both(ref, split, ids[:topk - 3], ids[topk - 3:topk + 5])
    layers = [layer.split for layer in split._step.layers if layer.split is not None]
    assert max(len(s.sets) for s in layers) > 1 and all((s.where < 0).any() for s in layers)
    assert_same(want, got)
    assert_same_rows(caches)
    assert split.route_hook.seen == ref.route_hook.seen


def test_validate_passes_with_the_step(snapshots, monkeypatch, capsys):
    """glm-validate's greedy run (MTP off) decodes through the step: f32 agrees with transformers on every
    greedy token."""
    calls = []
    enqueue = DeviceDecodeStep._enqueue
    monkeypatch.setattr(DeviceDecodeStep, "_enqueue", lambda self, *a, **k: calls.append(1) or enqueue(self, *a, **k))
    snap = snapshots("tiny-bf16", "f32")
    rc = cli_validate.main([str(snap), str(FIXTURES / "tiny-bf16" / "oracle.json"), "--device", "opencl", "--no-mtp"])
    out = capsys.readouterr().out
    assert rc == 0 and out.rstrip().endswith("PASS")
    # every greedy token after the first is decided by a device forward; pipelined, one more runs ahead; the short
    # prompt's tokens after its first run through the step too (`forward_prompt`), two per forward on the two-row
    # step (an odd one first on the single-row step)
    prompt, full = oracle("tiny-bf16")["prompt_ids"], oracle("tiny-bf16")["full_ids"]
    assert len(prompt) <= STEP_PREFILL_ROWS
    steps = len(prompt) - 1
    assert len(calls) == len(full) - len(prompt) + (steps + steps % 2) // 2


def test_mtp_is_off_by_default_where_verification_is_per_operation(snapshots, monkeypatch, tmp_path):
    """Over an expert cache too small for two token rows' routed experts the step has no two-row form: a draft's
    verification (two tokens, per operation) costs more than two device steps, so MTP defaults off there; over a
    larger cache (and on the mapping: test_mtp_step) the default follows costs measured over the cache, kept apart
    from the mapping's; it stays on without a step, and `--mtp` / `--no-mtp` decide when given."""
    from glmkit.generate import engine as engine_module

    monkeypatch.setenv("GLMKIT_DEVICE_CACHE_DIR", str(tmp_path))  # a profile without these measurements
    snap = snapshots("tiny-trained", "q4")
    ram = Engine(snap, "numpy", load_tokenizer=False)
    k, slot = ram.config.num_experts_per_tok, expert_slot_bytes(ram.container)
    device = Engine(snap, "opencl", load_tokenizer=False, expert_cache=k * slot)
    host = ram
    assert device.model.decodes_on_device() and not device.model.drafts_on_device()
    roomy = Engine(snap, "opencl", load_tokenizer=False, expert_cache=2 * k * slot)
    measured = []
    monkeypatch.setattr(engine_module, "measure_mtp_costs", lambda model: measured.append(model.step_experts) or
                        {"token": 1.0, "cycle": 1.5})
    assert roomy.model.drafts_on_device() and roomy.use_mtp(False, False)
    assert measured == [roomy.experts] and "mtp_ms_expert_cache" in json.dumps(read_profile(roomy.backend.k.info))
    roomy.close()
    assert not host.model.decodes_on_device()
    assert [device.use_mtp(False, False), device.use_mtp(True, False), device.use_mtp(False, True)] == [False, True,
                                                                                                      False]
    assert [host.use_mtp(False, False), host.use_mtp(False, True)] == [True, False]


def test_float_activations_option(snapshots):
    """`--float-activations` (glm-run, glm-serve, glm-validate) reaches the step: float inputs, its own numerics
    (prefill-cache entries of one are never reused by the other)."""
    snap = snapshots("tiny-trained", "q4")
    for cli, rest in ((cli_run, ["-p", "hi"]), (serve_cli, []), (cli_validate, ["oracle.json"])):
        assert cli.build_parser().parse_args([str(snap), *rest, "--float-activations"]).float_activations
    fast, exact = (Engine(snap, "opencl", load_tokenizer=False, float_activations=f) for f in (False, True))
    assert fast.backend.int8_activations and not exact.backend.int8_activations
    assert fast.backend.numerics != exact.backend.numerics
    names = launch_names(exact.model._decode_step())
    assert "eg_q4nl" in names and not any(n.endswith("_x8") for n in names)


# ---- greedy decoding with the next forward in flight ------------------------------------------------

def greedy_run(model, prompt, n, eos=(), cache=None):
    cache = cache if cache is not None else model.new_cache()
    tokens = list(Generator(model, eos, use_mtp=False).generate(list(prompt), n, Sampler(SamplingParams()), cache))
    return tokens, cache


def test_pipelined_greedy_matches_one_token_at_a_time(snapshots, kernels, monkeypatch):
    """The same tokens as NumPy, the cache left as a one-token-at-a-time loop leaves it (no row for the last
    token), stopping at max_tokens, at an eos id, and when the consumer stops early."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    ref, dev = models(engine, kernels)
    prompt = oracle("tiny-trained")["prompt_ids"]
    started = []
    pipeline = DeviceDecodeStep.pipeline
    monkeypatch.setattr(DeviceDecodeStep, "pipeline", lambda self, *a: started.append(1) or pipeline(self, *a))
    want, ref_cache = greedy_run(ref, prompt, 40)
    got, dev_cache = greedy_run(dev, prompt, 40)
    assert started == [1] and got == want
    assert dev_cache.length == ref_cache.length == len(prompt) + 39
    assert_same_rows((ref_cache, dev_cache))
    assert dev.route_hook.seen == ref.route_hook.seen  # every decoded token's routing, reported once
    eos = (want[12],)
    assert greedy_run(dev, prompt, 40, eos)[0] == greedy_run(ref, prompt, 40, eos)[0] == want[:want.index(eos[0]) + 1]
    cache = dev.new_cache()
    stream = Generator(dev, (), use_mtp=False).generate(list(prompt), 40, Sampler(SamplingParams()), cache)
    assert [next(stream) for _ in range(6)] == want[:6]
    stream.close()  # a consumer that stops early: the forward in flight is finished and its row dropped
    assert cache.length == len(prompt) + 5


def test_pipelined_greedy_over_the_expert_cache(snapshots, direct_kernels, monkeypatch):
    """Greedy decoding pipelined on the step over an expert cache whose slots hold a fraction of the experts: the
    tokens and cache rows of the pipelined step on the mapping; the cache sees each decoded token's experts once."""
    kernels = in_place(direct_kernels)
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    cfg = engine.config

    def backend() -> OpenCLBackend:
        return OpenCLBackend(kernels, Placement(), model_bytes=engine.container.nbytes)

    prompt = oracle("tiny-trained")["prompt_ids"]
    slots = 24  # of 3 MoE layers x 16 experts; each layer's experts for the prompt fit: prefill bounces none
    cache = ExpertCache(engine.container, slots * ExpertCache(engine.container, 1 << 30).slot_bytes)
    mapped = GlmMoeDsaModel(cfg, engine.experts, backend())
    cached = GlmMoeDsaModel(cfg, cache, backend(), route_hook=cache.on_route, step_experts=cache)
    started = []
    pipeline = DeviceDecodeStep.pipeline
    monkeypatch.setattr(DeviceDecodeStep, "pipeline", lambda self, *a: started.append(1) or pipeline(self, *a))
    want, ref_cache = greedy_run(mapped, prompt, 30)
    routed = cache.stats.hits + cache.stats.misses
    got, dev_cache = greedy_run(cached, prompt, 30)
    assert started == [1, 1] and got == want
    assert_same_rows((ref_cache, dev_cache))
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    decoded = cache.stats.hits + cache.stats.misses - routed - moe_layers * len(set(np.ravel(prompt)))
    assert cache.stats.bounced == 0 and cache.stats.evictions > 0
    # 29 decoded forwards and the one in flight when the consumer stopped, top_k experts per MoE layer each
    assert cache.stats.misses > 0 and decoded <= 30 * moe_layers * cfg.num_experts_per_tok
    cache.close()


def test_pipelined_greedy_across_cache_growth(snapshots, kernels):
    """The cache arrays (capacity 256) grow while a forward is in flight: its rows reach the grown arrays (and a
    discrete device's copy of them) like every other row."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    ref, dev = models(engine, kernels)
    prompt = np.random.default_rng(5).integers(0, engine.config.vocab_size, 250).tolist()
    want, ref_cache = greedy_run(ref, prompt, 16)
    got, dev_cache = greedy_run(dev, prompt, 16)
    assert got == want and dev_cache.length == 265
    assert_same_rows((ref_cache, dev_cache))


def test_interleaved_pipelines_and_forwards(snapshots, kernels):
    """Two sequences decoded in turns on one step (as glm-serve's scheduler does), with plain forwards of a third
    in between: each pipeline lets the other finish its forward in flight first."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    ref, dev = models(engine, kernels)
    ids = oracle("tiny-trained")["full_ids"]
    prompts = [ids[:20], ids[5:40]]
    want = [greedy_run(ref, p, 25)[0] for p in prompts]
    streams = [Generator(dev, (), use_mtp=False).generate(list(p), 25, Sampler(SamplingParams())) for p in prompts]
    other = dev.new_cache()
    dev.forward(np.array(ids[:8]), other)
    got: list[list[int]] = [[], []]
    for i in range(25):
        for s, stream in enumerate(streams):
            got[s].append(next(stream))
        if i % 7 == 3:
            dev.forward(np.array([ids[8 + i]]), other)  # a third sequence's token between them
    assert got == want


def test_pipelined_greedy_stops_at_the_context_limit(tmp_path, kernels):
    """With the next forward in flight, the context limit still stops where one token at a time stops (the
    in-flight row is not counted), and the cache ends the same."""
    prompt = oracle("tiny-trained")["prompt_ids"]
    limit = len(prompt) + 9
    source = copy_with_config("tiny-trained", tmp_path / "src", max_position_embeddings=limit)
    engine = Engine(convert(source, tmp_path / "snap", "q4"), "numpy", load_tokenizer=False)
    ref, dev = models(engine, kernels)
    runs = []
    for model in (ref, dev):
        generator, cache = Generator(model, (), use_mtp=False), model.new_cache()
        tokens = list(generator.generate(list(prompt), 40, Sampler(SamplingParams()), cache))
        runs.append((tokens, generator.stats.stop_reason, cache.length))
    assert runs[1] == runs[0]
    assert runs[0][1] == "context" and runs[0][2] == limit - 1


def test_routes_watched_as_they_happen(snapshots, direct_kernels, monkeypatch):
    """A step route hook sees every MoE layer's experts of every token as the device routes them (from the
    runtime's callback threads), the same experts the route hook is told of after the token; the engine sets it
    only for a model larger than the memory it may use (its experts then come from disk)."""
    snap = snapshots("tiny-trained", "q4")
    engine = Engine(snap, "numpy", load_tokenizer=False)
    seen: list[tuple[int, list[int]]] = []
    dev = GlmMoeDsaModel(engine.config, engine.experts, OpenCLBackend(in_place(direct_kernels), Placement()),
                         route_hook=Routes(),
                         step_route_hook=lambda layer, ids: seen.append((layer, sorted(ids.tolist()))))
    prompt = oracle("tiny-trained")["prompt_ids"]
    greedy_run(dev, prompt, 12)
    moe_layers = engine.config.num_hidden_layers - engine.config.first_k_dense_replace
    for _ in range(500):  # the callbacks may come a little after the last token (12 tokens: no id slot reused)
        if len(seen) == 12 * moe_layers:
            break
        time.sleep(0.01)
    # 11 tokens reported after they ran, and the forward in flight when decoding stopped (its row dropped); the
    # callbacks come from the runtime's threads, not always in order
    assert len(dev.route_hook.seen) == 11 * moe_layers and len(seen) == 12 * moe_layers
    assert not Counter((layer, tuple(ids)) for layer, ids in dev.route_hook.seen) - Counter(
        (layer, tuple(ids)) for layer, ids in seen)
    assert Engine(snap, "opencl", load_tokenizer=False).model.step_route_hook is None  # fits in RAM
    monkeypatch.setattr(expert_stream, "memory_limit_bytes", lambda: 1 << 20)
    monkeypatch.setattr(expert_cache, "memory_limit_bytes", lambda: 1 << 20)
    monkeypatch.setattr(expert_cache, "anonymous_resident_bytes", lambda: 0)  # a process of no size
    # 1 MB holds no expert cache (one layer's experts): the page cache streams them, the step's routing watched
    assert isinstance(Engine(snap, "opencl", load_tokenizer=False).experts, expert_stream.ExpertStreamer)
    watched = Engine(snap, "opencl", load_tokenizer=False, expert_cache=0)
    assert watched.model.step_route_hook == watched.experts.advise_routed
    assert not Engine(snap, "opencl", load_tokenizer=False, expert_cache=0, prefetch=False).model.step_route_hook


def assert_identical_rows(caches) -> None:
    """Every layer's cache rows (the MTP layer's too) bit for bit alike."""
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        assert a.length == b.length
        for name in ("kv_lat", "k_rot", "index_k") if a.has_index else ("kv_lat", "k_rot"):
            assert np.array_equal(a.rows(name), b.rows(name)), name


@pytest.mark.parametrize("mtp", [False, True])
def test_short_prompts_are_prefilled_on_the_step(snapshots, kernels, monkeypatch, mtp):
    """A prompt of at most `step_prefill` tokens runs one token per decode step (the first of an empty cache as a
    one-row forward), the steps queued back to back and only the last one's lm_head run; a longer one as one batched
    forward. The same greedy tokens as NumPy with and without MTP (whose catch-up takes the step's hidden rows), KV
    rows within f32 noise of NumPy's, and the same tokens, the same routes and bit for bit the same cache rows (the
    MTP layer's too) as one step per token waiting for its logits (`queue_prompt=False`)."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    ref, dev = models(engine, kernels)
    prompt = list(oracle("tiny-trained")["prompt_ids"])
    assert len(prompt) > decode_graph.TURNS
    events = []  # "q": a forward queued, "w": the host waits for one
    enqueue, complete = DeviceDecodeStep._enqueue, DeviceDecodeStep.complete
    monkeypatch.setattr(DeviceDecodeStep, "_enqueue", lambda self, *a, **k: events.append("q") or enqueue(self, *a,
                                                                                                          **k))
    monkeypatch.setattr(DeviceDecodeStep, "complete", lambda self, *a: events.append("w") or complete(self, *a))
    pairs = dev._verify_step()  # direct devices: the two-row step, two prompt tokens per forward
    heads = []  # lm_head launches of either step
    for step in {dev._decode_step(), pairs} - {None}:
        step.lm_head.enqueue = (lambda enqueue: lambda: heads.append(1) or enqueue())(step.lm_head.enqueue)
    want_cache, got_cache = ref.new_cache(), dev.new_cache()
    want = list(Generator(ref, (), use_mtp=mtp).generate(prompt, 12, Sampler(SamplingParams()), want_cache))
    stream = Generator(dev, (), use_mtp=mtp, step_prefill=len(prompt)).generate(prompt, 12, Sampler(SamplingParams()),
                                                                                got_cache)
    got = [next(stream)]
    # the prompt's first token: a one-row forward of an empty cache; the rest queued TURNS ahead of the host's waits
    # (in pairs where the two-row step runs, an odd one first)
    turns, steps = decode_graph.TURNS, len(prompt) - 1
    odd = steps % 2 if pairs is not None else steps

    def queued(n: int) -> list[str]:
        return ["q"] * min(n, turns) + ["w", "q"] * max(n - turns, 0) + ["w"] * min(n, turns)

    forwards = queued(odd) + queued((steps - odd) // 2)
    assert events[:len(forwards)] == forwards
    assert len(heads) == 1  # the lm_head of the prompt's last forward only
    assert got + list(stream) == want
    assert_same_rows((want_cache, got_cache))
    routes = dev.route_hook.rows.copy()
    dev.route_hook.rows.clear()
    one_cache = dev.new_cache()
    generator = Generator(dev, (), use_mtp=mtp, step_prefill=len(prompt), queue_prompt=False)
    events.clear()
    heads.clear()
    stream = generator.generate(prompt, 12, Sampler(SamplingParams()), one_cache)
    one = [next(stream)]
    assert events[:steps + steps] == ["q", "w"] * steps and len(heads) == steps  # each forward waited for
    assert one + list(stream) == want and dev.route_hook.rows == routes
    assert_identical_rows((one_cache, got_cache))
    events.clear()
    list(Generator(dev, (), use_mtp=mtp, step_prefill=len(prompt) - 1).generate(prompt, 1, Sampler(SamplingParams())))
    assert events == []  # one token past the limit: one batched forward


def test_queued_prompt_matches_one_step_per_token(snapshots, kernels, monkeypatch):
    """`prefill_on_step` queued gives bit for bit the logits, the hidden rows and the cache rows of one step per
    token waiting for its logits (`queued=False`; as where the step cannot look embeddings up: `prompt` refuses):
    after a batched prefix, across the growth of the cache arrays (capacity 256) and of the step's per-key scratch
    with forwards in flight, and from an empty cache. A failure with forwards in flight leaves the cache
    as it was before the prompt, and nothing they staged is stored later (a discrete device)."""
    engine = Engine(snapshots("tiny-bf16", "q4"), "numpy", load_tokenizer=False)
    monkeypatch.setattr(decode_graph, "INITIAL_KEYS", 16)
    _, dev = models(engine, kernels)
    rng = np.random.default_rng(5)
    vocab = engine.config.vocab_size
    cases = [(rng.integers(0, vocab, 240), rng.integers(0, vocab, 30)), ((), rng.integers(0, vocab, 40))]
    queued = [[] for _ in cases]
    for case, (prefix, ids) in enumerate(cases):
        with monkeypatch.context() as patch:
            for mode in ("queued", "one"):
                if mode == "one" and case:
                    patch.setattr(DeviceDecodeStep, "prompt", lambda self, cache, token_ids, logits=True: None)
                cache = dev.new_cache()
                if len(prefix):
                    dev.forward(np.asarray(prefix), cache)
                logits, hidden = dev.prefill_on_step(np.asarray(ids), cache, queued=mode == "queued" or case > 0)
                queued[case].append((logits, hidden, cache))
    for (logits, hidden, cache), (want_logits, want_hidden, want_cache) in queued:
        assert np.array_equal(logits, want_logits) and np.array_equal(hidden, want_hidden)
        assert cache.length == want_cache.length
        assert_identical_rows((want_cache, cache))
    assert queued[0][0][2].length == 270 and hidden.shape == (40, engine.config.hidden_size)
    _, dev = models(engine, kernels)  # a new step: its scratch holds 16 keys
    cache = dev.new_cache()
    dev.forward(np.arange(5), cache)
    enqueue, calls = DeviceDecodeStep._enqueue, []

    def fail(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return enqueue(self, *a, **k)

    monkeypatch.setattr(DeviceDecodeStep, "_enqueue", fail)
    with pytest.raises(RuntimeError, match="device lost"):
        dev.prefill_on_step(np.arange(6, 12), cache)
    assert [layer.length for layer in cache.layers[:-1]] == [5] * engine.config.num_hidden_layers
    monkeypatch.setattr(DeviceDecodeStep, "_enqueue", enqueue)
    clean = dev.new_cache()
    dev.forward(np.arange(5), clean)
    for c in (cache, clean):  # past the scratch's growth (16 keys), where every turn's staged rows are stored
        for token in range(20, 32):
            dev.forward(np.array([token]), c)
    assert_identical_rows((clean, cache))
