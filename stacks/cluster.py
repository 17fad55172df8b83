"""Cluster: node IAM policies, the pinned ParallelCluster provider and the Custom::PclusterCluster."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from aws_cdk import Aws, CfnStack, CustomResource, Fn, RemovalPolicy
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_fsx as fsx
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_s3_deployment as s3_deployment
from constructs import Construct

from stacks.cluster_requirements import LOCK
from stacks.config import PARALLELCLUSTER_VERSION
from stacks.pcluster_config import ClusterResources, ClusterSettings, build_cluster_configuration
from training.software import BOOTSTRAP_SCRIPT

# ParallelCluster's provider may attach only policies under this path (or named parallelcluster*).
PARALLELCLUSTER_POLICY_PATH = "/parallelcluster/"
# The bucket prefix of the files nodes read while bootstrapping, at keys that never change: the cluster
# configuration names them, and ParallelCluster cannot update the head node's OnNodeConfigured. Only the
# deployment writes there (Storage.protect_executed_code), so a new script or setting is a new object at the
# same key, which the next node to boot runs, and never a change of the cluster configuration.
NODE_FILES_PREFIX = "cluster/"
NODE_SETTINGS_FILE = "node-settings.json"
# The image build's component (stacks/node_image.py): fetches the deployed bootstrap and runs it with --bake.
BAKE_SCRIPT_FILE = "bake_neuron_image.sh"


def bake_script(*, bootstrap_uri: str, neuron_release: str, shared_env: str, node_settings_uri: str) -> str:
    """The image build component: Image Builder runs a script component without arguments."""
    return "\n".join(
        [
            "#!/bin/bash",
            "# pcluster build-image component (stacks/node_image.py): the deployed node bootstrap with --bake.",
            "set -euo pipefail",
            "script=$(mktemp)",
            f'aws s3 cp --only-show-errors "{bootstrap_uri}" "$script"',
            f'exec bash "$script" --bake --node-type compute --neuron-release {neuron_release} '
            f'--shared-env {shared_env} --node-settings "{node_settings_uri}"',
            "",
        ]
    )


# Where the first Trainium node records the Neuron apt key's fingerprint, once (a conditional write that
# cannot overwrite); not under NODE_FILES_PREFIX, which only the deployment writes.
NEURON_APT_KEY_RECORD = "trust/neuron-apt-key.fingerprint"


def provider_template_url(version: str) -> str:
    """Where ParallelCluster publishes its CloudFormation custom-resource provider for `version`."""
    return Fn.sub(
        "https://${AWS::Region}-aws-parallelcluster.s3.${AWS::Region}.${AWS::URLSuffix}"
        f"/parallelcluster/{version}/templates/custom_resource/cluster.yaml"
    )


@dataclass(frozen=True)
class NodeHealth:
    """What a healthy Trainium node shows, checked at bootstrap and by the Slurm prolog of its partition."""

    partition: str
    neuron_devices: int
    efa_devices: int


def bootstrap_arguments(
    *,
    neuron_release: str,
    shared_env: str,
    requirements_uri: str,
    node_settings_uri: str,
    health: NodeHealth,
    environment_name: str,
) -> tuple[str, ...]:
    """Arguments of the OnNodeConfigured script: only what never changes for the cluster's life.

    The environment's name tells the nodes' metric publishers which site file to follow (its namespace and
    region).

    The requirement set and the node settings are passed by their stable S3 keys, not by content, so a new lock
    or setting never changes the cluster configuration; the pipeline brings the shared environment up to date
    before a new run, and every node reads the settings when it boots.
    """
    return (
        *("--neuron-release", neuron_release, "--shared-env", shared_env, "--requirements", requirements_uri),
        *("--node-settings", node_settings_uri),
        *("--trainium-partition", health.partition),
        *("--neuron-devices", str(health.neuron_devices), "--efa-devices", str(health.efa_devices)),
        *("--environment", environment_name),
    )


def node_settings(*, neuron_apt_key_fingerprint: str | None, neuron_apt_key_record: str) -> dict[str, str]:
    """What the bootstrap reads from `NODE_SETTINGS_FILE` at every boot: settings a user may change on day 2.
    A setting left out of the environment file is left out here (the bootstrap reads it as unset)."""
    settings = {"neuron_apt_key_record": neuron_apt_key_record}
    if neuron_apt_key_fingerprint:
        settings["neuron_apt_key_fingerprint"] = neuron_apt_key_fingerprint.upper()
    return settings


class Cluster(Construct):
    """The ParallelCluster cluster, created and deleted with the stack (never retained).

    `head_node_access` and `compute_node_access` are the statements the stack grants each node type on
    resources outside the cluster; they lead the node policies, before the cluster's own statements.
    `queue_access` grants more to the nodes of one Slurm queue only (queue name -> statements): each queue with
    statements gets a managed policy of its own, attached to that queue alone (ParallelCluster's per-queue
    `Iam.AdditionalIamPolicies`), so what one queue's jobs need (the Hub token secrets of the CPU stages) is out
    of reach of the others.

    Every file a node executes or reads while bootstrapping (the script, the locked requirement set, the node
    settings) is uploaded by one deployment to fixed keys under `NODE_FILES_PREFIX`: the cluster configuration
    names the keys, never the content, so no edit of them is an update ParallelCluster refuses.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        cluster_name: str,
        environment_name: str,
        settings: ClusterSettings,
        metrics_namespace: str,
        neuron_release: str,
        shared_env: str,
        neuron_apt_key_fingerprint: str | None,
        health: NodeHealth,
        lock: Path = LOCK,
        head_node_subnet: ec2.ISubnet,
        compute_subnet: ec2.ISubnet,
        security_group: ec2.ISecurityGroup,
        file_system: fsx.IFileSystem,
        node_files_bucket: s3.IBucket,
        deployment_logs: logs.ILogGroup,
        head_node_access: Sequence[iam.PolicyStatement],
        compute_node_access: Sequence[iam.PolicyStatement],
        queue_access: Mapping[str, Sequence[iam.PolicyStatement]] | None = None,
    ) -> None:
        super().__init__(scope, construct_id)
        self.cluster_name = cluster_name
        self.node_files_bucket = node_files_bucket
        self.node_files = self._deploy_node_files(
            lock=lock,
            neuron_release=neuron_release,
            shared_env=shared_env,
            neuron_apt_key_fingerprint=neuron_apt_key_fingerprint,
            deployment_logs=deployment_logs,
        )
        self.bootstrap_script_uri = self.node_file_uri(BOOTSTRAP_SCRIPT.name)
        self._add_node_policies(
            head_node_access=head_node_access,
            compute_node_access=compute_node_access,
            queue_access=queue_access or {},
            metrics_namespace=metrics_namespace,
        )
        self.provider = CfnStack(
            self,
            "Provider",
            template_url=provider_template_url(PARALLELCLUSTER_VERSION),
        )
        resources = ClusterResources(
            head_node_subnet_id=head_node_subnet.subnet_id,
            compute_subnet_id=compute_subnet.subnet_id,
            security_group_id=security_group.security_group_id,
            file_system_id=file_system.file_system_id,
            head_node_policy_arn=self.head_node_policy.managed_policy_arn,
            compute_node_policy_arn=self.compute_node_policy.managed_policy_arn,
            queue_policy_arns={queue: policy.managed_policy_arn for queue, policy in self.queue_policies.items()},
            bootstrap_script_url=self.bootstrap_script_uri,
            bootstrap_args=bootstrap_arguments(
                neuron_release=neuron_release,
                shared_env=shared_env,
                requirements_uri=self.node_file_uri(lock.name),
                node_settings_uri=self.node_file_uri(NODE_SETTINGS_FILE),
                health=health,
                environment_name=environment_name,
            ),
        )
        self.resource = CustomResource(
            self,
            "Resource",
            resource_type="Custom::PclusterCluster",
            service_token=self.provider.get_att("Outputs.ServiceToken").to_string(),
            properties={
                "ClusterName": cluster_name,
                "ClusterConfiguration": build_cluster_configuration(settings, resources),
                "DeletionPolicy": "Delete",
            },
            removal_policy=RemovalPolicy.DESTROY,
        )
        # Nodes download the Neuron SDK while bootstrapping: the NAT route must exist before the cluster, and
        # the node files in the bucket.
        self.resource.node.add_dependency(compute_subnet.internet_connectivity_established)
        self.resource.node.add_dependency(self.node_files)
        self.head_node_instance_id = self.resource.get_att_string("headNode.instanceId")

    def node_file_uri(self, name: str) -> str:
        """The S3 URI of a node file: its fixed key under `NODE_FILES_PREFIX` of the bucket."""
        return f"s3://{self.node_files_bucket.bucket_name}/{NODE_FILES_PREFIX}{name}"

    def _deploy_node_files(
        self,
        *,
        lock: Path,
        neuron_release: str,
        shared_env: str,
        neuron_apt_key_fingerprint: str | None,
        deployment_logs: logs.ILogGroup,
    ) -> s3_deployment.BucketDeployment:
        """The bootstrap script and the locked requirement set (the same file the pipeline ships with the code),
        the image build's component and the day-2 settings, at their fixed keys."""
        node_files = (BOOTSTRAP_SCRIPT, lock)  # both in assets/node/
        return s3_deployment.BucketDeployment(
            self,
            "NodeFiles",
            sources=[
                s3_deployment.Source.asset(
                    str(BOOTSTRAP_SCRIPT.parent), exclude=["*", *(f"!{path.name}" for path in node_files)]
                ),
                s3_deployment.Source.data(
                    BAKE_SCRIPT_FILE,
                    bake_script(
                        bootstrap_uri=self.node_file_uri(BOOTSTRAP_SCRIPT.name),
                        neuron_release=neuron_release,
                        shared_env=shared_env,
                        node_settings_uri=self.node_file_uri(NODE_SETTINGS_FILE),
                    ),
                ),
                s3_deployment.Source.json_data(
                    NODE_SETTINGS_FILE,
                    node_settings(
                        neuron_apt_key_fingerprint=neuron_apt_key_fingerprint,
                        neuron_apt_key_record=f"s3://{self.node_files_bucket.bucket_name}/{NEURON_APT_KEY_RECORD}",
                    ),
                ),
            ],
            destination_bucket=self.node_files_bucket,
            destination_key_prefix=NODE_FILES_PREFIX,
            memory_limit=512,  # shares the stack's one BucketDeployment handler, and its log group
            log_group=deployment_logs,
        )

    def _add_node_policies(
        self,
        *,
        head_node_access: Sequence[iam.PolicyStatement],
        compute_node_access: Sequence[iam.PolicyStatement],
        queue_access: Mapping[str, Sequence[iam.PolicyStatement]],
        metrics_namespace: str,
    ) -> None:
        """The head node's and the compute nodes' policies, and one policy per queue with statements of its own."""
        self.head_node_policy = self._node_policy(
            "HeadNodePolicy", f"Head nodes of {self.cluster_name}", head_node_access, metrics_namespace
        )
        self.compute_node_policy = self._node_policy(
            "ComputeNodePolicy",
            f"Compute nodes of {self.cluster_name}",
            [*compute_node_access, *self._neuron_apt_key_record_access()],
            metrics_namespace,
        )
        self.queue_policies = {
            queue: iam.ManagedPolicy(
                self,
                f"QueuePolicy-{queue}",
                path=PARALLELCLUSTER_POLICY_PATH,
                description=f"Nodes of queue {queue} of {self.cluster_name} only",
                statements=list(statements),
            )
            for queue, statements in sorted(queue_access.items())
            if statements
        }

    def head_node_command_access(self) -> list[iam.PolicyStatement]:
        """Run shell commands through SSM on this cluster's head node only, and read their status."""
        return [
            iam.PolicyStatement(
                actions=["ssm:SendCommand"],
                resources=[f"arn:{Aws.PARTITION}:ec2:{Aws.REGION}:{Aws.ACCOUNT_ID}:instance/*"],
                # ParallelCluster tags its instances; the head node's id is known only once it exists.
                conditions={
                    "StringEquals": {
                        "ssm:resourceTag/parallelcluster:cluster-name": self.cluster_name,
                        "ssm:resourceTag/parallelcluster:node-type": "HeadNode",
                    }
                },
            ),
            iam.PolicyStatement(
                actions=["ssm:SendCommand"],
                resources=[
                    f"arn:{Aws.PARTITION}:ssm:{Aws.REGION}::document/AWS-RunShellScript",
                    # The command's output goes to the results bucket: SendCommand authorizes that bucket too
                    # (its `bucket` resource type in the Service Authorization Reference).
                    self.node_files_bucket.bucket_arn,
                ],
            ),
            # These two have no resource-level permissions (IAM Service Authorization Reference).
            iam.PolicyStatement(
                actions=["ssm:GetCommandInvocation", "ssm:DescribeInstanceInformation", "ssm:ListCommands"],
                resources=["*"],
            ),
        ]

    def _neuron_apt_key_record_access(self) -> list[iam.PolicyStatement]:
        """Trainium nodes read the recorded fingerprint of the Neuron apt key, and create it when absent: a
        conditional write (If-None-Match), which S3 refuses once the object exists, so no node can replace the
        record or delete it (AWS: "Enforce conditional writes on Amazon S3 buckets")."""
        record = self.node_files_bucket.arn_for_objects(NEURON_APT_KEY_RECORD)
        return [
            iam.PolicyStatement(actions=["s3:GetObject"], resources=[record]),
            iam.PolicyStatement(
                actions=["s3:PutObject"],
                resources=[record],
                conditions={"Null": {"s3:if-none-match": "false"}},
            ),
            iam.PolicyStatement(
                effect=iam.Effect.DENY,
                actions=["s3:PutObject"],
                resources=[record],
                conditions={"Null": {"s3:if-none-match": "true"}},
            ),
            iam.PolicyStatement(
                effect=iam.Effect.DENY,
                actions=["s3:DeleteObject", "s3:DeleteObjectVersion"],
                resources=[record],
            ),
        ]

    def _node_policy(
        self,
        construct_id: str,
        description: str,
        access: Sequence[iam.PolicyStatement],
        metrics_namespace: str,
    ) -> iam.ManagedPolicy:
        """Least privilege for cluster nodes: what the stack grants (the bucket's node files among it), their
        metrics."""
        return iam.ManagedPolicy(
            self,
            construct_id,
            path=PARALLELCLUSTER_POLICY_PATH,
            description=description,
            statements=[
                *access,
                iam.PolicyStatement(
                    actions=["cloudwatch:PutMetricData"],
                    resources=["*"],
                    conditions={"StringEquals": {"cloudwatch:namespace": metrics_namespace}},
                ),
            ],
        )
