"""Long prompts: prefill tok/s, peak RSS and decode tok/s after prompts of 1k to 32k tokens.

    PYTHONPATH=. python tools/bench_long.py --lengths 256,1024,4096,16384,32768 --json /tmp/long.json

The model is the benchmark model of tools/bench_model.py with its positions raised to 32k (+ room to decode),
converted at q4. Each length runs in a child process (its own peak RSS): the engine glm-run uses (`--device auto`),
a prompt of random ids prefilled by the Generator (chunks of `PREFILL_CHUNK` tokens, DSA's sparse attention past
`index_topk` keys), then greedy tokens (MTP off; decode timed from the second one, the first also builds the decode
step). Printed per length: prefill tok/s, decode tok/s, the peak RSS, and the model's bytes and the KV rows' bytes
beside it. `--kv-dtypes f32,bf16,fp8`: each length once per KV row precision, in turn.

`--decode-only`: in one process, decode speed alone after each length, per KV precision, in alternating rounds (each
round runs every length with every precision in turn): the cache is filled with random rows (no prefill; the
indexer's choice over random keys costs what it costs over real ones), then `--tokens` greedy tokens on the decode
step per round, timed from the second (wall time, and the process's CPU time per token: the work, which a shared
machine's load stretches less than the wall time); each length's speed is also given per round as a fraction of the
first length's in the same round (`of_first_length`: median and range). `--one-stage` adds, per precision, the
decode step selecting in one stage over all keys (`shadow_selects` off) to the rounds.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from glmkit.generate.generator import PREFILL_CHUNK
from tools.bench_model import BENCH_CONFIG, DEFAULT_WORK, ensure_bench_snapshot

LONG_CONFIG = {**BENCH_CONFIG, "max_position_embeddings": 32768 + 1024}
DECODE_TOKENS = 64


def worker(snapshot: str, length: int, chunk: int, kv_dtype: str) -> dict:
    import numpy as np

    from glmkit.generate.engine import Engine
    from glmkit.generate.generator import Generator
    from glmkit.generate.sampling import Sampler, SamplingParams
    from glmkit.model.kv_cache import kv_bytes_per_token

    engine = Engine(snapshot, "auto", load_tokenizer=False, kv_dtype=kv_dtype)
    prompt = np.random.default_rng(length).integers(0, engine.config.vocab_size, length).tolist()
    gen = Generator(engine.model, eos_token_ids=(), use_mtp=False, prefill_chunk=chunk)
    tokens, began = 0, time.perf_counter()
    first = second = began
    for _ in gen.generate(prompt, DECODE_TOKENS + 2, Sampler(SamplingParams())):
        if tokens == 0:
            first = time.perf_counter()
        elif tokens == 1:  # the first decoded token also builds the decode step
            second = time.perf_counter()
        tokens += 1
    end = time.perf_counter()
    per_token = kv_bytes_per_token(engine.config, kv_dtype)
    out = {"prompt": length, "chunk": chunk, "kv_dtype": kv_dtype, "prefill_tok_s": round(length / (first - began), 1),
           "decode_tok_s": round(DECODE_TOKENS / (end - second), 2),
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10,
           "model_mb": engine.container.nbytes >> 20, "kv_mb": (per_token * (length + tokens)) >> 20,
           "kv_bytes_per_token": per_token}
    engine.close()
    return out


def decode_rounds(snapshot: str, lengths: list[int], dtypes: list[str], tokens: int, rounds: int,
                  one_stage: bool = False) -> list[dict]:
    """`--decode-only`: tok/s per (length, dtype, selection), each round over every length and variant in turn;
    median and range. one_stage: each dtype also with the decode step's one-stage selection."""
    import numpy as np

    from glmkit.generate.engine import Engine

    engines = {(dtype, selection): Engine(snapshot, "auto", load_tokenizer=False, kv_dtype=dtype)
               for dtype in dtypes for selection in (("two-stage", "one-stage") if one_stage else ("two-stage",))}
    for (_, selection), engine in engines.items():
        step = engine.model._decode_step()
        if step is not None:
            step.shadow_selects &= selection == "two-stage"
    speeds: dict[tuple[int, str, str], list[float]] = {(length, *variant): [] for length in lengths
                                                       for variant in engines}
    cpu_ms: dict[tuple[int, str, str], list[float]] = {key: [] for key in speeds}  # the process's CPU time a token
    for _ in range(rounds):  # each round: every length, each with every variant in turn
        for length in lengths:
            for variant, engine in engines.items():
                model, rng = engine.model, np.random.default_rng(length)
                cache = model.new_cache()
                cache.reserve(length + tokens + 1)
                for layer in cache.layers[:engine.config.num_hidden_layers]:
                    names = ("kv_lat", "k_rot", "index_k") if layer.has_index else ("kv_lat", "k_rot")
                    layer.append(**{n: rng.standard_normal((length, layer.width(n))).astype(np.float32)
                                    for n in names})
                token = int(rng.integers(engine.config.vocab_size))
                for i in range(tokens + 1):
                    if i == 1:
                        began, cpu = time.perf_counter(), time.process_time()
                    token = int(model.forward(np.array([token]), cache)[0][-1].argmax())
                speeds[length, *variant].append(tokens / (time.perf_counter() - began))
                cpu_ms[length, *variant].append((time.process_time() - cpu) / tokens * 1e3)
    rows = []
    for (length, dtype, selection), got in speeds.items():
        # against the first length in the same round: a slow moment of the machine hits both sides of a ratio
        ratios = [a / b for a, b in zip(got, speeds[lengths[0], dtype, selection], strict=True)]
        rows.append({"context": length, "kv_dtype": dtype, "selection": selection,
                     "decode_tok_s": round(float(np.median(got)), 1),
                     "range": [round(min(got), 1), round(max(got), 1)],
                     "of_first_length": round(float(np.median(ratios)), 3),
                     "of_first_range": [round(min(ratios), 3), round(max(ratios), 3)],
                     "cpu_ms_per_token": round(float(np.median(cpu_ms[length, dtype, selection])), 2)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        print(json.dumps(worker(argv[1], int(argv[2]), int(argv[3]), argv[4])))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=DEFAULT_WORK.with_name("glmkit-long-model"))
    p.add_argument("--lengths", default="256,1024,4096,16384,32768", help="prompt lengths in tokens")
    p.add_argument("--chunk", type=int, default=PREFILL_CHUNK, help="prompt tokens per forward")
    p.add_argument("--kv-dtypes", default="f32", help="KV row precisions, each run in turn per length")
    p.add_argument("--decode-only", action="store_true", help="decode speed alone, over random cache rows")
    p.add_argument("--tokens", type=int, default=32, help="--decode-only: tokens per round")
    p.add_argument("--rounds", type=int, default=3, help="--decode-only: rounds over the dtypes")
    p.add_argument("--one-stage", action="store_true",
                   help="--decode-only: also the decode step's one-stage selection over all keys, in the same rounds")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    snapshot = ensure_bench_snapshot("q4", args.work, LONG_CONFIG)
    if args.decode_only:
        rows = decode_rounds(str(snapshot), [int(n) for n in args.lengths.split(",")], args.kv_dtypes.split(","),
                             args.tokens, args.rounds, args.one_stage)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return 0
    rows = []
    runs = [(int(n), dtype) for n in args.lengths.split(",") for dtype in args.kv_dtypes.split(",")]
    for length, dtype in runs:
        done = subprocess.run([sys.executable, __file__, "--worker", str(snapshot), str(length), str(args.chunk),
                               dtype], capture_output=True, text=True, timeout=args.timeout)
        if done.returncode != 0:
            row = {"prompt": length, "kv_dtype": dtype, "error": (done.stderr.strip().splitlines() or ["?"])[-1]}
        else:
            row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
