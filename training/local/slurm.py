"""A real Slurm cluster on this one machine, started and stopped by this module: no systemd, nothing in /etc.

One `slurmctld` and N `slurmd` (nodes `node1..nodeN`, all on 127.0.0.1 with their own ports) run detached
from a state directory that holds the generated `slurm.conf`, the controller state, the spool, the logs and
the daemons' PIDs. Like ParallelCluster's `/opt/slurm/bin`, the state directory's `bin/` holds the client
commands (sbatch, squeue, scontrol, ...), each bound to this cluster's `slurm.conf`; the system's Slurm
configuration, if any, is never read or changed, and nothing needs Slurm on PATH. It lets the pipeline's
real job scripts (dependencies, requeue, multi-node srun) run locally exactly as they do on ParallelCluster.

    python -m training.local.slurm up|down|status [--state-dir DIR] [--nodes N]
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from training.errors import ArgumentParser, UserError, guarded
from training.local.slurm_config import node_names, render_config, slurm_env, write_client_prefix
from training.local.slurm_host import alive, ensure_installed, file_tail, free_ports, proc_stat, system_command

DEFAULT_STATE_DIR = Path(".local-slurm")
DEFAULT_NODES = 3
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
POLL_S = 0.05
RECORD = "daemons.json"


@dataclass
class LocalSlurm:
    """A running cluster of one state directory; `daemons` maps slurmctld and each node to (pid, start time)."""

    state_dir: Path
    nodes: list[str]
    daemons: dict[str, tuple[int, int]]
    started: bool = False  # False when `start` found it already running
    _children: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)

    @property
    def conf(self) -> Path:
        return self.state_dir / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return slurm_env(self.state_dir)

    @property
    def bin_dir(self) -> Path:
        """The client commands' prefix (the site's `slurm_bin`)."""
        return self.state_dir / "bin"

    def run(
        self, *args: str, check: bool = True, timeout: float = 30.0, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command against this cluster (stdin from `input`, e.g. an sbatch script)."""
        env = {**os.environ, **self.env}
        command = [system_command(args[0]) or args[0], *args[1:]]  # the system's command, wherever PATH points
        result = subprocess.run(
            command, env=env, input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and result.returncode != 0:
            raise UserError(f"`{' '.join(args)}` failed: {result.stderr.strip() or result.stdout.strip()}")
        return result

    def node_address(self, name: str) -> str:
        """NodeAddr of a node: node names do not resolve here, so job scripts take MASTER_ADDR from this."""
        output = self.run("scontrol", "show", "node", "--oneliner", name).stdout
        match = re.search(r"\bNodeAddr=(\S+)", output)
        if match is None:
            raise UserError(f"no NodeAddr for node {name!r} in `scontrol show node`: {output.strip()}")
        return match.group(1)

    def node_states(self) -> dict[str, str]:
        """Node name -> State (e.g. IDLE, ALLOCATED, DOWN+NOT_RESPONDING); empty while the controller is down."""
        try:
            result = self.run("scontrol", "show", "node", "--oneliner", check=False, timeout=5)
        except subprocess.TimeoutExpired:
            return {}
        states = {}
        for line in result.stdout.splitlines():
            name, state = re.search(r"\bNodeName=(\S+)", line), re.search(r"\bState=(\S+)", line)
            if name and state:
                states[name.group(1)] = state.group(1)
        return states

    def sinfo(self) -> str:
        return self.run("sinfo", "--Node", "--long", check=False).stdout

    def alive(self) -> dict[str, bool]:
        return {name: alive(pid, start) for name, (pid, start) in self.daemons.items()}

    def _record(self) -> None:
        record = {"nodes": self.nodes, "daemons": {name: list(value) for name, value in self.daemons.items()}}
        (self.state_dir / RECORD).write_text(json.dumps(record, indent=2) + "\n")

    def _logs(self) -> str:
        """The daemons' own output: it has what the log files have plus errors from before they are opened."""
        logs = [_output_file(self.state_dir, name) for name in ["slurmctld", *self.nodes]]
        return "\n".join(f"--- {log} (last lines)\n{file_tail(log, 10)}" for log in logs)

    def _wait_until_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            dead = [name for name, up in self.alive().items() if not up]
            if dead:
                raise UserError(f"local Slurm: {', '.join(dead)} exited during start-up\n{self._logs()}")
            states = self.node_states()
            if all(states.get(node) == "IDLE" for node in self.nodes):
                return
            if time.monotonic() > deadline:
                raise UserError(
                    f"local Slurm: nodes not idle after {timeout:.0f} s (states: {states or 'controller unreachable'})"
                    f"\n{self._logs()}"
                )
            time.sleep(POLL_S)

    def _cancel_jobs(self, timeout: float) -> None:
        """Cancel every job so no job process outlives the cluster; wait a little for them to finish."""
        jobs = self.run("squeue", "--noheader", "--format=%A", check=False, timeout=10).stdout.split()
        if not jobs:
            return
        self.run("scancel", *jobs, check=False, timeout=10)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.run("squeue", "--noheader", "--format=%A", check=False, timeout=10).stdout.split():
                return
            time.sleep(POLL_S)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop exactly the recorded daemons (SIGTERM, SIGKILL after timeout); idempotent.

        `scontrol shutdown` is not used: with several slurmd on one host it stops only one of them.
        """
        with contextlib.suppress(subprocess.TimeoutExpired):
            if self.daemons.get("slurmctld") and alive(*self.daemons["slurmctld"]):
                self._cancel_jobs(timeout)
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            running = [(pid, start) for pid, start in self.daemons.values() if alive(pid, start)]
            for pid, _ in running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while any(alive(pid, start) for pid, start in running) and time.monotonic() < deadline:
                time.sleep(POLL_S)
        for child in self._children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=1)
        _kill_orphaned_job_processes(self.conf)
        still = [name for name, up in self.alive().items() if up]
        if still:
            raise UserError(f"local Slurm: {', '.join(still)} still running after SIGKILL")
        (self.state_dir / RECORD).unlink(missing_ok=True)


def _kill_orphaned_job_processes(conf: Path) -> None:
    """Kill slurmstepd and job processes of this cluster left behind by a daemon killed mid-job.

    They are recognised by their environment: SLURM_CONF of this cluster plus being a slurmstepd or a job
    task (SLURM_JOB_ID set), so a shell that merely exported SLURM_CONF is left alone.
    """
    marker = f"SLURM_CONF={conf.resolve()}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if marker in environ and (comm == "slurmstepd" or any(v.startswith(b"SLURM_JOB_ID=") for v in environ)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


def recorded(state_dir: Path) -> LocalSlurm | None:
    """The cluster recorded in state_dir, whether or not its daemons still run; None if there is no record."""
    record_path = state_dir / RECORD
    if not record_path.exists():
        return None
    record = json.loads(record_path.read_text())
    daemons = {name: (int(value[0]), int(value[1])) for name, value in record["daemons"].items()}
    return LocalSlurm(state_dir=state_dir.resolve(), nodes=list(record["nodes"]), daemons=daemons)


def running(state_dir: Path) -> LocalSlurm | None:
    """The cluster of state_dir if every recorded daemon is alive, else None."""
    cluster = recorded(state_dir)
    return cluster if cluster is not None and all(cluster.alive().values()) else None


def _output_file(state_dir: Path, daemon: str) -> Path:
    return state_dir / "log" / ("slurmctld.out" if daemon == "slurmctld" else f"slurmd-{daemon}.out")


def _spawn(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Detached: own session, no stdin, output to a file, so it neither holds the caller's terminal or pipes
    open nor dies with the caller's process group."""
    with log.open("wb") as output:
        return subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def start(
    state_dir: Path = DEFAULT_STATE_DIR, nodes: int = DEFAULT_NODES, timeout: float = START_TIMEOUT_S
) -> LocalSlurm:
    """Start the cluster of state_dir (installing Slurm if needed) and wait until every node is idle.

    Already running with the same node count: returned as is (`started` False).
    """
    if nodes < 1:
        raise UserError(f"--nodes {nodes}: at least 1")
    state_dir = state_dir.resolve()
    existing = recorded(state_dir)
    if existing is not None and all(existing.alive().values()):
        if len(existing.nodes) != nodes:
            raise UserError(
                f"local Slurm in {state_dir} already runs with {len(existing.nodes)} nodes, not {nodes}: "
                "run `down` first to change the node count"
            )
        write_client_prefix(state_dir)  # a cluster started by an older version has none
        return existing
    if existing is not None:  # partly dead (a daemon crashed or was killed): stop the rest, start afresh
        existing.stop()
    ensure_installed()
    for sub in ("state", "spool", "run", "log"):
        (state_dir / sub).mkdir(parents=True, exist_ok=True)
    for node in node_names(nodes):
        (state_dir / "spool" / node).mkdir(exist_ok=True)
    conf = state_dir / "slurm.conf"
    conf.write_text(render_config(state_dir, nodes, free_ports(nodes + 1), len(os.sched_getaffinity(0))))
    write_client_prefix(state_dir)
    env = {**os.environ, **slurm_env(state_dir)}
    commands = {"slurmctld": [system_command("slurmctld") or "slurmctld", "-D", "-f", str(conf)]}
    for node in node_names(nodes):
        commands[node] = [system_command("slurmd") or "slurmd", "-D", "-N", node, "-f", str(conf)]
    cluster = LocalSlurm(state_dir=state_dir, nodes=node_names(nodes), daemons={}, started=True)
    try:
        for name, command in commands.items():
            child = _spawn(command, _output_file(state_dir, name), env)
            cluster._children.append(child)
            stat = proc_stat(child.pid)
            cluster.daemons[name] = (child.pid, stat[1] if stat else 0)
        cluster._record()
        cluster._wait_until_idle(timeout)
    except BaseException:
        with contextlib.suppress(UserError):
            cluster.stop(timeout=5)
        raise
    return cluster


def stop(state_dir: Path = DEFAULT_STATE_DIR) -> bool:
    """Stop what runs of the cluster of state_dir; False if none of its daemons was running."""
    cluster = recorded(state_dir.resolve())
    if cluster is None:
        return False
    was_running = any(cluster.alive().values())
    cluster.stop()
    return was_running


# --- command line ------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 done (status: running), 1 status: partly running, 2 error, 3 status: not running."""
    parser = ArgumentParser(prog="python -m training.local.slurm", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="default: %(default)s")
    parser.add_argument("--nodes", type=int, default=DEFAULT_NODES, help="for up; default: %(default)s")
    args = parser.parse_args(argv)
    state_dir: Path = args.state_dir.resolve()

    def run() -> int:
        if args.action == "up":
            began = time.monotonic()
            cluster = start(state_dir, args.nodes)
            if cluster.started:
                print(f"local Slurm up in {time.monotonic() - began:.1f} s: {len(cluster.nodes)} nodes, {state_dir}")
            else:
                print(f"local Slurm already running: {len(cluster.nodes)} nodes, {state_dir}")
            print(f"export SLURM_CONF={cluster.conf}")
        elif args.action == "down":
            print(f"local Slurm stopped ({state_dir})" if stop(state_dir) else f"local Slurm not running ({state_dir})")
        else:
            cluster_or_none = recorded(state_dir)
            alive = cluster_or_none.alive() if cluster_or_none else {}
            if not any(alive.values()):
                print(f"local Slurm not running ({state_dir})")
                return 3
            if not all(alive.values()):
                dead = ", ".join(name for name, up in alive.items() if not up)
                print(
                    f"local Slurm partly running ({state_dir}): {dead} exited (logs in {state_dir / 'log'}); run down"
                )
                return 1
            assert cluster_or_none is not None
            pids = ", ".join(f"{name} {pid}" for name, (pid, _) in cluster_or_none.daemons.items())
            print(f"local Slurm running ({state_dir}): {pids}")
            print(f"export SLURM_CONF={cluster_or_none.conf}")
            print(cluster_or_none.sinfo().rstrip())
        return 0

    return guarded(run, status=2)


if __name__ == "__main__":
    sys.exit(main())
