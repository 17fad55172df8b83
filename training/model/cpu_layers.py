"""The CPU backend's layers, loss and memory savers: each computes what its neuronx-distributed namesake computes,
forward and backward.

The tensor-parallel linears, the vocabulary-parallel embedding and cross-entropy, activation checkpointing and
flash attention; the collectives they use are `training.model.cpu_collectives`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.autograd.function import FunctionCtx
from torch.distributed import ProcessGroup
from torch.nn.attention import SDPBackend, sdpa_kernel

from training.model.cpu_collectives import (
    all_reduce_step,
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    identity_step,
    mapped,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scaled_step,
    scatter_to_tensor_model_parallel_region,
    sequence_gathered_linears,
)
from training.model.cpu_groups import kv_shared_group, tp_group, tp_rank, tp_size

# --- memory ----------------------------------------------------------------------------------------------


def apply_activation_checkpointing(model: nn.Module, /, check_fn: Callable[[nn.Module], bool]) -> None:
    """torch.utils.checkpoint around the forward of each accepted submodule (not the model itself); the module
    is not wrapped, so names and the state dict are untouched."""
    for module in model.modules():
        if module is not model and check_fn(module):
            module.forward = functools.partial(_recomputed, module.forward)


def _recomputed(forward: Callable[..., Any], *args: Any) -> Any:
    # torch's checkpoint looked up at each call, not bound once, so a memory probe can see what it keeps
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False)


def nki_flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    /,
    softmax_scale: float | None = None,
    causal: bool = True,
    mixed_precision: bool = True,
    transpose_nki_inputs: bool = True,
) -> torch.Tensor:
    """torch's flash attention kernel (blocks of keys with a running softmax; backward recomputes them): it
    saves q, k, v, the output and the log-sum-exp, never the S x S scores. Its softmax statistics are fp32.

    Inputs as neuronx-distributed takes them: [B, heads, head_dim, S] with `transpose_nki_inputs` (the layout
    the NKI kernel reads), else [B, heads, S, head_dim]; the output is [B, heads, S, head_dim] either way.
    """
    if transpose_nki_inputs:  # torch's CPU kernel needs head_dim contiguous
        q, k, v = (t.transpose(-1, -2).contiguous() for t in (q, k, v))
    del mixed_precision  # the CPU kernel keeps its statistics in fp32 whatever the input dtype
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale)


# --- layers --------------------------------------------------------------------------------------------


def divide(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ValueError(f"{what} {size} is not divisible by the tensor-parallel degree {parts}")
    return size // parts


def _parameter(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    """Not initialised: a layer registers it first, then initialises it unless it is on the meta device."""
    return nn.Parameter(torch.empty(shape, dtype=dtype))


def init_uniform(parameter: torch.Tensor | None, fan_in: int) -> None:
    """torch.nn.Linear's default initialisation, with the fan-in of the whole (unsharded) matrix; nothing when
    the parameter was registered on the meta device (`init_on_device`), as neuronx-distributed's layers do."""
    if parameter is None or parameter.device.type == "meta":
        return
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    with torch.no_grad():
        parameter.uniform_(-bound, bound)


class ColumnParallelLinear(nn.Module):
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
        super().__init__()
        del stride  # shapes neuronx-distributed's random initialisation only
        tp = tp_size()
        if sequence_parallel_enabled and gather_output:
            raise ValueError("ColumnParallelLinear: sequence_parallel_enabled needs gather_output=False")
        self.input_size, self.output_size, self.gather_output = input_size, output_size, gather_output
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.sequence_dimension = 0 if sequence_dimension is None else sequence_dimension  # NxD's default
        per_rank = divide(output_size, tp, "output size")
        self.weight = _parameter((per_rank, input_size), dtype)
        init_uniform(self.weight, input_size)
        self.bias = _parameter((output_size if gather_output else per_rank,), dtype) if bias else None
        init_uniform(self.bias, input_size)

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel_enabled:
            (output,) = sequence_gathered_linears(tensor, self.sequence_dimension, (self.weight,), (1.0,))
        else:
            output = F.linear(copy_to_tensor_model_parallel_region(tensor), self.weight)
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output)
        return output + self.bias if self.bias is not None else output


class RowParallelLinear(nn.Module):
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
        super().__init__()
        if sequence_parallel_enabled and not input_is_parallel:
            raise RuntimeError("RowParallelLinear: sequence_parallel_enabled needs input_is_parallel=True")
        self.input_size, self.output_size, self.input_is_parallel = input_size, output_size, input_is_parallel
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.sequence_dimension = 0 if sequence_dimension is None else sequence_dimension
        self.weight = _parameter((output_size, divide(input_size, tp_size(), "input size")), dtype)
        init_uniform(self.weight, input_size)
        self.bias = _parameter((output_size,), dtype) if bias else None
        init_uniform(self.bias, input_size)

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            tensor = scatter_to_tensor_model_parallel_region(tensor)
        partial = F.linear(tensor, self.weight)
        if self.sequence_parallel_enabled:
            output = reduce_scatter_to_sequence_parallel_region(partial, sequence_dimension=self.sequence_dimension)
        else:
            output = reduce_from_tensor_model_parallel_region(partial)
        return output + self.bias if self.bias is not None else output


class ParallelEmbedding(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        dtype: torch.dtype = torch.float32,
        sequence_parallel_enabled: bool = False,
    ) -> None:
        super().__init__()
        self.sequence_parallel_enabled = sequence_parallel_enabled
        per_rank = divide(num_embeddings, tp_size(), "vocabulary size")
        self.start, self.end = tp_rank() * per_rank, (tp_rank() + 1) * per_rank
        # The padding row (no gradient, as in torch.nn.Embedding) lives on the rank whose rows include it.
        in_range = padding_idx is not None and self.start <= padding_idx < self.end
        self.padding_idx = padding_idx - self.start if in_range and padding_idx is not None else None
        self.weight = _parameter((per_rank, embedding_dim), dtype)
        if self.weight.device.type != "meta":  # see `init_uniform`
            with torch.no_grad():
                self.weight.normal_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            rows = F.embedding(ids, self.weight, self.padding_idx)
            return rows.transpose(0, 1).contiguous() if self.sequence_parallel_enabled else rows
        mine = (ids >= self.start) & (ids < self.end)
        rows = F.embedding((ids - self.start) * mine, self.weight, self.padding_idx) * mine.unsqueeze(-1).to(
            self.weight.dtype
        )
        if self.sequence_parallel_enabled:  # sequence first, as neuronx-distributed's embedding returns it
            return reduce_scatter_to_sequence_parallel_region(rows.transpose(0, 1).contiguous())
        return reduce_from_tensor_model_parallel_region(rows)


class GQAQKVColumnParallelLinear(nn.Module):
    """Q/K/V with K and V repeated `kv_size_multiplier` times before the split, as neuronx-distributed does.

    Backward, as there: the K/V output gradients are first summed over the ranks holding the same head, so
    every replica's weight gradient is the head's complete gradient; their input gradients are divided by
    the multiplier so the TP all-reduce counts each head once.
    """

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
        self.sequence_parallel_enabled = sequence_parallel_enabled
        if sequence_parallel_enabled and gather_output:
            raise ValueError("GQAQKVColumnParallelLinear: sequence_parallel_enabled needs gather_output=False")
        if tp % kv_size_multiplier:
            raise ValueError(f"kv_size_multiplier {kv_size_multiplier} must divide the tensor-parallel degree {tp}")
        if bias and gather_output:
            raise NotImplementedError("GQAQKVColumnParallelLinear: bias with gather_output")
        self.gather_output, self.kv_size_multiplier, self.fuse_qkv = gather_output, kv_size_multiplier, fuse_qkv
        self.q_size = divide(output_sizes[0], tp, "query size")
        self.kv_size = divide(output_sizes[1] * kv_size_multiplier, tp, "replicated key/value size")
        self.kv_group = kv_shared_group(kv_size_multiplier) if kv_size_multiplier > 1 else None
        sizes = {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}
        if fuse_qkv:
            self.weight_qkv = _parameter((sum(sizes.values()), input_size), dtype)
            init_uniform(self.weight_qkv, input_size)
            self.bias_qkv = _parameter((sum(sizes.values()),), dtype) if bias else None
            init_uniform(self.bias_qkv, input_size)
        else:
            for name, size in sizes.items():
                self.register_parameter(f"weight_{name}", _parameter((size, input_size), dtype))
                init_uniform(self._parameters[f"weight_{name}"], input_size)
                self.register_parameter(f"bias_{name}", _parameter((size,), dtype) if bias else None)
                init_uniform(self._parameters[f"bias_{name}"], input_size)

    def _parts(self, prefix: str) -> list[torch.Tensor | None]:
        if self.fuse_qkv:
            fused = getattr(self, f"{prefix}_qkv")
            return [None] * 3 if fused is None else list(fused.split([self.q_size, self.kv_size, self.kv_size]))
        return [getattr(self, f"{prefix}_{name}") for name in "qkv"]

    def forward(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        (weight_q, weight_k, weight_v), (bias_q, bias_k, bias_v) = self._parts("weight"), self._parts("bias")
        assert weight_q is not None and weight_k is not None and weight_v is not None
        kv_share = 1 / self.kv_size_multiplier if self.kv_group is not None else 1.0
        if self.sequence_parallel_enabled:
            q, k, v = sequence_gathered_linears(tensor, 0, (weight_q, weight_k, weight_v), (1.0, kv_share, kv_share))
            q, k, v = (t if b is None else t + b for t, b in ((q, bias_q), (k, bias_k), (v, bias_v)))
        else:
            tensor = copy_to_tensor_model_parallel_region(tensor)
            q = F.linear(tensor, weight_q, bias_q)
            kv_input = tensor if kv_share == 1 else mapped(tensor, kv_share, identity_step, scaled_step)
            k, v = F.linear(kv_input, weight_k, bias_k), F.linear(kv_input, weight_v, bias_v)
        if self.kv_group is not None:
            # the output gradients summed over the ranks holding the same head
            k, v = (mapped(t, self.kv_group, identity_step, all_reduce_step) for t in (k, v))
        if self.gather_output:
            q, k, v = (gather_from_tensor_model_parallel_region(t) for t in (q, k, v))
        return q, k, v


# --- loss ----------------------------------------------------------------------------------------------


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """-log softmax(logits)[target] with the vocabulary split over the TP group; targets outside any
    rank's range (the ignore index) give log-sum-exp, which the facade zeroes."""

    @staticmethod
    def forward(ctx: FunctionCtx, logits: torch.Tensor, target: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        maximum = logits.max(dim=-1).values
        if tp > 1:
            dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - maximum.unsqueeze(-1)
        part = logits.shape[-1]
        mine = (target >= rank * part) & (target < (rank + 1) * part)
        local = ((target - rank * part) * mine).unsqueeze(-1)
        predicted = shifted.gather(-1, local).squeeze(-1) * mine.to(shifted.dtype)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        if tp > 1:
            dist.all_reduce(predicted, group=group)
            dist.all_reduce(total, group=group)
        ctx.save_for_backward(exp / total.unsqueeze(-1), mine, local)
        return total.log() - predicted

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, mine, local = ctx.saved_tensors
        result = softmax.scatter_add(-1, local, -mine.unsqueeze(-1).to(softmax.dtype))
        return result * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, /) -> torch.Tensor:
    apply = _VocabParallelCrossEntropy.apply
    result: torch.Tensor = apply(vocab_parallel_logits, target, tp_group())  # type: ignore[no-untyped-call]
    return result
