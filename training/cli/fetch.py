"""`fetch`: the recipe's base model (or only its tokenizer) from the Hugging Face Hub, verified."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from training.cli.common import RECIPE_HELP, Subcommands, add_command
from training.errors import UserError

EXAMPLES = {
    "fetch": "{prog} fetch --recipe RUN_DIR/recipe.yaml --token-secret-arn SECRET_ARN --copy-to s3://BUCKET/fsx/models/M",
}


def add_arguments(commands: Subcommands, prog: str) -> None:
    fetch = add_command(
        commands,
        "fetch",
        "download the recipe's base model from the Hugging Face Hub (model.hub) into model.config, verified",
        prog,
        EXAMPLES["fetch"],
        run,
    )
    fetch.add_argument("--recipe", required=True, help="recipe with model.hub: " + RECIPE_HELP)
    fetch.add_argument(
        "--token-secret-arn", metavar="ARN", help="Secrets Manager secret holding the Hub token (gated models)"
    )
    fetch.add_argument("--copy-to", metavar="S3_URI", help="also upload the model there (s3://bucket/prefix)")
    fetch.add_argument("--overwrite", action="store_true", help="replace an earlier fetch of another revision")
    fetch.add_argument(
        "--tokenizer-only",
        action="store_true",
        help="only the tokenizer and configuration files (what `prepare` reads), into --output",
    )
    fetch.add_argument("--output", metavar="DIR", help="with --tokenizer-only: where (default: model.config)")


def run(arguments: argparse.Namespace) -> int:
    from training.config.recipe import load_recipe
    from training.pipeline.hub import fetch_model, read_token, tokenizer_source

    recipe = load_recipe(arguments.recipe)
    if recipe.model.hub is None:
        raise UserError(f"--recipe {arguments.recipe}: no model.hub section (where to download the model from)")
    if arguments.copy_to is not None and not arguments.copy_to.startswith("s3://"):
        raise UserError(f"--copy-to {arguments.copy_to!r} is not allowed; allowed: s3://bucket/prefix")
    if arguments.output is not None and not arguments.tokenizer_only:
        raise UserError("--output is not allowed without --tokenizer-only (the model goes to model.config)")
    if arguments.tokenizer_only and arguments.copy_to is not None:
        raise UserError("--copy-to is not allowed with --tokenizer-only (only a whole model is copied)")
    token = read_token(arguments.token_secret_arn) if arguments.token_secret_arn else None
    source = tokenizer_source(recipe.model.hub) if arguments.tokenizer_only else recipe.model.hub
    result = fetch_model(
        source,
        Path(arguments.output or recipe.model.config),
        token=token,
        copy_to=arguments.copy_to,
        overwrite=arguments.overwrite,
    )
    print(json.dumps({k: v for k, v in result.items() if k != "files"}, sort_keys=True))
    return 0
