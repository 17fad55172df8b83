"""Infra fixtures: each environment synthesized once per session (tests/support/synthesis.py)."""

from __future__ import annotations

import pytest

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
