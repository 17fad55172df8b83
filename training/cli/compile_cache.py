"""`compile-cache restore|save`: the Neuron compile cache kept in the results bucket (the compile stage's first
and last commands)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from training.cli.common import Subcommands, add_command, add_group

EXAMPLES = {
    "compile-cache restore": "{prog} compile-cache restore --run-dir /fsx/runs/llama31-8b-cpt-20250601-120000",
    "compile-cache save": "{prog} compile-cache save --run-dir /fsx/runs/llama31-8b-cpt-20250601-120000",
}


def add_arguments(commands: Subcommands, prog: str) -> None:
    actions = add_group(
        commands,
        "compile-cache",
        "keep the Neuron compile cache in the results bucket (the compile stage's first and last commands)",
        prog,
        list(EXAMPLES.values()),
        "action",
        description="keep the Neuron compile cache in the results bucket, by a key of what decides the graphs",
    )
    for action, text in (
        ("restore", "before compiling: the promoted cache of the run's key into the site's compile_cache, verified"),
        ("save", "after compiling: the cache's finished entries to staging, then promoted by the deployment"),
    ):
        command = add_command(actions, action, text, prog, EXAMPLES[f"compile-cache {action}"], run)
        command.add_argument("--run-dir", required=True, type=Path, help="run directory (<runs_root>/<run-id>)")


def run(arguments: argparse.Namespace) -> int:
    from training.pipeline import compile_cache

    action = compile_cache.save if arguments.action == "save" else compile_cache.restore
    print(json.dumps(action(arguments.run_dir), sort_keys=True))
    return 0
