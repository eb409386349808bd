#!/usr/bin/env python3
"""Batched decode: one `GlmMoeDsaModel.decode_batch` forward of B sequences against B=1, in one process.

    OPENBLAS_NUM_THREADS=1 PYTHONPATH=. python tools/bench_batch.py --device numpy
    PYTHONPATH=. python tools/bench_batch.py --device opencl     # B=1 is the device decode step there

Four caches are prefilled with random prompts of 40, 47, 54 and 61 tokens; each round times `--forwards` forwards
of every batch size in turn (B=1 on the first cache: `forward`, the device decode step where there is one; B>1 the
first B caches: the device step over B sequences where there is one, else through the operations), so a change of
machine load hits every size alike, and each cache is cut back to its prompt after every forward (the same keys each
time). The table gives the median milliseconds per forward and per token over `--rounds` rounds, and tokens/s
against B=1; where the device step over several sequences runs, each round also times the B>1 forwards through the
operations (the alternative it replaces) and through the batch's pipeline (`pipelined_batch`, greedy: each forward
queued before the host takes the tokens of the one before; the `--forwards` advances after the first forward,
timed between its start and its close). With `--profile B` it adds where the time of B-row forwards goes
(cProfile, the top functions by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from glmkit.generate.engine import Engine  # noqa: E402
from glmkit.model.glm5 import GlmMoeDsaModel  # noqa: E402
from glmkit.model.kv_cache import KVCache  # noqa: E402

PROMPTS = (40, 47, 54, 61)


def timed_forwards(model: GlmMoeDsaModel, caches: list[KVCache], rows: int, count: int,
                   operations: bool = False) -> float:
    """Seconds per forward of `rows` sequences (one new token each), the caches cut back after each; operations:
    B>1 through the operations even where the device step over several sequences runs."""
    if operations:
        model.sequences_step = lambda count: None  # type: ignore[method-assign]  # this instance: no device batch
    try:
        return _timed(model, caches, rows, count)
    finally:
        if operations:
            del model.sequences_step


def _timed(model: GlmMoeDsaModel, caches: list[KVCache], rows: int, count: int) -> float:
    lengths = [cache.length for cache in caches[:rows]]
    spent = 0.0
    for _ in range(count):
        start = time.perf_counter()
        model.decode_batch(np.full(rows, 5), caches[:rows])
        spent += time.perf_counter() - start
        for cache, length in zip(caches, lengths, strict=False):
            cache.truncate(length)
    return spent / count


def timed_pipeline(model: GlmMoeDsaModel, caches: list[KVCache], rows: int, count: int) -> float | None:
    """Seconds per forward of `rows` sequences through the batch's pipeline (`count` advances; None where it does
    not run), the caches cut back after."""
    lengths = [cache.length for cache in caches[:rows]]
    pipe = model.pipelined_batch([5] * rows, caches[:rows])
    if pipe is None:
        return None
    start = time.perf_counter()
    for _ in range(count):
        pipe.advance()
    spent = time.perf_counter() - start
    pipe.close()
    for cache, length in zip(caches, lengths, strict=False):
        cache.truncate(length)
    return spent / count


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--snapshot", type=Path, default=Path("/tmp/glmkit-bench-model/q4"))
    p.add_argument("--device", default="numpy")
    p.add_argument("--rows", default="1,2,3,4", help="batch sizes (default %(default)s)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--forwards", type=int, default=3, help="forwards per size and round (default %(default)s)")
    p.add_argument("--profile", type=int, metavar="B", help="also profile forwards of B rows")
    args = p.parse_args(argv)
    sizes = [int(b) for b in args.rows.split(",")]
    if not all(1 <= b <= len(PROMPTS) for b in sizes):
        p.error(f"--rows: sizes between 1 and {len(PROMPTS)}")
    engine = Engine(args.snapshot, device=args.device, load_tokenizer=False)
    model = engine.model
    rng = np.random.default_rng(0)
    caches = [model.new_cache() for _ in PROMPTS]
    for cache, n in zip(caches, PROMPTS, strict=True):
        model.forward(rng.integers(0, model.config.vocab_size, n), cache)
        cache.reserve(n + 4 * args.forwards + 8)
    both = any(b > 1 and model.sequences_step(b) is not None for b in sizes)  # also time the operations' batch
    for b in sizes:  # warm-up: kernel builds, the steps over B sequences, first page faults
        timed_forwards(model, caches, b, 1)
    times: dict[int, list[float]] = {b: [] for b in sizes}
    ops: dict[int, list[float]] = {b: [] for b in sizes if b > 1 and both}
    piped: dict[int, list[float]] = {b: [] for b in ops if timed_pipeline(model, caches, b, 1) is not None}
    for _ in range(args.rounds):
        for b in sizes:
            times[b].append(timed_forwards(model, caches, b, args.forwards))
            if b in ops:
                ops[b].append(timed_forwards(model, caches, b, args.forwards, operations=True))
            if b in piped:
                piped[b].append(timed_pipeline(model, caches, b, args.forwards))
    print(f"{args.snapshot.name} on {engine.device} (device decode step: {model.decodes_on_device()}, "
          f"over several sequences: {both})")
    vs = f"tok/s vs B={sizes[0]}"
    print(f"| B | ms per forward | ms per token | {vs} | operations: ms per forward | {vs} | pipelined: ms per forward "
          f"| {vs} |\n|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = statistics.median(times[sizes[0]]) / sizes[0]
    for b in sizes:
        per_forward = statistics.median(times[b])
        row = f"| {b} | {per_forward * 1e3:.1f} | {per_forward / b * 1e3:.1f} | {base / (per_forward / b):.2f}x |"
        for kind in (ops, piped):
            if b in kind:
                through = statistics.median(kind[b])
                row += f" {through * 1e3:.1f} | {base / (through / b):.2f}x |"
            else:
                row += " | |"
        print(row)
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        timed_forwards(model, caches, args.profile, args.forwards)
        profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(12)
        print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
