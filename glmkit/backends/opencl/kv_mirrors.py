"""A discrete device's copies of the KV rows that the decode step reads and writes (`KVMirrors`).

A discrete GPU's kernels cannot read the host's cache arrays (`LayerKV`), so each field of each layer's rows has one
copy in device memory, shared by every form of the step (single token, MTP's rows, a batch of sequences), kept
equal to the host's rows before each forward (`LayerKV.edited_from`: the rows the host wrote since) and freed with
the rows. Together they stay within the memory the device's weights leave (`OpenCLBackend.kv_room`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import numpy as np

from glmkit.errors import DeviceMemoryError
from glmkit.units import format_size


class CacheCopy:
    """Discrete devices: one cache field of one layer's rows (`LayerKV`) in device memory (`nbytes`, rows of the
    host array's `capacity`). The kernels read and write the rows there; `rows` of them are known equal to the host's
    (the rows the host edited since are uploaded before a forward)."""

    def __init__(self, buf, capacity: int, nbytes: int) -> None:
        self.buf, self.capacity, self.nbytes, self.rows = buf, capacity, nbytes, 0


class _LayerCopies:
    """The copies of one layer's rows (`LayerKV`): per field, and the number of the forward that used them last."""

    def __init__(self, used: int) -> None:
        self.fields: dict[str, CacheCopy] = {}
        self.used = used


class KVMirrors:
    """A discrete device's copies of the KV rows: per layer's rows (`LayerKV`) and field one copy, whichever step or
    token row uses it, freed with the rows. All copies together stay within `room()` bytes (None: no bound): a copy
    that does not fit first drops the copies of the sequences used least recently (the host keeps every row, so a
    dropped copy is sent whole again on its next use, once the queue has finished with it). The copies the forward
    being queued uses are never dropped: where they alone outgrow the room, `copy` raises a `DeviceMemoryError`
    naming `device`."""

    def __init__(self, buffers, room: Callable[[], int] | None = None, device: str = "the device") -> None:
        self.buffers, self.room, self.device = buffers, room, device
        self._copies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # LayerKV -> _LayerCopies
        self.forwards = 0  # forwards begun (`begin_forward`)

    def __len__(self) -> int:
        return len(self._copies)

    def layers(self) -> list:
        """The layers' rows (`LayerKV`) that have copies."""
        return list(self._copies.keys())

    def held_bytes(self) -> int:
        """Bytes of device memory the copies take."""
        return sum(m.nbytes for copies in self._copies.values() for m in copies.fields.values())

    def begin_forward(self) -> None:
        """A forward is being queued: the copies it binds (`copy`) are used by it."""
        self.forwards += 1

    def copy(self, kv, name: str, arr: np.ndarray, pos: int) -> CacheCopy:
        """The device copy of field `name` of `kv` (host array `arr`, one row per position) with its rows before `pos`
        equal to the host's: made where there is none or the host array was resized (every row sent), else sent the
        rows the host edited since."""
        copies = self._copies.get(kv)
        if copies is None:
            copies = self._copies[kv] = _LayerCopies(self.forwards)
        copies.used = self.forwards
        m = copies.fields.get(name)
        if m is None or m.capacity != len(arr):  # first use, or the host array resized: every row again
            copies.fields.pop(name, None)
            self._make_room(arr.nbytes)
            m = copies.fields[name] = CacheCopy(self.buffers.device_buffer(arr.nbytes), len(arr), arr.nbytes)
        start = min(m.rows, kv.edited_from, pos)
        if start < pos:
            self.buffers.upload(m.buf, arr[start:pos], start * arr.strides[0])
        m.rows = kv.length  # rows pos..: written by this forward's kernels
        return m

    def _make_room(self, nbytes: int) -> None:
        """Drop the copies of the least recently used layers' rows until `nbytes` more fit the room."""
        if self.room is None:
            return
        room, held = self.room(), self.held_bytes()
        idle = sorted((copies.used, id(kv), kv) for kv, copies in self._copies.items() if copies.used < self.forwards)
        for _, _, kv in idle:
            if held + nbytes <= room:
                break
            self.buffers.queue.finish()  # a forward still in flight may read the copy
            held -= sum(m.nbytes for m in self._copies.pop(kv).fields.values())
        if held + nbytes > room:
            raise DeviceMemoryError(f"{self.device}: the KV rows of the sequences being decoded take "
                                    f"{format_size(held + nbytes)} on the device, more than the "
                                    f"{format_size(max(room, 0))} its weights leave them (a shorter context, a smaller "
                                    f"--kv-dtype, or fewer concurrent requests)")
