"""Time to first step (training.pipeline.timeline): the job scripts' timeline lines as bash writes them, the
latest attempt of each stage, the phases of whatever stages a run has, `status`'s block and watch lines, and the
StageSeconds the head node's monitor sends. No Slurm here: a run record without submissions asks Slurm nothing."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.repository import ROOT
from tests.support.run_records import write_run_record
from training.config.recipe import load_recipe
from training.config.site import Site
from training.monitoring.cluster import stage_data
from training.pipeline import timeline
from training.pipeline.plan import plan_run
from training.pipeline.scripts import render
from training.pipeline.status import print_status, watch_lines
from training.pipeline.timeline import BOOTSTRAP, FIRST_STEP, Attempt, latest_attempts, phases, stage_seconds
from training.train.watchdog import write_stop

NODE_SCRIPT = ROOT / "assets" / "node" / "on_node_configured.sh"
STAGES = ["prepare", "compile", "preflight", "train", "convert-out"]


def event(stage: str, kind: str, time: float, job: str = "1", **extra: Any) -> dict[str, Any]:
    return {"stage": stage, "event": kind, "time": time, "job": job, **extra}


EVENTS = [
    event("prepare", "start", 1000, "1", node_boot=10.0, bootstrap_end=None),
    event("prepare", "end", 1060, "1"),
    event("compile", "start", 1100, "2", node_boot=900.0, bootstrap_end=1080.0),
    event("compile", "end", 1700, "2"),
    event("preflight", "start", 1710, "3", node_boot=900.0, bootstrap_end=1080.0),
    event("preflight", "end", 1770, "3"),
    event("train", "start", 1780, "4", node_boot=900.0, bootstrap_end=1080.0),  # killed, requeued
    event("train", "start", 2000, "4", restart=1, node_boot=1900.0, bootstrap_end=1990.0),
]


def test_each_stage_counts_from_its_latest_start_and_that_jobs_end() -> None:
    attempts = latest_attempts([*EVENTS, event("prepare", "end", 5000, "9")])  # another job's end: not this one's
    assert attempts["prepare"] == Attempt("prepare", "1", 1000, 1060, 10.0, None)
    assert attempts["train"] == Attempt("train", "4", 2000, None, 1900.0, 1990.0)
    assert attempts["compile"].seconds == 600


def test_the_phases_follow_the_runs_stages_up_to_train_and_end_at_the_first_step() -> None:
    attempts = latest_attempts(EVENTS)
    got = [(p.name, p.seconds) for p in phases(STAGES, attempts, first_step=2090.0)]
    # The bootstrap of the first stage whose node has one (compile's: the CPU node had none).
    assert got == [(BOOTSTRAP, 180.0), ("prepare", 60), ("compile", 600), ("preflight", 60), ("train", None)] + [
        (FIRST_STEP, 90.0)
    ]
    without_preflight = [s for s in STAGES if s != "preflight"]
    names = [p.name for p in phases(without_preflight, latest_attempts(EVENTS), 2090.0)]
    assert names == [BOOTSTRAP, "prepare", "compile", "train", FIRST_STEP]


def test_status_prints_the_block_with_the_total_since_the_first_nodes_boot() -> None:
    lines = timeline.describe(STAGES, latest_attempts(EVENTS), 2090.0)
    assert lines[0] == "time to first step:"
    assert re.search(r"^  bootstrap +3m00s  compile's first node: boot -> bootstrap end$", lines[1]), lines
    assert any(re.fullmatch(r"  compile +10m00s", line) for line in lines), lines
    assert any(re.fullmatch(r"  train +-  running or failed", line) for line in lines), lines
    assert lines[-2].startswith("  first-step") and "1m30s" in lines[-2]
    assert lines[-1] == "  total            19m50s  since the first node's boot (1970-01-01T00:15:00Z)"


def test_without_a_bootstrap_marker_the_block_says_so_and_counts_from_the_first_stage() -> None:
    local = [{k: v for k, v in e.items() if k != "bootstrap_end"} for e in EVENTS]
    lines = timeline.describe(STAGES, latest_attempts(local), 2090.0)
    assert lines[1].startswith(f"  bootstrap      not recorded (no {timeline.BOOTSTRAP_END_FILE} on the nodes")
    assert lines[-1].endswith("since the first stage's start (1970-01-01T00:16:40Z)")


def test_stage_seconds_are_sent_while_the_run_is_active_and_a_while_after() -> None:
    attempts = latest_attempts(EVENTS)
    data = stage_seconds(STAGES, attempts, 2090.0, active=True, now=10**9)
    assert {d.dimensions["Stage"]: d.value for d in data} == {
        BOOTSTRAP: 180.0,
        "prepare": 60,
        "compile": 600,
        "preflight": 60,
        FIRST_STEP: 90.0,
    }
    assert all(d.name == "StageSeconds" and d.unit == "Seconds" for d in data)
    assert stage_seconds(STAGES, attempts, 2090.0, active=False, now=2000 + timeline.PUBLISH_GRACE_SECONDS)
    assert stage_seconds(STAGES, attempts, 2090.0, active=False, now=2001 + timeline.PUBLISH_GRACE_SECONDS) == []
    assert timeline.most_phases(STAGES) == 4 + 2 and len(data) <= timeline.most_phases(STAGES)


def rendered_timeline(tmp_path: Path, marker: str | None) -> list[dict[str, Any]]:
    """The job scripts' own timeline lines (base.sbatch.j2, rendered for a stage), run by bash."""
    site = Site(runs_root=str(tmp_path / "runs"), results=str(tmp_path / "results"), python="/usr/bin/python3")
    recipe = load_recipe("tiny-llama-cpt")
    plan = plan_run(recipe, site, "run-1")
    script = render(plan)["convert-out"]
    lines = script.splitlines()
    begin = lines.index(next(line for line in lines if line.startswith("timeline() {")))
    end = lines.index(next(line for line in lines if line.startswith("timeline start ")))
    bootstrap = tmp_path / "configured"
    if marker is not None:
        bootstrap.write_text(marker)
    code = "\n".join(lines[begin : end + 1]).replace(timeline.BOOTSTRAP_END_FILE, str(bootstrap))
    (plan.run_dir).mkdir(parents=True)
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"}
    subprocess.run(["bash", "-euo", "pipefail", "-c", f"{code}\ntimeline end"], env=env, check=True)
    return [json.loads(line) for line in (plan.run_dir / timeline.TIMELINE_FILE).read_text().splitlines()]


@pytest.mark.parametrize("marker", ["1700000000\n", None, "garbage"])
def test_the_job_scripts_write_json_lines_with_the_nodes_boot_and_bootstrap(tmp_path: Path, marker: str | None) -> None:
    start, end = rendered_timeline(tmp_path, marker)
    assert (start["stage"], start["event"], start["job"], start["restart"]) == ("convert-out", "start", "42", 1)
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    assert abs(start["time"] - uptime - start["node_boot"]) <= 2
    assert start["bootstrap_end"] == (1700000000 if marker == "1700000000\n" else None)
    assert (end["event"], end["job"]) == ("end", "42") and end["time"] >= start["time"]
    assert latest_attempts([start, end])["convert-out"].seconds is not None


def test_the_bootstrap_writes_the_marker_the_jobs_read(tmp_path: Path) -> None:
    """on_node_configured.sh's record_bootstrap_end, run for real, at the path timeline.py names by default."""
    script = NODE_SCRIPT.read_text()
    assert f'BOOTSTRAP_END_FILE="${{BOOTSTRAP_END_FILE:-{timeline.BOOTSTRAP_END_FILE}}}"' in script
    assert "      record_bootstrap_end\n      ;;" in script.split("    compute)")[1].split("    cpu)")[0]  # last act
    marker = tmp_path / "var" / "configured"
    subprocess.run(
        ["bash", "-c", 'source "$1"\nDRY_RUN=0\nrecord_bootstrap_end', "bash", str(NODE_SCRIPT)],
        env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), "BOOTSTRAP_END_FILE": str(marker)},
        check=True,
    )
    assert abs(int(marker.read_text()) - __import__("time").time()) < 5


def run_dir_with(tmp_path: Path, records: list[dict[str, Any]], throughput: dict[str, Any]) -> Path:
    run_dir = tmp_path / "run-1"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_run_record(
        run_dir, STAGES, ["steps=100", *(f"throughput.{key}={value}" for key, value in throughput.items())]
    )
    (run_dir / timeline.TIMELINE_FILE).write_text("".join(json.dumps(e) + "\n" for e in EVENTS) + "{cut")
    return run_dir


THROUGHPUT = {"expected_tokens_per_second_per_node": 10000.0, "floor_fraction": 0.5, "warmup_steps": 10}


def record(step: int, **extra: Any) -> dict[str, Any]:
    return {"step": step, "loss": 2.0, "tokens_per_second": 4000.0, "time": 2090.0 + step, **extra}


def test_status_shows_the_stop_the_late_compilation_the_floor_and_the_time_to_first_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = [record(s, late_compilations=0) for s in range(1, 12)]
    records += [record(12, late_compilations=1, late_compilation_step=12, throughput_fraction=0.4)]
    run_dir = run_dir_with(tmp_path, records, THROUGHPUT)
    write_stop(run_dir / "checkpoints", "throughput below the floor at step 12: ...", 12)
    print_status(run_dir)
    printed = capsys.readouterr().out.splitlines()
    assert "train stopped, not requeued: throughput below the floor at step 12: ..." in printed
    late = [line for line in printed if line.startswith("train compiled a graph at step 12: the compile cache missed")]
    assert len(late) == 1
    assert (
        "throughput at step 12: actual 4,000 tokens/s per node against expected 10,000 (40%); below the floor of 50%"
        in printed
    )
    block = printed[printed.index("time to first step:") :]
    assert [line.split()[0] for line in block[1:]] == ["bootstrap", "prepare", "compile", "preflight", "train"] + [
        "first-step",
        "total",
    ]
    assert "1m31s" in block[-2]  # train started at 2000, its first record at 2091


def test_status_before_the_floor_applies_names_the_expectation(tmp_path: Path) -> None:
    run_dir = run_dir_with(tmp_path, [record(1)], {**THROUGHPUT, "window_steps": 5})
    assert watch_lines(run_dir) == [
        "throughput: expected 10,000 tokens/s per node, compared after 10 steps of warm-up and a window of 5"
    ]
    plain = run_dir_with(tmp_path / "plain", [record(1)], {})  # no expected figure (the CPU backend): no floor
    assert watch_lines(plain) == []


def test_the_monitor_sends_the_newest_runs_stage_seconds(tmp_path: Path) -> None:
    run_dir = run_dir_with(tmp_path, [record(1)], THROUGHPUT)
    data = stage_data(run_dir, [{"stage": "train", "state": "RUNNING"}], now=10**9)
    assert {d.dimensions["Stage"]: d.value for d in data}[FIRST_STEP] == 91.0
    assert stage_data(run_dir, [{"stage": "train", "state": "COMPLETED"}], now=10**9) == []
    assert stage_data(tmp_path, [], now=0) == []  # no timeline
