"""The preflight runs before anything that bills: the NAT gateway, its address, the file system and the cluster
wait for it, it waits for nothing that bills, and its properties are everything it checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stacks.application import ENVIRONMENTS_DIR
from stacks.config import load_environment
from stacks.preflight import READ_ACTIONS
from tests.support.synthesis import Synthesized, synthesize_config

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)

BILLING = ("AWS::EC2::NatGateway", "AWS::EC2::EIP", "AWS::FSx::FileSystem", "Custom::PclusterCluster")


def preflight(env: Synthesized) -> tuple[str, dict[str, Any]]:
    ((name, resource),) = env.resources_of_type("Custom::Preflight").items()
    return name, resource


def depends_on(resource: dict[str, Any]) -> list[str]:
    value = resource.get("DependsOn", [])
    return [value] if isinstance(value, str) else list(value)


def test_everything_that_bills_waits_for_the_preflight(synthesized: dict[str, Synthesized]) -> None:
    for env in synthesized.values():
        name, resource = preflight(env)
        for kind in BILLING:
            for logical, waiting in env.resources_of_type(kind).items():
                assert name in depends_on(waiting), f"{env.config.name}: {logical} ({kind}) does not wait"
        # The preflight itself waits only for its function's role and policy.
        types = {env.template["Resources"][d]["Type"] for d in depends_on(resource)}
        assert types <= {"AWS::IAM::Role", "AWS::IAM::Policy"}, types


def test_its_properties_are_what_it_checks(default_env: Synthesized) -> None:
    _, resource = preflight(default_env)
    properties = resource["Properties"]
    assert properties["Zone"] == "usw2-az4"
    assert properties["Nodes"] == [
        {"Role": "queue compute1", "InstanceType": "trn1.32xlarge", "Count": 4, "Purchase": "on-demand"},
        {"Role": "queue cpu", "InstanceType": "r6a.8xlarge", "Count": 2, "Purchase": "on-demand"},
        {"Role": "head node", "InstanceType": "m6a.2xlarge", "Count": 1, "Purchase": "on-demand"},
    ]
    assert properties["FsxScratchGib"] == 1200
    assert (properties["CapacityReservationId"], properties["CustomAmi"]) == ("", "")


def test_its_role_only_reads(default_env: Synthesized) -> None:
    _, resource = preflight(default_env)
    function = default_env.template["Resources"][resource["Properties"]["ServiceToken"]["Fn::GetAtt"][0]]
    role = function["Properties"]["Role"]["Fn::GetAtt"][0]
    (policy,) = (
        p
        for p in default_env.resources_of_type("AWS::IAM::Policy").values()
        if {"Ref": role} in p["Properties"]["Roles"]
    )
    statements = policy["Properties"]["PolicyDocument"]["Statement"]
    reads = [s for s in statements if s["Resource"] == "*"]
    assert [sorted(s["Action"]) for s in reads] == [sorted(READ_ACTIONS)]
    assert all(a.split(":")[1].startswith(("Describe", "Get", "List")) for a in READ_ACTIONS)


def test_a_capacity_block_and_a_baked_image_are_checked(tmp_path: Path) -> None:
    config = load_environment("default", ENVIRONMENTS_DIR)
    capacity = config.compute.capacity.model_copy(
        update={"type": "capacity-block", "reservation_id": "cr-0123456789abcdef0"}
    )
    compute = config.compute.model_copy(update={"capacity": capacity, "custom_ami": "ami-0123456789abcdef0"})
    env = synthesize_config(config.model_copy(update={"compute": compute}), tmp_path)
    properties = preflight(env)[1]["Properties"]
    assert properties["CapacityType"] == "capacity-block"
    assert properties["CapacityReservationId"] == "cr-0123456789abcdef0"
    assert properties["CustomAmi"] == "ami-0123456789abcdef0"
    assert properties["Nodes"][0]["Purchase"] == "capacity-block"
    queue = env.only("Custom::PclusterCluster")["Properties"]["ClusterConfiguration"]["Scheduling"]["SlurmQueues"][0]
    assert queue["Image"] == {"CustomAmi": "ami-0123456789abcdef0"}
