"""CPU backend of `training.model.parallel`: torch.distributed on gloo, the collectives as autograd functions.

Each layer computes what its neuronx-distributed namesake computes, forward and backward, so a model
sharded over N gloo processes gives the single-process logits and, merged with the layout's rules, the
single-process gradients. This is the backend the tests exercise.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch._C._distributed_c10d import HashStore, PrefixStore, Store
from torch.autograd.function import FunctionCtx
from torch.distributed import ProcessGroup
from torch.distributed.rendezvous import rendezvous as env_rendezvous
from torch.nn.attention import SDPBackend, sdpa_kernel

from training.errors import UserError

if TYPE_CHECKING:
    from training.model.parallel import Declaration


@dataclass
class _State:
    tp: int
    pp: int
    tp_group: ProcessGroup
    dp_group: ProcessGroup
    pp_group: ProcessGroup
    owns_world: bool
    kv_groups: dict[int, ProcessGroup] = field(default_factory=dict)


_state: _State | None = None
_generation = 0
_store: tuple[Store, int, int] | None = None


def _launcher_store() -> tuple[Store, int, int]:
    """torchrun's key-value store (env:// from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), opened once."""
    global _store
    if _store is None:
        _store = next(env_rendezvous("env://"))
    return _store


def initialize(tp: int, pp: int, options: Mapping[str, Any]) -> None:
    """gloo over env:// under torchrun (RANK, WORLD_SIZE, MASTER_ADDR), else a one-process world.

    `options` configure neuronx-distributed's trainer; nothing here uses them."""
    global _state, _generation
    owns_world = not dist.is_initialized()
    if owns_world:
        _generation += 1
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            store, rank, world = _launcher_store()
            # A fresh key prefix per initialisation: a process may initialise again after destroy()
            # (the tests run several TP degrees in one torchrun), and old rendezvous keys must not be reused.
            prefixed = PrefixStore(f"training.model.parallel.{_generation}", store)
            dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=world)
        else:
            store = HashStore()
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    world = dist.get_world_size()
    if tp < 1 or pp < 1 or world % (tp * pp):
        if owns_world:
            dist.destroy_process_group()
        degrees = f"tensor-parallel degree {tp}" + (f" x pipeline degree {pp}" if pp != 1 else "")
        raise UserError(f"{degrees} must divide the number of processes ({world})")
    # [PP, DP, TP] row-major, as neuronx-distributed arranges ranks: TP groups are consecutive ranks.
    dp = world // (tp * pp)

    def at(p: int, d: int, t: int) -> int:
        return (p * dp + d) * tp + t

    grid = [(p, d, t) for p in range(pp) for d in range(dp) for t in range(tp)]
    tp_group = _own_group([[at(p, d, t) for t in range(tp)] for p, d, t in grid if t == 0])
    dp_group = _own_group([[at(p, d, t) for d in range(dp)] for p, d, t in grid if d == 0])
    pp_group = _own_group([[at(p, d, t) for p in range(pp)] for p, d, t in grid if p == 0])
    _state = _State(tp=tp, pp=pp, tp_group=tp_group, dp_group=dp_group, pp_group=pp_group, owns_world=owns_world)


def _own_group(partition: list[list[int]]) -> ProcessGroup:
    """Create every group of a partition of the ranks (a collective call); return this rank's."""
    mine: ProcessGroup | None = None
    for ranks in partition:
        group: ProcessGroup = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    assert mine is not None, f"rank {dist.get_rank()} is in none of {partition}"
    return mine


def destroy() -> None:
    global _state
    if _state is None:
        return
    if _state.owns_world:
        dist.destroy_process_group()
    else:
        for group in {_state.tp_group, _state.dp_group, _state.pp_group, *_state.kv_groups.values()}:
            dist.destroy_process_group(group)
    _state = None


def resolve(declaration: Declaration) -> Callable[..., Any]:
    """The namesake of a declared facade name in this module (a class or a function with its exact signature)."""
    implementation: Callable[..., Any] = globals()[declaration.name]
    return implementation


def _get() -> _State:
    assert _state is not None, "the CPU parallel backend is not initialized"  # the facade says so to its callers
    return _state


def tp_rank() -> int:
    return dist.get_rank() % _get().tp


def tp_size() -> int:
    return _get().tp


def tp_group() -> ProcessGroup:
    return _get().tp_group


def dp_rank() -> int:
    return dist.get_rank() // _get().tp % dp_size()


def dp_size() -> int:
    return dist.get_world_size() // (_get().tp * _get().pp)


def dp_group() -> ProcessGroup:
    return _get().dp_group


def pp_rank() -> int:
    return dist.get_rank() // (_get().tp * dp_size())


def pp_size() -> int:
    return _get().pp


def pp_group() -> ProcessGroup:
    return _get().pp_group


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


def kv_shared_group(multiplier: int) -> ProcessGroup:
    """The TP ranks holding the same KV heads when K/V are repeated `multiplier` times: r, r + tp/m, ...

    Created on first use; every rank builds the same layers in the same order, so creation stays collective.
    """
    state = _get()
    if multiplier not in state.kv_groups:
        stride, world = state.tp // multiplier, dist.get_world_size()
        groups = [
            [start + offset + i * stride for i in range(multiplier)]
            for start in range(0, world, state.tp)
            for offset in range(stride)
        ]
        state.kv_groups[multiplier] = _own_group(groups)
    return state.kv_groups[multiplier]


# --- autograd collectives ----------------------------------------------------------------------------------


def _identity(tensor: torch.Tensor, argument: Any) -> torch.Tensor:
    return tensor.view_as(tensor)


def _all_reduce(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    result = tensor.clone()
    dist.all_reduce(result, group=group)
    return result


def _gather_last_dim(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _own_slice(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return tensor.chunk(dist.get_world_size(group), dim=-1)[dist.get_rank(group)].contiguous()


def _scaled(tensor: torch.Tensor, scale: float) -> torch.Tensor:
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
    return _slice_along(_all_reduce(tensor, argument[0]), argument).clone()


Step = Callable[[torch.Tensor, Any], torch.Tensor]


class _Mapping(torch.autograd.Function):
    """One collective with its autograd: `forward(tensor, argument)` forward, `backward(grad, argument)` backward.

    The argument is the process group (or, for `_scaled`, the factor). Megatron's four mappings are pairs of
    the steps above, e.g. copy-to-region = (identity, all-reduce) and gather = (gather, own slice).
    """

    @staticmethod
    def forward(ctx: FunctionCtx, tensor: torch.Tensor, argument: Any, forward: Step, backward: Step) -> torch.Tensor:
        ctx.argument, ctx.backward_step = argument, backward  # type: ignore[attr-defined]
        return forward(tensor, argument)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ctx.backward_step(grad, ctx.argument), None, None, None


def _map(tensor: torch.Tensor, argument: Any, forward: Step, backward: Step) -> torch.Tensor:
    result: torch.Tensor = _Mapping.apply(tensor, argument, forward, backward)  # type: ignore[no-untyped-call]
    return result


def _over_tp(tensor: torch.Tensor, forward: Step, backward: Step) -> torch.Tensor:
    state = _get()
    return tensor if state.tp == 1 else _map(tensor, state.tp_group, forward, backward)


def copy_to_tensor_model_parallel_region(tensor: torch.Tensor, /) -> torch.Tensor:
    return _over_tp(tensor, _identity, _all_reduce)


def reduce_from_tensor_model_parallel_region(tensor: torch.Tensor, /) -> torch.Tensor:
    return _over_tp(tensor, _all_reduce, _identity)


def gather_from_tensor_model_parallel_region(tensor: torch.Tensor, /) -> torch.Tensor:
    return _over_tp(tensor, _gather_last_dim, _own_slice)


def scatter_to_tensor_model_parallel_region(tensor: torch.Tensor, /) -> torch.Tensor:
    return _over_tp(tensor, _own_slice, _gather_last_dim)


def gather_from_sequence_parallel_region(
    tensor: torch.Tensor, /, sequence_dimension: int = 0, to_model_parallel: bool = True
) -> torch.Tensor:
    backward = _reduce_scatter_along if to_model_parallel else _slice_along
    return _map(tensor, (_get().tp_group, sequence_dimension), _gather_along, backward)


def reduce_scatter_to_sequence_parallel_region(tensor: torch.Tensor, /, sequence_dimension: int = 0) -> torch.Tensor:
    return _map(tensor, (_get().tp_group, sequence_dimension), _reduce_scatter_along, _gather_along)


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
        total = _gather_along(local, (_get().tp_group, dim))
        return tuple(F.linear(total, weight) for weight in weights)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        local, *weights = ctx.saved_tensors
        argument = (_get().tp_group, ctx.dim)
        total = _gather_along(local, argument)
        flat = total.reshape(-1, total.shape[-1])
        grad_total = torch.zeros_like(total)
        grad_weights = []
        for grad, weight, scale in zip(grads, weights, ctx.scales, strict=True):
            grad_total += (grad @ weight) * scale if scale != 1 else grad @ weight
            grad_weights.append(grad.reshape(-1, grad.shape[-1]).t() @ flat)
        return (_reduce_scatter_along(grad_total, argument), None, None, *grad_weights)


def _sequence_gathered_linears(
    local: torch.Tensor, dim: int, weights: tuple[torch.Tensor, ...], scales: tuple[float, ...]
) -> tuple[torch.Tensor, ...]:
    result: tuple[torch.Tensor, ...] = _SequenceGatheredLinears.apply(local, dim, scales, *weights)  # type: ignore[no-untyped-call]
    return result


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


def _divide(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ValueError(f"{what} {size} is not divisible by the tensor-parallel degree {parts}")
    return size // parts


def _parameter(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    """Not initialised: a layer registers it first, then initialises it unless it is on the meta device."""
    return nn.Parameter(torch.empty(shape, dtype=dtype))


def _init_uniform(parameter: torch.Tensor | None, fan_in: int) -> None:
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
        per_rank = _divide(output_size, tp, "output size")
        self.weight = _parameter((per_rank, input_size), dtype)
        _init_uniform(self.weight, input_size)
        self.bias = _parameter((output_size if gather_output else per_rank,), dtype) if bias else None
        _init_uniform(self.bias, input_size)

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel_enabled:
            (output,) = _sequence_gathered_linears(tensor, self.sequence_dimension, (self.weight,), (1.0,))
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
        self.weight = _parameter((output_size, _divide(input_size, tp_size(), "input size")), dtype)
        _init_uniform(self.weight, input_size)
        self.bias = _parameter((output_size,), dtype) if bias else None
        _init_uniform(self.bias, input_size)

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
        per_rank = _divide(num_embeddings, tp_size(), "vocabulary size")
        self.start, self.end = tp_rank() * per_rank, (tp_rank() + 1) * per_rank
        # The padding row (no gradient, as in torch.nn.Embedding) lives on the rank whose rows include it.
        in_range = padding_idx is not None and self.start <= padding_idx < self.end
        self.padding_idx = padding_idx - self.start if in_range and padding_idx is not None else None
        self.weight = _parameter((per_rank, embedding_dim), dtype)
        if self.weight.device.type != "meta":  # see `_init_uniform`
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
        self.q_size = _divide(output_sizes[0], tp, "query size")
        self.kv_size = _divide(output_sizes[1] * kv_size_multiplier, tp, "replicated key/value size")
        self.kv_group = kv_shared_group(kv_size_multiplier) if kv_size_multiplier > 1 else None
        sizes = {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}
        if fuse_qkv:
            self.weight_qkv = _parameter((sum(sizes.values()), input_size), dtype)
            _init_uniform(self.weight_qkv, input_size)
            self.bias_qkv = _parameter((sum(sizes.values()),), dtype) if bias else None
            _init_uniform(self.bias_qkv, input_size)
        else:
            for name, size in sizes.items():
                self.register_parameter(f"weight_{name}", _parameter((size, input_size), dtype))
                _init_uniform(self._parameters[f"weight_{name}"], input_size)
                self.register_parameter(f"bias_{name}", _parameter((size,), dtype) if bias else None)
                _init_uniform(self._parameters[f"bias_{name}"], input_size)

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
            q, k, v = _sequence_gathered_linears(tensor, 0, (weight_q, weight_k, weight_v), (1.0, kv_share, kv_share))
            q, k, v = (t if b is None else t + b for t, b in ((q, bias_q), (k, bias_k), (v, bias_v)))
        else:
            tensor = copy_to_tensor_model_parallel_region(tensor)
            q = F.linear(tensor, weight_q, bias_q)
            kv_input = tensor if kv_share == 1 else _map(tensor, kv_share, _identity, _scaled)
            k, v = F.linear(kv_input, weight_k, bias_k), F.linear(kv_input, weight_v, bias_v)
        if self.kv_group is not None:
            # the output gradients summed over the ranks holding the same head
            k, v = (_map(t, self.kv_group, _identity, _all_reduce) for t in (k, v))
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
    result: torch.Tensor = apply(vocab_parallel_logits, target, _get().tp_group)  # type: ignore[no-untyped-call]
    return result
