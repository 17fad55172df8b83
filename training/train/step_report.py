"""Each logged step's record, and rank 0's watches that read it: late compilations and the throughput floor.

The record is built in a step closure (`parallel.add_step_closure`), once the step's graph has run, so reading
its values costs no graph of its own. Rank 0 writes it (`training.train.metrics`) and watches it
(`training.train.watchdog`): a watch that asks the job to stop records its reason, and `stop_if_asked` ends
the job at the next point the loop checks.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from training.config.recipe import Recipe
from training.model import parallel
from training.train.backend import TrainingBackend
from training.train.batches import BatchPlan
from training.train.metrics import MetricsSink
from training.train.watchdog import (
    COMPILED,
    STEP,
    VALIDATION,
    CompileWatch,
    RunStopped,
    floor_line,
    floor_verdict,
    late_compile_line,
    write_stop,
)

log = logging.getLogger(__name__)


@dataclass
class Window:
    """The logging window: when it started and how many steps it has counted (for seq/s)."""

    start: float
    steps: int = 0


def metrics_record(
    recipe: Recipe,
    plan: BatchPlan,
    step: int,
    loss: float,
    learning_rate: float,
    grad_norm: float,
    elapsed: float,
    steps: int,
) -> dict[str, Any]:
    sequences = plan.global_batch * steps / max(elapsed, 1e-9)
    return {
        "step": step,
        "loss": round(loss, 6),
        "lr": learning_rate,
        "grad_norm": round(grad_norm, 6),
        "seq_per_second": round(sequences, 4),
        "tokens_per_second": round(sequences * recipe.batch.seq_len, 2),
        "time": time.time(),
    }


def nodes() -> int:
    """Nodes of the launched job: torchrun's processes over those of one node (1 without torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return max(1, world // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))))


@dataclass
class StepReport:
    """The run's logged steps: the record of each, written on rank 0, and rank 0's watches."""

    recipe: Recipe
    plan: BatchPlan
    backend: TrainingBackend
    start: int  # the step the process started after
    flops_per_token: float
    metrics: MetricsSink | None  # rank 0's
    watch: CompileWatch | None  # rank 0's, when the backend compiles graphs and the run is not the compile run
    expected: float | None  # tokens/s per node the throughput floor measures against (None: no floor)
    losses: list[float] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # the reason rank 0 stops the job, set by a watch
    window: Window = field(default_factory=lambda: Window(time.perf_counter()))
    _per_node: list[tuple[int, float]] = field(default_factory=list)
    _below: bool = False  # the floor's last verdict: a warning when it changes, not at every step

    def compilations(self, done: int, phase: str, count: int | None = None) -> None:
        """After `phase` of step `done` ran; `count`: the compilations so far, if already read."""
        if self.watch is None:
            return
        count = self.backend.compilations() if count is None else count
        if count is None:
            return
        late = self.watch.observe(done, phase, count)
        if late:
            line = late_compile_line(done, late, phase)
            log.warning(line)
            if self.recipe.neuron.fail_on_late_compile and not self.stop:
                self.stop.append(f"{line} (neuron.fail_on_late_compile)")

    def _throughput(self, done: int, record: dict[str, Any]) -> None:
        tokens = record["tokens_per_second"] / nodes()
        record["tokens_per_second_per_node"] = round(tokens, 2)
        if self.expected is None:
            return
        floor = self.recipe.throughput
        self._per_node.append((done, tokens))
        del self._per_node[: -floor.window_steps]  # the window is all the verdict reads
        verdict = floor_verdict(
            self._per_node,
            start=self.start,
            expected=self.expected,
            floor_fraction=floor.floor_fraction,
            warmup_steps=floor.warmup_steps,
            window_steps=floor.window_steps,
        )
        if verdict.fraction is None or verdict.tokens_per_node is None:
            return
        record["throughput_fraction"] = float(f"{verdict.fraction:.6g}")  # significant digits: far below is tiny
        record["below_throughput_floor"] = int(verdict.below)
        line = floor_line(verdict.tokens_per_node, self.expected, verdict.fraction, floor.floor_fraction)
        if verdict.below != self._below:
            (log.warning if verdict.below else log.info)(f"throughput at step {done}: {line}")
            self._below = verdict.below
        if verdict.below and floor.cancel_below_floor and not self.stop:
            self.stop.append(f"throughput below the floor at step {done}: {line} (throughput.cancel_below_floor)")

    def __call__(
        self,
        done: int,
        loss_tensor: torch.Tensor,
        norm_tensor: torch.Tensor,
        learning_rate: float,
        validation_tensor: torch.Tensor | None,
        dropped_tensor: torch.Tensor | None,
    ) -> None:
        """Runs once the step's graph has run (a step closure on Neuron), so reading the values costs no graph."""
        loss = float(loss_tensor)
        elapsed = time.perf_counter() - self.window.start
        record = metrics_record(
            self.recipe, self.plan, done, loss, learning_rate, float(norm_tensor), elapsed, self.window.steps
        )
        if validation_tensor is not None:
            record["validation_loss"] = round(float(validation_tensor), 6)
        if dropped_tensor is not None:
            record["moe_dropped"] = round(float(dropped_tensor), 6)  # fraction of the step's expert choices
        peak_flops = self.recipe.peak_tflops_per_worker * 1e12 * parallel.world_size()
        record["mfu"] = round(self.flops_per_token * record["tokens_per_second"] / peak_flops, 6)
        counters = self.backend.graph_counters()
        record.update(counters)
        if parallel.world_rank() == 0:
            self.compilations(done, VALIDATION if validation_tensor is not None else STEP, counters.get(COMPILED))
            if self.watch is not None:
                record.update(self.watch.fields())
            self._throughput(done, record)
        self.losses.append(loss)
        if self.metrics is not None:
            self.metrics.write(record)
            log.info(
                f"(step {done}) step_loss : {loss:.4f} learning_rate : {learning_rate:.2e} "
                f"throughput : {record['seq_per_second']:.2f} seq/s"
            )
        self.window.start, self.window.steps = time.perf_counter(), 0

    def stop_if_asked(self, checkpoint_dir: Path, step: int) -> None:
        """Rank 0 ends the job when a watch asked it to: the reason recorded first (the job script does not
        requeue a stopped job), then raised; torchrun ends the other ranks."""
        if not self.stop:
            return
        write_stop(checkpoint_dir, self.stop[0], step)
        raise RunStopped(self.stop[0])  # the CLI's `error:` line
