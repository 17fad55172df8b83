"""The run record, `<runs_root>/<run_id>/run.json`: what `submit` wrote (the resolved recipe, the site, the
stages, each submission's job ids) and what `status`, `cancel` and the jobs themselves read back."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from training import outputs
from training.config.loading import build
from training.config.recipe import Recipe
from training.config.site import Site
from training.errors import UserError

RUN_FILE = "run.json"
RUN_ID = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")  # \Z, unlike $, refuses a trailing newline


def read_run(run_dir: Path) -> dict[str, Any]:
    path = run_dir / RUN_FILE
    if not path.is_file():
        raise UserError(f"{run_dir}: no run.json (not a run submitted by `python -m training submit`)")
    return dict(json.loads(path.read_text()))


def run_recipe(run: dict[str, Any], run_dir: Path) -> Recipe:
    """The run's resolved recipe as `submit` recorded it (`settings`), read back typed: a record that no longer
    parses (edited by hand, or written by another version) is named by its file, one line a problem."""
    return build(Recipe, run.get("settings") or {}, f"{run_dir / RUN_FILE} settings")


def write_run(run_dir: Path, run: dict[str, Any]) -> None:
    """Rewrite the record in one rename (a reader never sees half of it)."""
    outputs.write_file(run_dir / RUN_FILE, json.dumps(run, indent=2) + "\n")


def latest_jobs(run: dict[str, Any]) -> dict[str, str]:
    """Stage -> the job id of its newest submission."""
    jobs: dict[str, str] = {}
    for submission in run.get("submissions", []):
        jobs.update(submission["jobs"])
    return jobs


def run_slurm_bin(run: dict[str, Any]) -> str | None:
    """Where the Slurm that runs a recorded run keeps its commands (the submitting site's)."""
    return (run.get("site") or {}).get("slurm_bin")


def find_run_dir(site: Site, run_id: str | None) -> Path:
    root = Path(site.runs_root).absolute()
    if run_id:
        if not RUN_ID.fullmatch(run_id):  # a name under runs_root, never a path out of it
            raise UserError(f"--run-id {run_id!r}: use letters, digits, '.', '_' and '-' (at most 64)")
        return root / run_id
    runs = sorted((p for p in root.glob("*/run.json")), key=lambda p: p.stat().st_mtime) if root.is_dir() else []
    if not runs:
        raise UserError(f"no runs under {root}")
    return runs[-1].parent
