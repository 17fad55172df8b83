"""Lambda handlers of assets/lambda/, loaded from their files as the Lambda runtime loads them."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType


@contextmanager
def as_lambda_runtime(directory: Path) -> Iterator[None]:
    """The asset's directory on sys.path, as the runtime has it (a handler imports the modules beside it),
    and no __pycache__ written there: it would ship in the Lambda asset and change its hash."""
    writes, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    sys.path.insert(0, str(directory))
    try:
        yield
    finally:
        sys.path.remove(str(directory))
        sys.dont_write_bytecode = writes


def load_handler_file(path: Path, module_name: str) -> ModuleType:
    """The handler module at `path`, registered as `module_name` (dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    with as_lambda_runtime(path.parent):
        spec.loader.exec_module(module)
    return module


def import_handler_module(directory: Path, module_name: str) -> ModuleType:
    """A module beside a handler, by the top-level name the handler imports it with (the same object once
    the handler has imported it)."""
    with as_lambda_runtime(directory):
        return importlib.import_module(module_name)
