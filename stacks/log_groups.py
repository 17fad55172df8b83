"""Log groups that are deleted with the stack and keep logs for the environment's retention."""

from __future__ import annotations

import typing

from aws_cdk import RemovalPolicy
from aws_cdk import aws_logs as logs
from constructs import Construct


def log_group_with_retention(scope: Construct, construct_id: str, retention_days: int) -> logs.LogGroup:
    """A log group with retention given in days (already validated against CloudWatch's allowed values)."""
    group = logs.LogGroup(scope, construct_id, removal_policy=RemovalPolicy.DESTROY)
    # RetentionDays is an enum of names; the environment file speaks in days, so set the raw property.
    typing.cast(logs.CfnLogGroup, group.node.default_child).retention_in_days = retention_days
    return group
