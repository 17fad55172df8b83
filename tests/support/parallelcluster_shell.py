"""The shell conditions of a ParallelCluster node, for running our scripts as the cluster runs them.

SSM Run Command and Slurm jobs start non-login shells: `/etc/profile.d/slurm.sh` is never read, so Slurm's
commands (in `/opt/slurm/bin`) are not on PATH, and no Python environment is activated. Here that is a
PATH of this machine's system commands without Slurm's client commands and without any Python, and an
environment holding nothing else; Slurm is reachable only through the local cluster's `bin/` prefix, and
Python only by its path. A script that relies on PATH for either fails with "command not found".
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from types import ModuleType

from tests.support.lambda_handlers import import_handler_module, load_handler_file
from training.local.slurm_config import CLIENT_COMMANDS

ROOT = Path(__file__).resolve().parents[2]
HANDLER_DIR = ROOT / "assets" / "lambda" / "pipeline_trigger"
HANDLER_FILE = HANDLER_DIR / "handler.py"
# Where a default Ubuntu SSM shell looks for commands (its PATH), in order.
SYSTEM_DIRECTORIES = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


def slurm_client_commands() -> set[str]:
    """Every command Debian's slurm-client package installs, or our prefix's list where dpkg cannot say."""
    listed = subprocess.run(["dpkg", "-L", "slurm-client"], capture_output=True, text=True, check=False)
    names = {Path(line).name for line in listed.stdout.splitlines() if "/bin/" in line}
    return names | set(CLIENT_COMMANDS)


def hidden(name: str, slurm: set[str]) -> bool:
    return name in slurm or name.startswith(("python", "pip", "pydoc", "slurm"))


def parallelcluster_path(directory: Path) -> str:
    """A directory of links to the system's commands minus Slurm and Python: the PATH of a non-login shell."""
    directory.mkdir(parents=True, exist_ok=True)
    slurm = slurm_client_commands()
    for system in SYSTEM_DIRECTORIES:
        if not os.path.isdir(system):
            continue
        for entry in sorted(os.scandir(system), key=lambda e: e.name):
            link = directory / entry.name
            if hidden(entry.name, slurm) or link.exists() or not os.access(entry.path, os.X_OK):
                continue
            link.symlink_to(entry.path)
    return str(directory)


def non_login_environment(path: str, home: Path) -> dict[str, str]:
    """All a non-login root shell started by SSM or slurmd can count on."""
    return {"PATH": path, "HOME": str(home), "LANG": "C.UTF-8"}


def run_script(script: str, env: dict[str, str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run a rendered script the way SSM's AWS-RunShellScript does: a non-login bash reading the script."""
    return subprocess.run(
        ["/bin/bash", "-c", script], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )


def load_pipeline_handler() -> ModuleType:
    """The pipeline custom resource's handler, loaded from its file as the Lambda runtime loads it."""
    return load_handler_file(HANDLER_FILE, "pipeline_trigger_handler")


def load_pipeline_trigger_module(module_name: str) -> ModuleType:
    """A module beside the pipeline custom resource's handler (`trigger_properties`, `trigger_scripts`,
    `trigger_aws`, `trigger_phases`), the one the handler imports."""
    load_pipeline_handler()
    return import_handler_module(HANDLER_DIR, module_name)
