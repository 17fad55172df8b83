"""Lambda handlers of assets/lambda/, loaded from their files as the Lambda runtime loads them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_handler_file(path: Path, module_name: str) -> ModuleType:
    """The handler module at `path`, registered as `module_name` (dataclasses look their module up). No
    __pycache__ is written next to it: it would ship in the Lambda asset and change its hash."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    writes, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = writes
    return module
