"""The head node's view of the cluster, every minute: Slurm's queue and nodes, and how the newest run is doing.

`python -m training monitor cluster` (a systemd timer on the head node, assets/node/on_node_configured.sh) runs
one pass: `squeue` and `sinfo` through the site's `slurm_bin`, the newest run's stage states, then one
PutMetricData per 500 values into the site's namespace. The parsers are pure functions of the commands' text.

Metrics (training/monitoring/cloudwatch.py), every one sent every pass, zeros included, so an alarm always has
data:
- SlurmJobs, dimension State: the queue's jobs per Slurm state (RUNNING and PENDING always, others when seen,
  e.g. CONFIGURING while ParallelCluster boots a job's nodes).
- TrainingJobsRunning: RUNNING jobs of the `train` stage of any run under the site's runs_root (found by their
  batch script, `<runs_root>/<run>/jobs/train.sbatch`, so other users' jobs named `...-train` do not count).
- FailedStages: stages of the newest run that failed (FAILED_STATES), or that can never run because an `afterok`
  dependency failed (Reason DependencyNeverSatisfied: the failed job itself may be forgotten by Slurm already).
- SlurmNodes, dimensions Partition and State: nodes per partition in one of NODE_STATES (see `node_state`).
- StageSeconds, dimension Stage: the newest run's time to first step phase by phase (training.pipeline.timeline),
  only while the run is active and a while after (no zeros: a phase not measured is not a duration).
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from training.config.site import Site
from training.errors import UserError
from training.monitoring.cloudwatch import (
    FAILED_STAGES,
    SLURM_JOBS,
    SLURM_NODES,
    TRAINING_JOBS_RUNNING,
    Datum,
    MetricsClient,
    cloudwatch_client,
    print_requests,
    put_metrics,
)
from training.pipeline import timeline
from training.pipeline.run_record import find_run_dir, read_run
from training.pipeline.slurm_client import ACTIVE_STATES, slurm_output
from training.pipeline.status import stage_states, train_records

log = logging.getLogger(__name__)

# `%P` may list a job's several partitions; `%o` (the batch script's path) goes last as the only free text.
SQUEUE_FORMAT = "%i|%T|%P|%o"
SQUEUE_COMMAND = ("squeue", "--noheader", "--all", f"--format={SQUEUE_FORMAT}")
# One line per partition and node state with its node count (a partition may have several lines per state).
SINFO_FORMAT = "%R|%T|%D"
SINFO_COMMAND = ("sinfo", "--noheader", "--all", f"--format={SINFO_FORMAT}")

ALWAYS_SENT_JOB_STATES = ("RUNNING", "PENDING")
TRAIN_SCRIPT = ("jobs", "train.sbatch")  # <runs_root>/<run>/jobs/train.sbatch
# A stage's job ended without success (CANCELLED is left out: a cancel is a decision, not a failure).
FAILED_STATES = frozenset(
    {"FAILED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL", "DEADLINE", "PREEMPTED", "SPECIAL_EXIT"}
)
NEVER_RUNS = "DependencyNeverSatisfied"
# slurmstepd's line in a job's output when a user cancels it: `*** JOB 12 ON node-1 CANCELLED AT <time> ***`
# (a cancel by Slurm itself adds `DUE TO TIME LIMIT`, `DUE TO NODE FAILURE`, ...).
USER_CANCEL = re.compile(r"\*\*\* JOB \d+ ON \S+ CANCELLED AT \S+ \*\*\*")
LOG_TAIL_BYTES = 4096

# The states nodes are counted in. Slurm's are many, with flags as suffixes (`sinfo` man page, NODE STATE
# CODES); ParallelCluster's cloud nodes use `~` (powered down), `#` (powering up), `%` (powering down) and
# `*` (not responding) besides the usual ones. Mapped, in this order of precedence:
#   down          down, drained or draining (drained by the health prolog or by ParallelCluster for
#                 replacement), fail/failing, not responding (`*`), inval, unknown; and any unrecognised state
#   powered_down  `~` powered off (ParallelCluster's idle~), `%`/`!` powering down, future
#   powering_up   `#` powering up (alloc#, idle#: the instance is booting), `^` rebooting, configuring
#   allocated     allocated, mixed, completing
#   idle          idle, reserved, planned (held for a pending job), maint
NODE_STATES = ("allocated", "idle", "powering_up", "powered_down", "down")
_FLAGS = "*~#!%$@^-"
_DOWN = {"down", "drain", "drained", "draining", "drng", "fail", "failing", "failg", "inval", "unk", "unknown"}
_POWERED_DOWN = {"powered_down", "powering_down", "pow_dn", "power_down", "future", "futr"}
_POWERING_UP = {"powering_up", "pow_up", "power_up", "configuring", "boot", "reboot", "rebooting"}
_ALLOCATED = {"alloc", "allocated", "mix", "mixed", "comp", "completing"}
_IDLE = {"idle", "resv", "reserved", "planned", "plnd", "maint", "npc", "perfctrs", "blocked"}


def node_state(raw: str) -> str:
    """One of NODE_STATES for a `sinfo` state, compact (`%t`: idle~, alloc#, down*, drng) or long (`%T`: idle~,
    allocated#, draining, mixed+drain): the words before the flag characters, joined by '+', and the flags."""
    text = raw.strip().lower()
    base = text.rstrip(_FLAGS)
    flags = set(text[len(base) :])
    words = set(base.split("+"))
    if "*" in flags or words & _DOWN:
        return "down"
    if flags & {"~", "%", "!"} or words & _POWERED_DOWN:
        return "powered_down"
    if flags & {"#", "^"} or words & _POWERING_UP:
        return "powering_up"
    if words & _ALLOCATED:
        return "allocated"
    if words & _IDLE:
        return "idle"
    log.warning("unrecognised Slurm node state %r counted as down", raw)
    return "down"


def job_data(squeue: str, runs_root: Path) -> list[Datum]:
    """SlurmJobs per state and TrainingJobsRunning from `squeue --noheader --format=%i|%T|%P|%o`."""
    states: Counter[str] = Counter({state: 0 for state in ALWAYS_SENT_JOB_STATES})
    training = 0
    root = Path(runs_root).absolute()
    for line in squeue.splitlines():
        fields = line.strip().split("|", 3)
        if len(fields) != 4 or not fields[1]:
            continue
        _, state, _, command = fields
        states[state] += 1
        script = Path(command)
        if state == "RUNNING" and script.parts[-2:] == TRAIN_SCRIPT and script.parent.parent.parent == root:
            training += 1
    data = [Datum(SLURM_JOBS, count, "Count", {"State": state}) for state, count in sorted(states.items())]
    data.append(Datum(TRAINING_JOBS_RUNNING, training, "Count"))
    return data


def node_data(sinfo: str, partitions: Iterable[str] = ()) -> list[Datum]:
    """SlurmNodes per partition and state from `sinfo --noheader --format=%R|%T|%D`; every state of every
    partition seen (or named in `partitions`) is sent, zeros included, so a graph falls to 0 instead of a gap."""
    counts: dict[str, Counter[str]] = {name: Counter() for name in partitions}
    for line in sinfo.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 3 or not fields[0] or not fields[2].strip().isdigit():
            continue
        partition, state, nodes = fields
        partition_counts = counts.setdefault(partition.rstrip("*"), Counter())
        if int(nodes):  # a partition without nodes shows one line `n/a|0`
            partition_counts[node_state(state)] += int(nodes)
    return [
        Datum(SLURM_NODES, counts[partition][state], "Count", {"Partition": partition, "State": state})
        for partition in sorted(counts)
        for state in NODE_STATES
    ]


def failed(row: Mapping[str, Any], run_dir: Path | None = None) -> bool:
    """Whether one stage row of `training.pipeline.status.stage_states` (of the run in `run_dir`) is a failed stage.

    ParallelCluster's Slurm forgets a finished job after MinJobAge (300 s by default; the local Slurm keeps them
    a day), and the stage's state is then UNKNOWN: a stage whose job ran (its log exists) and never wrote its
    done marker failed too, unless Slurm's last word in the log is a user's cancel, so the alarm holds until the
    run is resubmitted instead of clearing five minutes after the failure.
    """
    state = str(row.get("state") or "")
    if state in FAILED_STATES or (state in ("PENDING", "CANCELLED") and row.get("reason") == NEVER_RUNS):
        return True
    if state != "UNKNOWN" or not row.get("job") or run_dir is None:
        return False
    stage, job = row["stage"], row["job"]
    log_file = run_dir / "logs" / f"{stage}-{job}.out"
    if not log_file.is_file() or (run_dir / "state" / f"{stage}.done").exists():
        return False
    with log_file.open("rb") as handle:
        handle.seek(max(0, log_file.stat().st_size - LOG_TAIL_BYTES))
        tail = handle.read().decode(errors="replace")
    return USER_CANCEL.search(tail) is None


def failed_stages(rows: Iterable[Mapping[str, Any]], run_dir: Path | None = None) -> Datum:
    return Datum(FAILED_STAGES, sum(1 for row in rows if failed(row, run_dir)), "Count")


def collect(site: Site) -> list[Datum]:
    """One pass over the site's Slurm and newest run (the thin shell around the parsers)."""

    squeue = slurm_output(site.slurm_bin, *SQUEUE_COMMAND)
    sinfo = slurm_output(site.slurm_bin, *SINFO_COMMAND)
    partitions = [p for name in (site.partition, site.cpu_partition) if name for p in name.split(",")]
    data = job_data(squeue, Path(site.runs_root))
    run_dir: Path | None = None
    rows: list[dict[str, Any]] = []
    try:
        run_dir = find_run_dir(site, None)
        rows = stage_states(run_dir)
    except UserError:
        pass  # no run yet
    data.append(failed_stages(rows, run_dir))
    data.extend(node_data(sinfo, partitions))
    if run_dir is not None:
        data.extend(stage_data(run_dir, rows, time.time()))
    return data


def stage_data(run_dir: Path, rows: Iterable[Mapping[str, Any]], now: float) -> list[Datum]:
    """StageSeconds of the run in `run_dir`, whose stage rows (`stage_states`) say whether it is active."""
    events = timeline.read_timeline(run_dir)
    if not events:
        return []
    attempts = timeline.latest_attempts(events)
    train = attempts.get(timeline.TRAIN)
    first = timeline.first_step_time(train_records(run_dir), train.start) if train is not None else None
    active = any(row.get("state") in ACTIVE_STATES for row in rows)
    return timeline.stage_seconds(read_run(run_dir)["stages"], attempts, first, active=active, now=now)


def monitor_cluster(site: Site, namespace: str, *, dry_run: bool, client: MetricsClient | None = None) -> list[Datum]:
    """Collect once and publish to `namespace` (or, with `dry_run`, print the PutMetricData requests as JSON
    lines)."""
    data = collect(site)
    if dry_run:
        print_requests(namespace, data)
    else:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            put_metrics(client or cloudwatch_client(site.region), namespace, data)
        except (BotoCoreError, ClientError) as error:
            raise UserError(f"CloudWatch PutMetricData to {namespace} failed: {error}") from None
        log.info("sent %d values to CloudWatch namespace %s", len(data), namespace)
    return data
