"""Device selection (`--device`) and the bandwidth-adaptive placement profile.

`--device numpy` is the NumPy reference; `--device opencl[:P:D]` runs every operation as an OpenCL kernel
on platform P, device D (default: the first GPU, else the first device); `--device auto` uses a GPU when
there is one, else the fastest CPU path measured, with each operation placed where it measured faster.

On first use of a device with a model (its shapes and quantization), `measure` times each operation on
both paths with the model's real weights and shapes (decode products, the fused experts, attention,
indexer, norms, prefill products as tiled kernel / kernel dequantization + BLAS / NumPy) and measures
host->device and memory bandwidths. The result is stored as JSON under the device cache directory, keyed
by the device name and driver, so later runs only read it:
`$GLMKIT_DEVICE_CACHE_DIR`, else `devices/` next to `$GLMKIT_CACHE_DIR` (the prefill cache), else
`$XDG_CACHE_HOME/glmkit/devices`, else `~/.cache/glmkit/devices`.
No OpenCL platform (or a device that fails to build the kernels) means NumPy, with a one-line notice when
OpenCL was asked for explicitly; it never stops a run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from glmkit.backends.numpy_backend import NumpyBackend
from glmkit.backends.opencl.backend import (
    OpenCLBackend,
    Placement,
    device_kv_room,
    initial_blas_threads,
    set_blas_threads,
    weight_budget,
)
from glmkit.backends.opencl.device import DeviceInfo, list_devices
from glmkit.backends.opencl.kernels import kernel_version
from glmkit.backends.opencl.ops import Kernels
from glmkit.errors import GlmkitError
from glmkit.format.files import read_json_file, write_private_file
from glmkit.format.schema import tensor_layer
from glmkit.format.tensors import QuantWeight
from glmkit.model.compute import Backend
from glmkit.model.layer_spec import LM_HEAD, MLPSpec, MoESpec, layer_spec

PROFILE_VERSION = 7  # 2: Placement.decode_step; 3: on discrete devices too; 4: Placement.spill_experts;
# 5: Placement.index_prefill; 6: index_prefill measured over INDEX_PREFILL_KEYS keys; 7: the split step
PREFILL_ROWS = 256  # rows of the prefill measurements
# keys of the indexer's prefill measurement: a long prompt's context, where the selection's cost matters (the two
# paths scale differently with it)
INDEX_PREFILL_KEYS = 16384
MARGIN = 0.85  # a kernel path is chosen when it takes at most this fraction of the host path's time
# On CPU devices, a model whose decode step reads less than this stays on NumPy without measuring: every
# operation then takes microseconds, below a kernel launch's latency, and a measurement would only see noise.
AUTO_MIN_DECODE_BYTES = 2 << 20


def device_cache_dir() -> Path:
    if env := os.environ.get("GLMKIT_DEVICE_CACHE_DIR"):
        return Path(env)
    if env := os.environ.get("GLMKIT_CACHE_DIR"):
        return Path(env).parent / "devices"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "glmkit" / "devices"


def notice(message: str) -> None:
    print(f"glmkit: notice: {message}", file=sys.stderr)


# ---- choosing a device ---------------------------------------------------------------------------

def parse_device(spec: str) -> tuple[str, int | None, int | None]:
    """'numpy' | 'cpu' | 'auto' | 'opencl' | 'opencl:P:D' -> (kind, platform, device)."""
    if spec in ("numpy", "cpu"):
        return "numpy", None, None
    if spec == "auto":
        return "auto", None, None
    m = re.fullmatch(r"opencl(?::(\d+):(\d+))?", spec)
    if m is None:
        raise GlmkitError(f"--device: unknown device {spec!r} (numpy, auto, opencl, opencl:PLATFORM:DEVICE)")
    if m.group(1) is None:
        return "opencl", None, None
    return "opencl", int(m.group(1)), int(m.group(2))


def pick(devices: list[DeviceInfo], platform: int | None = None, device: int | None = None) -> DeviceInfo:
    if platform is not None:
        for d in devices:
            if (d.platform_index, d.device_index) == (platform, device):
                return d
        raise GlmkitError(f"--device opencl:{platform}:{device}: no such OpenCL device (see glm-run --list-devices)")
    gpus = [d for d in devices if d.kind == "gpu"]
    if gpus:
        return max(gpus, key=lambda d: d.global_mem)
    return next((d for d in devices if d.kind == "cpu"), devices[0])


def open_backend(spec: str, container: Any = None, int8_activations: bool = True, expert_usage: Any = None
                 ) -> tuple[Backend, str]:
    """The backend for `--device spec` and its name (as `glm-run --stats-json` reports it).

    container: the opened snapshot (auto measures with its weights; its size sets the hybrid budget).
    int8_activations: the device decode step's quantized products take int8-quantized inputs (off: float inputs).
    expert_usage: the routed experts' usage scores (`ExpertScores`) a discrete device smaller than the model uploads
    its routed experts by.
    """
    kind, platform, device = parse_device(spec)
    if kind == "numpy":
        return NumpyBackend(), "numpy"
    devices = list_devices()
    if not devices:
        if kind == "opencl":
            notice(f"--device {spec}: no OpenCL platform found; using numpy")
        return NumpyBackend(), "numpy"
    info = pick(devices, platform, device)
    model_bytes = container.nbytes if container is not None else 0
    if kind == "auto" and container is not None and info.kind == "cpu" \
            and decode_bytes_per_token(container) < AUTO_MIN_DECODE_BYTES:
        return NumpyBackend(), "numpy"  # below the launch-latency floor: nothing to measure
    if kind == "auto" and container is not None:
        cached = cached_placement(info, container)
        if cached is not None and not cached.uses_cl():
            return NumpyBackend(), "numpy"  # the stored placement keeps everything on the host
    try:
        kernels = Kernels(info)
    except Exception as e:  # noqa: BLE001 - a driver that cannot build the kernels must not stop the run
        notice(f"--device {spec}: {info.name} cannot run the kernels ({_one_line(e)}); using numpy")
        return NumpyBackend(), "numpy"
    blas_threads = initial_blas_threads()
    spill = spill_backend(devices, info, model_bytes, container if kind == "auto" else None)
    if kind == "opencl" or container is None:
        placement = Placement.all_cl(kernels.direct)
        placement.spill_experts = spill is not None
        name = info.spec
    else:
        placement = load_or_measure(kernels, container, spill)
        name = f"{info.spec}+auto"
    if not placement.uses_cl():
        if blas_threads:
            set_blas_threads(blas_threads)  # measuring ran the OpenCL backend, which pins BLAS to one thread
        return NumpyBackend(), "numpy"
    backend = OpenCLBackend(kernels, placement, model_bytes=model_bytes, int8_activations=int8_activations,
                            spill=spill, expert_usage=expert_usage)
    return backend, name + (f"+experts@{backend.spill.k.info.spec}" if backend.spill is not None else "")


def spill_backend(devices: list[DeviceInfo], info: DeviceInfo, model_bytes: int, container: Any = None
                  ) -> OpenCLBackend | None:
    """For a discrete device whose weight budget the model outgrows: a backend on the first CPU OpenCL device
    (PoCL), to run the routed experts the device cannot hold in fused kernels over the mapping; else None.
    container (`--device auto`): the CPU device gets its own measured placement (e.g. its prefill products on the
    NumPy worker pool rather than one BLAS thread); else every operation as a kernel."""
    if info.unified or model_bytes <= weight_budget(info.global_mem):
        return None
    cpu = next((d for d in devices if d.kind == "cpu"), None)
    if cpu is None:
        return None
    try:
        kernels = Kernels(cpu)
        placement = Placement.all_cl(True) if container is None else load_or_measure(kernels, container)
        return OpenCLBackend(kernels, placement)
    except Exception as e:  # noqa: BLE001 - experts over the budget then run on the NumPy path
        notice(f"{cpu.name} cannot run the kernels ({_one_line(e)}); routed experts over the weight budget of "
               f"{info.name} run on the NumPy path")
        return None


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


# ---- the profile file ----------------------------------------------------------------------------

def profile_path(info: DeviceInfo) -> Path:
    """Where the device's profile lies; the name carries the profile's version, so that installs of two versions
    (a rollback, a second checkout) keep a profile each instead of measuring again on every switch."""
    digest = hashlib.sha256(info.key.encode()).hexdigest()[:12]
    slug = re.sub(r"[^A-Za-z0-9]+", "-", info.name).strip("-")[:40] or "device"
    return device_cache_dir() / f"{slug}-{digest}-v{PROFILE_VERSION}.json"


MAX_PROFILE_BYTES = 1 << 20  # a device profile is a few KB


def _damaged_profile(path: Path, why: str) -> dict[str, Any]:
    """The empty profile a damaged one counts as: said, and the file removed (a run reads the profile up to three
    times before the new measurement replaces it)."""
    notice(f"device profile {path} is damaged ({why}); removed, measuring again")
    with contextlib.suppress(OSError):  # a read-only cache: said again next time, measured again anyway
        path.unlink()
    return {}


def read_profile(info: DeviceInfo) -> dict[str, Any]:
    """The device's stored profile: {} where there is none or it is another version's or device's, and where it is
    damaged (with a notice): anything `load_or_measure` and `measure_bandwidth` would not write is measured again."""
    path = profile_path(info)
    if not os.path.lexists(path):
        return {}
    try:
        data = read_json_file(path, MAX_PROFILE_BYTES)
    except GlmkitError as e:
        return _damaged_profile(path, str(e).removeprefix(f"{path}: "))
    if isinstance(data, dict) and (data.get("version") != PROFILE_VERSION or data.get("key") != info.key):
        return {}
    why = _profile_fault(data)
    return data if why is None else _damaged_profile(path, why)


def _profile_fault(data: Any) -> str | None:
    """What in a profile has another shape than the measurements write (None: nothing): `bandwidth` holds finite
    floats (host->device: or null), `models` an object per model, each `placement` a valid `Placement`."""
    if not isinstance(data, dict):
        return "not a JSON object"
    if "bandwidth" in data:
        bandwidth = data["bandwidth"]
        if not isinstance(bandwidth, dict):
            return "bandwidth"
        for name in ("host_read_gbs", "device_read_gbs", "host_to_device_gbs"):
            value = bandwidth.get(name)
            if not (isinstance(value, float) and math.isfinite(value)
                    or value is None and name == "host_to_device_gbs"):
                return f"bandwidth.{name}"
    models = data.get("models", {})
    if not isinstance(models, dict) or not all(isinstance(entry, dict) for entry in models.values()):
        return "models"
    for key, entry in models.items():
        if "placement" in entry:
            if not isinstance(entry["placement"], dict):
                return f"models.{key[:20]}.placement"
            try:
                Placement.from_json(entry["placement"])
            except ValueError as e:
                return f"models.{key[:20]}: {e}"
    return None


def write_profile(info: DeviceInfo, data: dict[str, Any]) -> None:
    path = profile_path(info)
    data = {**data, "version": PROFILE_VERSION, "key": info.key}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_private_file(path, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode())
    except OSError as e:  # a read-only cache only costs a new measurement next time
        notice(f"cannot store the device profile in {path.parent} ({e.strerror or e})")


def model_key(container: Any) -> str:
    """The shapes and quantization that the measurements depend on, plus the kernel version."""
    cfg = container.config
    layer = _moe_layer(cfg)
    schemes = []
    for name in _probe_names(cfg, layer):
        if container.has(name):
            e = container.entry(name)
            schemes.append((name.split(".")[-2], list(e.shape), e.quant.bits if e.quant else 32,
                            e.quant.group_size if e.quant else None, e.quant.scheme if e.quant else None))
    dims = [cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim,
            cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.vocab_size]
    text = json.dumps([dims, schemes, kernel_version()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached_placement(info: DeviceInfo, container: Any) -> Placement | None:
    """The placement stored for this device and model (checked by `read_profile`); None where there is none."""
    entry = read_profile(info).get("models", {}).get(model_key(container), {})
    return Placement.from_json(entry["placement"]) if "placement" in entry else None


def load_or_measure(kernels: Kernels, container: Any, spill: OpenCLBackend | None = None) -> Placement:
    """The placement stored for this device and model, measured and stored first if there is none (spill: see
    `measure`)."""
    info = kernels.info
    cached = cached_placement(info, container)
    if cached is not None:
        return cached
    profile = read_profile(info)
    key = model_key(container)
    if sys.stderr.isatty():  # progress for people; logs and captured output stay clean
        print(f"glmkit: measuring {info.name} for this model (once; stored in {device_cache_dir()})", file=sys.stderr)
    if "bandwidth" not in profile:
        profile["bandwidth"] = measure_bandwidth(kernels)
    placement = measure(kernels, container, profile["bandwidth"], spill)
    profile.setdefault("models", {})[key] = {
        "placement": placement.to_json(), "timings_ms": placement.timings,
        "measured": datetime.now(UTC).isoformat(timespec="seconds")}
    profile["device"] = {"name": info.name, "platform": info.platform, "driver": info.driver, "kind": info.kind,
                         "global_mem": info.global_mem, "unified": info.unified}
    write_profile(info, profile)
    return placement


def stored_measurement(info: DeviceInfo, container: Any, name: str, keys: tuple[str, ...],
                       measure_now: Callable[[], dict[str, float]]) -> dict[str, float]:
    """Measurement `name` of this model on this device (finite floats under exactly these `keys`): as stored in the
    device's profile, else `measure_now()`, stored there first (beside the placement, which the same model key
    holds)."""
    profile = read_profile(info)
    entry = profile.setdefault("models", {}).setdefault(model_key(container), {})
    stored = entry.get(name)
    if isinstance(stored, dict) and sorted(stored) == sorted(keys) and \
            all(isinstance(v, float) and math.isfinite(v) for v in stored.values()):
        return stored
    if stored is not None:
        _damaged_profile(profile_path(info), f"measurement {name!r}")
    entry[name] = measure_now()
    write_profile(info, profile)
    return entry[name]


# ---- measurements --------------------------------------------------------------------------------

def timeit(fn: Callable[[], object], budget_s: float = 0.25, min_reps: int = 3, max_reps: int = 50) -> float:
    """Median seconds of one call (after one warm-up call), repeated for about budget_s."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < budget_s and len(times) < max_reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_bandwidth(kernels: Kernels, nbytes: int = 64 << 20) -> dict[str, float]:
    """GB/s: host memory read (NumPy, one thread), device memory read (a kernel streaming a matrix),
    host->device copy (devices that do not share host memory; None where weights are used in place)."""
    host = np.ones(nbytes // 4, np.float32)
    host_read = nbytes / timeit(lambda: host.sum(dtype=np.float64)) / 1e9
    rows = 4096
    matrix = host.reshape(rows, -1)
    backend = OpenCLBackend(kernels, Placement.all_cl(kernels.direct))
    cw = backend._cw(matrix)
    x = np.ones((1, matrix.shape[1]), np.float32)
    device_read = nbytes / timeit(lambda: kernels.matvec(cw, x)) / 1e9
    h2d = None
    if not kernels.info.unified:
        buf = kernels.buffers.device_buffer(nbytes)
        h2d = nbytes / timeit(lambda: kernels.buffers.upload(buf, host).wait()) / 1e9
    return {"host_read_gbs": round(host_read, 2), "device_read_gbs": round(device_read, 2),
            "host_to_device_gbs": None if h2d is None else round(h2d, 2)}


def _moe_layer(cfg) -> int:
    return next((i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)), 0)


def _probe_names(cfg, layer: int) -> list[str]:
    """The products timed, from layer `layer` (a MoE layer where there is one): decode's first four, then the rest
    of the kinds of weights a layer holds."""
    spec = layer_spec(cfg, layer, lambda name: True)
    a, ffn = spec.attention, spec.ffn
    names = [a.kv_a, a.q_a, a.o_proj, LM_HEAD]
    if isinstance(ffn, MoESpec):
        names += [ffn.expert(0).gate, *([] if ffn.shared is None else [ffn.shared.gate])]
    if a.indexer is not None:
        names.append(a.indexer.wq_b)
    first = layer_spec(cfg, 0, lambda name: True).ffn
    return names + ([first.gate] if isinstance(first, MLPSpec) else [])


def measure(kernels: Kernels, container: Any, bandwidth: dict[str, float] | None = None,
            spill: OpenCLBackend | None = None) -> Placement:
    """Time every operation on both paths with the model's real shapes; the faster path wins. spill: a CPU
    OpenCL device's backend (`spill_backend`): its fused experts are timed against the NumPy host path's for the
    experts over a discrete device's budget."""
    cfg = container.config
    rng = np.random.default_rng(0)
    host = OpenCLBackend(kernels, Placement.all_host()).host  # the host path as the backend runs it (its workers)
    cl_backend = OpenCLBackend(kernels, Placement.all_cl(kernels.direct))
    w = container.weight
    layer = _moe_layer(cfg)
    spec = layer_spec(cfg, layer, container.has)
    timings: dict[str, dict[str, float]] = {}

    def both(name: str, run_cl: Callable[[], object], run_host: Callable[[], object], **extra: Callable) -> None:
        timings[name] = {"cl": timeit(run_cl) * 1e3, "host": timeit(run_host) * 1e3}
        for path, fn in extra.items():
            timings[name][path] = timeit(fn) * 1e3

    def faster(name: str) -> str:
        """The fastest path; a kernel path must beat the host by MARGIN (switching changes the numerics)."""
        t = timings[name]
        best = min(t, key=t.get)
        return best if best == "host" or t[best] < MARGIN * t["host"] else "host"

    hidden = cfg.hidden_size
    x1 = rng.standard_normal((1, hidden)).astype(np.float32)
    # Decode products: weights of several sizes and formats. Per format the largest one decides; smaller
    # matrices whose launch costs more than the host's product stay on the host (a byte threshold).
    placement = Placement.all_host()  # what is not measured (or measured slower) stays on the host
    by_bits: dict[int, list[tuple[int, str]]] = {}
    for name in _probe_names(cfg, layer)[:4]:
        if not container.has(name):
            continue
        weight = w(name)
        xin = rng.standard_normal((1, weight.shape[1])).astype(np.float32)
        both("matvec:" + name, lambda weight=weight, xin=xin: cl_backend.linear(xin, weight),
             lambda weight=weight, xin=xin: host.linear(xin, weight))
        bits = weight.bits if isinstance(weight, QuantWeight) else 32
        by_bits.setdefault(bits, []).append((weight.nbytes, faster("matvec:" + name)))
    cl_bits = [b for b, sizes in by_bits.items() if max(sizes)[1] == "cl"]
    if cl_bits:
        placement.matvec = "cl"
        placement.matvec_host_bits = tuple(sorted(b for b in by_bits if b not in cl_bits))
        smallest_cl = min(n for b in cl_bits for n, path in by_bits[b] if path == "cl")
        host_below = [n for b in cl_bits for n, path in by_bits[b] if path == "host" and n < smallest_cl]
        placement.matvec_min_bytes = max(host_below) + 1 if host_below else 0

    # decode MoE: the routed experts of one token plus the shared expert
    k = cfg.num_experts_per_tok
    moe = spec.ffn
    if isinstance(moe, MoESpec) and container.has(moe.expert(0).gate):
        def triple(e: int | MLPSpec):
            return tuple(w(name) for name in (moe.expert(e) if isinstance(e, int) else e).names)

        ids = np.arange(k)[None, :] % cfg.n_routed_experts
        gates = np.full((1, k), 1.0 / k, np.float32)
        shared = triple(moe.shared) if moe.shared is not None and container.has(moe.shared.gate) else None
        both("experts", lambda: cl_backend.moe(x1, ids, gates, triple, shared),
             lambda: host.moe(x1, ids, gates, triple, shared))
        placement.experts = faster("experts")
        if spill is not None:  # timed after `faster`: the spill device is no choice for placement.experts
            timings["experts"]["spill"] = timeit(lambda: spill.moe(x1, ids, gates, triple, shared)) * 1e3
            placement.spill_experts = timings["experts"]["spill"] < MARGIN * timings["experts"]["host"]
    # the device decode step runs the experts, and every other decode operation, as kernels: on devices that
    # share host memory it follows the fused experts (a token's weight bytes are mostly theirs); a discrete device
    # runs it whenever the model fits its weight budget (its per-operation timings above pay transfers it avoids),
    # or its routed experts over the budget run on the spill device (the split step, where the rest fits)
    step = placement.experts == "cl" if kernels.direct else (container.nbytes <= cl_backend.memory.budget
                                                             or placement.spill_experts)
    placement.decode_step = "cl" if step else "host"

    # attention: decode in latent space (one shared key head) over 1,024 keys; prefill with per-head keys
    heads, lat, rope = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    n_keys = 1024
    q = rng.standard_normal((1, heads, lat + rope)).astype(np.float32)
    keys = rng.standard_normal((n_keys, 1, lat + rope)).astype(np.float32)
    allowed = np.ones((1, n_keys), bool)
    both("attention", lambda: cl_backend.attention(q, keys, keys[..., :lat], allowed, 0.1),
         lambda: host.attention(q, keys, keys[..., :lat], allowed, 0.1))
    placement.attention = faster("attention")
    n = PREFILL_ROWS
    dk = cfg.qk_nope_head_dim + rope
    qp = rng.standard_normal((n, heads, dk)).astype(np.float32)
    kp = rng.standard_normal((n, heads, dk)).astype(np.float32)
    vp = rng.standard_normal((n, heads, cfg.v_head_dim)).astype(np.float32)
    causal = np.tril(np.ones((n, n), bool))
    both("attention_prefill", lambda: cl_backend.attention(qp, kp, vp, causal, 0.1),
         lambda: host.attention(qp, kp, vp, causal, 0.1))
    placement.attention_prefill = faster("attention_prefill")

    if any(container.has(f"model.layers.{i}.self_attn.indexer.wk.weight") for i in range(cfg.num_hidden_layers)):
        ih, ihd = cfg.index_n_heads, cfg.index_head_dim
        top = min(cfg.index_topk, n_keys // 2)
        qi = rng.standard_normal((1, ih, ihd)).astype(np.float32)
        ki = rng.standard_normal((n_keys, ihd)).astype(np.float32)
        wi = rng.standard_normal((1, ih)).astype(np.float32)
        last = np.array([n_keys - 1])  # the query sees every key
        both("index", lambda: cl_backend.index_topk(qi, ki, wi, 0.1, last, top),
             lambda: host.index_topk(qi, ki, wi, 0.1, last, top))
        placement.index = faster("index")
        # a prefill chunk's queries over a long context (the scores are S x T)
        long_keys = INDEX_PREFILL_KEYS
        qs, ks = (rng.standard_normal(shape).astype(np.float32) for shape in ((n, ih, ihd), (long_keys, ihd)))
        ws, ends = rng.standard_normal((n, ih)).astype(np.float32), np.arange(long_keys - n, long_keys)
        both("index_prefill", lambda: cl_backend.index_topk(qs, ks, ws, 0.1, ends, cfg.index_topk),
             lambda: host.index_topk(qs, ks, ws, 0.1, ends, cfg.index_topk))
        placement.index_prefill = faster("index_prefill")

    norm_w = np.ones(hidden, np.float32)
    xs = rng.standard_normal((n, hidden)).astype(np.float32)
    both("vector", lambda: cl_backend.rms_norm(x1, norm_w, 1e-6), lambda: host.rms_norm(x1, norm_w, 1e-6))
    placement.vector = faster("vector")
    both("vector_prefill", lambda: cl_backend.rms_norm(xs, norm_w, 1e-6), lambda: host.rms_norm(xs, norm_w, 1e-6))
    placement.vector_prefill = faster("vector_prefill")

    # prefill products: NumPy (dequantize in blocks + BLAS), kernel dequantization + BLAS, the tiled kernel
    probes = ([moe.expert(0).gate] if isinstance(moe, MoESpec) else []) + [spec.attention.o_proj]
    probe = next((name for name in probes
                  if container.has(name) and isinstance(w(name), QuantWeight)), None)
    if probe is not None:
        weight = w(probe)
        xin = rng.standard_normal((n, weight.shape[1])).astype(np.float32)
        blas = OpenCLBackend(kernels, Placement(matmul="cl+blas"))
        tiled = OpenCLBackend(kernels, Placement(matmul="cl"))
        both("matmul", lambda: tiled.linear(xin, weight), lambda: host.linear(xin, weight),
             **{"cl+blas": lambda: blas.linear(xin, weight)})
        placement.matmul = faster("matmul")
        if not kernels.info.unified and bandwidth and bandwidth.get("host_to_device_gbs"):
            # experts over the VRAM budget: stream them when the upload beats the host's compute (the spill
            # device's where it runs them)
            expert_bytes = 3 * weight.nbytes
            upload_ms = expert_bytes / (bandwidth["host_to_device_gbs"] * 1e9) * 1e3
            expert_ms = timings.get("experts", {})
            host_ms = expert_ms.get("spill" if placement.spill_experts else "host", 0.0) / max(k + 1, 1)
            placement.stream_experts = upload_ms < host_ms
    placement.timings = {name: {p: round(v, 4) for p, v in t.items()} for name, t in timings.items()}
    return placement


# ---- glm-run --list-devices ----------------------------------------------------------------------

def list_devices_report(measure_missing: bool = True) -> str:
    """Platforms, devices, memory and measured bandwidths (measured now for devices never profiled)."""
    devices = list_devices()
    if not devices:
        return "no OpenCL platform found (pyopencl and an ICD such as PoCL are needed); --device auto uses numpy"
    lines = []
    platform = None
    for d in devices:
        if d.platform != platform:
            platform = d.platform
            lines.append(f"platform {d.platform_index}: {d.platform}")
        profile = read_profile(d)
        bw = profile.get("bandwidth")
        if bw is None and measure_missing:
            with contextlib.suppress(Exception):  # a device that cannot build the kernels just shows no numbers
                bw = measure_bandwidth(Kernels(d))
                write_profile(d, {**profile, "bandwidth": bw})
        mem = "host-unified" if d.unified else "discrete"
        lines.append(f"  {d.spec}  {d.kind:4s} {d.name} (driver {d.driver}), {d.global_mem / 2**30:.1f} GiB {mem}, "
                     f"{d.compute_units} compute units, max allocation {d.max_alloc / 2**30:.1f} GiB")
        if bw:
            h2d = bw.get("host_to_device_gbs")
            lines.append(f"      bandwidth GB/s: device read {bw['device_read_gbs']}, host read {bw['host_read_gbs']}, "
                         f"host->device {'in place (no copy)' if h2d is None else h2d}")
        models = profile.get("models", {})
        if models:
            lines.append(f"      placements measured for {len(models)} model shape(s) in {profile_path(d)}")
    chosen = pick(devices)
    lines.append(f"--device auto: {chosen.spec} for the operations measured faster there, numpy for the rest")
    cpu = next((d for d in devices if d.kind == "cpu"), None)
    if not chosen.unified and cpu is not None:
        budget = weight_budget(chosen.global_mem) / 2**30
        lines.append(f"  a model over {budget:.1f} GiB (80% of {chosen.spec}'s memory): the routed experts that do "
                     f"not fit run on {cpu.spec} where measured faster than numpy")
    return "\n".join(lines)


def gpu_kv_room(model_bytes: int) -> tuple[str, int] | None:
    """(spec, bytes) of the memory `--device auto`'s discrete GPU leaves the decode step's copies of the KV rows beside
    a model of `model_bytes` (its weights up to the weight budget: a larger model's routed experts fill the budget), or
    None where auto picks no discrete GPU."""
    found = list_devices()
    chosen = pick(found) if found else None
    if chosen is None or chosen.unified:
        return None
    return chosen.spec, device_kv_room(chosen.global_mem, min(model_bytes, weight_budget(chosen.global_mem)))


def decode_bytes_per_token(container: Any) -> int:
    """Weight bytes one decoded token reads (MTP off): every tensor of the main layers except the routed
    experts, the lm_head, `num_experts_per_tok` routed experts per MoE layer and one embedding row."""
    cfg = container.config
    total = experts = 0
    scales = {e.quant.scales for e in container.manifest.tensors.values() if e.quant}
    for name, e in container.manifest.tensors.items():
        if name in scales or name == "model.embed_tokens.weight":
            continue
        layer = tensor_layer(name)
        if layer is not None and layer >= cfg.num_hidden_layers:
            continue  # the MTP layer
        nbytes = e.nbytes + (container.entry(e.quant.scales).nbytes if e.quant else 0)
        if ".mlp.experts." in name:
            experts += nbytes
        else:
            total += nbytes
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    if moe_layers:
        total += experts * cfg.num_experts_per_tok // cfg.n_routed_experts  # k of each layer's E experts
    if container.has("model.embed_tokens.weight"):
        total += container.entry("model.embed_tokens.weight").nbytes // cfg.vocab_size
    return int(total)
