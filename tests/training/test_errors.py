"""One user-error guard for every entry point: a user's mistake, an operating-system refusal or undecodable
text is its `error:` line(s) on stderr and the entry point's non-zero exit status, argparse's complaints one
line and exit status 2, anything else a traceback. The CLI, the local Slurm and the demo are checked here; the
cost command in tests/infra/test_cost.py, `app.py` in tests/infra/test_config.py."""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest

from training.errors import ArgumentParser, UserError, guarded


def raises(error: BaseException) -> int:
    raise error


@pytest.mark.parametrize(
    ("error", "says"),
    [
        (UserError("steps: 0 is not allowed"), "error: steps: 0 is not allowed"),
        (
            PermissionError(errno.EACCES, "Permission denied", "/fsx/runs"),
            "error: /fsx/runs: Permission denied; allowed: a location this user may read and write",
        ),
        (
            UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
            "error: input is not UTF-8 text (invalid start byte at byte 0); allowed: UTF-8 files",
        ),
    ],
)
def test_the_guard_turns_a_user_error_into_one_line_and_the_status(
    error: BaseException, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert guarded(lambda: raises(error), status=7) == 7
    assert capsys.readouterr().err == f"{says}\n"


def test_the_guard_gives_each_problem_its_line_and_passes_everything_else(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert guarded(lambda: raises(UserError("a: wrong\nb: wrong")), status=2) == 2
    assert capsys.readouterr().err == "error: a: wrong\nerror: b: wrong\n"
    assert guarded(lambda: 3, status=2) == 3  # the run's own exit status
    with pytest.raises(KeyError):  # a bug keeps its traceback
        guarded(lambda: raises(KeyError("bug")), status=2)


def test_argparse_complaints_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    parser = ArgumentParser(prog="python -m tool")
    parser.add_argument("--nodes", type=int)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--nodes", "many"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "error: argument --nodes: invalid int value: 'many' (see python -m tool --help)\n"
    )


def test_the_cli_gives_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from training.cli import main

    assert main(["export", "--run-dir", str(tmp_path / "missing"), "--output", str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(tmp_path / "missing") in lines[0], lines


def test_the_local_slurm_gives_one_line_and_exit_2(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "training.local.slurm", "up", "--nodes", "0", "--state-dir", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert (result.returncode, result.stderr, result.stdout) == (2, "error: --nodes 0: at least 1\n", "")
    result = subprocess.run([*command[:3], "restart"], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("error: argument action: invalid choice: 'restart'")
    assert list(tmp_path.iterdir()) == []


def test_the_demo_gives_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from training.local import demo

    made: list[str] = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(demo, "make_tiny_sources", lambda root, architecture: made.append(architecture))
    assert demo.main(["--nodes", "0"]) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error: ")] == ["error: --nodes 0: at least 1"]
    assert "Traceback" not in err and made == ["llama", "mixtral"]
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--nodes", "three"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "error: argument --nodes: invalid int value: 'three' (see python -m training.local.demo --help)\n"
    )
