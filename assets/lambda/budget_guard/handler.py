"""Budget guard: when the budget's stop notification arrives, stop the cluster's compute fleet.

Invoked by SNS with an AWS Budgets notification (plain text). It does what
`pcluster update-compute-fleet --status STOP_REQUESTED` does for a Slurm cluster of ParallelCluster 3.2 and
later: it writes STOP_REQUESTED into the cluster's status table, and the head node's clustermgtd then
deactivates the Slurm partitions and terminates every compute node, so no Trainium node keeps billing.

The status lives in the DynamoDB table `parallelcluster-<cluster name>`, item `{"Id": "COMPUTE_FLEET"}`, as
a map `Data` of `status` and `lastStatusUpdatedTime` (a `str()` of an aware UTC datetime). The rules are
ParallelCluster's (`ComputeFleetStatusManager.update_status(STOP_REQUESTED, STOPPING, STOPPED)`):

- a status that cannot be read (no table, no item, no status, UNKNOWN or an unknown value) is an error;
- STOP_REQUESTED, STOPPING and STOPPED are left alone: the stop is already under way or done (success, so
  a repeated notification changes nothing);
- any other status (RUNNING, START_REQUESTED, STARTING, PROTECTED) becomes STOP_REQUESTED through an update
  conditional on the status just read; when another writer changed it in between, the status is read again
  and the rules applied to the new one (ParallelCluster asks its user to retry).

Then one notice goes to the alarm topic saying what was done, with the budget's message. A failure to stop
fails the invocation (SNS retries it, and the log shows it), after the notice is still attempted.
Only the standard library and boto3 (the Lambda Python runtime's).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

TABLE_PREFIX = "parallelcluster-"  # pcluster.constants.PCLUSTER_DYNAMODB_PREFIX
FLEET_KEY = {"Id": {"S": "COMPUTE_FLEET"}}
DATA = "Data"
STATUS = "status"
UPDATED = "lastStatusUpdatedTime"
STOP_REQUESTED = "STOP_REQUESTED"
# pcluster.models.compute_fleet_status_manager.ComputeFleetStatus, without UNKNOWN (which cannot be updated).
KNOWN_STATUSES = frozenset(
    {"STOPPED", "RUNNING", "STOPPING", "STARTING", "STOP_REQUESTED", "START_REQUESTED", "PROTECTED"}
)
STOP_UNDER_WAY = frozenset({"STOP_REQUESTED", "STOPPING", "STOPPED"})
ATTEMPTS = 3  # reads and conditional updates, when another writer changes the status in between
SUBJECT_LIMIT = 100  # SNS's limit on a subject

LOGGER = logging.getLogger()
LOGGER.setLevel(logging.INFO)

ClientFactory = Callable[[str], Any]
Clock = Callable[[], datetime]


class FleetNotStopped(Exception):
    """The compute fleet could not be asked to stop; the message says why and what to do."""


def aws_client(service: str) -> Any:
    return boto3.client(service, config=Config(retries={"mode": "standard", "max_attempts": 5}))


def utc_now() -> datetime:
    return datetime.now(tz=timezone.utc)


def table_name(cluster_name: str) -> str:
    return TABLE_PREFIX + cluster_name


def read_status(dynamodb: Any, cluster_name: str) -> str:
    """The fleet status ParallelCluster stored, or FleetNotStopped when there is none it would accept."""
    table = table_name(cluster_name)
    try:
        response = dynamodb.get_item(TableName=table, Key=FLEET_KEY, ConsistentRead=True)
    except ClientError as error:
        if error.response["Error"]["Code"] == "ResourceNotFoundException":
            raise FleetNotStopped(
                f"DynamoDB table {table} does not exist: cluster {cluster_name} is not deployed in this account "
                "and region (or is being created or deleted), so there is no compute fleet to stop"
            ) from error
        raise FleetNotStopped(f"cannot read the compute fleet status from {table}: {error}") from error
    status = response.get("Item", {}).get(DATA, {}).get("M", {}).get(STATUS, {}).get("S")
    if status not in KNOWN_STATUSES:
        found = "no status" if status is None else f"status {status!r}"
        raise FleetNotStopped(
            f"{table} holds {found} for COMPUTE_FLEET, so ParallelCluster cannot change it either "
            f"(run `pcluster describe-compute-fleet --cluster-name {cluster_name}`)"
        )
    return str(status)


def request_stop(dynamodb: Any, cluster_name: str, current: str, now: datetime) -> bool:
    """Set STOP_REQUESTED if the status is still `current`; False when another writer changed it first."""
    try:
        dynamodb.update_item(
            TableName=table_name(cluster_name),
            Key=FLEET_KEY,
            UpdateExpression="SET #data.#status = :next, #data.#updated = :time",
            ConditionExpression="#data.#status = :current",
            ExpressionAttributeNames={"#data": DATA, "#status": STATUS, "#updated": UPDATED},
            ExpressionAttributeValues={
                ":next": {"S": STOP_REQUESTED},
                ":time": {"S": str(now)},
                ":current": {"S": current},
            },
        )
    except ClientError as error:
        if error.response["Error"]["Code"] == "ConditionalCheckFailedException":
            return False
        raise FleetNotStopped(
            f"cannot update the compute fleet status in {table_name(cluster_name)}: {error}"
        ) from error
    return True


def stop_fleet(dynamodb: Any, cluster_name: str, clock: Clock = utc_now) -> str:
    """Request the stop by ParallelCluster's rules; one line saying what was done."""
    seen = []
    for _ in range(ATTEMPTS):
        status = read_status(dynamodb, cluster_name)
        if status in STOP_UNDER_WAY:
            return f"the compute fleet was already {status}; nothing changed"
        if request_stop(dynamodb, cluster_name, status, clock()):
            return f"the compute fleet status changed from {status} to {STOP_REQUESTED}"
        seen.append(status)
    raise FleetNotStopped(
        f"the compute fleet status kept changing while the stop was requested (read {', '.join(seen)}); "
        f"run `pcluster update-compute-fleet --cluster-name {cluster_name} --status STOP_REQUESTED`"
    )


def budget_messages(event: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(subject, message) of each SNS record: AWS Budgets sends plain text."""
    return [
        (str(record["Sns"].get("Subject") or ""), str(record["Sns"].get("Message") or ""))
        for record in event.get("Records", [])
        if "Sns" in record
    ]


def notice(
    cluster_name: str, region: str, outcome: str, failure: str | None, budget: list[tuple[str, str]]
) -> tuple[str, str]:
    """The subject and text published to the alarm topic."""
    if failure is None:
        subject = f"Budget guard stopped the compute fleet of {cluster_name}"
        lines = [
            f"A budget notification reached the budget guard of cluster {cluster_name} ({region}): {outcome}.",
            "ParallelCluster's clustermgtd on the head node now deactivates the Slurm partitions and terminates "
            "the compute nodes; jobs running on them are interrupted, queued jobs stay queued. The head node, "
            "the file system and the results bucket keep running.",
            "To run again once the budget allows: pcluster update-compute-fleet --cluster-name "
            f"{cluster_name} --status START_REQUESTED --region {region}",
        ]
    else:
        subject = f"Budget guard FAILED to stop the compute fleet of {cluster_name}"
        lines = [
            f"A budget notification reached the budget guard of cluster {cluster_name} ({region}), but the "
            f"compute fleet was NOT stopped: {failure}.",
            "Compute nodes may still be billing. Stop them by hand: pcluster update-compute-fleet --cluster-name "
            f"{cluster_name} --status STOP_REQUESTED --region {region}",
        ]
    for budget_subject, message in budget:
        lines += ["", f"--- The budget notification: {budget_subject} ---", message]
    return subject[:SUBJECT_LIMIT], "\n".join(lines)


def handler(event: Mapping[str, Any], context: Any, client: ClientFactory = aws_client) -> dict[str, str]:
    cluster_name = os.environ["CLUSTER_NAME"]
    topic_arn = os.environ["ALARM_TOPIC_ARN"]
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "the cluster's region"
    budget = budget_messages(event)
    outcome, failure = "", None
    cause: Exception | None = None
    try:
        outcome = stop_fleet(client("dynamodb"), cluster_name)
        LOGGER.info("Cluster %s: %s", cluster_name, outcome)
    except FleetNotStopped as error:
        failure, cause = str(error), error
    except Exception as error:  # any other failure to stop is reported the same way, then raised
        LOGGER.exception("Cluster %s: the stop request failed", cluster_name)
        failure, cause = f"{type(error).__name__}: {error}", error
    subject, text = notice(cluster_name, region, outcome, failure, budget)
    try:
        client("sns").publish(TopicArn=topic_arn, Subject=subject, Message=text)
    except Exception:
        LOGGER.exception("Cannot publish the budget guard's notice to %s", topic_arn)
        if failure is None:
            raise
    if failure is not None:
        LOGGER.error("Cluster %s: compute fleet not stopped: %s", cluster_name, failure)
        raise FleetNotStopped(f"compute fleet of {cluster_name} not stopped: {failure}") from cause
    return {"cluster": cluster_name, "outcome": outcome}
