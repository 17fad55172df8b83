"""Post-deploy pipeline custom resource: submit a training run on the cluster's head node, through SSM.

Handlers for the CDK `custom_resources.Provider` framework: `on_event` starts the work, `is_complete` is
polled until it is done. CloudFormation waits at most an hour for a custom resource (REFERENCE.md section
1), so this resource only *submits* the Slurm pipeline (`python -m training submit`: seconds) and never
waits for training. Every wait is bounded by the `TimeoutSeconds` property, and every failure is raised
with a one-line reason on the poll that sees it.

- Create / Update: once the head node is online in SSM (a new one registers minutes after the cluster reports
  it; the polls wait for it within TimeoutSeconds), send one `AWS-RunShellScript` command to it that fetches
  the source (a zip, or a prefix of files) onto the shared file system once per SourceHash, brings the shared
  environment up to date with the source's requirement set, writes the site file and submits the run; succeed
  when the command has printed the run record. The run id is derived from what the environment file says about
  the run (its number, recipe and overrides), never from the code: an Update that changes only the code does
  nothing, and one that changes the run submits a new run next to the old one, which is left alone.
- A run that cannot start (the head node never online, the command failed, no run record) never fails the
  resource: on a first deploy that would roll back the cluster, the file system and the network with it.
  The resource completes with `RunStatus` `not-started: <reason>` (a stack output), and the reason goes to
  the alarm topic. Bad properties still fail: they are the deployment's own mistake.
- Delete: cancel the run's jobs when the head node is still reachable (skip it when it is not; a cancel
  that fails stops the Delete with its reason), then export the runs directory from the file system to
  its S3 data repository.

The physical id is `pipeline-<ClusterName>` and never changes, so CloudFormation never sends the Delete
of a replaced resource on Update. Only the standard library and boto3 (the Lambda Python runtime's).

This module holds the entry points; beside it, imported as the Lambda runtime imports them (the asset's
directory is on sys.path): `trigger_properties` (the properties, the run id, the paths), `trigger_scripts`
(the scripts sent to the head node and the reading of their output), `trigger_aws` (the AWS calls) and
`trigger_phases` (submit, cancel, export).
"""

from __future__ import annotations

import json
import posixpath
import time
from collections.abc import Callable, Mapping
from typing import Any

from botocore.exceptions import ClientError
from trigger_aws import ClientFactory, aws_client, error_message
from trigger_phases import check_submit, check_teardown, data, run_not_started, start_submit, start_teardown
from trigger_properties import parse_properties, paths_of, run_id_of, start_run

Clock = Callable[[], float]


def plan_event(request_type: str, new: Mapping[str, Any], old: Mapping[str, Any] | None) -> str:
    """What onEvent does: `nothing`, `unchanged` (same run already submitted), `submit` or `teardown`."""
    if request_type == "Delete":
        return "teardown" if start_run(new) else "nothing"
    if not start_run(new):
        return "nothing"
    if request_type == "Update" and old is not None and start_run(old):
        try:
            same = run_id_of(parse_properties(old)) == run_id_of(parse_properties(new))
        except ValueError:
            same = False  # the old properties were invalid: there is no old run to keep
        if same:
            return "unchanged"
    return "submit"


def on_event(
    event: Mapping[str, Any], context: Any = None, *, clients: ClientFactory = aws_client, now: Clock = time.time
) -> dict[str, Any]:
    """Create / Update / Delete: start the work (or decide there is none) and return the state is_complete reads."""
    request = str(event["RequestType"])
    raw = event.get("ResourceProperties") or {}
    print(f"{request} {event.get('PhysicalResourceId', '(new)')}: {json.dumps(dict(raw), sort_keys=True)}")
    if request == "Delete":
        physical_id = str(event["PhysicalResourceId"])  # the framework refuses a new id on Delete
    else:
        if not raw.get("ClusterName"):
            raise ValueError("property ClusterName is missing")
        physical_id = f"pipeline-{raw['ClusterName']}"
    started = now()
    action = plan_event(request, raw, event.get("OldResourceProperties"))
    if action == "nothing":
        state = data(phase="none", started=started)
    elif action == "unchanged":
        # The run was submitted by an earlier Create/Update; its job ids are not kept anywhere CloudFormation
        # passes back, so JobIds is empty here (`python -m training status --run-id <RunId>` shows them).
        props = parse_properties(raw)
        run_id = run_id_of(props)
        state = data(
            run_id=run_id, run_dir=posixpath.join(paths_of(props).runs_root, run_id), phase="unchanged", started=started
        )
    elif action == "submit":
        props = parse_properties(raw)
        try:
            state = start_submit(props, clients, started)
        except (RuntimeError, ClientError) as error:
            reason = error_message(error) if isinstance(error, ClientError) else str(error)
            outcome = run_not_started(props, reason, clients)["Data"]
            state = data(phase="not-started", started=started, status=outcome["RunStatus"])
    else:
        state = start_teardown(parse_properties(raw), clients, started)
    print(f"{request} -> {action}: {json.dumps(state, sort_keys=True)}")
    return {"PhysicalResourceId": physical_id, "Data": state}


def is_complete(
    event: Mapping[str, Any], context: Any = None, *, clients: ClientFactory = aws_client, now: Clock = time.time
) -> dict[str, Any]:
    """Poll the phase on_event started; stateless apart from the Data on_event returned."""
    state = event.get("Data") or {}
    phase = state.get("Phase", "none")
    if phase in ("none", "unchanged", "not-started"):
        return {"IsComplete": True}
    props = parse_properties(event.get("ResourceProperties") or {})
    if phase == "submit":
        try:
            result = check_submit(props, state, clients, now())
        except (RuntimeError, TimeoutError, ClientError) as error:
            reason = error_message(error) if isinstance(error, ClientError) else str(error)
            result = run_not_started(props, reason, clients)
    elif phase in ("cancel", "export"):
        result = check_teardown(props, state, clients, now())
    else:
        raise ValueError(f"unknown phase {phase!r} in the custom resource state")
    print(f"{phase}: {json.dumps(result, sort_keys=True)}")
    return result
