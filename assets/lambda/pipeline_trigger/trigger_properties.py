"""The pipeline trigger's resource properties, checked once, and what follows from them alone: the run id
and where things live on the shared file system."""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
SAFE_PATH = re.compile(r"^/[A-Za-z0-9._/-]*$")
# The shipped source's locked requirement sets (one per node software set), relative to the source's root.
REQUIREMENTS_IN_SOURCE = re.compile(r"assets/node/[A-Za-z0-9_-]+-requirements\.txt")
DEFAULT_REQUIREMENTS = "assets/node/cluster-requirements.txt"


@dataclass(frozen=True)
class Props:
    """The resource properties, checked once so that a misconfiguration fails at once with its name."""

    head_node: str
    cluster: str
    start_run: bool
    run: str
    recipe: str
    overrides: tuple[str, ...]
    source_bucket: str
    source_key: str
    source_hash: str
    site: dict[str, Any]
    export_optimizer_state: bool  # on destroy, export training checkpoints' optimizer state too
    shared_env: str | None  # the environment to bring up to date before submitting; None: left as it is
    neuron_release: str | None
    requirements: str  # the shared environment's locked requirement set, a path in the shipped source
    file_system_id: str
    mount_dir: str
    output_bucket: str
    output_prefix: str
    timeout: int
    environment: str
    notice_topic: str  # the alarm topic: a run that cannot start is a notice there; empty: none


def parse_bool(value: Any, name: str) -> bool:
    """CloudFormation passes booleans as the strings "true" / "false"."""
    text = str(value).strip().lower()
    if text not in ("true", "false"):
        raise ValueError(f"property {name} must be 'true' or 'false', got {value!r}")
    return text == "true"


def start_run(raw: Mapping[str, Any]) -> bool:
    return parse_bool(raw.get("StartRun", "false"), "StartRun")


def parse_properties(raw: Mapping[str, Any]) -> Props:
    """Every property the run needs, validated; raises ValueError naming the first bad one."""

    def text(name: str, *, allow_empty: bool = False) -> str:
        value = raw.get(name)
        if value is None or not isinstance(value, str) or (not value and not allow_empty):
            raise ValueError(f"property {name} is missing or not a non-empty string (got {value!r})")
        return value

    overrides_raw = raw.get("RecipeOverrides") or []
    if isinstance(overrides_raw, str):
        overrides_raw = [overrides_raw]
    overrides = tuple(str(item) for item in overrides_raw)
    for override in overrides:
        key, separator, _ = override.partition("=")
        if not separator or not key or key.startswith("-"):
            raise ValueError(f"property RecipeOverrides: {override!r} is not key=value (e.g. steps=100)")
    try:
        site = json.loads(text("SiteSettings"))
    except json.JSONDecodeError as error:
        raise ValueError(f"property SiteSettings is not JSON ({error})") from None
    if not isinstance(site, dict):
        raise ValueError("property SiteSettings must be a JSON object (the --site settings)")
    for key in ("runs_root", "python", "slurm_bin"):
        if key == "slurm_bin" and site.get(key) is None:
            continue  # Slurm on PATH (a site without a prefix)
        if not isinstance(site.get(key), str) or not SAFE_PATH.match(site[key]):
            raise ValueError(f"property SiteSettings.{key} must be an absolute path, got {site.get(key)!r}")
    mount_dir = text("FileSystemMountDir").rstrip("/") or "/"
    if not SAFE_PATH.match(mount_dir):
        raise ValueError(f"property FileSystemMountDir must be an absolute path, got {mount_dir!r}")
    source_hash = text("SourceHash")
    if not SAFE_NAME.match(source_hash):
        raise ValueError(f"property SourceHash must be letters, digits, '.', '_' or '-', got {source_hash!r}")
    try:
        timeout = int(text("TimeoutSeconds"))
    except ValueError:
        raise ValueError(
            f"property TimeoutSeconds must be a number of seconds, got {raw.get('TimeoutSeconds')!r}"
        ) from None
    if timeout < 60:
        raise ValueError(f"property TimeoutSeconds must be at least 60, got {timeout}")
    run = text("Run")
    if not SAFE_NAME.match(run):
        raise ValueError(f"property Run must be letters, digits, '.', '_' or '-', got {run!r}")
    shared_env, neuron_release = raw.get("SharedEnvironmentPath"), raw.get("NeuronRelease")
    if (shared_env is None) != (neuron_release is None):
        raise ValueError("properties SharedEnvironmentPath and NeuronRelease go together: give both or neither")
    if shared_env is not None and (not isinstance(shared_env, str) or not SAFE_PATH.match(shared_env)):
        raise ValueError(f"property SharedEnvironmentPath must be an absolute path, got {shared_env!r}")
    if neuron_release is not None and not re.fullmatch(r"\d+\.\d+\.\d+", str(neuron_release)):
        raise ValueError(f"property NeuronRelease must look like 2.28.1, got {neuron_release!r}")
    requirements = raw.get("RequirementsInSource", DEFAULT_REQUIREMENTS)
    if not isinstance(requirements, str) or not REQUIREMENTS_IN_SOURCE.fullmatch(requirements):
        raise ValueError(
            "property RequirementsInSource must name a locked requirement set of the source, such as "
            f"{DEFAULT_REQUIREMENTS}, got {requirements!r}"
        )
    return Props(
        head_node=text("HeadNodeInstanceId"),
        cluster=text("ClusterName"),
        start_run=start_run(raw),
        run=run,
        recipe=text("Recipe"),
        overrides=overrides,
        source_bucket=text("SourceBucket"),
        source_key=text("SourceKey"),
        source_hash=source_hash,
        site=site,
        export_optimizer_state=parse_bool(raw.get("ExportOptimizerState", "false"), "ExportOptimizerState"),
        shared_env=shared_env,
        neuron_release=None if neuron_release is None else str(neuron_release),
        requirements=requirements,
        file_system_id=text("FileSystemId"),
        mount_dir=mount_dir,
        output_bucket=text("OutputBucket"),
        output_prefix=text("OutputPrefix", allow_empty=True).strip("/"),
        timeout=timeout,
        environment=text("EnvironmentName"),
        notice_topic=str(raw.get("NoticeTopicArn") or ""),
    )


def derive_run_id(environment: str, recipe: str, overrides: Sequence[str], run: str) -> str:
    """`<env>-<recipe>-<sha256 of [run, recipe, overrides]>[:10]`: the same run settings, the same run.

    Sanitised to what `python -m training submit --run-id` accepts (letters, digits, '.', '_', '-', at
    most 64, starting with a letter or digit); the prefix is shortened, never the digest.
    """
    digest = hashlib.sha256(json.dumps([run, recipe, list(overrides)]).encode()).hexdigest()[:10]
    prefix = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{environment}-{recipe}").lstrip("._-")[:53].rstrip("._-")
    return f"{prefix or 'run'}-{digest}"


def safe_name(text: str) -> str:
    """A file name part from free text: runs of other characters become '-'."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "default"


def run_id_of(props: Props) -> str:
    return derive_run_id(props.environment, props.recipe, props.overrides, props.run)


@dataclass(frozen=True)
class Paths:
    """Where things live on the shared file system (seen alike by the head node and the compute nodes)."""

    source_dir: str  # the unzipped source of one SourceHash: immutable once there
    current: str  # symlink to the newest submitted source_dir: the nodes' monitoring services run the code there
    site_file: str
    runs_root: str
    export_path: str | None  # runs_root relative to the mount (FSx export task Paths); None: outside it


def paths_of(props: Props) -> Paths:
    runs_root = posixpath.normpath(props.site["runs_root"])
    mount = posixpath.normpath(props.mount_dir)
    inside = runs_root != mount and runs_root.startswith(mount.rstrip("/") + "/")
    return Paths(
        source_dir=f"{mount.rstrip('/')}/pipeline/source-{props.source_hash}",
        current=f"{mount.rstrip('/')}/pipeline/current",
        site_file=posixpath.join(posixpath.dirname(runs_root), "pipeline", f"site-{safe_name(props.environment)}.yaml"),
        runs_root=runs_root,
        export_path=posixpath.relpath(runs_root, mount) if inside else None,
    )
