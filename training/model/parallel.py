"""The parallel facade: the model is written once against these names, a backend chosen at start-up runs them.

Two interchangeable backends with the same tensor-parallel semantics:

- `cpu` (`training.model.cpu_backend`): torch.distributed on gloo, autograd functions for the collectives. It is
  what the tests run; forward and backward equal single-process math.
- `neuron` (`training.model.neuron_backend`): each name maps one-to-one onto neuronx-distributed and torch-xla.

Rank arrangement (both backends, as neuronx-distributed's `initialize_model_parallel`): the world is
[DP, TP] row-major, so a TP group is `tp` consecutive global ranks and a DP group is the ranks with the same
TP rank, `tp` apart.

Gradient contract the training loop relies on: after `backward()`, a parameter replicated over the TP group
(norms, the MoE router, a row-parallel bias) holds the same, complete gradient on every TP rank, and a
sharded parameter holds the gradient of its own shard (the replicated K/V heads of the GQA layer hold the
complete gradient of their head on every replica, as neuronx-distributed does). The loop therefore only
averages over the DP group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol

import torch
from torch import nn

from training.errors import UserError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

Backend = Literal["cpu", "neuron"]
BACKENDS: tuple[Backend, ...] = ("cpu", "neuron")
IGNORE_INDEX = -100  # label of a position that has no target (prompt tokens, block padding)


class ParallelBackend(Protocol):
    """What a backend module provides; `training.model.cpu_backend` and `training.model.neuron_backend` conform."""

    def initialize(self, tp: int) -> None: ...
    def destroy(self) -> None: ...
    def world_rank(self) -> int: ...
    def world_size(self) -> int: ...
    def tp_rank(self) -> int: ...
    def tp_size(self) -> int: ...
    def tp_group(self) -> ProcessGroup: ...
    def dp_rank(self) -> int: ...
    def dp_size(self) -> int: ...
    def dp_group(self) -> ProcessGroup: ...
    def device(self) -> torch.device: ...
    def mark_step(self) -> None: ...

    def ColumnParallelLinear(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = True,
        dtype: torch.dtype = torch.float32,
        stride: int = 1,
    ) -> nn.Module: ...

    def RowParallelLinear(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> nn.Module: ...

    def ParallelEmbedding(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> nn.Module: ...

    def GQAQKVColumnParallelLinear(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = True,
        gather_output: bool = True,
        dtype: torch.dtype = torch.float32,
        kv_size_multiplier: int = 1,
        fuse_qkv: bool = True,
    ) -> nn.Module: ...

    def parallel_cross_entropy(self, vocab_parallel_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor: ...
    def copy_to_tensor_model_parallel_region(self, tensor: torch.Tensor) -> torch.Tensor: ...
    def reduce_from_tensor_model_parallel_region(self, tensor: torch.Tensor) -> torch.Tensor: ...
    def gather_from_tensor_model_parallel_region(self, tensor: torch.Tensor) -> torch.Tensor: ...
    def scatter_to_tensor_model_parallel_region(self, tensor: torch.Tensor) -> torch.Tensor: ...


_active: ParallelBackend | None = None
_active_name: Backend | None = None


def _load(backend: Backend) -> ParallelBackend:
    # Imported on demand: the Neuron backend needs packages that exist only on Trainium hosts.
    if backend == "cpu":
        from training.model import cpu_backend

        return cpu_backend
    from training.model import neuron_backend

    return neuron_backend


def initialize(tp: int = 1, backend: Backend = "cpu") -> None:
    """Start torch.distributed if needed (env:// under torchrun, a one-process world otherwise) and the groups."""
    global _active, _active_name
    if backend not in BACKENDS:
        raise UserError(f"parallel backend {backend!r} is not supported; allowed: {', '.join(BACKENDS)}")
    if _active is not None:
        raise RuntimeError(f"the {_active_name} parallel backend is already initialized; call destroy() first")
    implementation = _load(backend)
    implementation.initialize(tp)
    _active, _active_name = implementation, backend


def destroy() -> None:
    """Tear down the groups (and the process group if `initialize` created it); safe to call twice."""
    global _active, _active_name
    if _active is not None:
        _active.destroy()
    _active, _active_name = None, None


def is_initialized() -> bool:
    return _active is not None


def backend() -> Backend:
    _backend()
    assert _active_name is not None
    return _active_name


def _backend() -> ParallelBackend:
    if _active is None:
        raise RuntimeError("training.model.parallel is not initialized; call parallel.initialize(tp, backend) first")
    return _active


def world_rank() -> int:
    return _backend().world_rank()


def world_size() -> int:
    return _backend().world_size()


def tp_rank() -> int:
    return _backend().tp_rank()


def tp_size() -> int:
    return _backend().tp_size()


def tp_group() -> ProcessGroup:
    return _backend().tp_group()


def dp_rank() -> int:
    return _backend().dp_rank()


def dp_size() -> int:
    return _backend().dp_size()


def dp_group() -> ProcessGroup:
    return _backend().dp_group()


def device() -> torch.device:
    """Where parameters and batches live: the CPU, or this process's NeuronCore (an XLA device)."""
    return _backend().device()


def mark_step() -> None:
    """End of a lazily traced step (cuts and runs the XLA graph on Neuron; nothing on CPU)."""
    _backend().mark_step()


# --- layers: neuronx-distributed's constructor arguments and semantics ------------------------------------


def ColumnParallelLinear(
    input_size: int,
    output_size: int,
    bias: bool = True,
    gather_output: bool = True,
    dtype: torch.dtype = torch.float32,
    stride: int = 1,
) -> nn.Module:
    """y = x A^T + b with A split by rows (output features): rank r holds rows [r*O/tp, (r+1)*O/tp).

    `gather_output=False` leaves each rank with its slice of y. `stride` only shapes neuronx-distributed's
    own random initialisation (interleaved parts such as gate/up); the CPU backend accepts and ignores it.
    The bias is [O] when the output is gathered, else [O/tp].
    """
    return _backend().ColumnParallelLinear(
        input_size, output_size, bias=bias, gather_output=gather_output, dtype=dtype, stride=stride
    )


def RowParallelLinear(
    input_size: int,
    output_size: int,
    bias: bool = True,
    input_is_parallel: bool = False,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """y = sum over ranks of x_r A_r^T, A split by columns; the output is all-reduced, the bias [O] added once."""
    return _backend().RowParallelLinear(
        input_size, output_size, bias=bias, input_is_parallel=input_is_parallel, dtype=dtype
    )


def ParallelEmbedding(
    num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """Vocabulary-parallel lookup: rank r holds rows [r*V/tp, (r+1)*V/tp); the rows are summed over ranks."""
    return _backend().ParallelEmbedding(num_embeddings, embedding_dim, padding_idx=padding_idx, dtype=dtype)


def GQAQKVColumnParallelLinear(
    input_size: int,
    output_sizes: list[int],
    bias: bool = True,
    gather_output: bool = True,
    dtype: torch.dtype = torch.float32,
    kv_size_multiplier: int = 1,
    fuse_qkv: bool = True,
) -> nn.Module:
    """Q, K and V projections; returns (q, k, v). `output_sizes` = [query features, key/value features].

    K and V are repeated `kv_size_multiplier` times and then split over the TP ranks, so a model with fewer
    KV heads than ranks gives every rank one (REFERENCE.md section 5); each rank's query heads belong to its
    own KV heads. Parameters: `weight_q`, `weight_k`, `weight_v`, or `weight_qkv` = cat(q, k, v) per rank
    when `fuse_qkv`.
    """
    return _backend().GQAQKVColumnParallelLinear(
        input_size,
        output_sizes,
        bias=bias,
        gather_output=gather_output,
        dtype=dtype,
        kv_size_multiplier=kv_size_multiplier,
        fuse_qkv=fuse_qkv,
    )


def parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy from this rank's vocabulary slice of the logits ([..., V/tp]) and full labels.

    Positions labelled IGNORE_INDEX (-100) get a loss of 0 here (and no gradient), on both backends;
    averaging over the remaining tokens is the caller's choice. The logits are not modified.
    """
    losses = _backend().parallel_cross_entropy(vocab_parallel_logits, labels)
    return losses * (labels != IGNORE_INDEX).to(losses.dtype)


# --- collectives with their autograd (Megatron's mappings) -----------------------------------------------


def copy_to_tensor_model_parallel_region(tensor: torch.Tensor) -> torch.Tensor:
    """Identity forward; gradients summed over the TP group (entering a region where ranks use partial weights)."""
    return _backend().copy_to_tensor_model_parallel_region(tensor)


def reduce_from_tensor_model_parallel_region(tensor: torch.Tensor) -> torch.Tensor:
    """Partial results summed over the TP group; gradient passed through unchanged."""
    return _backend().reduce_from_tensor_model_parallel_region(tensor)


def gather_from_tensor_model_parallel_region(tensor: torch.Tensor) -> torch.Tensor:
    """Slices concatenated along the last dimension in TP-rank order; the gradient is sliced back."""
    return _backend().gather_from_tensor_model_parallel_region(tensor)


def scatter_to_tensor_model_parallel_region(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's slice of the last dimension; gradients gathered back."""
    return _backend().scatter_to_tensor_model_parallel_region(tensor)
