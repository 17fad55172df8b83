"""The Trainium instance types, one row each (torch-free): the facts the memory planner, the forecast, the
preflight, the CLI's choices and the stacks (validation, the site file, the node health check, the cost table)
read.

A row is all a new instance type takes: its chip (NeuronCores, HBM and peak FLOPS per chip), its chip count,
the logical NeuronCore size it runs at, its EFA interfaces, vCPUs and price; the per-core figures follow.
Sources: the EC2 instance type pages for Trn1/Trn1n (16 chips x 2 NeuronCore-v2, 32 GiB HBM a chip;
trn1.2xlarge one chip, no EFA; trn1.32xlarge 8 EFA interfaces at 800 Gbps, trn1n.32xlarge 16 at 1600 Gbps),
Neuron's Trainium architecture page (NeuronCore-v2: 95 bf16 TFLOPS); for Trn2 the EC2 and Neuron Trn2 pages
(16 chips x 8 NeuronCore-v3, 96 GiB HBM a chip, 667 dense bf16 TFLOPS a chip, logical NeuronCores of 1 or 2
physical ones with 2 the default; trn2.48xlarge 16 EFA cards at 3,200 Gbps, trn2.3xlarge one chip). Trn1 prices
are us-west-2 on-demand Linux list prices in USD per hour (the AWS pricing pages, late 2026), Trn2's the
on-demand list price where it is sold (trn2.48xlarge $35.76, trn2.3xlarge a sixteenth of it, late 2026); other
regions differ by a few percent, and a Capacity Block is priced per reservation.

The generation is the compiler's target (`neuronx-cc --target`) and neuronx-distributed's hardware type, which
decides where the replicas of a KV head sit: trn1 tiles them (`repeat`), trn2 puts them on adjacent ranks
(`repeat_interleave`, `parallel_state.arrange_kv_groups`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Generation = Literal["trn1", "trn2"]
GENERATIONS: tuple[Generation, ...] = ("trn1", "trn2")
DEFAULT_GENERATION: Generation = "trn1"


@dataclass(frozen=True)
class Chip:
    """One Trainium generation's chip (a /dev/neuron* device)."""

    name: str
    generation: Generation
    physical_cores: int  # NeuronCores a chip has
    hbm_gib: float  # device memory a chip has
    peak_bf16_tflops_per_core: float  # a physical NeuronCore's
    kv_replicas_adjacent: bool  # NxD puts a KV head's replicas on adjacent TP ranks (else tiled over them)
    logical_core_sizes: tuple[int, ...] = (1,)  # the LNC values the runtime accepts, the default first

    @property
    def default_lnc(self) -> int:
        return self.logical_core_sizes[0]

    @property
    def peak_bf16_tflops_per_logical_core(self) -> float:
        """What one training process drives at the default LNC (the MFU estimate's peak)."""
        return self.peak_bf16_tflops_per_core * self.default_lnc


TRAINIUM1 = Chip(
    "Trainium1", "trn1", physical_cores=2, hbm_gib=32.0, peak_bf16_tflops_per_core=95.0, kv_replicas_adjacent=False
)
TRAINIUM2 = Chip(
    "Trainium2",
    "trn2",
    physical_cores=8,
    hbm_gib=96.0,
    peak_bf16_tflops_per_core=667.0 / 8,
    kv_replicas_adjacent=True,
    logical_core_sizes=(2, 1),
)
CHIPS: dict[Generation, Chip] = {chip.generation: chip for chip in (TRAINIUM1, TRAINIUM2)}


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

    @property
    def generation(self) -> Generation:
        return self.chip.generation

    @property
    def logical_core_size(self) -> int:
        """Physical NeuronCores per logical one (LNC, `NEURON_LOGICAL_NC_CONFIG`): the runtime's unit, a process's."""
        return self.chip.default_lnc

    def cores_at(self, lnc: int) -> int:
        """Logical NeuronCores of a node at logical core size `lnc`."""
        return self.neuron_devices * self.chip.physical_cores // lnc

    @property
    def cores_per_node(self) -> int:
        """Training processes per node: one per (logical) NeuronCore."""
        return self.cores_at(self.logical_core_size)

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
        Hardware("trn2.3xlarge", TRAINIUM2, neuron_devices=1, vcpus=12, usd_per_hour=2.235),
        Hardware(
            "trn2.48xlarge",
            TRAINIUM2,
            neuron_devices=16,
            vcpus=192,
            usd_per_hour=35.76,
            efa_devices=16,
            efa_gbps=3200,
        ),
    )
}
DEFAULT_HARDWARE = HARDWARE["trn1.32xlarge"]
# The instance type each generation's recipes are planned for (`python -m training plan` shows both).
TRAINING_HARDWARE: dict[Generation, Hardware] = {"trn1": DEFAULT_HARDWARE, "trn2": HARDWARE["trn2.48xlarge"]}
