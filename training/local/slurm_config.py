"""The local Slurm's configuration: `slurm.conf` for one host, and the client commands bound to it.

Part of the local Slurm (`training.local.slurm`); developer machine only, never shipped.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Sequence
from pathlib import Path

from training.errors import UserError
from training.local.slurm_host import system_command

PARTITION = "local"
REAL_MEMORY_MB = 1024  # small on purpose: memory is not a consumable resource here (CR_CPU), as on ParallelCluster
# The client commands of Debian's slurm-client package that the `bin/` prefix offers.
CLIENT_COMMANDS = ("sacct", "salloc", "sattach", "sbatch", "sbcast", "scancel", "scontrol", "sinfo", "squeue", "srun")


def node_names(nodes: int) -> list[str]:
    return [f"node{index}" for index in range(1, nodes + 1)]


def render_config(state_dir: Path, nodes: int, ports: Sequence[int], cpus: int) -> str:
    """slurm.conf for one host; ports[0] is the controller's, ports[1:] the nodes'. All paths inside state_dir."""
    d = state_dir
    user = pwd.getpwuid(os.geteuid()).pw_name
    node_lines = [
        f"NodeName={name} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} RealMemory={REAL_MEMORY_MB} State=UNKNOWN"
        for name, port in zip(node_names(nodes), ports[1:], strict=True)
    ]
    node_list = f"node[1-{nodes}]" if nodes > 1 else "node1"
    return "\n".join(
        [
            "# Written by training.local.slurm on every `up`; edits are overwritten.",
            "ClusterName=local",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={ports[0]}",
            f"SlurmUser={user}",
            f"SlurmdUser={user}",
            # No munge daemon: every daemon and client runs on this host as the same user.
            "AuthType=auth/none",
            "CredType=cred/none",
            # A requeued job may start again cred_expire + 1 s after the requeue (default 120 s).
            "AuthInfo=cred_expire=5",
            "MpiDefault=none",
            # No cgroups (none in this container): track job processes by parentage, no task binding.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            # A job whose dependency can never be met is cancelled instead of pending forever.
            "DependencyParameters=kill_invalid_depend",
            # Requests no partition can satisfy (GPUs, too many nodes) fail at submit instead of pending forever.
            "EnforcePartLimits=ALL",
            # Start jobs within a second of submission.
            "SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=1",
            # Finished jobs stay visible to `scontrol show job` for a day (no accounting database here).
            "MinJobAge=86400",
            "SlurmdTimeout=300",
            "ReturnToService=2",
            # A failed training run requeues itself with `scontrol requeue`.
            "JobRequeue=1",
            # All slurmd on this host report the same hardware; the node lines below are the truth.
            "SlurmdParameters=config_overrides",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool' / '%n'}",
            f"SlurmctldPidFile={d / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'run' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'log' / 'slurmd-%n.log'}",
            *node_lines,
            f"PartitionName={PARTITION} Nodes={node_list} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


def write_client_prefix(state_dir: Path) -> Path:
    """`state_dir/bin`: one wrapper per client command that runs the system's command on this cluster.

    The site settings name this directory as `slurm_bin`, as they name `/opt/slurm/bin` on ParallelCluster.
    """
    bin_dir = state_dir / "bin"
    bin_dir.mkdir(exist_ok=True)
    conf = (state_dir / "slurm.conf").resolve()
    for command in CLIENT_COMMANDS:
        system = system_command(command)
        if system is None:
            raise UserError(f"{command}: not installed (Debian package slurm-client)")
        wrapper = bin_dir / command
        wrapper.write_text(f'#!/bin/sh\nSLURM_CONF={conf} exec {system} "$@"\n')
        wrapper.chmod(0o755)
    return bin_dir


def slurm_env(state_dir: Path) -> dict[str, str]:
    """What to merge into os.environ so Slurm clients talk to the cluster of state_dir."""
    return {"SLURM_CONF": str((state_dir / "slurm.conf").resolve())}
