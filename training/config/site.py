"""Site settings: where and how a run's Slurm jobs run (the local demo's defaults, or the cluster's file).

On the cluster the file is written by the deployment from the reviewed environment file
(`stacks/pipeline_site.py`), so the jobs follow it; locally the defaults run everything under `work/`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, Strict

from training.config.backends import Backend
from training.config.loading import Allowed, Bool, PositiveInt, Str, StrictModel, build, read_mapping
from training.config.recipe import HubRepo
from training.config.tracking import Tracking
from training.secrets import SecretArn

# Slurm reads `#SBATCH` lines itself (quotes group, `#` starts a comment, whitespace separates), so a value
# there cannot be shell-quoted: a partition is one or more plain names, comma-separated.
SlurmPartition = Annotated[
    str,
    Strict(),
    Field(pattern=r"^[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*$"),
    Allowed("a Slurm partition name of letters, digits, '_', '.' and '-' (several: comma-separated)"),
]
# The compile cache is one flag inside NEURON_CC_FLAGS, a single string of flags that the Neuron tools split
# back into flags: whitespace or quotes in the path would not survive that.
FlagPath = Annotated[
    str,
    Strict(),
    Field(pattern=r"""^[^\s'"\\\x00-\x1f\x7f]+$"""),
    Allowed("a directory path without whitespace, quotes or backslashes (it is a flag in NEURON_CC_FLAGS)"),
]
S3Uri = Annotated[
    str,
    Strict(),
    Field(pattern=r"^s3://[^\s/]+(/\S*)?$"),
    Allowed("an S3 URI such as s3://bucket/fsx/models"),
]
# A Lambda function's name or ARN (Lambda's FunctionName: up to 64 of letters, digits, '-' and '_' for a name).
LambdaFunction = Annotated[
    str,
    Strict(),
    Field(pattern=r"^(arn:aws[a-z-]*:lambda:[a-z0-9-]+:\d{12}:function:)?[A-Za-z0-9_-]{1,64}$"),
    Allowed("a Lambda function name or ARN"),
]
# Slurm turns `--time` minutes into seconds in a signed 32-bit integer.
MAX_TIME_MINUTES = (2**31 - 1) // 60
TimeMinutes = Annotated[
    int, Strict(), Field(ge=0, le=MAX_TIME_MINUTES), Allowed(f"0 (no limit) to {MAX_TIME_MINUTES} minutes")
]
Usd = Annotated[
    float, Strict(), Field(ge=0, le=10**9, allow_inf_nan=False), Allowed("a number of US dollars, 0 or more")
]
# Slurm counts a job's restarts in 16 bits: beyond that the count wraps and the requeues would never end.
MAX_RESTARTS = 2**16 - 1
Restarts = Annotated[int, Strict(), Field(ge=0, le=MAX_RESTARTS), Allowed(f"0 to {MAX_RESTARTS}")]


class Site(StrictModel):
    name: Str = "local"
    runs_root: Str = Field("work/runs", description="directory holding one directory per run")
    results: Str = Field(
        "work/results", description="a directory, or s3://bucket/prefix: the export stage copies there"
    )
    python: Str | None = Field(None, description="interpreter on the nodes (default: the one running `submit`)")
    setup: tuple[Str, ...] = Field(
        (), description="shell lines run first in every job, as written (code, one line each)"
    )
    slurm_bin: Str | None = Field(
        None, description="directory of Slurm's commands (ParallelCluster: /opt/slurm/bin); default: found on PATH"
    )
    partition: SlurmPartition | None = None
    cpu_partition: SlurmPartition | None = Field(
        None, description="partition of the single-node CPU stages (default: partition)"
    )
    processes_per_node: PositiveInt | None = Field(
        None,
        description="training processes per node; default: one per NeuronCore of instance_type (trn1.32xlarge: 32), "
        "or without an instance type the recipe's tp x pp spread evenly over its nodes (else its tp)",
    )
    instance_type: Str | None = Field(
        None,
        description="the training nodes' instance type (trn1.32xlarge): `submit` plans memory against it, and the "
        "distributed jobs get its NeuronCores as processes and its vCPUs as --cpus-per-task",
    )
    exclusive: Bool = False
    neuron: Bool = Field(False, description="Neuron environment variables and neuron_parallel_compile")
    backend: Backend | None = Field(
        None,
        description="the training backend the nodes' software serves (the deployment's compute.backend: neuron or "
        "torch-native); a recipe on another Trainium backend is refused at submission; omit: not checked",
    )
    efa: Bool = False
    compile_cache: FlagPath = "/fsx/neuron-cache"
    compile_cache_store: S3Uri | None = Field(
        None,
        description="where the compile cache outlives the environment (s3://bucket/compile-cache): the compile "
        "stage restores the promoted entry of its key before compiling and stages what it compiled after; omit to "
        "keep the cache on the file system only (training.pipeline.compile_cache)",
    )
    compile_cache_promoter: LambdaFunction | None = Field(
        None, description="the deployment's function that promotes a staged compile cache (its name or ARN)"
    )
    max_restarts: Restarts = Field(3, description="requeues of a failed training job before it fails for good")
    preflight: Bool = Field(
        True,
        description="check the training nodes before training (devices, all-reduce, write speed; "
        "training/pipeline/preflight.py); false skips the stage",
    )
    time_minutes: TimeMinutes = Field(0, description="per-job time limit; 0: none")
    region: Annotated[
        str | None, Strict(), Field(pattern=r"^[a-z]{2}(-gov)?-[a-z]+-\d+$"), Allowed("an AWS region such as us-west-2")
    ] = Field(None, description="the AWS region of the jobs' AWS calls (CloudWatch metrics, S3 exports)")
    metrics_namespace: Annotated[
        str | None,
        Strict(),
        Field(pattern=r"^[A-Za-z0-9/_.#:-]{1,255}$"),
        Allowed("a CloudWatch namespace such as Trainium/default (1 to 255 of letters, digits and . - _ / # :)"),
    ] = Field(None, description="CloudWatch namespace of the training metrics; omit to keep them in files only")
    tracking: Tracking = Field(
        Tracking(), description="experiment trackers the training job also reports to (MLflow, Weights & Biases)"
    )
    models_dir: Str | None = Field(
        None,
        description="directory of the shared file system whose files the storage imports from models_uri; a model "
        "the fetch stage downloads under it is copied there too, so a new environment finds it without a download",
    )
    models_uri: S3Uri | None = Field(None, description="where models_dir's files live in S3 (the results bucket)")
    hub_token_secret_arn: SecretArn | None = Field(
        None, description="secret holding the Hugging Face token the fetch stage downloads with; omit for public models"
    )
    hub_write_token_secret_arn: SecretArn | None = Field(
        None, description="secret holding the Hugging Face write token the export stage pushes with"
    )
    hub_push_repo: HubRepo | None = Field(
        None, description="Hub repository the export stage pushes the trained model to; omit to push nothing"
    )
    hub_private: Bool = Field(True, description="create hub_push_repo as a private repository")
    node_usd_per_hour: Usd | None = Field(
        None,
        description="one training node while it trains (list price and root volume), for the run's forecast; "
        "omit: instance_type's list price",
    )
    environment_usd_per_hour: Usd | None = Field(
        None, description="the rest of the environment while a run trains (head node, FSx, NAT, CloudWatch)"
    )
    budget_monthly_usd: Usd | None = Field(
        None, description="`submit` refuses a run forecast to cost more (the environment's budget.monthly_usd)"
    )
    budget_accept_forecast_usd: Usd | None = Field(
        None, description="a run above budget_monthly_usd is submitted when its forecast is at most this"
    )


def load_site(path: Path | None) -> Site:
    """The site file's settings, or the local defaults without one."""
    if path is None:
        return Site()
    label = str(path)
    return build(Site, read_mapping(path, label), label)
