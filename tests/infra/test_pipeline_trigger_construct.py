"""CDK assertions on the post-deploy trigger: the custom resource, its properties, what it depends on (so
destroy cancels and exports before the file system goes), the least-privilege role of its handlers, and
exactly which files it ships to the cluster."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from aws_cdk import App, Stack
from aws_cdk import aws_s3_assets as s3_assets

from stacks.application import ENVIRONMENTS_DIR
from stacks.config import load_environment
from stacks.pipeline_trigger import SOURCE_EXCLUDE, SOURCE_PARTS, source_files, source_hash
from tests.support.repository import ROOT
from tests.support.synthesis import Synthesized, synthesize_config

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)


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
    (source,) = (name for name in deployments if name.startswith("PipelineSource"))
    assert source in resource.get("DependsOn", [])
    deployment = deployments[source]
    assert deployment["Properties"]["DestinationBucketKeyPrefix"] == f"pipeline/source/{source_hash()}/"
    assert deployment["Properties"]["Prune"] is False and deployment["Properties"]["RetainOnDelete"] is True


def test_the_requirement_file_is_in_the_bucket_before_the_cluster(default_env: Synthesized) -> None:
    """The head node fetches it from its stable key while bootstrapping."""
    deployments = default_env.resources_of_type("Custom::CDKBucketDeployment")
    (node_files,) = (name for name in deployments if name.startswith("ClusterNodeFiles"))
    assert deployments[node_files]["Properties"]["DestinationBucketKeyPrefix"] == "cluster/"
    cluster = default_env.only("Custom::PclusterCluster")
    assert node_files in cluster["DependsOn"]


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
            "ssm:ListCommands",  # finds the submit command a poll sent once the head node came online
            "sns:Publish",  # a run that cannot start is a notice on the alarm topic
            "kms:Decrypt",
            "kms:GenerateDataKey",
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
    # The command's output bucket is a resource SendCommand authorizes too.
    assert {"Fn::GetAtt": [logical_id(default_env, "AWS::S3::Bucket"), "Arn"]} in document[0]["Resource"]
    (s3,) = [s for s in statements if s["Action"] == "s3:GetObject"]
    assert "/pipeline/ssm-output/*" in json.dumps(s3["Resource"])
    (export,) = [s for s in statements if s["Action"] == "fsx:CreateDataRepositoryTask"]
    assert logical_id(default_env, "AWS::FSx::FileSystem") in json.dumps(export["Resource"])
    unscoped = [s["Action"] for s in statements if s["Resource"] == "*"]
    # The three have no resource-level permissions (Service Authorization Reference; tests/infra/test_iam_reference.py).
    assert unscoped == [
        [
            "fsx:DescribeDataRepositoryTasks",
            "ssm:DescribeInstanceInformation",
            "ssm:GetCommandInvocation",
            "ssm:ListCommands",
        ]
    ]
    (publish,) = [s for s in statements if s["Action"] == "sns:Publish"]
    assert publish["Resource"] == {"Ref": alarm_topic_id(default_env)}


def alarm_topic_id(env: Synthesized) -> str:
    (topic,) = env.resources_of_type("AWS::SNS::Topic")
    return topic


def test_a_first_deploy_that_starts_a_run_cannot_roll_back_the_environment(tmp_path: Path) -> None:
    """With start_run true on a first deploy, the run's resource reports a run that cannot start as its
    RunStatus (a stack output) and a notice on the alarm topic; the handler never fails for it (tested in
    tests/assets/test_pipeline_trigger.py), and the stack wires what that needs."""
    config = load_environment("default", ENVIRONMENTS_DIR)
    config = config.model_copy(update={"pipeline": config.pipeline.model_copy(update={"start_run": True})})
    env = synthesize_config(config, tmp_path)
    name, resource = pipeline_resource(env)
    assert resource["Properties"]["StartRun"] == "true"
    assert resource["Properties"]["NoticeTopicArn"] == {"Ref": alarm_topic_id(env)}
    assert env.template["Outputs"]["PipelineRunStatus"]["Value"] == {"Fn::GetAtt": [name, "RunStatus"]}
    # No resource depends on the run's resource: its outcome cannot hold up or undo the rest.
    dependants = [
        logical
        for logical, other in env.template["Resources"].items()
        if name in json.dumps(other.get("DependsOn", [])) or f'"{name}"' in json.dumps(other.get("Properties", {}))
    ]
    assert dependants == []


def test_run_outputs_are_published(default_env: Synthesized) -> None:
    outputs = default_env.template["Outputs"]
    name, _ = pipeline_resource(default_env)
    for output, attribute in (
        ("PipelineRunId", "RunId"),
        ("PipelineRunDirectory", "RunDir"),
        ("PipelineJobIds", "JobIds"),
        ("PipelineRunStatus", "RunStatus"),
    ):
        assert outputs[output]["Value"] == {"Fn::GetAtt": [name, attribute]}


# --- what is shipped to the cluster ---------------------------------------------------------------


def tracked_files(*paths: str) -> set[Path]:
    """Files git tracks under `paths`, plus new ones it does not ignore (work in progress counts)."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *paths],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {Path(name) for name in listing.split("\0") if name and (ROOT / name).is_file()}


def is_developer_only(path: Path) -> bool:
    return path.parts[:2] == ("training", "local") or path.parts[0] in ("tests", "benchmarks")


def test_shipped_source_is_exactly_the_tracked_package_templates_and_metadata() -> None:
    shipped = source_files()
    assert len(shipped) == len(set(shipped))
    expected = {path for path in tracked_files(*SOURCE_PARTS) if path.parts[:2] != ("training", "local")}
    assert set(shipped) == expected
    assert not [path for path in shipped if is_developer_only(path)]
    assert {path.parts[0] for path in shipped} == set(SOURCE_PARTS)
    for key in ("training/cli/__init__.py", "training/train/loop.py", "training/train/recipes/llama31-8b-cpt.yaml"):
        assert Path(key) in shipped
    assert Path("assets/slurm/distributed.sbatch.j2") in shipped and Path("pyproject.toml") in shipped
    assert source_hash() == source_hash() and len(source_hash()) == 64


def test_upload_is_exactly_the_shipped_files(default_env: Synthesized) -> None:
    """The directory CDK staged for the BucketDeployment holds `source_files()`, byte for byte."""
    deployments = default_env.resources_of_type("Custom::CDKBucketDeployment")
    (deployment,) = (d for name, d in deployments.items() if name.startswith("PipelineSource"))
    (key,) = deployment["Properties"]["SourceObjectKeys"]
    staged = default_env.outdir / f"asset.{key.removesuffix('.zip')}"
    uploaded = sorted(path.relative_to(staged) for path in staged.rglob("*") if path.is_file())
    assert uploaded == sorted(source_files())
    assert all((staged / path).read_bytes() == (ROOT / path).read_bytes() for path in uploaded)


def test_node_files_upload_is_the_bootstrap_the_lock_and_the_node_settings(default_env: Synthesized) -> None:
    deployments = default_env.resources_of_type("Custom::CDKBucketDeployment")
    (deployment,) = (d for name, d in deployments.items() if name.startswith("ClusterNodeFiles"))
    files, bake, settings = deployment["Properties"]["SourceObjectKeys"]
    staged_bake = default_env.outdir / f"asset.{bake.removesuffix('.zip')}"
    assert [p.name for p in staged_bake.iterdir()] == ["bake_neuron_image.sh"]
    staged = default_env.outdir / f"asset.{files.removesuffix('.zip')}"
    assert sorted(p.name for p in staged.iterdir()) == ["cluster-requirements.txt", "on_node_configured.sh"]
    for name in ("cluster-requirements.txt", "on_node_configured.sh"):
        assert (staged / name).read_bytes() == (ROOT / "assets/node" / name).read_bytes()
    staged_settings = default_env.outdir / f"asset.{settings.removesuffix('.zip')}"
    assert [p.name for p in staged_settings.iterdir()] == ["node-settings.json"]


def test_exclude_patterns_select_the_same_files_for_cdk_and_the_source_hash(tmp_path: Path) -> None:
    """On a tree with every kind of file that must not ship, CDK's staging and `source_files` agree."""
    tree = tmp_path / "tree"
    shipped = ["assets/slurm/single.sbatch.j2", "pyproject.toml", "training/cli/__init__.py", "training/train/x.yaml"]
    kept_back = [
        ".gitignore",
        ".venv/.installed",
        ".venv/lib/site.py",
        "README.md",
        "benchmarks/bench.py",
        "tests/training/test_x.py",
        "training/local/slurm.py",
        "training/local/__init__.py",
        "training/__pycache__/cli.cpython-311.pyc",
        "training/.mypy_cache/cache.json",
        "training/train/stale.pyc",
        "training.egg-info/PKG-INFO",
    ]
    for name in shipped + kept_back:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(name)
    assert source_files(tree) == [Path(name) for name in shipped]

    app = App(outdir=str(tmp_path / "out"))
    asset = s3_assets.Asset(Stack(app, "S"), "Source", path=str(tree), exclude=list(SOURCE_EXCLUDE))
    app.synth()
    staged = tmp_path / "out" / f"asset.{asset.asset_hash}"
    assert sorted(path.relative_to(staged) for path in staged.rglob("*") if path.is_file()) == source_files(tree)
