"""Pipeline parallelism over Ray: the decoder layers split into contiguous stages, each a Ray actor (one process,
on whichever machine of the cluster Ray places it) that opens the container, runs only its layers with the
model's own layer code (`GlmMoeDsaModel.run_layers`) and holds their KV rows; the head process keeps the
embedding, the final norm, lm_head, the MTP layer (its KV rows too) and the sampler.

Where the device decodes on the device decode step (OpenCL), so does the pipeline: a decoded token runs on each stage
as one queued step over its layers (`GlmMoeDsaModel.step_layers`: the hidden state in, the hidden state out), and the
head's final norm and lm_head as a step of their own, the kernels of one process's step: the same logits.

A forward sends the embedded rows `[S, H]` (and the DSA selection a 'shared' layer reuses) from stage to stage.
With `hops="graph"` (the default where every stage decodes on the device step) a forward of one piece (a decoded
token, MTP's two rows, a short prompt) goes through one Ray compiled graph of the stages (`ray.dag`, built at the
first such forward): the head writes the rows into a shared-memory channel, each stage reads its input from the one
before and writes its output to the next, and the head reads the last; no task is submitted per token. Ray's
channels wait by polling (the stages and the head keep a core busy while the graph is built: where the stages
compute on the cores they share, that costs more than the cheaper hops save), so it is torn down after
`GRAPH_IDLE_S` without a forward and built again at the next. Otherwise (`hops="tasks"`, or a block of several
pieces) each stage's `run` is an actor task taking the previous one's result as an object reference, submitted at
once and waited for once. A block of more than `chunk` rows is cut at multiples of `chunk` positions and every piece
is submitted before any is awaited, so stage 2 runs piece 1 while stage 1 runs piece 2 (each actor runs its calls in
the order they were submitted; Ray 2.60's compiled graph loses results with several executions in flight, so a
prompt's pieces do not use it). The logits equal those of one process that prefills in pieces of `chunk` tokens.

Ray is an optional dependency (`pip install glmkit[distributed]`): it is imported here only, and only when a
pipeline is opened. A stage that dies raises a GlmkitError naming it and its machine, and the head starts it again:
every sequence begun before then has lost rows (`KVCache.lost`) and is never computed with again; a new one runs
at once (a Session restores its prompt from the prefix cache, through the new stage). A stage that cannot be
started again leaves the pipeline refusing every later call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import socket
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from threadpoolctl import threadpool_limits

from glmkit.errors import GlmkitError
from glmkit.format.config import ModelConfig
from glmkit.format.reader import Container
from glmkit.generate.engine import (
    Engine,
    asked_auto_cache,
    default_expert_cache,
    make_backend,
    model_over_expert_cache,
    model_over_page_cache,
)
from glmkit.model.compute import Backend, DecodeStep
from glmkit.model.expert_cache import (
    CacheStats,
    ExpertCache,
    routed_expert_bytes,
    saved_scores,
    usage_path,
)
from glmkit.model.expert_stream import ExpertStats, ExpertStreamer
from glmkit.model.glm5 import GlmMoeDsaModel, WeightSource, prefill_bytes
from glmkit.model.kv_cache import KVCache, decode_kv_rows, encode_kv_rows, kv_bytes_per_token
from glmkit.units import format_size

DEFAULT_PIPELINE_CHUNK = 256  # prompt tokens per piece streamed through the stages
STAGE_START_TIMEOUT_S = 120  # a stage not started by then cannot be placed (or cannot open the container)
STAGE_CLOSE_TIMEOUT_S = 10  # a stage that has not closed by then (its reads, its usage file) is ended all the same
INSTALL_HINT = 'pip install "glmkit[distributed]"'
# a compiled graph of shared-memory channels, an actor task per stage, or the graph where every stage decodes on its
# device step and tasks elsewhere (docs/BENCHMARKS.md, "Pipeline over Ray")
PIPELINE_HOPS = ("auto", "graph", "tasks")
GRAPH_IDLE_S = 2.0  # the compiled graph is torn down after this long without a forward (its waits poll)

StageMessage = tuple[int, np.ndarray, "np.ndarray | None", int]  # (cache id, rows [S, H], selection [S, K], start)


def import_ray() -> Any:
    """The `ray` module, or a one-line GlmkitError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise GlmkitError(f"--pipeline: needs Ray, which is not installed ({INSTALL_HINT})") from None
    return ray


# ---- the plan -------------------------------------------------------------------------------------------

def main_layer_nbytes(container: Container) -> list[int]:
    """Bytes of each main decoder layer's tensors in the container (routed experts and scales included): what the
    stages split."""
    return list(container.layer_nbytes[:container.config.num_hidden_layers])


def split_layers(sizes: Sequence[int], shares: Sequence[float]) -> list[range]:
    """Contiguous ranges of the layers whose bytes are `sizes`, one per share, each holding as close to its share of
    the bytes as the layer boundaries allow (cut where the running total is nearest each cumulative share) and at
    least one layer."""
    n, stages = len(sizes), len(shares)
    if stages < 1 or any(s <= 0 for s in shares):
        raise GlmkitError(f"--pipeline: needs at least one stage with a positive share, got {list(shares)}")
    if stages > n:
        raise GlmkitError(f"--pipeline {stages}: the model has only {n} decoder layers")
    running = np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.float64))])  # bytes before layer i
    targets = np.cumsum(shares) / float(sum(shares)) * running[-1]
    cuts = [0]
    for k in range(1, stages):
        lo, hi = cuts[-1] + 1, n - (stages - k)  # leave a layer for every stage still to come
        cuts.append(lo + int(np.argmin(np.abs(running[lo:hi + 1] - targets[k - 1]))))
    cuts.append(n)
    return [range(a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


@dataclass
class StagePlan:
    """Where each stage runs: its layers, their bytes, and (with `--pipeline auto`) the Ray node it is pinned to."""

    layers: list[range]
    nbytes: list[int]
    node_ids: list[str | None]
    node_memory: list[int | None]

    def describe(self, where: Sequence[str]) -> str:
        """The plan as lines: one per stage, with the machine it landed on."""
        lines = []
        for i, (layers, size) in enumerate(zip(self.layers, self.nbytes, strict=True)):
            memory = self.node_memory[i]
            room = f" of the node's {format_size(memory)} memory" if memory else ""
            lines.append(f"pipeline stage {i}: layers {layers.start}-{layers.stop - 1} ({format_size(size)}{room}) "
                         f"on {where[i]}")
        return "\n".join(lines)


def plan_stages(container: Container, stages: int | str, nodes: list[dict[str, Any]] | None = None) -> StagePlan:
    """The split of `container`'s layers: `stages` equal shares of the bytes, or "auto": one stage per alive node of
    `nodes` (Ray's `ray.nodes()` records), shared by each node's memory resource."""
    sizes = main_layer_nbytes(container)
    if stages == "auto":
        alive = [n for n in nodes or [] if n.get("Alive") and n.get("Resources", {}).get("memory", 0) > 0]
        if not alive:
            raise GlmkitError("--pipeline auto: the Ray cluster reports no alive node with memory")
        alive = alive[:len(sizes)]
        memory = [int(n["Resources"]["memory"]) for n in alive]
        ranges = split_layers(sizes, memory)
        ids: list[str | None] = [n["NodeID"] for n in alive]
        node_memory: list[int | None] = list(memory)
    else:
        assert isinstance(stages, int)
        ranges = split_layers(sizes, [1.0] * stages)
        ids, node_memory = [None] * stages, [None] * stages
    return StagePlan(ranges, [sum(sizes[r.start:r.stop]) for r in ranges], ids, node_memory)


def pipeline_stages(text: str) -> int | str:
    """`--pipeline`: a stage count (at least 1) or "auto"."""
    if text == "auto":
        return "auto"
    try:
        count = int(text)
    except ValueError:
        raise GlmkitError(f"--pipeline: a number of stages or 'auto', got {text!r}") from None
    if count < 1:
        raise GlmkitError(f"--pipeline: needs at least 1 stage, got {count}")
    return count


# ---- one stage (a Ray actor) ------------------------------------------------------------------------------

def stage_expert_cache(container: Container, layers: range, expert_cache: int | str | None, kv_dtype: str,
                       context: int, rows: int) -> tuple[int, str]:
    """Where a stage over `layers` keeps their routed experts, as a single process decides for the whole model
    (`--expert-cache`: None, the default: an expert cache where their part of the container outgrows the RAM this
    process may use; "auto": one sized from that RAM; a size; 0: the page cache), with the reason in one line: (the
    bytes of an expert cache, or 0 for the page cache; why). An auto-sized cache holds only their routed experts and
    other weights, and keeps room for their KV rows of `context` positions at `kv_dtype` (not lent to the cache) and
    for the temporaries of a forward of `rows` rows (the most the head sends at once: `prefill_bytes`)."""
    if not routed_expert_bytes(container, layers):
        return 0, "no routed experts in its layers"
    kv_bytes = kv_bytes_per_token(container.config, kv_dtype, layers) * context
    activations = prefill_bytes(container.config, rows)
    if expert_cache is None:
        return default_expert_cache(container, kv_bytes=kv_bytes, layers=layers, activations=activations)
    if expert_cache == "auto":
        return asked_auto_cache(container, f"pipeline stage over layers {layers.start}-{layers.stop - 1}",
                                kv_bytes=kv_bytes, layers=layers, activations=activations)
    size = int(expert_cache)
    return size, (f"expert cache {format_size(size)} (--expert-cache)" if size else
                  "routed experts in the page cache (--expert-cache off)")


class PipelineStage:
    """The decoder layers `layers` of the model in `snapshot`, with the KV rows of every sequence the head runs
    (`cache_id` -> a KVCache whose other layers stay empty). Run as a Ray actor; plain methods, plain arrays."""

    def __init__(self, snapshot: str, index: int, layers: range, device: str, float_activations: bool,
                 prefetch: bool, blas_threads: int | None = None, niceness: int = 0, kv_dtype: str = "f32",
                 decode_step: bool = True, expert_cache: int | str | None = None, context: int | None = None,
                 chunk: int = DEFAULT_PIPELINE_CHUNK, usage_dir: str | None = None) -> None:
        """blas_threads: BLAS threads (None: the CPUs this process may use, as in a process of its own; Ray starts an
        actor of one CPU with OMP_NUM_THREADS=1, and the thread count changes the float sums' order). niceness: the
        scheduling priority to run at, the head's (Ray starts its workers at 15, behind any other work on the
        machine); kept at Ray's where the process may not raise its priority (`RAY_worker_niceness=0 ray start`
        then does it for every worker). kv_dtype: the precision its KV rows are kept at (`KV_DTYPES`). decode_step:
        a decoded token runs as the device's decode step over the stage's layers where the device has one (off: through
        the operations). expert_cache, context: where its layers' routed experts live (`stage_expert_cache`, for
        forwards of at most `chunk` rows: the head's pieces). usage_dir: where an expert cache keeps its usage scores
        on this stage's machine (a file for its layers, `usage_path`; it starts from the whole model's file there
        where it has none of its own; None: neither read nor saved)."""
        self.index, self.layer_range, self.niceness = index, layers, niceness
        threadpool_limits(blas_threads or len(os.sched_getaffinity(0)), user_api="blas")
        self._take_priority()
        container = Container(snapshot)
        backend, self.device = make_backend(device, container, not float_activations)
        backend.release_memory()  # a device profile measured just now leaves freed memory the cache is sized after
        size, self.experts_where = stage_expert_cache(container, layers, expert_cache, kv_dtype,
                                                      context or container.config.max_position_embeddings, chunk)
        self.experts: ExpertStreamer | ExpertCache
        if size:
            usage = None if usage_dir is None else usage_path(Path(usage_dir), container.model_hash, layers)
            if usage is not None and not usage.exists():  # no scores of its own yet: the whole model's, if any
                scores = saved_scores(usage_path(Path(usage_dir), container.model_hash), container)
            else:
                scores = saved_scores(usage, container)
            cache = self.experts = ExpertCache(container, size, readahead=prefetch, usage_file=usage, scores=scores,
                                               layers=layers)
            self.model = model_over_expert_cache(container.config, cache, backend, kv_dtype)
        else:  # the page cache, as a single process's
            self.experts, self.model = model_over_page_cache(container, container.config, backend, kv_dtype,
                                                             prefetch, layers=layers)
        self.caches: dict[int, KVCache] = {}
        self.steps = decode_step and self.model.part_step(layers, False) is not None  # built here, not at a token
        self.busy_s = 0.0  # seconds spent in `run`: the compute a pipeline's hops are compared with

    def describe(self) -> dict[str, Any]:
        """Where this stage runs: host name, IP address, process id, device, numerics, whether a decoded token runs
        as one device step, where its routed experts live and why (`stage_expert_cache`)."""
        import ray

        return {"host": socket.gethostname(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "device": self.device, "numerics": self.model.numerics, "decode_step": self.steps,
                "experts": self.experts_where}

    def _take_priority(self) -> None:
        """The calling thread at `niceness` (Linux keeps a priority per thread: the compiled graph's loop runs on a
        thread of Ray's, started at the worker's 15)."""
        with contextlib.suppress(PermissionError):
            if os.getpriority(os.PRIO_PROCESS, 0) != self.niceness:
                os.setpriority(os.PRIO_PROCESS, 0, self.niceness)

    def _cache(self, cache_id: int) -> KVCache:
        cache = self.caches.get(cache_id)
        if cache is None:
            cache = self.caches[cache_id] = self.model.new_cache()
        return cache

    def run(self, cache_id: int, carried: tuple[np.ndarray, np.ndarray | None], start: int
            ) -> tuple[np.ndarray, np.ndarray | None]:
        """This stage's layers on the rows `carried[0] [S, H]` of the tokens appended at `start..`, `carried[1]` the
        DSA selection `[S, K]` the layer before them chose (or None). Returns the same pair after the last layer."""
        began = time.perf_counter()
        self._take_priority()
        x, chosen = carried
        cache = self._cache(cache_id)
        held = cache.layer(self.layer_range.start).length
        if held != start:  # never compute against rows that are not the ones the head counts on
            raise GlmkitError(f"pipeline stage {self.index}: holds {held} KV rows, asked to append at {start}")
        stepped = self.model.step_layers(self.layer_range, x, cache, chosen) if \
            self.steps and len(x) == 1 and start > 0 else None
        out = stepped if stepped is not None else \
            self.model.run_layers(self.layer_range, x, np.arange(start, start + len(x)), cache, chosen)
        if len(x) > self.model.absorb_max_rows:
            self.model.backend.release_memory()
        self.busy_s += time.perf_counter() - began
        return out

    def forward(self, message: StageMessage) -> StageMessage:
        """`run` as a node of the compiled graph: (cache id, rows `[S, H]`, selection `[S, K]` or None, start) in,
        the same after this stage's layers out."""
        cache_id, x, chosen, start = message
        x, chosen = self.run(cache_id, (x, chosen), start)
        return cache_id, x, chosen, start

    def truncate(self, cache_id: int, n: int) -> None:
        self._cache(cache_id).truncate(n)

    def reserve(self, cache_id: int, rows: int) -> None:
        cache = self._cache(cache_id)
        for layer in self.layer_range:
            cache.layer(layer).reserve(rows)

    def fit(self, cache_id: int, rows: int) -> None:
        cache = self._cache(cache_id)
        for layer in self.layer_range:
            cache.layer(layer).fit(rows)

    def drop(self, cache_id: int) -> None:
        self.caches.pop(cache_id, None)

    def encoded(self, cache_id: int, layer: int) -> dict[str, tuple[np.ndarray, np.ndarray | None]]:
        """Every field of layer `layer`'s rows as stored (`LayerKV.encoded`: codes `[T, width]`, fp8 scales `[T]`)."""
        kv = self._cache(cache_id).layer(layer)
        names = ("kv_lat", "k_rot", "index_k") if kv.has_index else ("kv_lat", "k_rot")
        return {name: kv.encoded(name, 0, kv.length) for name in names}

    def append_encoded(self, cache_id: int, layer: int, fields: dict[str, tuple[np.ndarray, np.ndarray | None]]
                       ) -> None:
        self._cache(cache_id).layer(layer).append_encoded(fields)

    def close(self) -> None:
        """Let an expert cache finish its reads and save its usage scores (the head calls it before ending the
        actor)."""
        if isinstance(self.experts, ExpertCache):
            self.experts.close()

    def expert_stats(self) -> tuple[str, dict[str, Any]]:
        """("cache", the expert cache's counters) or ("stream", the page cache's): `StageExpertStats` sums them."""
        stats = self.experts.stats
        counters = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats) if f.name != "usage"}
        return ("cache" if isinstance(stats, CacheStats) else "stream"), counters

    def echo(self, carried: Any) -> Any:
        """The argument back (measures a hop's cost without compute: tools/bench_pipeline.py)."""
        return carried


# ---- the head's handle on the stages ----------------------------------------------------------------------

class Pipeline:
    """The stage actors in order, their plan, and the calls the head makes on them."""

    def __init__(self, ray: Any, actors: list[Any], plan: StagePlan, where: list[dict[str, Any]], chunk: int,
                 start_stage: Callable[[int], Any] | None = None, hops: str = "graph") -> None:
        """start_stage(i): a new actor for stage i (None: a dead stage is not started again). hops: how a forward
        goes through the stages, "graph" or "tasks" (module docstring)."""
        self.ray, self.actors, self.plan, self.where, self.chunk = ray, actors, plan, where, chunk
        self.start_stage, self.hops = start_stage, hops
        self.broken: str | None = None  # the error that broke the pipeline: every later call raises it again
        self.epoch = 0  # counts restarts: a sequence begun in an earlier epoch has lost rows
        self._pending: list[Any] = []  # refs of calls whose failure must surface at the next wait
        self._next_cache = 0
        self._graph: Any = None  # the compiled graph of the stages' `forward`, while one is built
        self._graph_lock = threading.Lock()  # held by a forward through the graph and by its teardown
        self._last_forward = 0.0  # time.monotonic() at the end of the last forward through the graph

    @property
    def layers(self) -> list[range]:
        return self.plan.layers

    def stage_name(self, i: int) -> str:
        w, layers = self.where[i], self.plan.layers[i]
        return f"pipeline stage {i} (layers {layers.start}-{layers.stop - 1}, {w['host']} {w['ip']} pid {w['pid']})"

    def stage_of(self, layer: int) -> int:
        return next(i for i, r in enumerate(self.plan.layers) if layer in r)

    def new_cache_id(self) -> int:
        self._next_cache += 1
        return self._next_cache

    def send(self, stage: int, method: str, *args: Any) -> None:
        """Call `method` on stage `stage` without waiting (in order with its other calls; a failure surfaces at the
        next `wait`)."""
        self._check()
        self._pending.append(getattr(self.actors[stage], method).remote(*args))

    def send_all(self, method: str, *args: Any) -> None:
        for stage in range(len(self.actors)):
            self.send(stage, method, *args)

    def call(self, stage: int, method: str, *args: Any) -> Any:
        """Call `method` on stage `stage` and wait for its result."""
        self._check()
        return self.wait([getattr(self.actors[stage], method).remote(*args)])[0]

    def run(self, cache_id: int, x: np.ndarray, start: int) -> np.ndarray:
        """Every stage's layers on `x [S, H]` appended at `start..` of sequence `cache_id`: the last layer's output
        `[S, H]`. Pieces end at multiples of `chunk` positions, all in flight at once."""
        self._check()
        ends = list(range((start // self.chunk + 1) * self.chunk, start + len(x), self.chunk)) + [start + len(x)]
        if self.hops == "graph" and len(ends) == 1:
            done = [self._graph_forward(cache_id, x, start)]
        else:
            outputs, lo = [], start
            for hi in ends:
                carried: Any = (x[lo - start:hi - start], None)
                for actor in self.actors:
                    carried = actor.run.remote(cache_id, carried, lo)
                outputs.append(carried)
                lo = hi
            done = self.wait(outputs)
        return done[0][0] if len(done) == 1 else np.concatenate([rows for rows, _ in done])

    def _graph_forward(self, cache_id: int, x: np.ndarray, start: int) -> tuple[np.ndarray, np.ndarray | None]:
        """`run` of one piece through the compiled graph: (rows, selection) after the last stage."""
        if self._pending:  # the calls sent before first: the graph's loop and the stage's other calls run apart
            self.wait([])
        with self._graph_lock:
            try:
                graph = self._graph or self._build_graph()
                _, rows, chosen, _ = graph.execute((cache_id, x, None, start)).get(timeout=-1)
            except self.ray.exceptions.RayError as e:
                self._drop_graph()  # a stage failed or died: the graph is not used again
                self._failed(e)
            self._last_forward = time.monotonic()
        return rows, chosen

    def _build_graph(self) -> Any:
        """Compile the stages' `forward` calls into one graph (input: a `StageMessage`; output: the last stage's) and
        start the thread that tears it down once idle."""
        from ray.dag import InputNode

        with InputNode() as message:
            node = message
            for actor in self.actors:
                node = actor.forward.bind(node)
        self._graph = node.experimental_compile(_submit_timeout=-1)
        self._last_forward = time.monotonic()
        threading.Thread(target=self._release_idle_graph, args=(self._graph,), name="glmkit-pipeline-graph",
                         daemon=True).start()
        return self._graph

    def _release_idle_graph(self, graph: Any) -> None:
        """Tear `graph` down once no forward has gone through it for `GRAPH_IDLE_S` (its waiting stages poll)."""
        while True:
            time.sleep(max(self._last_forward + GRAPH_IDLE_S - time.monotonic(), 0.05))
            with self._graph_lock:
                if self._graph is not graph:
                    return  # torn down or replaced meanwhile
                if time.monotonic() - self._last_forward >= GRAPH_IDLE_S:
                    self._drop_graph()
                    return

    def release_graph(self) -> None:
        """Tear the compiled graph down now (the next forward builds it again)."""
        with self._graph_lock:
            self._drop_graph()

    def _drop_graph(self) -> None:
        graph, self._graph = self._graph, None
        if graph is not None:
            with contextlib.suppress(Exception):  # a stage already gone: nothing left to tear down there
                graph.teardown()

    def wait(self, refs: list[Any]) -> list[Any]:
        """The results of `refs` (after every call sent before them); a stage's death or error becomes a
        GlmkitError naming the stage, and breaks the pipeline."""
        pending, self._pending = self._pending, []
        try:
            return self.ray.get(pending + refs)[len(pending):]
        except self.ray.exceptions.RayError as e:
            self._failed(e)

    def _failed(self, e: Exception) -> NoReturn:
        """Raise the GlmkitError of a stage's error `e` (breaking the pipeline); a stage that died (its actor gone, or
        the compiled graph's channel closed with it) is started again first."""
        ray = self.ray
        if isinstance(e, ray.exceptions.RayActorError | ray.exceptions.RayChannelError):
            message = f"{self._dead_stage(e)} died (its process or machine is gone: {type(e).__name__})"
            self.broken = f"{message}; its KV rows are lost"
            try:
                self.restart()
            except GlmkitError:
                pass  # raised below as it broke the pipeline
            else:
                raise GlmkitError(f"{message}; started again: the sequences it ran lost their KV rows, new ones run "
                                  "(a prompt restores from the prefix cache)") from None
        elif isinstance(e, ray.exceptions.RayTaskError):
            cause = e.cause if isinstance(e.cause, Exception) else e
            # the worker's pid: an attribute of a plain RayTaskError, in the message of one also of its cause's type
            found = re.search(r"pid=(\d+)", str(e))
            pid = getattr(e, "pid", None) or (int(found.group(1)) if found else None)
            stage = next((self.stage_name(i) for i, w in enumerate(self.where) if w.get("pid") == pid),
                         "a pipeline stage")
            self.broken = f"{stage} failed: {type(cause).__name__}: {_first_line(cause)}"
        else:
            raise e
        raise GlmkitError(self.broken)

    def check_epoch(self, epoch: int) -> None:
        """GlmkitError where a sequence begun in `epoch` has lost rows (before any call would use them)."""
        if epoch != self.epoch:
            raise GlmkitError("--pipeline: a stage was started again since this sequence began; its KV rows are "
                              "lost: start the sequence again")

    def restart(self) -> None:
        """Start every stage that does not answer again (its layers, empty KV rows) and begin a new epoch: the
        sequences of earlier epochs are never computed with again. GlmkitError where a stage cannot be started."""
        if self.start_stage is None:
            raise GlmkitError("--pipeline: no way to start a stage again")
        self._drop_graph()  # compiled over the old actors: the next forward compiles one over the new
        for i, actor in enumerate(self.actors):
            try:
                self.ray.get(actor.describe.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - any failure to answer: start it again
                with contextlib.suppress(Exception):
                    self.ray.kill(actor, no_restart=True)
                self.actors[i] = self.start_stage(i)
                try:
                    self.where[i] = self.ray.get(self.actors[i].describe.remote(), timeout=STAGE_START_TIMEOUT_S)
                except Exception as e:  # noqa: BLE001 - a stage that cannot start leaves the pipeline broken
                    raise GlmkitError(f"{self.stage_name(i)}: could not be started again ({_first_line(e)})"
                                      ) from None
        self.epoch += 1
        self.broken = None

    def _dead_stage(self, error: Exception) -> str:
        """The name of the stage whose actor `error` is about, else of the first stage that does not answer."""
        actor_id = getattr(error, "actor_id", None)
        for i, actor in enumerate(self.actors):
            if actor_id is not None and actor._actor_id.hex() == actor_id:
                return self.stage_name(i)
        for i, actor in enumerate(self.actors):
            try:
                self.ray.get(actor.describe.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - any failure to answer marks the stage
                return self.stage_name(i)
        return "a pipeline stage"

    def _check(self) -> None:
        if self.broken is not None:
            raise GlmkitError(self.broken)

    def expert_stats(self) -> CacheStats | ExpertStats:
        """The stages' expert counters, summed: an expert cache's where any stage has one (a page-cached stage adds
        its hits and misses), else the page cache's."""
        cached, streamed, any_cached = CacheStats(), ExpertStats(), False
        for i in range(len(self.actors)):
            kind, counters = self.call(i, "expert_stats")
            total = cached if kind == "cache" else streamed
            any_cached |= kind == "cache"
            for name, value in counters.items():
                setattr(total, name, getattr(total, name) + value)
        if not any_cached:
            return streamed
        cached.hits, cached.misses = cached.hits + streamed.hits, cached.misses + streamed.misses
        return cached

    def close(self) -> None:
        """Tear down the compiled graph and end the stage actors (their processes and KV rows), each told to close
        first (an expert cache saves its usage scores) where it answers within STAGE_CLOSE_TIMEOUT_S."""
        self.release_graph()
        with contextlib.suppress(Exception):  # a dead or stuck stage is ended all the same
            self.ray.get([actor.close.remote() for actor in self.actors], timeout=STAGE_CLOSE_TIMEOUT_S)
        for actor in self.actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []
        self.broken = self.broken or "the pipeline is closed"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def check_reachable(address: str | None, timeout_s: float = 10.0) -> None:
    """A `host:port` address must accept a TCP connection (Ray itself would retry an unreachable one for minutes)."""
    if address is None or address.count(":") != 1:
        return  # None, "auto", "ray://...": left to Ray
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        raise GlmkitError(f"--ray-address {address}: cannot reach a Ray cluster there ({e})") from None


def connect_ray(init: Callable[[], Any], address: str | None) -> None:
    """Run `init` (Ray's connection to the cluster at `address`) with file descriptor 2 sent to a temporary file: Ray's
    C++ client logs there, a line a second, while it retries a cluster that refuses it. Once connected, what it
    wrote goes on to stderr; a failure is one GlmkitError, saying when the cluster refused this process's
    authentication token."""
    with tempfile.TemporaryFile() as log:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            init()
            error = None
        except (ConnectionError, RuntimeError, ValueError) as e:
            error = e
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        written = log.read().decode(errors="replace")
    if error is None:
        sys.stderr.write(written)
        return
    token = os.environ.get("RAY_AUTH_MODE") == "token"
    if "InvalidAuthToken" in written or "Unauthenticated" in written:
        hint = ("; it refused this process's token (RAY_AUTH_TOKEN or ~/.ray/auth_token: the head's `ray "
                "get-auth-token`)" if token else "; it wants token authentication: set RAY_AUTH_MODE=token and its "
                "token (RAY_AUTH_TOKEN or ~/.ray/auth_token: the head's `ray get-auth-token`)")
    else:
        hint = "" if token else ("; a cluster with token authentication (`ray start`'s default) needs "
                                 "RAY_AUTH_MODE=token and its token")
    raise GlmkitError(f"--ray-address {address}: cannot connect to a Ray cluster ({_first_line(error)}{hint})")


def open_pipeline(snapshot: str | Path, container: Container, stages: int | str, address: str | None = None,
                  device: str = "numpy", float_activations: bool = False, prefetch: bool = True,
                  chunk: int = DEFAULT_PIPELINE_CHUNK, verbose: bool = True, blas_threads: int | None = None,
                  kv_dtype: str = "f32", decode_step: bool = True, hops: str = "auto",
                  expert_cache: int | str | None = None, context: int | None = None,
                  usage_dir: Path | None = None) -> Pipeline:
    """Start one stage actor per range of the plan on the Ray cluster at `address` (None: the cluster `ray start`
    made on this machine, else a new local one; already connected: that one), wait until each has opened the
    container, and print the plan on stderr when `verbose`. blas_threads, kv_dtype, decode_step, expert_cache (each
    stage's, for its own layers and RAM), context, usage_dir (the same path on every machine): see
    `PipelineStage`; hops: one of `PIPELINE_HOPS` ("auto": "graph" where every stage decodes on the device step, else
    "tasks"; see `Pipeline`)."""
    ray = import_ray()
    if chunk < 1:
        raise GlmkitError(f"--pipeline-chunk: must be >= 1, got {chunk}")
    if hops not in PIPELINE_HOPS:
        raise GlmkitError(f"--pipeline-hops: one of {', '.join(PIPELINE_HOPS)}, got {hops!r}")
    if not ray.is_initialized():
        check_reachable(address)
        connect_ray(lambda: ray.init(address=address, logging_level="warning", log_to_driver=False), address)
    plan = plan_stages(container, stages, ray.nodes() if stages == "auto" else None)
    # the stages import the same glmkit as the head (a source checkout or an installed package on every machine)
    package_root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
    remote = ray.remote(PipelineStage)

    def start_stage(i: int) -> Any:
        options: dict[str, Any] = {"num_cpus": 1, "max_restarts": 0, "runtime_env": {"env_vars": {"PYTHONPATH": path}}}
        node = plan.node_ids[i]
        if node is not None:  # where the plan put it (a restart on another node would not have its memory)
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        else:
            options["scheduling_strategy"] = "SPREAD"
        return remote.options(**options).remote(str(snapshot), i, plan.layers[i], device, float_activations, prefetch,
                                                 blas_threads, os.getpriority(os.PRIO_PROCESS, 0), kv_dtype,
                                                 decode_step, expert_cache, context, chunk,
                                                 None if usage_dir is None else str(usage_dir))

    actors = [start_stage(i) for i in range(len(plan.layers))]
    unknown = {"host": "?", "ip": "?", "pid": "?", "decode_step": False, "experts": "?"}  # until each describes itself
    pipeline = Pipeline(ray, actors, plan, [unknown] * len(actors), chunk, start_stage,
                        "tasks" if hops == "auto" else hops)
    try:
        pipeline.where = ray.get([actor.describe.remote() for actor in actors], timeout=STAGE_START_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        pipeline.close()
        raise GlmkitError(f"--pipeline: the {len(actors)} stages did not all start within {STAGE_START_TIMEOUT_S} s "
                          f"(each takes 1 CPU of the Ray cluster; it has {ray.available_resources().get('CPU', 0):g} "
                          "free)") from None
    except ray.exceptions.RayError as e:
        pipeline.close()
        raise GlmkitError(f"--pipeline: a stage failed to start ({_first_line(e)})") from None
    if hops == "auto" and all(w["decode_step"] for w in pipeline.where):
        pipeline.hops = "graph"
    if verbose:
        print(plan.describe([f"{w['host']} ({w['ip']}), {w['device']}{', decode step' if w['decode_step'] else ''}"
                             for w in pipeline.where]), file=sys.stderr)
        for i, w in enumerate(pipeline.where):
            print(f"pipeline stage {i}: {w['experts']}", file=sys.stderr)
        print(f"pipeline hops: {'a compiled graph' if pipeline.hops == 'graph' else 'actor tasks'}", file=sys.stderr)
    return pipeline


# ---- the head's model and KV cache ------------------------------------------------------------------------

class RemoteLayerKV:
    """A main layer's KV rows, held by the stage that runs the layer: its length is mirrored here (the head makes
    every change), its rows are fetched on demand (the prefix cache stores them) and appended remotely."""

    def __init__(self, pipeline: Pipeline, cache_id: int, layer: int, has_index: bool, dtype: str) -> None:
        self.pipeline, self.cache_id, self.layer, self.has_index = pipeline, cache_id, layer, has_index
        self.dtype, self.epoch = dtype, pipeline.epoch
        self.stage = pipeline.stage_of(layer)
        self.length = 0
        # the rows last fetched as stored (codes, fp8 scales), until the rows change
        self._fetched: dict[str, tuple[np.ndarray, np.ndarray | None]] | None = None

    def encoded(self, name: str, start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Copies of the stored codes `[n, width]` and (fp8) scales `[n]` of rows [start, stop) of field `name`,
        fetched from the stage."""
        if self._fetched is None:
            self.pipeline.check_epoch(self.epoch)
            self._fetched = self.pipeline.call(self.stage, "encoded", self.cache_id, self.layer)
        codes, scales = self._fetched[name]
        return codes[start:stop].copy(), None if scales is None else scales[start:stop].copy()

    def rows(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) (default: all `length`) of field `name` as float32 `[n, width]`."""
        return decode_kv_rows(*self.encoded(name, start, self.length if stop is None else min(stop, self.length)))

    def grow(self, n: int) -> None:
        """Count `n` rows the stage appended."""
        self.length += n
        self._fetched = None

    def append(self, **rows: np.ndarray) -> None:
        """Append float32 rows `[n, width]` (stored at the layer's dtype, on the stage)."""
        self.append_encoded({name: encode_kv_rows(self.dtype, r) for name, r in rows.items()})

    def append_encoded(self, fields: dict[str, tuple[np.ndarray, np.ndarray | None]]) -> None:
        """Append rows already at the layer's dtype (`LayerKV.append_encoded`)."""
        self.pipeline.check_epoch(self.epoch)
        self.pipeline.send(self.stage, "append_encoded", self.cache_id, self.layer, fields)
        self.grow(len(next(iter(fields.values()))[0]))

    def overwrite(self, positions: np.ndarray, **rows: np.ndarray) -> None:
        raise GlmkitError("--pipeline: rows cannot be rewritten in place (approximate reuse is not supported)")

    def truncate(self, n: int) -> None:
        if n < self.length:
            self.length = max(n, 0)
            self._fetched = None


class PipelineCache(KVCache):
    """The KV cache of one sequence run through a pipeline: the MTP layer's rows here, every main layer's on its
    stage (`RemoteLayerKV`); dropped on the stages when this object is collected."""

    def __init__(self, config: ModelConfig, index_layers: list[int], pipeline: Pipeline, dtype: str = "f32") -> None:
        super().__init__(config, [i for i in index_layers if i >= config.num_hidden_layers], dtype)
        self.pipeline = pipeline
        self.cache_id = pipeline.new_cache_id()
        self.epoch = pipeline.epoch
        for i in range(config.num_hidden_layers):
            remote = RemoteLayerKV(pipeline, self.cache_id, i, i in index_layers, dtype)
            self.layers[i] = remote  # type: ignore[call-overload]
        finalizer = weakref.finalize(self, _drop_remote, pipeline, self.cache_id)
        finalizer.atexit = False

    @property
    def lost(self) -> bool:
        """A stage restarted since this sequence began: its rows there are gone."""
        return self.epoch != self.pipeline.epoch

    def check_held(self) -> None:
        self.pipeline.check_epoch(self.epoch)

    def advance(self, n: int) -> None:
        """Count `n` rows the stages appended to every main layer."""
        for layer in self.layers[:self.num_main_layers]:
            layer.grow(n)

    def reserve(self, rows: int) -> None:
        self.check_held()
        self.layers[self.num_main_layers].reserve(rows)
        self.pipeline.send_all("reserve", self.cache_id, rows)

    def fit(self, rows: int) -> None:
        self.check_held()
        self.layers[self.num_main_layers].fit(rows)
        self.pipeline.send_all("fit", self.cache_id, rows)

    def truncate(self, n: int) -> None:
        self.check_held()
        if any(layer.length > n for layer in self.layers[:self.num_main_layers]):
            self.pipeline.send_all("truncate", self.cache_id, n)
        for layer in self.layers:
            layer.truncate(n)


def _drop_remote(pipeline: Pipeline, cache_id: int) -> None:
    if pipeline.broken is None:
        try:
            pipeline.send_all("drop", cache_id)
        except Exception:  # noqa: BLE001 - the cluster is already gone at exit
            pass


class StagedDecodeStep:
    """A decoded token as device steps (`DecodeStep`'s single-token call): each stage's layers as one step on the
    stage (`PipelineStage.run`), then the final norm and lm_head as the head's step `head` (`part_step` over no
    layers). The kernels of one process's step: the same logits."""

    def __init__(self, model: PipelineModel, head: DecodeStep) -> None:
        self.model, self.head = model, head

    def __call__(self, token: int, cache: KVCache, embed: np.ndarray) -> tuple[np.ndarray, np.ndarray, list]:
        """Append `token` (embedding row `embed [H]`): (logits `[1, V]`, hidden `[1, H]` after the final norm, no
        routes: the stages' route hooks saw them)."""
        x = self.model.main_layers(embed[None], cache)
        return self.head(token, cache, x[0])

    def pipeline(self, token: int, cache: KVCache, embed_of: Callable[[int], np.ndarray], draws: Any = None,
                 on_routes: Any = None, constraint: Any = None) -> None:
        return None  # the next token's forward starts on the first stage: nothing to queue here ahead of the host

    def prompt(self, cache: KVCache, token_ids: Sequence[int], logits: bool = True) -> None:
        return None  # as `pipeline`: a short prompt's tokens run one `__call__` each

    def watch_routes(self, hook: Callable[[int, np.ndarray], None]) -> None:
        pass  # the experts are read on the stages

    def settle(self) -> None:
        self.head.settle()

    def drafts(self) -> bool:
        return False


class PipelineModel(GlmMoeDsaModel):
    """The head's model: embedding, final norm, lm_head and MTP run here; the main decoder layers on the stages.
    Where every stage decodes on its device step, so does a single-token forward (`StagedDecodeStep`); MTP's
    two-row verification runs through the operations. Its forwards take one sequence (no `decode_batch`)."""

    batches_sequences = False

    def __init__(self, config: ModelConfig, weights: WeightSource, backend: Backend, pipeline: Pipeline,
                 kv_dtype: str = "f32") -> None:
        super().__init__(config, weights, backend, kv_dtype=kv_dtype)
        self.pipeline = pipeline
        stage_numerics = sorted({w["numerics"] for w in pipeline.where})
        self._numerics = backend.numerics if stage_numerics == [backend.numerics] else \
            "pipeline:" + "|".join([backend.numerics, *stage_numerics])

    @property
    def numerics(self) -> str:
        """The head's numerics where every stage computes in the same, else all of them (the prefix cache key)."""
        return self._numerics

    def new_cache(self) -> PipelineCache:
        return PipelineCache(self.config, [s.index for s in self.layers if s.attention.indexer is not None],
                             self.pipeline, self.kv_dtype)

    def main_layers(self, x: np.ndarray, cache: KVCache) -> np.ndarray:
        if not isinstance(cache, PipelineCache) or cache.pipeline is not self.pipeline:
            raise GlmkitError("--pipeline: this KV cache is not one of the pipeline's (use model.new_cache())")
        cache.check_held()
        out = self.pipeline.run(cache.cache_id, x, cache.length)
        cache.advance(len(x))
        return out

    def _decode_step(self) -> DecodeStep | None:
        if self._step is False:
            head = self.part_step(range(0), True) if all(w["decode_step"] for w in self.pipeline.where) else None
            self._step = None if head is None else StagedDecodeStep(self, head)
        return self._step

    def _verify_step(self) -> DecodeStep | None:
        return None  # two rows run through the operations: the stages' steps take one


class StageExpertStats:
    """The routed-expert counters of `--stats-json` and glm-serve's /stats: the stages' (`Pipeline.expert_stats`;
    empty once the pipeline is broken)."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    def to_json(self) -> dict[str, Any]:
        return {} if self.pipeline.broken else self.pipeline.expert_stats().to_json()


class PipelineEngine(Engine):
    """An Engine whose model is a `PipelineModel` over stage actors (see `open_pipeline` for the arguments;
    `expert_cache` is each stage's, `stage_expert_cache`; `expert_usage_dir` where each stage's expert cache keeps
    its usage scores on its machine). The head maps the container too but reads only the
    embedding, the final norm, lm_head and the MTP layer: no routed expert is read ahead here."""

    def __init__(self, snapshot: str | Path, stages: int | str, address: str | None = None, device: str = "numpy",
                 float_activations: bool = False, prefetch: bool = True, chunk: int = DEFAULT_PIPELINE_CHUNK,
                 load_tokenizer: bool = True, verbose: bool = True, blas_threads: int | None = None,
                 kv_dtype: str = "f32", decode_step: bool = True, hops: str = "auto",
                 max_context: int | None = None, expert_cache: int | str | None = None,
                 expert_usage_dir: Path | None = None) -> None:
        super().__init__(snapshot, device, prefetch=False, load_tokenizer=load_tokenizer,
                         float_activations=float_activations, expert_cache=0, kv_dtype=kv_dtype,
                         max_context=max_context)
        self.pipeline = open_pipeline(snapshot, self.container, stages, address, device, float_activations, prefetch,
                                      chunk, verbose, blas_threads, kv_dtype, decode_step, hops, expert_cache,
                                      self.config.max_position_embeddings, expert_usage_dir)
        self.model = PipelineModel(self.config, self.experts, self.backend, self.pipeline, kv_dtype)
        self.experts.stats = StageExpertStats(self.pipeline)  # type: ignore[assignment]  # the head routes nothing

    def close(self) -> None:
        self.pipeline.close()
        super().close()
