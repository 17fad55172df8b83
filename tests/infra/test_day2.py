"""Day-2 safety: a deploy of new code or node files must never touch the cluster's configuration.

ParallelCluster cannot update the head node's `OnNodeConfigured` (update policy UNSUPPORTED), and a change of a
queue's replaces its running nodes, so a cluster configuration that changed with a file would fail the next
`cdk deploy` at UPDATE, or kill jobs. Here the project is copied, every shipped file a node executes or reads is
edited (the training code, a job template, the locked requirement set, the bootstrap script, and the node
settings through the environment file), and the copy is synthesized for real: the cluster custom resource's
properties must be identical, while the pipeline and the node files deployment carry the edits.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.support.repository import ROOT
from tests.support.synthesis import CLI_CONTEXT, Synthesized

PROJECT_PARTS = ("app.py", "cdk.json", "pyproject.toml", "stacks", "training", "assets", "environments")
SYNTH = """
import json, sys
from pathlib import Path
from aws_cdk import App
from stacks.application import build_app
from stacks.config import load_environment

context = {**json.loads(Path("cdk.json").read_text())["context"], **json.loads(sys.argv[2]), "env": "default"}
app = App(outdir=sys.argv[1], context=context)
stack = build_app(app, load_environment("default"))
app.synth()
print(stack.stack_name)
"""


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path}: {old!r} not found"
    path.write_text(text.replace(old, new, 1))


def synthesize_copy(project: Path, outdir: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", SYNTH, str(outdir), json.dumps(CLI_CONTEXT)],
        cwd=project,
        env={"PATH": "/usr/bin:/bin", "HOME": str(project), "PYTHONPATH": str(project)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    stack_name = done.stdout.split()[-1]
    return dict(json.loads((outdir / f"{stack_name}.template.json").read_text()))


def only(template: dict[str, Any], resource_type: str) -> dict[str, Any]:
    (resource,) = (r for r in template["Resources"].values() if r["Type"] == resource_type)
    return resource


BUCKET = "results-bucket"


def deploy_time_value(value: Any, template: dict[str, Any]) -> str:
    """A marker's value as the deployment handler receives it, the results bucket's name being BUCKET."""
    if isinstance(value, str):
        return value
    if set(value) == {"Ref"} and template["Resources"][value["Ref"]]["Type"] == "AWS::S3::Bucket":
        return BUCKET
    separator, parts = value["Fn::Join"]
    return str(separator).join(deploy_time_value(part, template) for part in parts)


def uploaded_files(outdir: Path, template: dict[str, Any], deployment: dict[str, Any]) -> dict[str, bytes]:
    """What a BucketDeployment uploads: the files of its staged source assets in the cloud assembly, with the
    deploy-time values (the markers CDK leaves in them) filled in as its handler fills them."""
    properties = deployment["Properties"]
    files: dict[str, bytes] = {}
    for key, markers in zip(properties["SourceObjectKeys"], properties["SourceMarkers"], strict=True):
        staged = outdir / f"asset.{key.removesuffix('.zip')}"
        for path in (p for p in staged.rglob("*") if p.is_file()):
            content = path.read_bytes()
            for marker, value in markers.items():
                content = content.replace(marker.encode(), deploy_time_value(value, template).encode())
            files[path.name] = content
    return files


def node_files_deployment(template: dict[str, Any]) -> dict[str, Any]:
    (deployment,) = (
        d
        for name, d in template["Resources"].items()
        if d["Type"] == "Custom::CDKBucketDeployment" and name.startswith("ClusterNodeFiles")
    )
    return deployment


def test_an_edit_of_any_file_a_node_runs_or_reads_leaves_the_cluster_configuration_unchanged(
    default_env: Synthesized, tmp_path: Path
) -> None:
    project = tmp_path / "project"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".mypy_cache")
    for part in PROJECT_PARTS:
        source = ROOT / part
        if source.is_dir():
            shutil.copytree(source, project / part, ignore=ignore)
        else:
            project.mkdir(exist_ok=True)
            shutil.copy2(source, project / part)
    edit(project / "training/train/loop.py", '"""', '"""A change to the training loop.\n\n')
    edit(project / "assets/slurm/base.sbatch.j2", "set -euo pipefail\n", "set -euo pipefail\nulimit -n 65536\n")
    edit(project / "assets/node/cluster-requirements.txt", "transformers==4.57.6", "transformers==4.57.5")
    script = project / "assets/node/on_node_configured.sh"
    edit(script, "set -euo pipefail\n", "set -euo pipefail\n# A comment added on day 2.\n")
    edit(script, 'NEURON_TOOLS_VERSION="2.28.23.0"', 'NEURON_TOOLS_VERSION="2.28.24.0"')
    fingerprint = "0123456789ABCDEF0123456789ABCDEF01234567"
    environment = project / "environments/default.yaml"
    settings = yaml.safe_load(environment.read_text())
    settings.setdefault("neuron", {})["apt_key_fingerprint"] = fingerprint
    environment.write_text(yaml.safe_dump(settings))

    outdir = tmp_path / "cdk.out"
    changed = synthesize_copy(project, outdir)

    cluster = only(changed, "Custom::PclusterCluster")
    assert cluster["Properties"] == default_env.only("Custom::PclusterCluster")["Properties"]
    # The edits were seen: the pipeline ships the new source, the node files hold the new script, lock and
    # settings, at the same keys.
    old_pipeline = default_env.only("Custom::TrainingPipeline")["Properties"]
    new_pipeline = only(changed, "Custom::TrainingPipeline")["Properties"]
    assert new_pipeline["SourceHash"] != old_pipeline["SourceHash"]
    assert new_pipeline["Run"] == old_pipeline["Run"] == "1"  # and so no new run: the run id stays the same
    old_files, new_files = node_files_deployment(default_env.template), node_files_deployment(changed)
    assert old_files["Properties"]["SourceObjectKeys"] != new_files["Properties"]["SourceObjectKeys"]
    assert new_files["Properties"]["DestinationBucketKeyPrefix"] == "cluster/"
    uploaded = uploaded_files(outdir, changed, new_files)
    assert sorted(uploaded) == [
        "bake_neuron_image.sh",
        "cluster-requirements.txt",
        "node-settings.json",
        "on_node_configured.sh",
    ]
    assert uploaded["on_node_configured.sh"] == script.read_bytes()
    assert b"transformers==4.57.5" in uploaded["cluster-requirements.txt"]
    assert json.loads(uploaded["node-settings.json"]) == {
        "neuron_apt_key_fingerprint": fingerprint,
        "neuron_apt_key_record": f"s3://{BUCKET}/trust/neuron-apt-key.fingerprint",
    }
    before = uploaded_files(default_env.outdir, default_env.template, old_files)["node-settings.json"]
    assert json.loads(before) == {"neuron_apt_key_record": f"s3://{BUCKET}/trust/neuron-apt-key.fingerprint"}


def test_only_the_node_files_deployment_writes_the_keys_nodes_run(default_env: Synthesized) -> None:
    """Fixed keys are safe only if nobody else can write them: every key the cluster configuration names is under
    `cluster/`, which the bucket policy lets no principal but the node files deployment's role write, and the
    cluster waits for that deployment."""
    resources = default_env.template["Resources"]
    (bucket,) = default_env.resources_of_type("AWS::S3::Bucket")
    configuration = default_env.only("Custom::PclusterCluster")["Properties"]["ClusterConfiguration"]
    actions = [configuration["HeadNode"]["CustomActions"]["OnNodeConfigured"]] + [
        queue["CustomActions"]["OnNodeConfigured"] for queue in configuration["Scheduling"]["SlurmQueues"]
    ]
    named = [value for action in actions for value in (action["Script"], *action["Args"]) if isinstance(value, dict)]
    assert named and all(
        value["Fn::Join"][1][:2] == ["s3://", {"Ref": bucket}] and value["Fn::Join"][1][2].startswith("/cluster/")
        for value in named
    ), named

    (policy,) = default_env.resources_of_type("AWS::S3::BucketPolicy").values()
    (deny,) = (
        s
        for s in policy["Properties"]["PolicyDocument"]["Statement"]
        if s.get("Sid") == "OnlyTheDeploymentWritesNodeCode"
    )
    assert {"Fn::Join": ["", [{"Fn::GetAtt": [bucket, "Arn"]}, "/cluster/*"]]} in deny["Resource"]
    deployment_name, deployment = next(
        (name, d)
        for name, d in resources.items()
        if d["Type"] == "Custom::CDKBucketDeployment" and name.startswith("ClusterNodeFiles")
    )
    (handler,) = deployment["Properties"]["ServiceToken"]["Fn::GetAtt"][:1]
    assert deny["Condition"] == {"ArnNotEquals": {"aws:PrincipalArn": resources[handler]["Properties"]["Role"]}}
    assert deployment_name in default_env.only("Custom::PclusterCluster")["DependsOn"]
