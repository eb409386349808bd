"""`glm-convert SOURCE OUT`: convert a local Hugging Face snapshot into a glmkit container."""

from __future__ import annotations

import argparse
import sys
import time

from glmkit.convert.convert import DEFAULT_FILE_BYTES, convert
from glmkit.convert.plan import DEFAULT_GROUP_SIZE, PRESETS, QuantPlan
from glmkit.errors import GlmkitError
from glmkit.units import parse_size


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="glm-convert", description=__doc__)
    p.add_argument("source", help="local Hugging Face snapshot directory (config.json + *.safetensors)")
    p.add_argument("out", help="output container directory (must be empty or absent, unless --force)")
    p.add_argument("--preset", default="q4", choices=list(PRESETS),
                   help="f32 (lossless), q8 (int8 per row), q4 (default: int4 g64, int8 embed/lm_head/indexer/"
                        "MTP), q2 (routed experts int2 g64, rest as q4)")
    p.add_argument("--expert-bits", type=int, choices=(2, 4, 8, 32), help="override routed-expert bits (32 = F32)")
    p.add_argument("--dense-bits", type=int, choices=(2, 4, 8, 32),
                   help="override attention, dense MLP and shared-expert bits (32 = F32)")
    p.add_argument("--embed-bits", type=int, choices=(2, 4, 8, 32), help="override embed/lm_head bits (32 = F32)")
    p.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE,
                   help=f"scale group size for int4/int2 weights (default {DEFAULT_GROUP_SIZE}; 0 = per row)")
    p.add_argument("--max-file-size", type=parse_size, default=DEFAULT_FILE_BYTES, metavar="SIZE",
                   help="largest output data file, e.g. 4G, 500M, 64K (default 4G); one expert is never split")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty OUT")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.max_file_size < 1:
            raise GlmkitError("--max-file-size: must be at least 1 byte")
        plan = QuantPlan.from_preset(args.preset, args.expert_bits, args.dense_bits, args.embed_bits,
                                     args.group_size)
        start = time.perf_counter()
        result = convert(args.source, args.out, plan, args.preset, force=args.force,
                         max_file_bytes=args.max_file_size, progress=not args.quiet)
    except GlmkitError as e:
        print(f"glm-convert: error: {e}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    print(f"{result.out}: {result.tensors} tensors, {result.output_bytes / 1e6:.1f} MB from "
          f"{result.source_bytes / 1e6:.1f} MB source in {seconds:.1f} s; model hash {result.model_hash[:16]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
