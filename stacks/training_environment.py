"""The stack of one environment: wires network, storage, cluster and the pipeline's deploy trigger together,
grants each the access it needs to the others, and publishes the outputs.

This is the only code that reads the whole environment; each construct gets only the settings it uses.
"""

from __future__ import annotations

from collections import defaultdict

from aws_cdk import CfnOutput, Environment, Stack, Tags
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from constructs import Construct

from stacks.budget import BudgetGuard
from stacks.cluster import NODE_FILES_PREFIX, Cluster, NodeHealth
from stacks.compile_cache import CompileCache, promoter_name
from stacks.config import PARALLELCLUSTER_VERSION, EnvironmentConfig
from stacks.log_groups import log_group_with_retention
from stacks.monitoring import MemoryPlanLine, Monitoring
from stacks.network import Network
from stacks.notifications import Notifications
from stacks.pcluster_config import ClusterSettings
from stacks.pipeline_site import EXECUTED_FOLDERS, MODELS_FOLDER, shared_env_path, site_settings
from stacks.pipeline_trigger import SOURCE_PREFIX, SSM_OUTPUT_PREFIX, PipelineTrigger, SharedEnvironment
from stacks.preflight import Preflight, preflight_checks
from stacks.storage import Storage
from stacks.tracking_access import tracking_access
from training.config.hardware import HARDWARE
from training.config.recipe import load_recipe
from training.errors import UserError
from training.monitoring.cloudwatch import namespace_of
from training.software import SOURCE_ROOT
from training.train.memory import planned_gib_per_core

# Where the export stage writes each run's results in the bucket.
RESULTS_PREFIX = "results"


def cluster_settings(config: EnvironmentConfig) -> ClusterSettings:
    """The environment's settings that the ParallelCluster configuration uses."""
    return ClusterSettings(
        region=config.region,
        os=config.os,
        head_node=config.head_node,
        compute=config.compute,
        cpu_queue=config.cpu_queue,
        ssh_key_name=config.network.ssh_key_name,
        mount_dir=config.storage.mount_dir,
        log_retention_days=config.logging.retention_days,
        tags=config.tags,
    )


def memory_plan_line(config: EnvironmentConfig) -> MemoryPlanLine | None:
    """The pipeline recipe's memory plan on the Trainium queue's instances, for the dashboard."""
    hardware = HARDWARE.get(config.compute.instance_type)
    if hardware is None:
        return None
    try:
        recipe = load_recipe(config.pipeline.recipe, config.pipeline.overrides, generation=hardware.generation)
        planned = planned_gib_per_core(recipe, hardware)
    except UserError:  # a layout these instances cannot hold; the deploy refuses to start such a run
        return None
    if planned is None:
        return None
    return MemoryPlanLine(config.pipeline.recipe, planned, hardware.hbm_gib_per_core)


def cpu_stages_queue(config: EnvironmentConfig) -> str:
    """The queue of the single-node stages (fetch, prepare, convert, sample, export): the CPU queue, else the
    Trainium queue (the site file's cpu_partition falls back the same way)."""
    return config.cpu_queue.queue_name if config.cpu_queue else config.compute.queue_name


def hub_secret_access(config: EnvironmentConfig) -> list[iam.PolicyStatement]:
    """Read exactly the environment's Hub token secrets (the fetch stage's read token, the export's write token)."""
    arns = [arn for arn in (config.hub.token_secret_arn, config.hub.write_token_secret_arn) if arn]
    return [iam.PolicyStatement(actions=["secretsmanager:GetSecretValue"], resources=arns)] if arns else []


def node_health(config: EnvironmentConfig) -> NodeHealth:
    """The devices every node of the Trainium queue must show; EFA ones only when the queue uses EFA."""
    facts = HARDWARE[config.compute.instance_type]
    return NodeHealth(
        partition=config.compute.queue_name,
        neuron_devices=facts.neuron_devices,
        efa_devices=facts.efa_devices if config.compute.efa else 0,
    )


class TrainingEnvironmentStack(Stack):
    """Everything that bills for one environment, deployed and destroyed as one unit.

    One stack per environment keeps `cdk deploy -c env=NAME` and `cdk destroy -c env=NAME` free of stack
    names; the results bucket alone is retained on destroy.
    """

    def __init__(self, scope: Construct, *, config: EnvironmentConfig) -> None:
        super().__init__(
            scope,
            config.stack_name,
            # Region only: the account comes from the credentials at deploy time, so synth needs none.
            env=Environment(region=config.region),
            description=(
                f"Trainium training environment '{config.name}': VPC, FSx for Lustre, results bucket and "
                f"AWS ParallelCluster {PARALLELCLUSTER_VERSION} cluster '{config.cluster_name}'"
            ),
        )
        for key, value in sorted(config.tags.items()):
            Tags.of(self).add(key, value)
        self._add_foundation(config)
        neuron_release = config.compute.node_software.release()  # the bootstrap script pins it
        # One log group for the stack's one BucketDeployment handler (the code and the node files).
        deployment_logs = log_group_with_retention(self, "DeploymentLogs", config.logging.retention_days)
        self.cluster = self._add_cluster(config, neuron_release, deployment_logs)
        self._add_alerts(config)
        self.pipeline_trigger = self._add_pipeline_trigger(config, neuron_release, deployment_logs)
        self.notifications.grant_publish(self.pipeline_trigger.handler_role)
        self.storage.protect_executed_code(
            code_prefixes=(SOURCE_PREFIX, NODE_FILES_PREFIX),
            code_writer=self.pipeline_trigger.source.handler_role,
            imported=EXECUTED_FOLDERS,
        )
        self.monitoring = Monitoring(
            self,
            "Monitoring",
            name=config.stack_name,
            namespace=namespace_of(config.name),
            topic=self.notifications.topic,
            stall_minutes=config.monitoring.stall_minutes,
            file_system_id=self.storage.file_system.file_system_id,
            fsx_capacity_gib=config.storage.fsx_capacity_gib,
            head_node_instance_id=self.cluster.head_node_instance_id,
            memory_plan=memory_plan_line(config),
        )
        self._add_outputs(config)

    def _add_foundation(self, config: EnvironmentConfig) -> None:
        """The preflight, then the network, the storage and the compile cache; nothing that bills is created
        before the preflight has checked what only the account knows (zone offerings, quotas, reservations,
        images): the NAT gateway and the file system wait for it."""
        retention_days = config.logging.retention_days
        self.preflight = Preflight(
            self, "Preflight", checks=preflight_checks(config), log_retention_days=retention_days
        )
        self.network = Network(
            self,
            "Network",
            vpc_cidr=config.network.vpc_cidr,
            availability_zone=config.availability_zone,
            zone_is_id=config.zone_is_id,
            log_retention_days=retention_days,
        )
        self.storage = Storage(
            self,
            "Storage",
            fsx_capacity_gib=config.storage.fsx_capacity_gib,
            fsx_s3_prefix=config.storage.fsx_s3_prefix,
            vpc=self.network.vpc,
            subnet=self.network.private_subnet,
            client_security_group=self.network.cluster_security_group,  # the Lustre ports open to the nodes
        )
        for construct in self.network.node.find_all():
            if isinstance(construct, ec2.CfnNatGateway | ec2.CfnEIP):
                construct.node.add_dependency(self.preflight.resource)
        self.storage.file_system.node.add_dependency(self.preflight.resource)
        # The compile cache kept in the bucket: nodes stage, only its promoter's role promotes; staged copies expire.
        self.compile_cache = CompileCache(
            self,
            "CompileCache",
            bucket=self.storage.bucket,
            function_name=promoter_name(config.stack_name),
            log_retention_days=retention_days,
        )

    def _add_cluster(self, config: EnvironmentConfig, neuron_release: str, deployment_logs: logs.ILogGroup) -> Cluster:
        """The cluster on the network and the storage, after the preflight."""
        cluster = Cluster(
            self,
            "Cluster",
            cluster_name=config.cluster_name,
            environment_name=config.name,
            settings=cluster_settings(config),
            metrics_namespace=namespace_of(config.name),
            neuron_release=neuron_release,
            shared_env=shared_env_path(config, neuron_release),
            neuron_apt_key_fingerprint=config.neuron.apt_key_fingerprint,
            health=node_health(config),
            lock=config.compute.node_software.lock,
            head_node_subnet=self.network.private_subnet,
            compute_subnet=self.network.private_subnet,
            security_group=self.network.cluster_security_group,
            file_system=self.storage.file_system,
            node_files_bucket=self.storage.bucket,
            deployment_logs=deployment_logs,
            # Nodes read the bucket. The head node writes the SSM command output the pipeline trigger reads back;
            # compute nodes write results: the export stage runs there.
            head_node_access=self.storage.results_access(
                read_prefixes=(SOURCE_PREFIX, NODE_FILES_PREFIX, f"{RESULTS_PREFIX}/"),
                write_prefixes=(SSM_OUTPUT_PREFIX,),
            ),
            compute_node_access=self.storage.results_access(
                read_prefixes=(NODE_FILES_PREFIX, f"{RESULTS_PREFIX}/"), write_prefixes=(f"{RESULTS_PREFIX}/",)
            ),
            queue_access=self._queue_access(config),
        )
        cluster.resource.node.add_dependency(self.preflight.resource)
        return cluster

    def _add_alerts(self, config: EnvironmentConfig) -> None:
        """The alarm topic, and the budget guard when the environment file sets a monthly budget."""
        self.notifications = Notifications(
            self,
            "Notifications",
            topic_name=f"{config.stack_name}-alarms",
            email=config.monitoring.alarm_email,
        )
        if config.budget.monthly_usd is not None:
            self.budget = BudgetGuard(
                self,
                "Budget",
                budget_name=config.stack_name,
                monthly_usd=config.budget.monthly_usd,
                stop_at_percent=config.budget.stop_fleet_at_percent,
                cluster_name=config.cluster_name,
                notifications=self.notifications,
                log_retention_days=config.logging.retention_days,
            )

    def _add_pipeline_trigger(
        self, config: EnvironmentConfig, neuron_release: str, deployment_logs: logs.ILogGroup
    ) -> PipelineTrigger:
        """The deploy trigger that submits the recipe's Slurm pipeline on the head node. Its construct id stays
        "Pipeline": the resources' logical ids derive from it."""
        bucket = self.storage.bucket
        return PipelineTrigger(
            self,
            "Pipeline",
            environment_name=config.name,
            cluster_name=config.cluster_name,
            pipeline=config.pipeline,
            shared_environment=SharedEnvironment(
                path=shared_env_path(config, neuron_release),
                neuron_release=neuron_release,
                requirements=config.compute.node_software.lock.relative_to(SOURCE_ROOT).as_posix(),
            ),
            site_settings=site_settings(
                config,
                neuron_release=neuron_release,
                results_uri=f"s3://{bucket.bucket_name}/{RESULTS_PREFIX}",
                file_system_uri=f"s3://{bucket.bucket_name}/{config.storage.fsx_s3_prefix}",
                compile_cache_store=self.compile_cache.store_uri,
                compile_cache_promoter=promoter_name(config.stack_name),
            ),
            log_retention_days=config.logging.retention_days,
            bucket=bucket,
            file_system=self.storage.file_system,
            file_system_mount_dir=config.storage.mount_dir,
            head_node_instance_id=self.cluster.head_node_instance_id,
            deployment_logs=deployment_logs,
            # Commands to this cluster's head node, their output in the bucket, exports of the file system.
            handler_access=[
                *self.cluster.head_node_command_access(),
                *self.storage.results_read_access(SSM_OUTPUT_PREFIX),
                *self.storage.export_access(),
            ],
            notice_topic=self.notifications.topic,
        )

    def _add_outputs(self, config: EnvironmentConfig) -> None:
        """The stack outputs: how to reach the cluster, where the results and the run are, what was started."""
        head_node = self.cluster.head_node_instance_id
        trigger = self.pipeline_trigger
        CfnOutput(self, "ClusterName", value=config.cluster_name, description="ParallelCluster cluster name")
        CfnOutput(self, "HeadNodeInstanceId", value=head_node, description="EC2 instance id of the head node")
        CfnOutput(
            self,
            "SsmConnectCommand",
            value=f"aws ssm start-session --region {config.region} --target {head_node}",
            description="Open a shell on the head node through SSM Session Manager (no inbound ports)",
        )
        CfnOutput(self, "ResultsBucketName", value=self.storage.bucket.bucket_name, description="Kept on destroy")
        CfnOutput(
            self,
            "ComputeNodePolicyArn",
            value=self.cluster.compute_node_policy.managed_policy_arn,
            description="The compute nodes' policy (python -m stacks.node_image builds a baked image with it)",
        )
        CfnOutput(self, "FileSystemId", value=self.storage.file_system.file_system_id, description="FSx for Lustre")
        CfnOutput(
            self,
            "PipelineRunId",
            value=trigger.run_id,
            description="Run started by this deployment (empty when pipeline.start_run is false)",
        )
        CfnOutput(self, "PipelineRunDirectory", value=trigger.run_dir, description="On the cluster's /fsx")
        CfnOutput(
            self,
            "DashboardUrl",
            value=f"https://{config.region}.console.aws.amazon.com/cloudwatch/home?region={config.region}"
            f"#dashboards/dashboard/{config.stack_name}",
            description="CloudWatch dashboard: training, Slurm, nodes, FSx, Neuron devices, alarms",
        )
        CfnOutput(self, "AlarmTopicArn", value=self.notifications.topic.topic_arn, description="Alarms and budget")
        CfnOutput(self, "PipelineJobIds", value=trigger.job_ids, description="Slurm job id per stage")
        CfnOutput(
            self,
            "PipelineRunStatus",
            value=trigger.run_status,
            description="submitted, no-run, submitted-earlier, or not-started: <why> (the environment is kept)",
        )

    def _queue_access(self, config: EnvironmentConfig) -> dict[str, list[iam.PolicyStatement]]:
        """What only one queue's nodes may do, by queue (each list becomes that queue's own policy). The CPU stages'
        queue: the fetch stage's copy of base models to the bucket prefix the file system imports /fsx/models from,
        and the Hub token secrets (fetch, export). Statements for another queue are added to its list; without a
        CPU queue, the CPU stages' list is the Trainium queue's. The Trainium queue: the training job's trackers, and
        the compile stage's cache in the bucket (stage it, read the promoted one, ask for its promotion)."""
        access: dict[str, list[iam.PolicyStatement]] = defaultdict(list)
        models = self.storage.bucket.arn_for_objects(f"{config.storage.fsx_s3_prefix}/{MODELS_FOLDER}/*")
        access[cpu_stages_queue(config)] += [
            iam.PolicyStatement(actions=["s3:GetObject", "s3:PutObject", "s3:DeleteObject"], resources=[models]),
            *hub_secret_access(config),
        ]
        access[config.compute.queue_name] += tracking_access(config.tracking)  # the training job's trackers
        access[config.compute.queue_name] += self.compile_cache.node_access()  # the compile stage's cache
        return dict(access)
