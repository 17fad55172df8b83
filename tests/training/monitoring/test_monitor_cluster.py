"""The head node's metrics (training/monitoring/cluster.py): Slurm's own output shapes, ParallelCluster's node
state suffixes, failed stages of the newest run, and publishing to CloudWatch (moto) through the CLI.

The Slurm output below is what `squeue`/`sinfo` print for the formats the monitor asks for; the node states are
those of the sinfo man page (NODE STATE CODES) as ParallelCluster's cloud nodes show them: `idle~` powered down,
`alloc#`/`idle#` powering up, `idle%` powering down, `down*` not responding, `down~` a failed launch. The
real local Slurm runs the same command in tests/pipeline/test_monitor.py.
"""

from __future__ import annotations

import json
import textwrap
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml
from moto import mock_aws

from training.cli import main
from training.config.site import Site
from training.monitoring import cloudwatch
from training.monitoring.cluster import (
    NODE_STATES,
    SINFO_COMMAND,
    SQUEUE_COMMAND,
    failed_stages,
    job_data,
    node_data,
    node_state,
)

NAMESPACE = "Trainium/test"
REGION = "eu-central-1"


def values(data: list[cloudwatch.Datum]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(d.name, tuple(sorted(d.dimensions.items()))): d.value for d in data}


@pytest.mark.parametrize(
    ("raw", "state"),
    [
        ("idle~", "powered_down"),  # ParallelCluster's dynamic nodes at rest
        ("idle%", "powered_down"),  # powering down after ScaledownIdletime
        ("idle!", "powered_down"),  # power down pending
        ("powered_down", "powered_down"),
        ("alloc#", "powering_up"),  # a job's nodes while EC2 boots them
        ("allocated#", "powering_up"),
        ("idle#", "powering_up"),
        ("mix#", "powering_up"),
        ("configuring", "powering_up"),
        ("alloc", "allocated"),
        ("allocated", "allocated"),
        ("mixed", "allocated"),
        ("mix", "allocated"),
        ("completing", "allocated"),
        ("comp", "allocated"),
        ("idle", "idle"),
        ("reserved", "idle"),
        ("planned", "idle"),
        ("down*", "down"),  # not responding
        ("down~", "down"),  # ParallelCluster: a launch failed (e.g. InsufficientInstanceCapacity)
        ("down#", "down"),
        ("idle*", "down"),
        ("drained", "down"),  # drained by the health prolog
        ("drained~", "down"),
        ("draining", "down"),
        ("drng", "down"),
        ("drain", "down"),
        ("mixed+drain", "down"),
        ("fail", "down"),
        ("unknown", "down"),
        ("no-such-state", "down"),
    ],
)
def test_node_states_map_onto_five(raw: str, state: str) -> None:
    assert node_state(raw) == state
    assert node_state(raw.upper()) == state


def test_nodes_per_partition_and_state_with_zeros() -> None:
    # `sinfo --noheader --all --format=%R|%T|%D` on a cluster of 16 trn1 and 4 CPU nodes.
    sinfo = textwrap.dedent(
        """\
        compute1|allocated#|2
        compute1|mixed|1
        compute1|idle~|10
        compute1|down~|2
        compute1|drained|1
        cpu|idle~|3
        cpu|allocated|1
        spare|n/a|0
        """
    )
    data = node_data(sinfo, ["compute1", "cpu", "absent"])
    assert {d.name for d in data} == {cloudwatch.SLURM_NODES}
    assert {d.unit for d in data} == {"Count"}
    counts = {(d.dimensions["Partition"], d.dimensions["State"]): d.value for d in data}
    assert len(counts) == len(data) == 4 * len(NODE_STATES)  # every state of every partition, zeros included
    assert {s: counts["compute1", s] for s in NODE_STATES} == {
        "allocated": 1,
        "idle": 0,
        "powering_up": 2,
        "powered_down": 10,
        "down": 3,
    }
    assert {s: counts["cpu", s] for s in NODE_STATES} == {
        "allocated": 1,
        "idle": 0,
        "powering_up": 0,
        "powered_down": 3,
        "down": 0,
    }
    assert sum(counts["spare", s] for s in NODE_STATES) == 0
    assert sum(counts["absent", s] for s in NODE_STATES) == 0


def test_the_same_partition_and_state_on_several_lines_is_summed() -> None:
    data = node_data("compute1|idle~|3\ncompute1|idle~|4\ncompute1|idle%|1\n")
    counts = {d.dimensions["State"]: d.value for d in data}
    assert counts["powered_down"] == 8


def test_jobs_per_state_and_running_training_jobs(tmp_path: Path) -> None:
    runs_root = tmp_path / "runs"
    squeue = textwrap.dedent(
        f"""\
        101|RUNNING|compute1|{runs_root}/llama-1/jobs/train.sbatch
        102|PENDING|cpu|{runs_root}/llama-1/jobs/convert-out.sbatch
        103|PENDING|cpu|{runs_root}/llama-1/jobs/sample.sbatch
        104|RUNNING|compute1|/home/someone/jobs/train.sbatch
        105|CONFIGURING|compute1|{runs_root}/mixtral-2/jobs/train.sbatch
        106|RUNNING|compute1|{runs_root}/mixtral-3/jobs/train.sbatch
        107|PENDING|compute1,cpu|(null)
        """
    )
    data = values(job_data(squeue, runs_root))
    assert data == {
        (cloudwatch.SLURM_JOBS, (("State", "RUNNING"),)): 3,
        (cloudwatch.SLURM_JOBS, (("State", "PENDING"),)): 3,
        (cloudwatch.SLURM_JOBS, (("State", "CONFIGURING"),)): 1,
        (cloudwatch.TRAINING_JOBS_RUNNING, ()): 2,  # not the other user's train.sbatch, not the booting one
    }


def test_an_empty_queue_still_sends_running_and_pending() -> None:
    data = values(job_data("", Path("/fsx/runs")))
    assert data == {
        (cloudwatch.SLURM_JOBS, (("State", "RUNNING"),)): 0,
        (cloudwatch.SLURM_JOBS, (("State", "PENDING"),)): 0,
        (cloudwatch.TRAINING_JOBS_RUNNING, ()): 0,
    }


def row(stage: str, state: str, reason: str | None = None) -> dict[str, Any]:
    found: dict[str, Any] = {"stage": stage, "job": "1", "state": state, "elapsed": ""}
    if reason:
        found["reason"] = reason
    return found


@pytest.mark.parametrize(
    ("rows", "count"),
    [
        ([row("prepare", "COMPLETED"), row("train", "RUNNING"), row("sample", "PENDING", "Dependency")], 0),
        ([row("train", "FAILED", "NonZeroExitCode"), row("convert-out", "PENDING", "DependencyNeverSatisfied")], 2),
        # The failed job itself already forgotten by Slurm (MinJobAge): its dependants still tell.
        ([row("train", "UNKNOWN"), row("convert-out", "PENDING", "DependencyNeverSatisfied")], 1),
        ([row("compile", "TIMEOUT"), row("train", "OUT_OF_MEMORY"), row("export", "NODE_FAIL")], 3),
        ([row("train", "BOOT_FAIL"), row("sample", "DEADLINE"), row("export", "PREEMPTED")], 3),
        # kill_invalid_depend (the local Slurm) cancels the dependants instead of leaving them pending.
        ([row("convert-out", "CANCELLED", "DependencyNeverSatisfied")], 1),
        ([row("train", "CANCELLED"), row("sample", "CANCELLED")], 0),  # a cancel is a decision, not a failure
        ([], 0),
    ],
)
def test_failed_stages(rows: list[dict[str, Any]], count: int) -> None:
    assert failed_stages(rows) == cloudwatch.Datum(cloudwatch.FAILED_STAGES, count, "Count")


@pytest.mark.parametrize(
    ("log_tail", "done", "count"),
    [
        ("Traceback (most recent call last):\nRuntimeError: NRT error\n", False, 1),
        ("slurmstepd: error: *** JOB 7 ON trn-st-1 CANCELLED AT 2026-12-02T10:00:00 DUE TO TIME LIMIT ***\n", False, 1),
        ("slurmstepd: error: *** JOB 7 ON trn-st-1 CANCELLED AT 2026-12-02T10:00:00 ***\n", False, 0),  # a user's
        ("2026-12-02T10:00:00Z train done\n", True, 0),
        (None, False, 0),  # never ran: no log
    ],
)
def test_a_stage_whose_job_slurm_forgot_failed_if_it_ran_and_did_not_finish(
    tmp_path: Path, log_tail: str | None, done: bool, count: int
) -> None:
    """ParallelCluster's Slurm forgets finished jobs after MinJobAge (300 s): the alarm must not clear then."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "state").mkdir()
    forgotten = {**row("train", "UNKNOWN"), "job": "7"}
    if log_tail is not None:
        (tmp_path / "logs" / "train-7.out").write_text("x" * 10_000 + "\n" + log_tail)
    if done:
        (tmp_path / "state" / "train.done").touch()
    assert failed_stages([forgotten], tmp_path).value == count
    assert failed_stages([forgotten]).value == 0  # without the run directory nothing can be told


# --- through the CLI, Slurm's commands replaced by stand-ins printing their real output shapes ---------------


@pytest.fixture
def cluster_site(tmp_path: Path) -> tuple[Path, Path]:
    """A site whose slurm_bin holds stand-ins for squeue, sinfo and scontrol, and one run whose train stage
    failed (already forgotten by Slurm) with its dependant left pending for ever."""
    runs_root = tmp_path / "runs"
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    squeue = f"201|PENDING|cpu|{runs_root}/run-a/jobs/convert-out.sbatch\\n"
    sinfo = "compute1|idle~|15\\ncompute1|down*|1\\ncpu|idle|2\\n"
    scripts = {
        "squeue": f'printf "{squeue}"',
        "sinfo": f'printf "{sinfo}"',
        "scontrol": textwrap.dedent(
            """\
            case "$4" in
              201) echo "JobId=201 JobName=run-a-convert-out JobState=PENDING Reason=DependencyNeverSatisfied" \
                     "RunTime=00:00:00" ;;
              *) echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1 ;;
            esac"""
        ),
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(f'#!/bin/bash\necho "{name} $*" >>{calls}\n{body}\n')
        path.chmod(0o755)
    run_dir = runs_root / "run-a"
    run_dir.mkdir(parents=True)
    site = Site(
        runs_root=str(runs_root),
        slurm_bin=str(bin_dir),
        partition="compute1",
        cpu_partition="cpu",
        region=REGION,
        metrics_namespace=NAMESPACE,
    )
    record = {
        "run_id": "run-a",
        "site": site.model_dump(mode="json"),
        "stages": ["train", "convert-out"],
        "submissions": [{"jobs": {"train": "200", "convert-out": "201"}}],
    }
    (run_dir / "run.json").write_text(json.dumps(record))
    site_file = tmp_path / "site.yaml"
    site_file.write_text(yaml.safe_dump(site.model_dump(mode="json")))
    return site_file, calls


def test_dry_run_prints_the_request_and_uses_the_site_slurm(
    cluster_site: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    site_file, calls = cluster_site
    assert main(["monitor", "cluster", "--site", str(site_file), "--dry-run"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    request = json.loads(line)
    assert request["Namespace"] == NAMESPACE
    sent = {
        (m["MetricName"], tuple((d["Name"], d["Value"]) for d in m.get("Dimensions", []))): m
        for m in request["MetricData"]
    }
    assert sent[cloudwatch.SLURM_JOBS, (("State", "PENDING"),)]["Value"] == 1
    assert sent[cloudwatch.SLURM_JOBS, (("State", "RUNNING"),)]["Value"] == 0
    assert sent[cloudwatch.TRAINING_JOBS_RUNNING, ()]["Value"] == 0
    assert sent[cloudwatch.FAILED_STAGES, ()] == {"MetricName": "FailedStages", "Value": 1.0, "Unit": "Count"}
    nodes = (("Partition", "compute1"), ("State", "powered_down"))
    assert sent[cloudwatch.SLURM_NODES, nodes]["Value"] == 15
    assert sent[cloudwatch.SLURM_NODES, (("Partition", "compute1"), ("State", "down"))]["Value"] == 1
    assert sent[cloudwatch.SLURM_NODES, (("Partition", "cpu"), ("State", "idle"))]["Value"] == 2
    commands = calls.read_text().splitlines()
    assert " ".join(SQUEUE_COMMAND) in commands and " ".join(SINFO_COMMAND) in commands


def test_publishes_to_cloudwatch(
    cluster_site: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    site_file, _ = cluster_site
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")  # the site's region wins
    with mock_aws():
        assert main(["monitor", "cluster", "--site", str(site_file)]) == 0
        assert capsys.readouterr().out == ""
        client = boto3.client("cloudwatch", region_name=REGION)
        listed = client.list_metrics(Namespace=NAMESPACE)["Metrics"]
        names = {(m["MetricName"], tuple((d["Name"], d["Value"]) for d in m["Dimensions"])) for m in listed}
        assert (cloudwatch.FAILED_STAGES, ()) in names
        assert (cloudwatch.TRAINING_JOBS_RUNNING, ()) in names
        assert (cloudwatch.SLURM_JOBS, (("State", "RUNNING"),)) in names
        assert (cloudwatch.SLURM_NODES, (("Partition", "compute1"), ("State", "powered_down"))) in names
        now = datetime.now(timezone.utc)
        window = {"StartTime": now - timedelta(minutes=5), "EndTime": now + timedelta(minutes=1), "Period": 60}
        failed = client.get_metric_statistics(
            Namespace=NAMESPACE, MetricName=cloudwatch.FAILED_STAGES, Statistics=["Maximum"], **window
        )
        assert [(p["Maximum"], p["Unit"]) for p in failed["Datapoints"]] == [(1.0, "Count")]
        nodes = client.get_metric_statistics(
            Namespace=NAMESPACE,
            MetricName=cloudwatch.SLURM_NODES,
            Dimensions=[{"Name": "Partition", "Value": "compute1"}, {"Name": "State", "Value": "powered_down"}],
            Statistics=["Maximum"],
            **window,
        )
        assert [p["Maximum"] for p in nodes["Datapoints"]] == [15.0]
        assert boto3.client("cloudwatch", region_name="us-east-1").list_metrics(Namespace=NAMESPACE)["Metrics"] == []


def test_a_site_without_a_namespace_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    site_file = tmp_path / "site.yaml"
    site_file.write_text(yaml.safe_dump({"runs_root": str(tmp_path / "runs")}))
    assert main(["monitor", "cluster", "--site", str(site_file), "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().splitlines() == [
        f"error: {site_file}: no metrics_namespace; set it (e.g. Trainium/<environment>) to publish CloudWatch metrics"
    ]
