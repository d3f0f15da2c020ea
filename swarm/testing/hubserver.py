"""A small Hugging Face hub on 127.0.0.1 for tests without the internet: repositories served from local folders with
just what huggingface_hub calls for ``HfApi.model_info`` and ``hf_hub_download``.

- ``GET /api/models/{repo}/revision/{rev}``: the commit (``sha``), the files (``siblings``), ``gated``;
- ``HEAD`` / ``GET /{repo}/resolve/{rev}/{file}``: ``X-Repo-Commit``, ``ETag``, ``Content-Length`` for a small file,
  served here; a ``.safetensors`` file (an LFS file on the hub) is a 302 to the "CDN" (a second port of this server,
  another origin, as the hub's CDN is) with ``X-Linked-Etag`` (its sha256) and ``X-Linked-Size``;
- ``GET /blobs/{sha256}`` on the CDN: the bytes, with ``Range`` (206) for a resumed transfer.

The errors carry the ``X-Error-Code`` header huggingface_hub maps to its exceptions: ``RepoNotFound``,
``RevisionNotFound``, ``EntryNotFound``, and ``GatedRepo`` (401) for a gated repository asked without its token.
Every request is logged (``requests``, ``fetched``), and ``cut_once`` breaks the next transfer of a file midway (the
response promises the whole file, sends half, closes), as a dropped connection does.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors",)


@dataclass
class Logged:
    """One request the server answered: where (``hub`` or ``cdn``), what, and with which headers that matter."""

    server: str
    method: str
    repo: str | None
    file: str | None
    status: int
    range: str | None = None
    authorized: bool = False
    cut: bool = False  # a transfer stopped halfway on purpose (``cut_once``)


@dataclass
class Commit:
    sha: str
    folder: Path
    files: dict[str, tuple[str, int]]  # file -> (sha256, size)


@dataclass
class Repo:
    commits: dict[str, Commit] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    gated: bool = False
    token: str | None = None  # the one token that has access, when gated


class HubServer:
    """``with HubServer() as hub: hub.add_repo("org/name", folder)``; point ``HF_ENDPOINT`` at ``hub.endpoint``."""

    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.requests: list[Logged] = []
        self.blobs: dict[str, tuple[Path, str]] = {}  # sha256 -> (its path, the file name it was first added as)
        self.cuts: dict[str, int] = {}  # file name -> transfers of it still to cut
        self._lock = threading.Lock()
        self._hub = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, "hub"))
        self._cdn = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, "cdn"))
        for server in (self._hub, self._cdn):
            server.daemon_threads = True
        self._threads: list[threading.Thread] = []
        self._connections: set[socket.socket] = set()  # open ones: stop() closes them (clients keep them alive)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._hub.server_address[1]}"

    @property
    def cdn(self) -> str:
        return f"http://127.0.0.1:{self._cdn.server_address[1]}"

    def start(self) -> HubServer:
        for server in (self._hub, self._cdn):
            thread = threading.Thread(target=server.serve_forever, args=(0.05,), name="hubserver", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Stop listening and drop every open connection: from now on, nobody reaches this hub."""
        for server in (self._hub, self._cdn):
            server.shutdown()
            server.server_close()
        with self._lock:
            connections, self._connections = list(self._connections), set()
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(5)
        self._threads = []

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- what it serves ---------------------------------------------------------------------------------------

    def add_repo(
        self, repo_id: str, folder: str | Path, revision: str = "main", gated: bool = False, token: str | None = None
    ) -> str:
        """Serve ``folder``'s files as a new commit of ``repo_id`` that ``revision`` (a branch) points to; returns
        the commit. ``gated``: only requests with ``Authorization: Bearer {token}`` get its files."""
        folder = Path(folder)
        files = {}
        for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")):
            data = path.read_bytes()
            sha256 = hashlib.sha256(data).hexdigest()
            name = path.relative_to(folder).as_posix()
            files[name] = (sha256, len(data))
            self.blobs.setdefault(sha256, (path, name))
        sha = hashlib.sha1(json.dumps([repo_id, sorted(files.items())]).encode()).hexdigest()
        with self._lock:
            repo = self.repos.setdefault(repo_id, Repo())
            repo.commits[sha] = Commit(sha, folder, files)
            repo.refs[revision] = sha
            repo.gated, repo.token = gated or repo.gated, token or repo.token
        return sha

    def cut_once(self, file: str, times: int = 1) -> None:
        """The next ``times`` transfers of ``file`` stop halfway (their connection closed)."""
        with self._lock:
            self.cuts[file] = times

    # --- what it was asked --------------------------------------------------------------------------------------

    def fetched(self) -> dict[str, int]:
        """File -> how many transfers of its bytes were begun (small files here, shards from the CDN; cut ones too)."""
        counts: dict[str, int] = {}
        for entry in self._log():
            if entry.method == "GET" and entry.file and entry.status in (200, 206):
                counts[entry.file] = counts.get(entry.file, 0) + 1
        return counts

    def of(self, file: str) -> list[Logged]:
        return [entry for entry in self._log() if entry.file == file]

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    def _log(self) -> Iterator[Logged]:
        with self._lock:
            return iter(list(self.requests))

    def _record(self, entry: Logged) -> None:
        with self._lock:
            self.requests.append(entry)

    def _take_cut(self, file: str) -> bool:
        with self._lock:
            left = self.cuts.get(file, 0)
            if left:
                self.cuts[file] = left - 1
            return bool(left)


def _handler(hub: HubServer, server: str) -> type[BaseHTTPRequestHandler]:
    """The request handler class of one of the hub's two servers (``server``: "hub" or "cdn")."""
    return type("Handler", (_Handler,), {"hub": hub, "role": server})


class _Handler(BaseHTTPRequestHandler):
    """The hub's answers, as huggingface_hub reads them; ``hub`` and ``role`` are set by ``_handler``."""

    hub: HubServer
    role: str  # "hub" or "cdn" (not ``server``: BaseHTTPRequestHandler's server object)
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet: the test reads ``hub.requests``
        pass

    def setup(self) -> None:
        super().setup()
        with self.hub._lock:
            self.hub._connections.add(self.connection)

    def finish(self) -> None:
        with self.hub._lock:
            self.hub._connections.discard(self.connection)
        super().finish()

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    # --- routing --------------------------------------------------------------------------------------------

    def _answer(self, body: bool) -> None:
        path = urlsplit(self.path).path
        if self.role == "cdn":
            return self._blob(path, body)
        if path.startswith("/api/models/"):
            return self._model_info(path)
        if "/resolve/" in path:
            return self._resolve(path, body)
        self._error(404, None, None, "EntryNotFound", "no such endpoint")

    def _authorized(self, repo: Repo) -> bool:
        return repo.token is not None and self.headers.get("Authorization") == f"Bearer {repo.token}"

    def _find(self, repo_id: str, revision: str, file: str | None) -> tuple[Repo, Commit] | None:
        """The repo and commit, or None after answering the error."""
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(401, repo_id, file, "RepoNotFound", "Repository not found")
            return None
        sha = revision if revision in repo.commits else repo.refs.get(revision)
        if sha is None:
            self._error(404, repo_id, file, "RevisionNotFound", "Invalid rev id")
            return None
        return repo, repo.commits[sha]

    def _model_info(self, path: str) -> None:
        rest = path.removeprefix("/api/models/")
        repo_id, _, revision = rest.partition("/revision/")
        revision = unquote(revision) or "main"
        found = self._find(repo_id, revision, None)
        if found is None:
            return
        repo, commit = found
        info = {
            "id": repo_id,
            "modelId": repo_id,
            "sha": commit.sha,
            "private": False,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "siblings": [{"rfilename": name} for name in commit.files],
        }
        self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, repo_id, None)

    def _resolve(self, path: str, body: bool) -> None:
        repo_id, _, rest = path.lstrip("/").partition("/resolve/")
        revision, _, file = rest.partition("/")
        revision, file = unquote(revision), unquote(file)
        found = self._find(repo_id, revision, file)
        if found is None:
            return
        repo, commit = found
        headers = {"X-Repo-Commit": commit.sha}
        if repo.gated and not self._authorized(repo):
            message = f"Access to model {repo_id} is restricted. You must have access to it and be authenticated."
            return self._error(401, repo_id, file, "GatedRepo", message, headers)
        if file not in commit.files:
            return self._error(404, repo_id, file, "EntryNotFound", "Entry not found", headers)
        sha256, size = commit.files[file]
        if file.endswith(LFS_SUFFIXES):  # as the hub: a redirect to a signed URL elsewhere
            headers |= {
                "Location": f"{self.hub.cdn}/blobs/{sha256}",
                "X-Linked-Etag": f'"{sha256}"',
                "X-Linked-Size": str(size),
                "ETag": f'"{sha256[:40]}"',
            }
            return self._send(302, b"", headers, repo_id, file)
        data = (commit.folder / file).read_bytes()
        headers |= {"ETag": f'"{sha256}"', "Content-Type": "application/octet-stream"}
        self._send(200, data if body else None, headers, repo_id, file, length=size)

    def _blob(self, path: str, body: bool) -> None:
        sha256 = path.removeprefix("/blobs/")
        if sha256 not in self.hub.blobs:
            return self._error(404, None, None, "EntryNotFound", "no such blob")
        source, file = self.hub.blobs[sha256]
        data = source.read_bytes()
        start, status, headers = 0, 200, {"ETag": f'"{sha256}"', "Accept-Ranges": "bytes"}
        wanted = self.headers.get("Range")
        if wanted:
            first, _, last = wanted.removeprefix("bytes=").partition("-")
            start, end = int(first), int(last) + 1 if last else len(data)
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
            data, status = data[start:end], 206
        if body and self.hub._take_cut(file):
            return self._send_cut(status, data, headers, file)
        self._send(status, data if body else None, headers, None, file, length=len(data))

    # --- answers --------------------------------------------------------------------------------------------

    def _send(
        self,
        status: int,
        data: bytes | None,
        headers: dict[str, str],
        repo: str | None,
        file: str | None,
        length: int | None = None,
    ) -> None:
        self.hub._record(
            Logged(
                self.role, self.command, repo, file, status, self.headers.get("Range"), "Authorization" in self.headers
            )
        )
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(length if length is not None else len(data or b"")))
        self.end_headers()
        if data and self.command != "HEAD":
            self.wfile.write(data)

    def _send_cut(self, status: int, data: bytes, headers: dict[str, str], file: str) -> None:
        """Promise ``data`` whole, send half of it, and close the connection."""
        self.hub._record(Logged(self.role, self.command, None, file, status, self.headers.get("Range"), cut=True))
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data[: len(data) // 2])
        self.wfile.flush()
        self.close_connection = True

    def _error(
        self,
        status: int,
        repo: str | None,
        file: str | None,
        code: str,
        message: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        body = json.dumps({"error": message}).encode()
        headers = {**(headers or {}), "X-Error-Code": code, "X-Error-Message": message}
        self._send(status, body, {**headers, "Content-Type": "application/json"}, repo, file)
