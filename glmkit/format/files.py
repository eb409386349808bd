"""Untrusted files: regular-file opens (a FIFO or device is refused, never read forever), size caps checked
before reading, and JSON decoding with bounded nesting and no duplicate keys (config.json, shard indexes, side
files, resume state, safetensors headers); and files written whole or not at all (`write_private_file`)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import time
from pathlib import Path
from typing import Any, BinaryIO

from glmkit.errors import GlmkitError

MAX_JSON_DEPTH = 64  # GLM-5's config.json nests 3 deep, tokenizer.json 5
MAX_SIDE_FILE_BYTES = 64 << 20  # a snapshot's side files; a large vocabulary's tokenizer.json is ~20 MB
# GLM-5's manifest holds 1.5 M JSON values: the bound keeps a hostile one's parse to about a GB
MAX_JSON_VALUES = 1 << 24


def open_regular(path: str | Path, follow_symlinks: bool = True) -> BinaryIO:
    """`path` opened for binary reading, if it is a regular file; a FIFO, device or directory (and, without
    `follow_symlinks`, a symlink) raises OSError without blocking on it: the open does not wait for a FIFO's
    writer."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a FIFO, device or directory is never read)", str(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def open_regular_file(path: str | Path) -> BinaryIO:
    """`open_regular` (symlinks followed) for user-facing files: any failure is a GlmkitError naming `path`."""
    try:
        return open_regular(path)
    except FileNotFoundError:
        raise GlmkitError(f"{path}: not found") from None
    except OSError as e:
        raise GlmkitError(f"{path}: cannot read ({e.strerror})") from None


def read_capped(path: str | Path, max_bytes: int, what: str = "this file") -> bytes:
    """The whole content of a regular file of at most `max_bytes` (its size checked before reading); `what`
    names the file in the error."""
    with open_regular_file(path) as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(max_bytes + 1) if size <= max_bytes else b""
    if size > max_bytes or len(raw) > max_bytes:  # the second: it grew while being read
        raise GlmkitError(f"{path}: {max(size, len(raw))} bytes, more than the {max_bytes} {what} may have")
    return raw


def read_text_file(path: str | Path, max_bytes: int, what: str = "this file") -> str:
    """`read_capped`, decoded as UTF-8 (anything else is a GlmkitError naming the byte)."""
    raw = read_capped(path, max_bytes, what)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GlmkitError(f"{path}: not UTF-8 text (byte {e.start})") from None


def read_json_file(path: str | Path, max_bytes: int) -> Any:
    """An untrusted JSON document from a regular file of at most `max_bytes` (checked before reading)."""
    return parse_json(read_capped(path, max_bytes, "this JSON file"), str(path))


def parse_json(raw: bytes, where: str) -> Any:
    """Decode untrusted JSON: UTF-8, nesting at most MAX_JSON_DEPTH deep, no key twice in an object."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GlmkitError(f"{where}: not UTF-8 text (byte {e.start})") from None

    def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(pairs)
        if len(obj) != len(pairs):
            seen: set[str] = set()
            for key, _ in pairs:
                if key in seen:
                    raise GlmkitError(f"{where}: key {key!r} appears twice in one JSON object")
                seen.add(key)
        return obj

    try:
        value = json.loads(text, object_pairs_hook=unique_keys)
    except RecursionError:  # the decoder recurses once per level: far deeper than any real file
        raise GlmkitError(f"{where}: JSON nested more than {MAX_JSON_DEPTH} levels deep") from None
    except json.JSONDecodeError as e:
        raise GlmkitError(f"{where}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except ValueError as e:  # an integer literal longer than the interpreter converts (sys.get_int_max_str_digits)
        raise GlmkitError(f"{where}: not valid JSON ({_first_clause(e)})") from None
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > MAX_JSON_DEPTH:
            raise GlmkitError(f"{where}: JSON nested more than {MAX_JSON_DEPTH} levels deep")
        pending.extend((child, depth + 1) for child in children)
    return value


def parse_large_json(path: Path, raw: bytes) -> Any:
    """Decode an untrusted JSON document that may be large (a manifest, a data file's header): its count of
    values is bounded before parsing (every value but the first follows a comma or an opening bracket), its
    nesting by the decoder's recursion limit. (parse_json's per-object checks would double the parse of a
    GLM-5 manifest; a repeated key here changes nothing the model hash does not cover.)"""
    values = raw.count(b",") + raw.count(b"[") + raw.count(b"{")
    if values > MAX_JSON_VALUES:
        raise GlmkitError(f"{path}: JSON of more than {MAX_JSON_VALUES} values")
    try:
        return json.loads(raw)
    except RecursionError:
        raise GlmkitError(f"{path}: JSON nested too deeply") from None
    except UnicodeDecodeError as e:
        raise GlmkitError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise GlmkitError(f"{path}: malformed JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except ValueError as e:  # an integer literal longer than the interpreter converts
        raise GlmkitError(f"{path}: malformed JSON ({_first_clause(e)})") from None


def _first_clause(e: ValueError) -> str:
    """The first clause of a decoder's ValueError, without its advice on changing the interpreter's limits."""
    return str(e).split(":")[0].strip()


def create_temp_beside(path: Path, mode: int = 0o666) -> tuple[Path, BinaryIO]:
    """A new file for `path`'s next content, to be renamed over `path` once whole: named `<name>.tmp-<pid>-<ns>`
    beside it, created exclusively with `mode` (never an existing file, nor through a symlink planted there), open
    for binary writing. Raises OSError."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    return tmp, os.fdopen(fd, "wb")


def write_private_file(path: Path, data: bytes) -> None:
    """Replace `path` atomically by `data` (unique temp name, mode 0600, fsync, rename; a failed write leaves no
    temporary file): cache entries and saved sessions hold prompts and transcripts."""
    tmp, f = create_temp_beside(path, 0o600)
    try:
        with f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def make_private_dirs(path: Path) -> None:
    """`mkdir -p` whose every new directory is 0700 (the cache and its sessions are one user's)."""
    path = Path(path)
    for directory in [*reversed(path.parents), path]:
        if not directory.is_dir():
            with contextlib.suppress(FileExistsError):
                os.mkdir(directory, 0o700)
