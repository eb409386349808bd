"""Importance-matrix files (`glm-calibrate` writes them, `glm-convert --imatrix` reads them).

A stock safetensors file. One F32 tensor `[I]` per linear weight, named like the weight
(`model.layers.3.mlp.experts.7.down_proj.weight`): the mean of `x_j^2` over every input row `x` that
went through that weight during calibration (per routed expert: only the tokens routed to it).
Version 2 adds Hessians for the `gptq` quantizer: F32 `[I, I]` tensors `hessian.N`, the mean of `x x^T`
(its diagonal is the vector above); weights that saw exactly the same inputs (q_a and kv_a, an expert's gate
and up) share one, and with `glm-calibrate --hessians pooled` a routed expert's gate/up name their layer's
MoE-input Hessian (the shared expert's), an approximation of their own. `__metadata__`: `format` =
`glmkit-imatrix`, `format_version` = `2` (1 is read too), `model_hash` (the container it was collected on),
`tokens` (calibration tokens), `tokens_sha256`, `counts` (JSON: weight name -> rows seen) and `hessians`
(JSON: weight name -> Hessian tensor name).
Hessians stay in the file until asked for (`Imatrix.hessian`): at GLM-5 size they are gigabytes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from glmkit.errors import GlmkitError
from glmkit.format.files import create_temp_beside
from glmkit.format.safetensors_file import TensorInfo, read_header, read_metadata, read_tensor

FORMAT_NAME = "glmkit-imatrix"
FORMAT_VERSION = 2
READABLE_VERSIONS = ("1", "2")
HESSIAN_PREFIX = "hessian."


@dataclass
class Imatrix:
    values: dict[str, np.ndarray]  # weight name -> mean x^2 per input column, float32 [I]
    counts: dict[str, int]  # weight name -> input rows seen
    model_hash: str = ""
    tokens: int = 0
    tokens_sha256: str = ""
    hessians: dict[str, str] = field(default_factory=dict)  # weight name -> Hessian tensor name
    hessian_data: dict[str, np.ndarray] = field(default_factory=dict, compare=False)  # tensor name -> [I, I]
    sha256: str = field(default="", compare=False)  # of the content of the file it was read from
    path: Path | None = field(default=None, compare=False)  # the file it was read from (Hessians stay there)
    _hessian_info: dict[str, TensorInfo] = field(default_factory=dict, compare=False, repr=False)

    def hessian(self, weight: str) -> np.ndarray | None:
        """The mean `x x^T` `[I, I]` of this weight's inputs, or None when calibration kept only the diagonal."""
        tensor = self.hessians.get(weight)
        if tensor is None:
            return None
        if tensor in self.hessian_data:
            return self.hessian_data[tensor]
        assert self.path is not None
        h = read_tensor(self.path, self._hessian_info[tensor]).astype(np.float32)
        if not np.isfinite(h).all():
            raise GlmkitError(f"{self.path}: Hessian {tensor!r} holds non-finite values")
        return h

    def write(self, path: str | Path) -> None:
        from safetensors import SafetensorError
        from safetensors.numpy import save_file

        path = Path(path)
        meta = {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "model_hash": self.model_hash,
                "tokens": str(self.tokens), "tokens_sha256": self.tokens_sha256,
                "counts": json.dumps(dict(sorted(self.counts.items())), separators=(",", ":")),
                "hessians": json.dumps(dict(sorted(self.hessians.items())), separators=(",", ":"))}
        tensors = {n: np.ascontiguousarray(v, np.float32) for n, v in sorted(self.values.items())}
        for weight, name in sorted(self.hessians.items()):  # read ones stay in their file until now
            if name not in tensors:
                tensors[name] = np.ascontiguousarray(self.hessian(weight), np.float32)
        tmp = None
        try:
            tmp, f = create_temp_beside(path)
            f.close()  # safetensors writes it by name: made here, so that nothing planted at that name is written to
            save_file(tensors, str(tmp), metadata=meta)
            tmp.replace(path)
        except (OSError, SafetensorError) as e:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
            raise GlmkitError(f"{path}: cannot write ({getattr(e, 'strerror', None) or e})") from None


def read_imatrix(path: str | Path) -> Imatrix:
    """Read and check an imatrix file (untrusted input)."""
    path = Path(path)
    if not path.is_file():
        raise GlmkitError(f"{path}: imatrix file not found")
    tensors = read_header(path)
    meta = read_metadata(path)
    if meta.get("format") != FORMAT_NAME:
        raise GlmkitError(f"{path}: not a glmkit imatrix (format {meta.get('format')!r}); make one with glm-calibrate")
    if meta.get("format_version") not in READABLE_VERSIONS:
        raise GlmkitError(f"{path}: imatrix format version {meta.get('format_version')!r} is not one of "
                          f"{', '.join(READABLE_VERSIONS)}")
    try:
        counts = json.loads(meta.get("counts", "{}"))
        hessians = json.loads(meta.get("hessians", "{}"))
        tokens = int(meta.get("tokens", "0"))
    except (json.JSONDecodeError, ValueError):
        raise GlmkitError(f"{path}: malformed imatrix metadata") from None
    if not isinstance(counts, dict) or not all(isinstance(v, int) and v >= 0 for v in counts.values()):
        raise GlmkitError(f"{path}: malformed imatrix metadata ('counts')")
    if not isinstance(hessians, dict) or not all(isinstance(v, str) for v in hessians.values()):
        raise GlmkitError(f"{path}: malformed imatrix metadata ('hessians')")
    values: dict[str, np.ndarray] = {}
    hessian_info = {n: i for n, i in tensors.items() if n.startswith(HESSIAN_PREFIX)}
    for name, info in tensors.items():
        if name in hessian_info:
            if info.dtype != "F32" or len(info.shape) != 2 or info.shape[0] != info.shape[1]:
                raise GlmkitError(f"{path}: Hessian {name!r} must be a square 2-D F32 matrix")
            continue
        if info.dtype != "F32" or len(info.shape) != 1:
            raise GlmkitError(f"{path}: tensor {name!r} must be a 1-D F32 vector")
        v = read_tensor(path, info).astype(np.float32)
        if not np.isfinite(v).all() or (v < 0).any():
            raise GlmkitError(f"{path}: tensor {name!r} holds negative or non-finite values")
        values[name] = v
    for weight, tensor in hessians.items():
        info = hessian_info.get(tensor)
        if info is None or weight not in values or info.shape != (values[weight].shape[0],) * 2:
            raise GlmkitError(f"{path}: Hessian of {weight!r} ({tensor!r}) is missing or does not match its "
                              "input width")
    return Imatrix(values, {str(k): int(v) for k, v in counts.items()}, str(meta.get("model_hash", "")), tokens,
                   str(meta.get("tokens_sha256", "")), dict(hessians), sha256=content_sha256(path, tensors, meta),
                   path=path, _hessian_info=hessian_info)


def content_sha256(path: Path, tensors: dict[str, TensorInfo], meta: dict[str, str]) -> str:
    """sha256 of the metadata and tensors in name order, not of the file: safetensors writes `__metadata__`
    in hash-map order, so the same statistics saved twice differ in bytes (and would change the model hash)."""
    digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    with open(path, "rb") as f:
        for name in sorted(tensors):
            info = tensors[name]
            digest.update(json.dumps([name, info.dtype, list(info.shape)]).encode())
            f.seek(info.start)
            left = info.nbytes
            while left:
                chunk = f.read(min(left, 1 << 24))
                if not chunk:
                    raise GlmkitError(f"{path}: truncated imatrix file")
                digest.update(chunk)
                left -= len(chunk)
    return digest.hexdigest()
