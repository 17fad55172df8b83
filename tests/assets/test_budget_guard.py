"""Tests of the budget guard's Lambda handler (assets/lambda/budget_guard/handler.py).

AWS is moto: the cluster's status table as ParallelCluster's cluster stack creates it
(`pcluster.templates.cluster_stack`: `parallelcluster-<name>`, hash key `Id` (S), on demand) holding the
COMPUTE_FLEET item as the head node writes it, and the alarm topic with an SQS queue subscribed to read the
notices back. What the handler leaves in the table is read with ParallelCluster's own status manager, and its
rules are compared with `ComputeFleetStatusManager.update_status` (what `pcluster update-compute-fleet`
runs) on every status.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws
from pcluster.aws.aws_api import AWSApi
from pcluster.models.compute_fleet_status_manager import ComputeFleetStatus, ComputeFleetStatusManager

from stacks.config import PARALLELCLUSTER_VERSION
from tests.support.lambda_handlers import load_handler_file

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)

ROOT = Path(__file__).resolve().parents[2]
HANDLER_FILE = ROOT / "assets" / "lambda" / "budget_guard" / "handler.py"
REGION = "us-west-2"
ACCOUNT = "123456789012"  # moto's account
CLUSTER = "trn1-llama"
WRITTEN = "2025-06-01 08:00:00.000000+00:00"  # when the head node last wrote the status
BUDGET_SUBJECT = "AWS Budgets: trainium-default has exceeded your alert threshold"
# AWS Budgets' notices are plain text, not JSON.
BUDGET_MESSAGE = """AWS Budget Notification June 15, 2025
AWS Account 123456789012

Dear AWS Customer,

You requested that we alert you when the ACTUAL Cost associated with your trainium-default budget is greater \
than $2,500.00 for the current month. The ACTUAL Cost associated with this budget is $2,517.42. You can find \
additional details below and by accessing the AWS Budgets dashboard [1].

Budget Name: trainium-default
Budget Type: Cost
Budgeted Amount: $2,500.00
Alert Type: ACTUAL
Alert Threshold: > $2,500.00
ACTUAL Amount: $2,517.42

[1] https://console.aws.amazon.com/billing/home#/budgets
"""


handler = load_handler_file(HANDLER_FILE, "budget_guard_handler")


def budget_event(topic_arn: str) -> dict[str, Any]:
    """What SNS hands a subscribed Lambda function: one record of the guard topic."""
    return {
        "Records": [
            {
                "EventSource": "aws:sns",
                "EventVersion": "1.0",
                "EventSubscriptionArn": f"{topic_arn}:2bcfbf39-05c3-41de-beaa-fcfcc21c8f55",
                "Sns": {
                    "Type": "Notification",
                    "MessageId": "95df01b4-ee98-5cb9-9903-4c221d41eb5e",
                    "TopicArn": topic_arn,
                    "Subject": BUDGET_SUBJECT,
                    "Message": BUDGET_MESSAGE,
                    "Timestamp": "2025-06-15T07:13:51.000Z",
                    "SignatureVersion": "1",
                    "Signature": "EXAMPLE",
                    "SigningCertUrl": "https://sns.us-west-2.amazonaws.com/SimpleNotificationService-0000.pem",
                    "UnsubscribeUrl": "https://sns.us-west-2.amazonaws.com/?Action=Unsubscribe",
                    "MessageAttributes": {},
                },
            }
        ]
    }


@dataclass
class Account:
    dynamodb: Any
    sqs: Any
    queue_url: str
    alarm_topic: str
    guard_topic: str

    def create_status_table(self, cluster: str = CLUSTER, status: str | None = "RUNNING") -> None:
        """The table as the cluster stack creates it, and the item as the head node writes it."""
        table = f"parallelcluster-{cluster}"
        self.dynamodb.create_table(
            TableName=table,
            AttributeDefinitions=[{"AttributeName": "Id", "AttributeType": "S"}],
            KeySchema=[{"AttributeName": "Id", "KeyType": "HASH"}],
            BillingMode="PAY_PER_REQUEST",
        )
        if status is not None:
            self.set_status(status, cluster)

    def set_status(self, status: str, cluster: str = CLUSTER) -> None:
        self.dynamodb.put_item(
            TableName=f"parallelcluster-{cluster}",
            Item={
                "Id": {"S": "COMPUTE_FLEET"},
                "Data": {"M": {"status": {"S": status}, "lastStatusUpdatedTime": {"S": WRITTEN}}},
            },
        )

    def notices(self) -> list[dict[str, str]]:
        """The notices published to the alarm topic: SNS's envelope as the subscribed queue received it."""
        response = self.sqs.receive_message(QueueUrl=self.queue_url, MaxNumberOfMessages=10)
        return [json.loads(message["Body"]) for message in response.get("Messages", [])]


@pytest.fixture
def account(monkeypatch: pytest.MonkeyPatch) -> Iterator[Account]:
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": REGION,
        "AWS_REGION": REGION,
    }.items():
        monkeypatch.setenv(key, value)
    with mock_aws():
        AWSApi.reset()  # ParallelCluster's client cache: new clients inside this mock
        sns = boto3.client("sns", region_name=REGION)
        sqs = boto3.client("sqs", region_name=REGION)
        alarm_topic = sns.create_topic(Name="trainium-default-alarms")["TopicArn"]
        guard_topic = sns.create_topic(Name="trainium-default-budget-guard")["TopicArn"]
        queue_url = sqs.create_queue(QueueName="alarm-inbox")["QueueUrl"]
        queue_arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        sns.subscribe(TopicArn=alarm_topic, Protocol="sqs", Endpoint=queue_arn)
        monkeypatch.setenv("CLUSTER_NAME", CLUSTER)
        monkeypatch.setenv("ALARM_TOPIC_ARN", alarm_topic)
        yield Account(boto3.client("dynamodb", region_name=REGION), sqs, queue_url, alarm_topic, guard_topic)
        AWSApi.reset()


def pcluster_manager(cluster: str = CLUSTER) -> ComputeFleetStatusManager:
    """ParallelCluster's status manager for a cluster of the pinned version."""
    return ComputeFleetStatusManager.get_manager(cluster, PARALLELCLUSTER_VERSION)


def test_a_running_fleet_is_asked_to_stop(account: Account) -> None:
    account.create_status_table()
    before = datetime.now(tz=timezone.utc)
    result = handler.handler(budget_event(account.guard_topic), None)
    assert result == {
        "cluster": CLUSTER,
        "outcome": "the compute fleet status changed from RUNNING to STOP_REQUESTED",
    }
    status, updated = pcluster_manager().get_status_with_last_updated_time()
    assert status == ComputeFleetStatus.STOP_REQUESTED
    # The time as ParallelCluster writes it (`str` of an aware UTC datetime), which its CLI parses back.
    assert before <= datetime.fromisoformat(updated) <= datetime.now(tz=timezone.utc)
    (notice,) = account.notices()
    assert notice["Subject"] == f"Budget guard stopped the compute fleet of {CLUSTER}"
    assert notice["TopicArn"] == account.alarm_topic
    assert "the compute fleet status changed from RUNNING to STOP_REQUESTED" in notice["Message"]
    assert f"--status START_REQUESTED --region {REGION}" in notice["Message"]
    assert notice["Message"].endswith(f"--- The budget notification: {BUDGET_SUBJECT} ---\n{BUDGET_MESSAGE}")


@pytest.mark.parametrize("status", ["STOP_REQUESTED", "STOPPING", "STOPPED"])
def test_a_stop_under_way_or_done_is_left_alone(account: Account, status: str) -> None:
    account.create_status_table(status=status)
    result = handler.handler(budget_event(account.guard_topic), None)
    assert result["outcome"] == f"the compute fleet was already {status}; nothing changed"
    assert pcluster_manager().get_status_with_last_updated_time() == (ComputeFleetStatus(status), WRITTEN)
    (notice,) = account.notices()
    assert notice["Subject"] == f"Budget guard stopped the compute fleet of {CLUSTER}"
    assert f"already {status}" in notice["Message"]


def test_a_repeated_notification_changes_nothing_more(account: Account) -> None:
    account.create_status_table()
    handler.handler(budget_event(account.guard_topic), None)
    first = pcluster_manager().get_status_with_last_updated_time()
    assert handler.handler(budget_event(account.guard_topic), None)["outcome"].endswith("nothing changed")
    assert pcluster_manager().get_status_with_last_updated_time() == first


@pytest.mark.parametrize("status", [*(s.value for s in ComputeFleetStatus), "PAUSED"])
def test_the_rules_are_parallelclusters(account: Account, status: str) -> None:
    """From every status, the handler ends where `pcluster update-compute-fleet --status STOP_REQUESTED`
    ends (ComputeFleetStatusManager.update_status), and fails where it fails."""
    account.create_status_table("theirs", status=status)
    account.create_status_table(CLUSTER, status=status)
    try:
        pcluster_manager("theirs").update_status(
            ComputeFleetStatus.STOP_REQUESTED, ComputeFleetStatus.STOPPING, ComputeFleetStatus.STOPPED
        )
        theirs_failed = False
    except Exception:
        theirs_failed = True
    try:
        handler.handler(budget_event(account.guard_topic), None)
        ours_failed = False
    except handler.FleetNotStopped:
        ours_failed = True

    def stored(cluster: str) -> str:
        item = account.dynamodb.get_item(TableName=f"parallelcluster-{cluster}", Key={"Id": {"S": "COMPUTE_FLEET"}})
        return str(item["Item"]["Data"]["M"]["status"]["S"])

    assert (ours_failed, stored(CLUSTER)) == (theirs_failed, stored("theirs"))
    # Stated once more, plainly: a readable status ends in a stop; UNKNOWN and unknown values are refused.
    if status in ("UNKNOWN", "PAUSED"):
        assert (ours_failed, stored(CLUSTER)) == (True, status)
    elif status in ("STOP_REQUESTED", "STOPPING", "STOPPED"):
        assert (ours_failed, stored(CLUSTER)) == (False, status)
    else:
        assert (ours_failed, stored(CLUSTER)) == (False, "STOP_REQUESTED")


@pytest.mark.parametrize("status", ["UNKNOWN", "PAUSED", None])
def test_a_status_parallelcluster_cannot_change_fails_and_is_reported(account: Account, status: str | None) -> None:
    account.create_status_table(status=status)
    found = "no status" if status is None else f"status {status!r}"
    with pytest.raises(handler.FleetNotStopped) as raised:
        handler.handler(budget_event(account.guard_topic), None)
    assert str(raised.value) == (
        f"compute fleet of {CLUSTER} not stopped: parallelcluster-{CLUSTER} holds {found} for COMPUTE_FLEET, so "
        f"ParallelCluster cannot change it either (run `pcluster describe-compute-fleet --cluster-name {CLUSTER}`)"
    )
    (notice,) = account.notices()
    assert notice["Subject"] == f"Budget guard FAILED to stop the compute fleet of {CLUSTER}"
    assert "NOT stopped" in notice["Message"] and BUDGET_MESSAGE in notice["Message"]


def test_a_missing_table_fails_with_one_clear_line_and_is_still_reported(account: Account) -> None:
    with pytest.raises(handler.FleetNotStopped) as raised:
        handler.handler(budget_event(account.guard_topic), None)
    reason = (
        f"DynamoDB table parallelcluster-{CLUSTER} does not exist: cluster {CLUSTER} is not deployed in this "
        "account and region (or is being created or deleted), so there is no compute fleet to stop"
    )
    assert str(raised.value) == f"compute fleet of {CLUSTER} not stopped: {reason}"
    assert "\n" not in str(raised.value)
    (notice,) = account.notices()
    assert notice["Subject"] == f"Budget guard FAILED to stop the compute fleet of {CLUSTER}"
    assert reason in notice["Message"]
    assert f"--status STOP_REQUESTED --region {REGION}" in notice["Message"]


def test_a_status_changed_by_another_writer_is_read_again(account: Account) -> None:
    """Between the handler's read (RUNNING) and its conditional update, someone else requests the stop and
    clustermgtd moves on to STOPPING: the update's condition fails, and the new status is already a stop."""
    account.create_status_table()
    changed: list[bool] = []

    def someone_else_stops_first(**_: Any) -> None:
        if not changed:
            changed.append(True)
            account.set_status("STOPPING")

    def client(service: str) -> Any:
        made = handler.aws_client(service)
        made.meta.events.register("before-call.dynamodb.UpdateItem", someone_else_stops_first)
        return made

    result = handler.handler(budget_event(account.guard_topic), None, client=client)
    assert result["outcome"] == "the compute fleet was already STOPPING; nothing changed"
    assert pcluster_manager().get_status() == ComputeFleetStatus.STOPPING


def test_a_status_that_keeps_changing_fails_after_a_few_attempts(account: Account) -> None:
    account.create_status_table()
    flip = iter(["STARTING", "RUNNING", "STARTING", "RUNNING"])

    def someone_else_writes(**_: Any) -> None:
        account.set_status(next(flip))

    def client(service: str) -> Any:
        made = handler.aws_client(service)
        made.meta.events.register("before-call.dynamodb.UpdateItem", someone_else_writes)
        return made

    with pytest.raises(handler.FleetNotStopped, match=r"kept changing .*\(read RUNNING, STARTING, RUNNING\)"):
        handler.handler(budget_event(account.guard_topic), None, client=client)
    assert len(account.notices()) == 1


def test_a_notice_that_cannot_be_published_fails_the_invocation(
    account: Account, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fleet is stopped, but nobody would know: fail, so the retry (a no-op stop) publishes again."""
    account.create_status_table()
    monkeypatch.setenv("ALARM_TOPIC_ARN", f"arn:aws:sns:{REGION}:{ACCOUNT}:deleted-topic")
    with pytest.raises(Exception, match="NotFound"):
        handler.handler(budget_event(account.guard_topic), None)
    assert pcluster_manager().get_status() == ComputeFleetStatus.STOP_REQUESTED
