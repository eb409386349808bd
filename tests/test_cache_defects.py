"""The prefix cache against hostile input: an old or damaged index, forged rows and blobs, odd session names.

Every case must end in correct reuse or in a miss (or a clean one-line error), never in a traceback, a hang,
an unbounded allocation, rows restored for tokens they were not computed for, or a deleted file the cache did
not create."""

from __future__ import annotations

import ast
import contextlib
import hashlib
import io
import json
import os
import resource
import signal
import sqlite3
import stat
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

import glmkit.cache.prefix_cache as prefix_cache
from glmkit.cache.prefix_cache import MAGIC, PrefixCache
from glmkit.cli.cache import main as cache_main
from glmkit.cli.run import main as run_main
from glmkit.model.ops import apply_rope, rope_cos_sin

CHUNK = 8
LONG = "Wrap this text for a narrow window, then explain why the result reads well. " * 2


# ---- shared helpers (the fuzz harness uses them too) ----------------------------------------------

class Hang(Exception):
    """A cache operation ran past its time limit."""


@contextlib.contextmanager
def guarded(seconds: int = 10, extra_bytes: int = 1 << 30):
    """Run a block with a time limit (raises `Hang`) and an address-space cap of the current size + extra_bytes
    (an allocation beyond it raises MemoryError instead of taking the machine's memory)."""
    def on_alarm(signum, frame):
        raise Hang(f"still running after {seconds} s")

    vm_kb = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                 if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = vm_kb * 1024 + extra_bytes
    old = signal.signal(signal.SIGALRM, on_alarm)
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.signal(signal.SIGALRM, old)


def make_cache(engine, directory: Path, mtp: bool = False, **kw) -> PrefixCache:
    return PrefixCache.for_model(engine.model, engine.model_hash, directory, mtp, chunk_tokens=CHUNK, **kw)


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 370, n).tolist()  # ordinary (non-special) ids


def computed(engine, ids: list[int]):
    """The KV cache a plain forward over `ids` fills (what any restored row must equal)."""
    kv = engine.model.new_cache()
    engine.model.forward(np.asarray(ids), kv)
    return kv


def store(engine, directory: Path, ids: list[int]) -> None:
    """Store the chunks of `ids` (8-token chunks and a tail) from a plain forward, like a finished request."""
    cache = make_cache(engine, directory)
    cache.store(computed(engine, ids), ids)
    cache.db.close()


def rows_match(engine, kv, ids: list[int], n: int, want=None) -> bool:
    """Whether the first `n` rows of every main layer of `kv` equal those a plain forward over `ids` computes
    (`want`, when given, is that forward's KV cache), up to float32 rounding."""
    want = computed(engine, ids) if want is None else want
    for layer in range(engine.config.num_hidden_layers):
        fields = ("kv_lat", "k_rot", "index_k") if want.layer(layer).has_index else ("kv_lat", "k_rot")
        for name in fields:
            a, b = kv.layer(layer).rows(name)[:n], want.layer(layer).rows(name)[:n]
            if a.shape != b.shape or np.abs(a - b).max(initial=0) > 1e-5 * max(np.abs(b).max(initial=0), 1e-30):
                return False
    return True


def index(directory: Path) -> sqlite3.Connection:
    """A plain connection to the cache's index (as a user or another program would edit it)."""
    return sqlite3.connect(Path(directory) / "index.sqlite", isolation_level=None)


def blob_of(directory: Path, key: str) -> Path:
    return next(Path(directory).glob(f"*/{key[:2]}/{key}.kvc"))


def key_at(directory: Path, start: int) -> str:
    db = index(directory)
    try:
        return db.execute("SELECT key FROM entries WHERE start = ?", (start,)).fetchone()[0]
    finally:
        db.close()


def glm_run(capsys, monkeypatch, snapshot, cache_dir, *args, stdin: str = ""):
    """glm-run in this process (a fresh prefix-cache object each time); returns (rc, stdout, stderr)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    capsys.readouterr()
    rc = run_main([str(snapshot), *map(str, args), "--cache-dir", str(cache_dir), "--chunk-tokens", str(CHUNK),
                   "--max-tokens", "6"])
    out, err = capsys.readouterr()
    return rc, out, err


def write_old_layout_index(directory: Path) -> None:
    """Replace the index by one an earlier glmkit wrote (no `tokens` column)."""
    for suffix in ("", "-wal", "-shm"):
        (directory / f"index.sqlite{suffix}").unlink(missing_ok=True)
    db = sqlite3.connect(directory / "index.sqlite")
    db.execute("CREATE TABLE entries (key TEXT PRIMARY KEY, model_hash TEXT NOT NULL, parent TEXT NOT NULL, "
               "start INTEGER, n_tokens INTEGER, file TEXT NOT NULL, nbytes INTEGER, created REAL, "
               "last_access REAL, hits INTEGER)")
    db.execute("INSERT INTO entries VALUES ('k', 'm', 'p', 0, 8, 'photos/cat.jpg', 10, 0, 0, 0)")
    db.commit()
    db.close()


def user_files(directory: Path) -> list[Path]:
    """Files a user keeps in and around a cache directory; the cache must never delete one."""
    blob_dir = next(directory.glob("*/*/*.kvc")).parent
    files = [directory / "photos" / "cat.jpg", directory / "notes.txt", blob_dir / "readme.txt",
             blob_dir / ("0" * 64 + ".kvc.bak"), directory.parent / "beside-the-cache.txt"]
    for path in files:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("mine")
    return files


# ---- 1. an index with an older layout ---------------------------------------------------------------

def test_an_old_layout_index_removes_only_what_the_cache_created(snapshot, tmp_path, capsys, monkeypatch):
    cache = tmp_path / "cache"
    rc, _, err = glm_run(capsys, monkeypatch, snapshot, cache, "--chat", "--session", "work", stdin="Hello there\n")
    assert rc == 0, err
    mine = user_files(cache)
    write_old_layout_index(cache)
    rc, _, err = glm_run(capsys, monkeypatch, snapshot, cache, "--chat", "--session", "work", stdin="And again\n")
    assert rc == 0 and "old layout" in err and len(err.strip().splitlines()) == 1, err
    assert all(p.read_text() == "mine" for p in mine)  # user files, in and around the cache, all kept
    saved = next(cache.glob("sessions/*/work.json")).read_text()  # the saved transcript survived: resumed
    assert saved.count('"role": "user"') == 2


# ---- 2. the index's `file` column -------------------------------------------------------------------

def test_the_file_column_never_chooses_what_is_read_or_deleted(snapshot, tmp_path, capsys, monkeypatch):
    cache = tmp_path / "cache"
    rc, first, _ = glm_run(capsys, monkeypatch, snapshot, cache, "-p", LONG)
    assert rc == 0
    outside, above = tmp_path / "outside.txt", tmp_path / "above.txt"
    for victim in (outside, above):
        victim.write_text("mine")
    db = index(cache)
    db.execute("UPDATE entries SET file = ?", (str(outside),))
    db.close()
    stats = tmp_path / "stats.json"
    rc, again, _ = glm_run(capsys, monkeypatch, snapshot, cache, "-p", LONG, "--stats-json", stats)
    assert rc == 0 and outside.read_text() == "mine"
    assert again == first and json.loads(stats.read_text())["cached_tokens"] > 0  # blobs found by their keys
    db = index(cache)
    db.execute("UPDATE entries SET file = '../above.txt'")
    db.close()
    assert cache_main(["--cache-dir", str(cache), "clear"]) == 0
    assert above.read_text() == "mine" and outside.read_text() == "mine"
    assert not list(cache.glob("*/*/*.kvc"))  # the cache's own blobs are gone


def test_glm_cache_prune_removes_only_stale_files_the_cache_wrote(engine, tmp_path, capsys):
    store(engine, tmp_path, tokens(6, 20))
    blob = next(tmp_path.glob("*/*/*.kvc"))
    stale_temp = blob.with_name(blob.name + ".tmp-123-456")
    user = [tmp_path / "photos" / "2020" / "holiday.kvc", tmp_path / "photos" / "2020" / "draft.tmp-1",
            blob.with_name("notes.kvc.tmp-old"), tmp_path.parent / "next-door.kvc"]
    for path in [stale_temp, *user]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
        os.utime(path, (0, 0))  # older than any stale-temp age
    assert cache_main(["--cache-dir", str(tmp_path), "prune"]) == 0
    assert "1 stale or orphaned" in capsys.readouterr().out
    assert not stale_temp.exists() and all(p.read_text() == "x" for p in user) and blob.exists()


# ---- 3. the index's `tokens` column -----------------------------------------------------------------


@pytest.mark.parametrize("size", ["nan", "inf", "-1", "1e400"])
def test_glm_cache_prune_refuses_a_size_that_is_not_finite_and_positive(engine, tmp_path, capsys, size):
    """NaN and infinity were tracebacks, and a negative size deleted every entry."""
    store(engine, tmp_path, tokens(1, 8))
    with pytest.raises(SystemExit) as exit_info:
        cache_main(["--cache-dir", str(tmp_path), "prune", "--max-gb", size])
    assert exit_info.value.code == 2 and "argument --max-gb: invalid size in GiB" in capsys.readouterr().err
    assert index(tmp_path).execute("SELECT COUNT(*) FROM entries").fetchone()[0] > 0


def test_glm_cache_on_a_cache_dir_that_is_a_file_is_an_error(tmp_path, capsys):
    (tmp_path / "file").write_bytes(b"x")
    assert cache_main(["--cache-dir", str(tmp_path / "file"), "ls"]) == 1
    assert capsys.readouterr().err == f"glm-cache: error: --cache-dir {tmp_path / 'file'}: not a directory\n"

@pytest.mark.parametrize("tier", ["disk", "ram"])
def test_rows_are_never_reused_for_tokens_they_were_not_computed_for(engine, tmp_path, tier, capsys):
    """A row whose `tokens` column claims the tokens of another prompt's tail: a miss, and the entry dropped."""
    a = tokens(1, 22)
    b = a[:16] + tokens(2, 6)
    writer = make_cache(engine, tmp_path)
    writer.store(computed(engine, a), a)
    tail = key_at(tmp_path, 16)
    db = index(tmp_path)
    db.execute("UPDATE entries SET tokens = ? WHERE key = ?", (np.asarray(b[16:], "<i8").tobytes(), tail))
    db.close()
    cache = writer if tier == "ram" else make_cache(engine, tmp_path)
    kv = engine.model.new_cache()
    result = cache.restore(kv, b)
    assert rows_match(engine, kv, b, result.tokens)
    assert result.tokens == 16 and result.discarded == 1
    assert "prefix cache entry of positions 16-21 dropped" in capsys.readouterr().err
    assert index(tmp_path).execute("SELECT COUNT(*) FROM entries WHERE key = ?", (tail,)).fetchone()[0] == 0


# ---- 4. a damaged index.sqlite ----------------------------------------------------------------------

def damage_index(directory: Path, how: str) -> None:
    path = directory / "index.sqlite"
    data = bytearray(path.read_bytes())
    if how == "garbage":
        data = bytearray(b"not a database\x00" * 300)
    else:  # every page after the first (the schema's) overwritten: b-trees malformed, the header intact
        data[4096:] = np.random.default_rng(0).integers(0, 256, len(data) - 4096, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["garbage", "pages"])
def test_a_damaged_index_is_moved_aside_and_rebuilt_from_the_blobs(engine, tmp_path, capsys, how):
    ids = tokens(3, 30)
    store(engine, tmp_path, ids)
    damage_index(tmp_path, how)
    capsys.readouterr()
    cache = make_cache(engine, tmp_path)
    kv = engine.model.new_cache()
    result = cache.restore(kv, ids)  # damage inside the file shows at the first statement that reads it
    err = capsys.readouterr().err
    assert "damaged" in err and len(err.strip().splitlines()) == 1, err
    assert len([p for p in tmp_path.glob("index.sqlite.corrupt-*") if not p.name.endswith(("-wal", "-shm"))]) == 1
    assert result.tokens == 29 and rows_match(engine, kv, ids, 29)  # every entry came back from its blob
    assert cache.db.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_a_missing_index_is_rebuilt_from_the_blobs(engine, tmp_path, capsys):
    ids = tokens(3, 30)
    store(engine, tmp_path, ids)
    (tmp_path / "index.sqlite").unlink()
    kv = engine.model.new_cache()
    assert make_cache(engine, tmp_path).restore(kv, ids).tokens == 29 and rows_match(engine, kv, ids, 29)
    assert capsys.readouterr().err == ""  # nothing was wrong with the blobs: nothing to report


def test_blobs_of_an_earlier_version_are_removed_by_name_and_the_rest_kept(engine, tmp_path, capsys):
    """An index an earlier glmkit wrote (user_version 0) with a blob of the earlier layout: that blob goes, the
    current ones stay indexed, and nothing but the cache's own files is touched."""
    ids = tokens(3, 30)
    store(engine, tmp_path, ids)
    mine = user_files(tmp_path)
    old = blob_of(tmp_path, key_at(tmp_path, 24))
    body = bytearray(old.read_bytes()[:-32])
    body[len(MAGIC):len(MAGIC) + 4] = struct.pack("<I", 1)
    old.write_bytes(bytes(body) + hashlib.sha256(bytes(body)).digest())
    index(tmp_path).execute("PRAGMA user_version = 0")
    capsys.readouterr()
    cache = make_cache(engine, tmp_path)
    err = capsys.readouterr().err
    assert "removed 1 blobs" in err and len(err.strip().splitlines()) == 1, err
    assert not old.exists() and all(p.read_text() == "mine" for p in mine)
    kv = engine.model.new_cache()
    assert cache.restore(kv, ids).tokens == 24 and rows_match(engine, kv, ids, 24)


@pytest.mark.parametrize("command", ["stats", "prune", "ls"])
def test_glm_cache_on_a_damaged_index_rebuilds_it(engine, tmp_path, capsys, command):
    store(engine, tmp_path, tokens(3, 30))
    damage_index(tmp_path, "pages")
    assert cache_main(["--cache-dir", str(tmp_path), command]) == 0
    assert cache_main(["--cache-dir", str(tmp_path), "stats"]) == 0
    assert "entries 4 " in capsys.readouterr().out  # 3 chunks and a tail, rebuilt from their blobs


# ---- 5. hostile entries -----------------------------------------------------------------------------

def forge(path: Path, edit=lambda payload: payload, edit_header=lambda header: None) -> None:
    """Rewrite a blob's payload with `edit(payload) -> payload` (and its header dict in place with `edit_header`),
    fixing up everything a forger can: the header's payload size and both checksums (a header without
    `payload_bytes` has no checksum of its own)."""
    data = path.read_bytes()[:-32]
    version, head_len = struct.unpack_from("<II", data, len(MAGIC))
    head_end = len(MAGIC) + 8 + head_len
    header = json.loads(data[len(MAGIC) + 8:head_end])
    if "payload_bytes" in header:
        payload = edit(data[head_end + 32:])
        header["payload_bytes"] = len(payload)
        edit_header(header)
        head = json.dumps(header, separators=(",", ":")).encode()
        span = MAGIC + struct.pack("<II", version, len(head)) + head
        body = span + hashlib.sha256(span).digest() + payload
    else:
        body = data[:head_end] + edit(data[head_end:])
    path.write_bytes(body + hashlib.sha256(body).digest())


def claim_a_huge_size(frame: bytes) -> bytes:
    """The same zstd blocks under a frame header that declares 1 TiB of content."""
    fhd = frame[4]
    fcs_size = {0: 1 if fhd & 0x20 else 0, 1: 2, 2: 4, 3: 8}[fhd >> 6]
    header_len = 5 + (0 if fhd & 0x20 else 1) + (0, 1, 2, 4)[fhd & 3] + fcs_size
    dict_id = frame[5 + (0 if fhd & 0x20 else 1):header_len - fcs_size]
    return (frame[:4] + bytes([0xC0 | (fhd & 0x07), 7 << 3]) + dict_id + struct.pack("<Q", 1 << 40)
            + frame[header_len:])


def make_hostile(directory: Path, kind: str) -> Path:
    """Damage one entry of a stored 30-token prompt (`kind`: see HOSTILE); returns the first chunk's blob path."""
    first, tail = key_at(directory, 0), key_at(directory, 24)
    path = blob_of(directory, first)
    if kind in ("dev-zero", "fifo", "directory"):
        path.unlink()
        {"dev-zero": lambda: path.symlink_to("/dev/zero"), "fifo": lambda: os.mkfifo(path),
         "directory": lambda: path.mkdir()}[kind]()
    elif kind == "huge-frame":
        forge(path, claim_a_huge_size)
    else:
        column, value = {"empty-file": ("file", ""), "garbage-tokens": ("tokens", "abc"),
                         "odd-tokens": ("tokens", b"1234567"), "huge-n-tokens": ("n_tokens", 1 << 40)}[kind]
        db = index(directory)
        db.execute(f"UPDATE entries SET {column} = ? WHERE key = ?", (value, tail if "tokens" in kind else first))
        db.close()
    return path


# tokens each case restores of the 29 a 30-token prompt allows: a damaged first chunk stops reuse at 0,
# a damaged tail at 24; an empty `file` column changes nothing (paths come from the key)
HOSTILE = {"dev-zero": 0, "fifo": 0, "directory": 0, "huge-frame": 0, "empty-file": 29, "garbage-tokens": 24,
           "odd-tokens": 24, "huge-n-tokens": 24}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_entries_are_misses(engine, tmp_path, kind):
    ids = tokens(4, 30)
    store(engine, tmp_path, ids)
    path = make_hostile(tmp_path, kind)
    kv = engine.model.new_cache()
    with guarded():
        result = make_cache(engine, tmp_path).restore(kv, ids)
    assert result.tokens == HOSTILE[kind] and rows_match(engine, kv, ids, result.tokens)
    if kind == "directory":
        assert path.is_dir()  # a directory is never the cache's to delete, whatever its name


def test_storing_where_a_directory_took_a_blobs_place_is_a_notice(engine, tmp_path, capsys):
    ids = tokens(7, 20)
    store(engine, tmp_path, ids)
    path = blob_of(tmp_path, key_at(tmp_path, 0))
    path.unlink()
    path.mkdir()
    index(tmp_path).execute("DELETE FROM entries")
    cache = make_cache(engine, tmp_path)
    capsys.readouterr()
    assert cache.store(computed(engine, ids), ids) == 0
    err = capsys.readouterr().err
    assert "not stored" in err and len(err.strip().splitlines()) == 1 and path.is_dir(), err
    assert not list(path.parent.glob("*.tmp-*"))  # no temp file left behind


def test_stats_never_count_a_negative_size(engine, tmp_path, capsys):
    store(engine, tmp_path, tokens(5, 30))
    db = index(tmp_path)
    real = db.execute("SELECT SUM(nbytes) FROM entries WHERE start > 0").fetchone()[0]
    db.execute("UPDATE entries SET nbytes = -76000000000 WHERE start = 0")
    db.close()
    capsys.readouterr()
    assert cache_main(["--cache-dir", str(tmp_path), "stats"]) == 0
    out, err = capsys.readouterr()
    assert "entries 3 " in out and f"size {real / 1e6:.1f} MB" in out, out
    assert len(err.strip().splitlines()) <= 1  # at most a one-line notice about the damaged row


# ---- 6. session names and file modes ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["x" * 300, "a b", "tab\there", "../up", "a/b", ".hidden"])
def test_a_bad_session_name_is_a_one_line_error(snapshot, tmp_path, capsys, monkeypatch, name):
    rc, _, err = glm_run(capsys, monkeypatch, snapshot, tmp_path / "cache", "--chat", "--session", name,
                         stdin="Hello\n")
    assert rc == 1 and err.startswith("glm-run: error: --session") and len(err.strip().splitlines()) == 1, err


def test_cache_and_session_files_are_private(snapshot, tmp_path, capsys, monkeypatch):
    old = os.umask(0o022)
    try:
        cache = tmp_path / "cache" / "nested"
        rc, _, err = glm_run(capsys, monkeypatch, snapshot, cache, "--chat", "--session", "work", stdin="Hello\n")
        assert rc == 0, err
        rc, _, err = glm_run(capsys, monkeypatch, snapshot, cache, "-p", "def main():\n    return 42\n" * 4,
                             "--raw-prompt", "--reuse", "approximate")  # the similar-chunk index and its sidecar
    finally:
        os.umask(old)
    assert rc == 0, err
    paths = [cache.parent, *cache.parent.rglob("*")]
    assert any(p.name == "work.json" for p in paths) and any(p.suffix == ".kvc" for p in paths)
    assert {p.suffix for p in paths if p.parent.name == "ann"} == {".hnsw", ".json"}
    for path in paths:
        mode = stat.S_IMODE(path.lstat().st_mode)
        assert mode & 0o077 == 0, f"{path} is {oct(mode)}"


# ---- 7. one rope formula, no write-only state -------------------------------------------------------

def test_rerotation_uses_the_models_rope_angles(monkeypatch):
    calls = []

    def spy(positions, dim, theta):
        calls.append((int(positions[0]), len(positions), dim))
        return rope_cos_sin(positions, dim, theta)

    monkeypatch.setattr(prefix_cache, "rope_cos_sin", spy)
    raw = np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32)
    roped = apply_rope(raw, *rope_cos_sin(np.arange(3, 9), 8, 1e4))
    moved = prefix_cache.rerotate(roped, 3, 40, 1e4)
    assert np.abs(moved - apply_rope(raw, *rope_cos_sin(np.arange(40, 46), 8, 1e4))).max() < 1e-5
    assert sorted(calls) == [(3, 6, 8), (40, 6, 8)]


def _reads(tree: ast.AST, owner: str) -> set[str]:
    """Attribute names read (not as the object of an assignment or augmented assignment) from an expression
    named `owner` or ending in `cache` (how the package names a PrefixCache: `cache`, `self.prefix_cache`)."""
    written_through = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            while isinstance(target, ast.Attribute | ast.Subscript):
                target = target.value
                written_through.add(id(target))
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Load) and id(node) not in written_through
            and (ast.unparse(node.value) == owner or ast.unparse(node.value).endswith("cache"))}


def test_the_prefix_cache_keeps_no_write_only_state():
    """Every attribute a PrefixCache sets is read somewhere in the package (state nothing reads is dead)."""
    package = Path(prefix_cache.__file__).parent.parent
    tree = ast.parse(Path(prefix_cache.__file__).read_text())
    reads = _reads(tree, "self").union(*(_reads(ast.parse(p.read_text()), "") for p in package.rglob("*.py")))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PrefixCache")
    assigned = {t.attr for node in ast.walk(cls) if isinstance(node, ast.Assign) for t in node.targets
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    assert assigned and not assigned - reads, assigned - reads
