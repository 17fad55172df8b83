"""The software a Trainium queue installs, and the software a run ran with, each written in one place.

Two software sets, one per training backend on Trainium (`NODE_SOFTWARE`): the neuron backend's Neuron 2.28
(neuronx-distributed on PyTorch/XLA 2.9, trn1 and trn2) and the torch-native backend's TorchNeuron (Neuron's
native PyTorch backend, PyTorch 2.13, trn2 only). The bootstrap script (`assets/node/on_node_configured.sh`)
pins each release's packages in a block of its own and builds the shared Python environment of the one its
`--neuron-release` names from that set's locked requirements; it marks a finished environment with a file
naming both. The stacks read the pins from the script (`stacks.cluster`), the model card reads the marker of
the interpreter running it, or else the shipped source tree, which the pipeline uploads with `training/`
(training/, assets/, pyproject.toml side by side).
"""

from __future__ import annotations

import hashlib
import re
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from training.config.backends import Backend
from training.config.hardware import Generation

SOURCE_ROOT = Path(__file__).resolve().parent.parent
BOOTSTRAP_SCRIPT = SOURCE_ROOT / "assets" / "node" / "on_node_configured.sh"
NODE_ASSETS = SOURCE_ROOT / "assets" / "node"
CLUSTER_LOCK = NODE_ASSETS / "cluster-requirements.txt"
# The file system's folder of the shared Python environments the head node's bootstrap builds.
ENVS_FOLDER = "envs"
# Written last into a finished shared environment by the bootstrap script (its ENV_MARKER), one key=value a line.
ENV_MARKER = ".neuron-env-complete"
# The distributions whose versions say what trained and converted the model; absent ones are left out.
REPORTED_PACKAGES = ("torch", "torch-neuronx", "neuronx-cc", "neuronx-distributed", "transformers")


@dataclass(frozen=True)
class Pins:
    """A Neuron release and the SHA-256 of the locked requirement set, and where they were read."""

    neuron_release: str | None
    lock_sha256: str | None
    origin: str


@dataclass(frozen=True)
class NodeOs:
    """A ParallelCluster node OS (`Image.Os`), as its Python wheels see it."""

    python: str  # its python3, which the shared environment is built with
    glibc_minor: int  # glibc 2.N: wheels tagged manylinux_2_17 ... manylinux_2_N install


# ParallelCluster's Ubuntu images (Ubuntu 24.04 since 3.13; 26.04 is not supported).
NODE_OPERATING_SYSTEMS: dict[str, NodeOs] = {"ubuntu2204": NodeOs("3.10", 35), "ubuntu2404": NodeOs("3.12", 39)}


@dataclass(frozen=True)
class NodeSoftware:
    """What a Trainium queue installs for one training backend: the bootstrap script's pinned block (its
    release variable), the locked requirement set, and where it runs."""

    backend: Backend
    title: str  # what a message calls it
    release_variable: str  # the bootstrap script's variable holding the release
    pin_variables: tuple[str, ...]  # its variables holding the release's package versions
    requirements_in: Path
    lock: Path
    operating_systems: tuple[str, ...]  # ParallelCluster Image.Os values the lock installs on; `make lock`: first
    generations: tuple[Generation, ...]  # Trainium generations the release runs on
    env_prefix: str  # the shared environment's folder: <mount>/envs/<env_prefix>-<release>
    env_title: str  # what the lock's header calls that environment

    def release(self, script: str | None = None) -> str:
        """The release the bootstrap script pins for this set; the script is the one place it is written."""
        text = BOOTSTRAP_SCRIPT.read_text() if script is None else script
        pattern = rf'^{self.release_variable}="([0-9]+\.[0-9]+\.[0-9]+)"$'
        match = re.search(pattern, text, flags=re.MULTILINE)
        if match is None:
            raise ValueError(f"the bootstrap script pins no {self.release_variable}")
        return match.group(1)

    def unpinned(self, script: str | None = None) -> tuple[str, ...]:
        """The block's version variables the script leaves empty (or lacks): a release with any is refused."""
        text = BOOTSTRAP_SCRIPT.read_text() if script is None else script
        values = dict(re.findall(r'^([A-Z_]+)="([^"]*)"', text, flags=re.MULTILINE))
        return tuple(name for name in self.pin_variables if not values.get(name))

    def shared_env(self, mount_dir: str, release: str) -> str:
        return f"{mount_dir}/{ENVS_FOLDER}/{self.env_prefix}-{release}"


NODE_SOFTWARE: dict[Backend, NodeSoftware] = {
    "neuron": NodeSoftware(
        backend="neuron",
        title="Neuron 2.28 (neuronx-distributed, PyTorch/XLA 2.9)",
        release_variable="NEURON_RELEASE",
        pin_variables=tuple(
            f"NEURON_{name}_VERSION"
            for name in ("DKMS", "COLLECTIVES", "RUNTIME_LIB", "TOOLS", "TORCH_NEURONX", "NEURONX_CC")
        )
        + ("NEURON_NEURONX_DISTRIBUTED_VERSION",),
        requirements_in=NODE_ASSETS / "cluster-requirements.in",
        lock=CLUSTER_LOCK,
        operating_systems=("ubuntu2204", "ubuntu2404"),
        generations=("trn1", "trn2"),
        env_prefix="neuron",
        env_title="Neuron",
    ),
    # TorchNeuron's wheels are announced for Ubuntu 24.04 from Neuron 2.34 (2.33's were for Ubuntu 26.04 only, which
    # ParallelCluster does not run); its Python is 3.12 to 3.14, so Ubuntu 22.04's 3.10 cannot run it.
    "torch-native": NodeSoftware(
        backend="torch-native",
        title="TorchNeuron (Neuron's native PyTorch backend, PyTorch 2.13)",
        release_variable="TORCHNEURON_RELEASE",
        pin_variables=tuple(
            f"TORCHNEURON_{name}_VERSION"
            for name in ("DKMS", "COLLECTIVES", "RUNTIME_LIB", "TOOLS", "TORCH_NEURONX", "NEURONX_CC", "NKI")
        ),
        requirements_in=NODE_ASSETS / "torch-native-requirements.in",
        lock=NODE_ASSETS / "torch-native-requirements.txt",
        operating_systems=("ubuntu2404",),
        generations=("trn2",),
        env_prefix="torchneuron",
        env_title="TorchNeuron",
    ),
}
# What a Trainium queue installs unless its environment file says otherwise: NxD where TorchNeuron does not run
# (trn1), TorchNeuron where it does (NxD's training APIs are in maintenance from Neuron 2.30).
DEFAULT_BACKEND: dict[Generation, Backend] = {"trn1": "neuron", "trn2": "torch-native"}


def marker_pins(text: str, origin: str) -> Pins | None:
    """The release and lock digest an environment's marker records; None if it records neither."""
    fields = dict(line.partition("=")[::2] for line in text.splitlines() if "=" in line)
    release, digest = fields.get("neuron_release") or None, fields.get("requirements_sha256") or None
    return Pins(release, digest, origin) if release or digest else None


def running_pins(prefix: Path | None = None, root: Path = SOURCE_ROOT, backend: Backend = "neuron") -> Pins | None:
    """What the environment of this interpreter was built from (its marker), else what the source tree beside
    this package pins for `backend`'s software (the neuron backend's for the cpu backend, which the local demo
    runs); None when neither is there (a package installed without its source tree)."""
    marker = (prefix or Path(sys.prefix)) / ENV_MARKER
    try:
        found = marker_pins(marker.read_text(), f"the job's Python environment ({marker})")
    except (OSError, UnicodeDecodeError):
        found = None
    if found is not None:
        return found
    chosen = NODE_SOFTWARE.get(backend, NODE_SOFTWARE["neuron"])
    script, lock = root / BOOTSTRAP_SCRIPT.relative_to(SOURCE_ROOT), root / chosen.lock.relative_to(SOURCE_ROOT)
    try:
        release: str | None = chosen.release(script.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        release = None
    try:
        digest: str | None = hashlib.sha256(lock.read_bytes()).hexdigest()
    except OSError:
        digest = None
    if release is None and digest is None:
        return None
    return Pins(release, digest, "the shipped source tree (assets/node/), not a built environment")


def package_versions(names: tuple[str, ...] = REPORTED_PACKAGES) -> tuple[tuple[str, str], ...]:
    """(distribution, version) of those installed in the running interpreter, in the order asked."""
    found = []
    for name in names:
        try:
            found.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            continue
    return tuple(found)
