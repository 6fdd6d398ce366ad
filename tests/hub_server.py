"""A local Hugging Face Hub for the tests: the real `huggingface_hub` client (2.4.0) downloads from it.

Routes, each one a call of the client (checked against its source, not guessed):

  GET /api/models/{repo}[/revision/{rev}]
      `HfApi.repo_info`/`model_info`. `snapshot_download` resolves a branch or tag to the commit `sha`
      here; it skips the call when the revision is already a 40-hex sha. `siblings` lists the files.
      Their sizes, `blobId` and `lfs` come only with `?blobs=true` (`files_metadata=True`), as on the Hub.
  GET /api/models/{repo}/tree/{rev}[/{dir}]?recursive=true
      `list_repo_tree`/`list_repo_files`. `snapshot_download` takes its file list from here and keeps
      it in `trees/{sha}.json` in the cache, so the next call of the same commit does not list again.
  HEAD /{repo}/resolve/{rev}/{file}
      `hf_hub_download`'s metadata call (one per file, even in a snapshot). It needs `X-Repo-Commit`
      and an `ETag`. A git blob answers 200 with its git sha1 ETag and `Content-Length`. An LFS
      file answers 302 with `X-Linked-Etag` (sha256) and `X-Linked-Size`, plus a `Location` on
      another host ("localhost" where the endpoint says 127.0.0.1). The Hub's CDN is another host
      too. On another host the client stops at the 302 and reads the metadata from it. It then
      GETs the Location and drops the Authorization header. A redirect to the same host would be
      followed, and the metadata lost.
  GET /{repo}/resolve/{rev}/{file}
      The bytes of a git blob (an LFS file redirects again).
  GET /lfs/{sha256}/{file}
      The "CDN": the bytes of an LFS file. It needs no token, like the Hub's signed URLs.
  Every GET of file bytes honours `Range: bytes=N-` with 206 and `Content-Range`. The client
  resumes with it after a cut, in the same call (below).

GET /api/agent-harnesses: the registry of coding agents the client names in its user agent
(telemetry); the empty one, as it stands for "none". It is kept out of `requests`.

Xet: the client takes the Xet path only when a HEAD carries `X-Xet-Hash` (with a refresh route), or
a tree entry carries `xetHash`. This server sends neither, so every download is plain HTTP.

Errors: the client maps them by the `X-Error-Code` header alone (its fallback on a bare 401/404
matches https:// URLs only). Unknown repo: 404 `RepoNotFound` (RepositoryNotFoundError). Unknown
revision: 404 `RevisionNotFound` (RevisionNotFoundError). Unknown file: 404 `EntryNotFound`
(RemoteEntryNotFoundError, an EntryNotFoundError) with `X-Repo-Commit`. A gated repo's info and
tree are public, as on the Hub. Its files answer 401 `GatedRepo` (GatedRepoError) without
`Authorization: Bearer {hub.token}`, and 403 `GatedRepo` with another token.

Pointing the client here (huggingface_hub reads its environment once, at import):
  - In a subprocess: set HF_ENDPOINT=hub.url (and HF_HUB_OFFLINE, HF_TOKEN, HF_HUB_CACHE) in its env.
  - In-process: pass `endpoint=hub.url` to snapshot_download / hf_hub_download / HfApi(...), or call
    `hub.patch_endpoint(monkeypatch)`. That patches `constants.ENDPOINT` and
    `HUGGINGFACE_CO_URL_TEMPLATE`, which code calling the client without `endpoint=` reads. The
    module-level `huggingface_hub.model_info`, `list_repo_files`, ... belong to an HfApi made at
    import, so they keep the old endpoint: use `HfApi(endpoint=...)`.
  - HF_HUB_OFFLINE: `monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)` works
    (read at each request). HF_TOKEN is read from os.environ at each call: monkeypatch.setenv works.
  - The cache: pass `cache_dir=tmp_path`, or patch `constants.HF_HUB_CACHE`. Never the real ~/.cache.

Resume: huggingface_hub 2.4.0 resumes within one call only. `http_get` retries a cut body up to 5
times, 1 s apart, each with `Range: bytes={received}-`. A failed call deletes its partial file
(a temp file unique to the process), so the next call starts again from byte 0.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".onnx", ".h5", ".msgpack", ".ckpt")
LFS_MIN_SIZE = 10 * 1024 * 1024  # the Hub stores any file this large in LFS, whatever its name
_SKIPPED_DIRS = {".git", ".cache", "__pycache__"}
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class _File:
    """One file of a commit: its bytes (in memory or on disk) and the ids the Hub reports for it."""
    path: str
    size: int
    source: bytes | Path
    blob_id: str  # git sha1 of the blob, or of the LFS pointer for an LFS file
    sha256: str | None  # LFS files only: their ETag and their CDN address

    def read(self, start: int, end: int):
        """Yield the bytes [start, end) in chunks."""
        if isinstance(self.source, bytes):
            yield self.source[start:end]
            return
        with open(self.source, "rb") as f:
            f.seek(start)
            while start < end and (chunk := f.read(min(_CHUNK, end - start))):
                start += len(chunk)
                yield chunk


@dataclass
class _Repo:
    gated: bool
    commits: dict[str, dict[str, _File]]  # commit sha -> path -> file
    refs: dict[str, str]  # branch or tag -> commit sha


class _HubError(Exception):
    """An error answer: the status and the X-Error-Code that the client turns into its error class."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers or {}


class HubServer:
    """A Hub on 127.0.0.1 at a free port, served from a background thread until `close()`."""

    def __init__(self, token: str = "hf_test_token"):
        self.token = token  # the one token that opens gated repos
        self._repos: dict[str, _Repo] = {}
        self._lfs: dict[str, _File] = {}  # sha256 -> file, for the CDN route
        self._lock = threading.Lock()
        self._requests: list[tuple[str, str]] = []
        self._ranges: list[tuple[str, str, int]] = []
        self._cuts: list[list] = []  # [path suffix, bytes to send, times left]
        self._claimed: dict[str, int] = {}
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.hub = self
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"  # for HF_ENDPOINT
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="hub-server", daemon=True)
        self._thread.start()

    def __enter__(self) -> HubServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- building repos --------------------------------------------------------------------------

    def add_repo(self, repo_id: str, files: Mapping[str, Path | bytes], revision: str = "main",
                 gated: bool = False, tags: tuple[str, ...] = ()) -> str:
        """Add a commit holding `files` as branch `revision` of `repo_id` (and as each of `tags`);
        return its sha. Call again with another revision for another branch. `gated` applies to
        the whole repo: the last call sets it."""
        commit = {path: _make_file(path, source) for path, source in files.items()}
        listing = "".join(f"{path} {f.blob_id}\n" for path, f in sorted(commit.items()))
        sha = hashlib.sha1(f"{repo_id}\n{listing}".encode()).hexdigest()
        with self._lock:
            repo = self._repos.setdefault(repo_id, _Repo(gated, {}, {}))
            repo.gated = gated
            repo.commits[sha] = commit
            for ref in (revision, *tags):
                repo.refs[ref] = sha
            self._lfs.update({f.sha256: f for f in commit.values() if f.sha256})
        return sha

    def add_folder(self, repo_id: str, folder: Path, **kwargs) -> str:
        """Add every file under `folder` (but .git, .cache, __pycache__) as a commit; see add_repo."""
        folder = Path(folder)
        files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*"))
                 if p.is_file() and not _SKIPPED_DIRS & set(p.relative_to(folder).parts)}
        return self.add_repo(repo_id, files, **kwargs)

    # -- faults and observations -----------------------------------------------------------------

    def cut_after(self, path_suffix: str, nbytes: int, times: int = 1) -> None:
        """The next `times` GETs of a path ending in `path_suffix` send `nbytes` bytes of the body,
        then drop the connection (the server dying mid-file)."""
        with self._lock:
            self._cuts.append([path_suffix, nbytes, times])

    def claimed_size(self, path_suffix: str, size: int) -> None:
        """Listings (tree, and siblings with blobs=true) report `size` for files ending in
        `path_suffix`. The HEAD and the bytes stay true."""
        with self._lock:
            self._claimed[path_suffix] = size

    @property
    def requests(self) -> list[tuple[str, str]]:
        """(method, path without query) of every request received, in order (a copy)."""
        with self._lock:
            return list(self._requests)

    @property
    def range_requests(self) -> list[tuple[str, str, int]]:
        """(path, Range header, status answered) of every file request that carried a Range."""
        with self._lock:
            return list(self._ranges)

    def clear_requests(self) -> None:
        with self._lock:
            self._requests.clear()
            self._ranges.clear()

    def patch_endpoint(self, monkeypatch) -> None:
        """Point an imported huggingface_hub here for one test (see the module docstring)."""
        from huggingface_hub import constants
        monkeypatch.setattr(constants, "ENDPOINT", self.url)
        template = self.url + "/{repo_id}/resolve/{revision}/{filename}"
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)

    # -- used by the handler ---------------------------------------------------------------------

    def _record(self, method: str, path: str) -> None:
        with self._lock:
            self._requests.append((method, path))

    def _record_range(self, path: str, range_header: str, status: int) -> None:
        with self._lock:
            self._ranges.append((path, range_header, status))

    def _take_cut(self, path: str) -> int | None:
        with self._lock:
            for cut in self._cuts:
                if path.endswith(cut[0]) and cut[2] > 0:
                    cut[2] -= 1
                    return cut[1]
        return None

    def _listed_size(self, f: _File) -> int:
        with self._lock:
            return next((size for suffix, size in self._claimed.items() if f.path.endswith(suffix)), f.size)

    def _repo(self, repo_id: str) -> _Repo:
        with self._lock:
            repo = self._repos.get(repo_id)
        if repo is None:
            raise _HubError(404, "RepoNotFound", f"Repository not found: {repo_id}")
        return repo

    def _commit(self, repo_id: str, revision: str) -> tuple[str, dict[str, _File]]:
        """The commit sha and files of a branch, tag or full commit sha."""
        repo = self._repo(repo_id)
        sha = revision if revision in repo.commits else repo.refs.get(revision)
        if sha is None:
            raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return sha, repo.commits[sha]

    def _check_access(self, repo_id: str, authorization: str | None) -> None:
        if not self._repo(repo_id).gated or authorization == f"Bearer {self.token}":
            return
        if authorization is None:
            raise _HubError(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have "
                            "access to it and be authenticated to access it. Please log in.")
        raise _HubError(403, "GatedRepo", f"Access to model {repo_id} is restricted and you are not in "
                        "the authorized list.")

    def _file(self, sha256: str) -> _File:
        with self._lock:
            f = self._lfs.get(sha256)
        if f is None:
            raise _HubError(404, "EntryNotFound", f"No LFS object {sha256}")
        return f


def _make_file(path: str, source: Path | bytes) -> _File:
    source = source if isinstance(source, bytes) else Path(source)
    size = len(source) if isinstance(source, bytes) else source.stat().st_size
    if not (path.endswith(LFS_SUFFIXES) or size >= LFS_MIN_SIZE):
        data = source if isinstance(source, bytes) else source.read_bytes()
        return _File(path, size, data, _git_blob_id(data), None)
    sha256 = _sha256(source, size)
    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()
    return _File(path, size, source, _git_blob_id(pointer), sha256)


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


_sha256_of_path: dict[tuple[Path, int], str] = {}  # a big file that several repos share is hashed once


def _sha256(source: Path | bytes, size: int) -> str:
    if isinstance(source, bytes):
        return hashlib.sha256(source).hexdigest()
    if (source, size) not in _sha256_of_path:
        with open(source, "rb") as f:
            _sha256_of_path[(source, size)] = hashlib.file_digest(f, "sha256").hexdigest()
    return _sha256_of_path[(source, size)]


def _tree(files: dict[str, _File], directory: str, recursive: bool, size_of) -> list[dict] | None:
    """The /tree listing of `directory` ("" for the root): folders first, then files; None if no such folder."""
    prefix = f"{directory}/" if directory else ""
    folders, entries = set(), []
    for path, f in sorted(files.items()):
        if not path.startswith(prefix):
            continue
        parts = path[len(prefix):].split("/")
        depth = len(parts) - 1 if recursive else min(len(parts) - 1, 1)
        folders.update(prefix + "/".join(parts[:i]) for i in range(1, depth + 1))
        if recursive or len(parts) == 1:
            entry = {"type": "file", "oid": f.blob_id, "size": size_of(f), "path": path}
            if f.sha256:
                entry["lfs"] = {"oid": f.sha256, "size": size_of(f), "pointerSize": 134}
            entries.append(entry)
    if directory and not entries and not folders:
        return None
    dirs = [{"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "path": d} for d in sorted(folders)]
    return dirs + entries


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as httpx expects; every answer has a Content-Length

    def log_message(self, format, *args) -> None:  # quiet: pytest shows failures, not access logs
        pass

    def do_GET(self) -> None:
        self._answer(head=False)

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def _answer(self, head: bool) -> None:
        hub: HubServer = self.server.hub
        path, _, query = self.path.partition("?")
        parts = path.split("/")
        if path == "/api/agent-harnesses":  # the client's user-agent telemetry, cached a day: not counted
            return self._send_json({"standardEnvVars": [], "harnesses": {}})
        hub._record(self.command, path)
        try:
            if path.startswith("/api/models/"):
                self._api(hub, parts[3:], parse_qs(query))
            elif path.startswith("/lfs/") and len(parts) >= 4:
                self._send_file(hub, hub._file(parts[2]), head)
            elif "resolve" in parts[2:]:
                self._resolve(hub, parts, head)
            else:
                raise _HubError(404, "RepoNotFound", f"No route for {path}")
        except _HubError as e:
            body = json.dumps({"error": e.message}).encode()
            self._send(e.status, body, {"X-Error-Code": e.code, "X-Error-Message": e.message,
                                        "Content-Type": "application/json", **e.headers}, head)

    def _api(self, hub: HubServer, parts: list[str], query: dict) -> None:
        """/api/models/{repo}[/revision/{rev}] and /api/models/{repo}/tree/{rev}[/{dir}]."""
        kind = next((i for i, p in enumerate(parts) if i > 0 and p in ("revision", "tree")), len(parts))
        repo_id = unquote("/".join(parts[:kind]))
        revision = unquote(parts[kind + 1]) if kind + 1 < len(parts) else "main"
        sha, files = hub._commit(repo_id, revision)
        if kind < len(parts) and parts[kind] == "tree":
            directory = unquote("/".join(parts[kind + 2:]))
            recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
            listing = _tree(files, directory, recursive, hub._listed_size)
            if listing is None:
                raise _HubError(404, "EntryNotFound", f"{directory} does not exist on {revision}")
            return self._send_json(listing)
        blobs = query.get("blobs", ["false"])[0].lower() in ("true", "1")
        repo = hub._repo(repo_id)
        self._send_json({"id": repo_id, "modelId": repo_id, "sha": sha, "private": False,
                         "gated": "manual" if repo.gated else False, "disabled": False,
                         "siblings": [_sibling(f, blobs, hub._listed_size) for f in files.values()]})

    def _resolve(self, hub: HubServer, parts: list[str], head: bool) -> None:
        """/{repo}/resolve/{rev}/{file}: a git blob's bytes, or a 302 to the CDN for an LFS file."""
        at = parts.index("resolve", 2)
        repo_id = unquote("/".join(parts[1:at]))
        hub._check_access(repo_id, self.headers.get("Authorization"))
        sha, files = hub._commit(repo_id, unquote(parts[at + 1]) if at + 1 < len(parts) else "")
        filename = unquote("/".join(parts[at + 2:]))
        f = files.get(filename)
        if f is None:
            raise _HubError(404, "EntryNotFound", f"{filename} does not exist", {"X-Repo-Commit": sha})
        if f.sha256 is None:
            return self._send_file(hub, f, head, {"ETag": f'"{f.blob_id}"', "X-Repo-Commit": sha})
        location = f"http://localhost:{hub.port}/lfs/{f.sha256}/{quote(f.path)}"
        self._send(302, b"", {"Location": location, "ETag": f'"{f.sha256}"', "X-Repo-Commit": sha,
                              "X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(f.size)}, head)

    def _send_file(self, hub: HubServer, f: _File, head: bool, headers: dict | None = None) -> None:
        """The file's bytes, or the range asked for (206); cut short where `cut_after` says."""
        path = self.path.partition("?")[0]
        headers = {"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream",
                   "ETag": f'"{f.sha256 or f.blob_id}"', **(headers or {})}
        start, end, status = 0, f.size, 200
        if (asked := self.headers.get("Range")) is not None:
            span = _byte_range(asked, f.size)
            hub._record_range(path, asked, 416 if span is None else 206)
            if span is None:
                raise _HubError(416, "RangeNotSatisfiable", f"Range {asked}", {"Content-Range": f"bytes */{f.size}"})
            (start, end), status = span, 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{f.size}"
        self._send_headers(status, end - start, headers)
        if head:
            return
        cut = hub._take_cut(path)
        stop = end if cut is None else min(end, start + cut)
        for chunk in f.read(start, stop):
            self.wfile.write(chunk)
        if stop < end:  # the server "dies": the client sees the body end early
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)

    def _send_json(self, obj) -> None:
        self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json"}, head=False)

    def _send(self, status: int, body: bytes, headers: dict, head: bool) -> None:
        self._send_headers(status, len(body), headers)
        if not head:
            self.wfile.write(body)

    def _send_headers(self, status: int, length: int, headers: dict) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(length))
        self.end_headers()


def _byte_range(asked: str, size: int) -> tuple[int, int] | None:
    """[start, end) of a `Range: bytes=N-`, `bytes=N-M` or `bytes=-K` header; None if unsatisfiable."""
    match = _RANGE.fullmatch(asked.strip())
    if match is None or match.groups() == ("", ""):
        return None
    if not match[1]:  # the last K bytes
        return max(size - int(match[2]), 0), size
    start, end = int(match[1]), min(int(match[2]) + 1 if match[2] else size, size)
    return (start, end) if start < end else None


def _sibling(f: _File, blobs: bool, size_of) -> dict:
    """A model_info sibling: only the name, unless the caller asked for blobs (files_metadata=True)."""
    if not blobs:
        return {"rfilename": f.path}
    sibling = {"rfilename": f.path, "size": size_of(f), "blobId": f.blob_id}
    if f.sha256:
        sibling["lfs"] = {"sha256": f.sha256, "size": size_of(f), "pointerSize": 134}
    return sibling
