"""The stack of one environment: wires network, storage and cluster together and publishes the outputs."""

from __future__ import annotations

from aws_cdk import CfnOutput, Environment, Stack, Tags
from constructs import Construct

from stacks.cluster import Cluster
from stacks.config import PARALLELCLUSTER_VERSION, EnvironmentConfig
from stacks.network import Network
from stacks.pipeline import Pipeline
from stacks.storage import Storage


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

        self.network = Network(self, "Network", config=config)
        self.storage = Storage(
            self,
            "Storage",
            config=config,
            vpc=self.network.vpc,
            subnet=self.network.private_subnet,
            client_security_group=self.network.cluster_security_group,
        )
        self.cluster = Cluster(
            self,
            "Cluster",
            config=config,
            head_node_subnet=self.network.private_subnet,
            compute_subnet=self.network.private_subnet,
            security_group=self.network.cluster_security_group,
            file_system=self.storage.file_system,
            bucket=self.storage.bucket,
        )

        head_node = self.cluster.head_node_instance_id
        self.pipeline = Pipeline(
            self,
            "Pipeline",
            config=config,
            bucket=self.storage.bucket,
            file_system=self.storage.file_system,
            head_node_instance_id=head_node,
            neuron_release=self.cluster.neuron_release,
        )
        CfnOutput(self, "ClusterName", value=config.cluster_name, description="ParallelCluster cluster name")
        CfnOutput(self, "HeadNodeInstanceId", value=head_node, description="EC2 instance id of the head node")
        CfnOutput(
            self,
            "SsmConnectCommand",
            value=f"aws ssm start-session --region {config.region} --target {head_node}",
            description="Open a shell on the head node through SSM Session Manager (no inbound ports)",
        )
        CfnOutput(self, "ResultsBucketName", value=self.storage.bucket.bucket_name, description="Kept on destroy")
        CfnOutput(self, "FileSystemId", value=self.storage.file_system.file_system_id, description="FSx for Lustre")
        CfnOutput(
            self,
            "PipelineRunId",
            value=self.pipeline.run_id,
            description="Run started by this deployment (empty when pipeline.start_run is false)",
        )
        CfnOutput(self, "PipelineRunDirectory", value=self.pipeline.run_dir, description="On the cluster's /fsx")
        CfnOutput(self, "PipelineJobIds", value=self.pipeline.job_ids, description="Slurm job id per stage")
