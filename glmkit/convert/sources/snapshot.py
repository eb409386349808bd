"""`HFSnapshot`: a Hugging Face snapshot of a glm_moe_dsa model (local, or on the Hub), read tensor by tensor.

Accepts one or many safetensors shards (with or without `model.safetensors.index.json`), source
dtypes F32/F16/BF16 and FP8-E4M3 with 128x128-block `weight_scale_inv`, per-expert or fused
(`mlp.experts.gate_up_proj [E, 2I, H]`, gate rows first, and `mlp.experts.down_proj [E, H, I]`)
routed experts. Every tensor comes back as float32 with its logical HF shape.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from glmkit.errors import GlmkitError
from glmkit.format.config import MAX_CONFIG_BYTES, ModelConfig
from glmkit.format.files import MAX_SIDE_FILE_BYTES, open_regular_file, read_json_file
from glmkit.format.safetensors_file import TensorInfo, read_header, read_tensor
from glmkit.format.schema import TensorSpec

INDEX_NAME = "model.safetensors.index.json"
MAX_INDEX_BYTES = 128 << 20  # GLM-5's index names ~120,000 tensors in ~12 MB
FP8_BLOCK = 128
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
# Copied verbatim into the container next to the weights.
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja", "chat_template.json")
# Side files the converter also parses, to refuse a broken one before converting (tokenizer.json is parsed by
# the runtime's tokenizer; config.json by ModelConfig).
JSON_SIDE_FILES = ("generation_config.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.json")


@dataclass(frozen=True)
class SourceTensor:
    file: str  # shard name
    info: TensorInfo  # `start` is absolute once the shard is attached (on disk); before that, relative


class HFSnapshot:
    """The tensor catalog of a snapshot (every tensor's shard and header entry) and on-demand reads.

    `HFSnapshot(directory)` opens a local snapshot: every shard's header is parsed and every shard is
    attached. `HFSnapshot.from_headers(...)` builds the catalog from headers read remotely (Hub): nothing
    is on disk yet, shards are `attach`ed as they arrive (their local header must agree) and `detach`ed
    when deleted. `load(spec)` needs the shards `files_for(spec)` names to be attached.
    """

    allow_nonfinite = False  # convert NaN/infinite weights and non-positive FP8 scales instead of refusing them

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise GlmkitError(f"{self.directory}: source snapshot directory not found")
        config = ModelConfig.from_file(self.directory / "config.json")
        files = self._shard_files()
        self._setup(config, {path.name: read_header(path) for path in files},
                    {path.name: path.stat().st_size for path in files}, str(self.directory))
        self.paths = {path.name: path for path in files}

    @classmethod
    def from_headers(cls, config: ModelConfig, headers: dict[str, dict[str, TensorInfo]],
                     shard_bytes: dict[str, int], label: str) -> HFSnapshot:
        """A catalog whose shards are not on disk yet (`attach` each before reading from it)."""
        snapshot = cls.__new__(cls)
        snapshot._setup(config, headers, shard_bytes, label)
        return snapshot

    def _setup(self, config: ModelConfig, headers: dict[str, dict[str, TensorInfo]], shard_bytes: dict[str, int],
               label: str) -> None:
        self.config = config
        self.label = label
        self.shard_bytes = dict(shard_bytes)
        self.headers = headers
        self.paths: dict[str, Path] = {}
        self.tensors: dict[str, SourceTensor] = {}
        for file, header in headers.items():
            for name, info in header.items():
                if name in self.tensors:
                    raise GlmkitError(f"{self._where(file)}: tensor {name!r} also appears in "
                                      f"{self.tensors[name].file}")
                self.tensors[name] = SourceTensor(file, info)

    @property
    def files(self) -> list[Path]:
        """Paths of the attached shards (all of them for a local snapshot)."""
        return list(self.paths.values())

    def _where(self, file: str) -> str:
        return str(self.paths[file]) if file in self.paths else f"{self.label}/{file}"

    def _shard_files(self) -> list[Path]:
        index = self.directory / INDEX_NAME
        if index.exists() or index.is_symlink():
            try:
                names = shard_names_from_index(read_json_file(index, MAX_INDEX_BYTES))
            except ValueError:
                raise GlmkitError(f"{index}: not a valid safetensors index (needs a 'weight_map' object)") from None
            files = [self.directory / n for n in names]
            for f in files:
                if not f.exists() and not f.is_symlink():
                    raise GlmkitError(f"{index}: names shard {f.name} which is missing")
            return files
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise GlmkitError(f"{self.directory}: no *.safetensors files")
        return files

    def attach(self, file: str, path: Path) -> None:
        """A shard arrived on disk: its header must match the catalog's; reads then go to `path`."""
        header = read_header(path)
        planned = self.headers[file]
        for name in sorted(set(header) ^ set(planned)):
            where = "on disk" if name in header else "in the header read before downloading"
            raise GlmkitError(f"{path}: tensor {name!r} is only {where}: the file changed since its header was read")
        for name, info in header.items():
            was = planned[name]
            if (info.dtype, info.shape, info.nbytes) != (was.dtype, was.shape, was.nbytes):
                raise GlmkitError(f"{path}: tensor {name!r} is {info.dtype}{list(info.shape)} on disk but was "
                                  f"{was.dtype}{list(was.shape)} in the header read before downloading")
            self.tensors[name] = SourceTensor(file, info)
        self.headers[file] = header
        self.paths[file] = path

    def detach(self, file: str) -> None:
        self.paths.pop(file, None)

    def has(self, name: str) -> bool:
        return name in self.tensors or self._fused(name) is not None

    def stored_names(self, spec: TensorSpec) -> set[str]:
        """The source tensors `load(spec)` reads: the tensor (or the fused tensor holding it) and its FP8 scales."""
        if spec.name in self.tensors:
            name = spec.name
        elif fused := self._fused(spec.name):
            name = fused[1]
        else:
            raise GlmkitError(f"{self.label}: tensor {spec.name!r} is missing from the source")
        names = {name}
        if self.tensors[name].info.dtype == "F8_E4M3" and (scale := self._fp8_scale_name(name)) is not None:
            names.add(scale)
        return names

    def files_for(self, spec: TensorSpec) -> set[str]:
        """The shards `load(spec)` reads."""
        return {self.tensors[name].file for name in self.stored_names(spec)}

    def where(self, name: str) -> str:
        """The shard (path, or Hub label/name) holding source tensor `name`."""
        return self._where(self.tensors[name].file)

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
            raise GlmkitError(f"{self.label}: tensor {spec.name!r} is missing from the source")
        if src.info.shape != shape:
            raise GlmkitError(f"{self._where(src.file)}: tensor {src.info.name!r} has shape {list(src.info.shape)}, "
                              f"config.json implies {list(shape)}")

    def file_digests(self, stop: threading.Event | None = None) -> dict[str, dict[str, object]]:
        """sha256 and size of every (local) source shard, read in 16 MB chunks (`stop` set: DigestsStopped)."""
        digests: dict[str, dict[str, object]] = {}
        for name, path in self.paths.items():
            digests[name] = {"nbytes": path.stat().st_size, "sha256": sha256_file(path, stop=stop)}
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
            array = self._to_float32(spec.name, src, self._read(src))
        else:
            fused = self._fused(spec.name)
            if fused is None:
                raise GlmkitError(f"{self.label}: tensor {spec.name!r} is missing from the source")
            array = self._load_fused(spec, *fused)
        if tuple(array.shape) != spec.shape:
            where = self.tensors[spec.name].file if spec.name in self.tensors else "fused expert tensor"
            raise GlmkitError(f"{where}: tensor {spec.name!r} has shape {list(array.shape)}, config.json implies "
                              f"{list(spec.shape)}")
        return array

    def row_blocks(self, spec: TensorSpec, rows: int) -> Iterator[np.ndarray]:
        """The tensor as float32 blocks of about `rows` rows, read one at a time (a stored tensor, not an expert
        slice of a fused one; its shape was checked against config.json when the source was opened). FP8 blocks
        are whole 128-row scale blocks."""
        src = self.tensors[spec.name]
        total = spec.shape[0]
        step = self.block_rows(spec, rows)
        for first in range(0, total, step):
            count = min(step, total - first)
            raw = self._read(src, first, count)
            block = self._to_float32(spec.name, src, raw, rows=(first, count))
            del raw  # only one block alive while the caller works on it
            yield block

    def block_rows(self, spec: TensorSpec, rows: int) -> int:
        """The rows of each block `row_blocks(spec, rows)` yields (the last may be shorter)."""
        fp8 = self.tensors[spec.name].info.dtype == "F8_E4M3"
        return max(FP8_BLOCK, rows - rows % FP8_BLOCK) if fp8 else max(1, rows)

    def _read(self, src: SourceTensor, first: int = 0, count: int | None = None) -> np.ndarray:
        path = self.paths.get(src.file)
        if path is None:
            raise GlmkitError(f"{self.label}/{src.file}: shard is not on disk (internal error: read before attach)")
        return read_tensor(path, src.info, first=first, count=count)

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
            raise GlmkitError(f"{src.file}: fused tensor {fused_name!r} has shape {list(shape)}, "
                              f"which does not hold expert {expert}")
        raw = self._read(src, first=expert, count=1)
        block = self._to_float32(fused_name, src, raw, expert=expert)[0]
        if proj == "down_proj":
            return block
        if block.shape[0] % 2:
            raise GlmkitError(f"{src.file}: fused {fused_name!r} has an odd gate/up row count")
        half = block.shape[0] // 2
        return block[:half] if proj == "gate_proj" else block[half:]

    def _to_float32(self, name: str, src: SourceTensor, raw: np.ndarray, expert: int | None = None,
                    rows: tuple[int, int] | None = None) -> np.ndarray:
        """float32 of `raw`: the whole stored tensor, one `expert` of a fused one, or `rows` (first, count) of
        a stored 2-D one (FP8: `first` on a 128-row block boundary). NaN or infinite values are refused (a
        corrupted or misread shard) unless `allow_nonfinite`."""
        array = self._dequantize(name, src, raw, expert, rows)
        if not self.allow_nonfinite and not np.isfinite(array).all():
            bad = int(array.size - np.count_nonzero(np.isfinite(array)))
            raise GlmkitError(f"{self._where(src.file)}: tensor {name!r} holds {bad} NaN or infinite values"
                              f"{_part(expert, rows)}: the shard is corrupted or misread (--allow-nonfinite "
                              "converts it anyway)")
        return array

    def _dequantize(self, name: str, src: SourceTensor, raw: np.ndarray, expert: int | None,
                    rows: tuple[int, int] | None) -> np.ndarray:
        dtype = src.info.dtype
        if dtype in FLOAT_DTYPES:
            return raw.astype(np.float32)
        if dtype != "F8_E4M3":
            raise GlmkitError(f"{src.file}: tensor {name!r} has dtype {dtype}, not a float weight")
        scale_name = self._fp8_scale_name(name)
        if scale_name is None:
            raise GlmkitError(f"{src.file}: FP8 tensor {name!r} has no weight_scale_inv")
        scale_src = self.tensors[scale_name]
        if rows is not None:
            total, cols = src.info.shape
            if scale_src.info.shape != (-(-total // FP8_BLOCK), -(-cols // FP8_BLOCK)):
                raise GlmkitError(f"{name}: weight_scale_inv has shape {list(scale_src.info.shape)}, expected "
                                  f"128x128 blocks of a {[total, cols]} weight")
            first, count = rows
            scales = self._scales(scale_name, scale_src, first // FP8_BLOCK, -(-count // FP8_BLOCK), rows=rows)
            return dequantize_fp8_blocks(raw, scales, name)
        if expert is None:
            return dequantize_fp8_blocks(raw, self._scales(scale_name, scale_src), name)
        scales = self._scales(scale_name, scale_src, first=expert, count=1, expert=expert)[0]
        weight = raw[0]
        half = weight.shape[0] // 2
        if "gate_up_proj" in name and scales.shape[0] == 2 * -(-half // FP8_BLOCK):
            # fused from per-expert FP8 matrices: gate and up each have their own block grid, stacked
            grid = scales.shape[0] // 2
            return np.concatenate([dequantize_fp8_blocks(weight[:half], scales[:grid], name),
                                   dequantize_fp8_blocks(weight[half:], scales[grid:], name)])[None]
        return dequantize_fp8_blocks(weight, scales, name)[None]

    def _scales(self, scale_name: str, scale_src: SourceTensor, first: int = 0, count: int | None = None,
                expert: int | None = None, rows: tuple[int, int] | None = None) -> np.ndarray:
        """FP8 block scales as float32 (rows `first .. first+count`); each must be finite and positive (a zero
        scale erases its block, a negative one flips it) unless `allow_nonfinite`."""
        scales = self._read(scale_src, first, count).astype(np.float32)
        if not self.allow_nonfinite:
            good = np.isfinite(scales) & (scales > 0)
            if not good.all():
                raise GlmkitError(f"{self._where(scale_src.file)}: {scale_name!r} holds {good.size - int(good.sum())} "
                                  f"NaN, infinite, zero or negative FP8 scales{_part(expert, rows)}: the shard is "
                                  "corrupted or misread (--allow-nonfinite converts it anyway)")
        return scales

    def _fp8_scale_name(self, name: str) -> str | None:
        base = name.removesuffix(".weight")
        for candidate in (f"{base}.weight_scale_inv", f"{base}_scale_inv", f"{base}.scale_inv"):
            if candidate in self.tensors:
                return candidate
        return None


def _part(expert: int | None, rows: tuple[int, int] | None) -> str:
    """Which piece of a tensor a message is about: one expert of a fused tensor, or a block of rows."""
    if expert is not None:
        return f" (expert {expert})"
    if rows is not None:
        return f" (rows {rows[0]}-{rows[0] + rows[1] - 1})"
    return ""


def side_file_limit(name: str) -> int:
    """The most bytes side file `name` may have (checked before it is read or downloaded)."""
    return MAX_CONFIG_BYTES if name == "config.json" else MAX_INDEX_BYTES if name == INDEX_NAME else MAX_SIDE_FILE_BYTES


def check_side_files(directory: Path) -> list[str]:
    """The side files `directory` holds, each a regular file within `side_file_limit`; the JSON ones parse (and
    config.json was read already). A FIFO, device or oversized file is an error, not skipped or read forever."""
    present = []
    for name in SIDE_FILES:
        path = directory / name
        if not path.exists() and not path.is_symlink():
            continue
        with open_regular_file(path) as f:
            size = os.fstat(f.fileno()).st_size
        if size > side_file_limit(name):
            raise GlmkitError(f"{path}: {size} bytes, more than the {side_file_limit(name)} a side file may have")
        if name in JSON_SIDE_FILES:
            read_json_file(path, side_file_limit(name))
        present.append(name)
    return present


def copy_side_file(source: Path, dest: Path) -> None:
    """Copy a checked side file (`check_side_files`) under a temporary name, then rename it into place."""
    tmp = dest.with_name(dest.name + ".tmp")
    with open_regular_file(source) as f, open(tmp, "wb") as out:
        out.write(f.read(side_file_limit(source.name) + 1))
    if tmp.stat().st_size > side_file_limit(source.name):  # it grew since it was checked
        tmp.unlink()
        raise GlmkitError(f"{source}: grew past {side_file_limit(source.name)} bytes while being converted")
    tmp.replace(dest)


def shard_names_from_index(index: object) -> list[str]:
    """The shard names a `model.safetensors.index.json` document refers to, sorted (ValueError if malformed)."""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError("not a safetensors index")
    names = sorted(set(weight_map.values()))
    for name in names:
        if "/" in name or name.startswith("."):
            raise ValueError(f"shard name {name!r} is not a plain file name")
    return names


class DigestsStopped(Exception):
    """Hashing was stopped before it finished (the conversion it ran beside failed)."""


def sha256_file(path: Path, chunk: int = 16 << 20, stop: threading.Event | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while data := f.read(chunk):
            if stop is not None and stop.is_set():
                raise DigestsStopped(str(path))
            h.update(data)
    return h.hexdigest()


SAMPLE_BLOCKS = 16
SAMPLE_BLOCK_BYTES = 64 << 10


def file_identity(path: Path) -> dict[str, int | str]:
    """What a resumed conversion rechecks a safetensors file against (a local source shard, or a data file it
    completed): its size, mtime (ns) and the sha256 of its header plus SAMPLE_BLOCKS evenly spaced blocks of
    SAMPLE_BLOCK_BYTES (of the whole file when that is smaller: a same-size edit is caught even when the mtime
    was put back)."""
    with open_regular_file(path) as f:
        stat = os.fstat(f.fileno())
        size = stat.st_size
        h = hashlib.sha256()
        header_end = 8 + int.from_bytes(f.read(8), "little")  # a lying length only widens the first span
        if size <= header_end + SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES:
            spans = [(0, size)]
        else:
            last = size - SAMPLE_BLOCK_BYTES
            spans = [(0, header_end)] + [(header_end + i * (last - header_end) // (SAMPLE_BLOCKS - 1),
                                          SAMPLE_BLOCK_BYTES) for i in range(SAMPLE_BLOCKS)]
        for start, length in spans:
            f.seek(start)
            while length > 0 and (chunk := f.read(min(length, 1 << 20))):
                h.update(chunk)
                length -= len(chunk)
    return {"nbytes": size, "mtime_ns": stat.st_mtime_ns, "sampled_sha256": h.hexdigest()}


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


# --- where a snapshot comes from --------------------------------------------------------------------------
