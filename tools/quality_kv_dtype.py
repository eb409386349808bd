#!/usr/bin/env python3
"""What KV rows at bf16, f16 or fp8 (`--kv-dtype`) cost in quality, against f32 rows, on the trained fixture.

    PYTHONPATH=. python tools/quality_kv_dtype.py [--windows 24] [--preset q4] [--device auto]   # ~1 min

Per KV dtype, on one container: teacher-forced over held-out windows (eval_tokens.json), the first PREFIX tokens
prefilled and the rest decoded one token at a time (the device decode step on `--device auto`), every decoded
position's logits against the f32-row run's: mean KL(f32 rows || these rows), top-1 agreement. Then greedy: from
each window's first PREFIX tokens, GREEDY tokens decoded greedily; the share of continuations identical to the
f32-row run's and the mean length of their common prefix. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from glmkit.generate.engine import Engine  # noqa: E402
from glmkit.generate.generator import Generator  # noqa: E402
from glmkit.generate.sampling import Sampler, SamplingParams  # noqa: E402
from glmkit.model.kv_cache import KV_DTYPES  # noqa: E402
from tests.runtime_support import convert  # noqa: E402
from tools.quality_int8_activations import FIXTURE, PREFIX, decoded_logits, kl  # noqa: E402

GREEDY = 48


def greedy_runs(engine: Engine, windows: list[list[int]]) -> list[list[int]]:
    """GREEDY greedy tokens (MTP off) after each window's first PREFIX tokens."""
    generator = Generator(engine.model, (), use_mtp=False)
    return [list(generator.generate(w[:PREFIX], GREEDY, Sampler(SamplingParams()))) for w in windows]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=24, help="held-out windows (default %(default)s)")
    ap.add_argument("--preset", default="q4")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--work", type=Path, default=Path("/tmp/glmkit-kv-quality"))
    args = ap.parse_args(argv)
    shutil.rmtree(args.work, ignore_errors=True)
    snapshot = convert(FIXTURE, args.work / args.preset, args.preset)
    windows = json.loads((FIXTURE / "eval_tokens.json").read_text())[:args.windows]
    engines = {dtype: Engine(snapshot, args.device, load_tokenizer=False, kv_dtype=dtype)
               for dtype in KV_DTYPES}
    want, want_greedy = decoded_logits(engines["f32"], windows), greedy_runs(engines["f32"], windows)
    print(f"{args.preset}, --device {args.device} ({engines['f32'].device}): {len(want)} decoded positions over "
          f"{len(windows)} windows, {GREEDY} greedy tokens after {PREFIX} per window")
    print("| KV rows | KL(f32 rows || these) | top-1 agreement | identical greedy runs | mean common greedy prefix |")
    print("|---|---|---|---|---|")
    for dtype in KV_DTYPES[1:]:
        got, runs = decoded_logits(engines[dtype], windows), greedy_runs(engines[dtype], windows)
        agree = float((got.argmax(-1) == want.argmax(-1)).mean())
        same = np.mean([a == b for a, b in zip(runs, want_greedy, strict=True)])
        prefix = np.mean([common_prefix(a, b) for a, b in zip(runs, want_greedy, strict=True)])
        print(f"| {dtype} | {kl(want, got):.6f} | {agree:.2%} | {same:.0%} | {prefix:.1f} / {GREEDY} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
