"""The Hugging Face Hub, as tests meet it without a network: a cache laid out by hand, and a stand-in Hub on 127.0.0.1.

`write_to_cache` puts a model directory into a Hugging Face cache the way huggingface_hub lays one out:
`models--org--name/refs/<revision>` holds the commit hash, `snapshots/<commit>/<file>` are relative symlinks to
`blobs/<id>`, a blob's id being its git blob sha1, or its sha256 for a file the Hub keeps in LFS (weights).

`FakeHub` answers the routes huggingface_hub's downloads use (`HF_ENDPOINT=hub.url`): a repository's revision
(`/api/models/<id>/revision/<rev>`), its file tree (`/api/models/<id>/tree/<rev>`) and its files
(`/<id>/resolve/<rev>/<path>`, HEAD and GET), with the Hub's error codes (`X-Error-Code`: RepoNotFound,
RevisionNotFound, GatedRepo, EntryNotFound) for a repository that is not there, a revision it lacks, a gated
repository asked without its token (`FakeHub.TOKEN`), a file it lacks.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


def blob_id(path: str, content: bytes) -> str:
    """The name of a file's blob in the cache (and its ETag on the Hub): sha256 for LFS files, else git's sha1."""
    if _in_lfs(path):
        return hashlib.sha256(content).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def commit_of(files: dict[str, bytes], salt: str = "") -> str:
    """A commit hash (40 hex digits) for a set of files."""
    digest = hashlib.sha1(salt.encode())
    for path in sorted(files):
        digest.update(path.encode() + b"\0" + blob_id(path, files[path]).encode())
    return digest.hexdigest()


def files_of(directory: Path) -> dict[str, bytes]:
    """Every file under `directory`, by its path relative to it."""
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def write_to_cache(cache_dir: Path, repo_id: str, directory: Path, *, revision: str = "main",
                   commit: str | None = None) -> Path:
    """Put the files of `directory` into the Hugging Face cache `cache_dir` (`HF_HUB_CACHE`) as `repo_id` at
    `revision` (a branch or tag: its ref file is written; a commit hash: only the snapshot); returns the snapshot."""
    files = files_of(directory)
    commit = commit or commit_of(files, salt=revision)
    storage = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    for path, content in files.items():
        blob = storage / "blobs" / blob_id(path, content)
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(content)
        pointer = snapshot / path
        pointer.parent.mkdir(parents=True, exist_ok=True)
        pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    if revision != commit:
        ref = storage / "refs" / revision
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)  # no newline: huggingface_hub reads the file as it is
    return snapshot


def _in_lfs(path: str) -> bool:
    return path.endswith((".safetensors", ".bin"))


@dataclass
class HubRepo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> its files
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    gated: bool = False

    def commit(self, revision: str) -> str | None:
        return revision if revision in self.commits else self.refs.get(revision)


class FakeHub:
    """A stand-in Hugging Face Hub on 127.0.0.1 (see the module docstring): `with FakeHub() as hub:`."""

    TOKEN = "hf_test_token"  # what a gated repository asks for (HF_TOKEN)

    def __init__(self) -> None:
        self.repos: dict[str, HubRepo] = {}
        self.downloads: list[str] = []  # "<repo>/<path>" of every file GET, in order
        self.requests: list[str] = []  # "<method> <path>" of every request, in order
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def add(self, repo_id: str, directory: Path, *, revision: str = "main", gated: bool = False) -> str:
        """Publish the files of `directory` as `repo_id` at branch `revision`; returns the commit hash."""
        files = files_of(directory)
        commit = commit_of(files, salt=revision)
        repo = self.repos.setdefault(repo_id, HubRepo())
        repo.commits[commit], repo.refs[revision], repo.gated = files, commit, repo.gated or gated
        return commit

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
            self._answer(body=False)

        def do_GET(self) -> None:  # noqa: N802
            self._answer(body=True)

        def _answer(self, body: bool) -> None:
            hub.requests.append(f"{self.command} {self.path}")
            parts = [unquote(p) for p in urlsplit(self.path).path.strip("/").split("/")]
            api = parts[0] == "api"
            if api:
                parts = parts[2:]  # api/models/
            if len(parts) < 4:
                return self._error(404, "RepoNotFound")
            repo_id, route, revision, rest = "/".join(parts[:2]), parts[2], parts[3], "/".join(parts[4:])
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._error(401, "RepoNotFound")  # the Hub's answer for a missing (or private) repository
            commit = repo.commit(revision)
            if commit is None:
                return self._error(404, "RevisionNotFound")
            if api and route == "revision":
                return self._json({"id": repo_id, "sha": commit, "private": False, "gated": repo.gated and "manual",
                                   "siblings": [{"rfilename": p} for p in repo.commits[commit]]})
            if api and route == "tree":
                return self._json([_tree_entry(p, c) for p, c in repo.commits[commit].items()])
            if route != "resolve":
                return self._error(404, "EntryNotFound")
            if repo.gated and self.headers.get("authorization") != f"Bearer {FakeHub.TOKEN}":
                return self._error(403, "GatedRepo")
            self._file(repo_id, commit, rest, repo.commits[commit].get(rest), body)

        def _file(self, repo_id: str, commit: str, path: str, content: bytes | None, body: bool) -> None:
            if content is None:
                return self._error(404, "EntryNotFound")
            self.send_response(200)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{blob_id(path, content)}"')
            self.send_header("Content-Length", str(len(content)))
            self.end_headers()
            if body:
                hub.downloads.append(f"{repo_id}/{path}")
                self.wfile.write(content)

        def _json(self, value: object) -> None:
            data = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, code: str) -> None:
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Length", "0")
            self.end_headers()

    return Handler


def _tree_entry(path: str, content: bytes) -> dict:
    entry = {"type": "file", "path": path, "size": len(content), "oid": blob_id(path, content)}
    if _in_lfs(path):
        entry["oid"] = hashlib.sha1(content).hexdigest()  # the LFS pointer's blob; the file's own id is lfs.oid
        entry["lfs"] = {"oid": blob_id(path, content), "size": len(content), "pointerSize": 134}
    return entry
