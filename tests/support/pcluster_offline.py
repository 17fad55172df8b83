"""Validate an AWS ParallelCluster 3.16.1 cluster configuration offline with the real `pcluster` package.

The two stages of `pcluster create-cluster` run, unmodified:

1. the marshmallow schema, ``ClusterSchema(cluster_name=...).load(config)``;
2. the semantic validators, ``cluster_config.validate(suppressors, ValidatorContext())``.

Nothing in pcluster is patched. The AWS boundary is replaced instead:

* every boto3 client that pcluster creates comes from a private boto3 session whose ``before-call``
  hook answers the request in-process (botocore never signs or sends anything, the session holds dummy
  credentials so no credential provider or IMDS look-up happens, and an operation the fake does not
  know gets an ``OfflineHarness.UnsupportedOperation`` error instead of a network call);
* the fake answers DescribeInstanceTypes and DescribeInstanceTypeOfferings from ``INSTANCE_TYPES``,
  DescribeImages from a catalogue of official ParallelCluster AMI records of the installed version
  (40 GiB root snapshot; a custom AMI id gets a placeholder record), DescribeSubnets with
  private subnets of one VPC (availability zones as described in ``run_offline_validation``) and FSx
  DescribeFileSystems with a Lustre file system for any ``FileSystemId``;
* the list of supported regions, which pcluster downloads over HTTPS from S3, is served from the copy
  bundled in the package (pcluster's own fallback);
* DescribeSecurityGroups, when the caller passes the groups (``security_groups=``, built from the same
  template), which runs the security-group validators for real; DescribeCapacityReservations, when the
  caller passes the reservations (``capacity_reservations=``, as the account holds them), which runs the
  capacity reservation validators for real; DescribeFileSystems and DescribeNetworkInterfaces, when the
  caller passes the file systems and their network interfaces (``file_systems=``, from the template), which
  with the security groups runs the FSx networking validator (Lustre ports both ways) for real;
* validators whose verdict depends on real account resources (security groups unless given, IAM, S3 objects, key
  pairs, existing FSx networking, launch-template dry runs, ...) are switched off with pcluster's
  ``TypeMatchValidatorsSuppressor``; they are listed, with the reason, in ``SUPPRESSED_VALIDATORS``.

Schema errors do NOT raise: they come back as ``ERROR`` findings of the validator
``ConfigSchemaValidator`` (the name the pcluster CLI uses), one finding per schema message with the
path of the offending key, and the semantic stage is skipped because no config object exists. Call
``errors_of(findings)`` or filter on ``level == "ERROR"`` to fail a test.

Exceptions that are not findings: ``UnknownInstanceTypeError`` when the config uses an instance type
missing from ``INSTANCE_TYPES`` (add it), ``ValueError`` when the config's ``Region`` differs from the
``region`` argument, and any error pcluster raises while it registers validators (for example a
capacity reservation, which the fake does not model).

The function sets ``AWS_DEFAULT_REGION`` and ``AWS_EC2_METADATA_DISABLED=true`` while it runs and
restores the environment, ``boto3.DEFAULT_SESSION`` and pcluster's caches afterwards. It is not
thread-safe (pcluster keeps process-wide singletons).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import fnmatch
import hashlib
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from importlib.resources import files
from typing import Any, NamedTuple

import boto3
from botocore.awsrequest import AWSResponse
from marshmallow import ValidationError
from marshmallow.warnings import RemovedInMarshmallow4Warning

with warnings.catch_warnings():
    # pcluster 3.16.1 still passes `default=` to marshmallow 3 fields; silence only that deprecation.
    warnings.simplefilter("ignore", RemovedInMarshmallow4Warning)
    from pcluster.aws.aws_api import AWSApi
    from pcluster.aws.common import Cache
    from pcluster.config.common import TypeMatchValidatorsSuppressor, ValidatorSuppressor
    from pcluster.constants import OS_TO_IMAGE_NAME_PART_MAP, PRIVATE_OSES
    from pcluster.schemas.cluster_schema import ClusterSchema
    from pcluster.utils import get_installed_version, retrieve_supported_regions
    from pcluster.validators.common import ValidatorContext

__all__ = [
    "INSTANCE_TYPES",
    "SCHEMA_VALIDATOR",
    "SUPPRESSED_VALIDATORS",
    "VPC_ID",
    "FileSystems",
    "OfflineValidationReport",
    "SuppressedValidator",
    "UnknownInstanceTypeError",
    "ValidationFinding",
    "errors_of",
    "run_offline_validation",
    "validate_cluster_config",
]

# Name given to schema findings; the pcluster CLI reports schema failures under the same name.
SCHEMA_VALIDATOR = "ConfigSchemaValidator"


# --------------------------------------------------------------------------------------------------
# Instance-type catalogue
# --------------------------------------------------------------------------------------------------


def _network_cards(count: int, performance: str, max_interfaces: int, baseline: float, peak: float) -> list[dict]:
    """`NetworkInfo.NetworkCards` of a shape whose cards are all identical."""
    return [
        {
            "NetworkCardIndex": index,
            "NetworkPerformance": performance,
            "MaximumNetworkInterfaces": max_interfaces,
            "BaselineBandwidthInGbps": baseline,
            "PeakBandwidthInGbps": peak,
        }
        for index in range(count)
    ]


def _neuron_info(devices: int, *, name: str = "Trainium", cores: int = 2, version: int = 2, mib: int = 32768) -> dict:
    """`NeuronInfo` of a Trainium shape: trn1's 2 NeuronCore-v2 and 32 GiB per device unless told otherwise."""
    return {
        "NeuronDevices": [
            {
                "Count": devices,
                "Name": name,
                "CoreInfo": {"Count": cores, "Version": version},
                "MemoryInfo": {"SizeInMiB": mib},
            }
        ],
        "TotalNeuronDeviceMemoryInMiB": mib * devices,
    }


def _amd_general_record(
    name: str,
    *,
    vcpus: int,
    memory_gib: int,
    performance: str,
    interfaces: int,
    ips_per_interface: int,
    network_gbit: tuple[float, float],
    ebs_mbps: tuple[int, int],
    ebs_iops: tuple[int, int],
) -> dict[str, Any]:
    """A DescribeInstanceTypes record of a 6th-generation AMD (m6a/r6a) shape: no EFA, no instance store."""
    baseline, peak = ebs_mbps
    return {
        "InstanceType": name,
        "CurrentGeneration": True,
        "FreeTierEligible": False,
        "SupportedUsageClasses": ["on-demand", "spot"],
        "SupportedRootDeviceTypes": ["ebs"],
        "SupportedVirtualizationTypes": ["hvm"],
        "BareMetal": False,
        "Hypervisor": "nitro",
        "ProcessorInfo": {"SupportedArchitectures": ["x86_64"], "SustainedClockSpeedInGhz": 3.6, "Manufacturer": "AMD"},
        "VCpuInfo": {
            "DefaultVCpus": vcpus,
            "DefaultCores": vcpus // 2,
            "DefaultThreadsPerCore": 2,
            "ValidThreadsPerCore": [1, 2],
        },
        "MemoryInfo": {"SizeInMiB": memory_gib * 1024},
        "InstanceStorageSupported": False,
        "EbsInfo": {
            "EbsOptimizedSupport": "default",
            "EncryptionSupport": "supported",
            "EbsOptimizedInfo": {
                "BaselineBandwidthInMbps": baseline,
                "BaselineThroughputInMBps": baseline / 8,
                "BaselineIops": ebs_iops[0],
                "MaximumBandwidthInMbps": peak,
                "MaximumThroughputInMBps": peak / 8,
                "MaximumIops": ebs_iops[1],
            },
            "NvmeSupport": "required",
        },
        "NetworkInfo": {
            "NetworkPerformance": performance,
            "MaximumNetworkInterfaces": interfaces,
            "MaximumNetworkCards": 1,
            "DefaultNetworkCardIndex": 0,
            "NetworkCards": _network_cards(1, performance, interfaces, *network_gbit),
            "Ipv4AddressesPerInterface": ips_per_interface,
            "Ipv6AddressesPerInterface": ips_per_interface,
            "Ipv6Supported": True,
            "EnaSupport": "required",
            "EfaSupported": False,
            "EncryptionInTransitSupported": True,
            "EnaSrdSupported": False,
        },
        "PlacementGroupInfo": {"SupportedStrategies": ["cluster", "partition", "spread"]},
    }


# DescribeInstanceTypes records (the API's own field names and layout), one per instance type the
# offline EC2 knows. Values follow the EC2 instance-type specifications (vCPU/cores, memory, network
# cards and ENIs, EFA, Neuron devices, instance store, EBS, placement strategies, usage classes),
# transcribed by hand because this project has no AWS credentials at test time.
# Fields pcluster reads: InstanceType, ProcessorInfo.SupportedArchitectures, VCpuInfo, MemoryInfo,
# NetworkInfo (NetworkCards, MaximumNetworkCards, EfaSupported, EfaInfo), InstanceStorageSupported,
# EbsInfo.EbsOptimizedSupport, SupportedUsageClasses, PlacementGroupInfo, GpuInfo/NeuronInfo.
# To support another shape, add its record here (e.g. from `aws ec2 describe-instance-types
# --instance-types TYPE --query 'InstanceTypes[0]'`); every type also becomes "offered" in the region.
INSTANCE_TYPES: dict[str, dict[str, Any]] = {
    "trn1.32xlarge": {
        "InstanceType": "trn1.32xlarge",
        "CurrentGeneration": True,
        "FreeTierEligible": False,
        "SupportedUsageClasses": ["on-demand", "spot", "capacity-block"],
        "SupportedRootDeviceTypes": ["ebs"],
        "SupportedVirtualizationTypes": ["hvm"],
        "BareMetal": False,
        "Hypervisor": "nitro",
        "ProcessorInfo": {
            "SupportedArchitectures": ["x86_64"],
            "SustainedClockSpeedInGhz": 3.5,
            "Manufacturer": "Intel",
        },
        "VCpuInfo": {
            "DefaultVCpus": 128,
            "DefaultCores": 64,
            "DefaultThreadsPerCore": 2,
            "ValidThreadsPerCore": [1, 2],
        },
        "MemoryInfo": {"SizeInMiB": 524288},
        "InstanceStorageSupported": True,
        "InstanceStorageInfo": {
            "TotalSizeInGB": 7600,
            "Disks": [{"SizeInGB": 1900, "Count": 4, "Type": "ssd"}],
            "NvmeSupport": "required",
            "EncryptionSupport": "required",
        },
        "EbsInfo": {
            "EbsOptimizedSupport": "default",
            "EncryptionSupport": "supported",
            "EbsOptimizedInfo": {
                "BaselineBandwidthInMbps": 80000,
                "BaselineThroughputInMBps": 10000.0,
                "BaselineIops": 260000,
                "MaximumBandwidthInMbps": 80000,
                "MaximumThroughputInMBps": 10000.0,
                "MaximumIops": 260000,
            },
            "NvmeSupport": "required",
        },
        "NetworkInfo": {
            "NetworkPerformance": "800 Gigabit",
            "MaximumNetworkInterfaces": 40,
            "MaximumNetworkCards": 8,
            "DefaultNetworkCardIndex": 0,
            "NetworkCards": _network_cards(8, "100 Gigabit", 5, 100.0, 100.0),
            "Ipv4AddressesPerInterface": 50,
            "Ipv6AddressesPerInterface": 50,
            "Ipv6Supported": True,
            "EnaSupport": "required",
            "EfaSupported": True,
            "EfaInfo": {"MaximumEfaInterfaces": 8},
            "EncryptionInTransitSupported": True,
            "EnaSrdSupported": True,
        },
        "PlacementGroupInfo": {"SupportedStrategies": ["cluster", "partition", "spread"]},
        "NeuronInfo": _neuron_info(16),
    },
    "trn1n.32xlarge": {
        "InstanceType": "trn1n.32xlarge",
        "CurrentGeneration": True,
        "FreeTierEligible": False,
        "SupportedUsageClasses": ["on-demand", "spot"],
        "SupportedRootDeviceTypes": ["ebs"],
        "SupportedVirtualizationTypes": ["hvm"],
        "BareMetal": False,
        "Hypervisor": "nitro",
        "ProcessorInfo": {
            "SupportedArchitectures": ["x86_64"],
            "SustainedClockSpeedInGhz": 3.5,
            "Manufacturer": "Intel",
        },
        "VCpuInfo": {
            "DefaultVCpus": 128,
            "DefaultCores": 64,
            "DefaultThreadsPerCore": 2,
            "ValidThreadsPerCore": [1, 2],
        },
        "MemoryInfo": {"SizeInMiB": 524288},
        "InstanceStorageSupported": True,
        "InstanceStorageInfo": {
            "TotalSizeInGB": 7600,
            "Disks": [{"SizeInGB": 1900, "Count": 4, "Type": "ssd"}],
            "NvmeSupport": "required",
            "EncryptionSupport": "required",
        },
        "EbsInfo": {
            "EbsOptimizedSupport": "default",
            "EncryptionSupport": "supported",
            "EbsOptimizedInfo": {
                "BaselineBandwidthInMbps": 80000,
                "BaselineThroughputInMBps": 10000.0,
                "BaselineIops": 260000,
                "MaximumBandwidthInMbps": 80000,
                "MaximumThroughputInMBps": 10000.0,
                "MaximumIops": 260000,
            },
            "NvmeSupport": "required",
        },
        "NetworkInfo": {
            "NetworkPerformance": "1600 Gigabit",
            "MaximumNetworkInterfaces": 80,
            "MaximumNetworkCards": 16,
            "DefaultNetworkCardIndex": 0,
            "NetworkCards": _network_cards(16, "100 Gigabit", 5, 100.0, 100.0),
            "Ipv4AddressesPerInterface": 50,
            "Ipv6AddressesPerInterface": 50,
            "Ipv6Supported": True,
            "EnaSupport": "required",
            "EfaSupported": True,
            "EfaInfo": {"MaximumEfaInterfaces": 16},
            "EncryptionInTransitSupported": True,
            "EnaSrdSupported": True,
        },
        "PlacementGroupInfo": {"SupportedStrategies": ["cluster", "partition", "spread"]},
        "NeuronInfo": _neuron_info(16),
    },
    "trn1.2xlarge": {
        "InstanceType": "trn1.2xlarge",
        "CurrentGeneration": True,
        "FreeTierEligible": False,
        "SupportedUsageClasses": ["on-demand", "spot"],
        "SupportedRootDeviceTypes": ["ebs"],
        "SupportedVirtualizationTypes": ["hvm"],
        "BareMetal": False,
        "Hypervisor": "nitro",
        "ProcessorInfo": {
            "SupportedArchitectures": ["x86_64"],
            "SustainedClockSpeedInGhz": 3.5,
            "Manufacturer": "Intel",
        },
        "VCpuInfo": {"DefaultVCpus": 8, "DefaultCores": 4, "DefaultThreadsPerCore": 2, "ValidThreadsPerCore": [1, 2]},
        "MemoryInfo": {"SizeInMiB": 32768},
        "InstanceStorageSupported": True,
        "InstanceStorageInfo": {
            "TotalSizeInGB": 474,
            "Disks": [{"SizeInGB": 474, "Count": 1, "Type": "ssd"}],
            "NvmeSupport": "required",
            "EncryptionSupport": "required",
        },
        "EbsInfo": {
            "EbsOptimizedSupport": "default",
            "EncryptionSupport": "supported",
            "EbsOptimizedInfo": {
                "BaselineBandwidthInMbps": 5000,
                "BaselineThroughputInMBps": 625.0,
                "BaselineIops": 16250,
                "MaximumBandwidthInMbps": 20000,
                "MaximumThroughputInMBps": 2500.0,
                "MaximumIops": 65000,
            },
            "NvmeSupport": "required",
        },
        "NetworkInfo": {
            "NetworkPerformance": "Up to 12.5 Gigabit",
            "MaximumNetworkInterfaces": 4,
            "MaximumNetworkCards": 1,
            "DefaultNetworkCardIndex": 0,
            "NetworkCards": _network_cards(1, "Up to 12.5 Gigabit", 4, 3.125, 12.5),
            "Ipv4AddressesPerInterface": 15,
            "Ipv6AddressesPerInterface": 15,
            "Ipv6Supported": True,
            "EnaSupport": "required",
            "EfaSupported": False,
            "EncryptionInTransitSupported": True,
            "EnaSrdSupported": False,
        },
        "PlacementGroupInfo": {"SupportedStrategies": ["cluster", "partition", "spread"]},
        "NeuronInfo": _neuron_info(1),
    },
    "r6a.12xlarge": _amd_general_record(
        "r6a.12xlarge",
        vcpus=48,
        memory_gib=384,
        performance="18.75 Gigabit",
        interfaces=8,
        ips_per_interface=30,
        network_gbit=(18.75, 18.75),
        ebs_mbps=(15000, 15000),
        ebs_iops=(60000, 60000),
    ),
    # Head node of environments/smoke.yaml (m6a.xlarge: 2 cores x 2 threads, 16 GiB, up to 12.5 Gbit).
    "m6a.xlarge": _amd_general_record(
        "m6a.xlarge",
        vcpus=4,
        memory_gib=16,
        performance="Up to 12.5 Gigabit",
        interfaces=4,
        ips_per_interface=15,
        network_gbit=(1.562, 12.5),
        ebs_mbps=(1250, 10000),
        ebs_iops=(6000, 40000),
    ),
    # The default head node (m6a.2xlarge) and CPU queues (r6a.2xlarge, r6a.8xlarge), from the EC2 instance-type pages.
    "m6a.2xlarge": _amd_general_record(
        "m6a.2xlarge",
        vcpus=8,
        memory_gib=32,
        performance="Up to 12.5 Gigabit",
        interfaces=4,
        ips_per_interface=15,
        network_gbit=(3.125, 12.5),
        ebs_mbps=(2500, 10000),
        ebs_iops=(12000, 40000),
    ),
    "r6a.2xlarge": _amd_general_record(
        "r6a.2xlarge",
        vcpus=8,
        memory_gib=64,
        performance="Up to 12.5 Gigabit",
        interfaces=4,
        ips_per_interface=15,
        network_gbit=(3.125, 12.5),
        ebs_mbps=(2500, 10000),
        ebs_iops=(12000, 40000),
    ),
    "r6a.8xlarge": _amd_general_record(
        "r6a.8xlarge",
        vcpus=32,
        memory_gib=256,
        performance="12.5 Gigabit",
        interfaces=8,
        ips_per_interface=30,
        network_gbit=(12.5, 12.5),
        ebs_mbps=(10000, 10000),
        ebs_iops=(40000, 40000),
    ),
    "c5.xlarge": {
        "InstanceType": "c5.xlarge",
        "CurrentGeneration": True,
        "FreeTierEligible": False,
        "SupportedUsageClasses": ["on-demand", "spot"],
        "SupportedRootDeviceTypes": ["ebs"],
        "SupportedVirtualizationTypes": ["hvm"],
        "BareMetal": False,
        "Hypervisor": "nitro",
        "ProcessorInfo": {
            "SupportedArchitectures": ["x86_64"],
            "SustainedClockSpeedInGhz": 3.4,
            "Manufacturer": "Intel",
        },
        "VCpuInfo": {
            "DefaultVCpus": 4,
            "DefaultCores": 2,
            "DefaultThreadsPerCore": 2,
            "ValidCores": [2],
            "ValidThreadsPerCore": [1, 2],
        },
        "MemoryInfo": {"SizeInMiB": 8192},
        "InstanceStorageSupported": False,
        "EbsInfo": {
            "EbsOptimizedSupport": "default",
            "EncryptionSupport": "supported",
            "EbsOptimizedInfo": {
                "BaselineBandwidthInMbps": 1150,
                "BaselineThroughputInMBps": 143.75,
                "BaselineIops": 6000,
                "MaximumBandwidthInMbps": 4750,
                "MaximumThroughputInMBps": 593.75,
                "MaximumIops": 20000,
            },
            "NvmeSupport": "required",
        },
        "NetworkInfo": {
            "NetworkPerformance": "Up to 10 Gigabit",
            "MaximumNetworkInterfaces": 4,
            "MaximumNetworkCards": 1,
            "DefaultNetworkCardIndex": 0,
            "NetworkCards": _network_cards(1, "Up to 10 Gigabit", 4, 1.25, 10.0),
            "Ipv4AddressesPerInterface": 15,
            "Ipv6AddressesPerInterface": 15,
            "Ipv6Supported": True,
            "EnaSupport": "required",
            "EfaSupported": False,
            "EncryptionInTransitSupported": False,
            "EnaSrdSupported": False,
        },
        "PlacementGroupInfo": {"SupportedStrategies": ["cluster", "partition", "spread"]},
    },
}


def _trn2_variant(base: str, name: str, *, vcpus: int, memory_gib: int, cards: int, performance: str) -> dict:
    """A Trainium2 record from the trn1 record of the same shape: 16 (or 1) Trainium2 chips of 8 NeuronCore-v3
    and 96 GiB, its vCPUs, memory and network cards; sold on demand and as Capacity Blocks."""
    record = copy.deepcopy(INSTANCE_TYPES[base])
    devices = record["NeuronInfo"]["NeuronDevices"][0]["Count"]
    network = record["NetworkInfo"]
    card = network["NetworkCards"][0]
    record |= {
        "InstanceType": name,
        "SupportedUsageClasses": ["on-demand", "capacity-block"],
        "VCpuInfo": {**record["VCpuInfo"], "DefaultVCpus": vcpus, "DefaultCores": vcpus // 2},
        "MemoryInfo": {"SizeInMiB": memory_gib * 1024},
        "NeuronInfo": _neuron_info(devices, name="Trainium2", cores=8, version=3, mib=96 * 1024),
    }
    if cards > 1:
        bandwidth = float(performance.split()[0]) / cards
        network |= {
            "NetworkPerformance": performance,
            "MaximumNetworkCards": cards,
            "MaximumNetworkInterfaces": cards * card["MaximumNetworkInterfaces"],
            "NetworkCards": _network_cards(cards, f"{bandwidth:g} Gigabit", 5, bandwidth, bandwidth),
            "EfaInfo": {"MaximumEfaInterfaces": cards},
        }
    return record


# trn2.48xlarge: EFAv3 over 16 cards (3,200 Gbps), 192 vCPUs, 2 TiB; trn2.3xlarge: one chip, 12 vCPUs, no EFA.
INSTANCE_TYPES["trn2.48xlarge"] = _trn2_variant(
    "trn1.32xlarge", "trn2.48xlarge", vcpus=192, memory_gib=2048, cards=16, performance="3200 Gigabit"
)
INSTANCE_TYPES["trn2.3xlarge"] = _trn2_variant(
    "trn1.2xlarge", "trn2.3xlarge", vcpus=12, memory_gib=128, cards=1, performance="Up to 12.5 Gigabit"
)


# --------------------------------------------------------------------------------------------------
# Validators that need the real account
# --------------------------------------------------------------------------------------------------


class SuppressedValidator(NamedTuple):
    """A pcluster validator type switched off offline, and why."""

    name: str
    reason: str


# Suppressed unless the security groups are given (`security_groups=`, e.g. built from a synthesized template):
# with them, DescribeSecurityGroups is answered and these run for real.
SECURITY_GROUP_VALIDATORS = ("SecurityGroupsValidator", "EfaSecurityGroupValidator")
# Suppressed unless the file systems and the security groups are given.
FILE_SYSTEM_VALIDATORS = ("ExistingFsxNetworkingValidator",)
# Suppressed unless the reservations are given (`capacity_reservations=`).
CAPACITY_RESERVATION_VALIDATORS = (
    "CapacityReservationValidator",
    "CapacityReservationSizeValidator",
    "PlacementGroupCapacityReservationValidator",
)

# Validator type names as pcluster reports them (`Validator.type`, i.e. the class name).
SUPPRESSED_VALIDATORS: tuple[SuppressedValidator, ...] = (
    SuppressedValidator("AdditionalIamPolicyValidator", "IAM GetPolicy: each AdditionalIamPolicies ARN must exist"),
    SuppressedValidator("IamPolicyValidator", "IAM GetPolicy for Iam.PermissionsBoundary"),
    SuppressedValidator("RoleValidator", "IAM GetRole for InstanceRole and Iam.Roles.LambdaFunctionsRole"),
    SuppressedValidator("InstanceProfileValidator", "IAM GetInstanceProfile for InstanceProfile"),
    SuppressedValidator("SecurityGroupsValidator", "EC2 DescribeSecurityGroups: the groups must exist"),
    SuppressedValidator("EfaSecurityGroupValidator", "reads the real rules of custom security groups (EFA self-rule)"),
    SuppressedValidator("SubnetsValidator", "EC2 DescribeSubnets/DescribeVpcAttribute: one VPC with DNS enabled"),
    SuppressedValidator("LambdaFunctionsVpcConfigValidator", "EC2 look-ups of the Lambda VPC subnets and groups"),
    SuppressedValidator("ElasticIpValidator", "EC2 DescribeAddresses for HeadNode.Networking.ElasticIp"),
    SuppressedValidator("KeyPairValidator", "EC2 DescribeKeyPairs for HeadNode.Ssh.KeyName (key type check)"),
    SuppressedValidator("HeadNodeLaunchTemplateValidator", "EC2 RunInstances dry run of the head node template"),
    SuppressedValidator("ComputeResourceLaunchTemplateValidator", "EC2 RunInstances dry run of the compute template"),
    SuppressedValidator("LaunchTemplateValidator", "EC2 DescribeLaunchTemplateVersions for LaunchTemplateOverrides"),
    SuppressedValidator("CustomAmiTagValidator", "EC2 DescribeImages: tags of a real custom AMI"),
    SuppressedValidator("AmiOsCompatibleValidator", "EC2 DescribeImages: OS tag of a real custom AMI"),
    SuppressedValidator("UrlValidator", "S3 HeadObject / HTTPS GET: the script or package must exist"),
    SuppressedValidator(
        "AsyncTimedUrlValidator", "same check for CustomActions scripts (pcluster's timed wrapper type)"
    ),
    SuppressedValidator("S3BucketUriValidator", "S3 HeadBucket for ImportPath/ExportPath/DataRepositoryPath"),
    SuppressedValidator("S3BucketValidator", "S3 HeadBucket/GetBucketVersioning for CustomS3Bucket"),
    SuppressedValidator("S3BucketRegionValidator", "S3 GetBucketLocation for CustomS3Bucket"),
    SuppressedValidator("FsxAutoImportValidator", "S3 GetBucketLocation of the FSx import bucket"),
    SuppressedValidator("FsxBackupIdValidator", "FSx DescribeBackups for BackupId"),
    SuppressedValidator("ExistingFsxNetworkingValidator", "FSx/EC2 look-ups of an existing file system's ENIs and SGs"),
    SuppressedValidator("UnmanagedFsxMultiAzValidator", "needs the real AZs of an existing file system (INFO only)"),
    SuppressedValidator("EfsIdValidator", "EFS DescribeMountTargets and their security groups"),
    SuppressedValidator("SharedEbsVolumeIdValidator", "EC2 DescribeVolumes for an existing VolumeId"),
    SuppressedValidator("EbsVolumeSizeSnapshotValidator", "EC2 DescribeSnapshots for SnapshotId"),
    SuppressedValidator("KmsKeyValidator", "KMS DescribeKey"),
    SuppressedValidator("HostedZoneValidator", "Route 53 look-ups of Dns.HostedZoneId"),
    SuppressedValidator("PasswordSecretArnValidator", "Secrets Manager/SSM look-up of the directory password"),
    SuppressedValidator("MungeKeySecretSizeAndBase64Validator", "Secrets Manager GetSecretValue of the munge key"),
    SuppressedValidator("CapacityReservationValidator", "EC2 DescribeCapacityReservations"),
    SuppressedValidator("CapacityReservationSizeValidator", "EC2 DescribeCapacityReservations"),
    SuppressedValidator("CapacityReservationResourceGroupValidator", "Resource Groups look-ups of reservations"),
    SuppressedValidator("PlacementGroupCapacityReservationValidator", "EC2 DescribeCapacityReservations"),
    SuppressedValidator("CapacityBlockHealthStatusValidator", "EC2 DescribeCapacityBlockStatus"),
    SuppressedValidator("UltraserverCapacityBlockSizeValidator", "EC2 DescribeCapacityBlockStatus"),
)


# --------------------------------------------------------------------------------------------------
# Public result types
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ValidationFinding:
    """One validator failure: level is "ERROR", "WARNING" or "INFO"; validator is the pcluster type name."""

    level: str
    validator: str
    message: str


@dataclass(frozen=True)
class OfflineValidationReport:
    """Findings plus what ran: one entry per validator execution (types repeat when registered repeatedly)."""

    findings: tuple[ValidationFinding, ...]
    executed_validators: tuple[str, ...] = ()
    suppressed_validators: tuple[str, ...] = ()
    aws_calls: tuple[str, ...] = ()
    unsupported_aws_calls: tuple[str, ...] = ()


class UnknownInstanceTypeError(LookupError):
    """The config uses an instance type without a record in ``INSTANCE_TYPES``."""


def errors_of(findings: Iterable[ValidationFinding]) -> list[ValidationFinding]:
    """The ERROR findings only."""
    return [finding for finding in findings if finding.level == "ERROR"]


# --------------------------------------------------------------------------------------------------
# The offline AWS
# --------------------------------------------------------------------------------------------------

_OFFICIAL_AMI_VOLUME_GIB = 40  # root snapshot size of the official ParallelCluster 3.x AMIs
_OFFICIAL_AMI_BUILD = "202601010000 2026-01-01T00-00-00.000Z"
VPC_ID = "vpc-0a1b2c3d4e5f60718"  # the one VPC of every subnet the offline EC2 describes
_VPC_ID = VPC_ID
_ARCHITECTURES = ("x86_64", "arm64")


class _AwsError(Exception):
    def __init__(self, code: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status


def _stable_id(prefix: str, seed: str) -> str:
    """A deterministic AWS-looking id (17 hex digits) derived from a seed."""
    return f"{prefix}-0{hashlib.sha256(seed.encode()).hexdigest()[:16]}"


def _official_images(region: str) -> list[dict[str, Any]]:
    """DescribeImages records of the public ParallelCluster AMIs of the installed version."""
    version = get_installed_version()
    images = []
    for os_name, name_part in OS_TO_IMAGE_NAME_PART_MAP.items():
        if os_name in PRIVATE_OSES:
            continue  # AWS publishes no official AMI for these; pcluster requires Image.CustomAmi
        for architecture in _ARCHITECTURES:
            name = f"aws-parallelcluster-{version}-{name_part}-{architecture}-{_OFFICIAL_AMI_BUILD}"
            device = "/dev/xvda" if os_name.startswith("alinux") else "/dev/sda1"
            images.append(
                {
                    "ImageId": _stable_id("ami", f"{region}/{name}"),
                    "Name": name,
                    "Description": f"AWS ParallelCluster AMI for {os_name}",
                    "Architecture": architecture,
                    "CreationDate": "2026-01-01T00:00:00.000Z",
                    "State": "available",
                    "OwnerAlias": "amazon",
                    "Public": True,
                    "ImageType": "machine",
                    "RootDeviceName": device,
                    "RootDeviceType": "ebs",
                    "VirtualizationType": "hvm",
                    "EnaSupport": True,
                    "BlockDeviceMappings": [
                        {
                            "DeviceName": device,
                            "Ebs": {
                                "DeleteOnTermination": True,
                                "SnapshotId": _stable_id("snap", f"{region}/{name}"),
                                "VolumeSize": _OFFICIAL_AMI_VOLUME_GIB,
                                "VolumeType": "gp3",
                                "Encrypted": False,
                            },
                        }
                    ],
                    "Tags": [
                        {"Key": "parallelcluster:version", "Value": version},
                        {"Key": "parallelcluster:os", "Value": os_name},
                    ],
                }
            )
    return images


@dataclass(frozen=True)
class FileSystems:
    """DescribeFileSystems records by id and DescribeNetworkInterfaces records of their interfaces by id."""

    file_systems: Mapping[str, Mapping[str, Any]]
    network_interfaces: Mapping[str, Mapping[str, Any]]


class _OfflineAws:
    """In-process answers to the AWS API calls pcluster makes while loading and validating a config."""

    def __init__(
        self,
        region: str,
        subnet_azs: Mapping[str, str],
        head_node_architecture: str,
        security_groups: Mapping[str, Mapping[str, Any]] | None = None,
        capacity_reservations: Mapping[str, Mapping[str, Any]] | None = None,
        file_systems: FileSystems | None = None,
    ) -> None:
        self.region = region
        self.file_systems = file_systems
        self.capacity_reservations = {key: dict(value) for key, value in (capacity_reservations or {}).items()}
        self.subnet_azs = dict(subnet_azs)
        self.security_groups = {key: dict(value) for key, value in (security_groups or {}).items()}
        self.head_node_architecture = head_node_architecture
        self.images = _official_images(region)
        self.calls: list[str] = []
        self.unsupported: list[str] = []
        self._handlers = {
            ("ec2", "DescribeInstanceTypes"): self._describe_instance_types,
            ("ec2", "DescribeInstanceTypeOfferings"): self._describe_instance_type_offerings,
            ("ec2", "DescribeImages"): self._describe_images,
            ("ec2", "DescribeSubnets"): self._describe_subnets,
            ("fsx", "DescribeFileSystems"): self._describe_file_systems,
        }
        if security_groups is not None:
            self._handlers[("ec2", "DescribeSecurityGroups")] = self._describe_security_groups
        if capacity_reservations is not None:
            self._handlers[("ec2", "DescribeCapacityReservations")] = self._describe_capacity_reservations
        if file_systems is not None:
            self._handlers[("ec2", "DescribeNetworkInterfaces")] = self._describe_network_interfaces

    # botocore event hooks ------------------------------------------------------------------------

    def capture_params(self, params: dict, context: dict, **_: Any) -> None:
        """`before-parameter-build`: keep the caller's parameters (the `before-call` hook sees them serialized)."""
        context["offline_api_params"] = copy.deepcopy(params)

    def answer(self, model: Any, context: dict, **_: Any) -> tuple[AWSResponse, dict]:
        """`before-call`: return (http response, parsed response) so botocore never sends a request."""
        service = model.service_model.endpoint_prefix
        operation = model.name
        self.calls.append(f"{service}:{operation}")
        params = context.get("offline_api_params", {})
        handler = self._handlers.get((service, operation))
        try:
            if handler is None:
                self.unsupported.append(f"{service}:{operation}")
                raise _AwsError(
                    "OfflineHarness.UnsupportedOperation",
                    f"{service}:{operation} is not available offline; suppress the validator that needs it "
                    "or teach tests/support/pcluster_offline.py to answer it",
                )
            body = handler(params)
        except _AwsError as error:
            parsed = {"Error": {"Code": error.code, "Message": error.message}, "ResponseMetadata": {}}
            return AWSResponse("https://offline.invalid/", error.status, {}, None), parsed
        body.setdefault("ResponseMetadata", {"HTTPStatusCode": 200, "RequestId": "offline"})
        return AWSResponse("https://offline.invalid/", 200, {}, None), body

    # EC2 -------------------------------------------------------------------------------------------

    def _describe_instance_types(self, params: dict) -> dict:
        names = params.get("InstanceTypes")
        if names:
            missing = [name for name in names if name not in INSTANCE_TYPES]
            if missing:
                raise _AwsError(
                    "InvalidInstanceType", f"The following supplied instance types do not exist: [{', '.join(missing)}]"
                )
            records = [INSTANCE_TYPES[name] for name in names]
        else:
            records = list(INSTANCE_TYPES.values())
        top_level_filters = {
            "instance-type": "InstanceType",
            "free-tier-eligible": "FreeTierEligible",
            "current-generation": "CurrentGeneration",
        }
        for flt in params.get("Filters", []):
            key = top_level_filters.get(flt["Name"])
            if key is None:
                raise _AwsError("OfflineHarness.UnsupportedFilter", f"DescribeInstanceTypes filter {flt['Name']}")
            records = [r for r in records if any(fnmatch.fnmatch(str(r.get(key)).lower(), v) for v in flt["Values"])]
        # Deep copies: pcluster's InstanceTypeInfo rewrites SupportedUsageClasses in place.
        return {"InstanceTypes": copy.deepcopy(records)}

    def _describe_instance_type_offerings(self, params: dict) -> dict:
        location_type = params.get("LocationType", "region")
        if location_type == "region":
            locations = [self.region]
        elif location_type == "availability-zone":
            locations = sorted(set(self.subnet_azs.values()) | {f"{self.region}a"})
        else:
            raise _AwsError("OfflineHarness.UnsupportedFilter", f"LocationType {location_type}")
        offerings = [
            {"InstanceType": name, "LocationType": location_type, "Location": location}
            for name in INSTANCE_TYPES
            for location in locations
        ]
        for flt in params.get("Filters", []):
            key = {"instance-type": "InstanceType", "location": "Location"}.get(flt["Name"])
            if key is None:
                raise _AwsError("OfflineHarness.UnsupportedFilter", f"DescribeInstanceTypeOfferings {flt['Name']}")
            offerings = [o for o in offerings if any(fnmatch.fnmatch(o[key], v) for v in flt["Values"])]
        return {"InstanceTypeOfferings": offerings}

    def _describe_images(self, params: dict) -> dict:
        image_ids = params.get("ImageIds")
        if image_ids:
            by_id = {image["ImageId"]: image for image in self.images}
            images = [by_id.get(image_id) or self._placeholder_image(image_id) for image_id in image_ids]
        else:
            images = list(self.images)
        for flt in params.get("Filters", []):
            name, values = flt["Name"], flt["Values"]
            if name == "name":
                images = [i for i in images if any(fnmatch.fnmatchcase(i["Name"], v) for v in values)]
            elif name == "state":
                images = [i for i in images if i["State"] in values]
            elif name == "architecture":
                images = [i for i in images if i["Architecture"] in values]
            elif name.startswith("tag:"):
                key = name[len("tag:") :]
                images = [i for i in images if any(t["Key"] == key and t["Value"] in values for t in i["Tags"])]
            else:
                raise _AwsError("OfflineHarness.UnsupportedFilter", f"DescribeImages filter {name}")
        return {"Images": copy.deepcopy(images)}

    def _placeholder_image(self, image_id: str) -> dict[str, Any]:
        """Stand-in for a custom AMI: its real architecture, OS and size are unknown offline."""
        return {
            "ImageId": image_id,
            "Name": f"offline-placeholder-{image_id}",
            "Description": "Custom AMI (offline placeholder: the real image was not looked up)",
            "Architecture": self.head_node_architecture,
            "CreationDate": "2026-01-01T00:00:00.000Z",
            "State": "available",
            "RootDeviceName": "/dev/sda1",
            "RootDeviceType": "ebs",
            "VirtualizationType": "hvm",
            "BlockDeviceMappings": [
                {"DeviceName": "/dev/sda1", "Ebs": {"VolumeSize": _OFFICIAL_AMI_VOLUME_GIB, "VolumeType": "gp3"}}
            ],
            "Tags": [],
        }

    def _describe_security_groups(self, params: dict) -> dict:
        """The groups of the synthesized template, with their rules as EC2 reports them."""
        missing = [group for group in params.get("GroupIds", []) if group not in self.security_groups]
        if missing:
            raise _AwsError("InvalidGroup.NotFound", f"The security group '{missing[0]}' does not exist")
        return {"SecurityGroups": [copy.deepcopy(self.security_groups[g]) for g in params.get("GroupIds", [])]}

    def _describe_capacity_reservations(self, params: dict) -> dict:
        ids = params.get("CapacityReservationIds", [])
        missing = [cr for cr in ids if cr not in self.capacity_reservations]
        if missing:
            raise _AwsError(
                "InvalidCapacityReservationId.NotFound", f"The reservation ID '{missing[0]}' does not exist"
            )
        return {"CapacityReservations": [copy.deepcopy(self.capacity_reservations[cr]) for cr in ids]}

    def _describe_subnets(self, params: dict) -> dict:
        subnets = []
        for subnet_id in params.get("SubnetIds", []):
            index = list(self.subnet_azs).index(subnet_id) if subnet_id in self.subnet_azs else 255
            subnets.append(
                {
                    "SubnetId": subnet_id,
                    "AvailabilityZone": self.subnet_azs.get(subnet_id, f"{self.region}a"),
                    "VpcId": _VPC_ID,
                    "CidrBlock": f"10.0.{index}.0/24",
                    "State": "available",
                    "MapPublicIpOnLaunch": False,
                    "DefaultForAz": False,
                    "AvailableIpAddressCount": 251,
                }
            )
        return {"Subnets": subnets}

    # FSx -------------------------------------------------------------------------------------------

    def _describe_network_interfaces(self, params: dict) -> dict:
        assert self.file_systems is not None
        interfaces = self.file_systems.network_interfaces
        missing = [eni for eni in params.get("NetworkInterfaceIds", []) if eni not in interfaces]
        if missing:
            raise _AwsError(
                "InvalidNetworkInterfaceID.NotFound", f"The networkInterface ID '{missing[0]}' does not exist"
            )
        return {"NetworkInterfaces": [copy.deepcopy(interfaces[eni]) for eni in params.get("NetworkInterfaceIds", [])]}

    def _describe_file_systems(self, params: dict) -> dict:
        if self.file_systems is not None:
            known = self.file_systems.file_systems
            missing = [fs for fs in params.get("FileSystemIds", []) if fs not in known]
            if missing:
                raise _AwsError("FileSystemNotFound", f"File system '{missing[0]}' does not exist.")
            return {"FileSystems": [copy.deepcopy(known[fs]) for fs in params.get("FileSystemIds", [])]}
        # An existing Lustre file system placed in the first known subnet (its real placement is unknown).
        subnet = next(iter(self.subnet_azs), "subnet-00000000000000000")
        file_systems = [
            {
                "FileSystemId": fs_id,
                "FileSystemType": "LUSTRE",
                "FileSystemTypeVersion": "2.15",
                "Lifecycle": "AVAILABLE",
                "StorageCapacity": 1200,
                "StorageType": "SSD",
                "VpcId": _VPC_ID,
                "SubnetIds": [subnet],
                "NetworkInterfaceIds": [_stable_id("eni", fs_id)],
                "DNSName": f"{fs_id}.fsx.{self.region}.amazonaws.com",
                "LustreConfiguration": {
                    "DeploymentType": "PERSISTENT_2",
                    "PerUnitStorageThroughput": 125,
                    "MountName": hashlib.sha256(fs_id.encode()).hexdigest()[:8],
                },
            }
            for fs_id in params.get("FileSystemIds", [])
        ]
        return {"FileSystems": file_systems}


# --------------------------------------------------------------------------------------------------
# Helpers around pcluster
# --------------------------------------------------------------------------------------------------


class _ValidatorTally(ValidatorSuppressor):
    """Never suppresses; sees every validator pcluster is about to run (it must come first in the list)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def suppress_validator(self, validator: Any) -> bool:
        self.seen.append(validator.type)
        return False


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _as_dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _assign_availability_zones(config: Mapping[str, Any], region: str) -> dict[str, str]:
    """Subnet -> AZ: the head node subnet in `<region>a`; in each queue or login pool the i-th listed
    subnet in the i-th AZ (a, b, c, ...); a subnet keeps the AZ it got first."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    azs: dict[str, str] = {}
    head_subnet = _as_dict(_as_dict(config.get("HeadNode")).get("Networking")).get("SubnetId")
    if isinstance(head_subnet, str):
        azs[head_subnet] = f"{region}a"
    groups = _as_list(_as_dict(config.get("Scheduling")).get("SlurmQueues"))
    groups += _as_list(_as_dict(config.get("LoginNodes")).get("Pools"))
    for group in groups:
        subnets = _as_list(_as_dict(_as_dict(group).get("Networking")).get("SubnetIds"))
        for index, subnet in enumerate(subnets):
            if isinstance(subnet, str):
                azs.setdefault(subnet, f"{region}{letters[index % len(letters)]}")
    return azs


def _head_node_architecture(config: Mapping[str, Any]) -> str:
    instance_type = _as_dict(config.get("HeadNode")).get("InstanceType")
    record = INSTANCE_TYPES.get(instance_type) if isinstance(instance_type, str) else None
    return record["ProcessorInfo"]["SupportedArchitectures"][0] if record else "x86_64"


def _instance_types_in(cluster_config: Any) -> set[str]:
    """Every instance type the loaded config refers to."""
    types = {cluster_config.head_node.instance_type}
    for queue in cluster_config.scheduling.queues:
        for compute_resource in queue.compute_resources:
            types.update(compute_resource.instance_types)
    login_nodes = getattr(cluster_config, "login_nodes", None)
    if login_nodes:
        types.update(pool.instance_type for pool in login_nodes.pools)
    return types


def _schema_findings(messages: Any, path: str = "") -> list[ValidationFinding]:
    """Flatten marshmallow's nested messages into one finding per message, prefixed with the key path."""
    if isinstance(messages, dict):
        findings = []
        for key, value in messages.items():
            child = path if key == "_schema" else (f"{path}.{key}" if path else str(key))
            findings.extend(_schema_findings(value, child))
        return findings
    if isinstance(messages, (list, tuple)):
        return [finding for item in messages for finding in _schema_findings(item, path)]
    return [ValidationFinding("ERROR", SCHEMA_VALIDATOR, f"{path}: {messages}" if path else str(messages))]


_ENV_KEYS = ("AWS_DEFAULT_REGION", "AWS_EC2_METADATA_DISABLED")


@contextlib.contextmanager
def _offline_aws(fake: _OfflineAws) -> Iterator[None]:
    """Route every boto3 client pcluster creates to `fake`; restore the process state afterwards."""
    saved_env = {key: os.environ.get(key) for key in _ENV_KEYS}
    saved_session = boto3.DEFAULT_SESSION
    seeded_regions = not hasattr(retrieve_supported_regions, "cache")
    os.environ["AWS_DEFAULT_REGION"] = fake.region
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    # Explicit dummy credentials: botocore then consults no credential provider (files, SSO, container,
    # IMDS). They are never used because every request is answered before it is signed.
    session = boto3.session.Session(
        aws_access_key_id="OFFLINEACCESSKEY", aws_secret_access_key="offline-secret", region_name=fake.region
    )
    session.events.register("before-parameter-build", fake.capture_params, unique_id="pcluster-offline-params")
    session.events.register("before-call", fake.answer, unique_id="pcluster-offline-answer")
    if seeded_regions:
        # pcluster downloads this list from S3 and falls back to the copy in the package: use the copy.
        bundled = (files("pcluster") / "resources" / "supported-regions").read_text(encoding="utf-8")
        retrieve_supported_regions.cache = bundled.split("\n")  # type: ignore[attr-defined]
    boto3.DEFAULT_SESSION = session
    AWSApi.reset()
    Cache.clear_all()
    try:
        yield
    finally:
        AWSApi.reset()
        Cache.clear_all()
        boto3.DEFAULT_SESSION = saved_session
        if seeded_regions and hasattr(retrieve_supported_regions, "cache"):
            del retrieve_supported_regions.cache  # type: ignore[attr-defined]
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _current_event_loop() -> Iterator[None]:
    """pcluster awaits its async validators through `asyncio.get_event_loop()`: make sure one is set."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            asyncio.get_event_loop()  # creates and sets the main thread's loop on Python < 3.14
            has_loop = True
        except RuntimeError:
            has_loop = False
    if has_loop:
        yield
        return
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        yield
    finally:
        asyncio.set_event_loop(None)
        loop.close()


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def run_offline_validation(
    config: Mapping[str, Any],
    *,
    cluster_name: str,
    region: str,
    subnet_azs: Mapping[str, str] | None = None,
    security_groups: Mapping[str, Mapping[str, Any]] | None = None,
    capacity_reservations: Mapping[str, Mapping[str, Any]] | None = None,
    file_systems: FileSystems | None = None,
) -> OfflineValidationReport:
    """Load `config` with the real pcluster schema and run its validators offline; report what ran.

    `config` is the cluster configuration as a plain dict (the YAML's structure); it is not modified.
    Subnets are private subnets of one VPC. Unless `subnet_azs` maps a subnet id to an AZ name, the head
    node subnet is in `<region>a` and in every queue (and login node pool) the i-th subnet listed is in
    the i-th AZ (`<region>a`, `<region>b`, ...), a subnet keeping the AZ it was given first. So two
    subnets in one queue are two AZs (pcluster's multi-AZ rules apply), and a queue whose only subnet
    differs from the head node's is still in the head node's AZ.
    """
    config_region = config.get("Region")
    if config_region is not None and config_region != region:
        raise ValueError(f"config Region {config_region!r} differs from region {region!r}")
    azs = _assign_availability_zones(config, region)
    azs.update(subnet_azs or {})
    fake = _OfflineAws(
        region, azs, _head_node_architecture(config), security_groups, capacity_reservations, file_systems
    )
    suppressed_names = {entry.name for entry in SUPPRESSED_VALIDATORS}
    # Their inputs are given: these validators run for real.
    for given, names in (
        (security_groups, SECURITY_GROUP_VALIDATORS),
        (capacity_reservations, CAPACITY_RESERVATION_VALIDATORS),
        (file_systems if security_groups is not None else None, FILE_SYSTEM_VALIDATORS),
    ):
        if given is not None:
            suppressed_names -= set(names)
    tally = _ValidatorTally()

    with _offline_aws(fake):
        try:
            cluster_config = ClusterSchema(cluster_name=cluster_name).load(copy.deepcopy(dict(config)))
        except ValidationError as error:
            return OfflineValidationReport(
                findings=tuple(_schema_findings(error.messages)),
                aws_calls=tuple(fake.calls),
                unsupported_aws_calls=tuple(fake.unsupported),
            )
        unknown = sorted(_instance_types_in(cluster_config) - INSTANCE_TYPES.keys())
        if unknown:
            raise UnknownInstanceTypeError(
                f"no offline DescribeInstanceTypes record for {unknown}; add one to INSTANCE_TYPES in {__name__}"
            )
        with _current_event_loop():
            suppressors = [tally, TypeMatchValidatorsSuppressor(suppressed_names)]
            failures = cluster_config.validate(suppressors, ValidatorContext())

    return OfflineValidationReport(
        findings=tuple(ValidationFinding(str(f.level), f.validator_type, f.message) for f in failures),
        executed_validators=tuple(name for name in tally.seen if name not in suppressed_names),
        suppressed_validators=tuple(name for name in tally.seen if name in suppressed_names),
        aws_calls=tuple(fake.calls),
        unsupported_aws_calls=tuple(fake.unsupported),
    )


def validate_cluster_config(
    config: Mapping[str, Any],
    *,
    cluster_name: str,
    region: str,
    subnet_azs: Mapping[str, str] | None = None,
    security_groups: Mapping[str, Mapping[str, Any]] | None = None,
    capacity_reservations: Mapping[str, Mapping[str, Any]] | None = None,
    file_systems: FileSystems | None = None,
) -> list[ValidationFinding]:
    """Validate a ParallelCluster 3.16.1 cluster config offline; return every finding (ERROR/WARNING/INFO).

    Schema errors are returned as ERROR findings of ``ConfigSchemaValidator`` (the semantic validators
    then do not run); they are not raised. See ``run_offline_validation`` for the subnet/AZ model and the
    module docstring for what is stubbed and suppressed.
    """
    report = run_offline_validation(
        config,
        cluster_name=cluster_name,
        region=region,
        subnet_azs=subnet_azs,
        security_groups=security_groups,
        capacity_reservations=capacity_reservations,
        file_systems=file_systems,
    )
    return list(report.findings)
