"""Agent-style prefill reuse: rewritten histories (exact), chunks reused at other positions (approximate,
opt-in), the re-rotation of roped rows, the hnswlib index over stored chunks, and the CLI's honesty."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from glmkit.cache.blend import blend_forward, forward_at, reserve
from glmkit.cache.chunk_index import HNSW_HEADER, ChunkIndex, TokenLatents, chunk_label
from glmkit.cache.prefix_cache import PrefixCache, common_prefix, open_index, prune, read_blob, rerotate
from glmkit.cache.session import ApproxPolicy, Session
from glmkit.cli.run import main as run_main
from glmkit.cli.validate import main as validate_main
from glmkit.generate.engine import Engine
from glmkit.generate.generator import Generator
from glmkit.generate.sampling import Sampler, SamplingParams
from glmkit.model.ops import apply_rope, rope_cos_sin
from tests.runtime_support import FIXTURES, convert

CHUNK = 8


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    return convert(FIXTURES / "tiny-bf16", tmp_path_factory.mktemp("snap") / "f32", "f32")


@pytest.fixture(scope="module")
def engine(snapshot) -> Engine:
    return Engine(snapshot)


def make_cache(engine, directory, mtp=True, **kw) -> PrefixCache:
    return PrefixCache.for_model(engine.model, engine.model_hash, directory, mtp, chunk_tokens=CHUNK, **kw)


def request(engine, session, ids, n=4, mtp=True):
    """One request through a Session, like glm-run: (generated ids, generator stats)."""
    kv = session.prepare(ids)
    generator = Generator(engine.model, engine.eos_token_ids, use_mtp=mtp)
    out = list(generator.generate(ids, n, Sampler(SamplingParams()), kv))
    session.commit(ids, out)
    return out, generator.stats


def tokens(seed, n):
    return np.random.default_rng(seed).integers(0, 370, n).tolist()  # ordinary (non-special) ids


SYSTEM = [374, 376] + tokens(1, 10)
DOCS = [tokens(10 + i, 30) for i in range(3)]
QUESTION = tokens(20, 5)


def doc_prompt(order):
    return SYSTEM + [t for i in order for t in [381] + DOCS[i]] + QUESTION  # 381 = <|observation|>


# ---- anchors: a rewritten history reuses everything before the first changed token ----------------

def agent_history(engine, turn1_answer, thinking):
    msgs = [{"role": "system", "content": "You are a careful agent with tools."},
            {"role": "user", "content": "List the files and read the largest one."},
            {"role": "assistant", "content": f"<think>{thinking}</think>{turn1_answer}"},
            {"role": "observation", "content": "a.py 120 bytes\nb.py 4096 bytes"},
            {"role": "assistant", "content": "<think>b.py is larger</think>Reading b.py now."},
            {"role": "observation", "content": "def main():\n    return 42\n"},
            {"role": "user", "content": "What does it return?"}]
    return engine.tokenizer.encode_chat(msgs)


@pytest.mark.parametrize("mtp", [True, False])
@pytest.mark.parametrize("edit", ["rewrite turn", "drop thinking"])
def test_rewritten_history_reuses_exactly_up_to_the_first_changed_token(engine, tmp_path, mtp, edit):
    old = agent_history(engine, "I will call ls.", "the user wants files")
    new = agent_history(engine, "Calling ls first.", "the user wants files") if edit == "rewrite turn" \
        else agent_history(engine, "I will call ls.", "")
    first_diff = common_prefix(old, new)
    assert 20 < first_diff < len(old) - 20 and first_diff % CHUNK != 0  # mid-chunk, mid-conversation
    request(engine, Session(engine.model, make_cache(engine, tmp_path, mtp)), old, mtp=mtp)
    session = Session(engine.model, make_cache(engine, tmp_path, mtp))
    out, _ = request(engine, session, new, n=6, mtp=mtp)
    # the MTP layer's row i pairs h_i with token i+1: the token before the edit is recomputed for it
    assert session.last_reuse.exact == first_diff - (1 if mtp else 0)
    assert session.last_reuse.approx == 0
    plain, _ = request(engine, Session(engine.model, None), new, n=6, mtp=mtp)
    assert out == plain


# ---- re-rotation ------------------------------------------------------------------------------------

def test_rerotation_is_exact_rope_arithmetic(engine):
    theta = engine.config.rope_theta
    rng = np.random.default_rng(0)
    raw = rng.standard_normal((12, 8)).astype(np.float32)
    at = lambda start: apply_rope(raw, *rope_cos_sin(np.arange(start, start + 12), 8, theta))  # noqa: E731
    roped = at(5)
    assert rerotate(roped, 5, 5, theta) is roped  # same position: the stored rows, untouched
    for new in (0, 6, 77, 1500):
        moved = rerotate(roped, 5, new, theta)
        assert np.abs(moved - at(new)).max() < 1e-5  # = roped directly at the new positions
        assert np.abs(rerotate(moved, new, 5, theta) - roped).max() < 1e-5  # by d then -d: identity


def test_recomputing_positions_in_place_equals_the_ordinary_forward(engine):
    """`blend.forward_at` over a contiguous block (placeholders reserved first) is `model.forward`, DSA included."""
    ids = np.asarray(doc_prompt([0, 1]))
    model = engine.model
    want = model.new_cache()
    _, hidden = model.forward(ids, want)
    got = model.new_cache()
    model.forward(ids[:20], got)
    reserve(got, len(ids) - 20)
    positions = np.arange(20, len(ids))
    mine = forward_at(model, ids[20:], positions, got)
    assert np.abs(mine - hidden[20:]).max() <= 1e-5 * np.abs(hidden).max()
    for layer in range(engine.config.num_hidden_layers):
        for name in ("kv_lat", "k_rot", "index_k") if got.layer(layer).has_index else ("kv_lat", "k_rot"):
            a, b = got.layer(layer).rows(name), want.layer(layer).rows(name)
            assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), (layer, name)


def main_rows(cache, layers):
    """Every stored field of the given layers: {(layer, name): rows}."""
    return {(layer, name): cache.layer(layer).rows(name).copy() for layer in layers
            for name in ("kv_lat", "k_rot", "index_k") if name != "index_k" or cache.layer(layer).has_index}


def recompute_in_place(model, ids, start):
    """A cache holding `ids[:start]` (forward) and the rest recomputed in place (`forward_at`), and the hidden states
    `forward_at` returned."""
    cache = model.new_cache()
    model.forward(ids[:start], cache)
    reserve(cache, len(ids) - start)
    return cache, forward_at(model, ids[start:], np.arange(start, len(ids)), cache)


def test_recomputing_a_block_in_place_is_bit_for_bit_the_appending_forward(engine):
    """The same block appended by `model.forward` or recomputed in place (over placeholders) by `forward_at`: the
    same hidden states, the same rows and the same next-token logits, bit for bit."""
    ids = np.asarray(doc_prompt([0, 1]))
    model, layers = engine.model, range(engine.config.num_hidden_layers)
    appended = model.new_cache()
    model.forward(ids[:20], appended)
    _, hidden = model.forward(ids[20:-1], appended)
    in_place, mine = recompute_in_place(model, ids[:-1], 20)
    np.testing.assert_array_equal(mine, hidden)
    want = main_rows(appended, layers)
    for key, rows in main_rows(in_place, layers).items():
        np.testing.assert_array_equal(rows, want[key], err_msg=str(key))
    # the prompt's last token then decodes from either cache to the same logits as a plain prefill of it all
    prefill, _ = model.forward(ids, model.new_cache(), last_logits_only=True)
    after_append, _ = model.forward(ids[-1:], appended)
    after_in_place, _ = model.forward(ids[-1:], in_place)
    np.testing.assert_array_equal(after_in_place, after_append)
    assert np.abs(after_append - prefill).max() <= 1e-5 * np.abs(prefill).max()


def test_blend_runs_the_models_own_layer(engine, monkeypatch):
    """blend.forward_at and blend_forward follow the model's feed_forward and kv_latent (no copy of the layer):
    with the feed-forward changed they still equal `model.forward`, and the deviating rows they recompute are the
    ones the model's kv_latent says deviate."""
    ids = np.asarray(doc_prompt([0]))
    model, start = engine.model, 20
    _, plain = model.forward(ids, model.new_cache())
    feed_forward = model.feed_forward
    monkeypatch.setattr(model, "feed_forward", lambda layer, u: np.float32(1.5) * feed_forward(layer, u))
    _, hidden = model.forward(ids, model.new_cache())
    assert np.abs(hidden - plain).max() > 1e-2 * np.abs(plain).max()  # the change matters
    _, mine = recompute_in_place(model, ids, start)
    assert np.abs(mine - hidden[start:]).max() <= 1e-5 * np.abs(hidden).max()

    # blend_forward over exact reused rows: only the rows kv_latent makes deviate are recomputed past layer 0
    exact = model.new_cache()
    model.forward(ids, exact)
    cache = model.new_cache()
    model.forward(ids[:start], cache)
    reserve(cache, len(ids) - start)
    for layer in range(engine.config.num_hidden_layers):
        for name, rows in main_rows(exact, [layer]).items():
            cache.layer(layer).rows(name[1])[start:] = rows[start:]
    positions = np.arange(start, len(ids))
    bumped = np.array([1, 4, 9])
    kv_latent = model.kv_latent

    def deviating(layer, x):
        lat = kv_latent(layer, x)
        lat[bumped] += 10.0
        return lat

    monkeypatch.setattr(model, "kv_latent", deviating)
    out, chosen = blend_forward(model, ids[start:], positions, cache, np.ones(len(positions), bool),
                                len(bumped) / len(positions))
    np.testing.assert_array_equal(chosen, positions[bumped])
    assert np.abs(out - hidden[positions[bumped]]).max() <= 1e-5 * np.abs(hidden).max()


def test_token_latents_are_the_rows_layer_zero_caches(engine):
    ids = np.asarray(doc_prompt([2]))
    cache = engine.model.new_cache()
    engine.model.forward(ids, cache)
    np.testing.assert_array_equal(TokenLatents(engine.model)(ids), cache.layer(0).kv_lat)


def test_rows_of_a_chunk_moved_elsewhere_match_layer_zero_exactly(engine, tmp_path):
    """Layer 0 sees no context (its KV rows depend on the token and its position only), so a chunk imported at a
    shifted position must give layer 0's recomputed rows; deeper layers keep their old context: approximate."""
    first = SYSTEM + [381] + DOCS[0] + QUESTION
    moved = SYSTEM + tokens(30, 13) + [381] + DOCS[0] + QUESTION
    request(engine, Session(engine.model, make_cache(engine, tmp_path)), first)
    session = Session(engine.model, make_cache(engine, tmp_path),
                      ApproxPolicy(recompute_ratio=0.0, similar=False))
    kv = session.prepare(moved)
    assert session.last_reuse.approx >= len(DOCS[0]) - CHUNK
    exact = engine.model.new_cache()
    engine.model.forward(np.asarray(moved[:kv.length]), exact)
    start, stop = session.exact_len, kv.length  # the imported span and what follows it
    for name in ("kv_lat", "k_rot", "index_k"):
        got, want = kv.layer(0).rows(name)[start:stop], exact.layer(0).rows(name)[start:stop]
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), name
    assert np.abs(kv.layer(3).kv_lat[start:stop] - exact.layer(3).kv_lat[start:stop]).max() > 1e-3


# ---- approximate reuse ---------------------------------------------------------------------------

def chain_tokens(db, key, root):
    """The token ids a stored chunk's chain covers, from the start of the sequence to its end."""
    parts = []
    while key != root:
        parent, blob = db.execute("SELECT parent, tokens FROM entries WHERE key = ?", (key,)).fetchone()
        parts.insert(0, np.frombuffer(blob, dtype="<i8").tolist())
        key = parent
    return [t for p in parts for t in p]


def test_shuffled_documents_are_reused_approximately_and_never_stored(engine, tmp_path):
    cache = make_cache(engine, tmp_path)
    request(engine, Session(engine.model, cache), doc_prompt([0, 1, 2]))
    shuffled = doc_prompt([2, 0, 1])
    session = Session(engine.model, make_cache(engine, tmp_path), ApproxPolicy(recompute_ratio=0.25))
    out, stats = request(engine, session, shuffled, n=6)
    reuse = session.last_reuse
    assert reuse.approx >= 60 and reuse.runs >= 1 and reuse.blend_recomputed > 0
    assert reuse.exact + reuse.approx + reuse.computed + (len(shuffled) - stats.cached_tokens) == len(shuffled)
    assert stats.mtp_drafts == 0  # MTP rows cannot be rebuilt from imported rows: no drafts for this request
    assert session.exact_len < len(SYSTEM) + 1 + len(DOCS[2])  # exactness ends inside the first reused doc

    # every stored entry holds exactly the rows an exact forward over its chain's tokens computes
    db = open_index(tmp_path)
    root = make_cache(engine, tmp_path).root
    keys = [k for (k,) in db.execute("SELECT key FROM entries")]
    assert len(keys) > 5
    for key in keys:
        ids = chain_tokens(db, key, root)
        rel, start, n = db.execute("SELECT file, start, n_tokens FROM entries WHERE key = ?", (key,)).fetchone()
        chunk = read_blob(tmp_path / rel, engine.model_hash, cache.numerics,
                          cache.expected_shapes(n, start))
        exact = engine.model.new_cache()
        engine.model.forward(np.asarray(ids), exact)
        for layer in range(engine.config.num_hidden_layers):
            want = exact.layer(layer).kv_lat[start:start + n]
            assert np.abs(chunk.arrays[f"{layer}.kv_lat"] - want).max() <= 1e-5 * np.abs(want).max()

    # and an exact-mode request for the shuffled prompt restores only its exact part, with exact results
    again = Session(engine.model, make_cache(engine, tmp_path))
    out_exact, _ = request(engine, again, shuffled, n=6)
    assert again.last_reuse.approx == 0 and again.last_reuse.exact <= session.exact_len
    plain, _ = request(engine, Session(engine.model, None), shuffled, n=6)
    assert out_exact == plain


@pytest.mark.parametrize("select", ["first", "deviation"])
def test_recomputing_every_reused_token_gives_the_exact_result(engine, tmp_path, select):
    """Ratio 1 turns approximate reuse back into a full recompute (layer 0's reused rows are context-free and the
    rest are all recomputed); ratio 0.5 recomputes half of the reused tokens."""
    request(engine, Session(engine.model, make_cache(engine, tmp_path)), doc_prompt([0, 1, 2]))
    shuffled = doc_prompt([2, 0, 1])
    ref, _ = engine.model.forward(np.asarray(shuffled), engine.model.new_cache(), last_logits_only=True)
    session = Session(engine.model, make_cache(engine, tmp_path), ApproxPolicy(recompute_ratio=1.0, select=select))
    kv = session.prepare(shuffled)
    # "first" imports nothing at all then (the generator computes the rest); "deviation" recomputes what it imported
    reuse = session.last_reuse
    assert reuse.approx == 0 and reuse.blend_recomputed >= (60 if select == "deviation" else 0)
    got, _ = engine.model.forward(np.asarray(shuffled[kv.length:]), kv, last_logits_only=True)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    half = Session(engine.model, make_cache(engine, tmp_path), ApproxPolicy(recompute_ratio=0.5, select=select))
    half.prepare(shuffled)
    reuse = half.last_reuse
    assert abs(reuse.approx - reuse.blend_recomputed) <= 2 * reuse.runs


def test_a_chat_keeps_its_approximate_rows_but_stores_only_exact_ones(engine, tmp_path):
    request(engine, Session(engine.model, make_cache(engine, tmp_path)), doc_prompt([0, 1, 2]))
    session = Session(engine.model, make_cache(engine, tmp_path), ApproxPolicy())
    first = doc_prompt([1, 2, 0])
    out, _ = request(engine, session, first)
    exact_len = session.exact_len
    follow = first + out + [381] + DOCS[1] + tokens(40, 6)  # the next turn quotes a stored document again
    request(engine, session, follow)
    reuse = session.last_reuse
    assert reuse.exact <= exact_len and reuse.runs >= 1  # earlier rows kept (approximate), the document reused
    assert reuse.approx >= len(first) - exact_len + len(DOCS[1]) - CHUNK
    assert session.exact_len <= exact_len  # rows computed on top of approximate ones are approximate too
    exact_mode = Session(engine.model, make_cache(engine, tmp_path))
    exact_mode.prepare(follow)
    assert exact_mode.last_reuse.exact <= exact_len  # the chat's approximate rows never became exact entries


def test_a_similar_document_is_found_through_the_hnsw_index(engine, tmp_path):
    request(engine, Session(engine.model, make_cache(engine, tmp_path)), doc_prompt([0, 1]))
    edited = list(DOCS[0])
    edited[3::6] = tokens(50, len(edited[3::6]))  # every 6th token changed: no identical 8-token chunk is left
    prompt = SYSTEM + tokens(51, 5) + [381] + edited + QUESTION
    cache = make_cache(engine, tmp_path)
    session = Session(engine.model, cache, ApproxPolicy(recompute_ratio=0.0, min_block=3))
    request(engine, session, prompt)
    assert session.last_reuse.similar_runs >= 1 and session.last_reuse.approx >= 6
    runs = cache.find_runs(prompt, len(SYSTEM), len(prompt) - 1, session._latents.embed, 0.5, 3)
    for run in runs:  # a row is only ever reused for the very token it was computed for
        assert run.kind == "similar"
        for piece in run.pieces:
            stored = np.frombuffer(cache.db.execute("SELECT tokens FROM entries WHERE key = ?", (piece.key,))
                                   .fetchone()[0], dtype="<i8").tolist()
            assert stored[piece.offset:piece.offset + piece.count] == prompt[run.start:run.start + piece.count]
    strict = Session(engine.model, make_cache(engine, tmp_path), ApproxPolicy(threshold=0.999, min_block=3))
    strict.prepare(prompt)
    assert strict.last_reuse.similar_runs == 0


# ---- the hnswlib index ---------------------------------------------------------------------------

def stored_index(engine, directory, max_elements=1000):
    cache = make_cache(engine, directory)
    latents = TokenLatents(engine.model)
    return cache, cache.open_similar_index(latents.center, max_elements), latents


def test_hnsw_index_persists_rebuilds_follows_eviction_and_stays_bounded(engine, tmp_path):
    cache, index, latents = stored_index(engine, tmp_path)
    request(engine, Session(engine.model, cache), doc_prompt([0, 1, 2]))
    assert len(index) >= 10
    probe = latents.embed([DOCS[1][2:2 + CHUNK]])
    best = index.query(probe, k=1)[0][0]
    cache.save_similar_index()
    labels = set(index.labels)

    def reopen(max_elements=1000):
        return ChunkIndex(open_index(tmp_path), tmp_path, cache.root, latents.center, max_elements)

    loaded = reopen()
    assert not loaded.rebuilt and set(loaded.labels) == labels and loaded.query(probe, k=1)[0][0][0] == best[0]
    data = bytearray(index.path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    index.path.write_bytes(bytes(data))
    damaged = reopen()
    assert damaged.rebuilt and set(damaged.labels) == labels and damaged.query(probe, k=1)[0][0][0] == best[0]
    index.path.unlink()
    assert reopen().rebuilt
    for path in (index.path, index.meta_path):  # a FIFO in either file's place is not waited on: rebuilt
        saved = path.read_bytes() if path.exists() else None
        path.unlink(missing_ok=True)
        os.mkfifo(path)
        assert reopen().rebuilt
        path.unlink()
        if saved is not None:
            path.write_bytes(saved)

    # eviction by this process updates the live index; by another process, the next open reconciles
    cache.max_bytes = sum(p.stat().st_size for p in tmp_path.glob("*/*/*.kvc")) // 2
    cache.evict()
    left = {chunk_label(k) for (k,) in cache.db.execute("SELECT key FROM entries WHERE emb IS NOT NULL")}
    assert set(index.labels) == left and 0 < len(left) < len(labels)
    cache.save_similar_index()
    prune(open_index(tmp_path), tmp_path, 0)
    assert len(reopen()) == 0

    # bounded: at most max_elements live chunks (the most recently used), also after a save and a reload
    small_dir = tmp_path / "small"
    small_cache, small, _ = stored_index(engine, small_dir, max_elements=3)
    request(engine, Session(engine.model, small_cache), doc_prompt([0, 1, 2]))
    assert len(small) == 3 and small.index.get_max_elements() <= 3
    small_cache.save_similar_index()
    again = ChunkIndex(open_index(small_dir), small_dir, small_cache.root, latents.center, 3)
    assert len(again) == 3 and again.index.get_max_elements() <= 3


@pytest.fixture(scope="module")
def saved_ann(engine, tmp_path_factory) -> tuple[Path, str, np.ndarray, np.ndarray]:
    """A prefix cache holding three documents' chunks and their saved hnswlib index: (its directory, the chain's
    root, the reference vector, two probe embeddings)."""
    directory = tmp_path_factory.mktemp("ann")
    cache, _, latents = stored_index(engine, directory)
    request(engine, Session(engine.model, cache), doc_prompt([0, 1, 2]))
    cache.save_similar_index()
    return directory, cache.root, latents.center, latents.embed([DOCS[1][2:2 + CHUNK], DOCS[2][5:5 + CHUNK]])


def reopen_index(directory: Path, saved_ann) -> ChunkIndex:
    _, root, center, _ = saved_ann
    return ChunkIndex(open_index(directory), directory, root, center)


def ann_files(directory: Path) -> tuple[Path, Path]:
    (index_path,) = (directory / "ann").glob("*.hnsw")
    return index_path, index_path.with_suffix(".json")


def edit_sidecar(text: str, case: str) -> str:
    """The sidecar with one field of another type or range than `ChunkIndex.save` writes."""
    if case == "an integer past the digit limit":
        return text.replace("{", '{"x": ' + "9" * 5000 + ", ", 1)
    if case == "not an object":
        return "[]"
    if case == "dim a float":  # equal to the dimension, of another type
        return json.dumps({**json.loads(text), "dim": float(json.loads(text)["dim"])})
    field, value = SIDECAR_EDITS[case]
    return json.dumps({**json.loads(text), field: value})


SIDECAR_EDITS = {"count a string": ("count", "5"), "count null": ("count", None),
                 "count past the bound": ("count", 1001), "count past the elements": ("count", 999),
                 "deleted a string": ("deleted", ["x"]), "deleted nested": ("deleted", [[1]]),
                 "deleted infinite": ("deleted", [float("inf")]), "deleted a bool": ("deleted", [True]),
                 "deleted past 60 bits": ("deleted", [1 << 60]), "sha256 a number": ("sha256", 5)}


@pytest.mark.parametrize("case", [*SIDECAR_EDITS, "dim a float", "an integer past the digit limit", "not an object"])
def test_a_damaged_sidecar_is_one_warning_and_the_index_is_rebuilt(saved_ann, tmp_path, capsys, case):
    directory = Path(shutil.copytree(saved_ann[0], tmp_path / "cache"))
    probe = saved_ann[3]
    pristine = reopen_index(directory, saved_ann)
    assert not pristine.rebuilt and capsys.readouterr().err == ""
    index_path, meta_path = ann_files(directory)
    meta_path.write_text(edit_sidecar(meta_path.read_text(), case))
    rebuilt = reopen_index(directory, saved_ann)
    err = capsys.readouterr().err
    assert rebuilt.rebuilt and set(rebuilt.labels) == set(pristine.labels)
    assert rebuilt.query(probe) == pristine.query(probe)
    assert err.count("\n") == 1 and err.startswith(f"glmkit: warning: similar-chunk index {index_path} is damaged")
    rebuilt.save()
    assert not reopen_index(directory, saved_ann).rebuilt and capsys.readouterr().err == ""


def craft_hnsw(data: bytearray, case: str) -> None:
    """Edit a saved index of 14 elements, element 11 the only one with an upper level (the entry point)."""
    head = list(HNSW_HEADER.unpack_from(data))
    n, per_element = head[2], head[3]
    first_upper = HNSW_HEADER.size + n * per_element  # element 0's upper-level link list size
    if case == "a level-0 link count past its bound":
        data[96:104] = b"\xff" * 8
    elif case == "a level-0 neighbour past the elements":
        struct.pack_into("<II", data, HNSW_HEADER.size, 1, 1 << 30)
    elif case == "an upper-level neighbour without that level":
        pos = first_upper + 4 * 11  # elements 0..10 have no upper level: a 4-byte size each
        assert struct.unpack_from("<I", data, pos)[0] == 68
        struct.pack_into("<II", data, pos + 4, 1, 0)
    elif case == "the entry point past the elements":
        head[7] = 1 << 30
    elif case == "the top level above the entry point's":
        head[6] = 5
    elif case == "a level multiplier of 1e300":
        head[11] = 1e300
    elif case == "one element more than the file holds":
        head[2] = n + 1
    elif case == "an upper-level list of no whole level":
        struct.pack_into("<I", data, first_upper, 3)
    elif case == "a non-finite vector":
        struct.pack_into("<f", data, HNSW_HEADER.size + 132, float("nan"))
    if case not in ("a level-0 link count past its bound", "an upper-level neighbour without that level"):
        HNSW_HEADER.pack_into(data, 0, *head)


HNSW_CHILD = """
import json, sys
import numpy as np
from pathlib import Path
from glmkit.cache.chunk_index import ChunkIndex
from glmkit.cache.prefix_cache import open_index
directory, root = Path(sys.argv[1]), sys.argv[2]
center, probe = np.load(sys.argv[3]), np.load(sys.argv[4])
index = ChunkIndex(open_index(directory), directory, root, center)
hits = index.query(probe)
index.add("f" * 64, probe[0])
print(json.dumps({"rebuilt": index.rebuilt, "hits": hits, "after_add": index.query(probe)}))
"""


def open_in_child(directory: Path, saved_ann) -> subprocess.CompletedProcess:
    """Open the index, query it and add to it in a process of its own (hnswlib crashes on a crafted file)."""
    _, root, center, probe = saved_ann
    np.save(directory / "center.npy", center)
    np.save(directory / "probe.npy", probe)
    return subprocess.run([sys.executable, "-c", HNSW_CHILD, str(directory), root, str(directory / "center.npy"),
                           str(directory / "probe.npy")], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parent.parent)


HNSW_CASES = ["a level-0 link count past its bound", "a level-0 neighbour past the elements",
              "an upper-level neighbour without that level", "the entry point past the elements",
              "the top level above the entry point's", "a level multiplier of 1e300",
              "one element more than the file holds", "an upper-level list of no whole level", "a non-finite vector"]


@pytest.mark.parametrize("case", HNSW_CASES)
def test_a_crafted_index_file_is_never_handed_to_hnswlib(saved_ann, tmp_path, case):
    """An index file edited and its digest put in the sidecar, as anyone who can write the cache could: the file is
    checked before hnswlib reads it, rebuilt from the prefix cache, and the process lives."""
    directory = Path(shutil.copytree(saved_ann[0], tmp_path / "cache"))
    pristine = open_in_child(directory, saved_ann)
    assert pristine.returncode == 0 and pristine.stderr == "", pristine.stderr
    index_path, meta_path = ann_files(directory)
    data = bytearray(index_path.read_bytes())
    craft_hnsw(data, case)
    index_path.write_bytes(bytes(data))
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "sha256": hashlib.sha256(data).hexdigest()}))
    crafted = open_in_child(directory, saved_ann)
    assert crafted.returncode == 0, crafted.stderr[-2000:]
    result, before = json.loads(crafted.stdout), json.loads(pristine.stdout)
    assert result["rebuilt"] and not before["rebuilt"]
    assert result["hits"] == before["hits"] and result["after_add"] == before["after_add"]
    assert crafted.stderr.count("\n") == 1 and f"similar-chunk index {index_path} is damaged" in crafted.stderr


def test_random_damage_to_the_index_file_never_crashes(saved_ann, tmp_path):
    """Seeded: bytes of the index file overwritten, the digest put in the sidecar; every open, query and insert
    lives, on the file as loaded or on one rebuilt."""
    directory = Path(shutil.copytree(saved_ann[0], tmp_path / "cache"))
    index_path, meta_path = ann_files(directory)
    pristine, meta = index_path.read_bytes(), json.loads(meta_path.read_text())
    rng = np.random.default_rng(7)
    for case in range(12):
        data = bytearray(pristine)
        for _ in range(int(rng.integers(1, 4))):
            at = int(rng.integers(0, len(data) - 4))
            data[at:at + 4] = rng.integers(0, 256, 4, dtype=np.uint8).tobytes()
        index_path.write_bytes(bytes(data))
        meta_path.write_text(json.dumps({**meta, "sha256": hashlib.sha256(data).hexdigest()}))
        child = open_in_child(directory, saved_ann)
        assert child.returncode == 0, (case, child.stderr[-2000:])


def test_an_index_from_before_approximate_reuse_is_migrated_in_place(engine, tmp_path):
    import sqlite3
    old = sqlite3.connect(tmp_path / "index.sqlite")
    old.execute("CREATE TABLE entries (key TEXT PRIMARY KEY, model_hash TEXT NOT NULL, parent TEXT NOT NULL, "
                "start INTEGER, n_tokens INTEGER, tokens BLOB NOT NULL, file TEXT NOT NULL, nbytes INTEGER, "
                "created REAL, last_access REAL, hits INTEGER)")
    old.execute("INSERT INTO entries VALUES ('k', 'm', 'p', 0, 1, x'00', 'f', 1, 0, 0, 0)")
    old.commit()
    old.close()
    cache = make_cache(engine, tmp_path)
    columns = {row[1] for row in cache.db.execute("PRAGMA table_info(entries)")}
    assert {"content", "root", "emb"} <= columns
    assert cache.db.execute("SELECT content, root, emb FROM entries WHERE key = 'k'").fetchone() == (None, None, None)
    request(engine, Session(engine.model, cache, ApproxPolicy()), doc_prompt([0]))  # works on the migrated index


# ---- command line ---------------------------------------------------------------------------------

DOC_TEXT = ["The river flows north past the old mill and the stone bridge near the market.",
            "Tool result: 14 files changed, 203 insertions, 17 deletions in the parser module.",
            "Retrieved: the cache stores rows per chunk and checks the model hash on every read."]


def cli_prompt(order):
    return "<|system|>\nAnswer from the documents." + "".join(f"<|observation|>\n{DOC_TEXT[i]}" for i in order) \
        + "<|user|>\nSummarize.<|assistant|>"


def run_cli(snapshot, tmp_path, prompt, *flags):
    stats = tmp_path / "stats.json"
    rc = run_main([str(snapshot), "-p", prompt, "--raw-prompt", "--max-tokens", "4", "--chunk-tokens", str(CHUNK),
                   "--stats-json", str(stats), *flags])
    assert rc == 0
    return json.loads(stats.read_text())


def test_cli_reuse_approximate_reports_exact_approximate_and_recomputed(snapshot, tmp_path, capsys):
    first = run_cli(snapshot, tmp_path, cli_prompt([0, 1, 2]))
    assert (first["reused_exact"], first["reused_approx"], first["recomputed"]) == (0, 0, first["prompt_tokens"])
    exact = run_cli(snapshot, tmp_path, cli_prompt([2, 0, 1]))
    assert exact["reused_approx"] == 0 and exact["reused_exact"] == exact["cached_tokens"]
    approx = run_cli(snapshot, tmp_path, cli_prompt([1, 2, 0]), "--reuse", "approximate", "--recompute-ratio", "0.2")
    assert approx["reused_approx"] > 20 and approx["approx"]["runs"] >= 1
    assert approx["reused_exact"] + approx["reused_approx"] + approx["recomputed"] == approx["prompt_tokens"]
    assert approx["cached_tokens"] == approx["reused_exact"] + approx["reused_approx"]
    assert approx["ttft_s"] >= approx["prefill_s"]
    capsys.readouterr()
    assert run_main([str(snapshot), "-p", "hi", "--reuse", "approximate", "--no-cache"]) == 1
    assert "--reuse approximate" in capsys.readouterr().err
    assert run_main([str(snapshot), "-p", "hi", "--reuse", "approximate", "--recompute-ratio", "2"]) == 1


def test_glm_validate_never_touches_the_prefill_cache(snapshot, tmp_path, capsys, monkeypatch):
    cache_dir = tmp_path / "cache"
    monkeypatch.setenv("GLMKIT_CACHE_DIR", str(cache_dir))
    run_cli(snapshot, tmp_path, cli_prompt([0, 1, 2]))

    def state():
        rows = open_index(cache_dir).execute("SELECT key, last_access, hits FROM entries ORDER BY key").fetchall()
        return rows, sorted(p.name for p in cache_dir.rglob("*.kvc")), sorted(p.name for p in cache_dir.rglob("*.hnsw"))

    before = state()
    capsys.readouterr()
    assert validate_main([str(snapshot), str(FIXTURES / "tiny-bf16" / "oracle.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["passed"]
    assert state() == before and before[0]  # not read (no hit counted), not written


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_a_chunk_removed_and_added_again_takes_its_own_element_back(tmp_path, order):
    """A chunk removed from the index and added again gets its own (deleted) element back, never a second one: a later
    chunk taking the first one's slot would unlink its label from the live element, and the count of reusable slots
    would drift until adding failed (hnswlib's "exceeds the specified limit")."""
    rng = np.random.default_rng(0)
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(4)]
    vectors = {key: rng.standard_normal(8).astype(np.float32) for key in keys}
    index = ChunkIndex(open_index(tmp_path), tmp_path, "ab" * 32, np.zeros(8, np.float32), 2)
    again, other, new, newer = keys
    for key in (again, other):
        index.add(key, vectors[key])
    index.remove([(again, other)[i] for i in order])
    index.add(again, vectors[again])
    index.add(new, vectors[new])  # takes the one deleted slot left
    index.remove([again])
    index.add(newer, vectors[newer])
    index.add(other, vectors[other])  # the bound drops the least recently used
    assert len(index) == 2
    found = index.query(np.stack([vectors[newer], vectors[other]]), k=1)
    assert [hits[0][0] for hits in found] == [newer, other]
