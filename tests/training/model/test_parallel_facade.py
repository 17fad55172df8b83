"""The parallel facade's declarations against neuronx-distributed's real source and the cpu backend.

Each facade name is declared once in `training/model/parallel.py` (signature, docstring and the Neuron class or
function it stands for). Here: every declaration naming neuronx-distributed is checked against the vendored
NxD 2.28 source, read with `ast` (NxD cannot be imported here: it needs torch-xla), so the declaration cannot
drift from what the `neuron` backend will call; the `cpu` backend implements every name with exactly the
declared signature; and the argument passing both backends share sends what NxD's signatures accept.
"""

from __future__ import annotations

import ast
import inspect
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from training.model import cpu_backend, native_backend, neuron_backend, parallel
from training.model.parallel import DECLARATIONS, Declaration

ARCHIVE_NAME = "neuronx-distributed-2.28.0.tar.gz"
DEFAULT_ARCHIVE = Path(__file__).resolve().parents[3].parent / "shared" / "vendor" / ARCHIVE_NAME
NXD_DECLARATIONS = [d for d in DECLARATIONS.values() if d.module.startswith("neuronx_distributed.")]
REQUIRED = inspect.Parameter.empty


@pytest.fixture(scope="module")
def nxd_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `src` folder of the vendored neuronx-distributed source, extracted from its archive."""
    archive = Path(os.environ.get("NXD_SOURCE", DEFAULT_ARCHIVE))
    if not archive.is_file():
        pytest.fail(
            f"the neuronx-distributed source archive {archive} is missing: the facade's declarations are checked "
            f"against it (set NXD_SOURCE to the path of {ARCHIVE_NAME})",
            pytrace=False,
        )
    target = tmp_path_factory.mktemp("nxd")
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    found = sorted(target.glob("*/src/neuronx_distributed"))
    assert found, f"{archive} holds no */src/neuronx_distributed"
    return found[0].parent


@dataclass
class NxdParameter:
    name: str
    positional: bool  # can be passed by position (not keyword-only)
    default: ast.expr | None  # the default as written in NxD's source; None when it has none

    @property
    def required(self) -> bool:
        return self.default is None


def _default(node: ast.expr) -> Any:
    """The value of a default written in NxD's source: a literal or a `torch.` attribute such as torch.float32."""
    try:
        return ast.literal_eval(node)
    except ValueError:
        dotted = ast.unparse(node).split(".")
        assert dotted[0] == "torch", f"default {ast.unparse(node)!r} is neither a literal nor a torch attribute"
        value: Any = torch
        for part in dotted[1:]:
            value = getattr(value, part)
        return value


def _nxd_definition(src: Path, declaration: Declaration) -> tuple[ast.Module, ast.FunctionDef | ast.ClassDef]:
    module = src / declaration.module.replace(".", "/")
    path = module / "__init__.py" if module.is_dir() else module.with_suffix(".py")
    assert path.is_file(), f"{declaration.name}: NxD has no module {declaration.module} ({path})"
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == declaration.attribute:
            return tree, node
    raise AssertionError(f"{declaration.name}: {declaration.module} defines no {declaration.attribute}")


def _nxd_parameters(definition: ast.FunctionDef | ast.ClassDef) -> list[NxdParameter]:
    """The parameters of NxD's function, or of its class's `__init__` without `self`."""
    function = definition
    if isinstance(definition, ast.ClassDef):
        inits = [n for n in definition.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
        assert inits, f"NxD's {definition.name} defines no __init__ of its own"
        function = inits[0]
    assert isinstance(function, ast.FunctionDef)
    arguments = function.args
    positional = arguments.posonlyargs + arguments.args
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(arguments.defaults))
    defaults += arguments.defaults
    parameters = [NxdParameter(a.arg, True, d) for a, d in zip(positional, defaults, strict=True)]
    parameters += [
        NxdParameter(a.arg, False, d) for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True)
    ]
    return parameters[1:] if isinstance(definition, ast.ClassDef) else parameters


@pytest.mark.parametrize("declaration", NXD_DECLARATIONS, ids=lambda d: d.name)
def test_the_declaration_is_what_neuronx_distributed_accepts(declaration: Declaration, nxd_src: Path) -> None:
    _, definition = _nxd_definition(nxd_src, declaration)
    nxd = _nxd_parameters(definition)
    by_name = {p.name: p for p in nxd}
    supplied: set[str] = set()
    ours = list(declaration.signature.parameters.values())
    for index, parameter in enumerate(ours):
        where = f"{declaration.name}({parameter.name}) vs NxD {declaration.module}.{declaration.attribute}"
        if parameter.kind is parameter.POSITIONAL_ONLY:  # passed by position: NxD's parameter at that position
            assert index < len(nxd) and nxd[index].positional, f"{where}: NxD takes no argument at position {index}"
            assert nxd[index].required and parameter.default is REQUIRED, f"{where}: both must require it"
            supplied.add(nxd[index].name)
            continue
        assert parameter.kind is parameter.POSITIONAL_OR_KEYWORD, f"{where}: unexpected kind {parameter.kind}"
        assert parameter.name in by_name, f"{where}: NxD has no parameter {parameter.name!r} (it has {list(by_name)})"
        theirs = by_name[parameter.name]
        if parameter.default is REQUIRED:
            pass  # we always pass it: NxD's default (if it has one) never applies, whatever it is
        else:
            assert theirs.default is not None, f"{where}: NxD requires it, we default it to {parameter.default!r}"
            value = _default(theirs.default)
            assert parameter.default == value, f"{where}: our default {parameter.default!r} != NxD's {value!r}"
        supplied.add(parameter.name)
    missing = [p.name for p in nxd if p.required and p.name not in supplied]
    assert not missing, f"{declaration.name}: NxD requires {missing}, which the declaration does not pass"


@pytest.mark.parametrize(
    "declaration",
    [d for d in NXD_DECLARATIONS if not d.name[0].isupper()],  # functions; the layers are modules
    ids=lambda d: d.name,
)
def test_modifies_input_is_what_nxd_does_to_its_first_argument(declaration: Declaration, nxd_src: Path) -> None:
    """NxD's functions are `SomeFunction.apply(...)` autograd wrappers: read whether `forward` changes its input."""
    tree, definition = _nxd_definition(nxd_src, declaration)
    applied = [
        node.func.value.id
        for node in ast.walk(definition)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "apply"
        and isinstance(node.func.value, ast.Name)
    ]
    if not applied:  # a plain function (the parallel_state accessors): nothing it is given is a tensor
        assert not declaration.modifies_input
        return
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    forward = next(n for n in classes[applied[0]].body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    first = forward.args.args[1].arg  # after ctx
    in_place = [
        node.func.attr
        for node in ast.walk(forward)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == first
        and node.func.attr.endswith("_")
        and not node.func.attr.startswith("_")
    ]
    assert bool(in_place) == declaration.modifies_input, (
        f"{declaration.name}: NxD's {applied[0]}.forward calls {in_place} on {first}, "
        f"but the declaration says modifies_input={declaration.modifies_input}"
    )


def test_every_other_declaration_is_torch_xla() -> None:
    others = {d.name: f"{d.module}.{d.attribute}" for d in DECLARATIONS.values() if d not in NXD_DECLARATIONS}
    assert others == {
        "add_step_closure": "torch_xla.core.xla_model.add_step_closure",
        "rendezvous": "torch_xla.core.xla_model.rendezvous",
    }


@pytest.mark.parametrize("backend", [cpu_backend, native_backend], ids=["cpu", "torch-native"])
@pytest.mark.parametrize("declaration", DECLARATIONS.values(), ids=lambda d: d.name)
def test_the_cpu_and_torch_native_backends_implement_the_declaration_exactly(
    declaration: Declaration, backend: ModuleType
) -> None:
    implementation = backend.resolve(declaration)
    if backend is cpu_backend:
        assert getattr(cpu_backend, declaration.name) is implementation
    if inspect.isclass(implementation):
        assert issubclass(implementation, torch.nn.Module)
        parameters = list(inspect.signature(implementation.__init__).parameters.values())[1:]
        assert parameters == list(declaration.signature.parameters.values())
    else:
        assert inspect.signature(implementation) == declaration.signature


@pytest.mark.parametrize("declaration", DECLARATIONS.values(), ids=lambda d: d.name)
def test_the_facade_function_is_the_declared_one(declaration: Declaration) -> None:
    facade = getattr(parallel, declaration.name)
    assert inspect.signature(facade) == declaration.signature
    assert facade.__doc__ and facade.__doc__ == inspect.unwrap(facade).__doc__


def _recorded(declaration: Declaration, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    def record(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return args, kwargs

    result: tuple[tuple[Any, ...], dict[str, Any]] = declaration.call(
        record, declaration.signature.bind(*args, **kwargs)
    )
    return result


def test_arguments_go_by_name_with_the_defaults_and_positional_only_ones_by_position() -> None:
    # NxD's ColumnParallelLinear takes `device` before `stride`: passing stride by position would be wrong.
    assert _recorded(DECLARATIONS["ColumnParallelLinear"], 8, 16, stride=2) == (
        (),
        {
            "input_size": 8,
            "output_size": 16,
            "bias": True,
            "gather_output": True,
            "dtype": torch.float32,
            "stride": 2,
            "sequence_parallel_enabled": False,
            "sequence_dimension": None,
        },
    )
    tensor = torch.ones(2)
    assert _recorded(DECLARATIONS["copy_to_tensor_model_parallel_region"], tensor) == ((tensor,), {})


def test_the_neuron_backend_calls_the_named_attribute_on_a_copy_when_it_modifies_its_input() -> None:
    # A real in-place function stands in for NxD's cross-entropy (NxD itself needs torch-xla, absent here).
    signature = inspect.signature(lambda tensor, /: None)
    in_place = Declaration("relu", "torch", "relu_", signature, modifies_input=True)
    tensor = torch.tensor([-1.0, 2.0])
    assert torch.equal(neuron_backend.resolve(in_place)(tensor), torch.tensor([0.0, 2.0]))
    assert torch.equal(tensor, torch.tensor([-1.0, 2.0]))
    plain = Declaration("relu", "torch", "relu_", signature, modifies_input=False)
    assert neuron_backend.resolve(plain) is torch.relu_
