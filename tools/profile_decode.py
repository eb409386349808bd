#!/usr/bin/env python3
"""Where a decoded token's time goes on the device decode step (glmkit.backends.opencl.decode_graph).

    PYTHONPATH=. python tools/profile_decode.py            # bench model, q4, --device auto placement

Prefills a random prompt (`--prompt` tokens, default 256) on the benchmark model (or `--snapshot`; `--expert-cache`:
its routed experts in an expert cache of that many bytes, as glm-run keeps them), decodes warm-up tokens, then
`--tokens` greedy tokens with every launch on an OpenCL profiling queue. Prints the wall time per token, each
kernel's device time per token, the device's idle time between launches inside a token and between tokens, and
the host's time between tokens (the wait's return to the next token's first launch). Then, for comparison, the
speed of the default greedy path, which keeps the next forward in flight (`Generator`, MTP off; no per-launch
profile). On a shared machine compare rows of one run. Where the shadow selection runs (a long `--prompt`), a pass
after the timed tokens also counts the keys it lists for stage 2 in each scoring layer.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from glmkit.backends.opencl.decode_graph import DeviceDecodeStep  # noqa: E402
from glmkit.backends.opencl.program import Launch  # noqa: E402
from glmkit.generate.engine import Engine  # noqa: E402
from glmkit.generate.generator import Generator  # noqa: E402
from glmkit.generate.sampling import Sampler, SamplingParams  # noqa: E402
from glmkit.model.glm5 import GlmMoeDsaModel  # noqa: E402
from glmkit.model.kv_cache import KVCache  # noqa: E402
from tools.bench_model import DEFAULT_WORK, ensure_bench_snapshot  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="q4")
    ap.add_argument("--tokens", type=int, default=40, help="profiled tokens (default %(default)s)")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens, the context decoded against (default "
                                                             "%(default)s)")
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK, help="where the bench model lives")
    ap.add_argument("--kv-dtype", default="f32", help="precision of the KV rows (f32, bf16, fp8)")
    ap.add_argument("--snapshot", type=Path, help="a converted snapshot to profile instead of the bench model")
    ap.add_argument("--expert-cache", type=int, default=0, help="the routed experts in an expert cache of this many "
                                                                "bytes (glm-run's --expert-cache; default the mapping)")
    args = ap.parse_args(argv)
    snapshot = args.snapshot or ensure_bench_snapshot(args.preset, args.work)
    engine = Engine(snapshot, "auto", load_tokenizer=False, kv_dtype=args.kv_dtype, expert_cache=args.expert_cache)
    model = engine.model
    longest = engine.config.max_position_embeddings - 2 * args.tokens - 8  # the warm-up and profiled tokens fit
    if not 0 < args.prompt <= longest:
        print(f"profile_decode: --prompt must be in 1..{longest} (the model's {engine.config.max_position_embeddings} "
              f"positions less the decoded tokens)", file=sys.stderr)
        return 2
    if not hasattr(engine.backend, "k") or not model.decodes_on_device():
        print("profile_decode: this device/placement has no device decode step", file=sys.stderr)
        return 1
    engine.backend.k.enable_profiling()
    model._step = False  # rebuilt on the profiling queue
    events: list[tuple[str, object]] = []
    first_launch: list[float] = []  # per profiled token: when its first kernel was enqueued
    returned: list[float] = []  # when the host got each profiled token's logits back (the first: before token 0)
    enqueue = Launch.enqueue

    def recorded(self: Launch, wait_for: list | None = None):
        if len(first_launch) < len(returned):
            first_launch.append(time.perf_counter())
        event = enqueue(self, wait_for)
        events.append((self.kernel.function_name, event))
        return event

    Launch.enqueue = recorded  # type: ignore[method-assign]
    queueing: list[float] = []  # host seconds spent queueing each token (launches, copies), the recording included
    step_enqueue = DeviceDecodeStep._enqueue

    def timed(self, *a, **k):
        t0 = time.perf_counter()
        event = step_enqueue(self, *a, **k)
        queueing.append(time.perf_counter() - t0)
        return event

    DeviceDecodeStep._enqueue = timed  # type: ignore[method-assign]
    cache = model.new_cache()
    logits, _ = model.forward(np.random.default_rng(0).integers(0, engine.config.vocab_size, args.prompt), cache)
    token = int(logits[-1].argmax())
    for _ in range(5):  # warm-up (kernel builds, first touches)
        logits, _ = model.forward(np.array([token]), cache)
        token = int(logits[-1].argmax())
    events.clear()
    queueing.clear()
    returned.append(time.perf_counter())
    start = returned[0]
    for _ in range(args.tokens):
        logits, _ = model.forward(np.array([token]), cache)
        token = int(logits[-1].argmax())
        returned.append(time.perf_counter())
    host_gaps = [first - back for first, back in zip(first_launch, returned[:-1], strict=True)]
    wall = (time.perf_counter() - start) / args.tokens
    per = len(events) // args.tokens
    busy: dict[str, float] = collections.defaultdict(float)
    inside = between = 0.0
    for i, (name, event) in enumerate(events):
        busy[name] += (event.profile.end - event.profile.start) * 1e-6 / args.tokens
        if i:
            gap = (event.profile.start - events[i - 1][1].profile.end) * 1e-6 / args.tokens
            if i % per:
                inside += gap
            else:
                between += gap
    print(f"{engine.device}, preset {args.preset}: {wall * 1e3:.2f} ms per token ({1 / wall:.1f} tok/s), "
          f"{per} launches per token")
    print(f"kernels {sum(busy.values()):.2f} ms, device idle inside a token {inside:.2f} ms, between tokens "
          f"{between:.2f} ms, host between tokens {np.median(host_gaps) * 1e3:.2f} ms (median), host queueing a token "
          f"{np.median(queueing) * 1e3:.2f} ms (median)")
    for name, ms in sorted(busy.items(), key=lambda kv: -kv[1]):
        print(f"  {name:24s} {ms:6.3f} ms  x{sum(1 for n, _ in events if n == name) // args.tokens}")
    DeviceDecodeStep._enqueue = step_enqueue  # type: ignore[method-assign]
    listed = listed_keys(model, cache, token, enqueue)
    if listed:
        print(f"shadow selection: {np.mean(listed):.0f} keys listed for stage 2 per scoring layer (median "
              f"{np.median(listed):.0f}, {np.mean(listed) / cache.length:.2%} of {cache.length} keys), over 4 tokens")
    Launch.enqueue = enqueue  # type: ignore[method-assign]
    generator = Generator(model, (), use_mtp=False)
    prompt = np.random.default_rng(0).integers(0, engine.config.vocab_size, args.prompt).tolist()
    list(generator.generate(prompt, args.tokens + 1, Sampler(SamplingParams())))
    stats = generator.stats
    print(f"pipelined greedy (Generator, next forward in flight): {(stats.decode_tokens - 1) / stats.decode_s:.1f} "
          f"tok/s")
    return 0


def listed_keys(model: GlmMoeDsaModel, cache: KVCache, token: int, enqueue: Callable) -> list[int]:
    """The keys the shadow selection listed for stage 2 in each scoring layer over 4 more tokens (each candidates
    launch waited for and its count read: a pass of its own, after the timed tokens)."""
    counts: list[int] = []
    step = model._decode_step()

    def counted(self: Launch, wait_for: list | None = None):
        event = enqueue(self, wait_for)
        if self.kernel.function_name == "index_candidates":
            event.wait()
            counts.append(int(step.scratch["listed_count"].host[0]))
        return event

    Launch.enqueue = counted  # type: ignore[method-assign]
    for _ in range(4):
        logits, _ = model.forward(np.array([token]), cache)
        token = int(logits[-1].argmax())
    return counts


if __name__ == "__main__":
    raise SystemExit(main())
