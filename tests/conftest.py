"""Shared by every tier (the neuron tier's environment has no CDK): the repository root, no AWS look-ups,
and no skipped test in CI."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

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


# The edit loop's subset (`make test-fast`, `pytest -m fast`): pure configuration, layout, template and model
# checks that need no Slurm, no torchrun, no CDK synth and no neuron tier; a few minutes on 2 cores.
FAST_MODULES = frozenset(
    {
        "tests/training/test_recipe.py",
        "tests/training/test_site.py",
        "tests/training/test_setting_ranges.py",
        "tests/training/test_loader.py",
        "tests/training/test_layouts.py",
        "tests/training/test_recompute.py",
        "tests/training/test_throughput_model.py",
        "tests/pipeline/test_templates.py",
        "tests/pipeline/test_job_settings.py",
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.relative_to(ROOT).as_posix() in FAST_MODULES:
            item.add_marker(pytest.mark.fast)
