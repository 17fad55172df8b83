"""The reviewed cdk-nag acknowledgements: every accepted AwsSolutions finding, with why it is accepted.

This is the one place to review them. Any other finding fails `cdk synth` and the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Acknowledgment, Stack, Validations


@dataclass(frozen=True)
class Acknowledgement:
    path: str  # construct path below the stack
    rule: str
    reason: str


OBJECTS_OF_RESULTS_BUCKET = "AwsSolutions-IAM5[Resource::<StorageResultsB2A4FB2E.Arn>/*]"
PUT_METRIC_DATA = "AwsSolutions-IAM5[Resource::*]"

ACKNOWLEDGEMENTS = (
    Acknowledgement(
        "Storage/Results",
        "AwsSolutions-S1",
        "Results bucket is written only by this environment's node roles and FSx export; server access logs "
        "would need a second retained bucket per environment. Accounts that require object-level audit "
        "enable CloudTrail S3 data events account-wide instead.",
    ),
    *(
        Acknowledgement(
            policy,
            OBJECTS_OF_RESULTS_BUCKET,
            "Nodes read (and the head node writes) training data, checkpoints and results under run-specific "
            "keys of this environment's own results bucket; keys are not known at deploy time.",
        )
        for policy in ("Cluster/HeadNodePolicy", "Cluster/ComputeNodePolicy")
    ),
    *(
        Acknowledgement(
            policy,
            PUT_METRIC_DATA,
            "cloudwatch:PutMetricData has no resource-level permissions; the statement is limited to this "
            "environment's metric namespace by the cloudwatch:namespace condition.",
        )
        for policy in ("Cluster/HeadNodePolicy", "Cluster/ComputeNodePolicy")
    ),
)


def acknowledge_reviewed_findings(stack: Stack) -> None:
    """Attach each acknowledgement to the narrowest construct it concerns."""
    for acknowledgement in ACKNOWLEDGEMENTS:
        construct = stack.node.find_child(acknowledgement.path.split("/")[0])
        for part in acknowledgement.path.split("/")[1:]:
            construct = construct.node.find_child(part)
        Validations.of(construct).acknowledge(
            Acknowledgment(id=f"AwsSolutions::{acknowledgement.rule}", reason=acknowledgement.reason)
        )
