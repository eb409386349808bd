"""Versioned on-disk KV/prefill cache: exact prefix reuse across requests and processes.

A token sequence is cut into chunks at fixed absolute boundaries (every `chunk_tokens`); the end of a
request adds one "tail" chunk hanging off the last full chunk. A chunk's key is
`sha256(parent_key || token ids)`, rooted in the model hash and the backend's numerics version, so an
entry can only be used by the same converted model, the same kernels and the same token prefix.

A blob holds the chunk's KV rows for every main layer (`kv_lat`, `k_rot`, `index_k` on indexer
layers) and, when the model has an MTP layer, the MTP rows one position earlier (the MTP row at
position i pairs h_i with token i+1, so it belongs with the chunk holding token i+1). Rows are stored as the
running KV cache holds them (`--kv-dtype`: f32, bf16 codes, or f16 / fp8 codes with a `{layer}.{field}.scale`
array of one f32 per row), so a restore copies them back without rounding again; the dtype is part of the numerics key.

Blob file: `MAGIC | u32 version | u32 header length | header JSON | sha256 of all before | zstd payload |
sha256 of all before`. The header names everything the index records of an entry (model hash, numerics, chain
root, key, parent, position, token ids, array dims, embedding, payload size) under its own checksum, so a
damaged or missing index is rebuilt from the headers alone. Written to a temp name, fsynced, renamed; only
then recorded in the sqlite index. Anything that fails a check (magic, version, checksums, model, numerics,
dims, the tokens and position being restored) is discarded and recomputed, never used; the index only finds
candidates, and a blob's path comes from its key.

Exact reuse already extends to the first token that differs from anything stored, not just to the last
chunk boundary before it (`_best_tail`), so explicit "anchor" boundaries at chat-turn starts would add
nothing: a history rewritten after turn k reuses every token before the first changed one.

Approximate (non-prefix) reuse, opt-in: the index also records each chunk's position-free content hash,
its chain root and the mean of its layer-0 `kv_lat` (the embedding `chunk_index` searches). `find_runs`
locates spans of a new prompt whose tokens were stored at OTHER positions: identical chunks by content
hash (then extended token by token through the stored chain, backwards and forwards), and similar chunks
through the hnswlib index, aligned token by token so a row is only ever used for the same token id.
The caller (`Session`) imports those rows re-rotated to their new positions (`rerotate`); they are
approximate (computed in another context) and are never stored back.
"""

from __future__ import annotations

import base64
import contextlib
import difflib
import fcntl
import functools
import hashlib
import json
import os
import re
import sqlite3
import stat
import struct
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import zstandard

from glmkit.format.config import ModelConfig
from glmkit.format.files import make_private_dirs, open_regular, write_private_file
from glmkit.model.glm5 import GlmMoeDsaModel
from glmkit.model.kv_cache import SCALED_KV_DTYPES, KVCache, decode_kv_rows, kv_storage_dtype
from glmkit.model.ops import rope_cos_sin

MAGIC = b"GLMKVC\x00\x01"
# 2: the header carries its own checksum, the chain root, the embedding and the payload size; 3: rows at the KV dtype
BLOB_VERSION = 3
DEFAULT_CHUNK_TOKENS = 32
DEFAULT_MAX_BYTES = 20 << 30
MAX_HEADER_BYTES = 1 << 20
MAX_ENTRY_TOKENS = 1 << 16  # a header or row listing more token ids is not one the cache wrote
# entries longer than this (and than the cache's own chunk) are not read: one read allocates at most this many
# tokens' rows, sized by the model's dims
MAX_CHUNK_TOKENS = 1024
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


def tokens_hash(tokens: list[int] | np.ndarray) -> str:
    """Position- and prefix-free hash of a chunk's token ids (finds the same tokens stored elsewhere)."""
    return hashlib.sha256(b"glmkit-content|" + np.asarray(tokens, dtype="<i8").tobytes()).hexdigest()


def rerotate(x: np.ndarray, old_start: int, new_start: int, theta: float) -> np.ndarray:
    """Move roped rows `x [n, d]` (de-interleaved `apply_rope` output) from positions old_start.. to new_start...

    The rotation undoes the model's own float32 rotation at the old positions and applies the one at the new
    positions (`rope_cos_sin`, composed in float64), so the result is the row roped directly at the new
    position up to float32 rounding. Same positions: returned unchanged.
    """
    if old_start == new_start or len(x) == 0:
        return x
    n, dim = x.shape
    cos_old, sin_old = (a.astype(np.float64) for a in rope_cos_sin(np.arange(old_start, old_start + n), dim, theta))
    cos_new, sin_new = (a.astype(np.float64) for a in rope_cos_sin(np.arange(new_start, new_start + n), dim, theta))
    cos = cos_new * cos_old + sin_new * sin_old  # cos(new - old)
    sin = sin_new * cos_old - cos_new * sin_old  # sin(new - old)
    even, odd = x[:, : dim // 2].astype(np.float64), x[:, dim // 2:].astype(np.float64)
    return np.concatenate([even * cos - odd * sin, odd * cos + even * sin], axis=-1).astype(np.float32)


@dataclass
class Piece:
    """Rows [offset, offset + count) of the stored chunk `key` (which starts at `chunk_start`)."""

    key: str
    chunk_start: int
    chunk_tokens: int
    offset: int
    count: int


@dataclass
class Run:
    """A span [start, start + length) of a new prompt whose tokens sit, in order, in stored chunks."""

    start: int
    pieces: list[Piece]
    kind: str  # "content": identical tokens found by content hash; "similar": via the hnswlib index

    @property
    def length(self) -> int:
        return sum(p.count for p in self.pieces)

    @property
    def end(self) -> int:
        return self.start + self.length


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


def _survives_index_damage(method: Callable[..., Any]) -> Callable[..., Any]:
    """A PrefixCache method that, when the index turns out damaged part-way (`is_index_damage`), replaces it
    (`recover_index`: moved aside, rebuilt from the blobs) and runs once more. Methods leave the caller's KV cache
    untouched until their last index access, so the second run starts from the same state."""
    @functools.wraps(method)
    def run(self: PrefixCache, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except sqlite3.DatabaseError as e:
            if not is_index_damage(e):
                raise
            self._replace_index(e)
        return method(self, *args, **kwargs)
    return run


class PrefixCache:
    """One model's view of the shared cache directory (blobs + sqlite index)."""

    def __init__(self, directory: str | Path, model_hash: str, config: ModelConfig, numerics: str,
                 has_mtp: bool, index_layers: list[int], chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 max_bytes: int = DEFAULT_MAX_BYTES, kv_dtype: str = "f32"):
        """numerics: the backend's numerics version; the KV dtype is added to it (rows of another precision are
        another chain)."""
        if not _HEX64.fullmatch(model_hash):
            raise ValueError(f"model hash {model_hash!r}: not 64 hex digits")
        self.directory = Path(directory)
        self.model_hash = model_hash
        self.config = config
        self.kv_dtype = kv_dtype
        self.numerics = f"{numerics}|kv={kv_dtype}"
        self.has_mtp = has_mtp
        self.index_layers = set(index_layers)
        self.chunk_tokens = chunk_tokens
        self.max_bytes = max_bytes
        # MTP and non-MTP runs store different row sets, so they get separate chains
        self.root = hashlib.sha256(
            f"glmkit-prefix|{BLOB_VERSION}|{model_hash}|{numerics}|mtp={has_mtp}".encode()).hexdigest()
        self._ram: OrderedDict[str, Chunk] = OrderedDict()
        self._ram_bytes = 0
        self._touched: list[str] = []  # keys used since the last flush_touches
        self._loaded_from_disk: set[str] = set()  # keys `_load` just read from disk (for the counters)
        make_private_dirs(self.directory)
        self.db = open_index(self.directory)
        self.ann = None  # chunk_index.ChunkIndex, opened by `open_similar_index` (approximate reuse only)

    @classmethod
    def for_model(cls, model: GlmMoeDsaModel, model_hash: str, directory: str | Path, use_mtp: bool,
                  chunk_tokens: int = DEFAULT_CHUNK_TOKENS, max_bytes: int = DEFAULT_MAX_BYTES) -> PrefixCache:
        """The cache for a model as it runs: its backend's numerics, whether MTP rows are kept."""
        index_layers = [i for i, layer in enumerate(model.new_cache().layers) if layer.has_index]
        return cls(directory, model_hash, model.config, model.numerics, use_mtp and model.has_mtp,
                   index_layers, chunk_tokens, max_bytes, model.kv_dtype)

    # ---- layout of one chunk's arrays ----

    def expected_shapes(self, n_tokens: int, start: int) -> dict[str, tuple[int, int]]:
        """The arrays of a chunk of `n_tokens` at `start`, in blob order: `{layer}.{field}` `[rows, width]` (and at
        f16 / fp8 `{layer}.{field}.scale` `[rows, 1]`)."""
        cfg = self.config
        widths = {"kv_lat": cfg.kv_lora_rank, "k_rot": cfg.qk_rope_head_dim, "index_k": cfg.index_head_dim}
        fields = [(layer, n_tokens) for layer in range(cfg.num_hidden_layers)]
        if self.has_mtp:  # MTP rows [start-1, start+n-1) clipped at 0
            fields.append((cfg.num_hidden_layers, n_tokens - (1 if start == 0 else 0)))
        shapes = {}
        for layer, rows in fields:
            for name in _FIELDS:
                if name != "index_k" or layer in self.index_layers:
                    shapes[f"{layer}.{name}"] = (rows, widths[name])
                    if self.kv_dtype in SCALED_KV_DTYPES:
                        shapes[f"{layer}.{name}.scale"] = (rows, 1)
        return shapes

    # ---- lookup and restore ----

    @_survives_index_damage
    def restore(self, kv: KVCache, tokens: list[int]) -> RestoreResult:
        """Append to an EMPTY `kv` the longest cached prefix of `tokens`, leaving at least the last token
        for the caller to compute (it needs its logits). With MTP the main layers are cut back one token
        behind the MTP rows, so recomputing that token also yields the hidden state the MTP layer needs."""
        assert kv.length == 0
        result = RestoreResult()
        limit = len(tokens) if self.has_mtp else len(tokens) - 1
        parent, pos = self.root, 0
        chunks: list[Chunk] = []
        while pos + self.chunk_tokens <= limit:
            want = tokens[pos:pos + self.chunk_tokens]
            key = chunk_key(parent, want)
            chunk = self._load(key, pos, self.chunk_tokens, result, want, parent=parent)
            if chunk is None:
                break
            self._count(result, key, self.chunk_tokens)
            chunks.append(chunk)
            parent, pos = key, pos + self.chunk_tokens
        tail = self._best_tail(parent, pos, tokens[pos:limit], result)
        if tail is not None:
            chunks.append(tail)
        self.flush_touches()  # the last use of the index: `kv` is only written once it cannot fail
        for chunk in chunks:
            self._append_rows(kv, chunk)
        if chunks and self.has_mtp:
            kv.truncate(kv.layer(self.config.num_hidden_layers).length)
        result.tokens = kv.length
        return result

    def _best_tail(self, parent: str, pos: int, remaining: list[int], result: RestoreResult) -> Chunk | None:
        """The stored chunk under `parent` sharing the longest prefix with `remaining`, cut to that prefix.

        KV rows of position i depend only on tokens <= i, so the first n rows of a longer chunk are exact.
        """
        best, best_n, best_len = None, 0, 0
        for key, n_tokens, blob in self.db.execute(
                f"SELECT key, n_tokens, tokens FROM entries WHERE parent = ? AND model_hash = ? AND {VALID_ENTRY}",
                (parent, self.model_hash)).fetchall():
            n = common_prefix(np.frombuffer(blob, dtype="<i8").tolist(), remaining)
            if n > best_n:
                best, best_n, best_len = key, n, n_tokens
        if best is None:
            return None
        # the row's tokens only chose the candidate: the blob's own header must hold them too
        chunk = self._load(best, pos, best_len, result, remaining[:best_n], parent=parent)
        if chunk is None:
            return None
        self._count(result, best, best_n)
        return chunk.prefix(best_n, self.config.num_hidden_layers)

    def _append_rows(self, kv: KVCache, chunk: Chunk) -> None:
        by_layer: dict[int, dict[str, tuple[np.ndarray, np.ndarray | None]]] = {}
        for name, array in chunk.arrays.items():
            layer, fname, *scale = name.split(".")
            if not scale:
                by_layer.setdefault(int(layer), {})[fname] = (array, _scales_of(chunk, name))
        for layer, fields in sorted(by_layer.items()):
            if len(next(iter(fields.values()))[0]):
                kv.layer(layer).append_encoded(fields)

    def _load(self, key: str, start: int, n_tokens: int, result: RestoreResult, expect: list[int],
              offset: int = 0, parent: str | None = None) -> Chunk | None:
        """The stored chunk `key` of `n_tokens` tokens at `start`, from RAM or disk, when it holds the rows of the
        tokens `expect` at `offset` (and, given `parent`, after that chunk). Anything else is a miss, and an entry
        whose own blob disagrees with what the index said of it is dropped (counted in `result.discarded`)."""
        chunk = self._ram.get(key)
        from_disk = chunk is None
        why = "its rows are not of the tokens its index entry names"
        if from_disk:
            if not 0 < n_tokens <= max(self.chunk_tokens, MAX_CHUNK_TOKENS) or not self._exists(key):
                return None
            try:  # the path comes from the key, never from the index row
                path = blob_path(self.directory, self.model_hash, key)
                chunk = read_blob(path, self.model_hash, self.numerics, self.expected_shapes(n_tokens, start),
                                  self.root, self.kv_dtype)
            except (OSError, ValueError) as e:
                chunk, why = None, str(e)
        if chunk is None or not _holds(chunk, key, start, n_tokens, expect, offset, parent):
            # the output stays right (the rows are computed again), but a cache that keeps losing entries is news
            print(f"glmkit: warning: prefix cache entry of positions {start}-{start + n_tokens - 1} dropped, its rows "
                  f"computed again: {why}", file=sys.stderr)
            self._forget(key)
            result.discarded += 1
            return None
        if from_disk:
            self._loaded_from_disk.add(key)
            self._remember(chunk)
        else:
            self._ram.move_to_end(key)
        self._touch(key)
        return chunk

    def _count(self, result: RestoreResult, key: str, n_tokens: int) -> None:
        if key in self._loaded_from_disk:
            self._loaded_from_disk.discard(key)
            result.from_disk += n_tokens
        else:
            result.from_ram += n_tokens

    # ---- store ----

    @_survives_index_damage
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
                try:
                    self._write(chunk)
                except (OSError, ValueError) as e:  # no space, or something not the cache's where its blob goes
                    print(f"glmkit: prefix cache {self.directory}: chunk not stored ({e})", file=sys.stderr)
                    break  # the chunks after it would be unreachable
                stored += 1
            if n < self.chunk_tokens:
                break
            parent, pos = key, pos + n
        if stored:
            self.evict()
        return stored

    def _rows(self, kv: KVCache, start: int, n: int) -> dict[str, np.ndarray]:
        """The stored codes (and fp8 scales) of rows [start, start + n) as `expected_shapes` names them."""
        arrays = {}
        for name in self.expected_shapes(n, start):
            layer, fname, *scale = name.split(".")
            if scale:
                continue  # with its rows
            mtp = int(layer) >= self.config.num_hidden_layers
            lo = max(start - 1, 0) if mtp else start
            arrays[name], scales = kv.layer(int(layer)).encoded(fname, lo, start + n - mtp)
            if scales is not None:
                arrays[f"{name}.scale"] = scales[:, None]
        return arrays

    def _write(self, chunk: Chunk) -> None:
        path = blob_path(self.directory, self.model_hash, chunk.key)
        # full chunks get an embedding (mean layer-0 kv_lat: see chunk_index) for the similar-chunk search
        emb = (chunk_rows(chunk, "0.kv_lat").mean(axis=0).astype("<f4") if len(chunk.tokens) == self.chunk_tokens
               else None)
        nbytes = write_blob(path, chunk, self.model_hash, self.numerics, self.root, emb, self.kv_dtype)
        with self.db:
            _insert_entry(self.db, "INSERT OR REPLACE", self.directory, path, chunk, self.model_hash, self.root,
                          emb, nbytes, time.time())
        self._remember(chunk)
        if emb is not None and self.ann is not None:
            self.ann.add(chunk.key, emb)

    # ---- bookkeeping ----

    def _exists(self, key: str) -> bool:
        return self.db.execute(f"SELECT 1 FROM entries WHERE key = ? AND {VALID_ENTRY}", (key,)).fetchone() is not None

    def _touch(self, key: str) -> None:
        """Record a use; written in one transaction by `flush_touches` (one per chunk cost ~8 ms each)."""
        self._touched.append(key)

    @_survives_index_damage
    def flush_touches(self) -> None:
        if self._touched:
            now = time.time()
            with self.db:
                self.db.executemany("UPDATE entries SET last_access = ?, hits = hits + 1 WHERE key = ?",
                                    [(now, key) for key in self._touched])
            self._touched.clear()

    def _forget(self, key: str) -> None:
        """Drop an entry: its index row, its blob and any copy in RAM."""
        with self.db:
            self.db.execute("DELETE FROM entries WHERE key = ?", (key,))
        remove_blob(self.directory, self.model_hash, key)
        if (chunk := self._ram.pop(key, None)) is not None:
            self._ram_bytes -= chunk.nbytes
        if self.ann is not None:
            self.ann.remove([key])

    def _replace_index(self, error: sqlite3.Error) -> None:
        """Swap the damaged index for a rebuilt one (`recover_index`), forgetting what referred to the old one."""
        with contextlib.suppress(sqlite3.Error):
            self.db.close()
        self.db = recover_index(self.directory, error)
        self.ann = None  # it reads the old connection: reopened from the new index on the next use
        self._touched.clear()
        self._loaded_from_disk.clear()

    def _remember(self, chunk: Chunk) -> None:
        self._ram[chunk.key] = chunk
        self._ram_bytes += chunk.nbytes
        while self._ram_bytes > RAM_TIER_BYTES and len(self._ram) > 1:
            _, old = self._ram.popitem(last=False)
            self._ram_bytes -= old.nbytes

    @_survives_index_damage
    def evict(self) -> int:
        """Delete least-recently-used entries (all models) until the directory is under `max_bytes`."""
        removed: list[str] = []
        count = prune(self.db, self.directory, self.max_bytes, removed_keys=removed)
        for key in removed:
            if (chunk := self._ram.pop(key, None)) is not None:
                self._ram_bytes -= chunk.nbytes
        if self.ann is not None and removed:
            self.ann.remove(removed)
        return count

    # ---- approximate (non-prefix) reuse ----

    @_survives_index_damage
    def open_similar_index(self, center: np.ndarray, max_elements: int | None = None):
        """Open (load, or rebuild from the sqlite index) this chain's hnswlib index; see `chunk_index`."""
        from glmkit.cache.chunk_index import DEFAULT_MAX_ELEMENTS, ChunkIndex

        if self.ann is None:
            drop_damaged_entries(self.db, self.directory)  # the similar-chunk index reads every row of the chain
            make_private_dirs(self.directory / "ann")  # its files hold embeddings of prompts: not for other users
            self.ann = ChunkIndex(self.db, self.directory, self.root, center, max_elements or DEFAULT_MAX_ELEMENTS)
        return self.ann

    def save_similar_index(self) -> None:
        if self.ann is not None:
            try:
                self.ann.save()
            except OSError:
                pass  # a derived file: rebuilt from the sqlite index next time

    @_survives_index_damage
    def load_piece(self, piece: Piece, tokens: list[int]) -> dict[str, np.ndarray] | None:
        """The main layers' rows of `piece` (no MTP rows), which must be those of `tokens` (`[piece.count]` ids);
        None when the entry is gone, damaged or holds other tokens."""
        chunk = self._load(piece.key, piece.chunk_start, piece.chunk_tokens, RestoreResult(), tokens, piece.offset)
        self.flush_touches()
        if chunk is None:
            return None
        self._loaded_from_disk.discard(piece.key)
        mtp = self.config.num_hidden_layers
        return {name: chunk_rows(chunk, name)[piece.offset:piece.offset + piece.count] for name in chunk.arrays
                if int(name.split(".")[0]) < mtp and not name.endswith(".scale")}

    @_survives_index_damage
    def find_runs(self, tokens: list[int], begin: int, end: int,
                  embed: Callable[[list[list[int]]], np.ndarray] | None = None,
                  threshold: float = 0.5, min_block: int = 4) -> list[Run]:
        """Spans of `tokens[begin:end]` whose tokens were stored at other positions, in order, not overlapping.

        1. Every window of `chunk_tokens` tokens is hashed; a window equal to a stored full chunk of this chain
           seeds a run, which is then extended token by token through the stored chain: backwards into the
           chunk's parent (as far as the tokens agree) and forwards into the child sharing the longest prefix.
        2. With `embed` (and an open similar-chunk index), the gaps left are cut into windows of
           `chunk_tokens`; a stored chunk whose embedding has cosine similarity >= `threshold` with a window
           is aligned to it (difflib), and every block of at least `min_block` identical tokens becomes a run.
        """
        c = self.chunk_tokens
        runs: list[Run] = []
        arr = np.asarray(tokens, dtype="<i8")
        if end - begin >= c:
            hashes = [tokens_hash(arr[q:q + c]) for q in range(begin, end - c + 1)]
            found = self._by_content(set(hashes))
            q = lo = begin
            while q + c <= end:
                hit = found.get(hashes[q - begin])
                if hit is None:
                    q += 1
                    continue
                key, start = hit
                back = self._extend_back(key, tokens, q, lo)
                ahead = self._extend_forward(key, tokens, q + c, end)
                pieces = back + [Piece(key, start, c, 0, c)] + ahead
                run = Run(q - sum(p.count for p in back), pieces, "content")
                runs.append(run)
                q = lo = run.end
        if embed is not None and self.ann is not None and len(self.ann):
            runs += self._similar_runs(tokens, begin, end, runs, embed, threshold, min_block)
        return sorted(runs, key=lambda r: r.start)

    def _by_content(self, hashes: set[str]) -> dict[str, tuple[str, int]]:
        found: dict[str, tuple[str, int]] = {}
        items = sorted(hashes)
        for i in range(0, len(items), 500):
            batch = items[i:i + 500]
            marks = ",".join("?" * len(batch))
            for content, key, start in self.db.execute(
                    f"SELECT content, key, start FROM entries WHERE root = ? AND n_tokens = ? AND content IN ({marks}) "
                    f"AND {VALID_ENTRY} "
                    "ORDER BY last_access", (self.root, self.chunk_tokens, *batch)):
                found[content] = (key, start)  # the most recently used copy wins
        return found

    def _entry(self, key: str) -> tuple[str, int, int, list[int]] | None:
        row = self.db.execute(f"SELECT parent, start, n_tokens, tokens FROM entries WHERE key = ? AND {VALID_ENTRY}",
                              (key,)).fetchone()
        return None if row is None else (row[0], row[1], row[2], np.frombuffer(row[3], dtype="<i8").tolist())

    def _extend_back(self, key: str, tokens: list[int], q: int, lo: int) -> list[Piece]:
        """Pieces (in order) of the chunks before `key` in its chain whose trailing tokens equal tokens[..q)."""
        pieces: list[Piece] = []
        entry = self._entry(key)
        while entry is not None and q > lo and entry[0] != self.root:
            parent = self._entry(entry[0])
            if parent is None:
                break
            ptokens = parent[3]
            n = 0
            while n < len(ptokens) and q - n - 1 >= lo and ptokens[-1 - n] == tokens[q - n - 1]:
                n += 1
            if n == 0:
                break
            pieces.insert(0, Piece(entry[0], parent[1], parent[2], parent[2] - n, n))
            if n < len(ptokens):
                break
            q -= n
            entry = (parent[0], parent[1], parent[2], ptokens)
        return pieces

    def _extend_forward(self, key: str, tokens: list[int], q: int, end: int) -> list[Piece]:
        """Pieces of the chunks after `key` in stored chains whose leading tokens equal tokens[q:end]."""
        pieces: list[Piece] = []
        while q < end:
            best, best_n = None, 0
            for child, start, n_tokens, blob in self.db.execute(
                    f"SELECT key, start, n_tokens, tokens FROM entries WHERE parent = ? AND {VALID_ENTRY}",
                    (key,)).fetchall():
                n = common_prefix(np.frombuffer(blob, dtype="<i8").tolist(), tokens[q:end])
                if n > best_n:
                    best, best_n = (child, start, n_tokens), n
            if best is None:
                break
            pieces.append(Piece(best[0], best[1], best[2], 0, best_n))
            if best_n < best[2] or best[2] < self.chunk_tokens:
                break
            key, q = best[0], q + best_n
        return pieces

    def _similar_runs(self, tokens: list[int], begin: int, end: int, runs: list[Run],
                      embed: Callable[[list[list[int]]], np.ndarray], threshold: float, min_block: int) -> list[Run]:
        c = self.chunk_tokens
        gaps, pos = [], begin
        for run in sorted(runs, key=lambda r: r.start) + [Run(end, [], "")]:
            if run.start - pos >= c:
                gaps.append((pos, run.start))
            pos = max(pos, run.end)
        windows = [w for a, b in gaps for w in range(a, b - c + 1, c)]
        if not windows:
            return []
        candidates = self.ann.query(embed([tokens[w:w + c] for w in windows]))
        out = []
        for w, hits in zip(windows, candidates, strict=True):
            window = tokens[w:w + c]
            best, best_score = None, 0
            for key, similarity in hits:
                if similarity < threshold:
                    continue
                entry = self._entry(key)
                if entry is None:
                    self.ann.remove([key])  # evicted by another process
                    continue
                blocks = [b for b in difflib.SequenceMatcher(None, window, entry[3], autojunk=False)
                          .get_matching_blocks() if b.size >= min_block]
                score = sum(b.size for b in blocks)
                if score > best_score:
                    best, best_score = (key, entry, blocks), score
            if best is not None:
                key, entry, blocks = best
                self.ann.touch(key)  # recently matched chunks are the last to drop out of the bounded index
                out += [Run(w + b.a, [Piece(key, entry[1], entry[2], b.b, b.size)], "similar") for b in blocks]
        return out


def _holds(chunk: Chunk, key: str, start: int, n_tokens: int, expect: list[int], offset: int,
           parent: str | None) -> bool:
    """Whether a chunk read back (its header's key, parent, position and tokens) is the entry asked for and
    holds the rows of `expect` at `offset`; its key must also be the hash of its own parent and tokens."""
    return (chunk.key == key and chunk.start == start and len(chunk.tokens) == n_tokens
            and chunk.tokens[offset:offset + len(expect)] == list(expect) and (parent is None or chunk.parent == parent)
            and chunk_key(chunk.parent, chunk.tokens) == key)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# ---- the sqlite index, shared by every model and process ----

# columns added for approximate reuse: position-free content hash, chain root, layer-0 embedding (f32 bytes)
_ADDED_COLUMNS = (("content", "TEXT"), ("root", "TEXT"), ("emb", "BLOB"))


def open_index(directory: Path, wait_s: float = 30.0) -> sqlite3.Connection:
    """Open (creating if needed) the shared index; a damaged one is replaced (`recover_index`)."""
    try:
        return _open_retrying(directory, wait_s)
    except sqlite3.DatabaseError as e:
        if not is_index_damage(e):
            raise
        return recover_index(directory, e, wait_s)


def is_index_damage(error: sqlite3.Error) -> bool:
    """Whether an sqlite error says the index file itself is damaged (SQLITE_CORRUPT, SQLITE_NOTADB, or not a
    regular file): the errors that moving it aside and rebuilding it repairs."""
    return type(error) is sqlite3.DatabaseError


def recover_index(directory: Path, error: sqlite3.Error, wait_s: float = 30.0) -> sqlite3.Connection:
    """After `error` on the index: move it aside to `index.sqlite.corrupt-<time>-<pid>` (unless it now checks out:
    another process replaced it first) and open a new one, rebuilt from the blobs' headers; one-line notice."""
    moved = _move_damaged_index(directory)
    db = _open_retrying(directory, wait_s)  # a fresh index failing as well is not for a rebuild to repair
    if moved is not None:
        indexed = db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
        reason = " ".join(str(error).split())[:120]
        print(f"glmkit: prefix cache index {directory / 'index.sqlite'} was damaged ({reason}); moved it to "
              f"{moved.name} and rebuilt it from {indexed} blobs", file=sys.stderr)
    return db


def _open_retrying(directory: Path, wait_s: float) -> sqlite3.Connection:
    """Two processes creating the index at once can get SQLITE_BUSY from the journal-mode switch without sqlite's
    busy handler ever running, so setup is retried."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return _open_index(directory)
        except sqlite3.OperationalError as e:
            if ("locked" not in str(e) and "busy" not in str(e)) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _move_damaged_index(directory: Path) -> Path | None:
    """Under the index lock: unless the index passes sqlite's integrity check, rename it (with its WAL and
    shared-memory files) out of the way; returns its new name, or None when it was left in place."""
    with _index_lock(directory):
        path = directory / "index.sqlite"
        if _index_sound(path):
            return None
        aside = path.with_name(f"index.sqlite.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        for suffix in ("-wal", "-shm", ""):
            with contextlib.suppress(FileNotFoundError):
                os.rename(f"{path}{suffix}", f"{aside}{suffix}")
        return aside


def _index_sound(path: Path) -> bool:
    """Whether the index file is absent, or a regular file passing `PRAGMA integrity_check` (index b-trees
    against their tables included). Only run after an error: it reads the whole file."""
    if (seen := _lstat(path)) is None:
        return True
    if not stat.S_ISREG(seen.st_mode):
        return False
    db = sqlite3.connect(path, timeout=30)
    try:
        return db.execute("PRAGMA integrity_check(1)").fetchone() == ("ok",)
    except sqlite3.OperationalError:  # busy or locked: a live index another process is using
        return True
    except sqlite3.DatabaseError:
        return False
    finally:
        db.close()


@contextlib.contextmanager
def _index_lock(directory: Path) -> Iterator[None]:
    """An exclusive lock (flock on `DIR/index.lock`) around replacing the index file itself."""
    fd = os.open(directory / "index.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _open_index(directory: Path) -> sqlite3.Connection:
    path = directory / "index.sqlite"
    if (seen := _lstat(path)) is not None and not stat.S_ISREG(seen.st_mode):
        raise sqlite3.DatabaseError(f"{path} is not a regular file")
    if seen is None:  # sqlite gives its WAL and shared-memory files the index's mode: create it private
        with contextlib.suppress(FileExistsError):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    db = sqlite3.connect(path, timeout=30, isolation_level=None)
    try:
        _create_schema(db, directory)
    except sqlite3.Error:
        db.close()
        raise
    return db


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


_CREATE_ENTRIES = ("CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, model_hash TEXT NOT NULL, "
                   "parent TEXT NOT NULL, start INTEGER, n_tokens INTEGER, tokens BLOB NOT NULL, file TEXT NOT NULL, "
                   "nbytes INTEGER, created REAL, last_access REAL, hits INTEGER, content TEXT, root TEXT, emb BLOB)")
_REQUIRED_COLUMNS = {"key", "model_hash", "parent", "start", "n_tokens", "tokens", "file", "nbytes", "created",
                     "last_access", "hits"}


def _create_schema(db: sqlite3.Connection, directory: Path) -> None:
    """Bring the index's table to today's layout and, when the index does not yet record this blob version
    (new, rebuilt, or from an earlier glmkit), index the blobs on disk. Damage shows as sqlite3.DatabaseError,
    here or at any later statement (see `PrefixCache`: no full read of the file on every open)."""
    db.execute("PRAGMA busy_timeout=30000")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute(_CREATE_ENTRIES)
    if not _current(db):
        db.execute("BEGIN IMMEDIATE")  # one process migrates; the others then see the new version
        try:
            if not _current(db):
                _migrate(db, directory)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
    db.execute("CREATE INDEX IF NOT EXISTS by_parent ON entries(parent)")
    db.execute("CREATE INDEX IF NOT EXISTS by_content ON entries(root, content)")
    db.isolation_level = "DEFERRED"


def _current(db: sqlite3.Connection) -> bool:
    """Whether the index has today's columns and records this blob version."""
    have = {row[1] for row in db.execute("PRAGMA table_info(entries)")}
    return (db.execute("PRAGMA user_version").fetchone()[0] == BLOB_VERSION
            and _REQUIRED_COLUMNS | {name for name, _ in _ADDED_COLUMNS} <= have)


def _migrate(db: sqlite3.Connection, directory: Path) -> None:
    """Inside the caller's write transaction: today's columns, then every blob on disk indexed (or removed)."""
    have = {row[1] for row in db.execute("PRAGMA table_info(entries)")}
    old_layout = not _REQUIRED_COLUMNS <= have
    if old_layout:  # an index from an incompatible earlier layout: its rows cannot be matched, so it starts over
        db.execute("DROP TABLE entries")
        db.execute(_CREATE_ENTRIES)
    else:
        for name, kind in _ADDED_COLUMNS:  # an index made before these columns existed: add them (rows stay NULL)
            if name not in have:
                db.execute(f"ALTER TABLE entries ADD COLUMN {name} {kind}")
    counts = _index_blobs(db, directory)
    db.execute(f"PRAGMA user_version = {BLOB_VERSION}")
    if old_layout:
        print(f"glmkit: prefix cache index {directory / 'index.sqlite'} has an old layout; rebuilt it from "
              f"{counts[0]} blobs", file=sys.stderr)
    elif counts[1]:
        print(f"glmkit: prefix cache {directory}: removed {counts[1]} blobs of an earlier layout or damaged",
              file=sys.stderr)


def _index_blobs(db: sqlite3.Connection, directory: Path) -> tuple[int, int]:
    """Add a row for every blob whose header checks out and that no row names yet; remove the cache's files
    that are no blob of this version (found by the cache's naming: nothing else is touched; a blob of a later
    version is left for the glmkit that wrote it). Returns (indexed, removed)."""
    indexed = removed = 0
    for path, key, temp in cache_files(directory):
        if temp:
            continue  # a writer's, maybe still running: `glm-cache prune` removes stale ones
        try:
            with open_regular(path, follow_symlinks=False) as f:
                st = os.fstat(f.fileno())
                header, _ = _read_header(f, st.st_size, path)
            if header["key"] != key or header["model_hash"][:16] != path.parent.parent.name:
                raise ValueError(f"{path}: header names another entry")
        except _LaterVersionError:
            continue
        except (OSError, ValueError):
            if remove_cache_file(path):
                removed += 1
            db.execute("DELETE FROM entries WHERE key = ?", (key,))
            continue
        chunk = Chunk(key, header["parent"], header["start"], header["tokens"], {})
        emb = None if header["emb"] is None else np.frombuffer(base64.b64decode(header["emb"]), dtype="<f4")
        cursor = _insert_entry(db, "INSERT OR IGNORE", directory, path, chunk, header["model_hash"], header["root"],
                               emb, st.st_size, st.st_mtime)
        indexed += cursor.rowcount
    return indexed, removed


def _insert_entry(db: sqlite3.Connection, verb: str, directory: Path, path: Path, chunk: Chunk, model_hash: str,
                  root: str, emb: np.ndarray | None, nbytes: int, when: float) -> sqlite3.Cursor:
    """Record a stored chunk (`verb`: "INSERT OR REPLACE" or "INSERT OR IGNORE"), last used at `when`."""
    return db.execute(f"{verb} INTO entries(key, model_hash, parent, start, n_tokens, tokens, file, nbytes, created, "
                      "last_access, hits, content, root, emb) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?, ?, ?)",
                      (chunk.key, model_hash, chunk.parent, chunk.start, len(chunk.tokens),
                       np.asarray(chunk.tokens, dtype="<i8").tobytes(), str(path.relative_to(directory)), nbytes,
                       when, when, tokens_hash(chunk.tokens), root, None if emb is None else emb.tobytes()))


# what a row the cache wrote looks like; any other row is damaged: never returned by a lookup, dropped by
# `drop_damaged_entries` (glm-cache prune and clear, and before the similar-chunk index reads a chain)
VALID_ENTRY = (
    "(typeof(key) = 'text' AND length(key) = 64 AND key NOT GLOB '*[^0-9a-f]*' "
    "AND typeof(model_hash) = 'text' AND length(model_hash) = 64 AND model_hash NOT GLOB '*[^0-9a-f]*' "
    "AND typeof(parent) = 'text' AND length(parent) = 64 AND parent NOT GLOB '*[^0-9a-f]*' "
    "AND typeof(start) = 'integer' AND start >= 0 AND typeof(n_tokens) = 'integer' "
    f"AND n_tokens BETWEEN 1 AND {MAX_ENTRY_TOKENS} AND typeof(tokens) = 'blob' AND length(tokens) = 8 * n_tokens "
    "AND typeof(nbytes) = 'integer' AND nbytes >= 0 AND typeof(last_access) IN ('integer', 'real') "
    "AND typeof(hits) IN ('integer', 'real') AND hits >= 0 AND (content IS NULL OR typeof(content) = 'text') "
    "AND (root IS NULL OR typeof(root) = 'text') AND (emb IS NULL OR (typeof(emb) = 'blob' AND length(emb) % 4 = 0)))"
)


def damaged_entries(db: sqlite3.Connection) -> int:
    """How many index rows are not rows the cache wrote (ignored by every lookup)."""
    return db.execute(f"SELECT COUNT(*) FROM entries WHERE {VALID_ENTRY} IS NOT 1").fetchone()[0]


def drop_damaged_entries(db: sqlite3.Connection, directory: Path) -> int:
    """Delete the damaged rows, and the blobs their key names when it is a valid name; returns rows deleted."""
    rows = db.execute(f"SELECT rowid, key, model_hash FROM entries WHERE {VALID_ENTRY} IS NOT 1").fetchall()
    if rows:
        with db:
            db.executemany("DELETE FROM entries WHERE rowid = ?", [(rowid,) for rowid, _, _ in rows])
        for _, key, owner in rows:
            remove_blob(directory, owner, key)
    return len(rows)


def prune(db: sqlite3.Connection, directory: Path, max_bytes: int, model_hash: str | None = None,
          removed_keys: list[str] | None = None) -> int:
    """Evict LRU entries (of one model, or all) until the total is <= max_bytes; returns entries removed
    (and appends their keys to `removed_keys`). Only rows with a size count (`drop_damaged_entries` removes the
    rest); a row whose names are malformed goes without its blob, which nothing could name."""
    where, args = ("WHERE typeof(nbytes) = 'integer' AND nbytes >= 0" + (" AND model_hash = ?" if model_hash else ""),
                   (model_hash,) if model_hash else ())
    total = db.execute(f"SELECT TOTAL(nbytes) FROM entries {where}", args).fetchone()[0]
    removed = 0
    for key, owner, nbytes in db.execute(f"SELECT key, model_hash, nbytes FROM entries {where} ORDER BY last_access",
                                         args).fetchall():
        if total <= max_bytes:
            break
        with db:
            db.execute("DELETE FROM entries WHERE key = ?", (key,))
        remove_blob(directory, owner, key)
        total -= nbytes
        removed += 1
        if removed_keys is not None:
            removed_keys.append(key)
    return removed


# ---- blob files ----

_HEX64 = re.compile(r"[0-9a-f]{64}")
_MODEL_DIR = re.compile(r"[0-9a-f]{16}")
_KEY_DIR = re.compile(r"[0-9a-f]{2}")
_BLOB_NAME = re.compile(r"(?P<key>[0-9a-f]{64})\.kvc(?P<temp>\.tmp-[0-9]+-[0-9]+)?")


def blob_path(directory: Path, model_hash: str, key: str) -> Path:
    """Where the blob of chunk `key` lives, by the cache's naming alone: `DIR/<model hash[:16]>/<key[:2]>/<key>.kvc`.

    Raises ValueError for a hash or key that is not 64 hex digits, or when a directory on the way is a symlink
    (the path would leave the cache directory)."""
    if not (isinstance(model_hash, str) and _HEX64.fullmatch(model_hash) and isinstance(key, str)
            and _HEX64.fullmatch(key)):
        raise ValueError(f"{directory}: not a cache entry name ({model_hash!r}, {key!r})")
    path = Path(directory) / model_hash[:16] / key[:2] / f"{key}.kvc"
    if os.path.islink(path.parent.parent) or os.path.islink(path.parent):
        raise ValueError(f"{path.parent}: a symlink, not the cache's own directory")
    return path


def remove_blob(directory: Path, model_hash: str, key: str) -> None:
    """Delete the blob of `key` (a malformed name deletes nothing)."""
    try:
        remove_cache_file(blob_path(directory, model_hash, key))
    except ValueError:
        pass


def cache_files(directory: Path) -> Iterator[tuple[Path, str, bool]]:
    """The files the cache wrote, found by its naming alone: `(path, key, is_temp)` for each
    `<model hash[:16]>/<key[:2]>/<key>.kvc` and its `.tmp-<pid>-<ns>` temp files. Only real directories
    named that way are walked (never a symlink), and a directory is never yielded, whatever its name."""
    for model_dir in _named_subdirs(directory, _MODEL_DIR):
        for key_dir in _named_subdirs(model_dir, _KEY_DIR):
            try:
                entries = list(os.scandir(key_dir))
            except OSError:
                continue
            for entry in entries:
                match = _BLOB_NAME.fullmatch(entry.name)
                if match and match["key"][:2] == key_dir.name and not entry.is_dir(follow_symlinks=False):
                    yield Path(entry.path), match["key"], match["temp"] is not None


def _named_subdirs(directory: Path, pattern: re.Pattern[str]) -> list[Path]:
    try:
        return [Path(e.path) for e in os.scandir(directory)
                if pattern.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def remove_cache_file(path: Path) -> bool:
    """Unlink one of the cache's files (a symlink itself, never its target; never a directory)."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        os.unlink(path)
        return True
    except OSError:  # gone already, or not ours to remove (permissions): left as it is
        return False

def _blob_dtype(name: str, kv_dtype: str) -> np.dtype:
    """How a blob stores array `name`: row scales as little-endian f32, rows as the KV dtype's codes (f32, or the
    bits of bf16 / f16 / e4m3 as little-endian unsigned integers)."""
    if name.endswith(".scale") or kv_dtype == "f32":
        return np.dtype("<f4")
    return np.dtype("u1" if kv_dtype == "fp8" else "<u2")


def _scales_of(chunk: Chunk, name: str) -> np.ndarray | None:
    """The per-row scales `[n]` of chunk array `name` (f16, fp8), else None."""
    scales = chunk.arrays.get(f"{name}.scale")
    return None if scales is None else scales[:, 0]


def chunk_rows(chunk: Chunk, name: str) -> np.ndarray:
    """Chunk array `name` (`{layer}.{field}`) as float32 rows `[n, width]`."""
    array = chunk.arrays[name]
    return array if array.dtype == np.float32 else decode_kv_rows(array, _scales_of(chunk, name))


def write_blob(path: Path, chunk: Chunk, model_hash: str, numerics: str, root: str, emb: np.ndarray | None,
               kv_dtype: str = "f32") -> int:
    """Write atomically (unique temp name, fsync, rename); `emb` (`[kv_lora_rank]` f32 or None) goes in the
    header for rebuilding the index. Returns the file size."""
    def stored(name: str, a: np.ndarray) -> bytes:  # the array's bits, as `_blob_dtype` stores them
        dtype = _blob_dtype(name, kv_dtype)
        return np.ascontiguousarray(a).view(dtype.newbyteorder("=")).astype(dtype).tobytes()

    payload = zstandard.ZstdCompressor(level=3).compress(b"".join(stored(n, a) for n, a in chunk.arrays.items()))
    header = {"model_hash": model_hash, "numerics": numerics, "root": root, "key": chunk.key, "parent": chunk.parent,
              "start": chunk.start, "tokens": [int(t) for t in chunk.tokens], "compression": "zstd",
              "dtype": kv_dtype, "lossy": kv_dtype != "f32",
              "arrays": [[name, list(a.shape)] for name, a in chunk.arrays.items()],
              "emb": None if emb is None else base64.b64encode(np.asarray(emb, dtype="<f4").tobytes()).decode(),
              "payload_bytes": len(payload)}
    head = json.dumps(header, separators=(",", ":")).encode()
    span = MAGIC + struct.pack("<II", BLOB_VERSION, len(head)) + head
    body = span + hashlib.sha256(span).digest() + payload
    data = body + hashlib.sha256(body).digest()
    make_private_dirs(path.parent)
    write_private_file(path, data)
    return len(data)


class _LaterVersionError(ValueError):
    """A blob written by a later glmkit (another layout version): not this version's to use or remove."""


_PREFIX_BYTES = len(MAGIC) + 8  # magic, version, header length


def _read_header(f: BinaryIO, size: int, path: Path) -> tuple[dict[str, Any], bytes]:
    """The checked header of an open blob of `size` bytes, and the bytes up to its end (digest included).
    Reads at most `MAX_HEADER_BYTES` plus a few; raises ValueError for anything the cache would not write."""
    prefix = f.read(_PREFIX_BYTES)
    if len(prefix) < _PREFIX_BYTES or prefix[:len(MAGIC)] != MAGIC:
        raise ValueError(f"{path}: not a glmkit KV blob")
    version, head_len = struct.unpack_from("<II", prefix, len(MAGIC))
    if version > BLOB_VERSION:
        raise _LaterVersionError(f"{path}: blob version {version}")
    if version != BLOB_VERSION:
        raise ValueError(f"{path}: blob version {version}")
    if head_len > MAX_HEADER_BYTES or _PREFIX_BYTES + head_len + 64 > size:
        raise ValueError(f"{path}: bad header length")
    rest = f.read(head_len + 32)
    span = prefix + rest
    if len(rest) != head_len + 32 or hashlib.sha256(span[:-32]).digest() != span[-32:]:
        raise ValueError(f"{path}: header checksum mismatch")
    try:
        header = json.loads(rest[:-32])
    except RecursionError:  # nested past the parser's depth: no header the cache writes
        raise ValueError(f"{path}: malformed header") from None
    _check_header(header, path)
    if size != len(span) + header["payload_bytes"] + 32:
        raise ValueError(f"{path}: file size does not match its header")
    return header, span


def _check_header(h: Any, path: Path) -> None:
    """Raise ValueError unless `h` has every field the cache writes, of the right kind, and its key is the hash
    of its own parent and tokens."""
    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    ok = (isinstance(h, dict)
          and all(isinstance(h.get(k), str) and _HEX64.fullmatch(h[k]) for k in ("model_hash", "root", "key", "parent"))
          and isinstance(h.get("numerics"), str) and is_int(h.get("start")) and h["start"] >= 0
          and isinstance(h.get("tokens"), list) and 0 < len(h["tokens"]) <= MAX_ENTRY_TOKENS
          and all(is_int(t) and -(1 << 63) <= t < 1 << 63 for t in h["tokens"])
          and isinstance(h.get("arrays"), list)
          and all(isinstance(a, list) and len(a) == 2 and isinstance(a[0], str) and isinstance(a[1], list)
                  and len(a[1]) == 2 and all(is_int(d) and d >= 0 for d in a[1]) for a in h["arrays"])
          and (h.get("emb") is None or isinstance(h["emb"], str))
          and is_int(h.get("payload_bytes")) and h["payload_bytes"] >= 0)
    if not ok:
        raise ValueError(f"{path}: malformed header")
    if h["emb"] is not None and len(base64.b64decode(h["emb"], validate=True)) % 4:
        raise ValueError(f"{path}: malformed embedding")
    if chunk_key(h["parent"], h["tokens"]) != h["key"]:
        raise ValueError(f"{path}: key is not the hash of its parent and tokens")


def read_blob(path: Path, model_hash: str, numerics: str, shapes: dict[str, tuple[int, int]],
              root: str | None = None, kv_dtype: str = "f32") -> Chunk:
    """Read and check a blob (written for `model_hash`, `numerics` and, given, chain `root`, holding arrays of
    exactly `shapes` at `kv_dtype`); raises ValueError naming what is wrong, OSError for what is not a regular
    file."""
    with open_regular(path, follow_symlinks=False) as f:
        size = os.fstat(f.fileno()).st_size
        header, span = _read_header(f, size, path)
        if (header["model_hash"] != model_hash or header["numerics"] != numerics or root not in (None, header["root"])
                or header.get("dtype") != kv_dtype):
            raise ValueError(f"{path}: written for another model, numerics version or KV dtype")
        names = [tuple(x) for x in header["arrays"]]
        if {n: tuple(s) for n, s in names} != shapes or [n for n, _ in names] != list(shapes):
            raise ValueError(f"{path}: array layout does not match this model")
        sizes = {name: int(np.prod(shape)) * _blob_dtype(name, kv_dtype).itemsize for name, shape in shapes.items()}
        expected = sum(sizes.values())
        if header["payload_bytes"] > expected + (expected >> 7) + 1024:  # beyond zstd's worst case for that size
            raise ValueError(f"{path}: payload larger than its arrays")
        rest = f.read(header["payload_bytes"] + 32)
    if len(rest) != header["payload_bytes"] + 32 or hashlib.sha256(span + rest[:-32]).digest() != rest[-32:]:
        raise ValueError(f"{path}: checksum mismatch")
    payload = rest[:-32]
    try:  # the frame's own size claim is checked first: zstd allocates what a frame header declares
        if zstandard.frame_content_size(payload) != expected:
            raise ValueError(f"{path}: payload size mismatch")
        raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=expected)
    except zstandard.ZstdError as e:
        raise ValueError(f"{path}: bad payload ({e})") from None
    if len(raw) != expected:
        raise ValueError(f"{path}: payload size mismatch")
    arrays, offset = {}, 0
    for name, shape in shapes.items():
        dtype = _blob_dtype(name, kv_dtype)
        array = np.frombuffer(raw, dtype=dtype, count=int(np.prod(shape)), offset=offset).reshape(shape)
        arrays[name] = array if dtype.kind == "f" else array.astype(dtype.newbyteorder("=")).view(
            kv_storage_dtype(kv_dtype))
        offset += sizes[name]
    return Chunk(header["key"], header["parent"], int(header["start"]), list(header["tokens"]), arrays)
