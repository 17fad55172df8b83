"""Experiment trackers fed by the metrics sink: MLflow and Weights & Biases, each optional.

The training job gets the site's `tracking` settings as JSON in `TRAINING_TRACKING` (the Slurm job script of the
train stage exports it). Each configured tracker is one `TrackerSender`: its own thread and bounded queue, so a
slow or unreachable tracker never delays a step. The run starts in that thread (MLflow's experiment and run,
W&B's init and the API key from Secrets Manager); then every logged record's TensorBoard scalars go to it with
their step; at the end the resolved recipe and the metrics JSON lines go as artifacts. Anything that fails (at
start, while sending, at the end) is one warning, and that tracker stops: training goes on, and the files the
sink writes are the record.

What a run records:
- MLflow: experiment `experiment` (created when missing), one run per run id (tag `training.run_id`; a
  requeued job continues it), parameters the flattened recipe and `run_id`, metrics under TensorBoard's tags
  (`train/loss`...) with the step, artifacts `recipe.yaml` and `metrics.jsonl`, status FINISHED or FAILED.
- W&B: run id and name the run id (resumed when it exists), config the recipe with `run_id`, the same metrics
  with the step, and an artifact `<run id>-files` of type `run-files` with the same two files. Its local files
  are in `<run_dir>/wandb` (or WANDB_DIR); offline, `wandb sync` uploads them later.

mlflow, wandb and boto3 are imported in the sender's thread only, and only for a configured tracker.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from training.config.loading import build
from training.config.tracking import (
    TRACKING_VARIABLE,
    MlflowTracking,
    Tracking,
    WandbTracking,
    sagemaker_mlflow_arn,
)
from training.errors import UserError
from training.secrets import read_secret

log = logging.getLogger(__name__)

RUN_TAG = "training.run_id"  # MLflow tag naming the pipeline's run id, to find the run again on a requeue
RECIPE_ARTIFACT = "recipe.yaml"
TRACKER_QUEUE = 1000  # records waiting for one tracker; beyond that (a tracker slow for long) they are dropped
TRACKER_CLOSE_SECONDS = 60.0  # how long the end of a run waits for the trackers, all of them together
MLFLOW_PARAM_BATCH = 100  # MLflow's log_batch takes at most 100 parameters
MLFLOW_PARAM_LENGTH = 6000  # and values of at most 6000 characters
# MLflow's HTTP client retries a request 7 times with exponential backoff by default (minutes for a server that
# is down); a tracker that cannot answer soon is given up instead. The job's own settings win.
MLFLOW_HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}
# Uploads of artifacts to a SageMaker MLflow server through URLs it presigns, so the nodes need no access to the
# server's artifact bucket (the sagemaker-mlflow plugin's switch).
SAGEMAKER_PRESIGNED_UPLOAD = "SAGEMAKER_PRESIGNED_URL_UPLOAD_ENABLED"
MLFLOW_FILE_STORE = "MLFLOW_ALLOW_FILE_STORE"
WANDB_INIT_SECONDS = 60.0
THREAD_SUFFIX = "-tracker"
# Library loggers whose warnings, in a tracker's thread, repeat what its one warning says (urllib3's retries,
# wandb.init's traceback, the sagemaker-mlflow header provider's complaint on every request to a server that
# is not an ARN): dropped in those threads only, every other thread's records pass.
QUIETED_LOGGERS = ("urllib3.connectionpool", "wandb", "mlflow.tracking.request_header.registry")


class _TrackerThreadWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING or not (record.threadName or "").endswith(THREAD_SUFFIX)


_QUIET = _TrackerThreadWarnings()


def tracking_from_environment(environ: Mapping[str, str]) -> Tracking | None:
    """The trackers the job's environment configures; None when there are none."""
    text = environ.get(TRACKING_VARIABLE, "").strip()
    if not text:
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as error:
        raise UserError(
            f"{TRACKING_VARIABLE}: not JSON ({error.msg}); allowed: the site's tracking settings as a JSON object"
        ) from None
    if not isinstance(raw, dict):
        raise UserError(f"{TRACKING_VARIABLE}: a {type(raw).__name__}; allowed: a JSON object")
    tracking = build(Tracking, raw, TRACKING_VARIABLE)
    return tracking if tracking.configured else None


def flat_parameters(settings: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested settings as MLflow parameters: dotted keys (`optimizer.lr`), strings as they are, other values as
    JSON (lists stay one parameter), cut to MLflow's longest value."""
    flat: dict[str, str] = {}
    for key, value in settings.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat |= flat_parameters(value, f"{name}.")
        else:
            text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
            flat[name] = text[:MLFLOW_PARAM_LENGTH]
    return flat


class TrackerError(Exception):
    """A failure our own message already explains."""


def describe(error: Exception) -> str:
    return str(error) if isinstance(error, TrackerError) else f"{type(error).__name__}: {error}"


@dataclass(frozen=True)
class RunFacts:
    """What every tracker records of a run besides its metrics."""

    run_id: str | None  # TRAINING_RUN_ID; None outside the pipeline (each start is then a new tracker run)
    settings: Mapping[str, Any]  # the resolved recipe, as its YAML spells it
    run_dir: Path  # where a tracker keeps local files (W&B's)

    @property
    def parameters(self) -> dict[str, Any]:
        return {**self.settings, **({"run_id": self.run_id} if self.run_id else {})}


@dataclass(frozen=True)
class _Record:
    step: int
    walltime: float | None
    scalars: Mapping[str, float]


@dataclass(frozen=True)
class _End:
    artifacts: tuple[Path, ...]
    completed: bool


class TrackerSender:
    """One tracker behind a thread and a bounded queue; subclasses say how to start, send and finish."""

    label = "tracker"

    def __init__(self, facts: RunFacts) -> None:
        self.facts = facts
        self.sent = 0  # records the tracker took
        self.dropped = 0
        self.failed = False
        self._queue: queue.Queue[_Record | _End] = queue.Queue(maxsize=TRACKER_QUEUE)
        for name in QUIETED_LOGGERS:
            logging.getLogger(name).addFilter(_QUIET)  # once: a filter object is added only once
        self._thread = threading.Thread(target=self._work, name=f"{self.label}{THREAD_SUFFIX}", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def write(self, step: int, walltime: float | None, scalars: Mapping[str, float]) -> None:
        if self.failed:
            return
        try:
            # JSON, which both trackers' APIs speak, has no NaN or infinity
            finite = {tag: value for tag, value in scalars.items() if math.isfinite(value)}
            self._queue.put_nowait(_Record(step, walltime, finite))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning(
                    f"{self.label}: {TRACKER_QUEUE} records are waiting to be sent; dropped the one of step {step} "
                    "(later ones are counted); training continues"
                )

    def finish(self, artifacts: Sequence[Path], *, completed: bool) -> None:
        """Ask the thread to send the artifacts and end the run after what is queued (returns at once)."""
        if self.failed:
            return
        with contextlib.suppress(queue.Full):  # the thread is stuck on a request: `wait` reports it
            self._queue.put(_End(tuple(artifacts), completed), timeout=1.0)

    def wait(self, deadline: float) -> None:
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.warning(f"{self.label}: gave up waiting for it to finish ({self._queue.qsize()} records unsent)")
        if self.dropped > 1:
            log.info(f"{self.label}: {self.dropped} records were dropped in this run")

    def _work(self) -> None:
        """Start, send, finish; the first failure ends the thread (`write` then queues nothing more)."""
        if not self._attempt("could not start the run", self._start):
            return
        while True:
            item = self._queue.get()
            if isinstance(item, _End):
                self._attempt("could not finish the run", self._finish, item.artifacts, item.completed)
                return
            if not self._attempt(f"could not send step {item.step}", self._send, item):
                return
            self.sent += 1

    def _attempt(self, what: str, action: Callable[..., None], *arguments: Any) -> bool:
        try:
            action(*arguments)
            return True
        except Exception as error:  # anything at all: a tracker never stops training
            self.failed = True
            reason = " ".join(describe(error).split())[:500]
            log.warning(f"{self.label}: {what} ({reason}); training continues without {self.label}")
            return False

    def _start(self) -> None:
        raise NotImplementedError

    def _send(self, record: _Record) -> None:
        raise NotImplementedError

    def _finish(self, artifacts: tuple[Path, ...], completed: bool) -> None:
        raise NotImplementedError

    def _recipe_text(self) -> str:
        return yaml.safe_dump(dict(self.facts.settings), sort_keys=False)


class MlflowSender(TrackerSender):
    label = "MLflow"

    def __init__(self, settings: MlflowTracking, facts: RunFacts) -> None:
        self.settings = settings
        self._client: Any = None
        self.mlflow_run_id: str | None = None
        super().__init__(facts)

    def _start(self) -> None:
        for name, value in MLFLOW_HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
        if sagemaker_mlflow_arn(self.settings.tracking_uri):
            os.environ.setdefault(SAGEMAKER_PRESIGNED_UPLOAD, "true")
        if self.settings.tracking_uri.startswith("file:"):
            # MLflow 3 keeps its file store for those who ask; a site naming a file:// URI asks.
            os.environ.setdefault(MLFLOW_FILE_STORE, "true")
        import mlflow
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        # Also the process's tracking URI: the sagemaker-mlflow plugin's request headers (the server's ARN, which
        # routes each request) come from it, not from the client's.
        mlflow.set_tracking_uri(self.settings.tracking_uri)
        client = MlflowClient(tracking_uri=self.settings.tracking_uri)
        experiment = client.get_experiment_by_name(self.settings.experiment)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(self.settings.experiment)
        run_id = self.facts.run_id
        found: list[Any] = []
        if run_id:
            quoted = run_id.replace("'", "\\'")
            found = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{quoted}'", max_results=1)
        if found:
            run = found[0]
            client.update_run(run.info.run_id, status="RUNNING")
            logged = dict(run.data.params)
        else:
            tags = {RUN_TAG: run_id} if run_id else {}
            run = client.create_run(experiment_id, run_name=run_id, tags=tags)
            logged = {}
        self._client, self.mlflow_run_id = client, run.info.run_id
        # Parameters cannot change once logged: a requeued run logs only those it did not have.
        new = [Param(key, value) for key, value in flat_parameters(self.facts.parameters).items() if key not in logged]
        for start in range(0, len(new), MLFLOW_PARAM_BATCH):
            client.log_batch(self.mlflow_run_id, params=new[start : start + MLFLOW_PARAM_BATCH])
        log.info(
            f"MLflow: run {self.mlflow_run_id} of experiment {self.settings.experiment} at "
            f"{self.settings.tracking_uri}" + (" (continued)" if found else "")
        )

    def _send(self, record: _Record) -> None:
        from mlflow.entities import Metric

        timestamp = int((record.walltime if record.walltime is not None else time.time()) * 1000)
        metrics = [Metric(tag, value, timestamp, record.step) for tag, value in record.scalars.items()]
        if metrics:
            self._client.log_batch(self.mlflow_run_id, metrics=metrics)

    def _finish(self, artifacts: tuple[Path, ...], completed: bool) -> None:
        try:
            self._client.log_text(self.mlflow_run_id, self._recipe_text(), RECIPE_ARTIFACT)
            for path in artifacts:
                if path.is_file():
                    self._client.log_artifact(self.mlflow_run_id, str(path))
        finally:
            self._client.set_terminated(self.mlflow_run_id, "FINISHED" if completed else "FAILED")


class WandbSender(TrackerSender):
    label = "W&B"

    def __init__(self, settings: WandbTracking, facts: RunFacts, environ: Mapping[str, str] = os.environ) -> None:
        self.settings = settings
        self._environ = environ
        self._run: Any = None
        super().__init__(facts)

    def _start(self) -> None:
        api_key = None
        if self.settings.api_key_secret_arn:
            try:
                api_key = read_secret(self.settings.api_key_secret_arn, "W&B API key")
            except UserError as error:  # one line naming the secret already
                raise TrackerError(str(error)) from error
            except Exception as error:
                raise TrackerError(f"the API key in {self.settings.api_key_secret_arn}: {describe(error)}") from error
        import wandb

        # The key goes in the run's settings: no netrc written, nothing in the environment or a log.
        settings = wandb.Settings(
            api_key=api_key,
            mode=self.settings.mode,
            **({"base_url": self.settings.base_url} if self.settings.base_url else {}),
            console="off",  # the job's output is already in its Slurm log
            silent=True,
            save_code=False,
            init_timeout=WANDB_INIT_SECONDS,
        )
        directory = None if self._environ.get("WANDB_DIR") else str(self.facts.run_dir)
        if directory:
            self.facts.run_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=self.settings.project,
            entity=self.settings.entity,
            id=self.facts.run_id,
            name=self.facts.run_id,
            resume="allow" if self.facts.run_id else None,
            dir=directory,
            config=self.facts.parameters,
            allow_val_change=True,  # a requeued run may come with a changed recipe
            settings=settings,
            reinit="create_new",
        )
        log.info(f"W&B: run {self._run.id} of project {self.settings.project} ({self.settings.mode})")

    def _send(self, record: _Record) -> None:
        self._run.log(dict(record.scalars), step=record.step)

    def _finish(self, artifacts: tuple[Path, ...], completed: bool) -> None:
        import wandb

        try:
            artifact = wandb.Artifact(f"{self._run.id}-files", type="run-files")
            with artifact.new_file(RECIPE_ARTIFACT, mode="w", encoding="utf-8") as file:
                file.write(self._recipe_text())
            for path in artifacts:
                if path.is_file():
                    artifact.add_file(str(path))
            self._run.log_artifact(artifact)
        finally:
            self._run.finish(exit_code=0 if completed else 1)


def open_trackers(
    tracking: Tracking | None, facts: RunFacts, environ: Mapping[str, str] = os.environ
) -> list[TrackerSender]:
    """A started sender for each configured tracker (none without settings: nothing is imported)."""
    if tracking is None:
        return []
    senders: list[TrackerSender] = []
    if tracking.mlflow is not None:
        senders.append(MlflowSender(tracking.mlflow, facts))
    if tracking.wandb is not None:
        senders.append(WandbSender(tracking.wandb, facts, environ))
    return senders


def close_trackers(
    senders: Sequence[TrackerSender],
    artifacts: Sequence[Path],
    *,
    completed: bool,
    timeout: float = TRACKER_CLOSE_SECONDS,
) -> None:
    """End every tracker's run together, waiting at most `timeout` seconds for all of them."""
    deadline = time.monotonic() + timeout
    for sender in senders:
        sender.finish(artifacts, completed=completed)
    for sender in senders:
        sender.wait(deadline)
