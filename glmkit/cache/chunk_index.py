"""Similar-chunk search for approximate prefill reuse: an hnswlib index over position-free chunk embeddings.

Embedding of a chunk of token ids: the mean of layer 0's `kv_lat` over its tokens, minus a fixed
per-model reference vector (the mean over a deterministic sample of the vocabulary), compared by cosine.
Layer 0's `kv_lat` of a token depends on that token alone (embedding -> input_layernorm -> kv_a_proj ->
kv_a_layernorm, before any attention), so the same vector comes from a stored chunk's own KV rows
and from a query window's token ids without running the model. It is a bag of the model's own token
latents: good for finding a chunk that shares most of its tokens with a window, blind to their order,
which is why every candidate is aligned token by token before any row is used (`PrefixCache.find_runs`).

One index per chain (model hash + numerics + MTP flag: the blob layouts that chain may load), in
`DIR/ann/<root>.hnsw` next to the sqlite index, with a sidecar JSON (format version, dimension, digest of the
reference vector, sha256 of the index file, labels marked deleted), both 0600. The sqlite `entries.emb` column is
the source of truth: a missing, damaged or mismatched file is rebuilt from it (a damaged one with a warning), and
on open the index is reconciled with it (entries evicted by any process are marked deleted, entries stored by
others are added). hnswlib trusts the file it loads (a crafted link list makes it read out of bounds), so the
file's whole structure is checked first (`hnsw_fault`). Labels are derived from chunk keys (60 bits), so
processes never need to agree on a counter. The index holds at most `max_elements` live chunks; beyond that the
least recently used drop out of it (they stay in the exact cache).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sqlite3
import struct
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from glmkit.errors import GlmkitError
from glmkit.format.files import (
    create_temp_beside,
    make_private_dirs,
    open_regular_file,
    read_json_file,
    write_private_file,
)
from glmkit.model.glm5 import GlmMoeDsaModel

INDEX_VERSION = 1
DEFAULT_MAX_ELEMENTS = 100_000
MAX_META_BYTES = 1 << 20  # the index sidecar: a few fields
REFERENCE_SAMPLE = 4096  # vocabulary ids averaged into the reference vector
_HNSW = {"M": 16, "ef_construction": 100, "ef": 64}
# the head of an index file as hnswlib 0.8 saves it: offsetLevel0, max_elements, cur_element_count,
# size_data_per_element, label_offset, offsetData, maxlevel, enterpoint_node, maxM, maxM0, M, mult, ef_construction
HNSW_HEADER = struct.Struct("<6QiI3QdQ")
_NO_NODE = 0xFFFFFFFF  # the entry point of an empty index
_LABEL_LIMIT = 1 << 60  # labels are 60 bits of a chunk key (`chunk_label`)


def chunk_label(key: str) -> int:
    """The hnswlib label of a chunk: the first 60 bits of its key."""
    return int(key[:15], 16)


def hnsw_fault(data: bytes, dim: int, max_elements: int) -> tuple[str | None, int]:
    """(What makes `data` other than an index hnswlib saved with `_HNSW`'s parameters over `dim`-wide vectors,
    None if nothing; its elements, deleted ones included). Every field hnswlib reads without a check when it loads,
    searches or inserts is checked: the header's sizes and parameters, at most `max_elements` elements, every link
    count within its level's bound, every neighbour an element that has that level, the entry point an element of
    the top level, the file's length to the byte; and finite vectors, labels of 60 bits."""
    m, m0 = _HNSW["M"], 2 * _HNSW["M"]
    links0, links = 4 + 4 * m0, 4 + 4 * m  # a level-0 link list and an upper level's: a count, then ids
    per_element = links0 + 4 * dim + 8  # level-0 links, the vector, the label
    if len(data) < HNSW_HEADER.size:
        return "shorter than its header", 0
    (offset0, _, n, size_per, label_at, vector_at, top, entry, max_m, max_m0, m_, mult,
     ef_construction) = HNSW_HEADER.unpack_from(data)
    if (offset0, size_per, label_at, vector_at, max_m, max_m0, m_, ef_construction) != (
            0, per_element, links0 + 4 * dim, links0, m, m0, m, max(_HNSW["ef_construction"], m)) \
            or not math.isclose(mult, 1 / math.log(m)):
        return "header", 0
    if n > max_elements:
        return f"{n} elements, more than {max_elements}", 0
    pos = HNSW_HEADER.size + n * per_element
    if len(data) < pos + 4 * n:
        return "truncated", 0
    if (n == 0 and (entry, top) != (_NO_NODE, -1)) or (n > 0 and not (entry < n and top >= 0)):
        return "entry point", 0
    level0 = np.frombuffer(data, np.uint8, n * per_element, HNSW_HEADER.size).reshape(n, per_element)
    head = level0[:, :links0].view("<u4")
    counts, marks = head[:, 0] & 0xFFFF, head[:, 0] >> 16  # the count's upper half holds the deleted mark
    if (counts > m0).any() or (marks > 1).any() \
            or (head[:, 1:][np.arange(m0) < counts[:, None]] >= n).any():
        return "level-0 links", 0
    if not np.isfinite(level0[:, vector_at:label_at].view("<f4").sum(dtype=np.float64)) \
            or (level0[:, label_at:].view("<u8") >= _LABEL_LIMIT).any():
        return "vectors or labels", 0
    levels = np.zeros(n, np.int64)
    upper: list[tuple[int, int]] = []  # (element, where its upper levels' links start)
    for i in range(n):
        (size,) = struct.unpack_from("<I", data, pos) if pos + 4 <= len(data) else (-1,)
        if size < 0 or size % links or pos + 4 + size > len(data):
            return "upper links", 0
        if size:
            levels[i] = size // links
            upper.append((i, pos + 4))
        pos += 4 + size
    if pos != len(data) or n and (levels.max() > top or levels[entry] != top):
        return "levels", 0
    for i, start in upper:
        block = np.frombuffer(data, "<u4", int(levels[i]) * (1 + m), start).reshape(-1, 1 + m)
        used = np.arange(m) < block[:, :1]
        ids = block[:, 1:][used]
        if (block[:, 0] > m).any() or (ids >= n).any() \
                or (levels[ids] < np.broadcast_to(np.arange(1, len(block) + 1)[:, None], used.shape)[used]).any():
            return "upper links", 0
    return None, n


class TokenLatents:
    """Layer 0's `kv_lat` of single tokens (context-free), and the per-model reference vector."""

    def __init__(self, model: GlmMoeDsaModel):
        self.model = model
        cfg = model.config
        self.dim = cfg.kv_lora_rank
        sample = np.unique(np.linspace(0, cfg.vocab_size - 1, min(cfg.vocab_size, REFERENCE_SAMPLE)).astype(np.int64))
        self.center = self(sample).mean(axis=0).astype(np.float32)

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        """`[S] -> [S, kv_lora_rank]`: exactly what layer 0 stores as `kv_lat` for these tokens."""
        return self.model.kv_latent(0, self.model.embed(np.asarray(ids, dtype=np.int64)))

    def embed(self, windows: list[list[int]]) -> np.ndarray:
        """Raw (uncentred) embeddings `[W, dim]` of token windows: the mean of their tokens' latents."""
        if not windows:
            return np.zeros((0, self.dim), np.float32)
        lat = self(np.concatenate([np.asarray(w, dtype=np.int64) for w in windows]))
        bounds = np.cumsum([0] + [len(w) for w in windows])
        return np.stack([lat[a:b].mean(axis=0) for a, b in zip(bounds[:-1], bounds[1:], strict=True)])


class ChunkIndex:
    """The hnswlib index of one chain's full chunks (cosine over centred embeddings)."""

    def __init__(self, db: sqlite3.Connection, directory: Path, root: str, center: np.ndarray,
                 max_elements: int = DEFAULT_MAX_ELEMENTS):
        import hnswlib  # only approximate reuse needs it

        self._hnswlib = hnswlib
        self.db = db
        self.root = root
        self.center = np.asarray(center, dtype=np.float32)
        self.dim = len(self.center)
        self.max_elements = max(int(max_elements), 1)
        self.path = Path(directory) / "ann" / f"{root[:32]}.hnsw"
        self.meta_path = self.path.with_suffix(".json")
        self.center_digest = hashlib.sha256(self.center.tobytes()).hexdigest()
        self.labels: OrderedDict[int, str] = OrderedDict()  # live label -> key, least recently used first
        self.deleted: set[int] = set()
        self.dirty = False
        self.rebuilt = False  # whether the last open had to rebuild from sqlite
        self.index = self._load() or self._empty()
        self.reconcile()

    # ---- persistence ----

    def _empty(self):
        index = self._hnswlib.Index(space="cosine", dim=self.dim)
        index.init_index(max_elements=min(self.max_elements, 1024), ef_construction=_HNSW["ef_construction"],
                         M=_HNSW["M"], random_seed=100, allow_replace_deleted=True)
        index.set_ef(_HNSW["ef"])
        self.labels.clear()
        self.deleted.clear()
        self.rebuilt = self.dirty = True
        return index

    def _load(self):
        """The saved index when its sidecar matches this chain and is well formed, its checksum holds and the
        index file is well formed (`hnsw_fault`); else None (rebuilt, with a warning where the files were damaged
        rather than missing, another format version's or another chain's)."""
        if not (os.path.lexists(self.meta_path) and os.path.lexists(self.path)):
            return None
        try:  # regular files only (a FIFO here must not hang the run), the sidecar size-capped
            meta = read_json_file(self.meta_path, MAX_META_BYTES)
            with open_regular_file(self.path) as f:
                data = f.read()
        except (OSError, GlmkitError) as e:
            return self._damaged(str(e))
        if isinstance(meta, dict) and (meta.get("version") != INDEX_VERSION or meta.get("root") != self.root
                                       or meta.get("center") != self.center_digest):
            return None
        why = self._sidecar_fault(meta)
        if why is None and meta["sha256"] != hashlib.sha256(data).hexdigest():
            why = "the index file does not match its digest"
        if why is None:
            why, elements = hnsw_fault(data, self.dim, self.max_elements)
            if why is None and meta["count"] > elements:  # not equal: hnswlib may keep an element no label names
                why = f"{elements} elements, fewer than the sidecar's count {meta['count']}"
        if why is not None:
            return self._damaged(why)
        # hnswlib reads the bytes just checked, from a private copy another process cannot replace under it
        tmp = None
        try:
            tmp, f = create_temp_beside(self.path, 0o600)
            with f:
                f.write(data)
            index = self._hnswlib.Index(space="cosine", dim=self.dim)
            index.load_index(str(tmp), max_elements=self.max_elements, allow_replace_deleted=True)
        except (OSError, RuntimeError) as e:
            return self._damaged(str(e))
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        index.set_ef(_HNSW["ef"])
        self.deleted = set(meta["deleted"])
        self.labels = OrderedDict((int(label), "") for label in index.get_ids_list() if int(label) not in self.deleted)
        self.rebuilt = False
        return index

    def _sidecar_fault(self, meta: Any) -> str | None:
        """What in the sidecar has another type or range than `save` writes (None: nothing)."""
        if not isinstance(meta, dict):
            return "the sidecar is not a JSON object"
        deleted = meta.get("deleted")
        faults = {"dim": type(meta.get("dim")) is not int or meta["dim"] != self.dim,
                  "sha256": not isinstance(meta.get("sha256"), str),
                  "count": type(meta.get("count")) is not int or not 0 <= meta["count"] <= self.max_elements,
                  "deleted": not isinstance(deleted, list) or len(deleted) > self.max_elements
                  or not all(type(x) is int and 0 <= x < _LABEL_LIMIT for x in deleted)}
        bad = [name for name, fault in faults.items() if fault]
        return f"the sidecar's {bad[0]!r}" if bad else None

    def _damaged(self, why: str) -> None:
        """No index loaded: said on stderr (it is rebuilt from the prefix cache)."""
        print(f"glmkit: warning: similar-chunk index {self.path} is damaged ({why}); rebuilt from the prefix cache",
              file=sys.stderr)

    def save(self) -> None:
        """Write the index and its sidecar (temp + rename each); a no-op when nothing changed."""
        if not self.dirty:
            return
        make_private_dirs(self.path.parent)
        present = {int(x) for x in self.index.get_ids_list()}
        self.deleted &= present  # labels whose slot a new one took are gone for good
        tmp, f = create_temp_beside(self.path, 0o600)  # hnswlib writes it by name, keeping its mode
        f.close()
        try:
            self.index.save_index(str(tmp))
            digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
            tmp.replace(self.path)
            write_private_file(self.meta_path, json.dumps({
                "version": INDEX_VERSION, "root": self.root, "dim": self.dim, "center": self.center_digest,
                "sha256": digest, "count": len(self.labels), "deleted": sorted(self.deleted)}).encode())
            self.dirty = False
        finally:
            tmp.unlink(missing_ok=True)

    def reconcile(self) -> None:
        """Make the index hold exactly the chain's embedded entries (up to the size bound)."""
        rows = self.db.execute("SELECT key, emb FROM entries WHERE root = ? AND emb IS NOT NULL "
                               "ORDER BY last_access", (self.root,)).fetchall()
        expected = {chunk_label(key): (key, emb) for key, emb in rows}
        for label in [x for x in self.labels if x not in expected]:
            self._delete(label)
        live = OrderedDict()
        for label, (key, _) in expected.items():  # least recently used first, like the cache
            if label in self.labels:
                live[label] = key
        missing = [(label, key, emb) for label, (key, emb) in expected.items() if label not in live]
        self.labels = live
        for label, key, emb in missing[-self.max_elements:]:
            self._add(label, key, np.frombuffer(emb, dtype="<f4"))

    # ---- updates ----

    def add(self, key: str, raw_embedding: np.ndarray) -> None:
        self._add(chunk_label(key), key, raw_embedding)

    def _add(self, label: int, key: str, raw: np.ndarray) -> None:
        if len(raw) != self.dim:
            return
        if label in self.labels:
            self.labels[label] = key
            self.labels.move_to_end(label)
            return
        while len(self.labels) >= self.max_elements:  # bounded: the least recently used drops out
            self._delete(next(iter(self.labels)))
        index = self.index
        vec = (np.asarray(raw, dtype=np.float32) - self.center)[None, :]
        labels = np.array([label], dtype=np.uint64)
        # back after a removal: its own element, its vector updated (given another deleted slot, the old one would
        # stay labelled too, and a later label taking it would unlink this label from its live element)
        if label in self.deleted and self._unmark(label):
            index.add_items(vec, labels, num_threads=1)
        else:
            free_slots = index.element_count - len(self.labels)  # elements marked deleted, reusable
            if free_slots <= 0 and index.element_count >= index.get_max_elements():
                index.resize_index(min(2 * index.get_max_elements(), self.max_elements))
            # replace_deleted: a new label takes a deleted element's slot (that label leaves the index)
            index.add_items(vec, labels, num_threads=1, replace_deleted=True)
        self.deleted.discard(label)
        self.labels[label] = key
        self.dirty = True

    def _unmark(self, label: int) -> bool:
        """Unmark a deleted label's element; False where a new label has taken its slot since."""
        try:
            self.index.unmark_deleted(label)
        except RuntimeError:
            return False
        return True

    def remove(self, keys: list[str]) -> None:
        for key in keys:
            label = chunk_label(key)
            if label in self.labels:
                self._delete(label)

    def _delete(self, label: int) -> None:
        self.labels.pop(label, None)
        try:
            self.index.mark_deleted(label)
            self.deleted.add(label)
        except RuntimeError:
            pass
        self.dirty = True

    def touch(self, key: str) -> None:
        label = chunk_label(key)
        if label in self.labels:
            self.labels.move_to_end(label)

    # ---- search ----

    def query(self, raw_embeddings: np.ndarray, k: int = 4) -> list[list[tuple[str, float]]]:
        """Per query row, up to `k` (key, cosine similarity) pairs, most similar first."""
        live = len(self.labels)
        if live == 0 or len(raw_embeddings) == 0:
            return [[] for _ in range(len(raw_embeddings))]
        k = min(k, live)
        vecs = np.asarray(raw_embeddings, dtype=np.float32) - self.center
        try:
            labels, distances = self.index.knn_query(vecs, k=k, num_threads=1)
        except RuntimeError:  # too few reachable live elements for k results
            labels, distances = self.index.knn_query(vecs, k=1, num_threads=1)
        out = []
        for row_labels, row_dist in zip(labels, distances, strict=True):
            hits = []
            for label, dist in zip(row_labels, row_dist, strict=True):
                key = self.labels.get(int(label))
                if key:
                    hits.append((key, float(1.0 - dist)))
            out.append(hits)
        return out

    def __len__(self) -> int:
        return len(self.labels)
