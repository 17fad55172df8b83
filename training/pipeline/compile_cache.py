"""`python -m training compile-cache save|restore --run-dir R`: the Neuron compile cache outlives the environment.

The compile stage's graphs land in the site's `compile_cache` (the Neuron persistent cache on the shared file
system, `--cache_dir` in NEURON_CC_FLAGS), which `cdk destroy` deletes with the file system. Its layout is the
compiler's: `neuronxcc-<compiler version>/MODULE_<graph hash>+<flags hash>/` holding `model.neff`,
`model.hlo_module.pb`, `compile_flags.json` and `model.done`; the compiler's wrapper finds a graph there by the hash
of the graph and the compiler flags, so a restored entry is used exactly when it is the same graph (AWS Neuron docs,
"Neuron Persistent Cache").

The results bucket keeps copies by a key of what decides the graphs (`cache_key`): the Neuron packages' versions,
the recipe's graph-relevant settings, the model's configuration, the processes and the instance type. Under the
site's `compile_cache_store` (s3://bucket/compile-cache):

- `save` (after the compile stage succeeded) uploads every complete entry of the cache to
  `staging/<key>/<run id>/`, each object with its SHA-256 (S3 verifies it on receipt and keeps it), `manifest.json`
  last (every file's relative path, size and SHA-256), then asks the deployment's promoter function to promote it.
- The promoter (assets/lambda/compile_cache_promoter, the only role that may write `promoted/`) checks every staged
  object against the manifest and copies them to `promoted/<key>/`, its manifest last. Nodes write only staging:
  they never write what later runs' nodes execute.
- `restore` (before the compile stage) reads `promoted/<key>/manifest.json`, downloads each entry the cache lacks,
  checks every file's SHA-256 and moves the entry into place, `model.done` last. An entry with a file whose hash
  differs is refused, loudly, and left for the compiler to build again; no promoted entry: the compile starts cold.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Any

from training import outputs
from training.config.loading import StrictModel
from training.config.recipe import Recipe, load_recipe
from training.errors import UserError
from training.pipeline.hub import file_hashes

MANIFEST_KIND = "neuron-compile-cache"
STAGING = "staging"
PROMOTED = "promoted"
DONE = "model.done"  # the compiler's mark of a finished entry
NEFF = "model.neff"
# The packages whose versions decide the graphs: the compiler, and what traces the model into HLO.
GRAPH_PACKAGES = ("neuronx-cc", "torch-neuronx", "neuronx-distributed", "torch-xla", "torch")
SINGLE_PUT_LIMIT = 5 * 1024**3  # S3's largest single PUT; larger files go up in parts
SHA256_HEX = re.compile(r"\A[0-9a-f]{64}\Z")
# A cache entry's directory: neuronxcc-<version>/MODULE_<hashes> (anything else in the cache is not an entry).
ENTRY = re.compile(r"\Aneuronxcc-[A-Za-z0-9.+_-]+/MODULE_[A-Za-z0-9+_.-]+\Z")


# --- the key: what decides the graphs (pure) ----------------------------------------------------------------


def graph_settings(recipe: Recipe) -> dict[str, Any]:
    """The run's resolved recipe's settings that change the compiled graphs, spelt as run.json records them.

    In: the model's layout and the parallel plan (tp, pp, kv multiplier, fused QKV, sequence parallel), memory
    (activation checkpointing, flash attention), MoE capacity, precision, backend, nodes, the batch's shape (global,
    micro, seq_len: the accumulation count and the tensors' shapes) and the optimizer's hyperparameters other than
    the learning rate (Neuron's docs list optimizer hyperparameters among what changes a graph; betas, eps, weight
    decay and the clip are Python constants of the step), and the compiler flags (part of the cache's own hash).
    Out: the learning rate and its schedule (a device tensor overwritten each step, training.train.optimizer),
    steps (the compile run takes two whatever the run's length), seeds, data paths and checkpoints (the compile run
    saves nothing), the runtime's in-flight requests and retry_failed_compilation (neither changes a graph)."""

    def spelt(section: StrictModel, **leave_out: Any) -> dict[str, Any]:
        return section.model_dump(mode="json", by_alias=True, **leave_out)

    return {
        "backend": recipe.backend,
        "precision": recipe.precision,
        "nodes": recipe.nodes,
        "batch": spelt(recipe.batch),
        "parallelism": spelt(recipe.parallelism),
        "memory": spelt(recipe.memory),
        "moe": spelt(recipe.moe),
        "optimizer": spelt(recipe.optimizer, exclude={"lr"}),
        "compiler_flags": list(recipe.neuron.compiler_flags),
    }


def key_inputs(
    recipe: Recipe,
    model_config: dict[str, Any] | None,
    *,
    instance_type: str | None,
    processes_per_node: int,
    versions: dict[str, str | None],
) -> dict[str, Any]:
    """Everything the key is made of, recorded in each manifest so a reader sees why two keys differ."""
    return {
        "packages": {name: versions.get(name) for name in GRAPH_PACKAGES},
        "instance_type": instance_type,
        "processes_per_node": processes_per_node,
        "model_config": model_config,
        "recipe": graph_settings(recipe),
    }


def cache_key(inputs: dict[str, Any]) -> str:
    """SHA-256 of the inputs' canonical JSON (sorted keys, no spaces): equal inputs, equal key."""
    canonical = json.dumps(inputs, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def installed_versions() -> dict[str, str | None]:
    """The installed versions of the graph packages; None for one that is not installed (a machine without the
    Neuron SDK: its key never matches a Neuron node's)."""
    versions: dict[str, str | None] = {}
    for name in GRAPH_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


# --- the cache's files and the manifest (pure but for reading files) ------------------------------------------


def complete_entries(cache_dir: Path) -> list[PurePosixPath]:
    """The cache's finished entries (`neuronxcc-*/MODULE_*` with `model.done` and a non-empty `model.neff`),
    relative to the cache: one being compiled, or left by a killed compile, is not saved."""
    if not cache_dir.is_dir():
        return []
    found = []
    for done in sorted(cache_dir.glob(f"neuronxcc-*/MODULE_*/{DONE}")):
        entry = done.parent
        relative = PurePosixPath(entry.relative_to(cache_dir).as_posix())
        neff = entry / NEFF
        if ENTRY.fullmatch(str(relative)) and neff.is_file() and neff.stat().st_size > 0:
            found.append(relative)
    return found


def entry_files(cache_dir: Path, entries: list[PurePosixPath]) -> list[PurePosixPath]:
    """Every regular file of these entries (a hidden one, a writer's temporary file, left out)."""
    files = []
    for entry in entries:
        for path in sorted((cache_dir / entry).rglob("*")):
            if path.is_file() and not path.is_symlink() and not path.name.startswith("."):
                files.append(PurePosixPath(path.relative_to(cache_dir).as_posix()))
    return files


def build_manifest(
    cache_dir: Path, files: list[PurePosixPath], *, key: str, inputs: dict[str, Any], run_id: str
) -> dict[str, Any]:
    entries: dict[str, dict[str, Any]] = {}
    for relative in files:
        sha256, _ = file_hashes(cache_dir / relative)
        entries[str(relative)] = {"size": (cache_dir / relative).stat().st_size, "sha256": sha256}
    return {
        "kind": MANIFEST_KIND,
        "key": key,
        "key_inputs": inputs,
        "run_id": run_id,
        "files": entries,
        "bytes": sum(entry["size"] for entry in entries.values()),
    }


def manifest_problems(manifest: Any, key: str) -> list[str]:
    """What makes a manifest unusable: another kind or key, a path that is not a file of a cache entry (absolute,
    `..`, outside `neuronxcc-*/MODULE_*/`), a size or hash that is not one."""
    if not isinstance(manifest, dict) or manifest.get("kind") != MANIFEST_KIND:
        return [f"not a {MANIFEST_KIND} manifest"]
    if manifest.get("key") != key:
        return [f"its key {manifest.get('key')!r} is not {key}"]
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return ["no files"]
    problems = []
    for name, entry in files.items():
        path = PurePosixPath(name)
        if path.is_absolute() or ".." in path.parts or len(path.parts) < 3 or not ENTRY.fullmatch(str(entry_of(path))):
            problems.append(f"{name!r}: not a file of a cache entry (neuronxcc-*/MODULE_*/...)")
        elif not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or entry["size"] < 0:
            problems.append(f"{name}: no size")
        elif not isinstance(entry.get("sha256"), str) or not SHA256_HEX.fullmatch(entry["sha256"]):
            problems.append(f"{name}: no SHA-256")
    return problems


def entry_of(path: PurePosixPath) -> PurePosixPath:
    return PurePosixPath(*path.parts[:2])


def missing_entries(cache_dir: Path, manifest: dict[str, Any]) -> dict[PurePosixPath, list[PurePosixPath]]:
    """The manifest's entries the cache does not have finished (no `model.done`), with their files."""
    wanted: dict[PurePosixPath, list[PurePosixPath]] = {}
    for name in sorted(manifest["files"]):
        path = PurePosixPath(name)
        wanted.setdefault(entry_of(path), []).append(path)
    return {entry: files for entry, files in wanted.items() if not (cache_dir / entry / DONE).is_file()}


def sha256_base64(hex_digest: str) -> str:
    """S3's spelling of a SHA-256 (ChecksumSHA256: base64 of the digest's bytes)."""
    return base64.b64encode(bytes.fromhex(hex_digest)).decode()


# --- the run's key ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunCache:
    run_id: str
    cache_dir: Path
    store: str  # s3://bucket/prefix
    promoter: str | None
    key: str
    inputs: dict[str, Any]


def run_cache(run_dir: Path) -> RunCache:
    """The run's cache directory, store and key, from its run record and the installed packages."""
    from training.config.site import Site
    from training.pipeline.plan import processes_per_node
    from training.pipeline.run_record import read_run

    run = read_run(run_dir)
    site = Site.model_validate(run["site"])
    if not site.compile_cache_store:
        raise UserError(f"run {run['run_id']}: its site has no compile_cache_store (where the cache is kept)")
    recipe = load_recipe(str(run_dir / "recipe.yaml"))  # the run's resolved recipe, as run.json records it
    config_file = Path(recipe.model.config) / "config.json"
    model_config = json.loads(config_file.read_text()) if config_file.is_file() else None
    inputs = key_inputs(
        recipe,
        model_config,
        instance_type=site.instance_type,
        processes_per_node=processes_per_node(recipe, site),
        versions=installed_versions(),
    )
    return RunCache(
        run["run_id"],
        Path(site.compile_cache),
        site.compile_cache_store,
        site.compile_cache_promoter,
        cache_key(inputs),
        inputs,
    )


@contextmanager
def aws_errors(what: str) -> Iterator[None]:
    """An AWS refusal (access denied, no such function, throttling beyond botocore's retries) as one line."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except ClientError as error:
        details = error.response.get("Error", {})
        raise UserError(f"{what}: {details.get('Code', 'error')}: {details.get('Message', error)}") from None
    except BotoCoreError as error:
        raise UserError(f"{what}: {error}") from None


def _bucket_prefix(store: str) -> tuple[str, str]:
    bucket, _, prefix = store.removeprefix("s3://").partition("/")
    if not store.startswith("s3://") or not bucket:
        raise UserError(f"compile_cache_store {store!r}: expected s3://bucket/prefix")
    return bucket, prefix.strip("/")


def _join(*parts: str) -> str:
    return "/".join(part.strip("/") for part in parts if part.strip("/"))


# --- save ---------------------------------------------------------------------------------------------------


def save(run_dir: Path, *, client: Any = None, lambda_client: Any = None) -> dict[str, Any]:
    """Upload the cache's finished entries to staging, the manifest last, then ask for their promotion."""
    cache = run_cache(run_dir)
    with aws_errors(f"compile cache save to {cache.store}"):
        return _save(cache, client, lambda_client)


def _save(cache: RunCache, client: Any, lambda_client: Any) -> dict[str, Any]:
    entries = complete_entries(cache.cache_dir)
    files = entry_files(cache.cache_dir, entries)
    manifest = build_manifest(cache.cache_dir, files, key=cache.key, inputs=cache.inputs, run_id=cache.run_id)
    bucket, prefix = _bucket_prefix(cache.store)
    staging = _join(prefix, STAGING, cache.key, cache.run_id)
    result: dict[str, Any] = {"key": cache.key, "entries": len(entries), "files": len(files), "staging": None}
    if not files:
        print(f"compile cache {cache.cache_dir}: no finished entry; nothing saved")
        return result
    if client is None:
        import boto3

        client = boto3.client("s3")
    promoted = _read_manifest(client, bucket, _join(prefix, PROMOTED, cache.key, outputs.MANIFEST))
    if isinstance(promoted, dict) and promoted.get("files") == manifest["files"]:
        print(f"compile cache key {cache.key}: the promoted copy holds these {len(files)} files already; nothing saved")
        return result
    for count, relative in enumerate(files):
        outputs.kill_point(f"uploaded-{count}")
        _upload(client, cache.cache_dir / relative, bucket, _join(staging, str(relative)), manifest, str(relative))
    body = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    client.put_object(
        Bucket=bucket,
        Key=_join(staging, outputs.MANIFEST),
        Body=body,
        ContentType="application/json",
        ChecksumSHA256=sha256_base64(hashlib.sha256(body).hexdigest()),
    )
    print(
        f"compile cache saved: {len(entries)} entries, {len(files)} files, {manifest['bytes']:,} bytes to "
        f"s3://{bucket}/{staging}/ (key {cache.key})"
    )
    result["staging"] = staging
    if cache.promoter:
        result["promotion"] = promote(cache.promoter, bucket, staging, lambda_client=lambda_client)
    else:
        print("compile cache not promoted: the site names no compile_cache_promoter")
    return result


def _upload(client: Any, path: Path, bucket: str, key: str, manifest: dict[str, Any], name: str) -> None:
    """One file, with its SHA-256 for S3 to check and keep (in one PUT up to 5 GiB; in parts beyond, where S3
    keeps a checksum of the parts and the promoter reads the object to check it)."""
    entry = manifest["files"][name]
    if entry["size"] <= SINGLE_PUT_LIMIT:
        with path.open("rb") as body:
            client.put_object(Bucket=bucket, Key=key, Body=body, ChecksumSHA256=sha256_base64(entry["sha256"]))
    else:
        client.upload_file(str(path), bucket, key, ExtraArgs={"ChecksumAlgorithm": "SHA256"})


def promote(function: str, bucket: str, staging: str, *, lambda_client: Any = None) -> dict[str, Any]:
    """Invoke the promoter on the staged copy and wait for its answer; its refusal is an error."""
    if lambda_client is None:
        import boto3
        from botocore.config import Config

        # The promoter copies the whole cache: wait as long as it may run (15 minutes), never retry the call.
        lambda_client = boto3.client(
            "lambda", config=Config(read_timeout=900, retries={"max_attempts": 1, "mode": "standard"})
        )
    response = lambda_client.invoke(
        FunctionName=function,
        InvocationType="RequestResponse",
        Payload=json.dumps({"bucket": bucket, "staging": staging}).encode(),
    )
    answer = json.loads(response["Payload"].read() or b"null")
    if response.get("FunctionError") or not isinstance(answer, dict) or answer.get("status") != "promoted":
        detail = answer.get("errorMessage") if isinstance(answer, dict) else None
        raise UserError(f"compile cache at s3://{bucket}/{staging}/ not promoted: {detail or answer}")
    print(f"compile cache promoted to s3://{bucket}/{answer['promoted']}/ ({answer['files']} files)")
    return answer


# --- restore ------------------------------------------------------------------------------------------------


def restore(run_dir: Path, *, client: Any = None) -> dict[str, Any]:
    """Bring the promoted entries of the run's key into the cache, each checked file by file."""
    cache = run_cache(run_dir)
    with aws_errors(f"compile cache restore from {cache.store}"):
        return _restore(cache, client)


def _restore(cache: RunCache, client: Any) -> dict[str, Any]:
    bucket, prefix = _bucket_prefix(cache.store)
    promoted = _join(prefix, PROMOTED, cache.key)
    if client is None:
        import boto3

        client = boto3.client("s3")
    manifest = _read_manifest(client, bucket, _join(promoted, outputs.MANIFEST))
    if manifest is None:
        print(f"no promoted compile cache for key {cache.key}: the compile starts cold")
        return {"key": cache.key, "restored": 0, "refused": 0, "present": 0}
    problems = manifest_problems(manifest, cache.key)
    if problems:
        print(f"error: s3://{bucket}/{promoted}/{outputs.MANIFEST} refused: {'; '.join(problems)}", file=sys.stderr)
        return {"key": cache.key, "restored": 0, "refused": len(manifest.get("files") or {}), "present": 0}
    missing = missing_entries(cache.cache_dir, manifest)
    present = len({entry_of(PurePosixPath(name)) for name in manifest["files"]}) - len(missing)
    restored = refused = 0
    for entry, files in missing.items():
        if _restore_entry(client, bucket, promoted, cache.cache_dir, entry, files, manifest["files"]):
            restored += 1
        else:
            refused += 1
    print(
        f"compile cache key {cache.key}: {restored} entries restored, {present} present already"
        + (f", {refused} REFUSED (compiled again)" if refused else "")
    )
    return {"key": cache.key, "restored": restored, "refused": refused, "present": present}


def _read_manifest(client: Any, bucket: str, key: str) -> Any:
    from botocore.exceptions import ClientError

    try:
        body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as error:
        if error.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            return None
        raise UserError(f"s3://{bucket}/{key}: {error.response.get('Error', {}).get('Code')}") from None
    try:
        return json.loads(body)
    except ValueError:
        return {"kind": "unreadable"}


def _restore_entry(
    client: Any,
    bucket: str,
    promoted: str,
    cache_dir: Path,
    entry: PurePosixPath,
    files: list[PurePosixPath],
    expected: dict[str, dict[str, Any]],
) -> bool:
    """Download one entry beside the cache, check every file, then move the files into the entry, `model.done`
    last: the compiler never sees a finished entry with a file that is not the promoted one."""
    final = cache_dir / entry
    with outputs.scratch_directory(final) as scratch:
        for relative in files:
            local = scratch / relative.relative_to(entry)
            local.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, _join(promoted, str(relative)), str(local))
            sha256, _ = file_hashes(local)
            if sha256 != expected[str(relative)]["sha256"]:
                print(
                    f"error: compile cache file {relative} REFUSED: its SHA-256 is {sha256}, the manifest's "
                    f"{expected[str(relative)]['sha256']}; entry {entry} is left for the compiler",
                    file=sys.stderr,
                )
                return False
        final.mkdir(parents=True, exist_ok=True)
        for relative in sorted(files, key=lambda path: path.name == DONE):
            target = cache_dir / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(scratch / relative.relative_to(entry), target)
    return True
