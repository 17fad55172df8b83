"""The CPU backend's collectives with their autograd (Megatron's mappings), over the TP group on gloo.

Each is one step forward and one backward (`mapped`); the layers of `training.model.cpu_layers` build on them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx
from torch.distributed import ProcessGroup

from training.model.cpu_groups import tp_group, tp_size


def identity_step(tensor: torch.Tensor, argument: Any) -> torch.Tensor:
    """The tensor as it is (a view, so autograd sees a new node)."""
    return tensor.view_as(tensor)


def all_reduce_step(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The sum over `group`, in a copy (the input stays as it was)."""
    result = tensor.clone()
    dist.all_reduce(result, group=group)
    return result


def _gather_last_dim(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _own_slice(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return tensor.chunk(dist.get_world_size(group), dim=-1)[dist.get_rank(group)].contiguous()


def scaled_step(tensor: torch.Tensor, scale: float) -> torch.Tensor:
    """The tensor times `scale` (the argument is the factor, not a group)."""
    return tensor * scale


# Steps along a sequence dimension: the argument is (group, dimension).
def _gather_along(tensor: torch.Tensor, argument: tuple[ProcessGroup, int]) -> torch.Tensor:
    group, dim = argument
    if dist.get_world_size(group) == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _slice_along(tensor: torch.Tensor, argument: tuple[ProcessGroup, int]) -> torch.Tensor:
    group, dim = argument
    return tensor.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)].contiguous()


def _reduce_scatter_along(tensor: torch.Tensor, argument: tuple[ProcessGroup, int]) -> torch.Tensor:
    # gloo has no reduce-scatter: the sum, then a copy of this rank's slice (the same values and memory as a
    # reduce-scatter's result; a view would keep the whole sum alive)
    return _slice_along(all_reduce_step(tensor, argument[0]), argument).clone()


Step = Callable[[torch.Tensor, Any], torch.Tensor]


class _Mapping(torch.autograd.Function):
    """One collective with its autograd: `forward(tensor, argument)` forward, `backward(grad, argument)` backward.

    The argument is the process group (or, for `scaled_step`, the factor). Megatron's four mappings are pairs of
    the steps above, e.g. copy-to-region = (identity, all-reduce) and gather = (gather, own slice).
    """

    @staticmethod
    def forward(ctx: FunctionCtx, tensor: torch.Tensor, argument: Any, forward: Step, backward: Step) -> torch.Tensor:
        ctx.argument, ctx.backward_step = argument, backward  # type: ignore[attr-defined]
        return forward(tensor, argument)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ctx.backward_step(grad, ctx.argument), None, None, None


def mapped(tensor: torch.Tensor, argument: Any, forward: Step, backward: Step) -> torch.Tensor:
    """`forward(tensor, argument)`, whose gradient is `backward(grad, argument)`."""
    result: torch.Tensor = _Mapping.apply(tensor, argument, forward, backward)  # type: ignore[no-untyped-call]
    return result


def _over_tp(tensor: torch.Tensor, forward: Step, backward: Step) -> torch.Tensor:
    return tensor if tp_size() == 1 else mapped(tensor, tp_group(), forward, backward)


def copy_to_tensor_model_parallel_region(tensor: torch.Tensor, /) -> torch.Tensor:
    return _over_tp(tensor, identity_step, all_reduce_step)


def reduce_from_tensor_model_parallel_region(tensor: torch.Tensor, /) -> torch.Tensor:
    return _over_tp(tensor, all_reduce_step, identity_step)


def gather_from_tensor_model_parallel_region(tensor: torch.Tensor, /) -> torch.Tensor:
    return _over_tp(tensor, _gather_last_dim, _own_slice)


def scatter_to_tensor_model_parallel_region(tensor: torch.Tensor, /) -> torch.Tensor:
    return _over_tp(tensor, _own_slice, _gather_last_dim)


def gather_from_sequence_parallel_region(
    tensor: torch.Tensor, /, sequence_dimension: int = 0, to_model_parallel: bool = True
) -> torch.Tensor:
    backward = _reduce_scatter_along if to_model_parallel else _slice_along
    return mapped(tensor, (tp_group(), sequence_dimension), _gather_along, backward)


def reduce_scatter_to_sequence_parallel_region(tensor: torch.Tensor, /, sequence_dimension: int = 0) -> torch.Tensor:
    return mapped(tensor, (tp_group(), sequence_dimension), _reduce_scatter_along, _gather_along)


class _SequenceGatheredLinears(torch.autograd.Function):
    """x_r^T gathered along the sequence, times each weight; keeps only this rank's slice x_r for backward, which
    gathers it again (as neuronx-distributed's sequence-parallel linears do). `scales` weigh each product's
    share of the input gradient (the replicated K/V heads count 1/multiplier), which is reduce-scattered."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, local: torch.Tensor, dim: int, scales: tuple[float, ...], *weights: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.dim, ctx.scales = dim, scales  # type: ignore[attr-defined]
        ctx.save_for_backward(local, *weights)
        total = _gather_along(local, (tp_group(), dim))
        return tuple(F.linear(total, weight) for weight in weights)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        local, *weights = ctx.saved_tensors
        argument = (tp_group(), ctx.dim)
        total = _gather_along(local, argument)
        flat = total.reshape(-1, total.shape[-1])
        grad_total = torch.zeros_like(total)
        grad_weights = []
        for grad, weight, scale in zip(grads, weights, ctx.scales, strict=True):
            grad_total += (grad @ weight) * scale if scale != 1 else grad @ weight
            grad_weights.append(grad.reshape(-1, grad.shape[-1]).t() @ flat)
        return (_reduce_scatter_along(grad_total, argument), None, None, *grad_weights)


def sequence_gathered_linears(
    local: torch.Tensor, dim: int, weights: tuple[torch.Tensor, ...], scales: tuple[float, ...]
) -> tuple[torch.Tensor, ...]:
    """`local` gathered along `dim` times each weight, keeping only `local` for backward."""
    result: tuple[torch.Tensor, ...] = _SequenceGatheredLinears.apply(local, dim, scales, *weights)  # type: ignore[no-untyped-call]
    return result
