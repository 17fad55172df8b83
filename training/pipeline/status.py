"""`python -m training status`: each stage's job and Slurm state, the training job's last logged values and its
ETA, what the training job's watchdog found, the time to first step, and why queued nodes cannot start."""

from __future__ import annotations

import itertools
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from training.errors import UserError
from training.pipeline import timeline
from training.pipeline.run_record import latest_jobs, read_run, run_recipe, run_slurm_bin
from training.pipeline.slurm_client import ACTIVE_STATES, job_info, run_slurm
from training.pipeline.timeline import format_duration
from training.train.metrics import METRICS_FILE, read_metrics
from training.train.watchdog import floor_line, late_compile_line, read_stop


def stage_states(run_dir: Path) -> list[dict[str, Any]]:
    """Per stage: job id, Slurm state, elapsed time, and for the training stage the last logged metrics."""
    run = read_run(run_dir)
    jobs = latest_jobs(run)
    rows = []
    for stage in run["stages"]:
        job = jobs.get(stage, "")
        info = job_info(job, run_slurm_bin(run)) if job else {}
        done = (run_dir / "state" / f"{stage}.done").exists()
        state = info.get("JobState") or ("COMPLETED" if done else "UNKNOWN")
        row: dict[str, Any] = {"stage": stage, "job": job, "state": state, "elapsed": info.get("RunTime", "")}
        if info.get("Reason") and info["Reason"] != "None":
            row["reason"] = info["Reason"]
        if stage == "train" and (run_dir / "checkpoints" / METRICS_FILE).is_file():
            try:
                total_steps = run_recipe(run, run_dir).steps
                progress = training_progress(run_dir / "checkpoints" / METRICS_FILE, total_steps)
            except UserError as error:
                row["note"] = str(error)
            else:
                if state not in ACTIVE_STATES:  # an ETA only while the job is queued or running
                    progress["eta_seconds"] = progress["seconds_per_step"] = None
                row["metrics"] = progress
                eta = progress["eta_seconds"]
                total = progress["total_steps"] or "?"
                speed = progress["tokens_per_second"]
                row["note"] = (
                    f"step {progress['step']}/{total} loss {progress['loss']:.4f}"
                    + (f" {speed:,.0f} tokens/s" if speed is not None else "")
                    + (f" ETA {format_duration(eta)}" if eta else "")
                )
        if stage == "evaluate" and (run_dir / "evaluation.json").is_file():
            row["note"] = evaluation_note(run_dir / "evaluation.json")
        if stage == "preflight" and (run_dir / "preflight.json").is_file():
            from training.pipeline.preflight import note

            row["note"] = note(run_dir / "preflight.json")
        if state not in ("COMPLETED", "PENDING", "RUNNING", "UNKNOWN") and job:
            log = run_dir / "logs" / f"{stage}-{job}.out"
            row["log"] = str(log)
            row["log_tail"] = log.read_text(errors="replace").splitlines()[-10:] if log.is_file() else []
        rows.append(row)
    return rows


def evaluation_note(path: Path) -> str:
    """One line of the evaluate stage's outcome for `status`: the gate's verdict and the worst difference."""
    try:
        report = json.loads(path.read_text())
        verdict, rows = report["gate"], report["tasks"]
    except (ValueError, KeyError, TypeError):
        return f"{path}: not an evaluation report"
    deltas = [(row["delta_points"], name) for name, row in rows.items() if row.get("delta_points") is not None]
    worst = f"; lowest difference {min(deltas)[0]:+.2f} points ({min(deltas)[1]})" if deltas else ""
    if verdict.get("max_drop") is None:
        return f"{len(rows)} tasks evaluated, no gate{worst}"
    if verdict.get("passed"):
        return f"gate passed (max_drop {verdict['max_drop']:g}){worst}"
    return f"gate FAILED: {'; '.join(verdict['failures'])}"


ETA_WINDOW = 20  # intervals between logged steps whose pace the ETA assumes


def eta_seconds(points: Sequence[tuple[int, float]], total_steps: int, window: int = ETA_WINDOW) -> float | None:
    """Seconds from the last logged step to step `total_steps`, at the median pace (seconds per step) of the last
    `window` intervals between logged (step, time) points in step order. The median ignores the one long
    interval a restart leaves (requeue, resume: loading, compiling). 0 once the last step is logged; None
    without two points a step apart to measure a pace."""
    if not points:
        return None
    last_step = points[-1][0]
    if last_step >= total_steps:
        return 0.0
    recent = points[-(window + 1) :]
    paces = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in itertools.pairwise(recent) if s1 > s0 and t1 > t0]
    if not paces:
        return None
    return statistics.median(paces) * (total_steps - last_step)


def training_progress(metrics: Path, total_steps: int | None) -> dict[str, Any]:
    """The last logged values of a training job's metrics file (the validation loss from the last step that
    measured it) and the ETA of step `total_steps` (None when unknown)."""
    records = read_metrics(metrics)
    last = records[-1]
    progress: dict[str, Any] = {"step": int(last["step"]), "total_steps": total_steps}
    for key in ("loss", "lr", "grad_norm", "tokens_per_second", "seq_per_second", "mfu", "moe_dropped"):
        progress[key] = last.get(key)
    validated = [r for r in records if r.get("validation_loss") is not None]
    if validated:
        progress["validation_loss"] = validated[-1]["validation_loss"]
        progress["validation_step"] = validated[-1]["step"]
    timed = [(int(r["step"]), float(r["time"])) for r in records if isinstance(r.get("time"), int | float)]
    progress["seconds_per_step"] = None
    progress["eta_seconds"] = eta_seconds(timed, total_steps) if total_steps else None
    if progress["eta_seconds"] and total_steps:
        progress["seconds_per_step"] = progress["eta_seconds"] / (total_steps - progress["step"])
    return progress


def describe_progress(progress: dict[str, Any]) -> str:
    """One line of a training job's last logged values, for `status`."""
    total = progress.get("total_steps")
    parts = [f"loss {progress['loss']:.4f}"]
    if progress.get("validation_loss") is not None:
        parts.append(f"validation loss {progress['validation_loss']:.4f} (step {progress['validation_step']})")
    if progress.get("lr") is not None:
        parts.append(f"learning rate {progress['lr']:.2e}")
    if progress.get("grad_norm") is not None:
        parts.append(f"grad norm {progress['grad_norm']:.3f}")
    if progress.get("tokens_per_second") is not None:
        parts.append(f"{progress['tokens_per_second']:,.0f} tokens/s")
    if progress.get("mfu") is not None:
        parts.append(f"MFU {100 * progress['mfu']:.1f}%")
    if progress.get("moe_dropped") is not None:
        parts.append(f"MoE dropped {100 * progress['moe_dropped']:.2f}%")
    line = f"train at step {progress['step']}" + (f" of {total}" if total else "") + ": " + ", ".join(parts)
    eta = progress.get("eta_seconds")
    if eta:
        line += f"; ETA {format_duration(eta)} ({progress['seconds_per_step']:.2f} s/step recently)"
    return line


def train_records(run_dir: Path) -> list[dict[str, Any]]:
    """The train stage's metrics records, none while it has logged no step."""
    try:
        return read_metrics(run_dir / "checkpoints" / METRICS_FILE)
    except UserError:
        return []  # no step logged yet (the table's note says why when there is a file)


def watch_lines(run_dir: Path) -> list[str]:
    """What the training job found in itself (training.train.watchdog): its stop, a late compilation, its
    throughput against the expected figure."""
    throughput = run_recipe(read_run(run_dir), run_dir).throughput
    stop = read_stop(run_dir / "checkpoints")
    lines = [f"train stopped, not requeued: {stop['reason']}"] if stop else []
    records = train_records(run_dir)
    late = [r for r in records if r.get("late_compilations")]
    if late and not (stop and "compile cache missed" in stop["reason"]):
        last = late[-1]
        lines.append(
            late_compile_line(int(last.get("late_compilation_step", last["step"])), int(last["late_compilations"]))
        )
    expected = throughput.expected_tokens_per_second_per_node
    measured = [r for r in records if r.get("throughput_fraction") is not None]
    if expected and measured:
        fraction = float(measured[-1]["throughput_fraction"])
        line = floor_line(fraction * expected, expected, fraction, throughput.floor_fraction)
        lines.append(f"throughput at step {measured[-1]['step']}: {line}")
    elif expected and records:
        lines.append(
            f"throughput: expected {expected:,.0f} tokens/s per node, compared after "
            f"{throughput.warmup_steps} steps of warm-up and a window of {throughput.window_steps}"
        )
    return lines


def timeline_lines(run_dir: Path) -> list[str]:
    """The "time to first step" block (training.pipeline.timeline), from the run's timeline and metrics."""
    events = timeline.read_timeline(run_dir)
    if not events:
        return []
    attempts = timeline.latest_attempts(events)
    train = attempts.get(timeline.TRAIN)
    first = timeline.first_step_time(train_records(run_dir), train.start) if train is not None else None
    return timeline.describe(read_run(run_dir)["stages"], attempts, first)


def unavailable_nodes(sinfo_reasons: str) -> str | None:
    """One line from `sinfo --list-reasons --format=%E|%T|%N`: why nodes are down or drained, e.g.
    ParallelCluster's "(Code:InsufficientInstanceCapacity)Failure when resuming nodes"; None if none are."""
    problems: dict[str, list[str]] = {}
    for line in sinfo_reasons.splitlines():
        reason, _, rest = line.partition("|")
        state, _, nodes = rest.partition("|")
        if reason.strip() and nodes.strip():
            problems.setdefault(f"{reason.strip()} ({state.strip().lower()})", []).append(nodes.strip())
    if not problems:
        return None
    return "; ".join(f"{reason}: {','.join(nodes)}" for reason, nodes in problems.items())


def partition_problem(run: dict[str, Any]) -> str | None:
    """Why nodes of the run's partitions (Trainium and CPU stages) cannot start, from Slurm's node reasons
    (capacity, quota, health)."""
    site = run.get("site") or {}
    partitions = ",".join(dict.fromkeys(p for p in (site.get("partition"), site.get("cpu_partition")) if p))
    command = ["sinfo", "--noheader", "--list-reasons", "--format=%E|%T|%N"]
    result = run_slurm(run_slurm_bin(run), *command, *(["--partition", partitions] if partitions else []))
    if result.returncode:
        return None
    problem = unavailable_nodes(result.stdout)
    return f"nodes of partition {partitions or '(default)'} cannot start: {problem}" if problem else None


def print_status(run_dir: Path) -> list[dict[str, Any]]:
    rows = stage_states(run_dir)
    print(f"run {run_dir.name} ({run_dir})")
    if any(row["state"] == "PENDING" for row in rows):
        problem = partition_problem(read_run(run_dir))
        if problem:
            print(problem)
    print(f"{'stage':<12} {'job':>8} {'state':<12} {'elapsed':>10}  note")
    for row in rows:
        note = row.get("note") or row.get("reason") or ""
        print(f"{row['stage']:<12} {row['job']:>8} {row['state']:<12} {row['elapsed']:>10}  {note}")
    for row in rows:
        if row.get("metrics"):
            print(describe_progress(row["metrics"]))
    for line in watch_lines(run_dir) + timeline_lines(run_dir):
        print(line)
    for row in rows:
        if row.get("log"):
            print(f"\n{row['stage']} ended {row['state']}; last lines of {row['log']}:")
            print("\n".join(f"  {line}" for line in row["log_tail"]))
    return rows
