"""The Hugging Face Hub at both ends of a run: `fetch` downloads the base model, `export --push-to-hub` publishes
the trained one.

`fetch` downloads the recipe's `model.hub` repository at its pinned commit into `model.config`, checks every file
against the hash the Hub publishes for it (the LFS SHA-256 of large files, the git blob id of small ones), and
writes `fetch-manifest.json` (repo_id, revision, files {path: sha256}, license, fetched_at) into the directory,
which appears complete or not at all (downloaded into a temporary sibling, renamed into place). A directory that
already holds the same repository and commit is kept as it is. With `--copy-to s3://...` the directory is also
uploaded there, its manifest last: on AWS that is the bucket prefix the file system imports `models_dir` from, so
a new environment finds the model on the file system without a download.

Tokens come from AWS Secrets Manager, read at run time into memory and handed to huggingface_hub as `token=`:
never an environment variable, an argument or a line of a log. The Hub's refusals (gated model without an accepted
licence, bad token, missing repository or revision) are one line naming the repository.

The push creates the repository private unless told otherwise and commits the run's `hf/` directory as it is (the
model card in it included); unless `--push-despite-gate` it refuses a run whose evaluation gate failed or whose
recipe has an evaluate stage that wrote no report (training.pipeline.evaluate.publish_blocker), and pushes a run
of a recipe without an evaluate stage with a warning.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from training import outputs
from training.config.loading import not_allowed
from training.config.recipe import HUB_REPO_ALLOWED, HUB_REPO_PATTERN, HubSource, load_recipe
from training.errors import UserError
from training.secrets import read_secret

log = logging.getLogger(__name__)
FETCH_MANIFEST = "fetch-manifest.json"
HASH_CHUNK = 8 << 20
T = TypeVar("T")


# --- tokens ---------------------------------------------------------------------------------------------------


def read_token(secret_arn: str) -> str:
    """The Hub token a Secrets Manager secret holds: its string, plain or as JSON {"token": ...}."""
    text = read_secret(secret_arn, "Hugging Face token")
    if text.startswith("{"):
        try:
            text = str(json.loads(text).get("token") or "").strip()
        except (json.JSONDecodeError, AttributeError):
            text = ""
        if not text:
            raise UserError(f"Hugging Face token secret {secret_arn}: a JSON string without a token key")
    return text


def hub_endpoint() -> str | None:
    """HF_ENDPOINT as the process has it now (huggingface_hub reads it once, when imported): passed to every call."""
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or None


# --- the Hub's refusals ---------------------------------------------------------------------------------------


def hub_refusal(error: Exception, repo: str, revision: str | None, *, writing: bool = False) -> str | None:
    """One line for an error of huggingface_hub, naming the repository; None for errors that are not the Hub's."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    status = getattr(getattr(error, "response", None), "status_code", None)
    at = f" at revision {revision}" if revision else ""
    # No answer at all: what huggingface_hub raises when a download finds neither the Hub nor a cached copy, or the
    # HTTP library's own connection errors (requests in 0.x, httpx or httpx2 in later versions).
    library = type(error).__module__.partition(".")[0]
    if isinstance(error, LocalEntryNotFoundError | ConnectionError | TimeoutError) or (
        library in ("httpx", "httpx2", "httpcore", "httpcore2", "requests", "urllib3")
        and not isinstance(error, HfHubHTTPError)
    ):
        return f"Hugging Face model {repo}: the Hub cannot be reached from this node ({type(error).__name__})"
    if isinstance(error, GatedRepoError):
        return (
            f"Hugging Face model {repo} is gated: accept its licence on the Hub with the account of the token, "
            "then run again"
        )
    if status == 401 and isinstance(error, HfHubHTTPError) and not isinstance(error, RepositoryNotFoundError):
        return f"Hugging Face model {repo}: the Hub refused the token (401); store a valid token in the secret"
    if isinstance(error, RevisionNotFoundError):
        return f"Hugging Face model {repo} has no revision {revision}; pin a commit id of the repository"
    if isinstance(error, RepositoryNotFoundError):
        return (
            f"Hugging Face model {repo}{at}: not found (or private and the token cannot read it); check the "
            "repository name and the token"
        )
    if status == 403 and isinstance(error, HfHubHTTPError):
        need = "a write token of an account that may create and write it" if writing else "access to it"
        return f"Hugging Face model {repo}: the Hub refused the token (403); the token needs {need}"
    if isinstance(error, HfHubHTTPError):
        return f"Hugging Face model {repo}{at}: the Hub answered {status or 'an error'}: {str(error).splitlines()[0]}"
    return None


def calling_hub(repo: str, revision: str | None, call: Callable[[], T], *, writing: bool = False) -> T:
    try:
        return call()
    except Exception as error:
        line = hub_refusal(error, repo, revision, writing=writing)
        if line is None:
            raise
        raise UserError(line) from None


# --- hashes ---------------------------------------------------------------------------------------------------


def file_hashes(path: Path) -> tuple[str, str]:
    """(SHA-256, git blob id) of a file, read once: the Hub names large files by the first, small ones by the
    second."""
    sha256 = hashlib.sha256()
    blob = hashlib.sha1(f"blob {path.stat().st_size}\0".encode(), usedforsecurity=False)
    with path.open("rb") as stream:
        while chunk := stream.read(HASH_CHUNK):
            sha256.update(chunk)
            blob.update(chunk)
    return sha256.hexdigest(), blob.hexdigest()


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int | None
    sha256: str | None  # LFS files
    blob_id: str | None  # every file: its git blob id (an LFS file's is its pointer's)


def selected_files(files: Sequence[RemoteFile], include: Sequence[str], exclude: Sequence[str]) -> list[RemoteFile]:
    """The repository's files that `include` matches and `exclude` does not (fnmatch on the whole path)."""

    def matches(path: str, patterns: Sequence[str]) -> bool:
        return any(fnmatch.fnmatchcase(path, pattern) for pattern in patterns)

    return sorted((f for f in files if matches(f.path, include) and not matches(f.path, exclude)), key=lambda f: f.path)


def mismatch(remote: RemoteFile, sha256: str, blob_id: str) -> str | None:
    """What differs between a downloaded file and the Hub's record of it; None when it is the same file."""
    if remote.sha256 is not None:
        return None if sha256 == remote.sha256 else f"SHA-256 {sha256}, the Hub's {remote.sha256}"
    if remote.blob_id is not None:
        return None if blob_id == remote.blob_id else f"git blob id {blob_id}, the Hub's {remote.blob_id}"
    return "the Hub publishes no hash for it"


def remote_files(info: Any) -> list[RemoteFile]:
    """The files of a ModelInfo fetched with files_metadata=True (huggingface_hub 0.36 and 2.x alike)."""
    found = []
    for sibling in info.siblings or []:
        lfs = sibling.lfs
        sha256 = (lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)) if lfs else None
        found.append(RemoteFile(sibling.rfilename, sibling.size, sha256, sibling.blob_id))
    return found


def card_license(info: Any) -> str | None:
    card = getattr(info, "card_data", None) or getattr(info, "cardData", None)
    value = card.get("license") if card is not None and hasattr(card, "get") else None
    if value is None:
        return None
    return ",".join(value) if isinstance(value, list) else str(value)


# --- fetch ----------------------------------------------------------------------------------------------------


def read_fetch_manifest(directory: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((directory / FETCH_MANIFEST).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None
    return manifest if isinstance(manifest, dict) else None


def complete_fetch(directory: Path, source: HubSource) -> dict[str, Any] | None:
    """The manifest of a finished fetch of this repository and commit in `directory`, every file it lists
    present; None otherwise."""
    manifest = read_fetch_manifest(directory)
    if manifest is None or manifest.get("repo_id") != source.repo or manifest.get("revision") != source.revision:
        return None
    files = manifest.get("files")
    if not isinstance(files, dict) or not all((directory / name).is_file() for name in files):
        return None
    return manifest


# What `prepare` needs of a base model (tokenizer, its configuration, the model's config.json): megabytes, fetched
# first so data preparation runs while the weights download.
TOKENIZER_FILES = ("*.json", "tokenizer.model")


def tokenizer_source(source: HubSource) -> HubSource:
    """The same repository and commit, its tokenizer and configuration files only (no weights)."""
    return source.model_copy(update={"include": TOKENIZER_FILES})


def fetch_model(
    source: HubSource,
    output: Path,
    *,
    token: str | None,
    copy_to: str | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Download, verify and record `source` into `output` unless it holds it already; then the S3 copy."""
    manifest = complete_fetch(output, source)
    skipped = manifest is not None
    if manifest is None:
        manifest = _download(source, output, token=token, overwrite=overwrite)
    else:
        print(f"{output} holds {source.repo} at {source.revision} already; nothing downloaded")
    copied = copy_to_s3(output, manifest, copy_to) if copy_to else None
    return {"output": str(output), "skipped": skipped, "copied_to": copied, **manifest}


def _download(source: HubSource, output: Path, *, token: str | None, overwrite: bool) -> dict[str, Any]:
    from huggingface_hub import HfApi, hf_hub_download

    repo, revision, endpoint = source.repo, source.revision, hub_endpoint()
    earlier = read_fetch_manifest(output)
    if earlier is not None and (earlier.get("repo_id"), earlier.get("revision")) == (repo, revision):
        # The same fetch with files missing since (complete ones never get here): removed and fetched again in full,
        # since a publish keeps an output recorded as made from the same inputs.
        log.warning(f"{output}: files of the fetch of {repo} at {revision} are missing; fetching it again")
        shutil.rmtree(output)
    elif earlier is not None and not overwrite:
        raise UserError(
            f"model.config {output} holds {earlier.get('repo_id')} at {earlier.get('revision')}, not {repo} at "
            f"{revision}; fetch with --overwrite to replace it, or set model.config to another directory"
        )
    if outputs.output_state(output) == "foreign":
        raise UserError(
            f"model.config {output} holds files not fetched by this stage; remove it, or omit model.hub to train "
            "on what is there"
        )
    api = HfApi(endpoint=endpoint, token=token)
    info = calling_hub(repo, revision, lambda: api.model_info(repo, revision=revision, files_metadata=True))
    if info.sha != revision:
        raise UserError(f"Hugging Face model {repo}: revision {revision} resolved to {info.sha}; pin the commit id")
    files = selected_files(remote_files(info), source.include, source.exclude)
    if not files:
        raise UserError(
            f"Hugging Face model {repo} at {revision}: no file matches model.hub.include {list(source.include)}"
        )
    hashes: dict[str, str] = {}
    with outputs.atomic_directory(output, overwrite=overwrite) as partial:
        for count, remote in enumerate(files):

            def download(name: str = remote.path) -> str:
                return str(
                    hf_hub_download(repo, name, revision=revision, local_dir=partial, token=token, endpoint=endpoint)
                )

            calling_hub(repo, revision, download)
            sha256, blob_id = file_hashes(partial / remote.path)
            problem = mismatch(remote, sha256, blob_id)
            if problem is not None:
                raise UserError(f"Hugging Face model {repo}: downloaded {remote.path} has {problem}; run again")
            hashes[remote.path] = sha256
            outputs.kill_point(f"fetched-{count}")
        shutil.rmtree(partial / ".cache", ignore_errors=True)  # huggingface_hub's download bookkeeping
        manifest = {
            "repo_id": repo,
            "revision": info.sha,
            "files": hashes,
            "license": card_license(info),
            "gated": getattr(info, "gated", None) or False,
            "fetched_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "bytes": sum((partial / name).stat().st_size for name in hashes),
        }
        (partial / FETCH_MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        # The project's output record, so `--overwrite` may replace this directory later.
        outputs.write_manifest(partial, {"kind": "fetch", "fingerprint": {"repo_id": repo, "revision": info.sha}})
    print(f"fetched {repo} at {revision}: {len(hashes)} files, {manifest['bytes']:,} bytes, verified")
    return manifest


def copy_to_s3(directory: Path, manifest: dict[str, Any], destination: str) -> str:
    """Upload the fetched directory to `destination` unless a copy of the same fetch is there; the manifest goes up
    last, so a copy with a manifest is complete (an interrupted upload is redone by the next fetch)."""
    import boto3
    from botocore.exceptions import ClientError

    bucket, _, prefix = destination.removeprefix("s3://").partition("/")
    prefix = prefix.strip("/")

    def key(name: str) -> str:
        return f"{prefix}/{name}" if prefix else name

    client = boto3.client("s3")
    try:
        there = json.loads(client.get_object(Bucket=bucket, Key=key(FETCH_MANIFEST))["Body"].read())
    except ClientError as error:
        if error.response.get("Error", {}).get("Code") not in ("NoSuchKey", "404"):
            raise UserError(f"--copy-to {destination}: {error.response['Error'].get('Code')}") from None
        there = None
    except json.JSONDecodeError:
        there = None
    if isinstance(there, dict) and (there.get("repo_id"), there.get("revision")) == (
        manifest["repo_id"],
        manifest["revision"],
    ):
        print(f"{destination} holds the same fetch already; nothing uploaded")
        return destination
    client.delete_object(Bucket=bucket, Key=key(FETCH_MANIFEST))
    for name in sorted(manifest["files"]):
        client.upload_file(str(directory / name), bucket, key(name))
    client.upload_file(str(directory / FETCH_MANIFEST), bucket, key(FETCH_MANIFEST))
    print(f"copied {len(manifest['files'])} files to {destination}")
    return destination


def copy_destination(model_dir: Path, models_dir: str | None, models_uri: str | None) -> str | None:
    """Where in S3 a model directory under the site's models_dir lives (models_uri + its relative path); None when
    the site has no such pair or the directory lies elsewhere."""
    if not models_dir or not models_uri:
        return None
    try:
        relative = model_dir.absolute().relative_to(Path(models_dir).absolute())
    except ValueError:
        return None
    if not relative.parts:
        return None
    return f"{models_uri.rstrip('/')}/{relative.as_posix()}"


def check_hub_repo(flag: str, value: str) -> None:
    if re.fullmatch(HUB_REPO_PATTERN, value) is None:
        raise UserError(not_allowed(flag, value, HUB_REPO_ALLOWED))


# --- push -----------------------------------------------------------------------------------------------------


def gate_refusal(run_dir: Path) -> str | None:
    """Why the run's model must not be published (training.pipeline.evaluate.publish_blocker: a failed gate, or an
    evaluate stage of its recipe that did not finish); None to push, with a warning when no evaluation ran."""
    from training.pipeline.evaluate import EVALUATION_JSON, publish_blocker

    evaluated = _recipe_evaluates(run_dir)
    problem = publish_blocker(run_dir, evaluated=evaluated)
    if problem is not None:
        return f"run {run_dir.name} is not pushed: {problem}; pass --push-despite-gate to push anyway"
    if not (run_dir / EVALUATION_JSON).is_file():
        log.warning(f"{run_dir / EVALUATION_JSON}: no evaluation ran; pushing the model without a gate")
    return None


def _recipe_evaluates(run_dir: Path) -> bool:
    """Whether the run's recipe (`recipe.yaml`, what every job read) has an evaluate stage."""
    recipe = run_dir / "recipe.yaml"
    if not recipe.is_file():
        return False
    return load_recipe(str(recipe)).evaluate is not None


def push_model(
    run_dir: Path, repo: str, *, token: str | None, private: bool = True, despite_gate: bool = False
) -> dict[str, Any]:
    """Create `repo` (private unless told) if it is missing and commit the run's `hf/` directory to it."""
    from huggingface_hub import HfApi

    folder = run_dir / "hf"
    if not folder.is_dir() or not any(folder.iterdir()):
        raise UserError(f"--run-dir {run_dir}: no hf/ model to push (the convert-out stage writes it)")
    problem = None if despite_gate else gate_refusal(run_dir)
    if problem is not None:
        raise UserError(problem)
    api = HfApi(endpoint=hub_endpoint(), token=token)
    calling_hub(repo, None, lambda: api.create_repo(repo, private=private, exist_ok=True), writing=True)
    commit = calling_hub(
        repo,
        None,
        lambda: api.upload_folder(
            repo_id=repo, folder_path=folder, commit_message=f"Trained model of run {run_dir.name}"
        ),
        writing=True,
    )
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    summary = {"pushed_to": repo, "private": private, "commit": getattr(commit, "oid", None), "files": len(files)}
    print(json.dumps(summary))
    return summary
