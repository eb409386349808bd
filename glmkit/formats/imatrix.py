"""Importance-matrix files (`glm-calibrate` writes them, `glm-convert --imatrix` reads them).

A stock safetensors file. One F32 tensor `[I]` per linear weight, named like the weight
(`model.layers.3.mlp.experts.7.down_proj.weight`): the mean of `x_j^2` over every input row `x` that
went through that weight during calibration (per routed expert: only the tokens routed to it).
`__metadata__`: `format` = `glmkit-imatrix`, `format_version` = `1`, `model_hash` (the container it was
collected on), `tokens` (calibration tokens), `tokens_sha256`, and `counts` (JSON: weight name -> rows seen).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from glmkit.errors import GlmkitError
from glmkit.formats.safetensors_file import read_header, read_metadata, read_tensor

FORMAT_NAME = "glmkit-imatrix"
FORMAT_VERSION = 1


@dataclass
class Imatrix:
    values: dict[str, np.ndarray]  # weight name -> mean x^2 per input column, float32 [I]
    counts: dict[str, int]  # weight name -> input rows seen
    model_hash: str = ""
    tokens: int = 0
    tokens_sha256: str = ""
    sha256: str = field(default="", compare=False)  # of the file it was read from

    def write(self, path: str | Path) -> None:
        from safetensors.numpy import save_file

        path = Path(path)
        meta = {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "model_hash": self.model_hash,
                "tokens": str(self.tokens), "tokens_sha256": self.tokens_sha256,
                "counts": json.dumps(dict(sorted(self.counts.items())), separators=(",", ":"))}
        tmp = path.with_name(path.name + ".tmp")
        try:
            save_file({n: np.ascontiguousarray(v, np.float32) for n, v in sorted(self.values.items())}, str(tmp),
                      metadata=meta)
        except OSError as e:
            raise GlmkitError(f"{path}: cannot write ({e.strerror})") from None
        tmp.replace(path)


def read_imatrix(path: str | Path) -> Imatrix:
    """Read and check an imatrix file (untrusted input)."""
    path = Path(path)
    if not path.is_file():
        raise GlmkitError(f"{path}: imatrix file not found")
    tensors = read_header(path)
    meta = read_metadata(path)
    if meta.get("format") != FORMAT_NAME:
        raise GlmkitError(f"{path}: not a glmkit imatrix (format {meta.get('format')!r}); make one with glm-calibrate")
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise GlmkitError(f"{path}: imatrix format version {meta.get('format_version')!r} is not {FORMAT_VERSION}")
    try:
        counts = json.loads(meta.get("counts", "{}"))
        tokens = int(meta.get("tokens", "0"))
    except (json.JSONDecodeError, ValueError):
        raise GlmkitError(f"{path}: malformed imatrix metadata") from None
    if not isinstance(counts, dict) or not all(isinstance(v, int) and v >= 0 for v in counts.values()):
        raise GlmkitError(f"{path}: malformed imatrix metadata ('counts')")
    values: dict[str, np.ndarray] = {}
    for name, info in tensors.items():
        if info.dtype != "F32" or len(info.shape) != 1:
            raise GlmkitError(f"{path}: tensor {name!r} must be a 1-D F32 vector")
        v = read_tensor(path, info).astype(np.float32)
        if not np.isfinite(v).all() or (v < 0).any():
            raise GlmkitError(f"{path}: tensor {name!r} holds negative or non-finite values")
        values[name] = v
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return Imatrix(values, {str(k): int(v) for k, v in counts.items()}, str(meta.get("model_hash", "")), tokens,
                   str(meta.get("tokens_sha256", "")), digest)
