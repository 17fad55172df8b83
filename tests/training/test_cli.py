"""One convention for every subcommand of `python -m training`: flag names, help text, examples, --version,
the console script, the site file from $TRAINING_SITE, `train --resume` as a plain flag."""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import training
from training import cli

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from training.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
RECIPES = Path(training.__file__).parent / "train" / "recipes"


def subparsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    """(command path, parser) for the parser and every subcommand below it, e.g. ('prepare pretrain', p)."""
    yield " ".join(path), parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from subparsers(child, (*path, name))


def leaves() -> dict[str, argparse.ArgumentParser]:
    """Subcommands that run something (prepare's kinds, not prepare itself)."""
    found = dict(subparsers(build_parser()))
    return {name: p for name, p in found.items() if name and not any(k.startswith(f"{name} ") for k in found)}


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def test_every_option_and_argument_of_every_subcommand_has_help_text() -> None:
    missing = [
        f"{name or 'python -m training'}: {'/'.join(action.option_strings) or action.dest}"
        for name, parser in subparsers(build_parser())
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction)
        and (not action.help or action.help == argparse.SUPPRESS or not action.help.strip())
    ]
    assert missing == []


def test_the_same_flag_names_for_the_same_idea() -> None:
    commands = leaves()
    assert set(commands) == {
        "prepare pretrain",
        "prepare sft",
        "convert",
        "train",
        "plan",
        "submit",
        "status",
        "cancel",
        "sample",
        "evaluate",
        "export",
        "fetch",
        "monitor cluster",
        "monitor neuron",
        "compile-cache save",
        "compile-cache restore",
        "preflight",
    }
    for name in ("prepare pretrain", "prepare sft", "convert", "sample", "evaluate", "export"):
        assert "--output" in options(commands[name]), name  # what the command writes
    for name in ("convert", "sample", "evaluate"):
        assert "--input" in options(commands[name]), name  # the one path it reads
    for name in ("submit", "status", "cancel", "monitor cluster", "monitor neuron"):
        assert "--site" in options(commands[name]), name
    for name in ("train", "plan", "submit", "sample", "evaluate", "fetch"):
        assert "--recipe" in options(commands[name]), name
    for name in ("export", "preflight"):
        assert "--run-dir" in options(commands[name]), name
    retired = {"--out", "--env-file", "--model"}
    assert not [(name, options(p) & retired) for name, p in commands.items() if options(p) & retired]
    assert "--to" not in options(commands["export"])  # `convert --to` names a format and stays


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"python -m training {importlib.metadata.version(cli.PACKAGE)}\n"


def test_version_falls_back_to_pyproject(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    expected = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert cli.package_version() == expected


def test_console_script_is_declared_and_names_itself(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {cli.SCRIPT: "training.cli:main"}
    module, _, function = scripts[cli.SCRIPT].partition(":")
    assert getattr(sys.modules[module], function) is main
    monkeypatch.setattr(sys, "argv", [f"/venv/bin/{cli.SCRIPT}", "--version"])
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith(f"{cli.SCRIPT} ")


def test_help_lists_the_bundled_recipes_and_an_example_per_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    bundled = sorted(p.stem for p in RECIPES.glob("*.yaml"))
    assert {"llama31-8b-cpt", "mixtral-8x7b-sft", "tiny-llama-cpt", "tiny-mixtral-sft"} <= set(bundled)
    assert f"bundled recipes (--recipe NAME): {', '.join(bundled)}\n" in text
    example_lines = [line.strip() for line in text.splitlines() if re.match(r"^  \S.* -m training ", line)]
    for name in leaves():
        assert any(f"-m training {name} " in line for line in example_lines), name
    assert "TRAINING_SITE" in text and "TRAINING_LOG_LEVEL" in text


@pytest.mark.parametrize("command", sorted(leaves()))
def test_each_subcommand_help_shows_its_example(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([*command.split(), "--help"])
    text = capsys.readouterr().out
    example = text.split("example:\n", 1)[1].strip()
    assert f"-m training {command} " in example
    assert build_parser().parse_args(example.split(" -m training ", 1)[1].split())  # the example parses


def test_train_resume_is_a_plain_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = build_parser()
    assert parser.parse_args(["train", "--recipe", "tiny-llama-cpt", "--resume"]).resume is True
    assert parser.parse_args(["train", "--recipe", "tiny-llama-cpt"]).resume is False
    calls: list[dict[str, Any]] = []

    def run_from_cli(recipe: Any, **kwargs: Any) -> int:
        calls.append(kwargs)
        return 0

    import training.train.loop

    monkeypatch.setattr(training.train.loop, "run_from_cli", run_from_cli)
    assert main(["train", "--recipe", "tiny-llama-cpt", "--resume", "steps=3"]) == 0
    assert main(["train", "--recipe", "tiny-llama-cpt"]) == 0
    assert [c["resume"] for c in calls] == [True, False]


def site_file(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"runs_root: {tmp_path / name}\n")
    return path


def test_site_comes_from_training_site_when_site_is_absent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(cli.SITE_VARIABLE, str(site_file(tmp_path, "from-env")))
    assert main(["status"]) == 2
    assert capsys.readouterr().err == f"error: no runs under {tmp_path / 'from-env'}\n"
    # --site wins over the environment variable
    assert main(["status", "--site", str(site_file(tmp_path, "from-flag"))]) == 2
    assert capsys.readouterr().err == f"error: no runs under {tmp_path / 'from-flag'}\n"
    monkeypatch.setenv(cli.SITE_VARIABLE, str(tmp_path / "missing.yaml"))
    assert main(["cancel", "--run-id", "x"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and str(tmp_path / "missing.yaml") in error and error.count("\n") == 1


def test_site_helper() -> None:
    assert cli.site_file(None, {}) is None
    assert cli.site_file(None, {cli.SITE_VARIABLE: " "}) is None
    assert cli.site_file(None, {cli.SITE_VARIABLE: "/fsx/site.yaml"}) == Path("/fsx/site.yaml")
    assert cli.site_file(Path("a.yaml"), {cli.SITE_VARIABLE: "/fsx/site.yaml"}) == Path("a.yaml")
    site_help = dict(subparsers(build_parser()))["submit"]._option_string_actions["--site"].help
    assert f"${cli.SITE_VARIABLE}" in site_help


def test_sample_names_its_input_flag_in_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    arguments = ["--recipe", "tiny-llama-cpt", "--input", str(tmp_path), "--output", str(tmp_path / "s.json")]
    assert main(["sample", *arguments]) == 2
    message = f"error: --input {tmp_path}: not a Hugging Face model directory (no config.json)\n"
    assert capsys.readouterr().err == message


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["prepare", "pretrain", "--tokenizer", "t", "--out", "x"])  # the retired spelling
    assert exit_info.value.code == 2
    assert "--output" in capsys.readouterr().err


def test_every_problem_of_a_recipe_is_its_own_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--recipe", "tiny-llama-cpt", "steps=0", "backend=gpu"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and all(line.startswith("error: ") for line in lines), lines
    assert lines[0].endswith("tiny-llama-cpt.yaml: steps: 0 is not allowed; allowed: an integer above 0")
    assert lines[1].endswith("tiny-llama-cpt.yaml: backend: 'gpu' is not allowed; allowed: cpu, neuron, torch-native")
