#!/usr/bin/env python3
"""The host side of a discrete GPU too small for the model: where the routed experts over its budget run.

    PYTHONPATH=. python tools/bench_hybrid.py                 # bench model, q4, a "GPU" holding 25% of it
    PYTHONPATH=. python tools/bench_hybrid.py --budget 0.5
    PYTHONPATH=. python tools/bench_hybrid.py --gpu          # this machine's GPU, PoCL's CPU device beside it

With `--gpu` the discrete device is the machine's first OpenCL GPU. Without it, the GPU is PoCL's CPU device
driven as a discrete one (device buffers, weights uploaded within
`--budget` x the container; `Kernels(direct=False)`), decoding operation by operation as a real GPU would with a
model over its budget. The routed experts that do not fit run on the host, three ways: the NumPy path (no spill
device), fused kernels on a CPU OpenCL device with float inputs, and the same with int8 inputs (the
default). Prints decode tok/s (greedy, 20 tokens after a 64-token prompt; median of `--runs`) and the host's
expert time per token. Both "devices" share this machine's cores: the expert times are the comparison, the
tok/s only order the rows (on a real GPU its own share of a token is far smaller).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from glmkit.backends.opencl.backend import OpenCLBackend, Placement  # noqa: E402
from glmkit.backends.opencl.device import list_devices  # noqa: E402
from glmkit.backends.opencl.ops import Kernels  # noqa: E402
from glmkit.generate.engine import Engine  # noqa: E402
from glmkit.model.glm5 import GlmMoeDsaModel  # noqa: E402
from tools.bench_model import DEFAULT_WORK, ensure_bench_snapshot  # noqa: E402

PATHS = {"numpy": (False, False), "cpu-device float": (True, False), "cpu-device int8": (True, True)}


def hybrid_model(engine: Engine, gpu: Kernels, cpu: Kernels, budget: int, spill: bool, int8: bool
                 ) -> tuple[GlmMoeDsaModel, list[float]]:
    """A model on the emulated GPU whose over-budget experts run on `cpu` (spill) or NumPy; and the list that
    collects the seconds each call of that expert path took."""
    placement = Placement.all_cl(False)
    placement.spill_experts = spill
    backend = OpenCLBackend(gpu, placement, budget=budget, unified=False, model_bytes=engine.container.nbytes,
                            int8_activations=False,
                            spill=OpenCLBackend(cpu, Placement.all_cl(True), int8_activations=int8) if spill else None)
    spent: list[float] = []
    owner = backend.spill if spill else backend
    name = "_run_fused" if spill else "expert_mlp"
    run = getattr(owner, name)

    def timed(*args):
        start = time.perf_counter()
        out = run(*args)
        spent.append(time.perf_counter() - start)
        return out

    setattr(owner, name, timed)
    return GlmMoeDsaModel(engine.config, engine.experts, backend), spent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="q4")
    ap.add_argument("--budget", type=float, default=0.25, help="the GPU's weight budget, a fraction of the container")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK)
    ap.add_argument("--gpu", action="store_true", help="the machine's GPU as the discrete device (default: PoCL's "
                                                       "CPU device driven as one)")
    args = ap.parse_args(argv)
    engine = Engine(ensure_bench_snapshot(args.preset, args.work), "numpy", load_tokenizer=False)
    cpus = [d for d in list_devices() if d.kind == "cpu"]
    gpus = [d for d in list_devices() if d.kind == "gpu"]
    if not cpus or (args.gpu and not gpus):
        print(f"bench_hybrid: no {'CPU' if not cpus else 'GPU'} OpenCL device (the CPU one: pip install "
              "'pyopencl[pocl]')", file=sys.stderr)
        return 1
    gpu, cpu = Kernels(gpus[0]) if args.gpu else Kernels(cpus[0], direct=False), Kernels(cpus[0])
    budget = int(engine.container.nbytes * args.budget)
    models = {name: hybrid_model(engine, gpu, cpu, budget, *flags) for name, flags in PATHS.items()}
    prompt = np.random.default_rng(0).integers(0, engine.config.vocab_size, 64)
    rows: dict[str, dict[str, list[float]]] = {name: {"tok_s": [], "experts_ms": []} for name in models}
    for _ in range(args.runs):  # the paths alternate: a slow moment of the machine hits each of them
        for name, (model, spent) in models.items():
            cache = model.new_cache()
            model.forward(prompt, cache)
            spent.clear()
            token, start = 5, time.perf_counter()
            for _ in range(args.tokens):
                token = int(model.forward(np.array([token]), cache)[0][-1].argmax())
            rows[name]["tok_s"].append(args.tokens / (time.perf_counter() - start))
            rows[name]["experts_ms"].append(sum(spent) / args.tokens * 1e3)
    result = {name: {key: round(float(np.median(v)), 2) for key, v in row.items()} for name, row in rows.items()}
    where = gpu.info.name if args.gpu else "PoCL driven as a discrete device"
    print(f"bench model {args.preset}, GPU budget {args.budget:.0%} of {engine.container.nbytes / 1e6:.0f} MB "
          f"({where}); medians of {args.runs} runs")
    print("| experts over the budget run on | decode tok/s | host expert time per token (ms) |")
    print("|---|---|---|")
    for name, row in result.items():
        print(f"| {name} | {row['tok_s']} | {row['experts_ms']} |")
    print(json.dumps({"budget": args.budget, "preset": args.preset, "gpu": where, "paths": result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
