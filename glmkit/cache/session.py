"""`Session`: one conversation's KV state, reusing what this process and earlier ones computed.

Before each request the session keeps the longest common prefix of its in-process KV cache; when the
on-disk prefix cache can supply a longer prefix (an earlier process, another conversation), it
restores that instead. After each request it stores the new chunks, so the next request - in this
process or a later one - skips them. That reuse is exact: same model hash, same tokens, same kernels,
up to the first token that differs.

With an `ApproxPolicy` (`glm-run --reuse approximate`, opt-in) the session goes further: after the exact
prefix it imports rows of chunks stored at OTHER positions (identical tokens, or similar chunks found through
the hnswlib index, aligned token by token), re-rotated to their new positions, and computes every other
position up to the last imported one in a single pass (`blend.forward_at`: each computed position attends to
all rows at or before it, as a left-to-right build would, without one forward per gap). The first
`recompute_ratio` of each reused run is recomputed rather than imported (the rows nearest the changed
context deviate most). Imported rows were computed in another context, so
they and every row computed after them are approximate: `exact_len` marks where exactness ends, only
rows before it are ever stored, and the MTP head drafts nothing for such a request (its rows cannot be
rebuilt from imported ones). `last_reuse` counts exact, approximate and computed tokens.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from glmkit.cache.chunk_index import DEFAULT_MAX_ELEMENTS
from glmkit.cache.prefix_cache import (
    Piece,
    PrefixCache,
    common_prefix,
    rerotate,
)
from glmkit.errors import GlmkitError
from glmkit.format.files import make_private_dirs, open_regular, write_private_file
from glmkit.model.glm5 import GlmMoeDsaModel
from glmkit.model.kv_cache import KVCache

DEFAULT_SIMILARITY = 0.5
DEFAULT_RECOMPUTE_RATIO = 0.1
MAX_SESSION_NAME = 64
SESSION_NAME = re.compile(rf"[A-Za-z0-9_-][A-Za-z0-9._-]{{0,{MAX_SESSION_NAME - 1}}}")
MAX_SESSION_BYTES = 64 << 20  # a saved conversation beyond this is not one glm-run wrote for a context window


@dataclass
class ApproxPolicy:
    """Opt-in approximate reuse of chunks stored at other positions (see the module docstring)."""

    threshold: float = DEFAULT_SIMILARITY  # cosine similarity a similar (non-identical) chunk needs
    recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO  # fraction of the reused tokens recomputed instead
    select: str = "first"  # which: "first" tokens of each reused run; "deviation": CacheBlend's layer-1 test
    similar: bool = True  # also search the hnswlib index (False: identical chunks only)
    min_block: int = 4  # identical tokens in a row needed to reuse part of a similar chunk
    max_index_elements: int = DEFAULT_MAX_ELEMENTS


@dataclass
class ReuseStats:
    """Where the prompt's KV rows came from, in tokens."""

    process: int = 0  # exact: the conversation's own KV cache from earlier turns
    ram: int = 0  # exact: the prefix cache's in-process tier
    disk: int = 0  # exact: prefix-cache blobs on disk
    approx: int = 0  # approximate: rows of chunks stored at other positions (or kept from an approximate turn)
    computed: int = 0  # prompt tokens computed while preparing (gaps between reused runs, recomputed starts)
    blend_recomputed: int = 0  # of those, tokens of reused runs recomputed instead of imported
    runs: int = 0  # reused runs (identical or similar spans)
    similar_runs: int = 0  # of those, found through the hnswlib index
    compute_s: float = 0.0  # model time spent while preparing

    @property
    def exact(self) -> int:
        return self.process + self.ram + self.disk

    def to_json(self) -> dict[str, int]:
        """The exact sources (`cached_from`)."""
        return {"process": self.process, "ram": self.ram, "disk": self.disk}


class Session:
    def __init__(self, model: GlmMoeDsaModel, prefix_cache: PrefixCache | None = None,
                 approximate: ApproxPolicy | None = None, holds_kv: bool = False):
        """holds_kv: the Session's is the model's only sequence (glm-run), so `prepare` first tells the model the rows
        a restore may add to those it holds (`GlmMoeDsaModel.hold_kv_rows`; a server's scheduler does it for all)."""
        self.model = model
        self.holds_kv = holds_kv
        self.prefix_cache = prefix_cache
        self.approximate = approximate
        self.kv: KVCache = model.new_cache()
        self.ids: list[int] = []  # tokens whose KV rows `kv` holds
        self.exact_len = 0  # rows [0, exact_len) of `kv` are exact; the rest (approximate reuse) are not
        self.last_reuse = ReuseStats()
        self._prepared_len = 0
        self._latents = None

    def prepare(self, prompt_ids: list[int]) -> KVCache:
        """A KV cache holding the longest reusable prefix of `prompt_ids` (never all of it when it comes from
        the prefix cache); with approximate reuse, also the reused and computed rows after it, up to at most
        the last prompt token (the caller computes the rest)."""
        if self.kv.lost:  # e.g. a restarted pipeline stage: start over, from the prefix cache where it has the prompt
            self.kv, self.ids, self.exact_len = self.model.new_cache(), [], 0
        if self.holds_kv:  # a restored candidate may hold the whole prompt beside the rows kept until it wins
            self.model.hold_kv_rows(self.kv.length + len(prompt_ids))
        keep = common_prefix(self.ids, prompt_ids)
        if self.approximate is None:
            keep = min(keep, self.exact_len)
        self.kv.truncate(keep)
        self.kv.fit(len(prompt_ids))  # arrays sized for a far longer sequence are remade for this one
        self.exact_len = min(self.exact_len, self.kv.length)
        stats = ReuseStats(process=self.exact_len, approx=self.kv.length - self.exact_len)
        if self.prefix_cache is not None and self.exact_len < len(prompt_ids) - 1:
            candidate = self.model.new_cache()
            found = self.prefix_cache.restore(candidate, prompt_ids)
            if candidate.length > self.exact_len:  # more exact rows win over kept approximate ones
                self.kv = candidate
                self.exact_len = candidate.length
                stats = ReuseStats(ram=min(found.from_ram, candidate.length),
                                   disk=max(candidate.length - found.from_ram, 0))
        if self.approximate is not None and self.prefix_cache is not None:
            self._build_approximate(prompt_ids, stats)
        self.ids = list(prompt_ids[:self.kv.length])
        self._prepared_len = self.kv.length
        self.last_reuse = stats
        return self.kv

    def store_progress(self, prompt_ids: list[int]) -> None:
        """Store the rows a prefill has computed so far, `prompt_ids[:kv.length]`, when they are exact (a run killed
        later in the prompt then resumes from them)."""
        if self.prefix_cache is not None and self.exact_len >= self._prepared_len:
            self.prefix_cache.store(self.kv, list(prompt_ids[:self.kv.length]))

    def commit(self, prompt_ids: list[int], generated: list[int]) -> None:
        """Record a finished request: the KV cache now holds prompt + generated[:-1] (the last token was
        sampled, never fed back). Stores the new chunks of the EXACT part in the prefix cache."""
        self.ids = (list(prompt_ids) + list(generated[:-1]))[:self.kv.length]
        if self.exact_len >= self._prepared_len:  # nothing approximate before the rows computed since
            self.exact_len = self.kv.length
        self.exact_len = min(self.exact_len, self.kv.length)
        if self.prefix_cache is not None:
            self.prefix_cache.store(self.kv, self.ids[:self.exact_len])
            self.prefix_cache.save_similar_index()

    # ---- approximate reuse ----

    def _build_approximate(self, ids: list[int], stats: ReuseStats) -> None:
        """Import the rows of reused runs at their new positions, then compute every other position up to the
        last import in one pass (`blend.forward_at`); the generator computes what follows."""
        cache, policy, kv, model = self.prefix_cache, self.approximate, self.kv, self.model
        assert cache is not None and policy is not None
        begin, end = kv.length, len(ids) - 1  # the last prompt token is the generator's
        if end - begin < min(cache.chunk_tokens, policy.min_block):
            return
        embed = None
        if policy.similar:
            if self._latents is None:
                from glmkit.cache.chunk_index import TokenLatents
                self._latents = TokenLatents(model)
            cache.open_similar_index(self._latents.center, policy.max_index_elements)
            embed = self._latents.embed
        imports: list[tuple[int, Piece, dict[str, np.ndarray], int]] = []
        runs = cache.find_runs(ids, begin, end, embed, policy.threshold, policy.min_block)
        for index, run in enumerate(runs):
            skip = min(run.length, math.ceil(policy.recompute_ratio * run.length - 1e-9)) \
                if policy.select == "first" else 0
            stats.blend_recomputed += skip
            q = run.start
            for piece in run.pieces:
                cut = min(skip, piece.count)
                skip -= cut
                q += cut
                if piece.count == cut:
                    continue
                part = Piece(piece.key, piece.chunk_start, piece.chunk_tokens, piece.offset + cut, piece.count - cut)
                rows = cache.load_piece(part, ids[q:q + part.count])
                if rows is not None:  # gone or damaged: those positions are computed instead
                    imports.append((q, part, rows, index))
                q += part.count
        if not imports:
            stats.blend_recomputed = 0
            return  # nothing to import: the generator computes the rest exactly (and MTP keeps drafting)
        from glmkit.cache.blend import blend_forward, forward_at, reserve

        stop = max(q + part.count for q, part, _, _ in imports)
        reserve(kv, stop - begin)
        imported = np.zeros(stop - begin, dtype=bool)
        for q, part, rows, _ in imports:
            self._import(rows, part.chunk_start + part.offset, q)
            imported[q - begin:q - begin + part.count] = True
        used = {index for *_, index in imports}
        stats.runs += len(used)
        stats.similar_runs += sum(runs[i].kind == "similar" for i in used)
        first_import = begin + int(np.argmax(imported))
        t = time.perf_counter()
        tokens = np.asarray(ids, dtype=np.int64)
        if policy.select == "deviation":
            span = np.arange(begin, stop)
            hidden, positions = blend_forward(model, tokens[span], span, kv, imported, policy.recompute_ratio)
            stats.blend_recomputed += len(positions) - int((~imported).sum())
        else:
            positions = begin + np.flatnonzero(~imported)
            hidden = forward_at(model, tokens[positions], positions, kv)
        stats.approx += stop - begin - len(positions)
        if self.exact_len == begin:  # the positions before the first import saw exact rows only: exact too
            head = first_import - begin
            mtp = kv.layer(model.config.num_hidden_layers)
            if head and cache.has_mtp and mtp.length == begin:  # their MTP rows, so that part can be stored
                model.mtp_forward(hidden[:head], np.asarray(ids[begin + 1:first_import + 1], dtype=np.int64), kv)
            self.exact_len = first_import
        stats.computed += len(positions)
        stats.compute_s += time.perf_counter() - t

    def _import(self, rows: dict[str, np.ndarray], old_start: int, new_start: int) -> None:
        """Write stored main-layer rows (from positions old_start..) at new_start.., re-rotating the roped parts:
        `k_rot` (rope on all its dims) and the indexer key (rope on its FIRST qk_rope_head_dim dims)."""
        cfg = self.model.config
        theta, rope = cfg.rope_theta, cfg.qk_rope_head_dim
        by_layer: dict[int, dict[str, np.ndarray]] = {}
        for name, array in rows.items():
            layer, field = name.split(".")
            if field == "k_rot":
                array = rerotate(array, old_start, new_start, theta)
            elif field == "index_k":
                array = np.concatenate([rerotate(array[:, :rope], old_start, new_start, theta), array[:, rope:]],
                                       axis=-1)
            by_layer.setdefault(int(layer), {})[field] = array
        for layer, fields in by_layer.items():
            count = len(next(iter(fields.values())))
            self.kv.layer(layer).overwrite(np.arange(new_start, new_start + count), **fields)


def session_path(cache_dir: Path, model_hash: str, name: str) -> Path:
    """`CACHE_DIR/sessions/<model hash[:16]>/NAME.json`; NAME is 1-64 letters, digits, '.', '_' or '-', not
    starting with '.' (a file name on every system, inside that directory)."""
    if not SESSION_NAME.fullmatch(name):
        shown = repr(name[:40]) + ("..." if len(name) > 40 else "")
        raise GlmkitError(f"--session: invalid name {shown}: use 1-{MAX_SESSION_NAME} letters, digits, '.', '_' "
                          "or '-', not starting with '.'")
    return cache_dir / "sessions" / model_hash[:16] / f"{name}.json"


def load_messages(path: Path) -> list[dict[str, Any]]:
    """A saved conversation (list of {role, content}); empty when none was saved yet."""
    if not os.path.lexists(path):
        return []
    try:
        with open_regular(path, follow_symlinks=False) as f:
            data = f.read(MAX_SESSION_BYTES + 1)
        if len(data) > MAX_SESSION_BYTES:
            raise ValueError
        messages = json.loads(data.decode())["messages"]
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                   for m in messages):
            raise ValueError
        return messages
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        raise GlmkitError(f"{path}: not a valid saved session (delete it to start over)") from None


def save_messages(path: Path, messages: list[dict[str, Any]]) -> None:
    """Write the conversation (mode 0600 in 0700 directories: it is a transcript)."""
    make_private_dirs(path.parent)
    write_private_file(path, json.dumps({"messages": messages}, ensure_ascii=False, indent=1).encode())
