"""CDK assertions on the synthesized templates: each resource and property the environment promises."""

from __future__ import annotations

import inspect
import json
from typing import Any

import pytest
from aws_cdk.assertions import Match, Template

from stacks.cluster import Cluster
from stacks.config import PARALLELCLUSTER_VERSION
from stacks.network import Network
from stacks.pcluster_config import build_cluster_configuration
from stacks.pipeline_trigger import PipelineTrigger
from stacks.storage import Storage
from tests.support.synthesis import Synthesized


def template_of(env: Synthesized) -> Template:
    return Template.from_json(env.template)


def cluster_configuration(env: Synthesized) -> dict[str, Any]:
    return env.only("Custom::PclusterCluster")["Properties"]["ClusterConfiguration"]


def logical_id(env: Synthesized, resource_type: str) -> str:
    (name,) = env.resources_of_type(resource_type)
    return name


# --- network ---------------------------------------------------------------------------------------


def test_one_public_and_one_private_subnet_in_the_configured_zone(default_env: Synthesized) -> None:
    subnets = default_env.resources_of_type("AWS::EC2::Subnet").values()
    assert sorted(s["Properties"]["MapPublicIpOnLaunch"] for s in subnets) == [False, True]
    # A zone ID, not a name: names map to different physical zones per account.
    assert {s["Properties"]["AvailabilityZoneId"] for s in subnets} == {"usw2-az4"}
    assert all("AvailabilityZone" not in s["Properties"] for s in subnets)


def test_nat_gateway_and_s3_gateway_endpoint(default_env: Synthesized) -> None:
    template = template_of(default_env)
    template.resource_count_is("AWS::EC2::NatGateway", 1)
    template.has_resource_properties(
        "AWS::EC2::VPCEndpoint",
        {
            "VpcEndpointType": "Gateway",
            "ServiceName": {"Fn::Join": ["", ["com.amazonaws.", {"Ref": "AWS::Region"}, ".s3"]]},
        },
    )


def test_flow_logs_go_to_a_log_group_deleted_with_the_stack(default_env: Synthesized) -> None:
    template = template_of(default_env)
    template.has_resource_properties(
        "AWS::EC2::FlowLog", {"ResourceType": "VPC", "LogDestinationType": "cloud-watch-logs"}
    )
    template.has_resource(
        "AWS::Logs::LogGroup",
        {"Properties": {"RetentionInDays": 14}, "DeletionPolicy": "Delete", "UpdateReplacePolicy": "Delete"},
    )


def test_every_log_group_is_deleted_with_the_stack_and_every_function_logs_to_one(default_env: Synthesized) -> None:
    """A Lambda function without a log group of the template logs to one Lambda creates, which never expires
    and outlives `cdk destroy`."""
    groups = default_env.resources_of_type("AWS::Logs::LogGroup")
    assert groups and all(
        g["DeletionPolicy"] == "Delete" and g["Properties"]["RetentionInDays"] for g in groups.values()
    )
    for name, function in default_env.resources_of_type("AWS::Lambda::Function").items():
        log_group = function["Properties"].get("LoggingConfig", {}).get("LogGroup")
        assert log_group == {"Ref": log_group["Ref"]} and log_group["Ref"] in groups, name


def test_only_the_deployment_writes_what_nodes_execute(default_env: Synthesized) -> None:
    """The shipped code and node files: only the deployment's role; the folders FSx imports onto /fsx that nodes
    execute (shared environment, fetched sources, compile cache): nobody, through S3."""
    (policy,) = default_env.resources_of_type("AWS::S3::BucketPolicy").values()
    statements = {s.get("Sid"): s for s in policy["Properties"]["PolicyDocument"]["Statement"]}
    bucket = {"Fn::GetAtt": [logical_id(default_env, "AWS::S3::Bucket"), "Arn"]}
    code = statements["OnlyTheDeploymentWritesNodeCode"]
    assert code["Effect"] == "Deny" and code["Principal"] == {"AWS": "*"}
    assert set(code["Action"]) == {"s3:PutObject", "s3:DeleteObject", "s3:DeleteObjectVersion"}
    assert sorted(json.dumps(r, sort_keys=True) for r in code["Resource"]) == sorted(
        json.dumps({"Fn::Join": ["", [bucket, f"/{prefix}*"]]}, sort_keys=True)
        for prefix in ("pipeline/source/", "cluster/")
    )
    (writer,) = code["Condition"]["ArnNotEquals"]["aws:PrincipalArn"]["Fn::GetAtt"][:1]
    assert writer.startswith("CustomCDKBucketDeployment") and "ServiceRole" in writer
    imported = statements["NobodyWritesExecutedFileSystemFolders"]
    assert imported["Effect"] == "Deny" and "Condition" not in imported
    assert sorted(json.dumps(r, sort_keys=True) for r in imported["Resource"]) == sorted(
        json.dumps({"Fn::Join": ["", [bucket, f"/fsx/{folder}/*"]]}, sort_keys=True)
        for folder in ("envs", "pipeline", "neuron-cache")
    )


def test_results_bucket_expires_old_versions_and_abandoned_uploads(default_env: Synthesized) -> None:
    template_of(default_env).has_resource_properties(
        "AWS::S3::Bucket",
        {
            "VersioningConfiguration": {"Status": "Enabled"},
            "LifecycleConfiguration": {
                "Rules": [
                    {
                        "Id": "ExpireOldVersionsAndAbandonedUploads",
                        "Status": "Enabled",
                        "NoncurrentVersionExpiration": {"NoncurrentDays": 30},
                        "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 7},
                    },
                    # Compile caches the nodes staged (stacks/compile_cache.py): promoted in minutes, else dropped.
                    {
                        "Id": "ExpireStagedCompileCaches",
                        "Status": "Enabled",
                        "Prefix": "compile-cache/staging/",
                        "ExpirationInDays": 14,
                    },
                ]
            },
        },
    )


def test_cluster_group_allows_all_traffic_from_itself(default_env: Synthesized) -> None:
    group = next(
        name
        for name, resource in default_env.resources_of_type("AWS::EC2::SecurityGroup").items()
        if resource["Properties"]["GroupDescription"].startswith("Head and compute nodes")
    )
    template_of(default_env).has_resource_properties(
        "AWS::EC2::SecurityGroupIngress",
        {
            "IpProtocol": "-1",
            "GroupId": {"Fn::GetAtt": [group, "GroupId"]},
            "SourceSecurityGroupId": {"Fn::GetAtt": [group, "GroupId"]},
        },
    )


def test_file_system_group_opens_only_lustre_ports(default_env: Synthesized) -> None:
    ports = sorted(
        (rule["Properties"]["FromPort"], rule["Properties"]["ToPort"])
        for rule in default_env.resources_of_type("AWS::EC2::SecurityGroupIngress").values()
        if rule["Properties"]["IpProtocol"] == "tcp"
    )
    # Client rules from the cluster group, plus LustreFileSystem's own rule within the file system group.
    assert ports == [(988, 988), (988, 1023), (1018, 1023)]


@pytest.mark.parametrize("env_name", ["default", "smoke"])
def test_nothing_is_open_to_the_internet(env_name: str, synthesized: dict[str, Synthesized]) -> None:
    env = synthesized[env_name]
    for resource in env.template["Resources"].values():
        properties = resource.get("Properties", {})
        rules = properties.get("SecurityGroupIngress", []) + (
            [properties] if resource["Type"] == "AWS::EC2::SecurityGroupIngress" else []
        )
        for rule in rules:
            assert rule.get("CidrIp") not in ("0.0.0.0/0",) and rule.get("CidrIpv6") != "::/0", rule
    assert "Ssh" not in cluster_configuration(env)["HeadNode"]


# --- storage -----------------------------------------------------------------------------------------


def test_results_bucket_is_encrypted_private_versioned_tls_only_and_kept(default_env: Synthesized) -> None:
    template = template_of(default_env)
    template.has_resource(
        "AWS::S3::Bucket",
        {
            "Properties": {
                "BucketEncryption": {
                    "ServerSideEncryptionConfiguration": [{"ServerSideEncryptionByDefault": {"SSEAlgorithm": "AES256"}}]
                },
                "PublicAccessBlockConfiguration": {
                    "BlockPublicAcls": True,
                    "BlockPublicPolicy": True,
                    "IgnorePublicAcls": True,
                    "RestrictPublicBuckets": True,
                },
                "VersioningConfiguration": {"Status": "Enabled"},
            },
            "DeletionPolicy": "Retain",
            "UpdateReplacePolicy": "Retain",
        },
    )
    template.has_resource_properties(
        "AWS::S3::BucketPolicy",
        {
            "PolicyDocument": {
                "Statement": Match.array_with(
                    [
                        Match.object_like(
                            {
                                "Effect": "Deny",
                                "Condition": {"Bool": {"aws:SecureTransport": "false"}},
                                "Action": "s3:*",
                            }
                        )
                    ]
                )
            }
        },
    )


def test_the_kept_bucket_keeps_its_policy(synthesized: dict[str, Synthesized]) -> None:
    """A bucket kept on destroy without its policy would lose TLS-only and the write denials of node code."""
    for env in synthesized.values():
        bucket = logical_id(env, "AWS::S3::Bucket")
        (policy,) = env.resources_of_type("AWS::S3::BucketPolicy").values()
        assert policy["Properties"]["Bucket"] == {"Ref": bucket}
        assert (policy["DeletionPolicy"], policy["UpdateReplacePolicy"]) == ("Retain", "Retain")
        sids = {statement.get("Sid") for statement in policy["Properties"]["PolicyDocument"]["Statement"]}
        assert {"OnlyTheDeploymentWritesNodeCode", "NobodyWritesExecutedFileSystemFolders"} <= sids


def test_scratch_2_file_system_linked_to_the_bucket(default_env: Synthesized) -> None:
    bucket = logical_id(default_env, "AWS::S3::Bucket")
    repository = {"Fn::Join": ["", ["s3://", {"Ref": bucket}, "/fsx"]]}
    template_of(default_env).has_resource(
        "AWS::FSx::FileSystem",
        {
            "Properties": {
                "FileSystemType": "LUSTRE",
                "StorageCapacity": 1200,
                "LustreConfiguration": {
                    "DeploymentType": "SCRATCH_2",
                    "ImportPath": repository,
                    "ExportPath": repository,
                    "AutoImportPolicy": "NEW_CHANGED_DELETED",
                },
                "SubnetIds": [{"Ref": Match.string_like_regexp("private")}],
            },
            "DeletionPolicy": "Delete",
            "DependsOn": Match.array_with([Match.string_like_regexp("ResultsPolicy")]),
        },
    )


def test_file_system_is_passed_to_the_cluster_by_id(default_env: Synthesized) -> None:
    file_system = logical_id(default_env, "AWS::FSx::FileSystem")
    assert cluster_configuration(default_env)["SharedStorage"] == [
        {
            "Name": "fsx",
            "StorageType": "FsxLustre",
            "MountDir": "/fsx",
            "FsxLustreSettings": {"FileSystemId": {"Ref": file_system}},
        }
    ]


# --- cluster -----------------------------------------------------------------------------------------


def test_provider_is_pinned_to_one_parallelcluster_version(default_env: Synthesized) -> None:
    provider = default_env.only("AWS::CloudFormation::Stack")
    url = provider["Properties"]["TemplateURL"]["Fn::Sub"]
    assert url == (
        "https://${AWS::Region}-aws-parallelcluster.s3.${AWS::Region}.${AWS::URLSuffix}"
        f"/parallelcluster/{PARALLELCLUSTER_VERSION}/templates/custom_resource/cluster.yaml"
    )
    cluster = default_env.only("Custom::PclusterCluster")
    provider_id = logical_id(default_env, "AWS::CloudFormation::Stack")
    assert cluster["Properties"]["ServiceToken"] == {"Fn::GetAtt": [provider_id, "Outputs.ServiceToken"]}


def test_cluster_is_deleted_with_the_stack(default_env: Synthesized) -> None:
    cluster = default_env.only("Custom::PclusterCluster")
    assert cluster["Properties"]["DeletionPolicy"] == "Delete"
    assert cluster["DeletionPolicy"] == "Delete"
    assert cluster["Properties"]["ClusterName"] == "trn1-llama"
    assert "RollbackOnFailure" not in cluster["Properties"]
    assert cluster_configuration(default_env)["Monitoring"]["Logs"]["CloudWatch"] == {
        "Enabled": True,
        "RetentionInDays": 14,
        "DeletionPolicy": "Delete",
    }


def test_cluster_waits_for_the_nat_route(default_env: Synthesized) -> None:
    depends_on = default_env.only("Custom::PclusterCluster")["DependsOn"]
    assert any("privateSubnet1DefaultRoute" in name for name in depends_on)


def test_scheduling_scales_to_zero_and_drains_on_update(default_env: Synthesized) -> None:
    scheduling = cluster_configuration(default_env)["Scheduling"]
    # DRAIN (compute.queue_update_strategy): a deploy that changes a queue lets running jobs finish.
    # A failed stage's dependants are cancelled (ParallelCluster's validator allows the key: the offline tests).
    assert scheduling["SlurmSettings"] == {
        "ScaledownIdletime": 10,
        "QueueUpdateStrategy": "DRAIN",
        "CustomSlurmSettings": [{"DependencyParameters": "kill_invalid_depend"}],
    }
    queue, cpu = scheduling["SlurmQueues"]
    (resource,) = queue["ComputeResources"]
    assert resource == {
        "Name": "trn1-32xlarge",
        "InstanceType": "trn1.32xlarge",
        "MinCount": 0,
        "MaxCount": 4,
        "Efa": {"Enabled": True},
    }
    assert queue["Networking"]["PlacementGroup"] == {"Enabled": True}
    # The CPU stages' queue: on-demand r6a.8xlarge, no EFA, no placement group, scaled to zero too.
    assert cpu["Name"] == "cpu" and cpu["CapacityType"] == "ONDEMAND" and "PlacementGroup" not in cpu["Networking"]
    assert cpu["ComputeResources"] == [
        {"Name": "r6a-8xlarge", "InstanceType": "r6a.8xlarge", "MinCount": 0, "MaxCount": 2}
    ]
    assert cpu["CustomActions"]["OnNodeConfigured"]["Args"][-2:] == ["--node-type", "cpu"]
    # Both queues get the compute nodes' policy and one of their own: the CPU queue's (the Hub token secrets, the
    # model copy), the Trainium queue's (the compile cache in the bucket).
    assert (
        cpu["Iam"]["AdditionalIamPolicies"][:1]
        == queue["Iam"]["AdditionalIamPolicies"][:1]
        == [{"Policy": {"Ref": "ClusterComputeNodePolicy837CDCC1"}}]
    )
    assert cpu["Iam"]["AdditionalIamPolicies"][1:] == [{"Policy": {"Ref": "ClusterQueuePolicycpu7E0E695F"}}]
    assert queue["Iam"]["AdditionalIamPolicies"][1:] == [{"Policy": {"Ref": "ClusterQueuePolicycompute17DC320E5"}}]


def test_smoke_queue_has_no_efa_and_no_placement_group(smoke_env: Synthesized) -> None:
    queue, _ = cluster_configuration(smoke_env)["Scheduling"]["SlurmQueues"]
    assert queue["ComputeResources"][0]["Efa"] == {"Enabled": False}
    assert queue["ComputeResources"][0]["MaxCount"] == 1
    assert queue["Networking"]["PlacementGroup"] == {"Enabled": False}


def test_head_node_is_private_and_reached_through_ssm(default_env: Synthesized) -> None:
    head = cluster_configuration(default_env)["HeadNode"]
    assert head["InstanceType"] == "m6a.2xlarge"  # the CPU stages run in the CPU queue, not here
    assert head["LocalStorage"]["RootVolume"]["Size"] == 100
    assert head["Networking"]["SubnetId"]["Ref"].startswith("NetworkVpcprivate")
    assert {"Policy": "arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore"} in head["Iam"]["AdditionalIamPolicies"]


def test_bootstrap_script_at_a_fixed_key_runs_on_every_node(default_env: Synthesized) -> None:
    configuration = cluster_configuration(default_env)
    head_action = configuration["HeadNode"]["CustomActions"]["OnNodeConfigured"]
    queue_action = configuration["Scheduling"]["SlurmQueues"][0]["CustomActions"]["OnNodeConfigured"]
    assert head_action == queue_action
    bucket = {"Ref": logical_id(default_env, "AWS::S3::Bucket")}
    # Fixed keys, never content: a new script is a new object there, not a cluster update (tests/infra/test_day2.py).
    assert head_action["Script"] == {"Fn::Join": ["", ["s3://", bucket, "/cluster/on_node_configured.sh"]]}
    assert head_action["Args"][:2] == ["--neuron-release", head_action["Args"][1]]
    assert head_action["Args"][2:4] == ["--shared-env", f"/fsx/envs/neuron-{head_action['Args'][1]}"]
    assert head_action["Args"][4] == "--requirements"
    assert head_action["Args"][5] == {"Fn::Join": ["", ["s3://", bucket, "/cluster/cluster-requirements.txt"]]}
    assert head_action["Args"][6] == "--node-settings"
    assert head_action["Args"][7] == {"Fn::Join": ["", ["s3://", bucket, "/cluster/node-settings.json"]]}
    assert head_action["Args"][8:] == [
        "--trainium-partition",
        "compute1",
        "--neuron-devices",
        "16",
        "--efa-devices",
        "8",
        "--environment",
        "default",
    ]


def node_policy(env: Synthesized, which: str) -> dict[str, Any]:
    return env.template["Resources"][logical_id_of_policy(env, which)]["Properties"]


def grants(policy: dict[str, Any], effect: str = "Allow") -> set[tuple[str, str, str]]:
    """(action, resource, condition) triples of a policy's statements of `effect`, however CDK merged them."""
    triples = set()
    for statement in policy["PolicyDocument"]["Statement"]:
        assert statement["Effect"] in ("Allow", "Deny")
        if statement["Effect"] != effect:
            continue
        actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        resources = statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
        condition = json.dumps(statement.get("Condition"), sort_keys=True)
        triples |= {(a, json.dumps(r, sort_keys=True), condition) for a in actions for r in resources}
    return triples


@pytest.mark.parametrize(
    ("which", "read_prefixes", "write_prefix"),
    # The head node fetches the code and writes the SSM output the pipeline reads back; compute nodes run
    # the export stage. Both read the node files.
    [
        ("Head", ("pipeline/source/", "cluster/", "results/"), "pipeline/ssm-output/"),
        ("Compute", ("cluster/", "results/"), "results/"),
    ],
)
def test_node_policies_are_scoped_to_prefixes_of_the_bucket(
    default_env: Synthesized, which: str, read_prefixes: tuple[str, ...], write_prefix: str
) -> None:
    policy = node_policy(default_env, which)
    # ParallelCluster's provider may attach only policies under /parallelcluster/.
    assert policy["Path"] == "/parallelcluster/"
    bucket = {"Fn::GetAtt": [logical_id(default_env, "AWS::S3::Bucket"), "Arn"]}

    def under(prefix: str) -> str:
        return json.dumps({"Fn::Join": ["", [bucket, f"/{prefix}*"]]}, sort_keys=True)

    writable = under(write_prefix)
    # The Trainium nodes' record of the Neuron apt key: read, and created only by a conditional write.
    record = json.dumps({"Fn::Join": ["", [bucket, "/trust/neuron-apt-key.fingerprint"]]}, sort_keys=True)
    conditional = json.dumps({"Null": {"s3:if-none-match": "false"}}, sort_keys=True)
    unconditional = json.dumps({"Null": {"s3:if-none-match": "true"}}, sort_keys=True)
    record_grants = {("s3:GetObject", record, "null"), ("s3:PutObject", record, conditional)}
    namespace = json.dumps({"StringEquals": {"cloudwatch:namespace": "Trainium/default"}}, sort_keys=True)
    assert grants(policy) == {
        ("s3:ListBucket", json.dumps(bucket, sort_keys=True), "null"),
        *(("s3:GetObject", under(prefix), "null") for prefix in read_prefixes),
        ("s3:PutObject", writable, "null"),
        ("s3:DeleteObject", writable, "null"),
        ("cloudwatch:PutMetricData", json.dumps("*"), namespace),
        *(record_grants if which == "Compute" else ()),
    }
    assert grants(policy, "Deny") == (
        {
            ("s3:PutObject", record, unconditional),
            ("s3:DeleteObject", record, "null"),
            ("s3:DeleteObjectVersion", record, "null"),
        }
        if which == "Compute"
        else set()
    )


def test_the_export_stage_writes_where_compute_nodes_may(default_env: Synthesized) -> None:
    """The export stage runs on a compute node: its destination must be under the compute write prefix."""
    pipeline = default_env.resources_of_type("Custom::TrainingPipeline")
    (properties,) = (p["Properties"] for p in pipeline.values())
    site_json = properties["SiteSettings"]["Fn::Join"][1]
    results = next(part for part in site_json if isinstance(part, str) and '"results":"s3://' in part)
    assert results.endswith('"results":"s3://')
    following = site_json[site_json.index(results) + 2]
    assert following.startswith('/results",'), following  # s3://<bucket>/results
    bucket = {"Fn::GetAtt": [logical_id(default_env, "AWS::S3::Bucket"), "Arn"]}
    results_objects = json.dumps({"Fn::Join": ["", [bucket, "/results/*"]]}, sort_keys=True)
    assert ("s3:PutObject", results_objects, "null") in grants(node_policy(default_env, "Compute"))


def test_each_node_role_gets_its_own_policy(default_env: Synthesized) -> None:
    configuration = cluster_configuration(default_env)
    head = logical_id_of_policy(default_env, "Head")
    compute = logical_id_of_policy(default_env, "Compute")
    assert {"Policy": {"Ref": head}} in configuration["HeadNode"]["Iam"]["AdditionalIamPolicies"]
    assert configuration["Scheduling"]["SlurmQueues"][0]["Iam"]["AdditionalIamPolicies"][:1] == [
        {"Policy": {"Ref": compute}}
    ]


def logical_id_of_policy(env: Synthesized, which: str) -> str:
    (name,) = (
        n
        for n, p in env.resources_of_type("AWS::IAM::ManagedPolicy").items()
        if p["Properties"]["Description"].startswith(which)
    )
    return name


# --- outputs ----------------------------------------------------------------------------------------


def test_outputs(default_env: Synthesized) -> None:
    outputs = default_env.template["Outputs"]
    cluster = logical_id(default_env, "Custom::PclusterCluster")
    head_node = {"Fn::GetAtt": [cluster, "headNode.instanceId"]}
    assert outputs["HeadNodeInstanceId"]["Value"] == head_node
    assert outputs["SsmConnectCommand"]["Value"] == {
        "Fn::Join": ["", ["aws ssm start-session --region us-west-2 --target ", head_node]]
    }
    assert outputs["ResultsBucketName"]["Value"] == {"Ref": logical_id(default_env, "AWS::S3::Bucket")}
    assert outputs["FileSystemId"]["Value"] == {"Ref": logical_id(default_env, "AWS::FSx::FileSystem")}
    assert outputs["ClusterName"]["Value"] == "trn1-llama"


def test_tags_reach_stack_resources_and_cluster(default_env: Synthesized) -> None:
    template_of(default_env).has_resource_properties(
        "AWS::EC2::VPC", {"Tags": Match.array_with([{"Key": "project", "Value": "trainium-training"}])}
    )
    assert {"Key": "project", "Value": "trainium-training"} in cluster_configuration(default_env)["Tags"]


# --- wiring ----------------------------------------------------------------------------------------


def test_constructs_take_narrow_keyword_only_arguments() -> None:
    """Only the stack reads the whole environment; each construct gets the settings and resources it uses."""
    for construct in (Network, Storage, Cluster, PipelineTrigger):
        parameters = list(inspect.signature(construct.__init__).parameters.values())
        assert [p.name for p in parameters[:3]] == ["self", "scope", "construct_id"]
        assert {p.kind for p in parameters[3:]} == {inspect.Parameter.KEYWORD_ONLY}, construct.__name__
        assert not [p.name for p in parameters if "EnvironmentConfig" in str(p.annotation)], construct.__name__
    builder = inspect.signature(build_cluster_configuration).parameters.values()
    assert [str(p.annotation) for p in builder] == ["ClusterSettings", "ClusterResources"]
