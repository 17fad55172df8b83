"""What the local Slurm needs of this machine: Debian's Slurm packages installed, its daemons' processes and ports.

Part of the local Slurm (`training.local.slurm`); developer machine only, never shipped.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

from training.errors import UserError

PACKAGES = ("slurmctld", "slurmd", "slurm-client")
POLICY_RC_D = Path("/usr/sbin/policy-rc.d")


# --- installation --------------------------------------------------------------------------------------


def system_command(command: str) -> str | None:
    """The system's Slurm command: daemons live in /usr/sbin, which is not on every PATH, and a PATH set up
    like a ParallelCluster node's (tests/support/parallelcluster_shell.py) has no Slurm at all."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin", "/bin"])
    return shutil.which(command, path=path)


@contextlib.contextmanager
def no_service_starts() -> Iterator[None]:
    """Debian package scripts start their services unless policy-rc.d says no (exit 101); restore it afterwards."""
    original = POLICY_RC_D.read_bytes() if POLICY_RC_D.exists() else None
    mode = POLICY_RC_D.stat().st_mode if original is not None else 0o755
    POLICY_RC_D.write_text(
        "#!/bin/sh\n# Written by training.local.slurm for one package install: start no service.\nexit 101\n"
    )
    POLICY_RC_D.chmod(0o755)
    try:
        yield
    finally:
        if original is None:
            POLICY_RC_D.unlink(missing_ok=True)
        else:
            POLICY_RC_D.write_bytes(original)
            POLICY_RC_D.chmod(mode)


def ensure_installed() -> None:
    """Install Debian's Slurm packages when the daemons or sbatch are missing (root only)."""
    missing = [command for command in ("slurmctld", "slurmd", "sbatch") if system_command(command) is None]
    if not missing:
        return
    packages = " ".join(PACKAGES)
    if os.geteuid() != 0:
        raise UserError(
            f"Slurm is not installed ({', '.join(missing)} missing) and installing it needs root: "
            f"run `sudo apt-get install {packages}` once, or run this command as root"
        )
    if shutil.which("apt-get") is None:
        raise UserError(
            f"Slurm is not installed ({', '.join(missing)} missing) and there is no apt-get: install {packages}"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    with no_service_starts():
        result = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
        if result.returncode != 0:  # stale or missing package lists: refresh once and retry
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=False)
            result = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise UserError(f"`{' '.join(install)}` failed:\n{tail(result.stdout + result.stderr)}")


# --- processes ---------------------------------------------------------------------------------------------


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot); the start time tells a reused PID apart."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[19])


def alive(pid: int, start: int) -> bool:
    stat = proc_stat(pid)
    if stat is None or stat[1] != start:
        return False
    if stat[0] == "Z":  # exited; reap it if it is our child so it does not linger as a zombie
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        return False
    return True


def free_ports(count: int) -> list[int]:
    """Ports nobody listens on now, so several clusters (a developer's and a test run's) can coexist."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def file_tail(path: Path, lines: int = 20) -> str:
    try:
        return tail(path.read_text(errors="replace"), lines)
    except FileNotFoundError:
        return "(no log)"
