"""The pipeline trigger's phases: submit (waiting for the head node to come online in SSM), cancel and
export on Delete, and the resource attributes they return. Every wait is bounded by the props' timeout."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from typing import Any

from botocore.exceptions import ClientError
from trigger_aws import (
    ClientFactory,
    command_state,
    error_code,
    error_message,
    export_state,
    get_invocation,
    head_node_problem,
    invocation_output,
    list_export_tasks,
    our_export,
    send_script,
)
from trigger_properties import Props, paths_of, run_id_of
from trigger_scripts import MARKER, cancel_script, job_ids, one_line, output_tail, parse_run_line, submit_script

CANCEL_DELIVERY_SECONDS = 120  # a cancel that cannot reach the head node in 2 minutes is skipped
CANCEL_EXECUTION_SECONDS = 300


def timed_out(data: Mapping[str, Any], timeout: int, now: float) -> bool:
    return now - float(data.get("StartedAt") or now) > timeout


def data(
    *,
    run_id: str = "",
    run_dir: str = "",
    jobs: str = "",
    command: str = "",
    phase: str,
    started: float,
    status: str = "",
) -> dict[str, str]:
    """The resource's attributes; every key is always present so that any Fn::GetAtt resolves."""
    return {
        "RunId": run_id,
        "RunDir": run_dir,
        "JobIds": jobs,
        "CommandId": command,
        "Phase": phase,
        "StartedAt": str(int(started)),
        "RunStatus": status or RUN_STATUS.get(phase, ""),
    }


# What RunStatus says when nothing went wrong; a run that could not start says `not-started: <reason>`.
RUN_STATUS = {"none": "no-run", "unchanged": "submitted-earlier", "submit": "submitting"}
RETRY_HINT = (
    "The environment was kept. Fix the cause, then bump pipeline.run in the environment file and deploy again, "
    "or run `python -m training submit` on the head node (docs/deploy.md: 'When a run cannot start')."
)


def submit_comment(run_id: str, started: float) -> str:
    """The submit command's comment: how a later poll finds the command a deferred submission sent."""
    return f"submit pipeline run {run_id} at {int(started)}"


def start_submit(props: Props, clients: ClientFactory, now: float) -> dict[str, Any]:
    paths = paths_of(props)
    if paths.export_path is None:
        raise ValueError(
            f"SiteSettings.runs_root {paths.runs_root} is not below FileSystemMountDir {props.mount_dir}: "
            "the runs would not be on the shared file system"
        )
    run_id = run_id_of(props)
    run_dir = posixpath.join(paths.runs_root, run_id)
    ssm = clients("ssm")
    if head_node_problem(ssm, props.head_node) is not None:
        # A new head node registers with SSM minutes after the cluster reports it: the polls wait for it.
        return data(run_id=run_id, run_dir=run_dir, phase="submit", started=now)
    command = send_submit(ssm, props, run_id, now, now)
    return data(run_id=run_id, run_dir=run_dir, command=command, phase="submit", started=now)


def send_submit(ssm: Any, props: Props, run_id: str, started: float, now: float) -> str:
    """Send the submit command, with what remains of the timeout as its own bound."""
    remaining = max(60, int(props.timeout - (now - started)))
    try:
        return send_script(
            ssm,
            props,
            submit_script(props, run_id),
            submit_comment(run_id, started),
            delivery_seconds=remaining,
            execution_seconds=remaining,
        )
    except ClientError as error:
        raise RuntimeError(
            f"sending the submit command to head node {props.head_node} failed: {error_message(error)}"
        ) from None


def deferred_command(ssm: Any, props: Props, state: Mapping[str, Any], now: float) -> str | None:
    """The submit command of a submission that waited for SSM: the one an earlier poll sent, or one sent now
    that the head node is online; None while it is not. Polls cannot pass state on, so the command is found
    again by its comment."""
    run_id, started = str(state["RunId"]), float(state["StartedAt"])
    comment = submit_comment(run_id, started)
    sent = ssm.list_commands(InstanceId=props.head_node).get("Commands", [])
    for command in sent:
        if command.get("Comment") == comment:
            return str(command["CommandId"])
    problem = head_node_problem(ssm, props.head_node)
    if problem is None:
        return send_submit(ssm, props, run_id, started, now)
    if timed_out(state, props.timeout, now):
        raise TimeoutError(
            f"head node {props.head_node} did not come online in SSM within {props.timeout} s ({problem}); "
            "the run was not submitted"
        )
    return None


def start_teardown(props: Props, clients: ClientFactory, now: float) -> dict[str, Any]:
    run_id = run_id_of(props)
    run_dir = posixpath.join(paths_of(props).runs_root, run_id)
    ssm = clients("ssm")
    problem = head_node_problem(ssm, props.head_node)
    if problem is not None:
        print(f"head node {props.head_node} is not managed by SSM ({problem}): not cancelling run {run_id}")
        return data(run_id=run_id, run_dir=run_dir, phase="export", started=now)
    try:
        command = send_script(
            ssm,
            props,
            cancel_script(props, run_id),
            f"cancel pipeline run {run_id}",
            delivery_seconds=CANCEL_DELIVERY_SECONDS,
            execution_seconds=CANCEL_EXECUTION_SECONDS,
        )
    except ClientError as error:
        if error_code(error) != "InvalidInstanceId":
            raise
        print(f"head node {props.head_node} is gone ({error_message(error)}): not cancelling run {run_id}")
        return data(run_id=run_id, run_dir=run_dir, phase="export", started=now)
    return data(run_id=run_id, run_dir=run_dir, command=command, phase="cancel", started=now)


def check_submit(props: Props, state: Mapping[str, Any], clients: ClientFactory, now: float) -> dict[str, Any]:
    """The submission's outcome; raises with the reason when the run could not be started."""
    ssm = clients("ssm")
    command, run_id = str(state["CommandId"]), str(state["RunId"])
    if not command:
        found = deferred_command(ssm, props, state, now)
        if found is None:
            return {"IsComplete": False}
        command = found
    what = f"submit command {command} of run {run_id} on head node {props.head_node}"
    invocation = get_invocation(ssm, command, props.head_node)
    if invocation is None or command_state(invocation["Status"]) == "wait":
        status = invocation["Status"] if invocation is not None else "not yet registered"
        if timed_out(state, props.timeout, now):
            raise TimeoutError(f"timed out after {props.timeout} s waiting for the {what} (status {status})")
        return {"IsComplete": False}
    status = invocation["Status"]
    stdout, stderr = invocation_output(clients("s3"), props, invocation, need_marker=status == "Success")
    if status != "Success":
        code = invocation.get("ResponseCode", "?")
        raise RuntimeError(one_line(f"{what} {status} (exit {code}): {output_tail(stdout, stderr)}"))
    run = parse_run_line(stdout)
    if run is None:
        raise RuntimeError(
            one_line(f"{what} succeeded but printed no {MARKER.strip()} line: {output_tail(stdout, stderr)}")
        )
    run_id = str(run.get("run_id") or run_id)
    run_dir = posixpath.join(paths_of(props).runs_root, run_id)
    return {
        "IsComplete": True,
        "Data": {"RunId": run_id, "RunDir": run_dir, "JobIds": job_ids(run), "RunStatus": "submitted"},
    }


def run_not_started(props: Props, reason: str, clients: ClientFactory) -> dict[str, Any]:
    """A run that could not start completes the resource anyway: on a first deploy a failure here would roll
    back the cluster, the file system and the network with it. The reason is the RunStatus attribute (a stack
    output), the log's last line and a notice on the alarm topic."""
    reason = one_line(reason)
    print(f"the run was not started: {reason}")
    if props.notice_topic:
        try:
            clients("sns").publish(
                TopicArn=props.notice_topic,
                Subject=f"Training run of {props.environment} not started"[:100],
                Message=f"The deploy of environment {props.environment} could not start its training run: "
                f"{reason}\n\n{RETRY_HINT}",
            )
        except ClientError as error:  # the notice is a courtesy; the stack output still says it
            print(f"the notice to {props.notice_topic} failed: {error_message(error)}")
    return {
        "IsComplete": True,
        "Data": {"RunId": "", "RunDir": "", "JobIds": "", "RunStatus": f"not-started: {reason}"},
    }


def check_teardown(props: Props, state: Mapping[str, Any], clients: ClientFactory, now: float) -> dict[str, Any]:
    if state.get("CommandId"):
        command = str(state["CommandId"])
        invocation = get_invocation(clients("ssm"), command, props.head_node)
        status = invocation["Status"] if invocation is not None else "Pending"
        if command_state(status) == "wait":
            if timed_out(state, props.timeout, now):
                raise TimeoutError(
                    f"timed out after {props.timeout} s waiting for the cancel command {command} "
                    f"of run {state.get('RunId')} on head node {props.head_node} (status {status})"
                )
            return {"IsComplete": False}
        if status != "Success":
            # Exporting and deleting the cluster under running jobs would hide the failure: stop with it.
            stdout, stderr = invocation_output(clients("s3"), props, invocation or {}, need_marker=False)
            run_id = state.get("RunId")
            raise RuntimeError(
                one_line(
                    f"cancel command {command} of run {run_id} on head node {props.head_node} {status} "
                    f"(exit {(invocation or {}).get('ResponseCode', '?')}): {output_tail(stdout, stderr)}. "
                    f"Its jobs may still run: cancel them on the head node (python -m training cancel --run-id "
                    f"{run_id}) and destroy again, or deploy with pipeline.start_run false first"
                )
            )
    return check_export(props, state, clients("fsx"), now)


def check_export(props: Props, state: Mapping[str, Any], fsx: Any, now: float) -> dict[str, Any]:
    """Find or start the export of the runs directory to the file system's S3 data repository; wait for it."""
    fs, export_path = props.file_system_id, paths_of(props).export_path
    started = float(state.get("StartedAt") or now)
    what = f"the export of {export_path or '/'} from file system {fs} to S3"
    try:
        task = our_export(list_export_tasks(fsx, fs), started, export_path)
        if task is None:
            arguments: dict[str, Any] = {
                "Type": "EXPORT_TO_REPOSITORY",
                "FileSystemId": fs,
                "Report": {"Enabled": False},
                "ClientRequestToken": f"pipeline-export-{int(started)}",
            }
            if export_path:
                arguments["Paths"] = [export_path]
            task = fsx.create_data_repository_task(**arguments)["DataRepositoryTask"]
            print(f"started {what}: task {task['TaskId']}")
    except ClientError as error:
        code = error_code(error)
        if code == "FileSystemNotFound":
            print(f"file system {fs} no longer exists: nothing to export")
            return {"IsComplete": True}
        if code == "DataRepositoryTaskExecuting":  # another task holds the file system: try again next poll
            return wait_or_time_out(props, state, now, f"{what} (another data repository task is running)")
        raise RuntimeError(one_line(f"{what} failed to start: {code}: {error_message(error)}")) from None
    outcome = export_state(str(task.get("Lifecycle")))
    if outcome == "success":
        return {"IsComplete": True}
    if outcome == "failed":
        reason = (task.get("FailureDetails") or {}).get("Message") or "no failure details"
        raise RuntimeError(one_line(f"{what} (task {task['TaskId']}) ended {task.get('Lifecycle')}: {reason}"))
    return wait_or_time_out(props, state, now, f"{what} (task {task['TaskId']}, {task.get('Lifecycle')})")


def wait_or_time_out(props: Props, state: Mapping[str, Any], now: float, what: str) -> dict[str, Any]:
    if timed_out(state, props.timeout, now):
        raise TimeoutError(f"timed out after {props.timeout} s waiting for {what}")
    return {"IsComplete": False}
