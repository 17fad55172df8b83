"""The project's own Lambda handlers (assets/lambda/*): one way to build them."""

from __future__ import annotations

import typing
from collections.abc import Mapping
from pathlib import Path

from aws_cdk import Duration
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from constructs import Construct

from stacks.log_groups import log_group_with_retention


def handler_function(
    scope: Construct,
    construct_id: str,
    *,
    description: str,
    handler_dir: Path,
    role: iam.Role,
    logs_id: str,
    log_retention_days: int,
    timeout: Duration,
    environment: Mapping[str, str] | None = None,
    function_name: str | None = None,
) -> lambda_.Function:
    """`handler.handler` of `handler_dir` on the Lambda Python runtime, logging to a log group of its own that
    `role` may write (instead of the broad basic-execution policy)."""
    logs = log_group_with_retention(scope, logs_id, log_retention_days)
    logs.grant_write(role)
    function = lambda_.Function(
        scope,
        construct_id,
        description=description,
        runtime=lambda_.Runtime.PYTHON_3_14,
        handler="handler.handler",
        code=lambda_.Code.from_asset(str(handler_dir), exclude=["__pycache__", "*.pyc"]),
        role=role,
        timeout=timeout,
        memory_size=128,
        log_group=logs,
        environment=dict(environment) if environment else None,
        function_name=function_name,
    )
    # CDK writes both `DependsOn` and `Fn::GetAtt` to the role (harmless, not ours to change): this function
    # alone ignores only that cfn-lint rule, as stacks/pipeline_trigger.py does for its functions.
    cfn_function = typing.cast(lambda_.CfnFunction, function.node.default_child)
    cfn_function.add_metadata("cfn-lint", {"config": {"ignore_checks": ["W3005"]}})
    return function
