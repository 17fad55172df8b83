"""Site settings: where and how a run's Slurm jobs run (the local demo's defaults, or the cluster's file).

On the cluster the file is written by the deployment from the reviewed environment file
(`stacks/pipeline_site.py`), so the jobs follow it; locally the defaults run everything under `work/`.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from training.config.loading import Bool, NonNegativeInt, PositiveInt, Str, StrictModel, build, read_mapping


class Site(StrictModel):
    name: Str = "local"
    runs_root: Str = Field("work/runs", description="directory holding one directory per run")
    results: Str = Field(
        "work/results", description="a directory, or s3://bucket/prefix: the export stage copies there"
    )
    python: Str | None = Field(None, description="interpreter on the nodes (default: the one running `submit`)")
    setup: tuple[Str, ...] = Field((), description="shell lines run first in every job")
    slurm_bin: Str | None = Field(
        None, description="directory of Slurm's commands (ParallelCluster: /opt/slurm/bin); default: found on PATH"
    )
    partition: Str | None = None
    cpu_partition: Str | None = Field(None, description="partition of the single-node CPU stages (default: partition)")
    processes_per_node: PositiveInt | None = Field(None, description="default: the recipe's tp (one TP group a node)")
    instance_type: Str | None = Field(
        None, description="the training nodes' instance type, which `submit` plans memory against (trn1.32xlarge)"
    )
    exclusive: Bool = False
    neuron: Bool = Field(False, description="Neuron environment variables and neuron_parallel_compile")
    efa: Bool = False
    compile_cache: Str = "/fsx/neuron-cache"
    max_restarts: NonNegativeInt = Field(3, description="requeues of a failed training job before it fails for good")
    time_minutes: NonNegativeInt = Field(0, description="per-job time limit; 0: none")


def load_site(path: Path | None) -> Site:
    """The site file's settings, or the local defaults without one."""
    if path is None:
        return Site()
    label = str(path)
    return build(Site, read_mapping(path, label), label)
