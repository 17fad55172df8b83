"""`python -m training submit|cancel`: queue a planned run's jobs, cancel them, wait for them.

`submit` renders one job script per stage (training.pipeline.scripts), submits them with `afterok` dependencies
(independent stages in parallel) and records the run in `<runs_root>/<run_id>/run.json`, rewritten in one rename
after each sbatch; a rerun after a killed submit adopts the jobs it had queued (found by their scripts' paths) and
submits the rest. Each job touches `state/<stage>.done` as its last act, so a failed or cancelled run is resumed
from its first unfinished stage by submitting the same run id again.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from training import outputs
from training.config.recipe import load_recipe, recipe_as_dict
from training.config.site import Site
from training.errors import UserError
from training.pipeline.plan import (
    STAGES,
    Stage,
    check_budget,
    check_launch,
    check_memory,
    plan_run,
    site_generation,
)
from training.pipeline.run_record import read_run, run_slurm_bin, write_run
from training.pipeline.scripts import render
from training.pipeline.slurm_client import ACTIVE_STATES, job_info, slurm_output
from training.pipeline.status import stage_states


def submit(recipe_file: str, overrides: list[str], *, run_id: str | None, site: Site, dry_run: bool) -> dict[str, Any]:
    recipe = load_recipe(recipe_file, overrides, generation=site_generation(site))
    check_launch(recipe, site)
    plan = plan_run(recipe, site, run_id)
    check_memory(plan)
    check_budget(plan)
    scripts = render(plan)
    if dry_run:
        for stage in plan.stages:
            after = [a for a in stage.after if a in scripts] + [f"{a} (ended)" for a in stage.after_any if a in scripts]
            print(f"# ---- {stage.name} (after: {', '.join(after) or 'nothing'})\n{scripts[stage.name]}")
        return {"run_id": plan.run_id, "run_dir": str(plan.run_dir), "dry_run": True, "stages": list(scripts)}
    previous = read_run(plan.run_dir) if (plan.run_dir / "run.json").is_file() else None
    settings = recipe_as_dict(plan.resolved)  # as run.json and the run's recipe.yaml spell it
    if previous is not None and previous["settings"] != settings:
        raise UserError(
            f"run {plan.run_id} was submitted with other settings; submit with a new --run-id "
            f"(or the same recipe and overrides to resume it)"
        )
    done = {s.name for s in plan.stages if (plan.run_dir / "state" / f"{s.name}.done").exists()}
    todo = stages_to_submit(plan.stages, done)
    if not todo:
        print(f"run {plan.run_id} has finished every stage; nothing submitted")
        return {"run_id": plan.run_id, "run_dir": str(plan.run_dir), "jobs": {}, "submitted": False}
    queued = queued_jobs(plan.run_dir, site.slurm_bin) if previous is not None else {}
    todo = stages_to_submit(plan.stages, done, set(queued))
    if all(stage.name in queued for stage in todo):
        print(f"run {plan.run_id} is queued or running (jobs {', '.join(queued.values())}); nothing submitted")
        return {"run_id": plan.run_id, "run_dir": str(plan.run_dir), "jobs": queued, "submitted": False}
    for folder in ("jobs", "logs", "state"):
        (plan.run_dir / folder).mkdir(parents=True, exist_ok=True)
    outputs.write_file(plan.run_dir / "recipe.yaml", yaml.safe_dump(settings, sort_keys=False))
    run = previous or {
        "run_id": plan.run_id,
        "recipe": recipe.name,
        "recipe_file": str(Path(recipe_file).absolute()) if Path(recipe_file).exists() else recipe_file,
        "overrides": overrides,
        "settings": settings,
        "site": site.model_dump(mode="json"),
        "stages": [s.name for s in plan.stages],
        "submissions": [],
    }
    # Recorded before the first sbatch and after each one, so a kill loses at most the id of the job just
    # submitted: a rerun adopts it (and `cancel` finds it) by its script's path in Slurm's queue.
    kept = {stage.name: queued[stage.name] for stage in todo if stage.name in queued}
    submission: dict[str, Any] = {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "jobs": dict(kept)}
    run["submissions"].append(submission)
    write_run(plan.run_dir, run)
    jobs: dict[str, str] = {}
    for stage in todo:
        if stage.name in kept:
            continue
        script = plan.run_dir / "jobs" / f"{stage.name}.sbatch"
        outputs.write_file(script, scripts[stage.name])
        dependency = dependency_option(stage, submission["jobs"])
        command = ["sbatch", "--parsable"] + ([dependency] if dependency else [])
        jobs[stage.name] = slurm_output(site.slurm_bin, *command, str(script)).strip().split(";")[0]
        outputs.kill_point(f"submitted-{stage.name}")
        submission["jobs"][stage.name] = jobs[stage.name]
        write_run(plan.run_dir, run)
    resumed = f" (resuming at {todo[0].name})" if previous is not None else ""
    also = f"; kept queued or running: {', '.join(f'{s}={j}' for s, j in kept.items())}" if kept else ""
    print(f"run {plan.run_id}: submitted {', '.join(f'{s}={j}' for s, j in jobs.items())}{resumed}{also}")
    return {"run_id": plan.run_id, "run_dir": str(plan.run_dir), "jobs": jobs, "kept": kept, "submitted": True}


def stages_to_submit(stages: Sequence[Stage], done: set[str], queued: Collection[str] = ()) -> list[Stage]:
    """The unfinished stages; the preflight again whenever a training job is to be submitted, since it may get
    other nodes than those checked before (not for a training job still queued: its preflight pinned it)."""
    again = {"preflight"} if "train" not in done and "train" not in queued else set()
    return [stage for stage in stages if stage.name not in done or stage.name in again]


def dependency_option(stage: Stage, jobs: dict[str, str]) -> str | None:
    """sbatch's `--dependency` for a stage given the jobs submitted so far (stages finished earlier have none):
    `afterok` on what must succeed, `afterany` on what must only have ended, both required (a comma)."""
    parts = []
    for kind, names in (("afterok", stage.after), ("afterany", stage.after_any)):
        ids = [jobs[name] for name in names if name in jobs]
        if ids:
            parts.append(f"{kind}:{':'.join(ids)}")
    return f"--dependency={','.join(parts)}" if parts else None


def queued_jobs(run_dir: Path, slurm_bin: str | None) -> dict[str, str]:
    """Stage -> the newest queued or running job whose batch script is this run's, recorded or not."""
    found: dict[str, str] = {}
    scripts = {str(run_dir / "jobs" / f"{stage.name}.sbatch"): stage.name for stage in STAGES}
    listing = slurm_output(slurm_bin, "squeue", "--noheader", "--format=%i|%T|%o")
    for line in listing.splitlines():
        job, _, rest = line.strip().partition("|")
        state, _, command = rest.partition("|")
        stage = scripts.get(command)
        if stage is not None and state in ACTIVE_STATES and job.isdigit():
            found[stage] = max(found.get(stage, job), job, key=int)
    return found


def cancel(run_dir: Path) -> list[str]:
    """Cancel the run's queued and running jobs; a failed scancel is an error, never ignored.

    Jobs Slurm has finished or forgotten are left out: scancel fails on an id it no longer knows. Jobs of
    the run's scripts that run.json does not record (a submit killed right after an sbatch) are found in
    Slurm's queue and cancelled too.
    """
    run = read_run(run_dir)
    slurm_bin = run_slurm_bin(run)
    every = sorted({j for submission in run["submissions"] for j in submission["jobs"].values()}, key=int)
    recorded = {job for job in every if job_info(job, slurm_bin).get("JobState") in ACTIVE_STATES}
    jobs = sorted(recorded | set(queued_jobs(run_dir, slurm_bin).values()), key=int)
    if jobs:
        slurm_output(slurm_bin, "scancel", *jobs)
    print(f"run {run_dir.name}: cancelled jobs {', '.join(jobs) or '(none active)'}")
    return jobs


def wait(run_dir: Path, timeout: float, poll: float = 1.0) -> list[dict[str, Any]]:
    """Stage states once no job of the run is queued or running (or the timeout passed)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = stage_states(run_dir)
        if not any(row["state"] in ACTIVE_STATES for row in rows) or time.monotonic() > deadline:
            return rows
        time.sleep(poll)
