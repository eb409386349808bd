"""The container manifest (`manifest.json`): the single source of truth of format v1.

It names every tensor's file, absolute byte offset, size, logical shape, storage dtype, quantization
and role, every routed expert's contiguous byte range, the source and the conversion parameters.
The model hash is the sha256 of the canonical JSON of everything except the hash itself, `created_by`
and `source.origin` (where the weights came from: Hub repo and commit, or a local path), so identical
content gives an identical hash whatever tool version wrote it and wherever the source was read from.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from glmkit.errors import GlmkitError

FORMAT_NAME = "glmkit-container"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
ALIGNMENT = 64
MAX_MANIFEST_BYTES = 512 << 20
# Provenance inside `source` that the model hash does not cover (the shard digests next to it are covered).
UNHASHED_SOURCE_KEYS = ("origin",)

ROLES = ("embed", "lm_head", "norm", "router", "attention", "indexer", "dense_mlp", "shared_expert",
         "routed_expert", "mtp", "scales")


@dataclass(frozen=True, slots=True)
class Quant:
    """Symmetric integer quantization of a 2-D weight; scales live in the tensor named `scales`."""

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

    def to_json(self) -> dict[str, Any]:
        return _entry_json(self)

    @classmethod
    def from_json(cls, name: str, d: dict[str, Any]) -> TensorEntry:
        return _entry_from_json(name, d)


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
        """Parse and check manifest.json: format name, version, hash, and self-consistency."""
        path = directory / MANIFEST_NAME
        if not path.is_file():
            raise GlmkitError(f"{directory}: not a glmkit container (no {MANIFEST_NAME})")
        if path.stat().st_size > MAX_MANIFEST_BYTES:
            raise GlmkitError(f"{path}: manifest larger than {MAX_MANIFEST_BYTES} bytes")
        try:
            raw = json.loads(path.read_text())
            if not isinstance(raw, dict):
                raise GlmkitError(f"{path}: not a glmkit container manifest (not a JSON object)")
            if raw.get("format") != FORMAT_NAME:
                raise GlmkitError(f"{path}: not a glmkit container manifest (format {raw.get('format')!r})")
            version = raw.get("format_version")
            if not isinstance(version, int) or version < 1:
                raise GlmkitError(f"{path}: invalid format_version {version!r}")
            if version > FORMAT_VERSION:
                raise GlmkitError(f"{path}: container format version {version} is newer than this glmkit "
                                  f"reads ({FORMAT_VERSION}); upgrade glmkit")
            # hashed as read: what the writer hashed is its `to_json()`, and GLM-5's ~120,000 entries would
            # take seconds to rebuild through dataclasses first
            if content_hash(raw) != raw["model_hash"]:
                raise GlmkitError(f"{path}: manifest does not match its model hash (edited or corrupted)")
            manifest = cls(
                model_hash=raw["model_hash"],
                source=raw["source"],
                conversion=raw["conversion"],
                files=raw["files"],
                tensors={name: _entry_from_json(name, e) for name, e in raw["tensors"].items()},
                experts=[ExpertRange(**r) for r in raw["experts"]],
                config_sha256=raw["config_sha256"],
                created_by=raw.get("created_by", {}),
                format_version=version,
            )
        except GlmkitError:
            raise
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as e:
            raise GlmkitError(f"{path}: malformed manifest ({type(e).__name__}: {e})") from None
        manifest._check_layout(path)
        return manifest

    def _check_layout(self, path: Path) -> None:
        for e in self.tensors.values():
            size = self.files.get(e.file, {}).get("nbytes")
            if size is None:
                raise GlmkitError(f"{path}: tensor {e.name!r} names unknown file {e.file!r}")
            if e.offset < 0 or e.nbytes < 0 or e.offset + e.nbytes > size:
                raise GlmkitError(f"{path}: tensor {e.name!r} lies outside {e.file}")
            if e.quant is not None and e.quant.scales not in self.tensors:
                raise GlmkitError(f"{path}: tensor {e.name!r} names missing scales {e.quant.scales!r}")


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


def _entry_from_json(name: str, d: dict[str, Any]) -> TensorEntry:
    quant = d.get("quant")
    # file, dtype and role repeat across GLM-5's ~120,000 entries: one string object each, not one per entry
    return TensorEntry(
        name=name, file=sys.intern(d["file"]), offset=int(d["offset"]), nbytes=int(d["nbytes"]),
        shape=tuple(int(x) for x in d["shape"]), dtype=sys.intern(d["dtype"]), role=sys.intern(d["role"]),
        sha256=d["sha256"], quant=Quant(**quant) if quant else None,
    )
