"""What every subcommand of the CLI shares: how a subcommand is declared (help, its example, no abbreviated
flags), the recipe and site options, the program's name and version, and option objects built from the parsed
arguments by field name."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, Protocol, TypeVar

SCRIPT = "trainium-training"  # the console script ([project.scripts] in pyproject.toml)
PACKAGE = "trainium-training-environments"
SITE_VARIABLE = "TRAINING_SITE"  # default of --site
RECIPE_HELP = "recipe YAML file, or the name of a bundled recipe (listed by --help)"
SITE_HELP = (
    f"site settings YAML: runs root, results, python, partition... (default: ${SITE_VARIABLE}, "
    "else local defaults: runs in work/runs)"
)

Handler = Callable[[argparse.Namespace], int]
"""What a subcommand runs with its parsed arguments; returns the exit status."""

Subcommands = Any
"""argparse's subparsers action (its type is private to argparse)."""


class Command(Protocol):
    """A module of subcommands: their examples for the help texts (by command path) and the parsers they add."""

    @property
    def EXAMPLES(self) -> Mapping[str, str]: ...  # a module's constant, read only

    def add_arguments(self, commands: Subcommands, prog: str) -> None: ...


def program_name() -> str:
    """`trainium-training` when run as the console script, else `python -m training`."""
    return SCRIPT if Path(sys.argv[0]).name == SCRIPT else "python -m training"


def package_version() -> str:
    """The installed distribution's version, else the one in pyproject.toml (a source checkout)."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        found = (
            re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.MULTILINE) if pyproject.is_file() else None
        )
        return found.group(1) if found else "unknown"


def add_command(
    commands: Subcommands, name: str, text: str, prog: str, example: str, handler: Handler
) -> argparse.ArgumentParser:
    """A subcommand that runs `handler`, its help text and its one example."""
    parser: argparse.ArgumentParser = commands.add_parser(
        name,
        help=text,
        description=text,
        epilog=f"example:\n  {example.format(prog=prog)}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # flags are spelled out: an abbreviation would break when a flag is added
    )
    parser.set_defaults(handler=handler)
    return parser


def add_group(
    commands: Subcommands, name: str, text: str, prog: str, examples: Sequence[str], dest: str, description: str = ""
) -> Subcommands:
    """A subcommand with subcommands of its own (`prepare pretrain`), its help text and their examples."""
    return commands.add_parser(
        name,
        help=text,
        description=description or text,
        epilog="examples:\n" + "\n".join(f"  {example.format(prog=prog)}" for example in examples),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    ).add_subparsers(dest=dest, required=True, metavar=dest.upper())


def add_recipe_arguments(parser: argparse.ArgumentParser, override_example: str) -> None:
    """`--recipe` and the KEY=VALUE overrides after it (train, plan, submit)."""
    parser.add_argument("--recipe", required=True, help=RECIPE_HELP)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=f"recipe overrides, e.g. {override_example}")


def add_site_argument(parser: argparse.ArgumentParser) -> None:
    """`--site FILE`, defaulting to $TRAINING_SITE (see `site_file`)."""
    parser.add_argument("--site", type=Path, metavar="FILE", help=SITE_HELP)


def site_file(given: Path | None, environ: Mapping[str, str] = os.environ) -> Path | None:
    """--site, else $TRAINING_SITE, else None (the local defaults)."""
    if given is not None:
        return given
    from_environment = environ.get(SITE_VARIABLE, "").strip()
    return Path(from_environment) if from_environment else None


Options = TypeVar("Options")


def options_from(kind: type[Options], arguments: argparse.Namespace, **given: Any) -> Options:
    """The option object `kind` (a dataclass) from the parsed arguments by field name; `given` names the fields
    the command line spells otherwise or derives; a field in neither keeps its default."""
    values = {
        field.name: given[field.name] if field.name in given else getattr(arguments, field.name)
        for field in fields(kind)  # type: ignore[arg-type]
        if field.init and (field.name in given or hasattr(arguments, field.name))
    }
    return kind(**values)


def print_summary(manifest: Mapping[str, Any]) -> int:
    """A written output's manifest as the command's JSON result (without its fingerprint)."""
    summary = {k: v for k, v in manifest.items() if k not in ("fingerprint",)}
    print(json.dumps(summary, indent=2, sort_keys=True))
    return 0
