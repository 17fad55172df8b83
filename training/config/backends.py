"""The training backends and MoE dispatches by name, and what differs between the backends as data (torch-free).

Every other module imports these names (the recipe's `backend`, the parallel facade, the training-backend
registry, the model's MoE dispatch registry, the memory planner): a new backend is one more name and one
more row of `FACTS` here, one more module behind `training.model.parallel` and one behind
`training.train.backend`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

Backend = Literal["cpu", "neuron", "torch-native"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)

# How Mixtral's MoE block runs its experts (`training.model.transformer.MoE`): "sparse" each expert on its
# tokens only (dynamic shapes), "dense" every expert on every token (static shapes), "capacity" a fixed number
# of slots per expert (static shapes; choices beyond it dropped).
MoeDispatch = Literal["sparse", "dense", "capacity"]
MOE_DISPATCHES: tuple[MoeDispatch, ...] = get_args(MoeDispatch)


@dataclass(frozen=True)
class BackendFacts:
    """What the configuration, the model and the planner need to know of a backend before it runs."""

    moe_dispatch: MoeDispatch  # without a capacity factor
    on_trainium: bool  # runs on NeuronCores: device memory to plan, a throughput forecast
    flash_attention_block: int | None = None  # sequences a multiple of this with memory.flash_attention
    # The flash kernel reads q, k, v as [B, heads, head_dim, S] (the NKI kernel's layout, which NxD's wrapper
    # passes through untransposed), else as [B, heads, S, head_dim] (torch's kernel: head_dim contiguous).
    flash_reads_transposed: bool = False
    # Data parallelism shards parameters, gradients and optimizer state (FSDP2), not only the optimizer (ZeRO-1).
    fully_sharded: bool = False
    # On a Neuron site the compile stage traces the run ahead with neuron_parallel_compile (PyTorch/XLA's); False:
    # the program runs eagerly on the device, or compiles in the process (TorchNeuron).
    precompiled: bool = True


# The neuron backend compiles static graphs (so the dense dispatch), and NKI's flash attention kernel takes
# sequences in tiles of 2048 tokens.
FACTS: dict[Backend, BackendFacts] = {
    "cpu": BackendFacts(moe_dispatch="sparse", on_trainium=False),
    "neuron": BackendFacts(
        moe_dispatch="dense", on_trainium=True, flash_attention_block=2048, flash_reads_transposed=True
    ),
    # Eager PyTorch on Neuron (TorchNeuron) or on the CPU: dynamic shapes run as they come (a compiled run asks
    # for a static dispatch: `training.config.recipe`); torch's SDPA takes q, k, v with head_dim contiguous.
    "torch-native": BackendFacts(moe_dispatch="sparse", on_trainium=True, fully_sharded=True, precompiled=False),
}


def default_moe_dispatch(backend: Backend, capacity_factor: float | None) -> MoeDispatch:
    """The dispatch a run uses unless told otherwise: capacity with a capacity factor, else the backend's."""
    return "capacity" if capacity_factor is not None else FACTS[backend].moe_dispatch


def flash_attention_fits(backend: Backend, seq_len: int) -> bool:
    """Whether the backend's flash attention takes sequences of this length."""
    block = FACTS[backend].flash_attention_block
    return block is None or seq_len % block == 0
