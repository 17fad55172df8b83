"""The real local Slurm cluster the pipeline tests submit to: started once per session, stopped at its end."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from training.errors import UserError
from training.local.slurm import LocalSlurm, start


@pytest.fixture(scope="session")
def local_slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    """Three nodes in a temporary state directory, so a developer's own `.local-slurm` cluster is untouched.

    Without root and without Slurm installed the tests are skipped (CI, which runs as root, fails on skips).
    """
    try:
        cluster = start(tmp_path_factory.mktemp("local-slurm"), nodes=3)
    except UserError as error:
        if os.geteuid() != 0:
            pytest.skip(f"local Slurm unavailable without root: {error}")
        raise
    yield cluster
    cluster.stop()
