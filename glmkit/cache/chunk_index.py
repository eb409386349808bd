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
reference vector, sha256 of the index file, labels marked deleted). The sqlite `entries.emb` column is the
source of truth: a missing, damaged or mismatched file is rebuilt from it, and on open the index is
reconciled with it (entries evicted by any process are marked deleted, entries stored by others are
added). Labels are derived from chunk keys (60 bits), so processes never need to agree on a counter.
The index holds at most `max_elements` live chunks; beyond that the least recently used drop out of it
(they stay in the exact cache).
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from glmkit.errors import GlmkitError
from glmkit.format.files import open_regular_file, read_json_file
from glmkit.model.glm5 import GlmMoeDsaModel

INDEX_VERSION = 1
DEFAULT_MAX_ELEMENTS = 100_000
MAX_META_BYTES = 1 << 20  # the index sidecar: a few fields
REFERENCE_SAMPLE = 4096  # vocabulary ids averaged into the reference vector
_HNSW = {"M": 16, "ef_construction": 100, "ef": 64}


def chunk_label(key: str) -> int:
    """The hnswlib label of a chunk: the first 60 bits of its key."""
    return int(key[:15], 16)


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
        """The saved index when its sidecar matches this chain and its checksum holds; else None."""
        try:  # regular files only (a FIFO here must not hang the run), the sidecar size-capped
            meta = read_json_file(self.meta_path, MAX_META_BYTES)
            with open_regular_file(self.path) as f:
                data = f.read()
        except (OSError, GlmkitError):
            return None
        expected = {"version": INDEX_VERSION, "root": self.root, "dim": self.dim, "center": self.center_digest}
        if not isinstance(meta, dict) or any(meta.get(k) != v for k, v in expected.items()) \
                or meta.get("sha256") != hashlib.sha256(data).hexdigest() \
                or not isinstance(meta.get("deleted"), list) or not meta.get("count", 0) <= self.max_elements:
            return None
        # hnswlib trusts its input (a damaged file can crash it): it only ever reads bytes we just verified,
        # from a private copy another process cannot replace under it
        tmp = self.path.with_name(f"{self.path.name}.load-{os.getpid()}-{time.monotonic_ns()}")
        try:
            tmp.write_bytes(data)
            index = self._hnswlib.Index(space="cosine", dim=self.dim)
            index.load_index(str(tmp), max_elements=self.max_elements, allow_replace_deleted=True)
        except (OSError, RuntimeError):
            return None
        finally:
            tmp.unlink(missing_ok=True)
        if index.get_max_elements() > self.max_elements:
            return None
        index.set_ef(_HNSW["ef"])
        self.deleted = {int(x) for x in meta["deleted"]}
        self.labels = OrderedDict((int(label), "") for label in index.get_ids_list() if int(label) not in self.deleted)
        self.rebuilt = False
        return index

    def save(self) -> None:
        """Write the index and its sidecar (temp + rename each); a no-op when nothing changed."""
        if not self.dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        stamp = f"{os.getpid()}-{time.monotonic_ns()}"
        tmp = self.path.with_name(f"{self.path.name}.tmp-{stamp}")
        meta_tmp = self.meta_path.with_name(f"{self.meta_path.name}.tmp-{stamp}")
        present = {int(x) for x in self.index.get_ids_list()}
        self.deleted &= present  # labels whose slot a new one took are gone for good
        try:
            self.index.save_index(str(tmp))
            digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
            meta_tmp.write_text(json.dumps({"version": INDEX_VERSION, "root": self.root, "dim": self.dim,
                                            "center": self.center_digest, "sha256": digest,
                                            "count": len(self.labels), "deleted": sorted(self.deleted)}))
            tmp.replace(self.path)
            meta_tmp.replace(self.meta_path)
            self.dirty = False
        finally:
            tmp.unlink(missing_ok=True)
            meta_tmp.unlink(missing_ok=True)

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
        free_slots = index.element_count - len(self.labels)  # elements marked deleted, reusable
        if free_slots <= 0 and index.element_count >= index.get_max_elements():
            index.resize_index(min(2 * index.get_max_elements(), self.max_elements))
        vec = (np.asarray(raw, dtype=np.float32) - self.center)[None, :]
        # replace_deleted: a new label takes a deleted element's slot (that label leaves the index)
        index.add_items(vec, np.array([label], dtype=np.uint64), num_threads=1, replace_deleted=True)
        self.deleted.discard(label)
        self.labels[label] = key
        self.dirty = True

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
