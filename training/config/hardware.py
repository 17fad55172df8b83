"""The Trainium instance types, one row each (torch-free): the facts the memory planner, the forecast, the
preflight, the CLI's choices and the stacks (validation, the site file, the node health check, the cost table)
read.

A row is all a new instance type takes: its chip (NeuronCores, HBM and peak FLOPS per chip), its chip count,
the logical NeuronCore size it runs at, its EFA interfaces, vCPUs and price; the per-core figures follow.
Sources: the EC2 instance type pages for Trn1/Trn1n (16 chips x 2 NeuronCore-v2, 32 GiB HBM a chip;
trn1.2xlarge one chip, no EFA; trn1.32xlarge 8 EFA interfaces at 800 Gbps, trn1n.32xlarge 16 at 1600 Gbps),
Neuron's Trainium architecture page (NeuronCore-v2: 95 bf16 TFLOPS). Prices are us-west-2 on-demand Linux list
prices in USD per hour (the AWS pricing pages, late 2026); other regions differ by a few percent.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chip:
    """One Trainium generation's chip (a /dev/neuron* device)."""

    name: str
    physical_cores: int  # NeuronCores a chip has
    hbm_gib: float  # device memory a chip has
    peak_bf16_tflops_per_core: float  # a physical NeuronCore's


TRAINIUM1 = Chip("Trainium1", physical_cores=2, hbm_gib=32.0, peak_bf16_tflops_per_core=95.0)


@dataclass(frozen=True)
class Hardware:
    """One instance type: a training node."""

    name: str
    chip: Chip
    neuron_devices: int  # /dev/neuron* on a healthy node (the preflight and the node health check count them)
    vcpus: int  # what ParallelCluster gives the Slurm node (EC2's DefaultVCpus): the jobs' --cpus-per-task
    usd_per_hour: float  # on-demand list price, us-west-2
    efa_devices: int = 0  # /sys/class/infiniband/* on a healthy node; 0: no EFA, a single node
    efa_gbps: int = 0  # EFA line rate (Neuron's Trn1/Trn1n architecture page)
    logical_core_size: int = 1  # physical NeuronCores per logical one, the runtime's unit (and a process's)

    @property
    def cores_per_node(self) -> int:
        """Training processes per node: one per (logical) NeuronCore."""
        return self.neuron_devices * self.chip.physical_cores // self.logical_core_size

    @property
    def hbm_gib_per_core(self) -> float:
        return self.chip.hbm_gib * self.logical_core_size / self.chip.physical_cores

    @property
    def peak_bf16_tflops_per_core(self) -> float:
        return self.chip.peak_bf16_tflops_per_core * self.logical_core_size

    @property
    def efa(self) -> bool:
        return self.efa_devices > 0


HARDWARE: dict[str, Hardware] = {
    hardware.name: hardware
    for hardware in (
        Hardware("trn1.2xlarge", TRAINIUM1, neuron_devices=1, vcpus=8, usd_per_hour=1.34375),
        Hardware(
            "trn1.32xlarge", TRAINIUM1, neuron_devices=16, vcpus=128, usd_per_hour=21.50, efa_devices=8, efa_gbps=800
        ),
        Hardware(
            "trn1n.32xlarge",
            TRAINIUM1,
            neuron_devices=16,
            vcpus=128,
            usd_per_hour=24.78,
            efa_devices=16,
            efa_gbps=1600,
        ),
    )
}
DEFAULT_HARDWARE = HARDWARE["trn1.32xlarge"]
