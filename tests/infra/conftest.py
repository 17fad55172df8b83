"""Infra fixtures: each environment synthesized once per session (tests/support/synthesis.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

import training.software
from tests.support.pinned_script import pinned_copy
from tests.support.synthesis import ENVIRONMENT_NAMES, Synthesized, synthesize


@pytest.fixture(scope="session")
def synthesized(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Synthesized]:
    return {name: synthesize(name, tmp_path_factory.mktemp(f"cdk-{name}")) for name in ENVIRONMENT_NAMES}


@pytest.fixture(scope="session")
def default_env(synthesized: dict[str, Synthesized]) -> Synthesized:
    return synthesized["default"]


@pytest.fixture(scope="session")
def smoke_env(synthesized: dict[str, Synthesized]) -> Synthesized:
    return synthesized["smoke"]


@pytest.fixture
def torchneuron_pinned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A bootstrap script whose TorchNeuron block is pinned (test versions), where the software table reads the
    releases and their pins from (the nodes' files still come from assets/node/)."""
    script = pinned_copy(tmp_path)
    monkeypatch.setattr(training.software, "BOOTSTRAP_SCRIPT", script)
    return script
