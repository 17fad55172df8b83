"""The Slurm client: sbatch, squeue, scontrol, scancel and sinfo run through the site's `slurm_bin` (or PATH),
one place that turns a missing command or a failed one into one line for the user."""

from __future__ import annotations

import subprocess

from training.errors import UserError

ACTIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "RESIZING", "SUSPENDED"}


def slurm_prefix(slurm_bin: str | None) -> str:
    """What goes before a Slurm command's name: its directory, or nothing to find it on PATH."""
    return f"{slurm_bin.rstrip('/')}/" if slurm_bin else ""


def run_slurm(slurm_bin: str | None, *command: str) -> subprocess.CompletedProcess[str]:
    """The command's result whatever its exit status; a command not found is the user's error."""
    executable = slurm_prefix(slurm_bin) + command[0]
    try:
        return subprocess.run([executable, *command[1:]], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        where = f"in slurm_bin {slurm_bin}" if slurm_bin else "on PATH (set slurm_bin in the site file)"
        raise UserError(f"{command[0]}: not found {where}; run on a Slurm head node or start the local Slurm") from None


def slurm_output(slurm_bin: str | None, *command: str) -> str:
    """The command's standard output; its failure is the user's error, with Slurm's message."""
    result = run_slurm(slurm_bin, *command)
    if result.returncode:
        raise UserError(f"{' '.join(command[:2])} failed: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout


def job_info(job_id: str, slurm_bin: str | None = None) -> dict[str, str]:
    """`scontrol show job -o` as a dict; empty when Slurm no longer knows the job."""
    result = run_slurm(slurm_bin, "scontrol", "show", "job", "-o", job_id)
    if result.returncode or not result.stdout.strip():
        return {}
    fields: dict[str, str] = {}
    for token in result.stdout.split():
        key, _, value = token.partition("=")
        fields.setdefault(key, value)
    return fields
