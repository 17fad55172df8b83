"""Neuron backend of `training.model.parallel`: each name is the neuronx-distributed / torch-xla one it stands for.

Kept thin on purpose: no logic beyond argument passing, so what runs on Trainium is neuronx-distributed's
own code. Every facade name resolves to the class or function its declaration in `parallel.py` names
(`getattr(importlib.import_module(module), attribute)`), called with the caller's arguments unchanged.
Imported lazily (only on Trainium hosts do `neuronx_distributed` and `torch_xla` exist; their PyPI entries
are placeholders) and reached through `importlib`, so type-checking this file needs neither.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from training.config.hardware import DEFAULT_GENERATION, Generation
from training.config.loading import not_allowed
from training.errors import UserError
from training.model import cpu_groups
from training.model.parallel import NXD_UTILS, PARALLEL_STATE, PARALLEL_UTILS, QKV_LINEAR, TRAINER

if TYPE_CHECKING:
    from training.model.parallel import Declaration

_owns_world = False
_config: dict[str, Any] | None = None


def initialize(tp: int, pp: int, options: Mapping[str, Any], generation: Generation = DEFAULT_GENERATION) -> None:
    """`init_process_group` (torchrun's env; "xla", or gloo in NxD's CPU mode), then neuronx-distributed's
    trainer configuration, whose creation initializes the model-parallel groups (TP = consecutive ranks, DP
    = the rest): once. NxD lays out the K/V replicas for the host's generation, so a model laid out for another
    is refused here, in one line."""
    global _owns_world, _config
    check_generation(generation)
    if not dist.is_initialized():
        if cpu_mode():
            cpu_groups.start_gloo_world()
        else:
            importlib.import_module("torch_xla.distributed.xla_backend")  # registers the "xla" backend
            dist.init_process_group("xla")
        _owns_world = True
    trainer = importlib.import_module(TRAINER)
    _config = trainer.neuronx_distributed_config(tensor_parallel_size=tp, pipeline_parallel_size=pp, **options)


def check_generation(generation: Generation) -> None:
    """Refuse, in one line, a model laid out for another generation than this host's: NxD lays the K/V replicas
    out for the host (`get_platform_target()`, or NEURON_PLATFORM_TARGET_OVERRIDE)."""
    host = platform_target()
    if host != generation:
        raise UserError(
            not_allowed(
                "generation",
                generation,
                f"{host}, this host's Trainium generation (neuronx-distributed lays the K/V replicas out for it; "
                "a checkpoint moves to another generation through hf: `convert --to nxd --target`)",
            )
        )


def platform_target() -> str:
    """The Trainium generation this host compiles for ("trn1", "trn2", ...), as neuronx-distributed asks it."""
    return str(importlib.import_module("torch_neuronx.utils").get_platform_target())


def cpu_mode() -> bool:
    """neuronx-distributed's CPU mode (`NXD_CPU_MODE=1`): its layers on CPU tensors, collectives over gloo."""
    return bool(importlib.import_module(NXD_UTILS).cpu_mode())


def trainer_config() -> dict[str, Any]:
    """The one `neuronx_distributed_config` of this process (what NxD's optimizer and checkpoint calls take)."""
    if _config is None:
        raise RuntimeError("the neuron backend is not initialized")
    return _config


def destroy() -> None:
    global _owns_world, _config
    state = importlib.import_module(PARALLEL_STATE)
    state.destroy_model_parallel()
    state.destroy_kv_group()  # not part of destroy_model_parallel: a stale group would outlive the world
    _config = None
    if _owns_world:
        dist.destroy_process_group()
        _owns_world = False


def resolve(declaration: Declaration) -> Callable[..., Any]:
    if declaration.name == "add_step_closure" and cpu_mode():
        return _at_once  # nothing is traced in CPU mode, and no mark_step would ever run the closure
    implementation: Callable[..., Any] = getattr(importlib.import_module(declaration.module), declaration.attribute)
    if declaration.modifies_input:
        return functools.partial(_on_a_copy, implementation)
    return implementation


def complete_materialized(model: nn.Module) -> None:
    """What NxD's layers set only on their initialising branch, so a materialized model is the initialised one
    but for the values: the unfused GQA weights' tensor-parallel attributes (modules/qkv_linear.py:
    `_initialize_affine_weight` sets them, and its meta branch skips it; ZeRO-1's gradient norm reads them),
    and, on the linear layers (parallel_layers/layers.py), the device they record from their weight
    (`self.device = self.weight.device`) and the master weight `init_weight_cpu` keeps (None without
    `keep_master_weight`). The fused `weight_qkv` has no attributes either way (NxD replaces it by an unmarked
    concatenation). tests/neuron/test_startup.py compares both models attribute by attribute."""
    gqa = importlib.import_module(QKV_LINEAR).GQAQKVColumnParallelLinear
    mark = importlib.import_module(PARALLEL_UTILS).set_tensor_model_parallel_attributes
    tp = importlib.import_module(PARALLEL_STATE).get_tensor_model_parallel_size()
    for module in model.modules():
        recorded = getattr(module, "device", None)
        if isinstance(recorded, torch.device) and recorded.type == "meta":
            # plain attributes, which nn.Module's __setattr__ (typed for tensors and modules) stores as they are
            setattr(module, "device", next(module.parameters()).device)  # noqa: B010
            if getattr(module, "keep_master_weight", None) is False and not hasattr(module, "master_weight"):
                setattr(module, "master_weight", None)  # noqa: B010
        if isinstance(module, gqa) and not module.fuse_qkv:
            for weight in (module.weight_q, module.weight_k, module.weight_v):
                if not hasattr(weight, "tensor_model_parallel"):
                    mark(weight, is_parallel=True, dim=0, stride=1, num_partitions=tp)


def _at_once(closure: Callable[..., Any], args: tuple[Any, ...] = ()) -> None:
    closure(*args)


def _on_a_copy(implementation: Callable[..., Any], first: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """`implementation` changes its first argument in place: give it a copy, the caller's tensor stays as it was."""
    return implementation(first.clone(), *args, **kwargs)
