"""The training-backend interface: what a training run does differently on each backend, chosen once.

The model is written once against `training.model.parallel`; what the training services do differently per
backend sits behind `TrainingBackend`: the pipeline-parallel schedule, the optimizer's backend part
(data-parallel reduction, clipping, ZeRO-1), the checkpoint's rank files, and the graph counters. The loop picks
the implementation of the recipe's `backend` once (`training_backend`) and hands it down; no other module of
`training.train` asks which backend runs. One module per backend implements it (`IMPLEMENTATIONS`): a new
backend is one more module and one more entry here (and its name in `training.config.backends`).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from training.config.backends import Backend
from training.config.model import ModelSpec, Parallelism
from training.config.recipe import OptimizerSection, Precision, Recipe
from training.model.transformer import CausalLM
from training.train.pp_schedule import PPSchedule

if TYPE_CHECKING:
    from training.train.cpu_precision import MasterWeights
    from training.train.optimizer import TrainingOptimizer

IMPLEMENTATIONS: dict[Backend, str] = {
    "cpu": "training.train.cpu_training",
    "neuron": "training.train.neuron_training",
    "torch-native": "training.train.native_training",
}


class OptimizerCore(Protocol):
    """The backend's part of the optimizer (`training.train.optimizer.TrainingOptimizer` holds the rest)."""

    inner: Any  # the torch optimizer whose param_groups the schedule sets (the backend's wrapper, if any)
    master: MasterWeights | None  # fp32 master copies kept here (None: none, or the backend's optimizer keeps them)

    def step(self) -> torch.Tensor:
        """Reduce the gradients over data parallelism, clip, update; the gradient norm before clipping, on the
        device."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class TrainingBackend(Protocol):
    """One backend's training services (module docstring)."""

    name: Backend
    compiles_graphs: bool  # compiles graphs the run can watch for late compilations (`compilations`)

    def check_layout(self, spec: ModelSpec, parallelism: Parallelism) -> None:
        """Raises UserError when this backend cannot lay the model out so (before any process group)."""
        ...

    def parallel_options(self, recipe: Recipe) -> dict[str, Any]:
        """`parallel.initialize`'s options for this recipe."""
        ...

    def pp_schedule(self, model: CausalLM, micro_batches: int, micro: int, seq_len: int, *, zero1: bool) -> PPSchedule:
        """The pipeline-parallel schedule of this rank's stage."""
        ...

    def optimizer(
        self,
        model: CausalLM,
        groups: list[dict[str, Any]],
        settings: OptimizerSection,
        *,
        precision: Precision,
        seed: int,
    ) -> OptimizerCore:
        """AdamW over the parameter groups, with the reduction, clipping and ZeRO-1 of this backend; built after
        the weights are loaded (ZeRO-1 derives its fp32 master copy from the parameters)."""
        ...

    def save_checkpoint(
        self,
        directory: Path,
        step: int,
        model: CausalLM,
        optimizer: TrainingOptimizer,
        user_content: dict[str, Any],
        *,
        keep_last: int,
        xser: bool,
    ) -> Path:
        """Every rank writes its part of `step`'s checkpoint (`training.train.checkpointing`'s layout); it is
        marked done once all have, and older ones beyond `keep_last` are pruned."""
        ...

    def load_weights(self, directory: Path, step: int, model: CausalLM) -> None:
        """The model's weights of a checkpoint, before the optimizer is built."""
        ...

    def load_training_state(self, directory: Path, step: int, optimizer: TrainingOptimizer) -> dict[str, Any]:
        """Optimizer state, schedule and this rank's random generators of a checkpoint; returns the user
        content (step, data position)."""
        ...

    def compilations(self) -> int | None:
        """The graphs this process has compiled so far; None when the backend compiles none."""
        ...

    def graph_counters(self) -> dict[str, int]:
        """Cumulative graph counters for the metrics record (empty when the backend has none)."""
        ...


def training_backend(name: Backend) -> TrainingBackend:
    """The implementation of backend `name` (its module imports the backend's own packages only when used)."""
    module = importlib.import_module(IMPLEMENTATIONS[name])
    implementation: TrainingBackend = module.TRAINING_BACKEND
    return implementation
