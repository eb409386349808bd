"""Reading safetensors headers as untrusted input, and the tensor bytes they point to.

The stock `safetensors` NumPy API cannot return BF16 or FP8 tensors, so glmkit parses the header
itself and reads (or maps) the bytes with ml-dtypes' NumPy dtypes. Layout: 8-byte little-endian
header length N, N bytes of JSON `{name: {dtype, shape, data_offsets: [begin, end]}}`, then the data;
offsets are relative to the data section.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from glmkit.errors import GlmkitError

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}

MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes sit in a file. `start` is an absolute file offset."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    nbytes: int

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """Parse and check a safetensors header: sizes, dtypes, shapes and offsets must all agree."""
    path = Path(path)
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise GlmkitError(f"{path}: truncated safetensors file ({file_size} bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(MAX_HEADER_BYTES, file_size - 8):
                raise GlmkitError(f"{path}: safetensors header length {header_len} exceeds the file size")
            raw = f.read(header_len)
    except OSError as e:
        raise GlmkitError(f"{path}: cannot read ({e.strerror})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise GlmkitError(f"{path}: safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise GlmkitError(f"{path}: safetensors header is not a JSON object")

    return check_header(path, header, 8 + header_len, file_size - 8 - header_len)


def check_header(path: str | Path, header: dict, data_start: int, data_len: int) -> dict[str, TensorInfo]:
    """Check a decoded header against a data section of `data_len` bytes starting at `data_start`."""
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _check_entry(Path(path), name, entry, data_start, data_len)
    spans = sorted((t.start, t.start + t.nbytes, t.name) for t in tensors.values())
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:], strict=False):
        if begin < end:
            raise GlmkitError(f"{path}: tensors {a!r} and {b!r} overlap")
    return tensors


def _check_entry(path: Path, name: str, entry: object, data_start: int, data_len: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise GlmkitError(f"{path}: header entry for {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPES:
        raise GlmkitError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise GlmkitError(f"{path}: tensor {name!r} has an invalid shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets) or not 0 <= offsets[0] <= offsets[1]):
        raise GlmkitError(f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}")
    begin, end = offsets
    expected = math.prod(shape) * DTYPES[dtype].itemsize
    if end - begin != expected:
        raise GlmkitError(f"{path}: tensor {name!r} spans {end - begin} bytes but shape {shape} {dtype} "
                          f"needs {expected}")
    if end > data_len:
        raise GlmkitError(f"{path}: tensor {name!r} ends at byte {data_start + end} past the end of the file "
                          f"({data_start + data_len} bytes): truncated or lying header")
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, end - begin)


def read_tensor(path: str | Path, info: TensorInfo, first: int = 0, count: int | None = None) -> np.ndarray:
    """Read a tensor (or rows `first .. first+count` of its leading dimension) into a fresh array.

    Uses pread, not mmap, so a converter's resident memory stays at one tensor, not the whole file.
    """
    rows = info.shape[0] if info.shape else 1
    count = rows - first if count is None else count
    row_bytes = info.nbytes // rows if rows else 0
    out = np.empty((count, *info.shape[1:]) if info.shape else (), dtype=info.np_dtype)
    nbytes = count * row_bytes if info.shape else info.nbytes
    buf = memoryview(out.reshape(-1).view(np.uint8)) if nbytes else memoryview(b"")
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < nbytes:
            n = os.preadv(fd, [buf[done:]], info.start + first * row_bytes + done)
            if n <= 0:
                raise GlmkitError(f"{path}: unexpected end of file reading tensor {info.name!r}")
            done += n
    finally:
        os.close(fd)
    return out


def read_metadata(path: str | Path) -> dict[str, str]:
    """The header's `__metadata__` (string to string); call `read_header` first to validate the file."""
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
    except (OSError, struct.error, UnicodeDecodeError, json.JSONDecodeError):
        raise GlmkitError(f"{path}: cannot read the safetensors header") from None
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise GlmkitError(f"{path}: safetensors __metadata__ must map strings to strings")
    return meta
