"""Shared by every tier (the neuron tier's environment has no CDK): no AWS look-ups, no skipped test in CI, and
the `slurm` mark with its xdist group. Fixtures and hooks only: what tests import is in tests/support."""

from __future__ import annotations

import os

import pytest

# No credentials and no instance metadata look-ups, ever, in any test.
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

# tests/neuron needs the neuron tier's environment (torch-xla, neuronx-distributed); `make test-neuron`
# (run by `make test`) sets NEURON_TIER and runs it there.
collect_ignore = [] if os.environ.get("NEURON_TIER") else ["neuron"]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """In CI nothing may be skipped: a skip there means a missing install step, not an optional test."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if os.environ.get("CI") == "true" and skipped and exitstatus == 0:
        reporter.write_line(f"CI: {len(skipped)} test(s) skipped; every test must run in CI", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# The local Slurm's tests all run on one xdist worker: a single local cluster at a time, so the torchrun jobs of
# two clusters (MASTER_PORT = 31000 + job id % 100, and every cluster numbers its jobs 1, 2, ...) never meet on
# this host. `--dist loadgroup` honours the group; the Makefile's `test` runs the `slurm` tests in a plain pytest
# process after the xdist run, where the group is only a mark.
SLURM_GROUP = "local-slurm"
# tests/infra/conftest.py's session fixtures: every environment synthesized with cdk-nag (a minute or more).
SYNTHESIS_FIXTURES = frozenset({"synthesized", "default_env", "smoke_env"})


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that uses the local Slurm (the `local_slurm` fixture, directly or through another fixture, or a
    cluster of its own, marked `slurm`) is marked `slurm` and put in the local Slurm's xdist group; one that
    reads a CDK synthesis is marked `slow`."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if "local_slurm" in fixtures or item.get_closest_marker("slurm"):  # a test may start its own cluster
            item.add_marker(pytest.mark.slurm)
            item.add_marker(pytest.mark.xdist_group(SLURM_GROUP))
        if fixtures & SYNTHESIS_FIXTURES:
            item.add_marker(pytest.mark.slow)
