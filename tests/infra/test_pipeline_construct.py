"""CDK assertions on the post-deploy trigger: the custom resource, its properties, what it depends on (so
destroy cancels and exports before the file system goes) and the least-privilege role of its handlers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stacks.pipeline import SOURCE_PARTS, source_files, source_hash
from tests.conftest import Synthesized


def pipeline_resource(env: Synthesized) -> tuple[str, dict[str, Any]]:
    ((name, resource),) = env.resources_of_type("Custom::TrainingPipeline").items()
    return name, resource


def logical_id(env: Synthesized, resource_type: str) -> str:
    (name,) = env.resources_of_type(resource_type)
    return name


def test_custom_resource_carries_the_environment_pipeline_settings(default_env: Synthesized) -> None:
    _, resource = pipeline_resource(default_env)
    properties = resource["Properties"]
    assert properties["StartRun"] == "false" and properties["Recipe"] == "llama31-8b-cpt"
    assert properties["RecipeOverrides"] == [] and properties["TimeoutSeconds"] == "1800"
    assert properties["EnvironmentName"] == "default" and properties["FileSystemMountDir"] == "/fsx"
    assert properties["SourceKey"] == f"pipeline/source/{source_hash()}/"
    assert properties["SourceHash"] == source_hash()
    assert properties["HeadNodeInstanceId"] == {
        "Fn::GetAtt": [logical_id(default_env, "Custom::PclusterCluster"), "headNode.instanceId"]
    }
    assert properties["FileSystemId"] == {"Ref": logical_id(default_env, "AWS::FSx::FileSystem")}
    site = json.dumps(properties["SiteSettings"])
    for fact in ('\\"runs_root\\":\\"/fsx/runs\\"', '\\"processes_per_node\\":32', '\\"partition\\":\\"compute1\\"'):
        assert fact in site, site


def test_deletion_order_cancels_and_exports_before_cluster_and_file_system_go(default_env: Synthesized) -> None:
    """CloudFormation deletes a resource before everything it depends on: the trigger depends on the cluster
    (head node attribute), the file system (Ref) and the uploaded source, so its Delete runs first."""
    _, resource = pipeline_resource(default_env)
    references = json.dumps(resource)
    assert logical_id(default_env, "Custom::PclusterCluster") in references
    assert logical_id(default_env, "AWS::FSx::FileSystem") in references
    deployments = default_env.resources_of_type("Custom::CDKBucketDeployment")
    assert set(deployments) <= set(resource.get("DependsOn", []))
    ((_, deployment),) = deployments.items()
    assert deployment["Properties"]["DestinationBucketKeyPrefix"] == f"pipeline/source/{source_hash()}/"
    assert deployment["Properties"]["Prune"] is False and deployment["Properties"]["RetainOnDelete"] is True


def handler_statements(env: Synthesized) -> list[dict[str, Any]]:
    roles = {
        name: r
        for name, r in env.resources_of_type("AWS::IAM::Role").items()
        if "Pipeline trigger" in str(r["Properties"].get("Description", ""))
    }
    ((role_name, _),) = roles.items()
    statements = []
    for policy in env.resources_of_type("AWS::IAM::Policy").values():
        if {"Ref": role_name} in policy["Properties"]["Roles"]:
            statements += policy["Properties"]["PolicyDocument"]["Statement"]
    return statements


def test_handler_role_reaches_only_this_head_node_bucket_prefix_and_file_system(default_env: Synthesized) -> None:
    statements = handler_statements(default_env)
    actions = sorted(a for s in statements for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"]))
    assert actions == sorted(
        [
            "ssm:SendCommand",
            "ssm:SendCommand",
            "ssm:GetCommandInvocation",
            "ssm:DescribeInstanceInformation",
            "s3:GetObject",
            "fsx:CreateDataRepositoryTask",
            "fsx:DescribeDataRepositoryTasks",
            "logs:CreateLogStream",  # its two log groups, nothing broader
            "logs:PutLogEvents",
        ]
    )
    for statement in statements:
        if statement["Action"] == ["logs:CreateLogStream", "logs:PutLogEvents"]:
            assert "Logs" in json.dumps(statement["Resource"])
    send = [s for s in statements if s["Action"] == "ssm:SendCommand" and "Condition" in s]
    assert send and send[0]["Condition"] == {
        "StringEquals": {
            "ssm:resourceTag/parallelcluster:cluster-name": "trn1-llama",
            "ssm:resourceTag/parallelcluster:node-type": "HeadNode",
        }
    }
    assert "instance/*" in json.dumps(send[0]["Resource"])
    document = [s for s in statements if s["Action"] == "ssm:SendCommand" and "Condition" not in s]
    assert "document/AWS-RunShellScript" in json.dumps(document[0]["Resource"])
    (s3,) = [s for s in statements if s["Action"] == "s3:GetObject"]
    assert "/pipeline/ssm-output/*" in json.dumps(s3["Resource"])
    (export,) = [s for s in statements if s["Action"] == "fsx:CreateDataRepositoryTask"]
    assert logical_id(default_env, "AWS::FSx::FileSystem") in json.dumps(export["Resource"])
    unscoped = [s["Action"] for s in statements if s["Resource"] == "*"]
    assert unscoped == [["ssm:DescribeInstanceInformation", "ssm:GetCommandInvocation"]]


def test_run_outputs_are_published(default_env: Synthesized) -> None:
    outputs = default_env.template["Outputs"]
    name, _ = pipeline_resource(default_env)
    for output, attribute in (
        ("PipelineRunId", "RunId"),
        ("PipelineRunDirectory", "RunDir"),
        ("PipelineJobIds", "JobIds"),
    ):
        assert outputs[output]["Value"] == {"Fn::GetAtt": [name, attribute]}


def test_shipped_source_is_the_package_templates_and_metadata_only() -> None:
    files = source_files()
    assert {f.parts[0] for f in files} == set(SOURCE_PARTS)
    assert Path("training/train/loop.py") in files and Path("assets/slurm/distributed.sbatch.j2") in files
    assert not any("__pycache__" in str(f) or f.suffix == ".pyc" for f in files)
    assert source_hash() == source_hash() and len(source_hash()) == 64
