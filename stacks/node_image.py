"""`python -m stacks.node_image --env NAME ...` (`make image-config`): a baked image for the Trainium queue.

Without one, every Trainium node installs the Neuron driver (a DKMS build), runtime, collectives and tools from
apt at every boot: minutes of billed fleet time per scale-up, and an apt outage fails bootstraps until
ParallelCluster's protected mode disables the queue. This prints a `pcluster build-image` configuration that
starts from ParallelCluster's official image and runs the deployed bootstrap script with `--bake` (the same
pins, one place), so nodes booted from the result skip apt. Put the image id in `compute.custom_ami`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import yaml

from stacks.cluster import BAKE_SCRIPT_FILE, NODE_FILES_PREFIX
from stacks.config import EnvironmentConfig, load_environment
from training.errors import UserError, report

PARENT_IMAGE_HELP = "ParallelCluster's official image of the environment's OS (pcluster list-official-images)"


def build_image_configuration(
    config: EnvironmentConfig, *, bucket: str, parent_image: str, node_policy_arn: str, subnet_id: str | None = None
) -> dict[str, Any]:
    """The build-image configuration: the bake script the deploy ships, on a small instance of the environment's
    head node type, with the compute nodes' policy (it reads the bootstrap and the recorded Neuron key)."""
    software = config.compute.node_software
    release = software.release().replace(".", "-")
    build: dict[str, Any] = {
        "InstanceType": config.head_node.instance_type,
        "ParentImage": parent_image,
        "Components": [{"Type": "script", "Value": f"s3://{bucket}/{NODE_FILES_PREFIX}{BAKE_SCRIPT_FILE}"}],
        "Iam": {"AdditionalIamPolicies": [{"Policy": node_policy_arn}]},
        "UpdateOsPackages": {"Enabled": False},  # the kernel the driver is built for stays the parent's
    }
    if subnet_id:
        build["SubnetId"] = subnet_id
    return {
        "Region": config.region,
        "Image": {
            "Name": f"{config.cluster_name}-{software.env_prefix}-{release}",
            "RootVolume": {"Size": config.compute.root_volume_gib, "Encrypted": True},
            "Tags": [{"Key": key, "Value": value} for key, value in sorted(config.tags.items())],
        },
        "Build": build,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stacks.node_image", description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="default", help="environment name (environments/NAME.yaml)")
    parser.add_argument("--bucket", required=True, help="the stack's ResultsBucketName output")
    parser.add_argument("--node-policy-arn", required=True, help="the stack's ComputeNodePolicyArn output")
    parser.add_argument("--parent-image", required=True, help=PARENT_IMAGE_HELP)
    parser.add_argument("--subnet-id", help="a subnet with internet access for the build (default: the VPC's)")
    arguments = parser.parse_args(argv)
    try:
        config = load_environment(arguments.env)
    except UserError as error:
        report(error)
        return 2
    configuration = build_image_configuration(
        config,
        bucket=arguments.bucket,
        parent_image=arguments.parent_image,
        node_policy_arn=arguments.node_policy_arn,
        subnet_id=arguments.subnet_id,
    )
    print(yaml.safe_dump(configuration, sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
