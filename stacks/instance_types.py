"""Facts about the CPU instance types and the services an environment uses, for validation before synth and
for the cost table; the Trainium types are `training.config.hardware`'s table (the planner's too).

Prices are us-west-2 on-demand Linux list prices in USD per hour (the AWS pricing pages, late 2026); other
regions differ by a few percent. They feed `python -m stacks.cost`, never a deployment.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CpuInstanceFacts:
    vcpus: int
    memory_gib: int
    usd_per_hour: float


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
