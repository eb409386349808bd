"""Routed experts streamed from the mapping: residency counting, router-driven prefetch, RAM pinning.

The OS page cache is the expert cache. `ExpertStreamer` sits between the container and the model:
- it counts, per routed expert used, whether its bytes were already resident (`mincore`) - a hit -
  or had to come from disk - a miss;
- after each MoE layer routes, it applies the NEXT layer's router to the same normed hidden state
  and `madvise(WILLNEED)`s the experts that router would pick, so their reads overlap compute; under a device
  decode step (routing on the device) it advises each layer's routed experts as the routing completes;
- with a RAM budget it copies the most-used experts into anonymous memory (pinned: the page cache
  cannot evict them) once it has seen enough routing to know which are hot.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from glmkit.format.reader import Container
from glmkit.format.schema import EXPERT_PROJECTIONS, expert_weight_name
from glmkit.format.tensors import QuantWeight, Weight
from glmkit.model.layer_spec import MoESpec, layer_spec
from glmkit.model.ops import likely_experts, renormalized

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def resident_fraction(view: np.ndarray) -> float:
    """Fraction of the pages under this mapped array that are in RAM (Linux mincore)."""
    if view.nbytes == 0:
        return 1.0  # no pages to read
    start = view.ctypes.data - view.ctypes.data % mmap.PAGESIZE
    length = view.ctypes.data + view.nbytes - start
    pages = -(-length // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        return 1.0  # not a mapping we can query: count as resident rather than invent misses
    return np.count_nonzero(np.frombuffer(vec, np.uint8) & 1) / pages


def memory_limit_bytes(proc_cgroup: Path = Path("/proc/self/cgroup"), sysfs: Path = Path("/sys/fs/cgroup")) -> int:
    """The RAM this process may use: the machine's, or the lowest memory limit of its cgroup and the cgroups above it
    (v1 `memory.limit_in_bytes`, v2 `memory.max`) when lower. proc_cgroup, sysfs: where the kernel shows them."""
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return limit
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            root, knob = sysfs, "memory.max"
        elif "memory" in controllers.split(","):
            root, knob = sysfs / "memory", "memory.limit_in_bytes"
        else:
            continue
        group = root / path.strip().lstrip("/")
        for directory in (group, *group.parents):  # a limit may be set on any cgroup above this one
            try:
                text = (directory / knob).read_text().strip()
            except OSError:
                text = ""
            if text.isdigit():  # v2 says "max" when unlimited
                limit = min(limit, int(text))
            if directory == root:
                break
    return limit


def anonymous_resident_bytes() -> int:
    """This process's anonymous resident memory now (`RssAnon`: its heap, libraries' allocations, a device runtime's
    host memory); 0 where /proc does not say."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    line = next((row for row in status.splitlines() if row.startswith("RssAnon:")), None)
    return int(line.split()[1]) * 1024 if line is not None else 0


def outgrows_memory(container: Container, margin: int = 1 << 30, layers: range | None = None) -> bool:
    """Whether the container (with `layers`: those decoder layers' part of it, a pipeline stage's), plus `margin`
    bytes for the process, is larger than the RAM it may use: its experts are then read from disk again and again
    while decoding."""
    nbytes = container.nbytes if layers is None else container.layers_nbytes(layers)
    return nbytes + margin > memory_limit_bytes()


@dataclass
class ExpertStats:
    hits: int = 0
    misses: int = 0
    prefetched: int = 0
    pinned: int = 0
    pinned_bytes: int = 0
    usage: Counter = field(default_factory=Counter)

    def to_json(self) -> dict[str, int]:
        return {"expert_hits": self.hits, "expert_misses": self.misses, "experts_prefetched": self.prefetched,
                "experts_pinned": self.pinned, "pinned_mb": self.pinned_bytes >> 20}


class ExpertStreamer:
    """A weight source over a Container that tracks, prefetches and pins routed experts."""

    def __init__(self, container: Container, ram_budget_bytes: int = 0, prefetch: bool = True,
                 pin_after_tokens: int = 32):
        self.container = container
        self.config = container.config
        self.ram_budget = ram_budget_bytes
        self.prefetch = prefetch
        self.pin_after_tokens = pin_after_tokens
        self.stats = ExpertStats()
        self._specs = [layer_spec(self.config, i, container.has) for i in range(self.config.num_hidden_layers)]
        self._pinned: dict[str, Weight] = {}
        self._routed_tokens = 0
        self._pin_done = False  # pinning runs once, even when the budget holds no expert
        self._advised = threading.Lock()

    # ---- the weight-source interface the model uses ----

    def has(self, name: str) -> bool:
        return self.container.has(name)

    def weight(self, name: str) -> Weight:
        pinned = self._pinned.get(name)
        return pinned if pinned is not None else self.container.weight(name)

    # ---- the model's route hook ----

    def on_route(self, layer: int, expert_ids: np.ndarray, normed: np.ndarray | None = None) -> None:
        """Called after layer `layer` routed its tokens: `expert_ids [S, k]`, `normed [S, H]` its input.

        normed None: the experts already ran (the OpenCL device decode step reports its routing after the
        token): their use is counted, but not whether they were resident (they were just read) nor prefetch."""
        for expert in np.unique(expert_ids).tolist():
            self.stats.usage[(layer, expert)] += 1
            if normed is None:
                continue
            if self._is_resident(layer, expert):
                self.stats.hits += 1
            else:
                self.stats.misses += 1
        if layer == self.config.first_k_dense_replace:
            self._routed_tokens += len(expert_ids)
        if self.prefetch and normed is not None:
            self._prefetch_next(layer, normed)
        if self.ram_budget and not self._pin_done and self._routed_tokens >= self.pin_after_tokens:
            self.pin_hottest()

    def advise_routed(self, layer: int, expert_ids: np.ndarray) -> None:
        """madvise(WILLNEED) the experts a device decode step has just routed, before their kernels read them:
        the kernel then reads them in the background, many at once, instead of the step's worker threads faulting
        them in a page at a time. Called from the OpenCL runtime's callback threads (`DecodeStep.watch_routes`)."""
        experts = np.unique(expert_ids).tolist()  # no residency check first: it costs as much as the advice
        with contextlib.suppress(OSError, ValueError):  # advice only: e.g. the mapping closed at exit
            self.container.advise_experts(layer, experts, mmap.MADV_WILLNEED)
        with self._advised:  # callbacks of several layers may run at once
            self.stats.prefetched += len(experts)

    def warm_in_background(self, layers: range | None = None) -> threading.Thread:
        """Have the kernel read the whole container into the page cache, from a background thread (for a model that
        fits in memory: a decoded token then never waits for an expert that the prompt did not touch); with
        `layers`, only those layers' routed experts (a pipeline stage's share)."""

        def advise() -> None:
            with contextlib.suppress(OSError, ValueError):  # advice only: e.g. the container closed meanwhile
                if layers is None:
                    self.container.advise_all(mmap.MADV_WILLNEED)
                else:
                    for layer in layers:
                        self.container.advise_experts(layer, list(range(self.config.n_routed_experts)))

        thread = threading.Thread(target=advise, name="glmkit-warm", daemon=True)
        thread.start()
        return thread

    def _is_resident(self, layer: int, expert: int) -> bool:
        """Pinned, or every page of the expert's byte range (gate, up, down and scales) is in RAM."""
        if expert_weight_name(layer, expert, "gate_proj") in self._pinned:
            return True
        return resident_fraction(self.container.expert_bytes(layer, expert)) == 1.0

    def _prefetch_next(self, layer: int, normed: np.ndarray) -> None:
        nxt = layer + 1
        if nxt >= self.config.num_hidden_layers or not self.config.is_moe_layer(nxt):
            return
        this, following = self._specs[layer], self._specs[nxt]
        assert isinstance(following.ffn, MoESpec)
        r, w = following.ffn.router, self.container.weight
        estimate = renormalized(normed, w(this.post_attention_norm.weight), w(following.post_attention_norm.weight))
        likely = likely_experts(estimate, np.asarray(w(r.weight)), w(r.bias), r.top_k)  # [S, H] -> ids
        likely = [e for e in likely if not self._is_resident(nxt, e)]  # advising resident pages is wasted time
        if likely:
            self.container.advise_experts(nxt, likely, mmap.MADV_WILLNEED)
        self.stats.prefetched += len(likely)

    def pin_hottest(self) -> None:
        """Copy the most-used experts into RAM until the budget is spent."""
        self._pin_done = True
        used = 0
        for (layer, expert), _ in self.stats.usage.most_common():
            r = self.container.expert_range(layer, expert)
            if used + r.nbytes > self.ram_budget:
                break
            for proj in EXPERT_PROJECTIONS:
                name = expert_weight_name(layer, expert, proj)
                self._pinned[name] = copy_weight(self.container.weight(name))
            used += r.nbytes
            self.stats.pinned += 1
        self.stats.pinned_bytes = used


COPY_ALIGN = 256  # where each array of `copy_weights_into` starts (the kernels' widest loads)


def _arrays(w: Weight) -> list[np.ndarray]:
    return [w.packed, w.scales] if isinstance(w, QuantWeight) else [w]


def anonymous_bytes(nbytes: int, populate: bool = True) -> np.ndarray:
    """`nbytes` of anonymous memory (uint8, zeros) over a private mapping: weights copied there are used in place by
    the OpenCL backend, as the container's mapped ones are. `populate`: its pages are all taken at once (a block
    filled right away: populating a mapping costs the kernel less than faulting its pages in one by one), else each
    as it is first written (an expert cache's slots: as reads fill them; slots never read take no memory)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    return np.frombuffer(mmap.mmap(-1, max(nbytes, 1), flags=flags), np.uint8)[:nbytes]


def release_pages(data: np.ndarray) -> None:
    """Give the pages under `data` (whole pages of an `anonymous_bytes` block) back to the kernel
    (`MADV_DONTNEED`): they stop counting in the process's memory and read as zeros until written again."""
    if _libc.madvise(ctypes.c_void_p(data.ctypes.data), ctypes.c_size_t(data.nbytes), mmap.MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) of an expert cache's slots")


def weights_nbytes(ws: list[Weight]) -> int:
    """The bytes `copy_weights_into` needs for these weights."""
    return sum(-(-a.nbytes // COPY_ALIGN) * COPY_ALIGN for w in ws for a in _arrays(w))


def copy_weights_into(ws: list[Weight], data: np.ndarray) -> list[Weight]:
    """Copies of the weights' arrays one after another in `data` (uint8, at least `weights_nbytes(ws)` bytes),
    each at a multiple of COPY_ALIGN: views of one block of memory, so that a fused MLP reads them in place."""
    pos, out = 0, []
    for w in ws:
        copies = []
        for a in _arrays(w):
            copy = np.ndarray(a.shape, a.dtype, buffer=data, offset=pos)
            copy[...] = a
            copies.append(copy)
            pos += -(-a.nbytes // COPY_ALIGN) * COPY_ALIGN
        out.append(QuantWeight(*copies, w.bits, w.group_size, w.shape, w.scheme) if isinstance(w, QuantWeight)
                   else copies[0])
    return out


def copy_weight(w: Weight) -> Weight:
    """A copy of the weight's arrays in anonymous memory (out of the mapping)."""
    if isinstance(w, QuantWeight):
        return QuantWeight(w.packed.copy(), w.scales.copy(), w.bits, w.group_size, w.shape, w.scheme)
    return w.copy()
