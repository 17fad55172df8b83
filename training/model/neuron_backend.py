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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from training.model.parallel import PARALLEL_STATE

if TYPE_CHECKING:
    from training.model.parallel import Declaration

_owns_world = False


def initialize(tp: int) -> None:
    """`init_process_group("xla")` (torchrun's env), then NxD's groups: TP = consecutive ranks, DP = the rest."""
    global _owns_world
    if not dist.is_initialized():
        importlib.import_module("torch_xla.distributed.xla_backend")  # registers the "xla" process-group backend
        dist.init_process_group("xla")
        _owns_world = True
    importlib.import_module(PARALLEL_STATE).initialize_model_parallel(tensor_model_parallel_size=tp)


def destroy() -> None:
    global _owns_world
    importlib.import_module(PARALLEL_STATE).destroy_model_parallel()
    if _owns_world:
        dist.destroy_process_group()
        _owns_world = False


def resolve(declaration: Declaration) -> Callable[..., Any]:
    implementation: Callable[..., Any] = getattr(importlib.import_module(declaration.module), declaration.attribute)
    if declaration.modifies_input:
        return functools.partial(_on_a_copy, implementation)
    return implementation


def _on_a_copy(implementation: Callable[..., Any], first: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """`implementation` changes its first argument in place: give it a copy, the caller's tensor stays as it was."""
    return implementation(first.clone(), *args, **kwargs)
