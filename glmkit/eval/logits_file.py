"""Saved reference log-probabilities for `glm-perplexity --save-logits / --kl-base` (a checked format).

One stock safetensors file (any safetensors tool reads it):

| tensor | dtype | shape | what |
|---|---|---|---|
| `logprobs` | F32 | `[N, V]` | log-softmax of the reference model's logits at every scored position |
| `tokens` | I32 | `[T]` | the evaluation windows, concatenated |
| `window_lengths` | I32 | `[W]` | their lengths (window w scores its first `len - 1` positions) |

`__metadata__`: `format` = `glmkit-logits`, `format_version` = `1`, `model_hash` (the reference container),
`vocab_size`, `tokens_sha256` (over the `tokens` then `window_lengths` bytes) and `logprobs_sha256`.
`logprobs` comes first, 64-byte aligned, so it can be mapped. A base is only ever compared with a run over
exactly the same token windows and vocabulary; anything else is refused, and so is a file whose bytes do not
match its digests.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from pathlib import Path

import numpy as np

from glmkit.errors import GlmkitError
from glmkit.format.files import create_temp_beside
from glmkit.format.safetensors_file import read_header, read_metadata

FORMAT_NAME = "glmkit-logits"
FORMAT_VERSION = 1
_ALIGN = 64
_HASH_CHUNK = 1 << 24


def _token_bytes(windows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.asarray([t for w in windows for t in w], dtype="<i4")
    lengths = np.asarray([len(w) for w in windows], dtype="<i4")
    return tokens, lengths


def tokens_digest(windows: list[list[int]]) -> str:
    tokens, lengths = _token_bytes(windows)
    return hashlib.sha256(tokens.tobytes() + lengths.tobytes()).hexdigest()


class LogitsWriter:
    """Streams a base file: rows are appended window by window; the file appears only when complete."""

    def __init__(self, path: str | Path, model_hash: str, windows: list[list[int]], vocab_size: int):
        self.path = Path(path)
        self.rows = sum(len(w) - 1 for w in windows)
        self.vocab_size = vocab_size
        self.written = 0
        self._hash = hashlib.sha256()
        tokens, lengths = _token_bytes(windows)
        self._tail = tokens.tobytes() + lengths.tobytes()
        n_lp = self.rows * vocab_size * 4
        self._meta = {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "model_hash": model_hash,
                      "vocab_size": str(vocab_size), "tokens_sha256": tokens_digest(windows)}
        self._header = {
            "logprobs": {"dtype": "F32", "shape": [self.rows, vocab_size], "data_offsets": [0, n_lp]},
            "tokens": {"dtype": "I32", "shape": [int(tokens.size)], "data_offsets": [n_lp, n_lp + tokens.nbytes]},
            "window_lengths": {"dtype": "I32", "shape": [len(windows)],
                               "data_offsets": [n_lp + tokens.nbytes, n_lp + len(self._tail)]},
        }
        try:
            self._tmp, self._file = create_temp_beside(self.path)
        except OSError as e:
            raise GlmkitError(f"{self.path}: cannot write ({e.strerror})") from None
        # the header is rewritten with the logprobs digest at the end; reserve room for it now
        self._header_len = len(self._header_bytes("0" * 64))
        self._file.write(b"\0" * (8 + self._header_len))

    def _header_bytes(self, logprobs_digest: str) -> bytes:
        header = {"__metadata__": {**self._meta, "logprobs_sha256": logprobs_digest}, **self._header}
        raw = json.dumps(header, separators=(",", ":")).encode()
        pad = -(8 + len(raw)) % _ALIGN
        return raw + b" " * pad

    def append(self, logprobs: np.ndarray) -> None:
        rows = np.ascontiguousarray(logprobs, dtype="<f4")
        if rows.ndim != 2 or rows.shape[1] != self.vocab_size or self.written + rows.shape[0] > self.rows:
            raise GlmkitError(f"{self.path}: internal error: unexpected logprob rows {list(rows.shape)}")
        data = rows.tobytes()
        self._hash.update(data)
        self._file.write(data)
        self.written += rows.shape[0]

    def close(self) -> None:
        if self.written != self.rows:
            self.abort()
            raise GlmkitError(f"{self.path}: internal error: {self.written} of {self.rows} rows written")
        header = self._header_bytes(self._hash.hexdigest())
        assert len(header) == self._header_len
        try:
            self._file.write(self._tail)
            self._file.seek(0)
            self._file.write(struct.pack("<Q", len(header)) + header)
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._tmp.replace(self.path)
        except OSError as e:  # a full disk, or a directory made at the path since it was checked
            self.abort()
            raise GlmkitError(f"{self.path}: cannot write ({e.strerror})") from None

    def abort(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)


class LogitsBase:
    """A saved base, opened and checked; `rows(w)` gives window w's logprobs `[len - 1, V]` (mapped)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise GlmkitError(f"{self.path}: base logits file not found")
        tensors = read_header(self.path)  # checks offsets, sizes and dtypes against the file
        meta = read_metadata(self.path)
        if meta.get("format") != FORMAT_NAME:
            raise GlmkitError(f"{self.path}: not a glmkit logits file (format {meta.get('format')!r}); make one "
                              "with glm-perplexity --save-logits")
        if meta.get("format_version") != str(FORMAT_VERSION):
            raise GlmkitError(f"{self.path}: logits format version {meta.get('format_version')!r} is not "
                              f"{FORMAT_VERSION}")
        expected = {"logprobs": ("F32", 2), "tokens": ("I32", 1), "window_lengths": ("I32", 1)}
        for name, (dtype, ndim) in expected.items():
            info = tensors.get(name)
            if info is None or info.dtype != dtype or len(info.shape) != ndim:
                raise GlmkitError(f"{self.path}: malformed logits file (tensor {name!r})")
        try:
            self.vocab_size = int(meta["vocab_size"])
            self.model_hash = str(meta["model_hash"])
            tokens_sha, logprobs_sha = str(meta["tokens_sha256"]), str(meta["logprobs_sha256"])
        except (KeyError, ValueError):
            raise GlmkitError(f"{self.path}: malformed logits file metadata") from None
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        lp, tok, lens = tensors["logprobs"], tensors["tokens"], tensors["window_lengths"]
        self.tokens = np.frombuffer(self._map, "<i4", tok.shape[0], tok.start).astype(np.int64)
        self.lengths = np.frombuffer(self._map, "<i4", lens.shape[0], lens.start).astype(np.int64)
        if (self.lengths < 2).any() or self.lengths.sum() != self.tokens.size:
            raise GlmkitError(f"{self.path}: malformed logits file (window lengths)")
        rows = int((self.lengths - 1).sum())
        if lp.shape != (rows, self.vocab_size):
            raise GlmkitError(f"{self.path}: logprobs has shape {list(lp.shape)}, expected {[rows, self.vocab_size]}")
        if hashlib.sha256(self._map[tok.start:lens.start + lens.nbytes]).hexdigest() != tokens_sha:
            raise GlmkitError(f"{self.path}: token windows do not match their digest (corrupted)")
        digest = hashlib.sha256()
        for start in range(lp.start, lp.start + lp.nbytes, _HASH_CHUNK):
            digest.update(self._map[start:min(start + _HASH_CHUNK, lp.start + lp.nbytes)])
        if digest.hexdigest() != logprobs_sha:
            raise GlmkitError(f"{self.path}: logprobs do not match their digest (corrupted or truncated)")
        self._logprobs = np.frombuffer(self._map, "<f4", rows * self.vocab_size, lp.start).reshape(rows,
                                                                                                   self.vocab_size)
        self._row_start = np.concatenate([[0], np.cumsum(self.lengths - 1)])

    @property
    def windows(self) -> list[list[int]]:
        bounds = np.concatenate([[0], np.cumsum(self.lengths)])
        return [self.tokens[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    def check_matches(self, windows: list[list[int]], vocab_size: int) -> None:
        """Refuse to compare a run over other tokens, or a model with another vocabulary."""
        if vocab_size != self.vocab_size:
            raise GlmkitError(f"{self.path}: base has vocabulary size {self.vocab_size}, this model {vocab_size}")
        if len(windows) != len(self.lengths) or tokens_digest(windows) != tokens_digest(self.windows):
            mine = sum(len(w) for w in windows)
            raise GlmkitError(f"{self.path}: base was made from other tokens ({len(self.lengths)} windows, "
                              f"{self.tokens.size} tokens; this run: {len(windows)} windows, {mine} tokens); use "
                              "the same --text/--tokens, --ctx and --max-windows as when it was saved")

    def rows(self, window: int) -> np.ndarray:
        return self._logprobs[self._row_start[window]:self._row_start[window + 1]]

