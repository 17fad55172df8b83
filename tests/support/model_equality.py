"""Two models the same bit for bit, and the bytes a process reads: shared by the start-up tests of the cpu
backend (tests/training/train/test_startup.py) and of the neuron backend (tests/neuron/test_startup.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.model.transformer import CausalLM


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().reshape(-1).contiguous().view(torch.uint8)


SIMPLE = (bool, int, float, str, torch.device, torch.dtype, type(None))


def simple_attributes(module: nn.Module) -> dict[str, Any]:
    """A module's own plain attributes (settings, and e.g. the device NxD's layers record from their weight)."""
    return {k: v for k, v in vars(module).items() if not k.startswith("_") and isinstance(v, SIMPLE)}


def assert_same_model(expected: CausalLM, actual: CausalLM) -> None:
    """Bit for bit the same values, and everything a parameter carries (dtype, device, requires_grad, the
    tensor-parallel attributes NxD reads), the same tied parameters, buffers and module attributes."""
    ours = dict(actual.named_parameters(remove_duplicate=False))
    theirs = dict(expected.named_parameters(remove_duplicate=False))
    assert ours.keys() == theirs.keys()
    for name, parameter in theirs.items():
        other = ours[name]
        assert (other.dtype, other.device, other.requires_grad) == (
            parameter.dtype,
            parameter.device,
            parameter.requires_grad,
        ), name
        assert other.__dict__ == parameter.__dict__, name
        assert torch.equal(bits(other), bits(parameter)), name
    shared = {name: [n for n, p in theirs.items() if p is parameter] for name, parameter in theirs.items()}
    assert shared == {name: [n for n, p in ours.items() if p is parameter] for name, parameter in ours.items()}
    buffers = dict(expected.named_buffers())
    assert {n: bits(b) for n, b in actual.named_buffers()}.keys() == buffers.keys()
    assert all(torch.equal(bits(b), bits(buffers[n])) for n, b in actual.named_buffers())
    for (name, module), (_, other) in zip(expected.named_modules(), actual.named_modules(), strict=True):
        assert type(module) is type(other), name
        assert simple_attributes(other) == simple_attributes(module), name


def read_bytes() -> int:
    """What this process has read so far through read(2) and its kind (a mapped page never read is not)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("/proc/self/io has no rchar")
