"""MTP on the device decode step (glmkit.backends.opencl.decode_graph): the verification of [token, draft] as one
queue of two token rows, and the MTP head's next draft in the same queue.

Checked against the single-token step fed the same tokens (the same kernels: bit for bit), against the MTP head run
operation by operation, and through `Generator`: greedy and sampled tokens with MTP on equal those with MTP off."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from glmkit.backends.opencl.backend import OpenCLBackend, Placement
from glmkit.backends.opencl.decode_graph import DeviceDecodeStep
from glmkit.backends.opencl.ops import Kernels
from glmkit.generate.engine import Engine, measure_batch_costs, measure_mtp_costs
from glmkit.generate.generator import Generator
from glmkit.generate.sampling import Sampler, SamplingParams
from glmkit.model.expert_cache import ExpertCache, expert_slot_bytes
from glmkit.model.glm5 import GlmMoeDsaModel
from tests.runtime_support import Snapshots, opencl_test_device, oracle


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    return Snapshots(tmp_path_factory)


@pytest.fixture(scope="module")
def direct_kernels():
    """The test device as it is (PoCL's CPU device by default: direct, its buffers are host memory)."""
    return Kernels(opencl_test_device())


@pytest.fixture(scope="module")
def discrete_kernels():
    """The test device driven as a discrete GPU is (device buffers and copies, the GPU build of the kernels)."""
    return Kernels(opencl_test_device(), lanes=8, red_lanes=8, direct=False, cpu_loads=False)


@pytest.fixture(scope="module")
def spill_kernels():
    """Another context on the test device: the CPU OpenCL device beside a discrete one in the split step."""
    info = opencl_test_device()
    if info.kind != "cpu":
        pytest.skip("the split step's CPU side is a CPU OpenCL device")
    return Kernels(info, lanes=8, red_lanes=8, cpu_loads=False)


@pytest.fixture(params=["direct", "discrete"])
def kernels(request):
    """Each test that takes `kernels` runs on both kinds of device."""
    return request.getfixturevalue(f"{request.param}_kernels")


@pytest.fixture(params=["direct", "discrete", "split"])
def on_each_step(request) -> Callable[..., GlmMoeDsaModel]:
    """Each test that takes it builds its model (`device_model`'s arguments but the kernels) on each kind of decode
    step: the direct device, it driven as a discrete GPU holding the model, and the split step (that GPU holding 40%
    of the container, the routed experts over it run on the CPU device beside)."""
    kernels = request.getfixturevalue("direct_kernels" if request.param == "direct" else "discrete_kernels")
    spill = request.getfixturevalue("spill_kernels") if request.param == "split" else None
    return lambda engine, *args, **kwargs: device_model(engine, kernels, *args, spill=spill, **kwargs)


def device_model(engine: Engine, kernels: Kernels, int8_activations: bool = True, kv_dtype: str = "f32",
                 spill: Kernels | None = None) -> GlmMoeDsaModel:
    """The engine's model on an OpenCL backend over `kernels` (the decode step and its two-row form), KV rows at
    kv_dtype; with `spill` (a CPU device) the split step: a discrete device holding 40% of the container."""
    if spill is None:
        backend = OpenCLBackend(kernels, Placement(), int8_activations=int8_activations,
                                unified=None if kernels.direct else False, model_bytes=engine.container.nbytes)
    else:
        backend = OpenCLBackend(kernels, Placement(spill_experts=True), int8_activations=int8_activations,
                                unified=False, model_bytes=engine.container.nbytes,
                                budget=int(engine.container.nbytes * 0.4),
                                spill=OpenCLBackend(spill, Placement.all_cl(True), int8_activations=int8_activations))
    return GlmMoeDsaModel(engine.config, engine.experts, backend, kv_dtype=kv_dtype)


def copy_rows(cache, into) -> None:
    """Make `into` hold `cache`'s rows (a prefill done once, for two comparisons)."""
    for a, b in zip(cache.layers, into.layers, strict=True):
        b.truncate(0)
        if a.length:
            b.append(**{name: a.rows(name) for name in ("kv_lat", "k_rot", "index_k")[:3 if a.has_index else 2]})


@pytest.mark.parametrize("variant,preset,int8,kv_dtype", [("tiny-trained", "q4", True, "f32"),
                                                          ("tiny-bf16", "f32", False, "f32"),
                                                          ("tiny-fp8", "q2", True, "f32"),
                                                          ("tiny-trained", "q4", True, "fp8")])
def test_two_rows_equal_two_single_steps(snapshots, on_each_step, variant, preset, int8, kv_dtype):
    """The two-row step's logits, hidden states and KV rows are the single-token step's for the same two tokens,
    bit for bit: while every key is attended, where the first row has index_topk keys and the second one more
    (the causal mask of the selection), and with the indexer selecting for both rows; q2's shared expert runs apart
    (int4 beside int2 experts); KV rows at fp8 (each row's codes and scale). On a discrete device each row's KV rows
    come back to the host cache with the forward; on the split step the CPU side runs each row's experts over the
    budget."""
    engine = Engine(snapshots(variant, preset), "numpy", load_tokenizer=False)
    dev = on_each_step(engine, int8, kv_dtype)
    ids = np.array(oracle(variant)["full_ids"])
    topk = engine.config.index_topk
    for start in (3, topk - 1, topk, topk + 5):
        single, double = dev.new_cache(), dev.new_cache()
        dev.forward(ids[:start], single)
        if kv_dtype == "f32":
            copy_rows(single, double)
        else:  # the same prefill again (copy_rows would round the rows twice)
            dev.forward(ids[:start], double)
        want = [dev.forward(ids[start + r:start + r + 1], single) for r in range(2)]
        logits, hidden = dev.forward(ids[start:start + 2], double)
        assert isinstance(dev._verify, DeviceDecodeStep) and dev._verify.rows == 2
        assert np.array_equal(logits, np.concatenate([w[0] for w in want]))
        assert np.array_equal(hidden, np.concatenate([w[1] for w in want]))
        for a, b in zip(single.layers, double.layers, strict=True):
            assert a.length == b.length
            for name in ("kv_lat", "k_rot", "index_k") if a.has_index else ("kv_lat", "k_rot"):
                assert np.array_equal(a.rows(name), b.rows(name))
                assert np.array_equal(a.storage(name)[:a.length], b.storage(name)[:b.length])


def test_draft_in_the_queue_is_the_mtp_head(snapshots, on_each_step):
    """The MTP head in the verification's queue (each row's greedy token, then the MTP layer) gives the MTP
    head's logits run operation by operation on the same rows (float inputs: f32 noise), its greedy drafts, and the
    MTP layer's cache rows; `redraft` from host tokens gives the same, after another sequence's verification."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    dev = on_each_step(engine, int8_activations=False)
    cfg = engine.config
    ids = np.array(oracle("tiny-trained")["full_ids"])
    start = cfg.index_topk + 4  # both the main and the MTP layer select keys
    fused, ref = dev.new_cache(), dev.new_cache()
    _, hidden = dev.forward(ids[:start], fused)
    dev.mtp_forward(hidden, ids[1:start + 1], fused)
    copy_rows(fused, ref)
    logits, hidden, (chosen, drafts) = dev.verify_draft(ids[start:start + 2], fused, greedy=True)  # builds the steps
    assert dev.drafts_on_device()
    assert chosen.tolist() == logits.argmax(-1).tolist()
    dev.forward(ids[start:start + 2], ref)
    want, _ = dev.mtp_forward(hidden, chosen, ref)  # operation by operation (no step runs the MTP layer)
    step = dev._verify
    copied = step.buffers.to_host(step.draft_logits)  # a discrete device's copy: the step reads back the drafts only
    if copied is not None:
        copied.wait()
    got = step.draft_logits.host.reshape(2, -1)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert drafts.tolist() == want.argmax(-1).tolist()
    mtp_fused, mtp_ref = fused.layer(cfg.num_hidden_layers), ref.layer(cfg.num_hidden_layers)
    assert mtp_fused.length == mtp_ref.length == start + 2
    for name in ("kv_lat", "k_rot", "index_k"):
        np.testing.assert_allclose(mtp_fused.rows(name), mtp_ref.rows(name), rtol=1e-4, atol=1e-5)
    drafted_rows = {name: mtp_fused.rows(name).copy() for name in ("kv_lat", "k_rot", "index_k")}
    mtp_fused.truncate(start)
    for name in drafted_rows:  # what the redraft must write again
        mtp_fused.storage(name)[start:start + 2] = 0
    other = dev.new_cache()  # another sequence's verification in between (glm-serve interleaves requests)
    dev.forward(ids[:9], other)
    dev.verify_draft(ids[9:11], other, greedy=False)
    assert dev.redraft(chosen.tolist(), hidden, fused).tolist() == drafts.tolist()
    assert mtp_fused.length == start + 2
    for name, rows in drafted_rows.items():  # the MTP layer's rows as the queue's own draft wrote them
        assert np.array_equal(mtp_fused.rows(name), rows)


def generate(model: GlmMoeDsaModel, prompt: list[int], use_mtp: bool, params: SamplingParams, n: int = 40
             ) -> tuple[list[int], Generator]:
    gen = Generator(model, (), use_mtp=use_mtp)
    return list(gen.generate(prompt, n, Sampler(params))), gen


@pytest.mark.parametrize("variant,preset", [("tiny-trained", "q4"), ("tiny-bf16", "f32")])
def test_mtp_on_the_step_keeps_the_tokens(snapshots, on_each_step, variant, preset, monkeypatch):
    """Greedy and sampled tokens with MTP on (verification and drafts on the device) equal those with MTP off (the
    pipelined single-token step), across index_topk keys; the trained fixture's MTP head is accepted mostly, the
    random one's hardly ever (the rejected drafts' rows dropped)."""
    engine = Engine(snapshots(variant, preset), "numpy", load_tokenizer=False)
    dev = on_each_step(engine)
    prompt = [int(t) for t in oracle(variant)["full_ids"][:engine.config.index_topk - 6]]
    queues = []
    real = DeviceDecodeStep.verify
    monkeypatch.setattr(DeviceDecodeStep, "verify", lambda self, *a: queues.append(a[2]) or real(self, *a))
    greedy = SamplingParams(temperature=0)
    off, _ = generate(dev, prompt, False, greedy)
    on, gen = generate(dev, prompt, True, greedy)
    assert on == off
    assert queues and all(queues) and len(queues) == gen.stats.main_forwards  # fused: draft in the queue
    acceptance = gen.stats.mtp_acceptance
    assert acceptance > 0.5 if variant == "tiny-trained" else acceptance < 0.5
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
    queues.clear()
    on, gen = generate(dev, prompt, True, sampled)
    assert on == generate(dev, prompt, False, sampled)[0]
    assert queues and not any(queues)  # the host chose: the MTP head ran again from its tokens


def cached_model(engine: Engine, kernels: Kernels, slots: int, int8_activations: bool = True
                 ) -> tuple[GlmMoeDsaModel, ExpertCache]:
    """The engine's model on an OpenCL backend over `kernels` whose decode steps read the routed experts from an
    expert cache of `slots` slots (the arena in place: a CPU device)."""
    if not kernels.direct:
        pytest.skip("an expert cache's slots are read in place on direct (CPU) devices only")
    cache = ExpertCache(engine.container, slots * expert_slot_bytes(engine.container))
    backend = OpenCLBackend(kernels, Placement(), int8_activations=int8_activations,
                            model_bytes=engine.container.nbytes)
    return GlmMoeDsaModel(engine.config, cache, backend, route_hook=cache.on_route, step_experts=cache), cache


@pytest.mark.parametrize("variant,preset,chunk_slots", [("tiny-trained", "q4", None), ("tiny-trained", "q4", 5),
                                                        ("tiny-fp8", "q2", None)])
def test_two_rows_over_the_expert_cache(snapshots, direct_kernels, monkeypatch, variant, preset, chunk_slots):
    """The two-row step over an expert cache of two rows' routed experts (nearly every expert misses: each layer
    waits for its reads, the resident ones' launches first) gives the two-row step on the mapping's logits, hidden
    states, KV rows and MTP drafts bit for bit, across the indexer's switch to top-k selection; an expert both rows
    route to is read once; a short prompt two tokens per forward; with q2's shared expert apart; with the arena in
    buffers of 5 slots (each buffer's slots summed apart: float inputs, within float rounding)."""
    engine = Engine(snapshots(variant, preset), "numpy", load_tokenizer=False)
    cfg = engine.config
    if chunk_slots is not None:  # the arena in buffers of `chunk_slots` slots (a device's largest allocation)
        monkeypatch.setattr(direct_kernels.buffers, "max_alloc", chunk_slots * expert_slot_bytes(engine.container))
    int8 = chunk_slots is None
    mapped = device_model(engine, direct_kernels, int8)
    cached, cache = cached_model(engine, direct_kernels, 2 * cfg.num_experts_per_tok, int8)
    ids = np.array(oracle(variant)["full_ids"])
    topk = cfg.index_topk
    for start in (topk - 1, topk + 5):
        caches = mapped.new_cache(), cached.new_cache()
        _, hidden = mapped.forward(ids[:start], caches[0])
        mapped.mtp_forward(hidden, ids[1:start + 1], caches[0])
        copy_rows(caches[0], caches[1])
        reads = cache.stats.reads
        got = [model.verify_draft(ids[start:start + 2], c, greedy=True)
               for model, c in zip((mapped, cached), caches, strict=True)]
        assert cached._verify.experts is cache and cached.drafts_on_device()
        (lw, hw, (cw, dw)), (lg, hg, (cg, dg)) = got
        if int8:
            assert np.array_equal(lw, lg) and np.array_equal(hw, hg)
        else:
            assert np.abs(lw - lg).max() <= 1e-5 * np.abs(lw).max()
        assert cw.tolist() == cg.tolist() and dw.tolist() == dg.tolist()
        for a, b in zip(*(c.layers for c in caches), strict=True):
            assert a.length == b.length
            for name in ("kv_lat", "k_rot", "index_k") if a.has_index else ("kv_lat", "k_rot"):
                np.testing.assert_allclose(a.rows(name), b.rows(name), rtol=0 if int8 else 1e-5,
                                           atol=0 if int8 else 1e-6)
        moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers_with_mtp))
        assert moe_layers < cache.stats.reads - reads <= 2 * moe_layers * cfg.num_experts_per_tok
        # a short prompt's tokens two per forward on the same step (`prefill_on_step`)
        more = ids[start + 2:start + 8]
        (lw, hw), (lg, hg) = (model.prefill_on_step(more, c) for model, c in zip((mapped, cached), caches, strict=True))
        assert (np.array_equal(lw, lg) and np.array_equal(hw, hg)) if int8 else np.allclose(lw, lg, atol=1e-5)
    assert (len(cached._verify.chunks) > 1) == (chunk_slots is not None)
    cache.close()


def test_mtp_over_the_expert_cache_keeps_the_tokens(snapshots, direct_kernels, monkeypatch):
    """Greedy decoding with MTP on over an expert cache (verification and drafts on the two-row step over its slots)
    gives the tokens of MTP off, mostly accepted; a cache too small for two rows' experts has no two-row step (the
    verification then runs operation by operation, the same tokens); the MTP layer's expert reads are counted apart."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    k = engine.config.num_experts_per_tok
    prompt = [int(t) for t in oracle("tiny-trained")["full_ids"][:40]]
    queues = []
    real = DeviceDecodeStep.verify
    monkeypatch.setattr(DeviceDecodeStep, "verify", lambda self, *a: queues.append(a[2]) or real(self, *a))
    greedy = SamplingParams(temperature=0)
    for slots, fused in ((3 * k, True), (k, False)):
        model, cache = cached_model(engine, direct_kernels, slots)
        off, _ = generate(model, prompt, False, greedy, 24)
        assert cache.stats.mtp_bytes_read == 0 < cache.stats.bytes_read
        on, gen = generate(model, prompt, True, greedy, 24)
        assert 0 < cache.stats.mtp_bytes_read < cache.stats.bytes_read
        assert on == off
        assert model.drafts_on_device() is fused and bool(queues) is fused and all(queues)
        assert gen.stats.mtp_acceptance > 0.5
        queues.clear()
        cache.close()


@pytest.mark.parametrize("cycle,on", [(1.6, True), (2.4, False)])
def test_default_mtp_follows_the_measured_costs(snapshots, monkeypatch, tmp_path, cycle, on):
    """`Engine.use_mtp` without --mtp/--no-mtp on the device step: on where a verification with its draft measured
    cheaper than two single tokens (the break-even acceptance cycle / token - 1 below 1), measured once per device
    and model (kept in the device profile: a second engine does not measure again); the flags win."""
    from glmkit.generate import engine as engine_module

    monkeypatch.setenv("GLMKIT_DEVICE_CACHE_DIR", str(tmp_path))  # a profile without this measurement
    calls = []
    monkeypatch.setattr(engine_module, "measure_mtp_costs", lambda model: calls.append(model) or
                        {"token": 1.0, "cycle": cycle})
    snapshot = snapshots("tiny-trained", "q4")
    for _ in range(2):
        engine = Engine(snapshot, "opencl", load_tokenizer=False)
        assert engine.model.drafts_on_device()
        assert engine.use_mtp(False, False) is on
        assert engine.model.mtp_break_even == pytest.approx(cycle - 1)
        assert engine.use_mtp(True, False) and not engine.use_mtp(False, True)
    assert len(calls) == 1 and engine.mtp_costs()["cycle"] == cycle


def test_generation_drops_mtp_below_the_break_even(snapshots, kernels):
    """A generation whose first 16 drafts are accepted less often than the model's break-even goes on without MTP
    (the same tokens); above it MTP stays on."""
    from glmkit.generate.generator import MTP_PROBE_DRAFTS

    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    dev = device_model(engine, kernels)
    prompt = [int(t) for t in oracle("tiny-trained")["full_ids"][:20]]
    greedy = SamplingParams(temperature=0)
    off, _ = generate(dev, prompt, False, greedy)
    dev.mtp_break_even = 1.5  # more than every draft: MTP cannot pay
    on, gen = generate(dev, prompt, True, greedy)
    assert on == off and gen.stats.mtp_drafts == MTP_PROBE_DRAFTS
    dev.mtp_break_even = 0.0
    on, gen = generate(dev, prompt, True, greedy)
    assert on == off and gen.stats.mtp_drafts > MTP_PROBE_DRAFTS


def test_cost_measurements_fit_their_budget(snapshots, kernels, monkeypatch):
    """Where decoding is slow for the time given (a model streaming its experts from disk), the MTP and batch cost
    measurements time one alternation of short runs after their warm-up runs, else `rounds` of full ones; both modes
    are measured either way (MTP on drafts: each mode keeps a cache of its own)."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    dev = device_model(engine, kernels)
    runs, generators, forwards = [], [], []
    generate, decode_batch = Generator.generate, dev.decode_batch
    monkeypatch.setattr(Generator, "generate", lambda self, ids, n, *rest: (
        runs.append((self.use_mtp, n)), generators.append(self))[0] or generate(self, ids, n, *rest))
    monkeypatch.setattr(dev, "decode_batch", lambda ids, caches: forwards.append(len(ids)) or decode_batch(ids, caches))
    mtp = measure_mtp_costs(dev, budget_s=0.0)
    assert runs == [(False, 3), (True, 3), (False, 5), (True, 5)] and mtp["token"] > 0 and mtp["cycle"] > 0
    assert all(g.stats.mtp_drafts > 0 for g in generators if g.use_mtp)  # every MTP run drafted
    runs.clear()
    measure_mtp_costs(dev, budget_s=1e6)
    assert runs[2:] == [(False, 25), (True, 25)] * 5
    batch = measure_batch_costs(dev, budget_s=0.0)
    assert forwards == [1] * 4 + [2] * 4 + [1] * 4 + [2] * 4 and batch["token"] > 0 and batch["batch"] > 0
    forwards.clear()
    measure_batch_costs(dev, budget_s=1e6)
    assert forwards == ([1] * 4 + [2] * 4) * 4
