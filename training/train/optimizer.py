"""AdamW with the reference job's settings, its learning-rate schedule, and ZeRO-1 where it shards.

The backend-specific part of a step (the data-parallel reduction, the TP-aware clipping, ZeRO-1, the master
weights) is the training backend's (`training.train.backend.OptimizerCore`): neuronx-distributed's optimizer
wrapper on Neuron, torch.distributed and torch's ZeroRedundancyOptimizer on CPU. The schedule, the parameter
groups and the learning rate are the same on every backend, here.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from training.config.recipe import OptimizerSection, Precision, Recipe, ScheduleSection
from training.formats.layouts import replicated_targets
from training.model import parallel
from training.model.transformer import CausalLM

if TYPE_CHECKING:
    from training.train.backend import TrainingBackend

log = logging.getLogger(__name__)


def learning_rate(step: int, peak: float, schedule: ScheduleSection, total_steps: int) -> float:
    """Learning rate of optimizer step `step` (1-based): linear warmup from peak/warmup, then decay to min_lr."""
    warmup = schedule.warmup_steps
    if step <= warmup:
        return peak * step / warmup
    if schedule.decay == "constant":
        return peak
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    shape = 1.0 - progress if schedule.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return schedule.min_lr + (peak - schedule.min_lr) * shape


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on weight matrices only: none on biases and norms (as the reference job)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, parameter in model.named_parameters():
        (no_decay if name.endswith(("bias", "norm.weight")) else decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


CAPTURABLE_LR_FLOOR = 1e-12


class Schedule:
    """The learning rate of each step, set on the optimizer before the step; its state is the step count.

    On Neuron the optimizer's learning rate is a one-element device tensor, overwritten from a host tensor: the
    value is then an input of the step's graph. As a Python float it would reach the graph as a scalar, and
    torch-xla compiles the scalars 0 and 1 in as constants, so a schedule that decays to 0 would compile a new
    graph for its last step (minutes on Trainium).
    """

    def __init__(self, optimizer: Any, learning_rate_of_step: Callable[[int], float]) -> None:
        self.optimizer, self.learning_rate_of_step = optimizer, learning_rate_of_step
        self.last_epoch = 0  # steps taken (the name NxD's checkpointing and torch's schedulers use)
        self._apply()

    def current(self) -> float:
        """The learning rate of the next step (1-based steps)."""
        return self.learning_rate_of_step(self.last_epoch + 1)

    def step(self) -> None:
        self.last_epoch += 1
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_epoch = int(state["last_epoch"])
        self._apply()

    def _apply(self) -> None:
        value = self.current()
        for group in self.optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                # AdamW's capturable form divides by the step size: an lr of exactly 0 turns every weight whose
                # second moment is still 0 (an embedding row never seen) into NaN. 1e-12 moves no fp32 weight.
                group["lr"].copy_(torch.tensor([max(value, CAPTURABLE_LR_FLOOR)], dtype=group["lr"].dtype))
            else:
                group["lr"] = value


class TrainingOptimizer:
    """One optimizer step from the accumulated gradients: the backend's part (sequence-parallel sums, DP
    average, clip, update: `TrainingBackend.optimizer`), then the schedule's learning rate for the next.

    `precision` picks the regime (`training.config.precision`), which each backend's optimizer implements.
    """

    def __init__(
        self,
        model: CausalLM,
        settings: OptimizerSection,
        schedule: ScheduleSection,
        steps: int,
        *,
        backend: TrainingBackend,
        precision: Precision = "fp32",
        seed: int = 0,
    ) -> None:
        self.model, self.settings = model, settings
        groups = parameter_groups(model, settings.weight_decay)
        self.core = backend.optimizer(model, groups, settings, precision=precision, seed=seed)
        self.inner: Any = self.core.inner
        self.master = self.core.master
        self.scheduler = Schedule(self.inner, lambda step: learning_rate(step, settings.lr, schedule, steps))

    @property
    def lr(self) -> float:
        """The learning rate of the next step, from the schedule (never read back from the device)."""
        return self.scheduler.current()

    def step(self) -> torch.Tensor:
        """Update the parameters; the gradient norm before clipping, as a tensor on the device (reading it on
        Neuron before the step's graph has run would run a graph of its own)."""
        norm = self.core.step()
        self.scheduler.step()
        self.inner.zero_grad(set_to_none=True)
        return norm

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (its ZeRO-1 shard when sharded), with the fp32 master weights where the
        backend keeps them here (so a resumed run continues from them, not from the rounded bf16 weights)."""
        return self.core.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.core.load_state_dict(state)


def split_by_replication(
    model: CausalLM, parameters: dict[str, nn.Parameter]
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The trained tensors (by the model's parameter names) split into this TP rank's shards and the ones every TP
    rank holds whole (`training.formats.layouts.replicated_targets`; at TP 1 all count as shards)."""
    replicated = replicated_targets(model.spec, model.parallelism, "nxd")
    whole = parallel.tp_size() > 1
    sharded = [p for name, p in parameters.items() if name not in replicated or not whole]
    return sharded, [p for name, p in parameters.items() if name in replicated and whole]


def clip_by_global_norm(
    sharded: list[nn.Parameter], replicated: list[nn.Parameter], grad_clip: float, *, sharded_over_dp: bool
) -> float:
    """The model's global L2 gradient norm, from this rank's tensors: TP shards summed over TP, the replicated ones
    counted once, the stages summed; with `sharded_over_dp` (FSDP2: each rank holds a slice of every gradient) the
    slices summed over DP first. Gradients are scaled down to `grad_clip` when it is positive and exceeded."""

    def squares(parameters: list[nn.Parameter]) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64)
        for parameter in parameters:
            if parameter.grad is not None:
                total += parallel.local_view(parameter.grad).detach().double().pow(2).sum().cpu()
        return total

    tp_sums, whole = squares(sharded), squares(replicated)
    if sharded_over_dp and parallel.dp_size() > 1:
        both = torch.stack([tp_sums, whole])
        dist.all_reduce(both, group=parallel.dp_group())
        tp_sums, whole = both[0], both[1]
    if parallel.tp_size() > 1:
        dist.all_reduce(tp_sums, group=parallel.tp_group())
    stage = tp_sums + whole
    if parallel.pp_size() > 1:  # every stage holds other parameters
        dist.all_reduce(stage, group=parallel.pp_group())
    norm = float(stage.sqrt())
    if grad_clip > 0 and norm > grad_clip:
        scale = grad_clip / (norm + 1e-6)
        for parameter in sharded + replicated:
            if parameter.grad is not None:
                parallel.local_view(parameter.grad).mul_(scale)
    return norm


def zero1_where_it_shards(recipe: Recipe, dp: int) -> Recipe:
    """The recipe with `optimizer.zero1` off when data parallelism is 1, said in one log line.

    ZeRO-1 shards the optimizer state over the data-parallel ranks: with one there is nothing to shard, only
    collectives over single-rank groups and one more copy of the weights and gradients (fp32 master shard and
    reduced gradient: about 3 GB per NeuronCore for Mixtral 8x7B at TP 32 x PP 2). neuronx-distributed's
    Mixtral launcher turns it off the same way when DP is 1.
    """
    if not recipe.optimizer.zero1 or dp > 1:
        return recipe
    log.info("optimizer.zero1: off for this run: data parallelism is 1, so there is no optimizer state to shard")
    return recipe.model_copy(update={"optimizer": recipe.optimizer.model_copy(update={"zero1": False})})
