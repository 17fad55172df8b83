"""The node bootstrap script with its TorchNeuron block filled in with test versions, for the tests of what a
pinned block enables (the shipped block is not pinned yet: docs/native-pytorch.md). The versions are made up and
labelled so: the tests check the mechanism (which block is installed where), never Neuron's version numbers."""

from __future__ import annotations

from pathlib import Path

from training.software import BOOTSTRAP_SCRIPT, NODE_SOFTWARE

TEST_VERSIONS = {
    "TORCHNEURON_DKMS_VERSION": "9.1.0.0",
    "TORCHNEURON_COLLECTIVES_VERSION": "9.2.0.0",
    "TORCHNEURON_RUNTIME_LIB_VERSION": "9.3.0.0",
    "TORCHNEURON_TOOLS_VERSION": "9.4.0.0",
    "TORCHNEURON_TORCH_NEURONX_VERSION": "2.13.3.1.99999",
    "TORCHNEURON_NEURONX_CC_VERSION": "9.5.0.0",
    "TORCHNEURON_NKI_VERSION": "9.6.0",
}


def pinned_text(script: str | None = None) -> str:
    """The script's text with every empty TorchNeuron version variable set to its test version."""
    text = BOOTSTRAP_SCRIPT.read_text() if script is None else script
    assert set(TEST_VERSIONS) == set(NODE_SOFTWARE["torch-native"].pin_variables)
    for name, version in TEST_VERSIONS.items():
        text = text.replace(f'\n{name}=""', f'\n{name}="{version}"')
    return text


def pinned_copy(directory: Path) -> Path:
    """An executable copy of the pinned script in `directory` (its lock files are not needed beside it)."""
    path = directory / BOOTSTRAP_SCRIPT.name
    path.write_text(pinned_text())
    path.chmod(0o755)
    return path
