"""The node software sets' locked requirement sets: complete, consistent and installable on the Python of every
OS each set runs on, checked with pip's own resolver (it reads package metadata from PyPI; nothing is installed)."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import tomllib

from stacks.cluster_requirements import (
    REQUIREMENTS_IN,
    ROOT,
    SOURCE_ONLY,
    normalized,
    pins_of,
    read_lock,
    resolve,
)
from training.config.backends import Backend
from training.software import NODE_OPERATING_SYSTEMS, NODE_SOFTWARE

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)


SOFTWARE_ON_OS: list[tuple[Backend, str]] = [
    (backend, os) for backend, software in NODE_SOFTWARE.items() for os in software.operating_systems
]


def test_each_lock_resolves_to_itself_for_the_python_of_every_os_it_runs_on() -> None:
    """Resolving a lock for an OS's CPython and glibc installs exactly the lock: every dependency of every pin is
    in it, at a version that satisfies everything that needs it, with a wheel for that platform (the neuron
    backend's on Ubuntu 22.04's 3.10 and 24.04's 3.12; TorchNeuron's on 24.04's 3.12). The resolutions run side
    by side: each spends most of its time waiting for PyPI."""

    def resolved(backend: Backend, os: str) -> list[str]:
        return pins_of(resolve(["-r", str(NODE_SOFTWARE[backend].lock)], NODE_OPERATING_SYSTEMS[os]))

    with ThreadPoolExecutor(max_workers=len(SOFTWARE_ON_OS)) as pool:
        results = list(pool.map(lambda pair: resolved(*pair), SOFTWARE_ON_OS))
    assert len(SOFTWARE_ON_OS) == 3  # neuron on two OSes, TorchNeuron on one
    differences = {
        f"{backend} on {os}": sorted(set(pins) ^ set(read_lock(NODE_SOFTWARE[backend].lock)))
        for (backend, os), pins in zip(SOFTWARE_ON_OS, results, strict=True)
        if pins != list(read_lock(NODE_SOFTWARE[backend].lock))
    }
    assert not differences, f"pins the resolution and the lock do not share (run `make lock`): {differences}"


def test_the_torchneuron_lock_pins_what_the_tests_run_the_torch_native_backend_with() -> None:
    """The trn2 nodes' environment is the one this project tests the torch-native backend in: the same torch,
    transformers and every other pin of pyproject.toml's runtime and `training` extra, resolved for Python 3.12."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    tested = {normalized(pin): pin for pin in (*project["dependencies"], *project["optional-dependencies"]["training"])}
    software = NODE_SOFTWARE["torch-native"]
    wanted = [line.split("#", 1)[0].strip() for line in software.requirements_in.read_text().splitlines()]
    pinned = {normalized(pin): pin for pin in wanted if "==" in pin}
    assert pinned == tested
    locked = {normalized(pin): pin.split("==")[1] for pin in read_lock(software.lock)}
    assert {name: pin.split("==")[1] for name, pin in tested.items()}.items() <= locked.items()
    assert not [name for name in locked if name.startswith(("torch-xla", "neuronx"))]


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
