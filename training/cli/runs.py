"""`submit` a recipe's pipeline to Slurm, a run's `status`, `cancel` it: the commands that take the site."""

from __future__ import annotations

import argparse

from training.cli.common import Subcommands, add_command, add_recipe_arguments, add_site_argument, site_file

EXAMPLES = {
    "submit": "{prog} submit --recipe llama31-8b-cpt --site /fsx/pipeline/site-default.yaml steps=100",
    "status": "{prog} status --site /fsx/pipeline/site-default.yaml",
    "cancel": "{prog} cancel --run-id llama31-8b-cpt-20250601-120000 --site /fsx/pipeline/site-default.yaml",
}


def add_arguments(commands: Subcommands, prog: str) -> None:
    submit = add_command(
        commands,
        "submit",
        "submit a recipe's whole pipeline to Slurm as one dependency graph",
        prog,
        EXAMPLES["submit"],
        run_submit,
    )
    add_recipe_arguments(submit, "steps=100")
    submit.add_argument("--run-id", help="name of the run (default: <recipe>-<UTC time>); an existing run resumes")
    add_site_argument(submit)
    submit.add_argument("--dry-run", action="store_true", help="print the job scripts and the graph, submit nothing")

    status = add_command(
        commands,
        "status",
        "stages of a run with Slurm state, time and training progress",
        prog,
        EXAMPLES["status"],
        run_status,
    )
    status.add_argument("--run-id", help="the run (default: the newest)")
    add_site_argument(status)
    cancel = add_command(commands, "cancel", "cancel every job of a run", prog, EXAMPLES["cancel"], run_cancel)
    cancel.add_argument("--run-id", required=True, help="the run")
    add_site_argument(cancel)


def run_submit(arguments: argparse.Namespace) -> int:
    from training.config.site import load_site
    from training.pipeline.submit import submit

    site = load_site(site_file(arguments.site))
    submit(arguments.recipe, arguments.overrides, run_id=arguments.run_id, site=site, dry_run=arguments.dry_run)
    return 0


def run_status(arguments: argparse.Namespace) -> int:
    """Exit status 1 when a stage failed (neither completed nor still active)."""
    from training.config.site import load_site
    from training.pipeline.run_record import find_run_dir
    from training.pipeline.slurm_client import ACTIVE_STATES
    from training.pipeline.status import print_status

    rows = print_status(find_run_dir(load_site(site_file(arguments.site)), arguments.run_id))
    return 1 if any(row["state"] not in ("COMPLETED", *ACTIVE_STATES) for row in rows) else 0


def run_cancel(arguments: argparse.Namespace) -> int:
    from training.config.site import load_site
    from training.pipeline.run_record import find_run_dir
    from training.pipeline.submit import cancel

    cancel(find_run_dir(load_site(site_file(arguments.site)), arguments.run_id))
    return 0
