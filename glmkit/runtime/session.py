"""`Session`: one conversation's KV state, reusing what this process and earlier ones computed.

Before each request the session keeps the longest common prefix of its in-process KV cache; when the
on-disk prefix cache can supply a longer prefix (an earlier process, another conversation), it
restores that instead. After each request it stores the new chunks, so the next request - in this
process or a later one - skips them. Reuse is always exact: same model hash, same tokens, same kernels.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glmkit.errors import GlmkitError
from glmkit.runtime.kv_cache import KVCache
from glmkit.runtime.model import GlmMoeDsaModel
from glmkit.runtime.prefix_cache import PrefixCache, common_prefix


@dataclass
class ReuseStats:
    """Where the prompt's cached tokens came from, in tokens."""

    process: int = 0  # this session's KV cache from earlier turns
    ram: int = 0  # the prefix cache's in-process tier
    disk: int = 0  # prefix-cache blobs on disk

    def to_json(self) -> dict[str, int]:
        return {"process": self.process, "ram": self.ram, "disk": self.disk}


class Session:
    def __init__(self, model: GlmMoeDsaModel, prefix_cache: PrefixCache | None = None):
        self.model = model
        self.prefix_cache = prefix_cache
        self.kv: KVCache = model.new_cache()
        self.ids: list[int] = []  # tokens whose KV rows `kv` holds
        self.last_reuse = ReuseStats()

    def prepare(self, prompt_ids: list[int]) -> KVCache:
        """A KV cache holding the longest reusable prefix of `prompt_ids` (never all of it)."""
        keep = common_prefix(self.ids, prompt_ids)
        self.kv.truncate(keep)
        self.ids = self.ids[:self.kv.length]
        self.last_reuse = ReuseStats(process=self.kv.length)
        if self.prefix_cache is not None and self.kv.length < len(prompt_ids) - 1:
            candidate = self.model.new_cache()
            found = self.prefix_cache.restore(candidate, prompt_ids)
            if candidate.length > self.kv.length:
                self.kv, self.ids = candidate, list(prompt_ids[:candidate.length])
                self.last_reuse = ReuseStats(ram=min(found.from_ram, candidate.length),
                                             disk=max(candidate.length - found.from_ram, 0))
        return self.kv

    def commit(self, prompt_ids: list[int], generated: list[int]) -> None:
        """Record a finished request: the KV cache now holds prompt + generated[:-1] (the last token was
        sampled, never fed back). Stores the new chunks in the prefix cache."""
        self.ids = (list(prompt_ids) + list(generated[:-1]))[:self.kv.length]
        if self.prefix_cache is not None:
            self.prefix_cache.store(self.kv, self.ids)


def session_path(cache_dir: Path, model_hash: str, name: str) -> Path:
    if not name or "/" in name or name.startswith("."):
        raise GlmkitError(f"--session: invalid session name {name!r}")
    return cache_dir / "sessions" / model_hash[:16] / f"{name}.json"


def load_messages(path: Path) -> list[dict[str, Any]]:
    """A saved conversation (list of {role, content}); empty when none was saved yet."""
    if not path.is_file():
        return []
    try:
        messages = json.loads(path.read_text())["messages"]
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                   for m in messages):
            raise ValueError
        return messages
    except (OSError, ValueError, KeyError, TypeError):
        raise GlmkitError(f"{path}: not a valid saved session (delete it to start over)") from None


def save_messages(path: Path, messages: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"messages": messages}, ensure_ascii=False, indent=1))
    tmp.replace(path)
