"""Prefix cache: exact reuse (logits and greedy tokens), and every way an entry can be bad."""

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from glmkit.cache.prefix_cache import BLOB_VERSION, MAGIC, PrefixCache, open_index
from glmkit.cache.session import Session
from glmkit.cli.convert import main as convert_main
from glmkit.generate.engine import Engine
from glmkit.generate.generator import Generator
from glmkit.generate.sampling import Sampler, SamplingParams
from glmkit.model.glm5 import GlmMoeDsaModel
from glmkit.model.kv_cache import KV_DTYPES, KVCache

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-bf16"
ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("snap") / "f32"
    assert convert_main([str(FIXTURE), str(out), "--preset", "f32", "--quiet"]) == 0
    return Engine(out)


@pytest.fixture(scope="module")
def oracle():
    return json.loads((FIXTURE / "oracle.json").read_text())


def make_cache(engine, directory, mtp=True, chunk=8, **kw):
    kv = engine.model.new_cache()
    index_layers = [i for i in range(engine.config.num_layers_with_mtp) if kv.layer(i).has_index]
    return PrefixCache(directory, engine.model_hash, engine.config, "numpy-test", mtp, index_layers, chunk, **kw)


def greedy(engine, ids, n, kv=None, mtp=True):
    return list(Generator(engine.model, engine.eos_token_ids, use_mtp=mtp).generate(
        ids, n, Sampler(SamplingParams()), kv))


def run_and_store(engine, cache, ids, n=6, mtp=True):
    kv = engine.model.new_cache()
    out = greedy(engine, ids, n, kv, mtp)
    cache.store(kv, ids + out[:-1])
    return out


@pytest.mark.parametrize("mtp", [True, False])
def test_restored_prefix_gives_the_same_logits_and_tokens(engine, oracle, tmp_path, mtp):
    ids = oracle["full_ids"]
    cache = make_cache(engine, tmp_path, mtp)
    run_and_store(engine, cache, ids[:30], mtp=mtp)
    fresh = make_cache(engine, tmp_path, mtp)  # nothing in RAM: every hit comes from disk
    kv = engine.model.new_cache()
    result = fresh.restore(kv, ids)
    assert result.tokens >= 28 and result.from_disk >= 28 and result.from_ram == 0  # DSA active: > index_topk
    ref, _ = engine.model.forward(np.array(ids), engine.model.new_cache())
    hit, _ = engine.model.forward(np.array(ids[kv.length:]), kv)
    assert np.abs(ref[-len(hit):] - hit).max() <= 1e-5 * np.abs(ref).max()
    kv = engine.model.new_cache()
    fresh.restore(kv, ids[:36])
    assert greedy(engine, ids[:36], 12, kv, mtp) == greedy(engine, ids[:36], 12, None, mtp)


def test_follow_up_turn_reuses_the_tail_of_the_previous_one(engine, oracle, tmp_path):
    ids = oracle["full_ids"]
    cache = make_cache(engine, tmp_path, chunk=16)
    out = run_and_store(engine, cache, ids[:21])  # 21 + 5 tokens: one full chunk and a tail of 10
    follow = ids[:21] + out + ids[5:15]
    kv = engine.model.new_cache()
    got = make_cache(engine, tmp_path, chunk=16).restore(kv, follow)
    assert got.tokens == 21 + len(out) - 1 - 1  # all stored rows but the MTP cut-back token
    assert greedy(engine, follow, 8, kv) == greedy(engine, follow, 8)


def test_other_model_or_numerics_never_sees_entries(engine, oracle, tmp_path):
    ids = oracle["full_ids"]
    run_and_store(engine, make_cache(engine, tmp_path), ids[:30])
    kv = engine.model.new_cache()
    other = PrefixCache(tmp_path, "0" * 64, engine.config, "numpy-test", True,
                        [i for i in range(5) if kv.layer(i).has_index], 8)
    assert other.restore(kv, ids).tokens == 0
    kv = engine.model.new_cache()
    other_kernels = PrefixCache(tmp_path, engine.model_hash, engine.config, "opencl-test", True,
                                [i for i in range(5) if kv.layer(i).has_index], 8)
    assert other_kernels.restore(kv, ids).tokens == 0


@pytest.mark.parametrize("kv_dtype", ["bf16", "f16", "fp8"])
def test_rows_at_lower_precision_are_stored_as_they_are_held(engine, oracle, tmp_path, kv_dtype):
    """A bf16 / f16 / fp8 run stores the codes (and f16 / fp8 scales) its cache holds: restored, they are the same
    bits and give the logits of the run that computed them; the blobs are that much smaller; runs at another
    precision never see them."""
    ids = oracle["full_ids"]
    model = GlmMoeDsaModel(engine.config, engine.experts, engine.backend, kv_dtype=kv_dtype)
    index_layers = [i for i in range(engine.config.num_layers_with_mtp) if model.new_cache().layer(i).has_index]

    def cache_at(precision: str) -> PrefixCache:
        return PrefixCache(tmp_path, engine.model_hash, engine.config, "numpy-test", False, index_layers, 8,
                           kv_dtype=precision)

    computed = model.new_cache()
    ref, _ = model.forward(np.array(ids), computed)
    cache_at(kv_dtype).store(computed, ids[:32])
    kv = model.new_cache()
    assert cache_at(kv_dtype).restore(kv, ids).tokens == 32
    for a, b in zip(computed.layers[:engine.config.num_hidden_layers], kv.layers, strict=False):
        for name in ("kv_lat", "k_rot", "index_k") if a.has_index else ("kv_lat", "k_rot"):
            assert np.array_equal(a.storage(name)[:32].view(np.uint8), b.storage(name)[:32].view(np.uint8))
            if kv_dtype in ("f16", "fp8"):
                assert np.array_equal(a.scales(name)[:32], b.scales(name)[:32])
    hit, _ = model.forward(np.array(ids[32:]), kv)
    assert np.abs(ref[32:] - hit).max() <= 1e-5 * np.abs(ref).max()
    sizes = sum(p.stat().st_size for p in _blob_paths(tmp_path))
    f32_rows = engine.model.new_cache()
    engine.model.forward(np.array(ids[:32]), f32_rows)
    f32_dir = tmp_path.parent / f"{tmp_path.name}-f32"
    PrefixCache(f32_dir, engine.model_hash, engine.config, "numpy-test", False, index_layers, 8).store(f32_rows,
                                                                                                       ids[:32])
    assert sizes < sum(p.stat().st_size for p in _blob_paths(f32_dir)) / 1.5
    for other in set(KV_DTYPES) - {kv_dtype}:
        assert cache_at(other).restore(KVCache(engine.config, index_layers, other), ids).tokens == 0


def test_index_from_an_old_layout_starts_afresh(engine, oracle, tmp_path, capsys):
    """An index written by an earlier glmkit without today's columns (here: no `tokens`) is rebuilt, with a
    one-line notice, instead of failing every lookup; the blobs it referenced go (by the cache's own naming),
    a user's files in the directory stay."""
    import sqlite3

    old_blob = tmp_path / ("1" * 16) / "ab" / ("ab" * 32 + ".kvc")
    db = sqlite3.connect(tmp_path / "index.sqlite")
    db.execute("CREATE TABLE entries (key TEXT PRIMARY KEY, model_hash TEXT NOT NULL, parent TEXT NOT NULL, "
               "start INTEGER, n_tokens INTEGER, file TEXT NOT NULL, nbytes INTEGER, created REAL, "
               "last_access REAL, hits INTEGER)")
    db.execute("INSERT INTO entries VALUES (?, ?, 'p', 0, 8, ?, 10, 0, 0, 0)",
               ("ab" * 32, "1" * 64, str(old_blob.relative_to(tmp_path))))
    db.commit()
    db.close()
    for path in (old_blob, tmp_path / "old" / "blob"):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x" * 10)
    ids = oracle["full_ids"]
    cache = make_cache(engine, tmp_path)
    assert "old layout" in capsys.readouterr().err
    assert not old_blob.exists() and (tmp_path / "old" / "blob").read_bytes() == b"x" * 10
    run_and_store(engine, cache, ids[:20])
    assert make_cache(engine, tmp_path).restore(engine.model.new_cache(), ids).tokens >= 16
    assert capsys.readouterr().err == ""  # the rebuilt index is current: no notice the second time


def _blob_paths(directory):
    return sorted(Path(directory).glob("*/*/*.kvc"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "version", "model"])
def test_damaged_blobs_are_discarded_and_recomputed(engine, oracle, tmp_path, damage, capsys):
    ids = oracle["full_ids"]
    run_and_store(engine, make_cache(engine, tmp_path), ids[:30])
    first = min(_blob_paths(tmp_path), key=lambda p: open_index(tmp_path).execute(
        "SELECT start FROM entries WHERE file LIKE ?", (f"%{p.name}",)).fetchone()[0])
    data = bytearray(first.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    elif damage == "truncate":
        data = data[:-40]
    else:
        import hashlib
        body = bytes(data[:-32])
        if damage == "version":
            body = MAGIC + struct.pack("<I", BLOB_VERSION + 1) + body[len(MAGIC) + 4:]
        else:
            body = body.replace(engine.model_hash.encode(), b"f" * 64)
        data = bytearray(body + hashlib.sha256(body).digest())
    first.write_bytes(bytes(data))
    cache = make_cache(engine, tmp_path)
    kv = engine.model.new_cache()
    result = cache.restore(kv, ids)
    assert result.tokens == 0 and result.discarded == 1  # the first chunk is bad: nothing after it is used
    assert not first.exists()
    err = capsys.readouterr().err  # said once, naming the blob
    assert err.count("\n") == 1 and err.startswith("glmkit: warning: prefix cache entry of positions 0-")
    assert f"computed again: {first}: " in err
    assert greedy(engine, ids[:30], 6, kv) == greedy(engine, ids[:30], 6)
    run_and_store(engine, cache, ids[:30])  # recomputed and stored again
    assert make_cache(engine, tmp_path).restore(engine.model.new_cache(), ids).tokens >= 28


def test_eviction_keeps_the_cache_under_its_cap(engine, oracle, tmp_path):
    ids = oracle["full_ids"]
    cache = make_cache(engine, tmp_path)
    run_and_store(engine, cache, ids[:30])
    total = sum(p.stat().st_size for p in _blob_paths(tmp_path))
    small = make_cache(engine, tmp_path, max_bytes=total // 2)
    small.evict()
    left = sum(p.stat().st_size for p in _blob_paths(tmp_path))
    assert left <= total // 2 and left > 0
    db_total = open_index(tmp_path).execute("SELECT SUM(nbytes) FROM entries").fetchone()[0]
    assert db_total == left


WRITER = """
import json, os, sys, time
from glmkit.generate.engine import Engine
from tests.test_prefix_cache import make_cache, run_and_store
engine = Engine(sys.argv[1])
ids = json.loads(sys.argv[3])
if sys.argv[4] == "hang":
    real = os.fsync
    def slow(fd):
        print("writing", flush=True)
        time.sleep(60)
    os.fsync = slow
cache = make_cache(engine, sys.argv[2])
run_and_store(engine, cache, ids)
print("done", flush=True)
"""


def _writer(engine, directory, ids, mode):
    return subprocess.Popen([sys.executable, "-c", WRITER, str(engine.container.directory), str(directory),
                             json.dumps(ids), mode], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_kill_during_write_leaves_nothing_usable(engine, oracle, tmp_path):
    proc = _writer(engine, tmp_path, oracle["full_ids"][:30], "hang")
    assert proc.stdout.readline().strip() == "writing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert _blob_paths(tmp_path) == []  # only a temp file exists, never a blob or an index row
    assert list(tmp_path.glob("*/*/*.tmp-*"))
    assert make_cache(engine, tmp_path).restore(engine.model.new_cache(), oracle["full_ids"]).tokens == 0


def test_concurrent_writers_and_a_new_process_hit(engine, oracle, tmp_path):
    ids = oracle["full_ids"]
    procs = [_writer(engine, tmp_path, ids[:30], "normal"), _writer(engine, tmp_path, ids[:34], "normal")]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0 and "done" in out
    cache = make_cache(engine, tmp_path)
    kv = engine.model.new_cache()
    assert cache.restore(kv, ids).tokens >= 32
    assert greedy(engine, ids, 6, kv) == greedy(engine, ids, 6)
    rows = open_index(tmp_path).execute("SELECT file FROM entries").fetchall()
    assert all((tmp_path / r[0]).is_file() for r in rows)


@pytest.mark.parametrize("mtp", [True, False])
def test_a_prefill_killed_half_way_resumes_from_its_last_chunk(engine, oracle, tmp_path, mtp):
    """A prompt prefilled in chunks stores each chunk's rows as it goes (`Session.store_progress`): stopped after
    its second chunk, a new process restores those rows from disk, and the rest gives the tokens of a fresh run."""

    ids = oracle["full_ids"]
    session = Session(engine.model, make_cache(engine, tmp_path, mtp))
    session.prepare(ids)
    stops = []

    def stop_after_two(prompt_ids):
        session.store_progress(prompt_ids)
        stops.append(session.kv.length)
        if len(stops) == 2:
            raise KeyboardInterrupt  # killed during the prefill

    generator = Generator(engine.model, engine.eos_token_ids, use_mtp=mtp, prefill_chunk=8, checkpoint=stop_after_two)
    with pytest.raises(KeyboardInterrupt):
        list(generator.generate(ids, 4, Sampler(SamplingParams()), session.kv))
    assert stops == [8, 16]
    kv = engine.model.new_cache()
    assert make_cache(engine, tmp_path, mtp).restore(kv, ids).from_disk == 16
    assert greedy(engine, ids, 6, kv, mtp) == greedy(engine, ids, 6, None, mtp)


def test_a_session_that_holds_its_rows_says_so_before_a_restore_grows_them(engine, oracle, tmp_path, monkeypatch):
    """A Session that is the model's only sequence (glm-run's: `holds_kv`) tells the model, before each restore from
    the prefix cache, the rows it keeps and the prompt's (a restored candidate is built beside them), so that an
    expert cache lending their room gives it back first; a server's Sessions leave that to its scheduler."""
    ids = oracle["full_ids"]
    run_and_store(engine, make_cache(engine, tmp_path), ids[:30])
    events: list[tuple] = []
    monkeypatch.setattr(engine.model, "hold_kv_rows", lambda rows: events.append(("hold", rows)))
    for holds in (True, False):
        session = Session(engine.model, make_cache(engine, tmp_path), holds_kv=holds)
        restore = session.prefix_cache.restore
        monkeypatch.setattr(session.prefix_cache, "restore",
                            lambda kv, prompt, restore=restore: (events.append(("restore",)), restore(kv, prompt))[1])
        events.clear()
        kept = session.prepare(ids[:36]).length
        session.prepare(ids[:40])
        assert kept >= 28
        assert events == ([("hold", 36), ("restore",), ("hold", kept + 40), ("restore",)] if holds else
                          [("restore",), ("restore",)])
