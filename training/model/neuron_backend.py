"""Neuron backend of `training.model.parallel`: each name is the neuronx-distributed / torch-xla one it stands for.

Kept thin on purpose: no logic beyond argument passing, so what runs on Trainium is neuronx-distributed's
own code. Imported lazily (only on Trainium hosts do `neuronx_distributed` and `torch_xla` exist; their
PyPI entries are placeholders) and reached through `importlib`, so type-checking this file needs neither.

Sources of every name: aws-neuron/neuronx-distributed, `parallel_layers/{parallel_state,layers,mappings,
loss_functions}.py` and `modules/qkv_linear.py`; torch-xla's `core/xla_model.py` and
`distributed/xla_backend.py` (registers the "xla" process-group backend used under torchrun).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

_owns_world = False


def _import(name: str) -> Any:
    return importlib.import_module(name)


def _parallel_state() -> Any:
    return _import("neuronx_distributed.parallel_layers.parallel_state")


def _layers() -> Any:
    return _import("neuronx_distributed.parallel_layers.layers")


def _mappings() -> Any:
    return _import("neuronx_distributed.parallel_layers.mappings")


def _xla_model() -> Any:
    return _import("torch_xla.core.xla_model")


def initialize(tp: int) -> None:
    """`init_process_group("xla")` (torchrun's env), then NxD's groups: TP = consecutive ranks, DP = the rest."""
    global _owns_world
    if not dist.is_initialized():
        _import("torch_xla.distributed.xla_backend")
        dist.init_process_group("xla")
        _owns_world = True
    _parallel_state().initialize_model_parallel(tensor_model_parallel_size=tp)


def destroy() -> None:
    global _owns_world
    _parallel_state().destroy_model_parallel()
    if _owns_world:
        dist.destroy_process_group()
        _owns_world = False


def world_rank() -> int:
    return dist.get_rank()


def world_size() -> int:
    return dist.get_world_size()


def tp_rank() -> int:
    rank: int = _parallel_state().get_tensor_model_parallel_rank()
    return rank


def tp_size() -> int:
    size: int = _parallel_state().get_tensor_model_parallel_size()
    return size


def tp_group() -> ProcessGroup:
    group: ProcessGroup = _parallel_state().get_tensor_model_parallel_group()
    return group


def dp_rank() -> int:
    rank: int = _parallel_state().get_data_parallel_rank()
    return rank


def dp_size() -> int:
    size: int = _parallel_state().get_data_parallel_size()
    return size


def dp_group() -> ProcessGroup:
    group: ProcessGroup = _parallel_state().get_data_parallel_group()
    return group


def device() -> torch.device:
    xla_device: torch.device = _xla_model().xla_device()
    return xla_device


def mark_step() -> None:
    _xla_model().mark_step()


def ColumnParallelLinear(
    input_size: int,
    output_size: int,
    bias: bool = True,
    gather_output: bool = True,
    dtype: torch.dtype = torch.float32,
    stride: int = 1,
) -> nn.Module:
    layer: nn.Module = _layers().ColumnParallelLinear(
        input_size, output_size, bias=bias, gather_output=gather_output, dtype=dtype, stride=stride
    )
    return layer


def RowParallelLinear(
    input_size: int,
    output_size: int,
    bias: bool = True,
    input_is_parallel: bool = False,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    layer: nn.Module = _layers().RowParallelLinear(
        input_size, output_size, bias=bias, input_is_parallel=input_is_parallel, dtype=dtype
    )
    return layer


def ParallelEmbedding(
    num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, dtype: torch.dtype = torch.float32
) -> nn.Module:
    layer: nn.Module = _layers().ParallelEmbedding(num_embeddings, embedding_dim, padding_idx=padding_idx, dtype=dtype)
    return layer


def GQAQKVColumnParallelLinear(
    input_size: int,
    output_sizes: list[int],
    bias: bool = True,
    gather_output: bool = True,
    dtype: torch.dtype = torch.float32,
    kv_size_multiplier: int = 1,
    fuse_qkv: bool = True,
) -> nn.Module:
    module = _import("neuronx_distributed.modules.qkv_linear")
    layer: nn.Module = module.GQAQKVColumnParallelLinear(
        input_size,
        output_sizes,
        bias=bias,
        gather_output=gather_output,
        dtype=dtype,
        kv_size_multiplier=kv_size_multiplier,
        fuse_qkv=fuse_qkv,
    )
    return layer


def parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # NxD's version subtracts the maximum from its input in place; the caller's logits stay untouched.
    losses: torch.Tensor = _import("neuronx_distributed.parallel_layers.loss_functions").parallel_cross_entropy(
        vocab_parallel_logits.clone(), target
    )
    return losses


def copy_to_tensor_model_parallel_region(tensor: torch.Tensor) -> torch.Tensor:
    result: torch.Tensor = _mappings().copy_to_tensor_model_parallel_region(tensor)
    return result


def reduce_from_tensor_model_parallel_region(tensor: torch.Tensor) -> torch.Tensor:
    result: torch.Tensor = _mappings().reduce_from_tensor_model_parallel_region(tensor)
    return result


def gather_from_tensor_model_parallel_region(tensor: torch.Tensor) -> torch.Tensor:
    result: torch.Tensor = _mappings().gather_from_tensor_model_parallel_region(tensor)
    return result


def scatter_to_tensor_model_parallel_region(tensor: torch.Tensor) -> torch.Tensor:
    result: torch.Tensor = _mappings().scatter_to_tensor_model_parallel_region(tensor)
    return result
