"""Experiment trackers: real tiny training runs reporting to MLflow's file store and to W&B in offline mode,
read back with MLflow's client and from W&B's own run file; trackers that fail (a closed port, a W&B server that
refuses the key, a missing secret) are one warning each and change nothing in training. Secrets Manager is moto.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml
from mlflow.tracking import MlflowClient
from moto import mock_aws
from wandb.proto import wandb_internal_pb2

from tests.support.system_tools import require_tool
from tests.support.training_runs import world_overrides
from training.config.recipe import Recipe, load_recipe, recipe_as_dict
from training.config.site import Site
from training.config.tracking import TRACKING_VARIABLE, MlflowTracking, Tracking, tracking_environment
from training.errors import UserError
from training.pipeline.export import files_to_export
from training.pipeline.plan import plan_run
from training.pipeline.scripts import render
from training.train.loop import TrainOptions, train
from training.train.metrics import read_metrics, tensorboard_scalars
from training.train.optimizer import zero1_where_it_shards
from training.train.trackers import (
    MLFLOW_HTTP_DEFAULTS,
    RECIPE_ARTIFACT,
    RUN_TAG,
    TRACKER_QUEUE,
    MlflowSender,
    RunFacts,
    close_trackers,
    flat_parameters,
    tracking_from_environment,
)

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)

ROOT = Path(__file__).resolve().parents[3]
RUN_ID = "tiny-tracked-1"
REGION = "us-west-2"
WANDB_VARIABLES = ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY")


def recipe(llama_world_tp1: dict[str, Path], checkpoints: Path, *extra: str) -> Recipe:
    return load_recipe(
        "tiny-llama-cpt", world_overrides(llama_world_tp1, checkpoints, "parallelism.tp=1", "steps=3", *extra)
    )


@pytest.fixture
def job_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """What the train stage's job script exports, without AWS credentials or W&B settings of this machine."""
    for name in (*WANDB_VARIABLES, "TRAINING_METRICS_NAMESPACE", TRACKING_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRAINING_RUN_ID", RUN_ID)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # W&B would read ~/.netrc and ~/.config/wandb
    for name in ("MLFLOW_ALLOW_FILE_STORE", "MLFLOW_TRACKING_URI", *MLFLOW_HTTP_DEFAULTS):
        monkeypatch.delenv(name, raising=False)  # and restored when the test ends: the tracker sets some
    return monkeypatch


def configure(monkeypatch: pytest.MonkeyPatch, tracking: dict[str, Any]) -> None:
    value = tracking_environment(Tracking.model_validate(tracking))
    assert value is not None
    monkeypatch.setenv(TRACKING_VARIABLE, value)


def wandb_records(path: Path) -> Iterator[Any]:
    """The records of a W&B run file: a 7-byte header (`:W&B`, magic, version), then LevelDB's log format (32 KiB
    blocks of chunks, each with a 7-byte header: checksum, length, type full/first/middle/last)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    block, position, pending = 32768, 7, b""
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0 and length == 0:
            position += left
            continue
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # re-exported per protobuf version
            record.ParseFromString(pending)
            yield record


def wandb_history(records: list[Any]) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        if record.WhichOneof("record_type") != "history":
            continue
        items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        step = int(items.pop("_step"))
        for key, value in items.items():
            if not key.startswith("_"):
                series.setdefault(key, []).append((step, float(value)))
    return series


def expected_series(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for tag, value in tensorboard_scalars(record).items():
            series.setdefault(tag, []).append((int(record["step"]), value))
    return series


def test_mlflow_and_wandb_record_the_run(
    llama_world_tp1: dict[str, Path],
    tmp_path: Path,
    job_environment: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = tmp_path / "mlruns"
    configure(
        job_environment,
        {
            "mlflow": {"tracking_uri": store.as_uri(), "experiment": "tiny"},
            "wandb": {"project": "tiny-project", "mode": "offline"},
        },
    )
    checkpoints = tmp_path / "run" / "checkpoints"
    the_recipe = recipe(llama_world_tp1, checkpoints, "data.validation_split=train", "data.validation_every=2")
    ran = recipe_as_dict(zero1_where_it_shards(the_recipe, dp=1))  # the recipe as the loop runs it
    with caplog.at_level(logging.INFO, logger="training"):
        train(TrainOptions(recipe=the_recipe))
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    records = read_metrics(checkpoints / "metrics.jsonl")
    expected = expected_series(records)
    assert {"train/loss", "train/validation_loss", "train/learning_rate", "throughput/mfu"} <= expected.keys()

    client = MlflowClient(tracking_uri=store.as_uri())
    experiment = client.get_experiment_by_name("tiny")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == RUN_ID and run.data.tags[RUN_TAG] == RUN_ID
    assert run.data.params == flat_parameters({**ran, "run_id": RUN_ID})
    assert run.data.params["steps"] == "3" and run.data.params["checkpoint.dir"] == str(checkpoints)
    for tag, series in expected.items():
        history = client.get_metric_history(run.info.run_id, tag)
        assert [(m.step, m.value) for m in history] == series, tag
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.timestamp for m in history] == [int(r["time"] * 1000) for r in records]
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {RECIPE_ARTIFACT, "metrics.jsonl"}
    downloaded = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "downloaded")))
    assert yaml.safe_load((downloaded / RECIPE_ARTIFACT).read_text()) == ran
    assert (downloaded / "metrics.jsonl").read_bytes() == (checkpoints / "metrics.jsonl").read_bytes()

    # W&B's offline run lives in the run directory, beside TensorBoard's files.
    (run_file,) = (tmp_path / "run" / "wandb").glob(f"offline-run-*-{RUN_ID}/run-{RUN_ID}.wandb")
    wandb_run = list(wandb_records(run_file))
    assert wandb_history(wandb_run) == expected
    (started,) = [r.run for r in wandb_run if r.WhichOneof("record_type") == "run"]
    assert (started.run_id, started.display_name, started.project) == (RUN_ID, RUN_ID, "tiny-project")
    config = {item.key: json.loads(item.value_json) for item in started.config.update}
    assert config == {**ran, "run_id": RUN_ID, "_wandb": config["_wandb"]}
    (artifact,) = [r.artifact for r in wandb_run if r.WhichOneof("record_type") == "artifact"]
    assert (artifact.name, artifact.type) == (f"{RUN_ID}-files", "run-files")
    assert {entry.path for entry in artifact.manifest.contents} == {RECIPE_ARTIFACT, "metrics.jsonl"}
    (exit_record,) = [r.exit for r in wandb_run if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == 0
    # The export stage copies it with the results, for `wandb sync` later.
    assert run_file.relative_to(tmp_path / "run") in files_to_export(tmp_path / "run", with_checkpoints=False)


def test_a_requeued_run_continues_its_mlflow_run(
    llama_world_tp1: dict[str, Path], tmp_path: Path, job_environment: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "mlruns"
    configure(job_environment, {"mlflow": {"tracking_uri": store.as_uri()}})
    checkpoints = tmp_path / "run" / "checkpoints"
    train(TrainOptions(recipe=recipe(llama_world_tp1, checkpoints, "checkpoint.every=2", "steps=2")))
    # The requeue: resumed from step 2 with a longer schedule (a changed parameter keeps its first value).
    train(TrainOptions(recipe=recipe(llama_world_tp1, checkpoints, "checkpoint.every=2", "steps=4"), resume=True))
    client = MlflowClient(tracking_uri=store.as_uri())
    experiment = client.get_experiment_by_name("trainium-training")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["steps"] == "2"
    losses = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert losses == [(r["step"], r["loss"]) for r in read_metrics(checkpoints / "metrics.jsonl")]
    assert [step for step, _ in losses] == [1, 2, 3, 4]


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class RefusingWandbServer(ThreadingHTTPServer):
    """A W&B server on 127.0.0.1 that refuses every request (403) and keeps the credentials it was sent."""

    def __init__(self) -> None:
        self.authorizations: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                server.authorizations.append(self.headers.get("Authorization", ""))
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(403)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST

            def log_message(self, *arguments: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def test_failing_trackers_are_one_warning_each_and_training_is_unchanged(
    llama_world_tp1: dict[str, Path],
    tmp_path: Path,
    job_environment: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    reference = train(TrainOptions(recipe=recipe(llama_world_tp1, tmp_path / "plain" / "checkpoints")))
    key = "wandb-key-" + "7" * 40  # W&B checks the length (40 or more)
    server = RefusingWandbServer()
    with mock_aws():
        arn = boto3.client("secretsmanager", region_name=REGION).create_secret(Name="wandb", SecretString=key)["ARN"]
        configure(
            job_environment,
            {
                "mlflow": {"tracking_uri": f"http://127.0.0.1:{closed_port()}"},
                "wandb": {
                    "project": "tiny-project",
                    "api_key_secret_arn": arn,
                    "base_url": f"http://127.0.0.1:{server.server_port}",
                },
            },
        )
        checkpoints = tmp_path / "run" / "checkpoints"
        with caplog.at_level(logging.INFO, logger="training"):
            summary = train(TrainOptions(recipe=recipe(llama_world_tp1, checkpoints)))
    server.shutdown()
    assert (summary["first_loss"], summary["last_loss"]) == (reference["first_loss"], reference["last_loss"])
    assert [r["step"] for r in read_metrics(checkpoints / "metrics.jsonl")] == [1, 2, 3]
    warnings = sorted(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("MLflow: could not start the run (") and "without MLflow" in warnings[0]
    assert warnings[1].startswith("W&B: could not start the run (") and "without W&B" in warnings[1]
    # The key from Secrets Manager reached W&B's server, and no log line or file of the run holds it.
    assert f"Basic {base64.b64encode(f'api:{key}'.encode()).decode()}" in server.authorizations
    assert not [r for r in caplog.records if key in r.getMessage()]
    assert not [path for path in (tmp_path / "run").rglob("*") if path.is_file() and key.encode() in path.read_bytes()]


def test_a_tracker_that_hangs_never_delays_a_step(
    tmp_path: Path, job_environment: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that takes the connection and never answers: writes return at once, the queue's bound drops the
    records beyond it (one warning), and the end of the run waits no longer than its timeout."""
    facts = RunFacts(run_id=RUN_ID, settings={"steps": 2}, run_dir=tmp_path)
    silent, held = socket.socket(), []
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)

    def hold() -> None:
        with contextlib.suppress(OSError):  # the listener closed
            while True:
                held.append(silent.accept()[0])

    threading.Thread(target=hold, daemon=True).start()
    sender = MlflowSender(MlflowTracking(tracking_uri=f"http://127.0.0.1:{silent.getsockname()[1]}"), facts)
    with caplog.at_level(logging.WARNING, logger="training"):
        began = time.monotonic()
        for step in range(1, TRACKER_QUEUE + 11):
            sender.write(step, None, {"train/loss": 1.0})
        writing = time.monotonic() - began
        close_trackers([sender], [], completed=True, timeout=1.0)
        closing = time.monotonic() - began - writing
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    # The server goes away: the request fails, the retries are refused, the thread ends (before the next test).
    silent.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone would leave it listening)
    silent.close()
    for connection in held:
        connection.close()
    sender.wait(time.monotonic() + 30)
    assert not sender.running
    assert writing < 1.0 and closing < 3.0, (writing, closing)
    assert sender.dropped == 10 and sender.sent == 0
    assert warnings == [
        f"MLflow: {TRACKER_QUEUE} records are waiting to be sent; dropped the one of step {TRACKER_QUEUE + 1} "
        "(later ones are counted); training continues",
        f"MLflow: gave up waiting for it to finish ({TRACKER_QUEUE} records unsent)",
    ]


def test_a_missing_secret_is_one_warning(
    llama_world_tp1: dict[str, Path],
    tmp_path: Path,
    job_environment: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    arn = f"arn:aws:secretsmanager:{REGION}:123456789012:secret:wandb-AbCdEf"
    configure(job_environment, {"wandb": {"project": "tiny-project", "api_key_secret_arn": arn}})
    with mock_aws(), caplog.at_level(logging.WARNING, logger="training"):
        summary = train(TrainOptions(recipe=recipe(llama_world_tp1, tmp_path / "run" / "checkpoints")))
    assert summary["steps"] == 3
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warning == (
        f"W&B: could not start the run (W&B API key secret {arn}: ResourceNotFoundException; the node's role must "
        "read it); training continues without W&B"
    )
    assert not (tmp_path / "run" / "wandb").exists()


def test_the_tracking_variable_is_checked() -> None:
    with pytest.raises(UserError) as error:
        tracking_from_environment({TRACKING_VARIABLE: "{mlflow"})
    assert str(error.value).startswith(f"{TRACKING_VARIABLE}: not JSON (")
    with pytest.raises(UserError) as error:
        tracking_from_environment({TRACKING_VARIABLE: '{"wandb": {"project": "a b"}}'})
    assert str(error.value) == (
        f"{TRACKING_VARIABLE}: wandb.project: 'a b' is not allowed; allowed: 1 to 128 of letters, digits, '_', '.' "
        "and '-'"
    )
    assert tracking_from_environment({TRACKING_VARIABLE: "{}"}) is None
    assert tracking_from_environment({}) is None


def test_without_trackers_neither_library_is_imported(tmp_path: Path) -> None:
    code = (
        "import sys\nfrom pathlib import Path\nimport training.train.loop\n"
        "from training.train.metrics import open_metrics\n"
        f"sink = open_metrics(Path({str(tmp_path / 'c')!r}), first_step=1, environ={{}}, recipe_settings={{}})\n"
        "sink.write({'step': 1, 'loss': 1.0})\nsink.close()\n"
        "loaded = sorted(name for name in ('mlflow', 'wandb', 'sagemaker_mlflow') if name in sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert read_metrics(tmp_path / "c" / "metrics.jsonl") == [{"step": 1, "loss": 1.0}]


def test_the_train_job_alone_gets_the_trackers_and_the_shell_keeps_them(tmp_path: Path) -> None:
    tracking = Tracking.model_validate(
        {
            "mlflow": {"tracking_uri": "arn:aws:sagemaker:us-west-2:123456789012:mlflow-tracking-server/runs"},
            "wandb": {
                "project": "llama",
                "entity": "team.a",
                "api_key_secret_arn": f"arn:aws:secretsmanager:{REGION}:123456789012:secret:wandb-key-Ab12Cd",
            },
        }
    )
    site = Site(runs_root=str(tmp_path / "runs"), tracking=tracking)
    scripts = render(plan_run(load_recipe("tiny-llama-cpt"), site, "RUN-ID"))
    exports = {
        stage: [line for line in text.splitlines() if TRACKING_VARIABLE in line] for stage, text in scripts.items()
    }
    assert {stage: len(lines) for stage, lines in exports.items() if lines} == {"train": 1}
    (line,) = exports["train"]
    assert line.startswith(f"export {TRACKING_VARIABLE}='")
    shell = subprocess.run(
        ["bash", "-c", f"{line}\nprintenv {TRACKING_VARIABLE}"], capture_output=True, text=True, check=True
    )
    assert tracking_from_environment({TRACKING_VARIABLE: shell.stdout}) == tracking
    script = tmp_path / "train.sbatch"
    script.write_text(scripts["train"])
    lint = subprocess.run(
        [require_tool("shellcheck"), "-s", "bash", str(script)], capture_output=True, text=True, check=False
    )
    assert lint.returncode == 0, lint.stdout
