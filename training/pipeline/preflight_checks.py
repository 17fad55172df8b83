"""The preflight stage's decisions (training.pipeline.preflight runs the checks): pure functions from what was
measured on the nodes to a one-line problem, or None.

Floors (each a stated fraction of a published figure):
- across nodes: a quarter of the instance type's EFA line rate (trn1.32xlarge 800 Gbps, trn1n.32xlarge 1,600 Gbps:
  Neuron's Trn1/Trn1n architecture page) in nccom-test's unit (GiB/s of bus bandwidth). Neuron's own two-instance
  example in the nccom-test guide reaches about half the line rate at 256 MiB to 1 GiB; a quarter catches a node
  whose traffic falls back from EFA (a dead card, TCP) without failing on normal variation;
- within a node: 40 % of the single-instance all-reduce of the nccom-test guide (52.83 GiB/s at 1 GiB fp32), the
  only published figure; it catches a broken device link, not a few percent of loss;
- the checkpoint: the node's share must be written within `CHECKPOINT_WRITE_FRACTION` of the time between two
  checkpoints (checkpoint.every x the forecast's step time). No forecast (the CPU backend, an unknown model): the
  speed is recorded, not judged.


The memory: the canary's peak per NeuronCore against the planner's GiB per core (training/train/memory.py, as
`submit` planned it), with MEMORY_TOLERANCE, and against the HBM per core.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from training.config.hardware import Hardware
from training.config.model import ModelConfig
from training.config.recipe import Recipe
from training.errors import UserError
from training.monitoring import neuron as neuron_monitor
from training.train.memory import (
    GIB,
    REQUIRED_HEADROOM,
    parameters_per_core,
    state_bytes_per_parameter,
    workload_of,
)

EFA_FLOOR_FRACTION = 0.25
INTRA_NODE_REFERENCE_GIBPS = 52.83  # nccom-test guide: single-instance all-reduce, 1 GiB fp32
INTRA_NODE_FLOOR_FRACTION = 0.40
CHECKPOINT_WRITE_FRACTION = 0.10
# How far the compiled graphs' memory may exceed the plan: the plan's own headroom. Submit accepted the run with
# REQUIRED_HEADROOM of the HBM to spare for the plan's error; more than that above the plan and the guarantee given
# at submit (the run fits with that margin) no longer holds.
MEMORY_TOLERANCE = REQUIRED_HEADROOM


def device_problem(neuron: int, neuron_expected: int, efa: int, efa_expected: int) -> str | None:
    """The prolog's test and words: what is missing, or None."""
    problems = []
    if neuron < neuron_expected:
        problems.append(f"{neuron} of {neuron_expected} Neuron devices")
    if efa < efa_expected:
        problems.append(f"{efa} of {efa_expected} EFA devices")
    return ", ".join(problems) or None


def bus_bandwidth(report: str) -> float:
    """The bus bandwidth (GiB/s) at the largest size of an nccom-test `--report-to-json-file` report: the
    collective's steady state, where the average over a sweep mixes in latency-bound small sizes."""
    try:
        results = json.loads(report)["results"]
        largest = max(results, key=lambda row: row["size(B)"])
        return float(largest["busbw(GB/s)"])
    except (ValueError, KeyError, TypeError) as error:
        raise UserError(f"nccom-test report without results ({type(error).__name__}: {error})") from None


def efa_floor(hardware: Hardware) -> float | None:
    """The all-reduce bus bandwidth floor across nodes, GiB/s; None for a type without EFA (single node)."""
    if not hardware.efa_gbps:
        return None
    return round(hardware.efa_gbps * 1e9 / 8 / 2**30 * EFA_FLOOR_FRACTION, 1)


def intra_node_floor() -> float:
    return round(INTRA_NODE_REFERENCE_GIBPS * INTRA_NODE_FLOOR_FRACTION, 1)


def bandwidth_problem(measured: float, floor: float, what: str, hardware: Hardware) -> str | None:
    if measured >= floor:
        return None
    return f"{what} bus bandwidth {measured:.1f} GB/s below the floor {floor:.1f} GB/s of {hardware.name}"


def checkpoint_bytes_per_node(
    recipe: Recipe, config: ModelConfig | None, hardware: Hardware, processes_per_node: int
) -> int | None:
    """What one node writes for a checkpoint: each of its ranks' weights and optimizer state (the planner's
    per-core counts; gradients are not saved). None when the model's config is unknown (`config` None)."""
    if config is None:
        return None
    workload = workload_of(recipe, config, hardware, processes_per_node)
    sizes = state_bytes_per_parameter(workload)
    per_rank = parameters_per_core(workload) * (sizes["weights"] + sizes["optimizer state"])
    return int(per_rank * processes_per_node)


def checkpoint_interval(every: int, step_seconds: float | None) -> float | None:
    """Seconds between two checkpoints; None when unknown (no forecast) or when only the end is saved."""
    if not every or step_seconds is None:
        return None
    return every * step_seconds


def write_problem(bytes_per_second: float, node_bytes: int, interval_seconds: float | None) -> str | None:
    """The node's share of a checkpoint at the measured speed against the time the interval allows."""
    if interval_seconds is None or node_bytes <= 0:
        return None
    seconds = node_bytes / bytes_per_second
    allowed = interval_seconds * CHECKPOINT_WRITE_FRACTION
    if seconds <= allowed:
        return None
    return (
        f"shared storage writes {bytes_per_second / 1e6:.0f} MB/s: its {node_bytes / 1e9:.1f} GB of a checkpoint "
        f"take {seconds:.0f} s, more than {CHECKPOINT_WRITE_FRACTION:.0%} of the {interval_seconds:.0f} s between "
        "checkpoints"
    )


def canary_problem(nodes: list[str], results: dict[str, dict[str, Any]], status: int, log: str) -> str | None:
    """The canary's failure in one line: the nodes whose torchrun exited non-zero or left no result, else the
    srun's own non-zero `status`; `log`: where to read more."""
    failed = []
    for node in nodes:
        result = results.get(node)
        if result is None:
            failed.append(f"{node} left no result")
        elif result.get("status"):
            failed.append(f"{node} exited with status {result['status']}")
    if not failed and status:
        failed.append(f"the canary's srun exited with status {status}")
    if not failed:
        return None
    return f"the compiled graphs did not run: {', '.join(failed)} (see {log})"


def memory_problem(peak_bytes: float | None, planned_gib: float | None, hardware: Hardware) -> str | None:
    """The most device memory a NeuronCore held while the compiled graphs ran, against the plan (plus
    MEMORY_TOLERANCE) and the HBM per core; None when it fits, or when nothing was read (then the canary's success
    is all that is known: the graphs ran)."""
    if peak_bytes is None:
        return None
    held = peak_bytes / GIB
    if held > hardware.hbm_gib_per_core:
        return (
            f"the compiled graphs hold {held:.1f} GiB on a NeuronCore, more than its "
            f"{hardware.hbm_gib_per_core:g} GiB of HBM on {hardware.name}"
        )
    if planned_gib is not None and held > planned_gib * (1 + MEMORY_TOLERANCE):
        return (
            f"the compiled graphs hold {held:.1f} GiB on a NeuronCore, above the plan's {planned_gib:.1f} GiB "
            f"(+{MEMORY_TOLERANCE:.0%} allowed)"
        )
    return None


def peak_core_bytes(reports: Iterable[str]) -> tuple[float | None, int]:
    """The most bytes any NeuronCore held over neuron-monitor's report lines, and how many reports had memory;
    a line that is not a report, or a report whose memory could not be read, is skipped."""
    peak: float | None = None
    read = 0
    for line in reports:
        try:
            report = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(report, dict):
            continue
        cores = neuron_monitor.core_memory(report)
        if not cores:  # unreadable, or no Neuron application yet: no figure, not a 0
            continue
        read += 1
        peak = max(peak or 0.0, max(cores.values()))
    return peak, read


def failure_line(node: str, problem: str) -> str:
    return f"preflight: node {node}: {problem}"


def failed_nodes(nodes: list[str], results: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Per failing node its first problem; a node without a result failed before it could report."""
    failed: dict[str, str] = {}
    for node in nodes:
        result = results.get(node)
        if result is None:
            failed[node] = "no result (the node's check did not finish; see the job's log)"
        elif result.get("problems"):
            failed[node] = result["problems"][0]
    return failed
