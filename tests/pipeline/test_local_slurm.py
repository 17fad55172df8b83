"""The local Slurm cluster behaves as the pipeline's job scripts need: multi-node srun, dependencies that fail
fast, self-requeue, impossible requests rejected at submit, and a `down` that leaves nothing running."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from training.errors import UserError
from training.local import slurm_host
from training.local.slurm import LocalSlurm, running, start

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def submit(cluster: LocalSlurm, script: str, *options: str) -> str:
    result = cluster.run("sbatch", "--parsable", *options, input=script)
    return result.stdout.strip().split(";")[0]


def job(cluster: LocalSlurm, job_id: str) -> dict[str, str]:
    output = cluster.run("scontrol", "show", "job", "--oneliner", job_id).stdout
    return dict(re.findall(r"(\w+)=(\S*)", output))


def wait(cluster: LocalSlurm, job_id: str, timeout: float = 30) -> dict[str, str]:
    """Poll `scontrol show job` (no accounting here, and `sbatch --wait` polls only every few seconds)."""
    deadline = time.monotonic() + timeout
    while (info := job(cluster, job_id))["JobState"] not in TERMINAL:
        assert time.monotonic() < deadline, f"job {job_id} not finished after {timeout} s: {info}"
        time.sleep(0.1)
    return info


def pid_alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_two_node_job_runs_one_task_on_each_node(local_slurm: LocalSlurm, tmp_path: Path) -> None:
    script = """#!/bin/bash
set -euo pipefail
srun --ntasks-per-node=1 bash -c 'echo "task $SLURM_NODEID on $SLURMD_NODENAME"'
first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
echo "master $(scontrol show node "$first" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')"
"""
    job_id = submit(local_slurm, script, "--nodes=2", f"--output={tmp_path}/out")
    info = wait(local_slurm, job_id)
    assert info["JobState"] == "COMPLETED", info
    lines = (tmp_path / "out").read_text().splitlines()
    tasks = dict(line.split()[1::2] for line in lines if line.startswith("task "))
    assert sorted(tasks) == ["0", "1"]
    assert len(set(tasks.values())) == 2
    assert set(tasks.values()) <= set(local_slurm.nodes)
    # Job scripts take MASTER_ADDR from the first node's NodeAddr: node names do not resolve here.
    assert "master 127.0.0.1" in lines
    assert local_slurm.node_address(local_slurm.nodes[0]) == "127.0.0.1"


def test_afterok_on_a_failed_job_cancels_the_dependant_at_once(local_slurm: LocalSlurm) -> None:
    failing = submit(local_slurm, "#!/bin/bash\nexit 3\n", "--hold", "--output=/dev/null")
    dependant = submit(local_slurm, "#!/bin/bash\ntrue\n", f"--dependency=afterok:{failing}", "--output=/dev/null")
    local_slurm.run("scontrol", "release", failing)  # held until the dependant exists: no submit-time race
    began = time.monotonic()
    info = wait(local_slurm, dependant, timeout=15)
    assert (info["JobState"], info["Reason"]) == ("CANCELLED", "DependencyNeverSatisfied"), info
    assert time.monotonic() - began < 10
    assert job(local_slurm, failing)["JobState"] == "FAILED"


def test_a_job_that_requeues_itself_runs_again_and_completes(local_slurm: LocalSlurm, tmp_path: Path) -> None:
    # The training job's pattern after a failed rank: requeue itself, exit, run again from its checkpoint.
    script = """#!/bin/bash
set -euo pipefail
echo "run ${SLURM_RESTART_COUNT:-unset}"
if [ "${SLURM_RESTART_COUNT:-0}" -eq 0 ]; then
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
echo done
"""
    job_id = submit(local_slurm, script, "--requeue", "--open-mode=append", f"--output={tmp_path}/out")
    info = wait(local_slurm, job_id)
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1"), info
    lines = (tmp_path / "out").read_text().splitlines()
    runs = [line for line in lines if line.startswith("run ") or line == "done"]
    assert runs == ["run unset", "run 1", "done"], lines


def test_gpu_requests_are_rejected_at_submit(local_slurm: LocalSlurm) -> None:
    result = local_slurm.run("sbatch", "--gres=gpu:1", "--wrap=true", check=False)
    assert result.returncode != 0
    assert "Invalid generic resource" in result.stderr


@pytest.mark.slurm  # a cluster of its own
def test_stop_ends_every_daemon_and_running_job(tmp_path: Path) -> None:
    cluster = start(tmp_path / "state", nodes=1)
    again = start(tmp_path / "state", nodes=1)
    assert (cluster.started, again.started, again.daemons) == (True, False, cluster.daemons)
    job_id = submit(
        cluster, "#!/bin/bash\necho $$ > pid\nexec sleep 300\n", f"--chdir={tmp_path}", "--output=/dev/null"
    )
    deadline = time.monotonic() + 120  # a wait, not a timing: a fresh node registers slowly on a busy machine
    while not (tmp_path / "pid").exists() or not (tmp_path / "pid").read_text().strip():
        assert time.monotonic() < deadline, job(cluster, job_id)
        time.sleep(0.05)
    job_pid = int((tmp_path / "pid").read_text())
    assert pid_alive(job_pid)

    cluster.stop()
    assert not [pid for pid, _ in cluster.daemons.values() if pid_alive(pid)]
    assert not pid_alive(job_pid)
    assert running(tmp_path / "state") is None
    cluster.stop()  # idempotent


@pytest.mark.slurm  # a cluster of its own
def test_command_line_up_status_down(tmp_path: Path) -> None:
    """Through a pipe, as make or CI run it: the daemons must not hold the caller's output open."""
    state = tmp_path / "cli"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "training.local.slurm", *args, "--state-dir", str(state)]
        return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)

    up = cli("up", "--nodes", "2")
    assert up.returncode == 0, up.stderr
    assert f"export SLURM_CONF={state / 'slurm.conf'}" in up.stdout
    assert "already running" in cli("up", "--nodes", "2").stdout
    status = cli("status")
    assert status.returncode == 0
    assert re.search(r"node1 .* idle", status.stdout) and re.search(r"node2 .* idle", status.stdout)
    cluster = running(state)
    assert cluster is not None
    pids = [pid for pid, _ in cluster.daemons.values()]
    assert cli("down").stdout.startswith("local Slurm stopped")
    assert not [pid for pid in pids if pid_alive(pid)]
    assert cli("down").stdout.startswith("local Slurm not running")
    assert cli("status").returncode == 3


def test_installing_without_root_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm_host, "system_command", lambda command: None)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(UserError, match=r"installing it needs root: run `sudo apt-get install slurmctld slurmd"):
        slurm_host.ensure_installed()
