"""A Hugging Face Hub look-alike on 127.0.0.1 for tests: the endpoints huggingface_hub calls, nothing else.

- `GET /api/models/{repo}/revision/{rev}`: model info (`sha` = the commit the revision points to)
- `GET /api/models/{repo}/tree/{rev}[/{path}]`: file listing with git oid, size and LFS sha256
- `HEAD|GET /{repo}/resolve/{rev}/{path}`: the file, with `ETag` (LFS sha256 or git blob sha1),
  `X-Repo-Commit`, `Content-Length`, `X-Linked-Etag`/`X-Linked-Size` for LFS files, and `Range`
  (huggingface_hub reads safetensors headers with ranged GETs)
- errors as the Hub sends them: 404 + `X-Error-Code: RepoNotFound | RevisionNotFound | EntryNotFound`,
  401 for a private repo without a valid token.

Faults for tests: `corrupt(repo, path, times)` serves the next `times` downloads with one byte flipped;
`hold(repo, path, after)` stops a download after `after` bytes until `release()`. `requests` logs every
request as (method, path, range header).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin")


@dataclass
class FakeRepo:
    commits: dict[str, dict[str, bytes]]  # commit sha -> {path: content}
    refs: dict[str, str]  # branch or tag -> commit sha
    token: str | None = None  # private repo: requests need `Authorization: Bearer <token>`


def commit_sha(files: dict[str, bytes]) -> str:
    h = hashlib.sha1()
    for path in sorted(files):
        h.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
    return h.hexdigest()


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def read_dir(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


@dataclass
class _Hold:
    after: int
    event: threading.Event = field(default_factory=threading.Event)
    reached: threading.Event = field(default_factory=threading.Event)


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self._corrupt: dict[tuple[str, str], int] = {}
        self._holds: dict[tuple[str, str], _Hold] = {}
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def add_repo(self, repo_id: str, files: dict[str, bytes], *, token: str | None = None,
                 refs: dict[str, dict[str, bytes]] | None = None) -> str:
        """Serve `files` as branch main of `repo_id` (plus more branches in `refs`); returns main's commit."""
        commits, names = {}, {}
        for ref, content in {"main": files, **(refs or {})}.items():
            sha = commit_sha(content)
            commits[sha] = dict(content)
            names[ref] = sha
        self.repos[repo_id] = FakeRepo(commits, names, token)
        return names["main"]

    def corrupt(self, repo_id: str, path: str, times: int = 1) -> None:
        self._corrupt[(repo_id, path)] = times

    def hold(self, repo_id: str, path: str, after: int) -> _Hold:
        hold = self._holds[(repo_id, path)] = _Hold(after)
        return hold

    def release(self) -> None:
        for hold in self._holds.values():
            hold.event.set()
        self._holds.clear()

    def downloads(self, path: str) -> int:
        """Full (non-ranged) GETs of a file so far."""
        return sum(1 for method, p, rng in self.requests if method == "GET" and p.endswith("/" + path)
                   and "/resolve/" in p and rng is None)

    def close(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # keep pytest output clean
            pass

        def do_HEAD(self) -> None:
            self._dispatch(head=True)

        def do_GET(self) -> None:
            self._dispatch(head=False)

        # --- plumbing -----------------------------------------------------------------------------

        def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
                  head: bool = False) -> None:
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _json(self, obj: object, head: bool) -> None:
            self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json"}, head)

        def _error(self, status: int, code: str | None, message: str, head: bool,
                   extra: dict[str, str] | None = None) -> None:
            headers = {"Content-Type": "application/json", "X-Error-Message": message, **(extra or {})}
            if code:
                headers["X-Error-Code"] = code
            self._send(status, json.dumps({"error": message}).encode(), headers, head)

        def _dispatch(self, head: bool) -> None:
            url = urlsplit(self.path)
            hub.requests.append((self.command, url.path, self.headers.get("Range")))
            parts = url.path.strip("/").split("/")
            try:
                if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
                    repo_id, kind, rev, rest = f"{parts[2]}/{parts[3]}", parts[4], unquote(parts[5]), parts[6:]
                    self._api(repo_id, kind, rev, "/".join(unquote(p) for p in rest), head)
                elif len(parts) >= 5 and parts[2] == "resolve":
                    self._resolve(f"{parts[0]}/{parts[1]}", unquote(parts[3]),
                                  "/".join(unquote(p) for p in parts[4:]), head)
                else:
                    self._error(404, None, f"no route for {url.path}", head)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def _repo(self, repo_id: str, rev: str, head: bool) -> tuple[FakeRepo, str] | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found", head)
                return None
            if repo.token is not None:
                sent = self.headers.get("Authorization")
                if sent is None:
                    self._error(401, "RepoNotFound", "Invalid username or password.", head)
                    return None
                if sent != f"Bearer {repo.token}":
                    self._error(401, None, "Invalid credentials in Authorization header", head)
                    return None
            commit = repo.refs.get(rev, rev if rev in repo.commits else None)
            if commit is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
                return None
            return repo, commit

        def _api(self, repo_id: str, kind: str, rev: str, path: str, head: bool) -> None:
            found = self._repo(repo_id, rev, head)
            if found is None:
                return
            repo, commit = found
            files = repo.commits[commit]
            if kind == "revision":
                self._json({"id": repo_id, "modelId": repo_id, "sha": commit, "private": repo.token is not None,
                            "siblings": [{"rfilename": p} for p in sorted(files)]}, head)
                return
            entries = []
            for name in sorted(files):
                if path and not name.startswith(path.rstrip("/") + "/"):
                    continue
                data = files[name]
                entry = {"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": name}
                if name.endswith(LFS_SUFFIXES):
                    entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                entries.append(entry)
            self._json(entries, head)

        def _resolve(self, repo_id: str, rev: str, path: str, head: bool) -> None:
            found = self._repo(repo_id, rev, head)
            if found is None:
                return
            repo, commit = found
            data = repo.commits[commit].get(path)
            if data is None:
                self._error(404, "EntryNotFound", f"{path} does not exist on {rev}", head,
                            {"X-Repo-Commit": commit})
                return
            headers = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
            if path.endswith(LFS_SUFFIXES):
                digest = hashlib.sha256(data).hexdigest()
                headers.update({"ETag": f'"{digest}"', "X-Linked-Etag": f'"{digest}"', "X-Linked-Size": str(len(data))})
            else:
                headers["ETag"] = f'"{git_blob_sha1(data)}"'
            rng = self.headers.get("Range")
            if rng is not None:
                first, _, last = rng.removeprefix("bytes=").partition("-")
                start, end = int(first), min(int(last) if last else len(data) - 1, len(data) - 1)
                headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
                self._send(206, data[start:end + 1], headers, head)
                return
            if head:
                self._send(200, data, headers, head=True)
                return
            key = (repo_id, path)
            with hub._lock:
                if hub._corrupt.get(key):
                    hub._corrupt[key] -= 1
                    middle = len(data) // 2
                    data = data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:]
                hold = hub._holds.get(key)
            if hold is None:
                self._send(200, data, headers)
                return
            self.send_response(200)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[:hold.after])
            self.wfile.flush()
            hold.reached.set()
            deadline = time.monotonic() + 60
            while not hold.event.wait(0.05) and time.monotonic() < deadline:
                pass
            self.wfile.write(data[hold.after:])

    return Handler
