"""The training job's watches (training.train.watchdog): which compilations are late, when the throughput is below
its floor, the lines they print, and on the CPU backend a run that stops itself below the floor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.training_runs import metrics, torchrun, world_overrides
from training.train.watchdog import (
    CHECKPOINT,
    STEP,
    STOP_FILE,
    VALIDATION,
    CompileWatch,
    floor_line,
    floor_verdict,
    late_compile_line,
    read_stop,
    write_stop,
)

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)


def test_the_first_two_steps_of_a_process_compile_and_later_step_graphs_are_late() -> None:
    watch = CompileWatch(start=0)
    assert watch.observe(1, STEP, 3) == 0  # forward/backward of the first micro batch, the rest, the optimizer
    assert watch.observe(2, STEP, 4) == 0  # step 2's optimizer graph (step 1's differs)
    assert watch.observe(3, STEP, 4) == 0 and watch.late == 0
    assert watch.observe(4, STEP, 5) == 1  # a new step graph: the compile stage never had it
    assert watch.observe(4, STEP, 5) == 0  # the same count observed again (the step closure, then the loop)
    assert watch.fields() == {"late_compilations": 1, "late_compilation_step": 4}


def test_a_resumed_process_compiles_in_its_own_first_two_steps() -> None:
    watch = CompileWatch(start=5)
    assert watch.observe(6, STEP, 3) == watch.observe(7, STEP, 4) == 0
    assert watch.observe(8, STEP, 6) == 2
    assert watch.late_steps == [8] and watch.fields()["late_compilations"] == 2


def test_validation_and_checkpoint_graphs_compile_at_their_first_use_only() -> None:
    """Their first use in the process compiles whatever the step (the persistent cache answers it); a second
    compilation of the same phase is a graph that changed since the compile stage."""
    watch = CompileWatch(start=0)
    watch.observe(2, STEP, 4)
    assert watch.observe(10, VALIDATION, 6) == 0
    assert watch.observe(10, CHECKPOINT, 7) == 0
    assert watch.observe(20, VALIDATION, 7) == 0  # ran again, nothing compiled
    assert watch.observe(30, VALIDATION, 8) == 1
    assert watch.observe(40, CHECKPOINT, 9) == 1
    assert watch.late_steps == [30, 40] and watch.late == 2


def test_a_validation_in_the_first_two_steps_is_its_first_use() -> None:
    watch = CompileWatch(start=0)
    assert watch.observe(2, VALIDATION, 6) == 0
    assert watch.observe(4, VALIDATION, 7) == 1


def test_the_late_compilation_line_names_the_step_and_the_cache() -> None:
    line = late_compile_line(12, 1, STEP)
    assert line.startswith("train compiled a graph at step 12: the compile cache missed (the training step's graph")
    assert "\n" not in line
    assert late_compile_line(12, 2, VALIDATION).startswith("train compiled 2 graphs at step 12: the compile cache")
    # status: the process's total, the last one's step
    assert late_compile_line(12, 3).startswith("train compiled 3 graphs late, the last at step 12: the compile cache")


def floor(values: list[tuple[int, float]], **settings: float) -> tuple[float | None, float | None, bool]:
    options = {"start": 0, "expected": 100.0, "floor_fraction": 0.5, "warmup_steps": 2, "window_steps": 3} | settings
    verdict = floor_verdict(values, **options)  # type: ignore[arg-type]
    return verdict.tokens_per_node, verdict.fraction, verdict.below


def test_the_floor_waits_for_the_warmup_and_a_full_window() -> None:
    assert floor([(1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0)]) == (None, None, False)  # 2 steps after the warm-up
    assert floor([(1, 1.0), (2, 1.0), (3, 10.0), (4, 30.0), (5, 40.0)]) == (30.0, 0.3, True)


def test_the_floor_is_a_median_one_slow_step_is_not_below() -> None:
    assert floor([(3, 90.0), (4, 5.0), (5, 80.0)]) == (80.0, 0.8, False)
    assert floor([(3, 90.0), (4, 5.0), (5, 8.0)])[2] is True
    assert floor([(3, 49.0), (4, 50.0), (5, 51.0)]) == (50.0, 0.5, False)  # at the floor is not below


def test_a_resumed_process_warms_up_again() -> None:
    assert floor([(11, 1.0), (12, 1.0), (13, 1.0)], start=10) == (None, None, False)
    assert floor([(13, 1.0), (14, 1.0), (15, 1.0)], start=10)[2] is True


def test_the_floor_line_says_actual_against_expected() -> None:
    assert floor_line(1234.4, 10000.0, 0.123, 0.5) == (
        "actual 1,234 tokens/s per node against expected 10,000 (12%); below the floor of 50%"
    )
    assert floor_line(9000.0, 10000.0, 0.9, 0.5).endswith("above the floor of 50%")


def test_the_stop_is_recorded_and_read_back(tmp_path: Path) -> None:
    assert read_stop(tmp_path) is None
    write_stop(tmp_path / "checkpoints", "a reason", 7)
    stop = read_stop(tmp_path / "checkpoints")
    assert stop is not None and (stop["reason"], stop["step"]) == ("a reason", 7)
    (tmp_path / STOP_FILE).write_text("[1]")  # not one this module wrote
    assert read_stop(tmp_path) is None


FLOOR = ("throughput.warmup_steps=2", "throughput.window_steps=2")


def test_a_run_below_its_floor_logs_it_and_with_cancel_stops_with_the_reason(
    llama_world: dict[str, Path], tmp_path: Path
) -> None:
    """The CPU backend at far less than a figure no machine reaches: each record after the warm-up says so; with
    cancel_below_floor the job ends at the first full window, one line on stderr, the reason recorded. The CPU
    backend compiles no graphs: no late-compilation keys at all."""
    impossible = "throughput.expected_tokens_per_second_per_node=1e12"
    watched = torchrun("tiny-llama-cpt", world_overrides(llama_world, tmp_path / "a", impossible, *FLOOR), processes=2)
    assert watched.returncode == 0, watched.stderr[-3000:]
    records = metrics(tmp_path / "a")
    assert all(r["tokens_per_second_per_node"] == pytest.approx(r["tokens_per_second"], rel=1e-3) for r in records)
    assert [r["step"] for r in records if "below_throughput_floor" in r] == list(range(4, 21))
    assert all(r["below_throughput_floor"] == 1 and 0 < r["throughput_fraction"] < 1e-3 for r in records[3:])
    assert not any("late_compilations" in r or "xla_compilations" in r for r in records)
    assert "throughput at step 4: actual" in watched.stderr and read_stop(tmp_path / "a") is None

    stopped = torchrun(
        "tiny-llama-cpt",
        world_overrides(llama_world, tmp_path / "b", impossible, *FLOOR, "throughput.cancel_below_floor=true"),
        processes=2,
    )
    assert stopped.returncode != 0
    reason = read_stop(tmp_path / "b")
    assert reason is not None and reason["step"] == 4
    assert reason["reason"].startswith("throughput below the floor at step 4: actual ")
    assert reason["reason"].endswith("(0%); below the floor of 50% (throughput.cancel_below_floor)")
    assert f"error: {reason['reason']}" in stopped.stderr.splitlines()
    assert [r["step"] for r in metrics(tmp_path / "b")] == [1, 2, 3, 4]
    assert json.loads((tmp_path / "b" / STOP_FILE).read_text())["reason"] == reason["reason"]
