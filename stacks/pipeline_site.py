"""The Slurm pipeline's site settings for a deployed environment (`python -m training submit --site`).

Derived from the environment file, so the job scripts on the cluster follow the reviewed settings: runs on
the shared file system, results exported to the results bucket (which outlives the stack), the Neuron
environment the node bootstrap builds, one process per NeuronCore, EFA when the queue has it.
"""

from __future__ import annotations

from typing import Any

from stacks.config import EnvironmentConfig
from stacks.cost import besides_training_nodes_usd_per_hour, training_node_usd_per_hour
from training.config.hardware import HARDWARE
from training.config.site import Site
from training.monitoring.cloudwatch import namespace_of
from training.software import ENVS_FOLDER

# Where ParallelCluster installs Slurm; only login shells get it on PATH (/etc/profile.d/slurm.sh).
PARALLELCLUSTER_SLURM_BIN = "/opt/slurm/bin"
# Folders of the file system whose content nodes execute: the shared environments, the sources the
# pipeline fetches (the custom resource's `<mount>/pipeline/`) and the compile cache.
NEURON_CACHE_FOLDER = "neuron-cache"
EXECUTED_FOLDERS = (ENVS_FOLDER, "pipeline", NEURON_CACHE_FOLDER)
# The folder of base models: the fetch stage downloads into it and copies to the bucket prefix the file system
# imports it from (`<fsx_s3_prefix>/models/`), where a new environment finds them.
MODELS_FOLDER = "models"


def shared_env_path(config: EnvironmentConfig, neuron_release: str) -> str:
    """The shared Python environment the head node's bootstrap builds on the file system: the Trainium queue's
    software set's (`ComputeConfig.node_software`), which every queue's jobs run with."""
    return config.compute.node_software.shared_env(config.storage.mount_dir, neuron_release)


def site_settings(
    config: EnvironmentConfig,
    *,
    neuron_release: str,
    results_uri: str,
    file_system_uri: str,
    compile_cache_store: str | None = None,
    compile_cache_promoter: str | None = None,
) -> dict[str, Any]:
    """The site file's content, built with the model `python -m training submit --site` loads it with.
    `file_system_uri` is the bucket prefix the file system imports from (s3://bucket/<fsx_s3_prefix>);
    `compile_cache_store` where the compile cache outlives the environment, promoted by `compile_cache_promoter`."""
    facts = HARDWARE[config.compute.instance_type]
    mount = config.storage.mount_dir
    site = Site(
        name=config.name,
        runs_root=f"{mount}/runs",
        results=results_uri,
        python=f"{shared_env_path(config, neuron_release)}/bin/python",
        setup=(),
        slurm_bin=PARALLELCLUSTER_SLURM_BIN,
        partition=config.compute.queue_name,
        cpu_partition=config.cpu_queue.queue_name if config.cpu_queue else None,
        processes_per_node=facts.cores_per_node,
        instance_type=config.compute.instance_type,
        backend=config.compute.node_software.backend,
        exclusive=True,
        neuron=True,
        efa=config.compute.efa,
        compile_cache=f"{mount}/{NEURON_CACHE_FOLDER}",
        compile_cache_store=compile_cache_store,
        compile_cache_promoter=compile_cache_promoter,
        max_restarts=3,
        time_minutes=0,
        region=config.region,
        metrics_namespace=namespace_of(config.name),
        tracking=config.tracking,
        models_dir=f"{mount}/{MODELS_FOLDER}",
        models_uri=f"{file_system_uri.rstrip('/')}/{MODELS_FOLDER}",
        hub_token_secret_arn=config.hub.token_secret_arn,
        hub_write_token_secret_arn=config.hub.write_token_secret_arn,
        hub_push_repo=config.hub.push_repo,
        hub_private=config.hub.private,
        node_usd_per_hour=round(training_node_usd_per_hour(config), 4),
        environment_usd_per_hour=round(besides_training_nodes_usd_per_hour(config), 4),
        budget_monthly_usd=config.budget.monthly_usd,
        budget_accept_forecast_usd=config.budget.accept_forecast_usd,
    )
    return site.model_dump(mode="json")
