"""`Container`: a converted snapshot opened zero-copy (one read-only mmap per data file)."""

from __future__ import annotations

import functools
import hashlib
import mmap
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np

from glmkit.errors import GlmkitError
from glmkit.format.config import MAX_CONFIG_BYTES, ModelConfig
from glmkit.format.files import parse_json, parse_large_json
from glmkit.format.manifest import (
    MANIFEST_NAME,
    ExpertRange,
    Manifest,
    TensorEntry,
    collector_paused,
    open_in_container,
    read_container_file,
    read_exact,
    short_repr,
)
from glmkit.format.safetensors_file import DTYPES
from glmkit.format.schema import EXPERT_PROJECTIONS, expert_weight_name, tensor_layer
from glmkit.format.tensors import QuantWeight, Weight
from glmkit.format.writer import PAD_PREFIX

HEADER_BASE_BYTES = 4096
HEADER_BYTES_PER_TENSOR = 256
VERIFY_BLOCK_BYTES = 16 << 20


class Container:
    """Manifest + mapped data files. `weight(name)` returns views into the mapping, never copies.

    Opening checks everything before mapping anything: the manifest (`Manifest.read`), config.json against its
    recorded digest, the manifest against the model (`Manifest.check_model`), and each data file: a regular file
    in the container, of the recorded size, whose safetensors header lists exactly the manifest's tensors where
    the manifest puts them. A container that fails any check raises a one-line GlmkitError.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise GlmkitError(f"{self.directory}: snapshot directory not found")
        # kept open for verify_data: it reads the very files that are mapped, with bounded reads
        self._files: dict[str, BinaryIO] = {}
        self._maps: dict[str, mmap.mmap] = {}
        self._weights: dict[str, Weight] = {}
        with collector_paused():
            self.manifest = Manifest.read(self.directory)
            config_path = self.directory / "config.json"
            config_bytes = read_container_file(self.directory, "config.json", MAX_CONFIG_BYTES)
            if hashlib.sha256(config_bytes).hexdigest() != self.manifest.config_sha256:
                raise GlmkitError(f"{config_path}: does not match the manifest (edited after conversion)")
            config = parse_json(config_bytes, str(config_path))  # the very bytes hashed, not a second read
            if not isinstance(config, dict):
                raise GlmkitError(f"{config_path}: config must be a JSON object")
            self.config = ModelConfig.from_dict(config, source=str(config_path))
            self.manifest.check_model(self.directory / MANIFEST_NAME, self.config)
            self._by_file: dict[str, list[TensorEntry]] = {name: [] for name in self.manifest.files}
            for e in self.manifest.tensors.values():
                self._by_file[e.file].append(e)
            try:
                for name in self.manifest.files:
                    self._files[name] = self._open_data_file(name)
                for name, f in self._files.items():
                    self._maps[name] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except BaseException:
                self.close()
                raise
            self._experts = {(r.layer, r.expert): r for r in self.manifest.experts}
            # views on the mappings, made once (decode asks ~300 times a token) and all here, before any compute
            # allocates: long-lived objects made among freed temporaries would pin the heap
            for name, e in self.manifest.tensors.items():
                if e.role != "scales":
                    self.weight(name)

    def _open_data_file(self, name: str) -> BinaryIO:
        """The checked data file, open: a regular file in the container, of the manifest's size, with a
        safetensors header that agrees with the manifest (`_check_header`)."""
        path = self.directory / name
        f = open_in_container(self.directory, name)
        try:
            size, nbytes = os.fstat(f.fileno()).st_size, self.manifest.files[name]["nbytes"]
            if size != nbytes:
                raise GlmkitError(f"{path}: {size} bytes on disk but the manifest says {nbytes} (truncated?)")
            self._check_header(path, f.fileno(), self._by_file[name])
        except BaseException:
            f.close()
            raise
        return f

    @staticmethod
    def _check_header(path: Path, fd: int, entries: list[TensorEntry]) -> None:
        """The data file's safetensors header lists exactly the manifest's tensors of this file (and `__pad.N`
        padding), each with the manifest's storage dtype, shape and byte range."""
        (header_len,) = struct.unpack("<Q", read_exact(fd, path, 0, 8))
        size = os.fstat(fd).st_size
        # the writer's header: ~100 bytes a tensor beyond its name, and as much again for a padding entry
        limit = HEADER_BASE_BYTES + sum(len(e.name) + HEADER_BYTES_PER_TENSOR for e in entries)
        if header_len > min(limit, size - 8):
            raise GlmkitError(f"{path}: safetensors header length {header_len} exceeds what the file holds or its "
                              f"{len(entries)} tensors need")
        header = parse_large_json(path, read_exact(fd, path, 8, header_len))
        if not isinstance(header, dict):
            raise GlmkitError(f"{path}: safetensors header is not a JSON object")
        data_start = 8 + header_len
        for e in entries:
            got = header.get(e.name)
            start = e.offset - data_start
            if (start < 0 or type(got) is not dict or got.get("data_offsets") != [start, start + e.nbytes]
                    or got.get("dtype") != e.dtype or got.get("shape") != list(e.stored_shape)):
                want = {"dtype": e.dtype, "shape": list(e.stored_shape), "data_offsets": [start, start + e.nbytes]}
                raise GlmkitError(f"{path}: tensor {e.name!r}: the file's safetensors header ({data_start} bytes) "
                                  f"has {short_repr(got)}, the manifest {want}")
        listed = {e.name for e in entries}
        extra = next((n for n in header if n not in listed and n != "__metadata__" and not n.startswith(PAD_PREFIX)),
                     None)
        if extra is not None:
            raise GlmkitError(f"{path}: the safetensors header lists tensor {short_repr(extra)}, which the manifest "
                              "does not")

    @property
    def model_hash(self) -> str:
        return self.manifest.model_hash

    @property
    def nbytes(self) -> int:
        return sum(int(r["nbytes"]) for r in self.manifest.files.values())

    @functools.cached_property
    def layer_nbytes(self) -> tuple[int, ...]:
        """Bytes of each decoder layer's tensors (routed experts and scales included), the MTP layer's last: one pass
        over the manifest, kept (the sizing of a cache and of pipeline stages asks several times)."""
        sizes = [0] * self.config.num_layers_with_mtp
        for name, entry in self.manifest.tensors.items():
            layer = tensor_layer(name)
            if layer is not None and layer < len(sizes):
                sizes[layer] += entry.nbytes
        return tuple(sizes)

    def layers_nbytes(self, layers: range) -> int:
        """Bytes of the tensors of decoder layers `layers` (`layer_nbytes`): a pipeline stage's part."""
        return sum(self.layer_nbytes[layers.start:layers.stop])

    def has(self, name: str) -> bool:
        return name in self.manifest.tensors

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.manifest.tensors[name]
        except KeyError:
            raise GlmkitError(f"{self.directory}: tensor {name!r} is not in the container") from None

    def raw(self, name: str) -> np.ndarray:
        """The stored array (packed bytes for quantized weights), a read-only view."""
        e = self.entry(name)
        # one array object straight on the mapping (its base): frombuffer + reshape make three, which adds up
        # over GLM-5's ~120,000 tensors
        return np.ndarray(e.stored_shape, DTYPES[e.dtype], buffer=self._maps[e.file], offset=e.offset)

    def weight(self, name: str) -> Weight:
        """A float32 view, or a QuantWeight of views for quantized 2-D weights (the same object every call)."""
        w = self._weights.get(name)
        if w is None:
            e = self.entry(name)
            if e.quant is None:
                w = self.raw(name)
            else:
                w = QuantWeight(self.raw(name), self.raw(e.quant.scales), e.quant.bits, e.quant.group_size,
                                (e.shape[0], e.shape[1]), e.quant.scheme)
            self._weights[name] = w
        return w

    def expert_range(self, layer: int, expert: int) -> ExpertRange:
        return self._experts[(layer, expert)]

    def expert_bytes(self, layer: int, expert: int) -> np.ndarray:
        """The expert's whole contiguous byte range as a read-only uint8 view."""
        r = self._experts[(layer, expert)]
        return np.frombuffer(self._maps[r.file], dtype=np.uint8, count=r.nbytes, offset=r.offset)

    def expert_weights(self, layer: int, expert: int, data: np.ndarray) -> list[Weight]:
        """The expert's (gate, up, down) weights as views on `data`, a uint8 copy of its byte range (e.g. read into
        RAM of the caller's), laid out as `weight` lays them on the mapping."""
        r = self._experts[(layer, expert)]
        if data.nbytes < r.nbytes:
            raise GlmkitError(f"{self.directory}: {data.nbytes} bytes hold no copy of expert {expert} of layer "
                              f"{layer} ({r.nbytes} bytes)")

        def view(name: str) -> np.ndarray:
            e = self.entry(name)
            return np.ndarray(e.stored_shape, DTYPES[e.dtype], buffer=data, offset=e.offset - r.offset)

        out: list[Weight] = []
        for projection in EXPERT_PROJECTIONS:
            name = expert_weight_name(layer, expert, projection)
            e = self.entry(name)
            out.append(view(name) if e.quant is None else
                       QuantWeight(view(name), view(e.quant.scales), e.quant.bits, e.quant.group_size,
                                   (e.shape[0], e.shape[1]), e.quant.scheme))
        return out

    def advise_experts(self, layer: int, experts: list[int], advice: int = mmap.MADV_WILLNEED) -> None:
        """madvise the byte ranges of these experts (e.g. WILLNEED to prefetch them)."""
        for expert in experts:
            r = self._experts.get((layer, expert))
            if r is not None:
                self._advise(r.file, r.offset, r.nbytes, advice)

    def advise_tensors(self, names: list[str], advice: int = mmap.MADV_WILLNEED) -> None:
        """madvise the byte ranges of these tensors and of their scales (e.g. WILLNEED before copying them out of
        the mapping: the disk then reads ahead of the copies instead of one fault at a time)."""
        for name in names:
            e = self.entry(name)
            for entry in (e,) if e.quant is None else (e, self.entry(e.quant.scales)):
                self._advise(entry.file, entry.offset, entry.nbytes, advice)

    def advise_all(self, advice: int = mmap.MADV_WILLNEED, chunk: int = 8 << 20) -> None:
        """madvise every data file's whole mapping, `chunk` bytes a call (`_advise`)."""
        for name, mapped in list(self._maps.items()):
            self._advise(name, 0, len(mapped), advice, chunk)

    def _advise(self, file: str, offset: int, nbytes: int, advice: int, chunk: int = 8 << 20) -> None:
        """madvise the pages under `nbytes` bytes at `offset` of data file `file`, `chunk` bytes a call (Linux reads
        ahead at most its read-ahead window per WILLNEED call: one call over a large range reads only its start)."""
        mapped, end = self._maps[file], offset + nbytes
        for start in range(offset - offset % mmap.PAGESIZE, end, chunk):
            mapped.madvise(advice, start, min(chunk, end - start))

    def release_pages(self) -> None:
        """Unmap every data file's pages from this process (`MADV_DONTNEED`) and drop their clean pages from the page
        cache (`POSIX_FADV_DONTNEED`): for a reader that has copied what it needs, so that a memory cgroup does not
        keep counting them. The mappings stay valid: a later access reads the bytes again."""
        for name, mapped in self._maps.items():
            mapped.madvise(mmap.MADV_DONTNEED)
            fd = os.open(self.directory / name, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def verify_data(self, progress: Callable[[int], None] | None = None) -> list[str]:
        """Re-hash the data files against the sha256 digests the converter recorded: each file whole (`files`),
        and the tensors of a file whose digest differs (`tensors`), to name them.

        Returns the names of the tensors whose bytes differ, in manifest order, then those of the data files whose
        other bytes (safetensors header, padding) differ; [] when every byte matches. Reads each file once in
        blocks of VERIFY_BLOCK_BYTES (a damaged file twice), from the descriptors that are mapped; `progress`,
        if given, is called with each block's byte count. Raises GlmkitError when the container is closed or a
        data file changed size since it was opened (no block is then read past its end).
        """
        if not self._files:
            raise GlmkitError(f"{self.directory}: the container is closed")
        block = memoryview(bytearray(VERIFY_BLOCK_BYTES))
        damaged: set[str] = set()
        files = []
        for name, record in self.manifest.files.items():
            if self._sha256(name, 0, record["nbytes"], block, progress) == record["sha256"]:
                continue
            bad = {e.name for e in self._by_file[name]
                   if self._sha256(name, e.offset, e.nbytes, block, progress) != e.sha256}
            damaged |= bad
            if not bad:
                files.append(name)
        return [name for name in self.manifest.tensors if name in damaged] + files

    def _sha256(self, name: str, offset: int, nbytes: int, block: memoryview,
                progress: Callable[[int], None] | None) -> str:
        """sha256 of bytes `offset .. offset+nbytes` of data file `name`, read through `block`."""
        fd = self._files[name].fileno()
        path = self.directory / name
        size = os.fstat(fd).st_size
        if size != self.manifest.files[name]["nbytes"]:
            raise GlmkitError(f"{path}: {size} bytes now, {self.manifest.files[name]['nbytes']} when the container "
                              "was opened (truncated or changed since)")
        digest = hashlib.sha256()
        end = offset + nbytes
        while offset < end:
            n = os.preadv(fd, [block[:min(len(block), end - offset)]], offset)
            if n <= 0:
                raise GlmkitError(f"{path}: ends at byte {offset}, before byte {end} (truncated since opened)")
            digest.update(block[:n])
            offset += n
            if progress is not None:
                progress(n)
        return digest.hexdigest()

    def close(self) -> None:
        self._weights.clear()
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:
                pass  # views still alive; the mapping goes away with them
        self._maps.clear()
        for f in self._files.values():
            f.close()
        self._files.clear()
