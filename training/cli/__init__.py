"""`python -m training ...`: one entry point for every step of the pipeline.

One convention for every subcommand: `--input` for the one path a command reads, `--output` for what it
writes, `--run-dir` for a run directory, `--site FILE` (or $TRAINING_SITE) for the site settings. Results
(JSON summaries, the `status` table) go to stdout, logs to stderr (`training.logs`). User mistakes
(training.errors.UserError), the operating system's refusals (a read-only or full disk, a missing
permission, a file where a directory is needed), undecodable text and argparse's own complaints are printed
as one line, `error: ...`, with exit status 2; nothing else is caught, so real bugs keep their traceback.
Also installed as the console script `trainium-training`.

Each module of this package owns a subcommand or a group of related ones: its arguments, help, example and
handler; this one puts them under one parser and runs the chosen handler behind the user-error guard.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from training.cli import (
    compile_cache,
    convert,
    export,
    fetch,
    monitor,
    preflight,
    prepare,
    results,
    runs,
    train,
)
from training.cli.common import (
    PACKAGE,
    SCRIPT,
    SITE_VARIABLE,
    Command,
    Handler,
    package_version,
    program_name,
    site_file,
)
from training.config.recipe import bundled_recipes
from training.errors import ArgumentParser, guarded
from training.logs import LEVEL_VARIABLE, setup_logging

__all__ = ["PACKAGE", "SCRIPT", "SITE_VARIABLE", "build_parser", "main", "package_version", "site_file"]

# The subcommands in the order --help lists them.
COMMANDS: tuple[Command, ...] = (
    prepare,
    convert,
    train,
    runs,
    results,
    export,
    compile_cache,
    fetch,
    preflight,
    monitor,
)
EXAMPLES = {  # one per subcommand, in the order the top-level --help shows them
    **prepare.EXAMPLES,
    **convert.EXAMPLES,
    **train.EXAMPLES,
    **runs.EXAMPLES,
    **results.EXAMPLES,
    **fetch.EXAMPLES,
    **export.EXAMPLES,
    **compile_cache.EXAMPLES,
    **preflight.EXAMPLES,
    **monitor.EXAMPLES,
}


def _epilog(prog: str) -> str:
    examples = "\n".join(f"  {example.format(prog=prog)}" for example in EXAMPLES.values())
    return (
        f"bundled recipes (--recipe NAME): {', '.join(bundled_recipes()) or '(none)'}\n\n"
        f"examples:\n{examples}\n\n"
        f"environment:\n"
        f"  {SITE_VARIABLE:<20}site settings file used when --site is not given (submit, status, cancel, monitor)\n"
        f"  {LEVEL_VARIABLE:<20}log level: DEBUG, INFO (default), WARNING or ERROR; logs go to stderr"
    )


def build_parser() -> argparse.ArgumentParser:
    prog = program_name()
    parser = ArgumentParser(
        prog=prog,
        description=__doc__.splitlines()[0],
        epilog=_epilog(prog),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_arguments(commands, prog)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 done, 1 `status` of a failed run, a `plan` that does not fit, an `evaluate` whose gate
    failed, `monitor neuron` once neuron-monitor has exited or a `preflight` that found a problem, 2 user error
    (argparse's own errors included)."""
    arguments = build_parser().parse_args(argv)
    handler: Handler = arguments.handler

    def run() -> int:
        setup_logging(training=arguments.command == "train")
        return handler(arguments)

    return guarded(run, status=2)
