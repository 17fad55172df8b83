"""The system tools some tests run (shellcheck, gpg, systemd-analyze): a missing one is a message naming the
tool and how to install it, not a FileNotFoundError from deep inside a subprocess call.

Outside CI the test is skipped with that message (a developer's machine may lack them); in CI (CI=true) it fails,
as tests/conftest.py fails a CI run with any skip: CI installs them (`make tools`). The local Slurm is installed
by its own fixture (tests/pipeline/conftest.py, training.local.slurm)."""

from __future__ import annotations

import os
import shutil

import pytest

# tool -> how to get it on a Debian or Ubuntu machine
INSTALL = {
    "shellcheck": "`make tools` (as root) or `sudo apt-get install shellcheck`",
    "gpg": "`make tools` (as root) or `sudo apt-get install gnupg`",
    "systemd-analyze": "`sudo apt-get install systemd`",
}


def require_tool(tool: str) -> str:
    """The path of `tool`; when it is not on PATH the test stops here with what to install."""
    path = shutil.which(tool)
    if path is not None:
        return path
    message = f"{tool} is not on PATH; install it with {INSTALL[tool]}"
    if os.environ.get("CI") == "true":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)
