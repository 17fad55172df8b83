"""The software a run ran with: the Neuron release and the cluster's lock, each written in one place.

The bootstrap script (`assets/node/on_node_configured.sh`) pins the Neuron release and builds the shared
Python environment from the locked requirement set (`assets/node/cluster-requirements.txt`); it marks a
finished environment with a file naming both. The stacks read the pin from the script (`stacks.cluster`), the
model card reads the marker of the interpreter running it, or else the shipped source tree, which the pipeline
uploads with `training/` (training/, assets/, pyproject.toml side by side).
"""

from __future__ import annotations

import hashlib
import re
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parent.parent
BOOTSTRAP_SCRIPT = SOURCE_ROOT / "assets" / "node" / "on_node_configured.sh"
CLUSTER_LOCK = SOURCE_ROOT / "assets" / "node" / "cluster-requirements.txt"
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


def pinned_neuron_release(script: str) -> str:
    """The Neuron SDK release the bootstrap script pins; the script is the one place it is written."""
    match = re.search(r'^NEURON_RELEASE="([0-9.]+)"$', script, flags=re.MULTILINE)
    if match is None:
        raise ValueError("the bootstrap script pins no NEURON_RELEASE")
    return match.group(1)


def marker_pins(text: str, origin: str) -> Pins | None:
    """The release and lock digest an environment's marker records; None if it records neither."""
    fields = dict(line.partition("=")[::2] for line in text.splitlines() if "=" in line)
    release, digest = fields.get("neuron_release") or None, fields.get("requirements_sha256") or None
    return Pins(release, digest, origin) if release or digest else None


def running_pins(prefix: Path | None = None, root: Path = SOURCE_ROOT) -> Pins | None:
    """What the environment of this interpreter was built from (its marker), else what the source tree beside
    this package pins; None when neither is there (a package installed without its source tree)."""
    marker = (prefix or Path(sys.prefix)) / ENV_MARKER
    try:
        found = marker_pins(marker.read_text(), f"the job's Python environment ({marker})")
    except (OSError, UnicodeDecodeError):
        found = None
    if found is not None:
        return found
    script, lock = root / BOOTSTRAP_SCRIPT.relative_to(SOURCE_ROOT), root / CLUSTER_LOCK.relative_to(SOURCE_ROOT)
    try:
        release: str | None = pinned_neuron_release(script.read_text())
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
