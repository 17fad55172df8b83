"""The pipeline trigger's resource properties as CloudFormation passes them, for the tests of its handler and of
its scripts (assets/lambda/pipeline_trigger/)."""

from __future__ import annotations

import json
from typing import Any

HEAD_NODE = "i-0123456789abcdef0"
FILE_SYSTEM = "fs-0123456789abcdef0"
OUTPUT_BUCKET = "pipeline-command-output"
SITE = {
    "name": "default",
    "runs_root": "/fsx/runs",
    "results": "s3://results-bucket/results",
    "python": "/fsx/envs/neuron-2.28.1/bin/python",
    "setup": [],
    "slurm_bin": "/opt/slurm/bin",
    "partition": "compute1",
    "processes_per_node": 32,
    "exclusive": True,
    "neuron": True,
    "efa": True,
    "compile_cache": "/fsx/neuron-cache",
    "max_restarts": 3,
    "time_minutes": 0,
}


def properties(**changes: Any) -> dict[str, Any]:
    """ResourceProperties as CloudFormation passes them (strings and lists of strings)."""
    base: dict[str, Any] = {
        "ServiceToken": "arn:aws:lambda:us-west-2:123456789012:function:provider-framework-onEvent",
        "HeadNodeInstanceId": HEAD_NODE,
        "ClusterName": "trn1-llama",
        "StartRun": "true",
        "Recipe": "llama31-8b-cpt",
        "RecipeOverrides": ["steps=100", "batch.micro=1"],
        "SourceBucket": "cdk-hnb659fds-assets-123456789012-us-west-2",
        "SourceKey": "0a1b2c3d.zip",
        "SourceHash": "0a1b2c3d",
        "Run": "1",
        "SiteSettings": json.dumps(SITE),
        "SharedEnvironmentPath": "/fsx/envs/neuron-2.28.1",
        "NeuronRelease": "2.28.1",
        "FileSystemId": FILE_SYSTEM,
        "FileSystemMountDir": "/fsx",
        "OutputBucket": OUTPUT_BUCKET,
        "OutputPrefix": "pipeline/ssm",
        "TimeoutSeconds": "1800",
        "EnvironmentName": "default",
    }
    return base | changes
