"""The shell scripts the pipeline trigger sends to the head node (submit, cancel) and the reading of what
they print: the run record, and a failure's reason as one line CloudFormation can show."""

from __future__ import annotations

import json
import posixpath
import shlex
from collections.abc import Mapping
from typing import Any

from trigger_properties import Props, paths_of

MARKER = "PIPELINE-RUN "  # prefix of the run record line the submit script prints last
TAIL_LINES = 20
MAX_REASON = 1800  # CloudFormation rejects a response body over 4 KiB; the framework adds a stack trace


def site_file_text(site: Mapping[str, Any], source_dir: str) -> str:
    """The `--site` file content: the site settings as JSON (valid YAML), one line.

    The job scripts get `export PYTHONPATH=<source>` as their first setup line, so every stage runs the
    code this run was submitted with, whatever environment sbatch propagates.
    """
    setup = [f"export PYTHONPATH={shlex.quote(source_dir)}${{PYTHONPATH:+:${{PYTHONPATH}}}}"]
    setup += [str(line) for line in site.get("setup") or []]
    return json.dumps({**site, "setup": setup}, sort_keys=True)


# Where the shipped source keeps the node bootstrap (the locked requirement set: Props.requirements).
BOOTSTRAP_IN_SOURCE = "assets/node/on_node_configured.sh"


def environment_sync_lines(props: Props) -> list[str]:
    """Rebuild the shared environment when the source's requirement set differs from the one it was built
    with (the bootstrap's `--env-only`: a no-op when it matches; jobs on the old build keep it)."""
    if props.shared_env is None or props.neuron_release is None:
        return []
    q = shlex.quote
    return [
        f'bash "$source_dir/{BOOTSTRAP_IN_SOURCE}" --env-only --node-type head'
        f" --neuron-release {q(props.neuron_release)} --shared-env {q(props.shared_env)}"
        f' --requirements "$source_dir/{props.requirements}"',
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
