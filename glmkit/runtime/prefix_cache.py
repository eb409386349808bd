"""Versioned on-disk KV/prefill cache: exact prefix reuse across requests and processes.

A token sequence is cut into chunks at fixed absolute boundaries (every `chunk_tokens`); the end of a
request adds one "tail" chunk hanging off the last full chunk. A chunk's key is
`sha256(parent_key || token ids)`, rooted in the model hash and the backend's numerics version, so an
entry can only be used by the same converted model, the same kernels and the same token prefix.

A blob holds the chunk's KV rows for every main layer (`kv_lat`, `k_rot`, `index_k` on indexer
layers) and, when the model has an MTP layer, the MTP rows one position earlier (the MTP row at
position i pairs h_i with token i+1, so it belongs with the chunk holding token i+1).

Blob file: `MAGIC | u32 version | u32 header length | header JSON | zstd payload | sha256 of all before`.
Written to a temp name, fsynced, renamed; only then recorded in the sqlite index. Anything that fails
a check (magic, version, checksum, model, numerics, dims) is discarded and recomputed, never used.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zstandard

from glmkit.formats.config import ModelConfig
from glmkit.runtime.kv_cache import KVCache
from glmkit.runtime.model import GlmMoeDsaModel

MAGIC = b"GLMKVC\x00\x01"
BLOB_VERSION = 1
DEFAULT_CHUNK_TOKENS = 32
DEFAULT_MAX_BYTES = 20 << 30
MAX_HEADER_BYTES = 1 << 20
RAM_TIER_BYTES = 512 << 20
_FIELDS = ("kv_lat", "k_rot", "index_k")


def default_cache_dir() -> Path:
    """`$GLMKIT_CACHE_DIR`, else `$XDG_CACHE_HOME/glmkit/prefix`, else `~/.cache/glmkit/prefix`."""
    if env := os.environ.get("GLMKIT_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "glmkit" / "prefix"


def chunk_key(parent: str, tokens: list[int]) -> str:
    return hashlib.sha256(parent.encode() + np.asarray(tokens, dtype="<i8").tobytes()).hexdigest()


@dataclass
class Chunk:
    """KV rows of tokens [start, start + len(tokens)); arrays named `{layer}.{field}`."""

    key: str
    parent: str
    start: int
    tokens: list[int]
    arrays: dict[str, np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def prefix(self, n: int, mtp_layer: int) -> Chunk:
        """The first `n` tokens' rows (MTP rows sit one position earlier: one fewer when start == 0)."""
        mtp_rows = n - (1 if self.start == 0 else 0)
        arrays = {name: a[:mtp_rows if int(name.split(".")[0]) >= mtp_layer else n]
                  for name, a in self.arrays.items()}
        return Chunk(self.key, self.parent, self.start, self.tokens[:n], arrays)


@dataclass
class RestoreResult:
    tokens: int = 0  # prefix tokens whose KV rows were restored
    from_ram: int = 0
    from_disk: int = 0
    discarded: int = 0  # entries that failed a check and were deleted


@dataclass
class CacheCounters:
    lookups: int = 0
    stored_chunks: int = 0
    stored_bytes: int = 0
    last_restore: RestoreResult = field(default_factory=RestoreResult)


class PrefixCache:
    """One model's view of the shared cache directory (blobs + sqlite index)."""

    def __init__(self, directory: str | Path, model_hash: str, config: ModelConfig, numerics: str,
                 has_mtp: bool, index_layers: list[int], chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 max_bytes: int = DEFAULT_MAX_BYTES):
        self.directory = Path(directory)
        self.model_hash = model_hash
        self.config = config
        self.numerics = numerics
        self.has_mtp = has_mtp
        self.index_layers = set(index_layers)
        self.chunk_tokens = chunk_tokens
        self.max_bytes = max_bytes
        # MTP and non-MTP runs store different row sets, so they get separate chains
        self.root = hashlib.sha256(
            f"glmkit-prefix|{BLOB_VERSION}|{model_hash}|{numerics}|mtp={has_mtp}".encode()).hexdigest()
        self.counters = CacheCounters()
        self._ram: OrderedDict[str, Chunk] = OrderedDict()
        self._ram_bytes = 0
        self._loaded_from_disk: set[str] = set()  # keys `_load` just read from disk (for the counters)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.db = open_index(self.directory)

    @classmethod
    def for_model(cls, model: GlmMoeDsaModel, model_hash: str, directory: str | Path, use_mtp: bool,
                  chunk_tokens: int = DEFAULT_CHUNK_TOKENS, max_bytes: int = DEFAULT_MAX_BYTES) -> PrefixCache:
        """The cache for a model as it runs: its backend's numerics, whether MTP rows are kept."""
        index_layers = [i for i, layer in enumerate(model.new_cache().layers) if layer.has_index]
        return cls(directory, model_hash, model.config, model.backend.numerics, use_mtp and model.has_mtp,
                   index_layers, chunk_tokens, max_bytes)

    # ---- layout of one chunk's arrays ----

    def expected_shapes(self, n_tokens: int, start: int) -> dict[str, tuple[int, int]]:
        cfg = self.config
        widths = {"kv_lat": cfg.kv_lora_rank, "k_rot": cfg.qk_rope_head_dim, "index_k": cfg.index_head_dim}
        shapes = {}
        for layer in range(cfg.num_hidden_layers):
            for name in _FIELDS:
                if name != "index_k" or layer in self.index_layers:
                    shapes[f"{layer}.{name}"] = (n_tokens, widths[name])
        if self.has_mtp:
            mtp = cfg.num_hidden_layers
            rows = n_tokens - (1 if start == 0 else 0)  # MTP rows [start-1, start+n-1) clipped at 0
            for name in _FIELDS:
                if name != "index_k" or mtp in self.index_layers:
                    shapes[f"{mtp}.{name}"] = (rows, widths[name])
        return shapes

    # ---- lookup and restore ----

    def restore(self, kv: KVCache, tokens: list[int]) -> RestoreResult:
        """Append to an EMPTY `kv` the longest cached prefix of `tokens`, leaving at least the last token
        for the caller to compute (it needs its logits). With MTP the main layers are cut back one token
        behind the MTP rows, so recomputing that token also yields the hidden state the MTP layer needs."""
        assert kv.length == 0
        self.counters.lookups += 1
        result = RestoreResult()
        limit = len(tokens) if self.has_mtp else len(tokens) - 1
        parent, pos = self.root, 0
        chunks: list[Chunk] = []
        while pos + self.chunk_tokens <= limit:
            key = chunk_key(parent, tokens[pos:pos + self.chunk_tokens])
            chunk = self._load(key, pos, self.chunk_tokens, result)
            if chunk is None:
                break
            self._count(result, key, self.chunk_tokens)
            chunks.append(chunk)
            parent, pos = key, pos + self.chunk_tokens
        tail = self._best_tail(parent, pos, tokens[pos:limit], result)
        if tail is not None:
            chunks.append(tail)
        for chunk in chunks:
            self._append_rows(kv, chunk)
        if chunks and self.has_mtp:
            kv.truncate(kv.layer(self.config.num_hidden_layers).length)
        result.tokens = kv.length
        self.counters.last_restore = result
        return result

    def _best_tail(self, parent: str, pos: int, remaining: list[int], result: RestoreResult) -> Chunk | None:
        """The stored chunk under `parent` sharing the longest prefix with `remaining`, cut to that prefix.

        KV rows of position i depend only on tokens <= i, so the first n rows of a longer chunk are exact.
        """
        best, best_n = None, 0
        for key, blob in self.db.execute("SELECT key, tokens FROM entries WHERE parent = ? AND model_hash = ?",
                                         (parent, self.model_hash)).fetchall():
            n = common_prefix(np.frombuffer(blob, dtype="<i8").tolist(), remaining)
            if n > best_n:
                best, best_n = key, n
        if best is None:
            return None
        row = self.db.execute("SELECT n_tokens FROM entries WHERE key = ?", (best,)).fetchone()
        chunk = self._load(best, pos, row[0], result) if row else None
        if chunk is None:
            return None
        self._count(result, best, best_n)
        return chunk.prefix(best_n, self.config.num_hidden_layers)

    def _append_rows(self, kv: KVCache, chunk: Chunk) -> None:
        by_layer: dict[int, dict[str, np.ndarray]] = {}
        for name, array in chunk.arrays.items():
            layer, fname = name.split(".")
            by_layer.setdefault(int(layer), {})[fname] = array
        for layer, rows in sorted(by_layer.items()):
            if len(next(iter(rows.values()))):
                kv.layer(layer).append(**rows)

    def _load(self, key: str, start: int, n_tokens: int, result: RestoreResult) -> Chunk | None:
        chunk = self._ram.get(key)
        if chunk is not None:
            self._ram.move_to_end(key)
            self._touch(key)
            return chunk
        row = self.db.execute("SELECT file FROM entries WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        path = self.directory / row[0]
        try:
            chunk = read_blob(path, self.model_hash, self.numerics, self.expected_shapes(n_tokens, start))
        except (OSError, ValueError):
            self._forget(key, path)
            result.discarded += 1
            return None
        if chunk.key != key or chunk.start != start:
            self._forget(key, path)
            result.discarded += 1
            return None
        self._loaded_from_disk.add(key)
        self._touch(key)
        self._remember(chunk)
        return chunk

    def _count(self, result: RestoreResult, key: str, n_tokens: int) -> None:
        if key in self._loaded_from_disk:
            self._loaded_from_disk.discard(key)
            result.from_disk += n_tokens
        else:
            result.from_ram += n_tokens

    # ---- store ----

    def store(self, kv: KVCache, tokens: list[int]) -> int:
        """Store the chunks of `tokens` (whose KV rows `kv` holds) that are not stored yet; returns how many.

        Full chunks at every `chunk_tokens` boundary, plus one tail chunk for the rest.
        """
        main_len = kv.length
        mtp_len = kv.layer(self.config.num_hidden_layers).length if self.has_mtp else None
        usable = min(len(tokens), main_len, mtp_len + 1 if mtp_len is not None else main_len)
        parent, pos, stored = self.root, 0, 0
        while pos < usable:
            n = min(self.chunk_tokens, usable - pos)
            key = chunk_key(parent, tokens[pos:pos + n])
            if key not in self._ram and not self._exists(key):
                chunk = Chunk(key, parent, pos, list(tokens[pos:pos + n]), self._rows(kv, pos, n))
                self._write(chunk)
                stored += 1
            if n < self.chunk_tokens:
                break
            parent, pos = key, pos + n
        if stored:
            self.evict()
        return stored

    def _rows(self, kv: KVCache, start: int, n: int) -> dict[str, np.ndarray]:
        arrays = {}
        for name in self.expected_shapes(n, start):
            layer, fname = name.split(".")
            rows = kv.layer(int(layer)).rows(fname)
            lo = start if int(layer) < self.config.num_hidden_layers else max(start - 1, 0)
            arrays[name] = rows[lo:start + n - (int(layer) >= self.config.num_hidden_layers)].copy()
        return arrays

    def _write(self, chunk: Chunk) -> None:
        rel = f"{self.model_hash[:16]}/{chunk.key[:2]}/{chunk.key}.kvc"
        path = self.directory / rel
        nbytes = write_blob(path, chunk, self.model_hash, self.numerics)
        now = time.time()
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO entries(key, model_hash, parent, start, n_tokens, tokens, file, "
                            "nbytes, created, last_access, hits) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0)",
                            (chunk.key, self.model_hash, chunk.parent, chunk.start, len(chunk.tokens),
                             np.asarray(chunk.tokens, dtype="<i8").tobytes(), rel, nbytes, now, now))
        self.counters.stored_chunks += 1
        self.counters.stored_bytes += nbytes
        self._remember(chunk)

    # ---- bookkeeping ----

    def _exists(self, key: str) -> bool:
        return self.db.execute("SELECT 1 FROM entries WHERE key = ?", (key,)).fetchone() is not None

    def _touch(self, key: str) -> None:
        with self.db:
            self.db.execute("UPDATE entries SET last_access = ?, hits = hits + 1 WHERE key = ?", (time.time(), key))

    def _forget(self, key: str, path: Path) -> None:
        with self.db:
            self.db.execute("DELETE FROM entries WHERE key = ?", (key,))
        path.unlink(missing_ok=True)

    def _remember(self, chunk: Chunk) -> None:
        self._ram[chunk.key] = chunk
        self._ram_bytes += chunk.nbytes
        while self._ram_bytes > RAM_TIER_BYTES and len(self._ram) > 1:
            _, old = self._ram.popitem(last=False)
            self._ram_bytes -= old.nbytes

    def evict(self) -> int:
        """Delete least-recently-used entries (all models) until the directory is under `max_bytes`."""
        return prune(self.db, self.directory, self.max_bytes)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# ---- the sqlite index, shared by every model and process ----

def open_index(directory: Path) -> sqlite3.Connection:
    db = sqlite3.connect(directory / "index.sqlite", timeout=30, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA busy_timeout=30000")
    db.execute("CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, model_hash TEXT NOT NULL, "
               "parent TEXT NOT NULL, start INTEGER, n_tokens INTEGER, tokens BLOB NOT NULL, file TEXT NOT NULL, "
               "nbytes INTEGER, created REAL, last_access REAL, hits INTEGER)")
    db.execute("CREATE INDEX IF NOT EXISTS by_parent ON entries(parent)")
    db.isolation_level = "DEFERRED"
    return db


def prune(db: sqlite3.Connection, directory: Path, max_bytes: int, model_hash: str | None = None) -> int:
    """Evict LRU entries (of one model, or all) until the total is <= max_bytes; returns entries removed."""
    where, args = ("WHERE model_hash = ?", (model_hash,)) if model_hash else ("", ())
    total = db.execute(f"SELECT COALESCE(SUM(nbytes), 0) FROM entries {where}", args).fetchone()[0]
    removed = 0
    for key, rel, nbytes in db.execute(f"SELECT key, file, nbytes FROM entries {where} ORDER BY last_access",
                                       args).fetchall():
        if total <= max_bytes:
            break
        with db:
            db.execute("DELETE FROM entries WHERE key = ?", (key,))
        (directory / rel).unlink(missing_ok=True)
        total -= nbytes
        removed += 1
    return removed


# ---- blob files ----

def write_blob(path: Path, chunk: Chunk, model_hash: str, numerics: str) -> int:
    """Write atomically (unique temp name, fsync, rename). Returns the file size."""
    header = {"model_hash": model_hash, "numerics": numerics, "key": chunk.key, "parent": chunk.parent,
              "start": chunk.start, "tokens": chunk.tokens, "compression": "zstd", "dtype": "float32",
              "lossy": False, "arrays": [[name, list(a.shape)] for name, a in chunk.arrays.items()]}
    head = json.dumps(header, separators=(",", ":")).encode()
    payload = zstandard.ZstdCompressor(level=3).compress(
        b"".join(np.ascontiguousarray(a, dtype="<f4").tobytes() for a in chunk.arrays.values()))
    body = MAGIC + struct.pack("<II", BLOB_VERSION, len(head)) + head + payload
    data = body + hashlib.sha256(body).digest()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    return len(data)


def read_blob(path: Path, model_hash: str, numerics: str, shapes: dict[str, tuple[int, int]]) -> Chunk:
    """Read and check a blob; raises ValueError naming what is wrong."""
    data = path.read_bytes()
    if len(data) < len(MAGIC) + 8 + 32 or data[:len(MAGIC)] != MAGIC:
        raise ValueError(f"{path}: not a glmkit KV blob")
    body, digest = data[:-32], data[-32:]
    if hashlib.sha256(body).digest() != digest:
        raise ValueError(f"{path}: checksum mismatch")
    version, head_len = struct.unpack_from("<II", body, len(MAGIC))
    if version != BLOB_VERSION:
        raise ValueError(f"{path}: blob version {version}")
    start = len(MAGIC) + 8
    if head_len > MAX_HEADER_BYTES or start + head_len > len(body):
        raise ValueError(f"{path}: bad header length")
    header = json.loads(body[start:start + head_len])
    if header.get("model_hash") != model_hash or header.get("numerics") != numerics:
        raise ValueError(f"{path}: written for another model or numerics version")
    names = [tuple(x) for x in header["arrays"]]
    if {n: tuple(s) for n, s in names} != shapes or [n for n, _ in names] != list(shapes):
        raise ValueError(f"{path}: array layout does not match this model")
    expected = sum(int(np.prod(s)) for s in shapes.values()) * 4
    raw = zstandard.ZstdDecompressor().decompress(body[start + head_len:], max_output_size=expected)
    if len(raw) != expected:
        raise ValueError(f"{path}: payload size mismatch")
    arrays, offset = {}, 0
    for name, shape in shapes.items():
        count = int(np.prod(shape))
        arrays[name] = np.frombuffer(raw, dtype="<f4", count=count, offset=offset).reshape(shape)
        offset += count * 4
    return Chunk(header["key"], header["parent"], int(header["start"]), list(header["tokens"]), arrays)
