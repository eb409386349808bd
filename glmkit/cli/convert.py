"""`glm-convert SOURCE OUT`: convert a Hugging Face checkpoint (Hub repo or local snapshot) into a glmkit container.

`--calibrate FILE` is the one place a CLI runs both layers: the runtime's layer math runs FILE's windows through
the source layer by layer while the converter writes it (glmkit.eval.layerwise), and each layer is quantized with
`gptq` from the statistics of its own inputs. The converter library itself never imports the runtime.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from glmkit.convert.convert import (
    DEFAULT_FILE_BYTES,
    DEFAULT_INFLIGHT_BYTES,
    Calibration,
    check_group_sizes,
    convert,
    dry_run_report,
)
from glmkit.convert.plan import (
    DEFAULT_GRID,
    DEFAULT_GROUP_SIZE,
    DEFAULT_QUANTIZER,
    FINE_GROUP_SIZE,
    GRIDS,
    PRESETS,
    QuantPlan,
)
from glmkit.convert.quantizers import QUANTIZERS
from glmkit.convert.sources.open import open_source
from glmkit.convert.sources.source import Source
from glmkit.errors import GlmkitError
from glmkit.format.imatrix import read_imatrix
from glmkit.format.schema import model_tensors
from glmkit.units import format_size, parse_size

DEFAULT_WINDOWS = 64  # of 512 tokens (glmkit.eval.windows.DEFAULT_CTX)


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
    p.add_argument("--group-size", type=int, default=None,
                   help=f"scale group size of every quantized weight (default {DEFAULT_GROUP_SIZE}, and "
                        f"{FINE_GROUP_SIZE} for q8's weights other than routed experts; 0 = per row)")
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
                   help="calibrate while converting: UTF-8 sample text (or a .json list of token-id lists) run "
                        "through the source layer by layer, each layer quantized from its own inputs' Hessians; "
                        "implies --quantizer gptq")
    p.add_argument("--calibrate-windows", type=int, default=DEFAULT_WINDOWS, metavar="N",
                   help=f"--calibrate: at most N windows of 512 tokens (default {DEFAULT_WINDOWS}); their "
                        "hidden states are held in memory (N x 512 x hidden_size x 4 bytes)")
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
        if args.calibrate is not None and not args.calibrate.is_file():
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
                                 calibrating=args.calibrate is not None, **options))
            return 0
        start = time.perf_counter()
        source = open_source(args.source, revision=args.revision, endpoint=args.endpoint,
                             keep_source=args.keep_source)
        try:
            check_group_sizes(plan, model_tensors(source.snapshot.config))  # before --calibrate's work
            calibration = _calibration(args, source) if args.calibrate is not None else None
        except BaseException:
            source.close()
            raise
        result = convert(source, args.out, plan, args.preset, force=args.force, max_file_bytes=args.max_file_size,
                         progress=not args.quiet, imatrix=imatrix, allow_nonfinite=args.allow_nonfinite,
                         max_inflight=args.max_inflight, calibration=calibration)
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


def _calibration(args: argparse.Namespace, source: Source) -> Calibration:
    """--calibrate's statistics, made as the conversion runs; its windows are read now, before OUT is touched
    (the runtime is imported only here: a plain conversion does not load it)."""
    from glmkit.eval.calibration import calibration_windows
    from glmkit.eval.layerwise import LayerwiseCalibration

    windows = calibration_windows(source.side_dir, source.snapshot.config, args.calibrate)
    return LayerwiseCalibration(windows[:args.calibrate_windows])


if __name__ == "__main__":
    sys.exit(main())
