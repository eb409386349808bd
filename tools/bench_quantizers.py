#!/usr/bin/env python3
"""Time each quantizer per parameter on one matrix: what `glm-convert --quantizer` costs.

    PYTHONPATH=. python tools/bench_quantizers.py                      # 1024 x 2048, int4 g64, one thread
    PYTHONPATH=. python tools/bench_quantizers.py --rows 2048 --cols 6144 --bits 2 --threads 2
    PYTHONPATH=. python tools/bench_quantizers.py --rows 2048 --cols 6144 --quantizers absmax,mse

int4 is timed for both 4-bit grids: uniform codes (scheme symmetric) and the nl4 table (`--grid nl`, the default),
alternately within each of `--rounds` rounds. The weights are Gaussian and the inputs correlated (a random mixing
matrix). GPTQ's time excludes
factorising the Hessian, which a conversion does once per distinct input (reported apart). The row blocks
are the parallelism (`--threads`), with one BLAS thread each, as in a conversion. Prints a digest of the GPTQ
codes, so two versions of the code can be compared for identical output.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from glmkit.convert.quantizers import HessianFactor, gptq_quantize, search_scales  # noqa: E402
from glmkit.format.packing import quantize  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--bits", type=int, default=4, choices=(2, 3, 4, 8))
    ap.add_argument("--group-size", type=int, default=64, help="0 = per row")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quantizers", default="absmax,mse,gptq", help="which to time (default %(default)s)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    group = args.group_size or None
    chosen = args.quantizers.split(",")
    factor, factorise = None, 0.0
    if "gptq" in chosen:
        mixing = np.eye(args.cols, dtype=np.float32) + rng.standard_normal((args.cols, args.cols),
                                                                           np.float32) / np.sqrt(10 * args.cols)
        x = rng.standard_normal((2 * args.cols, args.cols), np.float32) @ mixing
        hessian = x.T.astype(np.float64) @ x / len(x)
        t = time.perf_counter()
        factor = HessianFactor.from_hessian(hessian)
        factorise = time.perf_counter() - t
    w = rng.standard_normal((args.rows, args.cols), np.float32)
    params = w.size
    schemes = ("symmetric", "nl4") if args.bits == 4 else ("symmetric",)
    runs = {
        "absmax": lambda scheme: quantize(w, args.bits, group, scheme=scheme),
        "mse": lambda scheme: quantize(w, args.bits, group, search_scales(w, args.bits, group, threads=args.threads,
                                                                           scheme=scheme), scheme),
        "gptq": lambda scheme: gptq_quantize(w, factor, args.bits, group, threads=args.threads, scheme=scheme),
    }
    runs = {name: run for name, run in runs.items() if name in chosen}
    best: dict[tuple[str, str], float] = {}
    digests = {}
    for _ in range(args.rounds):  # alternatives alternate within each round; the fastest round counts
        for name, run in runs.items():
            for scheme in schemes:
                t = time.perf_counter()
                codes, _ = run(scheme)
                seconds = time.perf_counter() - t
                best[name, scheme] = min(seconds, best.get((name, scheme), seconds))
                if name == "gptq":
                    digests[scheme] = hashlib.sha256(codes.tobytes()).hexdigest()[:16]

    print(f"{args.rows} x {args.cols}, int{args.bits} {'g' + str(group) if group else 'per row'}, "
          f"{args.threads} thread(s), fastest of {args.rounds} round(s):")
    for (name, scheme), seconds in best.items():
        ratio = f"  ({seconds / best[name, 'symmetric']:.2f}x uniform)" if scheme != "symmetric" else ""
        print(f"  {name:6s} {scheme:9s} {seconds * 1e9 / params:7.1f} ns per parameter{ratio}")
    if factor is not None:
        print(f"  factorising the {args.cols}-wide Hessian: {factorise:.2f} s")
    for scheme, digest in digests.items():
        print(f"  gptq codes digest ({scheme}): {digest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
