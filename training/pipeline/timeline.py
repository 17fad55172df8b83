"""Time to first step, measured: when each stage's job started and ended, and what the nodes did before.

Every job script (assets/slurm/base.sbatch.j2) appends two JSON lines to `<run_dir>/timeline.jsonl`: `start`
(with the first node's boot time, from /proc/uptime, and the end of its ParallelCluster bootstrap, the time
assets/node/on_node_configured.sh writes to BOOTSTRAP_END_FILE as its last act on a compute node) and `end`
(written with the `done` marker: a failed job has none). The first training step is the first metrics record
the train stage logged after its job started.

From them `status` prints a "time to first step" block and the head node's monitor publishes `StageSeconds`
(dimension Stage) for the newest run: each phase is the latest attempt of a stage (a requeued or resubmitted
stage counts from its last start), the stages are the run's own (whatever stages it has: preflight or not),
and a stage that never ran is left out.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from training.monitoring.cloudwatch import STAGE_SECONDS, Datum

TIMELINE_FILE = "timeline.jsonl"
# Written by on_node_configured.sh on a compute node as its last act: the epoch second its bootstrap ended.
BOOTSTRAP_END_FILE = "/var/lib/trainium-bootstrap/configured"
TRAIN = "train"
BOOTSTRAP = "bootstrap"  # node boot -> bootstrap end
FIRST_STEP = "first-step"  # train job start -> first logged step
PUBLISH_GRACE_SECONDS = 900  # the monitor still sends a finished run's durations this long after its last event


@dataclass(frozen=True)
class Attempt:
    """The latest job of one stage: its start, its end (None while running or after a failure), its node's facts."""

    stage: str
    job: str
    start: float
    end: float | None
    node_boot: float | None
    bootstrap_end: float | None

    @property
    def seconds(self) -> float | None:
        return None if self.end is None else self.end - self.start


def most_phases(stages: Sequence[str]) -> int:
    """The most StageSeconds values a run of these stages sends: each stage up to train, the bootstrap and the
    first step (what the cost table counts)."""
    return (stages.index(TRAIN) + 1 if TRAIN in stages else len(stages)) + 2


def read_timeline(run_dir: Path) -> list[dict[str, Any]]:
    """The run's events in file order; lines that are not events (a line cut by a full disk) are skipped."""
    path = run_dir / TIMELINE_FILE
    if not path.is_file():
        return []
    events = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and isinstance(event.get("stage"), str) and _number(event.get("time")) is not None:
            events.append(event)
    return events


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def latest_attempts(events: Iterable[Mapping[str, Any]]) -> dict[str, Attempt]:
    """Stage -> its latest start and that job's end."""
    attempts: dict[str, Attempt] = {}
    for event in events:
        stage, job, time = str(event["stage"]), str(event.get("job", "")), float(event["time"])
        if event.get("event") == "start":
            attempts[stage] = Attempt(
                stage, job, time, None, _number(event.get("node_boot")), _number(event.get("bootstrap_end"))
            )
        elif event.get("event") == "end" and stage in attempts and attempts[stage].job == job:
            previous = attempts[stage]
            attempts[stage] = Attempt(stage, job, previous.start, time, previous.node_boot, previous.bootstrap_end)
    return attempts


def first_step_time(records: Sequence[Mapping[str, Any]], train_start: float) -> float | None:
    """When the train job's first logged step ended: the earliest record time after its job started."""
    times = [float(r["time"]) for r in records if isinstance(r.get("time"), int | float) and r["time"] >= train_start]
    return min(times) if times else None


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float | None  # None: started, not ended
    note: str = ""


def phases(stages: Sequence[str], attempts: Mapping[str, Attempt], first_step: float | None) -> list[Phase]:
    """The way to the first step: the nodes' bootstrap (of the first stage whose node recorded one), then each
    of the run's stages up to train in the run's order, then train's start to its first step."""
    chain = list(stages[: stages.index(TRAIN) + 1]) if TRAIN in stages else list(stages)
    ran = [attempts[stage] for stage in chain if stage in attempts]
    result: list[Phase] = []
    booted = next((a for a in ran if a.bootstrap_end is not None and a.node_boot is not None), None)
    if booted is not None:
        assert booted.bootstrap_end is not None and booted.node_boot is not None
        result.append(
            Phase(
                BOOTSTRAP,
                booted.bootstrap_end - booted.node_boot,
                f"{booted.stage}'s first node: boot -> bootstrap end",
            )
        )
    for attempt in ran:
        result.append(Phase(attempt.stage, attempt.seconds, "" if attempt.end is not None else "running or failed"))
    train = attempts.get(TRAIN)
    if train is not None and first_step is not None:
        result.append(Phase(FIRST_STEP, first_step - train.start, "train job start -> first logged step"))
    return result


def describe(stages: Sequence[str], attempts: Mapping[str, Attempt], first_step: float | None) -> list[str]:
    """`status`'s block: one line per phase and the total from the first node's boot (or the first stage's
    start) to the first step."""
    rows = phases(stages, attempts, first_step)
    if not rows:
        return []
    lines = ["time to first step:"]
    ran = [attempts[s] for s in stages if s in attempts]
    booted = next((a for a in ran if a.node_boot is not None and a.bootstrap_end is not None), None)
    origin = booted.node_boot if booted is not None else min(a.start for a in ran)
    if booted is None:
        lines.append(f"  {BOOTSTRAP:<14} not recorded (no {BOOTSTRAP_END_FILE} on the nodes: not ParallelCluster's)")
    for phase in rows:
        took = format_duration(phase.seconds) if phase.seconds is not None else "-"
        lines.append(f"  {phase.name:<14} {took:>8}" + (f"  {phase.note}" if phase.note else ""))
    if first_step is not None and origin is not None:
        since = "the first node's boot" if booted is not None else "the first stage's start"
        stamp = datetime.fromtimestamp(origin, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        lines.append(f"  {'total':<14} {format_duration(first_step - origin):>8}  since {since} ({stamp})")
    return lines


def stage_seconds(
    stages: Sequence[str],
    attempts: Mapping[str, Attempt],
    first_step: float | None,
    *,
    active: bool,
    now: float,
) -> list[Datum]:
    """StageSeconds per measured phase (dimension Stage), while the run is active or within the grace after its
    last event; nothing otherwise (a finished run's durations stop being billed)."""
    last = max((a.end or a.start for a in attempts.values()), default=None)
    if not active and (last is None or now - last > PUBLISH_GRACE_SECONDS):
        return []
    return [
        Datum(STAGE_SECONDS, phase.seconds, "Seconds", {"Stage": phase.name})
        for phase in phases(stages, attempts, first_step)
        if phase.seconds is not None
    ]


def format_duration(seconds: float) -> str:
    """'45s', '5m10s', '2h05m', '3d04h'."""
    whole = round(seconds)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
