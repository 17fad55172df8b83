"""The node health prolog the head node installs, run as slurmd runs a prolog (as root, no PATH, the job's
partition and the node's name in the environment) against a fake device tree, draining a real Slurm node."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.assets.test_on_node_configured import SCRIPT, fake_device_tree

REASON = "trainium node health: 15 of 16 Neuron devices, 7 of 8 EFA devices"


@pytest.fixture
def prolog(tmp_path: Path, local_slurm: Any) -> Path:
    """The prolog as the head node's bootstrap writes it, calling this machine's Slurm by its prefix."""
    target = tmp_path / "prolog.d" / "80_trainium_node_health"
    snippet = "ARG_TRAINIUM_PARTITION=compute1 ARG_NEURON_DEVICES=16 ARG_EFA_DEVICES=8 write_health_prolog"
    written = subprocess.run(
        ["/bin/bash", "-c", f'source "$1"\n{snippet}', "bash", str(SCRIPT)],
        env={"PATH": "/usr/bin:/bin", "HEALTH_PROLOG": str(target), "SLURM_BIN": str(local_slurm.bin_dir)},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert written.returncode == 0, written.stderr
    return target


def run_prolog(prolog: Path, node: str, partition: str, devices: Path) -> subprocess.CompletedProcess[str]:
    environment = {"SLURM_JOB_PARTITION": partition, "SLURMD_NODENAME": node, "DEVICE_ROOT": str(devices)}
    return subprocess.run(["/bin/bash", str(prolog)], env=environment, capture_output=True, text=True, check=False)


def node_reason(local_slurm: Any, node: str) -> str:
    line = local_slurm.run("scontrol", "show", "node", "--oneliner", node).stdout
    return line.split(" Reason=", 1)[1].split(" [", 1)[0] if " Reason=" in line else ""


def test_a_node_missing_devices_is_drained_with_the_reason(prolog: Path, local_slurm: Any, tmp_path: Path) -> None:
    node = local_slurm.nodes[-1]
    broken = fake_device_tree(tmp_path / "broken", neuron=15, efa=7)
    try:
        result = run_prolog(prolog, node, "compute1", broken)
        assert result.returncode == 1 and result.stderr.strip() == REASON
        assert node_reason(local_slurm, node) == REASON
        assert "DRAIN" in local_slurm.node_states()[node]
    finally:
        local_slurm.run("scontrol", "update", f"NodeName={node}", "State=RESUME")


def test_a_healthy_node_and_other_partitions_pass(prolog: Path, local_slurm: Any, tmp_path: Path) -> None:
    node = local_slurm.nodes[-1]
    healthy = fake_device_tree(tmp_path / "healthy", neuron=16, efa=8)
    assert run_prolog(prolog, node, "compute1", healthy).returncode == 0
    empty = fake_device_tree(tmp_path / "cpu-node", neuron=0, efa=0)
    assert run_prolog(prolog, node, "cpu", empty).returncode == 0  # CPU queue nodes have no Neuron devices
    assert node_reason(local_slurm, node) == "" and "DRAIN" not in local_slurm.node_states()[node]
