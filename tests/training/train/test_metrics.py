"""Rank 0's metric sinks (training.train.metrics) in real training runs of the tiny Llama on one CPU process:
TensorBoard holds the JSON lines' values, each step once after a resume; a compile run writes no event files
and sends nothing; CloudWatch (moto, or botocore's Stubber, at the AWS boundary) gets every value with and
without the run's dimension, and its failures are one warning that never stops training."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import pytest
from botocore.stub import Stubber
from moto import mock_aws
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.support.training_runs import world_overrides
from training.config.recipe import Recipe, load_recipe
from training.monitoring import cloudwatch
from training.train.loop import KILL_AT_STEP, TrainOptions, train
from training.train.metrics import (
    NAMESPACE_VARIABLE,
    RUN_ID_VARIABLE,
    TAGS,
    CloudWatchSender,
    read_metrics,
)

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)

ROOT = Path(__file__).resolve().parents[3]
NAMESPACE = "Trainium/test"
RUN_ID = "tiny-run-1"
AWS_VARIABLES = ("AWS_PROFILE", "AWS_REGION", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_CLOUDWATCH")


def overrides(llama_world_tp1: dict[str, Path], checkpoints: Path, *extra: str) -> list[str]:
    return world_overrides(llama_world_tp1, checkpoints, "parallelism.tp=1", *extra)


def recipe(llama_world_tp1: dict[str, Path], checkpoints: Path, *extra: str) -> Recipe:
    return load_recipe("tiny-llama-cpt", overrides(llama_world_tp1, checkpoints, *extra))


@pytest.fixture
def fake_aws(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in AWS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")


def scalars(directory: Path) -> dict[str, list[tuple[int, float, float]]]:
    """Tag -> (step, value, wall time) as TensorBoard itself reads them (purges included)."""
    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(event.step, event.value, event.wall_time) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def expected_scalars(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """The JSON lines' values per tag, as float32 (TensorBoard's scalar type)."""
    expected: dict[str, list[tuple[int, float]]] = {}
    for key, tag in TAGS.items():
        series = [(r["step"], float(np.float32(r[key]))) for r in records if r.get(key) is not None]
        if series:
            expected[tag] = series
    return expected


def test_tensorboard_holds_the_values_of_the_json_lines(llama_world_tp1: dict[str, Path], tmp_path: Path) -> None:
    checkpoints = tmp_path / "run" / "checkpoints"
    settings = ("steps=4", "data.validation_split=train", "data.validation_every=2", "data.validation_batches=1")
    train(TrainOptions(recipe=recipe(llama_world_tp1, checkpoints, *settings)))
    records = [json.loads(line) for line in (checkpoints / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # In the run directory, beside the checkpoints (what export copies).
    found = scalars(tmp_path / "run" / "tensorboard")
    expected = expected_scalars(records)
    assert (
        {
            "train/loss",
            "train/validation_loss",
            "train/learning_rate",
            "train/grad_norm",
            "throughput/tokens_per_second",
            "throughput/seq_per_second",
            "throughput/mfu",
            "throughput/tokens_per_second_per_node",
        }
        == expected.keys()
        == found.keys()
    )
    assert [step for step, _ in expected["train/validation_loss"]] == [2, 4]
    for tag, series in expected.items():
        assert [(step, value) for step, value, _ in found[tag]] == series, tag
    assert [wall for _, _, wall in found["train/loss"]] == pytest.approx([r["time"] for r in records], abs=1e-3)


def test_a_resumed_run_shows_each_step_once_with_its_last_values(
    llama_world_tp1: dict[str, Path], tmp_path: Path
) -> None:
    checkpoints = tmp_path / "run" / "checkpoints"
    settings = overrides(llama_world_tp1, checkpoints, "steps=6", "checkpoint.every=3")
    killed = subprocess.run(
        [sys.executable, "-m", "training", "train", "--recipe", "tiny-llama-cpt", *settings],
        cwd=ROOT,
        env={**os.environ, KILL_AT_STEP: "5"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert killed.returncode != 0 and (checkpoints / "step_3" / "done").is_file(), killed.stderr[-3000:]
    (first_attempt,) = (tmp_path / "run" / "tensorboard").iterdir()
    assert [step for step, _, _ in scalars(first_attempt)["train/loss"]] == [1, 2, 3, 4, 5]  # 4 and 5: lost work

    train(TrainOptions(recipe=load_recipe("tiny-llama-cpt", settings), resume=True))
    logged = [json.loads(line)["step"] for line in (checkpoints / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4, 5, 4, 5, 6]
    found = scalars(tmp_path / "run" / "tensorboard")
    expected = expected_scalars(read_metrics(checkpoints / "metrics.jsonl"))  # the last record of each step
    for tag, series in expected.items():
        assert [(step, value) for step, value, _ in found[tag]] == series, tag
    # Throughput differs between the attempts: TensorBoard shows the resumed attempt's.
    resumed = [json.loads(line) for line in (checkpoints / "metrics.jsonl").read_text().splitlines()][-3:]
    assert found["throughput/tokens_per_second"][3:] == [
        (r["step"], float(np.float32(r["tokens_per_second"])), pytest.approx(r["time"], abs=1e-3)) for r in resumed
    ]


@mock_aws
def test_a_compile_run_writes_no_event_files_and_sends_nothing(
    llama_world_tp1: dict[str, Path], tmp_path: Path, fake_aws: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(NAMESPACE_VARIABLE, NAMESPACE)
    checkpoints = tmp_path / "run" / "checkpoints"
    train(TrainOptions(recipe=recipe(llama_world_tp1, checkpoints), compile_only=True))
    assert [r["step"] for r in read_metrics(checkpoints / "metrics-compile.jsonl")] == [1, 2]
    assert not (tmp_path / "run" / "tensorboard").exists()
    assert boto3.client("cloudwatch").list_metrics(Namespace=NAMESPACE)["Metrics"] == []


def statistics(client: Any, name: str, dimensions: list[dict[str, str]], since: float) -> dict[str, Any]:
    start, end = (datetime.fromtimestamp(t, timezone.utc) for t in (since - 600, time.time() + 600))
    points = client.get_metric_statistics(
        Namespace=NAMESPACE,
        MetricName=name,
        Dimensions=dimensions,
        StartTime=start,
        EndTime=end,
        Period=3600,
        Statistics=["Minimum", "Maximum", "SampleCount"],
    )["Datapoints"]
    assert len(points) == 1, (name, dimensions, points)
    return dict(points[0])


@mock_aws
def test_cloudwatch_gets_every_value_with_and_without_the_run(
    llama_world_tp1: dict[str, Path], tmp_path: Path, fake_aws: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(NAMESPACE_VARIABLE, NAMESPACE)
    monkeypatch.setenv(RUN_ID_VARIABLE, RUN_ID)
    started = time.time()
    checkpoints = tmp_path / "run" / "checkpoints"
    train(TrainOptions(recipe=recipe(llama_world_tp1, checkpoints, "steps=3")))
    records = read_metrics(checkpoints / "metrics.jsonl")
    client = boto3.client("cloudwatch")
    listed = client.list_metrics(Namespace=NAMESPACE)["Metrics"]
    sent = {(m["MetricName"], tuple((d["Name"], d["Value"]) for d in m["Dimensions"])) for m in listed}
    names = {
        cloudwatch.TRAINING_STEP: ("step", 1, "None"),
        cloudwatch.TRAINING_LOSS: ("loss", 1, "None"),
        cloudwatch.LEARNING_RATE: ("lr", 1, "None"),
        cloudwatch.GRADIENT_NORM: ("grad_norm", 1, "None"),
        cloudwatch.TOKENS_PER_SECOND: ("tokens_per_second", 1, "Count/Second"),
        cloudwatch.SEQUENCES_PER_SECOND: ("seq_per_second", 1, "Count/Second"),
        cloudwatch.MFU: ("mfu", 100, "Percent"),
    }
    assert sent == {(name, dimensions) for name in names for dimensions in ((), (("Run", RUN_ID),))}
    for name, (key, factor, unit) in names.items():
        values = [factor * r[key] for r in records]
        run = statistics(client, name, [{"Name": "Run", "Value": RUN_ID}], started)
        assert run["SampleCount"] == 3 and run["Unit"] == unit, (name, run)
        assert (run["Minimum"], run["Maximum"]) == pytest.approx((min(values), max(values)), rel=1e-9), name
        unqualified = statistics(client, name, [], started)
        assert (unqualified["Minimum"], unqualified["Maximum"]) == pytest.approx((min(values), max(values)), rel=1e-9)


@mock_aws
def test_percentages_and_optional_values_reach_cloudwatch(fake_aws: None) -> None:
    """Validation loss and MoE drops when a record has them; fractions sent as percent; no Run dimension
    without a run id."""
    started = time.time()
    sender = CloudWatchSender(NAMESPACE, None)
    sender.write({"step": 7, "loss": 2.5, "validation_loss": 2.75, "moe_dropped": 0.125, "mfu": 0.25, "time": started})
    sender.close()
    assert sender.sent == 1 and sender.failures == 0
    client = boto3.client("cloudwatch")
    listed = client.list_metrics(Namespace=NAMESPACE)["Metrics"]
    assert all(m["Dimensions"] == [] for m in listed) and len(listed) == 5
    expected = {
        cloudwatch.VALIDATION_LOSS: (2.75, "None"),
        cloudwatch.MOE_DROPPED_TOKENS: (12.5, "Percent"),
        cloudwatch.MFU: (25.0, "Percent"),
        cloudwatch.TRAINING_STEP: (7.0, "None"),
    }
    for name, (value, unit) in expected.items():
        point = statistics(client, name, [], started)
        assert (point["Maximum"], point["SampleCount"], point["Unit"]) == (value, 1, unit), name


@mock_aws
def test_the_throughput_floor_reaches_cloudwatch_with_and_without_the_run(
    llama_world_tp1: dict[str, Path], tmp_path: Path, fake_aws: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run far below its expected figure (no warm-up, a window of one step): every record's fraction of the
    expected tokens/s per node in percent and the below-the-floor flag, as the alarm reads them."""
    monkeypatch.setenv(NAMESPACE_VARIABLE, NAMESPACE)
    monkeypatch.setenv(RUN_ID_VARIABLE, RUN_ID)
    started = time.time()
    checkpoints = tmp_path / "run" / "checkpoints"
    floor = ("throughput.expected_tokens_per_second_per_node=1e12", "throughput.warmup_steps=0")
    train(TrainOptions(recipe=recipe(llama_world_tp1, checkpoints, "steps=3", *floor, "throughput.window_steps=1")))
    records = read_metrics(checkpoints / "metrics.jsonl")
    client = boto3.client("cloudwatch")
    percents = [100 * r["throughput_fraction"] for r in records]
    run = [{"Name": "Run", "Value": RUN_ID}]
    flag = statistics(client, cloudwatch.BELOW_THROUGHPUT_FLOOR, run, started)
    assert (flag["Minimum"], flag["Maximum"], flag["SampleCount"], flag["Unit"]) == (1.0, 1.0, 3, "None")
    fraction = statistics(client, cloudwatch.THROUGHPUT_FRACTION, run, started)
    assert fraction["Unit"] == "Percent" and fraction["SampleCount"] == 3
    for dimensions in ([], run):  # moto's query without dimensions matches the Run series too: the range only
        fraction = statistics(client, cloudwatch.THROUGHPUT_FRACTION, dimensions, started)
        assert (fraction["Minimum"], fraction["Maximum"]) == pytest.approx((min(percents), max(percents)), rel=1e-9)
        assert statistics(client, cloudwatch.BELOW_THROUGHPUT_FLOOR, dimensions, started)["Minimum"] == 1.0
    assert 0 < max(percents) < 1e-3


@mock_aws
def test_late_compilations_reach_cloudwatch_as_a_count(fake_aws: None) -> None:
    """A Neuron record's late compilations (the CPU backend has none: tests/neuron makes them)."""
    started = time.time()
    sender = CloudWatchSender(NAMESPACE, RUN_ID)
    record = {"step": 9, "loss": 2.0, "xla_compilations": 7, "late_compilations": 2, "late_compilation_step": 9}
    sender.write({**record, "time": started})
    sender.close()
    client = boto3.client("cloudwatch")
    point = statistics(client, cloudwatch.LATE_COMPILATIONS, [{"Name": "Run", "Value": RUN_ID}], started)
    assert (point["Maximum"], point["SampleCount"], point["Unit"]) == (2.0, 1, "Count")
    assert statistics(client, cloudwatch.LATE_COMPILATIONS, [], started)["Maximum"] == 2.0


def test_a_cloudwatch_error_is_one_warning(fake_aws: None, caplog: pytest.LogCaptureFixture) -> None:
    client = boto3.client("cloudwatch")
    with Stubber(client) as stubber:
        for _ in range(2):
            stubber.add_client_error("put_metric_data", "InvalidParameterValue", "The value is invalid.", 400)
        stubber.add_response("put_metric_data", {})
        sender = CloudWatchSender(NAMESPACE, RUN_ID, client=client)
        with caplog.at_level(logging.INFO, logger="training"):
            for step in (1, 2, 3):
                sender.write({"step": step, "loss": 1.0, "time": time.time()})
            sender.close()
        stubber.assert_no_pending_responses()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "InvalidParameterValue" in warnings[0] and NAMESPACE in warnings[0], warnings
    assert (sender.sent, sender.failures) == (1, 2)


def test_training_continues_when_cloudwatch_cannot_be_reached(
    llama_world_tp1: dict[str, Path],
    tmp_path: Path,
    fake_aws: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No region configured: every send fails in the client's set-up; one warning, the run completes."""
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    monkeypatch.setenv(NAMESPACE_VARIABLE, NAMESPACE)
    checkpoints = tmp_path / "run" / "checkpoints"
    with caplog.at_level(logging.INFO, logger="training"):
        summary = train(TrainOptions(recipe=recipe(llama_world_tp1, checkpoints, "steps=3")))
    assert summary["steps"] == 3 and (checkpoints / "step_3" / "done").is_file()
    assert [r["step"] for r in read_metrics(checkpoints / "metrics.jsonl")] == [1, 2, 3]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "NoRegionError" in warnings[0] and "training continues" in warnings[0], warnings
    assert any("3 sends to namespace" in r.getMessage() for r in caplog.records)


def test_without_a_namespace_nothing_imports_boto3(tmp_path: Path) -> None:
    """Our modules leave boto3 alone unless TRAINING_METRICS_NAMESPACE is set (TensorBoard's own file layer
    imports it where it is installed; a compile run does not load TensorBoard)."""
    code = (
        "import sys\nfrom pathlib import Path\nimport training.train.loop\n"
        "from training.train.metrics import open_metrics\n"
        f"sink = open_metrics(Path({str(tmp_path / 'c')!r}), first_step=1, compile_only=True, environ={{}})\n"
        "sink.write({'step': 1, 'loss': 1.0})\nsink.close()\n"
        "assert 'boto3' not in sys.modules, 'boto3 imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert read_metrics(tmp_path / "c" / "metrics-compile.jsonl") == [{"step": 1, "loss": 1.0}]
