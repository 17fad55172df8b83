"""The backend is chosen once: each backend name has one training backend and the MoE dispatches one registry,
and below the loop no module of `training.train` asks which backend runs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from training.config.backends import BACKENDS, FACTS, MOE_DISPATCHES, default_moe_dispatch
from training.config.recipe import load_recipe
from training.model.moe_dispatch import DISPATCHES
from training.train.backend import IMPLEMENTATIONS, training_backend
from training.train.memory import moe_dispatch_of

TRAIN = Path(__file__).resolve().parents[2] / "training" / "train"
IMPLEMENTATION_MODULES = {f"{name.rsplit('.', 1)[1]}.py" for name in IMPLEMENTATIONS.values()}
# The modules that may name a backend: the interface's registry and one module per backend.
BACKEND_MODULES = {"backend.py", *IMPLEMENTATION_MODULES}
DEVICE_ARGUMENTS = ("map_location", "device")  # "cpu" as a torch device is not the backend


def backend_mentions(path: Path) -> list[str]:
    """`parallel.backend()` calls, backend names as strings, and imports of a backend module in a module."""
    tree = ast.parse(path.read_text())
    devices = {id(k.value) for k in ast.walk(tree) if isinstance(k, ast.keyword) and k.arg in DEVICE_ARGUMENTS}
    found = []
    for node in ast.walk(tree):
        parallel_backend = isinstance(node, ast.Attribute) and node.attr == "backend"
        if parallel_backend and isinstance(node.value, ast.Name) and node.value.id == "parallel":  # type: ignore[attr-defined]
            found.append(f"{path.name}:{node.lineno} parallel.backend")
        if isinstance(node, ast.Constant) and node.value in BACKENDS and id(node) not in devices:
            found.append(f"{path.name}:{node.lineno} {node.value!r}")
        if isinstance(node, ast.ImportFrom) and node.module in IMPLEMENTATIONS.values():
            found.append(f"{path.name}:{node.lineno} imports {node.module}")
    return found


@pytest.mark.parametrize("name", BACKENDS)
def test_every_backend_has_one_training_backend_and_its_facts(name: str) -> None:
    assert training_backend(name).name == name
    assert name in FACTS


def test_every_moe_dispatch_name_has_one_implementation() -> None:
    assert sorted(DISPATCHES) == sorted(MOE_DISPATCHES)


def test_no_module_below_the_loop_names_a_backend() -> None:
    """Only the registry and the backends' own modules name a backend; those import none of each other."""
    found = [
        line
        for path in sorted(TRAIN.glob("*.py"))
        if path.name not in BACKEND_MODULES
        for line in backend_mentions(path)
    ]
    for name in IMPLEMENTATION_MODULES:
        imports = [line for line in backend_mentions(TRAIN / name) if " imports " in line]
        found += imports
    assert found == []


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("capacity_factor", [None, 1.5])
def test_the_planner_plans_the_dispatch_the_model_runs(backend: str, capacity_factor: float | None) -> None:
    # bf16-sr is neuronx-distributed's optimizer's; torch-native trains the recipe under bf16-mixed
    regime = ["precision=bf16-mixed", "optimizer.zero1=true"] if backend == "torch-native" else []
    recipe = load_recipe("mixtral-8x7b-sft", [f"backend={backend}", *regime])
    recipe = recipe.model_copy(update={"moe": recipe.moe.model_copy(update={"capacity_factor": capacity_factor})})
    expected = default_moe_dispatch(backend, capacity_factor)  # type: ignore[arg-type]
    assert moe_dispatch_of(recipe) == expected
    assert expected == ("capacity" if capacity_factor else FACTS[backend].moe_dispatch)  # type: ignore[index]
