"""The memory the kernels of one device work in: host arrays with their buffers (`DeviceArray`), device memory,
sub-buffers, the copies between host and device, and the named staging slots of per-operation calls.

- `direct` devices (CPU devices such as PoCL's): a buffer wraps a page-aligned host array, used in place
  (CL_MEM_USE_HOST_PTR): writing the array is writing the buffer, no transfer commands.
- other devices: a buffer is device memory of its own; `upload` / `download` queue non-blocking copies on the
  device's in-order queue.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from glmkit.backends.opencl.device import cl

ALIGN = 4096  # host staging alignment: lets CL_MEM_USE_HOST_PTR use the memory in place
KEEP_SLOT_BYTES = 8 << 20  # staging buffers up to this size are kept between operations; larger ones (prefill
# activations, attention scores) are released after the operation that needed them, so they do not stay resident


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialized uint8 array of `nbytes` starting at an ALIGN boundary."""
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + nbytes]


def address(arr: np.ndarray) -> int:
    """The address of an array's first byte."""
    return arr.__array_interface__["data"][0]


@dataclass(frozen=True, slots=True)
class DeviceArray:
    """A page-aligned host array and the buffer kernels see it as: on direct devices the same memory, elsewhere
    device memory of its own that `Buffers.to_device` / `Buffers.to_host` copy to and from."""

    host: np.ndarray
    buffer: Any


class Int8Codes(NamedTuple):
    """The buffers of int8-quantized rows (common.cl): codes in two orders (2 bytes per value), and per block of
    X8_BLOCK values a float scale and an int code sum."""

    codes: Any
    scales: Any
    sums: Any

    def args(self, row: str = "") -> dict[str, Any]:
        """As kernel arguments: `q, qs, qsum`, or in a kernel that takes the codes of several rows `{row}q, {row}s,
        {row}sum` (row "x": xq, xs, xsum)."""
        stem = row or "q"
        return {f"{row}q": self.codes, f"{stem}s": self.scales, f"{stem}sum": self.sums}

    @classmethod
    def unused(cls, buf: Any) -> Int8Codes:
        """The codes arguments of a kernel told not to write codes (quantize 0): any buffer, `buf`."""
        return cls(buf, buf, buf)


@dataclass
class _Slot:
    host: np.ndarray | None  # direct devices: the memory the buffer wraps
    buffer: Any
    nbytes: int


class Buffers:
    """Buffers of one device (context `ctx`, in-order `queue`); `direct`: buffers use host arrays in place;
    base_align: the bytes a sub-buffer's origin must be a multiple of; max_alloc: the largest buffer in bytes."""

    def __init__(self, ctx: Any, queue: Any, direct: bool, base_align: int, max_alloc: int) -> None:
        self.ctx, self.queue, self.direct = ctx, queue, direct
        self.base_align, self.max_alloc = base_align, max_alloc
        self._slots: dict[str, _Slot] = {}
        self._large_slots = False  # whether a slot over KEEP_SLOT_BYTES exists (released after its operation)

    # ---- buffers that stay ------------------------------------------------------------------------

    def array(self, count: int, dtype: Any = np.float32) -> DeviceArray:
        """A page-aligned host array of `count` items (uninitialized) and its buffer."""
        host = aligned_empty(max(count, 1) * np.dtype(dtype).itemsize).view(dtype)
        return DeviceArray(host, self.wrap(host) if self.direct else self.device_buffer(host.nbytes))

    def filled(self, values: Any, dtype: Any = np.float32) -> DeviceArray:
        """A `DeviceArray` holding `values` (flattened), on the device too."""
        values = np.asarray(values, dtype).reshape(-1)
        a = self.array(values.size, dtype)
        a.host[:] = values
        self.to_device(a)
        return a

    def device_buffer(self, nbytes: int) -> Any:
        """Device memory of its own (no host array)."""
        return cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, max(nbytes, 4))

    def wrap(self, arr: np.ndarray) -> Any:
        """Direct devices: a read-write buffer over a writable host array, used in place (no copy)."""
        assert self.direct and arr.flags.writeable and arr.flags.c_contiguous
        return cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.USE_HOST_PTR, hostbuf=arr)

    def read_only_in_place(self, arr: np.ndarray) -> Any:
        """A read-only buffer over host memory (e.g. a window of a mapped file), used in place where the device
        shares host memory."""
        return cl.Buffer(self.ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.USE_HOST_PTR, hostbuf=arr)

    def read_only(self, nbytes: int) -> Any:
        """Device memory the kernels only read (weight arenas)."""
        return cl.Buffer(self.ctx, cl.mem_flags.READ_ONLY, nbytes)

    def sub_buffer(self, buf: Any, offset: int, nbytes: int) -> Any:
        """The bytes [offset, offset + nbytes) of `buf` as a buffer of their own (offset: a `base_align` multiple)."""
        return buf.get_sub_region(offset, nbytes)

    def aligned_items(self, count: int, itemsize: int = 4) -> int:
        """`count` rounded up so that consecutive regions of it start where sub-buffers may (`base_align`)."""
        quantum = max(1, self.base_align // itemsize)
        return -(-count // quantum) * quantum

    # ---- copies -----------------------------------------------------------------------------------

    def upload(self, buf: Any, arr: np.ndarray, offset: int = 0) -> Any:
        """Queue a copy of `arr` into `buf` at byte `offset` (non-blocking: arr must stay as it is until done)."""
        return cl.enqueue_copy(self.queue, buf, arr, dst_offset=offset, is_blocking=False)

    def download(self, arr: np.ndarray, buf: Any, offset: int = 0) -> Any:
        """Queue a copy of `arr.nbytes` bytes of `buf` from byte `offset` into `arr`; returns its event."""
        return cl.enqueue_copy(self.queue, arr, buf, src_offset=offset, is_blocking=False)

    def to_device(self, a: DeviceArray) -> None:
        """Discrete devices: queue the copy of a's host array into its buffer (direct devices share it)."""
        if not self.direct:
            self.upload(a.buffer, a.host)

    def to_host(self, a: DeviceArray) -> Any:
        """Discrete devices: queue the copy of a's buffer into its host array; its event (None when direct)."""
        return None if self.direct else self.download(a.host, a.buffer)

    # ---- staging slots of per-operation calls -----------------------------------------------------

    def _slot(self, name: str, nbytes: int) -> _Slot:
        """A persistent staging buffer of at least nbytes (grown to the next power of two)."""
        have = self._slots.get(name)
        if have is not None and have.nbytes >= nbytes:
            return have
        size = max(4096, 1 << max(nbytes - 1, 1).bit_length())
        if self.direct:
            host = aligned_empty(size)
            slot = _Slot(host, self.wrap(host), size)
        else:
            slot = _Slot(None, self.device_buffer(size), size)
        self._slots[name] = slot
        self._large_slots |= size > KEEP_SLOT_BYTES
        return slot

    def put(self, name: str, arr: np.ndarray, dtype: Any = np.float32) -> Any:
        """Stage an input array in slot `name`; returns its buffer."""
        arr = np.ascontiguousarray(arr, dtype=dtype)
        slot = self._slot(name, max(arr.nbytes, 4))
        if self.direct:
            slot.host[:arr.nbytes].view(arr.dtype)[:] = arr.reshape(-1)
        elif arr.nbytes:
            self.upload(slot.buffer, arr)
        return slot.buffer

    def out(self, name: str, nbytes: int) -> Any:
        """The buffer of slot `name` for an output of `nbytes`."""
        return self._slot(name, max(nbytes, 4)).buffer

    def staged(self, name: str) -> Any:
        """The buffer of slot `name` as last put or written."""
        return self._slots[name].buffer

    def get(self, name: str, shape: tuple[int, ...], event: Any, dtype: Any = np.float32, copy: bool = True
            ) -> np.ndarray:
        """The result in slot `name` once `event` (the last kernel writing it) has completed (a copy, or with
        copy=False on direct devices the staging memory itself, valid until the slot is reused)."""
        count = math.prod(shape)
        slot = self._slots[name]
        if self.direct:
            event.wait()
            view = slot.host[:count * np.dtype(dtype).itemsize].view(dtype).reshape(shape)
            result = view.copy() if copy else view  # a view keeps its memory alive after the slot is dropped
        else:
            result = np.empty(shape, dtype)
            if count:
                cl.enqueue_copy(self.queue, result, slot.buffer, is_blocking=True)
        self._release_large()
        return result

    def _release_large(self) -> None:
        """Drop staging buffers over KEEP_SLOT_BYTES (the operation that used them has completed)."""
        if self._large_slots:
            self._slots = {k: v for k, v in self._slots.items() if v.nbytes <= KEEP_SLOT_BYTES}
            self._large_slots = False
