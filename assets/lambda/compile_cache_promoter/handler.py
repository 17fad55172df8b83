"""Compile cache promoter: a staged Neuron compile cache becomes the promoted one of its key.

Invoked by the compile stage (`python -m training compile-cache save`, on a Trainium node) with
{"bucket": B, "staging": "<prefix>/staging/<key>/<run id>"} once the node has uploaded the cache's files and then
their manifest there. Nodes may write only `staging/`; this function's role is the only principal the bucket lets
write `<prefix>/promoted/` (stacks/compile_cache.py), which every later compile stage restores from: nodes never
write what nodes execute.

It refuses (answers {"status": "refused", "problems": [...]}, copies nothing) a request for another bucket or
another prefix, a manifest that is not a compile cache's of that key, a path outside a cache entry
(`neuronxcc-*/MODULE_*/...`), and any staged object whose size or SHA-256 is not the manifest's: S3's own
ChecksumSHA256 (the node uploads each file with it, S3 checks it on receipt) when the object has a full-object one,
else the object read and hashed here. Each object is then copied at the version it checked (a node writing the
staged key again in between cannot change what is promoted), with a new SHA-256 checksum. The promoted manifest is
deleted first and written last, so a reader that finds one finds exactly the objects it lists; objects of an earlier
promotion that this one lacks are deleted after it.

Only the standard library and boto3 (the Lambda Python runtime's).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

import boto3
from botocore.exceptions import ClientError

LOGGER = logging.getLogger()
LOGGER.setLevel(logging.INFO)
MANIFEST = "manifest.json"
KIND = "neuron-compile-cache"
KEY = r"[0-9a-f]{64}"
RUN_ID = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
ENTRY = re.compile(r"\Aneuronxcc-[A-Za-z0-9.+_-]+/MODULE_[A-Za-z0-9+_.-]+\Z")
SHA256_HEX = re.compile(r"\A[0-9a-f]{64}\Z")
CHUNK = 8 << 20


class Refusal(Exception):
    """A request this function does not carry out, with why."""


def handler(event: Mapping[str, Any], context: Any, client: Any = None) -> dict[str, Any]:
    client = client or boto3.client("s3")
    try:
        bucket, key, staging = staging_of(event, os.environ["BUCKET"], os.environ["PREFIX"])
        manifest = read_json(client, bucket, f"{staging}/{MANIFEST}")
        problems = manifest_problems(manifest, key)
        if problems:
            raise Refusal(f"{staging}/{MANIFEST}: " + "; ".join(problems))
        versions = {
            name: checked_version(client, bucket, f"{staging}/{name}", entry)
            for name, entry in sorted(manifest["files"].items())
        }
    except Refusal as refusal:
        LOGGER.error("refused: %s", refusal)
        return {"status": "refused", "problems": [str(refusal)]}
    promoted = f"{os.environ['PREFIX'].strip('/')}/promoted/{key}"
    client.delete_object(Bucket=bucket, Key=f"{promoted}/{MANIFEST}")  # incomplete until the new one is written
    for name, version in versions.items():
        source = {"Bucket": bucket, "Key": f"{staging}/{name}", **({"VersionId": version} if version else {})}
        client.copy(source, bucket, f"{promoted}/{name}", ExtraArgs={"ChecksumAlgorithm": "SHA256"})
    body = (json.dumps({**manifest, "promoted_from": staging}, indent=2, sort_keys=True) + "\n").encode()
    client.put_object(
        Bucket=bucket,
        Key=f"{promoted}/{MANIFEST}",
        Body=body,
        ContentType="application/json",
        ChecksumSHA256=base64.b64encode(hashlib.sha256(body).digest()).decode(),
    )
    wanted = {f"{promoted}/{name}" for name in versions} | {f"{promoted}/{MANIFEST}"}
    stale = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{promoted}/"):
        for old in (item["Key"] for item in page.get("Contents", []) if item["Key"] not in wanted):
            client.delete_object(Bucket=bucket, Key=old)
            stale += 1
    LOGGER.info("promoted %s to %s: %d files, %d stale removed", staging, promoted, len(versions), stale)
    return {"status": "promoted", "promoted": promoted, "files": len(versions), "stale_removed": stale}


def staging_of(event: Mapping[str, Any], bucket: str, prefix: str) -> tuple[str, str, str]:
    """(bucket, key, staging prefix) of a request for this deployment's bucket and staging prefix only."""
    if not isinstance(event, Mapping) or event.get("bucket") != bucket:
        raise Refusal(
            f"not this environment's bucket: {event.get('bucket') if isinstance(event, Mapping) else event!r}"
        )
    staging = str(event.get("staging") or "").strip("/")
    match = re.fullmatch(rf"{re.escape(prefix.strip('/'))}/staging/({KEY})/{RUN_ID}", staging)
    if match is None:
        raise Refusal(f"staging {staging!r} is not {prefix.strip('/')}/staging/<key>/<run id>")
    return bucket, match.group(1), staging


def read_json(client: Any, bucket: str, key: str) -> Any:
    try:
        body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as error:
        raise Refusal(f"{key}: {error.response.get('Error', {}).get('Code')}") from None
    try:
        return json.loads(body)
    except ValueError:
        raise Refusal(f"{key}: not JSON") from None


def manifest_problems(manifest: Any, key: str) -> list[str]:
    """The rules of training.pipeline.compile_cache.manifest_problems (this function ships alone)."""
    if not isinstance(manifest, dict) or manifest.get("kind") != KIND:
        return [f"not a {KIND} manifest"]
    if manifest.get("key") != key:
        return [f"its key {manifest.get('key')!r} is not {key}"]
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return ["no files"]
    problems = []
    for name, entry in files.items():
        parts = name.split("/")
        if (
            name.startswith("/")
            or ".." in parts
            or "" in parts
            or len(parts) < 3
            or not ENTRY.fullmatch("/".join(parts[:2]))
        ):
            problems.append(f"{name!r}: not a file of a cache entry (neuronxcc-*/MODULE_*/...)")
        elif not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or entry["size"] < 0:
            problems.append(f"{name}: no size")
        elif not isinstance(entry.get("sha256"), str) or not SHA256_HEX.fullmatch(entry["sha256"]):
            problems.append(f"{name}: no SHA-256")
    return problems


def checked_version(client: Any, bucket: str, key: str, entry: Mapping[str, Any]) -> str | None:
    """The version of the staged object whose size and SHA-256 are the manifest's (None: the bucket keeps no
    versions); a Refusal otherwise."""
    try:
        head = client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    except ClientError as error:
        raise Refusal(f"{key}: {error.response.get('Error', {}).get('Code')}") from None
    version = head.get("VersionId") if head.get("VersionId") not in (None, "null") else None
    if head["ContentLength"] != entry["size"]:
        raise Refusal(f"{key}: {head['ContentLength']} bytes, the manifest's {entry['size']}")
    checksum = head.get("ChecksumSHA256")
    if checksum and "-" not in checksum and head.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT":
        found = base64.b64decode(checksum).hex()
    else:  # uploaded in parts (a checksum of the parts) or without one: read it
        digest = hashlib.sha256()
        body = client.get_object(Bucket=bucket, Key=key, **({"VersionId": version} if version else {}))["Body"]
        while chunk := body.read(CHUNK):
            digest.update(chunk)
        found = digest.hexdigest()
    if found != entry["sha256"]:
        raise Refusal(f"{key}: SHA-256 {found}, the manifest's {entry['sha256']}")
    return version
