"""Tests of the scripts the pipeline trigger sends to the head node (assets/lambda/pipeline_trigger/trigger_scripts.py):
checked with `bash -n` and shellcheck, and run for real with bash against a fake `aws` command and a fake
`training` package; and the reading of what they print.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tests.support.parallelcluster_shell import load_pipeline_trigger_module
from tests.support.pipeline_trigger import SITE, properties
from tests.support.system_tools import require_tool
from training.cli import build_parser

BASH = shutil.which("bash") or "/bin/bash"

parsing = load_pipeline_trigger_module("trigger_properties")
scripts = load_pipeline_trigger_module("trigger_scripts")


# --- The scripts, run by bash -----------------------------------------------------------------------------

HOSTILE = [
    "steps=100",
    "name=it's; touch pwned-quote",
    'prompt="a b";touch pwned-semicolon',
    "x=$(touch pwned-subst) `id`",
]

FAKE_TRAINING = '''\
"""Stands in for `python -m training`: records its arguments, writes a run record like `submit` does."""
import json, sys
from pathlib import Path

args = sys.argv[1:]
site = json.loads(Path(args[args.index("--site") + 1]).read_text())
runs = Path(site["runs_root"])
with open(runs / "calls.jsonl", "a") as log:
    log.write(json.dumps(args) + "\\n")
if args[0] == "submit" and args[args.index("--recipe") + 1] == "broken":
    sys.exit(print("error: sbatch --parsable failed: sbatch: error: invalid partition", file=sys.stderr) or 2)
if args[0] == "cancel" and (runs / "cancel-fails").exists():
    sys.exit(print("error: scancel failed: Invalid job id specified", file=sys.stderr) or 2)
if args[0] == "cancel":
    sys.exit(print("run: cancelled jobs 1, 2"))
run_id = args[args.index("--run-id") + 1]
(runs / run_id).mkdir(parents=True, exist_ok=True)
record = {"run_id": run_id, "stages": ["prepare", "train"], "submissions": [{"jobs": {"prepare": "1", "train": "2"}}]}
(runs / run_id / "run.json").write_text(json.dumps(record, indent=2))
print(f"run {run_id}: submitted prepare=1, train=2")
'''

FAKE_BOOTSTRAP = """\
#!/bin/bash
# Stands in for the node bootstrap: records the arguments it was run with.
echo "$*" >>"$HOME/bootstrap.log"
"""

FAKE_AWS = """\
#!/bin/bash
# Stands in for the AWS CLI: `aws s3 cp [--recursive] --only-show-errors s3://bucket/key destination`.
echo "$*" >>"$FAKE_AWS_LOG"
if [[ "$1 $2 $3 $4" == "s3 cp --recursive --only-show-errors" ]]; then
  mkdir -p "$6" && cp -R "$FAKE_SOURCE_TREE"/. "$6"
elif [[ "$1 $2 $3" == "s3 cp --only-show-errors" ]]; then
  cp "$FAKE_SOURCE_ZIP" "$5"
else
  exit 64
fi
"""


@pytest.fixture
def head_node(tmp_path: Path) -> dict[str, Any]:
    """A file system mount, a source zip, a fake `aws` on PATH and the real Python as the shared one."""
    mount = tmp_path / "fsx"
    mount.mkdir()
    source = io.BytesIO()
    with zipfile.ZipFile(source, "w") as archive:
        archive.writestr("training/__init__.py", "")
        archive.writestr("training/__main__.py", FAKE_TRAINING)
        archive.writestr("pyproject.toml", "[project]\nname = 'x'\n")
        archive.writestr("assets/node/on_node_configured.sh", FAKE_BOOTSTRAP)
        archive.writestr("assets/node/cluster-requirements.txt", "transformers==4.57.6\n")
    (tmp_path / "source.zip").write_bytes(source.getvalue())
    with zipfile.ZipFile(source) as archive:
        archive.extractall(tmp_path / "source-tree")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "aws").write_text(FAKE_AWS)
    (bin_dir / "aws").chmod(0o755)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "FAKE_AWS_LOG": str(tmp_path / "aws.log"),
        "FAKE_SOURCE_ZIP": str(tmp_path / "source.zip"),
        "FAKE_SOURCE_TREE": str(tmp_path / "source-tree"),
    }
    site = SITE | {"runs_root": f"{mount}/runs", "python": sys.executable, "setup": ["ulimit -n 65536"]}
    props = properties(SiteSettings=json.dumps(site), FileSystemMountDir=str(mount), RecipeOverrides=HOSTILE)
    return {"mount": mount, "env": env, "props": props, "site": site, "tmp": tmp_path}


def run_bash(script: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [BASH, "-c", script], env=env, cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def test_scripts_pass_bash_syntax_check_with_hostile_values() -> None:
    props = parsing.parse_properties(
        properties(Recipe="llama'; rm -rf /; echo '", RecipeOverrides=HOSTILE, EnvironmentName="prod $(id)")
    )
    run_id = parsing.run_id_of(props)
    for script in (scripts.submit_script(props, run_id), scripts.cancel_script(props, run_id)):
        checked = subprocess.run([BASH, "-n"], input=script, capture_output=True, text=True, check=False)
        assert checked.returncode == 0, checked.stderr


def test_scripts_pass_shellcheck() -> None:
    shellcheck = require_tool("shellcheck")
    props = parsing.parse_properties(properties())  # hostile values are run for real below (they'd be SC2016)
    run_id = parsing.run_id_of(props)
    for script in (scripts.submit_script(props, run_id), scripts.cancel_script(props, run_id)):
        checked = subprocess.run(
            [shellcheck, "--severity=style", "--shell=bash", "-"],
            input=script,
            capture_output=True,
            text=True,
            check=False,
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize("source_key", ["0a1b2c3d.zip", "pipeline/source/0a1b2c3d/"], ids=["zip", "prefix"])
def test_submit_script_runs_with_hostile_values_quoted(head_node: dict[str, Any], source_key: str) -> None:
    props = parsing.parse_properties(head_node["props"] | {"SourceKey": source_key})
    run_id = parsing.run_id_of(props)
    script = scripts.submit_script(props, run_id)
    workdir = head_node["tmp"] / "cwd"
    workdir.mkdir()

    first = run_bash(script, head_node["env"], workdir)
    second = run_bash(script, head_node["env"], workdir)  # the source is fetched once

    assert first.returncode == 0, first.stderr
    assert second.returncode == 0, second.stderr
    mount, runs = head_node["mount"], head_node["mount"] / "runs"
    site_file = mount / "pipeline" / "site-default.yaml"
    source_dir = mount / "pipeline" / "source-0a1b2c3d"
    calls = [json.loads(line) for line in (runs / "calls.jsonl").read_text().splitlines()]
    expected = ["submit", "--recipe", "llama31-8b-cpt", "--run-id", run_id, "--site", str(site_file), *HOSTILE]
    assert calls == [expected, expected]
    parsed = build_parser().parse_args(expected)  # what the stand-in recorded, the real CLI accepts
    assert (parsed.command, parsed.site, parsed.overrides) == ("submit", site_file, HOSTILE)
    assert not list(head_node["tmp"].rglob("pwned*"))
    aws_calls = (head_node["tmp"] / "aws.log").read_text().splitlines()
    recursive = "--recursive " if source_key.endswith("/") else ""
    assert len(aws_calls) == 1 and aws_calls[0].startswith(
        f"s3 cp {recursive}--only-show-errors s3://cdk-hnb659fds-assets-123456789012-us-west-2/{source_key} "
    )
    assert (source_dir / "training" / "__main__.py").is_file()
    # The shared environment is brought up to date from the shipped lock before each submission.
    sync = (
        f"--env-only --node-type head --neuron-release 2.28.1 --shared-env /fsx/envs/neuron-2.28.1 "
        f"--requirements {source_dir}/assets/node/cluster-requirements.txt"
    )
    assert (head_node["tmp"] / "bootstrap.log").read_text().splitlines() == [sync, sync]
    assert not [p for p in (mount / "pipeline").iterdir() if p.name.startswith(".source-")]  # staging removed
    # The nodes' monitoring units run `<mount>/pipeline/current`: a relative link to this source, moved in one
    # rename (no temporary link left behind).
    current = mount / "pipeline" / "current"
    assert current.is_symlink() and os.readlink(current) == source_dir.name
    assert (current / "training" / "__main__.py").is_file()
    assert not [p for p in (mount / "pipeline").iterdir() if p.name.startswith("current.")]
    site = json.loads(site_file.read_text())
    assert site == head_node["site"] | {
        "setup": [f"export PYTHONPATH={source_dir}${{PYTHONPATH:+:${{PYTHONPATH}}}}", "ulimit -n 65536"]
    }
    run = scripts.parse_run_line(second.stdout)
    assert run is not None and run["run_id"] == run_id
    assert scripts.job_ids(run) == "prepare=1,train=2"
    assert second.stdout.splitlines()[-1].startswith(scripts.MARKER)


def test_submit_script_fails_with_the_cli_error(head_node: dict[str, Any]) -> None:
    props = parsing.parse_properties(head_node["props"] | {"Recipe": "broken"})
    done = run_bash(scripts.submit_script(props, parsing.run_id_of(props)), head_node["env"], head_node["tmp"])
    assert done.returncode == 2
    assert scripts.parse_run_line(done.stdout) is None
    assert scripts.output_tail(done.stdout, done.stderr).endswith(
        "error: sbatch --parsable failed: sbatch: error: invalid partition"
    )


def test_cancel_script_cancels_nothing_before_a_submission_and_fails_with_the_cli_error(
    head_node: dict[str, Any],
) -> None:
    props = parsing.parse_properties(head_node["props"])
    run_id = parsing.run_id_of(props)
    cancel = scripts.cancel_script(props, run_id)

    nothing = run_bash(cancel, head_node["env"], head_node["tmp"])  # never submitted: no source, no site file
    assert nothing.returncode == 0 and "nothing to cancel" in nothing.stdout

    assert run_bash(scripts.submit_script(props, run_id), head_node["env"], head_node["tmp"]).returncode == 0
    (head_node["mount"] / "runs" / "cancel-fails").touch()
    failed = run_bash(cancel, head_node["env"], head_node["tmp"])  # the stand-in's `training cancel` exits 2
    assert failed.returncode == 2
    assert scripts.output_tail(failed.stdout, failed.stderr).endswith("error: scancel failed: Invalid job id specified")
    calls = [json.loads(line) for line in (head_node["mount"] / "runs" / "calls.jsonl").read_text().splitlines()]
    assert calls[-1] == [
        "cancel",
        "--run-id",
        run_id,
        "--site",
        str(head_node["mount"] / "pipeline" / "site-default.yaml"),
    ]
    assert build_parser().parse_args(calls[-1]).run_id == run_id


@pytest.mark.parametrize("export_optimizer", ["false", "true"])
def test_cancel_script_keeps_optimizer_state_out_of_the_export_unless_asked(
    head_node: dict[str, Any], export_optimizer: str
) -> None:
    props = parsing.parse_properties(head_node["props"] | {"ExportOptimizerState": export_optimizer})
    run_id = parsing.run_id_of(props)
    assert run_bash(scripts.submit_script(props, run_id), head_node["env"], head_node["tmp"]).returncode == 0
    runs = head_node["mount"] / "runs"
    for step in ("step_5", "step_10"):
        for part in ("model", "optim"):
            (runs / run_id / "checkpoints" / step / part).mkdir(parents=True)
            (runs / run_id / "checkpoints" / step / part / "dp_rank_00_tp_rank_00_pp_rank_00.pt").write_text(part)

    done = run_bash(scripts.cancel_script(props, run_id), head_node["env"], head_node["tmp"])

    assert done.returncode == 0, done.stderr
    checkpoints = runs / run_id / "checkpoints"
    assert (checkpoints / "step_10" / "model").is_dir() and (checkpoints / "step_5" / "model").is_dir()
    aside = head_node["mount"] / ".not-exported" / run_id / "checkpoints"
    if export_optimizer == "true":
        assert (checkpoints / "step_10" / "optim").is_dir() and not aside.exists()
    else:
        assert not list(checkpoints.glob("*/optim"))  # the export copies runs/: no optimizer state in it
        assert (aside / "step_10" / "optim" / "dp_rank_00_tp_rank_00_pp_rank_00.pt").read_text() == "optim"
        assert f"not exported (optimizer state): {run_id}/checkpoints/step_5/optim" in done.stdout


# --- Pure helpers -----------------------------------------------------------------------------------------


def test_output_tail_keeps_stderr_and_the_last_lines() -> None:
    stdout = "\n".join(f"out {i}" for i in range(30))
    assert scripts.output_tail(stdout, "error: boom\n") == " | ".join(
        [f"out {i}" for i in range(11, 30)] + ["error: boom"]
    )
    assert scripts.output_tail("", "") == "(no output)"


def test_reason_is_one_bounded_line_keeping_the_end() -> None:
    reason = scripts.one_line("start\n" + "x" * 5000 + "\nerror: the end")
    assert "\n" not in reason and len(reason) <= scripts.MAX_REASON
    assert reason.startswith("start ") and reason.endswith("error: the end")


def test_parse_run_line_takes_the_last_marker_line() -> None:
    text = f'{scripts.MARKER}{{"run_id": "old"}}\nnoise\n{scripts.MARKER}{{"run_id": "new"}}\ntrailing\n'
    assert scripts.parse_run_line(text) == {"run_id": "new"}
    assert scripts.parse_run_line(f"{scripts.MARKER}not json") is None
    assert scripts.parse_run_line("nothing") is None
