"""The canary before scale-out: the `preflight` stage checks the nodes the training job will get before it
starts, and fails in one line naming the node and the number.

It runs after compile, as a job of the training job's size on the training partition, in two steps, the second
starting a third on a Neuron site:

1. on every node (`srun`, one task a node: `python -m training preflight --run-dir R --node`): the node's Neuron
   and EFA devices (the prolog's test, `assets/node/on_node_configured.sh`), an all-reduce over the node's own
   NeuronCores with Neuron's collective test (`nccom-test`, aws-neuronx-tools), and the shared file system's write
   speed for the node's share of a checkpoint; each node writes `<run>/preflight/<node>.json`;
2. on the job's first node (`python -m training preflight --run-dir R`): the all-reduce across all nodes over EFA
   (`nccom-test --slurm-mode` in the job's own allocation), on a Neuron site the canary (3.), the decision,
   `<run>/preflight.json`. A failing node is drained with the reason (`scontrol update NodeName=... State=DRAIN
   Reason=...`; ParallelCluster replaces a drained static node under the same name) and the job fails, so the
   training job (`afterok`) never starts. On success the pending training job is pinned to the checked nodes
   (`ReqNodeList`);
3. the canary, once every check above passed (`--canary -- <srun ...>`): the compiled graphs run for real on the
   job's nodes, the compile stage's torchrun (assets/slurm/launch.j2, one a node, the same rendezvous) without
   neuron_parallel_compile: `training train --compile`, its two steps (validation and the checkpoint's
   rendezvous graph included) from the compile cache, nothing saved, its metrics in `<run>/preflight/
   canary-metrics.jsonl` rather than the run's. On every node (`--watch -- <torchrun ...>`) neuron-monitor
   samples every MONITOR_PERIOD meanwhile; the node's peak per NeuronCore (training/monitoring/neuron.py's sum
   over the memory categories and applications) and the torchrun's exit status go to
   `<run>/preflight/canary/<node>.json`. The decision fails, in one line naming the node and both numbers, a
   peak above the planner's GiB per NeuronCore (training/train/memory.py, as `submit` planned it) by more than
   MEMORY_TOLERANCE, or above the HBM per core; no node is drained for it (the plan's error, or the recipe's, is
   not the node's). A canary that does not run (a node's torchrun non-zero, or no result) fails in one line
   pointing to the job's log, none drained. A node whose memory neuron-monitor did not report is not judged
   (the graphs ran: all that is known) and says so in the log.

On a site without Neuron (the local demo) the Neuron checks are "not applicable" and the write speed is still
measured, so the graph and the pinning are the same everywhere. A Neuron site without `instance_type` is checked
against trn1.32xlarge's facts, as `submit` plans its memory.
The floors and the decisions are training.pipeline.preflight_checks'.

The device memory is known only once the graphs are loaded, hence the canary: the compiler refuses a graph whose
own HBM need exceeds the device (NCC_EOOM001/002), but the total with the weights and optimizer state that
torch-xla keeps on the device appears only at run time (the runtime's per-NEFF log, sysfs
`.../stats/memory_usage/device_mem`, neuron-monitor's `memory_used`: Neuron's "Neuron Device Memory" guide);
neuron-monitor's figure is the one `monitor neuron` publishes while training runs. The canary costs the training
nodes the model's load and two steps: for llama31-8b-cpt on 4 x trn1.32xlarge, 2 x 170.7 s (the forecast's step)
plus the load (start-up and the 4 nodes' 64 GB of pretrained shards from FSx), about 7-11 minutes; `preflight.json`
records its measured seconds. Not on a site without Neuron: no graphs to load there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from training import outputs
from training.config.hardware import DEFAULT_HARDWARE, Hardware
from training.config.model import ModelConfig
from training.config.recipe import Recipe, load_recipe
from training.config.site import Site
from training.errors import UserError
from training.monitoring import neuron as neuron_monitor
from training.pipeline.plan import planned_model, processes_per_node, site_forecast, site_hardware
from training.pipeline.preflight_checks import (
    CHECKPOINT_WRITE_FRACTION,
    MEMORY_TOLERANCE,
    bandwidth_problem,
    bus_bandwidth,
    canary_problem,
    checkpoint_bytes_per_node,
    checkpoint_interval,
    device_problem,
    efa_floor,
    failed_nodes,
    failure_line,
    intra_node_floor,
    memory_problem,
    peak_core_bytes,
    write_problem,
)
from training.pipeline.run_record import latest_jobs, read_run
from training.pipeline.slurm_client import run_slurm, slurm_prefix
from training.train.memory import (
    GIB,
    planned_gib_per_core,
)

RESULT = "preflight.json"
NODES_DIR = "preflight"  # <run>/preflight/<node>.json, and the write test's scratch files
NCCOM_TEST = "nccom-test"
NEURON_TOOLS_BIN = "/opt/aws/neuron/bin"  # aws-neuronx-tools; not on a job's PATH (the profile script adds it)
DEVICE_ROOT_VARIABLE = "DEVICE_ROOT"  # a fake device tree in tests, as for the prolog

WRITE_SAMPLE_MAX_BYTES = GIB  # what each node writes to measure; the projection scales it to the real share
ALLREDUCE_BYTES = "1GB"  # nccom-test's size unit; the size whose bus bandwidth is judged
NCCOM_TIMEOUT_S = 900
CANARY_DIR = "canary"  # <run>/preflight/canary/<node>.json: each node's canary status and memory peak
CANARY_METRICS = "canary-metrics.jsonl"  # the canary's JSON lines, apart from the run's training files
NEURON_MONITOR = "neuron-monitor"
MONITOR_PERIOD = "1s"  # neuron-monitor's period format (Neuron Monitor User Guide, "Configuration file example")


# --- the node ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Context:
    run_dir: Path
    site: Site
    recipe: Recipe
    hardware: Hardware | None  # None: not a Neuron site, the Neuron checks do not apply
    model: ModelConfig | None  # the model's config.json, parsed once (None: unknown)
    processes_per_node: int
    step_seconds: float | None


def load_context(run_dir: Path) -> Context:
    run = read_run(run_dir)
    site = Site(**run["site"])
    recipe = load_recipe(str(run_dir / "recipe.yaml"))
    hardware = (site_hardware(site) or DEFAULT_HARDWARE) if site.neuron else None
    model = planned_model(recipe)
    forecast = site_forecast(recipe, site, model)
    return Context(
        run_dir,
        site,
        recipe,
        hardware,
        model,
        processes_per_node(recipe, site),
        forecast.step_seconds if forecast is not None else None,
    )


def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def count_devices(root: str) -> tuple[int, int]:
    """/dev/neuron<N> and /sys/class/infiniband/* under `root` (empty: the real tree)."""
    base = Path(root or "/")
    neuron = [p for p in (base / "dev").glob("neuron*") if re.fullmatch(r"neuron[0-9]+", p.name)]
    efa_dir = base / "sys" / "class" / "infiniband"
    efa = list(efa_dir.iterdir()) if efa_dir.is_dir() else []
    return len(neuron), len(efa)


def nccom_test() -> str:
    """nccom-test on PATH, else where aws-neuronx-tools installs it."""
    path = os.environ.get("PATH", "") + os.pathsep + NEURON_TOOLS_BIN
    found = shutil.which(NCCOM_TEST, path=path)
    if found is None:
        raise UserError(f"{NCCOM_TEST}: not found on PATH or in {NEURON_TOOLS_BIN} (aws-neuronx-tools)")
    return found


def run_allreduce(ranks: int, nodes: int, extra: list[str]) -> float:
    """One all-reduce of ALLREDUCE_BYTES in fp32 with nccom-test; its bus bandwidth, GiB/s."""
    with tempfile.TemporaryDirectory(prefix="nccom-") as scratch:
        report = Path(scratch) / "report.json"
        command = [nccom_test(), "-r", str(ranks), "-N", str(nodes), "-b", ALLREDUCE_BYTES, "-e", ALLREDUCE_BYTES]
        command += ["-d", "fp32", "--non-interactive", "--report-to-json-file", str(report), "allr", *extra]
        print("$ " + " ".join(command), file=sys.stderr, flush=True)
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=NCCOM_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            raise UserError(f"nccom-test did not finish within {NCCOM_TIMEOUT_S} s") from None
        sys.stderr.write(done.stdout + done.stderr)
        if done.returncode or not report.is_file():
            last = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["no output"]
            raise UserError(f"nccom-test failed (exit status {done.returncode}): {last[0]}")
        return bus_bandwidth(report.read_text())


def measure_write(directory: Path, size: int) -> float:
    """Bytes per second of writing `size` bytes to the shared file system, flushed to it (fsync)."""
    directory.mkdir(parents=True, exist_ok=True)
    block = os.urandom(min(size, 16 * 2**20))
    path = directory / f".write-test-{node_name()}-{os.getpid()}"
    start = time.monotonic()
    try:
        with path.open("wb") as stream:
            left = size
            while left > 0:
                left -= stream.write(block[: min(left, len(block))])
            stream.flush()
            os.fsync(stream.fileno())
        seconds = time.monotonic() - start
    finally:
        path.unlink(missing_ok=True)
    return size / max(seconds, 1e-9)


def check_node(context: Context) -> dict[str, Any]:
    """This node's checks, each with its number; `problems` lists what fails, first the most basic."""
    node = node_name()
    result: dict[str, Any] = {"node": node, "job": os.environ.get("SLURM_JOB_ID"), "problems": [], "checks": {}}
    checks, problems = result["checks"], result["problems"]
    hardware = context.hardware
    if hardware is None:
        checks["devices"] = checks["allreduce_node"] = "not applicable (not a Neuron site)"
    else:
        neuron, efa = count_devices(os.environ.get(DEVICE_ROOT_VARIABLE, ""))
        efa_expected = hardware.efa_devices if context.site.efa else 0  # as the prolog is told
        checks["devices"] = {"neuron": neuron, "neuron_expected": hardware.neuron_devices, "efa": efa}
        checks["devices"]["efa_expected"] = efa_expected
        problem = device_problem(neuron, hardware.neuron_devices, efa, efa_expected)
        if problem:
            problems.append(problem)
        else:
            floor = intra_node_floor()
            try:
                measured = run_allreduce(hardware.cores_per_node, 1, [])
            except UserError as error:
                problems.append(f"all-reduce over its {hardware.cores_per_node} NeuronCores: {error}")
            else:
                checks["allreduce_node"] = {"busbw_gbps": measured, "floor_gbps": floor}
                problem = bandwidth_problem(measured, floor, "all-reduce within the node", hardware)
                if problem:
                    problems.append(problem)
    node_bytes = checkpoint_bytes_per_node(
        context.recipe, context.model, hardware or DEFAULT_HARDWARE, context.processes_per_node
    )
    sample = min(node_bytes or WRITE_SAMPLE_MAX_BYTES, WRITE_SAMPLE_MAX_BYTES)
    speed = measure_write(context.run_dir / NODES_DIR, max(sample, 2**20))
    interval = checkpoint_interval(context.recipe.checkpoint.every, context.step_seconds)
    checks["checkpoint_write"] = {
        "bytes_per_second": round(speed),
        "checkpoint_bytes": node_bytes,
        "interval_seconds": interval,
        "allowed_fraction": CHECKPOINT_WRITE_FRACTION,
        "judged": interval is not None and bool(node_bytes),
    }
    problem = write_problem(speed, node_bytes or 0, interval)
    if problem:
        problems.append(problem)
    return result


def find_tool(name: str) -> str | None:
    """A tool of aws-neuronx-tools on PATH, else where the package installs it."""
    return shutil.which(name, path=os.environ.get("PATH", "") + os.pathsep + NEURON_TOOLS_BIN)


def watch_canary(run_dir: Path, command: list[str]) -> int:
    """On every node: run the canary's torchrun (`command`) while neuron-monitor samples every MONITOR_PERIOD;
    the node's peak per NeuronCore and the command's exit status go to <run>/preflight/canary/<node>.json. Its
    exit status is the command's, so srun's --kill-on-bad-exit ends the other nodes' ranks."""
    node = node_name()
    monitor_path = find_tool(NEURON_MONITOR)
    found: list[tuple[float | None, int]] = []  # the reader's peak_core_bytes, read as the reports come
    monitor: subprocess.Popen[str] | None = None
    reader: threading.Thread | None = None
    result: dict[str, Any] = {"node": node, "monitor": monitor_path, "period": MONITOR_PERIOD}
    with tempfile.TemporaryDirectory(prefix="neuron-monitor-") as scratch:
        if monitor_path is None:
            result["monitor_error"] = f"{NEURON_MONITOR}: not found on PATH or in {NEURON_TOOLS_BIN}"
            print(f"warning: {result['monitor_error']}; the device memory is not read", file=sys.stderr)
        else:
            config = Path(scratch) / "monitor.conf"
            config.write_text(neuron_monitor.config_text(MONITOR_PERIOD))
            monitor = subprocess.Popen([monitor_path, "-c", str(config)], stdout=subprocess.PIPE, text=True)
            stream = monitor.stdout
            assert stream is not None
            reader = threading.Thread(target=lambda: found.append(peak_core_bytes(stream)), daemon=True)
            reader.start()
        start = time.monotonic()
        child = subprocess.Popen(command)
        # srun ends the other nodes' tasks with SIGTERM when one fails: torchrun then stops its ranks, and this
        # node still writes its result.
        previous = signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
        try:
            status = child.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)
            if monitor is not None:
                if monitor.poll() is not None:
                    result["monitor_error"] = f"{NEURON_MONITOR} exited with status {monitor.returncode} early"
                monitor.terminate()
                try:
                    monitor.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    monitor.kill()
                    monitor.wait()
            if reader is not None:
                reader.join(timeout=30)
    peak, reports = found[0] if found else (None, 0)
    result |= {"status": status, "seconds": round(time.monotonic() - start, 1)}
    result |= {"peak_core_bytes": peak, "memory_reports": reports}
    outputs.write_file(run_dir / NODES_DIR / CANARY_DIR / f"{node}.json", json.dumps(result, indent=2) + "\n")
    held = "not read" if peak is None else f"{peak / GIB:.2f} GiB at most on a NeuronCore"
    print(f"preflight: node {node}: canary exit status {status}, device memory {held}", file=sys.stderr)
    return status


def run_canary(context: Context, nodes: list[str], command: list[str]) -> dict[str, Any]:
    """The canary's srun (`command`) on the job's nodes, then each node's result and the judgement: the canary's
    failure, and per node the memory problem."""
    directory = context.run_dir / NODES_DIR / CANARY_DIR
    shutil.rmtree(directory, ignore_errors=True)  # an earlier preflight's results are not this one's
    (context.run_dir / NODES_DIR / CANARY_METRICS).unlink(missing_ok=True)  # the JSON lines would be appended to
    hardware = context.hardware or DEFAULT_HARDWARE
    planned = planned_gib_per_core(context.recipe, hardware, context.model)
    print("$ " + shlex.join(command), file=sys.stderr, flush=True)
    start = time.monotonic()
    status = subprocess.run(command, check=False).returncode
    results = {}
    for node in nodes:
        path = directory / f"{node}.json"
        if path.is_file():
            results[node] = json.loads(path.read_text())
    record: dict[str, Any] = {"status": status, "seconds": round(time.monotonic() - start, 1), "results": results}
    record |= {"planned_gib_per_core": planned, "hbm_gib_per_core": hardware.hbm_gib_per_core}
    record["tolerance"] = MEMORY_TOLERANCE
    log = context.run_dir / "logs" / f"preflight-{os.environ.get('SLURM_JOB_ID', '<job>')}.out"
    record["failure"] = canary_problem(nodes, results, status, str(log))
    memory: dict[str, str] = {}
    for node, result in results.items():
        problem = memory_problem(result.get("peak_core_bytes"), planned, hardware)
        if problem:
            memory[node] = problem
        elif result.get("peak_core_bytes") is None and not result.get("status"):
            print(f"warning: preflight: node {node}: the device memory was not read; not judged", file=sys.stderr)
    record["memory"] = memory
    return record


def run_node(run_dir: Path) -> int:
    context = load_context(run_dir)
    result = check_node(context)
    outputs.write_file(run_dir / NODES_DIR / f"{result['node']}.json", json.dumps(result, indent=2) + "\n")
    print(f"preflight: node {result['node']}: {'; '.join(result['problems']) or 'passed'}", file=sys.stderr)
    return 0  # the job's own step decides, with every node's result


# --- the job ----------------------------------------------------------------------------------------------


def hostnames(site: Site, nodelist: str) -> list[str]:
    done = run_slurm(site.slurm_bin, "scontrol", "show", "hostnames", nodelist)
    if done.returncode:
        raise UserError(f"scontrol show hostnames {nodelist} failed: {done.stderr.strip()}")
    return done.stdout.split()


def drain(site: Site, node: str, reason: str) -> str:
    """Drain `node` with the reason: as this user (root or a Slurm operator: the pipeline's SSM submission runs as
    root), else with `sudo -n` (ParallelCluster's default user may sudo without a password); what happened."""
    arguments = ["update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"]
    done = run_slurm(site.slurm_bin, "scontrol", *arguments)
    if done.returncode == 0:
        return "drained"
    sudo = shutil.which("sudo")
    if sudo is not None:
        again = subprocess.run(
            [sudo, "-n", f"{slurm_prefix(site.slurm_bin)}scontrol", *arguments],
            capture_output=True,
            text=True,
            check=False,
        )
        if again.returncode == 0:
            return "drained (sudo)"
    refusal = done.stderr.strip() or done.stdout.strip()
    return f"not drained: {refusal} (drain it as an operator: scontrol {' '.join(arguments)})"


def pin_training(site: Site, run_dir: Path, nodelist: str) -> str:
    """The pending training job of this run is given the checked nodes (`ReqNodeList`); what happened."""
    job = latest_jobs(read_run(run_dir)).get("train")
    if job is None:
        return "no training job recorded"
    done = run_slurm(site.slurm_bin, "scontrol", "update", f"JobId={job}", f"ReqNodeList={nodelist}")
    if done.returncode:
        return f"job {job} not pinned: {done.stderr.strip() or done.stdout.strip()}"
    return f"job {job} pinned to {nodelist}"


def this_jobs_results(directory: Path, nodes: list[str], job: str | None) -> dict[str, dict[str, Any]]:
    """Each node's result written by this job: an earlier preflight's file (a node whose check died before it
    wrote its own) is no result, so that node fails instead of passing on old numbers."""
    results: dict[str, dict[str, Any]] = {}
    for node in nodes:
        path = directory / f"{node}.json"
        if path.is_file():
            result = json.loads(path.read_text())
            if result.get("job") == job:
                results[node] = result
    return results


def run_job(run_dir: Path, canary: list[str] | None = None) -> int:
    """Every node's results, the all-nodes all-reduce, on a Neuron site the canary (`canary`: its srun), the
    decision: 0 when the training job may start."""
    context = load_context(run_dir)
    site, hardware = context.site, context.hardware
    nodelist = os.environ.get("SLURM_JOB_NODELIST", "")
    nodes = hostnames(site, nodelist) if nodelist else [node_name()]
    results = this_jobs_results(run_dir / NODES_DIR, nodes, os.environ.get("SLURM_JOB_ID"))
    failed = failed_nodes(nodes, results)
    record: dict[str, Any] = {"job": os.environ.get("SLURM_JOB_ID"), "nodelist": nodelist, "nodes": nodes}
    record |= {"results": results, "floors": {}, "instance_type": hardware.name if hardware else None}
    job_problem = None
    floor = efa_floor(hardware) if hardware is not None else None
    if hardware is not None:
        record["floors"]["allreduce_node_gbps"] = intra_node_floor()
    if not failed and hardware is not None and site.efa and len(nodes) > 1 and floor is not None:
        record["floors"]["allreduce_nodes_gbps"] = floor
        job_id = os.environ.get("SLURM_JOB_ID", "")
        try:
            measured = run_allreduce(
                hardware.cores_per_node * len(nodes), len(nodes), ["--slurm-mode", "--slurm-job-id", job_id]
            )
        except UserError as error:
            job_problem = f"all-reduce across {len(nodes)} nodes: {error}"
        else:
            record["allreduce_nodes_gbps"] = measured
            job_problem = bandwidth_problem(measured, floor, f"all-reduce across {len(nodes)} nodes", hardware)
    lines = []
    for node, problem in failed.items():
        line = failure_line(node, problem)
        record.setdefault("drained", {})[node] = drain(site, node, line[:200])
        lines.append(f"{line} ({record['drained'][node]})")
    if job_problem:
        lines.append(f"preflight: nodes {','.join(nodes)}: {job_problem} (each node's own checks passed; none drained)")
    if hardware is None:
        record["canary"] = "not applicable (not a Neuron site)"
    elif lines:
        record["canary"] = "not run (a check above failed)"
    elif not canary:
        record["canary"] = "not run (no canary command given)"
    else:
        record["canary"] = run_canary(context, nodes, canary)
        if record["canary"]["failure"]:
            lines.append(f"preflight: {record['canary']['failure']}")
        # Memory above the plan is the plan's error (or the recipe's), not the node's: no node is drained for it.
        for node, problem in record["canary"]["memory"].items():
            lines.append(f"{failure_line(node, problem)} (not the node's fault; none drained)")
    record["failure"] = "; ".join(lines) or None
    if not lines:
        record["pinned"] = pin_training(site, run_dir, nodelist) if nodelist else "not in a Slurm job"
    outputs.write_file(run_dir / RESULT, json.dumps(record, indent=2) + "\n")
    for line in lines:
        print(line, file=sys.stderr)
    if lines:
        return 1
    print(f"preflight: {len(nodes)} node(s) passed ({nodelist}); {record['pinned']}", file=sys.stderr)
    return 0


def verify_nodes(run_dir: Path) -> int:
    """In the training job: say whether it runs on the nodes the preflight checked (a user may have changed the
    job's nodes, or the preflight was skipped). Never fails the job: it only tells."""
    path = run_dir / RESULT
    nodelist = os.environ.get("SLURM_JOB_NODELIST", "")
    if not path.is_file():
        print("preflight: no preflight.json; the nodes were not checked", file=sys.stderr)
        return 0
    checked = json.loads(path.read_text())
    site = load_context(run_dir).site
    if nodelist and hostnames(site, nodelist) == checked["nodes"]:
        print(f"preflight: training on the checked nodes {nodelist}", file=sys.stderr)
    else:
        print(
            f"warning: preflight checked {checked['nodelist']}, but this job runs on {nodelist or '(no Slurm job)'}",
            file=sys.stderr,
        )
    return 0


def note(path: Path) -> str:
    """One line for `status`: the failure, else the nodes that passed."""
    try:
        result = json.loads(path.read_text())
        failure, nodelist = result.get("failure"), result["nodelist"]
    except (ValueError, OSError, AttributeError, KeyError):
        return f"{path}: not a preflight result"
    return str(failure) if failure else f"passed on {nodelist or 'this host'}"
