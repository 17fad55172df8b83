"""The metrics every publisher sends to CloudWatch, named once: the dashboard and alarms (stacks/) read them here.

Every metric is in the environment's namespace, `Trainium/<environment>`. Each is sent without dimensions,
so the dashboard and alarms can name it before any run exists; training metrics are also sent with the
run's id (dimension `Run`), Neuron metrics with the instance (`InstanceId`), to tell runs and nodes apart.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from training.config.site import Site

NAMESPACE_PREFIX = "Trainium/"

# Rank 0 of the training job, at every logged step.
TRAINING_STEP = "TrainingStep"
TRAINING_LOSS = "TrainingLoss"
VALIDATION_LOSS = "ValidationLoss"
LEARNING_RATE = "LearningRate"
GRADIENT_NORM = "GradientNorm"
TOKENS_PER_SECOND = "TokensPerSecond"
SEQUENCES_PER_SECOND = "SequencesPerSecond"
MFU = "ModelFlopsUtilization"  # percent of the workers' peak
MOE_DROPPED_TOKENS = "MoEDroppedTokens"  # percent of the step's token-expert choices
LATE_COMPILATIONS = "LateCompilations"  # graphs compiled that the compile stage did not (training.train.watchdog)
THROUGHPUT_FRACTION = "ThroughputFraction"  # percent of the expected tokens/s per node (the window's median)
BELOW_THROUGHPUT_FLOOR = "BelowThroughputFloor"  # 1 while that median is below the recipe's floor, else 0
# The head node, every minute.
SLURM_JOBS = "SlurmJobs"  # dimension State: RUNNING or PENDING
TRAINING_JOBS_RUNNING = "TrainingJobsRunning"  # jobs of the train stage that are running
FAILED_STAGES = "FailedStages"  # stages of the newest run that ended in failure
SLURM_NODES = "SlurmNodes"  # dimensions Partition and State (allocated, idle, powering, down)
STAGE_SECONDS = "StageSeconds"  # dimension Stage: the newest run's time to first step, phase by phase
# Each compute node, every minute, from the Neuron monitor.
NEURONCORE_UTILIZATION = "NeuronCoreUtilization"  # percent, the mean over the node's NeuronCores
NEURONCORE_MEMORY_USED = "NeuronCoreMemoryUsed"  # bytes, the most any of the node's NeuronCores holds
NEURON_DEVICE_MEMORY_USED = "NeuronDeviceMemoryUsed"  # bytes, all of the node's Neuron devices

RUN_DIMENSION = "Run"
INSTANCE_DIMENSION = "InstanceId"
# PutMetricData takes at most 1000 values per request; fewer keep each request far below its 1 MB.
BATCH_SIZE = 500


def namespace_of(environment: str) -> str:
    return f"{NAMESPACE_PREFIX}{environment}"


@dataclass(frozen=True)
class Datum:
    """One value of one metric, with the dimensions it is sent with (besides the one without any)."""

    name: str
    value: float
    unit: str = "None"
    dimensions: Mapping[str, str] = field(default_factory=dict)

    def as_api(self, timestamp: float | None = None) -> dict[str, Any]:
        entry: dict[str, Any] = {"MetricName": self.name, "Value": float(self.value), "Unit": self.unit}
        if self.dimensions:
            entry["Dimensions"] = [{"Name": k, "Value": v} for k, v in sorted(self.dimensions.items())]
        if timestamp is not None:
            entry["Timestamp"] = timestamp
        return entry


class MetricsClient(Protocol):
    def put_metric_data(self, **kwargs: Any) -> Any: ...


def batches(data: Iterable[Datum], timestamp: float | None = None) -> Iterator[list[dict[str, Any]]]:
    """PutMetricData's MetricData lists, at most BATCH_SIZE values each."""
    batch: list[dict[str, Any]] = []
    for datum in data:
        batch.append(datum.as_api(timestamp))
        if len(batch) == BATCH_SIZE:
            yield batch
            batch = []
    if batch:
        yield batch


def put_metrics(client: MetricsClient, namespace: str, data: Iterable[Datum], timestamp: float | None = None) -> int:
    """Send `data` in as few requests as the API allows; the number of requests sent."""
    sent = 0
    for batch in batches(data, timestamp):
        client.put_metric_data(Namespace=namespace, MetricData=batch)
        sent += 1
    return sent


def with_dimension(data: Iterable[Datum], name: str, value: str) -> list[Datum]:
    """Each datum as it is, and again with one more dimension (a run, an instance)."""
    result: list[Datum] = []
    for datum in data:
        result.append(datum)
        result.append(Datum(datum.name, datum.value, datum.unit, {**datum.dimensions, name: value}))
    return result


def required_namespace(site: Site, source: str) -> str:
    """The site's namespace; a site without one (the local defaults) keeps its metrics to itself.
    `source`: where the site's settings came from, for the message."""
    from training.errors import UserError

    if not site.metrics_namespace:
        raise UserError(
            f"{source}: no metrics_namespace; set it (e.g. Trainium/<environment>) to publish CloudWatch metrics"
        )
    return site.metrics_namespace


def print_requests(namespace: str, data: Iterable[Datum], out: IO[str] | None = None) -> int:
    """A dry run's publish: each PutMetricData request it would send, one JSON line each; the number of lines."""
    printed = 0
    for batch in batches(data):
        print(json.dumps({"Namespace": namespace, "MetricData": batch}, sort_keys=True), file=out or sys.stdout)
        printed += 1
    (out or sys.stdout).flush()
    return printed


def cloudwatch_client(region: str | None, *, max_attempts: int = 5, timeout_seconds: float | None = None) -> Any:
    """boto3's CloudWatch client in `region` (None: boto3's own default), with standard retries; `timeout_seconds`
    bounds each connection and read (None: botocore's 60 s)."""
    import boto3
    from botocore.config import Config

    timeouts = {} if timeout_seconds is None else {"connect_timeout": timeout_seconds, "read_timeout": timeout_seconds}
    config = Config(retries={"mode": "standard", "max_attempts": max_attempts}, **timeouts)
    return boto3.client("cloudwatch", region_name=region, config=config)
