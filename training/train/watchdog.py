"""What the training job watches in itself at every logged step: late graph compilations and a throughput floor.

Late compilations (Neuron only; the CPU backend compiles no graphs and reports nothing). torch-xla counts every
graph it compiles in the process (`CompileTime`), including the ones the Neuron persistent cache answers, so a
compilation is expected where the process meets a graph for the first time: in its first COMPILE_STEPS steps (the
step's graphs: a resumed process compiles them in its own first two steps, counted from its start step), and at
the first validation and the first checkpoint save (their graphs, which the compile stage ran too). Any other
compilation is a graph the compile stage never compiled, so the compile cache cannot have had it: a step graph
after the first two steps (a shape or schedule change), or a validation or checkpoint graph a second time. What
torch-xla cannot tell: whether a first use's compilation found the cache (the Neuron cache's own log says).

The throughput floor: after `throughput.warmup_steps` of the process, the median tokens/s per node of the last
`throughput.window_steps` logged steps below `floor_fraction` x expected is below the floor (a median, so one
slow step, such as the one after a checkpoint save, is not).

A stop (`neuron.fail_on_late_compile`, `throughput.cancel_below_floor`) writes its one-line reason to
`<checkpoint.dir>/stopped.json` before rank 0 raises RunStopped: the train stage's job script does not requeue a
stopped job, and `status` prints the reason.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training import outputs
from training.errors import UserError

COMPILE_STEPS = 2  # step 1's optimizer graph differs from the steady state of step 2 (REFERENCE.md s7)
STEP, VALIDATION, CHECKPOINT = "step", "validation", "checkpoint"
FIRST_USE_PHASES = (VALIDATION, CHECKPOINT)  # graphs a process compiles when it first runs them, at any step
STOP_FILE = "stopped.json"
COMPILED = "xla_compilations"  # the metrics record's count of the process's graph compilations (backends that compile)


class RunStopped(UserError):
    """The training job stopped itself on purpose (its reason is one line); never requeued."""


@dataclass
class CompileWatch:
    """Attributes each observed increase of the process's cumulative compilations to a phase of a step and
    counts the late ones (module docstring). `start`: the step the process started after (0, or the resumed
    checkpoint's step)."""

    start: int
    compilations: int = 0  # cumulative, at the last observation
    late: int = 0
    late_steps: list[int] = field(default_factory=list)  # each step that compiled late, once
    _used: set[str] = field(default_factory=set)

    def observe(self, step: int, phase: str, compilations: int) -> int:
        """The process's cumulative compilations after `phase` of `step` ran; returns the late ones among the
        new ones. Observing the same count twice adds nothing."""
        new = max(0, compilations - self.compilations)
        self.compilations = max(self.compilations, compilations)
        first_use = phase in FIRST_USE_PHASES and phase not in self._used
        self._used.add(phase)
        if not new or step <= self.start + COMPILE_STEPS or first_use:
            return 0
        self.late += new
        if step not in self.late_steps:
            self.late_steps.append(step)
        return new

    def fields(self) -> dict[str, Any]:
        """The metrics record's late-compilation keys (cumulative for the process)."""
        record: dict[str, Any] = {"late_compilations": self.late}
        if self.late_steps:
            record["late_compilation_step"] = self.late_steps[-1]
        return record


WHAT = {
    STEP: "the training step's graph",
    VALIDATION: "the validation's graph",
    CHECKPOINT: "the checkpoint save's graph",
}


def late_compile_line(step: int, count: int, phase: str | None = None) -> str:
    """The one line of late compilations, in the job's log and its stop reason (`count` graphs at `step`, in
    `phase`) and in `status` (`phase` None: `count` is the process's total so far, `step` the last one's)."""
    what = WHAT[phase] if phase is not None else "a graph"
    if count == 1:
        graphs = "a graph at"
    else:
        graphs = f"{count} graphs at" if phase is not None else f"{count} graphs late, the last at"
    return (
        f"train compiled {graphs} step {step}: the compile cache missed ({what} changed since the compile "
        "stage; each miss costs minutes on every node: compile again with the recipe the run trains with)"
    )


@dataclass(frozen=True)
class FloorVerdict:
    """The floor's view of the logged steps so far: None values while warming up or filling the window."""

    tokens_per_node: float | None  # the window's median
    fraction: float | None  # of the expected figure
    below: bool


def floor_verdict(
    tokens_per_node: Sequence[tuple[int, float]],
    *,
    start: int,
    expected: float,
    floor_fraction: float,
    warmup_steps: int,
    window_steps: int,
) -> FloorVerdict:
    """`tokens_per_node`: (step, tokens/s per node) of the process's logged steps in order. Only steps after
    `start + warmup_steps` count; below when their last `window_steps` have a median under the floor."""
    counted = [value for step, value in tokens_per_node if step > start + warmup_steps]
    if len(counted) < window_steps:
        return FloorVerdict(None, None, False)
    median = statistics.median(counted[-window_steps:])
    fraction = median / expected
    return FloorVerdict(median, fraction, fraction < floor_fraction)


def floor_line(actual: float, expected: float, fraction: float, floor_fraction: float) -> str:
    """`status`'s and the stop reason's line: actual against expected, and the floor."""
    verdict = "below the floor" if fraction < floor_fraction else "above the floor"
    return (
        f"actual {actual:,.0f} tokens/s per node against expected {expected:,.0f} ({fraction:.0%}); "
        f"{verdict} of {floor_fraction:.0%}"
    )


def write_stop(checkpoint_dir: Path, reason: str, step: int) -> None:
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    content = {"reason": reason, "step": step, "time": time.time()}
    outputs.write_file(checkpoint_dir / STOP_FILE, json.dumps(content) + "\n")


def read_stop(checkpoint_dir: Path) -> dict[str, Any] | None:
    """The recorded stop of the training job, or None (none, or not one this module wrote)."""
    try:
        content = json.loads((checkpoint_dir / STOP_FILE).read_text())
    except (OSError, ValueError):
        return None
    return content if isinstance(content, dict) and isinstance(content.get("reason"), str) else None
