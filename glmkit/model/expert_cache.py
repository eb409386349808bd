"""Routed experts in a cache glmkit manages: a fixed arena of slots in anonymous memory, filled with `pread`.

Where the model is larger than the RAM the process may use, the page cache is a poor expert cache: it evicts 4 KB
pages by recency (hot non-expert weights included), reads ahead by file position and cannot be told which experts
matter. `ExpertCache` is a weight source (what `GlmMoeDsaModel` reads its tensors from) that instead
- copies every non-expert weight into anonymous memory once (they are read every token: never evicted);
- keeps routed experts in equal slots of one arena, each loaded by one `pread` of its contiguous byte range on a
  small pool of I/O threads (several reads in flight), with `O_DIRECT` where the file system takes it: the disk
  writes straight into the slot, with no page-cache copy to make, charge to the process and reclaim (the range is
  widened to whole pages, so an expert lies in its slot at its offset within its first page: `place`); where it
  does not, a buffered read whose page-cache copy is dropped after (`POSIX_FADV_DONTNEED`);
- evicts by frequency with aging (`ExpertScores`: each use counts `2^(uses so far / half_life)`, so a use
  `half_life` routed tokens ago weighs half of one now), never an expert handed out for the layer being computed;
- reads ahead: after layer L routes, layer L+1's router applied to L's hidden state (normed as L+1 norms it)
  names its likely experts,
  read while the recent share of named experts that were then routed to stays at least READ_AHEAD_PRECISION (a
  wrong guess costs a read and a slot); below it, only one layer in READ_AHEAD_PROBE is named, to keep measuring;
- persists the scores beside the prefill cache, keyed by the model hash, and loads the hot set from them in the
  background at start (into free slots only: the first token is not delayed);
- lends slots to the KV rows (`lend`): an auto-sized cache's arena also covers the room kept for the KV rows of the
  whole context, which short sequences leave empty; as the sequences' rows grow, the cache evicts that many bytes of
  its least used experts and gives their pages back to the kernel before the rows take them, and takes the slots
  back as the rows go.
A slot's bytes are the container's bytes, so every path gives the logits it gives on the mapping.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import math
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from glmkit.errors import GlmkitError
from glmkit.format.files import make_private_dirs, read_json_file, write_private_file
from glmkit.format.reader import Container
from glmkit.format.schema import EXPERT_PROJECTIONS, expert_weight_name, tensor_layer
from glmkit.format.tensors import Weight
from glmkit.model.expert_stream import (
    anonymous_bytes,
    anonymous_resident_bytes,
    copy_weight,
    copy_weights_into,
    memory_limit_bytes,
    release_pages,
    resident_fraction,
    weights_nbytes,
)
from glmkit.model.layer_spec import MLPSpec, MoESpec, layer_spec
from glmkit.model.ops import likely_experts, renormalized
from glmkit.units import format_size

SLOT_ALIGN = 4096  # slots start on page boundaries
USAGE_VERSION = 1
READ_AHEAD_PRECISION = 0.5  # read-ahead reads only while at least this share of what it names is routed to
READ_AHEAD_PROBE = 8  # while it does not read, read-ahead names (and measures) one layer's experts in this many
PRECISION_WEIGHT = 0.05  # weight of one layer's outcome in the moving average of the read-ahead's precision
# a usage file is read only up to its longest valid size: one `[layer, expert, score]` entry per routed expert, at
# most USAGE_ENTRY_BYTES each with its separator, and USAGE_HEAD_BYTES for the rest (GLM-5: ~1.3 MB)
USAGE_ENTRY_BYTES, USAGE_HEAD_BYTES = 64, 1024
Key = tuple[int, int]  # (layer, expert)


class ExpertScores:
    """Frequency with aging, as one number per expert: a use at routed-token count t adds `2^(t / half_life)`.

    Comparing two experts' sums compares their uses with older ones discounted by half every `half_life` tokens,
    without touching every score as time passes; sums are rescaled before they overflow."""

    def __init__(self, half_life: float = 256.0) -> None:
        self.half_life = half_life
        self.tokens = 0.0  # routed tokens seen (the clock)
        self.scores: dict[Key, float] = {}
        self._scale = 0.0  # log2 of the factor every stored score is divided by

    def use(self, key: Key, count: int = 1) -> None:
        self.scores[key] = self.scores.get(key, 0.0) + count * self._weight()

    def tick(self, tokens: int = 1) -> None:
        self.tokens += tokens
        exponent = self.tokens / self.half_life - self._scale
        if exponent > 512:  # keep every sum far from float overflow: divide all by 2^exponent
            factor = 2.0 ** -exponent
            self.scores = {k: v * factor for k, v in self.scores.items()}
            self._scale += exponent

    def _weight(self) -> float:
        return 2.0 ** (self.tokens / self.half_life - self._scale)

    def score(self, key: Key) -> float:
        return self.scores.get(key, 0.0)

    def normalized(self) -> dict[Key, float]:
        """Scores in units of one use now (what a later process starts from)."""
        now = self._weight()
        return {k: v / now for k, v in self.scores.items()}


@dataclass
class CacheStats:
    """Counters of routed-expert use; `to_json` is what `--stats-json` reports."""

    hits: int = 0  # routed to while in a slot
    misses: int = 0  # routed to while not in a slot (or still being read)
    bytes_read: int = 0
    mtp_bytes_read: int = 0  # ... of them the MTP layer's experts
    reads: int = 0
    io_wait_s: float = 0.0  # compute threads' time waiting for expert reads
    evictions: int = 0
    bounced: int = 0  # misses read into a temporary buffer: every slot held an expert of the layer in use
    predicted: int = 0  # read-ahead: experts named for the next layer
    predicted_used: int = 0  # ... that it then routed to
    read_ahead: int = 0  # reads the read-ahead started
    routed: int = 0  # experts routed to on layers that had a prediction
    preloaded: int = 0  # experts loaded from the usage file's hot set
    lent_most: int = 0  # the most slots lent to KV rows at once (`ExpertCache.lend`)

    def to_json(self) -> dict[str, float | int | None]:
        handed = self.hits + self.misses
        return {"expert_hits": self.hits, "expert_misses": self.misses,
                "expert_hit_rate": round(self.hits / handed, 4) if handed else None,
                "expert_bytes_read": self.bytes_read, "expert_bytes_read_mtp": self.mtp_bytes_read,
                "expert_reads": self.reads,
                "expert_io_wait_s": round(self.io_wait_s, 4), "expert_evictions": self.evictions,
                "expert_bounced": self.bounced, "experts_preloaded": self.preloaded,
                "readahead_recall": round(self.predicted_used / self.routed, 4) if self.routed else None,
                "readahead_precision": round(self.predicted_used / self.predicted, 4) if self.predicted else None,
                "readahead_reads": self.read_ahead, "expert_slots_lent_most": self.lent_most}


def usage_path(cache_dir: Path, model_hash: str, layers: range | None = None) -> Path:
    """Where the usage scores of the model `model_hash` are kept under `cache_dir`: one file for the whole model, or,
    with `layers`, one for those layers only (a pipeline stage's)."""
    part = "" if layers is None else f".layers-{layers.start}-{layers.stop - 1}"
    return cache_dir / "experts" / f"{model_hash}{part}.json"


def read_usage(path: Path, model_hash: str, n_layers: int, n_experts: int) -> dict[Key, float]:
    """Scores saved by `write_usage`; {} for a missing file or another version's or model's, and for a damaged or
    oversized one, which is said in one line and removed (the scores are only a hint; an engine that counts no
    routes would leave it to be said again on every run)."""

    def ignored(why: str) -> dict[Key, float]:
        print(f"glmkit: warning: expert usage file {path} is damaged ({why}); removed", file=sys.stderr)
        with contextlib.suppress(OSError):
            path.unlink()
        return {}

    if not os.path.lexists(path):
        return {}
    try:
        raw = read_json_file(path, USAGE_HEAD_BYTES + USAGE_ENTRY_BYTES * n_layers * n_experts)
    except (GlmkitError, OSError) as e:
        return ignored(str(e).removeprefix(f"{path}: "))
    if isinstance(raw, dict) and (raw.get("version") != USAGE_VERSION or raw.get("model_hash") != model_hash):
        return {}
    if not (isinstance(raw, dict) and isinstance(raw.get("scores"), list)):
        return ignored("no list of scores")
    out: dict[Key, float] = {}
    for item in raw["scores"]:
        if not (isinstance(item, list) and len(item) == 3 and all(isinstance(v, int | float) for v in item)
                and not any(isinstance(v, bool) for v in item)):
            return ignored(f"entry {str(item)[:40]}")
        layer, expert, score = item
        try:
            value = float(score)
        except OverflowError:  # an integer past a float's range
            value = math.inf
        if not (isinstance(layer, int) and isinstance(expert, int) and 0 <= layer < n_layers
                and 0 <= expert < n_experts and math.isfinite(value) and value >= 0):
            return ignored(f"entry {str(item)[:40]}")
        out[(layer, expert)] = value
    return out


def saved_scores(path: Path | None, container: Container, half_life: float = 256.0) -> ExpertScores:
    """Usage scores to go on from: those `save_scores` left at `path` for the container's routed experts (none
    where there is no path, or the file is missing, corrupt or another model's)."""
    scores = ExpertScores(half_life)
    if path is not None:
        cfg = container.config
        saved = read_usage(path, container.model_hash, cfg.num_layers_with_mtp, cfg.n_routed_experts)
        routed = {(r.layer, r.expert) for r in container.manifest.experts}
        scores.scores.update({key: score for key, score in saved.items() if key in routed})
    return scores


def save_scores(path: Path, model_hash: str, scores: ExpertScores) -> None:
    """`write_usage` of the scores in units of one use now; a file that cannot be written is left as it is (the
    scores are only a hint for the next process)."""
    try:
        write_usage(path, model_hash, scores.normalized())
    except OSError:
        pass


def write_usage(path: Path, model_hash: str, scores: dict[Key, float]) -> None:
    """Save scores (atomically: a temporary file renamed; a reader sees the old file or the new one)."""
    make_private_dirs(path.parent)
    body = {"version": USAGE_VERSION, "model_hash": model_hash,
            "scores": [[layer, expert, round(score, 6)] for (layer, expert), score in sorted(scores.items())]}
    write_private_file(path, json.dumps(body).encode())


def page_span(offset: int, nbytes: int) -> tuple[int, int]:
    """The whole pages (`SLOT_ALIGN`) holding bytes `[offset, offset + nbytes)` of a file: (first byte, length)."""
    start = offset // SLOT_ALIGN * SLOT_ALIGN
    return start, -(-(offset + nbytes - start) // SLOT_ALIGN) * SLOT_ALIGN


def expert_slot_bytes(container: Container) -> int:
    """The bytes of one slot of an expert cache over `container`: the most whole pages a routed expert spans."""
    return max(page_span(r.offset, r.nbytes)[1] for r in container.manifest.experts)


def activation_allowance(limit: int) -> int:
    """The bytes an auto-sized cache leaves for activations and KV rows under a memory limit: a quarter, at most
    1 GB (a prefill's chunks are cut to fit it: `prefill_rows_within`)."""
    return min(1 << 30, limit // 4)


def growth_allowance(limit: int) -> int:
    """The bytes an auto-sized cache also leaves under a memory limit for what the process comes to hold after it
    is sized, beyond activations and KV rows (kernels built for new shapes, sessions, the allocator's freed
    fragments): a sixteenth, at most 256 MB."""
    return min(256 << 20, limit // 16)


def routed_expert_bytes(container: Container, layers: range | None = None) -> int:
    """The bytes of the container's routed experts (with `layers`: those of these decoder layers only)."""
    return sum(r.nbytes for r in container.manifest.experts if layers is None or r.layer in layers)


def non_expert_bytes(container: Container, layers: range | None = None) -> int:
    """The container's bytes outside its routed experts: what an expert cache copies into RAM beside its slots (with
    `layers`, a pipeline stage's part: only those decoder layers' tensors)."""
    if layers is None:
        return container.nbytes - routed_expert_bytes(container)
    return container.layers_nbytes(layers) - routed_expert_bytes(container, layers)


def auto_cache_bytes(container: Container, reserve_bytes: int | None = None, pinned: bool = True, kv_bytes: int = 0,
                     lend_kv: bool = False, layers: range | None = None, activations: int | None = None
                     ) -> tuple[int, str]:
    """A cache size from the RAM this process may use (`memory_limit_bytes`: the cgroup's limit or the machine's),
    less the non-expert weights it copies into RAM (unless not `pinned`: a discrete GPU holds them),
    `reserve_bytes` for the process and activations (default: what the process holds now,
    `anonymous_resident_bytes`, `activation_allowance` and `growth_allowance`) and `kv_bytes` for the KV rows of the
    context it keeps (`lend_kv`: lent to the cache while the rows leave them empty, `lendable_bytes`); with `layers`,
    for those decoder layers only (a pipeline stage's part: their weights and experts); `activations`: the most
    bytes its forwards' temporaries take, where known (a pipeline stage's pieces), kept instead of the
    `activation_allowance` if fewer; with the reason, for the log."""
    limit, room, reserve_bytes, held = room_for_cache(container, reserve_bytes, pinned, layers, activations)
    copied = non_expert_bytes(container, layers) if pinned else 0
    experts = routed_expert_bytes(container, layers)
    size = max(0, min(room - kv_bytes, experts))
    weights = (f"less {format_size(copied)} of non-expert weights and" if pinned else
               "the non-expert weights on the GPU, less")
    kv = f" and {format_size(kv_bytes)} for KV rows (--max-context)" if kv_bytes else ""
    lent = lendable_bytes(container, size, kv_bytes) if lend_kv and size else 0
    kv += f", {format_size(lent)} of it lent to the cache while the rows leave it empty" if lent else ""
    why = (f"{format_size(size)}: {format_size(limit)} may be used, {weights} {format_size(reserve_bytes)} kept for "
           f"the process{held}{kv}; the experts are {format_size(experts)}")
    return size, why


def room_for_cache(container: Container, reserve_bytes: int | None, pinned: bool, layers: range | None = None,
                   activations: int | None = None) -> tuple[int, int, int, str]:
    """(the RAM this process may use, what it leaves for slots and KV rows, the `reserve_bytes` kept for the process,
    activations and later growth, what the process holds now as said in the log): see `auto_cache_bytes`. With
    `pinned` False and the cache already built, what is left for KV rows beside it."""
    limit = memory_limit_bytes()
    held = ""
    if reserve_bytes is None:
        now = anonymous_resident_bytes()
        allowance = activation_allowance(limit)
        if activations is not None:
            allowance = min(allowance, activations)
        reserve_bytes = now + allowance + growth_allowance(limit)
        held = f" ({format_size(now)} it holds now)"
    return limit, limit - (non_expert_bytes(container, layers) if pinned else 0) - reserve_bytes, reserve_bytes, held


def context_beside_cache(container: Container, kv_bytes_per_token: int) -> int:
    """The most positions whose KV rows (`kv_bytes_per_token` each) an auto-sized cache over `container`, its
    non-expert weights copied into RAM, can keep room for beside two layers' routed experts (the layer computed and
    the next one read ahead: 2 x `num_experts_per_tok` slots); 0 where the RAM holds not even those."""
    room = room_for_cache(container, None, True)[1]
    room -= 2 * container.config.num_experts_per_tok * expert_slot_bytes(container)
    return max(0, room) // kv_bytes_per_token


def lendable_bytes(container: Container, size: int, kv_bytes: int) -> int:
    """The bytes of the `kv_bytes` kept for KV rows that an auto-sized cache of `size` bytes also takes, lent to the
    rows as they grow (`ExpertCache.lend`): all of them, at most the routed experts the cache would not hold."""
    return max(0, min(kv_bytes, routed_expert_bytes(container) - size))


def slot_arena(nbytes: int, budget_bytes: int, pinned_bytes: int) -> np.ndarray:
    """The cache's `nbytes` of slots (for `--expert-cache budget_bytes`), each page taken as a read first fills it
    (opening does not wait for the kernel to populate them all, and slots lent to KV rows before any read never take
    memory); a GlmkitError where they and the `pinned_bytes` of other weights copied into RAM beside them are more
    than the RAM this process may use (`memory_limit_bytes`), or where the mapping cannot be had."""
    limit = memory_limit_bytes()
    if nbytes + pinned_bytes > limit:
        raise GlmkitError(f"--expert-cache {format_size(budget_bytes)}: its slots take {format_size(nbytes)} and the "
                          f"other weights {format_size(pinned_bytes)}, more than the {format_size(limit)} of RAM this "
                          f"process may use")
    try:
        return anonymous_bytes(nbytes, populate=False)
    except OSError as e:
        raise GlmkitError(f"--expert-cache {format_size(budget_bytes)}: {format_size(nbytes)} of RAM for its slots "
                          f"could not be had ({e.strerror})") from None


def open_for_experts(path: Path, direct: bool) -> tuple[int, bool]:
    """A read-only descriptor on `path` for expert reads: (descriptor, whether it reads with O_DIRECT), O_DIRECT
    when `direct` and the file system takes it, else buffered with the kernel's read-ahead off."""
    flag = getattr(os, "O_DIRECT", 0) if direct else 0
    if flag:
        try:
            return os.open(path, os.O_RDONLY | flag), True
        except OSError:
            pass  # e.g. a file system without direct I/O: buffered reads below
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd, False


class ExpertCache:
    """A weight source over `container` with its routed experts in `budget_bytes` of slots (see the module).

    io_threads: reads in flight at most; usage_file: where scores persist (None: they do not); scores: the usage to
    start from (default: what `saved_scores` reads at usage_file, aged by half_life); direct: read with `O_DIRECT`
    where the file system takes it (False: buffered reads everywhere); pin_weights: copy every other weight into RAM
    (False: the routed experts only, the rest read from the mapping, for a discrete GPU that holds them: the split
    step's CPU side). lendable_bytes: of the budget, the bytes `lend` may give to KV rows (the slots left are never
    lent). layers: only these decoder layers' routed experts are cached and other weights pinned (a pipeline stage's
    part; None: every layer's). Raises GlmkitError when the budget holds fewer slots than one layer routes to
    (`num_experts_per_tok`)."""

    def __init__(self, container: Container, budget_bytes: int, io_threads: int = 8, readahead: bool = True,
                 usage_file: Path | None = None, half_life: float = 256.0, direct: bool = True,
                 scores: ExpertScores | None = None, pin_weights: bool = True, lendable_bytes: int = 0,
                 layers: range | None = None) -> None:
        cfg = self.config = container.config
        self.container, self.readahead, self.usage_file = container, readahead, usage_file

        def ours(layer: int | None) -> bool:  # a tensor (or expert) of the layers this cache serves
            return layers is None or layer in layers

        ranges = [r for r in container.manifest.experts if ours(r.layer)]
        if not ranges:
            raise GlmkitError(f"{container.directory}: no routed experts to cache")
        self.slot_bytes = expert_slot_bytes(container)
        self.n_slots = min(budget_bytes // self.slot_bytes, len(ranges))  # more than every expert would sit empty
        if self.n_slots < cfg.num_experts_per_tok:
            raise GlmkitError(f"--expert-cache {budget_bytes} bytes holds {self.n_slots} experts of "
                              f"{self.slot_bytes} bytes; a layer routes to {cfg.num_experts_per_tok}: give at "
                              f"least {cfg.num_experts_per_tok * self.slot_bytes} bytes")
        specs = [layer_spec(cfg, i, container.has) for i in range(cfg.num_layers_with_mtp)]
        self.moe = {s.index: s.ffn for s in specs if isinstance(s.ffn, MoESpec) and ours(s.index)}
        self._post_attention_norms = [s.post_attention_norm.weight for s in specs]  # read-ahead's estimate
        # a shared expert that fits a slot is pinned in one past the routed ones: one device buffer holds a
        # layer's routed and shared experts, as the mapping's file does
        shared = {layer: ffn.shared for layer, ffn in self.moe.items() if pin_weights and ffn.shared is not None and
                  weights_nbytes([container.weight(n) for n in ffn.shared.names]) <= self.slot_bytes}
        self._shared_slot = {layer: self.n_slots + j for j, layer in enumerate(shared)}
        pinned = non_expert_bytes(container, layers) if pin_weights else 0  # copied into RAM below
        self.arena = slot_arena((self.n_slots + len(shared)) * self.slot_bytes, budget_bytes, pinned)
        self.stats = CacheStats()
        self.scores = scores if scores is not None else saved_scores(usage_file, container, half_life)
        self._names: dict[str, tuple[Key, int]] = {
            expert_weight_name(r.layer, r.expert, p): ((r.layer, r.expert), i)
            for r in ranges for i, p in enumerate(EXPERT_PROJECTIONS)}
        self._pinned: dict[str, Weight] = {}  # every other tensor, copied into RAM once
        if pin_weights:
            pinned_names = [name for name, entry in container.manifest.tensors.items()
                            if name not in self._names and entry.role != "scales" and ours(tensor_layer(name))]
            container.advise_tensors(pinned_names)  # the disk reads ahead of the copies below, not a fault at a time
            for layer, mlp in shared.items():
                self._pin_together(mlp.names, self._slot_data(self._shared_slot[layer]))
            for ffn in [s.ffn for s in specs if isinstance(s.ffn, MLPSpec) and ours(s.index)] + [
                    ffn.shared for layer, ffn in self.moe.items() if ffn.shared is not None and layer not in shared]:
                self._pin_together(ffn.names)  # a dense MLP's (or shared expert's) weights in one block
            for name in pinned_names:
                if name not in self._pinned:
                    self._pinned[name] = copy_weight(container.weight(name))
            container.release_pages()  # the copies are read from now on: the mapping's pages would count twice
        self._free = list(range(self.n_slots - 1, -1, -1))
        # slots that may be lent to KV rows: the budget less the lendable bytes keeps its own
        kept = max(cfg.num_experts_per_tok, (budget_bytes - lendable_bytes) // self.slot_bytes)
        self.lendable_slots = max(0, self.n_slots - kept)
        self._lent: list[int] = []  # slots lent, their pages given back
        self._lend_wanted = 0  # slots `lend` asked for: the rest are taken as the experts holding them are let go
        self._slot: dict[Key, int] = {}  # resident experts
        # where each read expert starts in the arena (-1: not resident or still being read), in page-aligned memory
        # that the device decode step's routing reads in place (`route_arena`); written only once an expert's bytes
        # are all in its slot, and set to -1 before its slot is taken
        self.place_table = anonymous_bytes(cfg.num_layers_with_mtp * cfg.n_routed_experts * 8).view(np.int64)
        self.place_table[:] = -1
        self._place_of = self.place_table.reshape(cfg.num_layers_with_mtp, cfg.n_routed_experts)
        self._views: dict[Key, list[Weight]] = {}
        self._loading: dict[Key, Future] = {}
        self._in_use: set[Key] = set()  # routed to by the layer being computed and not yet run: not evicted
        self._wanted: set[Key] = set()  # the next layer's experts read-ahead named: kept until it routes
        self._pending: list[Key] = []  # of those, the ones still to read once slots come free (`ran`)
        self._handed: dict[Key, list[Weight]] = {}  # its experts handed out so far
        self._elsewhere: set[Key] = set()  # routed experts another device holds: `hold_elsewhere`
        self._heap: list[tuple[float, int, Key]] = []  # (score when pushed, tiebreak, key): lazily updated
        self._parked: dict[Key, tuple[float, int, Key]] = {}  # entries taken off the heap while held: `_unpark`
        self._tiebreak = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="glmkit-experts")
        # descriptors of the cache's own, leaving the mapping's as they are: O_DIRECT where it is taken, else with
        # the kernel's read-ahead off (an expert is read whole, once: pages past it would be read for nothing)
        self._fds: dict[str, tuple[int, bool]] = {}  # file -> (descriptor, opened with O_DIRECT)
        for name in {r.file for r in ranges}:
            self._fds[name] = open_for_experts(container.directory / name, direct)
        self._predicted: dict[int, set[int]] = {}  # layer -> experts the read-ahead named for it
        self.ahead_precision = 1.0  # recent read-ahead precision (moving average): reads ahead while high enough
        self._probes = 0  # layers read-ahead passed over while not trusted
        self._first_moe = min(self.moe)
        self._closed = False
        self.preloader: threading.Thread | None = None  # loads the saved hot set into free slots
        known = {key: score for key, score in self.scores.scores.items() if ours(key[0])}  # the saved hot set
        hot = sorted(known, key=known.get, reverse=True)[:self.n_slots]
        if hot:
            self.preloader = threading.Thread(target=self._preload, args=(hot,), daemon=True, name="glmkit-preload")
            self.preloader.start()

    def _slot_data(self, slot: int) -> np.ndarray:
        return self.arena[slot * self.slot_bytes:(slot + 1) * self.slot_bytes]

    def _pin_together(self, names: tuple[str, ...], data: np.ndarray | None = None) -> None:
        """Copy these weights into RAM one after another, in `data` (default: a block of their own)."""
        ws = [self.container.weight(n) for n in names]
        if data is None:
            data = anonymous_bytes(weights_nbytes(ws))
        self._pinned.update(zip(names, copy_weights_into(ws, data), strict=True))

    # ---- the weight source the model reads ----

    def has(self, name: str) -> bool:
        return self.container.has(name)

    def weight(self, name: str) -> Weight:
        pinned = self._pinned.get(name)
        if pinned is not None:
            return pinned
        found = self._names.get(name)
        if found is None:
            return self.container.weight(name)  # raises the container's error for an unknown name
        key, projection = found
        return self.expert(*key)[projection]

    def expert(self, layer: int, expert: int) -> list[Weight]:
        """The expert's (gate, up, down), from its slot (waiting for its read on a miss); kept until the next layer
        routes. An expert no route named (a caller outside the model) is read as a miss."""
        key = (layer, expert)
        with self._lock:
            views = self._handed.get(key)
            if views is not None:
                return views  # its second and third projection
            self._in_use.add(key)
            if key in self._slot and key not in self._loading:
                views = self._handed[key] = self._views[key]
                return views
            future = self._loading.get(key) or self._start_load(key)
        started = time.perf_counter()
        views = future.result() if future is not None else self._bounce(key)
        with self._lock:
            self.stats.io_wait_s += time.perf_counter() - started
            self._handed[key] = views
        return views

    # ---- the model's route hook ----

    def on_route(self, layer: int, expert_ids: np.ndarray, normed: np.ndarray | None = None) -> None:
        """Layer `layer` routed `expert_ids [S, k]` (its input `normed [S, H]`): count their use (one per row), read
        its misses (several in flight), and read ahead the next MoE layer's likely experts."""
        rows_of = Counter(expert_ids.ravel().tolist())  # expert -> how many rows routed to it
        used = sorted(rows_of)
        with self._lock:
            self._in_use = {(layer, e) for e in used}  # the previous layer's experts have run; these are next
            self._handed = {}
            self._wanted, self._pending = set(), []  # the layer's own misses replace what was guessed for it
            self._unpark(list(self._parked))
            if len(self._lent) < self._lend_wanted:
                self._settle_lent()
            for e in used:
                key = (layer, e)
                if key in self._slot and key not in self._loading:
                    self.stats.hits += 1
                else:
                    self.stats.misses += 1
                self.scores.use(key, rows_of[e])
                self._push(key)
            if layer == self._first_moe:  # one tick per routed token
                self.scores.tick(len(expert_ids))
            predicted = self._predicted.pop(layer, None)
            if predicted is not None:
                self.stats.routed += len(used)
                self.stats.predicted_used += len(predicted & set(used))
                right = len(predicted & set(used)) / max(len(predicted), 1)
                self.ahead_precision += (right - self.ahead_precision) * PRECISION_WEIGHT
            for e in used:  # its misses, all in flight at once
                key = (layer, e)
                if key not in self._slot and self._start_load(key) is None:
                    break  # every slot holds an expert of this layer: the rest are read as they run
        if normed is not None:
            self.read_ahead(layer, normed)

    def read_ahead(self, layer: int, normed: np.ndarray) -> None:
        """Start reading the experts layer `layer + 1`'s router picks for the hidden state of `normed [S, H]` (layer
        `layer`'s MoE or dense MLP input), normed as layer `layer + 1` norms it, that are not cached (when read-ahead is
        on)."""
        if not self.readahead:
            return
        nxt = self.moe.get(layer + 1) if layer + 1 < self.config.num_hidden_layers else None
        if nxt is None:
            return
        if self.ahead_precision < READ_AHEAD_PRECISION:
            self._probes += 1
            if self._probes % READ_AHEAD_PROBE:
                return  # not trusted: naming costs a router product; one layer in READ_AHEAD_PROBE keeps measuring
        r, norms = nxt.router, self._post_attention_norms
        estimate = renormalized(normed, self.weight(norms[layer]), self.weight(norms[layer + 1]))  # [S, H]
        likely = {e for e in likely_experts(estimate, np.asarray(self.weight(r.weight)), self.weight(r.bias), r.top_k)
                  if (layer + 1, e) not in self._elsewhere}
        self._predicted[layer + 1] = likely
        with self._lock:
            self.stats.predicted += len(likely)
            if self.ahead_precision < READ_AHEAD_PRECISION:
                return  # named (its precision still measured), not read: a wrong guess costs a read and a slot
            self._wanted = {(layer + 1, e) for e in likely}
            self._pending = [(layer + 1, e) for e in sorted(likely) if (layer + 1, e) not in self._slot]
            self._continue_read_ahead()

    def ran(self, layer: int, expert: int) -> None:
        """Layer `layer`'s expert `expert` has run on all of its rows (a prompt's MoE runs each routed expert once):
        its slot may be evicted now, and the next layer's pending read-ahead continues into free slots."""
        with self._lock:
            key = (layer, expert)
            self._in_use.discard(key)
            self._handed.pop(key, None)
            self._unpark([key])
            self._continue_read_ahead()

    def _continue_read_ahead(self) -> None:
        """Start the pending read-ahead's reads while slots can be had (lock held); the layer being computed goes
        first: nothing starts while one of its routed experts waits for a slot."""
        if not self._pending or any(key not in self._slot for key in self._in_use):
            return
        while self._pending:
            key = self._pending[0]
            if key not in self._slot:
                if self._start_load(key) is None:
                    return
                self.stats.read_ahead += 1
            self._pending.pop(0)

    def untaken_bytes(self) -> int:
        """The arena's bytes whose pages no read has taken yet (`slot_arena`): what the process will come to hold
        as its slots fill, beside what it holds now."""
        return round(self.arena.nbytes * (1 - resident_fraction(self.arena)))

    def lend(self, nbytes: int) -> None:
        """Keep `nbytes` (at most the lendable slots') out of the arena for KV rows: slots evicted (free ones first,
        then the least used experts') and their pages given back to the kernel, or slots lent before taken back
        into use. Slots whose experts are held now (`_held`) are taken after the next layer routes. Call it from
        the thread that routes, before the rows grow."""
        with self._lock:
            self._lend_wanted = min(self.lendable_slots, -(-max(nbytes, 0) // self.slot_bytes))
            self._settle_lent()

    def _settle_lent(self) -> None:
        """Lend slots or take them back until `_lend_wanted` are lent, as far as slots can be had (lock held)."""
        while len(self._lent) > self._lend_wanted:
            self._free.append(self._lent.pop())  # its pages come back as a read writes them
        while len(self._lent) < self._lend_wanted:
            slot = self._claim_slot()
            if slot is None:
                break  # every slot is held: the rest once the next layer has routed
            release_pages(self._slot_data(slot))
            self._lent.append(slot)
        self.stats.lent_most = max(self.stats.lent_most, len(self._lent))

    # ---- slots ----

    def _start_load(self, key: Key) -> Future | None:
        """Claim a slot for `key` and queue its read (lock held); None when every slot is held (`_held`)."""
        slot = self._claim_slot()
        if slot is None:
            return None
        self._slot[key] = slot
        future = self._pool.submit(self._load, key, slot)
        self._loading[key] = future
        return future

    def _claim_slot(self) -> int | None:
        """A free slot, or the slot of the resident expert with the lowest score that is not held (lock held)."""
        if self._free:
            return self._free.pop()
        while self._heap:
            entry = heapq.heappop(self._heap)
            score, _, key = entry
            if key not in self._slot:
                continue  # stale: evicted since
            if self._held(key):
                self._parked[key] = entry  # off the heap until it is no longer held: not popped again per claim
                continue
            if score != self.scores.score(key):  # used since it was pushed: back with its score now
                heapq.heappush(self._heap, (self.scores.score(key), entry[1], key))
                continue
            self.stats.evictions += 1
            return self._unslot(key)
        return None

    def _unslot(self, key: Key) -> int:
        """Take a resident expert out of its slot, found nowhere any more (lock held); returns the slot."""
        self._place_of[key] = -1
        self._views.pop(key, None)
        return self._slot.pop(key)

    def _held(self, key: Key) -> bool:
        """Not to be evicted now: being read, routed to by the layer being computed and not yet run, or named by
        the next layer's read-ahead."""
        return key in self._loading or key in self._in_use or key in self._wanted

    def _unpark(self, keys: list[Key]) -> None:
        """Back on the heap, the parked entries of those `keys` that are no longer held (lock held)."""
        for key in keys:
            if key in self._parked and not self._held(key):
                del self._parked[key]
                if key in self._slot:
                    self._push(key)

    def _push(self, key: Key) -> None:
        self._tiebreak += 1
        heapq.heappush(self._heap, (self.scores.score(key), self._tiebreak, key))
        if len(self._heap) > 4 * self.n_slots + 1024:  # outdated entries pile up: one entry per resident expert
            self._heap = [(self.scores.score(k), i, k) for i, k in enumerate(self._slot)]
            heapq.heapify(self._heap)
            self._parked.clear()  # every resident expert has its entry on the heap again

    def _load(self, key: Key, slot: int) -> list[Weight]:
        data = self._slot_data(slot)
        try:
            views = self._read_into(key, data)
        except BaseException:
            with self._lock:  # the slot goes back: a failed read holds none
                self._loading.pop(key, None)
                self._slot.pop(key, None)
                self._free.append(slot)
            raise
        with self._lock:
            self._loading.pop(key, None)
            if key in self._elsewhere and key not in self._in_use:  # another device took it while it was read
                self._slot.pop(key, None)
                self._free.append(slot)
                return views
            self._views[key] = views
            self._place_of[key] = self.place(*key, slot)
            self._parked.pop(key, None)
            self._push(key)
        return views

    def _bounce(self, key: Key) -> list[Weight]:
        """A miss with no slot to spare: read into a buffer of its own, not cached."""
        with self._lock:
            self.stats.bounced += 1
        r = self.container.expert_range(*key)
        return self._read_into(key, anonymous_bytes(page_span(r.offset, r.nbytes)[1]))

    def _read_into(self, key: Key, data: np.ndarray) -> list[Weight]:
        """Read the expert's byte range into `data` (page-aligned, a slot's bytes) at its offset within its first
        page, with one pread: of its whole pages with O_DIRECT, else of its range, the page cache's copy dropped."""
        r = self.container.expert_range(*key)
        fd, direct = self._fds[r.file]
        shift = r.offset % SLOT_ALIGN
        start, nbytes = page_span(r.offset, r.nbytes) if direct else (r.offset, r.nbytes)
        into = 0 if direct else shift  # whole pages land at the slot's start, the bare range at its offset
        view, done, need = memoryview(data)[into:into + nbytes], 0, r.offset + r.nbytes - start
        while done < need:
            n = os.preadv(fd, [view[done:]], start + done)
            done += max(n, 0)
            if n <= 0 or (direct and done < need and done % SLOT_ALIGN):  # a short direct read: the file's end
                raise GlmkitError(f"{self.container.directory / r.file}: expert {key[1]} of layer {key[0]} ends at "
                                  f"byte {start + done} (the file was truncated while in use?)")
        if not direct:
            os.posix_fadvise(fd, r.offset, r.nbytes, os.POSIX_FADV_DONTNEED)
        with self._lock:
            self.stats.bytes_read += r.nbytes
            self.stats.mtp_bytes_read += r.nbytes if key[0] >= self.config.num_hidden_layers else 0
            self.stats.reads += 1
        return self.container.expert_weights(key[0], key[1], data[shift:shift + r.nbytes])

    def _preload(self, hot: list[Key]) -> None:
        for key in hot:
            with self._lock:
                if self._closed or not self._free:
                    return
                if key in self._slot or key in self._elsewhere:
                    continue
                future = self._start_load(key)
                self.stats.preloaded += 1
            if future is not None:
                future.result()

    # ---- slots read in place (the device decode step) ----

    @property
    def slot_count(self) -> int:
        """Slots in the arena: the routed experts' `n_slots`, then the pinned shared experts'."""
        return len(self.arena) // self.slot_bytes

    def slot_weights(self, layer: int, slot: int) -> list[Weight]:
        """(gate, up, down) of `layer`'s routed experts as views on an expert lying at the start of slot `slot` (the
        layout of the layer's expert 0: `uniform_layout` says whether all share it); nothing is read."""
        return self.container.expert_weights(layer, 0, self._slot_data(slot))

    def place(self, layer: int, expert: int, slot: int) -> int:
        """Where in the arena (a byte offset) the expert starts when slot `slot` holds it."""
        return slot * self.slot_bytes + self.container.expert_range(layer, expert).offset % SLOT_ALIGN

    def uniform_layout(self, layer: int) -> bool:
        """Whether every routed expert of `layer` lays its tensors out alike within its byte range."""
        def layout(expert: int) -> tuple:
            r = self.container.expert_range(layer, expert)
            entries = [self.container.entry(expert_weight_name(layer, expert, p)) for p in EXPERT_PROJECTIONS]
            entries += [self.container.entry(e.quant.scales) for e in entries if e.quant is not None]
            return tuple((e.offset - r.offset, e.dtype, tuple(e.stored_shape), e.quant and
                          (e.quant.bits, e.quant.group_size, e.quant.scheme)) for e in entries)
        return len({layout(e) for e in range(self.config.n_routed_experts)}) == 1

    def shared_slot(self, layer: int) -> int | None:
        """The slot `layer`'s shared expert is pinned in, or None (no shared expert, or one larger than a slot)."""
        return self._shared_slot.get(layer)

    def wait_places(self, layer: int, experts: list[int]) -> list[int]:
        """Where these experts of `layer` (routed by the last `on_route`) start in the arena once their reads are
        done; a miss without a slot yet claims one, waiting for reads in flight to give one back where every slot
        is held."""
        started, out = time.perf_counter(), []
        for e in experts:
            key = (layer, e)
            while True:
                with self._lock:
                    future = self._loading.get(key)
                    if future is None and key in self._slot:
                        out.append(self.place(layer, e, self._slot[key]))
                        break
                    if future is None:
                        future = self._start_load(key) or next(iter(self._loading.values()), None)
                    if future is None:
                        raise GlmkitError(f"the expert cache's {self.n_slots} slots are all held by experts of "
                                          f"layer {layer}")
                future.result()
        with self._lock:
            self.stats.io_wait_s += time.perf_counter() - started
        return out

    def hold_elsewhere(self, keys: Iterable[Key]) -> None:
        """These routed experts are held by another device (a discrete GPU's, beside the split step's CPU side, which
        reads the rest from here): never read ahead or preloaded, and their slots freed where they hold one."""
        with self._lock:
            self._elsewhere.update(keys)
            for key in self._elsewhere & self._slot.keys():
                if not self._held(key):
                    self._free.append(self._unslot(key))

    def resident(self, layer: int, expert: int) -> bool:
        with self._lock:
            return (layer, expert) in self._slot and (layer, expert) not in self._loading

    def close(self) -> None:
        """Finish the reads in flight and save the scores (when a usage file was given)."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)
        if self.preloader is not None:
            self.preloader.join()  # it stops at its next expert (closed), its last read done
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self.usage_file is not None:
            save_scores(self.usage_file, self.container.model_hash, self.scores)
