"""The cluster's locked requirement set: complete, consistent and installable on the nodes' Python, checked
with pip's own resolver (it reads package metadata from PyPI; nothing is installed)."""

from __future__ import annotations

import re

import pytest

from stacks.cluster_requirements import LOCK, REQUIREMENTS_IN, SOURCE_ONLY, normalized, pins_of, read_lock, resolve

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)


def test_lock_resolves_to_itself_for_the_nodes_python() -> None:
    """Resolving the lock for CPython 3.10 installs exactly the lock: every dependency of every pin is in it,
    at a version that satisfies everything that needs it, with a wheel for the nodes' platform."""
    assert pins_of(resolve(["-r", str(LOCK)])) == list(read_lock())


def test_lock_has_exact_pins_and_every_direct_requirement() -> None:
    pins = read_lock()
    assert pins and all(re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!-]+", pin) for pin in pins), pins
    locked = {normalized(pin): pin.split("==", 1)[1] for pin in pins}
    for line in REQUIREMENTS_IN.read_text().splitlines():
        requirement = line.split("#", 1)[0].strip()
        if requirement:
            assert normalized(requirement) in locked, f"{requirement} is not in the lock: run `make lock`"
            if "==" in requirement:
                assert locked[normalized(requirement)] == requirement.split("==", 1)[1], "run `make lock`"


def test_the_development_transformers_does_not_install_on_the_nodes_python() -> None:
    """Why the lock keeps transformers 4.57: 5.23 (the local development pin) needs Python 3.11, and NxD 2.28
    imports transformers.utils.fx, which transformers 5 removed."""
    with pytest.raises(RuntimeError, match=r"transformers==5\.23\.0"):
        resolve(["transformers==5.23.0"])


def test_source_only_requirements_are_the_locked_versions() -> None:
    """The wheels `make lock` builds from source are the versions the lock pins (the nodes' pip builds those)."""
    locked = {normalized(pin): pin for pin in read_lock()}
    assert [locked.get(normalized(pin)) for pin in SOURCE_ONLY] == list(SOURCE_ONLY)
