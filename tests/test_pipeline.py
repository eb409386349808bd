"""Pipeline parallelism over Ray (glmkit.generate.pipeline): 2 and 3 stage processes of a local Ray cluster give the
logits and tokens of one process, through the compiled graph and through actor tasks, the prefix cache stores and
restores rows through the stages, a dead stage is a clear error, the compiled graph is torn down when idle and glm-run
leaves no process behind; the layer split and the `--pipeline` flags."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import ray
from threadpoolctl import threadpool_limits

from glmkit.cache.prefix_cache import PrefixCache
from glmkit.cache.session import Session
from glmkit.cli.run import main as run_main
from glmkit.cli.serve import build_app, build_parser
from glmkit.errors import GlmkitError
from glmkit.eval.metrics import kl_divergence, log_softmax
from glmkit.format.reader import Container
from glmkit.generate import pipeline as pipeline_module
from glmkit.generate.engine import Engine
from glmkit.generate.generator import Generator
from glmkit.generate.pipeline import (
    PipelineEngine,
    StagedDecodeStep,
    check_reachable,
    connect_ray,
    import_ray,
    main_layer_nbytes,
    plan_stages,
    split_layers,
)
from glmkit.generate.sampling import Sampler, SamplingParams
from glmkit.model.expert_cache import expert_slot_bytes, usage_path
from glmkit.model.glm5 import GlmMoeDsaModel
from glmkit.units import format_size
from tests.runtime_support import FIXTURES, Snapshots
from tests.test_serve import ServerThread, glm_run

CHUNK = 16  # pipeline pieces: a 70-token prompt is 5 pieces in flight at once
PROMPT = json.loads((FIXTURES / "tiny-trained" / "eval_tokens.json").read_text())[0][:70]  # > index_topk (32)
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster of the module's own, whatever cluster `ray start` may have made on this machine (10 logical
    CPUs: a stage takes one, 9 are alive at most)."""
    ray.init(address="local", num_cpus=10, object_store_memory=100 << 20, include_dashboard=False, log_to_driver=False,
             logging_level="warning")
    yield
    ray.shutdown()


@pytest.fixture(scope="module", autouse=True)
def blas_threads():
    """This process's BLAS at the thread count a stage takes by default (its machine's CPUs): the float sums of the
    single process then have the stages' order, whatever an earlier test set (the OpenCL backend sets one thread)."""
    with threadpool_limits(len(os.sched_getaffinity(0)), user_api="blas"):
        yield


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Snapshots(tmp_path_factory)("tiny-trained", "q4")


@pytest.fixture(scope="module")
def single(snapshot) -> Engine:
    return Engine(snapshot, load_tokenizer=False)


@pytest.fixture(scope="module")
def pipelines(cluster, snapshot):
    """(stages, hops) -> a PipelineEngine: 2 and 3 stages on the compiled graph, 2 on actor tasks."""
    engines = {(n, hops): PipelineEngine(snapshot, n, chunk=CHUNK, load_tokenizer=False, verbose=False, hops=hops)
               for n, hops in ((2, "graph"), (3, "graph"), (2, "tasks"))}
    yield engines
    for engine in engines.values():
        engine.close()


def forward_outputs(model: GlmMoeDsaModel, chunk: int) -> list[np.ndarray]:
    """Prefill PROMPT in pieces ending at multiples of `chunk`, then 3 single tokens and a two-token forward:
    (post-norm hidden of the prompt, the last prompt logits, every later forward's logits)."""
    cache = model.new_cache()
    hidden, lo = [], 0
    while lo < len(PROMPT):
        hi = min((lo // chunk + 1) * chunk, len(PROMPT))
        logits, h = model.forward(np.asarray(PROMPT[lo:hi]), cache, last_logits_only=True)
        hidden.append(h)
        lo = hi
    outputs = [np.concatenate(hidden), logits]
    for tokens in ([5], [17], [230], [40, 41]):
        outputs.append(model.forward(np.asarray(tokens), cache)[0])
    assert cache.length == len(PROMPT) + 5
    return outputs


def test_layers_split_contiguously_by_bytes():
    assert split_layers([10, 10, 10, 10], [1, 1]) == [range(0, 2), range(2, 4)]
    assert split_layers([10, 10, 10, 10], [3, 1]) == [range(0, 3), range(3, 4)]  # a node with 3x the memory
    assert split_layers([100, 1, 1, 1], [1, 1, 1]) == [range(0, 1), range(1, 2), range(2, 4)]  # a layer each at least
    assert split_layers([1, 1, 1, 100], [1, 1]) == [range(0, 3), range(3, 4)]
    with pytest.raises(GlmkitError, match="only 4 decoder layers"):
        split_layers([1, 1, 1, 1], [1] * 5)


def test_auto_plan_follows_each_node_memory(snapshot):
    from glmkit.format.reader import Container

    container = Container(snapshot)
    sizes = main_layer_nbytes(container)
    assert len(sizes) == 4 and all(s > 0 for s in sizes)
    assert sum(sizes) < container.nbytes  # embed, lm_head and the MTP layer stay out of the stages
    nodes = [{"NodeID": "a", "Alive": True, "Resources": {"memory": 3e9}},
             {"NodeID": "dead", "Alive": False, "Resources": {"memory": 1e12}},
             {"NodeID": "b", "Alive": True, "Resources": {"memory": 1e9}}]
    plan = plan_stages(container, "auto", nodes)
    assert plan.node_ids == ["a", "b"]
    assert plan.layers == split_layers(sizes, [3e9, 1e9])
    assert plan.layers[0].stop > 2  # the bigger node takes more than half the layers
    assert "pipeline stage 1: layers" in plan.describe(["x", "y"])
    with pytest.raises(GlmkitError, match="no alive node"):
        plan_stages(container, "auto", [])


@pytest.mark.parametrize(("stages", "hops"), [(2, "graph"), (3, "graph"), (2, "tasks")])
def test_logits_are_those_of_one_process(single, pipelines, stages, hops):
    pipeline = pipelines[stages, hops]
    pipeline.pipeline.release_graph()
    layers = pipeline.pipeline.layers
    assert layers == split_layers(main_layer_nbytes(single.container), [1] * stages)
    assert [r.start for r in layers[1:]] == ([2] if stages == 2 else [2, 3])
    assert single.config.indexer_type(2) == "shared"  # a hop carries the DSA selection layer 2 reuses
    assert pipeline.model.numerics == single.model.numerics  # the same rows: the prefix cache is shared
    reference = forward_outputs(single.model, CHUNK)
    # one forward of the whole prompt: the pipeline cuts it into the same pieces and streams them
    cache = pipeline.model.new_cache()
    logits, hidden = pipeline.model.forward(np.asarray(PROMPT), cache, last_logits_only=True)
    assert pipeline.pipeline._graph is None  # a prompt's pieces go as actor tasks, all in flight
    got = [hidden, logits] + [pipeline.model.forward(np.asarray(t), cache)[0] for t in ([5], [17], [230], [40, 41])]
    assert (pipeline.pipeline._graph is not None) == (hops == "graph")  # one piece: the way asked
    for ref, out in zip(reference, got, strict=True):
        assert ref.shape == out.shape and np.array_equal(ref, out)
    assert not np.array_equal(reference[2], reference[3])  # the compared logits are not all alike


@pytest.mark.parametrize("mtp", [False, True])
def test_greedy_output_is_identical(single, pipelines, mtp):
    reference = list(Generator(single.model, (), use_mtp=mtp).generate(PROMPT, 24, Sampler(GREEDY)))
    generator = Generator(pipelines[3, "graph"].model, (), use_mtp=mtp)
    assert list(generator.generate(PROMPT, 24, Sampler(GREEDY))) == reference
    assert (generator.stats.mtp_drafts > 0) == mtp


def decoded_logits(model: GlmMoeDsaModel, prompt: int, tokens: int) -> np.ndarray:
    """The logits `[tokens, V]` of PROMPT's tokens from `prompt` on, one forward each, after one forward of the first
    `prompt` tokens."""
    cache = model.new_cache()
    model.forward(np.asarray(PROMPT[:prompt]), cache)
    return np.concatenate([model.forward(np.asarray([t]), cache)[0] for t in PROMPT[prompt:prompt + tokens]])


@pytest.fixture
def restores_blas_threads():
    """The module's BLAS thread count back after the test (an OpenCL backend pins this process's to one thread)."""
    with threadpool_limits(len(os.sched_getaffinity(0)), user_api="blas"):
        yield


def test_stages_decode_on_the_device_step(cluster, snapshot, restores_blas_threads):
    """With OpenCL (PoCL), each stage runs a decoded token as one device step over its layers and the head the final
    norm and lm_head as one: the logits and greedy tokens of one process's step, bit for bit (the hop between the
    stages carries the selection layer 2 reuses); against the stages' per-operation path, int8-input noise as
    test_decode_step's (the step's products take int8 inputs, the operations' float ones)."""
    single = Engine(snapshot, "opencl", load_tokenizer=False)
    topk = single.config.index_topk
    want = decoded_logits(single.model, topk - 3, 10)  # the indexer starts selecting while decoding
    reference = list(Generator(single.model, (), use_mtp=False).generate(PROMPT[:40], 16, Sampler(GREEDY)))
    got = {}
    for step in (True, False):  # one pipeline at a time: the module's pipelines hold 7 of the cluster's 10 CPUs
        engine = PipelineEngine(snapshot, 2, device="opencl", load_tokenizer=False, verbose=False, decode_step=step)
        try:  # prompts in one piece, as the single process runs them
            model = engine.model
            assert model.decodes_on_device() == step and isinstance(model._decode_step(), StagedDecodeStep) == step
            assert [w["decode_step"] for w in engine.pipeline.where] == [step, step]
            assert engine.pipeline.hops == ("graph" if step else "tasks")  # the default, "auto"
            got[step] = decoded_logits(model, topk - 3, 10)
            if step:
                tokens = list(Generator(model, (), use_mtp=False).generate(PROMPT[:40], 16, Sampler(GREEDY)))
                assert tokens == reference
        finally:
            engine.close()
    assert np.array_equal(got[True], want)
    assert not np.array_equal(got[False], got[True])  # int8 inputs show: the stages did run the step
    assert kl_divergence(log_softmax(got[False]), log_softmax(got[True])).mean() < 0.01
    assert (got[False].argmax(-1) == got[True].argmax(-1)).mean() >= 0.95


def test_prefix_cache_stores_and_restores_through_the_stages(single, pipelines, tmp_path):
    model = pipelines[2, "graph"].model

    def cache() -> PrefixCache:
        return PrefixCache.for_model(model, single.model_hash, tmp_path, use_mtp=True, chunk_tokens=16)

    reference = list(Generator(single.model, (), use_mtp=True).generate(PROMPT, 12, Sampler(GREEDY)))
    first = Session(model, cache())
    kv = first.prepare(PROMPT)
    assert kv.length == 0
    out = list(Generator(model, (), use_mtp=True).generate(PROMPT, 12, Sampler(GREEDY), kv))
    first.commit(PROMPT, out)
    assert out == reference
    # a new session (another request, another process's cache object) restores the rows into the stages
    second = Session(model, cache())
    kv = second.prepare(PROMPT)
    restored = kv.length
    assert second.last_reuse.disk == restored >= 64  # 16-token chunks and the tail, now held by the stages
    generator = Generator(model, (), use_mtp=True)
    assert list(generator.generate(PROMPT, 12, Sampler(GREEDY), kv)) == reference
    assert generator.stats.cached_tokens == restored
    # the rows the stages sent to the cache are the single process's: it restores and continues identically
    local = Session(single.model, PrefixCache.for_model(single.model, single.model_hash, tmp_path, True, 16))
    kv = local.prepare(PROMPT)
    assert kv.length == restored
    assert list(Generator(single.model, (), use_mtp=True).generate(PROMPT, 12, Sampler(GREEDY), kv)) == reference


def test_rows_read_back_are_the_stages_current_ones(single, pipelines):
    """Rows fetched from the stages (what the prefix cache stores) follow truncation and new rows at the same
    length, and equal one process's."""
    model, ref = pipelines[2, "graph"].model, single.model
    caches = (model.new_cache(), ref.new_cache())
    for m, c in zip((model, ref), caches, strict=True):
        m.forward(np.asarray(PROMPT[:16]), c)
    before = caches[0].layer(3).rows("kv_lat")
    for m, c in zip((model, ref), caches, strict=True):
        c.truncate(10)
        m.forward(np.asarray(PROMPT[40:46]), c)  # other tokens, back to 16 rows
    for layer in range(single.config.num_hidden_layers):
        for name in ("kv_lat", "k_rot", "index_k") if caches[1].layer(layer).has_index else ("kv_lat", "k_rot"):
            assert np.array_equal(caches[0].layer(layer).rows(name), caches[1].layer(layer).rows(name))
    assert not np.array_equal(before, caches[0].layer(3).rows("kv_lat"))


@pytest.mark.parametrize("hops", ["graph", "tasks"])
def test_a_killed_stage_is_named_started_again_and_replayed_from_the_prefix_cache(cluster, snapshot, tmp_path, hops):
    engine = PipelineEngine(snapshot, 2, chunk=CHUNK, load_tokenizer=False, verbose=False, hops=hops)
    try:
        model, pipeline = engine.model, engine.pipeline
        cache = PrefixCache.for_model(model, engine.model_hash, tmp_path, use_mtp=True, chunk_tokens=16)
        session = Session(model, cache)
        reference = list(Generator(model, (), use_mtp=True).generate(PROMPT, 12, Sampler(GREEDY),
                                                                     session.prepare(PROMPT)))
        session.commit(PROMPT, reference)
        assert (pipeline._graph is not None) == (hops == "graph")  # killed while the graph is built over it
        killed = pipeline.where[1]["pid"]
        os.kill(killed, signal.SIGKILL)
        time.sleep(0.5)
        with pytest.raises(GlmkitError, match=r"pipeline stage 1 \(layers 2-3, .* pid \d+\) died .*; started again"):
            model.forward(np.asarray([7]), session.kv)
        assert pipeline.where[1]["pid"] != killed and session.kv.lost
        with pytest.raises(GlmkitError, match="KV rows are lost"):  # never computed with again
            model.forward(np.asarray([7]), session.kv)
        kv = session.prepare(PROMPT)  # the session starts over: the prompt's rows from the prefix cache
        assert session.last_reuse.process == 0 and session.last_reuse.exact == kv.length >= 64
        assert list(Generator(model, (), use_mtp=True).generate(PROMPT, 12, Sampler(GREEDY), kv)) == reference
        assert (pipeline._graph is not None) == (hops == "graph")  # built again, over the new stage
        # a stage that cannot be started again leaves the pipeline refusing every call
        pipeline.start_stage = None
        os.kill(pipeline.where[0]["pid"], signal.SIGKILL)
        time.sleep(0.5)
        with pytest.raises(GlmkitError, match=r"pipeline stage 0 \(layers 0-1, .*\) died .*; its KV rows are lost$"):
            model.forward(np.asarray([7]), model.new_cache())
        with pytest.raises(GlmkitError, match="pipeline stage 0"):
            model.forward(np.asarray([7]), model.new_cache())
    finally:
        engine.close()


@pytest.mark.parametrize("hops", ["graph", "tasks"])
def test_a_stage_never_computes_out_of_step(cluster, snapshot, hops):
    """A call whose position is not the end of the stage's rows is refused, named, and breaks the pipeline."""
    engine = PipelineEngine(snapshot, 1, load_tokenizer=False, verbose=False, hops=hops)
    try:
        pipeline = engine.pipeline
        x = engine.model.embed(np.asarray(PROMPT[:3]))
        with pytest.raises(GlmkitError, match=r"pipeline stage 0 \(layers 0-3, .*\) failed: GlmkitError: pipeline "
                                              r"stage 0: holds 0 KV rows, asked to append at 5"):
            pipeline.run(engine.model.new_cache().cache_id, x, 5)
        with pytest.raises(GlmkitError, match="holds 0 KV rows"):
            engine.model.forward(np.asarray(PROMPT[:3]), engine.model.new_cache())
    finally:
        engine.close()


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, every thread) process `pid` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_the_compiled_graph_is_torn_down_when_idle_and_built_again(single, pipelines, monkeypatch):
    """Ray's channels wait by polling: the graph goes once the pipeline idles (its stages then take no CPU), and the
    next forward builds it again and continues the sequence with one process's logits."""
    monkeypatch.setattr(pipeline_module, "GRAPH_IDLE_S", 0.5)
    engine = pipelines[2, "graph"]
    engine.pipeline.release_graph()
    caches = (engine.model.new_cache(), single.model.new_cache())
    for model, cache in zip((engine.model, single.model), caches, strict=True):
        model.forward(np.asarray(PROMPT[:CHUNK]), cache)  # one piece in both
    assert engine.pipeline._graph is not None
    time.sleep(1.5)  # past GRAPH_IDLE_S, and the teardown's own time
    assert engine.pipeline._graph is None
    pids = [w["pid"] for w in engine.pipeline.where]
    before = [cpu_seconds(pid) for pid in pids]
    time.sleep(1.0)
    idle = [cpu_seconds(pid) - b for pid, b in zip(pids, before, strict=True)]
    assert max(idle) < 0.1, idle  # a polling stage takes most of a core
    for token in PROMPT[CHUNK:CHUNK + 4]:
        got, want = (model.forward(np.asarray([token]), cache)[0] for model, cache in
                     zip((engine.model, single.model), caches, strict=True))
        assert np.array_equal(got, want)
    assert engine.pipeline._graph is not None


def test_glm_run_pipeline_leaves_no_process_behind(snapshot, tmp_path):
    """glm-run on a Ray cluster of its own: every process it started (Ray's, the stages) is gone soon after it exits.
    They are found by an environment variable only they inherit."""
    mark = f"{time.time_ns()}-{os.getpid()}"
    env = {**os.environ, "GLMKIT_TEST_TEARDOWN": mark, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

    def marked() -> set[int]:
        found = set()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and entry.name != str(os.getpid()):
                try:
                    if f"GLMKIT_TEST_TEARDOWN={mark}".encode() in (entry / "environ").read_bytes():
                        found.add(int(entry.name))
                except OSError:
                    pass  # gone meanwhile, or not ours to read
        return found

    run = subprocess.Popen([sys.executable, "-m", "glmkit.cli.run", str(snapshot), "--raw-prompt", "-p", "def f():",
                            "--max-tokens", "6", "--device", "numpy", "--cache-dir", str(tmp_path), "--pipeline", "2",
                            "--pipeline-hops", "graph", "--ray-address", "local"], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    seen: set[int] = set()
    while run.poll() is None:
        seen |= marked()
        time.sleep(0.2)
    out, err = run.communicate()
    assert run.returncode == 0 and len(out.strip()) > 3, err
    assert "pipeline stage 1: layers 2-3" in err and "pipeline hops: a compiled graph" in err
    assert len(seen - {run.pid}) >= 3  # Ray's processes and the two stages were seen
    deadline = time.monotonic() + 20
    while (left := marked()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, [Path(f"/proc/{pid}/cmdline").read_bytes()[:80] for pid in left]


def test_glm_run_pipeline_prints_the_single_process_reply(cluster, snapshot, capsys, tmp_path):
    argv = [str(snapshot), "--raw-prompt", "-p", "def __repr__(self):", "--max-tokens", "20", "--device", "numpy",
            "--cache-dir", str(tmp_path), "--kv-dtype", "fp8"]  # rows kept, fetched and restored as fp8 codes
    assert run_main(argv) == 0
    alone = capsys.readouterr().out
    assert run_main(argv + ["--pipeline", "2", "--pipeline-chunk", "4", "--stats-json", str(tmp_path / "s.json")]) == 0
    out, err = capsys.readouterr()
    assert out == alone and len(out.strip()) > 10
    assert "pipeline stage 0: layers 0-1" in err and "pipeline stage 1: layers 2-3" in err
    record = json.loads((tmp_path / "s.json").read_text())
    assert record["cached_tokens"] > 0  # the first run's prompt, restored into the stages
    assert record["expert_hits"] + record["expert_misses"] > 0  # counted by the stages, which run the experts
    # each stage's layers' experts in an expert cache of its own: 6 slots, fewer than a layer's 16 routed experts
    slots = 6 * expert_slot_bytes(Container(snapshot))
    assert run_main(argv + ["--pipeline", "2", "--expert-cache", str(slots), "--stats-json", str(tmp_path / "c.json")]
                    ) == 0
    out, err = capsys.readouterr()
    assert out == alone
    assert err.count(f"expert cache {format_size(slots)} (--expert-cache)") == 2  # said for each stage
    record = json.loads((tmp_path / "c.json").read_text())
    assert record["expert_misses"] > 0 and record["expert_bytes_read"] >= record["expert_misses"] * 20_000
    assert record["expert_evictions"] > 0  # the two stages' counters, summed as an expert cache's


def test_stages_keep_their_layers_experts_in_caches_of_their_own(cluster, snapshot, restores_blas_threads, tmp_path):
    """`expert_cache` with a pipeline: each stage keeps its own layers' routed experts in an expert cache (one
    layer's top-k and 2 more slots: nearly every layer misses, read-ahead on) and copies only its layers' other
    weights; the logits are the single process's on the mapping, bit for bit, on the device step (OpenCL) and through
    NumPy's operations. Each stage saves its layers' usage scores when the pipeline closes, and loads its hot set from
    them when it opens again."""
    for device in ("opencl", "numpy"):
        single = Engine(snapshot, device, load_tokenizer=False)
        topk, k = single.config.index_topk, single.config.num_experts_per_tok
        want = decoded_logits(single.model, topk - 3, 10)
        size = (k + 2) * expert_slot_bytes(single.container)
        usage = tmp_path / device
        for run in range(2):
            engine = PipelineEngine(snapshot, 2, device=device, load_tokenizer=False, verbose=False,
                                    expert_cache=size, expert_usage_dir=usage)
            try:
                assert [w["experts"] for w in engine.pipeline.where] == [f"expert cache {format_size(size)} "
                                                                         "(--expert-cache)"] * 2
                got = decoded_logits(engine.model, topk - 3, 10)
                stats = engine.expert_stats.to_json()
                layers = engine.pipeline.layers
            finally:
                engine.close()
            assert np.array_equal(got, want), device
            assert stats["expert_misses"] > stats["expert_hits"] > 0 and stats["readahead_reads"] > 0
            assert (stats["experts_preloaded"] > 0) == (run == 1)  # the first run's scores, read by the second
        for part in layers:  # one file per stage, holding its layers' scores only
            saved = json.loads(usage_path(usage, single.model_hash, part).read_text())["scores"]
            assert saved and {layer for layer, _, _ in saved} <= set(part)
        assert not usage_path(usage, single.model_hash).exists()


def test_glm_serve_pipeline_completes_as_glm_run(cluster, snapshot, capsys, tmp_path):
    expected = glm_run(capsys, snapshot, "def main():", 12, "--raw-prompt", "--device", "numpy")
    args = build_parser().parse_args([str(snapshot), "--pipeline", "2", "--device", "numpy",
                                      "--cache-dir", str(tmp_path)])
    server = ServerThread(build_app(args)).start()
    try:
        client = server.client(api_key="unused")
        for _ in range(2):  # the second request reuses the first one's rows, kept on the stages
            reply = client.completions.create(model=snapshot.name, prompt="def main():", max_tokens=12, temperature=0)
            assert reply.choices[0].text == expected and len(expected) > 5
    finally:
        server.stop()


def test_pipeline_flags_are_checked(snapshot, capsys, monkeypatch):
    assert run_main([str(snapshot), "-p", "x", "--pipeline", "2", "--reuse", "approximate"]) == 1
    assert "not with --pipeline" in capsys.readouterr().err
    assert run_main([str(snapshot), "-p", "x", "--pipeline", "2", "--ram-budget", "1G"]) == 1
    assert "--ram-budget: not with --pipeline" in capsys.readouterr().err
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(GlmkitError, match=f"--ray-address 127.0.0.1:{port}: cannot reach a Ray cluster"):
        check_reachable(f"127.0.0.1:{port}", timeout_s=2)
    monkeypatch.setitem(sys.modules, "ray", None)  # as if the distributed extra were not installed
    with pytest.raises(GlmkitError, match=r'pip install "glmkit\[distributed\]"'):
        import_ray()
    assert run_main([str(snapshot), "-p", "x", "--pipeline", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'needs Ray, which is not installed (pip install "glmkit[distributed]")' in err


def test_a_refused_connection_is_one_line_and_a_made_one_passes_ray_s_log_on(capfd, monkeypatch):
    """Ray's C++ client writes a warning a second to file descriptor 2 while a cluster refuses its token: none of it
    reaches the terminal, the error is one line saying what the cluster wanted; once connected, what Ray wrote is
    passed on."""
    def refused() -> None:
        for _ in range(3):
            os.write(2, b"[W gcs_client.cc:210] Unauthenticated: RPC error: InvalidAuthToken: token is missing\n")
        raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379\nmore")

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with pytest.raises(GlmkitError) as info:
        connect_ray(refused, "10.0.0.1:6379")
    assert str(info.value) == ("--ray-address 10.0.0.1:6379: cannot connect to a Ray cluster (Failed to connect to "
                               "Ray cluster at 10.0.0.1:6379; it wants token authentication: set RAY_AUTH_MODE=token "
                               "and its token (RAY_AUTH_TOKEN or ~/.ray/auth_token: the head's `ray get-auth-token`))")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    with pytest.raises(GlmkitError, match="it refused this process's token"):
        connect_ray(refused, "10.0.0.1:6379")
    assert capfd.readouterr().err == ""
    connect_ray(lambda: os.write(2, b"ray says hello\n"), None)
    assert capfd.readouterr().err == "ray says hello\n"


def test_a_stage_without_scores_of_its_own_starts_from_the_whole_models(snapshot, tmp_path):
    """A stage's expert cache (built here in this process, as Ray would in an actor) whose usage file is missing
    loads its hot set from the whole model's file on its machine: its own layers' experts only."""
    from glmkit.generate.pipeline import PipelineStage
    from glmkit.model.expert_cache import write_usage

    container = Container(snapshot)
    ranges = container.manifest.experts
    write_usage(usage_path(tmp_path, container.model_hash), container.model_hash,
                {(r.layer, r.expert): 1.0 + r.expert for r in ranges})
    stage = PipelineStage(str(snapshot), 0, range(0, 2), "numpy", False, True, expert_cache=4 * expert_slot_bytes(
        container), usage_dir=str(tmp_path))
    stage.experts.preloader.join()
    held = set(stage.experts._slot)
    assert held and {layer for layer, _ in held} == {1}  # layer 0 is dense; layers 2-3 are the other stage's
    assert stage.experts.stats.preloaded == len(held) == 4
    stage.close()
    assert usage_path(tmp_path, container.model_hash, range(0, 2)).exists()
