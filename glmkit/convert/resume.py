"""OUT's conversion state: a lock, what is being converted, and which data files are complete.

While a conversion runs, OUT holds `.glm-convert/`:

| file | what |
|---|---|
| `lock` | `flock`ed by the running converter (the kernel drops it when the process dies, even on kill -9) |
| `state.json` | the conversion's identity: source (repo + commit, or path + shard records), parameters, layout digest |
| `done.jsonl` | one line per completed data file, appended after its rename: file record and tensor entries |
| `source/` | downloaded shards waiting to be converted (deleted as soon as no remaining tensor needs them) |

A re-run with the same identity continues after the last complete data file; data files are written
deterministically, so the result is byte-identical to an uninterrupted run. A local shard's record is its
size, mtime and the sha256 of sampled bytes (`shard_identity`), so a resume refuses a source edited since
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

STATE_DIR = ".glm-convert"


@dataclass(frozen=True)
class DoneFile:
    record: dict[str, Any]  # {"nbytes", "sha256"} as in the manifest's `files`
    tensors: dict[str, dict[str, Any]]  # tensor name -> manifest entry JSON


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
        return (self.dir / "state.json").is_file()

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
        try:
            return json.loads((self.dir / "state.json").read_text())["identity"]
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise GlmkitError(f"{self.dir / 'state.json'}: unreadable conversion state; use --force to start "
                              "over") from None

    def done(self) -> dict[str, DoneFile]:
        """Completed data files in completion order; a torn last line (killed mid-append) is ignored."""
        out: dict[str, DoneFile] = {}
        try:
            lines = (self.dir / "done.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return out
        for line in lines:
            try:
                item = json.loads(line)
                out[item["file"]] = DoneFile(item["record"], item["tensors"])
            except (json.JSONDecodeError, KeyError, TypeError):
                break
        return out

    def start(self, identity: dict[str, Any]) -> None:
        """A fresh conversion: forget completed files (and staged shards) of any earlier one."""
        (self.dir / "done.jsonl").unlink(missing_ok=True)
        if self.staging.exists():
            shutil.rmtree(self.staging)
        tmp = self.dir / "state.json.tmp"
        tmp.write_text(json.dumps({"identity": identity}, indent=1, sort_keys=True) + "\n")
        tmp.replace(self.dir / "state.json")

    def record(self, file: str, record: dict[str, Any], tensors: dict[str, dict[str, Any]]) -> None:
        """A data file is complete (already renamed into place): append it durably."""
        line = json.dumps({"file": file, "record": record, "tensors": tensors}, separators=(",", ":")) + "\n"
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
