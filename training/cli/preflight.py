"""`preflight`: the preflight stage's checks of the training nodes (its job runs `--node` on every node, then
the decision once; the training job runs `--verify`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from training.cli.common import Subcommands, add_command
from training.errors import UserError

EXAMPLES = {
    "preflight": "{prog} preflight --run-dir /fsx/runs/llama31-8b-cpt-20250601-120000 --node",
}


def add_arguments(commands: Subcommands, prog: str) -> None:
    preflight = add_command(
        commands,
        "preflight",
        "the preflight stage's checks of the training nodes (run by its job: --node on every node, then once)",
        prog,
        EXAMPLES["preflight"],
        run,
    )
    preflight.add_argument("--run-dir", required=True, type=Path, help="run directory (<runs_root>/<run-id>)")
    step = preflight.add_mutually_exclusive_group()
    step.add_argument("--node", action="store_true", help="this node's checks, written to <run>/preflight/<node>.json")
    step.add_argument(
        "--verify", action="store_true", help="in the training job: say whether it runs on the checked nodes"
    )
    step.add_argument(
        "--canary",
        action="store_true",
        help="the decision, which runs COMMAND (the canary's srun) on a Neuron site once the other checks passed",
    )
    step.add_argument(
        "--watch",
        action="store_true",
        help="on every node: run COMMAND (the canary's torchrun) while neuron-monitor samples the device memory",
    )
    preflight.add_argument("wrapped", nargs="*", metavar="COMMAND", help="after `--`: what --canary or --watch runs")


def run(arguments: argparse.Namespace) -> int:
    """Exit status 1 when a check found a problem."""
    from training.pipeline import preflight

    if arguments.node:
        return preflight.run_node(arguments.run_dir)
    if arguments.verify:
        return preflight.verify_nodes(arguments.run_dir)
    if bool(arguments.wrapped) != (arguments.canary or arguments.watch):
        raise UserError("preflight: a COMMAND after `--` goes with --canary or --watch, and only with them")
    if arguments.watch:
        return preflight.watch_canary(arguments.run_dir, arguments.wrapped)
    return preflight.run_job(arguments.run_dir, arguments.wrapped or None)
