"""`export`: a run's model, metrics, samples and logs to S3 or a directory, then optionally to the Hub."""

from __future__ import annotations

import argparse
from pathlib import Path

from training.cli.common import Subcommands, add_command

EXAMPLES = {
    "export": "{prog} export --run-dir RUN_DIR --output s3://BUCKET/results/RUN_ID --push-to-hub OWNER/NAME",
}


def add_arguments(commands: Subcommands, prog: str) -> None:
    export = add_command(
        commands,
        "export",
        "copy a run's model, metrics, samples and logs to S3 or a directory",
        prog,
        EXAMPLES["export"],
        run,
    )
    export.add_argument("--run-dir", required=True, type=Path, help="run directory (<runs_root>/<run-id>)")
    export.add_argument("--output", required=True, help="where to copy: s3://bucket/prefix or a directory")
    export.add_argument("--with-checkpoints", action="store_true", help="also copy the training checkpoints")
    export.add_argument(
        "--overwrite", action="store_true", help="replace a local export made from other files (S3: always replaced)"
    )

    export.add_argument(
        "--push-to-hub", metavar="OWNER/NAME", help="then push hf/ to this Hub repository (created private)"
    )
    export.add_argument(
        "--hub-token-secret-arn", metavar="ARN", help="Secrets Manager secret holding the Hub write token for the push"
    )
    export.add_argument("--public", action="store_true", help="create the Hub repository public instead of private")
    export.add_argument(
        "--push-despite-gate", action="store_true", help="push although the run's evaluation gate failed"
    )


def run(arguments: argparse.Namespace) -> int:
    from training.pipeline.export import export

    if arguments.push_to_hub is not None:  # a bad repository name fails before anything is copied
        from training.pipeline.hub import check_hub_repo

        check_hub_repo("--push-to-hub", arguments.push_to_hub)
    export(
        arguments.run_dir, arguments.output, with_checkpoints=arguments.with_checkpoints, overwrite=arguments.overwrite
    )
    if arguments.push_to_hub is not None:
        from training.pipeline.hub import push_model, read_token

        token = read_token(arguments.hub_token_secret_arn) if arguments.hub_token_secret_arn else None
        push_model(
            arguments.run_dir,
            arguments.push_to_hub,
            token=token,
            private=not arguments.public,
            despite_gate=arguments.push_despite_gate,
        )
    return 0
