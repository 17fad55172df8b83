"""Typed environment configuration, loaded from `environments/<name>.yaml` and validated before synth.

Every fact about an environment is typed once here; the stacks and the ParallelCluster configuration read
it from these objects and never from raw dicts. Validation collects every problem and reports each as one
line naming the file, the key, the bad value and what is allowed, so a reviewer fixes them in one pass.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml

from stacks.instance_types import COMPUTE_INSTANCE_TYPES

# Pinned once: the custom-resource provider template, the offline validator in the tests and the docs
# all follow this version.
PARALLELCLUSTER_VERSION = "3.16.1"

# Image.Os values that ParallelCluster 3.16 accepts, and the subset the Neuron bootstrap supports.
PARALLELCLUSTER_OPERATING_SYSTEMS = (
    "alinux2023",
    "ubuntu2204",
    "ubuntu2404",
    "rhel8",
    "rocky8",
    "rhel9",
    "rocky9",
)
NEURON_OPERATING_SYSTEMS = ("ubuntu2204", "ubuntu2404")

CLUSTER_NAME_PATTERN = re.compile(r"^[a-zA-Z][a-zA-Z0-9-]{0,59}$")
REGION_PATTERN = re.compile(r"^[a-z]{2}(-gov)?-[a-z]+-\d+$")
ENVIRONMENT_NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{0,30}$")
SCRATCH_2_SMALL_CAPACITY_GIB = 1200
SCRATCH_2_CAPACITY_STEP_GIB = 2400
CLOUDWATCH_RETENTION_DAYS = (
    1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653,
)  # fmt: skip
CAPACITY_TYPES = ("ONDEMAND", "SPOT", "CAPACITY_BLOCK")


class ConfigError(Exception):
    """One or more problems in an environment file; `str()` is the message shown to the user."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class NetworkConfig:
    vpc_cidr: str = "10.0.0.0/16"
    # Off by default: the head node is reached through SSM Session Manager.
    ssh_key_name: str | None = None


@dataclass(frozen=True)
class HeadNodeConfig:
    instance_type: str = "r6a.12xlarge"
    root_volume_gib: int = 1024


@dataclass(frozen=True)
class ComputeConfig:
    instance_type: str = "trn1.32xlarge"
    queue_name: str = "compute1"
    min_count: int = 0
    max_count: int = 4
    efa: bool = True
    # None means "follow efa": ParallelCluster needs the setting explicit when EFA is on.
    placement_group: bool | None = None
    capacity_type: Literal["ONDEMAND", "SPOT", "CAPACITY_BLOCK"] = "ONDEMAND"
    root_volume_gib: int = 1024
    scaledown_idle_minutes: int = 10

    @property
    def placement_group_enabled(self) -> bool:
        return self.efa if self.placement_group is None else self.placement_group


@dataclass(frozen=True)
class StorageConfig:
    fsx_capacity_gib: int = 1200
    mount_dir: str = "/fsx"
    # S3 prefix of the results bucket that FSx imports from and exports to.
    fsx_s3_prefix: str = "fsx"


@dataclass(frozen=True)
class LoggingConfig:
    retention_days: int = 14


@dataclass(frozen=True)
class PipelineConfig:
    """What `cdk deploy` starts on the cluster once it exists (a bundled recipe of training/train/recipes/)."""

    # Off by default: the recipe's Hugging Face model must first be uploaded to s3://<bucket>/fsx/models/.
    start_run: bool = False
    recipe: str = "llama31-8b-cpt"
    overrides: tuple[str, ...] = ()  # recipe key=value overrides, e.g. "steps=100"
    timeout_minutes: int = 30  # bound on any wait of the deploy/destroy hooks (below CloudFormation's hour)


@dataclass(frozen=True)
class EnvironmentConfig:
    """One deployable environment: everything `cdk deploy -c env=NAME` needs."""

    name: str
    region: str
    availability_zone: str
    cluster_name: str
    os: str = "ubuntu2204"
    network: NetworkConfig = field(default_factory=NetworkConfig)
    head_node: HeadNodeConfig = field(default_factory=HeadNodeConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    tags: dict[str, str] = field(default_factory=dict)

    @property
    def stack_name(self) -> str:
        return f"trainium-{self.name}"


def load_environment(name: str, directory: Path) -> EnvironmentConfig:
    """Read, type-check and validate `directory/<name>.yaml`; raise ConfigError listing every problem."""
    if not ENVIRONMENT_NAME_PATTERN.match(name):
        raise ConfigError(
            [f"-c env={name!r} is not a valid environment name; allowed: lowercase letters, digits and '-'"]
        )
    path = directory / f"{name}.yaml"
    label = _display_path(path)
    if not path.is_file():
        available = ", ".join(sorted(p.stem for p in directory.glob("*.yaml"))) or "none"
        raise ConfigError([f"{label}: no such environment file; available environments: {available}"])
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise ConfigError([f"{label}: not valid YAML: {error}"]) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError([f"{label}: top level must be a mapping of keys, got {type(raw).__name__}"])
    if "name" in raw:
        raise ConfigError([f"{label}: name: the environment name comes from the file name; remove the key"])
    problems: list[str] = []
    config: EnvironmentConfig = _build(EnvironmentConfig, {"name": name, **raw}, "", problems)
    if problems:
        raise ConfigError([f"{label}: {problem}" for problem in problems])
    problems = validate(config)
    if problems:
        raise ConfigError([f"{label}: {problem}" for problem in problems])
    return config


def validate(config: EnvironmentConfig) -> list[str]:
    """Semantic rules that types alone cannot express; one line per violation, 'key: value ...; allowed ...'."""
    problems: list[str] = []

    def bad(key: str, value: Any, allowed: str) -> None:
        problems.append(f"{key}: {value!r} is not allowed; {allowed}")

    if not REGION_PATTERN.match(config.region):
        bad("region", config.region, "allowed: an AWS region code such as 'us-west-2'")
    if not re.fullmatch(re.escape(config.region) + r"[a-z]", config.availability_zone):
        bad(
            "availability_zone",
            config.availability_zone,
            f"allowed: a zone of {config.region}, e.g. '{config.region}d'",
        )
    if not CLUSTER_NAME_PATTERN.match(config.cluster_name):
        bad(
            "cluster_name",
            config.cluster_name,
            "allowed: a letter followed by up to 59 letters, digits or '-' (ParallelCluster's rule)",
        )
    elif config.cluster_name == config.stack_name:
        bad("cluster_name", config.cluster_name, f"allowed: any name other than the stack name {config.stack_name!r}")
    if config.os not in PARALLELCLUSTER_OPERATING_SYSTEMS:
        bad("os", config.os, f"allowed: {', '.join(NEURON_OPERATING_SYSTEMS)} (ParallelCluster rejects it)")
    elif config.os not in NEURON_OPERATING_SYSTEMS:
        bad(
            "os",
            config.os,
            f"allowed: {', '.join(NEURON_OPERATING_SYSTEMS)} (the Neuron bootstrap supports only these)",
        )
    if config.network.ssh_key_name == "":
        bad("network.ssh_key_name", "", "allowed: an EC2 key pair name, or omit the key to use SSM only")

    _validate_compute(config.compute, bad)
    _validate_volumes(config, bad)

    capacity = config.storage.fsx_capacity_gib
    if capacity != SCRATCH_2_SMALL_CAPACITY_GIB and (capacity <= 0 or capacity % SCRATCH_2_CAPACITY_STEP_GIB):
        bad("storage.fsx_capacity_gib", capacity, "allowed for SCRATCH_2: 1200 or a multiple of 2400 (2400, 4800, ...)")
    if not re.fullmatch(r"/[A-Za-z0-9_./-]+", config.storage.mount_dir) or config.storage.mount_dir == "/":
        bad("storage.mount_dir", config.storage.mount_dir, "allowed: an absolute directory path such as '/fsx'")
    if not re.fullmatch(r"[a-z0-9][a-z0-9_/-]*[a-z0-9]", config.storage.fsx_s3_prefix):
        bad("storage.fsx_s3_prefix", config.storage.fsx_s3_prefix, "allowed: an S3 key prefix such as 'fsx'")
    if config.logging.retention_days not in CLOUDWATCH_RETENTION_DAYS:
        bad(
            "logging.retention_days",
            config.logging.retention_days,
            f"allowed: one of {list(CLOUDWATCH_RETENTION_DAYS)}",
        )
    for key, value in config.tags.items():
        if key.lower().startswith("aws:") or not 1 <= len(key) <= 128 or len(value) > 256:
            bad(f"tags.{key}", value, "allowed: keys of 1-128 characters not starting with 'aws:', values up to 256")
    _validate_pipeline(config.pipeline, bad)
    return problems


RECIPES_DIR = Path(__file__).resolve().parent.parent / "training" / "train" / "recipes"


def _validate_pipeline(pipeline: PipelineConfig, bad: typing.Callable[[str, Any, str], None]) -> None:
    bundled = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml") if not p.stem.startswith("tiny-"))
    if pipeline.recipe not in bundled:
        bad("pipeline.recipe", pipeline.recipe, f"allowed: a bundled recipe ({', '.join(bundled)})")
    for override in pipeline.overrides:
        if "=" not in override or override.startswith("="):
            bad("pipeline.overrides", override, "allowed: recipe overrides as 'section.key=value'")
    if not 1 <= pipeline.timeout_minutes <= 55:
        bad("pipeline.timeout_minutes", pipeline.timeout_minutes, "allowed: 1 to 55 (CloudFormation waits an hour)")


def _validate_compute(compute: ComputeConfig, bad: typing.Callable[[str, Any, str], None]) -> None:
    facts = COMPUTE_INSTANCE_TYPES.get(compute.instance_type)
    if facts is None:
        bad("compute.instance_type", compute.instance_type, f"allowed: {', '.join(COMPUTE_INSTANCE_TYPES)}")
    if compute.min_count < 0:
        bad("compute.min_count", compute.min_count, "allowed: 0 (scale to zero) or more")
    if compute.max_count < 1:
        bad("compute.max_count", compute.max_count, "allowed: 1 or more")
    elif compute.min_count > compute.max_count:
        bad("compute.min_count", compute.min_count, f"allowed: at most compute.max_count ({compute.max_count})")
    if compute.scaledown_idle_minutes < 1:
        bad("compute.scaledown_idle_minutes", compute.scaledown_idle_minutes, "allowed: 1 or more minutes")
    if not re.fullmatch(r"[a-z][a-z0-9-]{0,29}", compute.queue_name):
        bad(
            "compute.queue_name",
            compute.queue_name,
            "allowed: a lowercase letter then up to 29 lowercase letters, digits or '-'",
        )
    if facts is None:
        return
    if compute.efa and not facts.efa:
        efa_types = ", ".join(name for name, f in COMPUTE_INSTANCE_TYPES.items() if f.efa)
        bad(
            "compute.efa",
            True,
            f"allowed: false for {compute.instance_type}, which has no EFA (EFA types: {efa_types})",
        )
    elif compute.max_count > 1 and not compute.efa:
        if facts.efa:
            allowed = f"allowed: efa: true for multi-node training on {compute.instance_type}, or max_count 1"
        else:
            allowed = f"allowed: 1, since {compute.instance_type} has no EFA for multi-node training"
        bad("compute.max_count", compute.max_count, allowed)
    if compute.placement_group is False and compute.efa:
        bad(
            "compute.placement_group",
            False,
            "allowed: true (or omit) when EFA is on; EFA nodes belong in one placement group",
        )


def _validate_volumes(config: EnvironmentConfig, bad: typing.Callable[[str, Any, str], None]) -> None:
    for key, size in (
        ("head_node.root_volume_gib", config.head_node.root_volume_gib),
        ("compute.root_volume_gib", config.compute.root_volume_gib),
    ):
        if not 40 <= size <= 16384:
            bad(key, size, "allowed: 40 to 16384 GiB (Neuron recommends at least 512 on compute nodes)")


def _display_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _build(cls: type, raw: Any, prefix: str, problems: list[str]) -> Any:
    """Turn a YAML mapping into the frozen dataclass `cls`, reporting unknown keys and wrong types."""
    if not isinstance(raw, dict):
        problems.append(f"{prefix or 'top level'}: expected a mapping, got {raw!r}")
        return None
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    allowed = ", ".join(name for name in fields if name != "name")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        path = f"{prefix}{key}"
        if key not in fields:
            problems.append(f"{path}: unknown key; allowed keys here: {allowed}")
            continue
        values[key] = _coerce(hints[key], value, path, problems)
    for name, spec in fields.items():
        if name not in values and spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            problems.append(f"{prefix}{name}: required key is missing")
    if problems:
        return None
    return cls(**values)


def _coerce(hint: Any, value: Any, path: str, problems: list[str]) -> Any:
    origin = get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        options = get_args(hint)
        if value is None and type(None) in options:
            return None
        (hint,) = [option for option in options if option is not type(None)]
        origin = get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _build(typing.cast(type, hint), value, f"{path}.", problems)
    if origin is Literal:
        choices = get_args(hint)
        if value not in choices:
            problems.append(f"{path}: {value!r} is not allowed; allowed: {', '.join(map(str, choices))}")
        return value
    if origin is tuple:
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            problems.append(f"{path}: {value!r} is not allowed; allowed: a list of strings")
            return value
        return tuple(value)
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            problems.append(f"{path}: {value!r} is not allowed; allowed: a mapping of strings to strings")
        return value
    expected = {int: "an integer", bool: "true or false", str: "a string"}[hint]
    # bool is a subclass of int in Python; YAML `yes` must not pass as a count.
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        problems.append(f"{path}: {value!r} is not allowed; allowed: {expected}")
    return value
