"""Thin Python launchers for the OpenCL kernels: devices, staging buffers, weight memory, one call per kernel.

Every launcher takes and returns float32 NumPy arrays, so each kernel can be checked against the NumPy
reference directly (tests/test_kernels_cl.py) and the backend (glmkit.backends.opencl.backend) stays small.

Memory:
- `direct` devices (CPU devices such as PoCL's): inputs are copied into persistent page-aligned host arrays
  that the device uses in place (CL_MEM_USE_HOST_PTR) and outputs are read straight from them after the
  kernel's event completes: one command per operation, no transfer commands.
- other devices: inputs go up with non-blocking writes on the in-order queue, outputs come back with one
  blocking read.
- weights (`WeightMemory`): on unified-memory devices a mapped data file is wrapped in place (windows of
  at most the device's largest allocation, CL_MEM_USE_HOST_PTR over the read-only mapping: no second copy);
  on discrete devices weights are uploaded once into arenas and kept, within a byte budget.
"""

from __future__ import annotations

import math
import mmap
import re
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from glmkit.backends.opencl.kernels import kernel_version, source

try:  # pyopencl is a dependency, but a broken install must never take the NumPy path down with it
    import pyopencl as cl
except Exception:  # noqa: BLE001 - any import failure means "no OpenCL"
    cl = None

ALIGN = 4096  # host staging alignment: lets CL_MEM_USE_HOST_PTR use the memory in place
ARENA_BYTES = 256 << 20  # discrete devices: weights are uploaded into arenas of this size (or max alloc)
KEEP_SLOT_BYTES = 8 << 20  # staging buffers up to this size are kept between operations; larger ones (prefill
# activations, attention scores) are released after the operation that needed them, so they do not stay resident

_U32, _U64, _F32 = np.uint32, np.uint64, np.float32
_W = [None, _U64, None, _U64, _U32, _U32, _U32, _U32]  # the weight argument block of the quant kernels
SIGNATURES = {
    "mv": _W + [None, _U32, _U32, _U32, None, _U32, _U32, _U32, _U32, _U32],
    "mvt": _W + [None, _U32, _U32, _U32, None, _U32, _U32, _U32, _U32, _U32],
    "mm": _W + [None, _U32, _U32, None, _U32, _U32],
    "dq": _W + [None, _U32, _U32],
    "er": _W + [None, None],
    "eg": [None, None, None, _U32, _U32, _U32, _U32, None, _U32, None, _U32],
    "ed": [None, None, None, None, _U32, _U32, _U32, _U32, None, None, _U32, _U32],
    "rms_norm": [None, None, None, _U32, _F32],
    "layer_norm": [None, None, None, None, _U32, _F32],
    "softmax_rows": [None, None, _U32],
    "rope": [None, None, None, None, _U32, _U32, _U32, _U32],
    "silu_mul": [None, None, None, _U32],
    "attention": [None] * 6 + [_U32] * 8 + [_F32],
    "index_scores": [None] * 4 + [_U32] * 3 + [_F32, _F32],
    "topk_select": [None] * 4 + [_U32] * 3,
    "topk_select_group": [None] * 4 + [_U32] * 3,
    "residual_rms_norm": [None, _U32, None, None, None, _U32, None, _U32, None, _U32, _U32, _F32, _U32, None, None,
                          None],
    "add_into": [None, None, _U32],
    "argmax_row": [None, _U32, None],
    "token_rows": [None, None, _U32, None, None, _U32, _U32, _U32, None, _F32, None, _U32, None, _U32, _U32, None, None,
                   None, _U32, None, _U32, _U32, None, None, _U32, None, _U32],
    "mla_query": _W + [None, _U32, None, _U32, _U32, None, None, _U32],
    "rope_rows": [None, _U32, _U32, None, _U32, _U32, None, _U32, _U32],
    "mla_decode_scores": [None] * 5 + [_U32, None] + [_U32] * 4 + [_F32],
    "mla_decode_values": [None] * 3 + [_U32, _U32, _U32, None, None, None, None, _U32],
    "route_noaux_tc": [None, None, _U32, None, None] + [_U32] * 6 + [_F32, _U32, None, None, None, _U32, None, None],
    "quantize_x8": [None, _U32, _U32, None, None, None],
    "mv_x8": _W + [None, None, None, _U32, _U32, _U32, None, _U32, _U32, _U32, _U32, _U32, None, None, None],
    "eg_x8": [None, None, None, _U32, _U32, _U32, _U32, None, None, None, None, _U32],
    "edp": [None, None, None, _U32, _U32, _U32, _U32, None, None, _U32],
    "edp_x8": [None, None, None, _U32, _U32, _U32, _U32, None, None, None, None, _U32],
    "expert_sum": [None, None, None, None, _U32],
}
SIGNATURES["mvq_x8"] = SIGNATURES["mv_x8"]  # mv_x8 that also writes its output's codes
SIGNATURES["mv2_x8"] = _W + [None, _U64, None, _U64, None, None, None, None, _U32, _U32, None, _U32]
BIT_SUFFIX = {32: "f32", 8: "q8", 4: "q4", 2: "q2"}
_WEIGHT_TYPE = re.compile("_(" + "|".join(BIT_SUFFIX.values()) + ")(?=_|$)")  # a quant kernel's weight type
X8_BLOCK = 64  # columns per scale of int8-quantized activations (common.cl)
NO_STAGE = 0xFFFFFFFF  # token_rows: no staging copy of the cache rows (decode.cl)


def x8_eligible(bits: int, group: int, *widths: int) -> bool:
    """Whether products can take int8 activations: int4 or int8 codes whose scale groups are whole blocks of
    X8_BLOCK columns, every input width (a matrix's columns; an MLP's n_in and inter) a whole number of blocks."""
    return bits in (4, 8) and group > 0 and group % X8_BLOCK == 0 and all(w % X8_BLOCK == 0 for w in widths)


def mvt_chunked(w: ClWeight) -> bool:
    """Whether matvec_t's work-items own a 16-byte chunk of each row (int4: 32 columns, int8: 16): chunks in whole
    scale groups (`mvt_chunked` in quant.cl)."""
    cols = {4: 32, 8: 16}.get(w.bits)
    return cols is not None and w.n_in % cols == 0 and w.group % cols == 0


def mvt_global(w: ClWeight, heads: int) -> tuple[int, int]:
    """matvec_t's global size: a work-item per 16-byte chunk of a row where `mvt_chunked`, else per 8 columns."""
    cols = {4: 32, 8: 16}[w.bits] if mvt_chunked(w) else 8
    return -(-w.n_in // cols), heads


def available() -> bool:
    return cl is not None


@dataclass(frozen=True)
class DeviceInfo:
    platform_index: int
    device_index: int
    platform: str
    name: str
    driver: str
    kind: str  # "gpu", "cpu", "accelerator"
    global_mem: int
    max_alloc: int
    compute_units: int
    unified: bool  # host-unified memory: weights can be used in place from the mapping

    @property
    def spec(self) -> str:
        return f"opencl:{self.platform_index}:{self.device_index}"

    @property
    def key(self) -> str:
        """Identity of the device and its driver: the device profile is stored under it."""
        return f"{self.platform}|{self.name}|{self.driver}"


_PROBE_SOURCE = "__kernel void probe(__global float *out) { out[get_global_id(0)] = 1.0f; }"
_COMPILES: dict[tuple[str, str, str], bool] = {}


def compiles(platform: str, device: Any) -> bool:
    """Whether the device's compiler builds a trivial kernel (once per process and device): a driver whose compiler
    does not know the host CPU (e.g. an older PoCL's LLVM on a newer CPU) lists a device that builds nothing."""
    key = (platform, device.name, device.driver_version)
    if key not in _COMPILES:
        try:
            cl.Program(cl.Context([device]), _PROBE_SOURCE).build()
            _COMPILES[key] = True
        except Exception:  # noqa: BLE001 - cl.RuntimeError (BUILD_PROGRAM_FAILURE), a broken driver, ...
            _COMPILES[key] = False
    return _COMPILES[key]


def list_devices() -> list[DeviceInfo]:
    """Every OpenCL device of every platform whose compiler works (`compiles`); [] when pyopencl or the ICD loader
    finds no platform."""
    if cl is None:
        return []
    try:
        platforms = cl.get_platforms()
    except Exception:  # noqa: BLE001 - cl.LogicError (no platform, PLATFORM_NOT_FOUND_KHR), a broken ICD, ...
        return []
    found = []
    for p_index, platform in enumerate(platforms):
        try:
            devices = platform.get_devices()
        except Exception:  # noqa: BLE001 - a platform without usable devices
            continue
        for d_index, dev in enumerate(devices):
            if not compiles(platform.name, dev):
                continue
            kind = "gpu" if dev.type & cl.device_type.GPU else "cpu" if dev.type & cl.device_type.CPU else "accelerator"
            unified = bool(dev.type & cl.device_type.CPU) or bool(getattr(dev, "host_unified_memory", False))
            found.append(DeviceInfo(p_index, d_index, platform.name.strip(), dev.name.strip(),
                                    dev.driver_version.strip(), kind, int(dev.global_mem_size),
                                    int(dev.max_mem_alloc_size), int(dev.max_compute_units), unified))
    return found


def _aligned_empty(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + nbytes]


def address(arr: np.ndarray) -> int:
    return arr.__array_interface__["data"][0]


@dataclass(frozen=True)
class ClWeight:
    """A 2-D weight on the device: packed rows at (wbuf, w_off), float scales at (sbuf, s_off).

    bits 32 = float32 rows (no scales); group 0 = one scale per row.
    """

    wbuf: object
    w_off: int
    sbuf: object
    s_off: int
    bits: int
    group: int
    n_groups: int
    rows: int
    n_in: int
    row_bytes: int

    def args(self) -> tuple:
        return (self.wbuf, self.w_off, self.sbuf, self.s_off, self.n_in, self.row_bytes, self.group, self.n_groups)


class Kernels:
    """One device: context, in-order queue, the built program, staging buffers and a launcher per kernel.

    lanes: work-items per matvec row (1 on CPUs; a power of two, e.g. 32, on GPUs); red_lanes: work-group
    size of the row-reduction kernels; direct: read/write staging memory without transfer commands
    (default: CPU devices); cpu_loads: vector loads as plain unaligned loads instead of vloadn (default: CPU
    devices, whose PoCL compiler leaves vloadn as calls).
    """

    def __init__(self, info: DeviceInfo, lanes: int | None = None, red_lanes: int | None = None,
                 direct: bool | None = None, items_per_group: int | None = None,
                 cpu_loads: bool | None = None) -> None:
        if cl is None:
            raise RuntimeError("pyopencl is not installed")
        self.info = info
        self.device = cl.get_platforms()[info.platform_index].get_devices()[info.device_index]
        gpu = info.kind == "gpu"
        self.lanes = lanes or (32 if gpu else 1)
        self.red_lanes = red_lanes or (64 if gpu else 16)
        self.rows_per_item = 1 if self.lanes > 1 else 4  # matvec rows per work-item (ROWS in the kernels)
        self.items_per_group = items_per_group or (1 if self.lanes > 1 else 4)
        self.direct = (info.kind == "cpu") if direct is None else direct
        self.ctx = cl.Context([self.device])
        self.queue = cl.CommandQueue(self.ctx)
        options = [f"-DLANES={self.lanes}", f"-DRED_LANES={self.red_lanes}", f"-DROWS={self.rows_per_item}"]
        self.cpu_loads = (info.kind == "cpu") if cpu_loads is None else cpu_loads
        if self.cpu_loads:
            options.append("-DCPU_LOADS")  # plain unaligned vector loads (PoCL does not inline vloadn)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # clang's notes about float16 ABI on AVX2 are not actionable
            self.program = cl.Program(self.ctx, source()).build(options=options)
        self._kernels: dict[str, object] = {}
        self._slots: dict[str, tuple[np.ndarray | None, object, int]] = {}
        self._large_slots = False  # whether a slot over KEEP_SLOT_BYTES exists (released after its operation)
        self.version = f"{kernel_version()}-l{self.lanes}r{self.red_lanes}w{self.rows_per_item}" + (
            "c" if self.cpu_loads else "")

    # ---- kernels and buffers ---------------------------------------------------------------------

    def kernel(self, name: str):
        k = self._kernels.get(name)
        if k is None:
            k = self._kernels[name] = self.new_kernel(name)
        return k

    def new_kernel(self, name: str):
        """A kernel object of its own (its arguments stay as set), with its scalar argument types."""
        k = cl.Kernel(self.program, name)
        k.set_scalar_arg_dtypes(signature(name))
        return k

    def bind(self, name: str, size: tuple[int, ...], local: tuple[int, ...] | None, *args) -> Launch:
        """A launch of kernel `name` with its arguments set once (see `Launch`)."""
        return Launch(self, name, size, local, args)

    def host_buffer(self, count: int, dtype=np.float32) -> tuple[np.ndarray, object]:
        """A page-aligned host array of `count` items and its buffer: on direct devices the device uses the array
        in place; elsewhere the buffer is device memory of its own, which `upload` / `download` copy to and from."""
        host = _aligned_empty(max(count, 1) * np.dtype(dtype).itemsize).view(dtype)
        if self.direct:
            return host, self.wrap(host)
        return host, self.device_buffer(host.nbytes)

    def device_buffer(self, nbytes: int):
        """Device memory of its own (no host array)."""
        return cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, max(nbytes, 4))

    def upload(self, buf, arr: np.ndarray, offset: int = 0):
        """Queue a copy of `arr` into `buf` at byte `offset` (non-blocking: arr must stay as it is until done)."""
        return cl.enqueue_copy(self.queue, buf, arr, dst_offset=offset, is_blocking=False)

    def download(self, arr: np.ndarray, buf, offset: int = 0):
        """Queue a copy of `arr.nbytes` bytes of `buf` from byte `offset` into `arr`; returns its event."""
        return cl.enqueue_copy(self.queue, arr, buf, src_offset=offset, is_blocking=False)

    @property
    def base_align(self) -> int:
        """Bytes a sub-buffer's origin must be a multiple of."""
        return max(1, self.device.mem_base_addr_align // 8)

    def topk_kernel(self, rows: int) -> tuple[str, tuple[int], tuple[int] | None]:
        """The top-k selection kernel for `rows` rows, with its global and local size: one work-group per row on GPUs
        (LANES > 1; one item's serial passes took ~0.3 ms per row there), one work-item per row on CPUs."""
        if self.lanes > 1:
            return "topk_select_group", (rows * self.red_lanes,), (self.red_lanes,)
        return "topk_select", (rows,), None

    @property
    def heads_apart(self) -> bool:
        """Whether per-key attention kernels give each head its own work-items (GPUs), rather than one item every
        head of a key (CPUs: the key is read once)."""
        return self.lanes > 1

    def sub_buffer(self, buf, offset: int, nbytes: int):
        """The bytes [offset, offset + nbytes) of `buf` as a buffer of their own (offset: a `base_align` multiple)."""
        return buf.get_sub_region(offset, nbytes)

    def wrap(self, arr: np.ndarray):
        """Direct devices: a read-write buffer over a writable host array, used in place (no copy)."""
        assert self.direct and arr.flags.writeable and arr.flags.c_contiguous
        return cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.USE_HOST_PTR, hostbuf=arr)

    def _slot(self, name: str, nbytes: int) -> tuple[np.ndarray | None, object]:
        """A persistent staging buffer of at least nbytes (grown to the next power of two)."""
        have = self._slots.get(name)
        if have is not None and have[2] >= nbytes:
            return have[0], have[1]
        size = max(4096, 1 << max(nbytes - 1, 1).bit_length())
        if self.direct:
            host = _aligned_empty(size)
            buf = cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.USE_HOST_PTR, hostbuf=host)
        else:
            host, buf = None, self.device_buffer(size)
        self._slots[name] = (host, buf, size)
        self._large_slots |= size > KEEP_SLOT_BYTES
        return host, buf

    def put(self, name: str, arr: np.ndarray, dtype=np.float32):
        """Stage an input array; returns its buffer."""
        arr = np.ascontiguousarray(arr, dtype=dtype)
        host, buf = self._slot(name, max(arr.nbytes, 4))
        if self.direct:
            host[:arr.nbytes].view(arr.dtype)[:] = arr.reshape(-1)
        elif arr.nbytes:
            self.upload(buf, arr)
        return buf

    def out(self, name: str, nbytes: int):
        return self._slot(name, max(nbytes, 4))[1]

    def get(self, name: str, shape: tuple[int, ...], event, dtype=np.float32, copy: bool = True) -> np.ndarray:
        """The result in slot `name` once `event` (the last kernel writing it) has completed (a copy, or with
        copy=False on direct devices the staging memory itself, valid until the slot is reused)."""
        count = math.prod(shape)
        if self.direct:
            event.wait()
            host = self._slots[name][0]
            view = host[:count * np.dtype(dtype).itemsize].view(dtype).reshape(shape)
            result = view.copy() if copy else view  # a view keeps its memory alive after the slot is dropped
        else:
            result = np.empty(shape, dtype)
            if count:
                cl.enqueue_copy(self.queue, result, self._slots[name][1], is_blocking=True)
        self._release_large()
        return result

    def _release_large(self) -> None:
        """Drop staging buffers over KEEP_SLOT_BYTES (the operation that used them has completed)."""
        if self._large_slots:
            self._slots = {k: v for k, v in self._slots.items() if v[2] <= KEEP_SLOT_BYTES}
            self._large_slots = False

    def finish(self) -> None:
        self.queue.finish()

    def on_complete(self, event, fn) -> None:
        """Call `fn()` from the OpenCL runtime's callback thread once the command of `event` completed."""
        event.set_callback(cl.command_execution_status.COMPLETE, lambda status: fn())

    def _rows_global(self, rows: int) -> tuple[int, tuple[int, int]]:
        """Global size along dim 0 and the local size for the row-parallel kernels (ROWS rows per item)."""
        items = -(-rows // self.rows_per_item)
        if self.lanes > 1:
            return items * self.lanes, (self.lanes, 1)
        g = self.items_per_group
        return -(-items // g) * g, (g, 1)

    # ---- quantized products ----------------------------------------------------------------------

    def matvec(self, w: ClWeight, x: np.ndarray, heads: int = 1, head_rows: int = 0, row_start: int = 0,
               rows: int | None = None) -> np.ndarray:
        """`y[s, h, r] = x[s, h] . W[h * head_rows + row_start + r]`; x `[S, I]` (heads 1) or `[S, heads, I]`.

        Returns `[S, rows]` for 2-D x, `[S, heads, rows]` otherwise. One pass over each weight row."""
        rows = w.rows if rows is None else rows
        n_s = x.shape[0]
        xb = self.put("x", x)
        yb = self.out("y", n_s * heads * rows * 4)
        g0, local = self._rows_global(rows)
        evt = self.kernel("mv_" + BIT_SUFFIX[w.bits])(
            self.queue, (g0, heads), local, *w.args(), xb, n_s, heads * w.n_in, w.n_in, yb, heads * rows, rows,
            rows, head_rows, row_start)
        shape = (n_s, rows) if x.ndim == 2 else (n_s, heads, rows)
        return self.get("y", shape, evt)

    def bind_matvec(self, w: ClWeight, xb, yb, heads: int = 1, x_h: int = 0, head_rows: int = 0, row_start: int = 0,
                    rows: int | None = None) -> Launch:
        """`matvec` of one row between buffers: `y[h, r] = x[h] . W[h * head_rows + row_start + r]` (x rows
        `x_h` floats apart, y rows `rows`), bound for repeated launches."""
        rows = w.rows if rows is None else rows
        g0, local = self._rows_global(rows)
        return self.bind("mv_" + BIT_SUFFIX[w.bits], (g0, heads), local, *w.args(), xb, 1, heads * w.n_in, x_h, yb,
                         heads * rows, rows, rows, head_rows, row_start)

    def bind_quantize(self, xb, n: int, rows: int, scratch: tuple) -> Launch:
        """int8 codes, scales and code sums (scratch: their buffers) of `rows` contiguous rows of n floats (n a
        multiple of X8_BLOCK): the inputs of the int8-input products."""
        return self.bind("quantize_x8", (n // X8_BLOCK, rows), None, xb, n, n, *scratch)

    @property
    def writes_codes(self) -> bool:
        """Whether products can write their output's int8 codes themselves (`codes_out` in quant.cl): a
        work-group of X8_BLOCK / ROWS items then owns one block of output rows (one lane per row only)."""
        return self.lanes == 1 and X8_BLOCK % self.rows_per_item == 0

    def bind_matvec_x8(self, w: ClWeight, scratch: tuple, yb, heads: int = 1, head_rows: int = 0,
                       row_start: int = 0, rows: int | None = None, codes_out: tuple | None = None) -> Launch:
        """`bind_matvec` of contiguous input rows (x_h = n_in) with int8 activations (`x8_eligible`): scratch
        holds the rows quantized (`bind_quantize`). codes_out: y's own codes written there too (`writes_codes`
        devices, rows a multiple of X8_BLOCK), for a product that takes y as int8 input."""
        rows = w.rows if rows is None else rows
        g0, local = self._rows_global(rows)
        name = f"mv_{BIT_SUFFIX[w.bits]}_x8"
        if codes_out is not None:
            assert self.writes_codes and rows % X8_BLOCK == 0
            name, local = "mvq" + name[2:], (X8_BLOCK // self.rows_per_item, 1)
        return self.bind(name, (g0, heads), local, *w.args(), *scratch, 1, heads * w.n_in, w.n_in, yb, heads * rows,
                         rows, rows, head_rows, row_start, *(codes_out or (yb, yb, yb)))

    def bind_matvec_pair(self, w: ClWeight, w2: ClWeight, scratch: tuple, yb, y2b) -> Launch:
        """`y = W x` and `y2 = W2 x` in one launch, over one input row quantized in scratch (`bind_quantize`); W
        and W2 alike in bits, columns and groups, both `x8_eligible`."""
        assert (w.bits, w.n_in, w.group, w.row_bytes) == (w2.bits, w2.n_in, w2.group, w2.row_bytes)
        items = -(-w.rows // self.rows_per_item)
        g0, local = self._rows_global(items * self.rows_per_item + w2.rows)
        return self.bind(f"mv2_{BIT_SUFFIX[w.bits]}_x8", (g0, 1), local, *w.args(), *w2.args()[:4], *scratch, yb,
                         w.rows, items, y2b, w2.rows)

    def bind_embed_row(self, w: ClWeight, token, out) -> Launch:
        """Row `token[0]` of W (a buffer holding one uint) as float into `out`: an embedding lookup on the device."""
        return self.bind("er_" + BIT_SUFFIX[w.bits], (w.n_in,), None, *w.args(), token, out)

    def bind_matvec_t(self, w: ClWeight, xb, yb, heads: int, x_h: int, head_rows: int, row_start: int, rows: int
                      ) -> Launch:
        """`matvec_t` of one row between buffers: `y[h] = x[h, :rows] @ W[h * head_rows + row_start ...]`."""
        return self.bind("mvt_" + BIT_SUFFIX[w.bits], mvt_global(w, heads), None, *w.args(), xb, 1,
                         heads * x_h, x_h, yb, heads * w.n_in, w.n_in, rows, head_rows, row_start)

    def bind_mla_query(self, w: ClWeight, xb, x_h: int, q_abs, rows: int, head_rows: int, heads: int, cs, q_rot,
                       rope: int) -> Launch:
        """MLA's decode query per head (`mla_query` in quant.cl): q_abs[h] = x[h, :rows] @ W[h * head_rows ...] and
        q_rot[h] = RoPE(x[h, rows:rows + rope]); W `mvt_chunked`."""
        assert mvt_chunked(w)
        return self.bind("mla_query_" + BIT_SUFFIX[w.bits], mvt_global(w, heads), None, *w.args(), xb, x_h, q_abs,
                         rows, head_rows, cs, q_rot, rope)

    def bind_experts(self, wbuf, bits: int, group: int, n_groups: int, n_in: int, inter: int, in_row_bytes: int,
                     inter_row_bytes: int, inter_groups: int, xb, offs, slot_tok, tok_start, slot_w, hid, yb,
                     n_slots: int, part, summed: bool = True) -> tuple[Launch, ...]:
        """`experts` for one token between buffers (the slots' offsets and weights already on the device), its
        down product per slot into part (`[n_slots, n_in]` floats) as `bind_experts_x8`'s, then (when summed) the
        slots' weighted sum into yb."""
        suffix = BIT_SUFFIX[bits]
        g_inter, l_inter = self._rows_global(inter)
        g_out, l_out = self._rows_global(n_in)
        launches = (self.bind("eg_" + suffix, (g_inter, n_slots), l_inter, wbuf, offs, slot_tok, n_in, in_row_bytes,
                              group, n_groups, xb, n_in, hid, inter),
                    self.bind("edp_" + suffix, (g_out, n_slots), l_out, wbuf, offs, tok_start, inter,
                              inter_row_bytes, group, inter_groups, hid, part, n_in))
        return self._summed(launches, summed, part, tok_start, slot_w, yb, n_in)

    def _summed(self, launches: tuple[Launch, ...], summed: bool, part, tok_start, slot_w, yb, n: int
                ) -> tuple[Launch, ...]:
        """The experts' launches, then (when summed) expert_sum of their per-slot down rows into yb."""
        if not summed:
            return launches
        return (*launches, self.bind("expert_sum", (n,), None, part, tok_start, slot_w, yb, n))

    def bind_experts_x8(self, wbuf, bits: int, group: int, n_groups: int, n_in: int, inter: int, in_row_bytes: int,
                        inter_row_bytes: int, inter_groups: int, x_scratch: tuple, offs, slot_tok, tok_start, slot_w,
                        hid, yb, n_slots: int, hid_scratch: tuple, part, summed: bool = True) -> tuple[Launch, ...]:
        """`bind_experts` for int4/int8 experts with int8 activations (`x8_eligible`): gate+up over x quantized in
        x_scratch (`bind_quantize`), the slots' hidden rows quantized into hid_scratch, down per slot into part
        (`[n_slots, n_in]` floats), then (when summed) the slots' weighted sum into yb."""
        g_inter, l_inter = self._rows_global(inter)
        g_out, l_out = self._rows_global(n_in)
        suffix = BIT_SUFFIX[bits] + "_x8"
        launches = (self.bind("eg_" + suffix, (g_inter, n_slots), l_inter, wbuf, offs, slot_tok, n_in, in_row_bytes,
                              group, n_groups, *x_scratch, hid, inter),
                    self.bind_quantize(hid, inter, n_slots, hid_scratch),
                    self.bind("edp_" + suffix, (g_out, n_slots), l_out, wbuf, offs, tok_start, inter, inter_row_bytes,
                              group, inter_groups, *hid_scratch, part, n_in))
        return self._summed(launches, summed, part, tok_start, slot_w, yb, n_in)

    def matvec_t(self, w: ClWeight, x: np.ndarray, head_rows: int, row_start: int, rows: int) -> np.ndarray:
        """`y[s, h] = x[s, h] @ W[h * head_rows + row_start : ... + rows]` (x `[S, heads, rows]`) -> `[S, heads, I]`."""
        n_s, heads = x.shape[0], x.shape[1]
        xb = self.put("x", x)
        yb = self.out("y", n_s * heads * w.n_in * 4)
        evt = self.kernel("mvt_" + BIT_SUFFIX[w.bits])(
            self.queue, mvt_global(w, heads), None, *w.args(), xb, n_s, heads * rows, rows, yb, heads * w.n_in,
            w.n_in, rows, head_rows, row_start)
        return self.get("y", (n_s, heads, w.n_in), evt)

    def matmul(self, w: ClWeight, x: np.ndarray) -> np.ndarray:
        """Prefill `x [S, I] @ W^T -> [S, O]` with the tiled kernel."""
        n_s = x.shape[0]
        xb = self.put("x", x)
        yb = self.out("y", n_s * w.rows * 4)
        gx, gy = -(-w.rows // 32) * 8, -(-n_s // 32) * 8
        evt = self.kernel("mm_" + BIT_SUFFIX[w.bits])(
            self.queue, (gx, gy), (8, 8), *w.args(), xb, n_s, w.n_in, yb, w.rows, w.rows)
        return self.get("y", (n_s, w.rows), evt)

    def dequant(self, w: ClWeight, row_start: int = 0, rows: int | None = None, copy: bool = True) -> np.ndarray:
        """Rows `[row_start, row_start + rows)` of W as float32 `[rows, I]`.

        copy=False may return the staging memory itself (valid until the next dequant): for an immediate GEMM."""
        rows = w.rows - row_start if rows is None else rows
        yb = self.out("dq", rows * w.n_in * 4)
        evt = self.kernel("dq_" + BIT_SUFFIX[w.bits])(
            self.queue, (w.n_in, rows), None, *w.args(), yb, rows, row_start)
        return self.get("dq", (rows, w.n_in), evt, copy=copy)

    def experts(self, wbuf, bits: int, group: int, n_groups: int, n_in: int, inter: int, in_row_bytes: int,
                inter_row_bytes: int, inter_groups: int, x: np.ndarray, offs: np.ndarray, slot_tok: np.ndarray,
                tok_start: np.ndarray, slot_w: np.ndarray) -> np.ndarray:
        """Fused expert MLPs over slots (token, expert): `y[t] = sum_slot w * down(silu(gate x_t) * up x_t)`.

        wbuf holds every slot's weights; offs `[slots, 6]` their byte offsets (gate, gate scales, up, up
        scales, down, down scales); slot_tok `[slots]`; tok_start `[T + 1]` (slots sorted by token);
        slot_w `[slots]`. gate/up are `[inter, n_in]`, down `[n_in, inter]`, all with `bits`/`group`.
        """
        n_tok, n_slots = x.shape[0], len(slot_tok)
        xb = self.put("x", x)
        ob = self.put("offs", offs, np.uint64)
        sb = self.put("slot_tok", slot_tok, np.uint32)
        tb = self.put("tok_start", tok_start, np.uint32)
        wb = self.put("slot_w", slot_w)
        hb = self.out("hid", n_slots * inter * 4)
        yb = self.out("y", n_tok * n_in * 4)
        suffix = BIT_SUFFIX[bits]
        g0, local = self._rows_global(inter)
        self.kernel("eg_" + suffix)(self.queue, (g0, n_slots), local, wbuf, ob, sb, n_in, in_row_bytes, group,
                                    n_groups, xb, n_in, hb, inter)
        g0, local = self._rows_global(n_in)
        evt = self.kernel("ed_" + suffix)(self.queue, (g0, n_tok), local, wbuf, ob, tb, wb, inter, inter_row_bytes,
                                          group, inter_groups, hb, yb, n_in, n_in)
        return self.get("y", (n_tok, n_in), evt)

    def experts_x8(self, wbuf, bits: int, group: int, n_groups: int, n_in: int, inter: int, in_row_bytes: int,
                   inter_row_bytes: int, inter_groups: int, x: np.ndarray, offs: np.ndarray, slot_tok: np.ndarray,
                   tok_start: np.ndarray, slot_w: np.ndarray) -> np.ndarray:
        """`experts` with int8-quantized activations (`x8_eligible` experts): x's rows and the slots' hidden rows
        quantized per block of X8_BLOCK, the products summed as integers (2.5x the float kernels' speed on PoCL,
        tools/bench_kernels.py); down per slot, each token's slots then summed on the host in slot order."""
        n_tok, n_slots = x.shape[0], len(slot_tok)
        x_codes = (self.out("xq", 2 * x.size), self.out("xs", 4 * (x.size // X8_BLOCK)),
                   self.out("xsum", 4 * (x.size // X8_BLOCK)))
        hid_codes = (self.out("hq", 2 * n_slots * inter), self.out("hs", 4 * (n_slots * inter // X8_BLOCK)),
                     self.out("hsum", 4 * (n_slots * inter // X8_BLOCK)))
        xb, ob = self.put("x", x), self.put("offs", offs, np.uint64)
        sb = self.put("slot_tok", slot_tok, np.uint32)
        used = self.put("tok_start", np.array([0, n_slots]), np.uint32)  # edp's slot range: all of them
        hb, pb = self.out("hid", n_slots * inter * 4), self.out("part", n_slots * n_in * 4)
        g_inter, l_inter = self._rows_global(inter)
        g_out, l_out = self._rows_global(n_in)
        suffix = BIT_SUFFIX[bits] + "_x8"
        quantize = self.kernel("quantize_x8")
        quantize(self.queue, (n_in // X8_BLOCK, n_tok), None, xb, n_in, n_in, *x_codes)
        self.kernel("eg_" + suffix)(self.queue, (g_inter, n_slots), l_inter, wbuf, ob, sb, n_in, in_row_bytes, group,
                                    n_groups, *x_codes, hb, inter)
        quantize(self.queue, (inter // X8_BLOCK, n_slots), None, hb, inter, inter, *hid_codes)
        evt = self.kernel("edp_" + suffix)(self.queue, (g_out, n_slots), l_out, wbuf, ob, used, inter,
                                           inter_row_bytes, group, inter_groups, *hid_codes, pb, n_in)
        part = self.get("part", (n_slots, n_in), evt) * slot_w[:, None]
        return np.stack([part[tok_start[t]:tok_start[t + 1]].sum(0) for t in range(n_tok)])

    # ---- norms, rope, activations ----------------------------------------------------------------

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        n = x.shape[-1]
        rows = x.size // n if n else 0
        xb, wb = self.put("x", x), self.put("nw", weight)
        yb = self.out("y", x.size * 4)
        evt = self.kernel("rms_norm")(self.queue, (rows * self.red_lanes,), (self.red_lanes,), xb, wb, yb, n, eps)
        return self.get("y", x.shape, evt)

    def layer_norm(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
        n = x.shape[-1]
        rows = x.size // n if n else 0
        xb, wb, bb = self.put("x", x), self.put("nw", weight), self.put("nb", bias)
        yb = self.out("y", x.size * 4)
        evt = self.kernel("layer_norm")(self.queue, (rows * self.red_lanes,), (self.red_lanes,), xb, wb, bb, yb,
                                        n, eps)
        return self.get("y", x.shape, evt)

    def softmax(self, x: np.ndarray) -> np.ndarray:
        """Softmax over the last axis (-inf entries get 0)."""
        n = x.shape[-1]
        rows = x.size // n if n else 0
        xb, yb = self.put("x", x), self.out("y", x.size * 4)
        evt = self.kernel("softmax_rows")(self.queue, (rows * self.red_lanes,), (self.red_lanes,), xb, yb, n)
        return self.get("y", x.shape, evt)

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, offset: int = 0, width: int | None = None
             ) -> np.ndarray:
        """RoPE on dims `[offset, offset + width)` of `x [S, ..., D]` (default: all D), the rest copied."""
        n_s, dim = x.shape[0], x.shape[-1]
        width = dim if width is None else width
        heads = x.size // (n_s * dim) if x.size else 0
        xb = self.put("x", x)
        yb = self.put("y", x) if width < dim else self.out("y", x.size * 4)
        cb, sb = self.put("cos", cos), self.put("sin", sin)
        evt = self.kernel("rope")(self.queue, (width // 2, n_s * heads), None, xb, yb, cb, sb, heads, dim, offset,
                                  width // 2)
        return self.get("y", x.shape, evt)

    def silu_mul(self, g: np.ndarray, u: np.ndarray) -> np.ndarray:
        gb, ub = self.put("x", g), self.put("u", u)
        yb = self.out("y", g.size * 4)
        evt = self.kernel("silu_mul")(self.queue, (g.size,), None, gb, ub, yb, g.size)
        return self.get("y", g.shape, evt)

    # ---- attention and the indexer ---------------------------------------------------------------

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, allowed: np.ndarray, scale: float
                  ) -> np.ndarray:
        """q `[S, nh, dk]`, k `[T, kh, dk]`, v `[T, kh, dv]` (kh = nh or 1), allowed `[S, T]` -> `[S, nh, dv]`."""
        n_s, heads, dk = q.shape
        n_keys, kh, dv = k.shape[0], k.shape[1], v.shape[2]
        qb, kb, vb = self.put("q", q), self.put("k", k), self.put("v", v)
        ab = self.put("mask", allowed, np.uint8)
        sb = self.out("scores", n_s * heads * n_keys * 4)
        yb = self.out("y", n_s * heads * dv * 4)
        evt = self.kernel("attention")(
            self.queue, (heads * self.red_lanes, n_s), (self.red_lanes, 1), qb, kb, vb, ab, sb, yb, heads, n_keys,
            dk, dv, kh * dk, dk if kh > 1 else 0, kh * dv, dv if kh > 1 else 0, scale)
        return self.get("y", (n_s, heads, dv), evt)

    def index_scores(self, q: np.ndarray, k: np.ndarray, weights: np.ndarray, scale: float) -> np.ndarray:
        n_s, heads, d = q.shape
        n_keys = k.shape[0]
        evt = self._index_scores(q, k, weights, scale)
        return self.get("scores", (n_s, n_keys), evt)

    def _index_scores(self, q, k, weights, scale):
        n_s, heads, d = q.shape
        n_keys = k.shape[0]
        qb, kb, wb = self.put("q", q), self.put("k", k), self.put("iw", weights)
        sb = self.out("scores", n_s * n_keys * 4)
        return self.kernel("index_scores")(self.queue, (n_keys, n_s), None, qb, kb, wb, sb, heads, d, n_keys, scale,
                                            1.0)

    def topk(self, scores: np.ndarray, allowed: np.ndarray, k: int) -> np.ndarray:
        """`[S, T]` bool: the k largest allowed scores of each row (every allowed key when fewer than k)."""
        self.put("scores", scores)
        return self._topk(allowed, k, scores.shape)

    def _topk(self, allowed: np.ndarray, k: int, shape: tuple[int, int]) -> np.ndarray:
        n_s, n_keys = shape
        ab = self.put("mask", allowed, np.uint8)
        ob, chosen = self.out("sel", n_s * n_keys), self.out("chosen", 4 * n_s * k)
        name, size, local = self.topk_kernel(n_s)
        evt = self.kernel(name)(self.queue, size, local, self._slots["scores"][1], ab, ob, chosen, n_keys, k, n_s)
        return self.get("sel", shape, evt, np.uint8).astype(bool)

    def index_topk(self, q: np.ndarray, k: np.ndarray, weights: np.ndarray, scale: float, allowed: np.ndarray,
                   topk: int) -> np.ndarray:
        """Indexer scores and the top-k selection in one round trip (scores stay on the device)."""
        self._index_scores(q, k, weights, scale)
        return self._topk(allowed, topk, (q.shape[0], k.shape[0]))


def signature(name: str) -> list:
    """Scalar argument types of a kernel (None for buffers); the quant kernels by their family, the name without
    its weight type (`mv_q4` -> mv, `mv_q4_x8` -> mv_x8, `mla_query_q8` -> mla_query)."""
    return SIGNATURES[name if name in SIGNATURES else _WEIGHT_TYPE.sub("", name)]


class Launch:
    """A kernel with its arguments bound, on its own kernel object: enqueue it as often as needed, changing
    single arguments in between (the device decode step's per-token positions and cache buffers)."""

    def __init__(self, kernels: Kernels, name: str, size: tuple[int, ...], local: tuple[int, ...] | None,
                 args: tuple) -> None:
        self.queue = kernels.queue
        self.kernel = kernels.new_kernel(name)
        self.kernel.set_args(*args)
        self.args = list(args)  # an OpenCL kernel does not keep its buffers alive: this does
        self.types = signature(name)
        self.size, self.local = size, local

    def set(self, index: int, value) -> None:
        if self.args[index] is value or (self.types[index] is not None and self.args[index] == value):
            return  # unchanged (most arguments stay put from token to token)
        kind = self.types[index]
        if kind is None:
            self.kernel.set_arg(index, value)
        else:  # as pyopencl's own invokers set scalars: set_arg's type dispatch took ~6 us a call, this ~0.1 us
            self.kernel._set_arg_buf(index, kind(value))
        self.args[index] = value

    def enqueue(self):
        return cl.enqueue_nd_range_kernel(self.queue, self.kernel, self.size, self.local)


class WeightMemory:
    """Where a weight's bytes live on the device.

    unified: a read-only mapping is wrapped in place, in windows no larger than the device's largest
    allocation (windows overlap by half, so any range of up to half a window lies inside one); arrays that
    are not in a mapping (e.g. experts pinned in RAM) get their own in-place buffer.
    discrete: arrays are uploaded once into arenas and kept while `budget` bytes last; `place` returns None
    for an array that does not fit (the caller computes it on the host).
    """

    def __init__(self, kernels: Kernels, unified: bool, budget: int) -> None:
        self.k = kernels
        self.unified = unified
        self.budget = budget
        self.used = 0
        self.window = max(ALIGN, (min(kernels.info.max_alloc, 1 << 40) // ALIGN) * ALIGN)
        # id(mmap) -> (a uint8 view keeping it exported, base address, size, {window index: buffer})
        self._maps: dict[int, tuple[np.ndarray, int, int, dict[int, object]]] = {}
        self._own: dict[tuple[int, int], tuple[object, int, np.ndarray]] = {}  # (addr, nbytes) -> (buf, off, keep)
        self._arenas: list[list] = []  # [buffer, used bytes]

    def _mapping(self, arr: np.ndarray):
        base = arr
        while isinstance(base, np.ndarray):
            base = base.base
        if isinstance(base, memoryview):
            base = base.obj
        if not isinstance(base, mmap.mmap):
            return None
        entry = self._maps.get(id(base))
        if entry is None:
            view = np.frombuffer(base, np.uint8)
            entry = (view, address(view), view.nbytes, {})
            self._maps[id(base)] = entry
        return entry

    def locate(self, start: int, stop: int, arrays: tuple[np.ndarray, ...]) -> tuple[object, int] | None:
        """(buffer, byte offset of `start`) for the address range [start, stop) that `arrays` lie in."""
        if self.unified:
            entry = self._mapping(arrays[0])
            if entry is not None and all(self._mapping(a) is entry for a in arrays[1:]):
                view, base, size, windows = entry
                half = self.window // 2
                index = (start - base) // half
                w_start = index * half
                if stop - base <= w_start + self.window:
                    buf = windows.get(index)
                    if buf is None:
                        region = view[w_start:min(size, w_start + self.window)]
                        buf = cl.Buffer(self.k.ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.USE_HOST_PTR, hostbuf=region)
                        windows[index] = buf
                    return buf, start - base - w_start
        if len(arrays) == 1:
            return self._own_buffer(arrays[0])
        if not self.unified:
            # several tensors of one mapping (an expert's contiguous range): uploaded together, once
            entry = self._mapping(arrays[0])
            if entry is not None and all(self._mapping(a) is entry for a in arrays[1:]):
                return self._own_buffer(entry[0][start - entry[1]:stop - entry[1]])
        return None  # the caller places them one by one

    def _own_buffer(self, arr: np.ndarray) -> tuple[object, int] | None:
        key = (address(arr), arr.nbytes)
        have = self._own.get(key)
        if have is not None:
            return have[0], have[1]
        data = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        if self.unified:
            flags = cl.mem_flags.READ_ONLY | cl.mem_flags.USE_HOST_PTR
            buf, off = cl.Buffer(self.k.ctx, flags, hostbuf=data if data.flags.writeable else data.copy()), 0
        else:
            placed = self._upload(data)
            if placed is None:
                return None
            buf, off = placed
        self._own[key] = (buf, off, arr)  # keeps arr alive: its address stays this key's
        return buf, off

    def _upload(self, data: np.ndarray) -> tuple[object, int] | None:
        nbytes = data.nbytes
        if self.used + nbytes > self.budget:
            return None
        size = max(nbytes, min(ARENA_BYTES, self.k.info.max_alloc))
        for arena in self._arenas:
            off = -(-arena[1] // 256) * 256
            if off + nbytes <= arena[2]:
                break
        else:
            arena = [cl.Buffer(self.k.ctx, cl.mem_flags.READ_ONLY, size), 0, size]
            self._arenas.append(arena)
            off = 0
        cl.enqueue_copy(self.k.queue, arena[0], data, dst_offset=off, is_blocking=True)
        arena[1] = off + nbytes
        self.used += nbytes
        return arena[0], off

    def is_kept(self, arr: np.ndarray) -> bool:
        """Whether arr's bytes stay where they are: in a mapping, or referenced by a buffer of ours."""
        return self._mapping(arr) is not None or (address(arr), arr.nbytes) in self._own

    def weight(self, packed: np.ndarray, scales: np.ndarray | None, bits: int, group: int | None,
               shape: tuple[int, int]) -> ClWeight | None:
        """A ClWeight for a (packed, scales) pair or a float32 matrix (scales None, bits 32); None if over budget."""
        rows, n_in = shape
        if scales is None:
            placed = self._place_one(packed)
            if placed is None:
                return None
            return ClWeight(placed[0], placed[1], placed[0], placed[1], 32, 0, 1, rows, n_in, n_in * 4)
        p, s = self._place_one(packed), self._place_one(scales)
        if p is None or s is None:
            return None
        n_groups = 1 if not group else -(-n_in // group)
        return ClWeight(p[0], p[1], s[0], s[1], bits, group or 0, n_groups, rows, n_in, packed.shape[1])

    def _place_one(self, arr: np.ndarray) -> tuple[object, int] | None:
        start = address(arr)
        return self.locate(start, start + arr.nbytes, (arr,))
