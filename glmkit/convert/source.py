"""`HFSnapshot`: a local Hugging Face snapshot of a glm_moe_dsa model, read tensor by tensor.

Accepts one or many safetensors shards (with or without `model.safetensors.index.json`), source
dtypes F32/F16/BF16 and FP8-E4M3 with 128x128-block `weight_scale_inv`, per-expert or fused
(`mlp.experts.gate_up_proj [E, 2I, H]`, gate rows first, and `mlp.experts.down_proj [E, H, I]`)
routed experts. Every tensor comes back as float32 with its logical HF shape.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from glmkit.errors import GlmkitError
from glmkit.formats.config import ModelConfig
from glmkit.formats.safetensors_file import TensorInfo, read_header, read_tensor
from glmkit.formats.schema import TensorSpec

INDEX_NAME = "model.safetensors.index.json"
FP8_BLOCK = 128
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
# Copied verbatim into the container next to the weights.
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja", "chat_template.json")


@dataclass(frozen=True)
class SourceTensor:
    path: Path
    info: TensorInfo


class HFSnapshot:
    """Headers of every shard, parsed and checked; tensors read on demand with pread."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise GlmkitError(f"{self.directory}: source snapshot directory not found")
        self.config = ModelConfig.from_file(self.directory / "config.json")
        self.files = self._shard_files()
        self.tensors: dict[str, SourceTensor] = {}
        for path in self.files:
            for name, info in read_header(path).items():
                if name in self.tensors:
                    raise GlmkitError(f"{path}: tensor {name!r} also appears in {self.tensors[name].path.name}")
                self.tensors[name] = SourceTensor(path, info)

    def _shard_files(self) -> list[Path]:
        index = self.directory / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                names = sorted(set(weight_map.values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                raise GlmkitError(f"{index}: not a valid safetensors index (needs a 'weight_map' object)") from None
            files = [self.directory / n for n in names]
            for f in files:
                if not f.is_file():
                    raise GlmkitError(f"{index}: names shard {f.name} which is missing")
            return files
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise GlmkitError(f"{self.directory}: no *.safetensors files")
        return files

    def has(self, name: str) -> bool:
        return name in self.tensors or self._fused(name) is not None

    def check(self, spec: TensorSpec) -> None:
        """Fail before converting anything if the tensor is missing or its header shape disagrees with config."""
        if spec.name in self.tensors:
            src, shape = self.tensors[spec.name], spec.shape
        elif fused := self._fused(spec.name):
            src = fused[0]
            rows, cols = spec.shape
            gate_up = "gate_up_proj" in fused[1]
            shape = (self.config.n_routed_experts, 2 * rows if gate_up else rows, cols)
        else:
            raise GlmkitError(f"{self.directory}: tensor {spec.name!r} is missing from the source")
        if src.info.shape != shape:
            raise GlmkitError(f"{src.path}: tensor {src.info.name!r} has shape {list(src.info.shape)}, "
                              f"config.json implies {list(shape)}")

    def file_digests(self) -> dict[str, dict[str, object]]:
        """sha256 and size of every source shard, read in 16 MB chunks."""
        digests: dict[str, dict[str, object]] = {}
        for path in self.files:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(16 << 20):
                    h.update(chunk)
            digests[path.name] = {"nbytes": path.stat().st_size, "sha256": h.hexdigest()}
        return digests

    def source_bytes(self, spec: TensorSpec) -> int:
        """Bytes read from the source for this tensor (for progress and throughput)."""
        if spec.name in self.tensors:
            return self.tensors[spec.name].info.nbytes
        fused = self._fused(spec.name)
        assert fused is not None
        src, _ = fused
        return src.info.nbytes // src.info.shape[0] * spec.shape[0] // src.info.shape[1]

    def load(self, spec: TensorSpec) -> np.ndarray:
        """The tensor as float32 with the logical shape `spec.shape` (shape checked)."""
        if spec.name in self.tensors:
            src = self.tensors[spec.name]
            array = self._to_float32(spec.name, src, read_tensor(src.path, src.info))
        else:
            fused = self._fused(spec.name)
            if fused is None:
                raise GlmkitError(f"{self.directory}: tensor {spec.name!r} is missing from the source")
            array = self._load_fused(spec, *fused)
        if tuple(array.shape) != spec.shape:
            where = self.tensors[spec.name].path.name if spec.name in self.tensors else "fused expert tensor"
            raise GlmkitError(f"{where}: tensor {spec.name!r} has shape {list(array.shape)}, config.json implies "
                              f"{list(spec.shape)}")
        return array

    def _fused(self, name: str) -> tuple[SourceTensor, str] | None:
        """For a per-expert name missing from the source, the fused tensor that holds it."""
        if spec_parts := _split_expert_name(name):
            prefix, _, proj = spec_parts
            fused = "gate_up_proj" if proj in ("gate_proj", "up_proj") else "down_proj"
            for candidate in (f"{prefix}mlp.experts.{fused}", f"{prefix}mlp.experts.{fused}.weight"):
                if candidate in self.tensors:
                    return self.tensors[candidate], candidate
        return None

    def _load_fused(self, spec: TensorSpec, src: SourceTensor, fused_name: str) -> np.ndarray:
        _, expert, proj = _split_expert_name(spec.name)  # type: ignore[misc]
        shape = src.info.shape
        if len(shape) != 3 or expert >= shape[0]:
            raise GlmkitError(f"{src.path.name}: fused tensor {fused_name!r} has shape {list(shape)}, "
                              f"which does not hold expert {expert}")
        raw = read_tensor(src.path, src.info, first=expert, count=1)
        block = self._to_float32(fused_name, src, raw, expert=expert)[0]
        if proj == "down_proj":
            return block
        if block.shape[0] % 2:
            raise GlmkitError(f"{src.path.name}: fused {fused_name!r} has an odd gate/up row count")
        half = block.shape[0] // 2
        return block[:half] if proj == "gate_proj" else block[half:]

    def _to_float32(self, name: str, src: SourceTensor, raw: np.ndarray, expert: int | None = None) -> np.ndarray:
        dtype = src.info.dtype
        if dtype in FLOAT_DTYPES:
            return raw.astype(np.float32)
        if dtype != "F8_E4M3":
            raise GlmkitError(f"{src.path.name}: tensor {name!r} has dtype {dtype}, not a float weight")
        scale_name = self._fp8_scale_name(name)
        if scale_name is None:
            raise GlmkitError(f"{src.path.name}: FP8 tensor {name!r} has no weight_scale_inv")
        scale_src = self.tensors[scale_name]
        if expert is None:
            scales = read_tensor(scale_src.path, scale_src.info).astype(np.float32)
            return dequantize_fp8_blocks(raw, scales, name)
        scales = read_tensor(scale_src.path, scale_src.info, first=expert, count=1).astype(np.float32)[0]
        weight = raw[0]
        half = weight.shape[0] // 2
        if "gate_up_proj" in name and scales.shape[0] == 2 * -(-half // FP8_BLOCK):
            # fused from per-expert FP8 matrices: gate and up each have their own block grid, stacked
            rows = scales.shape[0] // 2
            return np.concatenate([dequantize_fp8_blocks(weight[:half], scales[:rows], name),
                                   dequantize_fp8_blocks(weight[half:], scales[rows:], name)])[None]
        return dequantize_fp8_blocks(weight, scales, name)[None]

    def _fp8_scale_name(self, name: str) -> str | None:
        base = name.removesuffix(".weight")
        for candidate in (f"{base}.weight_scale_inv", f"{base}_scale_inv", f"{base}.scale_inv"):
            if candidate in self.tensors:
                return candidate
        return None


def _split_expert_name(name: str) -> tuple[str, int, str] | None:
    """`model.layers.L.mlp.experts.E.proj.weight` -> (`model.layers.L.`, E, proj)."""
    head, sep, tail = name.partition("mlp.experts.")
    parts = tail.split(".")
    if not sep or len(parts) != 3 or not parts[0].isdigit() or parts[2] != "weight":
        return None
    return head, int(parts[0]), parts[1]


def dequantize_fp8_blocks(weight: np.ndarray, scale_inv: np.ndarray, name: str = "weight") -> np.ndarray:
    """FP8 `[O, I]` x `weight_scale_inv [ceil(O/128), ceil(I/128)]` -> float32 (fixed 128x128 blocks).

    Despite its name the scale multiplies (it is the block's amax / 448); edge blocks may be partial.
    """
    out_features, in_features = weight.shape
    expected = (-(-out_features // FP8_BLOCK), -(-in_features // FP8_BLOCK))
    if scale_inv.shape != expected:
        raise GlmkitError(f"{name}: weight_scale_inv has shape {list(scale_inv.shape)}, expected {list(expected)} "
                          f"for 128x128 blocks of a {[out_features, in_features]} weight")
    full = np.repeat(np.repeat(scale_inv, FP8_BLOCK, axis=0), FP8_BLOCK, axis=1)
    return weight.astype(np.float32) * full[:out_features, :in_features]
