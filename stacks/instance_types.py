"""Facts about the instance types an environment may use, for validation before synth and for the cost table.

Prices are us-west-2 on-demand Linux list prices in USD per hour (the AWS pricing pages, late 2026); other
regions differ by a few percent. They feed `python -m stacks.cost`, never a deployment.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ComputeInstanceFacts:
    neuron_devices: int  # /dev/neuron* on a healthy node (2 NeuronCores each)
    efa_devices: int  # /sys/class/infiniband/* on a healthy node
    usd_per_hour: float

    @property
    def neuron_cores(self) -> int:
        return 2 * self.neuron_devices

    @property
    def efa(self) -> bool:
        return self.efa_devices > 0


@dataclass(frozen=True)
class CpuInstanceFacts:
    vcpus: int
    memory_gib: int
    usd_per_hour: float


# Source: EC2 instance type pages for Trn1/Trn1n (16 chips x 2 NeuronCore-v2; trn1.2xlarge 1 chip, no EFA;
# trn1.32xlarge 8 EFA interfaces at 800 Gbps, trn1n.32xlarge 16 at 1600 Gbps).
COMPUTE_INSTANCE_TYPES: dict[str, ComputeInstanceFacts] = {
    "trn1.2xlarge": ComputeInstanceFacts(neuron_devices=1, efa_devices=0, usd_per_hour=1.34375),
    "trn1.32xlarge": ComputeInstanceFacts(neuron_devices=16, efa_devices=8, usd_per_hour=21.50),
    "trn1n.32xlarge": ComputeInstanceFacts(neuron_devices=16, efa_devices=16, usd_per_hour=24.78),
}

# x86_64 types for the head node and the CPU queue (the shared Neuron environment is built for x86_64).
CPU_INSTANCE_TYPES: dict[str, CpuInstanceFacts] = {
    "m6a.xlarge": CpuInstanceFacts(vcpus=4, memory_gib=16, usd_per_hour=0.1728),
    "m6a.2xlarge": CpuInstanceFacts(vcpus=8, memory_gib=32, usd_per_hour=0.3456),
    "m6a.4xlarge": CpuInstanceFacts(vcpus=16, memory_gib=64, usd_per_hour=0.6912),
    "m6a.8xlarge": CpuInstanceFacts(vcpus=32, memory_gib=128, usd_per_hour=1.3824),
    "r6a.2xlarge": CpuInstanceFacts(vcpus=8, memory_gib=64, usd_per_hour=0.4536),
    "r6a.4xlarge": CpuInstanceFacts(vcpus=16, memory_gib=128, usd_per_hour=0.9072),
    "r6a.8xlarge": CpuInstanceFacts(vcpus=32, memory_gib=256, usd_per_hour=1.8144),
    "r6a.12xlarge": CpuInstanceFacts(vcpus=48, memory_gib=384, usd_per_hour=2.7216),
    "r6a.16xlarge": CpuInstanceFacts(vcpus=64, memory_gib=512, usd_per_hour=3.6288),
}

GP3_USD_PER_GIB_MONTH = 0.08
FSX_SCRATCH_2_USD_PER_GB_MONTH = 0.14
NAT_GATEWAY_USD_PER_HOUR = 0.045
PUBLIC_IPV4_USD_PER_HOUR = 0.005  # the NAT gateway's Elastic IP, billed like any public IPv4 address
HOURS_PER_MONTH = 730
# CloudWatch (first tier): a custom metric, billed by the hour it is sent in; a dashboard; a metric an alarm reads.
CLOUDWATCH_METRIC_USD_PER_MONTH = 0.30
CLOUDWATCH_DASHBOARD_USD_PER_MONTH = 3.00
CLOUDWATCH_ALARM_METRIC_USD_PER_MONTH = 0.10
CLOUDWATCH_COMPOSITE_ALARM_USD_PER_MONTH = 0.50
KMS_KEY_USD_PER_MONTH = 1.00
ROUTE53_HOSTED_ZONE_USD_PER_MONTH = 0.50
