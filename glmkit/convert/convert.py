"""HF snapshot -> container: plan every tensor, lay out the files, stream tensors through quantization.

Only one source tensor (plus its quantized form) is in memory at a time. Data files are written under
`*.tmp` names and renamed when complete; manifest.json is written last, so an interrupted or failed
conversion never leaves a valid-looking container. The source is a local snapshot or a Hub repo; for a
Hub repo the `ShardFetcher` keeps on disk only the shards the next tensors read (fetch.py). Progress is
recorded in OUT (resume.py): re-running the same command continues after the last complete data file.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from tqdm import tqdm

import glmkit
from glmkit.convert.plan import DEFAULT_QUANTIZER, PRESETS, QuantPlan
from glmkit.convert.quantizers import HessianFactor, choose_scales, gptq_quantize, normalized_importance
from glmkit.convert.resume import STATE_DIR, ConversionState, DoneFile, differences, source_change
from glmkit.convert.sources.fetch import peak_alive_bytes
from glmkit.convert.sources.open import open_source
from glmkit.convert.sources.snapshot import SIDE_FILES, HFSnapshot, copy_side_file, file_identity
from glmkit.convert.sources.source import BackgroundDigests, Source
from glmkit.errors import GlmkitError
from glmkit.format.imatrix import Imatrix
from glmkit.format.manifest import FORMAT_VERSION, MANIFEST_NAME, ExpertRange, Manifest, Quant, TensorEntry
from glmkit.format.packing import pack, quantize
from glmkit.format.schema import TensorSpec, layer_prefix, model_tensors
from glmkit.format.writer import DataFileWriter, FileLayout, PlannedTensor, layout_files
from glmkit.units import format_size

DEFAULT_FILE_BYTES = 4 << 30
DEFAULT_INFLIGHT_BYTES = 16 << 30
# manifest.json and the progress log grow by well under this per stored tensor
STATE_BYTES_PER_TENSOR = 1024


@dataclass(frozen=True)
class ConvertResult:
    out: Path
    model_hash: str
    source_bytes: int
    output_bytes: int
    tensors: int
    resumed_files: int = 0  # data files an earlier, interrupted run had completed
    peak_source_bytes: int = 0  # most bytes of downloaded shards on OUT's disk at once
    already_converted: bool = False  # OUT held this very conversion, finished: nothing was written


@dataclass
class ConversionJob:
    """A planned conversion: what to read, what to write, and the identity a resume must match."""

    source: Source
    plan: QuantPlan
    preset: str
    specs: list[TensorSpec]
    layouts: list[FileLayout]
    identity: dict[str, Any]
    max_file_bytes: int
    importance: Importance

    @classmethod
    def create(cls, source: Source, plan: QuantPlan, preset: str, max_file_bytes: int,
               imatrix: Imatrix | None = None, calibration: Calibration | None = None) -> ConversionJob:
        """calibration: statistics made while converting (`Importance.bind`), instead of an imatrix's."""
        specs = _check_source(source.snapshot)
        check_group_sizes(plan, specs)
        importance = (Importance(imatrix, specs, plan) if calibration is None
                      else calibration.bind(source.snapshot, specs, plan))
        layouts = _layouts(specs, plan, max_file_bytes)
        layout_digest = hashlib.sha256(b"".join(layout.header for layout in layouts)).hexdigest()
        conversion = _conversion_record(source.snapshot, specs, plan, preset, importance)
        identity = {"source": source.identity, "conversion": conversion,
                    "max_file_bytes": max_file_bytes, "glmkit_version": glmkit.__version__,
                    "format_version": FORMAT_VERSION, "layout_sha256": layout_digest}
        return cls(source, plan, preset, specs, layouts, identity, max_file_bytes, importance)

    @cached_property
    def spec_by_name(self) -> dict[str, TensorSpec]:
        return {s.name: s for s in self.specs}

    def steps(self, layouts: list[FileLayout]) -> tuple[list[TensorSpec], list[set[str]]]:
        """The logical tensors the given files hold, in write order, and the shards each one reads."""
        by_name = self.spec_by_name
        specs = [by_name[p.name] for layout in layouts for p, _ in layout.tensors if p.name in by_name]
        return specs, [self.importance.reads(self.source.snapshot, s) for s in specs]

    def disk_needed(self, layouts: list[FileLayout], budget: int) -> tuple[int, int]:
        """(output bytes, peak downloaded source bytes) that writing `layouts` adds to OUT's file system."""
        _, steps = self.steps(layouts)
        sizes = self.source.download_bytes()
        stored = sum(len(layout.tensors) for layout in layouts)
        output = sum(layout.size for layout in layouts) + STATE_BYTES_PER_TENSOR * stored
        needed = {name for step in steps for name in step}
        in_flight = min(max(peak_alive_bytes(steps, sizes), budget), sum(sizes[n] for n in needed))
        return output, in_flight


def convert(source: str | Path | Source, out_dir: str | Path, plan: QuantPlan, preset: str, force: bool = False,
            max_file_bytes: int = DEFAULT_FILE_BYTES, progress: bool = True, *, revision: str | None = None,
            endpoint: str | None = None, keep_source: bool = False,
            max_inflight: int = DEFAULT_INFLIGHT_BYTES, imatrix: Imatrix | None = None,
            allow_nonfinite: bool = False, calibration: Calibration | None = None) -> ConvertResult:
    """Convert SOURCE (local snapshot, HF cache directory or Hub repo id) into a container at `out_dir`.

    imatrix: per-column activation energies (glm-calibrate) weighting the `mse` quantizer's error, and Hessians.
    calibration: statistics made layer by layer while converting (glm-convert --calibrate), instead of an imatrix.
    allow_nonfinite: convert NaN/infinite source values and non-positive FP8 scales instead of failing.
    """
    src = source if isinstance(source, Source) else open_source(
        str(source), revision=revision, endpoint=endpoint, keep_source=keep_source)
    src.snapshot.allow_nonfinite = allow_nonfinite
    try:
        check_out_apart(src, Path(out_dir))
        job = ConversionJob.create(src, plan, preset, max_file_bytes, imatrix, calibration)
        return _run(job, Path(out_dir), force, progress, max_inflight)
    finally:
        src.close()


def check_group_sizes(plan: QuantPlan, specs: list[TensorSpec]) -> None:
    """Refuse a scale group wider than every weight's rows (each row is padded to whole groups: the work and memory
    would grow with the group), before anything is read or written."""
    widest = max(spec.shape[-1] for spec in specs)
    for group in sorted({plan.group_size or 0, *(g or 0 for g in plan.groups.values())}):
        if group > widest:
            raise GlmkitError(f"--group-size: {group} is wider than every weight's rows (the widest has {widest} "
                              "columns; 0 = one scale per row)")


def check_out_apart(source: Source, out: Path) -> None:
    """Refuse an OUT that is the source, sits inside it or holds it (symlinks resolved): preparing OUT
    deletes its old data files and writes new ones, which would destroy the source before it is read."""
    target = out.resolve()
    for path in source.local_paths():
        real = path.resolve()
        if target == real or target in real.parents:
            relation = "is" if target == real else "holds"
        elif real in target.parents:
            relation = "is inside"
        else:
            continue
        raise GlmkitError(f"{out}: {relation} the source {path}; converting would overwrite or delete source files: "
                          "choose an output directory outside the source")


def _run(job: ConversionJob, out: Path, force: bool, progress: bool, budget: int) -> ConvertResult:
    state = ConversionState(out)
    if not force and not state.exists() and (finished := _finished(job, out)) is not None:
        return finished
    done = _open_output(job, out, state, force, budget)
    snapshot = job.source.snapshot
    todo = job.layouts[len(done):]
    specs, steps = job.steps(todo)
    entries: dict[str, TensorEntry] = {}
    files: dict[str, dict[str, object]] = {}
    for name, finished in done.items():
        files[name] = finished.record
        entries.update({t: TensorEntry.from_json(t, e) for t, e in finished.tensors.items()})
    if done:
        job.importance.resume(out, entries)
    needed = set().union(*steps)
    to_download = sum(size for name, size in job.source.download_bytes().items() if name in needed)
    down_bar = tqdm(total=to_download, unit="B", unit_scale=True, desc="download", position=0, file=sys.stderr,
                    disable=not progress or not to_download)
    bar = tqdm(total=sum(snapshot.source_bytes(s) for s in specs), unit="B", unit_scale=True, desc="convert",
               position=1 if to_download else 0, disable=not progress, file=sys.stderr)
    spec_names = {s.name for s in job.specs}
    writer: DataFileWriter | None = None
    fetcher = None
    hashing = BackgroundDigests(job.source)
    try:
        fetcher = job.source.fetcher(steps, state.staging, budget, down_bar)
        step = 0
        for layout in todo:
            writer = DataFileWriter(out, layout)
            planned_entries = _planned_entries(job, layout)
            written: dict[str, TensorEntry] = {}
            for planned, _ in layout.tensors:
                if planned.name not in spec_names:
                    continue  # a `.qs` scales tensor, written together with its weight
                spec = specs[step]
                fetcher.acquire(step)
                job.importance.prepare(spec)
                digests = _write_tensor(writer, snapshot, job.plan, spec, job.importance)
                written.update({n: replace(planned_entries[n], sha256=d) for n, d in digests.items()})
                fetcher.release(step)
                step += 1
                bar.set_postfix_str(f"{len(job.specs) - len(specs) + step}/{len(job.specs)} tensors", refresh=False)
                bar.update(snapshot.source_bytes(spec))
            files[layout.name] = writer.finish()
            writer = None
            entries.update(written)
            state.record(layout.name, files[layout.name], {n: e.to_json() for n, e in written.items()},
                         file_identity(out / layout.name))
        fetcher.close()
        down_bar.close()
        bar.close()
        for name in job.source.side_files:
            copy_side_file(job.source.side_dir / name, out / name)
        manifest = Manifest(
            model_hash="",
            source={"files": hashing.result(), "origin": job.source.origin},
            conversion=job.identity["conversion"],
            files={layout.name: files[layout.name] for layout in job.layouts},
            tensors=entries,
            experts=_expert_ranges(job.specs, entries),
            config_sha256=_sha256_file(out / "config.json"),
            created_by={"tool": "glm-convert", "glmkit_version": glmkit.__version__},
        )
        manifest.model_hash = manifest.compute_hash()
        manifest.write(out)
        state.finish()
    except BaseException:
        hashing.cancel()
        if fetcher is not None:
            fetcher.close()
        down_bar.close()
        bar.close()
        if writer is not None:
            writer.abort()
        state.unlock()
        raise
    return ConvertResult(out, manifest.model_hash, sum(snapshot.source_bytes(s) for s in job.specs),
                         sum(int(f["nbytes"]) for f in files.values()), len(entries), len(done),
                         fetcher.peak_bytes)


def _finished(job: ConversionJob, out: Path) -> ConvertResult | None:
    """OUT's finished container when it is this very conversion (same source, parameters, layout, side files
    and glmkit version): nothing to do. One of other inputs is an error; None when OUT holds no readable one."""
    try:
        manifest = Manifest.read(out)
    except GlmkitError:
        return None
    reasons = differences(manifest.conversion, job.identity["conversion"], "conversion.")
    version = manifest.created_by.get("glmkit_version")
    if version != glmkit.__version__:
        reasons.append(f"written by glmkit {version}, this is {glmkit.__version__}")
    origin = {k: v for k, v in job.source.identity.items() if k != "files"}
    if {k: manifest.source.get("origin", {}).get(k) for k in origin} != origin:
        reasons.append(f"source {_source_name(manifest.source.get('origin', {}))} in OUT vs "
                       f"{_source_name(job.source.origin)} now")
    elif (change := job.source.changed_since(manifest.source.get("files", {}),
                                              (out / MANIFEST_NAME).stat().st_mtime_ns)) is not None:
        reasons.append(change)
    if {name: f.get("nbytes") for name, f in manifest.files.items()} != {lay.name: lay.size for lay in job.layouts}:
        reasons.append("other data files (--max-file-size)")
    for name in sorted(set(SIDE_FILES) & ({p.name for p in out.iterdir()} | set(job.source.side_files))):
        if (name not in job.source.side_files or not (out / name).is_file()
                or (out / name).read_bytes() != (job.source.side_dir / name).read_bytes()):
            reasons.append(f"{name} differs")
    if reasons:
        raise GlmkitError(f"{out}: holds a finished conversion of other inputs ({'; '.join(reasons)}): use --force "
                          "to overwrite it")
    for name, record in manifest.files.items():
        if not (out / name).is_file() or (out / name).stat().st_size != record["nbytes"]:
            raise GlmkitError(f"{out}: holds this conversion, finished, but its data file {name} is missing or "
                              "truncated: use --force to convert again")
    return ConvertResult(out, manifest.model_hash, sum(job.source.snapshot.source_bytes(s) for s in job.specs),
                         sum(int(f["nbytes"]) for f in manifest.files.values()), len(manifest.tensors),
                         already_converted=True)


def _source_name(origin: dict[str, Any]) -> str:
    return json.dumps(origin.get("repo") or origin.get("path")) + (f"@{origin['revision'][:12]}"
                                                                    if origin.get("revision") else "")


def _open_output(job: ConversionJob, out: Path, state: ConversionState, force: bool, budget: int
                 ) -> dict[str, DoneFile]:
    """Lock OUT and decide: resume (same identity), refuse (another conversion), or start afresh."""
    if out.exists() and not out.is_dir():
        raise GlmkitError(f"{out}: exists and is not a directory")
    created = not out.exists()
    if (not force and not state.exists() and out.is_dir()
            and any(p.name != STATE_DIR for p in out.iterdir())):
        raise GlmkitError(f"{out}: output directory is not empty (use --force to overwrite)")
    state.lock()
    try:
        try:
            then = state.identity()
            recorded = state.done() if then == job.identity else {}
        except GlmkitError:
            if not force:
                raise
            then, recorded = None, {}  # --force starts over from damaged state
        same = then is not None and then == job.identity
        resume = same and job.importance.resumable
        if same and not resume:
            print(f"glm-convert: {out} holds an unfinished conversion of the same inputs whose statistics cannot "
                  "resume: starting over", file=sys.stderr)
        if then is not None and not same and not force:
            if (change := source_change(then, job.identity)) is not None:
                raise GlmkitError(f"{out}: holds an unfinished conversion of this source, but its {change} since that "
                                  "run began: the data files already written hold the old weights; use --force to "
                                  "start over")
            old_revision = then.get("source", {}).get("revision")
            pin = (f" (with --revision {old_revision})" if old_revision
                   and old_revision != job.identity["source"].get("revision") else "")
            raise GlmkitError(f"{out}: holds an unfinished conversion with other inputs "
                              f"({'; '.join(differences(then, job.identity))}): rerun that command{pin} to finish it, "
                              "or use --force to start over")
        done = _completed_prefix(job, out, recorded) if resume else {}
        if not force:
            _check_disk(job, out, state, done, budget, reuse_staged=resume)
        if resume:
            state.clean_partial_downloads()
            if done:
                print(f"glm-convert: resuming {out}: {len(done)} of {len(job.layouts)} data files already "
                      "converted", file=sys.stderr)
            return done
        (out / MANIFEST_NAME).unlink(missing_ok=True)
        for old in out.glob("model-*.safetensors*"):
            old.unlink()
        state.start(job.identity)
        return {}
    except BaseException:
        if state.locked and not state.exists():  # nothing to resume: leave OUT as it was
            state.finish()
            if created and out.is_dir() and not any(out.iterdir()):
                out.rmdir()
        state.unlock()
        raise


def _completed_prefix(job: ConversionJob, out: Path, recorded: dict[str, DoneFile]) -> dict[str, DoneFile]:
    """The data files, in layout order, that a previous run recorded complete and that are still intact: the
    record is what writing that layout records, and the file has the size, mtime and sampled bytes it had."""
    done: dict[str, DoneFile] = {}
    for layout in job.layouts:
        finished = recorded.get(layout.name)
        path = out / layout.name
        if (finished is None or not _records_layout(job, layout, finished) or not path.is_file()
                or path.stat().st_size != layout.size or file_identity(path) != finished.identity):
            break
        done[layout.name] = finished
    return done


def _records_layout(job: ConversionJob, layout: FileLayout, finished: DoneFile) -> bool:
    """Whether a done.jsonl line is what writing `layout` records: its size, a digest and the planned entries."""
    record, digest = finished.record, finished.record.get("sha256")
    if record.keys() != {"nbytes", "sha256"} or record["nbytes"] != layout.size or not (
            isinstance(digest, str) and len(digest) == 64 and set(digest) <= set("0123456789abcdef")):
        return False
    planned = _planned_entries(job, layout)
    if finished.tensors.keys() != planned.keys():
        return False
    try:
        entries = {n: TensorEntry.from_json(n, e) for n, e in finished.tensors.items()}
    except GlmkitError:
        return False
    return all(replace(entries[n], sha256="") == planned[n] for n in planned)


def free_bytes(path: Path) -> int:
    """Free bytes on the file system holding `path` (or its nearest existing parent)."""
    return shutil.disk_usage(_existing_dir(path)).free


def _existing_dir(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _check_disk(job: ConversionJob, out: Path, state: ConversionState, done: dict[str, DoneFile], budget: int,
                reuse_staged: bool) -> None:
    """Refuse to start when OUT's file system cannot hold the rest of the output plus the shards in flight."""
    todo = job.layouts[len(done):]
    output, in_flight = job.disk_needed(todo, budget)
    reclaimable = sum(p.stat().st_size for p in out.glob("model-*.safetensors*") if p.name not in done
                      ) if out.is_dir() else 0
    reclaimable += state.staged_bytes() if reuse_staged else 0
    available = free_bytes(out) + reclaimable
    cache, cache_dir = job.source.cache_bytes(), job.source.cache_dir
    same_fs = bool(cache) and _existing_dir(cache_dir).stat().st_dev == _existing_dir(out).stat().st_dev
    needed = output + in_flight + (cache if same_fs else 0)
    if needed > available:
        parts = [f"{format_size(output)} output", f"{format_size(in_flight)} downloaded shards in flight"]
        if same_fs:
            parts.append(f"{format_size(cache)} kept in the HF cache (--keep-source)")
        raise GlmkitError(f"{out}: not enough disk space: needs {format_size(needed)} ({' + '.join(parts)}) but "
                          f"its file system has {format_size(available)} available; free some space, lower "
                          "--max-inflight, or use --force to try anyway")
    if cache and not same_fs and cache > free_bytes(cache_dir):
        raise GlmkitError(f"{cache_dir}: not enough disk space for --keep-source: the HF cache needs "
                          f"{format_size(cache)}, its file system has {format_size(free_bytes(cache_dir))}; "
                          "drop --keep-source, or use --force to try anyway")


def dry_run_report(source: str | Path | Source, out_dir: str | Path, plan: QuantPlan, preset: str,
                   max_file_bytes: int = DEFAULT_FILE_BYTES, *, revision: str | None = None,
                   endpoint: str | None = None, keep_source: bool = False,
                   max_inflight: int = DEFAULT_INFLIGHT_BYTES, imatrix: Imatrix | None = None,
                   calibrating: bool = False) -> str:
    """What a conversion would download and write, and the disk it needs; touches neither OUT nor weights.

    calibrating: glm-convert --calibrate (statistics made while converting, none needed to plan)."""
    src = source if isinstance(source, Source) else open_source(
        str(source), revision=revision, endpoint=endpoint, keep_source=keep_source)
    try:
        if calibrating and imatrix is None:  # statistics to come: plan the same layout
            plan = replace(plan, quantizer=DEFAULT_QUANTIZER)
        job = ConversionJob.create(src, plan, preset, max_file_bytes, imatrix)
        snapshot = src.snapshot
        origin = src.origin
        lines = [f"source: {origin.get('repo') or origin.get('path')}"
                 + (f" @ {origin['revision']}" if "revision" in origin else "")
                 + (f" (revision {origin['requested_revision']!r}, {origin['endpoint']})" if src.remote else "")]
        lines.append(f"shards: {len(snapshot.shard_bytes)}, {format_size(sum(snapshot.shard_bytes.values()))}")
        for name, size in snapshot.shard_bytes.items():
            where = "local" if not src.remote else "in the HF cache" if name in src.cached else "download"
            lines.append(f"  {name}  {format_size(size)}  {where}")
        if src.remote:
            download = sum(s for n, s in snapshot.shard_bytes.items() if n not in src.cached)
            lines.append(f"download: {format_size(download)}")
        lines.append("expected output size per preset:")
        for name in PRESETS:
            if name == preset:
                size = sum(layout.size for layout in job.layouts)
                mark = "  <- selected" + ("" if plan == plan.on_preset(name) else " (with your overrides)")
            else:
                size = sum(layout.size for layout in _layouts(job.specs, plan.on_preset(name), max_file_bytes))
                mark = ""
            lines.append(f"  {name:4s} {format_size(size):>10s}{mark}")
        output, in_flight = job.disk_needed(job.layouts, max_inflight)
        if calibrating:
            lines.append("--calibrate: the calibration text runs through the source layer by layer while it is "
                         "converted (one read of the source, no temporary container; shards held a layer at a time)")
        need = f"disk needed in {out_dir}: {format_size(output + in_flight)} ({format_size(output)} output"
        if src.remote and not keep_source:
            need += f" + {format_size(in_flight)} shards in flight, --max-inflight {format_size(max_inflight)}"
        free = free_bytes(Path(out_dir))
        need += f"); available: {format_size(free)}"
        lines.append(need + (" - enough" if output + in_flight <= free else
                             " - NOT enough: free some space or lower --max-inflight"))
        if src.remote and keep_source:
            lines.append(f"HF cache ({src.cache_dir}) grows by {format_size(src.cache_bytes())} (--keep-source)")
        return "\n".join(lines)
    finally:
        src.close()


def _check_source(source: HFSnapshot) -> list[TensorSpec]:
    """The tensors to convert. The source must hold exactly the model config.json describes: every tensor (with
    the shape config.json implies) and nothing else besides FP8 scales and fused expert tensors, so a layer count
    that is off (the MTP layer taken for a decoder layer, or the reverse) or an indexer on a layer scheduled
    without one is refused. MTP is optional but all-or-nothing."""
    cfg = source.config
    specs = model_tensors(cfg, include_mtp=cfg.num_nextn_predict_layers > 0)
    mtp = [s for s in specs if s.layer is not None and s.layer >= cfg.num_hidden_layers]
    present = [s for s in mtp if source.has(s.name)]
    if mtp and not present:
        specs = [s for s in specs if s not in mtp]
    for s in specs:
        if not source.has(s.name):
            raise GlmkitError(f"{source.label}: tensor {s.name!r} is missing from the source, but the model "
                              f"config.json describes has it ({_layers_described(source, bool(present))}): "
                              "config.json does not match these weights")
        source.check(s)
    used = set().union(*(source.stored_names(s) for s in specs))
    # exports that copy the main embedding and lm_head into the MTP layer: it reuses the main ones
    copies = {f"{layer_prefix(cfg.num_hidden_layers)}{n}" for n in ("embed_tokens.weight", "shared_head.head.weight")
              } if present else set()
    extra = sorted((n for n in source.tensors if n not in used and n not in copies), key=_layer_order)
    if extra:
        raise GlmkitError(f"{source.where(extra[0])}: tensor {extra[0]!r} is not part of the model config.json "
                          f"describes ({_layers_described(source, bool(present))}): config.json does not match these "
                          "weights")
    if mtp and not present:
        print(f"glm-convert: note: {source.label} has no MTP layer tensors; converting without MTP",
              file=sys.stderr)
    return specs


def _layers_described(source: HFSnapshot, mtp: bool) -> str:
    """What config.json says the layers are, against the layer indices the source holds (for a mismatch)."""
    cfg = source.config
    held = sorted({_layer_order(n)[0] for n in source.tensors} - {-1})
    where = f"MTP at layer {cfg.num_hidden_layers}" if mtp else "no MTP layer"
    span = f"layers {held[0]}-{held[-1]}" if held else "no layers"
    return (f"num_hidden_layers={cfg.num_hidden_layers}, num_nextn_predict_layers={cfg.num_nextn_predict_layers}, "
            f"{where}; the source holds {span}")


def _layer_order(name: str) -> tuple[int, str]:
    """(decoder layer index or -1, name): source tensors in layer order."""
    head, _, tail = name.removeprefix("model.layers.").partition(".")
    return (int(head), name) if name.startswith("model.layers.") and head.isdigit() and tail else (-1, name)


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


def _layouts(specs: list[TensorSpec], plan: QuantPlan, max_file_bytes: int) -> list[FileLayout]:
    return layout_files([[p for _, p in unit] for unit in _units(specs, plan)], max_file_bytes)


def _conversion_record(snapshot: HFSnapshot, specs: list[TensorSpec], plan: QuantPlan, preset: str,
                       importance: Importance) -> dict[str, Any]:
    mtp = any(s.layer == snapshot.config.num_hidden_layers for s in specs)
    return {"preset": preset, **plan.to_json(), "mtp": mtp, **importance.record()}


FACTOR_CACHE = 3  # GPTQ factors kept (GLM-5: 151 MB each for 6144 inputs)


class Calibration(Protocol):
    """Statistics made while converting (glm-convert --calibrate: glmkit.eval.layerwise), bound to a conversion."""

    def bind(self, snapshot: HFSnapshot, specs: list[TensorSpec], plan: QuantPlan) -> Importance: ...


class Importance:
    """Per-tensor input-column importance for the `mse` quantizer, and Hessians for `gptq`, from an imatrix
    (None: uniform; `gptq` needs one).

    A routed expert the calibration text never reached has no statistics of its own: it gets the mean of
    its layer's other experts' (same projection). Tensors with no linear input (the embedding) are uniform.

    The converter calls `reads`, `prepare`, `source_blocks` and `written` around every tensor it writes: here they
    read the source as it is; statistics made while converting (glm-convert --calibrate) override them.
    """

    resumable = True  # an interrupted conversion continues after its last complete data file

    def __init__(self, imatrix: Imatrix | None, specs: list[TensorSpec], plan: QuantPlan):
        self.use(imatrix)
        if imatrix is None:
            if plan.quantizer == "gptq":
                raise GlmkitError("--quantizer gptq: needs calibration statistics: --imatrix FILE (glm-calibrate) "
                                  "or --calibrate TEXT")
            return
        if plan.quantizer == "absmax":
            raise GlmkitError("--imatrix: weights the error of the mse and gptq quantizers; it cannot be used "
                              "with --quantizer absmax")
        shapes = {s.name: s.shape for s in specs}
        for name, v in imatrix.values.items():
            shape = shapes.get(name)
            if shape is None:
                continue  # e.g. the router (kept F32) or an MTP layer this conversion leaves out
            if len(shape) != 2 or v.shape != (shape[1],):
                raise GlmkitError(f"--imatrix: {name} has {v.shape[0]} input columns there but {list(shape)} in "
                                  "this source: the imatrix was collected on another model")
        quantized = [s for s in specs if plan.quant_for(s) is not None]
        if not quantized:
            raise GlmkitError("--imatrix: this preset quantizes nothing (f32)")
        if not any(s.name in imatrix.values for s in quantized):
            raise GlmkitError("--imatrix: names none of this model's quantized weights: collected on another model")
        if plan.quantizer == "gptq" and not any(s.name in imatrix.hessians for s in quantized):
            raise GlmkitError("--quantizer gptq: the imatrix holds no Hessians for this model's quantized weights "
                              "(collect them with glm-calibrate --hessians pooled)")

    def use(self, imatrix: Imatrix | None) -> None:
        """Take the statistics from `imatrix` from now on (what was derived from earlier ones is dropped)."""
        self.imatrix = imatrix
        self._fallback: dict[str, np.ndarray | None] = {}
        self._factors: dict[str, HessianFactor] = {}  # Hessian tensor name -> factor, oldest first

    def record(self) -> dict[str, Any]:
        """What the conversion record (manifest `conversion`) says about the statistics."""
        if self.imatrix is None:
            return {}
        return {"imatrix": {"sha256": self.imatrix.sha256, "model_hash": self.imatrix.model_hash,
                            "tokens": self.imatrix.tokens}}

    def reads(self, snapshot: HFSnapshot, spec: TensorSpec) -> set[str]:
        """The source shards that must be on disk while `spec` is converted."""
        return snapshot.files_for(spec)

    def prepare(self, spec: TensorSpec) -> None:
        """Called before `spec` is converted."""

    def resume(self, out: Path, entries: dict[str, TensorEntry]) -> None:
        """The conversion continues after the data files in `out` an earlier run completed, which hold `entries`."""

    def source_blocks(self, snapshot: HFSnapshot, spec: TensorSpec, rows: int) -> Iterator[np.ndarray]:
        """The source tensor as float32: whole, or a big stored one in blocks of about `rows` rows."""
        if spec.name in snapshot.tensors and len(spec.shape) == 2 and spec.shape[0] > rows:
            return snapshot.row_blocks(spec, rows)
        return iter([snapshot.load(spec)])

    def written(self, spec: TensorSpec, first_row: int, packed: np.ndarray, scales: np.ndarray | None) -> None:
        """Rows `first_row..` of `spec` as stored: packed codes `[n, bytes]` uint8 and their scales, or float32
        values (scales None)."""

    def hessian(self, spec: TensorSpec) -> HessianFactor | None:
        """GPTQ's factor of this weight's input Hessian, when calibration recorded one. Weights sharing an input
        are written near each other (q_a/kv_a, gate/up), so the last few factors are kept."""
        if self.imatrix is None or (tensor := self.imatrix.hessians.get(spec.name)) is None:
            return None
        if tensor not in self._factors:
            hessian = self.imatrix.hessian(spec.name)
            assert hessian is not None
            try:
                self._factors[tensor] = HessianFactor.from_hessian(hessian)
            except np.linalg.LinAlgError:
                raise GlmkitError(f"--imatrix: the Hessian of {spec.name} is not positive definite") from None
            while len(self._factors) > FACTOR_CACHE:
                del self._factors[next(iter(self._factors))]
        return self._factors[tensor]

    def __call__(self, spec: TensorSpec) -> np.ndarray | None:
        if self.imatrix is None:
            return None
        values = self.imatrix.values.get(spec.name)
        if values is None and spec.expert is not None:
            values = self._expert_mean(spec)
        return None if values is None else normalized_importance(values)

    def _expert_mean(self, spec: TensorSpec) -> np.ndarray | None:
        prefix, _, tail = spec.name.partition(f"mlp.experts.{spec.expert}.")
        key = prefix + tail
        if key not in self._fallback:
            assert self.imatrix is not None
            pattern = f"{prefix}mlp.experts."
            seen = [(v, self.imatrix.counts.get(n, 0)) for n, v in self.imatrix.values.items()
                    if n.startswith(pattern) and n.endswith("." + tail) and v.shape == (spec.shape[1],)]
            total = sum(c for _, c in seen)
            self._fallback[key] = (sum(v.astype(np.float64) * c for v, c in seen) / total) if total else None
        return self._fallback[key]


STREAM_ELEMS = 1 << 22  # tensors with more elements are read, quantized and written in row blocks of this size


def _write_tensor(writer: DataFileWriter, source: HFSnapshot, plan: QuantPlan, spec: TensorSpec,
                  importance: Importance) -> dict[str, str]:
    """Convert one tensor; returns the sha256 of each stored tensor it became (the weight, and `.qs` scales).
    Every scheme is row-local (a row's scales and codes depend on that row alone, GPTQ included), so a big
    stored tensor (embed, lm_head: GB at GLM-5 size) goes through in row blocks: the converter's memory stays
    at one block, not the tensor."""
    quant = plan.quant_for(spec)
    rows = max(1, STREAM_ELEMS // max(spec.shape[-1], 1))
    blocks = importance.source_blocks(source, spec, rows)
    if quant is None:
        def kept_blocks() -> Iterator[np.ndarray]:
            first = 0
            for values in blocks:
                importance.written(spec, first, values, None)
                first += len(values)
                yield values

        return {spec.name: writer.write_rows(spec.name, kept_blocks())[1]}
    bits, group = quant
    scheme = plan.scheme_for(bits)
    hessian = importance.hessian(spec) if plan.quantizer == "gptq" else None
    weights_importance = importance(spec) if hessian is None else None
    scales: list[np.ndarray] = []

    def packed_blocks() -> Iterator[np.ndarray]:
        first = 0
        for weights in blocks:
            if hessian is not None:
                codes, block_scales = gptq_quantize(weights, hessian, bits, group, scheme=scheme)
            else:
                chosen = choose_scales(weights, bits, group, plan.quantizer, weights_importance, scheme=scheme)
                codes, block_scales = quantize(weights, bits, group, chosen, scheme)
            del weights
            scales.append(block_scales)
            packed = pack(codes, bits)
            del codes
            importance.written(spec, first, packed, block_scales)
            first += len(packed)
            yield packed

    digest = writer.write_rows(spec.name, packed_blocks())[1]
    return {spec.name: digest, spec.name + ".qs": writer.write_rows(spec.name + ".qs", scales)[1]}


def _planned_entries(job: ConversionJob, layout: FileLayout) -> dict[str, TensorEntry]:
    """The manifest entries of a laid-out data file's tensors, digests left empty: what writing it records."""
    entries: dict[str, TensorEntry] = {}
    for planned, offset in layout.tensors:
        spec = job.spec_by_name.get(planned.name)
        if spec is None:  # the `.qs` scales of the weight before it
            entries[planned.name] = TensorEntry(planned.name, layout.name, offset, planned.nbytes, planned.shape,
                                                "F32", "scales", "")
            continue
        quant = job.plan.quant_for(spec)
        q = None if quant is None else Quant(*quant, spec.name + ".qs", job.plan.scheme_for(quant[0]))
        entries[spec.name] = TensorEntry(spec.name, layout.name, offset, planned.nbytes, spec.shape, planned.dtype,
                                         spec.role, "", q)
    return entries


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


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
