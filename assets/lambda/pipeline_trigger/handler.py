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
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
import shlex
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

MARKER = "PIPELINE-RUN "  # prefix of the run record line the submit script prints last
DOCUMENT = "AWS-RunShellScript"
WAITING = frozenset({"Pending", "InProgress", "Delayed", "Cancelling"})  # GetCommandInvocation statuses
EXPORT_WAITING = frozenset({"PENDING", "EXECUTING", "CANCELING"})  # data repository task lifecycles
TAIL_LINES = 20
MAX_REASON = 1800  # CloudFormation rejects a response body over 4 KiB; the framework adds a stack trace
CANCEL_DELIVERY_SECONDS = 120  # a cancel that cannot reach the head node in 2 minutes is skipped
CANCEL_EXECUTION_SECONDS = 300
SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
SAFE_PATH = re.compile(r"^/[A-Za-z0-9._/-]*$")

ClientFactory = Callable[[str], Any]
Clock = Callable[[], float]


def aws_client(service: str) -> Any:
    """A boto3 client with standard retries, so that a throttled poll retries instead of failing the stack."""
    return boto3.client(service, config=Config(retries={"mode": "standard", "max_attempts": 5}))


# --- Properties -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Props:
    """The resource properties, checked once so that a misconfiguration fails at once with its name."""

    head_node: str
    cluster: str
    start_run: bool
    run: str
    recipe: str
    overrides: tuple[str, ...]
    source_bucket: str
    source_key: str
    source_hash: str
    site: dict[str, Any]
    export_optimizer_state: bool  # on destroy, export training checkpoints' optimizer state too
    shared_env: str | None  # the environment to bring up to date before submitting; None: left as it is
    neuron_release: str | None
    file_system_id: str
    mount_dir: str
    output_bucket: str
    output_prefix: str
    timeout: int
    environment: str
    notice_topic: str  # the alarm topic: a run that cannot start is a notice there; empty: none


def parse_bool(value: Any, name: str) -> bool:
    """CloudFormation passes booleans as the strings "true" / "false"."""
    text = str(value).strip().lower()
    if text not in ("true", "false"):
        raise ValueError(f"property {name} must be 'true' or 'false', got {value!r}")
    return text == "true"


def start_run(raw: Mapping[str, Any]) -> bool:
    return parse_bool(raw.get("StartRun", "false"), "StartRun")


def parse_properties(raw: Mapping[str, Any]) -> Props:
    """Every property the run needs, validated; raises ValueError naming the first bad one."""

    def text(name: str, *, allow_empty: bool = False) -> str:
        value = raw.get(name)
        if value is None or not isinstance(value, str) or (not value and not allow_empty):
            raise ValueError(f"property {name} is missing or not a non-empty string (got {value!r})")
        return value

    overrides_raw = raw.get("RecipeOverrides") or []
    if isinstance(overrides_raw, str):
        overrides_raw = [overrides_raw]
    overrides = tuple(str(item) for item in overrides_raw)
    for override in overrides:
        key, separator, _ = override.partition("=")
        if not separator or not key or key.startswith("-"):
            raise ValueError(f"property RecipeOverrides: {override!r} is not key=value (e.g. steps=100)")
    try:
        site = json.loads(text("SiteSettings"))
    except json.JSONDecodeError as error:
        raise ValueError(f"property SiteSettings is not JSON ({error})") from None
    if not isinstance(site, dict):
        raise ValueError("property SiteSettings must be a JSON object (the --site settings)")
    for key in ("runs_root", "python", "slurm_bin"):
        if key == "slurm_bin" and site.get(key) is None:
            continue  # Slurm on PATH (a site without a prefix)
        if not isinstance(site.get(key), str) or not SAFE_PATH.match(site[key]):
            raise ValueError(f"property SiteSettings.{key} must be an absolute path, got {site.get(key)!r}")
    mount_dir = text("FileSystemMountDir").rstrip("/") or "/"
    if not SAFE_PATH.match(mount_dir):
        raise ValueError(f"property FileSystemMountDir must be an absolute path, got {mount_dir!r}")
    source_hash = text("SourceHash")
    if not SAFE_NAME.match(source_hash):
        raise ValueError(f"property SourceHash must be letters, digits, '.', '_' or '-', got {source_hash!r}")
    try:
        timeout = int(text("TimeoutSeconds"))
    except ValueError:
        raise ValueError(
            f"property TimeoutSeconds must be a number of seconds, got {raw.get('TimeoutSeconds')!r}"
        ) from None
    if timeout < 60:
        raise ValueError(f"property TimeoutSeconds must be at least 60, got {timeout}")
    run = text("Run")
    if not SAFE_NAME.match(run):
        raise ValueError(f"property Run must be letters, digits, '.', '_' or '-', got {run!r}")
    shared_env, neuron_release = raw.get("SharedEnvironmentPath"), raw.get("NeuronRelease")
    if (shared_env is None) != (neuron_release is None):
        raise ValueError("properties SharedEnvironmentPath and NeuronRelease go together: give both or neither")
    if shared_env is not None and (not isinstance(shared_env, str) or not SAFE_PATH.match(shared_env)):
        raise ValueError(f"property SharedEnvironmentPath must be an absolute path, got {shared_env!r}")
    if neuron_release is not None and not re.fullmatch(r"\d+\.\d+\.\d+", str(neuron_release)):
        raise ValueError(f"property NeuronRelease must look like 2.28.1, got {neuron_release!r}")
    return Props(
        head_node=text("HeadNodeInstanceId"),
        cluster=text("ClusterName"),
        start_run=start_run(raw),
        run=run,
        recipe=text("Recipe"),
        overrides=overrides,
        source_bucket=text("SourceBucket"),
        source_key=text("SourceKey"),
        source_hash=source_hash,
        site=site,
        export_optimizer_state=parse_bool(raw.get("ExportOptimizerState", "false"), "ExportOptimizerState"),
        shared_env=shared_env,
        neuron_release=None if neuron_release is None else str(neuron_release),
        file_system_id=text("FileSystemId"),
        mount_dir=mount_dir,
        output_bucket=text("OutputBucket"),
        output_prefix=text("OutputPrefix", allow_empty=True).strip("/"),
        timeout=timeout,
        environment=text("EnvironmentName"),
        notice_topic=str(raw.get("NoticeTopicArn") or ""),
    )


# --- Pure parts: run id, paths, scripts, output parsing ---------------------------------------------------


def derive_run_id(environment: str, recipe: str, overrides: Sequence[str], run: str) -> str:
    """`<env>-<recipe>-<sha256 of [run, recipe, overrides]>[:10]`: the same run settings, the same run.

    Sanitised to what `python -m training submit --run-id` accepts (letters, digits, '.', '_', '-', at
    most 64, starting with a letter or digit); the prefix is shortened, never the digest.
    """
    digest = hashlib.sha256(json.dumps([run, recipe, list(overrides)]).encode()).hexdigest()[:10]
    prefix = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{environment}-{recipe}").lstrip("._-")[:53].rstrip("._-")
    return f"{prefix or 'run'}-{digest}"


def safe_name(text: str) -> str:
    """A file name part from free text: runs of other characters become '-'."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "default"


def run_id_of(props: Props) -> str:
    return derive_run_id(props.environment, props.recipe, props.overrides, props.run)


@dataclass(frozen=True)
class Paths:
    """Where things live on the shared file system (seen alike by the head node and the compute nodes)."""

    source_dir: str  # the unzipped source of one SourceHash: immutable once there
    current: str  # symlink to the newest submitted source_dir: the nodes' monitoring services run the code there
    site_file: str
    runs_root: str
    export_path: str | None  # runs_root relative to the mount (FSx export task Paths); None: outside it


def paths_of(props: Props) -> Paths:
    runs_root = posixpath.normpath(props.site["runs_root"])
    mount = posixpath.normpath(props.mount_dir)
    inside = runs_root != mount and runs_root.startswith(mount.rstrip("/") + "/")
    return Paths(
        source_dir=f"{mount.rstrip('/')}/pipeline/source-{props.source_hash}",
        current=f"{mount.rstrip('/')}/pipeline/current",
        site_file=posixpath.join(posixpath.dirname(runs_root), "pipeline", f"site-{safe_name(props.environment)}.yaml"),
        runs_root=runs_root,
        export_path=posixpath.relpath(runs_root, mount) if inside else None,
    )


def site_file_text(site: Mapping[str, Any], source_dir: str) -> str:
    """The `--site` file content: the site settings as JSON (valid YAML), one line.

    The job scripts get `export PYTHONPATH=<source>` as their first setup line, so every stage runs the
    code this run was submitted with, whatever environment sbatch propagates.
    """
    setup = [f"export PYTHONPATH={shlex.quote(source_dir)}${{PYTHONPATH:+:${{PYTHONPATH}}}}"]
    setup += [str(line) for line in site.get("setup") or []]
    return json.dumps({**site, "setup": setup}, sort_keys=True)


# Where the shipped source keeps the node bootstrap and the cluster's locked requirement set.
BOOTSTRAP_IN_SOURCE = "assets/node/on_node_configured.sh"
LOCK_IN_SOURCE = "assets/node/cluster-requirements.txt"


def environment_sync_lines(props: Props) -> list[str]:
    """Rebuild the shared environment when the source's requirement set differs from the one it was built
    with (the bootstrap's `--env-only`: a no-op when it matches; jobs on the old build keep it)."""
    if props.shared_env is None or props.neuron_release is None:
        return []
    q = shlex.quote
    return [
        f'bash "$source_dir/{BOOTSTRAP_IN_SOURCE}" --env-only --node-type head'
        f" --neuron-release {q(props.neuron_release)} --shared-env {q(props.shared_env)}"
        f' --requirements "$source_dir/{LOCK_IN_SOURCE}"',
    ]


PRINT_RUN = (
    "import json, sys; "
    f'print("{MARKER}" + json.dumps(json.load(open(sys.argv[1])), separators=(",", ":"), sort_keys=True))'
)


def fetch_source_lines(props: Props) -> list[str]:
    """Shell lines that put the source tree in "$staging/tree".

    SourceKey is either a zip (a CDK file asset) or, ending in '/', a prefix holding the tree's files
    (e.g. a BucketDeployment); the zip is extracted with the shared Python, which is there for sure.
    """
    uri = shlex.quote(f"s3://{props.source_bucket}/{props.source_key}")
    if props.source_key.endswith("/"):
        return [f'  aws s3 cp --recursive --only-show-errors {uri} "$staging/tree"']
    return [
        f'  aws s3 cp --only-show-errors {uri} "$staging/source.zip"',
        '  "$python" -m zipfile -e "$staging/source.zip" "$staging/tree"',
    ]


def submit_script(props: Props, run_id: str) -> str:
    """The bash script the head node runs: fetch the source once, write the site file, submit, print the run.

    The code is used from the unzipped source with PYTHONPATH rather than `pip install -e` into the shared
    environment: nothing is written into the environment the node bootstrap built and verified (jobs of
    other runs use it), runs of different sources coexist (one directory per SourceHash), and an install
    could not add anything anyway (`--no-deps`; the environment must already provide PyYAML and Jinja2).
    """
    q = shlex.quote
    paths = paths_of(props)
    parent = posixpath.dirname(paths.source_dir)
    staging = f"{parent}/.source-{props.source_hash}.XXXXXX"
    submit = [
        '"$python" -m training submit',
        f"--recipe {q(props.recipe)}",
        f"--run-id {q(run_id)}",
        '--site "$site_file"',
        *(q(override) for override in props.overrides),
    ]
    lines = [
        "#!/bin/bash",
        f"# Submit pipeline run {run_id}: sent by the pipeline custom resource over SSM.",
        "set -euo pipefail",
        'export HOME="${HOME:-/root}"',  # the AWS CLI needs one; SSM's shell may have none
        "umask 022",
        f"python={q(props.site['python'])}",
        f"source_dir={q(paths.source_dir)}",
        f"site_file={q(paths.site_file)}",
        f"run_json={q(posixpath.join(paths.runs_root, run_id, 'run.json'))}",
        'if [[ ! -d "$source_dir" ]]; then',
        f"  mkdir -p {q(parent)}",
        f"  staging=$(mktemp -d {q(staging)})",
        "  trap 'rm -rf -- \"$staging\"' EXIT",
        *fetch_source_lines(props),
        '  mv -T "$staging/tree" "$source_dir" || [[ -d "$source_dir" ]]',  # a concurrent run may have won
        "fi",
        *environment_sync_lines(props),
        f'mkdir -p "$(dirname "$site_file")" {q(paths.runs_root)}',
        "# shellcheck disable=SC2016  # the setup line's ${PYTHONPATH...} expands in the jobs, not here",
        f"printf '%s\\n' {q(site_file_text(props.site, paths.source_dir))} >\"$site_file.$$\"",
        'mv -f "$site_file.$$" "$site_file"',
        # The monitoring units on the nodes (on_node_configured.sh) run `<mount>/pipeline/current`: repointed in
        # one rename (a relative link, as the source sits beside it), never missing while it moves.
        f"current={q(paths.current)}",
        'ln -sfn "$(basename "$source_dir")" "$current.$$"',
        'mv -T -f "$current.$$" "$current"',
        "\"$python\" -c 'import yaml, jinja2' || "
        '{ echo "error: $python cannot import PyYAML and Jinja2, which python -m training submit needs" >&2; exit 1; }',
        'cd "$source_dir"',
        'export PYTHONPATH="$source_dir${PYTHONPATH:+:$PYTHONPATH}"',
        " \\\n  ".join(submit),
        f'"$python" -c {q(PRINT_RUN)} "$run_json"',
    ]
    return "\n".join(lines) + "\n"


def cancel_script(props: Props, run_id: str) -> str:
    """Cancel the run's jobs. A never-submitted run is nothing to cancel; a failed cancel fails the script,
    so the Delete stops with the reason instead of exporting and deleting under running jobs. Then, unless
    the optimizer state is to be exported, move it out of the runs directory the export copies: it stays on
    the file system, which is deleted right after, instead of filling the kept bucket."""
    q = shlex.quote
    paths = paths_of(props)
    lines = [
        "#!/bin/bash",
        f"# Cancel pipeline run {run_id}: sent by the pipeline custom resource over SSM.",
        "set -uo pipefail",
        f"python={q(props.site['python'])}",
        f"source_dir={q(paths.source_dir)}",
        f"site_file={q(paths.site_file)}",
        f"run_id={q(run_id)}",
        'if [[ -d "$source_dir" && -f "$site_file" ]]; then',
        '  cd "$source_dir" || exit',
        '  PYTHONPATH="$source_dir" "$python" -m training cancel --run-id "$run_id" --site "$site_file" || exit',
        "else",
        '  echo "run $run_id: $source_dir or $site_file is missing; nothing to cancel"',
        "fi",
        *([] if props.export_optimizer_state else optimizer_set_aside_lines(props)),
    ]
    return "\n".join(lines) + "\n"


def optimizer_set_aside_lines(props: Props) -> list[str]:
    """Shell lines moving every `<run>/checkpoints/<step>/optim` out of the runs directory (into a hidden
    folder of the same file system, so it is a rename)."""
    q = shlex.quote
    paths = paths_of(props)
    return [
        f"runs_root={q(paths.runs_root)}",
        f"aside={q(props.mount_dir.rstrip('/') + '/.not-exported')}",
        "while IFS= read -r -d '' optimizer; do",
        '  relative=${optimizer#"$runs_root"/}',
        '  mkdir -p "$aside/$(dirname "$relative")" || exit',
        '  mv -T "$optimizer" "$aside/$relative" || exit',
        '  echo "not exported (optimizer state): $relative"',
        "done < <(find \"$runs_root\" -mindepth 4 -maxdepth 4 -type d -path '*/checkpoints/*/optim' -print0)",
    ]


def parse_run_line(stdout: str) -> dict[str, Any] | None:
    """The run record from the last marker line of the submit output; None when there is none."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARKER):
            try:
                record = json.loads(line[len(MARKER) :])
            except json.JSONDecodeError:
                return None
            return record if isinstance(record, dict) else None
    return None


def job_ids(run: Mapping[str, Any]) -> str:
    """`stage=jobid,...` of each stage's newest submission, in pipeline order."""
    jobs: dict[str, str] = {}
    for submission in run.get("submissions") or []:
        jobs.update({str(k): str(v) for k, v in (submission.get("jobs") or {}).items()})
    order = [str(stage) for stage in run.get("stages") or []]
    ordered = [s for s in order if s in jobs] + [s for s in jobs if s not in order]
    return ",".join(f"{stage}={jobs[stage]}" for stage in ordered)


def output_tail(stdout: str, stderr: str, lines: int = TAIL_LINES) -> str:
    """The last lines of stdout then stderr (where `error: ...` goes), as one line for a CloudFormation reason."""
    out = [line.strip() for line in stdout.splitlines() if line.strip()]
    err = [line.strip() for line in stderr.splitlines() if line.strip()]
    keep_err = err[-lines:]
    keep_out = out[-(lines - len(keep_err)) :] if len(keep_err) < lines else []
    return " | ".join(keep_out + keep_err) or "(no output)"


def one_line(message: str, limit: int = MAX_REASON) -> str:
    """A reason CloudFormation can show: one line, and short; the end (the error) is kept over the middle."""
    flat = " ".join(message.split())
    if len(flat) <= limit:
        return flat
    head = limit // 3
    return flat[:head] + " ... " + flat[-(limit - head - 5) :]


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


# --- AWS calls --------------------------------------------------------------------------------------------


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


# --- Phases -----------------------------------------------------------------------------------------------


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


# --- Lambda entry points ----------------------------------------------------------------------------------


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
