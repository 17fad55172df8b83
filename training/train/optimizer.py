"""AdamW with the reference job's settings, its learning-rate schedule, gradient clipping and ZeRO-1.

On Neuron, neuronx-distributed's optimizer wrapper does the data-parallel reduction, the TP-aware clipping
and ZeRO-1 (with fp32 master weights, derived from the parameters when the wrapper is built: so the
pretrained weights are loaded first). On CPU the same steps are done here with torch.distributed, and
ZeRO-1 shards the optimizer state over the data-parallel ranks with torch's ZeroRedundancyOptimizer.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from training.config.recipe import OptimizerSection, ScheduleSection
from training.formats.layouts import replicated_targets
from training.model import parallel
from training.model.transformer import CausalLM


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


class TrainingOptimizer:
    """One optimizer step from the accumulated gradients: DP average, clip, update. Returns the grad norm."""

    def __init__(self, model: CausalLM, settings: OptimizerSection, schedule: ScheduleSection, steps: int) -> None:
        self.model, self.settings = model, settings
        groups = parameter_groups(model, settings.weight_decay)
        defaults: dict[str, Any] = {"lr": settings.lr, "betas": settings.betas, "eps": settings.eps}
        self.inner: Any
        if parallel.backend() == "neuron":
            self.inner = _neuron_optimizer(groups, settings, defaults)
        elif settings.zero1 and parallel.dp_size() > 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.inner = ZeroRedundancyOptimizer(
                groups, optimizer_class=torch.optim.AdamW, process_group=parallel.dp_group(), **defaults
            )
        else:
            self.inner = torch.optim.AdamW(groups, **defaults)
        peak = settings.lr
        self.scheduler = LambdaLR(self.inner, lambda index: learning_rate(index + 1, peak, schedule, steps) / peak)
        replicated = replicated_targets(model.spec, model.parallelism, "nxd")
        names = dict(model.named_parameters())
        self._sharded = [p for n, p in names.items() if n not in replicated or parallel.tp_size() == 1]
        self._replicated = [p for n, p in names.items() if n in replicated and parallel.tp_size() > 1]

    @property
    def lr(self) -> float:
        return float(self.inner.param_groups[0]["lr"])

    def step(self) -> float:
        if parallel.backend() == "neuron":
            self.inner.step()  # reduces over DP, clips with the TP-aware norm, updates
            norm = float(self.inner.grad_norm) if self.inner.grad_norm is not None else float("nan")
        else:
            self._average_over_data_parallel()
            norm = self._clip()
            self.inner.step()
        self.scheduler.step()
        self.inner.zero_grad(set_to_none=True)
        return norm

    def _average_over_data_parallel(self) -> None:
        if parallel.dp_size() == 1:
            return
        for parameter in self.model.parameters():
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
        norm = float((sharded + squares(self._replicated)).sqrt())
        if self.settings.grad_clip > 0 and norm > self.settings.grad_clip:
            scale = self.settings.grad_clip / (norm + 1e-6)
            for parameter in self.model.parameters():
                if parameter.grad is not None:
                    parameter.grad.mul_(scale)
        return norm

    def _local(self) -> Any:
        """The optimizer holding this rank's state: the local shard of torch's ZeRO-1 wrapper on CPU."""
        return getattr(self.inner, "optim", self.inner) if parallel.backend() == "cpu" else self.inner

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (its ZeRO-1 shard when sharded)."""
        return dict(self._local().state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._local().load_state_dict(state)


def _neuron_optimizer(groups: list[dict[str, Any]], settings: OptimizerSection, defaults: dict[str, Any]) -> Any:
    """neuronx-distributed's optimizer wrapper (ZeRO-1 with fp32 master weights and grad accumulation)."""
    from neuronx_distributed.trainer import initialize_parallel_optimizer, neuronx_distributed_config

    config = neuronx_distributed_config(
        tensor_parallel_size=parallel.tp_size(),
        optimizer_config={
            "zero_one_enabled": settings.zero1,
            "grad_clipping": settings.grad_clip > 0,
            "max_grad_norm": settings.grad_clip,
        },
        mixed_precision_config={
            "use_master_weights": settings.zero1,
            "use_fp32_grad_acc": settings.zero1,
            "use_master_weights_in_ckpt": False,
        },
    )
    return initialize_parallel_optimizer(config, torch.optim.AdamW, groups, **defaults)
