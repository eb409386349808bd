"""Token windows to evaluate or calibrate over: UTF-8 text cut into fixed-length windows, or a JSON list of
token-id lists (both untrusted input files)."""

from __future__ import annotations

from pathlib import Path

from glmkit.errors import GlmkitError
from glmkit.format.files import parse_json, read_capped, read_text_file
from glmkit.generate.engine import Engine
from glmkit.generate.tokenizer import ChatTokenizer

DEFAULT_CTX = 512
MAX_INPUT_BYTES = 256 << 20


def text_windows(engine: Engine, path: Path, ctx: int) -> list[list[int]]:
    """The text at `path`, tokenized, as consecutive windows of `ctx` tokens (a shorter tail is dropped)."""
    if engine.tokenizer is None:
        raise GlmkitError("internal error: tokenizer not loaded")
    return tokenized_windows(engine.tokenizer, path, ctx)


def tokenized_windows(tokenizer: ChatTokenizer, path: Path, ctx: int) -> list[list[int]]:
    """`text_windows` with a tokenizer of its own (a source snapshot's, before any conversion)."""
    if ctx < 2:
        raise GlmkitError(f"--ctx: must be at least 2, got {ctx}")
    ids = tokenizer.encode(read_text_file(path, MAX_INPUT_BYTES))
    if len(ids) < ctx:
        raise GlmkitError(f"{path}: {len(ids)} tokens, fewer than one --ctx window of {ctx}")
    return [ids[i:i + ctx] for i in range(0, len(ids) - ctx + 1, ctx)]


def token_windows(path: Path, vocab_size: int) -> list[list[int]]:
    """A JSON list of windows, each a list of at least 2 token ids below `vocab_size`."""
    windows = parse_json(read_capped(path, MAX_INPUT_BYTES), str(path))  # UTF-8, nesting bounded
    if not isinstance(windows, list) or not windows:
        raise GlmkitError(f"{path}: must be a non-empty JSON list of token-id lists")
    for i, w in enumerate(windows):
        if not isinstance(w, list) or len(w) < 2:
            raise GlmkitError(f"{path}: window {i} must be a list of at least 2 token ids")
        if not all(type(t) is int and 0 <= t < vocab_size for t in w):
            raise GlmkitError(f"{path}: window {i} holds something other than token ids below {vocab_size}")
    return windows


