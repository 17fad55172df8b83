"""CPU backend of `training.model.parallel`: torch.distributed on gloo, the collectives as autograd functions.

Each layer computes what its neuronx-distributed namesake computes, forward and backward, so a model
sharded over N gloo processes gives the single-process logits and, merged with the layout's rules, the
single-process gradients. This is the backend the tests exercise.

This module is the backend the facade loads: every declared name, implemented here (device, steps,
building a model) or in `cpu_groups` (the process groups), `cpu_collectives` (the autograd collectives) and
`cpu_layers` (layers, loss, memory savers), and `resolve`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from training.model.cpu_collectives import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from training.model.cpu_groups import (
    destroy,
    dp_group,
    dp_rank,
    dp_size,
    initialize,
    pp_group,
    pp_rank,
    pp_size,
    tp_group,
    tp_rank,
    tp_size,
)
from training.model.cpu_layers import (
    ColumnParallelLinear,
    GQAQKVColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
    apply_activation_checkpointing,
    nki_flash_attn_func,
    vocab_parallel_cross_entropy,
)

if TYPE_CHECKING:
    from training.model.parallel import Declaration

__all__ = [
    "ColumnParallelLinear",
    "GQAQKVColumnParallelLinear",
    "ParallelEmbedding",
    "RowParallelLinear",
    "add_step_closure",
    "apply_activation_checkpointing",
    "complete_materialized",
    "copy_to_tensor_model_parallel_region",
    "destroy",
    "device",
    "dp_group",
    "dp_rank",
    "dp_size",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "init_on_device",
    "initialize",
    "mark_step",
    "move_model_to_device",
    "nki_flash_attn_func",
    "pp_group",
    "pp_rank",
    "pp_size",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "rendezvous",
    "resolve",
    "scatter_to_tensor_model_parallel_region",
    "set_tensor_model_parallel_attributes",
    "tp_group",
    "tp_rank",
    "tp_size",
    "vocab_parallel_cross_entropy",
]


def resolve(declaration: Declaration) -> Callable[..., Any]:
    """The namesake of a declared facade name in this module (a class or a function with its exact signature)."""
    implementation: Callable[..., Any] = globals()[declaration.name]
    return implementation


def device() -> torch.device:
    return torch.device("cpu")


def mark_step() -> None:
    """Eager execution: nothing to cut."""


def add_step_closure(closure: Callable[..., Any], args: tuple[Any, ...] = ()) -> None:
    """Eager execution: the values are ready now."""
    closure(*args)


def rendezvous(tag: str, /, payload: bytes = b"") -> Any:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return [payload]


def move_model_to_device(model: nn.Module, device: torch.device) -> None:
    model.to(device)


@contextmanager
def init_on_device(
    device: torch.device, include_buffers: bool = False, force_custom_init_on_device: bool = False
) -> Iterator[None]:
    """`nn.Module.register_parameter` (and `register_buffer` with `include_buffers`) moving what is registered
    to `device`, as neuronx-distributed's own implementation does; the parameter's attributes are kept, and
    one already there (a tied weight assigned again) stays the same tensor. This backend's layers skip their
    initialisation when their weight lands on the meta device, as NxD's do."""
    del force_custom_init_on_device  # chooses between NxD's implementations; this is the only one here
    register_parameter, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer

    def move_parameter(module: nn.Module, name: str, parameter: nn.Parameter | None) -> None:
        register_parameter(module, name, parameter)
        if parameter is not None and parameter.device != device:
            moved = nn.Parameter(parameter.detach().to(device), parameter.requires_grad)
            moved.__dict__.update(parameter.__dict__)
            module._parameters[name] = moved

    def move_buffer(module: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        register_buffer(module, name, tensor, persistent)
        if tensor is not None:
            module._buffers[name] = tensor.to(device)

    # setattr: the replacements are plain functions of the module, which mypy would not take for the methods
    setattr(nn.Module, "register_parameter", move_parameter)  # noqa: B010
    if include_buffers:
        setattr(nn.Module, "register_buffer", move_buffer)  # noqa: B010
    try:
        yield
    finally:
        setattr(nn.Module, "register_parameter", register_parameter)  # noqa: B010
        setattr(nn.Module, "register_buffer", register_buffer)  # noqa: B010


def complete_materialized(model: nn.Module) -> None:
    """Nothing: this backend's layers set nothing up when they initialise (see `training.model.parallel`)."""


def set_tensor_model_parallel_attributes(
    tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int, num_partitions: int = -1
) -> None:
    """The same attributes neuronx-distributed sets; this backend's gradient norm uses the layout rules instead."""
    for name, value in (("tensor_model_parallel", is_parallel), ("partition_dim", dim), ("partition_stride", stride)):
        setattr(tensor, name, value)
    tensor.num_partitions = num_partitions if num_partitions > 0 else tp_size()  # type: ignore[attr-defined]
