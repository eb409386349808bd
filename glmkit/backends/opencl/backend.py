"""The OpenCL backend: the `Backend` operations as OpenCL kernels (glmkit/backends/opencl/kernels), NumPy where placed.

`Placement` says, per operation, whether it runs as a kernel ("cl") or on the NumPy reference path
("host"); prefill products can also run as "cl+blas" (a kernel dequantizes the weight once per batch and
a BLAS GEMM multiplies). `--device opencl[:P:D]` runs every operation as a kernel (`Placement.all_cl`);
`--device auto` uses the placement measured for the device and the model (glmkit.backends.devices).

Weights never get a second host copy: CPU and unified-memory devices read them in place from the mapping;
discrete GPUs get each weight uploaded once and kept, within a VRAM budget; routed experts that do not fit
are computed on the host (hybrid): in fused kernels on a CPU OpenCL device where one is given (`spill`: PoCL,
weights in place), else on the NumPy path; or they are streamed per use when the profile says the transfer is
cheaper than the host's compute.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
from threadpoolctl import ThreadpoolController

from glmkit.backends.numpy_backend import NumpyBackend
from glmkit.backends.opencl.buffers import address
from glmkit.backends.opencl.decode_graph import DeviceDecodeStep, SpillDevice, Unsupported
from glmkit.backends.opencl.kv_mirrors import KVMirrors
from glmkit.backends.opencl.ops import Kernels
from glmkit.backends.opencl.weights import (
    ClWeight,
    ExpertShape,
    WeightMemory,
    fused_expert_arrays,
    plain_f32,
    x8_eligible,
)
from glmkit.format.config import ModelConfig
from glmkit.format.tensors import QuantWeight, Weight
from glmkit.model.compute import ExpertArena, ExpertFn, moe_layer
from glmkit.model.expert_cache import ExpertScores
from glmkit.model.layer_spec import LayerSpec, MTPSpec
from glmkit.model.ops import position_mask, silu

DECODE_ROWS = 4  # calls with at most this many rows are decode calls (MTP verification has 2)
INDEX_BLOCK = 1 << 22  # indexer scores [rows, T] of one prefill launch
PROMPT_SLOTS = 512  # (row, expert) slots of a prompt's MoE per fused launch pair: bounds its [slots, I] temporaries
PROMPT_EXPERTS = 16  # routed experts per launch pair: the weights an expert cache holds for it at once
ACTIVATION_SHARE = 0.05  # of a discrete device's memory kept from the KV rows' copies: activations, the steps' scratch
PROMPT_HOST_ROWS = 64  # a prompt's expert with this many rows runs on the host: one dequantization, then BLAS, pays


@dataclass
class Placement:
    """Where each operation runs. Decode = at most DECODE_ROWS input rows, prefill = more.

    matvec / matmul: decode / prefill weight products ("cl", "host"; matmul also "cl+blas");
    matvec_min_bytes: decode products over smaller weights stay on the host (the launch costs more);
    matvec_host_bits: weight formats (2, 3, 4, 8, 32 = float) whose decode products stay on the host;
    experts: the decode MoE (all routed experts + the shared one fused into two launches);
    attention / attention_prefill; index / index_prefill: indexer scores + top-k; vector / vector_prefill: norms, RoPE,
    SiLU;
    stream_experts: discrete devices: experts over the VRAM budget are uploaded per use instead of host-computed;
    spill_experts: discrete devices: experts over the VRAM budget run on a CPU OpenCL device (`OpenCLBackend`'s
    spill) instead of the NumPy host path;
    decode_step: "cl" runs a single-token decode as one queue of kernels (backends.opencl.decode_graph): on direct
    devices, and on discrete ones whose weight budget holds the whole model; "host" per operation as above.
    """

    matvec: str = "cl"
    matvec_min_bytes: int = 0
    matvec_host_bits: tuple[int, ...] = ()
    matmul: str = "cl"
    experts: str = "cl"
    attention: str = "cl"
    attention_prefill: str = "cl"
    index: str = "cl"
    index_prefill: str = "cl"
    vector: str = "cl"
    vector_prefill: str = "cl"
    stream_experts: bool = False
    spill_experts: bool = False
    decode_step: str = "cl"
    timings: dict = field(default_factory=dict, compare=False)  # the measurements behind the choice (info only)

    @classmethod
    def all_cl(cls, direct: bool) -> Placement:
        """Every operation as a kernel; prefill products dequantize + BLAS on devices that share host memory."""
        return cls(matmul="cl+blas" if direct else "cl")

    def uses_cl(self) -> bool:
        return "cl" in (self.matvec, self.experts, self.attention, self.attention_prefill, self.index,
                        self.index_prefill, self.vector, self.vector_prefill, self.decode_step) or self.matmul != "host"

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("timings")
        return d

    @classmethod
    def all_host(cls) -> Placement:
        return cls(matvec="host", matmul="host", experts="host", attention="host", attention_prefill="host",
                   index="host", index_prefill="host", vector="host", vector_prefill="host", decode_step="host")

    @classmethod
    def from_json(cls, d: dict) -> Placement:
        """The placement `to_json` gave (unknown keys skipped), also read back from JSON (a list for the tuple);
        ValueError for a field of another type than its default's, as in a damaged profile."""
        defaults = cls()
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        for name, value in known.items():
            want = type(getattr(defaults, name))
            ok = (isinstance(value, list | tuple) and all(type(bits) is int for bits in value)) if want is tuple \
                else type(value) is want  # `type is`: a bool is no int here
            if not ok:
                raise ValueError(f"placement field {name!r} is {str(value)[:40]!r}, not of type {want.__name__}")
        if "matvec_host_bits" in known:
            known["matvec_host_bits"] = tuple(known["matvec_host_bits"])
        return cls(**known)


@dataclass(frozen=True)
class _ExpertRef:
    """One expert's fused-MLP weights in one device buffer: 6 byte offsets (gate, scales, up, scales, down, scales),
    read as `shape` says."""

    buf: object
    offs: tuple[int, int, int, int, int, int]
    shape: ExpertShape

    @property
    def key(self) -> tuple:
        """(id(buf), bits, scheme, group, n_in, inter): experts with equal keys share one launch."""
        s = self.shape
        return id(self.buf), s.bits, s.scheme, s.group, s.n_in, s.inter


class OpenCLBackend:
    """`Backend` on one OpenCL device. `budget`: bytes of weights kept on a discrete device (default
    `weight_budget`); `model_bytes`: the container size (a budget below it makes expert placement per process);
    `spill`: a backend on a CPU OpenCL device that runs the routed experts this device does not hold, in fused
    launches over the mapping (used where `placement.spill_experts`); `expert_usage`: the routed experts' usage
    scores, by which the split step chooses the experts it uploads (and which its decoded tokens' routes count)."""

    def __init__(self, kernels: Kernels, placement: Placement | None = None, budget: int | None = None,
                 model_bytes: int = 0, unified: bool | None = None, int8_activations: bool = True,
                 spill: OpenCLBackend | None = None, expert_usage: ExpertScores | None = None) -> None:
        self.k = kernels
        workers = 1
        if kernels.info.kind == "cpu":
            # OpenBLAS threads spin while they wait for work and take the cores the OpenCL CPU workers need
            # (host GEMMs crawl next to PoCL's workers); host BLAS runs on the calling thread instead, and
            # prefill-sized host work is shared by as many NumPy workers as BLAS had threads
            workers = initial_blas_threads() or 1
            set_blas_threads(1)
        elif spill is not None:  # the spill device pinned BLAS to one thread: this device's host work shares a pool
            workers = initial_blas_threads() or 1
        self.host = NumpyBackend(decode_rows=DECODE_ROWS, workers=workers)
        self.placement = placement or Placement.all_cl(kernels.direct)
        unified = kernels.info.unified if unified is None else unified
        if budget is None:
            budget = 1 << 62 if unified else weight_budget(kernels.info.global_mem)
        self.memory = WeightMemory(kernels.buffers, unified, budget)
        self.spill = spill if self.placement.spill_experts else None
        self.expert_usage = expert_usage  # the split step's: which experts it uploads, and its decoded routes
        # a discrete device's copies of the KV rows, shared by its decode steps, within the memory its weights leave
        self.kv_mirrors = KVMirrors(kernels.buffers, None if unified else self.kv_room, kernels.info.spec)
        self.model_bytes = model_bytes
        self.device = kernels.info.spec
        # int8_activations: the device decode step's quantized products take int8-quantized inputs (DeviceDecodeStep),
        # and so do the fused int4 experts of decode rows run operation by operation (`Kernels.experts_x8`)
        self.int8_activations = int8_activations
        tag = {"device": kernels.info.key, "kernels": kernels.version, "placement": self.placement.to_json(),
               "unified": unified, "host": self.host.numerics, "int8_activations": int8_activations,
               "spill": None if self.spill is None else self.spill.numerics, "prompt_experts": self._prompt_x8()}
        if not unified and budget < model_bytes and not self.placement.stream_experts:
            # which experts end up on the device depends on the order they were first used: the arithmetic of a
            # row is then only reproducible within this process, so its prefill-cache entries stay its own
            tag["process"] = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        digest = hashlib.sha256(json.dumps(tag, sort_keys=True).encode()).hexdigest()[:10]
        self.numerics = f"opencl-{kernels.version}-{digest}"
        self._experts: dict[tuple[int, int], _ExpertRef | None] = {}
        self._views: dict[tuple[int, int, int], ClWeight] = {}
        # the same weight objects come back every token (Container.weight): look them up by identity first,
        # holding each object so that its id cannot be reused
        self._views_by_id: dict[int, tuple[Weight, ClWeight]] = {}
        self._experts_by_id: dict[tuple[int, int, int], tuple[tuple[Weight, ...], _ExpertRef | None]] = {}

    # ---- weights ---------------------------------------------------------------------------------

    def _cw(self, w: Weight) -> ClWeight | None:
        """The device view of a weight; cached by the address of its bytes (mapped or kept alive by `memory`)."""
        hit = self._views_by_id.get(id(w))
        if hit is not None and hit[0] is w:
            return hit[1]
        quant = isinstance(w, QuantWeight)
        data = w.packed if quant else w
        key = (address(data), data.nbytes, (w.bits, w.scheme) if quant else 32)
        cw = self._views.get(key)
        if cw is not None:
            return cw
        if quant:
            cw = self.memory.weight(w.packed, w.scales, w.bits, w.group_size, w.shape, w.scheme)
        elif plain_f32(w):
            cw = self.memory.weight(w, None, 32, None, w.shape)
        if cw is not None and (self.memory.unified or self.memory.is_kept(data)):
            self._views[key] = cw
            self._views_by_id[id(w)] = (w, cw)
        return cw

    def _expert_ref(self, gate: Weight, up: Weight, down: Weight) -> _ExpertRef | None:
        """The fused-MLP view of (gate, up, down), or None when they cannot share one buffer and scheme."""
        ids = (id(gate), id(up), id(down))
        hit = self._experts_by_id.get(ids)
        if hit is not None and all(a is b for a, b in zip(hit[0], (gate, up, down), strict=True)):
            return hit[1]
        arrays = fused_expert_arrays(gate, up, down)
        if arrays is None:
            return None
        starts = [address(a) for a in arrays]
        lo, hi = min(starts), max(s + a.nbytes for s, a in zip(starts, arrays, strict=True))
        # the same bytes may hold another expert later (a cache's slot): equal only with the same layout
        cache_key = (lo, hi, *(s - lo for s in starts), *(a.shape for a in arrays), *(w.dtype for w in arrays))
        if cache_key in self._experts:
            return self._experts[cache_key]
        placed = self.memory.locate(lo, hi, arrays)
        ref = None
        if placed is not None:
            buf, base = placed
            offs = tuple(base + s - lo for s in starts)
            inter, n_in = gate.shape
            quant = isinstance(gate, QuantWeight)
            bits, group = (gate.bits, gate.group_size or 0) if quant else (32, 0)
            ref = _ExpertRef(buf, offs, ExpertShape(
                bits, group, gate.scales.shape[1] if quant and gate.scales.ndim == 2 else 1, n_in, inter,
                arrays[0].shape[1] * arrays[0].itemsize, arrays[4].shape[1] * arrays[4].itemsize,
                down.scales.shape[1] if quant and down.scales.ndim == 2 else 1, gate.scheme if quant else "symmetric"))
        if placed is not None or self.memory.unified or self.memory.used >= self.memory.budget:
            self._experts[cache_key] = ref  # a miss is final once the budget is spent (or memory is unified)
            self._experts_by_id[ids] = ((gate, up, down), ref)
        return ref

    def kv_room(self) -> int:
        """Bytes of a discrete device's memory its copies of the KV rows may take (`device_kv_room`): beside its
        weight arenas, or the weights still to come (the model's, up to the budget) where those are more."""
        weights = max(self.memory.device_bytes, min(self.model_bytes, self.memory.budget))
        return device_kv_room(self.k.info.global_mem, weights)

    @property
    def over_budget(self) -> bool:
        """Whether this discrete device's budget is smaller than the model (routed experts then run on `spill`, where
        there is one: the split step)."""
        return not self.memory.unified and self.model_bytes > self.memory.budget

    def decode_step(self, config: ModelConfig, layers: Sequence[LayerSpec], weight: Callable[[str], Weight],
                    experts: ExpertArena | None = None, kv_dtype: str = "f32", rows: int = 1,
                    draft: tuple[LayerSpec, MTPSpec] | None = None, span: range | None = None,
                    logits: bool = True, sequences: bool = False, mtp: tuple[LayerSpec, MTPSpec] | None = None
                    ) -> DeviceDecodeStep | None:
        """The device decode step for this model (placement.decode_step "cl"; on a discrete device every weight
        must fit the budget, or every one but routed experts, which then run on the spill device where there is one:
        the split step), or None: the model then decodes operation by operation. experts: see
        `DeviceDecodeStep`; rows: token rows per forward (2: MTP's verification of a draft); draft: the MTP layer and
        head, whose draft then follows a verification in the same queue (the step is built without it where they
        cannot be bound); sequences: the rows are as many sequences, each with its own cache (`decode_rows`); mtp:
        the model's MTP layer and head (see `DeviceDecodeStep`). The steps of a discrete device share its copies of
        the KV rows (`kv_mirrors`)."""
        over = self.over_budget
        if self.placement.decode_step != "cl" or (over and self.spill is None):
            return None
        # a discrete device smaller than the model: the routed experts it cannot hold run on the spill device (from
        # an expert cache's slots where one is given); a discrete device holding them all reads no cache
        spill = SpillDevice(self.spill.k, self.spill._expert_ref, self.expert_usage) if over else None
        experts = experts if spill is not None or self.k.direct else None
        for bound_draft in (draft, None) if draft is not None else (None,):
            try:
                return DeviceDecodeStep(config, layers, weight, self._cw, self._expert_ref, self.k,
                                        self.int8_activations, experts, kv_dtype, rows, bound_draft, span, logits,
                                        spill, sequences, self.kv_mirrors, mtp)
            except Unsupported:
                pass
        return None

    # ---- products --------------------------------------------------------------------------------

    def linear(self, x: np.ndarray, w: Weight) -> np.ndarray:
        p = self.placement
        if x.shape[0] <= DECODE_ROWS:
            bits = w.bits if isinstance(w, QuantWeight) else 32
            if p.matvec == "cl" and w.nbytes >= p.matvec_min_bytes and bits not in p.matvec_host_bits:
                cw = self._cw(w)
                if cw is not None:
                    return self.k.matvec(cw, x)
            return self.host.linear(x, w)
        if p.matmul == "host" or (p.matmul == "cl+blas" and not isinstance(w, QuantWeight)):
            return self.host.linear(x, w)
        cw = self._cw(w)
        if cw is None:
            return self.host.linear(x, w)
        if p.matmul == "cl":
            return self.k.matmul(cw, x)
        return x @ self.k.dequant(cw, copy=False).T  # one dequantization per batch, then BLAS

    def head_matmul(self, x: np.ndarray, w: Weight, row_start: int, rows: int, transpose: bool) -> np.ndarray:
        if x.shape[0] <= DECODE_ROWS and self.placement.matvec == "cl":
            cw = self._cw(w)
            if cw is not None:
                heads = x.shape[1]
                stride = w.shape[0] // heads
                if transpose:
                    return self.k.matvec_t(cw, x, stride, row_start, rows)
                return self.k.matvec(cw, x, heads, stride, row_start, rows)
        return self.host.head_matmul(x, w, row_start, rows, transpose)

    # ---- norms, rope, MLPs -------------------------------------------------------------------------

    def _vector_cl(self, rows: int) -> bool:
        return (self.placement.vector if rows <= DECODE_ROWS else self.placement.vector_prefill) == "cl"

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        if self._vector_cl(x.shape[0]):
            return self.k.rms_norm(x, weight, eps)
        return self.host.rms_norm(x, weight, eps)

    def layer_norm(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
        if self._vector_cl(x.shape[0]):
            return self.k.layer_norm(x, weight, bias, eps)
        return self.host.layer_norm(x, weight, bias, eps)

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        if self._vector_cl(x.shape[0]):
            return self.k.rope(x, cos, sin)
        return self.host.rope(x, cos, sin)

    def _silu_mul(self, g: np.ndarray, u: np.ndarray) -> np.ndarray:
        if self._vector_cl(g.shape[0]):
            return self.k.silu_mul(g, u)
        return silu(g) * u

    def expert_mlp(self, x: np.ndarray, gate: Weight, up: Weight, down: Weight) -> np.ndarray:
        if x.shape[0] <= DECODE_ROWS and self.placement.experts == "cl":
            ref = self._expert_ref(gate, up, down)
            if ref is not None:
                return self._run_fused(x, ref, [(s, 1.0, ref.offs) for s in range(x.shape[0])])
        if self.spill is not None and any(self._cw(w) is None for w in (gate, up, down)):
            return self.spill.expert_mlp(x, gate, up, down)  # e.g. a prefill's expert this device does not hold
        return self.linear(self._silu_mul(self.linear(x, gate), self.linear(x, up)), down)

    def moe(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, expert: ExpertFn,
            shared: tuple[Weight, Weight, Weight] | None, done: Callable[[int], None] | None = None) -> np.ndarray:
        p = self.placement
        if x.shape[0] > DECODE_ROWS and p.matmul == "host" and p.vector_prefill == "host":
            if self._prompt_x8():
                return self._prompt_moe_x8(x, ids, weights, expert, shared, done)
            return self.host.moe(x, ids, weights, expert, shared, done)  # every product on the host: its worker pool
        if x.shape[0] > DECODE_ROWS or p.experts != "cl":
            return moe_layer(self, x, ids, weights, expert, shared, done=done)
        # Decode: every (token, expert) pair is a slot carrying its expert's offsets; slots whose weights share
        # a buffer and a scheme (usually all of them, the shared expert included) run in one fused launch pair.
        # Experts the device does not hold are streamed to it in one upload (placement.stream_experts), run in
        # fused launches on the spill device (placement.spill_experts), or run through the per-weight path
        # (kernels where the weights can be placed, else the host).
        groups: dict[tuple, tuple[_ExpertRef, list[tuple[int, float, tuple]]]] = {}
        spilled: dict[tuple, tuple[_ExpertRef, list[tuple[int, float, tuple]]]] = {}
        streamed: list[tuple[np.ndarray, np.ndarray, tuple[Weight, Weight, Weight]]] = []
        out = np.zeros_like(x)
        every_row = np.arange(x.shape[0])
        routed = [(e, *np.nonzero(ids == e)) for e in np.unique(ids).tolist()]
        for e, rows, cols in routed + ([(None, every_row, None)] if shared is not None else []):
            triple = shared if e is None else expert(e)
            gate = np.ones((len(rows), 1), np.float32) if cols is None else weights[rows, cols, None]
            ref, into = self._expert_ref(*triple), groups
            if ref is None:
                if self._streamable(triple):
                    streamed.append((rows, gate[:, 0], triple))
                    continue
                ref, into = (None if self.spill is None else self.spill._expert_ref(*triple)), spilled
                if ref is None:
                    out[rows] += gate * self.expert_mlp(x[rows], *triple)
                    continue
            slots = into.setdefault(ref.key, (ref, []))[1]
            slots.extend((int(r), float(w), ref.offs) for r, w in zip(rows, gate[:, 0], strict=True))
        keep = None
        if streamed:
            keep, refs = self._stream(streamed)
            for (rows, gate, _), ref in zip(streamed, refs, strict=True):
                slots = groups.setdefault(ref.key, (ref, []))[1]
                slots.extend((int(r), float(w), ref.offs) for r, w in zip(rows, gate, strict=True))
        for ref, slots in spilled.values():
            out += self.spill._run_fused(x, ref, slots)
        for ref, slots in groups.values():
            out += self._run_fused(x, ref, slots)
        del keep  # the streamed bytes had to live until the launches that read them completed
        return out

    def _prompt_x8(self) -> bool:
        """Whether a prompt's routed experts that take int8 inputs run as fused kernels (`_prompt_moe_x8`): where the
        decode MoE runs on the device and the prompt's products on the host (a CPU device)."""
        p = self.placement
        return self.int8_activations and p.experts == "cl" and p.matmul == "host" and p.vector_prefill == "host"

    def _prompt_moe_x8(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, expert: ExpertFn,
                       shared: tuple[Weight, Weight, Weight] | None, done: Callable[[int], None] | None
                       ) -> np.ndarray:
        """A prompt's MoE on a device that shares host memory: the routed experts that take int8 inputs (as in the
        decode step) and have fewer than PROMPT_HOST_ROWS rows run as the fused expert kernels over their (row, expert)
        slots, at most PROMPT_EXPERTS experts and PROMPT_SLOTS slots at a time in expert order (each chunk's experts
        are then released: `done`); the others, and the shared expert, on the host. Few rows per expert (a 256-expert
        MoE) make the host's dequantize-then-GEMM cost far more than the kernels' integer sums (docs/BENCHMARKS.md)."""
        out = np.zeros_like(x)
        chunk: list[tuple[int, np.ndarray, np.ndarray, _ExpertRef]] = []  # (expert, rows, slot weights, its view)

        def flush() -> None:
            used = np.unique(np.concatenate([rows for _, rows, _, _ in chunk]))  # [U] the rows these slots read
            slots = [(int(i), float(w), ref.offs) for _, rows, gate, ref in chunk
                     for i, w in zip(np.searchsorted(used, rows), gate, strict=True)]
            out[used] += self._run_fused(x[used], chunk[0][3], slots)
            if done is not None:
                for e, *_ in chunk:
                    done(e)
            chunk.clear()

        for e in np.unique(ids).tolist():
            rows, cols = np.nonzero(ids == e)
            triple = expert(e)
            ref = self._expert_ref(*triple)
            if ref is None or not self._x8_ref(ref) or len(rows) >= PROMPT_HOST_ROWS:
                out[rows] += weights[rows, cols, None] * self.host.expert_mlp(x[rows], *triple)
                if done is not None:
                    done(e)
                continue
            if chunk and (ref.key != chunk[0][3].key or len(chunk) == PROMPT_EXPERTS
                          or sum(len(c[1]) for c in chunk) >= PROMPT_SLOTS):
                flush()
            chunk.append((e, rows, weights[rows, cols], ref))
        if chunk:
            flush()
        if shared is not None:
            out += self.host.expert_mlp(x, *shared)
        return out

    def _streamable(self, triple: tuple[Weight, Weight, Weight]) -> bool:
        if not self.placement.stream_experts or self.memory.unified:
            return False
        if (not all(isinstance(w, QuantWeight) for w in triple)
                or len({(w.bits, w.group_size, w.scheme) for w in triple}) != 1):
            return False
        arrays = [a for w in triple for a in (w.packed, w.scales)]
        entry = self.memory._mapping(arrays[0])
        return entry is not None and all(self.memory._mapping(a) is entry for a in arrays[1:])

    def _stream(self, experts: list) -> tuple[np.ndarray, list[_ExpertRef]]:
        """Upload the byte ranges of experts the device does not keep, back to back, in one transfer."""
        parts, refs, pos = [], [], 0
        spans = []
        for _, _, triple in experts:
            arrays = [a for w in triple for a in (w.packed, w.scales)]
            starts = [address(a) for a in arrays]
            lo, hi = min(starts), max(st + a.nbytes for st, a in zip(starts, arrays, strict=True))
            mapping = self.memory._mapping(arrays[0])
            view, base = mapping.view, mapping.base
            pos = -(-pos // 256) * 256
            spans.append((pos, starts, lo, triple))
            parts.append((pos, view[lo - base:hi - base]))
            pos += hi - lo
        blob = np.zeros(pos, np.uint8)
        for at, data in parts:
            blob[at:at + data.nbytes] = data
        buf = self.k.buffers.put("stream", blob, np.uint8)
        for at, starts, lo, (gate, _, down) in spans:
            inter, n_in = gate.shape
            group = gate.group_size or 0
            refs.append(_ExpertRef(buf, tuple(at + st - lo for st in starts), ExpertShape(
                gate.bits, group, gate.scales.shape[1] if gate.scales.ndim == 2 else 1, n_in, inter,
                gate.packed.shape[1], down.packed.shape[1], down.scales.shape[1] if down.scales.ndim == 2 else 1,
                gate.scheme)))
        return blob, refs

    def _run_fused(self, x: np.ndarray, ref: _ExpertRef, slots: list[tuple[int, float, tuple]]) -> np.ndarray:
        """`y[t] = sum over t's slots of w * MLP_slot(x[t])`, two launches (gate+up+SiLU, down)."""
        slots = sorted(slots, key=lambda slot: slot[0])
        tok = np.array([slot[0] for slot in slots], np.uint32)
        tok_start = np.zeros(x.shape[0] + 1, np.uint32)
        np.cumsum(np.bincount(tok, minlength=x.shape[0]), out=tok_start[1:])
        offs = np.array([slot[2] for slot in slots], np.uint64)
        slot_w = np.array([slot[1] for slot in slots], np.float32)
        run = self.k.experts_x8 if self._x8_ref(ref) else self.k.experts
        return run(ref.buf, ref.shape, x, offs, tok, tok_start, slot_w)

    def _x8_ref(self, ref: _ExpertRef) -> bool:
        """Whether the expert's products take int8 inputs: int4 and int3 experts only, as in the decode step (a q8
        model's experts keep float inputs)."""
        shape = ref.shape
        return self.int8_activations and shape.bits in (3, 4) and x8_eligible(shape.bits, shape.group, shape.n_in,
                                                                             shape.inter)

    # ---- attention and the indexer ---------------------------------------------------------------

    def release_memory(self) -> None:
        self.host.release_memory()

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, allowed: np.ndarray,
                  scale: float) -> np.ndarray:
        where = self.placement.attention if q.shape[0] <= DECODE_ROWS else self.placement.attention_prefill
        if where == "cl":
            return self.k.attention(q, k, v, allowed, scale)
        return self.host.attention(q, k, v, allowed, scale)

    def attention_chosen(self, q: np.ndarray, k: tuple[np.ndarray, ...], v: np.ndarray, chosen: np.ndarray,
                         scale: float) -> np.ndarray:
        return self.host.attention_chosen(q, k, v, chosen, scale)  # a gather per query: the host's BLAS

    def index_topk(self, q: np.ndarray, k: np.ndarray, weights: np.ndarray, scale: float, positions: np.ndarray,
                   topk: int) -> np.ndarray:
        if (self.placement.index if len(q) <= DECODE_ROWS else self.placement.index_prefill) != "cl":
            return self.host.index_topk(q, k, weights, scale, positions, topk)
        step = max(1, INDEX_BLOCK // k.shape[0])  # query rows whose scores [rows, T] are made at once
        return np.concatenate([self.k.index_topk(q[s0:s0 + step], k, weights[s0:s0 + step], scale,
                                                 position_mask(positions[s0:s0 + step], k.shape[0]), topk)
                               for s0 in range(0, len(q), step)])


def device_kv_room(global_mem: int, weight_bytes: int) -> int:
    """Bytes of a discrete device's memory (`global_mem`) the copies of the KV rows may take beside `weight_bytes` of
    weights: the rest, less ACTIVATION_SHARE of it for activations and the steps' scratch."""
    return global_mem - weight_bytes - int(global_mem * ACTIVATION_SHARE)


def weight_budget(global_mem: int) -> int:
    """Bytes of weights a discrete device keeps by default: 80% of its memory (the rest: activations, the KV rows'
    copies: `OpenCLBackend.kv_room`)."""
    return int(global_mem * 0.8)


def set_blas_threads(n: int) -> int | None:
    """Set NumPy's BLAS thread count (OpenBLAS's spin-waiting threads fight OpenCL CPU workers for the cores).

    Returns the previous count, or None when no BLAS library is loaded (nothing done)."""
    blas = ThreadpoolController().select(user_api="blas")
    if not blas.lib_controllers:
        return None
    before = max(c.num_threads for c in blas.lib_controllers)
    blas.limit(limits=n)
    return before


@functools.cache
def initial_blas_threads() -> int | None:
    """NumPy's OpenBLAS thread count as the process first had it (before any backend pinned it to one thread);
    None when it cannot be read."""
    before = set_blas_threads(1)
    if before is not None:
        set_blas_threads(before)
    return before
