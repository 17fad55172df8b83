"""A stand-in for the Hugging Face Hub's HTTP API on 127.0.0.1, for the real `huggingface_hub` client.

Only what `model_info(files_metadata=True)`, `hf_hub_download`, `create_repo` and `upload_folder` call, answered
as the Hub answers (its documented routes and headers; the refusals carry the `X-Error-Code` header the client
reads): model info with each file's size, git blob id and, for LFS files, SHA-256; downloads under
`/{repo}/resolve/{revision}/{path}` with `X-Repo-Commit` and `ETag`; repository creation; the commit API
(`preupload`, then an NDJSON commit with base64 file contents; every file here is small enough for that).

Refusals: an unknown token is 401 "Invalid credentials in Authorization header"; a gated repository for a token
whose account has not accepted its licence is 403 GatedRepo (401 without a token); a missing repository is 404
RepoNotFound, a missing revision 404 RevisionNotFound, a missing file 404 EntryNotFound; writing with a read token
is 403. Point the client at it with `HfApi(endpoint=...)` or HF_ENDPOINT in a new process.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

LFS_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.model")  # what the Hub's .gitattributes puts in LFS


def git_blob_id(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content, usedforsecurity=False).hexdigest()


def lfs_pointer(content: bytes) -> bytes:
    digest = hashlib.sha256(content).hexdigest()
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{digest}\nsize {len(content)}\n".encode()


@dataclass
class Account:
    name: str
    write: bool = False


@dataclass
class Repo:
    repo_id: str
    private: bool = False
    gated: bool = False
    license: str | None = None
    accepted: set[str] = field(default_factory=set)  # accounts that accepted the gated licence
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    served: dict[str, bytes] = field(default_factory=dict)  # path -> bytes served instead (a damaged download)

    def resolve(self, revision: str) -> str | None:
        if revision in self.commits:
            return revision
        return self.branches.get(revision)


@dataclass
class HubStandin:
    accounts: dict[str, Account] = field(default_factory=dict)  # token -> account
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)
    endpoint: str = ""

    def add_token(self, token: str, account: str, *, write: bool = False) -> None:
        self.accounts[token] = Account(account, write)

    def add_model(
        self, repo_id: str, files: dict[str, bytes], *, gated: bool = False, license: str | None = None
    ) -> str:
        """A repository holding `files` in one commit on main; its commit id."""
        repo = self.repos.setdefault(repo_id, Repo(repo_id, gated=gated, license=license))
        return self._commit(repo, files)

    def add_model_directory(self, repo_id: str, directory: Path, **options: Any) -> str:
        paths = sorted(p for p in directory.rglob("*") if p.is_file())
        files = {p.relative_to(directory).as_posix(): p.read_bytes() for p in paths}
        return self.add_model(repo_id, files, **options)

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        repo = self.repos[repo_id]
        return dict(repo.commits[repo.resolve(revision) or revision])

    def _commit(self, repo: Repo, files: dict[str, bytes]) -> str:
        parent = repo.branches.get("main", "")
        digest = hashlib.sha1(parent.encode(), usedforsecurity=False)
        for path, content in sorted(files.items()):
            digest.update(path.encode() + b"\0" + hashlib.sha256(content).digest())
        sha = digest.hexdigest()
        repo.commits[sha] = dict(files)
        repo.branches["main"] = sha
        return sha


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # the tests read `requests` instead
        pass

    # --- answers ---

    def _send(
        self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, *, head: bool = False
    ) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, status: int, value: Any, headers: dict[str, str] | None = None, *, head: bool = False) -> None:
        headers = {"Content-Type": "application/json", **(headers or {})}
        self._send(status, json.dumps(value).encode(), headers, head=head)

    def _error(self, status: int, code: str | None, message: str, *, head: bool = False) -> None:
        headers = {"X-Error-Message": message, **({"X-Error-Code": code} if code else {})}
        self._json(status, {"error": message}, headers, head=head)

    # --- who asks ---

    def _account(self) -> tuple[Account | None, bool]:
        """(account, valid): no Authorization header is anonymous and valid; an unknown token is invalid."""
        header = self.headers.get("Authorization", "")
        if not header.startswith("Bearer "):
            return None, True
        account = self.server.hub.accounts.get(header.removeprefix("Bearer "))
        return account, account is not None

    def _readable(self, repo_id: str, *, head: bool = False) -> Repo | None:
        """The repository if this request may read it; otherwise the Hub's refusal has been sent."""
        account, valid = self._account()
        if not valid:
            self._error(401, None, "Invalid credentials in Authorization header", head=head)
            return None
        repo = self.server.hub.repos.get(repo_id)
        if repo is None or (repo.private and account is None):
            self._error(404, "RepoNotFound", "Repository not found", head=head)
            return None
        if repo.gated and (account is None or account.name not in repo.accepted):
            status = 401 if account is None else 403
            message = (
                f"Access to model {repo_id} is restricted and you are not in the authorized list. "
                f"Visit https://huggingface.co/{repo_id} to ask for access."
            )
            self._error(status, "GatedRepo", message, head=head)
            return None
        return repo

    def _writer(self) -> Account | None:
        account, valid = self._account()
        if not valid:
            self._error(401, None, "Invalid credentials in Authorization header")
            return None
        if account is None or not account.write:
            self._error(403, None, "You don't have the rights to create or write this repository")
            return None
        return account

    # --- routes ---

    def do_HEAD(self) -> None:
        self._route("HEAD")

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def _route(self, method: str) -> None:
        # Read the whole body first: on a kept-alive connection, unread bytes would be taken for the next request.
        self._payload = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        url = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(url.path)
        self.server.hub.requests.append(f"{method} {path}")
        head = method == "HEAD"
        parts = path.strip("/").split("/")
        if method == "GET" and parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo_id = "/".join(parts[2:4])
            revision = "/".join(parts[5:]) if len(parts) > 5 and parts[4] == "revision" else "main"
            # `files_metadata=True`: blobs=true from httpx (huggingface_hub 1.x), blobs=True from requests (0.x).
            blobs = [v.lower() for v in urllib.parse.parse_qs(url.query).get("blobs", [])] == ["true"]
            return self._model_info(repo_id, revision, blobs=blobs)
        if method in ("GET", "HEAD") and len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]), head=head)
        if method == "POST" and path == "/api/repos/create":
            return self._create_repo(self._body_json())
        if method == "POST" and path == "/api/validate-yaml":
            return self._json(200, {"errors": [], "warnings": []})
        if method == "POST" and parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "preupload":
            return self._preupload("/".join(parts[2:4]), self._body_json())
        if method == "POST" and parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "commit":
            return self._commit("/".join(parts[2:4]), "/".join(parts[5:]))
        self._error(404, None, f"the stand-in has no route {method} {path}", head=head)

    def _body(self) -> bytes:
        return self._payload

    def _body_json(self) -> Any:
        return json.loads(self._body() or b"{}")

    def _model_info(self, repo_id: str, revision: str, *, blobs: bool) -> None:
        repo = self._readable(repo_id)
        if repo is None:
            return
        sha = repo.resolve(revision)
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        siblings = []
        for name, content in sorted(repo.commits[sha].items()):
            sibling: dict[str, Any] = {"rfilename": name}
            if blobs:
                lfs = any(fnmatch.fnmatchcase(name, pattern) for pattern in LFS_PATTERNS)
                pointer = lfs_pointer(content)
                sibling |= {"size": len(content), "blobId": git_blob_id(pointer if lfs else content)}
                if lfs:
                    sibling["lfs"] = {
                        "sha256": hashlib.sha256(content).hexdigest(),
                        "size": len(content),
                        "pointerSize": len(pointer),
                    }
            siblings.append(sibling)
        self._json(
            200,
            {
                "_id": hashlib.md5(repo_id.encode(), usedforsecurity=False).hexdigest()[:24],
                "id": repo_id,
                "modelId": repo_id,
                "author": repo_id.split("/")[0],
                "sha": sha,
                "private": repo.private,
                "gated": "manual" if repo.gated else False,
                "disabled": False,
                "downloads": 0,
                "likes": 0,
                "tags": [],
                "library_name": "transformers",
                "cardData": {"license": repo.license} if repo.license else None,
                "siblings": siblings,
                "createdAt": "2024-07-23T00:00:00.000Z",
                "lastModified": "2024-07-23T00:00:00.000Z",
            },
        )

    def _resolve(self, repo_id: str, revision: str, name: str, *, head: bool) -> None:
        repo = self._readable(repo_id, head=head)
        if repo is None:
            return
        sha = repo.resolve(urllib.parse.unquote(revision))
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", head=head)
        content = repo.commits[sha].get(name)
        if content is None:
            return self._error(404, "EntryNotFound", f"{name} does not exist on {revision}", head=head)
        lfs = any(fnmatch.fnmatchcase(name, pattern) for pattern in LFS_PATTERNS)
        etag = hashlib.sha256(content).hexdigest() if lfs else git_blob_id(content)
        body = repo.served.get(name, content)
        headers = {"X-Repo-Commit": sha, "ETag": f'"{etag}"', "Content-Type": "application/octet-stream"}
        if lfs:
            headers |= {"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(content))}
        self._send(200, body, headers, head=head)

    def _create_repo(self, payload: dict[str, Any]) -> None:
        if self._writer() is None:
            return
        repo_id = f"{payload.get('organization')}/{payload['name']}"
        hub = self.server.hub
        url = f"{hub.endpoint}/{repo_id}"
        if repo_id in hub.repos:
            return self._json(409, {"error": "You already created this model repo", "url": url})
        private = bool(payload.get("private")) or payload.get("visibility") == "private"
        repo = Repo(repo_id, private=private)
        hub.repos[repo_id] = repo
        repo.commits[""] = {}
        repo.branches["main"] = ""
        self._json(200, {"url": url, "name": repo_id})

    def _preupload(self, repo_id: str, payload: dict[str, Any]) -> None:
        if self._writer() is None:
            return
        if repo_id not in self.server.hub.repos:
            return self._error(404, "RepoNotFound", "Repository not found")
        files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in payload["files"]]
        self._json(200, {"files": files})

    def _commit(self, repo_id: str, revision: str) -> None:
        lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
        if self._writer() is None:
            return
        repo = self.server.hub.repos.get(repo_id)
        if repo is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        parent = repo.resolve(revision)
        if parent is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        files = dict(repo.commits[parent])
        for line in lines:
            if line["key"] == "file":
                value = line["value"]
                if value.get("encoding") != "base64":
                    return self._error(400, None, "the stand-in takes base64 file contents only")
                files[value["path"]] = base64.b64decode(value["content"])
            elif line["key"] != "header":
                return self._error(400, None, f"the stand-in does not take {line['key']} operations")
        sha = self.server.hub._commit(repo, files)
        url = f"{self.server.hub.endpoint}/{repo_id}/commit/{sha}"
        self._json(200, {"success": True, "commitOid": sha, "commitUrl": url, "hookOutput": ""})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    hub: HubStandin


def point_client_at(endpoint: str, monkeypatch: Any) -> None:
    """This process's huggingface_hub as a process started with HF_ENDPOINT=endpoint has it (the pipeline's jobs):
    the client reads the variable once, when imported, into these module values (0.36 parses the commit URLs the
    Hub answers with against the first one, whatever endpoint a call was given)."""
    import huggingface_hub.constants
    import huggingface_hub.file_download

    template = endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    if hasattr(huggingface_hub.file_download, "HUGGINGFACE_CO_URL_TEMPLATE"):  # imported by name there
        monkeypatch.setattr(huggingface_hub.file_download, "HUGGINGFACE_CO_URL_TEMPLATE", template)


@contextmanager
def running_hub(hub: HubStandin | None = None) -> Iterator[HubStandin]:
    """The stand-in on a free port of 127.0.0.1 for the block; `hub.endpoint` is its URL."""
    hub = hub or HubStandin()
    server = _Server(("127.0.0.1", 0), _Handler)
    server.hub = hub
    hub.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
