"""Tests of the offline ParallelCluster validation harness, with sample configs defined here."""

from __future__ import annotations

import copy
import importlib
import inspect
import os
import pkgutil
import socket
from typing import Any

import boto3
import pytest
from pcluster.aws.aws_api import AWSApi
from pcluster.aws.aws_resources import InstanceTypeInfo
from pcluster.validators.common import Validator, get_async_timed_validator_type_for
from pcluster.validators.s3_validators import UrlValidator

from tests.support.pcluster_offline import (
    INSTANCE_TYPES,
    SCHEMA_VALIDATOR,
    SUPPRESSED_VALIDATORS,
    UnknownInstanceTypeError,
    ValidationFinding,
    errors_of,
    run_offline_validation,
    validate_cluster_config,
)

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)

CLUSTER_NAME = "trn-offline-test"
REGION = "us-east-1"
SUBNET = "subnet-0123456789abcdef0"
OTHER_SUBNET = "subnet-0fedcba9876543210"
SECURITY_GROUP = "sg-0123456789abcdef0"


def valid_config() -> dict[str, Any]:
    """A trn1 training cluster as the cluster YAML would describe it (fresh copy per call)."""
    return {
        "Region": REGION,
        "Image": {"Os": "ubuntu2204"},
        "HeadNode": {
            "InstanceType": "r6a.12xlarge",
            "Networking": {"SubnetId": SUBNET, "SecurityGroups": [SECURITY_GROUP]},
            "LocalStorage": {"RootVolume": {"Size": 1024}},
            "Iam": {"AdditionalIamPolicies": [{"Policy": "arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore"}]},
            "CustomActions": {
                "OnNodeConfigured": {
                    "Script": "s3://example-bucket/assets/on_node_configured.sh",
                    "Args": ["--neuron-release", "2.33.0"],
                }
            },
        },
        "Scheduling": {
            "Scheduler": "slurm",
            "SlurmSettings": {"ScaledownIdletime": 10, "QueueUpdateStrategy": "TERMINATE"},
            "SlurmQueues": [
                {
                    "Name": "compute1",
                    "Networking": {
                        "SubnetIds": [SUBNET],
                        "SecurityGroups": [SECURITY_GROUP],
                        "PlacementGroup": {"Enabled": True},
                    },
                    "ComputeResources": [
                        {
                            "Name": "trn1-32xl",
                            "InstanceType": "trn1.32xlarge",
                            "MinCount": 0,
                            "MaxCount": 4,
                            "Efa": {"Enabled": True},
                        }
                    ],
                }
            ],
        },
        "SharedStorage": [
            {
                "Name": "fsx",
                "StorageType": "FsxLustre",
                "MountDir": "/fsx",
                "FsxLustreSettings": {"FileSystemId": "fs-0123456789abcdef0"},
            }
        ],
        "Monitoring": {"Logs": {"CloudWatch": {"Enabled": True, "RetentionInDays": 14, "DeletionPolicy": "Delete"}}},
        "Tags": [{"Key": "project", "Value": "trainium-training"}, {"Key": "environment", "Value": "test"}],
    }


def queue(config: dict[str, Any]) -> dict[str, Any]:
    return config["Scheduling"]["SlurmQueues"][0]


def compute_resource(config: dict[str, Any]) -> dict[str, Any]:
    return queue(config)["ComputeResources"][0]


def validate(config: dict[str, Any], **kwargs: Any) -> list[ValidationFinding]:
    return validate_cluster_config(config, cluster_name=CLUSTER_NAME, region=REGION, **kwargs)


def assert_error(findings: list[ValidationFinding], validator: str, fragment: str) -> None:
    matching = [f for f in errors_of(findings) if f.validator == validator and fragment in f.message]
    assert matching, f"no ERROR from {validator} containing {fragment!r}; findings: {findings}"


# --- the valid cluster --------------------------------------------------------------------------


def test_valid_config_has_no_error() -> None:
    findings = validate(valid_config())
    assert errors_of(findings) == []


def test_valid_config_runs_the_local_validators_without_unanswered_aws_calls() -> None:
    report = run_offline_validation(valid_config(), cluster_name=CLUSTER_NAME, region=REGION)
    executed = set(report.executed_validators)
    for name in (
        "ClusterNameValidator",
        "RegionValidator",
        "InstanceTypeValidator",
        "EfaValidator",
        "EfaPlacementGroupValidator",
        "EfaMultiAzValidator",
        "ComputeResourceSizeValidator",
        "FsxStorageCapacityValidator",
        "InstanceTypePlacementGroupValidator",
        "MultiNetworkInterfacesInstancesValidator",
        "RootVolumeSizeValidator",
    ):
        assert name in executed
    assert len(report.executed_validators) >= 70
    # The OnNodeConfigured URL check and the SG/IAM look-ups were registered and switched off.
    assert {"AsyncTimedUrlValidator", "SecurityGroupsValidator", "AdditionalIamPolicyValidator"} <= set(
        report.suppressed_validators
    )
    assert not executed & {entry.name for entry in SUPPRESSED_VALIDATORS}
    assert report.unsupported_aws_calls == ()
    assert set(report.aws_calls) <= {
        "ec2:DescribeInstanceTypes",
        "ec2:DescribeInstanceTypeOfferings",
        "ec2:DescribeImages",
        "ec2:DescribeSubnets",
        "fsx:DescribeFileSystems",
    }


# --- configs the real validators reject ---------------------------------------------------------


def test_min_count_above_max_count() -> None:
    config = valid_config()
    compute_resource(config)["MinCount"] = 5
    findings = validate(config)
    assert_error(findings, "ComputeResourceSizeValidator", "Max count must be greater than or equal to min count")


def test_efa_on_trn1_2xlarge() -> None:
    config = valid_config()
    compute_resource(config)["InstanceType"] = "trn1.2xlarge"
    assert_error(validate(config), "EfaValidator", "Instance type 'trn1.2xlarge' does not support EFA")


def test_efa_without_explicit_placement_group() -> None:
    config = valid_config()
    del queue(config)["Networking"]["PlacementGroup"]
    assert_error(validate(config), "EfaPlacementGroupValidator", "must be explicit")


def test_efa_with_placement_group_disabled_is_only_a_warning() -> None:
    config = valid_config()
    queue(config)["Networking"]["PlacementGroup"] = {"Enabled": False}
    findings = validate(config)
    assert errors_of(findings) == []
    assert any(f.level == "WARNING" and f.validator == "EfaPlacementGroupValidator" for f in findings)


def test_managed_fsx_scratch_2_capacity_1000() -> None:
    config = valid_config()
    config["SharedStorage"][0]["FsxLustreSettings"] = {"DeploymentType": "SCRATCH_2", "StorageCapacity": 1000}
    assert_error(validate(config), "FsxStorageCapacityValidator", "1,200 GB or increments of 2,400 GB")


def test_managed_fsx_scratch_2_capacity_1200_is_accepted() -> None:
    config = valid_config()
    config["SharedStorage"][0]["FsxLustreSettings"] = {"DeploymentType": "SCRATCH_2", "StorageCapacity": 1200}
    assert errors_of(validate(config)) == []


def test_two_subnets_with_efa() -> None:
    config = valid_config()
    queue(config)["Networking"]["SubnetIds"] = [SUBNET, OTHER_SUBNET]
    findings = validate(config)
    assert_error(findings, "EfaMultiAzValidator", "EFA is not supported across Availability zones")
    assert_error(findings, "MultiAzPlacementGroupValidator", "PlacementGroups are not supported across Availability")
    assert_error(findings, "SingleInstanceTypeSubnetValidator", "Multiple subnets configuration is not supported")


def test_two_subnets_declared_in_one_az() -> None:
    config = valid_config()
    queue(config)["Networking"]["SubnetIds"] = [SUBNET, OTHER_SUBNET]
    findings = validate(config, subnet_azs={OTHER_SUBNET: f"{REGION}a"})
    assert_error(findings, "QueueSubnetsValidator", "two or more subnets in the same Availability Zone")


def test_ubuntu2004_is_a_schema_error() -> None:
    config = valid_config()
    config["Image"]["Os"] = "ubuntu2004"
    report = run_offline_validation(config, cluster_name=CLUSTER_NAME, region=REGION)
    assert_error(list(report.findings), SCHEMA_VALIDATOR, "Image.Os: Must be one of")
    assert report.executed_validators == ()


def test_multi_network_card_queue_cannot_assign_public_ips() -> None:
    config = valid_config()
    queue(config)["Networking"]["AssignPublicIp"] = True
    assert_error(validate(config), "MultiNetworkInterfacesInstancesValidator", "AssignPublicIp is set to true")


# --- schema rules worth knowing -----------------------------------------------------------------


def test_s3_access_and_additional_iam_policies_may_be_combined() -> None:
    config = valid_config()
    config["HeadNode"]["Iam"]["S3Access"] = [{"BucketName": "example-bucket", "KeyName": "assets/*"}]
    assert errors_of(validate(config)) == []


def test_instance_role_excludes_additional_iam_policies() -> None:
    config = valid_config()
    config["HeadNode"]["Iam"]["InstanceRole"] = "arn:aws:iam::123456789012:role/head-node"
    assert_error(validate(config), SCHEMA_VALIDATOR, "can not be configured together")


def test_file_system_id_excludes_other_fsx_settings() -> None:
    config = valid_config()
    config["SharedStorage"][0]["FsxLustreSettings"]["DeploymentType"] = "PERSISTENT_2"
    assert_error(validate(config), SCHEMA_VALIDATOR, "cannot be specified when an existing Lustre file system is used")


def test_cluster_name_is_validated() -> None:
    findings = validate_cluster_config(valid_config(), cluster_name="1-starts-with-a-digit", region=REGION)
    assert_error(findings, "ClusterNameValidator", "must start with an alphabetic character")


# --- the harness itself -------------------------------------------------------------------------


def test_never_opens_a_network_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    assert errors_of(validate(valid_config())) == []


def test_restores_process_state_and_leaves_config_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    monkeypatch.delenv("AWS_EC2_METADATA_DISABLED", raising=False)
    session_before = boto3.DEFAULT_SESSION
    config = valid_config()
    snapshot = copy.deepcopy(config)
    validate(config)
    assert config == snapshot
    assert os.environ["AWS_DEFAULT_REGION"] == "eu-west-1"
    assert "AWS_EC2_METADATA_DISABLED" not in os.environ
    assert boto3.DEFAULT_SESSION is session_before
    assert AWSApi._instance is None


def test_unknown_instance_type_is_reported_as_a_harness_gap() -> None:
    config = valid_config()
    compute_resource(config)["InstanceType"] = "p5.48xlarge"
    with pytest.raises(UnknownInstanceTypeError, match=r"p5\.48xlarge"):
        validate(config)


def test_region_argument_must_match_config_region() -> None:
    with pytest.raises(ValueError, match="differs"):
        validate_cluster_config(valid_config(), cluster_name=CLUSTER_NAME, region="us-west-2")


def test_suppressed_names_are_real_validator_types() -> None:
    import pcluster.validators as validators_package

    known = {get_async_timed_validator_type_for(UrlValidator).__name__}
    for module_info in pkgutil.iter_modules(validators_package.__path__):
        module = importlib.import_module(f"{validators_package.__name__}.{module_info.name}")
        known.update(name for name, obj in inspect.getmembers(module, inspect.isclass) if issubclass(obj, Validator))
    names = [entry.name for entry in SUPPRESSED_VALIDATORS]
    assert len(names) == len(set(names))
    assert set(names) <= known
    assert all(entry.reason for entry in SUPPRESSED_VALIDATORS)


@pytest.mark.parametrize(
    ("instance_type", "vcpus", "memory_mib", "efa", "network_cards", "neuron_devices"),
    [
        ("trn1.32xlarge", 128, 524288, True, 8, 16),
        ("trn1n.32xlarge", 128, 524288, True, 16, 16),
        ("trn1.2xlarge", 8, 32768, False, 1, 1),
        ("r6a.12xlarge", 48, 393216, False, 1, 0),
        ("c5.xlarge", 4, 8192, False, 1, 0),
    ],
)
def test_instance_type_records_read_through_pcluster(
    instance_type: str, vcpus: int, memory_mib: int, efa: bool, network_cards: int, neuron_devices: int
) -> None:
    record = INSTANCE_TYPES[instance_type]
    info = InstanceTypeInfo(copy.deepcopy(record))
    assert info.instance_type() == instance_type
    assert info.vcpus_count() == vcpus
    assert info.ec2memory_size_in_mib() == memory_mib
    assert info.is_efa_supported() is efa
    assert info.max_network_cards() == network_cards == record["NetworkInfo"]["MaximumNetworkCards"]
    assert info.supported_architecture() == ["x86_64"]
    assert "ondemand" in info.supported_usage_classes()
    assert "cluster" in record["PlacementGroupInfo"]["SupportedStrategies"]
    devices = record.get("NeuronInfo", {}).get("NeuronDevices", [])
    assert sum(device["Count"] for device in devices) == neuron_devices
