"""`monitor cluster` against the real local Slurm, under ParallelCluster's shell conditions (no Slurm and no
Python on PATH, as in a systemd unit): the queue, the nodes, a running training job and the failed stages of
the newest run, as the head node's timer would publish them (printed with --dry-run)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.parallelcluster_shell import non_login_environment, parallelcluster_path
from training.config.site import Site
from training.local.slurm import LocalSlurm
from training.local.slurm_config import PARTITION
from training.monitoring import cloudwatch

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "Trainium/local-test"


def job_state(cluster: LocalSlurm, job: str) -> tuple[str, str]:
    output = cluster.run("scontrol", "show", "job", "-o", job).stdout
    fields = dict(token.partition("=")[::2] for token in output.split())
    return fields.get("JobState", ""), fields.get("Reason", "")


def wait_for(cluster: LocalSlurm, wanted: dict[str, str], timeout: float = 30) -> None:
    """Until each job is in its wanted state."""
    deadline = time.monotonic() + timeout
    while True:
        states = {job: job_state(cluster, job) for job in wanted}
        if all(states[job][0] == state for job, state in wanted.items()):
            return
        assert time.monotonic() < deadline, f"jobs not in the expected states after {timeout} s: {states}"
        time.sleep(0.2)


def submit(cluster: LocalSlurm, script: Path, name: str, *options: str) -> str:
    result = cluster.run("sbatch", "--parsable", f"--job-name={name}", "--output=/dev/null", *options, str(script))
    return result.stdout.strip().split(";")[0]


def test_monitor_cluster_dry_run_on_the_local_slurm(local_slurm: LocalSlurm, tmp_path: Path) -> None:
    runs_root = tmp_path / "runs"
    run_dir = runs_root / "run-m"
    jobs = run_dir / "jobs"
    jobs.mkdir(parents=True)
    bodies = {"prepare": "exit 3", "train": "sleep 120", "convert-out": "true"}
    for stage, body in bodies.items():
        (jobs / f"{stage}.sbatch").write_text(f"#!/bin/bash\n{body}\n")
    train = submit(local_slurm, jobs / "train.sbatch", "run-m-train")
    prepare = submit(local_slurm, jobs / "prepare.sbatch", "run-m-prepare", "--hold")
    convert = submit(local_slurm, jobs / "convert-out.sbatch", "run-m-convert-out", f"--dependency=afterok:{prepare}")
    local_slurm.run("scontrol", "release", prepare)
    try:
        # prepare fails; its dependant can never run (the local Slurm's kill_invalid_depend cancels it).
        wait_for(local_slurm, {train: "RUNNING", prepare: "FAILED", convert: "CANCELLED"})
        site = Site(
            runs_root=str(runs_root),
            slurm_bin=str(local_slurm.bin_dir),
            partition=PARTITION,
            metrics_namespace=NAMESPACE,
        )
        record: dict[str, Any] = {
            "run_id": "run-m",
            "site": site.model_dump(mode="json"),
            "stages": list(bodies),
            "submissions": [{"jobs": {"prepare": prepare, "train": train, "convert-out": convert}}],
        }
        (run_dir / "run.json").write_text(json.dumps(record))
        # The jobs' timeline and the train stage's first step (as base.sbatch.j2 and the training job write them)
        now = time.time()
        events = [
            {"stage": "prepare", "event": "start", "time": now - 100, "job": prepare},
            {"stage": "train", "event": "start", "time": now - 60, "job": train, "node_boot": now - 900.0},
        ]
        (run_dir / "timeline.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        (run_dir / "checkpoints").mkdir()
        first_step = {"step": 1, "loss": 2.0, "time": now - 15}
        (run_dir / "checkpoints" / "metrics.jsonl").write_text(json.dumps(first_step) + "\n")
        site_file = tmp_path / "site.yaml"
        site_file.write_text(yaml.safe_dump(site.model_dump(mode="json")))
        home = tmp_path / "home"
        home.mkdir()
        env = {**non_login_environment(parallelcluster_path(tmp_path / "node-bin"), home), "PYTHONPATH": str(ROOT)}
        result = subprocess.run(
            [sys.executable, "-m", "training", "monitor", "cluster", "--site", str(site_file), "--dry-run"],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        local_slurm.run("scancel", train, prepare, convert, check=False)

    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.splitlines()
    request = json.loads(line)
    assert request["Namespace"] == NAMESPACE
    sent = {
        (m["MetricName"], tuple((d["Name"], d["Value"]) for d in m.get("Dimensions", []))): m["Value"]
        for m in request["MetricData"]
    }
    assert sent[cloudwatch.SLURM_JOBS, (("State", "RUNNING"),)] >= 1
    assert sent[cloudwatch.TRAINING_JOBS_RUNNING, ()] == 1
    assert sent[cloudwatch.FAILED_STAGES, ()] == 2  # prepare FAILED, convert-out never satisfied
    nodes = {
        dict(dims)["State"]: value
        for (name, dims), value in sent.items()
        if name == cloudwatch.SLURM_NODES and dict(dims)["Partition"] == PARTITION
    }
    assert set(nodes) == {"allocated", "idle", "powering_up", "powered_down", "down"}
    assert sum(nodes.values()) == len(local_slurm.nodes)
    assert nodes["allocated"] >= 1 and nodes["down"] == 0
    # While the run is active: the time to its first step; prepare failed (no end), no bootstrap on this machine.
    stages = {dict(dims)["Stage"]: value for (name, dims), value in sent.items() if name == cloudwatch.STAGE_SECONDS}
    assert stages == {"first-step": pytest.approx(45.0, abs=0.01)}
