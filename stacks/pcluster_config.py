"""The ParallelCluster cluster configuration, built as a plain dict from narrow typed inputs.

Kept free of CDK so it can be unit-tested and validated by the real `aws-parallelcluster` schema: the
values in `ClusterResources` may be CloudFormation tokens at synth time and placeholder ids in tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stacks.config import PARALLELCLUSTER_CAPACITY_TYPES, ComputeConfig, CpuQueueConfig, HeadNodeConfig

SSM_MANAGED_INSTANCE_CORE = "arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore"


@dataclass(frozen=True, kw_only=True)
class ClusterSettings:
    """The environment's settings that the cluster configuration uses (the stack picks them out)."""

    region: str
    os: str
    head_node: HeadNodeConfig
    compute: ComputeConfig
    cpu_queue: CpuQueueConfig | None
    ssh_key_name: str | None
    mount_dir: str
    log_retention_days: int
    tags: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ClusterResources:
    """Ids of resources created outside the cluster that its configuration refers to."""

    head_node_subnet_id: str
    compute_subnet_id: str
    security_group_id: str
    file_system_id: str
    head_node_policy_arn: str
    compute_node_policy_arn: str
    bootstrap_script_url: str
    bootstrap_args: tuple[str, ...]
    # Queue name -> the ARN of the policy only that queue's nodes get (besides the compute node policy).
    queue_policy_arns: Mapping[str, str] = field(default_factory=dict)


def queue_policies(queue: str, resources: ClusterResources) -> list[dict[str, str]]:
    """A queue's AdditionalIamPolicies: the compute nodes' policy, then the queue's own if it has one."""
    own = resources.queue_policy_arns.get(queue)
    return [{"Policy": resources.compute_node_policy_arn}, *([{"Policy": own}] if own else [])]


def build_cluster_configuration(settings: ClusterSettings, resources: ClusterResources) -> dict[str, Any]:
    """The `ClusterConfiguration` object of `Custom::PclusterCluster` (same shape as the cluster YAML)."""
    bootstrap = {"OnNodeConfigured": {"Script": resources.bootstrap_script_url, "Args": list(resources.bootstrap_args)}}
    compute = settings.compute
    cluster: dict[str, Any] = {
        "Region": settings.region,
        "Image": {"Os": settings.os},
        "HeadNode": head_node_section(settings, resources, bootstrap),
        "Scheduling": {
            "Scheduler": "slurm",
            "SlurmSettings": {
                "ScaledownIdletime": compute.scaledown_idle_minutes,
                # DRAIN unless the environment says otherwise: a deploy never kills a running job.
                "QueueUpdateStrategy": compute.queue_update_strategy,
                # A failed stage's dependants are cancelled, not left pending as DependencyNeverSatisfied (a rerun
                # of the run would adopt them, waiting on a job that failed); the local Slurm is configured the same.
                "CustomSlurmSettings": [{"DependencyParameters": "kill_invalid_depend"}],
            },
            "SlurmQueues": [trainium_queue(compute, resources, bootstrap), *cpu_queues(settings.cpu_queue, resources)],
        },
        "SharedStorage": [
            {
                "Name": "fsx",
                "StorageType": "FsxLustre",
                "MountDir": settings.mount_dir,
                "FsxLustreSettings": {"FileSystemId": resources.file_system_id},
            }
        ],
        "Monitoring": {
            "Logs": {
                "CloudWatch": {
                    "Enabled": True,
                    "RetentionInDays": settings.log_retention_days,
                    "DeletionPolicy": "Delete",
                }
            },
            "Dashboards": {"CloudWatch": {"Enabled": True}},
        },
    }
    if settings.tags:
        cluster["Tags"] = [{"Key": key, "Value": value} for key, value in sorted(settings.tags.items())]
    return cluster


def head_node_section(
    settings: ClusterSettings, resources: ClusterResources, bootstrap: Mapping[str, Any]
) -> dict[str, Any]:
    """The head node: our security group, an encrypted root volume, SSM and the stack's policy, IMDSv2 only."""
    head_node: dict[str, Any] = {
        "InstanceType": settings.head_node.instance_type,
        "Networking": {
            "SubnetId": resources.head_node_subnet_id,
            # Our own group replaces the one ParallelCluster would create, which opens SSH to AllowedIps.
            "SecurityGroups": [resources.security_group_id],
        },
        "LocalStorage": {"RootVolume": {"Size": settings.head_node.root_volume_gib, "Encrypted": True}},
        "Iam": {
            "AdditionalIamPolicies": [
                {"Policy": SSM_MANAGED_INSTANCE_CORE},
                {"Policy": resources.head_node_policy_arn},
            ]
        },
        "CustomActions": bootstrap,
        "Imds": {"Secured": True},
    }
    if settings.ssh_key_name:
        head_node["Ssh"] = {"KeyName": settings.ssh_key_name}
    return head_node


def trainium_queue(compute: ComputeConfig, resources: ClusterResources, bootstrap: Mapping[str, Any]) -> dict[str, Any]:
    """The Trainium queue: one compute resource of the environment's instance type, on its capacity."""
    min_count, max_count = compute.node_counts
    compute_resource: dict[str, Any] = {
        "Name": _compute_resource_name(compute.instance_type),
        "InstanceType": compute.instance_type,
        "MinCount": min_count,
        "MaxCount": max_count,
        "Efa": {"Enabled": compute.efa},
    }
    target = capacity_reservation_target(compute)
    if target:
        compute_resource["CapacityReservationTarget"] = target
    return {
        "Name": compute.queue_name,
        "CapacityType": PARALLELCLUSTER_CAPACITY_TYPES[compute.capacity.type],
        "Networking": {
            "SubnetIds": [resources.compute_subnet_id],
            "SecurityGroups": [resources.security_group_id],
            "PlacementGroup": {"Enabled": compute.placement_group_enabled},
        },
        "ComputeSettings": {"LocalStorage": {"RootVolume": {"Size": compute.root_volume_gib, "Encrypted": True}}},
        "ComputeResources": [compute_resource],
        **({"Image": {"CustomAmi": compute.custom_ami}} if compute.custom_ami else {}),
        "CustomActions": bootstrap,
        "Iam": {"AdditionalIamPolicies": queue_policies(compute.queue_name, resources)},
        # Trainium jobs own whole nodes; sharing a node between jobs would split its NeuronCores.
        "JobExclusiveAllocation": True,
    }


def cpu_queues(cpu: CpuQueueConfig | None, resources: ClusterResources) -> list[dict[str, Any]]:
    """The CPU queue, if any: on-demand nodes without Neuron devices or EFA; the bootstrap skips Neuron there."""
    if cpu is None:
        return []
    bootstrap = {"Script": resources.bootstrap_script_url, "Args": [*resources.bootstrap_args, "--node-type", "cpu"]}
    return [
        {
            "Name": cpu.queue_name,
            "CapacityType": "ONDEMAND",
            "Networking": {
                "SubnetIds": [resources.compute_subnet_id],
                "SecurityGroups": [resources.security_group_id],
            },
            "ComputeSettings": {"LocalStorage": {"RootVolume": {"Size": cpu.root_volume_gib, "Encrypted": True}}},
            "ComputeResources": [
                {
                    "Name": _compute_resource_name(cpu.instance_type),
                    "InstanceType": cpu.instance_type,
                    "MinCount": 0,
                    "MaxCount": cpu.max_count,
                }
            ],
            "CustomActions": {"OnNodeConfigured": bootstrap},
            "Iam": {"AdditionalIamPolicies": queue_policies(cpu.queue_name, resources)},
            "JobExclusiveAllocation": True,
        }
    ]


def capacity_reservation_target(compute: ComputeConfig) -> dict[str, str]:
    """ParallelCluster's CapacityReservationTarget for reserved capacity; empty for on-demand and spot."""
    if compute.capacity.reservation_id:
        return {"CapacityReservationId": compute.capacity.reservation_id}
    if compute.capacity.resource_group_arn:
        return {"CapacityReservationResourceGroupArn": compute.capacity.resource_group_arn}
    return {}


def _compute_resource_name(instance_type: str) -> str:
    """ParallelCluster compute resource names allow letters, digits and '-' only."""
    return instance_type.replace(".", "-")
