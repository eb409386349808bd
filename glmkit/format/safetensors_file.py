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
from glmkit.format.files import open_regular_file, parse_json

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
    """Parse and check a safetensors header: sizes, dtypes, shapes and offsets must all agree, and the tensors
    must tile the data section exactly (as the safetensors library requires), so a header length off by a
    byte, which would shift every tensor, is refused."""
    path = Path(path)
    with open_regular_file(path) as f:
        try:
            file_size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise GlmkitError(f"{path}: truncated safetensors file ({file_size} bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(MAX_HEADER_BYTES, file_size - 8):
                raise GlmkitError(f"{path}: safetensors header length {header_len} exceeds the file size")
            raw = f.read(header_len)
        except OSError as e:
            raise GlmkitError(f"{path}: cannot read ({e.strerror})") from None
    if len(raw) != header_len:
        raise GlmkitError(f"{path}: truncated safetensors header ({len(raw)} of {header_len} bytes)")
    header = parse_json(raw, f"{path}: safetensors header")
    if not isinstance(header, dict):
        raise GlmkitError(f"{path}: safetensors header is not a JSON object")

    return check_header(path, header, 8 + header_len, file_size - 8 - header_len)


def check_header(path: str | Path, header: dict, data_start: int, data_len: int, exact: bool = True
                 ) -> dict[str, TensorInfo]:
    """Check a decoded header against a data section of `data_len` bytes starting at `data_start`.

    exact: the tensors must cover the data section with neither gap nor overlap (a local file); False only
    bounds and separates them (a Hub listing, where `data_len` is the whole file's size)."""
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise GlmkitError(f"{path}: safetensors __metadata__ must map strings to strings")
            continue
        tensors[name] = _check_entry(Path(path), name, entry, data_start, data_len)
    spans = sorted((t.start - data_start, t.start - data_start + t.nbytes, t.name) for t in tensors.values())
    end, last = 0, None
    for begin, stop, name in spans:
        if begin < end:
            raise GlmkitError(f"{path}: tensors {last!r} and {name!r} overlap")
        if exact and begin > end:
            raise GlmkitError(f"{path}: {begin - end} bytes before tensor {name!r} belong to no tensor (data_offsets "
                              "must be contiguous)")
        end, last = stop, name
    if exact and end != data_len:
        raise GlmkitError(f"{path}: the tensors cover {end} bytes of a {data_len}-byte data section: wrong header "
                          "length or data_offsets, or trailing bytes")
    return tensors


def _check_entry(path: Path, name: str, entry: object, data_start: int, data_len: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise GlmkitError(f"{path}: header entry for {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise GlmkitError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise GlmkitError(f"{path}: tensor {name!r} has an invalid shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(_is_count(o) for o in offsets) or not offsets[0] <= offsets[1]):
        raise GlmkitError(f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}")
    begin, end = offsets
    if end > data_len:
        raise GlmkitError(f"{path}: tensor {name!r} ends at byte {data_start + end} past the end of the file "
                          f"({data_start + data_len} bytes): truncated or lying header")
    expected = math.prod(shape) * DTYPES[dtype].itemsize  # shape is bounded by the file only once this matches
    if end - begin != expected:
        raise GlmkitError(f"{path}: tensor {name!r} spans {end - begin} bytes but shape {shape} {dtype} "
                          f"needs {expected}")
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, end - begin)


def _is_count(value: object) -> bool:
    """A non-negative JSON integer (not a boolean, which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


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
