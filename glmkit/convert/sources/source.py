"""`Source`: a snapshot plus how its shards reach the disk and how the manifest records it; `LocalSource`: a local
snapshot directory or a Hugging Face cache directory (hub.py holds the Hub's)."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

from glmkit.convert.sources.fetch import LocalShards
from glmkit.convert.sources.snapshot import HFSnapshot, check_side_files, file_identity
from glmkit.errors import GlmkitError

_COMMIT = re.compile(r"[0-9a-f]{40}")


class Source:
    """A snapshot plus how its shards get onto disk and how it is recorded (local directory; see hub.py)."""

    snapshot: HFSnapshot
    side_dir: Path  # holds config.json, tokenizer files, ... (copied into the container)
    side_files: list[str]  # the SIDE_FILES side_dir holds, checked (check_side_files)
    origin: dict[str, Any]  # manifest `source.origin`: provenance, not part of the model hash
    identity: dict[str, Any]  # what a resumed conversion must match
    remote = False
    cached: dict[str, Path] = {}  # shards already in the local HF cache (Hub sources)
    cache_dir: Path = Path(".")  # where --keep-source downloads go (Hub sources)

    def download_bytes(self) -> dict[str, int]:
        """Per shard, the bytes fetching it puts on OUT's file system (0: already local)."""
        return dict.fromkeys(self.snapshot.shard_bytes, 0)

    def cache_bytes(self) -> int:
        """Bytes the conversion adds to the HF cache (--keep-source)."""
        return 0

    def fetcher(self, steps: list[set[str]], staging: Path, budget: int, bar: Any) -> Any:
        return LocalShards()

    def digests(self, stop: threading.Event | None = None) -> dict[str, dict[str, object]]:
        """Manifest `source.files`: size and sha256 of every shard (`stop`: hashing ends early)."""
        return self.snapshot.file_digests(stop)

    def local_paths(self) -> list[Path]:
        """Source files and directories on this machine that the conversion reads (OUT must stay apart)."""
        return list(self.cached.values())

    def changed_since(self, recorded: dict[str, dict[str, object]], written_ns: int) -> str | None:
        """How the shards differ from a finished container's `source.files` (written at `written_ns`), or None.
        A Hub source compares the Hub's digests, which cost nothing to get."""
        return _first_change(recorded, self.digests())



    def close(self) -> None:
        pass


class LocalSource(Source):
    """A local snapshot directory, or a Hugging Face cache (`models--org--name` or one of its snapshots)."""

    def __init__(self, directory: Path, revision: str | None):
        snapshot_dir, repo, commit = _resolve_cache_dir(directory, revision)
        if repo is None and revision is not None:
            raise GlmkitError(f"{directory}: --revision applies to a Hub repo id or a Hugging Face cache directory, "
                              "not to a plain snapshot directory")
        self.directory = directory
        self.snapshot = HFSnapshot(snapshot_dir)
        self.side_dir = snapshot_dir
        self.side_files = check_side_files(snapshot_dir)
        path = str(snapshot_dir.resolve())
        if repo is None:
            self.origin = {"kind": "local", "path": path}
        else:
            self.origin = {"kind": "hf-cache", "repo": repo, "revision": commit, "path": path}
        self.identity = {**self.origin,
                         "files": {name: file_identity(p) for name, p in sorted(self.snapshot.paths.items())}}

    def local_paths(self) -> list[Path]:
        return [self.directory, self.side_dir, *self.snapshot.paths.values()]

    def changed_since(self, recorded: dict[str, dict[str, object]], written_ns: int) -> str | None:
        """Without reading the shards again: same names and sizes, none modified after the container was written."""
        now = {name: {"nbytes": size} for name, size in self.snapshot.shard_bytes.items()}
        if (change := _first_change({n: {"nbytes": r.get("nbytes")} for n, r in recorded.items()}, now)) is not None:
            return change
        for name, path in sorted(self.snapshot.paths.items()):
            if path.stat().st_mtime_ns > written_ns:
                return f"shard {name} changed (modified after the conversion)"
        return None


def _first_change(then: dict[str, dict[str, object]], now: dict[str, dict[str, object]]) -> str | None:
    """The first shard (by name) whose record differs between two `source.files` maps."""
    for name in sorted(set(then) | set(now)):
        if then.get(name) != now.get(name):
            return f"shard {name} " + ("appeared" if name not in then else "disappeared" if name not in now
                                       else "changed")
    return None


def _resolve_cache_dir(directory: Path, revision: str | None) -> tuple[Path, str | None, str | None]:
    """(snapshot dir, repo id, commit) for an HF cache dir; (directory, None, None) for anything else."""
    if directory.parent.name == "snapshots" and directory.parent.parent.name.startswith("models--"):
        repo = directory.parent.parent.name.removeprefix("models--").replace("--", "/", 1)
        if revision is not None and revision != directory.name:
            raise GlmkitError(f"{directory}: is the cache snapshot of commit {directory.name}, not --revision "
                              f"{revision}")
        return directory, repo, directory.name
    if not (directory.name.startswith("models--") and (directory / "snapshots").is_dir()):
        return directory, None, None
    repo = directory.name.removeprefix("models--").replace("--", "/", 1)
    wanted = revision or "main"
    if _COMMIT.fullmatch(wanted):
        commit = wanted
    else:
        ref = directory / "refs" / wanted
        if not ref.is_file():
            known = sorted(p.name for p in (directory / "refs").glob("*")) if (directory / "refs").is_dir() else []
            raise GlmkitError(f"{directory}: Hugging Face cache has no ref {wanted!r} (refs: "
                              f"{', '.join(known) or 'none'}); pass --revision with a branch or a commit under "
                              "snapshots/")
        commit = ref.read_text().strip()
    snapshot = directory / "snapshots" / commit
    if not snapshot.is_dir():
        raise GlmkitError(f"{directory}: Hugging Face cache has no snapshot {commit}")
    return snapshot, repo, commit


class BackgroundDigests:
    """`source.digests()` computed on a daemon thread while the conversion runs: a local source's shards
    are hashed in a pass of their own, overlapped with quantization (CPU-bound) instead of after it
    (reads and sha256 release the GIL)."""

    def __init__(self, source: Source):
        self._stop = threading.Event()
        self._digests: dict[str, dict[str, object]] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(source,), name="glmkit-digests", daemon=True)
        self._thread.start()

    def _run(self, source: Source) -> None:
        try:
            self._digests = source.digests(self._stop)
        except BaseException as e:  # handed to result()
            self._error = e

    def result(self) -> dict[str, dict[str, object]]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._digests is not None
        return self._digests

    def cancel(self) -> None:
        """Stop hashing at the next chunk; the daemon thread never holds up the process's exit."""
        self._stop.set()
