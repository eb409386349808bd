"""Streaming writer of container data files (stock safetensors, 64-byte aligned tensors).

Every tensor's storage dtype and shape is known before any weight is converted, so each file's
header is laid out up front; tensors are then streamed into it one at a time, in plan order, and
only one tensor is ever held in memory. safetensors forbids gaps between tensors, so alignment
padding is stored as small `U8` tensors named `__pad.N`; the manifest never lists them.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from glmkit.errors import GlmkitError
from glmkit.format.manifest import ALIGNMENT, FORMAT_NAME, FORMAT_VERSION
from glmkit.format.safetensors_file import DTYPES

PAD_PREFIX = "__pad."


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor as it will be stored: storage dtype name and storage shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


@dataclass
class FileLayout:
    name: str
    header: bytes  # the complete 8-byte length prefix + padded JSON header
    tensors: list[tuple[PlannedTensor, int]]  # (tensor, absolute offset), in write order
    size: int


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def layout_files(units: list[list[PlannedTensor]], max_file_bytes: int) -> list[FileLayout]:
    """Assign units (tensors that must stay contiguous, e.g. one expert) to files, in order."""
    groups: list[list[PlannedTensor]] = [[]]
    size = 0
    for unit in units:
        unit_bytes = sum(_align(t.nbytes) for t in unit)
        if groups[-1] and size + unit_bytes > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].extend(unit)
        size += unit_bytes
    count = len(groups)
    return [_layout_one(f"model-{i + 1:05d}-of-{count:05d}.safetensors", g) for i, g in enumerate(groups)]


def _layout_one(name: str, tensors: list[PlannedTensor]) -> FileLayout:
    header: dict[str, object] = {"__metadata__": {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION)}}
    relative: list[int] = []
    pos = 0
    for t in tensors:
        aligned = _align(pos)
        if aligned != pos:
            header[f"{PAD_PREFIX}{len(relative)}"] = {"dtype": "U8", "shape": [aligned - pos],
                                                      "data_offsets": [pos, aligned]}
            pos = aligned
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        relative.append(pos)
        pos += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (_align(8 + len(text)) - 8 - len(text))  # data section starts aligned
    data_start = 8 + len(text)
    return FileLayout(name, struct.pack("<Q", len(text)) + text,
                      [(t, data_start + r) for t, r in zip(tensors, relative, strict=True)], data_start + pos)


class DataFileWriter:
    """Writes one laid-out file under a temporary name; `finish()` renames it into place."""

    def __init__(self, directory: Path, layout: FileLayout):
        self.layout = layout
        self.path = directory / layout.name
        self.tmp_path = directory / (layout.name + ".tmp")
        self._file = open(self.tmp_path, "wb")
        self._file_hash = hashlib.sha256()
        self._emit(layout.header)
        self._pos = len(layout.header)
        self._pending: Iterator[tuple[PlannedTensor, int]] = iter(layout.tensors)

    def _emit(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._file_hash.update(data)

    def write(self, name: str, array: np.ndarray) -> tuple[int, str]:
        """Write the next planned tensor; returns (absolute offset, sha256 of its bytes)."""
        return self.write_rows(name, [array])

    def write_rows(self, name: str, blocks: Iterable[np.ndarray]) -> tuple[int, str]:
        """Write the next planned tensor from consecutive blocks of its rows (so only one block need exist at a
        time); returns (absolute offset, sha256 of its bytes). The blocks must add up to the planned shape."""
        planned, offset = next(self._pending)
        if planned.name != name:
            raise GlmkitError(f"{self.path.name}: expected tensor {planned.name!r} next, got {name!r}")
        self._emit(b"\0" * (offset - self._pos))
        digest = hashlib.sha256()
        rows = 0
        for block in blocks:
            block = np.ascontiguousarray(block)
            if block.dtype != DTYPES[planned.dtype] or tuple(block.shape[1:]) != planned.shape[1:]:
                raise GlmkitError(f"{self.path.name}: tensor {name!r} has a block {block.dtype}{list(block.shape)}, "
                                  f"planned {planned.dtype}{list(planned.shape)}")
            data = memoryview(block.reshape(-1).view(np.uint8))
            self._emit(data)
            digest.update(data)
            rows += block.shape[0] if block.ndim else 1
            del block, data  # not alive while the next block is made
        if rows != (planned.shape[0] if planned.shape else 1):
            raise GlmkitError(f"{self.path.name}: tensor {name!r} got {rows} rows, planned "
                              f"{planned.dtype}{list(planned.shape)}")
        self._pos = offset + planned.nbytes
        return offset, digest.hexdigest()

    def finish(self) -> dict[str, object]:
        """Close and rename into place; returns the file's manifest record."""
        if next(self._pending, None) is not None:
            raise GlmkitError(f"{self.path.name}: closed before all planned tensors were written")
        self._file.close()
        self.tmp_path.replace(self.path)
        return {"nbytes": self._pos, "sha256": self._file_hash.hexdigest()}

    def abort(self) -> None:
        self._file.close()
        self.tmp_path.unlink(missing_ok=True)
