"""`glm-calibrate SNAPSHOT (--text FILE | --tokens FILE) -o IMATRIX`: activation statistics for the quantizer.

Runs the converted model (best: the f32 conversion, or q8 for a model too big for that) over sample text
and records, for every linear weight, the mean square of each input column (`mean x_j^2` over the rows
that went through it; per routed expert only its tokens; the MTP layer included). `glm-convert --imatrix`
then weights each weight's quantization error by it (imatrix-style, DESIGN section 4 is unchanged: only
the choice of scales differs). With `--hessians` it also records the full second moment `mean x x^T`
`[I, I]` for the `gptq` quantizer: `pooled` (default) for every weight but the routed experts, whose gate and
up then use their layer's MoE input over all tokens (the shared expert's Hessian: an approximation of each
expert's own, at no extra memory; down_proj keeps the diagonal); `dense` leaves the routed experts to the
diagonal (faster conversion); `all` records each expert's own (GLM-5 has ~20,000 of them at 151 MB each:
small models only); `none` the diagonal only. Inputs wider than `--max-hessian-dim` keep only the diagonal.
Weights fed the very same input rows (q_a and kv_a, an expert's gate and up) share one Hessian. The runtime
collects, the converter only reads a file: convert never imports runtime.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from glmkit.cli.common import (
    add_engine_arguments,
    add_window_arguments,
    check_output_path,
    check_window_arguments,
    engine_from_arguments,
    windows_from_arguments,
)
from glmkit.errors import GlmkitError
from glmkit.eval.calibration import DEFAULT_MAX_HESSIAN_DIM, HESSIAN_CHOICES, collect_imatrix


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="glm-calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("snapshot", help="converted container directory (f32, or q8 for a large model)")
    add_window_arguments(p)
    p.add_argument("-o", "--output", type=Path, required=True, metavar="IMATRIX", help="imatrix file to write")
    p.add_argument("--hessians", choices=HESSIAN_CHOICES, default="pooled",
                   help="record mean x x^T for glm-convert --quantizer gptq: pooled (default: all but routed "
                        "experts, whose gate/up share their layer's MoE-input Hessian), dense (routed experts "
                        "diagonal only: faster conversion), all (each expert its own: small models), none")
    p.add_argument("--max-hessian-dim", type=int, default=DEFAULT_MAX_HESSIAN_DIM, metavar="N",
                   help=f"inputs wider than N keep only the diagonal (default {DEFAULT_MAX_HESSIAN_DIM}: "
                        f"{DEFAULT_MAX_HESSIAN_DIM ** 2 * 4 >> 20} MiB per Hessian)")
    add_engine_arguments(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_window_arguments(args)
        if args.max_hessian_dim < 0:
            raise GlmkitError(f"--max-hessian-dim: must be >= 0, got {args.max_hessian_dim}")
        check_output_path(args.output, "-o")
        engine = engine_from_arguments(args, load_tokenizer=args.text is not None)
        windows = windows_from_arguments(engine, args)
        imatrix = collect_imatrix(engine, windows, progress=not args.quiet, hessians=args.hessians,
                          max_hessian_dim=args.max_hessian_dim)
        imatrix.write(args.output)
    except GlmkitError as e:
        print(f"glm-calibrate: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("glm-calibrate: interrupted", file=sys.stderr)
        return 130
    print(f"{args.output}: {len(imatrix.values)} weights ({len(imatrix.hessians)} with Hessians, "
          f"{len(imatrix.hessian_data)} distinct) from {imatrix.tokens} tokens in {len(windows)} windows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
