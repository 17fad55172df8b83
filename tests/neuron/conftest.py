"""The neuron tier: neuronx-distributed's real code on torch-xla's CPU device (`make test-neuron`)."""

from __future__ import annotations

import importlib.util

import pytest

MISSING = [
    name for name in ("torch_xla", "neuronx_distributed", "neuron_standins") if not importlib.util.find_spec(name)
]
if MISSING:
    raise pytest.UsageError(
        f"tests/neuron needs the neuron tier's environment (missing: {', '.join(MISSING)}); run `make test-neuron`"
    )
