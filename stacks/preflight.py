"""Preflight: account checks that refuse an environment in seconds, before anything that bills is created.

The checks themselves are `assets/lambda/preflight/handler.py`; this construct runs them as a custom resource
whose properties are everything checked, so a day-2 change of a type, a count or the capacity runs them again.
The stack makes the NAT gateway, the file system and the cluster depend on it.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from pathlib import Path

from aws_cdk import CustomResource, Duration
from aws_cdk import aws_iam as iam
from constructs import Construct

from stacks.config import EnvironmentConfig
from stacks.handler_functions import handler_function

HANDLER_DIR = Path(__file__).resolve().parent.parent / "assets" / "lambda" / "preflight"
# What the checks read; none of these actions has resource-level permissions (Service Authorization Reference).
READ_ACTIONS = (
    "ec2:DescribeAvailabilityZones",
    "ec2:DescribeInstanceTypeOfferings",
    "ec2:DescribeInstanceTypes",
    "ec2:DescribeCapacityReservations",
    "ec2:DescribeImages",
    "servicequotas:GetServiceQuota",
    "servicequotas:GetAWSDefaultServiceQuota",
    "servicequotas:ListServiceQuotas",
)


@dataclass(frozen=True)
class PreflightNodes:
    role: str
    instance_type: str
    count: int
    purchase: str


@dataclass(frozen=True)
class PreflightChecks:
    """What the account must allow; the Trainium queue comes first (the capacity checks read it)."""

    zone: str
    nodes: tuple[PreflightNodes, ...]
    fsx_scratch_gib: int
    capacity_type: str
    reservation_id: str
    resource_group_arn: str
    custom_ami: str

    def properties(self) -> dict[str, typing.Any]:
        """The custom resource's properties, in the handler's names."""
        return {
            "Zone": self.zone,
            "Nodes": [
                {"Role": n.role, "InstanceType": n.instance_type, "Count": n.count, "Purchase": n.purchase}
                for n in self.nodes
            ],
            "FsxScratchGib": self.fsx_scratch_gib,
            "CapacityType": self.capacity_type,
            "CapacityReservationId": self.reservation_id,
            "CapacityResourceGroupArn": self.resource_group_arn,
            "CustomAmi": self.custom_ami,
        }


def preflight_checks(config: EnvironmentConfig) -> PreflightChecks:
    """Every node at the largest count the environment allows, and what it is bought as."""
    compute = config.compute
    capacity = compute.capacity
    nodes = [PreflightNodes(f"queue {compute.queue_name}", compute.instance_type, compute.max_count, capacity.type)]
    if config.cpu_queue is not None:
        cpu = config.cpu_queue
        nodes.append(PreflightNodes(f"queue {cpu.queue_name}", cpu.instance_type, cpu.max_count, "on-demand"))
    nodes.append(PreflightNodes("head node", config.head_node.instance_type, 1, "on-demand"))
    return PreflightChecks(
        zone=config.availability_zone,
        nodes=tuple(nodes),
        fsx_scratch_gib=config.storage.fsx_capacity_gib,
        capacity_type=capacity.type,
        reservation_id=capacity.reservation_id or "",
        resource_group_arn=capacity.resource_group_arn or "",
        custom_ami=compute.custom_ami or "",
    )


class Preflight(Construct):
    """A Lambda-backed custom resource that fails with one line when the account cannot run the environment."""

    def __init__(
        self, scope: Construct, construct_id: str, *, checks: PreflightChecks, log_retention_days: int
    ) -> None:
        super().__init__(scope, construct_id)
        role = iam.Role(
            self,
            "Role",
            assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"),
            description="Preflight of the environment: reads zones, instance types, quotas, reservations, images",
        )
        role.add_to_policy(iam.PolicyStatement(actions=list(READ_ACTIONS), resources=["*"]))
        if checks.resource_group_arn:
            role.add_to_policy(
                iam.PolicyStatement(
                    actions=["resource-groups:ListGroupResources"], resources=[checks.resource_group_arn]
                )
            )
        self.function = handler_function(
            self,
            "Check",
            description="Refuses an environment the account cannot run, before anything bills",
            handler_dir=HANDLER_DIR,
            role=role,
            logs_id="Logs",
            log_retention_days=log_retention_days,
            timeout=Duration.minutes(2),
        )
        self.resource = CustomResource(
            self,
            "Resource",
            resource_type="Custom::Preflight",
            service_token=self.function.function_arn,
            properties=checks.properties(),
        )
        self.checks = checks
