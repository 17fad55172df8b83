"""The ParallelCluster configuration: built by a pure function, accepted by the real aws-parallelcluster.

The synthesized `ClusterConfiguration` contains CloudFormation references; they are replaced by
realistic placeholder ids, then the configuration is loaded by pcluster's schema and run through its
local semantic validators (tests/support/pcluster_offline.py stubs only the AWS look-ups).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from aws_cdk import App

from stacks.application import ENVIRONMENTS_DIR, build_app
from stacks.cluster import BOOTSTRAP_SCRIPT, bootstrap_arguments
from stacks.cluster_requirements import LOCK, ROOT, normalized, read_lock
from stacks.config import EnvironmentConfig, load_environment
from stacks.pcluster_config import ClusterResources, build_cluster_configuration
from stacks.pipeline_site import shared_env_path
from stacks.training_environment import cluster_settings, node_health
from tests.support.pcluster_offline import (
    INSTANCE_TYPES,
    VPC_ID,
    FileSystems,
    errors_of,
    run_offline_validation,
    validate_cluster_config,
)
from tests.support.synthesis import ENVIRONMENT_NAMES, Synthesized, cdk_json_context
from training.config.hardware import HARDWARE
from training.software import NODE_SOFTWARE

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ACCOUNT = "123456789012"


def placeholder_id(prefix: str, logical_id: str) -> str:
    return f"{prefix}-{hashlib.sha256(logical_id.encode()).hexdigest()[:17]}"


def resolve(value: Any, resources: dict[str, Any]) -> Any:
    """Replace CloudFormation intrinsics with the kind of id AWS would return for that resource type."""
    if isinstance(value, list):
        return [resolve(item, resources) for item in value]
    if not isinstance(value, dict):
        return value
    if set(value) == {"Ref"}:
        name = value["Ref"]
        kind = resources[name]["Type"]
        if kind == "AWS::EC2::Subnet":
            return placeholder_id("subnet", name)
        if kind == "AWS::FSx::FileSystem":
            return placeholder_id("fs", name)
        if kind == "AWS::IAM::ManagedPolicy":
            return f"arn:aws:iam::{ACCOUNT}:policy/parallelcluster/{name}"
        if kind == "AWS::S3::Bucket":
            return f"{name.lower()}-{ACCOUNT}"
        raise AssertionError(f"no placeholder for Ref to {kind}")
    if set(value) == {"Fn::GetAtt"}:
        name, attribute = value["Fn::GetAtt"]
        assert (resources[name]["Type"], attribute) == ("AWS::EC2::SecurityGroup", "GroupId")
        return placeholder_id("sg", name)
    if set(value) == {"Fn::Sub"} and isinstance(value["Fn::Sub"], str):
        return value["Fn::Sub"].replace("${AWS::AccountId}", ACCOUNT)
    if set(value) == {"Fn::Join"}:
        separator, parts = value["Fn::Join"]
        return separator.join(str(resolve(part, resources)) for part in parts)
    unresolved = [key for key in value if key.startswith("Fn::")]
    assert not unresolved, f"unexpected intrinsic {unresolved}"
    return {key: resolve(item, resources) for key, item in value.items()}


def resolved_configuration(env: Synthesized) -> dict[str, Any]:
    (cluster,) = env.resources_of_type("Custom::PclusterCluster").values()
    return resolve(cluster["Properties"]["ClusterConfiguration"], env.template["Resources"])


def security_groups_of(template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every security group of the template as EC2's DescribeSecurityGroups would return it: inline rules and
    the separate ingress/egress resources CDK writes for rules between groups, with placeholder ids."""
    resources = template["Resources"]

    def permission(rule: dict[str, Any], peer_key: str) -> dict[str, Any]:
        entry: dict[str, Any] = {"IpProtocol": str(rule["IpProtocol"]), "IpRanges": [], "UserIdGroupPairs": []}
        entry |= {key: rule[key] for key in ("FromPort", "ToPort") if key in rule}
        if "CidrIp" in rule:
            entry["IpRanges"].append({"CidrIp": rule["CidrIp"]})
        if peer_key in rule:
            entry["UserIdGroupPairs"].append({"GroupId": resolve(rule[peer_key], resources)})
        return entry

    groups = {
        placeholder_id("sg", name): {
            "GroupId": placeholder_id("sg", name),
            "VpcId": "vpc-0aaaaaaaaaaaaaaa1",
            "IpPermissions": [
                permission(r, "SourceSecurityGroupId") for r in resource["Properties"].get("SecurityGroupIngress", [])
            ],
            "IpPermissionsEgress": [
                permission(r, "DestinationSecurityGroupId")
                for r in resource["Properties"].get("SecurityGroupEgress", [])
            ],
        }
        for name, resource in resources.items()
        if resource["Type"] == "AWS::EC2::SecurityGroup"
    }
    for resource in resources.values():
        kind, rule = resource["Type"], resource.get("Properties", {})
        if kind == "AWS::EC2::SecurityGroupIngress":
            groups[resolve(rule["GroupId"], resources)]["IpPermissions"].append(
                permission(rule, "SourceSecurityGroupId")
            )
        elif kind == "AWS::EC2::SecurityGroupEgress":
            groups[resolve(rule["GroupId"], resources)]["IpPermissionsEgress"].append(
                permission(rule, "DestinationSecurityGroupId")
            )
    return groups


def subnet_zones_of(template: dict[str, Any], region: str) -> dict[str, str]:
    """Each subnet's zone name. A subnet placed by zone ID gets `<region>a`: which name an account gives that
    zone is known only to the account (the same physical zone is what matters, and reservations below are
    placed by the same rule)."""
    resources = template["Resources"]
    return {
        resolve({"Ref": name}, resources): str(r["Properties"].get("AvailabilityZone") or f"{region}a")
        for name, r in resources.items()
        if r["Type"] == "AWS::EC2::Subnet"
    }


def file_systems_of(template: dict[str, Any]) -> FileSystems:
    """Every file system of the template as FSx describes it, with the network interface FSx gives it in its
    subnet, carrying its security groups: what ParallelCluster checks the Lustre ports against."""
    resources = template["Resources"]
    file_systems: dict[str, dict[str, Any]] = {}
    interfaces: dict[str, dict[str, Any]] = {}
    for name, resource in resources.items():
        if resource["Type"] != "AWS::FSx::FileSystem":
            continue
        properties = resource["Properties"]
        fs_id = resolve({"Ref": name}, resources)
        subnets = [resolve(subnet, resources) for subnet in properties["SubnetIds"]]
        eni = placeholder_id("eni", name)
        file_systems[fs_id] = {
            "FileSystemId": fs_id,
            "FileSystemType": properties["FileSystemType"],
            "Lifecycle": "AVAILABLE",
            "StorageCapacity": properties["StorageCapacity"],
            "VpcId": VPC_ID,
            "SubnetIds": subnets,
            "NetworkInterfaceIds": [eni],
            "LustreConfiguration": {"DeploymentType": properties["LustreConfiguration"]["DeploymentType"]},
        }
        interfaces[eni] = {
            "NetworkInterfaceId": eni,
            "VpcId": VPC_ID,
            "SubnetId": subnets[0],
            "Groups": [{"GroupId": resolve(group, resources)} for group in properties["SecurityGroupIds"]],
        }
    return FileSystems(file_systems=file_systems, network_interfaces=interfaces)


def account_of(env: Synthesized) -> dict[str, Any]:
    """What the account holds once the template is deployed, answered from the template itself."""
    return {
        "security_groups": security_groups_of(env.template),
        "subnet_azs": subnet_zones_of(env.template, env.config.region),
        "file_systems": file_systems_of(env.template),
    }


def reservations_of(env: Synthesized) -> dict[str, dict[str, Any]] | None:
    """The reservation or Capacity Block the environment file names, in the zone of its template's subnets."""
    return reservations_in(env.config, next(iter(subnet_zones_of(env.template, env.config.region).values())))


def reservations_in(config: EnvironmentConfig, zone: str) -> dict[str, dict[str, Any]] | None:
    """The reservation or Capacity Block an environment file names, as the account holds it when the file is
    right (its instance type, `zone` and count); None for capacity bought on demand or spot."""
    compute = config.compute
    reservation_id = compute.capacity.reservation_id
    if reservation_id is None:
        return None
    kind = "capacity-block" if compute.capacity.type == "capacity-block" else "default"
    held = reservation(
        reservation_id, instance_type=compute.instance_type, zone=zone, count=compute.max_count, kind=kind
    )
    return {reservation_id: held}


def reservation(
    reservation_id: str, *, instance_type: str, zone: str, count: int, kind: str = "default"
) -> dict[str, Any]:
    """A capacity reservation as DescribeCapacityReservations returns it (kind 'capacity-block' for a block)."""
    return {
        "CapacityReservationId": reservation_id,
        "InstanceType": instance_type,
        "InstancePlatform": "Linux/UNIX",
        "AvailabilityZone": zone,
        "TotalInstanceCount": count,
        "AvailableInstanceCount": count,
        "State": "active" if kind == "default" else "scheduled",
        "ReservationType": kind,
        "InstanceMatchCriteria": "targeted",
        "Tenancy": "default",
    }


@pytest.mark.parametrize("env_name", ENVIRONMENT_NAMES)
def test_synthesized_configuration_passes_parallelcluster_validation(
    env_name: str, synthesized: dict[str, Synthesized]
) -> None:
    env = synthesized[env_name]
    configuration = resolved_configuration(env)
    assert not re.search(r"\$\{|Fn::|\"Ref\"", repr(configuration))
    report = run_offline_validation(
        configuration,
        cluster_name=env.config.cluster_name,
        region=env.config.region,
        capacity_reservations=reservations_of(env),
        **account_of(env),
    )
    assert errors_of(report.findings) == []
    assert {"SecurityGroupsValidator", "EfaSecurityGroupValidator", "ExistingFsxNetworkingValidator"} <= set(
        report.executed_validators
    )


def test_efa_needs_the_cluster_group_open_to_itself_both_ways(default_env: Synthesized) -> None:
    """ParallelCluster's EfaSecurityGroupValidator, fed the template's rules: without the group's outbound rule
    to itself (an egress to 0.0.0.0/0 does not count) it rejects the cluster, as it would at create time."""
    configuration = resolved_configuration(default_env)
    groups = security_groups_of(default_env.template)
    (cluster_group,) = configuration["Scheduling"]["SlurmQueues"][0]["Networking"]["SecurityGroups"]
    outbound = groups[cluster_group]["IpPermissionsEgress"]
    assert any(p["IpProtocol"] == "-1" and {"GroupId": cluster_group} in p["UserIdGroupPairs"] for p in outbound)
    groups[cluster_group]["IpPermissionsEgress"] = [p for p in outbound if not p["UserIdGroupPairs"]]
    account = account_of(default_env) | {"security_groups": groups}
    findings = validate_cluster_config(configuration, cluster_name="trn1-llama", region="us-west-2", **account)
    assert [(f.validator, f.message[:32]) for f in errors_of(findings)] == [
        ("EfaSecurityGroupValidator", "An EFA requires a security group")
    ]


def test_the_file_system_must_open_the_lustre_ports_to_the_nodes(default_env: Synthesized) -> None:
    """ParallelCluster's FSx networking validator, fed the template's file system, its security group and the
    nodes' group: without the Lustre rule from the cluster group it rejects the cluster."""
    configuration = resolved_configuration(default_env)
    account = account_of(default_env)
    (interface,) = account["file_systems"].network_interfaces.values()
    (fsx_group,) = (g["GroupId"] for g in interface["Groups"])
    group = account["security_groups"][fsx_group]
    group["IpPermissions"] = [p for p in group["IpPermissions"] if p.get("FromPort") != 988]
    findings = validate_cluster_config(configuration, cluster_name="trn1-llama", region="us-west-2", **account)
    (error,) = errors_of(findings)
    assert error.validator == "ExistingFsxNetworkingValidator" and "Missing ports: [988]" in error.message


def test_parallelcluster_validation_catches_a_broken_configuration(default_env: Synthesized) -> None:
    """The same path rejects what ParallelCluster would reject: proof the validators really run."""
    configuration = resolved_configuration(default_env)
    queue = configuration["Scheduling"]["SlurmQueues"][0]
    queue["ComputeResources"][0]["MinCount"] = 5
    del queue["Networking"]["PlacementGroup"]
    findings = validate_cluster_config(configuration, cluster_name="trn1-llama", region="us-west-2")
    assert {finding.validator for finding in errors_of(findings)} == {
        "ComputeResourceSizeValidator",
        "EfaPlacementGroupValidator",
    }


# --- the pure builder ----------------------------------------------------------------------------------

RESOURCES = ClusterResources(
    head_node_subnet_id="subnet-0aaaaaaaaaaaaaaa1",
    compute_subnet_id="subnet-0aaaaaaaaaaaaaaa1",
    security_group_id="sg-0bbbbbbbbbbbbbbb2",
    file_system_id="fs-0ccccccccccccccc3",
    head_node_policy_arn=f"arn:aws:iam::{ACCOUNT}:policy/parallelcluster/head",
    compute_node_policy_arn=f"arn:aws:iam::{ACCOUNT}:policy/parallelcluster/compute",
    bootstrap_script_url="s3://bucket/on_node_configured.sh",
    bootstrap_args=("--neuron-release", "2.28.1", "--shared-env", "/fsx/envs/neuron-2.28.1"),
)


def test_builder_is_pure_and_uses_every_resource() -> None:
    settings = cluster_settings(load_environment("default", ENVIRONMENTS_DIR))
    first = build_cluster_configuration(settings, RESOURCES)
    assert first == build_cluster_configuration(settings, RESOURCES)
    text = repr(first)
    for value in (RESOURCES.head_node_subnet_id, RESOURCES.security_group_id, RESOURCES.file_system_id):
        assert value in text
    assert first["HeadNode"]["Iam"]["AdditionalIamPolicies"][1] == {"Policy": RESOURCES.head_node_policy_arn}
    assert first["Scheduling"]["SlurmQueues"][0]["Iam"] == {
        "AdditionalIamPolicies": [{"Policy": RESOURCES.compute_node_policy_arn}]
    }
    assert first["HeadNode"]["CustomActions"]["OnNodeConfigured"]["Args"] == list(RESOURCES.bootstrap_args)


def test_builder_output_passes_parallelcluster_validation_for_every_environment() -> None:
    for name in ENVIRONMENT_NAMES:
        config = load_environment(name, ENVIRONMENTS_DIR)
        built = build_cluster_configuration(cluster_settings(config), RESOURCES)
        (subnet,) = built["Scheduling"]["SlurmQueues"][0]["Networking"]["SubnetIds"]
        zone = f"{config.region}a"  # the compute subnet's zone, and the reservation's the file names
        findings = validate_cluster_config(
            built,
            cluster_name=config.cluster_name,
            region=config.region,
            subnet_azs={subnet: zone},
            capacity_reservations=reservations_in(config, zone),
        )
        assert errors_of(findings) == [], name


def test_ssh_key_is_optional_and_off_by_default() -> None:
    settings = cluster_settings(load_environment("default", ENVIRONMENTS_DIR))
    assert settings.ssh_key_name is None
    assert "Ssh" not in build_cluster_configuration(settings, RESOURCES)["HeadNode"]
    with_key = dataclasses.replace(settings, ssh_key_name="ops")
    assert build_cluster_configuration(with_key, RESOURCES)["HeadNode"]["Ssh"] == {"KeyName": "ops"}


def test_neuron_release_comes_from_the_bootstrap_script() -> None:
    release = NODE_SOFTWARE["neuron"].release(BOOTSTRAP_SCRIPT.read_text())
    assert re.fullmatch(r"\d+\.\d+\.\d+", release)
    config = load_environment("default", ENVIRONMENTS_DIR)
    arguments = bootstrap_arguments(
        neuron_release=release,
        shared_env=shared_env_path(config, release),
        requirements_uri="s3://b/cluster/r.txt",
        node_settings_uri="s3://b/cluster/node-settings.json",
        health=node_health(config),
        environment_name=config.name,
    )
    # The requirement set and the node settings by their stable keys, never by content: a new lock or setting
    # must not change the configuration.
    assert arguments == (
        "--neuron-release",
        release,
        "--shared-env",
        f"/fsx/envs/neuron-{release}",
        "--requirements",
        "s3://b/cluster/r.txt",
        "--node-settings",
        "s3://b/cluster/node-settings.json",
        # What a healthy trn1.32xlarge shows: checked at bootstrap and before each job of the queue.
        "--trainium-partition",
        "compute1",
        "--neuron-devices",
        "16",
        "--efa-devices",
        "8",
        # Which site file the nodes' metric publishers follow: <mount>/pipeline/site-default.yaml.
        "--environment",
        "default",
    )
    assert {"torch==2.9.1", "torch-xla==2.9.0", "transformers==4.57.6"} <= set(read_lock(LOCK))
    with pytest.raises(ValueError, match="pins no NEURON_RELEASE"):
        NODE_SOFTWARE["neuron"].release("#!/bin/bash\n")


def test_cluster_installs_the_training_pins_only() -> None:
    """The shared environment on the cluster gets the locked runtime set: no CDK (infra) or test and lint
    (dev) package is installed on a node."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    installed = {normalized(pin) for pin in read_lock(LOCK)}
    developer_only = {normalized(pin) for pin in (*extras["infra"], *extras["dev"])} - {
        normalized(pin) for pin in extras["training"]
    }
    assert developer_only and not installed & developer_only


def test_parallelcluster_rejects_a_capacity_block_without_its_reservation(default_env: Synthesized) -> None:
    """What the environment file refuses (a block without its reservation id and static nodes) is what
    ParallelCluster's own validators reject."""
    configuration = resolved_configuration(default_env)
    configuration["Scheduling"]["SlurmQueues"][0]["CapacityType"] = "CAPACITY_BLOCK"
    findings = validate_cluster_config(
        configuration, cluster_name="trn1-llama", region="us-west-2", **account_of(default_env)
    )
    assert {f.validator for f in errors_of(findings)} == {"ComputeResourceSizeValidator", "CapacityTypeValidator"}


BLOCK = "cr-0b10c0b10c0b10c0b"
ODCR = "cr-0dc40dc40dc40dc40"
GROUP = "arn:aws:resource-groups:us-west-2:123456789012:group/trn1-odcrs"
CAPACITY_CASES = {
    "capacity-block": {"compute": {"capacity": {"type": "capacity-block", "reservation_id": BLOCK}}},
    "reservation": {"compute": {"capacity": {"type": "reservation", "reservation_id": ODCR}}},
    "zone-name": {"availability_zone": "us-west-2d"},  # the bundled files name their zone by ID
    "custom-ami": {"compute": {"custom_ami": "ami-0123456789abcdef0"}},
}


def synthesize_variant(tmp_path: Path, changes: dict[str, Any]) -> Synthesized:
    """default.yaml with `changes` merged in, synthesized for real."""
    directory = tmp_path / "environments"
    directory.mkdir()
    data = yaml.safe_load((ENVIRONMENTS_DIR / "default.yaml").read_text())
    for key, value in changes.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    (directory / "variant.yaml").write_text(yaml.safe_dump(data))
    config = load_environment("variant", directory)
    app = App(outdir=str(tmp_path / "cdk.out"), context=cdk_json_context())
    stack = build_app(app, config)
    app.synth()
    template = json.loads((tmp_path / "cdk.out" / f"{stack.stack_name}.template.json").read_text())
    return Synthesized(config=config, outdir=tmp_path / "cdk.out", template=template, validation_report={})


@pytest.mark.parametrize("case", CAPACITY_CASES)
def test_reserved_capacity_and_zone_ids_pass_parallelcluster_validation(case: str, tmp_path: Path) -> None:
    """Each way of buying capacity, emitted as ParallelCluster expects and validated with the reservation as
    the account holds it: the block's static nodes and no placement group, the reservation's target."""
    env = synthesize_variant(tmp_path, CAPACITY_CASES[case])
    configuration = resolved_configuration(env)
    queue = configuration["Scheduling"]["SlurmQueues"][0]
    (resource,) = queue["ComputeResources"]
    zone = next(iter(subnet_zones_of(env.template, "us-west-2").values()))
    reservations = {
        BLOCK: reservation(BLOCK, instance_type="trn1.32xlarge", zone=zone, count=4, kind="capacity-block"),
        ODCR: reservation(ODCR, instance_type="trn1.32xlarge", zone=zone, count=4),
    }
    report = run_offline_validation(
        configuration,
        cluster_name="trn1-llama",
        region="us-west-2",
        capacity_reservations=reservations,
        **account_of(env),
    )
    assert errors_of(report.findings) == []
    if case == "capacity-block":
        assert queue["CapacityType"] == "CAPACITY_BLOCK" and resource["MinCount"] == resource["MaxCount"] == 4
        assert resource["CapacityReservationTarget"] == {"CapacityReservationId": BLOCK}
        assert queue["Networking"]["PlacementGroup"] == {"Enabled": False}
        assert "CapacityReservationValidator" in report.executed_validators
    elif case == "reservation":
        assert queue["CapacityType"] == "ONDEMAND" and resource["MinCount"] == 0
        assert resource["CapacityReservationTarget"] == {"CapacityReservationId": ODCR}
        assert "CapacityReservationSizeValidator" in report.executed_validators
    elif case == "custom-ami":
        # The queue's own image (update policy QUEUE_UPDATE_STRATEGY: new nodes boot it after a deploy).
        assert queue["Image"] == {"CustomAmi": "ami-0123456789abcdef0"}
    else:
        subnets = [r for r in env.template["Resources"].values() if r["Type"] == "AWS::EC2::Subnet"]
        assert {s["Properties"].get("AvailabilityZone") for s in subnets} == {"us-west-2d"}
        assert all("AvailabilityZoneId" not in s["Properties"] for s in subnets)
        assert "CapacityReservationTarget" not in resource


def test_the_trn2_environment_passes_parallelcluster_validation_with_its_block(
    synthesized: dict[str, Synthesized],
) -> None:
    """environments/trn2.yaml, validated with its Capacity Block as the account would hold it: ParallelCluster's
    rules for reserved capacity (static nodes, the block as the target, no placement group of ours) and EFA on a
    type whose 16 network cards ParallelCluster gives an interface each."""
    env = synthesized["trn2"]
    configuration = resolved_configuration(env)
    queue = configuration["Scheduling"]["SlurmQueues"][0]
    (resource,) = queue["ComputeResources"]
    reservations = reservations_of(env)
    assert reservations is not None
    ((block, held),) = reservations.items()
    assert (held["InstanceType"], held["ReservationType"], held["TotalInstanceCount"]) == (
        "trn2.48xlarge",
        "capacity-block",
        1,
    )
    report = run_offline_validation(
        configuration,
        cluster_name=env.config.cluster_name,
        region=env.config.region,
        capacity_reservations=reservations,
        **account_of(env),
    )
    assert errors_of(report.findings) == []
    assert resource["InstanceType"] == "trn2.48xlarge" and resource["Efa"] == {"Enabled": True}
    assert queue["CapacityType"] == "CAPACITY_BLOCK" and resource["MinCount"] == resource["MaxCount"] == 1
    assert resource["CapacityReservationTarget"] == {"CapacityReservationId": block}
    assert queue["Networking"]["PlacementGroup"] == {"Enabled": False}
    assert {"CapacityReservationValidator", "EfaValidator"} <= set(report.executed_validators)
    assert (
        INSTANCE_TYPES["trn2.48xlarge"]["NetworkInfo"]["MaximumNetworkCards"] == HARDWARE["trn2.48xlarge"].efa_devices
    )


def node_software_of(env: Synthesized) -> tuple[dict[str, Any], list[list[str]], dict[str, Any]]:
    """The resolved cluster configuration, every node's OnNodeConfigured arguments, and the pipeline trigger's
    properties."""
    configuration = resolved_configuration(env)
    queues = configuration["Scheduling"]["SlurmQueues"]
    actions = (configuration["HeadNode"]["CustomActions"], *(queue["CustomActions"] for queue in queues))
    (trigger,) = [r for r in env.template["Resources"].values() if "RequirementsInSource" in r.get("Properties", {})]
    return configuration, [a["OnNodeConfigured"]["Args"] for a in actions], trigger["Properties"]


def assert_installs(env: Synthesized, backend: str) -> dict[str, Any]:
    """Every node gets `backend`'s release, environment and lock, and the pipeline rebuilds that environment from
    the same lock in the shipped source."""
    software = NODE_SOFTWARE[backend]  # type: ignore[index]
    release = software.release()
    configuration, arguments, trigger = node_software_of(env)
    for node in arguments:
        assert node[:4] == ["--neuron-release", release, "--shared-env", f"/fsx/envs/{software.env_prefix}-{release}"]
        assert node[4] == "--requirements" and node[5].endswith(f"/cluster/{software.lock.name}")
    assert (trigger["NeuronRelease"], trigger["RequirementsInSource"]) == (release, f"assets/node/{software.lock.name}")
    return configuration


def test_a_trn1_queue_keeps_neuron_2_28(default_env: Synthesized) -> None:
    assert default_env.config.compute.node_software == NODE_SOFTWARE["neuron"]
    assert_installs(default_env, "neuron")


def test_a_trn2_queue_installs_the_pinned_torchneuron_release(tmp_path: Path, torchneuron_pinned: Path) -> None:
    """A trn2 queue's own software once TorchNeuron's block is pinned (test versions): its release, environment
    and lock on every node, on Ubuntu 24.04, which ParallelCluster's own validators accept with the instance type."""
    env = synthesize_variant(
        tmp_path, {"os": "ubuntu2404", "compute": {"instance_type": "trn2.48xlarge", "max_count": 1}}
    )
    assert env.config.compute.node_software == NODE_SOFTWARE["torch-native"]
    configuration = assert_installs(env, "torch-native")
    assert configuration["Image"]["Os"] == "ubuntu2404"
    report = run_offline_validation(
        configuration, cluster_name=env.config.cluster_name, region=env.config.region, **account_of(env)
    )
    assert errors_of(report.findings) == []


def test_parallelcluster_rejects_a_reservation_of_another_type_zone_or_size(tmp_path: Path) -> None:
    """Fed a reservation that does not fit what the environment file says, ParallelCluster says why: the check
    the deploy would fail on, seen before it."""
    env = synthesize_variant(tmp_path, CAPACITY_CASES["capacity-block"])
    configuration = resolved_configuration(env)
    wrong = reservation(BLOCK, instance_type="trn1n.32xlarge", zone="us-west-2b", count=2, kind="default")
    findings = validate_cluster_config(
        configuration,
        cluster_name="trn1-llama",
        region="us-west-2",
        capacity_reservations={BLOCK: wrong},
        **account_of(env),
    )
    messages = " | ".join(f.message for f in errors_of(findings))
    assert "must have the same instance type as trn1.32xlarge" in messages
    assert "must use the same availability zone" in messages
    assert "is not a Capacity Block reservation" in messages
    assert "is exceeding the total instances count available for the Capacity Reservation: 2" in messages
