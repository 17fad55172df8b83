"""The cluster's requirement set runs neuronx-distributed and every training module."""

from __future__ import annotations

import importlib
import pkgutil
from importlib import metadata

import training
from stacks.cluster_requirements import normalized, read_lock


def test_the_environment_is_the_cluster_lock() -> None:
    """Every locked package is installed at its locked version: this tier tests what the nodes install."""
    wrong = []
    for pin in read_lock():
        name, version = pin.split("==", 1)
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = "missing"
        if installed != version:
            wrong.append(f"{normalized(name)}: locked {version}, installed {installed}")
    assert wrong == []


def test_neuronx_distributed_imports_with_the_cluster_transformers() -> None:
    nxd = importlib.import_module("neuronx_distributed")
    assert importlib.import_module("transformers.utils.fx")  # what NxD's pipeline/trace.py imports
    for name in ("parallel_layers.layers", "modules.qkv_linear", "optimizer", "trainer", "utils.model_utils"):
        importlib.import_module(f"{nxd.__name__}.{name}")


def test_every_training_module_imports() -> None:
    modules = pkgutil.walk_packages(training.__path__, prefix="training.")
    names = [m.name for m in modules if not m.name.endswith(".__main__")]  # __main__ runs the CLI
    assert "training.model.neuron_backend" in names and "training.train.loop" in names
    for name in names:
        importlib.import_module(name)
