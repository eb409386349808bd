"""`glm-cache ls|stats|prune|clear`: see and manage the on-disk prefill cache."""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import time
from pathlib import Path

from glmkit.cache.prefix_cache import (
    DEFAULT_MAX_BYTES,
    VALID_ENTRY,
    cache_files,
    damaged_entries,
    default_cache_dir,
    drop_damaged_entries,
    is_index_damage,
    open_index,
    prune,
    recover_index,
    remove_cache_file,
)
from glmkit.errors import GlmkitError
from glmkit.format.manifest import Manifest
from glmkit.units import parse_gigabytes

STALE_TEMP_SECONDS = 3600


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="glm-cache", description=__doc__)
    p.add_argument("--cache-dir", type=Path, default=None, help=f"cache directory (default {default_cache_dir()})")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("ls", help="one line per model: entries, size, last use")
    stats = sub.add_parser("stats", help="entries, tokens, size and hit counts")
    stats.add_argument("--model", help="only this snapshot (a converted container directory)")
    prune_p = sub.add_parser("prune", help="evict least-recently-used entries down to a size; drop stale temp files")
    prune_p.add_argument("--max-gb", type=parse_gigabytes, default=DEFAULT_MAX_BYTES / (1 << 30),
                         help="size to prune to")
    prune_p.add_argument("--model", help="only entries of this snapshot")
    clear = sub.add_parser("clear", help="delete every entry (of one model with --model)")
    clear.add_argument("--model", help="only this snapshot")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    directory = args.cache_dir or default_cache_dir()
    try:
        model_hash = Manifest.read(Path(args.model)).model_hash if getattr(args, "model", None) else None
        if directory.exists() and not directory.is_dir():
            raise GlmkitError(f"--cache-dir {directory}: not a directory")
        if not os.path.lexists(directory / "index.sqlite"):
            print(f"{directory}: empty (no cache yet)")
            return 0
        db = open_index(directory)
        try:
            _run(args, db, directory, model_hash)
        except sqlite3.DatabaseError as e:  # damage found past the open: replace the index, then once more
            if not is_index_damage(e):
                raise
            _run(args, recover_index(directory, e), directory, model_hash)
    except GlmkitError as e:
        print(f"glm-cache: error: {e}", file=sys.stderr)
        return 1
    except (OSError, sqlite3.Error) as e:
        print(f"glm-cache: error: --cache-dir {directory}: {e}", file=sys.stderr)
        return 1
    return 0


def _run(args: argparse.Namespace, db: sqlite3.Connection, directory: Path, model_hash: str | None) -> None:
    """One command on an open index (rows the cache would not write are never counted; prune and clear drop
    them)."""
    if args.command == "ls":
        rows = db.execute(f"SELECT model_hash, COUNT(*), TOTAL(nbytes), MAX(last_access) FROM entries "
                          f"WHERE {VALID_ENTRY} GROUP BY model_hash ORDER BY MAX(last_access) DESC").fetchall()
        for h, count, nbytes, last in rows:
            print(f"{h[:16]}  {count:6d} entries  {nbytes / 1e6:10.1f} MB  last used {_ago(last)}")
    elif args.command == "stats":
        where, params = (" AND model_hash = ?", (model_hash,)) if model_hash else ("", ())
        count, tokens, nbytes, hits = db.execute(
            f"SELECT COUNT(*), TOTAL(n_tokens), TOTAL(nbytes), TOTAL(hits) FROM entries WHERE {VALID_ENTRY}{where}",
            params).fetchone()
        damaged = damaged_entries(db)
        print(f"entries {count}  tokens {tokens:.0f}  size {nbytes / 1e6:.1f} MB  hits {hits:.0f}  "
              + (f"damaged {damaged} (prune drops them)  " if damaged else "") + f"({directory})")
    elif args.command == "prune":
        removed = drop_damaged_entries(db, directory) + prune(db, directory, int(args.max_gb * (1 << 30)), model_hash)
        stale = _remove_stale_files(db, directory)
        print(f"removed {removed} entries and {stale} stale or orphaned files")
    elif args.command == "clear":
        removed = drop_damaged_entries(db, directory) + prune(db, directory, 0, model_hash)
        print(f"removed {removed} entries")


def _remove_stale_files(db, directory: Path) -> int:
    """Temp files left by killed writers, and blobs no index row names (a kill between rename and insert); only
    files the cache's naming says it wrote are looked at."""
    known = {(str(h)[:16], key) for h, key in db.execute("SELECT model_hash, key FROM entries")}
    removed = 0
    now = time.time()
    for path, key, temp in cache_files(directory):
        try:
            age = now - path.lstat().st_mtime
        except OSError:
            continue
        stale = age > STALE_TEMP_SECONDS if temp else (path.parent.parent.name, key) not in known
        if stale and remove_cache_file(path):
            removed += 1
    return removed


def _ago(timestamp: float) -> str:
    seconds = max(time.time() - timestamp, 0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


if __name__ == "__main__":
    sys.exit(main())
