"""Long prompts: prefill tok/s, peak RSS and decode tok/s after prompts of 1k to 32k tokens.

    PYTHONPATH=. python tools/bench_long.py --lengths 256,1024,4096,16384,32768 --json /tmp/long.json

The model is the benchmark model of tools/bench_model.py with its positions raised to 32k (+ room to decode),
converted at q4. Each length runs in a child process (its own peak RSS): the engine glm-run uses (`--device auto`),
a prompt of random ids prefilled by the Generator (chunks of `PREFILL_CHUNK` tokens, DSA's sparse attention past
`index_topk` keys), then greedy tokens (MTP off; decode timed from the second one, the first also builds the decode
step). Printed per length: prefill tok/s, decode tok/s, the peak RSS, and the model's bytes and the KV rows' bytes
beside it. `--kv-dtypes f32,bf16,fp8`: each length once per KV row precision, in turn.
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
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    snapshot = ensure_bench_snapshot("q4", args.work, LONG_CONFIG)
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
