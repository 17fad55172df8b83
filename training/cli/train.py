"""`train` a recipe (under torchrun) and `plan` it: memory per NeuronCore, tokens, time and cost."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from training.cli.common import Subcommands, add_command, add_recipe_arguments
from training.config.hardware import HARDWARE, TRAINING_HARDWARE

EXAMPLES = {
    "train": "torchrun --nproc_per_node 32 -m training train --recipe llama31-8b-cpt --resume",
    "plan": "{prog} plan --recipe llama31-8b-cpt memory.activation_checkpointing=none --json",
}


def add_arguments(commands: Subcommands, prog: str) -> None:
    train = add_command(
        commands,
        "train",
        "train with a recipe (launch with torchrun, one process per worker)",
        prog,
        EXAMPLES["train"],
        run_train,
    )
    add_recipe_arguments(train, "batch.micro=2")
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in checkpoint.dir if there is one (else start fresh)",
    )
    train.add_argument(
        "--compile", action="store_true", help="run exactly 2 steps and save nothing (for neuron_parallel_compile)"
    )
    train.add_argument("--metrics", type=Path, help="JSON lines file (default: <checkpoint.dir>/metrics.jsonl)")

    plan = add_command(
        commands,
        "plan",
        "memory per NeuronCore of a recipe against the device's (and the cheapest fix when it does not fit); the run's "
        "tokens, time and cost",
        prog,
        EXAMPLES["plan"],
        run_plan,
    )
    add_recipe_arguments(plan, "nodes=8")
    plan.add_argument(
        "--instance-type",
        choices=list(HARDWARE),
        help="the training nodes; default: each generation's side by side ("
        + ", ".join(hardware.name for hardware in TRAINING_HARDWARE.values())
        + "), the recipe's settings for that generation applied",
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")


def run_train(arguments: argparse.Namespace) -> int:
    from training.config.recipe import load_recipe
    from training.train.loop import run_from_cli

    recipe = load_recipe(arguments.recipe, arguments.overrides)
    return run_from_cli(recipe, resume=arguments.resume, compile_only=arguments.compile, metrics=arguments.metrics)


def run_plan(arguments: argparse.Namespace) -> int:
    """Exit status 1 when the recipe does not fit the device (on either generation, when both are shown)."""
    from training.train.plan_report import plan_generations

    if arguments.instance_type is not None:
        hardware = [HARDWARE[arguments.instance_type]]
    else:
        hardware = list(TRAINING_HARDWARE.values())
    plans, text = plan_generations(arguments.recipe, arguments.overrides, hardware)
    if arguments.json:
        data = plans[0] if len(plans) == 1 else {"generations": {p["generation"]: p for p in plans}}
        print(json.dumps(data, indent=2))
    else:
        print(text)
    return 0 if all(p["fits"] for p in plans) else 1
