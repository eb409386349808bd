"""Out-of-core decode: a 256-expert model larger than the memory its process may use, page cache vs expert cache.

    PYTHONPATH=. python tools/bench_stream.py --fractions none,0.7,0.5,0.3 --json /tmp/stream.json

The model is the benchmark model of tools/bench_model.py with GLM-5's expert count (256 routed experts, top-8),
its router bias drawn with a small spread so that tokens route to experts of their own (as a trained router's
do), converted at q4. Each run is a child process in a fresh memory cgroup (v1 or v2) whose limit is a fraction of the
container's bytes (its own memory and the page cache it reads are both charged to it), started cold (every
container file dropped from the page cache first): a 256-token prompt, then 64 greedy tokens (MTP off).
Modes: `page` (`--device auto --expert-cache off`: the page cache as the expert cache, the device decode step on
the mapping), `cache` (`--device auto --expert-cache auto`, glm-run's default where the model outgrows the limit:
the device decode step on the cache's slots), `numpy` (`--device numpy --expert-cache off`), `base` (the
`page` run of the glmkit in `--baseline-tree`, e.g. a git worktree of an older commit: a baseline in the same run;
any mode suffixed `@base`, e.g. `cache@base`, runs that mode with that glmkit),
and a GPU smaller than the model: `split` and `split-cache` (PoCL's CPU device driven as a discrete GPU holding
GPU_SHARE of the container, the split step's CPU side beside it on PoCL reading the other routed experts from the
mapping, or from an expert cache sized as glm-run sizes it beside a GPU, less the stand-in's buffers, which lie in
this machine's RAM).
Printed per run: decode tok/s, TTFT, bytes read from disk per decoded token (the child's /proc/self/io), the
expert hit rate, read-ahead recall, the cgroup's peak memory, and the I/O bounds: the expert bytes missed per
decoded token (and the prompt's expert bytes, for the TTFT) over the disk bandwidth measured in the same run for
expert-sized reads, read as the cache reads them (O_DIRECT), the faster of 1 and 8 (its I/O threads) in flight.
`--disk-mbps N` also puts each child in a cgroup whose reads of the snapshot's disk are throttled to N MB/s (v1 blkio,
v2 io.max): the bounds then take at most N MB/s. `--rounds N` runs every fraction and mode N times in turn and ends
with the medians and ranges, each mode's speed taken against the `@base` run of the same mode in its round, else the
`base` run. `--max-context model` keeps room for the model's whole context's KV rows, as glm-run does by default
(default `run`: the run's own prompt and tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from glmkit.units import parse_size
from tools.bench_model import BENCH_CONFIG, DEFAULT_WORK, ensure_bench_snapshot

STREAM_CONFIG = {**BENCH_CONFIG, "n_routed_experts": 256, "n_group": 8, "topk_group": 4}
# a router bias spread small next to the sigmoid scores: tokens route to their own experts (a trained router's
# load balancing), not to the same few, so the experts a run touches outgrow the memory limits measured
ROUTER_BIAS_STD = 0.05
PROMPT, TOKENS, QUEUE_DEPTH = 256, 64, 8  # QUEUE_DEPTH: the expert cache's I/O threads
MTP_CHOICES = {"off": (False,), "on": (True,), "both": (False, True)}
GPU_SHARE = 0.25  # split modes: the stand-in GPU's weight budget, a share of the container


def ensure_stream_snapshot(work: Path, residual_write_scale: float = 1.0, grid: str = "nl") -> Path:
    """The 256-expert model at q4 under `work` (written and converted on first use); residual_write_scale: see
    `tools.synth.write_snapshot_streaming`; grid: glm-convert's `--grid`."""
    return ensure_bench_snapshot("q4", work, STREAM_CONFIG, ROUTER_BIAS_STD, residual_write_scale, grid)


def drop_from_page_cache(snapshot: Path) -> None:
    for path in snapshot.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_bandwidth(snapshot: Path, ranges: list[tuple[str, int, int]], depth: int) -> float:
    """GB/s of cold reads of these (file, offset, nbytes) ranges, `depth` in flight, read as the expert cache reads
    them (O_DIRECT of their whole pages where the file system takes it); counted in the ranges' bytes."""
    from glmkit.model.expert_cache import open_for_experts, page_span
    from glmkit.model.expert_stream import anonymous_bytes

    drop_from_page_cache(snapshot)
    fds = {name: open_for_experts(snapshot / name, direct=True) for name in {r[0] for r in ranges}}
    size, local = page_span(0, max(r[2] for r in ranges))[1] + 4096, threading.local()

    def read(r: tuple[str, int, int]) -> int:
        name, offset, nbytes = r
        fd, direct = fds[name]
        start, span = page_span(offset, nbytes) if direct else (offset, nbytes)
        if not hasattr(local, "buffer"):
            local.buffer = memoryview(anonymous_bytes(size))  # page-aligned, one per I/O thread
        return min(os.preadv(fd, [local.buffer[:span]], start), nbytes)

    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(depth) as pool:
            total = sum(pool.map(read, ranges))
        return total / (time.perf_counter() - start) / 1e9
    finally:
        for fd, _ in fds.values():
            os.close(fd)


def whole_disk(path: Path) -> str:
    """`MAJ:MIN` of the disk holding `path` (a partition's disk: read throttles take whole devices)."""
    dev = os.stat(path).st_dev
    sysdev = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not sysdev.exists():
        raise SystemExit(f"--disk-mbps: {path} lies on no block device (device {os.major(dev)}:{os.minor(dev)})")
    if (sysdev / "partition").exists():
        sysdev = sysdev.resolve().parent
    return (sysdev / "dev").read_text().strip()


def new_cgroups(limit: int | None, read_bps: int | None = None, disk: str = "", name: str | None = None,
                proc_cgroup: Path = Path("/proc/self/cgroup"), sysfs: Path = Path("/sys/fs/cgroup")) -> list[Path]:
    """Fresh cgroups `name` (default glmkit-stream-PID) below this process's whose processes hold at most `limit`
    bytes of memory and read disk `disk` (`MAJ:MIN`) at most `read_bps` bytes a second: v1, a memory group and a
    blkio group (`blkio.throttle.read_bps_device`); v2, one group (`memory.max`, `io.max`). None: no such limit;
    [] where neither is asked for. proc_cgroup, sysfs: where the kernel shows the process's cgroups and the tree."""
    if limit is None and read_bps is None:
        return []
    name = name or f"glmkit-stream-{os.getpid()}"
    lines = [line.split(":", 2) for line in proc_cgroup.read_text().splitlines()]
    unified = next((path for _, controllers, path in lines if controllers == ""), None)
    if unified is not None and (sysfs / "cgroup.controllers").exists():
        group = sysfs / unified.lstrip("/") / name
        group.mkdir(exist_ok=True)
        if limit is not None:
            (group / "memory.max").write_text(str(limit))
        if read_bps is not None:
            (group / "io.max").write_text(f"{disk} rbps={read_bps}")
        return [group]
    groups = []
    for controller, knob, value in (("memory", "memory.limit_in_bytes", limit),
                                    ("blkio", "blkio.throttle.read_bps_device", read_bps)):
        if value is None:
            continue
        path = next((path for _, controllers, path in lines if controller in controllers.split(",")), None)
        if path is None:
            raise SystemExit(f"no {controller} cgroup controller found")
        group = sysfs / controller / path.lstrip("/") / name
        group.mkdir(exist_ok=True)
        (group / knob).write_text(str(value) if controller == "memory" else f"{disk} {value}")
        groups.append(group)
    return groups


def peak_mb(group: Path) -> int | None:
    """The memory cgroup's peak use in MiB (its processes' memory and the page cache they read), where it tells."""
    knob = next((group / n for n in ("memory.max_usage_in_bytes", "memory.peak") if (group / n).exists()), None)
    return None if knob is None else int(knob.read_text()) >> 20


def run_child(snapshot: Path, mode: str, limit: int | None, timeout: float, cache: str = "auto",
              mtp: bool = False, prompt_file: Path | None = None, baseline_tree: Path | None = None,
              read_bps: int | None = None, prompt: int = PROMPT, prefill_chunk: int = 0,
              context: str = "run", max_alloc: int = 0) -> dict:
    groups = new_cgroups(limit, read_bps, whole_disk(snapshot) if read_bps else "")
    memory = next((g for g in groups if "blkio" not in g.parts), None)  # the group whose peak is the memory's
    drop_from_page_cache(snapshot)
    name, _, where = mode.partition("@")  # mode@base: that mode with the baseline tree's glmkit
    argv = [sys.executable, __file__, "--worker", str(snapshot), name, cache, str(int(mtp)), str(prompt_file or ""),
            str(prompt), str(prefill_chunk), context, str(max_alloc)]

    def enter() -> None:
        for group in groups:
            (group / "cgroup.procs").write_text(str(os.getpid()))

    env = {**os.environ, "OPENBLAS_NUM_THREADS": "2"}
    if mode == "base" or where == "base":
        if baseline_tree is None:
            raise SystemExit("mode base needs --baseline-tree")
        env["PYTHONPATH"] = str(baseline_tree.resolve())
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, preexec_fn=enter, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    finally:
        time.sleep(0.2 if groups else 0)
        peak = None if memory is None or limit is None else peak_mb(memory)
        for group in groups:
            group.rmdir()
    if done.returncode != 0:
        killed = f"killed by signal {-done.returncode} (over the memory limit?)" if done.returncode < 0 else "?"
        return {"error": (done.stderr.strip().splitlines() or [killed])[-1]}
    # the group's peak: the process's memory and the page cache it read, against the limit
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "peak_mb": peak}


def worker(snapshot: str, mode: str, cache: str, mtp: bool, prompt_file: str, prompt_len: int, prefill_chunk: int,
           context: str, max_alloc: int) -> dict:
    """One run in this process (the child `run_child` starts); prefill_chunk 0: the Generator's own (an older glmkit's
    `base` run imports nothing newer); max_alloc: the OpenCL device's largest buffer taken as at most this many bytes
    (0: as it says)."""
    import numpy as np

    from glmkit.backends.opencl import buffers
    from glmkit.generate.engine import Engine
    from glmkit.generate.generator import Generator
    from glmkit.generate.sampling import Sampler, SamplingParams

    def read_bytes() -> int:
        return int(next(line.split()[1] for line in Path("/proc/self/io").read_text().splitlines()
                        if line.startswith("read_bytes")))

    if max_alloc:  # a device with a smaller largest buffer: an expert cache's arena spans several, as GLM-5's does
        made = buffers.Buffers.__init__

        def capped(self, *args, **kwargs) -> None:
            made(self, *args, **kwargs)
            self.max_alloc = min(self.max_alloc, max_alloc)

        buffers.Buffers.__init__ = capped  # type: ignore[method-assign]
    start = time.perf_counter()
    if mode == "base":  # an older glmkit: only the arguments every version takes
        engine = Engine(snapshot, "auto", load_tokenizer=False)
    elif mode.startswith("split"):
        engine = split_engine(snapshot, mode == "split-cache")
    else:
        # the KV rows kept room for: this run's context (glm-run --max-context), or the model's whole one
        engine = Engine(snapshot, "numpy" if mode == "numpy" else "auto", load_tokenizer=False,
                        expert_cache=(cache if cache == "auto" else int(cache)) if mode == "cache" else 0,
                        max_context=prompt_len + TOKENS + 2 if context == "run" else None)
    stats_of = engine.expert_stats if hasattr(engine, "expert_stats") else getattr(engine.experts, "stats", None)
    if prompt_file:  # a JSON list of token ids, or of windows of them (glm-perplexity's): the first prompt_len ids
        ids = json.loads(Path(prompt_file).read_text())
        flat = [t for window in ids for t in window] if ids and isinstance(ids[0], list) else ids
        prompt = [int(t) for t in flat[:prompt_len]]
    else:
        prompt = np.random.default_rng(0).integers(0, engine.config.vocab_size, prompt_len).tolist()
    chunk = {"prefill_chunk": prefill_chunk} if prefill_chunk else {}
    gen = Generator(engine.model, eos_token_ids=(), use_mtp=mtp, **chunk)
    tokens, first = 0, 0.0
    before, began = read_bytes(), time.perf_counter()
    for _ in gen.generate(prompt, TOKENS + 1, Sampler(SamplingParams())):
        if tokens == 0:
            first = time.perf_counter()
            after_prefill, stats_at = read_bytes(), dict(stats_of.to_json() if stats_of else {})
        tokens += 1
    end = time.perf_counter()
    stats = stats_of.to_json() if stats_of else {}
    out = {"mode": mode, "open_s": round(began - start, 3), "ttft_s": round(first - began, 3),
           "decode_tok_s": round(TOKENS / (end - first), 2), "read_gb_total": round((read_bytes() - before) / 1e9, 3),
           "read_mb_per_token": round((read_bytes() - after_prefill) / TOKENS / 1e6, 3),
           "cache_reason": getattr(engine, "expert_cache_reason", ""), **stats}
    if mode in ("cache", "split-cache"):
        missed = stats["expert_bytes_read"] - stats_at["expert_bytes_read"]
        out["expert_mb_read_per_token"] = round(missed / TOKENS / 1e6, 3)
        mtp_missed = stats["expert_bytes_read_mtp"] - stats_at["expert_bytes_read_mtp"]
        out["mtp_layer_mb_read_per_token"] = round(mtp_missed / TOKENS / 1e6, 3)  # of them the MTP layer's
        out["prefill_expert_mb"] = round(stats_at["expert_bytes_read"] / 1e6, 1)
    if mtp:
        out["mtp_acceptance"] = gen.stats.mtp_acceptance
    if hasattr(engine, "close"):  # an older glmkit's Engine has no close
        engine.close()
    return out


def split_engine(snapshot: str, with_cache: bool):
    """The engine of the split modes: PoCL's CPU device as a discrete GPU with a weight budget of GPU_SHARE of the
    container, PoCL beside it for the routed experts over it (the split step), read from the mapping or (with_cache)
    from an expert cache of the routed experts only (`step_cache`, as glm-run has beside a GPU smaller than the
    model), sized from the RAM left once the stand-in's buffers are counted."""
    from glmkit.backends.opencl.backend import OpenCLBackend, Placement
    from glmkit.backends.opencl.device import list_devices
    from glmkit.backends.opencl.ops import Kernels
    from glmkit.generate.engine import Engine
    from glmkit.model.expert_cache import ExpertCache, auto_cache_bytes
    from glmkit.model.glm5 import GlmMoeDsaModel

    engine = Engine(snapshot, "numpy", load_tokenizer=False, expert_cache=0)
    cpu = next(d for d in list_devices() if d.kind == "cpu")
    container, budget = engine.container, int(engine.container.nbytes * GPU_SHARE)
    if with_cache:
        size = auto_cache_bytes(container, pinned=False)[0] - budget
        engine.step_cache = ExpertCache(container, size, pin_weights=False)
    backend = OpenCLBackend(Kernels(cpu, direct=False), Placement(spill_experts=True), budget=budget, unified=False,
                            model_bytes=container.nbytes, spill=OpenCLBackend(Kernels(cpu), Placement.all_cl(True)))
    engine.backend = backend
    engine.model = GlmMoeDsaModel(engine.config, engine.experts, backend, route_hook=engine.experts.on_route,
                                  step_experts=engine.step_cache)
    step = engine.model._decode_step()
    if step is None or step.spill is None:
        raise SystemExit("bench_stream: the split step does not bind")
    return engine


def summary(rows: list[dict]) -> list[str]:
    """Per fraction and mode over the rounds: the median and range of decode tok/s and TTFT; against `base` in the
    same round (the run just before or after it) the median and range of the speed ratio; for the cache mode the
    median shares of the decode and TTFT I/O bounds."""
    def spread(values: list[float], digits: int = 2) -> str:
        values = sorted(values)
        mid = statistics.median(values)
        return f"{mid:.{digits}f} ({values[0]:.{digits}f}-{values[-1]:.{digits}f})" if values else "-"

    ok = [r for r in rows if "error" not in r]
    lines = [f"summary over the rounds ({len(ok)} of {len(rows)} runs finished): median (range)"]
    keys = sorted({(r["fraction"], r["mode"], r["mtp"]) for r in ok}, key=lambda k: (k[0] != "none", k[0], k[1:]))
    for fraction, mode, mtp in keys:
        runs = [r for r in ok if (r["fraction"], r["mode"], r["mtp"]) == (fraction, mode, mtp)]
        line = (f"{fraction} {mode}{' mtp' if mtp else ''}: decode {spread([r['decode_tok_s'] for r in runs])} "
                f"tok/s, TTFT {spread([r['ttft_s'] for r in runs], 3)} s")
        against = f"{mode}@base" if any(r["mode"] == f"{mode}@base" for r in ok) else "base"
        base = {r["round"]: r["decode_tok_s"] for r in ok if (r["fraction"], r["mode"]) == (fraction, against)}
        ratios = [r["decode_tok_s"] / base[r["round"]] for r in runs if r["round"] in base and "base" not in mode]
        if ratios:
            line += f", {spread(ratios)}x {against} in its round"
        shares = [r["decode_tok_s"] / r["io_bound_tok_s"] for r in runs if r.get("io_bound_tok_s")]
        if shares and fraction != "none":
            line += f", {spread(shares)} of the decode I/O bound"
        ttft = [r["ttft_s"] / r["ttft_io_bound_s"] for r in runs if r.get("ttft_io_bound_s")]
        if ttft and fraction != "none":
            line += f", TTFT {spread(ttft)}x its I/O bound"
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        print(json.dumps(worker(argv[1], argv[2], argv[3], argv[4] == "1", argv[5], int(argv[6]), int(argv[7]),
                                argv[8], int(argv[9]))))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=DEFAULT_WORK.with_name("glmkit-stream-model"))
    p.add_argument("--fractions", default="none,0.7,0.5,0.3", help="memory limits as fractions of the container")
    p.add_argument("--modes", default="page,cache",
                   help="page, cache, numpy, base, split, split-cache, any of them @base (comma-separated)")
    p.add_argument("--baseline-tree", type=Path, help="base mode: the source tree whose glmkit it runs")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--snapshot", type=Path, help="a converted snapshot to run instead of the 256-expert model "
                                                 "(e.g. a q4 conversion of tests/fixtures/tiny-trained)")
    p.add_argument("--residual-write-scale", type=float, default=1.0,
                   help="build the 256-expert model with its residual writers scaled so (e.g. 0.02: each layer a "
                        "small change of the hidden state, as in a trained model; read-ahead then predicts)")
    p.add_argument("--grid", choices=("nl", "uniform"),
                   help="glm-convert's --grid for the 256-expert model (default: uniform where a base run is asked "
                        "for, since the code before the expert cache reads uniform int4 only; else nl, the default)")
    p.add_argument("--disk-mbps", type=float, help="each run reads the disk at most this many MB/s (a cgroup read "
                                                    "throttle: a slower disk than the machine's)")
    p.add_argument("--cache", default="auto", help="the cache mode's --expert-cache (bytes or auto)")
    p.add_argument("--mtp", default="off", help="off, on, or both (MTP speculative decoding)")
    p.add_argument("--prompt-tokens", type=Path,
                   help="a JSON list of token ids or of windows of them, the prompt's (default: random ids)")
    p.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens (default %(default)s)")
    p.add_argument("--prefill-chunk", type=int, default=0,
                   help="prompt tokens per forward asked for (default: glm-run's, 2,048; glm-serve's steps: 512)")
    p.add_argument("--max-context", choices=("run", "model"), default="run",
                   help="the context the cache mode keeps KV room for: the run's (default) or the model's whole one "
                        "(glm-run's default)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every fraction and mode this many times, in turn (a summary of medians follows)")
    p.add_argument("--max-alloc", type=parse_size, default=0,
                   help="take the OpenCL device's largest buffer as at most this size (e.g. 128M: the expert "
                        "cache's arena then spans several buffers, as GLM-5's does on any device)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    from glmkit.format.reader import Container

    grid = args.grid or ("uniform" if "base" in args.modes.split(",") else "nl")
    snapshot = args.snapshot or ensure_stream_snapshot(args.work, args.residual_write_scale, grid)
    container = Container(snapshot)
    size = container.nbytes
    ranges = [(r.file, r.offset, r.nbytes) for r in container.manifest.experts[::7]][:256]
    # the bound takes the faster of one read in flight (a decoded token's few misses) and the cache's full depth
    by_depth = {depth: disk_bandwidth(snapshot, ranges, depth) for depth in (1, QUEUE_DEPTH)}
    read_bps = None if args.disk_mbps is None else int(args.disk_mbps * 1e6)
    if read_bps is not None:  # the throttle caps what the disk gives (measured here unthrottled)
        by_depth = {depth: min(bw, read_bps / 1e9) for depth, bw in by_depth.items()}
    bandwidth = max(by_depth.values())
    print(f"container {size / 1e9:.2f} GB, expert reads "
          + ", ".join(f"{bw:.2f} GB/s at depth {depth}" for depth, bw in by_depth.items())
          + ("" if read_bps is None else f" (reads throttled to {args.disk_mbps:g} MB/s)"))
    rows = []
    for turn in range(args.rounds):
        for fraction in args.fractions.split(","):
            limit = None if fraction == "none" else int(float(fraction) * size)
            for mode, mtp in [(m, t) for m in args.modes.split(",") for t in MTP_CHOICES[args.mtp]]:
                row = {"round": turn, "fraction": fraction, "limit_mb": None if limit is None else limit >> 20,
                       "mtp": mtp, **run_child(snapshot, mode, limit, args.timeout, args.cache, mtp,
                                               args.prompt_tokens, args.baseline_tree, read_bps, args.prompt,
                                               args.prefill_chunk, args.max_context, args.max_alloc),
                       "mode": mode}
                if "expert_mb_read_per_token" in row and row["expert_mb_read_per_token"] > 0:
                    row["io_bound_tok_s"] = round(bandwidth * 1e3 / row["expert_mb_read_per_token"], 1)
                if "prefill_expert_mb" in row:  # the prompt's expert reads alone, at the measured bandwidth
                    row["ttft_io_bound_s"] = round(row["prefill_expert_mb"] / 1e3 / bandwidth, 3)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.rounds > 1:
        for line in summary(rows):
            print(line)
    if args.json:
        args.json.write_text(json.dumps({"bandwidth_gbs": by_depth, "container_bytes": size, "rows": rows},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
