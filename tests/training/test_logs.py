"""training.logs: the log line format with the rank, the level variable, and progress lines for batch logs."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from training.cli import main
from training.errors import UserError
from training.local.tiny import sample_documents
from training.logs import LEVEL_VARIABLE, Progress, human, log, rank_label, setup_logging

STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), log.level
    yield
    root.handlers[:] = handlers
    log.setLevel(level)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_progress_logs_every_interval_and_at_the_end(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    steps = ((10, 1000, 600_000), (31, 11_345, 600_000), (45, 1000, 1), (62, 0, 0))  # seconds, docs, tokens
    with (
        caplog.at_level(logging.INFO, logger="training"),
        Progress("tokenizing", "docs", interval=30, terminal=False, clock=clock) as progress,
    ):
        for seconds, documents, tokens in steps:
            clock.now = 1000.0 + seconds
            progress.update(documents, tokens=tokens)
        clock.now = 1070.0
    assert [r.getMessage() for r in caplog.records] == [
        "tokenizing: 12,345 docs, 1.2 M tokens, 0:00:31",  # 30 s after the start
        "tokenizing: 13,345 docs, 1.2 M tokens, 0:01:02",  # 30 s after the previous line
        "tokenizing: 13,345 docs, 1.2 M tokens, 0:01:10",  # the end
    ]
    assert all(r.levelno == logging.INFO and r.name == "training" for r in caplog.records)


def test_progress_with_a_total_and_a_zero_interval(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    progress = Progress("hf -> nxd", "layers", total=3, interval=0, terminal=False, clock=clock)
    with caplog.at_level(logging.INFO, logger="training"):
        for _ in range(3):
            progress.update(1)
        progress.close()
    assert [r.getMessage() for r in caplog.records] == [
        "hf -> nxd: 1/3 layers, 0:00:00",
        "hf -> nxd: 2/3 layers, 0:00:00",
        "hf -> nxd: 3/3 layers, 0:00:00",
        "hf -> nxd: 3/3 layers, 0:00:00",
    ]


def test_progress_leaves_out_the_final_line_on_an_error(caplog: pytest.LogCaptureFixture) -> None:
    with (
        caplog.at_level(logging.INFO, logger="training"),
        pytest.raises(UserError),
        Progress("packing train", "blocks", terminal=False, clock=FakeClock()) as progress,
    ):
        progress.update(5, trained_tokens=100)
        raise UserError("bad record")
    assert caplog.records == []


def test_progress_on_a_terminal_is_a_bar_not_log_lines(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    with (
        caplog.at_level(logging.INFO, logger="training"),
        Progress("packing train", "blocks", interval=0, terminal=True) as progress,
    ):
        progress.update(7, trained_tokens=2500)
    assert caplog.records == []
    bar = capsys.readouterr().err
    assert "packing train" in bar and "7 blocks" in bar and "2.5 k trained tokens" in bar


def test_human() -> None:
    values = (0, 999, 1000, 1_234_567, 3.2e9, 5e12)
    assert [human(v) for v in values] == ["0", "999", "1.0 k", "1.2 M", "3.2 G", "5.0 T"]


def test_line_format_carries_the_rank_under_torchrun(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging(environ={"RANK": "3", "WORLD_SIZE": "64"})
    logging.getLogger("training.train.loop").info("(step 1) step_loss : 2.0000")
    line = capsys.readouterr().err
    assert re.fullmatch(rf"{STAMP} INFO \[rank 3/64\] \(step 1\) step_loss : 2\.0000\n", line), line


def test_rank_label() -> None:
    assert rank_label({}) == ""
    assert rank_label({}, training=True) == "[rank 0/1] "  # a training job without torchrun
    assert rank_label({"RANK": "1", "WORLD_SIZE": "2"}) == "[rank 1/2] "


def test_level_variable(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging(environ={LEVEL_VARIABLE: "warning"})
    logging.getLogger("training.data").info("hidden")
    logging.getLogger("training.data").warning("shown")
    assert re.fullmatch(rf"{STAMP} WARNING shown\n", capsys.readouterr().err)
    with pytest.raises(
        UserError, match=f"{LEVEL_VARIABLE}: 'chatty' is not allowed; allowed: DEBUG, INFO, WARNING, ERROR"
    ):
        setup_logging(environ={LEVEL_VARIABLE: "chatty"})


def test_setting_up_twice_keeps_one_handler(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging(environ={})
    setup_logging(environ={})
    log.info("once")
    assert capsys.readouterr().err.count("once") == 1


def test_a_later_basic_config_adds_no_second_handler(capsys: pytest.CaptureFixture[str]) -> None:
    """torch-xla calls `logging.basicConfig()` when it is imported, after the CLI has set up logging."""
    setup_logging(environ={})
    logging.basicConfig()
    log.info("once")
    assert capsys.readouterr().err.count("once") == 1


def test_prepare_logs_progress_to_stderr_and_prints_the_summary_to_stdout(
    llama_tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under pytest stderr is no terminal, as under Slurm: progress comes as log lines, never as a bar."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(sample_documents(200)) + "\n")
    arguments = ["--source", str(corpus), "--tokenizer", str(llama_tokenizer), "--seq-len", "16"]
    assert main(["prepare", "pretrain", *arguments, "--output", str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["documents"] == 200
    lines = captured.err.splitlines()
    final = f"tokenizing: 200 docs, {human(summary['tokens'])} tokens, 0:00:00"
    assert any(re.fullmatch(rf"{STAMP} INFO {final}", line) for line in lines), captured.err
    assert "\r" not in captured.err and "it/s" not in captured.err  # no tqdm bar


def test_progress_with_nothing_counted_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="training"), Progress("tokenizing", "docs", terminal=False):
        pass
    assert caplog.records == []
