"""What autograd keeps for backward, in bytes: the measurement the memory planner's activation terms are
tested against (tests/training/train/test_memory.py) and the benchmark reports (benchmarks/bench_train.py).

Counted: every tensor an operation saves for backward (`torch.autograd.graph.saved_tensors_hooks`), once per
storage, parameters excluded (they are counted as weights), plus the inputs `torch.utils.checkpoint` keeps
for its recomputation (the operations inside a checkpointed region save nothing: checkpoint's own hooks take
over there, which is the point).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn


@dataclass
class SavedTensors:
    excluded: set[int]
    storages: dict[int, int] = field(default_factory=dict)  # storage address -> bytes
    shapes: list[tuple[tuple[int, ...], torch.dtype]] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def record(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address in self.excluded or address in self.storages:
            return
        self.storages[address] = storage.nbytes()
        self.shapes.append((tuple(tensor.shape), tensor.dtype))


@contextmanager
def saved_for_backward(model: nn.Module) -> Iterator[SavedTensors]:
    """Measure a forward pass run inside the block (keep its output alive until the block ends)."""
    saved = SavedTensors(excluded={p.untyped_storage().data_ptr() for p in model.parameters()})
    checkpoint = torch.utils.checkpoint.checkpoint

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.record(tensor)
        return tensor

    def keeping_inputs(function: Any, *args: Any, **kwargs: Any) -> Any:
        for argument in args:
            if isinstance(argument, torch.Tensor):
                saved.record(argument)
        return checkpoint(function, *args, **kwargs)

    torch.utils.checkpoint.checkpoint = keeping_inputs  # type: ignore[assignment]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield saved
    finally:
        torch.utils.checkpoint.checkpoint = checkpoint
