"""The torch-native backend's layers: the facade's tensor-parallel layers as DTensor placements on the TP mesh.

Each parallel weight is a DTensor parameter sharded as neuronx-distributed shards it (its local tensor is the
rank file's tensor, so loading, the converter and initialisation see the same shards on every backend), and the
layers run through torch's own tensor parallelism:

- column-parallel linear: `ColwiseParallel` (weight `Shard(0)`; input `Replicate`, or `Shard(sequence)` with
  sequence parallelism, which DTensor all-gathers forward and reduce-scatters backward);
- row-parallel linear: `RowwiseParallel` (weight `Shard(1)`; output all-reduced, or reduce-scattered along the
  sequence with sequence parallelism);
- vocabulary-parallel embedding: `RowwiseParallel` on an embedding (weight `Shard(0)`, masked lookup, partial
  sums reduced);
- vocabulary-parallel cross entropy: `loss_parallel` over logits `Shard(-1)`;
- Q/K/V: each weight `Shard(0)` of the repeated K/V tensor, so a KV head's replicas are the rank order the
  generation lays them out in (adjacent on trn2, tiled on trn1: `training.formats.layouts`); the replicas'
  output gradients are summed over the ranks sharing the head, as neuronx-distributed does, so every replica
  holds the head's complete gradient.

Everything the model computes between the layers stays in local tensors (the facade's contract); the MoE's
collectives are the cpu backend's autograd collectives, which run on any torch.distributed process group.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

from training.model.cpu_collectives import all_reduce_step, identity_step, mapped, scaled_step
from training.model.cpu_groups import kv_shared_group, tp_rank, tp_size
from training.model.cpu_layers import divide, init_uniform

_mesh: DeviceMesh | None = None


def use_mesh(mesh: DeviceMesh | None) -> None:
    """The TP mesh the layers distribute over (set by the backend's initialize, cleared by destroy)."""
    global _mesh
    _mesh = mesh


def tp_mesh() -> DeviceMesh:
    assert _mesh is not None, "the torch-native parallel backend is not initialized"
    return _mesh


def distributed(local: torch.Tensor, placement: Placement) -> nn.Parameter:
    """A DTensor parameter whose local tensor is `local`, this rank's shard (or copy) on the TP mesh."""
    # the global shape is inferred: every rank's shard is the same size (the layers divide evenly or refuse)
    tensor = DTensor.from_local(local, tp_mesh(), [placement], run_check=False)
    return nn.Parameter(tensor, requires_grad=True)


def accept_rank_files(module: nn.Module) -> None:
    """`load_state_dict` of this module takes rank files' plain tensors too (this rank's shards, as every other
    backend's state dict holds them): each is wrapped as its DTensor parameter is placed. Called once a layer's
    parameters are final (parallelize_module registers new ones)."""

    def wrap(_module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
        for name, parameter in module.named_parameters(recurse=False):
            key = prefix + name
            value = state.get(key)
            if isinstance(parameter, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                state[key] = DTensor.from_local(
                    value,
                    parameter.device_mesh,
                    parameter.placements,
                    run_check=False,
                    shape=parameter.shape,
                    stride=parameter.stride(),
                )

    module.register_load_state_dict_pre_hook(wrap)  # type: ignore[no-untyped-call]


def place_gradients(module: nn.Module) -> None:
    """Hooks on the module's own DTensor parameters placing their accumulated gradients as the parameters, once
    the model is on its device (moving swaps the tensors, hooks included). DTensor may leave an embedding's gradient
    `Replicate` (each rank then keeps its rows, no communication); the optimizer, FSDP2 and the norm need every
    gradient placed as its weight. (A tensor hook is not called for these leaves; the post-accumulate one is.)"""
    for parameter in module.parameters(recurse=False):
        if isinstance(parameter, DTensor):
            parameter.register_post_accumulate_grad_hook(_place_as_parameter)  # type: ignore[no-untyped-call]
    if isinstance(module, ParallelEmbedding) and module.local_padding is not None:
        module.weight.register_post_accumulate_grad_hook(module.without_padding_gradient)  # type: ignore[no-untyped-call]


def _place_as_parameter(parameter: torch.Tensor) -> None:
    grad, placements = cast(DTensor, parameter.grad), cast(DTensor, parameter).placements
    if grad is not None and grad.placements != placements:
        parameter.grad = grad.redistribute(placements=placements)


def _initialised(shape: tuple[int, ...], dtype: torch.dtype, fan_in: int) -> torch.Tensor:
    """This rank's shard, initialised as the cpu backend's layers initialise theirs (`cpu_layers.init_uniform`)."""
    local = torch.empty(shape, dtype=dtype)
    init_uniform(local, fan_in)
    return local


class ColumnParallelLinear(nn.Linear):
    """`ColwiseParallel`: weight rows split over TP; the output gathered (`Replicate`) or left `Shard(-1)`."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = True,
        dtype: torch.dtype = torch.float32,
        stride: int = 1,
        sequence_parallel_enabled: bool = False,
        sequence_dimension: int | None = None,
    ) -> None:
        del stride  # shapes neuronx-distributed's random initialisation only
        if sequence_parallel_enabled and gather_output:
            raise ValueError("ColumnParallelLinear: sequence_parallel_enabled needs gather_output=False")
        if bias and gather_output:
            raise NotImplementedError("ColumnParallelLinear: bias with gather_output on the torch-native backend")
        super().__init__(input_size, output_size, bias=False, device="meta", dtype=dtype)
        per_rank = divide(output_size, tp_size(), "output size")
        self.weight = distributed(_initialised((per_rank, input_size), dtype, input_size), Shard(0))
        if bias:
            self.bias = distributed(_initialised((per_rank,), dtype, input_size), Shard(0))
        dimension = 0 if sequence_dimension is None else sequence_dimension
        parallelize_module(
            self,
            tp_mesh(),
            ColwiseParallel(
                input_layouts=Shard(dimension) if sequence_parallel_enabled else Replicate(),
                output_layouts=Replicate() if gather_output else Shard(-1),
            ),
        )
        accept_rank_files(self)


class RowParallelLinear(nn.Linear):
    """`RowwiseParallel`: weight columns split over TP; the partial products all-reduced, or reduce-scattered
    along the sequence (`Shard(sequence)`) with sequence parallelism."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = False,
        dtype: torch.dtype = torch.float32,
        sequence_parallel_enabled: bool = False,
        sequence_dimension: int | None = None,
    ) -> None:
        if sequence_parallel_enabled and not input_is_parallel:
            raise RuntimeError("RowParallelLinear: sequence_parallel_enabled needs input_is_parallel=True")
        super().__init__(input_size, output_size, bias=False, device="meta", dtype=dtype)
        per_rank = divide(input_size, tp_size(), "input size")
        self.weight = distributed(_initialised((output_size, per_rank), dtype, input_size), Shard(1))
        if bias:
            self.bias = distributed(_initialised((output_size,), dtype, input_size), Replicate())
        dimension = 0 if sequence_dimension is None else sequence_dimension
        parallelize_module(
            self,
            tp_mesh(),
            RowwiseParallel(
                input_layouts=Shard(-1) if input_is_parallel else Replicate(),
                output_layouts=Shard(dimension) if sequence_parallel_enabled else Replicate(),
            ),
        )
        accept_rank_files(self)


class ParallelEmbedding(nn.Embedding):
    """`RowwiseParallel` on an embedding: vocabulary rows split over TP, each id looked up on the rank holding
    it and the rows summed (reduce-scattered along the sequence with sequence parallelism, which returns the
    facade's sequence-first [S/tp, B, H])."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        dtype: torch.dtype = torch.float32,
        sequence_parallel_enabled: bool = False,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, device="meta", dtype=dtype)
        self.sequence_parallel_enabled = sequence_parallel_enabled
        per_rank = divide(num_embeddings, tp_size(), "vocabulary size")
        local = torch.empty((per_rank, embedding_dim), dtype=dtype)
        if local.device.type != "meta":
            with torch.no_grad():
                local.normal_()
        self.weight = distributed(local, Shard(0))
        # The padding row gets no gradient (as in torch.nn.Embedding), on the rank whose rows include it; DTensor's
        # masked lookup takes no padding index, so the row's gradient is cleared by a hook.
        start = tp_rank() * per_rank
        self.local_padding = (
            padding_idx - start if padding_idx is not None and 0 <= padding_idx - start < per_rank else None
        )
        parallelize_module(
            self,
            tp_mesh(),
            RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1) if sequence_parallel_enabled else Replicate()
            ),
        )
        accept_rank_files(self)
        if sequence_parallel_enabled:
            self.register_forward_hook(_sequence_first)

    def without_padding_gradient(self, weight: torch.Tensor) -> None:
        """The padding row's gradient cleared, on the rank holding it (after `_place_as_parameter`)."""
        if weight.grad is not None:
            cast(DTensor, weight.grad).to_local()[self.local_padding] = 0


def _sequence_first(_module: nn.Module, _inputs: Any, rows: torch.Tensor) -> torch.Tensor:
    """[B, S/tp, H] to neuronx-distributed's sequence-parallel [S/tp, B, H] (after DTensor's own output hook)."""
    return rows.transpose(0, 1).contiguous()


class GQAQKVColumnParallelLinear(nn.Module):
    """Q, K, V: each weight `Shard(0)` over TP (fused: this rank's [q; k; v] rows, `Shard(0)` of the fused
    tensor). The input is `Replicate` (or `Shard(0)` along the sequence, all-gathered), its gradient a `Partial`
    sum DTensor reduces; K and V are repeated `kv_size_multiplier` times before the split (module docstring)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = True,
        gather_output: bool = True,
        dtype: torch.dtype = torch.float32,
        sequence_parallel_enabled: bool = False,
        kv_size_multiplier: int = 1,
        fuse_qkv: bool = True,
    ) -> None:
        super().__init__()
        tp = tp_size()
        if sequence_parallel_enabled and gather_output:
            raise ValueError("GQAQKVColumnParallelLinear: sequence_parallel_enabled needs gather_output=False")
        if tp % kv_size_multiplier:
            raise ValueError(f"kv_size_multiplier {kv_size_multiplier} must divide the tensor-parallel degree {tp}")
        if gather_output:
            raise NotImplementedError("GQAQKVColumnParallelLinear: gather_output on the torch-native backend")
        self.sequence_parallel_enabled, self.fuse_qkv = sequence_parallel_enabled, fuse_qkv
        self.kv_size_multiplier = kv_size_multiplier
        self.q_size = divide(output_sizes[0], tp, "query size")
        self.kv_size = divide(output_sizes[1] * kv_size_multiplier, tp, "replicated key/value size")
        self.kv_group = kv_shared_group(kv_size_multiplier) if kv_size_multiplier > 1 else None
        sizes = {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}
        parts = {"qkv": sum(sizes.values())} if fuse_qkv else sizes
        for name, size in parts.items():
            self.register_parameter(
                f"weight_{name}", distributed(_initialised((size, input_size), dtype, input_size), Shard(0))
            )
            local_bias = _initialised((size,), dtype, input_size) if bias else None
            self.register_parameter(f"bias_{name}", None if local_bias is None else distributed(local_bias, Shard(0)))
        accept_rank_files(self)

    def _local(self, prefix: str) -> list[torch.Tensor | None]:
        if self.fuse_qkv:
            fused = getattr(self, f"{prefix}_qkv")
            if fused is None:
                return [None] * 3
            return list(_local_of(fused).split([self.q_size, self.kv_size, self.kv_size]))  # type: ignore[no-untyped-call]
        return [
            None if getattr(self, f"{prefix}_{n}") is None else _local_of(getattr(self, f"{prefix}_{n}")) for n in "qkv"
        ]

    def forward(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        placement: Placement = Shard(0) if self.sequence_parallel_enabled else Replicate()
        gathered = DTensor.from_local(tensor, tp_mesh(), [placement], run_check=False).redistribute(
            tp_mesh(), [Replicate()]
        )
        # every rank's products use the whole input: their input gradients are partial sums, reduced by DTensor
        full = gathered.to_local(grad_placements=[Partial()])
        (weight_q, weight_k, weight_v), (bias_q, bias_k, bias_v) = self._local("weight"), self._local("bias")
        assert weight_q is not None and weight_k is not None and weight_v is not None
        q = F.linear(full, weight_q, bias_q)
        kv_input = full
        if self.kv_group is not None:  # each head's input gradient counted once over its replicas
            kv_input = mapped(full, 1 / self.kv_size_multiplier, identity_step, scaled_step)
        k, v = F.linear(kv_input, weight_k, bias_k), F.linear(kv_input, weight_v, bias_v)
        if self.kv_group is not None:  # the output gradients summed over the ranks holding the same head
            k, v = (mapped(t, self.kv_group, identity_step, all_reduce_step) for t in (k, v))
        return q, k, v


def _local_of(parameter: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor parameter, differentiably (its gradient goes back with the placement)."""
    return cast(DTensor, parameter).to_local()


class _LossParallel(torch.autograd.Function):
    """torch's `loss_parallel` cross entropy inside one autograd node: torch requires its backward to run inside
    the context too, and the facade's callers run backward wherever they like."""

    @staticmethod
    def forward(ctx: Any, local_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        leaf = local_logits.detach().requires_grad_(True)
        with torch.enable_grad():
            logits = DTensor.from_local(leaf, tp_mesh(), [Shard(-1)], run_check=False)
            with loss_parallel():
                losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
        ctx.leaf, ctx.losses = leaf, losses
        return cast(DTensor, losses).to_local().detach().reshape(target.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        losses: DTensor = ctx.losses
        upstream = DTensor.from_local(grad.reshape(-1).contiguous(), tp_mesh(), losses.placements, run_check=False)
        with loss_parallel():
            (logits_grad,) = torch.autograd.grad(losses, ctx.leaf, upstream)
        return logits_grad, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, /) -> torch.Tensor:
    """`loss_parallel`: torch's cross entropy over logits `Shard(-1)` on the TP mesh, per token."""
    result: torch.Tensor = _LossParallel.apply(vocab_parallel_logits, target)  # type: ignore[no-untyped-call]
    return result
