"""Pipeline parallelism over Ray on one machine: what a hop between stages costs, and decode / prefill speed with the
layers split over 1, 2 and 3 stage processes against one process.

    PYTHONPATH=. python tools/bench_pipeline.py --rounds 3 --json /tmp/pipeline.json
    PYTHONPATH=. python tools/bench_pipeline.py --device opencl --stages 1,2 --tokens 64

The benchmark model (tools/bench_model.py) at q4, the `--device` backend everywhere (default NumPy; the head and every
stage: the logits are bit-identical to the single process's, tests/test_pipeline.py). Each stage count is measured
with the hidden state going stage to stage through Ray's compiled graph (`--pipeline-hops graph`, the default where
the stages decode on the device step) and as a Ray actor task per stage ("tasks", the default elsewhere). Where the
device decodes on the device decode step, each stage count is also measured with the stages running a decoded token
operation by operation ("per operation", on the graph). `--blas` BLAS threads in every process (default 1: on two
shared cores, two threads per process spin while they wait for a core). A local Ray cluster is started in this
process (or `--ray-address` joins one); the pipelines are opened once and measured round-robin with the single
process (this process's own model) after one uncounted warm-up run of each, so a change of load hits every
configuration alike; a pipeline's compiled graph is torn down after its turn (its waiting stages poll: left built,
they would take the cores from the next configuration).
Per round and configuration:
- echo hop (on the first configuration of each stage count): `--trips` round trips of one token's hidden state
  `[1, H]` through N actors that return it untouched: chained actor tasks submitted at once and waited for once
  ("tasks"), and a compiled graph of the same actors' `echo` ("graph"); milliseconds per token per hop;
- decode: a `--prompt`-token random prompt, then `--tokens` greedy tokens (MTP off): decode tok/s, and the time per
  token over the single process's divided by N, the hop cost as decoding sees it;
- prefill: a `--prefill`-token random prompt, one token out: prompt tok/s, the pipeline streaming pieces of
  `--chunk` tokens and the single process prefilling in pieces of the same size (the same arithmetic).

    PYTHONPATH=. python tools/bench_pipeline.py --cgroup 0.6 --device auto --rounds 2

`--cgroup FRACTION` measures instead the case a pipeline is for: the 256-expert model of tools/bench_stream.py, each
of 2 stage processes moved into a fresh memory cgroup of FRACTION of the container's bytes (the stage holds its half
of the layers resident), against one process in one such cgroup (bench_stream's `cache` mode: `--device auto` and
glm-run's default expert cache; it must stream). Per round, alternating, each cold (every container file dropped
from the page cache first): a 256-token random prompt, then 64 greedy tokens (MTP off); decode tok/s and each
cgroup's peak memory. The stages start without reading their experts ahead (what they read before the move would be
charged to this process's cgroup); the head (this process: embedding, final norm, lm_head) is not limited; the
hops glm-run's default picks (`--pipeline-hops auto`). `--stage-experts page,cache` measures the stages both over
the page cache and each with an expert cache for its own layers (`--expert-cache` with `--pipeline`), sized as a
stage sizes it from the RAM of its group (the stages open before they are moved into their groups, so the size is
worked out here from what a stage holds once open, and given to them); each pipeline is opened fresh for its run.
What a stage holds when it is moved stays charged where it was taken, so a stage's group is limited to FRACTION less
that (measured once, on a pipeline over the page cache): its group and what it brought hold at most FRACTION.
`--disk-mbps N` also throttles every cgroup's reads of the snapshot's disk to N MB/s (tools/bench_stream.py's
`--disk-mbps`: a disk like the ones the product is for).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import ray
from threadpoolctl import threadpool_limits

from glmkit.format.reader import Container
from glmkit.generate.engine import Engine
from glmkit.generate.generator import Generator
from glmkit.generate.pipeline import DEFAULT_PIPELINE_CHUNK, PipelineEngine
from glmkit.generate.sampling import Sampler, SamplingParams
from glmkit.model.expert_cache import activation_allowance, growth_allowance, non_expert_bytes, routed_expert_bytes
from glmkit.model.glm5 import prefill_bytes
from glmkit.model.kv_cache import kv_bytes_per_token
from tools.bench_model import DEFAULT_WORK, ensure_bench_snapshot
from tools.bench_stream import (
    PROMPT,
    TOKENS,
    drop_from_page_cache,
    ensure_stream_snapshot,
    new_cgroups,
    peak_mb,
    run_child,
    whole_disk,
)

GREEDY = SamplingParams()


def stage_busy_s(engine: Engine) -> float:
    """Seconds the engine's stages have spent computing, summed (0 for a single process)."""
    if not isinstance(engine, PipelineEngine):
        return 0.0
    return sum(ray.get([actor.__ray_call__.remote(lambda stage: stage.busy_s) for actor in engine.pipeline.actors]))


def decode_rate(engine: Engine, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(decode tok/s, the stages' compute in ms per decoded token)."""
    generator = Generator(engine.model, (), use_mtp=False)
    busy = None
    for _ in generator.generate(prompt, tokens, Sampler(GREEDY)):
        if busy is None:  # the first token: the prefill is over
            busy = stage_busy_s(engine)
    assert generator.stats.decode_tokens == tokens
    return (tokens - 1) / generator.stats.decode_s, (stage_busy_s(engine) - busy) / (tokens - 1) * 1e3


def prefill_rate(engine: Engine, prompt: list[int], chunk: int) -> float:
    generator = Generator(engine.model, (), use_mtp=False, prefill_chunk=chunk)
    list(generator.generate(prompt, 1, Sampler(GREEDY)))
    return len(prompt) / generator.stats.prefill_s


def hop_ms(engine: PipelineEngine, hidden: int, trips: int) -> dict[str, float]:
    """Milliseconds per token per hop, `[1, hidden]` sent through every stage's `echo`: as chained actor tasks waited
    for once ("tasks") and through a compiled graph of the same calls ("graph")."""
    from ray.dag import InputNode

    actors = engine.pipeline.actors
    x = np.zeros((1, hidden), np.float32)
    engine.pipeline.release_graph()  # an actor runs one compiled graph at a time

    def tasks() -> None:
        carried = x
        for actor in actors:
            carried = actor.echo.remote(carried)
        ray.get(carried)

    with InputNode() as node:
        for actor in actors:
            node = actor.echo.bind(node)
    graph = node.experimental_compile()
    try:
        ms = {}
        for name, trip in (("tasks", tasks), ("graph", lambda: ray.get(graph.execute(x)))):
            trip()
            start = time.perf_counter()
            for _ in range(trips):
                trip()
            ms[name] = (time.perf_counter() - start) / trips / len(actors) * 1e3
        return ms
    finally:
        graph.teardown()


def stage_anonymous_bytes(engine: PipelineEngine) -> int:
    """The most anonymous memory (`RssAnon`) a stage process of `engine` holds now (this machine's stages only)."""
    held = 0
    for where in engine.pipeline.where:
        for line in Path(f"/proc/{where['pid']}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                held = max(held, int(line.split()[1]) << 10)
    return held


def stage_cache_bytes(container: Container, layers: range, limit: int, held: int, context: int) -> int:
    """The expert cache a stage over `layers` sizes for itself from the RAM when it opens inside a memory cgroup of
    `limit` bytes holding `held` bytes (`stage_expert_cache` with "auto"): the stages here open before they are moved
    into their groups, so it is given to them."""
    pieces = min(activation_allowance(limit), prefill_bytes(container.config, DEFAULT_PIPELINE_CHUNK))
    room = limit - non_expert_bytes(container, layers) - held - pieces - growth_allowance(limit)
    room -= kv_bytes_per_token(container.config, "f32", layers) * context
    return max(0, min(room, routed_expert_bytes(container, layers)))


def cgroup_rounds(args: argparse.Namespace) -> None:
    """`--cgroup`: 2 stages, each in a memory cgroup of its own, against one process in one such cgroup."""
    snapshot = ensure_stream_snapshot(DEFAULT_WORK.with_name("glmkit-stream-model"))
    container = Container(snapshot)
    size = container.nbytes
    limit = int(args.cgroup * size)
    ray.init(address="local", num_cpus=4, object_store_memory=100 << 20, include_dashboard=False,
             log_to_driver=False, logging_level="warning")
    read_bps = None if args.disk_mbps is None else int(args.disk_mbps * 1e6)
    disk = whole_disk(snapshot) if read_bps else ""
    context = PROMPT + TOKENS + 2  # bench_stream's single process keeps room for the rows of its own run
    # what a stage holds once open (charged outside its group), measured on a pipeline over the page cache
    probe = PipelineEngine(snapshot, 2, device=args.device, prefetch=False, load_tokenizer=False,
                           blas_threads=args.blas, expert_cache=0, verbose=False)
    held = stage_anonymous_bytes(probe)
    caches = {"cache": [stage_cache_bytes(container, layers, limit, held, context) for layers in probe.pipeline.layers]}
    probe.close()
    print(f"a stage holds {held >> 20} MiB once open: stage groups of {(limit - held) >> 20} MiB, expert caches of "
          f"{' / '.join(str(c >> 20) for c in caches['cache'])} MiB", flush=True)
    prompt = np.random.default_rng(0).integers(0, container.config.vocab_size, PROMPT).tolist()  # bench_stream's
    names = ["single"] + [f"2 stages, {where}" for where in args.stage_experts]
    rounds: dict[str, list[float]] = {name: [] for name in names}
    peaks: dict[str, list[int | None]] = {name: [] for name in names}

    def staged(where: str) -> tuple[float, int | None]:
        """One cold run of a fresh pipeline whose stages keep their experts `where` ("page" or "cache")."""
        cached = where == "cache"
        # over the page cache the stages start without reading their experts ahead (what they read before the move
        # would be charged to this process's group); a cache's slots fill only once they are in their groups
        engine = PipelineEngine(snapshot, 2, device=args.device, prefetch=cached, load_tokenizer=False,
                                blas_threads=args.blas, expert_cache=min(caches["cache"]) if cached else 0,  # the
                                # smaller of the two stages' sizes
                                verbose=False, max_context=context)
        groups = [new_cgroups(limit - held, read_bps, disk, name=f"glmkit-stage-{os.getpid()}-{i}") for i in range(2)]
        try:
            for both, stage in zip(groups, engine.pipeline.where, strict=True):
                for group in both:
                    (group / "cgroup.procs").write_text(str(stage["pid"]))
            drop_from_page_cache(snapshot)
            rate = decode_rate(engine, prompt, TOKENS + 1)[0]
            counters = engine.expert_stats.to_json()
            print(f"2 stages, {where}: {json.dumps(counters)}", flush=True)
            peak = max(peak_mb(g) or 0 for both in groups for g in both if "blkio" not in g.parts)
        finally:
            engine.close()
            time.sleep(1)  # the stage processes leave their groups as they exit
            for group in (g for both in groups for g in both):
                group.rmdir()
        return rate, peak

    for _ in range(args.rounds):
        single = run_child(snapshot, "cache", limit, 900, read_bps=read_bps)
        if "error" in single:
            raise SystemExit(f"the single process failed: {single['error']}")
        rounds["single"].append(single["decode_tok_s"])
        peaks["single"].append(single["peak_mb"])
        for where in args.stage_experts:
            rate, peak = staged(where)
            rounds[f"2 stages, {where}"].append(rate)
            peaks[f"2 stages, {where}"].append(peak)
        print(", ".join(f"{name} {rounds[name][-1]:.2f} tok/s" for name in names), flush=True)
    medians = {name: statistics.median(rounds[name]) for name in names}
    print(f"{snapshot}: {size / 1e9:.2f} GB, cgroups of {limit >> 20} MiB ({args.cgroup:g} of it), --device "
          f"{args.device}; {args.rounds} rounds, medians"
          + ("" if read_bps is None else f"; reads throttled to {args.disk_mbps:g} MB/s"))
    print("| configuration | decode tok/s | x single | per round | cgroup peak MiB |")
    print("|---|---:|---:|---|---:|")
    for name in names:
        print(f"| {name} | {medians[name]:.2f} | {medians[name] / medians['single']:.2f} | "
              f"{' / '.join(f'{r:.2f}' for r in rounds[name])} | {max(p or 0 for p in peaks[name])} |")
    if args.json:
        args.json.write_text(json.dumps({"limit_bytes": limit, "container_bytes": size, "device": args.device,
                                         "decode_tok_s": rounds, "peak_mb": peaks, "stage_cache_bytes": caches,
                                         "disk_mbps": args.disk_mbps}, indent=1) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=DEFAULT_WORK, help="where the benchmark model is built and reused")
    p.add_argument("--stages", default="1,2,3", help="stage counts to measure (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt", type=int, default=64, help="decode runs' prompt tokens (default %(default)s)")
    p.add_argument("--tokens", type=int, default=32, help="decoded tokens per run (default %(default)s)")
    p.add_argument("--prefill", type=int, default=512, help="prefill runs' prompt tokens (default %(default)s)")
    p.add_argument("--chunk", type=int, default=128, help="prefill piece, pipeline and single (default %(default)s)")
    p.add_argument("--trips", type=int, default=200, help="round trips per echo hop measurement (default %(default)s)")
    p.add_argument("--hops", default="graph,tasks", help="how the stages pass the hidden state (--pipeline-hops), "
                   "the pipeline configurations measured (default %(default)s)")
    p.add_argument("--device", default="numpy", help="backend of the head, the stages and the single process "
                   "(default %(default)s; opencl: the device decode step)")
    p.add_argument("--ray-address", help="join this Ray cluster instead of starting a local one")
    p.add_argument("--blas", type=int, default=1, help="BLAS threads, this process and every stage (default 1)")
    p.add_argument("--cgroup", type=float, metavar="FRACTION",
                   help="instead: 2 stages and one process, each in a memory cgroup of this fraction of the 256-expert "
                        "model (module docstring)")
    p.add_argument("--stage-experts", type=lambda t: t.split(","), default=["page"],
                   help="with --cgroup: where the stages keep their routed experts, configurations measured: page (the "
                        "page cache), cache (an expert cache each, sized as in its group); default page")
    p.add_argument("--disk-mbps", type=float, help="with --cgroup: each cgroup's reads of the snapshot's disk "
                   "throttled to this many MB/s")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.cgroup is not None:
        cgroup_rounds(args)
        return

    snapshot = ensure_bench_snapshot("q4", args.work)
    threadpool_limits(args.blas, user_api="blas")
    if args.ray_address:
        ray.init(address=args.ray_address, log_to_driver=False, logging_level="warning")
    else:
        ray.init(address="local", num_cpus=64, object_store_memory=200 << 20, include_dashboard=False,
                 log_to_driver=False, logging_level="warning")  # logical CPUs: one per stage of every configuration
    single = Engine(snapshot, args.device, load_tokenizer=False)
    counts = [int(n) for n in args.stages.split(",")]
    engines: dict[str, Engine] = {"single": single}
    echoed = []  # the configurations whose actors measure the echo hop: the first of each stage count
    for hops in args.hops.split(","):
        for step in (True, False) if single.model.decodes_on_device() and hops == "graph" else (True,):
            for n in counts:
                name = f"{n} stage{'s' if n > 1 else ''}, {hops}{'' if step else ', per operation'}"
                engines[name] = PipelineEngine(snapshot, n, device=args.device, chunk=args.chunk,
                                               load_tokenizer=False, blas_threads=args.blas, decode_step=step,
                                               hops=hops)
                if not any(len(engines[e].pipeline.layers) == n for e in echoed):
                    echoed.append(name)
    rng = np.random.default_rng(0)
    vocab = single.config.vocab_size - 2  # never an eos id: every run decodes all its tokens
    decode_prompt = rng.integers(0, vocab, args.prompt).tolist()
    prefill_prompt = rng.integers(0, vocab, args.prefill).tolist()
    load_start = os.getloadavg()[0]
    results: dict[str, dict[str, list[float]]] = {
        name: {"decode": [], "prefill": [], "hop_tasks": [], "hop_graph": [], "stage_ms": []} for name in engines}
    for engine in engines.values():  # warm-up, not counted: weights into the page cache, first-call costs
        decode_rate(engine, decode_prompt[:8], 4)
        prefill_rate(engine, prefill_prompt[:args.chunk + 1], args.chunk)
        if isinstance(engine, PipelineEngine):
            engine.pipeline.release_graph()
    for _ in range(args.rounds):
        for name, engine in engines.items():
            rate, stage_ms = decode_rate(engine, decode_prompt, args.tokens)
            results[name]["decode"].append(rate)
            results[name]["stage_ms"].append(stage_ms)
            results[name]["prefill"].append(prefill_rate(engine, prefill_prompt, args.chunk))
            if isinstance(engine, PipelineEngine):
                engine.pipeline.release_graph()
            if name in echoed:
                for hops, ms in hop_ms(engine, single.config.hidden_size, args.trips).items():
                    results[name][f"hop_{hops}"].append(ms)
    load_end = os.getloadavg()[0]
    single_ms = 1e3 / statistics.median(results["single"]["decode"])
    print(f"{snapshot}: {single.config.num_hidden_layers} layers; {args.rounds} rounds, medians; "
          f"load average {load_start:.1f} -> {load_end:.1f}")
    print("| configuration | layers per stage | decode tok/s | ms per token | stages' compute ms per token | rest ms "
          "per token per stage | over the single process, ms per token per stage | echo hop ms, tasks | "
          "echo hop ms, graph | prefill tok/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    table = {}
    for name, engine in engines.items():
        r = results[name]
        decode, prefill = statistics.median(r["decode"]), statistics.median(r["prefill"])
        layers = "-" if name == "single" else "/".join(str(len(x)) for x in engine.pipeline.layers)
        stages = 0 if name == "single" else len(engine.pipeline.layers)
        per_hop = (1e3 / decode - single_ms) / stages if stages else None
        hop = {k: statistics.median(r[f"hop_{k}"]) if r[f"hop_{k}"] else None for k in ("tasks", "graph")}
        stage_ms = statistics.median(r["stage_ms"])
        # per token: head work + hops = the token's time less the stages' compute, per stage
        rest = statistics.median([(1e3 / d - s) / stages for d, s in zip(r["decode"], r["stage_ms"], strict=True)]
                                 ) if stages else None
        table[name] = {"decode_tok_s": decode, "prefill_tok_s": prefill, "ms_per_token": 1e3 / decode,
                       "stage_compute_ms_per_token": stage_ms, "rest_ms_per_token_per_stage": rest,
                       "decode_ms_per_hop": per_hop, "echo_hop_ms": hop, "layers": layers, "runs": r}

        def cell(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f}"

        print(f"| {name} | {layers} | {decode:.2f} | {1e3 / decode:.1f} | {cell(stage_ms if stages else None)} | "
              f"{cell(rest)} | {cell(per_hop)} | {cell(hop['tasks'])} | {cell(hop['graph'])} | "
              f"{prefill:.1f} |")
    for engine in engines.values():
        engine.close()
    if args.json:
        meta = {"snapshot": str(snapshot), "device": args.device, "rounds": args.rounds, "blas_threads": args.blas,
                "prompt": args.prompt, "tokens": args.tokens, "trips": args.trips, "hops": args.hops,
                "prefill": args.prefill, "chunk": args.chunk, "load_start": load_start, "load_end": load_end,
                "cores": os.cpu_count()}
        args.json.write_text(json.dumps({"meta": meta, "results": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()
