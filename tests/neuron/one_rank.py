"""This test process as a one-rank torchrun job on the neuron backend (shared by the tier's in-process tests)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def one_rank_neuron_backend() -> Iterator[None]:
    """torchrun's variables for one rank (restored afterwards) and the facade initialized on the neuron backend."""
    from training.config.recipe import OptimizerSection
    from training.model import parallel
    from training.train.neuron_training import neuron_trainer_options

    ranks = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    with pytest.MonkeyPatch.context() as monkeypatch:
        for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **ranks}.items():
            monkeypatch.setenv(name, value)
        parallel.initialize(1, "neuron", neuron_options=neuron_trainer_options(OptimizerSection(lr=1e-3)))
        try:
            yield
        finally:
            parallel.destroy()
