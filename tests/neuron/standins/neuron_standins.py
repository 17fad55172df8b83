"""Stand-ins for the Neuron SDK's binary packages, so neuronx-distributed's Python code runs on XLA:CPU.

`torch_neuronx`, `neuronxcc` and `libneuronxla` wrap the Neuron compiler and runtime, which exist only on
Trainium hosts (their PyPI entries are placeholders). neuronx-distributed imports them at module level for
tracing, NKI kernels and compilation, none of which the training path calls. Every module and attribute
under those names is a placeholder class: importing, subclassing, decorating and annotating work, a
placeholder's attributes and items are placeholders, and `get_platform_target()` answers "trn1".
`libneuronxla.libneuronpjrt_path` stays absent on purpose: its presence would switch torch-xla to the
Neuron PJRT plugin. The real torch_neuronx also registers `torch.classes.neuron.*` from its C++ library;
NxD uses them as annotations, so the stand-in registers placeholders. Two differences of the CPU device are
bridged too: see `_host_world_size` and `_rendezvous_across_processes`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from typing import Any

ROOTS = frozenset({"torch_neuronx", "neuronxcc", "libneuronxla"})
ABSENT = frozenset({"libneuronxla.libneuronpjrt_path"})
PLATFORM = "trn1"


class _PlaceholderType(type):
    """Any attribute of a placeholder class is another placeholder class."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return placeholder(f"{cls.__qualname__}.{name}")


def placeholder(name: str) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        self.arguments = (args, kwargs)

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Used as a decorator (`@nki.jit`, `@nki.jit(...)`): hand back what it decorates.
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return placeholder(name)()

    def __getattr__(self: Any, attribute: str) -> Any:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return placeholder(f"{name}.{attribute}")()

    def __getitem__(self: Any, key: Any) -> Any:
        return placeholder(f"{name}[]")()

    namespace = {"__init__": __init__, "__call__": __call__, "__getattr__": __getattr__, "__getitem__": __getitem__}
    return _PlaceholderType(name, (), {**namespace, "__module__": name})


def _platform_target(*args: Any, **kwargs: Any) -> str:
    return os.environ.get("NEURON_STANDIN_PLATFORM", PLATFORM)  # a test may pretend to be another generation


class StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or f"{self.__name__}.{name}" in ABSENT:
            raise AttributeError(name)
        value: Any = _platform_target if name == "get_platform_target" else placeholder(name)
        setattr(self, name, value)
        return value


def _host_world_size(module: types.ModuleType) -> None:
    """On the CPU device NxD's `get_local_world_size` takes torch-xla's pre-PJRT path, which reads the number of
    hosts from `xenv.HOST_WORLD_SIZE` (a name torch-xla 2.9 no longer defines); on Trainium (PJRT_DEVICE=NEURON)
    it asks the runtime instead. Define the name and the value torchrun's variables imply."""
    module.HOST_WORLD_SIZE = "HOST_WORLD_SIZE"  # type: ignore[attr-defined]
    hosts = int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    os.environ.setdefault("HOST_WORLD_SIZE", str(max(hosts, 1)))


def _rendezvous_across_processes(module: types.ModuleType) -> None:
    """On Trainium torch-xla's `rendezvous` waits for every worker and exchanges their payloads (the Neuron
    runtime's collectives). On XLA:CPU each process is a world of its own, so under NxD's CPU mode (several
    processes over gloo) it would return at once, and NxD's checkpointing relies on it: rank 0 creates the
    directories and marks a save done while the others write, and a worker that looks before rank 0 has
    marked it removes its own files as an interrupted save's. There it is what it is on Trainium: a
    rendezvous of all processes (torch.distributed's default group)."""
    if int(os.environ.get("NXD_CPU_MODE", "0")) <= 0:
        return
    on_this_device = module.rendezvous

    def rendezvous(tag: str, payload: bytes = b"", replicas: Any = None) -> Any:
        import torch.distributed as dist

        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return on_this_device(tag, payload, replicas or [])
        payloads: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(payloads, payload)
        return payloads

    module.rendezvous = rendezvous  # type: ignore[attr-defined]


AFTER_IMPORT = {
    "torch_xla.core.xla_env_vars": _host_world_size,
    "torch_xla.core.xla_model": _rendezvous_across_processes,
}


class _Amended(importlib.abc.Loader):
    """The real module, with the stand-in's additions applied once it has run."""

    def __init__(self, loader: Any, amend: Any) -> None:
        self.loader, self.amend = loader, amend

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        created: types.ModuleType | None = self.loader.create_module(spec)
        return created

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        self.amend(module)


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname in AFTER_IMPORT:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _Amended(spec.loader, AFTER_IMPORT[fullname])
            return spec
        if fullname in ABSENT or fullname.split(".")[0] not in ROOTS:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__ == "torch_neuronx":
            import torch

            torch.classes.neuron = StandInModule("torch.classes.neuron")  # type: ignore[attr-defined]


def install() -> None:
    if not any(isinstance(finder, StandInFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, StandInFinder())
