"""The OpenCL backend end to end (PoCL's CPU device in CI): glm-validate verdicts, the hybrid/discrete memory
path, device selection and its fallbacks, the measured placement profile and `glm-run --list-devices`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from glmkit.backends import devices
from glmkit.backends.numpy_backend import NumpyBackend
from glmkit.backends.opencl import device as opencl_device
from glmkit.backends.opencl.backend import OpenCLBackend, Placement, initial_blas_threads
from glmkit.backends.opencl.device import list_devices
from glmkit.backends.opencl.ops import Kernels
from glmkit.cli import run as cli_run
from glmkit.cli import validate as cli_validate
from glmkit.errors import GlmkitError
from glmkit.format.reader import Container
from glmkit.generate.engine import Engine
from glmkit.model import expert_cache, expert_stream
from glmkit.model.glm5 import GlmMoeDsaModel
from glmkit.model.kv_cache import KV_DTYPES, KVCache, kv_bytes_per_token
from glmkit.units import format_size
from tests.runtime_support import FIXTURES, VARIANTS, Snapshots, convert, opencl_test_device, with_huge_integer


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    return Snapshots(tmp_path_factory)


@pytest.fixture(scope="module")
def device():
    return opencl_test_device()


@pytest.fixture(scope="module")
def kernels(device):
    return Kernels(device)


def with_backend(engine: Engine, backend) -> GlmMoeDsaModel:
    return GlmMoeDsaModel(engine.config, engine.experts, backend, route_hook=engine.experts.on_route)


def logits_of(model: GlmMoeDsaModel, ids: np.ndarray) -> np.ndarray:
    """Prefill of all but the last two ids, then two single-token decode steps (the absorbed MLA path)."""
    cache = model.new_cache()
    out = [model.forward(ids[:-2], cache)[0]]
    for token in ids[-2:]:
        out.append(model.forward(np.array([token]), cache)[0])
    return np.concatenate(out)


# ---- glm-validate: the same verdict on every oracle fixture ----------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_validate_same_verdict_as_numpy(snapshots, variant, capsys):
    snap = snapshots(variant, "f32")
    oracle = FIXTURES / variant / "oracle.json"
    verdicts = {}
    for dev in ("numpy", "opencl"):
        rc = cli_validate.main([str(snap), str(oracle), "--device", dev, "--json"])
        out, err = capsys.readouterr()
        assert err == ""
        result = json.loads(out)
        verdicts[dev] = (rc, result["passed"], result["teacher_forcing"]["match"], result["greedy"]["match"])
        tf = result["teacher_forcing"]
        assert tf["max_abs_logit_diff"] <= 1e-4 * tf["logit_scale"]
    assert verdicts["opencl"] == verdicts["numpy"]
    assert verdicts["numpy"][:2] == (0, True)
    assert Engine(snap, "opencl", load_tokenizer=False).device.startswith("opencl:")


def test_every_operation_as_a_kernel_matches_numpy_quantized(snapshots, kernels):
    """q4 weights (int4 g64 products, int8 head/indexer) through every kernel, prefill and decode."""
    engine = Engine(snapshots("tiny-bf16", "q4"), "numpy", load_tokenizer=False)
    ids = np.array(json.loads((FIXTURES / "tiny-bf16" / "oracle.json").read_text())["full_ids"][:30])
    want = logits_of(engine.model, ids)
    for placement in (Placement.all_cl(kernels.direct), Placement(matmul="cl")):  # dequant + BLAS / tiled kernel
        backend = OpenCLBackend(kernels, placement, int8_activations=False)  # the reference arithmetic
        got = logits_of(with_backend(engine, backend), ids)
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
        # unified memory: every weight used in place from the mapping, no copy (a discrete GPU uploads them)
        assert (backend.memory._own == {}) == kernels.info.unified
        w = engine.experts.weight("model.layers.2.self_attn.q_b_proj.weight")
        assert backend._cw(w) is backend._views_by_id[id(w)][1]  # found by identity, not by address, next time
        assert backend.numerics.startswith("opencl-") and backend.numerics != engine.backend.numerics


def test_prompt_lengths_share_work_groups(snapshots, kernels, monkeypatch):
    """A prompt of a new length launches each per-operation kernel with a work-group size a prompt of another
    length used too (PoCL builds a kernel anew for each work-group size it is given or picks by the global size,
    so a new length would wait for builds); the logits stay NumPy's at lengths that are not multiples of it."""
    engine = Engine(snapshots("tiny-bf16", "q4"), "numpy", load_tokenizer=False)
    ids = np.array(json.loads((FIXTURES / "tiny-bf16" / "oracle.json").read_text())["full_ids"])
    model = with_backend(engine, OpenCLBackend(kernels, Placement.all_cl(kernels.direct), int8_activations=False))
    run, launched = kernels.program.run, set()

    def recorded(queue, name, size, local, **args):  # an open work-group: the driver's pick for this global size
        launched.add((name, local or ("open", size)))
        return run(queue, name, size, local, **args)

    monkeypatch.setattr(kernels.program, "run", recorded)
    kinds = []
    for n in (19, 37):
        launched.clear()
        want = logits_of(engine.model, ids[:n])
        got = logits_of(model, ids[:n])
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
        kinds.append(set(launched))
    assert {"rope", "silu_mul", "index_scores", kernels.topk_kernel(1)[0]} <= {name for name, _ in kinds[0]}
    if kernels.lanes == 1:  # a GPU build leaves these work-groups to the driver, which builds no kernel per size
        assert kinds[0] == kinds[1], kinds[0] ^ kinds[1]


def test_per_operation_int4_experts_take_int8_inputs(snapshots, kernels):
    """Fused int4 experts of decode rows run operation by operation (here three-token forwards: a two-token one, an
    MTP draft's verification, runs as the two-row decode step; the trained fixture's dense MLP is the int4 MLP with
    whole 64-column blocks) take int8 inputs
    unless int8_activations is off: within int8 rounding of the float inputs' logits, the same greedy tokens."""
    engine = Engine(snapshots("tiny-trained", "q4"), "numpy", load_tokenizer=False)
    ids = np.array(json.loads((FIXTURES / "tiny-trained" / "oracle.json").read_text())["full_ids"][:40])
    logits, calls = {}, {}
    for int8 in (False, True):
        backend = OpenCLBackend(kernels, Placement.all_cl(kernels.direct), int8_activations=int8)
        calls[int8] = []
        run = backend.k.experts_x8
        backend.k.experts_x8 = lambda *a, run=run, seen=calls[int8]: (seen.append(1), run(*a))[1]
        model = with_backend(engine, backend)
        cache = model.new_cache()
        model.forward(ids[:30], cache)
        logits[int8] = np.concatenate([model.forward(ids[i:i + 3], cache)[0] for i in range(30, 39, 3)])
        backend.k.experts_x8 = run
    assert calls[True] and not calls[False]
    err = np.abs(logits[True] - logits[False]).max() / np.abs(logits[False]).max()
    assert 1e-6 < err < 5e-2
    assert (logits[True].argmax(-1) == logits[False].argmax(-1)).mean() >= 0.9


def test_discrete_memory_budget_is_hybrid(snapshots, device):
    """A device without host-unified memory: weights uploaded once within the budget, the experts that do
    not fit computed on the host; the result is the same forward pass."""
    engine = Engine(snapshots("tiny-bf16", "q4"), "numpy", load_tokenizer=False)
    ids = np.array(json.loads((FIXTURES / "tiny-bf16" / "oracle.json").read_text())["full_ids"][:24])
    want = logits_of(engine.model, ids)
    k = Kernels(device, direct=False)  # transfers instead of direct host access, as on a discrete GPU
    budget = 60_000
    backend = OpenCLBackend(k, Placement.all_cl(False), budget=budget, unified=False,
                            model_bytes=engine.container.nbytes)
    got = logits_of(with_backend(engine, backend), ids)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert 0 < backend.memory.used <= budget
    refs = list(backend._experts.values())
    assert any(r is None for r in refs) and any(r is not None for r in refs)  # some on the device, some not
    again = OpenCLBackend(k, Placement.all_cl(False), budget=budget, unified=False,
                          model_bytes=engine.container.nbytes)
    assert again.numerics != backend.numerics  # expert placement depends on history: rows stay per process

    # streaming: experts over the budget are uploaded per decode step and run on the device, not the host
    streaming = Placement(matmul="cl", stream_experts=True)
    backend = OpenCLBackend(k, streaming, budget=budget, unified=False, model_bytes=engine.container.nbytes)
    host_mlp = backend.host.expert_mlp
    backend.host.expert_mlp = lambda *a: pytest.fail("a routed expert ran on the host")
    got = logits_of(with_backend(engine, backend), ids)
    backend.host.expert_mlp = host_mlp
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert backend.memory.used <= budget
    same = OpenCLBackend(k, streaming, budget=budget, unified=False, model_bytes=engine.container.nbytes)
    assert same.numerics == backend.numerics  # every expert on the device: the arithmetic is fixed


def routed_expert_ids(engine: Engine) -> set[int]:
    """ids of every routed expert weight object (the container hands out the same objects each time)."""
    cfg, w = engine.config, engine.experts.weight
    return {id(w(f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"))
            for layer in range(cfg.num_hidden_layers) if cfg.is_moe_layer(layer)
            for e in range(cfg.n_routed_experts) for proj in ("gate_proj", "up_proj", "down_proj")}


def test_experts_over_the_budget_spill_to_a_cpu_device(snapshots, device):
    """A discrete device with a CPU OpenCL device beside it (`spill`): the routed experts it cannot hold run in
    fused kernels on the CPU device, prefill and decode, never on the NumPy path; the same forward pass."""
    cpus = [d for d in list_devices() if d.kind == "cpu"]
    if not cpus:
        pytest.skip("no CPU OpenCL device to spill to (GLMKIT_TEST_DEVICE=gpu on a machine without PoCL)")
    engine = Engine(snapshots("tiny-bf16", "q4"), "numpy", load_tokenizer=False)
    ids = np.array(json.loads((FIXTURES / "tiny-bf16" / "oracle.json").read_text())["full_ids"][:24])
    want = logits_of(engine.model, ids)
    cpu = OpenCLBackend(Kernels(cpus[0]), Placement.all_cl(True), int8_activations=False)
    spilled = []
    run_fused = cpu._run_fused
    cpu._run_fused = lambda x, ref, slots: (spilled.append(len(slots)), run_fused(x, ref, slots))[1]
    placement = Placement.all_cl(False)
    placement.spill_experts = True
    budget = 60_000
    backend = OpenCLBackend(Kernels(device, direct=False), placement, budget=budget, unified=False,
                            model_bytes=engine.container.nbytes, spill=cpu)
    experts, host_linear = routed_expert_ids(engine), backend.host.linear
    on_host = []
    backend.host.linear = lambda x, w: (on_host.append(id(w) in experts), host_linear(x, w))[1]
    got = logits_of(with_backend(engine, backend), ids)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert spilled and not any(on_host) and 0 < backend.memory.used <= budget
    assert cpu.k.info.unified and cpu.memory._own == {}  # the spill device reads the experts in place
    without = OpenCLBackend(Kernels(device, direct=False), Placement.all_cl(False), budget=budget, unified=False,
                            model_bytes=engine.container.nbytes, spill=cpu)
    assert without.spill is None  # the placement decides: spill_experts off
    assert without.numerics.split("-")[:-1] == backend.numerics.split("-")[:-1]
    assert without.numerics != backend.numerics


def test_make_backend_spills_when_the_model_outgrows_a_discrete_device(snapshots, device, monkeypatch):
    """`--device opencl` on a discrete GPU whose weight budget the model exceeds runs the experts over it on the
    machine's CPU OpenCL device (named in the device string), in the split step where the rest fits the budget; a
    model that fits does not; `auto` measures the CPU
    device's experts against the NumPy path's. (A GPU here: PoCL's device described as a small discrete one.)"""
    if device.kind != "cpu":
        pytest.skip("needs a CPU OpenCL device to play both parts")
    snap = snapshots("tiny-bf16", "q4")
    engine = Engine(snap, "numpy", load_tokenizer=False)
    nbytes = engine.container.nbytes

    def gpu_of(global_mem: int):
        return dataclasses.replace(device, kind="gpu", unified=False, global_mem=global_mem, name="Small GPU")

    # the fixture's KV rows are a fifth of its weights: more than any GPU it outgrows has left beside them
    monkeypatch.setattr(OpenCLBackend, "kv_room", lambda self: 1 << 30)
    # 80% of it: a fifth of the model (the non-expert weights do not fit), half of it (they do: the split step
    # decodes), or all of it
    for global_mem, spills, split in ((nbytes // 4, True, False), (nbytes * 5 // 8, True, True),
                                      (4 * nbytes, False, False)):
        monkeypatch.setattr(devices, "list_devices", lambda gm=global_mem: [gpu_of(gm), device])
        backend, name = devices.open_backend("opencl", engine.container, int8_activations=False)
        assert (backend.spill is not None) == spills and name.endswith(f"+experts@{device.spec}") == spills
        # beside the spill device BLAS runs one thread: the GPU's own host work gets the worker pool
        assert backend.host.workers == ((initial_blas_threads() or 1) if spills else 1)
        if spills:
            model = with_backend(engine, backend)
            ids = np.array(json.loads((FIXTURES / "tiny-bf16" / "oracle.json").read_text())["full_ids"][:12])
            got, want = logits_of(model, ids), logits_of(engine.model, ids)
            assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
            assert model.decodes_on_device() == split  # else operation by operation: the model outgrows the device
            assert any(ref is not None for ref in backend.spill._experts.values())  # experts ran on the CPU device
    monkeypatch.setattr(devices, "list_devices", lambda: [gpu_of(nbytes), device])
    monkeypatch.setattr(devices, "measure_bandwidth", lambda k: {"device_read_gbs": 1.0, "host_read_gbs": 1.0})
    # auto: the CPU device runs with its own measured placement (stored in its profile, as `--device auto` there)
    timeit = devices.timeit
    monkeypatch.setattr(devices, "timeit", lambda fn, *a, **k: (fn(), 1.0)[1])  # every path ties: host wins
    spill = devices.spill_backend([gpu_of(nbytes), device], gpu_of(nbytes), nbytes, engine.container)
    assert spill.placement == devices.cached_placement(device, engine.container) == Placement.all_host()
    monkeypatch.setattr(devices, "timeit", timeit)
    assert f"the routed experts that do not fit run on {device.spec}" in devices.list_devices_report()
    placement = devices.measure(Kernels(gpu_of(nbytes), lanes=8, red_lanes=8), engine.container,
                                spill=devices.spill_backend([gpu_of(nbytes), device], gpu_of(nbytes), nbytes))
    timed = placement.timings["experts"]
    assert placement.spill_experts == (timed["spill"] < devices.MARGIN * timed["host"])


# ---- device selection and fallbacks ------------------------------------------------------------------

def test_no_platform_means_numpy_with_one_line_notice(snapshots, monkeypatch, capsys):
    snap = snapshots("tiny-bf16", "f32")
    monkeypatch.setattr(opencl_device, "cl", None)  # as if pyopencl (or every ICD) were missing
    assert list_devices() == []
    engine = Engine(snap, "opencl", load_tokenizer=False)
    assert isinstance(engine.backend, NumpyBackend) and engine.device == "numpy"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no OpenCL platform" in err
    engine = Engine(snap, "auto", load_tokenizer=False)
    assert isinstance(engine.backend, NumpyBackend) and capsys.readouterr().err == ""
    assert "no OpenCL platform" in devices.list_devices_report()


def test_platform_query_errors_are_no_platform(monkeypatch):
    class Broken:
        @staticmethod
        def get_platforms():
            raise RuntimeError("clGetPlatformIDs failed: PLATFORM_NOT_FOUND_KHR")

    monkeypatch.setattr(opencl_device, "cl", Broken)
    assert list_devices() == []


def test_cli_falls_back_and_generates(snapshots, monkeypatch, capsys):
    snap = snapshots("tiny-bf16", "f32")
    monkeypatch.setattr(opencl_device, "cl", None)
    assert cli_run.main([str(snap), "-p", "Hello", "--max-tokens", "3", "--device", "opencl:0:0", "--no-cache"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and err.count("\n") == 1 and "using numpy" in err


def test_device_specs(device):
    assert devices.parse_device("opencl:1:2") == ("opencl", 1, 2)
    assert devices.parse_device("cpu") == ("numpy", None, None)
    for bad in ("cuda", "opencl:1", "opencl:a:b"):
        with pytest.raises(GlmkitError):
            devices.parse_device(bad)
    with pytest.raises(GlmkitError, match="no such OpenCL device"):
        devices.pick([device], 7, 7)


def test_kernel_build_failure_is_a_notice(snapshots, monkeypatch, capsys):
    def fail(*args, **kwargs):
        raise RuntimeError("clBuildProgram failed: BUILD_PROGRAM_FAILURE\nlong log")

    monkeypatch.setattr(devices, "Kernels", fail)
    engine = Engine(snapshots("tiny-bf16", "f32"), "opencl", load_tokenizer=False)
    assert isinstance(engine.backend, NumpyBackend)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "BUILD_PROGRAM_FAILURE" in err


# ---- the measured placement --------------------------------------------------------------------------

def test_tiny_models_stay_numpy_without_measuring(snapshots, monkeypatch):
    """The launch-latency floor of CPU devices (a GPU machine's `auto` would pick its GPU, which is measured)."""
    cpus = [d for d in list_devices() if d.kind == "cpu"]
    if not cpus:
        pytest.skip("the rule is for CPU OpenCL devices, and there is none")
    monkeypatch.setattr(devices, "list_devices", lambda: cpus)
    monkeypatch.setattr(devices, "measure", lambda *a, **k: pytest.fail("measured a tiny model"))
    for preset in ("f32", "q4"):
        engine = Engine(snapshots("tiny-bf16", preset), "auto", load_tokenizer=False)
        assert engine.device == "numpy"
        assert devices.decode_bytes_per_token(engine.container) < devices.AUTO_MIN_DECODE_BYTES


def test_auto_measures_once_and_stores_the_profile(snapshots, device, tmp_path, monkeypatch):
    monkeypatch.delenv("GLMKIT_DEVICE_CACHE_DIR")
    monkeypatch.setenv("GLMKIT_CACHE_DIR", str(tmp_path / "prefix"))  # profiles go next to the prefill cache
    monkeypatch.setattr(devices, "AUTO_MIN_DECODE_BYTES", 0)  # measure even this tiny model
    snap = snapshots("tiny-bf16", "q4")
    first = Engine(snap, "auto", load_tokenizer=False)
    files = list((tmp_path / "devices").glob("*.json"))
    assert len(files) == 1
    profile = json.loads(files[0].read_text())
    assert profile["key"] == device.key and profile["device"]["name"] == device.name
    assert profile["bandwidth"]["device_read_gbs"] > 0 and profile["bandwidth"]["host_read_gbs"] > 0
    (entry,) = profile["models"].values()
    assert {"matvec", "matmul", "experts", "attention", "index", "vector"} <= set(entry["placement"])
    assert {"experts", "attention", "vector", "matmul"} <= set(entry["timings_ms"])
    measured = Placement.from_json(entry["placement"])
    assert first.device == ("opencl:0:0+auto" if measured.uses_cl() else "numpy").replace("0:0", device.spec[7:])

    monkeypatch.setattr(devices, "measure", lambda *a, **k: pytest.fail("measured twice"))
    assert Engine(snap, "auto", load_tokenizer=False).device == first.device

    # a stored placement that favours the kernels is used as stored
    entry["placement"] = Placement(matvec="cl", matvec_host_bits=(8,)).to_json()
    files[0].write_text(json.dumps(profile))
    engine = Engine(snap, "auto", load_tokenizer=False)
    assert engine.device.endswith("+auto") and engine.backend.placement.matvec_host_bits == (8,)


@pytest.fixture(scope="module")
def measured_profile(snapshots, tmp_path_factory) -> tuple[Path, Path]:
    """(a snapshot, the device profile `--device auto` measured for it, in a directory of its own)."""
    directory = tmp_path_factory.mktemp("profile")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GLMKIT_DEVICE_CACHE_DIR", str(directory))
        mp.setattr(devices, "AUTO_MIN_DECODE_BYTES", 0)  # measure even this tiny model
        snap = snapshots("tiny-bf16", "q4")
        Engine(snap, "auto", load_tokenizer=False)
    (path,) = directory.glob("*.json")
    return snap, path


def _placements(d: dict, **fields) -> None:
    for entry in d["models"].values():
        entry["placement"].update(fields)


PROFILE_DAMAGE = {
    "models not an object": lambda d: d.update(models=[]),
    "a model's entry not an object": lambda d: d.update(models={key: [] for key in d["models"]}),
    "a placement field of another type": lambda d: _placements(d, matvec="cl", matvec_min_bytes="abc"),
    "a placement flag a number": lambda d: _placements(d, stream_experts=1),
    "bandwidth without its fields": lambda d: d.update(bandwidth={"a": 1}),
    "bandwidth not an object": lambda d: d.update(bandwidth="x"),
    "bandwidth past a float's range": lambda d: d["bandwidth"].update(host_read_gbs=10**400),
}


@pytest.mark.parametrize("case", [*PROFILE_DAMAGE, "an integer past the digit limit"])
def test_a_damaged_profile_is_said_removed_and_measured_again(measured_profile, device, tmp_path, monkeypatch,
                                                              capsys, case):
    """Whatever reads it (a run's `--device auto`, `--list-devices`): one notice, the file removed, the profile
    measured again and stored whole."""
    snap, pristine = measured_profile
    monkeypatch.setenv("GLMKIT_DEVICE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(devices, "AUTO_MIN_DECODE_BYTES", 0)
    path = tmp_path / pristine.name
    for read, stored in ((lambda: Engine(snap, "auto", load_tokenizer=False),
                          lambda: devices.cached_placement(device, Container(snap))),
                         (lambda: cli_run.main(["--list-devices"]), lambda: devices.read_profile(device)["bandwidth"])):
        if case == "an integer past the digit limit":
            path.write_bytes(with_huge_integer(pristine.read_bytes()))
        else:
            profile = json.loads(pristine.read_text())
            PROFILE_DAMAGE[case](profile)
            path.write_text(json.dumps(profile))
        capsys.readouterr()
        read()
        err = capsys.readouterr().err
        assert err.startswith(f"glmkit: notice: device profile {path} is damaged (") and err.count("\n") == 1, err
        assert stored() and capsys.readouterr().err == ""


def test_a_damaged_stored_measurement_is_said_and_measured_again(measured_profile, device, tmp_path, monkeypatch,
                                                                 capsys):
    snap, _ = measured_profile
    monkeypatch.setenv("GLMKIT_DEVICE_CACHE_DIR", str(tmp_path))
    container = Container(snap)
    keys = ("token",)
    assert devices.stored_measurement(device, container, "batch_ms", keys, lambda: {"token": 1.0}) == {"token": 1.0}
    path = devices.profile_path(device)
    path.write_text(path.read_text().replace("1.0", '"slow"'))
    capsys.readouterr()
    assert devices.stored_measurement(device, container, "batch_ms", keys, lambda: {"token": 2.0}) == {"token": 2.0}
    err = capsys.readouterr().err
    assert err.startswith(f"glmkit: notice: device profile {path} is damaged (") and err.count("\n") == 1, err
    assert devices.stored_measurement(device, container, "batch_ms", keys, lambda: {"token": 3.0}) == {"token": 2.0}
    # floats under other keys than its reader's: damaged too, not a KeyError in the reader
    both = {"batch": 4.0, "token": 5.0}
    assert devices.stored_measurement(device, container, "batch_ms", ("batch", "token"), lambda: both) == both
    err = capsys.readouterr().err
    assert err.startswith(f"glmkit: notice: device profile {path} is damaged (") and err.count("\n") == 1, err


def test_measured_placement_runs_the_step_on_discrete_devices(snapshots, device, monkeypatch):
    """A discrete device decodes with the step whenever the model fits its weight budget, even where the
    per-operation timings (which pay transfers the step avoids) favour the host; a direct device follows them."""
    monkeypatch.setattr(devices, "timeit", lambda fn, *a, **k: (fn(), 1.0)[1])  # every path ties: host wins
    container = Engine(snapshots("tiny-bf16", "q4"), "numpy", load_tokenizer=False).container
    discrete = devices.measure(Kernels(device, direct=False), container)
    assert discrete.experts == "host" and discrete.decode_step == "cl"
    if device.kind == "cpu":
        assert devices.measure(Kernels(device), container).decode_step == "host"


def test_list_devices(device, capsys, tmp_path, monkeypatch):
    assert cli_run.main(["--list-devices"]) == 0
    out = capsys.readouterr().out
    assert device.spec in out and device.name in out and "bandwidth GB/s" in out and "GiB" in out
    # with a snapshot: where its routed experts would live, by the RAM the process may use
    snap = str(convert(FIXTURES / "tiny-trained", tmp_path / "q4", "q4"))
    assert cli_run.main([snap, "--list-devices"]) == 0
    out = capsys.readouterr().out
    assert f"{snap}: routed experts in the page cache" in out
    # the context and what a token adds to the KV cache at each precision: the bytes a KVCache grows by for one
    # token (its codes, and f16's and fp8's scales)
    config = Container(snap).config
    per_token = {}
    for dtype in KV_DTYPES:
        cache, per_token[dtype] = KVCache(config, dtype=dtype), 0
        for layer in cache.layers:
            names = ("kv_lat", "k_rot", "index_k")[:3 if layer.has_index else 2]
            layer.append(**{name: np.ones((1, layer.width(name)), np.float32) for name in names})
            per_token[dtype] += sum(layer.storage(name)[:1].nbytes + 4 * (layer.scales(name) is not None)
                                    for name in names)
        assert kv_bytes_per_token(config, dtype) == per_token[dtype]
    assert per_token["f32"] == 2 * per_token["bf16"] > 3 * per_token["fp8"]
    assert per_token["bf16"] < per_token["f16"] < per_token["bf16"] * 1.1
    assert (f"{snap}: context 2,048 tokens; KV cache per token " + ", ".join(
        f"{format_size(n)} ({dtype})" for dtype, n in per_token.items())) in out
    assert "copies of the KV rows" not in out  # no discrete GPU here
    monkeypatch.setattr(expert_stream, "memory_limit_bytes", lambda: 64 << 20)
    monkeypatch.setattr(expert_cache, "memory_limit_bytes", lambda: 64 << 20)
    monkeypatch.setattr(expert_cache, "anonymous_resident_bytes", lambda: 0)  # a process of no size
    assert cli_run.main([snap, "--list-devices"]) == 0
    assert f"{snap}: expert cache " in capsys.readouterr().out
    # a discrete GPU of 1 GB (PoCL's device described as one): the memory its weights leave the decode step's KV
    # copies, as positions at each precision; a model over its budget fills the budget
    nbytes = Container(snap).nbytes
    for global_mem in (1 << 30, nbytes):
        gpu = dataclasses.replace(device, kind="gpu", unified=False, global_mem=global_mem, name="A GPU")
        monkeypatch.setattr(devices, "list_devices", lambda gpu=gpu: [gpu, device])
        assert cli_run.main([snap, "--list-devices"]) == 0
        room = global_mem - min(nbytes, int(global_mem * 0.8)) - int(global_mem * 0.05)
        assert (f"{snap}: on {gpu.spec} the decode step's copies of the KV rows have {format_size(room)} beside the "
                f"weights: {room // per_token['f32']:,} positions at f32, {room // per_token['bf16']:,} positions at "
                f"bf16") in capsys.readouterr().out
    # a limit whose rest holds half the context's KV rows beside two layers' experts: the context glm-run would run
    snapshot = Container(snap)
    pinned = snapshot.nbytes - sum(r.nbytes for r in snapshot.manifest.experts)
    rest = per_token["f32"] * 1024 + 2 * config.num_experts_per_tok * expert_cache.expert_slot_bytes(snapshot)
    limit = (rest + pinned) * 16 // 11 + 16
    monkeypatch.setattr(expert_stream, "memory_limit_bytes", lambda: limit)
    monkeypatch.setattr(expert_cache, "memory_limit_bytes", lambda: limit)
    assert cli_run.main([snap, "--list-devices"]) == 0
    out = capsys.readouterr().out
    assert "; context 1,024 positions of the model's 2,048" in out and f"{snap}: context 1,024 tokens;" in out
    assert cli_run.main([str(tmp_path / "missing"), "--list-devices"]) == 2
