"""Seeded, bounded fuzzing of the prefix cache: random damage to index rows, the index file and the blobs,
then the cache's real paths (open, restore, find_runs + load_piece, store, glm-cache ls/stats/prune/clear).

Every case must end in correct reuse or a miss / clean one-line error: never a traceback, a hang, an
allocation past a cap, a row restored that differs from the row computed without the cache for that token,
or a deleted file the cache did not create (sentinels sit in the cache directory and around it). The outcome
table prints with `pytest -s`."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import sqlite3
import traceback
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from glmkit.cache.prefix_cache import read_blob
from glmkit.cli.cache import main as cache_main
from tests.test_cache_defects import (
    Hang,
    claim_a_huge_size,
    computed,
    forge,
    guarded,
    make_cache,
    rows_match,
    store,
    tokens,
)

SEED = 20240601
CASES = 240
COLUMNS = ("key", "model_hash", "parent", "start", "n_tokens", "tokens", "file", "nbytes", "created",
           "last_access", "hits", "content", "root", "emb")
BAD = ("traceback", "hang", "memory blow-up", "silent wrong", "data lost")


class SilentWrong(Exception):
    """Rows came back that differ from the rows computed without the cache."""


class DataLost(Exception):
    """A file the cache did not create is gone or changed."""


class CleanError(Exception):
    """A command ended in a one-line error (what a user sees from glm-run or glm-cache)."""


@pytest.fixture(scope="module")
def world(engine, tmp_path_factory):
    """A cache directory holding three prompts' chunks, their rows computed without the cache, and every stored
    chunk's pristine rows by key."""
    template = tmp_path_factory.mktemp("fuzz-template") / "cache"
    a = tokens(101, 30)
    prompts = [a, a[:16] + tokens(102, 14), tokens(103, 21)]
    for ids in prompts:
        store(engine, template, ids)
    cache = make_cache(engine, template)
    pristine = {}
    for key, start, n in cache.db.execute("SELECT key, start, n_tokens FROM entries").fetchall():
        path = next(template.glob(f"*/{key[:2]}/{key}.kvc"))
        pristine[key] = read_blob(path, engine.model_hash, cache.numerics, cache.expected_shapes(n, start))
    cache.db.close()
    return template, prompts, [computed(engine, ids) for ids in prompts], pristine


# ---- damage ---------------------------------------------------------------------------------------

def random_value(rng, db, home: Path):
    """Something SQL accepts in any column: wrong types, out-of-range numbers, paths, other rows' values."""
    other = db.execute(f"SELECT {COLUMNS[rng.integers(len(COLUMNS))]} FROM entries ORDER BY random() LIMIT 1")
    other = other.fetchone()
    pool = [None, 0, -1, -76_000_000_000, 1 << 62, int(rng.integers(-1 << 40, 1 << 40)), float("inf"), 1.5, "",
            "abc", "../outside.txt", str(home / "outside.txt"), "/dev/zero", bytes(rng.bytes(int(rng.integers(0, 80)))),
            os.urandom(32).hex(), b"\x00" * 7, np.asarray(tokens(int(rng.integers(1 << 20)), 8), "<i8").tobytes(),
            other[0] if other else None]
    return pool[rng.integers(len(pool))]


def regular(path: Path) -> bool:
    """A plain file (the harness itself must not open a FIFO or follow a link an earlier damage left)."""
    return path.is_file() and not path.is_symlink()


def damage_rows(rng, cache_dir: Path, home: Path) -> str:
    if not regular(cache_dir / "index.sqlite"):
        return "row-skipped"
    db = sqlite3.connect(cache_dir / "index.sqlite", isolation_level=None)
    try:
        rowids = [r for (r,) in db.execute("SELECT rowid FROM entries")]
        what = rng.choice(["update", "update", "update", "swap", "insert", "delete"])
        rowid = int(rng.choice(rowids)) if rowids else 0
        column = COLUMNS[rng.integers(len(COLUMNS))]
        with contextlib.suppress(sqlite3.IntegrityError):  # a primary-key or NOT NULL clash: that edit is skipped
            if what == "update":
                db.execute(f"UPDATE entries SET {column} = ? WHERE rowid = ?", (random_value(rng, db, home), rowid))
            elif what == "swap":
                a, b = (int(x) for x in rng.choice(rowids, 2))
                va = db.execute(f"SELECT {column} FROM entries WHERE rowid = ?", (a,)).fetchone()[0]
                vb = db.execute(f"SELECT {column} FROM entries WHERE rowid = ?", (b,)).fetchone()[0]
                db.execute(f"UPDATE entries SET {column} = ? WHERE rowid = ?", (vb, a))
                db.execute(f"UPDATE entries SET {column} = ? WHERE rowid = ?", (va, b))
            elif what == "insert":
                row = list(db.execute("SELECT * FROM entries ORDER BY random() LIMIT 1").fetchone())
                for i in rng.choice(len(COLUMNS), int(rng.integers(1, 4)), replace=False):
                    row[i] = random_value(rng, db, home)
                row[0] = os.urandom(32).hex() if rng.random() < 0.5 else row[0]
                db.execute(f"INSERT OR REPLACE INTO entries VALUES ({','.join('?' * len(row))})", row)
            else:
                db.execute("DELETE FROM entries WHERE rowid = ?", (rowid,))
        return f"row-{what}-{column}"
    finally:
        db.close()


def damage_index_file(rng, cache_dir: Path, home: Path) -> str:
    path = cache_dir / "index.sqlite"
    if not regular(path):
        return "index-skipped"
    what = rng.choice(["flip", "truncate", "garbage", "delete", "directory", "fifo", "symlink", "user_version",
                       "old-layout"])
    if what == "flip":
        data = bytearray(path.read_bytes())
        for _ in range(int(rng.integers(1, 16))):
            data[rng.integers(len(data))] ^= 1 << int(rng.integers(8))
        path.write_bytes(bytes(data))
    elif what == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[:int(rng.integers(len(data)))])
    elif what == "garbage":
        path.write_bytes(rng.bytes(int(rng.integers(1, 20000))))
    elif what == "user_version":
        db = sqlite3.connect(path)
        db.execute(f"PRAGMA user_version = {int(rng.integers(-5, 5))}")
        db.close()
    elif what == "old-layout":
        db = sqlite3.connect(path)
        db.execute("ALTER TABLE entries DROP COLUMN tokens")
        db.close()
    else:
        path.unlink()
        if what == "directory":
            path.mkdir()
            (path / "inner.txt").write_text("sentinel")  # a tree under the index's name: never deleted
        elif what == "fifo":
            os.mkfifo(path)
        elif what == "symlink":
            path.symlink_to(home / "outside.txt")
    return f"index-{what}"


def damage_blob(rng, cache_dir: Path, home: Path) -> str:
    blobs = sorted(p for p in cache_dir.glob("*/*/*.kvc")
                   if regular(p) and not p.parent.is_symlink()  # not a user's look-alike, here or elsewhere
                   and re.fullmatch("[0-9a-f]{16}", p.parent.parent.name))
    if not blobs:
        return "blob-skipped"
    path = blobs[rng.integers(len(blobs))]
    what = rng.choice(["flip", "truncate", "append", "swap", "copy", "dev-zero", "symlink-out", "fifo", "directory",
                       "empty", "huge-frame", "forge-tokens", "forge-start", "forge-dims", "forge-payload-size",
                       "forge-key", "key-dir-symlink", "key-dir-file"])
    if what in ("flip", "truncate", "append"):
        data = bytearray(path.read_bytes())
        if what == "flip":
            for _ in range(int(rng.integers(1, 8))):
                data[rng.integers(len(data))] ^= 1 << int(rng.integers(8))
        elif what == "truncate":
            data = data[:int(rng.integers(len(data)))]
        else:
            data += rng.bytes(int(rng.integers(1, 5000)))
        path.write_bytes(bytes(data))
    elif what in ("swap", "copy"):
        other = blobs[rng.integers(len(blobs))]
        if what == "swap" and other != path:
            tmp = path.with_name("swap")
            path.rename(tmp)
            other.rename(path)
            tmp.rename(other)
        else:
            shutil.copyfile(other, path)
    elif what in ("dev-zero", "symlink-out", "fifo", "directory", "empty"):
        path.unlink()
        if what == "dev-zero":
            path.symlink_to("/dev/zero")
        elif what == "symlink-out":
            path.symlink_to(home / "outside.txt")
        elif what == "fifo":
            os.mkfifo(path)
        elif what == "directory":
            path.mkdir()
            (path / "inner.txt").write_text("sentinel")
        else:
            path.write_bytes(b"")
    elif what == "huge-frame":
        forge(path, claim_a_huge_size)
    elif what == "key-dir-symlink":  # the key directory now leads outside, to look-alike files of the user's
        elsewhere = home / "elsewhere"
        for blob in path.parent.iterdir():
            (elsewhere / blob.name).write_text("sentinel")
        shutil.rmtree(path.parent)
        path.parent.symlink_to(elsewhere)
    elif what == "key-dir-file":
        shutil.rmtree(path.parent)
        path.parent.write_text("sentinel")
    else:
        def edit(header):
            if what == "forge-tokens":
                header["tokens"] = tokens(int(rng.integers(1 << 20)), len(header["tokens"]))
            elif what == "forge-start":
                header["start"] = int(rng.integers(0, 64))
            elif what == "forge-dims":
                header["arrays"] = [[name, [1 << 30, dims[1]]] for name, dims in header["arrays"]]
            elif what == "forge-payload-size":
                header["payload_bytes"] = 1 << 40
            else:
                header["key"] = os.urandom(32).hex()
        forge(path, edit_header=edit)
    return f"blob-{what}"


def sentinels(home: Path, cache_dir: Path, model_dir: str) -> dict[Path, str]:
    """User files in and around the cache directory (their contents, to compare afterwards)."""
    files = {home / "outside.txt": "outside", cache_dir / "photos" / "cat.jpg": "cat",
             cache_dir / "photos" / "00" / (("0" * 64) + ".kvc"): "look-alike in a user folder",
             cache_dir / "sessions" / model_dir / "work.json": '{"messages": []}',
             cache_dir / model_dir / "readme.txt": "notes", cache_dir / "index.sqlite.bak": "user backup"}
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (home / "elsewhere").mkdir()
    return files


def surviving(home: Path, files: dict[Path, str]) -> None:
    """Raise DataLost unless every user file is intact (inner sentinels of trees under cache names included)."""
    for path, text in files.items():
        if not path.is_file() or path.read_text() != text:
            raise DataLost(str(path))
    for path in [*home.rglob("inner.txt"), *(home / "elsewhere").iterdir()]:
        if path.read_text() != "sentinel":
            raise DataLost(str(path))


def counted_sentinels(home: Path) -> int:
    return sum(1 for _ in home.rglob("inner.txt")) + sum(1 for _ in (home / "elsewhere").iterdir())


# ---- the cache's paths ------------------------------------------------------------------------------

def glm_cache(*argv: str) -> None:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cache_main(list(argv))
    lines = err.getvalue().strip().splitlines()
    if rc == 1 and len(lines) == 1 and lines[0].startswith("glm-cache: error:"):
        raise CleanError(lines[0])
    if rc != 0 or any(not line.startswith("glmkit: ") for line in lines):
        raise AssertionError(f"glm-cache {argv[-1]}: rc {rc}: {err.getvalue()!r}")
    if "-" in out.getvalue().replace("--", "").split("(")[0]:
        raise SilentWrong(f"glm-cache {argv[-1]} printed a negative number: {out.getvalue()!r}")


def exercise(engine, cache_dir: Path, prompts, exact, pristine) -> int:
    """Every lookup path on a (damaged) cache; returns the tokens correctly reused. Raises SilentWrong."""
    reused = 0
    with contextlib.redirect_stderr(io.StringIO()):
        cache = make_cache(engine, cache_dir)
        for ids, want in zip(prompts, exact, strict=True):
            kv = engine.model.new_cache()
            n = cache.restore(kv, ids).tokens
            if not rows_match(engine, kv, ids, n, want):
                raise SilentWrong(f"restore: {n} rows")
            reused += n
            for run in cache.find_runs(ids, 0, len(ids) - 1):
                q = run.start
                for piece in run.pieces:
                    rows = cache.load_piece(piece, ids[q:q + piece.count])
                    if rows is not None:
                        ref = pristine.get(piece.key)
                        if ref is None or ref.tokens[piece.offset:piece.offset + piece.count] != ids[q:q + piece.count]:
                            raise SilentWrong(f"load_piece: rows of an entry never stored ({piece.key[:12]})")
                        for name, array in rows.items():
                            if not np.array_equal(array, ref.arrays[name][piece.offset:piece.offset + piece.count]):
                                raise SilentWrong(f"load_piece: {name} differs")
                    q += piece.count
        for ids, want in zip(prompts, exact, strict=True):
            cache.store(want, ids)
            kv = engine.model.new_cache()
            n = cache.restore(kv, ids).tokens
            if not rows_match(engine, kv, ids, n, want):
                raise SilentWrong(f"restore after store: {n} rows")
        cache.db.close()
    return reused


def run_case(engine, world, case: int, root: Path, full_reuse: int) -> tuple[str, list[str]]:
    """One seeded case: copy the template, damage it 1-3 times, run every path; (outcome, damage done)."""
    template, prompts, exact, pristine = world
    rng = np.random.default_rng([SEED, case])
    home = root / f"case-{case}"
    cache_dir = home / "cache"
    shutil.copytree(template, cache_dir, symlinks=True)
    files = sentinels(home, cache_dir, engine.model_hash[:16])
    done = []
    for _ in range(int(rng.integers(1, 4))):
        damage = rng.choice([damage_rows, damage_rows, damage_blob, damage_blob, damage_index_file])
        try:
            done.append(damage(rng, cache_dir, home))
        except (OSError, ValueError, sqlite3.DatabaseError):
            pass  # an earlier damage took what this one needed (the index or a blob): the case goes on without it
    before = counted_sentinels(home)
    clean_errors = 0
    try:
        with guarded(seconds=10):
            reused = exercise(engine, cache_dir, prompts, exact, pristine)
            for command in ("ls", "stats", "prune", "clear"):
                try:
                    glm_cache("--cache-dir", str(cache_dir), command)
                except CleanError:
                    clean_errors += 1
        surviving(home, files)
        if counted_sentinels(home) != before:
            raise DataLost("a file inside a tree under a cache name")
    except Hang:
        return "hang", done
    except MemoryError:
        return "memory blow-up", done
    except SilentWrong as e:
        print(f"case {case} {done}: silent wrong: {e}")
        return "silent wrong", done
    except DataLost as e:
        print(f"case {case} {done}: data lost: {e}")
        return "data lost", done
    except Exception as e:  # noqa: BLE001 - anything else escaping the cache is a traceback to a user
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "/glmkit/" in f.filename]
        where = f"{frames[-1].filename.split('glmkit/')[-1]}:{frames[-1].lineno}" if frames else "?"
        print(f"case {case} {done}: traceback at {where}: {type(e).__name__}: {e}")
        return "traceback", done
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(home)
    # all the undamaged cache would give: correct reuse; less (entries refused, dropped) or an error: a miss
    return ("correct reuse" if reused == full_reuse and not clean_errors else "clean error/miss"), done


def test_fuzz_the_prefix_cache(engine, world, tmp_path):
    template, prompts, exact, pristine = world
    scratch = tmp_path / "undamaged"
    shutil.copytree(template, scratch)
    full_reuse = exercise(engine, scratch, prompts, exact, pristine)
    results = [run_case(engine, world, case, tmp_path, full_reuse) for case in range(CASES)]
    outcomes = Counter(outcome for outcome, _ in results)
    columns = ("tried", "correct reuse", "clean error/miss", *BAD)
    counts = {"tried": CASES, **{c: outcomes.get(c, 0) for c in columns[1:]}}
    print("\n" + "  ".join(f"{c:>{max(len(c), 5)}}" for c in columns))
    print("  ".join(f"{counts[c]:>{max(len(c), 5)}}" for c in columns))
    kinds = Counter(kind for _, done in results for kind in done)
    print("damage done:", ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items())))
    assert sum(counts[c] for c in columns[1:]) == CASES
    assert counts["clean error/miss"] > 0 and counts["correct reuse"] > 0  # the damage reached the cache, not all
    assert all(counts[c] == 0 for c in BAD), counts
