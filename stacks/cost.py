"""`python -m stacks.cost --env NAME`: what an environment costs per hour, from the same settings it deploys.

Three states: idle (nodes scaled to zero: head node, file system, NAT), while a CPU stage runs (prepare,
convert, sample, export: the CPU queue's nodes start), and while training (every Trainium node). List
prices from `stacks/instance_types.py` and `training/config/hardware.py` (us-west-2 on-demand); data
transfer, S3 and CloudWatch Logs are left out; the monitoring's CloudWatch metrics, dashboard and alarms are
in. The README's cost table is this command's output for the default environment (a test keeps it so).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from stacks.config import EnvironmentConfig, load_environment
from stacks.instance_types import (
    CLOUDWATCH_ALARM_METRIC_USD_PER_MONTH,
    CLOUDWATCH_COMPOSITE_ALARM_USD_PER_MONTH,
    CLOUDWATCH_DASHBOARD_USD_PER_MONTH,
    CLOUDWATCH_METRIC_USD_PER_MONTH,
    CPU_INSTANCE_TYPES,
    FSX_SCRATCH_2_USD_PER_GB_MONTH,
    GP3_USD_PER_GIB_MONTH,
    HOURS_PER_MONTH,
    KMS_KEY_USD_PER_MONTH,
    NAT_GATEWAY_USD_PER_HOUR,
    PUBLIC_IPV4_USD_PER_HOUR,
    ROUTE53_HOSTED_ZONE_USD_PER_MONTH,
)
from stacks.monitoring import ALARM_METRICS
from training.config.hardware import HARDWARE
from training.config.recipe import Recipe, load_recipe
from training.errors import ArgumentParser, guarded
from training.monitoring.cluster import ALWAYS_SENT_JOB_STATES, NODE_STATES
from training.monitoring.neuron import METRICS_PER_REPORT
from training.pipeline.plan import STAGES
from training.pipeline.timeline import most_phases
from training.train.forecast import Forecast, forecast_of
from training.train.metrics import CLOUDWATCH_METRICS

IDLE_TARGET_USD_PER_HOUR = 0.75  # what an environment left deployed but unused should cost at most
# What ParallelCluster itself adds while idle (pcluster/templates/cluster_stack.py `_add_head_node_alarms` and
# slurm_builder.py): the head node's alarms (Health, Cpu, Mem, Disk and, with CloudWatch logs on, the clustermgtd
# heartbeat) and one composite alarm over them, its CloudWatch agent's metrics (mem_used_percent,
# disk_used_percent) and the heartbeat's metric filter, its dashboard, and a Route 53 private hosted zone for
# the nodes' names.
PARALLELCLUSTER_HEAD_NODE_ALARMS = 5
PARALLELCLUSTER_CUSTOM_METRICS = 3


@dataclass(frozen=True)
class CostLine:
    item: str
    idle: float  # USD per hour
    cpu_stage: float
    training: float


def volume_usd_per_hour(gib: int) -> float:
    return gib * GP3_USD_PER_GIB_MONTH / HOURS_PER_MONTH


def cost_lines(config: EnvironmentConfig) -> list[CostLine]:
    head = CPU_INSTANCE_TYPES[config.head_node.instance_type]
    head_root = volume_usd_per_hour(config.head_node.root_volume_gib)
    fsx = config.storage.fsx_capacity_gib * FSX_SCRATCH_2_USD_PER_GB_MONTH / HOURS_PER_MONTH
    compute = config.compute
    trainium = HARDWARE[compute.instance_type].usd_per_hour
    idle_nodes, nodes = compute.node_counts
    trainium_root = volume_usd_per_hour(compute.root_volume_gib)
    lines = [
        CostLine(
            f"Head node {config.head_node.instance_type}", head.usd_per_hour, head.usd_per_hour, head.usd_per_hour
        ),
        CostLine(f"Head node root volume, {config.head_node.root_volume_gib} GiB gp3", head_root, head_root, head_root),
        CostLine(f"FSx for Lustre SCRATCH_2, {config.storage.fsx_capacity_gib} GiB", fsx, fsx, fsx),
        CostLine(
            "NAT gateway and its public IPv4 address (plus $0.045 per GB processed)",
            *(NAT_GATEWAY_USD_PER_HOUR + PUBLIC_IPV4_USD_PER_HOUR,) * 3,
        ),
        CostLine(
            f"{compute.instance_type} x {nodes} ({idle_nodes} while idle)",
            idle_nodes * trainium,
            idle_nodes * trainium,
            nodes * trainium,
        ),
        CostLine(
            f"Trainium root volumes, {compute.root_volume_gib} GiB gp3 each",
            idle_nodes * trainium_root,
            idle_nodes * trainium_root,
            nodes * trainium_root,
        ),
    ]
    lines.append(monitoring_line(config))
    lines.append(parallelcluster_line())
    key = KMS_KEY_USD_PER_MONTH / HOURS_PER_MONTH
    lines.append(CostLine("KMS key of the alarm topic", key, key, key))
    if config.cpu_queue is not None:
        cpu = config.cpu_queue
        per_node = CPU_INSTANCE_TYPES[cpu.instance_type].usd_per_hour + volume_usd_per_hour(cpu.root_volume_gib)
        lines.append(
            CostLine(
                f"CPU queue {cpu.instance_type} x {cpu.max_count}, {cpu.root_volume_gib} GiB root (CPU stages only)",
                0.0,
                cpu.max_count * per_node,
                0.0,
            )
        )
    return lines


def monitoring_line(config: EnvironmentConfig) -> CostLine:
    """The dashboard, the alarms' metrics and the custom metrics sent in each state: the head node's always
    (jobs, nodes per partition and state), its StageSeconds of the newest run while a run is active (at most one
    per phase to the first step), the training job's (with and without its run) and each Trainium node's Neuron
    metrics (with and without its instance) while training."""
    partitions = 2 if config.cpu_queue is not None else 1
    head_node = len(ALWAYS_SENT_JOB_STATES) + 2 + partitions * len(NODE_STATES)  # + TrainingJobsRunning, FailedStages
    phases = most_phases([stage.name for stage in STAGES])
    training = 2 * len(CLOUDWATCH_METRICS) + METRICS_PER_REPORT * (1 + config.compute.max_count)
    fixed = CLOUDWATCH_DASHBOARD_USD_PER_MONTH + ALARM_METRICS * CLOUDWATCH_ALARM_METRIC_USD_PER_MONTH
    idle = (fixed + head_node * CLOUDWATCH_METRIC_USD_PER_MONTH) / HOURS_PER_MONTH
    running = phases * CLOUDWATCH_METRIC_USD_PER_MONTH / HOURS_PER_MONTH
    return CostLine(
        f"CloudWatch: dashboard, {ALARM_METRICS} alarm metrics, {head_node} metrics ({head_node + phases} while a "
        f"run is active, {head_node + phases + training} while training)",
        idle,
        idle + running,
        idle + running + training * CLOUDWATCH_METRIC_USD_PER_MONTH / HOURS_PER_MONTH,
    )


def parallelcluster_line() -> CostLine:
    """What ParallelCluster's own monitoring and name service cost, whatever the environment."""
    monthly = (
        CLOUDWATCH_DASHBOARD_USD_PER_MONTH
        + PARALLELCLUSTER_HEAD_NODE_ALARMS * CLOUDWATCH_ALARM_METRIC_USD_PER_MONTH
        + CLOUDWATCH_COMPOSITE_ALARM_USD_PER_MONTH
        + PARALLELCLUSTER_CUSTOM_METRICS * CLOUDWATCH_METRIC_USD_PER_MONTH
        + ROUTE53_HOSTED_ZONE_USD_PER_MONTH
    )
    hourly = monthly / HOURS_PER_MONTH
    return CostLine(
        f"ParallelCluster: dashboard, {PARALLELCLUSTER_HEAD_NODE_ALARMS} head-node alarms and a composite one, "
        f"{PARALLELCLUSTER_CUSTOM_METRICS} metrics, Route 53 private zone",
        hourly,
        hourly,
        hourly,
    )


def render_table(config: EnvironmentConfig) -> str:
    """The cost table in Markdown, with totals and the idle month."""
    lines = cost_lines(config)
    rows = [
        f"| Line item (environment `{config.name}`) | Idle | While a CPU stage runs | While training |",
        "| --- | ---: | ---: | ---: |",
    ]
    rows += [
        f"| {line.item} | {money(line.idle)} | {money(line.cpu_stage)} | {money(line.training)} |" for line in lines
    ]
    idle, cpu_stage, training = (
        sum(getattr(line, column) for line in lines) for column in ("idle", "cpu_stage", "training")
    )
    rows.append(
        f"| **Total** (idle month: ~${idle * HOURS_PER_MONTH:,.0f}) | **{money(idle)}** | **{money(cpu_stage)}** "
        f"| **{money(training)}** |"
    )
    return "\n".join(rows) + "\n"


def training_node_usd_per_hour(config: EnvironmentConfig) -> float:
    """One Trainium node while it trains: its list price and its root volume."""
    compute = config.compute
    return HARDWARE[compute.instance_type].usd_per_hour + volume_usd_per_hour(compute.root_volume_gib)


def besides_training_nodes_usd_per_hour(config: EnvironmentConfig) -> float:
    """The rest of the environment while training (head node, FSx, NAT, CloudWatch, ...): the training column
    without its Trainium nodes. The CPU queue is idle while training; its stages before and after are not in."""
    training = sum(line.training for line in cost_lines(config))
    return training - config.compute.max_count * training_node_usd_per_hour(config)


def run_usd_per_hour(config: EnvironmentConfig, nodes: int) -> float:
    """What the environment costs while a run trains on `nodes` (a static node bills whether it trains or not)."""
    billed = max(nodes, config.compute.node_counts[0])
    return besides_training_nodes_usd_per_hour(config) + billed * training_node_usd_per_hour(config)


def run_forecast(config: EnvironmentConfig, recipe: Recipe | None = None) -> Forecast | None:
    """The forecast of the run the deploy starts (`pipeline.start_run`), at this environment's cost while it
    trains; None when the deploy starts none or nothing can be forecast (an unknown model, the CPU backend)."""
    hardware = HARDWARE.get(config.compute.instance_type)
    if not config.pipeline.start_run or hardware is None:
        return None
    recipe = recipe or load_recipe(config.pipeline.recipe, config.pipeline.overrides, generation=hardware.generation)
    return forecast_of(
        recipe,
        hardware,
        run_usd_per_hour(config, recipe.nodes),
        f"environment {config.name} while training: nodes, head node, FSx, NAT, CloudWatch",
    )


def idle_usd_per_hour(config: EnvironmentConfig) -> float:
    return sum(line.idle for line in cost_lines(config))


def money(usd_per_hour: float) -> str:
    if not usd_per_hour:
        return "$0"
    return f"${usd_per_hour:,.3f}/h" if usd_per_hour < 0.1 else f"${usd_per_hour:,.2f}/h"


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 printed, 2 user error (argparse's own included)."""
    parser = ArgumentParser(prog="python -m stacks.cost", description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="default", help="environment name (environments/NAME.yaml)")
    arguments = parser.parse_args(argv)

    def run() -> int:
        config = load_environment(arguments.env)
        print(render_table(config), end="")
        idle = idle_usd_per_hour(config)
        verdict = "within" if idle <= IDLE_TARGET_USD_PER_HOUR else "ABOVE"
        target = f"${IDLE_TARGET_USD_PER_HOUR:.2f}/h target for an unused environment"
        print(f"\nIdle: ${idle:.2f}/h, {verdict} the {target}.")
        return 0

    return guarded(run, status=2)


if __name__ == "__main__":
    sys.exit(main())
