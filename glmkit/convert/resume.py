"""OUT's conversion state: a lock, what is being converted, and which data files are complete.

While a conversion runs, OUT holds `.glm-convert/`:

| file | what |
|---|---|
| `lock` | `flock`ed by the running converter (the kernel drops it when the process dies, even on kill -9) |
| `state.json` | the conversion's identity: source (repo + commit, or path + shard records), parameters, layout digest |
| `done.jsonl` | one line per completed data file, appended after its rename: its record, entries and identity |
| `source/` | downloaded shards waiting to be converted (deleted as soon as no remaining tensor needs them) |

A re-run with the same identity continues after the last complete data file; data files are written
deterministically, so the result is byte-identical to an uninterrupted run. A local shard's record is its
size, mtime and the sha256 of sampled bytes (`file_identity`), so a resume refuses a source edited since
the first run. The directory is removed once manifest.json is written.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glmkit.errors import GlmkitError
from glmkit.format.files import open_regular_file, parse_json, read_json_file

STATE_DIR = ".glm-convert"
MAX_STATE_BYTES = 16 << 20
MAX_DONE_BYTES = 512 << 20  # one line per data file, holding its manifest entries: GLM-5's are ~40 MB in all


@dataclass(frozen=True)
class DoneFile:
    record: dict[str, Any]  # {"nbytes", "sha256"} as in the manifest's `files`
    tensors: dict[str, dict[str, Any]]  # tensor name -> manifest entry JSON
    identity: dict[str, Any]  # file_identity of the data file once renamed into place


class ConversionState:
    def __init__(self, out: Path):
        self.out = out
        self.dir = out / STATE_DIR
        self.staging = self.dir / "source"
        self._lock_fd: int | None = None

    @property
    def locked(self) -> bool:
        return self._lock_fd is not None

    def exists(self) -> bool:
        """Whether OUT holds conversion state (whatever its shape: `identity` checks it)."""
        return os.path.lexists(self.dir / "state.json")

    def lock(self) -> None:
        """Take OUT's lock, or fail naming the process that holds it."""
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise GlmkitError(f"{self.out}: another glm-convert (pid {holder}) is converting into this directory; "
                              "wait for it to finish or stop it") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor drops the flock
            self._lock_fd = None

    def identity(self) -> dict[str, Any] | None:
        """The identity of the conversion OUT holds unfinished, None when there is none (state.json is read as
        untrusted: a damaged one is an error that --force gets past)."""
        path = self.dir / "state.json"
        if not os.path.lexists(path):
            return None
        try:
            state = read_json_file(path, MAX_STATE_BYTES)
        except GlmkitError as e:
            raise GlmkitError(f"unreadable conversion state ({e}); use --force to start over") from None
        if not isinstance(state, dict) or not isinstance(state.get("identity"), dict):
            raise GlmkitError(f"{path}: unreadable conversion state; use --force to start over")
        return state["identity"]

    def done(self) -> dict[str, DoneFile]:
        """Completed data files in completion order, up to the first line that is not a whole record (a torn
        last line, killed mid-append, or a damaged one: the files after it are converted again)."""
        out: dict[str, DoneFile] = {}
        path = self.dir / "done.jsonl"
        if not os.path.lexists(path):
            return out
        try:
            with open_regular_file(path) as f:
                text = f.read(MAX_DONE_BYTES + 1)
        except GlmkitError as e:
            raise GlmkitError(f"unreadable conversion state ({e}); use --force to start over") from None
        for line in text[:MAX_DONE_BYTES].splitlines():
            try:
                item = parse_json(line, str(path))
            except GlmkitError:
                break
            if not (isinstance(item, dict) and isinstance(item.get("file"), str)
                    and all(isinstance(item.get(k), dict) for k in ("record", "tensors", "identity"))):
                break
            out[item["file"]] = DoneFile(item["record"], item["tensors"], item["identity"])
        return out

    def start(self, identity: dict[str, Any]) -> None:
        """A fresh conversion: forget completed files (and staged shards) of any earlier one."""
        (self.dir / "done.jsonl").unlink(missing_ok=True)
        if self.staging.exists():
            shutil.rmtree(self.staging)
        tmp = self.dir / "state.json.tmp"
        tmp.write_text(json.dumps({"identity": identity}, indent=1, sort_keys=True) + "\n")
        tmp.replace(self.dir / "state.json")

    def record(self, file: str, record: dict[str, Any], tensors: dict[str, dict[str, Any]],
               identity: dict[str, Any]) -> None:
        """A data file is complete (already renamed into place, `identity` its file_identity): append it durably."""
        line = json.dumps({"file": file, "record": record, "tensors": tensors, "identity": identity},
                          separators=(",", ":")) + "\n"
        with open(self.dir / "done.jsonl", "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def clean_partial_downloads(self) -> None:
        """huggingface_hub's per-process `*.incomplete` files of a killed run are never reused."""
        for partial in self.staging.glob(".cache/huggingface/download/**/*.incomplete"):
            partial.unlink(missing_ok=True)

    def staged_bytes(self) -> int:
        """Bytes a previous run left in the staging folder (reused or freed by this one)."""
        if not self.staging.exists():
            return 0
        return sum(p.stat().st_size for p in self.staging.rglob("*") if p.is_file() and not p.is_symlink())

    def finish(self) -> None:
        """The container is complete: remove the state directory (lock included)."""
        shutil.rmtree(self.dir, ignore_errors=True)
        self.unlock()


def differences(then: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[str]:
    """Human-readable differences between two identities: `key: old (in OUT) vs new (now)`."""
    out: list[str] = []
    for key in sorted(set(then) | set(now)):
        a, b = then.get(key), now.get(key)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(differences(a, b, f"{prefix}{key}."))
        else:
            out.append(f"{prefix}{key}: {_short(a)} in OUT vs {_short(b)} now")
    return out


def source_change(then: dict[str, Any], now: dict[str, Any]) -> str | None:
    """When two identities differ only in the local source's shards: the first shard that changed and how."""
    rest_then = {k: v for k, v in then.items() if k != "source"}
    rest_now = {k: v for k, v in now.items() if k != "source"}
    source_then, source_now = then.get("source") or {}, now.get("source") or {}
    if (rest_then != rest_now or {k: v for k, v in source_then.items() if k != "files"}
            != {k: v for k, v in source_now.items() if k != "files"}):
        return None
    files_then, files_now = source_then.get("files") or {}, source_now.get("files") or {}
    for name in sorted(set(files_then) | set(files_now)):
        a, b = files_then.get(name), files_now.get(name)
        if a == b:
            continue
        if a is None or b is None:
            return f"shard {name} {'appeared' if a is None else 'disappeared'}"
        fields = sorted(set(a) | set(b)) if isinstance(a, dict) and isinstance(b, dict) else ["record"]
        return f"shard {name} changed ({', '.join(k for k in fields if a.get(k) != b.get(k))} differ)"
    return None


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True) if value is not None else "(none)"
    return text if len(text) <= 80 else text[:77] + "..."
