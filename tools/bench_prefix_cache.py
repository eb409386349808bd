"""Prefill-cache benchmark on the benchmark-size model: TTFT miss vs hit, and a 10-turn chat.

    python tools/bench_prefix_cache.py [--preset q4] [--lengths 1000,2000] [--json out.json]

TTFT = cache lookup/restore + prefill of what is not cached + the first token's logits. A "new process"
hit runs in a fresh interpreter that only has the on-disk cache. Token ids are random (the model is too).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from glmkit.cache.prefix_cache import PrefixCache  # noqa: E402
from glmkit.cache.session import Session  # noqa: E402
from glmkit.generate.engine import Engine  # noqa: E402
from glmkit.generate.generator import Generator  # noqa: E402
from glmkit.generate.sampling import Sampler, SamplingParams  # noqa: E402
from tools.bench_model import ensure_bench_snapshot  # noqa: E402


def ttft(engine: Engine, session: Session, ids: list[int], max_tokens: int = 1) -> tuple[float, int, list[int]]:
    """(seconds to the first token, cached tokens, generated ids); stores the request in the cache."""
    generator = Generator(engine.model, engine.eos_token_ids)
    start = time.perf_counter()
    kv = session.prepare(ids)
    cached = kv.length
    out = []
    for token in generator.generate(ids, max_tokens, Sampler(SamplingParams()), kv):
        if not out:
            first = time.perf_counter() - start
        out.append(token)
    session.commit(ids, out)
    return first, cached, out


def child(snapshot: str, cache_dir: str, ids_json: str) -> None:
    """One TTFT measurement in a fresh process: prints {"ttft_s", "cached"}."""
    engine = Engine(snapshot, load_tokenizer=False)
    cache = PrefixCache.for_model(engine.model, engine.model_hash, cache_dir, use_mtp=True)
    seconds, cached, _ = ttft(engine, Session(engine.model, cache), json.loads(ids_json))
    print(json.dumps({"ttft_s": seconds, "cached": cached}))


def new_process_ttft(snapshot: Path, cache_dir: Path, ids: list[int]) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", str(snapshot), str(cache_dir), json.dumps(ids)],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ttft_table(snapshot: Path, lengths: list[int], work: Path) -> list[dict]:
    rows = []
    rng = np.random.default_rng(0)
    for n in lengths:
        ids = rng.integers(0, 8000, n).tolist()
        cache_dir = work / f"ttft-{n}"
        miss = new_process_ttft(snapshot, cache_dir, ids)  # empty cache: full prefill, then stored
        hit_new = new_process_ttft(snapshot, cache_dir, ids)
        engine = Engine(snapshot, load_tokenizer=False)
        cache = PrefixCache.for_model(engine.model, engine.model_hash, cache_dir, use_mtp=True)
        ttft(engine, Session(engine.model, cache), ids)  # loads the blobs into this process's RAM tier
        same, cached_same, _ = ttft(engine, Session(engine.model, cache), ids)
        rows.append({"prompt_tokens": n, "miss_s": miss["ttft_s"], "hit_new_process_s": hit_new["ttft_s"],
                     "hit_same_process_s": same, "cached_new_process": hit_new["cached"],
                     "cached_same_process": cached_same,
                     "speedup_new_process": miss["ttft_s"] / hit_new["ttft_s"],
                     "speedup_same_process": miss["ttft_s"] / same})
    return rows


def chat_table(snapshot: Path, work: Path, turns: int = 10, user_tokens: int = 80, reply_tokens: int = 16
               ) -> dict:
    """A stateless client resending the whole conversation each turn (a fresh Session per turn)."""
    engine = Engine(snapshot, load_tokenizer=False)
    rng = np.random.default_rng(1)
    users = [rng.integers(0, 8000, user_tokens).tolist() for _ in range(turns)]
    result = {}
    for label, use_cache in (("no cache", False), ("prefix cache", True)):
        cache = PrefixCache.for_model(engine.model, engine.model_hash, work / "chat", use_mtp=True) \
            if use_cache else None
        history: list[int] = []
        computed, ttfts = [], []
        for user in users:
            ids = history + user
            seconds, cached, out = ttft(engine, Session(engine.model, cache), ids, reply_tokens)
            computed.append(len(ids) - cached)
            ttfts.append(seconds)
            history = ids + out
        result[label] = {"prefill_tokens_per_turn": computed, "ttft_s_per_turn": [round(t, 3) for t in ttfts],
                         "total_prefill_tokens": sum(computed), "total_ttft_s": sum(ttfts)}
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        child(*argv[1:4])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="q4")
    p.add_argument("--lengths", default="1000,2000")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    snapshot = ensure_bench_snapshot(args.preset)
    with tempfile.TemporaryDirectory(prefix="glmkit-prefix-bench-") as tmp:
        work = Path(tmp)
        rows = ttft_table(snapshot, [int(x) for x in args.lengths.split(",")], work)
        chat = chat_table(snapshot, work)
    print("| prompt tokens | miss TTFT s | hit, new process s | hit, same process s | speedup new / same |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prompt_tokens']} | {r['miss_s']:.2f} | {r['hit_new_process_s']:.3f} | "
              f"{r['hit_same_process_s']:.3f} | {r['speedup_new_process']:.0f}x / {r['speedup_same_process']:.0f}x |")
    print()
    print("| 10-turn chat | prefill tokens computed | sum of TTFT s | per turn |")
    print("|---|---|---|---|")
    for label, c in chat.items():
        print(f"| {label} | {c['total_prefill_tokens']} | {c['total_ttft_s']:.1f} | "
              f"{' '.join(map(str, c['prefill_tokens_per_turn']))} |")
    if args.json:
        args.json.write_text(json.dumps({"ttft": rows, "chat": chat}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
