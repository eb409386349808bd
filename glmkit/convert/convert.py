"""HF snapshot -> container: plan every tensor, lay out the files, stream tensors through quantization.

Only one source tensor (plus its quantized form) is in memory at a time. Data files are written under
`*.tmp` names and renamed when complete; manifest.json is written last, so an interrupted or failed
conversion never leaves a valid-looking container.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

import glmkit
from glmkit.convert.plan import QuantPlan
from glmkit.convert.source import SIDE_FILES, HFSnapshot
from glmkit.errors import GlmkitError
from glmkit.formats.manifest import MANIFEST_NAME, ExpertRange, Manifest, Quant, TensorEntry
from glmkit.formats.packing import pack, quantize
from glmkit.formats.schema import TensorSpec, model_tensors
from glmkit.formats.writer import DataFileWriter, PlannedTensor, layout_files

DEFAULT_FILE_BYTES = 4 << 30


@dataclass(frozen=True)
class ConvertResult:
    out: Path
    model_hash: str
    source_bytes: int
    output_bytes: int
    tensors: int


def convert(source_dir: str | Path, out_dir: str | Path, plan: QuantPlan, preset: str,
            force: bool = False, max_file_bytes: int = DEFAULT_FILE_BYTES, progress: bool = True) -> ConvertResult:
    """Convert a local HF snapshot into a container at `out_dir`."""
    source = HFSnapshot(source_dir)
    cfg = source.config
    specs = _check_source(source)
    units = _units(specs, plan)
    layouts = layout_files([[p for _, p in unit] for unit in units], max_file_bytes)

    out = Path(out_dir)
    _prepare_out(out, force)
    by_name = {s.name: s for s in specs}
    entries: dict[str, TensorEntry] = {}
    files: dict[str, dict[str, object]] = {}
    total = sum(source.source_bytes(s) for s in specs)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="convert", disable=not progress, file=sys.stderr)
    writer: DataFileWriter | None = None
    done = 0
    try:
        for layout in layouts:
            writer = DataFileWriter(out, layout)
            for planned, _ in layout.tensors:
                spec = by_name.get(planned.name)
                if spec is None:
                    continue  # a `.qs` scales tensor, written together with its weight
                entries.update(_write_tensor(writer, source, plan, spec))
                done += 1
                bar.set_postfix_str(f"{done}/{len(specs)} tensors", refresh=False)
                bar.update(source.source_bytes(spec))
            files[layout.name] = writer.finish()
            writer = None
        bar.close()
        for name in SIDE_FILES:
            if (source.directory / name).is_file():
                tmp = out / (name + ".tmp")
                shutil.copyfile(source.directory / name, tmp)
                tmp.replace(out / name)
        manifest = Manifest(
            model_hash="",
            source={"kind": "local", "files": source.file_digests()},
            conversion={"preset": preset, **plan.to_json(), "mtp": any(s.layer == cfg.num_hidden_layers
                                                                        for s in specs)},
            files=files,
            tensors=entries,
            experts=_expert_ranges(specs, entries),
            config_sha256=_sha256_file(out / "config.json"),
            created_by={"tool": "glm-convert", "glmkit_version": glmkit.__version__,
                        "source_path": str(source.directory.resolve())},
        )
        manifest.model_hash = manifest.compute_hash()
        manifest.write(out)
    except BaseException:
        bar.close()
        if writer is not None:
            writer.abort()
        raise
    return ConvertResult(out, manifest.model_hash, total, sum(int(f["nbytes"]) for f in files.values()),
                         len(entries))


def _check_source(source: HFSnapshot) -> list[TensorSpec]:
    """The tensors to convert; every one must exist. MTP is optional but all-or-nothing."""
    cfg = source.config
    specs = model_tensors(cfg, include_mtp=cfg.num_nextn_predict_layers > 0)
    mtp = [s for s in specs if s.layer is not None and s.layer >= cfg.num_hidden_layers]
    present = [s for s in mtp if source.has(s.name)]
    if mtp and not present:
        print(f"glm-convert: note: {source.directory} has no MTP layer tensors; converting without MTP",
              file=sys.stderr)
        specs = [s for s in specs if s not in mtp]
    for s in specs:
        source.check(s)
    return specs


def _units(specs: list[TensorSpec], plan: QuantPlan) -> list[list[tuple[TensorSpec, PlannedTensor]]]:
    """Stored tensors grouped into units that stay contiguous: one routed expert = one unit."""
    units: list[list[tuple[TensorSpec, PlannedTensor]]] = []
    last_expert: tuple[int | None, int | None] = (None, None)
    for spec in specs:
        stored = [(spec, p) for p in plan.stored(spec)]
        key = (spec.layer, spec.expert)
        if spec.expert is not None and key == last_expert:
            units[-1].extend(stored)
        else:
            units.append(stored)
        last_expert = key
    return units


def _write_tensor(writer: DataFileWriter, source: HFSnapshot, plan: QuantPlan, spec: TensorSpec
                  ) -> dict[str, TensorEntry]:
    weights = source.load(spec)
    quant = plan.quant_for(spec)
    file = writer.layout.name
    if quant is None:
        offset, digest = writer.write(spec.name, weights)
        return {spec.name: TensorEntry(spec.name, file, offset, weights.nbytes, spec.shape, "F32", spec.role,
                                       digest)}
    bits, group = quant
    codes, scales = quantize(weights, bits, group)
    del weights
    packed = pack(codes, bits)
    del codes
    offset, digest = writer.write(spec.name, packed)
    s_offset, s_digest = writer.write(spec.name + ".qs", scales)
    qs = spec.name + ".qs"
    return {
        spec.name: TensorEntry(spec.name, file, offset, packed.nbytes, spec.shape, "U8", spec.role, digest,
                               Quant(bits, group, qs)),
        qs: TensorEntry(qs, file, s_offset, scales.nbytes, tuple(scales.shape), "F32", "scales", s_digest),
    }


def _expert_ranges(specs: list[TensorSpec], entries: dict[str, TensorEntry]) -> list[ExpertRange]:
    spans: dict[tuple[int, int], list[TensorEntry]] = {}
    for spec in specs:
        if spec.expert is None or spec.layer is None:
            continue
        parts = [entries[spec.name]]
        if (q := entries[spec.name].quant) is not None:
            parts.append(entries[q.scales])
        spans.setdefault((spec.layer, spec.expert), []).extend(parts)
    ranges = []
    for (layer, expert), parts in spans.items():
        start = min(p.offset for p in parts)
        end = max(p.offset + p.nbytes for p in parts)
        ranges.append(ExpertRange(layer, expert, parts[0].file, start, end - start))
    return ranges


def _prepare_out(out: Path, force: bool) -> None:
    """Refuse a non-empty OUT unless forced; never leave an old manifest that would look valid."""
    if out.exists() and not out.is_dir():
        raise GlmkitError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise GlmkitError(f"{out}: output directory is not empty (use --force to overwrite)")
        (out / MANIFEST_NAME).unlink(missing_ok=True)
        for old in out.glob("model-*.safetensors*"):
            old.unlink()
    out.mkdir(parents=True, exist_ok=True)


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
