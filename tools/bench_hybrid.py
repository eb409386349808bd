#!/usr/bin/env python3
"""A discrete GPU too small for the model: where the routed experts over its budget run, and how a token is queued.

    PYTHONPATH=. python tools/bench_hybrid.py                 # bench model, q4, "GPU" budgets of 25% and 50% of it
    PYTHONPATH=. python tools/bench_hybrid.py --budget 0.25
    PYTHONPATH=. python tools/bench_hybrid.py --gpu          # this machine's GPU, PoCL's CPU device beside it
    PYTHONPATH=. python tools/bench_hybrid.py --forms --snapshot /tmp/tt-q4 --budget 0.4   # the split step's forms

With `--gpu` the discrete device is the machine's first OpenCL GPU. Without it, the GPU is PoCL's CPU device
driven as a discrete one (device buffers, weights uploaded within `--budget` x the container;
`Kernels(direct=False)`). Rows: decoding operation by operation (the routed experts that do not fit run on the host
three ways: the NumPy path, fused kernels on a CPU OpenCL device with float inputs, and the same with int8 inputs),
and the split step (the device decode step with the experts that do not fit on the CPU OpenCL device, float and
int8 inputs; the routed experts uploaded in rank order, or by the usage scores a split step counted over
`--learn-tokens` tokens after another prompt, as an earlier process leaves them). Prints decode tok/s (greedy, 20
tokens after a 64-token prompt; median of `--runs`, every row of every budget in turn per run), the host's time per
token in the experts (per operation: the CPU side's expert calls; split step: from the wait for each layer's routed
ids to the upload of the CPU side's rows) and, for the split step, the share of the routed experts the timed tokens
found on the GPU. Both "devices" share this machine's cores: on a real GPU its own share of a token is far smaller.

`--forms`: the split step's multi-row forms instead (experts uploaded by usage, int8 inputs), on `--snapshot` (default
the bench model; a trained fixture has a real MTP head): greedy decode with MTP on (a draft's verification and the
next draft as one step) against off (the pipelined single-token step), `--tokens` after a 48-token prompt, alternated
`--runs` times, the ratio taken per alternation; and `--batch` sequences decoded as one step of that many rows against
one single-token step per sequence (after 20-token random prompts), alternated likewise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from glmkit.backends.opencl.backend import OpenCLBackend, Placement  # noqa: E402
from glmkit.backends.opencl.device import list_devices  # noqa: E402
from glmkit.backends.opencl.ops import Kernels  # noqa: E402
from glmkit.generate.engine import Engine  # noqa: E402
from glmkit.generate.generator import Generator  # noqa: E402
from glmkit.generate.sampling import Sampler, SamplingParams  # noqa: E402
from glmkit.model.expert_cache import ExpertScores  # noqa: E402
from glmkit.model.glm5 import GlmMoeDsaModel  # noqa: E402
from tools.bench_model import DEFAULT_WORK, ensure_bench_snapshot  # noqa: E402

PATHS = {"numpy": (False, False, False, False), "cpu-device float": (True, False, False, False),
         "cpu-device int8": (True, True, False, False), "split step float": (True, False, True, False),
         "split step int8": (True, True, True, False), "split step int8, by usage": (True, True, True, True)}
# name: (spill device, int8 inputs, split step, experts uploaded by usage scores learned on another prompt)
NO_AGING = 1e12  # the scores' half-life in tokens: within a run a score is a count


def hybrid_model(engine: Engine, gpu: Kernels, cpu: Kernels, budget: int, spill: bool, int8: bool, split: bool,
                 usage: ExpertScores | None = None) -> tuple[GlmMoeDsaModel, list[float]]:
    """A model on the emulated GPU whose over-budget experts run on `cpu` (spill) or NumPy, per operation or in
    the split step (`split`, uploading routed experts by `usage`, into which it counts its decoded routes); and the
    list that collects the seconds each call of that expert path took."""
    placement = Placement.all_cl(False)
    placement.spill_experts = spill
    placement.decode_step = "cl" if split else "host"
    backend = OpenCLBackend(gpu, placement, budget=budget, unified=False, model_bytes=engine.container.nbytes,
                            int8_activations=int8 and split,
                            spill=OpenCLBackend(cpu, Placement.all_cl(True), int8_activations=int8) if spill else None,
                            expert_usage=usage)
    model = GlmMoeDsaModel(engine.config, engine.experts, backend)
    spent: list[float] = []
    if split:
        step = model._decode_step()
        if step is None or step.spill is None:
            raise SystemExit(f"bench_hybrid: the split step does not bind at a budget of {budget} bytes")
        owner, name = step, "_run_split"
    else:
        owner, name = (backend.spill, "_run_fused") if spill else (backend, "expert_mlp")
    run = getattr(owner, name)

    def timed(*args):
        start = time.perf_counter()
        out = run(*args)
        spent.append(time.perf_counter() - start)
        return out

    setattr(owner, name, timed)
    return model, spent


def learn_usage(engine: Engine, gpu: Kernels, cpu: Kernels, budget: int, tokens: int) -> ExpertScores:
    """The usage scores a split step counts over `tokens` greedy tokens after a random prompt other than the timed
    one's (what an earlier process leaves in the usage file)."""
    usage = ExpertScores(NO_AGING)
    model, _ = hybrid_model(engine, gpu, cpu, budget, True, True, True, usage)
    cache = model.new_cache()
    token = int(model.forward(np.random.default_rng(1).integers(0, engine.config.vocab_size, 64), cache)[0][-1]
                .argmax())
    for _ in range(tokens):
        token = int(model.forward(np.array([token]), cache)[0][-1].argmax())
    return usage


def share_on_device(model: GlmMoeDsaModel, usage: ExpertScores, before: dict) -> float:
    """Of the routes `usage` counted since `before` (its scores then), the share whose experts the split step holds
    on the device."""
    resident = {(s.layer, int(e)) for s in (layer.split for layer in model._step.layers if layer.split is not None)
                for e in np.flatnonzero(s.where >= 0)}
    counted = {key: score - before.get(key, 0.0) for key, score in usage.scores.items()}
    total = sum(counted.values())
    return sum(v for key, v in counted.items() if key in resident) / total if total else 0.0


def bench_forms(engine: Engine, gpu: Kernels, cpu: Kernels, budget: int, runs: int, tokens: int, batch: int,
                learn_tokens: int) -> dict[str, Any]:
    """The split step's forms at a budget of `budget` bytes (see the module docstring): per alternation tok/s of MTP
    off and on and their ratio, and of `batch` sequences batched and stepped one by one; medians."""
    usage = ExpertScores(NO_AGING)
    usage.scores.update(learn_usage(engine, gpu, cpu, budget, learn_tokens).scores)
    model, _ = hybrid_model(engine, gpu, cpu, budget, True, True, True, usage)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, engine.config.vocab_size, 48)]
    greedy = SamplingParams(temperature=0)

    def decode(mtp: bool, n: int) -> tuple[list[int], float, float | None]:
        gen = Generator(model, (), use_mtp=mtp)
        out = list(gen.generate(prompt, n, Sampler(greedy)))
        return out, gen.stats.decode_tokens / gen.stats.decode_s, gen.stats.mtp_acceptance

    decode(False, 8), decode(True, 8)  # the steps built
    mtp: dict[str, list[float]] = {"off": [], "on": [], "ratio": [], "acceptance": []}
    for _ in range(runs):
        off, off_tps, _ = decode(False, tokens)
        on, on_tps, acceptance = decode(True, tokens)
        if on != off:
            raise SystemExit("bench_hybrid: MTP on changed the greedy tokens")
        for key, value in (("off", off_tps), ("on", on_tps), ("ratio", on_tps / off_tps),
                           ("acceptance", acceptance or 0.0)):
            mtp[key].append(value)
    rng = np.random.default_rng(1)
    rows: dict[str, list[float]] = {"batched": [], "single": [], "ratio": []}
    for r in range(runs + 1):  # the first pair builds the step of `batch` rows: not counted
        pair = {}
        for mode in ("single", "batched") if r % 2 else ("batched", "single"):
            caches = [model.new_cache() for _ in range(batch)]
            last = [int(model.forward(rng.integers(0, engine.config.vocab_size, 20), c, last_logits_only=True)[0][-1]
                        .argmax()) for c in caches]
            start = time.perf_counter()
            for _ in range(tokens):
                if mode == "batched":
                    last = [int(row.argmax()) for row in model.decode_batch(np.array(last), caches)[0]]
                else:
                    last = [int(model.forward(np.array([t]), c)[0][-1].argmax()) for t, c in zip(last, caches,
                                                                                                  strict=True)]
            pair[mode] = batch * tokens / (time.perf_counter() - start)
        if r:
            for key, value in (*pair.items(), ("ratio", pair["batched"] / pair["single"])):
                rows[key].append(value)
    if model.sequences_step(batch) is None or not model.drafts_on_device():
        raise SystemExit("bench_hybrid: the split step's forms did not bind")
    return {"mtp": {k: round(float(np.median(v)), 2) for k, v in mtp.items()},
            "mtp_ratio_range": [round(min(mtp["ratio"]), 2), round(max(mtp["ratio"]), 2)],
            "batch": {k: round(float(np.median(v)), 2) for k, v in rows.items()},
            "batch_ratio_range": [round(min(rows["ratio"]), 2), round(max(rows["ratio"]), 2)]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="q4")
    ap.add_argument("--budget", type=float, nargs="+", default=[0.25, 0.5],
                    help="the GPU's weight budgets, fractions of the container")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--learn-tokens", type=int, default=64,
                    help="tokens whose routes choose the experts of the rows placed by usage (another prompt's)")
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK)
    ap.add_argument("--gpu", action="store_true", help="the machine's GPU as the discrete device (default: PoCL's "
                                                       "CPU device driven as one)")
    ap.add_argument("--forms", action="store_true", help="the split step's forms: MTP on against off, and a batch")
    ap.add_argument("--snapshot", type=Path, help="with --forms: this container instead of the bench model")
    ap.add_argument("--batch", type=int, default=4, help="with --forms: sequences in the batch")
    args = ap.parse_args(argv)
    snapshot = args.snapshot or ensure_bench_snapshot(args.preset, args.work)
    engine = Engine(snapshot, "numpy", load_tokenizer=False)
    cpus = [d for d in list_devices() if d.kind == "cpu"]
    gpus = [d for d in list_devices() if d.kind == "gpu"]
    if not cpus or (args.gpu and not gpus):
        print(f"bench_hybrid: no {'CPU' if not cpus else 'GPU'} OpenCL device (the CPU one: pip install "
              "'pyopencl[pocl]')", file=sys.stderr)
        return 1
    gpu, cpu = Kernels(gpus[0]) if args.gpu else Kernels(cpus[0], direct=False), Kernels(cpus[0])
    if args.forms:
        for share in args.budget:
            result = bench_forms(engine, gpu, cpu, int(engine.container.nbytes * share), args.runs, args.tokens,
                                 args.batch, args.learn_tokens)
            m, b = result["mtp"], result["batch"]
            print(f"{snapshot} at {share:.0%}: MTP off {m['off']} tok/s, on {m['on']} (acceptance "
                  f"{m['acceptance']}): {m['ratio']}x ({result['mtp_ratio_range']}); {args.batch} sequences batched "
                  f"{b['batched']} tok/s against {b['single']} one by one: {b['ratio']}x "
                  f"({result['batch_ratio_range']})")
            print(json.dumps({"budget": share, **result}))
        return 0
    learned = {share: learn_usage(engine, gpu, cpu, int(engine.container.nbytes * share), args.learn_tokens)
               for share in args.budget}
    models, usages = {}, {}
    for share in args.budget:
        for name, (spill, int8, split, by_usage) in PATHS.items():
            usage = ExpertScores(NO_AGING) if split else None  # counts the timed routes (empty: the rank order)
            if by_usage:
                usage.scores.update(learned[share].scores)
            models[share, name] = hybrid_model(engine, gpu, cpu, int(engine.container.nbytes * share), spill, int8,
                                               split, usage)
            usages[share, name] = usage
    prompt = np.random.default_rng(0).integers(0, engine.config.vocab_size, 64)
    rows: dict[tuple, dict[str, list[float]]] = {key: {"tok_s": [], "experts_ms": [], "on_gpu": []}
                                                 for key in models}
    for _ in range(args.runs):  # the paths alternate: a slow moment of the machine hits each of them
        for key, (model, spent) in models.items():
            cache = model.new_cache()
            model.forward(prompt, cache)
            spent.clear()
            usage = usages[key]
            before = {} if usage is None else dict(usage.scores)
            token, start = 5, time.perf_counter()
            for _ in range(args.tokens):
                token = int(model.forward(np.array([token]), cache)[0][-1].argmax())
            rows[key]["tok_s"].append(args.tokens / (time.perf_counter() - start))
            rows[key]["experts_ms"].append(sum(spent) / args.tokens * 1e3)
            if usage is not None:
                rows[key]["on_gpu"].append(share_on_device(model, usage, before))
    result = {key: {k: round(float(np.median(v)), 2) if v else None for k, v in row.items()}
              for key, row in rows.items()}
    where = gpu.info.name if args.gpu else "PoCL driven as a discrete device"
    print(f"bench model {args.preset}, {engine.container.nbytes / 1e6:.0f} MB ({where}); medians of {args.runs} runs")
    print("| budget | decode | experts over the budget run on | decode tok/s | host expert time per token (ms) | "
          "routed experts on the GPU |")
    print("|---|---|---|---|---|---|")
    for (share, name), row in result.items():
        how = "split step" + (", experts uploaded by usage" if PATHS[name][3] else "") if PATHS[name][2] \
            else "per operation"
        on = {"numpy": "NumPy path"}.get(name, "CPU OpenCL device, " + name.split(",")[0].split()[-1] + " inputs")
        gpu_share = "" if row["on_gpu"] is None else f"{row['on_gpu']:.0%}"
        print(f"| {share:.0%} | {how} | {on} | {row['tok_s']} | {row['experts_ms']} | {gpu_share} |")
    print(json.dumps({"preset": args.preset, "gpu": where,
                      "paths": {f"{share} {name}": row for (share, name), row in result.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
