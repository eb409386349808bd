"""The container manifest (`manifest.json`): the single source of truth of format v1.

It names every tensor's file, absolute byte offset, size, logical shape, storage dtype, quantization
and role, every routed expert's contiguous byte range, the source and the conversion parameters.
The model hash is the sha256 of the canonical JSON of everything except the hash itself, `created_by`
and `source.origin` (where the weights came from: Hub repo and commit, or a local path), so identical
content gives an identical hash whatever tool version wrote it and wherever the source was read from.

A matching hash proves nothing about intent (anyone can recompute it), so a manifest is untrusted input: `read`
checks every field against the format's schema and every entry against the others, `check_model` checks the
tensors against the model config.json describes, and the container's files are opened only as regular files
inside its directory (`open_in_container`).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import re
import stat
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any, BinaryIO

from glmkit.errors import GlmkitError
from glmkit.format.config import ModelConfig
from glmkit.format.files import open_regular_file, parse_large_json
from glmkit.format.packing import SCHEMES, SUPPORTED_BITS, packed_row_bytes, scales_shape
from glmkit.format.schema import EXPERT_PROJECTIONS, TensorSpec, expert_weight_name, model_tensors

FORMAT_NAME = "glmkit-container"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
ALIGNMENT = 64
MAX_MANIFEST_BYTES = 512 << 20
# Provenance inside `source` that the model hash does not cover (the shard digests next to it are covered).
UNHASHED_SOURCE_KEYS = ("origin",)

ROLES = ("embed", "lm_head", "norm", "router", "attention", "indexer", "dense_mlp", "shared_expert",
         "routed_expert", "mtp", "scales")
UNQUANTIZED_ROLES = ("norm", "router", "scales")
FLOAT_DTYPE = "F32"
PACKED_DTYPE = "U8"
DTYPE_BYTES = {FLOAT_DTYPE: 4, PACKED_DTYPE: 1}
SCALES_SUFFIX = ".qs"
# the writer names data files model-NNNNN-of-MMMMM.safetensors; any plain name (no directory part) is read
DATA_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\.safetensors")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
TOP_LEVEL_KEYS = frozenset({"format", "format_version", "model_hash", "config_sha256", "source", "conversion",
                            "files", "tensors", "experts"})
FILE_KEYS = frozenset({"nbytes", "sha256"})
ENTRY_KEYS = frozenset({"file", "offset", "nbytes", "shape", "dtype", "role", "sha256", "quant"})
QUANT_KEYS = frozenset({"bits", "group_size", "scales", "scheme"})
EXPERT_KEYS = frozenset({"layer", "expert", "file", "offset", "nbytes"})


@dataclass(frozen=True, slots=True)
class Quant:
    """Integer quantization of a 2-D weight; scales live in the tensor named `scales`. `scheme`: what a code
    stands for, "symmetric" (the code itself) or "nl4" (4-bit codes looked up in a fixed table: packing.py)."""

    bits: int
    group_size: int | None  # None = one scale per output row
    scales: str
    scheme: str = "symmetric"


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One stored tensor. `shape` is logical ([O, I] for a packed weight); `dtype` is the storage dtype."""

    name: str
    file: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    role: str
    sha256: str
    quant: Quant | None = None

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape in the data file: `shape`, or `[O, packed_row_bytes(I, bits)]` bytes for a packed weight."""
        if self.quant is None:
            return self.shape
        return self.shape[0], packed_row_bytes(self.shape[1], self.quant.bits)

    def to_json(self) -> dict[str, Any]:
        return _entry_json(self)

    @classmethod
    def from_json(cls, name: str, d: Any, where: str = MANIFEST_NAME) -> TensorEntry:
        """An entry checked by the format's rules for one entry (see `_entry_from_json`; `where` names the file it
        came from in errors), its data file unchecked."""
        return _entry_from_json(where, name, d, None)


@dataclass(frozen=True, slots=True)
class ExpertRange:
    """The one contiguous byte range holding a routed expert's gate/up/down weights and scales."""

    layer: int
    expert: int
    file: str
    offset: int
    nbytes: int


@dataclass
class Manifest:
    model_hash: str
    source: dict[str, Any]
    conversion: dict[str, Any]
    files: dict[str, dict[str, Any]]  # data file name -> {"nbytes", "sha256"}
    tensors: dict[str, TensorEntry]
    experts: list[ExpertRange]
    config_sha256: str
    created_by: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "format_version": self.format_version,
            "model_hash": self.model_hash,
            "created_by": self.created_by,
            "config_sha256": self.config_sha256,
            "source": self.source,
            "conversion": self.conversion,
            "files": self.files,
            "tensors": {name: _entry_json(e) for name, e in self.tensors.items()},
            "experts": [asdict(r) for r in self.experts],
        }

    def compute_hash(self) -> str:
        return content_hash(self.to_json())

    def write(self, directory: Path) -> None:
        """Write manifest.json atomically (temp name, then rename): it is what makes a container valid."""
        tmp = directory / (MANIFEST_NAME + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n")
        tmp.replace(directory / MANIFEST_NAME)

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        """Read and check manifest.json before anything is mapped: format name, version and hash, then every
        field against the format's schema (`_entry_from_json`, `_expert_from_json`) and the entries against each
        other (`_check_layout`). The model itself is checked by `check_model` once config.json is read."""
        with collector_paused():
            return cls._read(directory)

    @classmethod
    def _read(cls, directory: Path) -> Manifest:
        path = directory / MANIFEST_NAME
        if not os.path.lexists(path):
            raise GlmkitError(f"{directory}: not a glmkit container (no {MANIFEST_NAME})")
        raw = parse_large_json(path, read_container_file(directory, MANIFEST_NAME, MAX_MANIFEST_BYTES))
        if not isinstance(raw, dict):
            raise GlmkitError(f"{path}: not a glmkit container manifest (not a JSON object)")
        if raw.get("format") != FORMAT_NAME:
            raise GlmkitError(f"{path}: not a glmkit container manifest (format {short_repr(raw.get('format'))})")
        version = raw.get("format_version")
        if type(version) is not int or version < 1:
            raise GlmkitError(f"{path}: invalid format_version {short_repr(version)}")
        if version > FORMAT_VERSION:
            raise GlmkitError(f"{path}: container format version {version} is newer than this glmkit "
                              f"reads ({FORMAT_VERSION}); upgrade glmkit")
        # hashed as read: what the writer hashed is its `to_json()`, and GLM-5's ~120,000 entries would
        # take seconds to rebuild through dataclasses first
        try:
            matches = content_hash(raw) == raw.get("model_hash")
        except RecursionError:
            raise GlmkitError(f"{path}: malformed manifest (JSON nested too deeply)") from None
        if not matches:
            raise GlmkitError(f"{path}: manifest does not match its model hash (edited or corrupted)")
        keys = raw.keys() - {"created_by"}
        if keys != TOP_LEVEL_KEYS:
            odd = sorted(keys - TOP_LEVEL_KEYS) or sorted(TOP_LEVEL_KEYS - keys)
            raise GlmkitError(f"{path}: manifest must hold exactly the keys {sorted(TOP_LEVEL_KEYS)} (and "
                              f"'created_by'): {'unknown' if keys - TOP_LEVEL_KEYS else 'missing'} {odd}")
        created_by = raw.get("created_by", {})
        if type(created_by) is not dict:
            raise GlmkitError(f"{path}: 'created_by' must be an object")
        _check_digest(f"{path}: config_sha256", raw["config_sha256"])
        files = _files_from_json(path, raw["files"])
        sizes = {name: record["nbytes"] for name, record in files.items()}
        tensors, experts = raw["tensors"], raw["experts"]
        if type(tensors) is not dict or not tensors:
            raise GlmkitError(f"{path}: 'tensors' must be a non-empty object of tensor entries")
        if type(experts) is not list:
            raise GlmkitError(f"{path}: 'experts' must be a list of expert byte ranges")
        manifest = cls(
            model_hash=raw["model_hash"],
            source=_source_from_json(path, raw["source"]),
            conversion=_conversion_from_json(path, raw["conversion"]),
            files=files,
            tensors={name: _entry_from_json(str(path), name, e, sizes) for name, e in tensors.items()},
            experts=[_expert_from_json(path, i, r, sizes) for i, r in enumerate(experts)],
            config_sha256=raw["config_sha256"],
            created_by=created_by,
            format_version=version,
        )
        manifest._check_layout(path)
        return manifest

    def _check_layout(self, path: Path) -> None:
        """Entries against each other: every quantized weight's `.qs` scales present with the shape its group size
        gives, no scales tensor without its weight, no two tensors sharing a byte, no expert listed twice."""
        by_file: dict[str, list[TensorEntry]] = {}
        for e in self.tensors.values():
            if e.quant is not None:
                s = self.tensors.get(e.quant.scales)
                want = scales_shape((e.shape[0], e.shape[1]), e.quant.group_size)
                if s is None or s.role != "scales" or s.shape != want:
                    raise GlmkitError(f"{path}: tensor {short_repr(e.quant.scales)}: the scales of "
                                      f"{short_repr(e.name)} must be an F32 "
                                      f"'scales' tensor of shape {list(want)}"
                                      + (" (missing)" if s is None else f", not {s.role!r} {list(s.shape)}"))
            elif e.role == "scales":
                weight = self.tensors.get(e.name.removesuffix(SCALES_SUFFIX))
                if not e.name.endswith(SCALES_SUFFIX) or weight is None or weight.quant is None:
                    raise GlmkitError(f"{path}: tensor {short_repr(e.name)}: a 'scales' tensor of no quantized "
                                      "weight")
            by_file.setdefault(e.file, []).append(e)
        for file, entries in by_file.items():
            entries.sort(key=attrgetter("offset"))
            for a, b in zip(entries, entries[1:], strict=False):
                if b.offset < a.offset + a.nbytes:
                    raise GlmkitError(f"{path}: tensors {short_repr(a.name)} and {short_repr(b.name)} overlap in "
                                      f"{file} (bytes "
                                      f"{a.offset}+{a.nbytes} and {b.offset}+{b.nbytes})")
        seen: set[tuple[int, int]] = set()
        for r in self.experts:
            if (r.layer, r.expert) in seen:
                raise GlmkitError(f"{path}: experts: layer {r.layer} expert {r.expert} is listed twice")
            seen.add((r.layer, r.expert))

    def check_model(self, path: Path, config: ModelConfig) -> None:
        """Check the manifest against the model config.json describes: exactly the tensors `model_tensors` lists
        (with the MTP layer if `conversion.mtp`), each with its logical shape, its role and the bits and group
        size `conversion` records for that role (plus its `.qs` scales when quantized); and in `experts`, for
        every routed expert of every MoE layer, the one byte range its weights and scales fill back to back."""
        conversion = self.conversion
        bits_of, groups = conversion["bits"], conversion.get("group_sizes", {})
        nl4 = conversion.get("grid", "uniform") == "nl"  # containers from before the grid choice: uniform
        tensors = self.tensors
        stored = 0
        for spec in model_tensors(config, include_mtp=conversion["mtp"]):
            e = tensors.get(spec.name)
            bits = bits_of.get(spec.role) if len(spec.shape) == 2 else None
            group = groups.get(spec.role, conversion["group_size"])
            q = e.quant if e is not None else None
            if (e is None or e.shape != spec.shape or e.role != spec.role or (q is None) != (bits is None)
                    or (q is not None and (q.bits, q.group_size) != (bits, group))):
                raise _model_error(path, spec, e, None if bits is None else (bits, group))
            want = "nl4" if nl4 and bits == 4 else "symmetric"
            if q is not None and q.scheme != want:
                raise GlmkitError(f"{path}: tensor {spec.name!r}: quant scheme {q.scheme!r}, but the conversion's "
                                  f"grid {conversion.get('grid', 'uniform')!r} stores it as {want!r}")
            stored += 1 if q is None else 2  # the weight, and its scales (checked by `_check_layout`)
        if stored != len(tensors):
            known = {spec.name for spec in model_tensors(config, include_mtp=conversion["mtp"])}
            unknown = next(name for name, e in tensors.items() if name not in known and e.role != "scales")
            raise GlmkitError(f"{path}: tensor {short_repr(unknown)} is not a tensor of config.json's model")
        layers = config.num_layers_with_mtp if conversion["mtp"] else config.num_hidden_layers
        moe = [layer for layer in range(layers) if config.is_moe_layer(layer)]
        ranges = {(r.layer, r.expert): r for r in self.experts}
        for layer in moe:
            for expert in range(config.n_routed_experts):
                r = ranges.get((layer, expert))
                if r is None:
                    raise GlmkitError(f"{path}: experts: no byte range for layer {layer} expert {expert}")
                self._check_expert(path, r)
        if len(ranges) != len(moe) * config.n_routed_experts:
            layer, expert = next(k for k in ranges if k[0] not in moe or k[1] >= config.n_routed_experts)
            raise GlmkitError(f"{path}: experts: layer {layer} expert {expert} is not a routed expert of "
                              "config.json's model")

    def _check_expert(self, path: Path, r: ExpertRange) -> None:
        """The expert's weights and scales lie in `r.file`, back to back (only alignment padding between), and
        span exactly `r`."""
        parts = []
        for projection in EXPERT_PROJECTIONS:
            weight = self.tensors[expert_weight_name(r.layer, r.expert, projection)]
            parts.append(weight)
            if weight.quant is not None:
                parts.append(self.tensors[weight.quant.scales])
        parts.sort(key=attrgetter("offset"))
        where = f"{path}: experts: layer {r.layer} expert {r.expert}"
        if any(p.file != r.file for p in parts):
            raise GlmkitError(f"{where}: its tensors are not all in {r.file}")
        start, end = parts[0].offset, parts[-1].offset + parts[-1].nbytes
        if (r.offset, r.nbytes) != (start, end - start):
            raise GlmkitError(f"{where}: range {r.offset}+{r.nbytes} is not the span of its tensors "
                              f"({start}+{end - start})")
        for a, b in zip(parts, parts[1:], strict=False):
            if b.offset - (a.offset + a.nbytes) >= ALIGNMENT:
                raise GlmkitError(f"{where}: its tensors are not back to back (a gap after {short_repr(a.name)})")


def content_hash(body: dict[str, Any]) -> str:
    """The model hash of a manifest's JSON: sha256 of its canonical form without `model_hash`, `created_by`
    and the source keys that do not identify the weights."""
    body = {k: v for k, v in body.items() if k not in ("model_hash", "created_by")}
    if isinstance(body.get("source"), dict):
        body["source"] = {k: v for k, v in body["source"].items() if k not in UNHASHED_SOURCE_KEYS}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _entry_json(e: TensorEntry) -> dict[str, Any]:
    d = asdict(e)
    del d["name"]
    d["shape"] = list(e.shape)
    return d


def _entry_from_json(where: str, name: str, d: Any, file_sizes: dict[str, int] | None) -> TensorEntry:
    """One `tensors` entry, each field checked, and its storage by the format's rules: F32 `shape`, or a packed
    U8 `[O, packed_row_bytes(I, bits)]` weight; 64-byte aligned and, given `file_sizes`, inside its data file."""
    if type(d) is not dict or d.keys() != ENTRY_KEYS:
        has = sorted(d) if type(d) is dict else type(d).__name__
        raise _entry_error(where, name, f"an entry must hold exactly the keys {sorted(ENTRY_KEYS)}, not "
                                        f"{short_repr(has)}")
    file, offset, nbytes, shape, dtype, role = d["file"], d["offset"], d["nbytes"], d["shape"], d["dtype"], d["role"]
    if type(file) is not str or (file_sizes is not None and file not in file_sizes):
        raise _entry_error(where, name, f"file {short_repr(file)} is not one of the manifest's data files")
    if not _is_dims(shape):
        raise _entry_error(where, name, f"shape {short_repr(shape)} is not a list of one or two positive integers")
    if type(dtype) is not str or dtype not in DTYPE_BYTES:
        raise _entry_error(where, name, f"dtype {short_repr(dtype)} is not a storage dtype of the format (F32, or U8 "
                                        "for a packed weight)")
    if type(role) is not str or role not in ROLES:
        raise _entry_error(where, name, f"role {short_repr(role)} is not one of {', '.join(ROLES)}")
    digest = d["sha256"]
    if type(digest) is not str or not SHA256_HEX.fullmatch(digest):
        raise _entry_error(where, name, f"sha256 {short_repr(digest)} is not a sha256 hex digest")
    quant = None if d["quant"] is None else _quant_from_json(where, name, d["quant"])
    if quant is None:
        if dtype != FLOAT_DTYPE:
            raise _entry_error(where, name, f"dtype {dtype} without 'quant' (only F32 tensors are stored unquantized)")
        expected = 4 * shape[0] * (shape[1] if len(shape) == 2 else 1)
    else:
        if dtype != PACKED_DTYPE or len(shape) != 2 or role in UNQUANTIZED_ROLES:
            raise _entry_error(where, name, f"only a 2-D weight is quantized, stored U8 (dtype {dtype}, shape {shape}, "
                                            f"role {role!r})")
        expected = shape[0] * packed_row_bytes(shape[1], quant.bits)
    if type(offset) is not int or offset < 0 or offset % ALIGNMENT:
        raise _entry_error(where, name, f"offset {short_repr(offset)} is not a non-negative multiple of {ALIGNMENT}")
    if type(nbytes) is not int or nbytes != expected:
        raise _entry_error(where, name, f"nbytes {short_repr(nbytes)}, but shape {shape} stored as {dtype} takes "
                                        f"{expected}")
    if file_sizes is not None and offset + nbytes > file_sizes[file]:
        raise _entry_error(where, name, f"bytes {offset}+{nbytes} lie outside {file} ({file_sizes[file]} bytes)")
    # file, dtype and role repeat across GLM-5's ~120,000 entries: one string object each, not one per entry
    return TensorEntry(name=name, file=sys.intern(file), offset=offset, nbytes=nbytes, shape=tuple(shape),
                       dtype=sys.intern(dtype), role=sys.intern(role), sha256=digest, quant=quant)


def _is_dims(shape: Any) -> bool:
    """Whether `shape` is a JSON list of one or two positive integers (the format's tensors are 1-D or 2-D)."""
    if type(shape) is not list:
        return False
    if len(shape) == 1:
        return type(shape[0]) is int and shape[0] > 0
    return len(shape) == 2 and type(shape[0]) is int and type(shape[1]) is int and shape[0] > 0 and shape[1] > 0


def _entry_error(where: str, name: str, problem: str) -> GlmkitError:
    return GlmkitError(f"{where}: tensor {short_repr(name)}: {problem}")


def _quant_from_json(where: str, name: str, q: Any) -> Quant:
    if type(q) is not dict or q.keys() != QUANT_KEYS:
        raise _entry_error(where, name, f"quant must be null or hold exactly the keys {sorted(QUANT_KEYS)}")
    scheme = q["scheme"]
    if type(scheme) is not str or scheme not in SCHEMES:
        raise _entry_error(where, name, f"quant scheme {short_repr(scheme)} is not one of {', '.join(SCHEMES)}")
    bits, group, scales = q["bits"], q["group_size"], q["scales"]
    if type(bits) is not int or bits not in SUPPORTED_BITS:
        raise _entry_error(where, name, f"quant bits {short_repr(bits)} is not one of {SUPPORTED_BITS}")
    if scheme == "nl4" and bits != 4:
        raise _entry_error(where, name, f"quant scheme 'nl4' needs bits 4, not {short_repr(bits)}")
    if group is not None and (type(group) is not int or group < 1):
        raise _entry_error(where, name, f"quant group_size {short_repr(group)} is neither null (per row) nor a "
                                        "positive integer")
    if type(scales) is not str or scales != name + SCALES_SUFFIX:
        raise _entry_error(where, name, f"quant scales {short_repr(scales)} is not {name + SCALES_SUFFIX!r}")
    return Quant(bits, group, scales, sys.intern(scheme))


def _expert_from_json(path: Path, index: int, d: Any, file_sizes: dict[str, int]) -> ExpertRange:
    where = f"{path}: experts[{index}]"
    if type(d) is not dict or d.keys() != EXPERT_KEYS:
        raise GlmkitError(f"{where}: an expert range must hold exactly the keys {sorted(EXPERT_KEYS)}")
    numbers = d["layer"], d["expert"], d["offset"], d["nbytes"]
    if not all(type(v) is int and v >= 0 for v in numbers):
        raise GlmkitError(f"{where}: layer, expert, offset and nbytes must be non-negative integers, not "
                          f"{short_repr(list(numbers))}")
    file = d["file"]
    if type(file) is not str or file not in file_sizes:
        raise GlmkitError(f"{where}: file {short_repr(file)} is not one of the manifest's data files")
    if d["offset"] + d["nbytes"] > file_sizes[file]:
        raise GlmkitError(f"{where}: bytes {d['offset']}+{d['nbytes']} lie outside {file}")
    return ExpertRange(d["layer"], d["expert"], sys.intern(file), d["offset"], d["nbytes"])


def _files_from_json(path: Path, files: Any) -> dict[str, dict[str, Any]]:
    """`files`: plain data file names (no directory part: nothing outside the container is named), each with
    its size (at least the 8-byte safetensors header length) and sha256."""
    if type(files) is not dict or not files:
        raise GlmkitError(f"{path}: 'files' must be a non-empty object of data file records")
    for name, record in files.items():
        if not DATA_FILE_NAME.fullmatch(name):
            raise GlmkitError(f"{path}: data file name {short_repr(name)} is not a plain '*.safetensors' name inside "
                              "the container")
        if type(record) is not dict or record.keys() != FILE_KEYS:
            raise GlmkitError(f"{path}: files[{name!r}] must hold exactly the keys {sorted(FILE_KEYS)}")
        if type(record["nbytes"]) is not int or record["nbytes"] < 8:
            raise GlmkitError(f"{path}: files[{name!r}]: nbytes {short_repr(record['nbytes'])} is not the size of a "
                              "safetensors file")
        _check_digest(f"{path}: files[{name!r}]: sha256", record["sha256"])
    return files


def _source_from_json(path: Path, source: Any) -> dict[str, Any]:
    if type(source) is not dict or type(source.get("files")) is not dict:
        raise GlmkitError(f"{path}: 'source' must be an object with the source's 'files'")
    return source


def _conversion_from_json(path: Path, conversion: Any) -> dict[str, Any]:
    """`conversion`: what the reader relies on is checked: the bits per role, the group size (and the per-role ones
    that replace it), `mtp`."""
    if type(conversion) is not dict:
        raise GlmkitError(f"{path}: 'conversion' must be an object")
    bits, group, mtp = conversion.get("bits"), conversion.get("group_size"), conversion.get("mtp")
    if type(bits) is not dict or not all(role in ROLES and type(b) is int and b in SUPPORTED_BITS
                                         for role, b in bits.items()):
        raise GlmkitError(f"{path}: conversion bits {short_repr(bits)} must map tensor roles to one of "
                          f"{SUPPORTED_BITS}")
    if group is not None and (type(group) is not int or group < 1):
        raise GlmkitError(f"{path}: conversion group_size {short_repr(group)} is neither null nor a positive integer")
    groups = conversion.get("group_sizes", {})
    if type(groups) is not dict or not all(role in ROLES and (g is None or (type(g) is int and g >= 1))
                                           for role, g in groups.items()):
        raise GlmkitError(f"{path}: conversion group_sizes {short_repr(groups)} must map tensor roles to null or a "
                          "positive integer")
    if type(mtp) is not bool:
        raise GlmkitError(f"{path}: conversion mtp {short_repr(mtp)} must be true or false")
    if conversion.get("grid", "uniform") not in ("uniform", "nl"):
        raise GlmkitError(f"{path}: conversion grid {short_repr(conversion['grid'])} is neither 'uniform' nor 'nl'")
    return conversion


def _check_digest(where: str, digest: Any) -> None:
    if type(digest) is not str or not SHA256_HEX.fullmatch(digest):
        raise GlmkitError(f"{where} {short_repr(digest)} is not a sha256 hex digest")


def _model_error(path: Path, spec: TensorSpec, e: TensorEntry | None, want: tuple[int, int | None] | None
                 ) -> GlmkitError:
    """What differs between tensor entry `e` and the model's `spec`, stored as `want` by the conversion."""
    where = f"{path}: tensor {spec.name!r}"
    if e is None:
        return GlmkitError(f"{where} is missing (config.json's model has it)")
    if e.shape != spec.shape:
        return GlmkitError(f"{where}: shape {list(e.shape)}, but config.json's model has {list(spec.shape)}")
    if e.role != spec.role:
        return GlmkitError(f"{where}: role {e.role!r}, but the format gives it {spec.role!r}")
    got = None if e.quant is None else (e.quant.bits, e.quant.group_size)
    return GlmkitError(f"{where}: stored as {_quant_text(got)}, but the conversion records {_quant_text(want)} for "
                       f"role {spec.role!r}")


def _quant_text(quant: tuple[int, int | None] | None) -> str:
    if quant is None:
        return "F32"
    return f"bits={quant[0]} group_size={quant[1]}"


def short_repr(value: Any, limit: int = 120) -> str:
    """repr of an untrusted value for a one-line message, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def open_in_container(directory: Path, name: str) -> BinaryIO:
    """Open the container's file `name` for binary reading: it must be a regular file in the container directory
    (a symlink may point elsewhere inside it, never out of it; a FIFO, device, directory or symlink loop is
    refused, and named, before any open). The caller closes it."""
    path = directory / name
    try:
        target = path.resolve(strict=True)
        root = directory.resolve(strict=True)
    except FileNotFoundError:
        raise GlmkitError(f"{path}: missing from the container") from None
    except RuntimeError:  # Python 3.11 reports a symlink loop so
        raise GlmkitError(f"{path}: a symlink loop") from None
    except OSError as e:
        raise GlmkitError(f"{path}: cannot be resolved ({e.strerror})") from None
    if not target.is_relative_to(root):
        raise GlmkitError(f"{path}: a symlink out of the container (to {target})")
    if kind := _file_kind(target.stat().st_mode):  # before the open: opening a device can act on it
        raise GlmkitError(f"{path}: a {kind}, not a regular file")
    return open_regular_file(path)


def _file_kind(mode: int) -> str:
    """'' for a regular file, else what it is."""
    if stat.S_ISREG(mode):
        return ""
    kinds = ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
             (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"))
    return next((kind for test, kind in kinds if test(mode)), "special file")


def read_container_file(directory: Path, name: str, max_bytes: int) -> bytes:
    """The whole content of the container's file `name` (see `open_in_container`), refused unread when larger
    than `max_bytes`."""
    with open_in_container(directory, name) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise GlmkitError(f"{directory / name}: {size} bytes, more than the {max_bytes} it may have")
        return read_exact(f.fileno(), directory / name, 0, size)


def read_exact(fd: int, path: Path, offset: int, nbytes: int) -> bytes:
    """Bytes `offset .. offset+nbytes` of the open file `fd` (named `path` in errors); a short file is an error."""
    chunks = []
    done = 0
    while done < nbytes:
        chunk = os.pread(fd, nbytes - done, offset + done)
        if not chunk:
            raise GlmkitError(f"{path}: ends at byte {offset + done}, before byte {offset + nbytes} (truncated?)")
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (restored as it was on exit): reading a manifest makes millions of
    objects and no cycles, and every collection those allocations trigger would walk all of them again."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
