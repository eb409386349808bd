"""`glm-convert SOURCE OUT`: convert a Hugging Face checkpoint (Hub repo or local snapshot) into a glmkit container.

`--calibrate FILE` is the one place a CLI runs both layers: it converts a temporary q8 (or f32) container,
runs the runtime's calibration over FILE on it, deletes it, then converts with those statistics (`gptq`).
The converter library itself never imports the runtime.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

from glmkit.convert.convert import DEFAULT_FILE_BYTES, DEFAULT_INFLIGHT_BYTES, convert, dry_run_report
from glmkit.convert.plan import DEFAULT_GRID, DEFAULT_GROUP_SIZE, DEFAULT_QUANTIZER, GRIDS, PRESETS, QuantPlan
from glmkit.convert.quantizers import QUANTIZERS
from glmkit.errors import GlmkitError
from glmkit.format.imatrix import Imatrix, read_imatrix
from glmkit.units import format_size, parse_size


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="glm-convert", description=__doc__)
    p.add_argument("source", help="Hub repo id (zai-org/GLM-5.1-FP8), local snapshot directory (config.json + "
                                  "*.safetensors) or Hugging Face cache directory (models--org--name)")
    p.add_argument("out", help="output container directory (empty or absent, unless --force; an unfinished "
                               "conversion of the same inputs there is resumed)")
    p.add_argument("--preset", default="q4", choices=list(PRESETS),
                   help="f32 (lossless), q8 (int8 g64, F32 embedding), q4 (default: int4 g64, int8 g64 "
                        "embed/lm_head/indexer/MTP), q3 (routed experts int3 g64, rest as q4), q2 (routed "
                        "experts int2 g64, rest as q4)")
    p.add_argument("--expert-bits", type=int, choices=(2, 3, 4, 8, 32),
                   help="override routed-expert bits (32 = F32)")
    p.add_argument("--dense-bits", type=int, choices=(2, 3, 4, 8, 32),
                   help="override attention, dense MLP and shared-expert bits (32 = F32)")
    p.add_argument("--embed-bits", type=int, choices=(2, 3, 4, 8, 32), help="override embed/lm_head bits (32 = F32)")
    p.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE,
                   help=f"scale group size of quantized weights (default {DEFAULT_GROUP_SIZE}; 0 = per row)")
    p.add_argument("--quantizer", choices=QUANTIZERS,
                   help=f"how codes and scales are chosen: mse searches each group's error-minimising scale "
                        f"(default {DEFAULT_QUANTIZER}), absmax takes amax/qmax (faster), gptq corrects rounding "
                        "errors across columns with calibration Hessians (default with --calibrate; needs "
                        "--imatrix or --calibrate)")
    p.add_argument("--grid", choices=GRIDS, default=DEFAULT_GRID,
                   help="what a 4-bit code stands for: nl, a fixed non-uniform table of 16 levels (default; lower "
                        "error at the same size), or uniform, the evenly spaced codes -8..7")
    p.add_argument("--imatrix", metavar="FILE",
                   help="statistics from glm-calibrate: weight the mse quantizer's error by each input column's "
                        "activation energy; gptq uses its Hessians")
    p.add_argument("--calibrate", type=Path, metavar="FILE",
                   help="calibrate first: UTF-8 sample text (or a .json list of token-id lists) run through a "
                        "temporary --calibrate-preset conversion; implies --quantizer gptq")
    p.add_argument("--calibrate-preset", choices=("q8", "q4", "f32"), default="q8",
                   help="the temporary container --calibrate runs (default q8: a quarter of f32's disk; q4 halves "
                        "that, fine for q4/q2 outputs; docs/QUALITY.md)")
    p.add_argument("--calibrate-windows", type=int, default=64, metavar="N",
                   help="--calibrate: at most N windows of 512 tokens (default 64)")
    p.add_argument("--max-file-size", type=parse_size, default=DEFAULT_FILE_BYTES, metavar="SIZE",
                   help="largest output data file, e.g. 4G, 500M, 64K (default 4G); one expert is never split")
    p.add_argument("--revision", help="Hub branch, tag or commit (default main); for an HF cache dir: a ref or commit")
    p.add_argument("--endpoint", help="Hub endpoint (default: $HF_ENDPOINT or https://huggingface.co)")
    p.add_argument("--max-inflight", type=parse_size, default=DEFAULT_INFLIGHT_BYTES, metavar="SIZE",
                   help="Hub: downloaded shards kept ahead of the converter, at most (default 16G; 0 = one at a "
                        "time); a shard the next tensor needs is always fetched")
    p.add_argument("--keep-source", action="store_true",
                   help="Hub: download into the Hugging Face cache and keep the shards (default: into OUT, deleting "
                        "each one once converted)")
    p.add_argument("--dry-run", action="store_true",
                   help="list the files, download size, output size per preset and disk needed, then exit")
    p.add_argument("--force", action="store_true",
                   help="overwrite a non-empty OUT (or an unfinished conversion of other inputs); skip the free-space "
                        "check")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="convert NaN or infinite source weights and NaN, infinite, zero or negative FP8 "
                        "weight_scale_inv values as they are (default: refuse them, naming the tensor and shard: "
                        "they mean a corrupted or misread checkpoint)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.max_file_size < 1:
            raise GlmkitError("--max-file-size: must be at least 1 byte")
        if args.calibrate is not None and args.imatrix is not None:
            raise GlmkitError("--calibrate and --imatrix: give one (--calibrate computes what --imatrix reads)")
        if args.calibrate is not None and not args.calibrate.is_file():  # before hours of temporary conversion
            raise GlmkitError(f"--calibrate: {args.calibrate}: file not found")
        if args.calibrate_windows < 1:
            raise GlmkitError(f"--calibrate-windows: must be at least 1, got {args.calibrate_windows}")
        quantizer = args.quantizer or ("gptq" if args.calibrate is not None else DEFAULT_QUANTIZER)
        plan = QuantPlan.from_preset(args.preset, args.expert_bits, args.dense_bits, args.embed_bits,
                                     args.group_size, quantizer, args.grid)
        options = {"revision": args.revision, "endpoint": args.endpoint, "keep_source": args.keep_source,
                   "max_inflight": args.max_inflight}
        imatrix = read_imatrix(args.imatrix) if args.imatrix is not None else None
        if args.dry_run:
            print(dry_run_report(args.source, args.out, plan, args.preset, args.max_file_size, imatrix=imatrix,
                                 calibrate_preset=args.calibrate_preset if args.calibrate else None, **options))
            return 0
        start = time.perf_counter()
        scratch = (tempfile.TemporaryDirectory(prefix=".glmkit-calibrate-", dir=_parent(args.out))
                   if args.calibrate is not None else contextlib.nullcontext(None))
        with scratch as scratch_dir:
            if scratch_dir is not None:
                imatrix = _calibrate(args, Path(scratch_dir), options)
            result = convert(args.source, args.out, plan, args.preset, force=args.force,
                             max_file_bytes=args.max_file_size, progress=not args.quiet, imatrix=imatrix,
                             allow_nonfinite=args.allow_nonfinite, **options)
    except GlmkitError as e:
        print(f"glm-convert: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("glm-convert: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    if result.already_converted:
        print(f"{result.out}: already converted (model hash {result.model_hash[:16]}); nothing rewritten "
              "(--force converts again)")
        return 0
    seconds = time.perf_counter() - start
    resumed = f" (resumed after {result.resumed_files} complete data files)" if result.resumed_files else ""
    staged = (f"; at most {format_size(result.peak_source_bytes)} of downloaded shards on disk"
              if result.peak_source_bytes else "")
    print(f"{result.out}: {result.tensors} tensors, {result.output_bytes / 1e6:.1f} MB from "
          f"{result.source_bytes / 1e6:.1f} MB source in {seconds:.1f} s{resumed}{staged}; "
          f"model hash {result.model_hash[:16]}")
    return 0


def _parent(out: str) -> Path:
    """An existing directory next to OUT for scratch files (same file system, so the disk check holds)."""
    parent = Path(out).resolve().parent
    while not parent.is_dir():
        parent = parent.parent
    return parent


def _calibrate(args: argparse.Namespace, scratch: Path, options: dict[str, object]) -> Imatrix:
    """Convert a temporary container, collect calibration statistics (`--hessians pooled`) on it over
    --calibrate's text, and return them; the temporary container is deleted."""
    from glmkit.eval.calibration import calibration_windows, collect_imatrix
    from glmkit.generate.engine import Engine

    model_dir = scratch / "model"
    plan = QuantPlan.from_preset(args.calibrate_preset)
    if not args.quiet:
        print(f"calibrate: converting a temporary {args.calibrate_preset} container", file=sys.stderr)
    convert(args.source, model_dir, plan, args.calibrate_preset, progress=not args.quiet,  # type: ignore[arg-type]
            allow_nonfinite=args.allow_nonfinite, **options)
    engine = Engine(model_dir, "numpy", load_tokenizer=args.calibrate.suffix != ".json")
    windows = calibration_windows(engine, args.calibrate)[:args.calibrate_windows]
    statistics = collect_imatrix(engine, windows, progress=not args.quiet)
    del engine
    shutil.rmtree(model_dir)
    path = scratch / "imatrix.safetensors"
    statistics.write(path)
    return read_imatrix(path)  # as --imatrix would read it: its sha256 goes into the manifest


if __name__ == "__main__":
    sys.exit(main())
