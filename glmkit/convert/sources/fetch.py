"""`ShardFetcher`: keep on disk exactly the source shards the next conversion steps read, within a budget.

The converter writes output tensors in a fixed order (the layout); step `i` is one logical tensor and
reads the shards `steps[i]` names (the tensor's shard, the shard of its FP8 scales, the shard holding its
fused expert tensor). A shard is needed from its first step to its last; the fetcher downloads shards in
first-need order on a background thread and the converter, on the main thread, calls

    fetcher.acquire(i)   # blocks until step i's shards are on disk (and attached to the snapshot)
    ...convert step i...
    fetcher.release(i)   # discards every shard no step after i reads

A shard the waited-for step needs is fetched at once; a later one only while the fetched, not yet
released shards plus it fit in `budget` bytes. Downloads happen in first-need order, so while a
needed shard downloads nothing prefetched is held: the source bytes on disk never exceed
`max(budget, peak_alive_bytes(steps))`, the least any order-preserving converter needs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from glmkit.convert.sources.snapshot import HFSnapshot


class ShardStore(Protocol):
    """Where shards come from. `fetch` runs on the fetcher's thread; `discard` on the caller's."""

    def fetch(self, name: str) -> Path:
        """Get the shard onto local disk (download and verify); return its path."""
        ...

    def discard(self, name: str, path: Path) -> None:
        """The conversion no longer reads this shard: delete it if the store owns the file."""
        ...


@dataclass(frozen=True)
class ShardSchedule:
    order: list[str]  # shards in first-need order
    first: dict[str, int]
    last: dict[str, int]


def schedule(steps: list[set[str]]) -> ShardSchedule:
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, shards in enumerate(steps):
        for name in sorted(shards):
            first.setdefault(name, i)
            last[name] = i
    return ShardSchedule(sorted(first, key=lambda n: (first[n], n)), first, last)


def peak_alive_bytes(steps: list[set[str]], sizes: dict[str, int]) -> int:
    """The most bytes of shards alive (first need <= step <= last need) at any one step."""
    plan = schedule(steps)
    delta = [0] * (len(steps) + 1)
    for name in plan.order:
        delta[plan.first[name]] += sizes[name]
        delta[plan.last[name] + 1] -= sizes[name]
    peak = alive = 0
    for d in delta:
        alive += d
        peak = max(peak, alive)
    return peak


class ShardFetcher:
    """See the module docstring. `sizes[name]` is the disk cost of a shard (0 for one the store does not own)."""

    def __init__(self, store: ShardStore, snapshot: HFSnapshot, steps: list[set[str]], sizes: dict[str, int],
                 budget: int):
        self._store = store
        self._snapshot = snapshot
        self._steps = steps
        self._sizes = sizes
        self._budget = budget
        self._plan = schedule(steps)
        self._cond = threading.Condition()
        self._ready: dict[str, Path] = {}  # fetched and not released
        self._released: set[str] = set()
        self._held = 0
        self.peak_bytes = 0
        self._wanted = 0  # the step the converter waits for (or converts)
        self._error: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="glm-convert-fetch", daemon=True)
        self._thread.start()

    def _may_start(self, name: str) -> bool:
        return self._plan.first[name] <= self._wanted or self._held + self._sizes[name] <= self._budget

    def _run(self) -> None:
        try:
            for name in self._plan.order:
                with self._cond:
                    self._cond.wait_for(lambda name=name: self._stop or self._may_start(name))
                    if self._stop:
                        return
                path = self._store.fetch(name)
                with self._cond:
                    self._ready[name] = path
                    self._held += self._sizes[name]
                    self.peak_bytes = max(self.peak_bytes, self._held)
                    self._cond.notify_all()
        except BaseException as e:  # handed to the converter's thread by acquire()
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def acquire(self, step: int) -> None:
        """Block until every shard step `step` reads is on disk; attach the new ones to the snapshot."""
        needed = self._steps[step]
        with self._cond:
            self._wanted = step
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._error is not None or all(n in self._ready for n in needed))
            if self._error is not None:
                raise self._error
            arrived = {n: self._ready[n] for n in needed if n not in self._snapshot.paths}
        for name, path in sorted(arrived.items()):
            self._snapshot.attach(name, path)

    def release(self, step: int) -> None:
        """Step `step` is done: discard the shards whose last reader it was."""
        done = [n for n in self._steps[step] if self._plan.last[n] == step]
        for name in sorted(done):
            with self._cond:
                path = self._ready.pop(name)
            self._snapshot.detach(name)
            self._store.discard(name, path)
            with self._cond:
                self._released.add(name)
                self._held -= self._sizes[name]
                self._cond.notify_all()

    def close(self) -> None:
        """Stop fetching (a download in progress finishes on its own daemon thread)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._error is None and len(self._released) == len(self._plan.order):
            self._thread.join()


class LocalShards:
    """The fetcher of a local snapshot: every shard is already on disk and attached."""

    peak_bytes = 0

    def acquire(self, step: int) -> None:
        pass

    def release(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass
