"""Weights on the device: where a weight's bytes live (`WeightMemory`), how the product kernels address them
(`ClWeight`, `ExpertShape`) and which kernel variants a weight can take (`x8_eligible`, `mvt_chunked`).

On unified-memory devices a mapped data file is wrapped in place (windows of at most the device's largest
allocation, CL_MEM_USE_HOST_PTR over the read-only mapping: no second copy); on discrete devices weights are
uploaded once into arenas and kept, within a byte budget.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from glmkit.backends.opencl.buffers import ALIGN, Buffers, address
from glmkit.format.tensors import QuantWeight, Weight

ARENA_BYTES = 256 << 20  # discrete devices: weights are uploaded into arenas of this size (or max alloc)
BIT_SUFFIX = {32: "f32", 8: "q8", 4: "q4", 3: "q3", 2: "q2"}  # a product kernel's weight type: mv_q4, eg_q8_x8, ...
SCHEME_SUFFIX = {"nl4": "q4nl"}  # the same for the schemes other than symmetric (mv_q4nl, ...)
X8_BLOCK = 64  # columns per scale of int8-quantized activations (common.cl)


def kernel_suffix(bits: int, scheme: str) -> str:
    """The weight type in the names of the product kernels for `bits`-bit codes of quant scheme `scheme`."""
    return SCHEME_SUFFIX.get(scheme) or BIT_SUFFIX[bits]


def x8_eligible(bits: int, group: int, *widths: int) -> bool:
    """Whether products can take int8 activations: int3, int4 or int8 codes whose scale groups are whole blocks of
    X8_BLOCK columns, every input width (a matrix's columns; an MLP's n_in and inter) a whole number of blocks."""
    return bits in (3, 4, 8) and group > 0 and group % X8_BLOCK == 0 and all(w % X8_BLOCK == 0 for w in widths)


@dataclass(frozen=True)
class ClWeight:
    """A 2-D weight on the device: packed rows at (wbuf, w_off), float scales at (sbuf, s_off).

    bits 32 = float32 rows (no scales); group 0 = one scale per row; scheme: the manifest's quant scheme (nl4:
    int4 bytes whose codes stand for the nl4 table's levels).
    """

    wbuf: Any
    w_off: int
    sbuf: Any
    s_off: int
    bits: int
    group: int
    n_groups: int
    rows: int
    n_in: int
    row_bytes: int
    scheme: str = "symmetric"

    @property
    def suffix(self) -> str:
        """The weight type of its product kernels' names (mv_q4, ...)."""
        return kernel_suffix(self.bits, self.scheme)

    def location(self, tag: str = "") -> dict[str, Any]:
        """Where its bytes are, as kernel arguments (`wbuf, w_off, sbuf, s_off`; with tag "2": wbuf2, ...)."""
        return {f"wbuf{tag}": self.wbuf, f"w_off{tag}": self.w_off, f"sbuf{tag}": self.sbuf, f"s_off{tag}": self.s_off}

    def args(self) -> dict[str, Any]:
        """The weight argument block of the product kernels (WARGS in quant.cl)."""
        return {**self.location(), "n_in": self.n_in, "row_bytes": self.row_bytes, "group": self.group,
                "n_groups": self.n_groups}


def mvt_chunked(w: ClWeight) -> bool:
    """Whether matvec_t's work-items own a 16-byte chunk of each row (int4: 32 columns, int8: 16): chunks in whole
    scale groups (`mvt_chunked` in quant.cl)."""
    cols = {4: 32, 8: 16}.get(w.bits)
    return cols is not None and w.n_in % cols == 0 and w.group % cols == 0


def mvt_global(w: ClWeight, heads: int) -> tuple[int, int]:
    """matvec_t's global size: a work-item per 16-byte chunk of a row where `mvt_chunked`, else per 8 columns."""
    cols = {4: 32, 8: 16}[w.bits] if mvt_chunked(w) else 8
    return -(-w.n_in // cols), heads


def plain_f32(w: Weight) -> bool:
    """Whether w is a float32 matrix the kernels read as rows in place."""
    return not isinstance(w, QuantWeight) and w.dtype == np.float32 and w.ndim == 2 and w.flags.c_contiguous


def fused_expert_arrays(gate: Weight, up: Weight, down: Weight) -> tuple[np.ndarray, ...] | None:
    """The 6 arrays a fused expert launch reads (gate, its scales, up, its scales, down, its scales; float weights
    stand in for their missing scales), or None when the three do not share one scheme."""
    if all(isinstance(w, QuantWeight) for w in (gate, up, down)):
        if len({(w.bits, w.group_size, w.scheme) for w in (gate, up, down)}) != 1:
            return None
        return gate.packed, gate.scales, up.packed, up.scales, down.packed, down.scales
    if all(plain_f32(w) for w in (gate, up, down)):
        return gate, gate, up, up, down, down  # float rows have no scales: the kernels never read them
    return None


@dataclass(frozen=True)
class ExpertShape:
    """How the fused expert kernels read an expert MLP: gate and up `[inter, n_in]`, down `[n_in, inter]`, all with
    `bits` and scale group `group` (0: one scale per row); a gate/up row is `in_row_bytes` bytes with `n_groups`
    scales, a down row `inter_row_bytes` with `inter_groups`; `scheme` as ClWeight's."""

    bits: int
    group: int
    n_groups: int
    n_in: int
    inter: int
    in_row_bytes: int
    inter_row_bytes: int
    inter_groups: int
    scheme: str = "symmetric"

    @property
    def suffix(self) -> str:
        return kernel_suffix(self.bits, self.scheme)

    def gate_up_args(self) -> dict[str, int]:
        """The row shape of gate and up, as arguments of the gate+up kernels (eg_*)."""
        return {"n_in": self.n_in, "row_bytes": self.in_row_bytes, "group": self.group, "n_groups": self.n_groups}

    def down_args(self) -> dict[str, int]:
        """The row shape of down, as arguments of the down kernels (ed_*, edp_*)."""
        return {"n_in": self.inter, "row_bytes": self.inter_row_bytes, "group": self.group,
                "n_groups": self.inter_groups}


class _Mapping(NamedTuple):
    """A read-only file mapping the weights lie in: a uint8 view keeping it exported, its base address and size, and
    the in-place buffers over its windows (window index -> buffer)."""

    view: np.ndarray
    base: int
    size: int
    windows: dict[int, Any]


@dataclass
class _Arena:
    """Discrete devices: device memory weights are uploaded into, `used` of its `size` bytes taken."""

    buffer: Any
    used: int
    size: int


class WeightMemory:
    """Where a weight's bytes live on the device.

    unified: a read-only mapping is wrapped in place, in windows no larger than the device's largest
    allocation (windows overlap by half, so any range of up to half a window lies inside one); arrays that
    are not in a mapping (e.g. experts pinned in RAM) get their own in-place buffer.
    discrete: arrays are uploaded once into arenas and kept while `budget` bytes last; `weight` and `locate`
    return None for arrays that do not fit (the caller computes with them on the host).
    """

    def __init__(self, buffers: Buffers, unified: bool, budget: int) -> None:
        self.buffers = buffers
        self.unified = unified
        self.budget = budget
        self.used = 0
        self.window = max(ALIGN, (min(buffers.max_alloc, 1 << 40) // ALIGN) * ALIGN)
        self._maps: dict[int, _Mapping] = {}  # id(mmap) -> its mapping
        self._own: dict[tuple[int, int], tuple[Any, int, np.ndarray]] = {}  # (addr, nbytes) -> (buf, off, keep)
        self._arenas: list[_Arena] = []

    def _mapping(self, arr: np.ndarray) -> _Mapping | None:
        """The mapping `arr` is a view of (a file's, or anonymous memory mapped to hold weights in one block, e.g.
        the expert cache's slots), or None."""
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
            entry = self._maps[id(base)] = _Mapping(view, address(view), view.nbytes, {})
        return entry

    def locate(self, start: int, stop: int, arrays: tuple[np.ndarray, ...]) -> tuple[Any, int] | None:
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
                        buf = self.buffers.read_only_in_place(view[w_start:min(size, w_start + self.window)])
                        windows[index] = buf
                    return buf, start - base - w_start
        if len(arrays) == 1:
            return self._own_buffer(arrays[0])
        if not self.unified:
            # several tensors of one mapping (an expert's contiguous range): uploaded together, once
            entry = self._mapping(arrays[0])
            if entry is not None and all(self._mapping(a) is entry for a in arrays[1:]):
                return self._own_buffer(entry.view[start - entry.base:stop - entry.base])
        return None  # the caller places them one by one

    def _own_buffer(self, arr: np.ndarray) -> tuple[Any, int] | None:
        key = (address(arr), arr.nbytes)
        have = self._own.get(key)
        if have is not None:
            buf, off, _ = have
            return buf, off
        data = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        if self.unified:
            buf, off = self.buffers.read_only_in_place(data if data.flags.writeable else data.copy()), 0
        else:
            placed = self._upload(data)
            if placed is None:
                return None
            buf, off = placed
        self._own[key] = (buf, off, arr)  # keeps arr alive: its address stays this key's
        return buf, off

    def _upload(self, data: np.ndarray) -> tuple[Any, int] | None:
        nbytes = data.nbytes
        if self.used + nbytes > self.budget:
            return None
        size = max(nbytes, min(ARENA_BYTES, self.buffers.max_alloc, self.budget - self.used))  # within the budget
        for arena in self._arenas:
            off = -(-arena.used // 256) * 256
            if off + nbytes <= arena.size:
                break
        else:
            arena = _Arena(self.buffers.read_only(size), 0, size)
            self._arenas.append(arena)
            off = 0
        self.buffers.upload(arena.buffer, data, off).wait()
        arena.used = off + nbytes
        self.used += nbytes
        return arena.buffer, off

    @property
    def device_bytes(self) -> int:
        """Bytes of device memory the weights' arenas take (discrete devices; 0 where memory is unified)."""
        return sum(arena.size for arena in self._arenas)

    def is_kept(self, arr: np.ndarray) -> bool:
        """Whether arr's bytes stay where they are: in a mapping, or referenced by a buffer of ours."""
        return self._mapping(arr) is not None or (address(arr), arr.nbytes) in self._own

    def weight(self, packed: np.ndarray, scales: np.ndarray | None, bits: int, group: int | None,
               shape: tuple[int, int], scheme: str = "symmetric") -> ClWeight | None:
        """A ClWeight for a (packed, scales) pair or a float32 matrix (scales None, bits 32); None if over budget."""
        rows, n_in = shape
        if scales is None:
            placed = self._place_one(packed)
            if placed is None:
                return None
            buf, off = placed
            return ClWeight(buf, off, buf, off, 32, 0, 1, rows, n_in, n_in * 4)  # float rows: no scales read
        codes, scale_rows = self._place_one(packed), self._place_one(scales)
        if codes is None or scale_rows is None:
            return None
        n_groups = 1 if not group else -(-n_in // group)
        return ClWeight(*codes, *scale_rows, bits, group or 0, n_groups, rows, n_in, packed.shape[1], scheme)

    def _place_one(self, arr: np.ndarray) -> tuple[Any, int] | None:
        start = address(arr)
        return self.locate(start, start + arr.nbytes, (arr,))
