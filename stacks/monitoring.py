"""Monitoring: the environment's CloudWatch dashboard and the alarms that notify its topic.

What it shows comes from three publishers on the cluster (names in `training/monitoring/cloudwatch.py`):
rank 0 of the training job, the head node's minute timer (Slurm queue, nodes, failed stages) and each
Trainium node's Neuron monitor; AWS publishes the file system's and the head node's own metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aws_cdk import Duration
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_cloudwatch_actions as actions
from aws_cdk import aws_sns as sns
from constructs import Construct

from training.monitoring import cloudwatch as names

GIB = 1024**3
# The alarm on the file system's free capacity, a fraction of its size.
FSX_FREE_ALARM_FRACTION = 0.10
# Minutes in a row the file system must be that full: a checkpoint being written and deleted is not an alarm.
FSX_LOW_MINUTES = 5
# The head node's minute timer: the period of the Slurm metrics, and of the alarm on failed stages.
HEAD_NODE_PERIOD = Duration.minutes(1)
WIDGET_HEIGHT = 6
# The metrics the alarms read, each billed: one each, two for the stall alarm.
ALARM_METRICS = 7
DEFAULT_PERIOD = Duration.minutes(5)
# Periods in a row (of DEFAULT_PERIOD) in which every logged step was below the throughput floor: a run that
# stays below it for a quarter of an hour, not one slow window (the job's own window already takes a median).
THROUGHPUT_FLOOR_PERIODS = 3


@dataclass(frozen=True)
class MemoryPlanLine:
    """The memory plan of the environment's recipe, drawn beside what the NeuronCores held."""

    recipe: str
    planned_gib_per_core: float
    device_gib_per_core: float


class Monitoring(Construct):
    """One dashboard and six alarms; every alarm notifies `topic` when it fires and when it clears."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        name: str,
        namespace: str,
        topic: sns.ITopic,
        stall_minutes: int,
        file_system_id: str,
        fsx_capacity_gib: int,
        head_node_instance_id: str,
        memory_plan: MemoryPlanLine | None,
    ) -> None:
        super().__init__(scope, construct_id)
        self.namespace = namespace
        free = cloudwatch.Metric(
            namespace="AWS/FSx",
            metric_name="FreeDataStorageCapacity",
            dimensions_map={"FileSystemId": file_system_id},
            # FSx reports each storage target every minute: a minute's Sum is the file system's free bytes at
            # any capacity (Minimum would be the fullest target's alone).
            statistic="Sum",
            period=Duration.minutes(1),
            label="free bytes",
        )
        head_status = cloudwatch.Metric(
            namespace="AWS/EC2",
            metric_name="StatusCheckFailed",
            dimensions_map={"InstanceId": head_node_instance_id},
            statistic="Maximum",
            period=Duration.minutes(1),
            label="status check failed",
        )
        self.alarms = [
            *self._training_alarms(name, stall_minutes),
            *self._infrastructure_alarms(name, fsx_capacity_gib, free, head_status),
        ]
        for alarm in self.alarms:
            alarm.add_alarm_action(actions.SnsAction(topic))
            alarm.add_ok_action(actions.SnsAction(topic))
        self.dashboard = cloudwatch.Dashboard(
            self,
            "Dashboard",
            dashboard_name=name,
            default_interval=Duration.hours(12),
            widgets=self._rows(free, head_status, fsx_capacity_gib, head_node_instance_id, memory_plan),
        )

    def _training_alarms(self, name: str, stall_minutes: int) -> list[cloudwatch.Alarm]:
        """The alarms on the training jobs and the stages: a stall, a failed stage, a late compilation, a run
        below its throughput floor."""
        stalled = cloudwatch.MathExpression(
            # 1 when a training job ran through the whole window and logged no step in it.
            expression="IF(FILL(running, 0) > 0 AND FILL(steps, 0) == 0, 1, 0)",
            using_metrics={
                "running": self._metric(names.TRAINING_JOBS_RUNNING, "Minimum"),
                "steps": self._metric(names.TRAINING_STEP, "SampleCount"),
            },
            period=Duration.minutes(stall_minutes),
            label="training stalled",
        )
        return [
            self._alarm(
                "TrainingStalled",
                f"{name}-training-stalled",
                f"A training job ran for {stall_minutes} minutes and logged no step: it may hang (a collective "
                "waiting for a dead rank, a stuck compile or checkpoint). See the alarm table in docs/monitoring.md.",
                stalled,
                threshold=1,
                comparison=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            ),
            self._alarm(
                "StageFailed",
                f"{name}-stage-failed",
                "A stage of the newest run ended in failure, or waits on one that did; `python -m training status` "
                "on the head node names it and shows its log.",
                self._metric(names.FAILED_STAGES, "Maximum", HEAD_NODE_PERIOD),
                threshold=1,
                comparison=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            ),
            self._alarm(
                "LateCompilation",
                f"{name}-late-compilation",
                "A training job compiled a graph its compile stage did not: the compile cache missed, and each miss "
                "costs minutes of every node. `python -m training status` names the step; the recipe's "
                "neuron.fail_on_late_compile stops the job instead.",
                self._metric(names.LATE_COMPILATIONS, "Maximum"),
                threshold=0,
                comparison=cloudwatch.ComparisonOperator.GREATER_THAN_THRESHOLD,
            ),
            self._alarm(
                "ThroughputBelowFloor",
                f"{name}-throughput-below-floor",
                f"For {THROUGHPUT_FLOOR_PERIODS * 5} minutes every logged step of a training job was below the "
                "recipe's throughput floor (throughput.floor_fraction of the expected tokens/s per node); "
                "`python -m training status` shows actual against expected. throughput.cancel_below_floor stops "
                "the job instead.",
                self._metric(names.BELOW_THROUGHPUT_FLOOR, "Minimum"),
                threshold=1,
                comparison=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
                evaluation_periods=THROUGHPUT_FLOOR_PERIODS,
                datapoints=THROUGHPUT_FLOOR_PERIODS,
            ),
        ]

    def _infrastructure_alarms(
        self, name: str, fsx_capacity_gib: int, free: cloudwatch.Metric, head_status: cloudwatch.Metric
    ) -> list[cloudwatch.Alarm]:
        """The alarms on what the jobs run on: the file system filling up, the head node failing its checks."""
        return [
            self._alarm(
                "FsxLowFreeCapacity",
                f"{name}-fsx-low-free-capacity",
                f"Less than {FSX_FREE_ALARM_FRACTION:.0%} of the {fsx_capacity_gib} GiB file system is free: "
                "checkpoints and exports will fail when it is full.",
                free,
                threshold=fsx_capacity_gib * GIB * FSX_FREE_ALARM_FRACTION,
                comparison=cloudwatch.ComparisonOperator.LESS_THAN_THRESHOLD,
                evaluation_periods=FSX_LOW_MINUTES,
                datapoints=FSX_LOW_MINUTES,
            ),
            self._alarm(
                "HeadNodeUnhealthy",
                f"{name}-head-node-unhealthy",
                "The head node fails its EC2 status checks: Slurm, the pipeline and the other alarms' metrics "
                "depend on it.",
                head_status,
                threshold=1,
                comparison=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
                evaluation_periods=5,
                datapoints=3,
            ),
        ]

    def _metric(self, metric_name: str, statistic: str, period: Duration = DEFAULT_PERIOD) -> cloudwatch.Metric:
        """A metric of the environment's namespace, without dimensions (every publisher sends that one)."""
        return cloudwatch.Metric(
            namespace=self.namespace, metric_name=metric_name, statistic=statistic, period=period, label=metric_name
        )

    def _alarm(
        self,
        construct_id: str,
        alarm_name: str,
        description: str,
        metric: cloudwatch.IMetric,
        *,
        threshold: float,
        comparison: cloudwatch.ComparisonOperator,
        evaluation_periods: int = 1,
        datapoints: int = 1,
    ) -> cloudwatch.Alarm:
        return cloudwatch.Alarm(
            self,
            construct_id,
            alarm_name=alarm_name,
            alarm_description=description,
            metric=metric,
            threshold=threshold,
            comparison_operator=comparison,
            evaluation_periods=evaluation_periods,
            datapoints_to_alarm=datapoints,
            # No data: nothing runs, or the head node is down (its own alarm says so).
            treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
        )

    def _search(self, metric_name: str, dimensions: str, statistic: str, label: str) -> cloudwatch.MathExpression:
        """Every series of a metric sent with `dimensions` (nodes, partitions), however many there are."""
        return cloudwatch.MathExpression(
            expression=f"SEARCH('{{{self.namespace},{dimensions}}} MetricName=\"{metric_name}\"', '{statistic}', 60)",
            label=label,
            period=Duration.minutes(1),
        )

    def _rows(
        self,
        free: cloudwatch.Metric,
        head_status: cloudwatch.Metric,
        fsx_capacity_gib: int,
        head_node_instance_id: str,
        memory_plan: MemoryPlanLine | None,
    ) -> list[list[cloudwatch.IWidget]]:
        """The dashboard, row by row: the alarms, training, the watch on the run, Slurm, devices and storage."""
        status = cloudwatch.AlarmStatusWidget(alarms=self.alarms, title="Alarms", width=24, height=3)
        return [
            [status],
            self._training_row(),
            self._watch_row(),
            self._slurm_row(head_status, head_node_instance_id),
            self._devices_row(free, fsx_capacity_gib, memory_plan),
        ]

    def _training_row(self) -> list[cloudwatch.IWidget]:
        m, minute = self._metric, HEAD_NODE_PERIOD
        return [
            graph(
                "Loss",
                [m(names.TRAINING_LOSS, "Average", minute), m(names.VALIDATION_LOSS, "Average", minute)],
            ),
            graph(
                "Throughput",
                [m(names.TOKENS_PER_SECOND, "Average", minute)],
                right=[m(names.MFU, "Average", minute)],
                right_y_axis=cloudwatch.YAxisProps(label="MFU %", min=0, show_units=False),
            ),
            graph(
                "Optimizer",
                [m(names.GRADIENT_NORM, "Average", minute)],
                right=[m(names.LEARNING_RATE, "Average", minute), m(names.MOE_DROPPED_TOKENS, "Average", minute)],
            ),
        ]

    def _slurm_row(self, head_status: cloudwatch.Metric, head_node_instance_id: str) -> list[cloudwatch.IWidget]:
        m, minute = self._metric, HEAD_NODE_PERIOD
        return [
            graph(
                "Slurm queue",
                [
                    cloudwatch.Metric(
                        namespace=self.namespace,
                        metric_name=names.SLURM_JOBS,
                        dimensions_map={"State": state},
                        statistic="Maximum",
                        period=minute,
                        label=f"{state.lower()} jobs",
                    )
                    # CONFIGURING: a job whose nodes ParallelCluster is booting
                    for state in ("RUNNING", "PENDING", "CONFIGURING")
                ]
                + [m(names.TRAINING_JOBS_RUNNING, "Maximum", minute), m(names.FAILED_STAGES, "Maximum", minute)],
            ),
            graph("Nodes by partition and state", [self._search(names.SLURM_NODES, "Partition,State", "Maximum", "")]),
            graph(
                "Head node",
                [head_status],
                right=[
                    cloudwatch.Metric(
                        namespace="AWS/EC2",
                        metric_name="CPUUtilization",
                        dimensions_map={"InstanceId": head_node_instance_id},
                        statistic="Average",
                        period=Duration.minutes(5),
                        label="CPU %",
                    )
                ],
            ),
        ]

    def _devices_row(
        self, free: cloudwatch.Metric, fsx_capacity_gib: int, memory_plan: MemoryPlanLine | None
    ) -> list[cloudwatch.IWidget]:
        m, minute = self._metric, HEAD_NODE_PERIOD
        return [
            graph(
                "FSx for Lustre free capacity",
                [free],
                left_annotations=[
                    cloudwatch.HorizontalAnnotation(
                        value=fsx_capacity_gib * GIB * FSX_FREE_ALARM_FRACTION,
                        label=f"alarm: {FSX_FREE_ALARM_FRACTION:.0%} free",
                        color="#d62728",
                    )
                ],
                left_y_axis=cloudwatch.YAxisProps(min=0),
            ),
            graph("NeuronCore utilisation", [m(names.NEURONCORE_UTILIZATION, "Average", minute)]),
            graph(
                "NeuronCore memory (the fullest core)",
                [m(names.NEURONCORE_MEMORY_USED, "Maximum", minute)],
                left_annotations=memory_plan_annotations(memory_plan),
                left_y_axis=cloudwatch.YAxisProps(min=0),
            ),
        ]

    def _watch_row(self) -> list[cloudwatch.IWidget]:
        m, minute = self._metric, HEAD_NODE_PERIOD
        return [
            graph(
                "Throughput against expected",
                [m(names.THROUGHPUT_FRACTION, "Average", minute)],
                right=[m(names.BELOW_THROUGHPUT_FLOOR, "Maximum", minute)],
                left_y_axis=cloudwatch.YAxisProps(label="% of expected", min=0, show_units=False),
            ),
            graph("Late compilations", [m(names.LATE_COMPILATIONS, "Maximum", minute)]),
            graph(
                "Time to first step (seconds per phase)",
                [self._search(names.STAGE_SECONDS, "Stage", "Maximum", "")],
                view=cloudwatch.GraphWidgetView.BAR,
            ),
        ]


def graph(title: str, left: Sequence[cloudwatch.IMetric], **options: object) -> cloudwatch.GraphWidget:
    """A third of a dashboard row."""
    return cloudwatch.GraphWidget(title=title, left=left, width=8, height=WIDGET_HEIGHT, **options)  # type: ignore[arg-type]


def memory_plan_annotations(memory_plan: MemoryPlanLine | None) -> list[cloudwatch.HorizontalAnnotation]:
    """The recipe's planned GiB per core and the device's, as lines on the NeuronCore memory graph."""
    if memory_plan is None:
        return []
    return [
        cloudwatch.HorizontalAnnotation(
            value=memory_plan.planned_gib_per_core * GIB,
            label=f"plan of {memory_plan.recipe}: {memory_plan.planned_gib_per_core:.2f} GiB",
        ),
        cloudwatch.HorizontalAnnotation(
            value=memory_plan.device_gib_per_core * GIB,
            label=f"device: {memory_plan.device_gib_per_core:g} GiB",
            color="#d62728",
        ),
    ]
