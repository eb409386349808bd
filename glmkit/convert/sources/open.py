"""`open_source`: SOURCE on the command line (a directory or a Hub repo id) -> its `Source`."""

from __future__ import annotations

import re
from pathlib import Path

from glmkit.convert.sources.source import LocalSource, Source
from glmkit.errors import GlmkitError

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def open_source(text: str, *, revision: str | None = None, endpoint: str | None = None,
                keep_source: bool = False) -> Source:
    """SOURCE on the command line: an existing directory (snapshot or HF cache), else a Hub repo id."""
    path = Path(text).expanduser()
    if path.exists() or not _REPO_ID.fullmatch(text):
        if not path.is_dir():
            raise GlmkitError(f"{path}: source snapshot directory not found")
        return LocalSource(path, revision)
    from glmkit.convert.sources.hub import HubSource  # imports huggingface_hub only when needed

    return HubSource(text, revision=revision, endpoint=endpoint, keep_source=keep_source)
