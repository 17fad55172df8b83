"""Facts about the Trainium instance types a compute queue may use, for validation before synth."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ComputeInstanceFacts:
    neuron_cores: int
    efa: bool


# Source: EC2 instance type pages for Trn1/Trn1n (16 chips x 2 NeuronCore-v2; trn1.2xlarge 1 chip, no EFA).
COMPUTE_INSTANCE_TYPES: dict[str, ComputeInstanceFacts] = {
    "trn1.2xlarge": ComputeInstanceFacts(neuron_cores=2, efa=False),
    "trn1.32xlarge": ComputeInstanceFacts(neuron_cores=32, efa=True),
    "trn1n.32xlarge": ComputeInstanceFacts(neuron_cores=32, efa=True),
}
