"""Where rank 0 of a training job puts its metrics: one `MetricsSink`, three destinations.

Each logged step is one record (`step`, `loss`, `lr`, `grad_norm`, `seq_per_second`, `tokens_per_second`,
`time`, `tokens_per_second_per_node`, and when there are such values `validation_loss`, `moe_dropped` and `mfu`
as fractions, `xla_*` counters and `late_compilations` (with `late_compilation_step`) on Neuron,
`throughput_fraction` and `below_throughput_floor` once the throughput floor applies: training.train.watchdog).
The sink writes it to:

- the JSON lines file `<checkpoint.dir>/metrics.jsonl` (`metrics-compile.jsonl` for a compile run, or the
  `--metrics` path): every record as logged, appended, so a resumed run logs the steps after its checkpoint
  again; `read_metrics` keeps the last record of each step. `status`, the exported plot and the tests read it.
- TensorBoard event files in `<run_dir>/tensorboard`, where run_dir is the parent of `checkpoint.dir`: the
  pipeline puts checkpoints in `<runs_root>/<run_id>/checkpoints` (the recipe names no run directory of its
  own), so the event files sit beside them in the run directory and `export` copies them with the results.
  Tags are grouped by what they measure (TAGS); the values are the JSON lines' values (fractions stay
  fractions). Every writer starts with SummaryWriter's `purge_step` at the first step it will log, so
  TensorBoard drops the steps an interrupted attempt logged after its last checkpoint: each step once.
- CloudWatch, when the job's environment names a namespace (`TRAINING_METRICS_NAMESPACE`, exported by the
  Slurm job scripts on AWS): the metrics of training.monitoring.cloudwatch, each record once without
  dimensions and once with `Run=<TRAINING_RUN_ID>`, time-stamped with the record's time. A background
  thread sends them, so a slow or unreachable CloudWatch never stalls a step; a failure is logged as one
  warning (later ones are counted, and the count logged when the run ends) and never stops training.
  boto3 is imported only when the namespace is set.
- MLflow and Weights & Biases, when the job's environment configures them (`TRAINING_TRACKING`, the site's
  `tracking` settings, exported by the train stage's job script): the TensorBoard scalars with their step, the
  recipe as parameters, and the recipe and the JSON lines as artifacts at the end (training.train.trackers).
  Each has its own thread and queue like CloudWatch's; a failing tracker is one warning and stops, training
  goes on. Neither library is imported without its settings.

A compile run (`--compile`) writes its JSON lines only: no event files, nothing sent to CloudWatch.
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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from training.errors import UserError
from training.monitoring import cloudwatch
from training.monitoring.cloudwatch import Datum
from training.train import trackers as tracker_senders

log = logging.getLogger(__name__)

NAMESPACE_VARIABLE = "TRAINING_METRICS_NAMESPACE"
RUN_ID_VARIABLE = "TRAINING_RUN_ID"
METRICS_FILE = "metrics.jsonl"
COMPILE_METRICS_FILE = "metrics-compile.jsonl"
TENSORBOARD_DIR = "tensorboard"

# JSON lines key -> TensorBoard tag
TAGS = {
    "loss": "train/loss",
    "validation_loss": "train/validation_loss",
    "lr": "train/learning_rate",
    "grad_norm": "train/grad_norm",
    "tokens_per_second": "throughput/tokens_per_second",
    "seq_per_second": "throughput/seq_per_second",
    "mfu": "throughput/mfu",  # a fraction of the workers' peak, as in the JSON lines
    "tokens_per_second_per_node": "throughput/tokens_per_second_per_node",
    "throughput_fraction": "throughput/fraction_of_expected",  # the floor's window median over the expected figure
    "late_compilations": "xla/late_compilations",
    "moe_dropped": "moe/dropped_fraction",
}
XLA_PREFIX = "xla_"  # xla_compilations -> xla/compilations

# JSON lines key -> (CloudWatch metric, unit, factor from the JSON value to the sent one)
CLOUDWATCH_METRICS = {
    "step": (cloudwatch.TRAINING_STEP, "None", 1.0),
    "loss": (cloudwatch.TRAINING_LOSS, "None", 1.0),
    "validation_loss": (cloudwatch.VALIDATION_LOSS, "None", 1.0),
    "lr": (cloudwatch.LEARNING_RATE, "None", 1.0),
    "grad_norm": (cloudwatch.GRADIENT_NORM, "None", 1.0),
    "tokens_per_second": (cloudwatch.TOKENS_PER_SECOND, "Count/Second", 1.0),
    "seq_per_second": (cloudwatch.SEQUENCES_PER_SECOND, "Count/Second", 1.0),
    "mfu": (cloudwatch.MFU, "Percent", 100.0),
    "moe_dropped": (cloudwatch.MOE_DROPPED_TOKENS, "Percent", 100.0),
    "late_compilations": (cloudwatch.LATE_COMPILATIONS, "Count", 1.0),
    "throughput_fraction": (cloudwatch.THROUGHPUT_FRACTION, "Percent", 100.0),
    "below_throughput_floor": (cloudwatch.BELOW_THROUGHPUT_FLOOR, "None", 1.0),
}
CLOUDWATCH_QUEUE = 1000  # records waiting to be sent; beyond that (CloudWatch unreachable for long) they are dropped
CLOUDWATCH_CLOSE_SECONDS = 30.0  # how long the end of a run waits for the records still queued


def tensorboard_dir(checkpoint_dir: Path) -> Path:
    """`<run_dir>/tensorboard`, run_dir being the checkpoint directory's parent (see the module's docstring)."""
    return checkpoint_dir.absolute().parent / TENSORBOARD_DIR


def tensorboard_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """Tag -> value of one record (the keys it has)."""
    scalars = {tag: float(record[key]) for key, tag in TAGS.items() if record.get(key) is not None}
    for key, value in record.items():
        if key.startswith(XLA_PREFIX) and isinstance(value, int | float):
            scalars[f"xla/{key.removeprefix(XLA_PREFIX)}"] = float(value)
    return scalars


def cloudwatch_data(record: Mapping[str, Any]) -> list[Datum]:
    """The record's values as CloudWatch data, without dimensions (percent where the unit says so)."""
    data = []
    for key, (name, unit, factor) in CLOUDWATCH_METRICS.items():
        value = record.get(key)
        if value is not None and math.isfinite(float(value)):  # CloudWatch refuses NaN and infinities
            data.append(Datum(name, float(value) * factor, unit))
    return data


class CloudWatchSender:
    """Sends records' metrics from a background thread; failures are logged once and never raised."""

    def __init__(self, namespace: str, run_id: str | None, client: cloudwatch.MetricsClient | None = None) -> None:
        self.namespace = namespace
        self.run_id = run_id or None
        self.sent = 0  # records sent (one or more PutMetricData requests each)
        self.failures = 0
        self._client = client
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[float | None, list[Datum]] | None] = queue.Queue(maxsize=CLOUDWATCH_QUEUE)
        self._thread = threading.Thread(target=self._send_queued, name="cloudwatch-metrics", daemon=True)
        self._thread.start()

    def write(self, record: Mapping[str, Any]) -> None:
        data = cloudwatch_data(record)
        if self.run_id is not None:
            data = cloudwatch.with_dimension(data, cloudwatch.RUN_DIMENSION, self.run_id)
        timestamp = record.get("time")
        try:
            self._queue.put_nowait((float(timestamp) if timestamp is not None else None, data))
        except queue.Full:
            self._failed(f"{CLOUDWATCH_QUEUE} records are waiting to be sent; dropped the one of step {record['step']}")

    def close(self, timeout: float = CLOUDWATCH_CLOSE_SECONDS) -> None:
        """Send what is queued (waiting at most `timeout` seconds), then stop the thread."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning(f"CloudWatch: gave up waiting for {self._queue.qsize()} records still to send")
        if self.failures > 1:
            log.info(f"CloudWatch: {self.failures} sends to namespace {self.namespace} failed in this run")

    def _send_queued(self) -> None:
        while (item := self._queue.get()) is not None:
            timestamp, data = item
            try:
                if self._client is None:
                    # Short timeouts and few attempts: a record that cannot be sent soon is not worth a queue of them.
                    self._client = cloudwatch.cloudwatch_client(None, max_attempts=3, timeout_seconds=10)
                cloudwatch.put_metrics(self._client, self.namespace, data, timestamp)
                self.sent += 1
            except Exception as error:  # anything at all: metrics never stop training
                self._failed(f"{type(error).__name__}: {error}")

    def _failed(self, reason: str) -> None:
        with self._lock:
            self.failures += 1
            first = self.failures == 1
        if first:
            log.warning(
                f"CloudWatch: metrics not sent to namespace {self.namespace} ({reason}); training continues, "
                "further failures are counted, not logged"
            )


class MetricsSink:
    """Rank 0's metric destinations for one run; `write` each logged step's record, `close` at the end."""

    def __init__(
        self,
        jsonl: Path,
        tensorboard: Any | None = None,
        cloudwatch: CloudWatchSender | None = None,
        trackers: Sequence[tracker_senders.TrackerSender] = (),
    ) -> None:
        jsonl.parent.mkdir(parents=True, exist_ok=True)
        self.jsonl = jsonl
        self._file = jsonl.open("a")
        self.tensorboard = tensorboard  # a torch.utils.tensorboard.SummaryWriter
        self.cloudwatch = cloudwatch
        self.trackers = tuple(trackers)

    def write(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        step, walltime = int(record["step"]), record.get("time")
        if self.tensorboard is not None or self.trackers:
            scalars = tensorboard_scalars(record)
            for tracker in self.trackers:
                tracker.write(step, walltime, scalars)
            if self.tensorboard is not None:
                for tag, value in scalars.items():
                    self.tensorboard.add_scalar(tag, value, global_step=step, walltime=walltime)
                self.tensorboard.flush()
        if self.cloudwatch is not None:
            self.cloudwatch.write(record)

    def close(self, *, completed: bool = True) -> None:
        """`completed`: the run ended normally (trackers mark their run finished, else failed)."""
        self._file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        # The trackers end their runs while CloudWatch sends what it has queued: the waits overlap.
        deadline = time.monotonic() + tracker_senders.TRACKER_CLOSE_SECONDS
        for tracker in self.trackers:
            tracker.finish([self.jsonl], completed=completed)
        if self.cloudwatch is not None:
            self.cloudwatch.close()
        for tracker in self.trackers:
            tracker.wait(deadline)

    def __enter__(self) -> MetricsSink:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        self.close(completed=kind is None)


def open_metrics(
    checkpoint_dir: Path,
    *,
    first_step: int,
    compile_only: bool = False,
    path: Path | None = None,
    environ: Mapping[str, str] = os.environ,
    recipe_settings: Mapping[str, Any] | None = None,
) -> MetricsSink:
    """The sink of a run whose first logged step will be `first_step` (1, or the resumed checkpoint's step + 1);
    `recipe_settings` (the resolved recipe) is what trackers record as the run's parameters."""
    jsonl = path or (checkpoint_dir / (COMPILE_METRICS_FILE if compile_only else METRICS_FILE))
    if compile_only:
        return MetricsSink(jsonl)
    from torch.utils.tensorboard import SummaryWriter

    _wait_for_a_later_second(tensorboard_dir(checkpoint_dir))
    # purge_step: TensorBoard discards what earlier writers logged from this step on (a killed attempt's
    # steps after its last checkpoint), so the resumed run's values replace them.
    writer = SummaryWriter(log_dir=str(tensorboard_dir(checkpoint_dir)), purge_step=first_step)
    namespace = environ.get(NAMESPACE_VARIABLE, "").strip()
    sender = CloudWatchSender(namespace, environ.get(RUN_ID_VARIABLE, "").strip()) if namespace else None
    if sender is not None:
        run = f" and dimension {cloudwatch.RUN_DIMENSION}={sender.run_id}" if sender.run_id else ""
        log.info(f"sending training metrics to CloudWatch namespace {namespace} without dimensions{run}")
    facts = tracker_senders.RunFacts(
        run_id=environ.get(RUN_ID_VARIABLE, "").strip() or None,
        settings=recipe_settings or {},
        run_dir=checkpoint_dir.absolute().parent,
    )
    trackers = tracker_senders.open_trackers(tracker_senders.tracking_from_environment(environ), facts, environ)
    return MetricsSink(jsonl, writer, sender, trackers)


EVENT_FILE_PREFIX = "events.out.tfevents."


def _wait_for_a_later_second(directory: Path) -> None:
    """TensorBoard reads a directory's event files in name order, and a name starts with the second its file was
    created (`events.out.tfevents.<seconds>.<host>.<pid>.<n>`): a file opened in the same second as an earlier
    attempt's would be read before it when its pid sorts first, and the earlier file's steps would undo the purge.
    So a writer waits for the next second in that case (only a restart within a second: never on a cluster)."""
    seconds = [
        int(part)
        for path in (directory.glob(f"{EVENT_FILE_PREFIX}*") if directory.is_dir() else [])
        if (part := path.name.removeprefix(EVENT_FILE_PREFIX).split(".")[0]).isdigit()
    ]
    remaining = max(seconds) + 1 - time.time() if seconds else 0.0
    if remaining > 0:
        time.sleep(remaining)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file, the last one logged of each step (a resumed run logs some steps again),
    in step order. A last line without its newline that does not parse is one being written, and skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: no such file (the JSON lines a training job writes)") from None
    except UnicodeDecodeError as error:
        raise UserError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start}); allowed: JSON lines") from None
    lines = text.split("\n")
    by_step: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines):  # no newline after it: still being written
                continue
            raise UserError(f"{path} line {number}: not JSON ({error.msg}); allowed: one JSON object a line") from None
        if not isinstance(record, dict):
            raise UserError(f"{path} line {number}: a {type(record).__name__}; allowed: one JSON object a line")
        for key in ("step", "loss"):
            value = record.get(key)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise UserError(f"{path} line {number}: {key} {value!r}; allowed: a number")
        by_step[int(record["step"])] = record
    if not by_step:
        raise UserError(f"{path}: no metrics in it (no step logged yet); allowed: JSON lines with step and loss")
    return [by_step[step] for step in sorted(by_step)]
