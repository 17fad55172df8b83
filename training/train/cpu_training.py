"""The CPU backend's training services (`training.train.backend.TrainingBackend`): torch.distributed over gloo.

Pipeline parallelism runs the 1F1B schedule over gloo point-to-point messages (`training.train.p2p_schedule`).

The optimizer step sums the sequence-parallel gradients over TP, averages over data parallelism, clips by the
global norm and updates; ZeRO-1 shards the optimizer state over the data-parallel ranks with torch's
ZeroRedundancyOptimizer, `bf16-mixed` keeps fp32 master weights and `bf16-sr` rounds stochastically
(`training.train.cpu_precision`). Checkpoints are plain torch.save rank files in neuronx-distributed's layout
(`training.train.checkpointing`), every file read back the safe way and checked before any state changes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from training.config.backends import Backend
from training.config.model import ModelSpec, Parallelism
from training.config.recipe import OptimizerSection, Precision, Recipe
from training.errors import UserError
from training.formats.lazy import shown
from training.formats.sharded import nxd_rank_file
from training.model import parallel
from training.model.transformer import CausalLM
from training.train.backend import TrainingBackend
from training.train.checkpointing import (
    finish_saving,
    load_mapping,
    load_plain,
    optimizer_file,
    read_position,
    restore_rng_of,
    save_atomically,
    start_saving,
    step_directory,
)
from training.train.cpu_precision import MasterWeights, StochasticRoundingAdamW
from training.train.optimizer import TrainingOptimizer, clip_by_global_norm, split_by_replication
from training.train.p2p_schedule import OneFOneB
from training.train.pp_schedule import PPSchedule, carry_shape

# --- the optimizer's backend part -----------------------------------------------------------------------------


class CpuOptimizer:
    """AdamW (or the stochastically rounding one) over the parameter groups, with master weights under
    bf16-mixed and torch's ZeRO-1 when asked and data parallelism shards."""

    def __init__(
        self,
        model: CausalLM,
        groups: list[dict[str, Any]],
        settings: OptimizerSection,
        *,
        precision: Precision,
        seed: int,
    ) -> None:
        self.settings = settings
        defaults: dict[str, Any] = {"lr": settings.lr, "betas": settings.betas, "eps": settings.eps}
        self.master = MasterWeights(model.parameters()) if precision == "bf16-mixed" else None
        if self.master is not None:
            master = self.master
            groups = [{**group, "params": [master.of(p) for p in group["params"]]} for group in groups]
        optimizer_class: Any = torch.optim.AdamW
        if precision == "bf16-sr":
            optimizer_class, defaults = StochasticRoundingAdamW, {**defaults, "seed": seed}
        self.inner: Any
        if settings.zero1 and parallel.dp_size() > 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.inner = ZeroRedundancyOptimizer(
                groups, optimizer_class=optimizer_class, process_group=parallel.dp_group(), **defaults
            )
        else:
            self.inner = optimizer_class(groups, **defaults)
        names = {name: self._trained(p) for name, p in model.named_parameters()}
        self.sharded, self.replicated = split_by_replication(model, names)

    def _trained(self, parameter: nn.Parameter) -> nn.Parameter:
        """The tensor the optimizer updates for a model parameter (its fp32 master copy under bf16-mixed)."""
        return self.master.of(parameter) if self.master is not None else parameter

    def step(self) -> torch.Tensor:
        trained = self.sharded + self.replicated
        parallel.sum_sequence_parallel_gradients(trained)
        self._average_over_data_parallel(trained)
        clipped = clip_by_global_norm(self.sharded, self.replicated, self.settings.grad_clip, sharded_over_dp=False)
        norm = torch.tensor(clipped, dtype=torch.float64)
        self.inner.step()
        if self.master is not None:
            self.master.copy_to_model()
        return norm

    def _average_over_data_parallel(self, trained: list[nn.Parameter]) -> None:
        if parallel.dp_size() == 1:
            return
        for parameter in trained:
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad, group=parallel.dp_group())
                parameter.grad /= parallel.dp_size()

    def _local(self) -> Any:
        """The optimizer holding this rank's state: the local shard of torch's ZeRO-1 wrapper."""
        return getattr(self.inner, "optim", self.inner)

    def state_dict(self) -> dict[str, Any]:
        state = dict(self._local().state_dict())
        if self.master is not None:
            state["master_weights"] = self.master.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        masters = state.pop("master_weights", None)
        if self.master is not None:
            if masters is None:
                raise UserError(
                    "the checkpoint's optimizer state has no fp32 master weights (saved under another precision)"
                )
            self.master.load_state_dict(masters)
        self._local().load_state_dict(state)


# --- checkpoint rank files ------------------------------------------------------------------------------------


def _checked_weights(path: Path, model: CausalLM) -> dict[str, Any]:
    state = load_plain(path)
    expected = model.state_dict()
    if not isinstance(state, dict) or set(state) != set(expected):
        names = sorted(set(expected) ^ set(state)) if isinstance(state, dict) else []
        detail = f" (differs in {', '.join(map(shown, names[:3]))})" if names else ""
        raise UserError(f"{path}: not this model's state dict{detail}; allowed: a checkpoint of this recipe's model")
    for name, tensor in expected.items():
        loaded = state[name]
        if not isinstance(loaded, torch.Tensor) or loaded.shape != tensor.shape:
            found = list(loaded.shape) if isinstance(loaded, torch.Tensor) else type(loaded).__name__
            raise UserError(f"{path}: {name}: {found} is not allowed; allowed: a tensor of shape {list(tensor.shape)}")
    return state


class CpuTraining:
    """The CPU backend's `TrainingBackend` (module docstring)."""

    name: Backend = "cpu"
    compiles_graphs = False

    def check_layout(self, spec: ModelSpec, parallelism: Parallelism) -> None:
        """Any layout the configuration allows runs here."""

    def parallel_options(self, recipe: Recipe) -> dict[str, Any]:
        return {}

    def pp_schedule(self, model: CausalLM, micro_batches: int, micro: int, seq_len: int, *, zero1: bool) -> PPSchedule:
        return OneFOneB(model, carry_shape(model, micro, seq_len))

    def optimizer(
        self,
        model: CausalLM,
        groups: list[dict[str, Any]],
        settings: OptimizerSection,
        *,
        precision: Precision,
        seed: int,
    ) -> CpuOptimizer:
        return CpuOptimizer(model, groups, settings, precision=precision, seed=seed)

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
        target = start_saving(directory, step)
        tp, dp, pp = parallel.tp_rank(), parallel.dp_rank(), parallel.pp_rank()
        if dp == 0:
            save_atomically(model.state_dict(), nxd_rank_file(target, tp, pp))
        save_atomically(optimizer.state_dict(), optimizer_file(target))
        finish_saving(directory, target, optimizer.scheduler.state_dict(), user_content, keep_last)
        return target

    def load_weights(self, directory: Path, step: int, model: CausalLM) -> None:
        path = nxd_rank_file(step_directory(directory, step), parallel.tp_rank(), parallel.pp_rank())
        model.load_state_dict(_checked_weights(path, model))

    def load_training_state(self, directory: Path, step: int, optimizer: TrainingOptimizer) -> dict[str, Any]:
        target = step_directory(directory, step)
        # Every file is read and checked before any state is changed.
        optimizer_state = load_mapping(optimizer_file(target), "the optimizer's state dict")
        scheduler_state, content = read_position(target)
        optimizer.load_state_dict(optimizer_state)
        optimizer.scheduler.load_state_dict(scheduler_state)
        restore_rng_of(target)
        return content

    def compilations(self) -> int | None:
        return None  # nothing is compiled

    def graph_counters(self) -> dict[str, int]:
        return {}


TRAINING_BACKEND: TrainingBackend = CpuTraining()
