"""The pipeline trigger's AWS calls: SSM commands to the head node, their output in S3, FSx export tasks."""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError
from trigger_properties import Props
from trigger_scripts import parse_run_line

DOCUMENT = "AWS-RunShellScript"
WAITING = frozenset({"Pending", "InProgress", "Delayed", "Cancelling"})  # GetCommandInvocation statuses
EXPORT_WAITING = frozenset({"PENDING", "EXECUTING", "CANCELING"})  # data repository task lifecycles

ClientFactory = Callable[[str], Any]


def aws_client(service: str) -> Any:
    """A boto3 client with standard retries, so that a throttled poll retries instead of failing the stack."""
    return boto3.client(service, config=Config(retries={"mode": "standard", "max_attempts": 5}))


def command_state(status: str) -> str:
    """`wait`, `success` or `failed` for a GetCommandInvocation status."""
    if status in WAITING:
        return "wait"
    return "success" if status == "Success" else "failed"


def export_state(lifecycle: str) -> str:
    """`wait`, `success` or `failed` for a data repository task lifecycle."""
    if lifecycle in EXPORT_WAITING:
        return "wait"
    return "success" if lifecycle == "SUCCEEDED" else "failed"


def error_code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


def error_message(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Message", "")) or str(error)


def head_node_problem(ssm: Any, instance_id: str) -> str | None:
    """Why the head node cannot take a command (not registered with SSM, agent offline), or None if it can."""
    try:
        found = ssm.describe_instance_information(Filters=[{"Key": "InstanceIds", "Values": [instance_id]}])
    except ClientError as error:
        if error_code(error) == "InvalidInstanceId":
            return f"not registered ({error_message(error)})"
        raise
    infos = [i for i in found.get("InstanceInformationList", []) if i.get("InstanceId") == instance_id]
    if not infos:
        return "no SSM agent has registered it: is the instance running, with AmazonSSMManagedInstanceCore?"
    ping = infos[0].get("PingStatus", "unknown")
    return None if ping == "Online" else f"SSM agent ping status {ping}"


def send_script(
    ssm: Any, props: Props, script: str, comment: str, *, delivery_seconds: int, execution_seconds: int
) -> str:
    """Run the script on exactly the head node; output goes to S3 too, since the API keeps only its start."""
    arguments: dict[str, Any] = {
        "InstanceIds": [props.head_node],
        "DocumentName": DOCUMENT,
        "Comment": comment[:100],
        "TimeoutSeconds": max(30, delivery_seconds),
        "Parameters": {"commands": script.splitlines(), "executionTimeout": [str(execution_seconds)]},
        "OutputS3BucketName": props.output_bucket,
    }
    if props.output_prefix:
        arguments["OutputS3KeyPrefix"] = props.output_prefix
    return str(ssm.send_command(**arguments)["Command"]["CommandId"])


def get_invocation(ssm: Any, command_id: str, instance_id: str) -> dict[str, Any] | None:
    """The invocation, or None while SSM has not registered it yet (right after SendCommand)."""
    try:
        return dict(ssm.get_command_invocation(CommandId=command_id, InstanceId=instance_id))
    except ClientError as error:
        if error_code(error) == "InvocationDoesNotExist":
            return None
        raise


def output_keys(props: Props, invocation: Mapping[str, Any]) -> dict[str, str]:
    """The S3 keys of the full stdout / stderr: from the invocation's URLs, else SSM's documented layout.

    Exact keys rather than a listing, so the role needs s3:GetObject on the output prefix only.
    """
    folder = (
        "/".join(p for p in (props.output_prefix, str(invocation.get("CommandId")), props.head_node) if p)
        + "/awsrunShellScript/0.awsrunShellScript"
    )
    keys = {"stdout": f"{folder}/stdout", "stderr": f"{folder}/stderr"}
    for name, field in (("stdout", "StandardOutputUrl"), ("stderr", "StandardErrorUrl")):
        key = key_from_url(str(invocation.get(field) or ""), props.output_bucket)
        if key:
            keys[name] = key
    return keys


def key_from_url(url: str, bucket: str) -> str | None:
    """The object key of an S3 https URL, path-style (`s3.<region>.amazonaws.com/<bucket>/<key>`) or virtual-hosted."""
    parsed = urllib.parse.urlparse(url)
    path = urllib.parse.unquote(parsed.path).lstrip("/")
    if not parsed.netloc or not path:
        return None
    if parsed.netloc.startswith(f"{bucket}."):
        return path
    return path[len(bucket) + 1 :] if path.startswith(f"{bucket}/") else None


def read_s3_output(
    s3: Any, props: Props, invocation: Mapping[str, Any], tail_bytes: int = 65536
) -> tuple[str, str] | None:
    """The ends of the full stdout / stderr SSM wrote to S3; None when there is nothing to read there."""
    texts = {"stdout": "", "stderr": ""}
    for name, key in output_keys(props, invocation).items():
        try:
            tail = s3.get_object(Bucket=props.output_bucket, Key=key, Range=f"bytes=-{tail_bytes}")
        except ClientError as error:  # NoSuchKey (nothing written), AccessDenied: the inline output remains
            print(f"cannot read s3://{props.output_bucket}/{key}: {error_code(error)}")
            continue
        texts[name] = tail["Body"].read().decode("utf-8", errors="replace")
    if not any(texts.values()):
        return None
    return texts["stdout"], texts["stderr"]


def invocation_output(s3: Any, props: Props, invocation: Mapping[str, Any], *, need_marker: bool) -> tuple[str, str]:
    """stdout / stderr of a finished command, from S3 when the inline copy may be cut (24,000 / 8,000 chars)."""
    stdout = str(invocation.get("StandardOutputContent") or "")
    stderr = str(invocation.get("StandardErrorContent") or "")
    cut = len(stdout) >= 24000 or len(stderr) >= 8000
    if cut or (need_marker and parse_run_line(stdout) is None):
        full = read_s3_output(s3, props, invocation)
        if full is not None:
            return full
    return stdout, stderr


def list_export_tasks(fsx: Any, file_system_id: str) -> list[dict[str, Any]]:
    tasks: list[dict[str, Any]] = []
    arguments: dict[str, Any] = {"Filters": [{"Name": "file-system-id", "Values": [file_system_id]}]}
    while True:
        page = fsx.describe_data_repository_tasks(**arguments)
        tasks += [t for t in page.get("DataRepositoryTasks", []) if t.get("Type") == "EXPORT_TO_REPOSITORY"]
        if not page.get("NextToken"):
            return tasks
        arguments["NextToken"] = page["NextToken"]


def created_at(task: Mapping[str, Any]) -> float:
    value = task.get("CreationTime")
    return value.timestamp() if isinstance(value, datetime) else float(value or 0)


def our_export(tasks: Sequence[Mapping[str, Any]], started: float, export_path: str | None) -> Mapping[str, Any] | None:
    """The newest export of our paths created since this Delete started: is_complete keeps no state."""
    wanted = [export_path] if export_path else []
    ours = [t for t in tasks if created_at(t) >= started - 1 and list(t.get("Paths") or []) == wanted]
    return max(ours, key=created_at) if ours else None
