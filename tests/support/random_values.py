"""Random values torch generates, counted at its dispatcher: the measurement behind the start-up test
(tests/training/train/test_startup.py) and benchmark (benchmarks/startup.py).

Counted: every aten operation tagged `nondeterministic_seeded` (normal_, uniform_, bernoulli_, randn,
randperm, ... whoever calls them: torch.nn.init, a layer's constructor, our own initialisation) on a tensor
that has storage, with the bytes of its result. The same operations on the meta device are listed apart: they
produce no values (a layer built on the meta device still calls its initialiser there).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass
class RandomValues:
    operations: list[str] = field(default_factory=list)  # with storage: values were made
    bytes: int = 0
    on_meta: list[str] = field(default_factory=list)  # on the meta device: nothing was made


class _Recorder(TorchDispatchMode):
    def __init__(self, found: RandomValues) -> None:
        super().__init__()
        self.found = found

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        if torch.Tag.nondeterministic_seeded in func.tags:
            made = result if isinstance(result, torch.Tensor) else args[0]
            if made.device.type == "meta":
                self.found.on_meta.append(str(func))
            else:
                self.found.operations.append(str(func))
                self.found.bytes += made.numel() * made.element_size()
        return result


@contextmanager
def random_values() -> Iterator[RandomValues]:
    """The random operations run inside (in this thread), and the bytes of values they made."""
    found = RandomValues()
    with _Recorder(found):
        yield found
