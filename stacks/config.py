"""Typed environment configuration, loaded from `environments/<name>.yaml` and validated before synth.

Every fact about an environment is typed once here, on the project's one configuration layer
(`training.config.loading`, shared with recipes and site settings); the stacks and the ParallelCluster
configuration read these objects, never raw dicts. Every problem is one line naming the file, the key,
the bad value and what is allowed, so a reviewer fixes them all in one pass. The rules across keys are in
`stacks.config_rules`.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field
from pydantic.json_schema import SkipJsonSchema

from stacks.config_rules import SCRATCH_2_DEFAULT_QUOTA_GIB, ZONE_ID_PATTERN, validate
from stacks.instance_types import CPU_INSTANCE_TYPES
from training.config.hardware import DEFAULT_HARDWARE, HARDWARE
from training.config.loading import Allowed, Bool, ConfigError, Int, Str, StrictModel, build, check, read_mapping
from training.config.recipe import HubRepo
from training.config.tracking import Tracking
from training.secrets import SecretArn
from training.software import DEFAULT_BACKEND, NODE_SOFTWARE, NodeSoftware

# Pinned once: the custom-resource provider template, the offline validator in the tests and the docs
# all follow this version.
PARALLELCLUSTER_VERSION = "3.16.1"

ENVIRONMENT_NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{0,30}$")
CFN_INTEGER_MAX = 2**31 - 1  # CloudFormation's Integer, the type of AWS::FSx::FileSystem StorageCapacity
# CloudWatch Logs' retention periods, once: the type of `logging.retention_days` and its allowed values.
CloudWatchRetentionDays = Literal[
    1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653
]
CLOUDWATCH_RETENTION_DAYS: tuple[int, ...] = typing.get_args(CloudWatchRetentionDays)
ENVIRONMENTS_DIR = Path(__file__).resolve().parent.parent / "environments"
SCHEMA_FILE = ENVIRONMENTS_DIR / "environment.schema.json"

# The training backends a Trainium queue can install software for (training.software.NODE_SOFTWARE).
NodeBackend = Literal["neuron", "torch-native"]

RootVolumeGib = Annotated[
    int,
    Field(strict=True, ge=40, le=16384),
    Allowed("40 to 16384 GiB (Neuron recommends at least 512 on compute nodes)"),
]
RetentionDays = Annotated[CloudWatchRetentionDays, Allowed(f"one of {list(CLOUDWATCH_RETENTION_DAYS)}")]


class NetworkConfig(StrictModel):
    vpc_cidr: Str = "10.0.0.0/16"
    # Off by default: the head node is reached through SSM Session Manager.
    ssh_key_name: Str | None = Field(None, description="EC2 key pair for SSH; omit to reach the head node through SSM")


QueueName = Annotated[
    str,
    Field(strict=True, pattern=r"^[a-z][a-z0-9-]{0,29}$"),
    Allowed("a lowercase letter then up to 29 lowercase letters, digits or '-'"),
]


class HeadNodeConfig(StrictModel):
    """The head node runs Slurm's controller, SSM commands and the shared environment's pip builds; CPU
    stages run in the CPU queue, so it needs no more than this."""

    instance_type: Str = Field("m6a.2xlarge", json_schema_extra={"enum": list(CPU_INSTANCE_TYPES)})
    root_volume_gib: RootVolumeGib = 100


class CpuQueueConfig(StrictModel):
    """The queue of the CPU-only stages (prepare, convert, sample, export), so they never hold a trn1 node.

    Sized for the largest bundled model: sampling Mixtral 8x7B loads its 46.7B parameters in float32
    (187 GB), so the default has 256 GiB; 32 vCPUs tokenize the corpus in parallel. Two nodes let prepare
    and convert-in run side by side. Nodes start on demand and stop after the idle time.
    """

    queue_name: QueueName = "cpu"
    instance_type: Str = Field("r6a.8xlarge", json_schema_extra={"enum": list(CPU_INSTANCE_TYPES)})
    max_count: Annotated[int, Field(strict=True, ge=1), Allowed("1 or more")] = 2
    root_volume_gib: RootVolumeGib = 200


CapacityType = Literal["on-demand", "spot", "reservation", "capacity-block"]
RESERVATION_ID_PATTERN = r"^cr-[0-9a-f]{17}$"
RESOURCE_GROUP_ARN_PATTERN = r"^arn:aws[a-z-]*:resource-groups:[a-z0-9-]+:\d{12}:group/[A-Za-z0-9_.-]{1,128}$"
# What ParallelCluster calls each kind of capacity (SlurmQueues[].CapacityType).
PARALLELCLUSTER_CAPACITY_TYPES: dict[str, str] = {
    "on-demand": "ONDEMAND",
    "spot": "SPOT",
    "reservation": "ONDEMAND",  # an on-demand capacity reservation: on-demand nodes launched into it
    "capacity-block": "CAPACITY_BLOCK",
}


class CapacityConfig(StrictModel):
    """How the compute nodes' capacity is bought: on demand, spot, an on-demand capacity reservation (by id or
    resource group) or an EC2 Capacity Block for ML (by its reservation id)."""

    type: Annotated[CapacityType, Allowed("on-demand, spot, reservation or capacity-block")] = "on-demand"
    reservation_id: Annotated[
        str | None,
        Field(strict=True, pattern=RESERVATION_ID_PATTERN),
        Allowed("a reservation id such as cr-0123456789abcdef0"),
    ] = Field(None, description="the on-demand capacity reservation or the Capacity Block (cr-...)")
    resource_group_arn: Annotated[
        str | None,
        Field(strict=True, pattern=RESOURCE_GROUP_ARN_PATTERN),
        Allowed("a resource group ARN such as arn:aws:resource-groups:us-west-2:123456789012:group/trn1-odcrs"),
    ] = Field(None, description="a resource group of on-demand capacity reservations (type reservation only)")

    @property
    def reserved(self) -> bool:
        """Bought in advance (a reservation or a block), so already placed where it was bought."""
        return self.type in ("reservation", "capacity-block")


# How ParallelCluster applies a change of a queue to nodes that run (Scheduling.SlurmSettings.QueueUpdateStrategy).
# Its third value, COMPUTE_FLEET_STOP, fails every such deploy while a node runs, so it is not offered.
QueueUpdateStrategy = Literal["DRAIN", "TERMINATE"]


class ComputeConfig(StrictModel):
    instance_type: Str = Field(DEFAULT_HARDWARE.name, json_schema_extra={"enum": list(HARDWARE)})
    queue_name: QueueName = "compute1"
    min_count: Annotated[int, Field(strict=True, ge=0), Allowed("0 (scale to zero) or more")] = 0
    max_count: Annotated[int, Field(strict=True, ge=1), Allowed("1 or more")] = 4
    efa: Bool = True
    placement_group: Bool | None = Field(
        None,
        description="omit to follow efa on on-demand and spot capacity; reserved capacity brings its own placement",
    )
    capacity: CapacityConfig = CapacityConfig()
    root_volume_gib: RootVolumeGib = 1024
    scaledown_idle_minutes: Annotated[int, Field(strict=True, ge=1), Allowed("1 or more minutes")] = 10
    queue_update_strategy: Annotated[
        QueueUpdateStrategy, Allowed("DRAIN (running jobs finish first) or TERMINATE (running nodes are replaced)")
    ] = Field(
        "DRAIN",
        description="how a deploy that changes a queue treats its running nodes: DRAIN lets their jobs finish "
        "and replaces them afterwards; TERMINATE replaces them at once, killing their jobs (also needed to lower "
        "max_count while nodes run)",
    )
    backend: Annotated[
        NodeBackend | None, Allowed("neuron (Neuron 2.28: NxD on PyTorch/XLA) or torch-native (TorchNeuron)")
    ] = Field(
        None,
        description="the training backend the queue's nodes install software for: neuron installs Neuron 2.28 "
        "(neuronx-distributed on PyTorch/XLA 2.9; trn1 and trn2), torch-native the TorchNeuron release (native "
        "PyTorch 2.13; trn2 only, os ubuntu2404); omit to follow the instance type's generation (trn1 neuron, "
        "trn2 torch-native). The recipes pick their backend by generation in the same way",
    )
    custom_ami: Annotated[
        str | None,
        Field(strict=True, pattern=r"^ami-[0-9a-f]{8,17}$"),
        Allowed("an image id such as ami-0123456789abcdef0"),
    ] = Field(
        None,
        description="an image of the Trainium queue with the Neuron packages baked in (make image-config); omit to "
        "install them at every boot",
    )

    @property
    def node_software(self) -> NodeSoftware:
        """What the queue's nodes install: its `backend`'s software, else its generation's (neuron for an
        instance type the rules refuse anyway)."""
        hardware = HARDWARE.get(self.instance_type)
        generation = hardware.generation if hardware is not None else DEFAULT_HARDWARE.generation
        return NODE_SOFTWARE[self.backend or DEFAULT_BACKEND[generation]]

    @property
    def placement_group_enabled(self) -> bool:
        """A new placement group for EFA nodes, unless the capacity is reserved: a reservation is placed where it
        was bought, and a group of ours would only cause insufficient-capacity errors (ParallelCluster's rule)."""
        if self.placement_group is not None:
            return self.placement_group
        return self.efa and not self.capacity.reserved

    @property
    def node_counts(self) -> tuple[int, int]:
        """(MinCount, MaxCount): every node of a Capacity Block is paid for, so they are all static."""
        if self.capacity.type == "capacity-block":
            return self.max_count, self.max_count
        return self.min_count, self.max_count


class StorageConfig(StrictModel):
    fsx_capacity_gib: Int = Field(1200, description="SCRATCH_2: 1200 or a multiple of 2400, at most fsx_quota_gib")
    fsx_quota_gib: Annotated[
        int, Field(strict=True, ge=1200, le=CFN_INTEGER_MAX), Allowed(f"1200 to {CFN_INTEGER_MAX} GiB")
    ] = Field(
        SCRATCH_2_DEFAULT_QUOTA_GIB,
        description="this account's FSx for Lustre scratch storage quota in the region (Service Quotas); "
        "raise it here once the quota is raised",
    )
    mount_dir: Annotated[
        str, Field(strict=True, pattern=r"^/[A-Za-z0-9_./-]+$"), Allowed("an absolute directory path such as '/fsx'")
    ] = "/fsx"
    fsx_s3_prefix: Annotated[
        str, Field(strict=True, pattern=r"^[a-z0-9][a-z0-9_/-]*[a-z0-9]$"), Allowed("an S3 key prefix such as 'fsx'")
    ] = Field("fsx", description="prefix of the results bucket that FSx imports from and exports to")


class LoggingConfig(StrictModel):
    retention_days: RetentionDays = 14


EMAIL_PATTERN = r"^[^@\s]+@[^@\s]+\.[^@\s]+$"
# CloudWatch alarms evaluate periods of at most a day.
MAX_STALL_MINUTES = 1440


class MonitoringConfig(StrictModel):
    """The CloudWatch dashboard and alarms; every alarm and budget notice goes to one SNS topic."""

    alarm_email: Annotated[
        str | None, Field(strict=True, pattern=EMAIL_PATTERN), Allowed("an e-mail address such as ops@example.com")
    ] = Field(None, description="subscribed to the alarm topic (AWS sends a confirmation first); omit for none")
    stall_minutes: Annotated[
        int, Field(strict=True, ge=5, le=MAX_STALL_MINUTES), Allowed(f"5 to {MAX_STALL_MINUTES} minutes")
    ] = Field(
        30,
        description="alarm when a training job runs and no step is logged for this long (longer than a step "
        "times the recipe's log_every, and than loading a checkpoint)",
    )


class BudgetConfig(StrictModel):
    """An AWS Budgets cost budget for the account: notices at 80 % and 100 %, and the compute fleet stopped."""

    monthly_usd: Annotated[
        float | None, Field(strict=True, gt=0, le=10**9, allow_inf_nan=False), Allowed("a number of US dollars above 0")
    ] = Field(None, description="the month's limit in USD; omit for no budget")
    stop_fleet_at_percent: Annotated[
        int | None, Field(strict=True, ge=1, le=1000), Allowed("1 to 1000 (percent of monthly_usd), or null")
    ] = Field(100, description="stop the cluster's compute fleet when actual cost reaches this; null: notify only")
    accept_forecast_usd: Annotated[
        float | None, Field(strict=True, gt=0, le=10**9, allow_inf_nan=False), Allowed("a number of US dollars above 0")
    ] = Field(
        None,
        description="a run forecast to cost more than monthly_usd starts only when it costs at most this (you know "
        "what it costs); omit to refuse such runs",
    )


class PipelineConfig(StrictModel):
    """What `cdk deploy` starts on the cluster once it exists (a bundled recipe of training/train/recipes/)."""

    start_run: Bool = Field(
        False,
        description="start the recipe's run on deploy; a recipe with model.hub fetches its model first (a gated one "
        "needs hub.token_secret_arn), others need it uploaded to s3://<bucket>/fsx/models/",
    )
    run: Annotated[int, Field(strict=True, ge=1), Allowed("a run number of 1 or more")] = Field(
        1, description="bump to start a new run on the next deploy; code changes alone never start one"
    )
    recipe: Str = "llama31-8b-cpt"
    overrides: tuple[Str, ...] = Field((), description="recipe key=value overrides, e.g. 'steps=100'")
    export_optimizer_state: Bool = Field(
        False, description="destroy exports /fsx/runs to S3; the checkpoints' optimizer state only when true"
    )
    timeout_minutes: Annotated[
        int, Field(strict=True, ge=1, le=55), Allowed("1 to 55 (CloudFormation waits an hour)")
    ] = Field(30, description="bound on any wait of the deploy and destroy hooks")


NEURON_APT_KEY_FINGERPRINT_PATTERN = r"^[0-9A-Fa-f]{40}$"


class NeuronConfig(StrictModel):
    """The Neuron SDK's apt repository, whose signing key the Trainium nodes download and check before apt
    trusts it. Delivered to the nodes in a file they read at every boot, so a change is a day-2 change."""

    apt_key_fingerprint: Annotated[
        str | None,
        Field(strict=True, pattern=NEURON_APT_KEY_FINGERPRINT_PATTERN),
        Allowed("the key's fingerprint: 40 hexadecimal digits without spaces, as gpg prints it"),
    ] = Field(
        None,
        description="the fingerprint the Neuron apt key must have; omit to trust the key the first node "
        "downloads and have every later node compare with it (recorded in the results bucket)",
    )


class HubConfig(StrictModel):
    """The Hugging Face Hub: tokens as Secrets Manager secrets (only their ARNs here; the CPU queue's nodes may read
    exactly these two secrets), and where the export stage pushes the trained model."""

    token_secret_arn: SecretArn | None = Field(
        None,
        description="secret whose string is the Hub token the fetch stage downloads the base model with (needed for "
        "gated models such as Llama 3.1); its complete ARN, with the six characters Secrets Manager appends",
    )
    write_token_secret_arn: SecretArn | None = Field(
        None, description="secret holding a Hub write token for hub.push_repo; its complete ARN"
    )
    push_repo: HubRepo | None = Field(
        None, description="Hub repository (owner/name) the export stage pushes the trained model to; omit: no push"
    )
    private: Bool = Field(True, description="create push_repo as a private repository")


class EnvironmentConfig(StrictModel):
    """One deployable environment: everything `cdk deploy -c env=NAME` needs."""

    name: SkipJsonSchema[str] = Field(exclude=True, description="from the file name")
    region: Str
    availability_zone: Str = Field(
        description="a zone name (us-west-2d) or, the same physical zone in every account, a zone ID (usw2-az4)"
    )
    cluster_name: Str
    os: Str = "ubuntu2204"
    network: NetworkConfig = NetworkConfig()
    head_node: HeadNodeConfig = HeadNodeConfig()
    compute: ComputeConfig = ComputeConfig()
    cpu_queue: CpuQueueConfig | None = Field(
        CpuQueueConfig(), description="null runs the CPU stages on the Trainium queue instead"
    )
    storage: StorageConfig = StorageConfig()
    logging: LoggingConfig = LoggingConfig()
    monitoring: MonitoringConfig = MonitoringConfig()
    budget: BudgetConfig = BudgetConfig()
    pipeline: PipelineConfig = PipelineConfig()
    neuron: NeuronConfig = NeuronConfig()
    tracking: Tracking = Field(
        Tracking(),
        description="experiment trackers the training job reports to besides TensorBoard and CloudWatch; the "
        "Trainium nodes get access to exactly the SageMaker MLflow server and the W&B key's secret named here",
    )
    hub: HubConfig = HubConfig()
    tags: dict[Str, Str] = Field(default_factory=dict)

    @property
    def stack_name(self) -> str:
        return f"trainium-{self.name}"

    @property
    def zone_is_id(self) -> bool:
        return ZONE_ID_PATTERN.match(self.availability_zone) is not None


def load_environment(name: str, directory: Path = ENVIRONMENTS_DIR) -> EnvironmentConfig:
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
    raw = read_mapping(path, label)
    if "name" in raw:
        raise ConfigError([f"{label}: name: the environment name comes from the file name; remove the key"])
    config = build(EnvironmentConfig, {"name": name, **raw}, label)
    check(label, validate, config)
    return config


def _display_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
