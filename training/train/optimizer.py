"""AdamW with the reference job's settings, its learning-rate schedule, gradient clipping and ZeRO-1.

On Neuron, neuronx-distributed's optimizer wrapper does the data-parallel reduction, the TP-aware clipping
and ZeRO-1 (with fp32 master weights, derived from the parameters when the wrapper is built: so the
pretrained weights are loaded first). On CPU the same steps are done here with torch.distributed, and
ZeRO-1 shards the optimizer state over the data-parallel ranks with torch's ZeroRedundancyOptimizer.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from training.config.precision import neuron_mixed_precision_config
from training.config.recipe import OptimizerSection, Precision, Recipe, ScheduleSection
from training.errors import UserError
from training.formats.layouts import replicated_targets
from training.model import parallel
from training.model.transformer import CausalLM
from training.train.cpu_precision import MasterWeights, StochasticRoundingAdamW

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
    """One optimizer step from the accumulated gradients: sequence-parallel sums, DP average, clip, update.

    `precision` picks the regime (`training.config.precision`): on CPU, bf16-mixed updates fp32 master copies
    and bf16-sr a stochastically rounding AdamW; on Neuron, NxD's optimizer does either from its configuration.
    """

    def __init__(
        self,
        model: CausalLM,
        settings: OptimizerSection,
        schedule: ScheduleSection,
        steps: int,
        *,
        precision: Precision = "fp32",
        seed: int = 0,
    ) -> None:
        self.model, self.settings = model, settings
        groups = parameter_groups(model, settings.weight_decay)
        defaults: dict[str, Any] = {"lr": settings.lr, "betas": settings.betas, "eps": settings.eps}
        self.master: MasterWeights | None = None
        self.inner: Any
        if parallel.backend() == "neuron":
            self.inner = _neuron_optimizer(groups, settings, defaults, precision)
        else:
            if precision == "bf16-mixed":
                self.master = MasterWeights(model.parameters())
                groups = [{**group, "params": [self.master.of(p) for p in group["params"]]} for group in groups]
            optimizer_class: Any = torch.optim.AdamW
            if precision == "bf16-sr":
                optimizer_class, defaults = StochasticRoundingAdamW, {**defaults, "seed": seed}
            if settings.zero1 and parallel.dp_size() > 1:
                from torch.distributed.optim import ZeroRedundancyOptimizer

                self.inner = ZeroRedundancyOptimizer(
                    groups, optimizer_class=optimizer_class, process_group=parallel.dp_group(), **defaults
                )
            else:
                self.inner = optimizer_class(groups, **defaults)
        self.scheduler = Schedule(self.inner, lambda step: learning_rate(step, settings.lr, schedule, steps))
        replicated = replicated_targets(model.spec, model.parallelism, "nxd")
        names = {name: self._trained(p) for name, p in model.named_parameters()}
        self._sharded = [p for n, p in names.items() if n not in replicated or parallel.tp_size() == 1]
        self._replicated = [p for n, p in names.items() if n in replicated and parallel.tp_size() > 1]

    def _trained(self, parameter: nn.Parameter) -> nn.Parameter:
        """The tensor the optimizer updates for a model parameter (its fp32 master copy under bf16-mixed)."""
        return self.master.of(parameter) if self.master is not None else parameter

    @property
    def lr(self) -> float:
        """The learning rate of the next step, from the schedule (never read back from the device)."""
        return self.scheduler.current()

    def step(self) -> torch.Tensor:
        """Update the parameters; the gradient norm before clipping, as a tensor on the device (reading it on
        Neuron before the step's graph has run would run a graph of its own)."""
        if parallel.backend() == "neuron":
            self.inner.step()  # reduces over DP, clips with the TP-aware norm, updates
            norm = self.inner.grad_norm if self.inner.grad_norm is not None else torch.tensor(float("nan"))
        else:
            trained = self._sharded + self._replicated
            parallel.sum_sequence_parallel_gradients(trained)
            self._average_over_data_parallel(trained)
            norm = torch.tensor(self._clip(), dtype=torch.float64)
            self.inner.step()
            if self.master is not None:
                self.master.copy_to_model()
        self.scheduler.step()
        self.inner.zero_grad(set_to_none=True)
        return norm

    def _average_over_data_parallel(self, trained: list[nn.Parameter]) -> None:
        if parallel.dp_size() == 1:
            return
        for parameter in trained:
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad, group=parallel.dp_group())
                parameter.grad /= parallel.dp_size()

    def _clip(self) -> float:
        """Global L2 norm over the whole model: sharded parameters summed over TP, replicated ones once."""

        def squares(parameters: list[nn.Parameter]) -> torch.Tensor:
            total = torch.zeros((), dtype=torch.float64)
            for parameter in parameters:
                if parameter.grad is not None:
                    total += parameter.grad.detach().double().pow(2).sum()
            return total

        sharded = squares(self._sharded)
        if parallel.tp_size() > 1:
            dist.all_reduce(sharded, group=parallel.tp_group())
        stage = sharded + squares(self._replicated)
        if parallel.pp_size() > 1:  # every stage holds other parameters
            dist.all_reduce(stage, group=parallel.pp_group())
        norm = float(stage.sqrt())
        if self.settings.grad_clip > 0 and norm > self.settings.grad_clip:
            scale = self.settings.grad_clip / (norm + 1e-6)
            for parameter in self._sharded + self._replicated:
                if parameter.grad is not None:
                    parameter.grad.mul_(scale)
        return norm

    def _local(self) -> Any:
        """The optimizer holding this rank's state: the local shard of torch's ZeRO-1 wrapper on CPU."""
        return getattr(self.inner, "optim", self.inner) if parallel.backend() == "cpu" else self.inner

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (its ZeRO-1 shard when sharded), with the fp32 master weights under
        bf16-mixed (so a resumed run continues from them, not from the rounded bf16 weights)."""
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


def neuron_trainer_options(
    settings: OptimizerSection, *, precision: Precision = "bf16-mixed", sequence_parallel: bool = False
) -> dict[str, Any]:
    """neuronx-distributed's trainer configuration for this optimizer (`parallel.initialize(neuron_options=)`).

    `sequence_parallel` makes NxD's optimizer sum the sequence-parallel parameters' gradients over TP first.
    """
    return {
        "sequence_parallel": sequence_parallel,
        "optimizer_config": {
            "zero_one_enabled": settings.zero1,
            "grad_clipping": settings.grad_clip > 0,
            "max_grad_norm": settings.grad_clip,
        },
        "mixed_precision_config": neuron_mixed_precision_config(precision),
    }


def _neuron_optimizer(
    groups: list[dict[str, Any]], settings: OptimizerSection, defaults: dict[str, Any], precision: Precision
) -> Any:
    """neuronx-distributed's optimizer wrapper (ZeRO-1 with fp32 master weights and grad accumulation), built from
    the process's one trainer configuration."""
    from neuronx_distributed.trainer import initialize_parallel_optimizer

    from training.model import neuron_backend

    # The learning rate as a device tensor (see Schedule), which AdamW takes in its capturable form: bias
    # corrections and step counts stay on the device too, nothing is read back during the step.
    # (NxD's CPU mode keeps the parameters on the host, where AdamW has no capturable form: a float there.)
    if parallel.device().type != "cpu":
        learning_rate = torch.tensor([settings.lr], dtype=torch.float32, device=parallel.device())
        defaults = {**defaults, "lr": learning_rate, "foreach": False, "capturable": True}
    if settings.zero1:
        # NxD hands ZeRO-1 `grad_clipping` but never the norm, so torch-xla's default max_norm=1.0 would apply.
        defaults["max_norm"] = settings.grad_clip
        if precision == "bf16-sr":
            # torch-xla's ZeRO-1 keeps its weight shards and AdamW state in fp32 unless told otherwise: bf16-sr
            # keeps them in bf16 (the runtime rounds stochastically), which is what makes it 8 bytes a parameter.
            defaults["optimizer_dtype"] = torch.bfloat16
    return initialize_parallel_optimizer(neuron_backend.trainer_config(), torch.optim.AdamW, groups, **defaults)
