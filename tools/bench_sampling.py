#!/usr/bin/env python3
"""Sampled against greedy decode on the device decode step: does sampling keep the next forward in flight?

    PYTHONPATH=. python tools/bench_sampling.py            # bench model, q4, --device auto placement

Prefills a random `--prompt`-token prompt on the benchmark model (tools/bench_model.py), then decodes `--tokens`
tokens (MTP off, no EOS) with each row's sampler through `Generator`, each row right after a greedy run (pipelined:
the argmax on the device), rows in turn, `--rounds` times, so that the machine's load hits every row and its
greedy run alike. Rows: greedy against greedy (the pairs' noise), and per sampling setting the device draw
(pipelined, the default: sample.cl) and the host draw (`Generator(pipelined=False)`: each token's forward queued
after the host drew it, as before device sampling). Prints per row the median tok/s, the median (and range) of
its ratio to the greedy run just before it, how many tokens the host chose instead of the device, and whether
the two draws gave the same tokens (they must: same seed, same logits). Then the draw's kernels alone on the same
device (`--kernels`: 0 skips), per vocabulary (the benchmark model's and GLM-5's) and setting, against greedy's
argmax: ms per token over 50 launches of normal x3 random logits, rows alternated, best of 3.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from glmkit.backends.opencl import decode_graph  # noqa: E402
from glmkit.backends.opencl.decode_graph import SampleLaunches, SampleScratch  # noqa: E402
from glmkit.backends.opencl.ops import Kernels  # noqa: E402
from glmkit.generate.engine import Engine  # noqa: E402
from glmkit.generate.generator import Generator  # noqa: E402
from glmkit.generate.sampling import Sampler, SamplingParams  # noqa: E402
from tools.bench_model import DEFAULT_WORK, ensure_bench_snapshot  # noqa: E402

SETTINGS = {  # name -> sampling settings (seeded: the device and host draws are comparable token for token)
    "T 0.7, top-k 40, top-p 0.95": SamplingParams(temperature=0.7, top_k=40, top_p=0.95, seed=1),
    "T 1.0": SamplingParams(temperature=1.0, seed=2),
    "T 0.7, top-p 0.95": SamplingParams(temperature=0.7, top_p=0.95, seed=3),
}


VOCABULARIES = (8192, 154880)  # the benchmark model's, GLM-5's


def kernel_times(k: Kernels, launches: int) -> dict[tuple[int, str], float]:
    """(vocabulary, row) -> ms per draw of the draw's launches alone (greedy: argmax_row), rows alternated, best
    of 3."""
    best: dict[tuple[int, str], float] = {}
    for vocab in VOCABULARIES:
        logits = k.buffers.filled(np.random.default_rng(0).standard_normal(vocab) * 3)
        scratch, token = SampleScratch(k.buffers, vocab), k.buffers.array(2, np.uint32)
        argmax = k.bind("argmax_row", (k.red_lanes,), (k.red_lanes,), x=logits.buffer, n=vocab, token=token.buffer)
        draws = {name: SampleLaunches(k, logits.buffer, params, scratch) for name, params in SETTINGS.items()}
        for _ in range(3):
            for name in ["greedy", *draws]:
                start = time.perf_counter()
                for _ in range(launches):
                    if name == "greedy":
                        argmax.enqueue()
                    else:
                        draws[name].enqueue(0.5, token.buffer, scratch.held[0].buffer)
                k.finish()
                ms = (time.perf_counter() - start) / launches * 1e3
                best[vocab, name] = min(best.get((vocab, name), ms), ms)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="q4")
    ap.add_argument("--tokens", type=int, default=64, help="decoded tokens per run (default %(default)s)")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over every row (default %(default)s)")
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK, help="where the bench model lives")
    ap.add_argument("--kernels", type=int, default=50, help="launches per kernel timing (default %(default)s)")
    args = ap.parse_args(argv)
    engine = Engine(ensure_bench_snapshot(args.preset, args.work), "auto", load_tokenizer=False)
    model = engine.model
    if not model.decodes_on_device():
        print("bench_sampling: this device/placement has no device decode step", file=sys.stderr)
        return 1
    prompt = np.random.default_rng(0).integers(0, engine.config.vocab_size, args.prompt).tolist()
    rows = [("greedy", SamplingParams(), True)] + [
        (f"{name}, {where}", params, where == "device") for name, params in SETTINGS.items()
        for where in ("device", "host")]
    pipes: list = []
    pipeline = decode_graph.DeviceDecodeStep.pipeline

    def counted(self, *a, **k):  # the pipelines, for their host-chosen token counts
        pipes.append(pipeline(self, *a, **k))
        return pipes[-1]

    decode_graph.DeviceDecodeStep.pipeline = counted  # type: ignore[method-assign]
    speed: dict[str, list[float]] = {name: [] for name, _, _ in rows}
    ratio: dict[str, list[float]] = {name: [] for name, _, _ in rows}
    tokens: dict[str, list[int]] = {}
    by_host: dict[str, int] = {}

    def run(params: SamplingParams, pipelined: bool) -> tuple[float, list[int], int]:
        """(decode tok/s, the tokens, how many of them the host chose)."""
        pipes.clear()
        generator = Generator(model, (), use_mtp=False, pipelined=pipelined)
        out = list(generator.generate(prompt, args.tokens + 1, Sampler(params)))
        stats = generator.stats
        host = sum(p.fallbacks for p in pipes if p is not None) if pipelined else stats.decode_tokens - 1
        return (stats.decode_tokens - 1) / stats.decode_s, out, host

    for r in range(-1, args.rounds):  # round -1: warm-up (kernel builds, first touches), not counted
        for name, params, pipelined in rows:  # each row right after a greedy run of its own: a ratio per pair
            greedy = run(SamplingParams(), True)[0]
            tok_s, out, host = run(params, pipelined)
            if r >= 0:
                speed[name].append(tok_s)
                ratio[name].append(tok_s / greedy)
                tokens.setdefault(name, out)
                by_host[name] = host
    print(f"{engine.device}, preset {args.preset}, {args.prompt}-token prompt, {args.tokens} tokens, "
          f"{args.rounds} rounds (medians; the ratio's range over the rounds)")
    print("| decoding | tok/s | / greedy run just before | tokens chosen by the host | same tokens as the host draw |")
    print("|---|---|---|---|---|")
    for name, _, _ in rows:
        same = "" if not name.endswith(", device") else (
            "yes" if tokens[name] == tokens[name.removesuffix(", device") + ", host"] else "NO")
        print(f"| {name} | {statistics.median(speed[name]):.1f} | {statistics.median(ratio[name]):.2f} "
              f"({min(ratio[name]):.2f}-{max(ratio[name]):.2f}) | {by_host[name]} of {args.tokens} | {same} |")
    if args.kernels and hasattr(engine.backend, "k"):
        times = kernel_times(engine.backend.k, args.kernels)
        print("\n| draw kernels, ms per token | " + " | ".join(f"vocab {v:,}" for v in VOCABULARIES) + " |")
        print("|---|" + "---|" * len(VOCABULARIES))
        for name in ["greedy", *SETTINGS]:
            print(f"| {name} | " + " | ".join(f"{times[v, name]:.3f}" for v in VOCABULARIES) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
