"""What every backend's pipeline-parallel schedule shares: the interface the loop calls, and the carry.

Names: "pp" is pipeline parallelism (a model's layers cut into stages, one per rank of a PP group), as
`pp_schedule` (this module: what a schedule is) and the backends' schedules in `cpu_training` (1F1B over gloo)
and `neuron_training` (neuronx-distributed's `NxDPPModel`). "pipeline" in a module name is the Slurm job graph
(`training.pipeline`) only.

Between stages travel the hidden states and, for Mixtral, the router balance loss's running sums (`StageCarry`),
as a fixed list of tensors (`flat`, `carry_of`), so the loss, and every gradient, equal the unstaged model's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from training.model import parallel
from training.model.transformer import CausalLM, StageCarry

Batches = Sequence[tuple[torch.Tensor, torch.Tensor]]  # one optimizer step's micro batches: (ids, targets)


@dataclass
class StepResult:
    loss_sum: torch.Tensor  # sum of the micro batches' losses (last stage; zero elsewhere)
    dropped: torch.Tensor | None  # this stage's dropped expert choices (capacity dispatch), all micro batches


class PPSchedule(Protocol):
    """One optimizer step's micro batches through this rank's stage, and validation, on any backend."""

    def train_step(self, batches: Batches) -> StepResult: ...

    def forward_only(self, batches: Batches) -> torch.Tensor:
        """The language-model loss (no balance loss) summed over the micro batches, without gradients; on the
        last stage, zero elsewhere."""
        ...


@dataclass(frozen=True)
class CarryShape:
    """What a stage receives from the previous one, to allocate the receive buffers."""

    hidden: tuple[int, ...]
    dtype: torch.dtype
    experts: int  # 0: no balance sums travel

    def buffers(self, device: torch.device) -> list[torch.Tensor]:
        hidden = torch.empty(self.hidden, dtype=self.dtype, device=device)
        if not self.experts:
            return [hidden]
        chosen = torch.empty(self.experts, device=device)
        probability = torch.empty(self.experts, device=device)
        return [hidden, chosen, probability, torch.empty((), device=device)]


def carry_shape(model: CausalLM, micro: int, seq_len: int) -> CarryShape:
    h, tp = model.spec.hidden_size, model.parallelism.tp
    hidden = (seq_len // tp, micro, h) if model.execution.sequence_parallel else (micro, seq_len, h)
    experts = model.spec.num_experts if model.router_aux_loss else 0
    return CarryShape(hidden, model.parameter_dtype, experts)


def flat(carry: StageCarry) -> list[torch.Tensor]:
    """A carry as the tensors that travel, in a fixed order (the inverse of `carry_of`)."""
    return [carry.hidden] if carry.balance is None else [carry.hidden, *carry.balance]


def carry_of(tensors: Sequence[torch.Tensor]) -> StageCarry:
    hidden, *balance = tensors
    return StageCarry(hidden, None if not balance else (balance[0], balance[1], balance[2]))


def from_last_stage(value: torch.Tensor) -> torch.Tensor:
    """The last stage's value on every stage of this rank's pipeline (for logging on global rank 0); every
    other stage holds zero. A sum over the stages, not a broadcast: torch-xla's process groups reduce but do
    not broadcast."""
    return over_stages(value)


def over_stages(value: torch.Tensor) -> torch.Tensor:
    """The sum of every stage's value."""
    if parallel.pp_size() == 1:
        return value
    value = value.clone()
    dist.all_reduce(value, group=parallel.pp_group())
    return value
