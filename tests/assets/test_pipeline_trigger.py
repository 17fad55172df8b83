"""Tests of the pipeline custom resource's Lambda handlers (assets/lambda/pipeline_trigger/: handler.py, trigger_*.py).

AWS is moto where moto implements the call (SSM SendCommand, GetCommandInvocation and ListCommands to
read back what was sent; S3 for the command output SSM writes there), and botocore's Stubber, which checks
parameters and responses against the real API models, where it does not: DescribeInstanceInformation (not
implemented by moto 5.2), command statuses moto cannot produce (InProgress, Failed with output), and the
FSx data repository tasks. The scripts themselves are run in test_pipeline_trigger_scripts.py.
"""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.response import StreamingBody
from botocore.stub import Stubber
from moto import mock_aws

from tests.support.parallelcluster_shell import load_pipeline_handler, load_pipeline_trigger_module
from tests.support.pipeline_trigger import FILE_SYSTEM, HEAD_NODE, OUTPUT_BUCKET, SITE, properties
from training.pipeline.run_record import RUN_ID

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)

ROOT = Path(__file__).resolve().parents[2]
BASH = shutil.which("bash") or "/bin/bash"
REGION = "us-west-2"
NOW = 1_750_000_000.0
COMMAND = "0b2f7f4e-2a55-4a3e-9a41-3c8d54f1e7a1"  # SSM command ids are UUIDs
RUN_RECORD = {
    "run_id": "set-by-test",
    "recipe": "llama31-8b-cpt",
    "stages": ["prepare", "convert-in", "compile", "train", "convert-out", "sample", "export"],
    "submissions": [
        {"time": "2025-06-15T00:00:00+00:00", "jobs": {"prepare": "7", "convert-in": "8", "compile": "9"}},
        {
            "time": "2025-06-15T01:00:00+00:00",
            "jobs": {"compile": "19", "train": "20", "convert-out": "21", "sample": "22", "export": "23"},
        },
    ],
}
JOB_IDS = "prepare=7,convert-in=8,compile=19,train=20,convert-out=21,sample=22,export=23"


handler = load_pipeline_handler()
parsing = load_pipeline_trigger_module("trigger_properties")
scripts = load_pipeline_trigger_module("trigger_scripts")
aws_api = load_pipeline_trigger_module("trigger_aws")
phases = load_pipeline_trigger_module("trigger_phases")


# --- Events and clients -----------------------------------------------------------------------------------


def cfn_event(request: str, props: dict[str, Any], old: dict[str, Any] | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {
        "RequestType": request,
        "ServiceToken": props["ServiceToken"],
        "ResponseURL": "https://cloudformation-custom-resource-response-uswest2.s3.amazonaws.com/x",
        "StackId": "arn:aws:cloudformation:us-west-2:123456789012:stack/trn1/guid",
        "RequestId": "request-1",
        "LogicalResourceId": "PipelineRun",
        "ResourceType": "Custom::PipelineRun",
        "ResourceProperties": props,
    }
    if request != "Create":
        event["PhysicalResourceId"] = "pipeline-trn1-llama"
    if old is not None:
        event["OldResourceProperties"] = old
    return event


def poll_event(event: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """What the Provider framework passes to isComplete: the event with onEvent's result merged in."""
    return {**event, **result}


def clients(**by_service: Any) -> Callable[[str], Any]:
    def factory(service: str) -> Any:
        if service not in by_service:
            raise AssertionError(f"the handler asked for an unexpected {service} client")
        return by_service[service]

    return factory


def no_clients(service: str) -> Any:
    raise AssertionError(f"the handler must not call AWS here (asked for {service})")


class Routed:
    """One service's client: the listed operations go to a Stubber-backed client, all others to moto."""

    def __init__(self, moto_client: Any, stubbed_client: Any, operations: set[str]) -> None:
        self._moto, self._stubbed, self._operations = moto_client, stubbed_client, operations

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stubbed if name in self._operations else self._moto, name)


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """moto's in-process AWS, with fake credentials so nothing can reach a real account."""
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": REGION,
    }.items():
        monkeypatch.setenv(name, value)
    with mock_aws():
        yield


@pytest.fixture
def stubbers() -> Iterator[Callable[[str], tuple[Any, Stubber]]]:
    """Stubber-backed clients; every queued response must have been used by the end of the test."""
    made: list[Stubber] = []

    def make(service: str) -> tuple[Any, Stubber]:
        client = boto3.client(service, region_name=REGION, aws_access_key_id="testing", aws_secret_access_key="testing")
        stubber = Stubber(client)
        stubber.activate()
        made.append(stubber)
        return client, stubber

    yield make
    for stubber in made:
        stubber.assert_no_pending_responses()


def instance_information(ping: str = "Online") -> dict[str, Any]:
    return {
        "InstanceInformationList": [
            {
                "InstanceId": HEAD_NODE,
                "PingStatus": ping,
                "LastPingDateTime": datetime(2025, 6, 15, tzinfo=timezone.utc),
                "AgentVersion": "3.3.1611.0",
                "IsLatestVersion": False,
                "PlatformType": "Linux",
                "PlatformName": "Ubuntu",
                "PlatformVersion": "22.04",
                "ResourceType": "EC2Instance",
                "IPAddress": "10.0.1.10",
                "ComputerName": "ip-10-0-1-10",
            }
        ]
    }


DESCRIBE_HEAD_NODE = {"Filters": [{"Key": "InstanceIds", "Values": [HEAD_NODE]}]}


def invocation(command_id: str, status: str, stdout: str = "", stderr: str = "", code: int = -1) -> dict[str, Any]:
    """A GetCommandInvocation response as SSM returns it."""
    done = status not in ("Pending", "InProgress", "Delayed")
    return {
        "CommandId": command_id,
        "InstanceId": HEAD_NODE,
        "Comment": "submit pipeline run",
        "DocumentName": "AWS-RunShellScript",
        "DocumentVersion": "$DEFAULT",
        "PluginName": "aws:runShellScript",
        "ResponseCode": code,
        "ExecutionStartDateTime": "2025-06-15T00:00:01.000Z",
        "ExecutionElapsedTime": "PT12.5S" if done else "",
        "ExecutionEndDateTime": "2025-06-15T00:00:13.500Z" if done else "",
        "Status": status,
        "StatusDetails": status,
        "StandardOutputContent": stdout,
        "StandardOutputUrl": "",
        "StandardErrorContent": stderr,
        "StandardErrorUrl": "",
        "CloudWatchOutputConfig": {"CloudWatchOutputEnabled": False},
    }


def export_task(
    lifecycle: str, *, created: float = NOW + 30, paths: list[str] | None = None, **extra: Any
) -> dict[str, Any]:
    """A data repository task as FSx describes it."""
    task = {
        "TaskId": f"task-{int(created):x}",
        "Lifecycle": lifecycle,
        "Type": "EXPORT_TO_REPOSITORY",
        "CreationTime": datetime.fromtimestamp(created, tz=timezone.utc),
        "ResourceARN": f"arn:aws:fsx:us-west-2:123456789012:task/task-{int(created):x}",
        "FileSystemId": FILE_SYSTEM,
        "Paths": ["runs"] if paths is None else paths,
        "Status": {"TotalCount": 10, "SucceededCount": 10, "FailedCount": 0},
        "Report": {"Enabled": False},
    }
    return task | extra


DESCRIBE_TASKS = {"Filters": [{"Name": "file-system-id", "Values": [FILE_SYSTEM]}]}
CREATE_TASK = {
    "Type": "EXPORT_TO_REPOSITORY",
    "FileSystemId": FILE_SYSTEM,
    "Paths": ["runs"],
    "Report": {"Enabled": False},
    "ClientRequestToken": f"pipeline-export-{int(NOW)}",
}


def sent_commands() -> list[dict[str, Any]]:
    return list(boto3.client("ssm", region_name=REGION).list_commands()["Commands"])


def expected_run_id(props: dict[str, Any]) -> str:
    return str(parsing.run_id_of(parsing.parse_properties(props)))


def submitted(
    stubbers: Callable[[str], tuple[Any, Stubber]], props: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """on_event Create with a managed head node: DescribeInstanceInformation stubbed, SendCommand in moto."""
    stubbed, stubber = stubbers("ssm")
    stubber.add_response("describe_instance_information", instance_information(), DESCRIBE_HEAD_NODE)
    ssm = Routed(boto3.client("ssm", region_name=REGION), stubbed, {"describe_instance_information"})
    event = cfn_event("Create", props)
    return event, handler.on_event(event, None, clients=clients(ssm=ssm), now=lambda: NOW)


# --- Run id -----------------------------------------------------------------------------------------------


def test_run_id_depends_on_the_run_number_recipe_and_overrides_only() -> None:
    run_id = parsing.derive_run_id("default", "llama31-8b-cpt", ["steps=100"], "1")
    assert run_id.startswith("default-llama31-8b-cpt-") and len(run_id) == len("default-llama31-8b-cpt-") + 10
    assert run_id == parsing.derive_run_id("default", "llama31-8b-cpt", ["steps=100"], "1")
    others = {
        parsing.derive_run_id("default", "mixtral-8x7b-sft", ["steps=100"], "1"),
        parsing.derive_run_id("default", "llama31-8b-cpt", ["steps=200"], "1"),
        parsing.derive_run_id("default", "llama31-8b-cpt", [], "1"),
        parsing.derive_run_id("default", "llama31-8b-cpt", ["steps=100"], "2"),
    }
    assert run_id not in others and len(others) == 4


@pytest.mark.parametrize(
    ("environment", "recipe"),
    [("default", "llama31-8b-cpt"), ("my env", "../recipes/x y.yaml"), ("-x" * 40, "r" * 80), ("", "")],
)
def test_run_id_is_accepted_by_training_submit(environment: str, recipe: str) -> None:
    run_id = parsing.derive_run_id(environment, recipe, ["a=b"], "12")
    assert RUN_ID.match(run_id), run_id
    assert len(run_id) <= 64


# --- Create / Update --------------------------------------------------------------------------------------


def test_create_submits_on_the_head_node(aws: None, stubbers: Callable[[str], tuple[Any, Stubber]]) -> None:
    props = properties()
    _, result = submitted(stubbers, props)

    run_id = expected_run_id(props)
    (command,) = sent_commands()
    assert result == {
        "PhysicalResourceId": "pipeline-trn1-llama",
        "Data": {
            "RunId": run_id,
            "RunDir": f"/fsx/runs/{run_id}",
            "JobIds": "",
            "CommandId": command["CommandId"],
            "Phase": "submit",
            "StartedAt": str(int(NOW)),
            "RunStatus": "submitting",
        },
    }
    assert command["Comment"] == f"submit pipeline run {run_id} at {int(NOW)}"
    assert command["DocumentName"] == "AWS-RunShellScript"
    assert command["InstanceIds"] == [HEAD_NODE]
    assert command["OutputS3BucketName"] == OUTPUT_BUCKET
    assert command["OutputS3KeyPrefix"] == "pipeline/ssm"
    assert command["TimeoutSeconds"] == 1800
    script = scripts.submit_script(parsing.parse_properties(props), run_id)
    assert command["Parameters"] == {"commands": script.splitlines(), "executionTimeout": ["1800"]}
    assert command["Parameters"]["commands"][0] == "#!/bin/bash"  # SSM runs the file: bash, not sh
    submit_line = next(
        i for i, line in enumerate(script.splitlines()) if line.startswith('"$python" -m training submit')
    )
    assert script.splitlines()[submit_line : submit_line + 5] == [
        '"$python" -m training submit \\',
        "  --recipe llama31-8b-cpt \\",
        f"  --run-id {run_id} \\",
        '  --site "$site_file" \\',
        "  steps=100 \\",
    ]


def test_start_run_false_does_nothing() -> None:
    event = cfn_event("Create", properties(StartRun="false"))
    result = handler.on_event(event, None, clients=no_clients, now=lambda: NOW)
    assert result["PhysicalResourceId"] == "pipeline-trn1-llama"
    assert result["Data"] | {"StartedAt": ""} == {
        "RunId": "",
        "RunDir": "",
        "JobIds": "",
        "CommandId": "",
        "Phase": "none",
        "StartedAt": "",
        "RunStatus": "no-run",
    }
    assert handler.is_complete(poll_event(event, result), None, clients=no_clients, now=lambda: NOW) == {
        "IsComplete": True
    }


def test_update_with_nothing_relevant_changed_does_nothing() -> None:
    old = properties()
    # A deploy of new code: new source, new head node (a replaced cluster), other timeouts. No new run.
    new = properties(
        TimeoutSeconds="900",
        HeadNodeInstanceId="i-0fedcba9876543210",
        SiteSettings=json.dumps(SITE),
        SourceHash="99ffee00",
        SourceKey="99ffee00.zip",
    )
    event = cfn_event("Update", new, old)

    result = handler.on_event(event, None, clients=no_clients, now=lambda: NOW)

    run_id = expected_run_id(old)
    assert result["PhysicalResourceId"] == "pipeline-trn1-llama"
    assert {k: result["Data"][k] for k in ("RunId", "RunDir", "JobIds", "CommandId", "Phase")} == {
        "RunId": run_id,
        "RunDir": f"/fsx/runs/{run_id}",
        "JobIds": "",  # not known without asking the cluster; see the handler's docstring
        "CommandId": "",
        "Phase": "unchanged",
    }
    assert handler.is_complete(poll_event(event, result), None, clients=no_clients, now=lambda: NOW) == {
        "IsComplete": True
    }


@pytest.mark.parametrize(
    "change",
    [
        {"Recipe": "mixtral-8x7b-sft"},
        {"Run": "2", "SourceHash": "99ffee00", "SourceKey": "99ffee00.zip"},
        {"RecipeOverrides": ["steps=200"]},
    ],
    ids=["recipe", "run-number", "overrides"],
)
@pytest.mark.parametrize("old_start", ["true", "false"])
def test_update_with_a_new_run_submits_it_and_leaves_the_old_one(
    aws: None, stubbers: Callable[[str], tuple[Any, Stubber]], change: dict[str, Any], old_start: str
) -> None:
    old, new = properties(StartRun=old_start), properties(**change)
    stubbed, stubber = stubbers("ssm")
    stubber.add_response("describe_instance_information", instance_information(), DESCRIBE_HEAD_NODE)
    ssm = Routed(boto3.client("ssm", region_name=REGION), stubbed, {"describe_instance_information"})

    result = handler.on_event(cfn_event("Update", new, old), None, clients=clients(ssm=ssm), now=lambda: NOW)

    old_id, new_id = expected_run_id(old), expected_run_id(new)
    assert new_id != old_id
    assert result["PhysicalResourceId"] == "pipeline-trn1-llama"
    assert result["Data"]["RunId"] == new_id and result["Data"]["Phase"] == "submit"
    (command,) = sent_commands()  # one submit; no cancel of the old run
    commands = "\n".join(command["Parameters"]["commands"])
    assert f"--run-id {new_id}" in commands
    assert old_id not in commands and "training cancel" not in commands


def test_update_from_start_run_true_to_false_does_nothing() -> None:
    event = cfn_event("Update", properties(StartRun="false"), properties())
    result = handler.on_event(event, None, clients=no_clients, now=lambda: NOW)
    assert result["Data"]["Phase"] == "none" and result["Data"]["RunId"] == ""


def test_first_deploy_waits_for_the_head_node_to_come_online_then_submits_once(
    aws: None, stubbers: Callable[[str], tuple[Any, Stubber]]
) -> None:
    """A new cluster's head node registers with SSM minutes after the cluster reports it: the first deploy with
    start_run true waits for it through the polls, sends one submit command, and finds it again by its comment."""
    props = properties()
    run_id = expected_run_id(props)
    stubbed, stubber = stubbers("ssm")
    ssm = Routed(
        boto3.client("ssm", region_name=REGION), stubbed, {"describe_instance_information", "get_command_invocation"}
    )
    stubber.add_response("describe_instance_information", {"InstanceInformationList": []}, DESCRIBE_HEAD_NODE)
    event = cfn_event("Create", props)
    result = handler.on_event(event, None, clients=clients(ssm=ssm), now=lambda: NOW)
    assert (result["Data"]["Phase"], result["Data"]["CommandId"], result["Data"]["RunStatus"]) == (
        "submit",
        "",
        "submitting",
    )
    assert sent_commands() == []

    stubber.add_response("describe_instance_information", instance_information("ConnectionLost"), DESCRIBE_HEAD_NODE)
    polled = handler.is_complete(poll_event(event, result), None, clients=clients(ssm=ssm), now=lambda: NOW + 60)
    assert polled == {"IsComplete": False} and sent_commands() == []

    stubber.add_response("describe_instance_information", instance_information(), DESCRIBE_HEAD_NODE)
    stubber.add_response("get_command_invocation", invocation(COMMAND, "InProgress"))
    polled = handler.is_complete(poll_event(event, result), None, clients=clients(ssm=ssm), now=lambda: NOW + 120)
    assert polled == {"IsComplete": False}
    (command,) = sent_commands()
    assert command["Comment"] == f"submit pipeline run {run_id} at {int(NOW)}"
    assert command["TimeoutSeconds"] == 1800 - 120  # what remains of the bound

    stdout = f"{scripts.MARKER}{json.dumps(RUN_RECORD | {'run_id': run_id})}\n"
    stubber.add_response(
        "get_command_invocation",
        invocation(command["CommandId"], "Success", stdout, code=0),
        {"CommandId": command["CommandId"], "InstanceId": HEAD_NODE},
    )
    s3, _ = stubbers("s3")  # the record is inline: nothing read from S3
    polled = handler.is_complete(
        poll_event(event, result), None, clients=clients(ssm=ssm, s3=s3), now=lambda: NOW + 180
    )
    assert polled["IsComplete"] is True
    assert (polled["Data"]["RunId"], polled["Data"]["RunStatus"]) == (run_id, "submitted")
    assert len(sent_commands()) == 1  # found again, not sent twice


TOPIC = "arn:aws:sns:us-west-2:123456789012:trainium-default-alarms"


@pytest.mark.parametrize(
    ("response", "why"),
    [
        (
            {"InstanceInformationList": []},
            "no SSM agent has registered it: is the instance running, with AmazonSSMManagedInstanceCore?",
        ),
        (instance_information("ConnectionLost"), "SSM agent ping status ConnectionLost"),
    ],
)
def test_a_head_node_never_online_completes_without_a_run_and_says_why(
    aws: None, stubbers: Callable[[str], tuple[Any, Stubber]], response: dict[str, Any], why: str
) -> None:
    """Failing here would roll back the cluster, the file system and the network of a first deploy."""
    props = properties(NoticeTopicArn=TOPIC)
    stubbed, stubber = stubbers("ssm")
    ssm = Routed(boto3.client("ssm", region_name=REGION), stubbed, {"describe_instance_information"})
    stubber.add_response("describe_instance_information", response, DESCRIBE_HEAD_NODE)
    event = cfn_event("Create", props)
    result = handler.on_event(event, None, clients=clients(ssm=ssm), now=lambda: NOW)
    stubber.add_response("describe_instance_information", response, DESCRIBE_HEAD_NODE)
    reason = f"head node {HEAD_NODE} did not come online in SSM within 1800 s ({why}); the run was not submitted"
    sns, sns_stubber = stubbers("sns")
    sns_stubber.add_response(
        "publish",
        {"MessageId": "1"},
        {
            "TopicArn": TOPIC,
            "Subject": "Training run of default not started",
            "Message": "The deploy of environment default could not start its training run: "
            f"{reason}\n\n{phases.RETRY_HINT}",
        },
    )

    polled = handler.is_complete(
        poll_event(event, result), None, clients=clients(ssm=ssm, sns=sns), now=lambda: NOW + 1801
    )

    assert not_started_reason(polled) == reason
    assert sent_commands() == []


def test_a_submit_that_cannot_be_sent_completes_without_a_run(
    aws: None, stubbers: Callable[[str], tuple[Any, Stubber]]
) -> None:
    stubbed, stubber = stubbers("ssm")
    stubber.add_response("describe_instance_information", instance_information(), DESCRIBE_HEAD_NODE)
    stubber.add_client_error("send_command", "InvalidDocument", "Document AWS-RunShellScript does not exist")
    event = cfn_event("Create", properties())

    result = handler.on_event(event, None, clients=clients(ssm=stubbed), now=lambda: NOW)

    assert result["Data"]["Phase"] == "not-started"
    assert result["Data"]["RunStatus"] == (
        f"not-started: sending the submit command to head node {HEAD_NODE} failed: "
        "Document AWS-RunShellScript does not exist"
    )
    assert handler.is_complete(poll_event(event, result), None, clients=no_clients, now=lambda: NOW) == {
        "IsComplete": True
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"StartRun": "yes"}, "property StartRun must be 'true' or 'false'"),
        ({"SiteSettings": "{not json"}, "property SiteSettings is not JSON"),
        ({"SiteSettings": json.dumps(SITE | {"runs_root": "/home/runs"})}, "is not below FileSystemMountDir /fsx"),
        ({"RecipeOverrides": ["--dry-run"]}, "property RecipeOverrides: '--dry-run' is not key=value"),
        ({"HeadNodeInstanceId": ""}, "property HeadNodeInstanceId is missing"),
        ({"Run": "1; reboot"}, "property Run must be letters, digits"),
        ({"NeuronRelease": None}, "SharedEnvironmentPath and NeuronRelease go together"),
        ({"SharedEnvironmentPath": "envs/x"}, "property SharedEnvironmentPath must be an absolute path"),
        ({"NeuronRelease": "latest"}, "property NeuronRelease must look like 2.28.1"),
        (
            {"RequirementsInSource": "../../etc/passwd"},
            "property RequirementsInSource must name a locked requirement set of the source",
        ),
    ],
)
def test_bad_properties_fail_at_once_with_their_name(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        handler.on_event(cfn_event("Create", properties(**change)), None, clients=clients(ssm=None), now=lambda: NOW)


# --- is_complete of the submission ------------------------------------------------------------------------


def test_submission_success_reads_the_run_record_from_s3(
    aws: None, stubbers: Callable[[str], tuple[Any, Stubber]]
) -> None:
    """moto's invocation succeeds with no inline output, as a long output would leave the marker out of it."""
    props = properties()
    event, result = submitted(stubbers, props)
    command_id, run_id = result["Data"]["CommandId"], result["Data"]["RunId"]
    s3 = boto3.client("s3", region_name=REGION)
    s3.create_bucket(Bucket=OUTPUT_BUCKET, CreateBucketConfiguration={"LocationConstraint": REGION})
    folder = f"pipeline/ssm/{command_id}/{HEAD_NODE}/awsrunShellScript/0.awsrunShellScript"
    stdout = (
        "x" * 30000 + f"\nrun {run_id}: submitted ...\n{scripts.MARKER}{json.dumps(RUN_RECORD | {'run_id': run_id})}\n"
    )
    s3.put_object(Bucket=OUTPUT_BUCKET, Key=f"{folder}/stdout", Body=stdout.encode())

    polled = handler.is_complete(
        poll_event(event, result),
        None,
        clients=clients(ssm=boto3.client("ssm", region_name=REGION), s3=s3),
        now=lambda: NOW + 20,
    )

    assert polled == {
        "IsComplete": True,
        "Data": {"RunId": run_id, "RunDir": f"/fsx/runs/{run_id}", "JobIds": JOB_IDS, "RunStatus": "submitted"},
    }


def not_started_reason(polled: dict[str, Any]) -> str:
    """The reason of a run that could not start: the resource completes, and says why."""
    assert polled["IsComplete"] is True
    assert {key: polled["Data"][key] for key in ("RunId", "RunDir", "JobIds")} == {
        "RunId": "",
        "RunDir": "",
        "JobIds": "",
    }
    status = str(polled["Data"]["RunStatus"])
    assert status.startswith("not-started: ")
    return status.removeprefix("not-started: ")


def submit_state(props: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    event = cfn_event("Create", props)
    result = {
        "PhysicalResourceId": "pipeline-trn1-llama",
        "Data": phases.data(run_id=expected_run_id(props), run_dir="", command=COMMAND, phase="submit", started=NOW),
    }
    return event, result


def test_submission_success_with_the_record_inline(stubbers: Callable[[str], tuple[Any, Stubber]]) -> None:
    props = properties()
    event, result = submit_state(props)
    run_id = expected_run_id(props)
    ssm, stubber = stubbers("ssm")
    stdout = f"run {run_id}: submitted prepare=7\n{scripts.MARKER}{json.dumps(RUN_RECORD | {'run_id': run_id})}\n"
    stubber.add_response(
        "get_command_invocation",
        invocation(COMMAND, "Success", stdout, code=0),
        {"CommandId": COMMAND, "InstanceId": HEAD_NODE},
    )
    s3, _ = stubbers("s3")  # nothing queued: reading S3 would fail the test

    polled = handler.is_complete(poll_event(event, result), None, clients=clients(ssm=ssm, s3=s3), now=lambda: NOW)

    assert polled["IsComplete"] is True and polled["Data"]["JobIds"] == JOB_IDS


@pytest.mark.parametrize("status", ["Pending", "InProgress", "Delayed"])
def test_submission_in_progress_is_not_complete(stubbers: Callable[[str], tuple[Any, Stubber]], status: str) -> None:
    event, result = submit_state(properties())
    ssm, stubber = stubbers("ssm")
    stubber.add_response(
        "get_command_invocation", invocation(COMMAND, status), {"CommandId": COMMAND, "InstanceId": HEAD_NODE}
    )

    polled = handler.is_complete(poll_event(event, result), None, clients=clients(ssm=ssm), now=lambda: NOW + 60)

    assert polled == {"IsComplete": False}  # the framework refuses Data while not complete


def test_submission_not_yet_registered_is_not_complete(stubbers: Callable[[str], tuple[Any, Stubber]]) -> None:
    event, result = submit_state(properties())
    ssm, stubber = stubbers("ssm")
    stubber.add_client_error("get_command_invocation", "InvocationDoesNotExist", http_status_code=400)

    polled = handler.is_complete(poll_event(event, result), None, clients=clients(ssm=ssm), now=lambda: NOW + 1)

    assert polled == {"IsComplete": False}


def test_submission_times_out_within_one_poll(stubbers: Callable[[str], tuple[Any, Stubber]]) -> None:
    event, result = submit_state(properties(TimeoutSeconds="600"))
    ssm, stubber = stubbers("ssm")
    stubber.add_response("get_command_invocation", invocation(COMMAND, "InProgress"))

    reason = not_started_reason(
        handler.is_complete(poll_event(event, result), None, clients=clients(ssm=ssm), now=lambda: NOW + 601)
    )

    assert reason.startswith(f"timed out after 600 s waiting for the submit command {COMMAND} of run ")
    assert "(status InProgress)" in reason


def test_submission_failure_reason_has_the_cli_error(stubbers: Callable[[str], tuple[Any, Stubber]]) -> None:
    event, result = submit_state(properties())
    ssm, stubber = stubbers("ssm")
    stdout = "\n".join(f"line {i}" for i in range(40)) + "\n"
    stderr = "error: sbatch --parsable failed: sbatch: error: invalid partition specified: compute9\n"
    stubber.add_response("get_command_invocation", invocation(COMMAND, "Failed", stdout, stderr, code=2))
    s3, _ = stubbers("s3")  # the inline output is complete: no S3 read

    message = not_started_reason(
        handler.is_complete(poll_event(event, result), None, clients=clients(ssm=ssm, s3=s3), now=lambda: NOW + 30)
    )
    assert "\n" not in message
    assert message.startswith(
        f"submit command {COMMAND} of run {expected_run_id(properties())} on head node {HEAD_NODE} Failed (exit 2): "
    )
    assert message.endswith("error: sbatch --parsable failed: sbatch: error: invalid partition specified: compute9")
    assert "line 39" in message and "line 21" in message and "line 20" not in message  # the last 20 lines


def test_submission_failure_with_cut_output_reads_the_tail_from_s3(
    aws: None, stubbers: Callable[[str], tuple[Any, Stubber]]
) -> None:
    event, result = submit_state(properties())
    ssm, stubber = stubbers("ssm")
    stubber.add_response("get_command_invocation", invocation(COMMAND, "Failed", "y" * 24000, "", code=1))
    s3 = boto3.client("s3", region_name=REGION)
    s3.create_bucket(Bucket=OUTPUT_BUCKET, CreateBucketConfiguration={"LocationConstraint": REGION})
    folder = f"pipeline/ssm/{COMMAND}/{HEAD_NODE}/awsrunShellScript/0.awsrunShellScript"
    s3.put_object(Bucket=OUTPUT_BUCKET, Key=f"{folder}/stdout", Body=("y" * 100000 + "\nfetching source\n").encode())
    s3.put_object(
        Bucket=OUTPUT_BUCKET,
        Key=f"{folder}/stderr",
        Body=b"fatal error: An error occurred (403) when calling the HeadObject operation: Forbidden\n",
    )

    message = not_started_reason(
        handler.is_complete(poll_event(event, result), None, clients=clients(ssm=ssm, s3=s3), now=lambda: NOW + 30)
    )
    assert "Failed (exit 1)" in message and "fetching source" in message
    assert message.endswith("HeadObject operation: Forbidden")
    assert len(message) <= scripts.MAX_REASON


def test_submission_success_without_a_run_record_fails(stubbers: Callable[[str], tuple[Any, Stubber]]) -> None:
    event, result = submit_state(properties())
    ssm, stubber = stubbers("ssm")
    stubber.add_response("get_command_invocation", invocation(COMMAND, "Success", "done\n", code=0))
    s3, s3_stubber = stubbers("s3")
    folder = f"pipeline/ssm/{COMMAND}/{HEAD_NODE}/awsrunShellScript/0.awsrunShellScript"
    for name in ("stdout", "stderr"):  # SSM could not write the output (e.g. the head node's role lacks it)
        s3_stubber.add_client_error(
            "get_object",
            "AccessDenied",
            "Access Denied",
            http_status_code=403,
            expected_params={"Bucket": OUTPUT_BUCKET, "Key": f"{folder}/{name}", "Range": "bytes=-65536"},
        )

    polled = handler.is_complete(poll_event(event, result), None, clients=clients(ssm=ssm, s3=s3), now=lambda: NOW)
    assert not_started_reason(polled).endswith("succeeded but printed no PIPELINE-RUN line: done")


def test_output_is_read_at_the_keys_of_the_invocation_urls(stubbers: Callable[[str], tuple[Any, Stubber]]) -> None:
    event, result = submit_state(properties())
    folder = f"pipeline/ssm/{COMMAND}/{HEAD_NODE}/awsrunShellScript/0.awsrunShellScript"
    failed = invocation(COMMAND, "Failed", "z" * 24000, "", code=1) | {
        "StandardOutputUrl": f"https://s3.us-west-2.amazonaws.com/{OUTPUT_BUCKET}/{folder}/stdout",
        "StandardErrorUrl": f"https://{OUTPUT_BUCKET}.s3.us-west-2.amazonaws.com/{folder}/stderr",
    }
    ssm, stubber = stubbers("ssm")
    stubber.add_response("get_command_invocation", failed)
    s3, s3_stubber = stubbers("s3")
    for name, text in (("stdout", b"zzz\nunzipping\n"), ("stderr", b"error: no space left on device\n")):
        s3_stubber.add_response(
            "get_object",
            {"Body": StreamingBody(io.BytesIO(text), len(text)), "ContentLength": len(text)},
            {"Bucket": OUTPUT_BUCKET, "Key": f"{folder}/{name}", "Range": "bytes=-65536"},
        )

    polled = handler.is_complete(poll_event(event, result), None, clients=clients(ssm=ssm, s3=s3), now=lambda: NOW)
    assert not_started_reason(polled).endswith("Failed (exit 1): zzz | unzipping | error: no space left on device")


@pytest.mark.parametrize(
    ("url", "key"),
    [
        (
            "https://s3.us-west-2.amazonaws.com/b/p/c/i/awsrunShellScript/0.awsrunShellScript/stdout",
            "p/c/i/awsrunShellScript/0.awsrunShellScript/stdout",
        ),
        ("https://b.s3.us-west-2.amazonaws.com/p/x%20y/stderr", "p/x y/stderr"),
        ("https://s3.amazonaws.com/other-bucket/p/stdout", None),
        ("", None),
    ],
)
def test_key_from_url(url: str, key: str | None) -> None:
    assert aws_api.key_from_url(url, "b") == key


# --- Delete -----------------------------------------------------------------------------------------------


def test_delete_with_a_live_head_node_cancels_then_exports(
    aws: None, stubbers: Callable[[str], tuple[Any, Stubber]]
) -> None:
    props = properties()
    run_id = expected_run_id(props)
    event = cfn_event("Delete", props)
    stubbed, stubber = stubbers("ssm")
    stubber.add_response("describe_instance_information", instance_information(), DESCRIBE_HEAD_NODE)
    moto_ssm = boto3.client("ssm", region_name=REGION)
    ssm = Routed(moto_ssm, stubbed, {"describe_instance_information"})

    result = handler.on_event(event, None, clients=clients(ssm=ssm), now=lambda: NOW)

    (command,) = sent_commands()
    assert result["PhysicalResourceId"] == "pipeline-trn1-llama"
    assert result["Data"]["Phase"] == "cancel" and result["Data"]["CommandId"] == command["CommandId"]
    assert command["DocumentName"] == "AWS-RunShellScript" and command["InstanceIds"] == [HEAD_NODE]
    assert command["TimeoutSeconds"] == phases.CANCEL_DELIVERY_SECONDS
    cancel = scripts.cancel_script(parsing.parse_properties(props), run_id)
    assert command["Parameters"]["commands"] == cancel.splitlines()
    assert f"run_id={run_id}" in cancel.splitlines()
    assert (
        '  PYTHONPATH="$source_dir" "$python" -m training cancel --run-id "$run_id" --site "$site_file" || exit'
        in cancel.splitlines()
    )
    state = poll_event(event, result)

    # 1. The cancel is still running: no export yet.
    in_progress, in_progress_stubber = stubbers("ssm")
    in_progress_stubber.add_response(
        "get_command_invocation",
        invocation(command["CommandId"], "InProgress"),
        {"CommandId": command["CommandId"], "InstanceId": HEAD_NODE},
    )
    fsx, fsx_stubber = stubbers("fsx")
    assert handler.is_complete(state, None, clients=clients(ssm=in_progress, fsx=fsx), now=lambda: NOW + 5) == {
        "IsComplete": False
    }

    # 2. The cancel is done (moto): the export is started, once.
    fsx_stubber.add_response("describe_data_repository_tasks", {"DataRepositoryTasks": []}, DESCRIBE_TASKS)
    fsx_stubber.add_response("create_data_repository_task", {"DataRepositoryTask": export_task("PENDING")}, CREATE_TASK)
    assert handler.is_complete(state, None, clients=clients(ssm=moto_ssm, fsx=fsx), now=lambda: NOW + 30) == {
        "IsComplete": False
    }

    # 3. Found again (no second create) while it runs, then succeeded.
    fsx_stubber.add_response(
        "describe_data_repository_tasks", {"DataRepositoryTasks": [export_task("EXECUTING")]}, DESCRIBE_TASKS
    )
    assert handler.is_complete(state, None, clients=clients(ssm=moto_ssm, fsx=fsx), now=lambda: NOW + 60) == {
        "IsComplete": False
    }
    fsx_stubber.add_response(
        "describe_data_repository_tasks", {"DataRepositoryTasks": [export_task("SUCCEEDED")]}, DESCRIBE_TASKS
    )
    assert handler.is_complete(state, None, clients=clients(ssm=moto_ssm, fsx=fsx), now=lambda: NOW + 90) == {
        "IsComplete": True
    }


def test_delete_whose_cancel_fails_stops_with_the_reason_and_exports_nothing(
    stubbers: Callable[[str], tuple[Any, Stubber]],
) -> None:
    """Exporting and deleting the cluster under jobs that could not be cancelled would hide it: the Delete fails."""
    event = cfn_event("Delete", properties())
    state = poll_event(
        event,
        {
            "PhysicalResourceId": "pipeline-trn1-llama",
            "Data": phases.data(run_id="r1", command=COMMAND, phase="cancel", started=NOW),
        },
    )
    ssm, ssm_stubber = stubbers("ssm")
    failed = invocation(COMMAND, "Failed", stderr="error: scancel failed: Access/permission denied", code=2)
    ssm_stubber.add_response("get_command_invocation", failed, {"CommandId": COMMAND, "InstanceId": HEAD_NODE})

    with pytest.raises(RuntimeError) as raised:
        handler.is_complete(state, None, clients=clients(ssm=ssm, s3=None), now=lambda: NOW + 30)  # no fsx client

    reason = str(raised.value)
    assert reason.startswith(f"cancel command {COMMAND} of run r1 on head node {HEAD_NODE} Failed (exit 2): ")
    assert "error: scancel failed: Access/permission denied" in reason
    assert "python -m training cancel --run-id r1" in reason and "\n" not in reason


@pytest.mark.parametrize(
    "gone",
    [
        ("response", {"InstanceInformationList": []}),
        ("error", "InvalidInstanceId"),
    ],
    ids=["unregistered", "invalid-instance"],
)
def test_delete_with_the_head_node_gone_skips_the_cancel_and_exports(
    stubbers: Callable[[str], tuple[Any, Stubber]], gone: tuple[str, Any]
) -> None:
    event = cfn_event("Delete", properties())
    ssm, ssm_stubber = stubbers("ssm")
    if gone[0] == "response":
        ssm_stubber.add_response("describe_instance_information", gone[1], DESCRIBE_HEAD_NODE)
    else:
        ssm_stubber.add_client_error("describe_instance_information", gone[1], "Instances not in a valid state")

    result = handler.on_event(event, None, clients=clients(ssm=ssm), now=lambda: NOW)  # no SendCommand queued

    assert result["Data"]["Phase"] == "export" and result["Data"]["CommandId"] == ""
    fsx, fsx_stubber = stubbers("fsx")
    earlier = export_task("SUCCEEDED", created=NOW - 3600)  # an export of an earlier Delete attempt: not ours
    fsx_stubber.add_response("describe_data_repository_tasks", {"DataRepositoryTasks": [earlier]}, DESCRIBE_TASKS)
    fsx_stubber.add_response("create_data_repository_task", {"DataRepositoryTask": export_task("PENDING")}, CREATE_TASK)
    fsx_stubber.add_response(
        "describe_data_repository_tasks", {"DataRepositoryTasks": [earlier, export_task("SUCCEEDED")]}, DESCRIBE_TASKS
    )
    state = poll_event(event, result)
    assert handler.is_complete(state, None, clients=clients(fsx=fsx), now=lambda: NOW + 30) == {"IsComplete": False}
    assert handler.is_complete(state, None, clients=clients(fsx=fsx), now=lambda: NOW + 60) == {"IsComplete": True}


def export_state() -> dict[str, Any]:
    event = cfn_event("Delete", properties())
    result = {
        "PhysicalResourceId": "pipeline-trn1-llama",
        "Data": phases.data(run_id="r", phase="export", started=NOW),
    }
    return poll_event(event, result)


def test_export_failure_is_the_reason(stubbers: Callable[[str], tuple[Any, Stubber]]) -> None:
    fsx, stubber = stubbers("fsx")
    failed = export_task(
        "FAILED",
        FailureDetails={"Message": "Export failed: the data repository bucket denied access (403)"},
        EndTime=datetime.fromtimestamp(NOW + 50, tz=timezone.utc),
    )
    stubber.add_response("describe_data_repository_tasks", {"DataRepositoryTasks": [failed]}, DESCRIBE_TASKS)

    with pytest.raises(RuntimeError) as raised:
        handler.is_complete(export_state(), None, clients=clients(fsx=fsx), now=lambda: NOW + 60)

    assert str(raised.value) == (
        f"the export of runs from file system {FILE_SYSTEM} to S3 (task {failed['TaskId']}) ended FAILED: "
        "Export failed: the data repository bucket denied access (403)"
    )


@pytest.mark.parametrize("where", ["describe", "create"])
def test_file_system_gone_completes(stubbers: Callable[[str], tuple[Any, Stubber]], where: str) -> None:
    fsx, stubber = stubbers("fsx")
    if where == "describe":
        stubber.add_client_error("describe_data_repository_tasks", "FileSystemNotFound", "File system not found")
    else:
        stubber.add_response("describe_data_repository_tasks", {"DataRepositoryTasks": []}, DESCRIBE_TASKS)
        stubber.add_client_error("create_data_repository_task", "FileSystemNotFound", "File system not found")

    assert handler.is_complete(export_state(), None, clients=clients(fsx=fsx), now=lambda: NOW + 10) == {
        "IsComplete": True
    }


def test_export_waits_for_another_task_then_times_out(stubbers: Callable[[str], tuple[Any, Stubber]]) -> None:
    fsx, stubber = stubbers("fsx")
    for _ in range(2):
        stubber.add_response("describe_data_repository_tasks", {"DataRepositoryTasks": []}, DESCRIBE_TASKS)
        stubber.add_client_error("create_data_repository_task", "DataRepositoryTaskExecuting", "A task is running")

    assert handler.is_complete(export_state(), None, clients=clients(fsx=fsx), now=lambda: NOW + 10) == {
        "IsComplete": False
    }
    with pytest.raises(TimeoutError, match=r"^timed out after 1800 s waiting for the export of runs from file system"):
        handler.is_complete(export_state(), None, clients=clients(fsx=fsx), now=lambda: NOW + 1801)


def test_delete_after_start_run_false_completes_at_once() -> None:
    event = cfn_event("Delete", properties(StartRun="false"))
    result = handler.on_event(event, None, clients=no_clients, now=lambda: NOW)
    assert result["PhysicalResourceId"] == "pipeline-trn1-llama" and result["Data"]["Phase"] == "none"
    assert handler.is_complete(poll_event(event, result), None, clients=no_clients, now=lambda: NOW) == {
        "IsComplete": True
    }
