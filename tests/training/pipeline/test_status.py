"""`python -m training status` for the train stage: the last logged values and the ETA (training.pipeline.status).
No Slurm here: a run record without submissions asks Slurm nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.run_records import write_run_record
from training.pipeline.status import describe_progress, eta_seconds, print_status, stage_states, training_progress
from training.pipeline.timeline import format_duration


def test_eta_is_the_remaining_steps_at_the_recent_pace() -> None:
    points = [(step, 100.0 + 2.0 * step) for step in range(1, 11)]  # 2 s a step
    assert eta_seconds(points, 100) == pytest.approx(90 * 2.0)
    # Logged every 5 steps: the pace is per step, not per logged record.
    assert eta_seconds([(5, 10.0), (10, 20.0), (15, 30.0)], 20) == pytest.approx(5 * 2.0)


def test_eta_ignores_a_restart_and_follows_the_recent_pace() -> None:
    before = [(step, 2.0 * step) for step in range(1, 11)]
    resumed = [(step, 3600.0 + 3.0 * step) for step in range(11, 21)]  # an hour's pause, then 3 s a step
    assert eta_seconds(before + resumed, 40, window=9) == pytest.approx(20 * 3.0)
    assert eta_seconds(before + resumed, 40, window=3) == pytest.approx(20 * 3.0)  # the pause is one interval


@pytest.mark.parametrize(
    ("points", "total", "expected"),
    [
        ([], 10, None),
        ([(1, 5.0)], 10, None),  # one point: no pace yet
        ([(3, 5.0), (3, 9.0)], 10, None),  # no step apart
        ([(1, 5.0), (2, 5.0)], 10, None),  # no time apart (clock resolution)
        ([(9, 1.0), (10, 2.0)], 10, 0.0),  # done
        ([(1, 1.0)], 1, 0.0),
    ],
)
def test_eta_without_a_pace_or_with_nothing_left(
    points: list[tuple[int, float]], total: int, expected: float | None
) -> None:
    assert eta_seconds(points, total) == expected


@pytest.mark.parametrize(
    ("seconds", "text"), [(0, "0s"), (45.4, "45s"), (310, "5m10s"), (7500, "2h05m"), (3 * 86400 + 4 * 3600, "3d04h")]
)
def test_durations_read_as_a_person_would_write_them(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def run_dir_with(tmp_path: Path, records: list[dict[str, Any]], steps: int = 100) -> Path:
    run_dir = tmp_path / "run-1"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_run_record(run_dir, ["train"], [f"steps={steps}"])
    return run_dir


def test_status_shows_the_last_values_of_the_train_stage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = [
        {"step": s, "loss": 3.0 - 0.01 * s, "lr": 2e-4, "grad_norm": 0.75, "seq_per_second": 4.0}
        | {"tokens_per_second": 32768.0, "time": 1000.0 + 4 * s, "mfu": 0.3125, "moe_dropped": 0.0125}
        | ({"validation_loss": 2.5} if s == 20 else {})
        for s in range(1, 26)
    ]
    records.append(dict(records[-1], loss=1.5, time=5000.0))  # step 25 logged again after a resume
    run_dir = run_dir_with(tmp_path, records)
    rows = print_status(run_dir)
    out = capsys.readouterr().out
    (train,) = rows
    assert train["state"] == "UNKNOWN" and train["metrics"]["step"] == 25 and train["metrics"]["loss"] == 1.5
    assert "step 25/100 loss 1.5000" in train["note"] and "ETA" not in train["note"]  # not queued or running
    assert (
        "train at step 25 of 100: loss 1.5000, validation loss 2.5000 (step 20), learning rate 2.00e-04, "
        "grad norm 0.750, 32,768 tokens/s, MFU 31.2%, MoE dropped 1.25%" in out
    ), out


def test_status_of_a_running_train_stage_has_an_eta(tmp_path: Path) -> None:
    """As stage_states computes it from the file, for a job Slurm says is running (the rows' state)."""
    records = [{"step": s, "loss": 2.0, "time": 1000.0 + 3 * s} for s in range(1, 11)]
    progress = training_progress(run_dir_with(tmp_path, records, steps=30) / "checkpoints" / "metrics.jsonl", 30)
    assert progress["eta_seconds"] == pytest.approx(60.0) and progress["seconds_per_step"] == pytest.approx(3.0)
    assert "; ETA 1m00s (3.00 s/step recently)" in describe_progress(progress)
    assert progress["step"] == 10 and "validation_loss" not in progress and progress["lr"] is None


def test_status_names_a_damaged_metrics_file_instead_of_failing(tmp_path: Path) -> None:
    run_dir = run_dir_with(tmp_path, [])
    (run_dir / "checkpoints" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\ngarbage\n{"step": 2}\n')
    (train,) = stage_states(run_dir)
    assert "metrics.jsonl line 2: not JSON" in train["note"] and "metrics" not in train
