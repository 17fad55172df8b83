"""torch-native backend of `training.model.parallel`: native PyTorch distributed (DTensor, FSDP2, pipelining) on
the device TorchNeuron adds, `neuron` (trn2 and trn3), or on the CPU over gloo.

The successor of the neuron backend: Neuron's NxD training APIs are in maintenance from Neuron 2.30, and its
TorchNeuron package (`torch-neuronx` 2.13 / 2.14) runs PyTorch's own distributed stack on Trainium2 instead of
torch-xla. The groups are the cpu backend's ([PP, DP, TP] row-major, as neuronx-distributed arranges them), and
a `DeviceMesh` ("pp", "dp", "tp") is made of them: the layers (`training.model.native_layers`) place their
weights on its "tp" dimension, FSDP2 shards over "dp" (`training.train.native_training`).

Where it runs is explicit: on Neuron (device `neuron`, process group `neuron`, both registered by importing
`torch_neuronx`), or on the CPU with `TORCH_NATIVE_CPU=1` (gloo): the same code, as Neuron's distributed guide
recommends (run on CPU with gloo, then on Neuron, and compare).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from training.config.hardware import DEFAULT_GENERATION, Generation
from training.config.loading import not_allowed
from training.config.recipe import sparse_dispatch_compiled
from training.errors import UserError
from training.model import cpu_backend, cpu_groups, native_layers
from training.model.cpu_groups import dp_group, dp_size, pp_group, tp_group
from training.model.native_layers import (
    ColumnParallelLinear,
    GQAQKVColumnParallelLinear,
    ParallelEmbedding,
    RowParallelLinear,
)
from training.model.transformer import MoE

if TYPE_CHECKING:
    from training.model.parallel import Declaration

LAYERS = (ColumnParallelLinear, RowParallelLinear, ParallelEmbedding, GQAQKVColumnParallelLinear)
CPU_MODE = "TORCH_NATIVE_CPU"  # "1": run on the CPU over gloo (tests, and the comparison run Neuron recommends)
NEURON_GENERATIONS: tuple[Generation, ...] = ("trn2",)  # TorchNeuron supports trn2 and trn3, not trn1
# `initialize`'s option (the recipe's torch_native.compile): the decoder layers are compiled once the model is
# final (`training.train.native_training.compile_decoder_layers`)
COMPILE_OPTION = "compile_decoder_layers"

# The layers' names this backend implements (`native_layers`); with this module's own functions (`OWN_FUNCTIONS`)
# they are what `resolve` finds here, every other declared name being the cpu backend's.
LAYER_NAMES = (*(layer.__name__ for layer in LAYERS), "vocab_parallel_cross_entropy")
OWN_FUNCTIONS = ("device", "move_model_to_device", "nki_flash_attn_func")

_mesh: DeviceMesh | None = None
_compiled = False


def cpu_mode() -> bool:
    return os.environ.get(CPU_MODE) == "1"


def device_type() -> str:
    return "cpu" if cpu_mode() else "neuron"


def initialize(tp: int, pp: int, options: Mapping[str, Any], generation: Generation = DEFAULT_GENERATION) -> None:
    """The world (gloo on the CPU, `neuron` on Trainium), the cpu backend's groups, and the mesh made of them;
    `options`: `COMPILE_OPTION`, whether the decoder layers are compiled."""
    global _mesh, _compiled
    _compiled = bool(options.get(COMPILE_OPTION, False))
    if not cpu_mode():
        _start_neuron_world(generation)
    cpu_groups.initialize(tp, pp, options, generation)
    grid = torch.arange(dist.get_world_size()).reshape(pp, dp_size(), tp)
    _mesh = DeviceMesh.from_group(
        [pp_group(), dp_group(), tp_group()], device_type(), grid, mesh_dim_names=("pp", "dp", "tp")
    )
    native_layers.use_mesh(_mesh["tp"])


def _start_neuron_world(generation: Generation) -> None:
    if generation not in NEURON_GENERATIONS:
        allowed = (
            f"{', '.join(NEURON_GENERATIONS)} (TorchNeuron runs on Trainium2 and later; trn1 trains on backend neuron)"
        )
        raise UserError(not_allowed("generation", generation, allowed))
    try:
        importlib.import_module("torch_neuronx")  # registers the `neuron` device and process-group backend
    except ImportError as error:
        raise UserError(
            f"backend torch-native: torch_neuronx is not installed ({error}); allowed: a trn2 queue's TorchNeuron "
            f"software, or {CPU_MODE}=1 to run on the CPU over gloo"
        ) from None
    if not dist.is_initialized():
        dist.init_process_group("neuron")


def mesh() -> DeviceMesh:
    """The ("pp", "dp", "tp") mesh of the initialized world."""
    assert _mesh is not None, "the torch-native parallel backend is not initialized"
    return _mesh


def compiler() -> str | None:
    """The torch.compile backend of the decoder layers: None when they run eagerly (the default); TorchNeuron's
    `neuron` on Trainium; on the CPU torch's `aot_eager` (AOTAutograd's forward and backward graphs run by eager
    kernels, no fused code: the numerics of the eager run, the graphs `neuron` would get)."""
    if not _compiled:
        return None
    return "aot_eager" if cpu_mode() else "neuron"


def destroy() -> None:
    global _mesh, _compiled
    native_layers.use_mesh(None)
    _mesh, _compiled = None, False
    cpu_groups.destroy()


def resolve(declaration: Declaration) -> Callable[..., Any]:
    """The namesake of a declared facade name: this backend's (`LAYER_NAMES`, `OWN_FUNCTIONS`), else the cpu
    backend's (the same semantics: its groups, collectives and memory savers run on any process group)."""
    implementation: Callable[..., Any]
    if declaration.name in LAYER_NAMES:
        implementation = getattr(native_layers, declaration.name)
    elif declaration.name in OWN_FUNCTIONS:
        implementation = globals()[declaration.name]
    else:
        implementation = cpu_backend.resolve(declaration)
    return implementation


def device() -> torch.device:
    return torch.device(device_type())


def complete_materialized(model: nn.Module) -> None:
    """Nothing: the DTensor layers set nothing up when they initialise."""


def move_model_to_device(model: nn.Module, device: torch.device) -> None:
    """`model.to(device)`; every other tensor-parallel parameter (one `set_tensor_model_parallel_attributes`
    marked: the MoE experts) placed as a DTensor `Shard(partition_dim)` too, so FSDP2, the norm and Distributed
    Checkpoint see every shard as one; then the gradient hooks (`native_layers.place_gradients`) on the
    parameters as they are now. Every model is built with this call last; a model to be compiled with an MoE
    dispatch of dynamic shapes is refused here, before any weights are loaded."""
    if _compiled and any(isinstance(m, MoE) and m.dispatch == "sparse" for m in model.modules()):
        raise UserError(sparse_dispatch_compiled())
    model.to(device)
    for module in model.modules():
        marked = [
            (name, parameter)
            for name, parameter in module.named_parameters(recurse=False)
            if getattr(parameter, "tensor_model_parallel", False) and not isinstance(parameter, DTensor)
        ]
        for name, parameter in marked:
            placed = native_layers.distributed(parameter.data, Shard(parameter.partition_dim))  # type: ignore[attr-defined]
            placed.__dict__.update(parameter.__dict__)
            setattr(module, name, placed)
        if marked:  # its rank files' plain tensors load into the DTensors, as the layers' do
            native_layers.accept_rank_files(module)
        if marked or isinstance(module, LAYERS):
            native_layers.place_gradients(module)


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
    """torch's scaled-dot-product attention: its flash kernel on the CPU (the cpu backend's), the device's own
    kernel on Neuron (TorchNeuron lowers SDPA)."""
    if cpu_mode():
        return cpu_backend.nki_flash_attn_func(
            q,
            k,
            v,
            softmax_scale=softmax_scale,
            causal=causal,
            mixed_precision=mixed_precision,
            transpose_nki_inputs=transpose_nki_inputs,
        )
    if transpose_nki_inputs:
        q, k, v = (t.transpose(-1, -2) for t in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale)
