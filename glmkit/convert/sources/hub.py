"""A Hugging Face Hub repo as a conversion source, through huggingface_hub (auth, retries, cache, transfers).

`HubSource` pins the requested revision to its commit, lists the files with their LFS sha256, downloads
the small files (config, tokenizer, index) and reads every shard's safetensors header with a ranged
request, so the whole conversion is planned and checked before a byte of weights is downloaded.
`HubShardStore` then fetches one shard at a time for the `ShardFetcher`: from the local HF cache when the
commit's file is already there, else with `hf_hub_download` into OUT's staging folder; every shard's
sha256 is checked against the Hub's LFS metadata (a mismatch deletes it and downloads it once more).
"""

from __future__ import annotations

import hashlib
import inspect
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi, constants, get_token, hf_hub_download, try_to_load_from_cache
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    SafetensorsParsingError,
    disable_progress_bars,
)
from tqdm import tqdm

from glmkit.convert.sources.fetch import ShardFetcher
from glmkit.convert.sources.snapshot import (
    INDEX_NAME,
    MAX_INDEX_BYTES,
    SIDE_FILES,
    HFSnapshot,
    check_side_files,
    sha256_file,
    shard_names_from_index,
    side_file_limit,
)
from glmkit.convert.sources.source import Source
from glmkit.errors import GlmkitError
from glmkit.format.config import ModelConfig
from glmkit.format.files import read_json_file
from glmkit.format.safetensors_file import check_header

HEADER_THREADS = 8
# recent hf_hub_download versions take a progress-bar class (1.0 does not); older ones draw their own bars
_HF_TQDM_CLASS = "tqdm_class" in inspect.signature(hf_hub_download).parameters


class TransferError(GlmkitError):
    """A download that failed in transit (connection, size mismatch, 5xx): worth one more try."""


class HubSource(Source):
    remote = True

    def __init__(self, repo: str, *, revision: str | None, endpoint: str | None, keep_source: bool):
        self.repo = repo
        self.requested = revision or "main"
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
        self.keep_source = keep_source
        self.cache_dir = Path(constants.HF_HUB_CACHE)
        self.api = HfApi(endpoint=self.endpoint)
        self._tmp = tempfile.TemporaryDirectory(prefix="glm-convert-meta-")
        self.side_dir = Path(self._tmp.name)
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        with self.errors():
            sha = self.api.model_info(self.repo, revision=self.requested).sha
            if not sha:
                raise GlmkitError(f"{self.repo}: {self.endpoint} did not say which commit {self.requested!r} is")
            self.commit = str(sha)
            tree = self.api.list_repo_tree(self.repo, revision=self.commit, recursive=True)
            self.files: dict[str, RepoFile] = {f.path: f for f in tree if isinstance(f, RepoFile)}
        self.label = f"{self.repo}@{self.commit[:12]}"
        if "config.json" not in self.files:
            raise GlmkitError(f"{self.label}: the repo has no config.json (is it a Hugging Face model repo?)")
        # with --keep-source the small files go to the HF cache too, so that its snapshot is complete
        local_dir = None if self.keep_source else self.side_dir
        for name in (*SIDE_FILES, INDEX_NAME):
            if name in self.files:
                if int(self.files[name].size) > side_file_limit(name):  # before downloading it
                    raise GlmkitError(f"{self.label}/{name}: {self.files[name].size} bytes, more than the "
                                      f"{side_file_limit(name)} it may have")
                self.side_dir = self._fetch_verified(name, local_dir).parent
        shards = self._shard_names()
        sizes = {name: int(self.files[name].size) for name in shards}
        with ThreadPoolExecutor(min(HEADER_THREADS, len(shards))) as pool:
            headers = dict(zip(shards, pool.map(self._remote_header, shards), strict=True))
        try:
            config = ModelConfig.from_file(self.side_dir / "config.json")
            self.side_files = check_side_files(self.side_dir)
        except GlmkitError as e:
            raise GlmkitError(str(e).replace(str(self.side_dir), self.label)) from None
        self.snapshot = HFSnapshot.from_headers(config, headers, sizes, self.label)
        self.cached: dict[str, Path] = {}
        for name in shards:
            hit = try_to_load_from_cache(self.repo, name, cache_dir=self.cache_dir, revision=self.commit)
            if isinstance(hit, str) and Path(hit).is_file():
                self.cached[name] = Path(hit)
        self.origin = {"kind": "hub", "repo": self.repo, "revision": self.commit,
                       "requested_revision": self.requested, "endpoint": self.endpoint}
        self.identity = {"kind": "hub", "repo": self.repo, "revision": self.commit}

    def _shard_names(self) -> list[str]:
        if INDEX_NAME in self.files:
            try:
                names = shard_names_from_index(read_json_file(self.side_dir / INDEX_NAME, MAX_INDEX_BYTES))
            except GlmkitError as e:
                raise GlmkitError(str(e).replace(str(self.side_dir), self.label)) from None
            except ValueError:
                raise GlmkitError(f"{self.label}/{INDEX_NAME}: not a valid safetensors index") from None
            for name in names:
                if name not in self.files:
                    raise GlmkitError(f"{self.label}/{INDEX_NAME}: names shard {name} which is not in the repo")
            return names
        names = sorted(p for p in self.files if p.endswith(".safetensors") and "/" not in p)
        if not names:
            raise GlmkitError(f"{self.label}: no *.safetensors files in the repo")
        return names

    def _remote_header(self, name: str) -> dict:
        """A shard's header (relative offsets) through a ranged read of its first bytes."""
        with self.errors(name):
            meta = self.api.parse_safetensors_file_metadata(self.repo, name, revision=self.commit)
        header = {t: {"dtype": i.dtype, "shape": list(i.shape), "data_offsets": list(i.data_offsets)}
                  for t, i in meta.tensors.items()}
        return check_header(f"{self.label}/{name}", header, 0, int(self.files[name].size), exact=False)

    # --- disk, digests, fetching ----------------------------------------------------------------------

    def download_bytes(self) -> dict[str, int]:
        """Bytes each shard adds to OUT's file system (0 when it comes from the HF cache or goes there)."""
        return {name: 0 if name in self.cached or self.keep_source else size
                for name, size in self.snapshot.shard_bytes.items()}

    def cache_bytes(self) -> int:
        """With --keep-source: bytes the downloads add to the HF cache."""
        if not self.keep_source:
            return 0
        return sum(size for name, size in self.snapshot.shard_bytes.items() if name not in self.cached)

    def digests(self, stop: threading.Event | None = None) -> dict[str, dict[str, object]]:
        """The Hub's digests of the shards (each one checked when it was downloaded): nothing to read."""
        out: dict[str, dict[str, object]] = {}
        for name in self.snapshot.shard_bytes:
            f = self.files[name]
            out[name] = ({"nbytes": int(f.size), "sha256": f.lfs.sha256} if f.lfs is not None
                         else {"nbytes": int(f.size), "git_sha1": f.blob_id})
        return out

    def fetcher(self, steps: list[set[str]], staging: Path, budget: int, bar: Any) -> ShardFetcher:
        store = HubShardStore(self, staging, bar)
        return ShardFetcher(store, self.snapshot, steps, self.download_bytes(), budget)

    def _fetch_verified(self, name: str, local_dir: Path | None, bar: Any = None) -> Path:
        """Download `name` (into `local_dir`, or the HF cache when None) and check it against the Hub's digest;
        a mismatch deletes the file and downloads it once more, a second mismatch is an error."""
        expected = self.files[name]
        where = {"local_dir": local_dir} if local_dir is not None else {"cache_dir": self.cache_dir}
        if _HF_TQDM_CLASS:
            where["tqdm_class"] = _forward_to(bar)
        elif bar is None or bar.disable:
            disable_progress_bars()  # older huggingface_hub: its own bar per file, unless --quiet
        for attempt in (1, 2):
            try:
                with self.errors(name):
                    path = Path(hf_hub_download(self.repo, name, revision=self.commit, endpoint=self.endpoint,
                                                force_download=attempt > 1, **where))
            except TransferError as e:
                if attempt == 2:
                    raise
                print(f"glm-convert: warning: {e}; trying once more", file=sys.stderr)
                continue
            kind, want, got = verify(path, expected)
            if got == want:
                return path
            _delete_download(path)
            if attempt == 1:
                print(f"glm-convert: warning: {self.label}/{name}: {kind} {got} does not match the Hub's {want}; "
                      "deleted it, downloading it again", file=sys.stderr)
        raise GlmkitError(f"{self.label}/{name}: downloaded twice and both copies fail verification ({kind} {got} "
                          f"!= the Hub's {want}); deleted. The transfer is corrupted (proxy, network or disk): "
                          "run the same command again later")

    @contextmanager
    def errors(self, name: str | None = None) -> Iterator[None]:
        """huggingface_hub / HTTP errors -> one GlmkitError line that says what to do."""
        where = f"{self.repo}" + (f"/{name}" if name else "")
        try:
            yield
        except GlmkitError:
            raise
        except RevisionNotFoundError:
            raise GlmkitError(f"{self.repo}: revision {self.requested!r} not found on {self.endpoint} (--revision "
                              "takes a branch, a tag or a commit sha)") from None
        except GatedRepoError:
            raise GlmkitError(f"{self.repo}: gated repo: accept its terms at {self.endpoint}/{self.repo} and set "
                              "HF_TOKEN (or run `hf auth login`) with that account's token") from None
        except HfHubHTTPError as e:
            raise self._http_error(where, e) from None
        except SafetensorsParsingError as e:
            raise GlmkitError(f"{where}: {e}") from None
        except OSError as e:
            if e.errno is not None:  # a local problem: disk full, permissions, ...
                raise GlmkitError(f"{where}: {e.strerror} ({e.filename or 'download'})") from None
            raise TransferError(f"{where}: transfer from {self.endpoint} failed: {_first_line(e)}") from None
        except Exception as e:
            if type(e).__module__.split(".")[0] not in ("huggingface_hub", "httpx", "httpx2", "httpcore", "requests",
                                                        "urllib3"):
                raise
            raise TransferError(f"{where}: cannot get it from {self.endpoint}: {type(e).__name__}: "
                                f"{_first_line(e)}") from None

    def _http_error(self, where: str, e: HfHubHTTPError) -> GlmkitError:
        status = e.response.status_code if e.response is not None else None
        token = get_token() is not None
        if status == 401:
            hint = ("the token from HF_TOKEN (or `hf auth login`) was rejected: check it" if token else
                    "no token was sent: set HF_TOKEN or run `hf auth login`")
            return GlmkitError(f"{where}: 401 Unauthorized from {self.endpoint}: the repo is private or gated, or "
                               f"does not exist; {hint}")
        if status == 403:
            return GlmkitError(f"{where}: 403 Forbidden from {self.endpoint}: your token has no access to "
                               f"{self.repo} (check its permissions, or accept the repo's terms)")
        if isinstance(e, EntryNotFoundError):
            return GlmkitError(f"{where}: not found in {self.repo} at revision {self.requested!r}")
        if isinstance(e, RepositoryNotFoundError) or status == 404:
            hint = "" if token else "; if it is private, set HF_TOKEN or run `hf auth login`"
            return GlmkitError(f"{self.repo}: repository not found on {self.endpoint}{hint}")
        if status is not None and status >= 500 or status == 429:
            return TransferError(f"{where}: {self.endpoint} answered {status}: {_first_line(e)}")
        return GlmkitError(f"{where}: Hub request failed: {_first_line(e)}")

    def close(self) -> None:
        self._tmp.cleanup()


class HubShardStore:
    """Shards of a Hub source for the `ShardFetcher`: HF cache hit, or a verified download.

    Downloads go to `staging` (in OUT, deleted once converted), or with --keep-source to the HF cache
    (kept). Files in the HF cache are never deleted by glm-convert.
    """

    def __init__(self, source: HubSource, staging: Path, bar: Any):
        self.source = source
        self.staging = staging
        self.bar = bar

    def fetch(self, name: str) -> Path:
        cached = self.source.cached.get(name)
        if cached is not None:
            kind, want, got = verify(cached, self.source.files[name])
            if got == want:
                return cached
            print(f"glm-convert: warning: {self.source.label}/{name}: the Hugging Face cache copy fails verification "
                  f"({kind} {got} != {want}); downloading it", file=sys.stderr)
        return self.source._fetch_verified(name, None if self.source.keep_source else self.staging, self.bar)

    def discard(self, name: str, path: Path) -> None:
        if path.parent == self.staging:
            path.unlink(missing_ok=True)


def verify(path: Path, expected: RepoFile) -> tuple[str, str, str]:
    """(digest kind, the Hub's digest, the file's digest): LFS sha256, else the git blob sha1."""
    if expected.lfs is not None:
        return "sha256", expected.lfs.sha256, sha256_file(path)
    h = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        while data := f.read(16 << 20):
            h.update(data)
    return "git sha1", expected.blob_id, h.hexdigest()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _delete_download(path: Path) -> None:
    """Delete a downloaded file (in the HF cache: the blob the snapshot entry links to, and the link)."""
    if path.is_symlink():
        path.resolve().unlink(missing_ok=True)
    path.unlink(missing_ok=True)


def _forward_to(bar: Any) -> type[tqdm]:
    """A tqdm class for huggingface_hub that draws nothing and adds the transferred bytes to `bar`."""

    class _Forward(tqdm):
        def __init__(self, *args: Any, **kwargs: Any):
            kwargs.pop("name", None)
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            if bar is not None and n:
                bar.update(n)
            return None

    return _Forward
