"""Agent-trace prefill-reuse benchmark: no cache / exact chunk-aligned / exact to the first difference /
approximate (`--reuse approximate`), plus the quality cost of approximate reuse per recompute ratio.

    python tools/bench_semantic_reuse.py [--preset q4] [--quality-fixture tests/fixtures/tiny-trained] [--json out]

The trace is a stateless agent client resending its whole conversation each request (a fresh Session per
request, one shared cache): system prompt + tool schemas, a user task, assistant turns (thinking + tool call),
tool observations, then (request 4) the client drops the thinking blocks of earlier turns and rewrites the
first tool call, and (request 5) retrieves documents again in a different order (one new, one lightly edited).
Token ids are random but structured (role tokens, repeated documents); the models are random (the bench
model) or tiny (the quality fixture), so TTFT/prefill numbers are about the cache, not about the text.

"exact, chunk-aligned" emulates a block-granular prefix cache (vLLM-style: reuse stops at the last whole chunk
before the first difference) by cutting glmkit's restored prefix back to a chunk boundary; "exact to first
difference" is glmkit's exact mode (partial-chunk reuse: what chat-turn anchors would give, and more).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# one BLAS thread, as tools/bench_run.py: on a shared 2-core box spinning BLAS threads make wall time swing 10x;
# the CPU seconds reported next to TTFT are then close to an unloaded machine's wall time
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from glmkit.cache.chunk_index import TokenLatents  # noqa: E402
from glmkit.cache.prefix_cache import PrefixCache  # noqa: E402
from glmkit.cache.session import ApproxPolicy, Session  # noqa: E402
from glmkit.generate.engine import Engine  # noqa: E402
from glmkit.generate.generator import Generator  # noqa: E402
from glmkit.generate.sampling import Sampler, SamplingParams  # noqa: E402
from tools.bench_model import ensure_bench_snapshot  # noqa: E402

CHUNK = 32
RATIOS = (0.0, 0.05, 0.1, 0.25, 0.5, 1.0)


def mean_kl(exact: np.ndarray, approx: np.ndarray) -> float:
    """Mean over rows of KL(softmax(exact) || softmax(approx)), in nats."""
    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    le, la = log_softmax(exact), log_softmax(approx)
    return float((np.exp(le) * (le - la)).sum(axis=-1).mean())


# ---- the trace -----------------------------------------------------------------------------------

def agent_trace(vocab: int, roles: dict[str, int], scale: float, seed: int = 0,
                doc_source: list[int] | None = None) -> list[list[int]]:
    """Six requests of one agent conversation (token ids). `scale` sizes every part; documents come from
    `doc_source` (real text tokens) when given, else random ids."""
    rng = np.random.default_rng(seed)
    plain = vocab - 16  # keep clear of the special ids at the top of the vocabulary

    def text(n: int) -> list[int]:
        return rng.integers(0, plain, max(int(n * scale), 1)).tolist()

    def doc(i: int, n: int) -> list[int]:
        n = max(int(n * scale), 1)
        if doc_source is not None:
            start = (i * 977) % max(len(doc_source) - n, 1)
            return doc_source[start:start + n]
        return text(n / scale)

    r = roles
    system = [r["gmask"], r["system"]] + text(300) + text(200)  # instructions + tool schemas
    user1 = [r["user"]] + text(60)
    think1, call1 = text(40), [r["tool_call"]] + text(25)
    docs = [doc(i, 150) for i in range(5)]
    obs1 = [t for d in docs[:3] for t in [r["observation"]] + d]
    think2, call2 = text(40), [r["tool_call"]] + text(25)
    file2 = [r["observation"]] + doc(7, 300)
    user2 = [r["user"]] + text(40)

    def assistant(think: list[int] | None, call: list[int]) -> list[int]:
        return [r["assistant"], r["think"]] + (think or []) + [r["end_think"]] + call

    gen = [r["assistant"], r["think"]]  # the generation prompt
    p1 = system + user1 + gen
    p2 = system + user1 + assistant(think1, call1) + obs1 + gen
    p3 = p2[:-2] + assistant(think2, call2) + file2 + gen
    # request 4: the client drops earlier thinking and rewrites the first tool call (its arguments changed)
    call1b = call1[:10] + text(12)
    history4 = system + user1 + assistant(None, call1b) + obs1 + assistant(None, call2) + file2 + user2
    p4 = history4 + gen
    # request 5: retrieval again: documents in another order, one new, one lightly edited (every 10th token)
    edited = list(docs[1])
    edited[5::10] = rng.integers(0, plain, len(edited[5::10])).tolist()
    obs5 = [t for d in (docs[2], docs[0], docs[3], edited) for t in [r["observation"]] + d]
    p5 = history4 + assistant(None, [r["tool_call"]] + text(20)) + obs5 + gen
    p6 = p5[:-2] + assistant(None, text(30)) + [r["user"]] + text(30) + gen
    return [p1, p2, p3, p4, p5, p6]


def bench_roles(vocab: int) -> dict[str, int]:
    names = ("gmask", "system", "user", "assistant", "observation", "think", "end_think", "tool_call")
    return {name: vocab - 16 + i for i, name in enumerate(names)}


def tokenizer_roles(engine: Engine) -> dict[str, int]:
    tok = engine.tokenizer
    roles = {"gmask": "[gMASK]", "system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>",
             "observation": "<|observation|>", "think": "<think>", "end_think": "</think>", "tool_call": "<tool_call>"}
    fallback = bench_roles(engine.config.vocab_size)
    return {k: (tok.token_id(v) if tok and tok.token_id(v) is not None else fallback[k]) for k, v in roles.items()}


# ---- one configuration over the trace ------------------------------------------------------------

class TraceRunner:
    """One configuration (none | aligned | exact | approximate) of the trace, request by request."""

    def __init__(self, engine: Engine, mode: str, cache_dir: Path | None, ratio: float = 0.1,
                 stateless: bool = False):
        self.engine, self.mode, self.stateless = engine, mode, stateless
        self.cache = PrefixCache.for_model(engine.model, engine.model_hash, cache_dir, use_mtp=False,
                                           chunk_tokens=CHUNK) if mode != "none" else None
        self.policy = ApproxPolicy(recompute_ratio=ratio) if mode == "approximate" else None
        self.session = Session(engine.model, self.cache, self.policy)

    def request(self, ids: list[int]) -> dict:
        model = self.engine.model
        # persistent: one Session for the conversation (glm-serve's session pool, glm-run --chat);
        # stateless: a fresh one per request (a new process each time: only the disk cache carries over)
        session = Session(model, self.cache, self.policy) if self.stateless or self.mode == "none" else self.session
        start, cpu = time.perf_counter(), time.process_time()
        kv = session.prepare(ids)
        if self.mode == "aligned":
            kv.truncate(kv.length // CHUNK * CHUNK)
        prepared = time.perf_counter() - start
        reuse = session.last_reuse
        exact = min(reuse.exact, kv.length)
        logits, _ = model.forward(np.asarray(ids[kv.length:], dtype=np.int64), kv, last_logits_only=True)
        ttft, cpu = time.perf_counter() - start, time.process_time() - cpu
        session.commit(ids, [int(np.argmax(logits[-1]))])
        return {"prompt_tokens": len(ids), "computed": len(ids) - exact - reuse.approx, "reused_exact": exact,
                "reused_approx": reuse.approx, "recomputed_in_runs": reuse.blend_recomputed,
                "runs": reuse.runs, "similar_runs": reuse.similar_runs, "ttft_s": ttft, "ttft_cpu_s": cpu,
                "prepare_s": prepared, "logits": logits[-1]}


def trace_table(engine: Engine, prompts: list[list[int]], work: Path, ratio: float, stateless: bool = False
                ) -> dict[str, list[dict]]:
    """Every configuration over the trace, interleaved request by request (machine load hits all alike)."""
    runners = {"no cache": TraceRunner(engine, "none", None),
               "exact, chunk-aligned": TraceRunner(engine, "aligned", work / "aligned", stateless=stateless),
               "exact to first difference": TraceRunner(engine, "exact", work / "exact", stateless=stateless),
               f"approximate r={ratio}": TraceRunner(engine, "approximate", work / "approx", ratio, stateless)}
    results: dict[str, list[dict]] = {label: [] for label in runners}
    for _ in range(2):  # warm-up: page the weights in, let BLAS settle
        engine.model.forward(np.asarray(prompts[0][:256], dtype=np.int64), engine.model.new_cache())
    for i, ids in enumerate(prompts):
        for label, runner in runners.items():
            row = runner.request(ids)
            row["request"] = i + 1
            results[label].append(row)
        reference = results["no cache"][i]["logits"]
        for label in runners:
            row = results[label][i]
            row["max_logit_diff"] = float(np.abs(row["logits"] - reference).max())
            row["same_argmax"] = bool(np.argmax(row["logits"]) == np.argmax(reference))
    for rows in results.values():
        for row in rows:
            row.pop("logits")
    return results


# ---- quality cost of approximate reuse -------------------------------------------------------------

def quality_table(engine: Engine, prompts: list[list[int]], work: Path, requests: tuple[int, ...] = (4, 5),
                  n_next: int = 32) -> list[dict]:
    """Per request (with the earlier requests stored exactly) and recompute ratio: teacher-forced comparison over
    the exact greedy continuation's next `n_next` tokens, and how long free greedy decoding stays identical."""
    model = engine.model
    out = []
    greedy = Sampler(SamplingParams())
    for req in requests:
        base = work / f"quality-base-{req}"
        cache = PrefixCache.for_model(model, engine.model_hash, base, use_mtp=False, chunk_tokens=CHUNK)
        for ids in prompts[:req - 1]:
            session = Session(model, cache)
            kv = session.prepare(ids)
            logits, _ = model.forward(np.asarray(ids[kv.length:], dtype=np.int64), kv, last_logits_only=True)
            session.commit(ids, [int(np.argmax(logits[-1]))])
        ids = prompts[req - 1]
        cont = list(Generator(model, (), use_mtp=False).generate(ids, n_next, greedy))
        exact_logits, _ = model.forward(np.asarray(ids + cont[:-1], dtype=np.int64), model.new_cache())
        exact_logits = exact_logits[len(ids) - 1:]
        scale = float(exact_logits.std())
        for ratio, select in [(r, m) for r in RATIOS for m in ("first", "deviation") if 0 < r < 1 or m == "first"]:
            directory = work / f"quality-{req}-{ratio}-{select}"
            shutil.copytree(base, directory)
            session = Session(model, PrefixCache.for_model(model, engine.model_hash, directory, use_mtp=False,
                                                           chunk_tokens=CHUNK),
                              ApproxPolicy(recompute_ratio=ratio, select=select))
            kv = session.prepare(ids)
            reuse = session.last_reuse
            rows_before = kv.length
            logits, _ = model.forward(np.asarray(ids[kv.length:] + cont[:-1], dtype=np.int64), kv)
            logits = logits[len(ids) - 1 - rows_before:]
            kv.truncate(rows_before)
            free = list(Generator(model, (), use_mtp=False).generate(ids, n_next, greedy, kv))
            same_prefix = next((i for i, (a, b) in enumerate(zip(free, cont, strict=True)) if a != b), n_next)
            out.append({"request": req, "ratio": ratio, "select": select, "prompt_tokens": len(ids),
                        "computed": len(ids) - reuse.exact - reuse.approx, "reused_approx": reuse.approx,
                        "max_logit_diff": float(np.abs(logits - exact_logits).max()), "logit_std": scale,
                        "mean_kl": mean_kl(exact_logits, logits),
                        "tf_top1_agree": int((logits.argmax(-1) == exact_logits.argmax(-1)).sum()),
                        "greedy_identical_prefix": same_prefix, "n_next": n_next})
    return out


def similarity_table(engine: Engine, chunk: int = CHUNK, trials: int = 200, seed: int = 0) -> list[dict]:
    """Cosine similarity of the chunk embedding between a window and a copy with a fraction of its tokens kept
    (the rest replaced at random): what a `--reuse-threshold` admits."""
    latents = TokenLatents(engine.model)
    rng = np.random.default_rng(seed)
    vocab = engine.config.vocab_size - 16
    rows = []
    for kept in (1.0, 0.9, 0.75, 0.5, 0.25, 0.0):
        sims = []
        for _ in range(trials):
            a = rng.integers(0, vocab, chunk)
            b = a.copy()
            swap = rng.choice(chunk, int(round((1 - kept) * chunk)), replace=False)
            b[swap] = rng.integers(0, vocab, len(swap))
            va, vb = latents.embed([a.tolist(), b.tolist()]) - latents.center
            sims.append(float(va @ vb / (np.linalg.norm(va) * np.linalg.norm(vb))))
        sims = np.array(sims)
        rows.append({"tokens_kept": kept, "cos_mean": float(sims.mean()), "cos_p05": float(np.quantile(sims, 0.05)),
                     "cos_p95": float(np.quantile(sims, 0.95))})
    return rows


# ---- output ----------------------------------------------------------------------------------------

def print_trace(results: dict[str, list[dict]]) -> None:
    print("| configuration | prefill tokens computed per request | total computed | sum of TTFT s (CPU s) |")
    print("|---|---|---|---|")
    for label, rows in results.items():
        print(f"| {label} | {' '.join(str(r['computed']) for r in rows)} | {sum(r['computed'] for r in rows)} | "
              f"{sum(r['ttft_s'] for r in rows):.2f} ({sum(r['ttft_cpu_s'] for r in rows):.2f}) |")
    approx = next(rows for label, rows in results.items() if label.startswith("approximate"))
    print()
    exact = results["exact to first difference"]
    print("| request | prompt | approx: exact / approx reused | runs (similar) | recomputed in runs | TTFT CPU s "
          "(none / aligned / exact / approx) | first-token max logit diff vs no cache: exact / approx | "
          "same argmax: exact / approx |")
    print("|---|---|---|---|---|---|---|---|")
    labels = list(results)
    for i, row in enumerate(approx):
        ttfts = " / ".join(f"{results[label][i]['ttft_cpu_s']:.2f}" for label in labels)
        yes = lambda r: "yes" if r["same_argmax"] else "no"  # noqa: E731
        print(f"| {row['request']} | {row['prompt_tokens']} | {row['reused_exact']} / {row['reused_approx']} | "
              f"{row['runs']} ({row['similar_runs']}) | {row['recomputed_in_runs']} | {ttfts} | "
              f"{exact[i]['max_logit_diff']:.3g} / {row['max_logit_diff']:.3g} | {yes(exact[i])} / {yes(row)} |")


def print_quality(rows: list[dict]) -> None:
    print("| request | recompute ratio | selection | tokens computed | approx reused | max logit diff (logit std) | "
          "mean KL nats | teacher-forced top-1 agreement | identical greedy tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['request']} | {r['ratio']} | {r['select']} | {r['computed']} / {r['prompt_tokens']} | "
              f"{r['reused_approx']} | "
              f"{r['max_logit_diff']:.3g} ({r['logit_std']:.2g}) | {r['mean_kl']:.3g} | "
              f"{r['tf_top1_agree']}/{r['n_next']} | "
              f"{r['greedy_identical_prefix']}/{r['n_next']} |")


def print_similarity(rows: list[dict], label: str) -> None:
    print(f"| {label}: tokens kept | cosine mean | 5th pct | 95th pct |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens_kept']:.2f} | {r['cos_mean']:.3f} | {r['cos_p05']:.3f} | {r['cos_p95']:.3f} |")


def default_quality_fixture() -> Path:
    trained = sorted(p for p in (ROOT / "tests" / "fixtures").glob("tiny-trained*") if (p / "config.json").is_file())
    return trained[0] if trained else ROOT / "tests" / "fixtures" / "tiny-bf16"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="q4", help="benchmark-model preset for the trace (default q4)")
    p.add_argument("--quality-fixture", type=Path, default=None,
                   help="HF snapshot for the quality table (default: tests/fixtures/tiny-trained* if present, "
                        "else tiny-bf16); converted at f32")
    p.add_argument("--ratio", type=float, default=0.1, help="recompute ratio of the trace's approximate run")
    p.add_argument("--stateless", action="store_true",
                   help="trace: a fresh Session per request (a new process each time) instead of one per conversation")
    p.add_argument("--skip-trace", action="store_true")
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    report: dict = {}
    with tempfile.TemporaryDirectory(prefix="glmkit-semantic-bench-") as tmp:
        work = Path(tmp)
        if not args.skip_trace:
            engine = Engine(ensure_bench_snapshot(args.preset), load_tokenizer=False)
            prompts = agent_trace(engine.config.vocab_size, bench_roles(engine.config.vocab_size), 1.0)
            report["trace"] = trace_table(engine, prompts, work / "trace", args.ratio, args.stateless)
            report["similarity_bench"] = similarity_table(engine)
            kind = "a fresh Session per request" if args.stateless else "one Session per conversation"
            print(f"## agent trace, benchmark model ({args.preset}), chunk {CHUNK}, {kind}\n")
            print_trace(report["trace"])
            print()
            print_similarity(report["similarity_bench"], "bench model")
            print()
        if not args.skip_quality:
            from tests.runtime_support import convert
            fixture = args.quality_fixture or default_quality_fixture()
            snap = convert(fixture, work / "quality-snapshot", "f32")
            engine = Engine(snap)
            source = None
            if (fixture / "eval_tokens.json").is_file():
                data = json.loads((fixture / "eval_tokens.json").read_text())
                if isinstance(data, dict):
                    data = data.get("tokens") or data.get("sequences") or []
                source = [t for seq in data for t in (seq if isinstance(seq, list) else [seq])] or None
            scale = min(1.0, (engine.config.max_position_embeddings - 64) / 2600)
            prompts = agent_trace(engine.config.vocab_size, tokenizer_roles(engine), scale, doc_source=source)
            report["quality_fixture"] = fixture.name
            report["quality"] = quality_table(engine, prompts, work / "quality")
            report["similarity_quality"] = similarity_table(engine)
            print(f"## quality of approximate reuse vs full recompute: {fixture.name} (f32), chunk {CHUNK}, "
                  f"prompts of {len(prompts[3])} and {len(prompts[4])} tokens\n")
            print_quality(report["quality"])
            print()
            print_similarity(report["similarity_quality"], fixture.name)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
