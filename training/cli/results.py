"""`sample` and `evaluate`: what a trained Hugging Face model answers and scores."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from training.cli.common import RECIPE_HELP, Subcommands, add_command
from training.errors import UserError

EXAMPLES = {
    "sample": "{prog} sample --recipe RUN_DIR/recipe.yaml --input RUN_DIR/hf --output RUN_DIR/samples.json",
    "evaluate": "{prog} evaluate --recipe RUN_DIR/recipe.yaml --input RUN_DIR/hf --base /fsx/models/Llama-3.1-8B "
    "--output RUN_DIR",
}


def add_arguments(commands: Subcommands, prog: str) -> None:
    sample = add_command(
        commands,
        "sample",
        "greedy and top-k answers of a trained Hugging Face model",
        prog,
        EXAMPLES["sample"],
        run_sample,
    )
    sample.add_argument("--recipe", required=True, help="recipe (prompts, chat format): " + RECIPE_HELP)
    sample.add_argument("--input", required=True, type=Path, help="Hugging Face model directory to read")
    sample.add_argument("--output", required=True, type=Path, help="JSON file to write")

    evaluate = add_command(
        commands,
        "evaluate",
        "lm-evaluation-harness tasks of the recipe on a trained model and its base, with the recipe's gate",
        prog,
        EXAMPLES["evaluate"],
        run_evaluate,
    )
    evaluate.add_argument("--recipe", required=True, help="recipe (its evaluate section): " + RECIPE_HELP)
    evaluate.add_argument("--input", required=True, type=Path, help="Hugging Face model directory to evaluate")
    evaluate.add_argument(
        "--base",
        type=Path,
        help="base model directory to compare with (default: the recipe's model.config when evaluate.base is true)",
    )
    evaluate.add_argument(
        "--output", required=True, type=Path, help="directory for evaluation.json and evaluation.md (the run's)"
    )


def run_sample(arguments: argparse.Namespace) -> int:
    from training.config.recipe import load_recipe
    from training.pipeline.sample import sample

    sample(load_recipe(arguments.recipe), arguments.input, arguments.output)
    return 0


def run_evaluate(arguments: argparse.Namespace) -> int:
    """Exit status 1 when the recipe's gate failed."""
    from training.config.recipe import load_recipe
    from training.pipeline.evaluate import evaluate

    recipe = load_recipe(arguments.recipe)
    if recipe.evaluate is None:
        raise UserError(f"--recipe {arguments.recipe}: no evaluate section (tasks and limits to run)")
    base = arguments.base
    if base is None and recipe.evaluate.base:
        base = Path(recipe.model.config)
    report = evaluate(recipe.evaluate, arguments.input, base, arguments.output)
    print(json.dumps({"tasks": report["tasks"], "gate": report["gate"]}, indent=2, sort_keys=True))
    if not report["gate"]["passed"]:
        print(f"error: evaluation gate failed: {'; '.join(report['gate']['failures'])}", file=sys.stderr)
        return 1
    return 0
