"""The preflight custom resource (assets/lambda/preflight/handler.py) against botocore's Stubber.

Every AWS answer is stubbed with the real API models (parameters and responses are validated), and the answer to
CloudFormation goes to a real HTTP server on the loopback address, as the Lambda sends it to the pre-signed URL.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from stacks.config import load_environment
from stacks.preflight import preflight_checks
from tests.support.lambda_handlers import load_handler_file

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)

ROOT = Path(__file__).resolve().parents[2]
handler = load_handler_file(ROOT / "assets" / "lambda" / "preflight" / "handler.py", "preflight_handler")
REGION = "us-west-2"
NOW = datetime(2026, 12, 2, 12, 0, tzinfo=timezone.utc)
ZONE_ID, ZONE_NAME = "usw2-az4", "us-west-2d"
VCPUS = {
    "trn1.32xlarge": 128,
    "trn1.2xlarge": 8,
    "trn2.48xlarge": 192,
    "r6a.8xlarge": 32,
    "m6a.2xlarge": 8,
    "r6a.2xlarge": 8,
}
RESERVATION = "cr-0123456789abcdef0"


def default_properties(name: str = "default", **capacity: Any) -> dict[str, Any]:
    """An environment's properties as the stack passes them (numbers become strings in CloudFormation)."""
    config = load_environment(name)
    if capacity:
        compute = config.compute.model_copy(update={"capacity": config.compute.capacity.model_copy(update=capacity)})
        config = config.model_copy(update={"compute": compute})
    raw = preflight_checks(config).properties()
    raw["Nodes"] = [{key: str(value) for key, value in node.items()} for node in raw["Nodes"]]
    raw["FsxScratchGib"] = str(raw["FsxScratchGib"])
    return raw


class Aws:
    """Stubbed clients per service; every queued answer must be used."""

    def __init__(self) -> None:
        self.stubbers: dict[str, Stubber] = {}
        self.clients: dict[str, Any] = {}

    def __call__(self, service: str) -> Any:
        if service not in self.clients:
            client = boto3.client(
                service, region_name=REGION, aws_access_key_id="testing", aws_secret_access_key="testing"
            )
            self.stubbers[service] = Stubber(client)
            self.stubbers[service].activate()
            self.clients[service] = client
        return self.clients[service]

    def stub(self, service: str) -> Stubber:
        self(service)
        return self.stubbers[service]


@pytest.fixture
def aws() -> Iterator[Aws]:
    stubs = Aws()
    yield stubs
    for stubber in stubs.stubbers.values():
        stubber.assert_no_pending_responses()


def zone(aws: Aws, given: str = ZONE_ID, found: tuple[str, str, str] = (ZONE_ID, ZONE_NAME, REGION)) -> None:
    key = "ZoneIds" if "-az" in given else "ZoneNames"
    zone_id, zone_name, region = found
    aws.stub("ec2").add_response(
        "describe_availability_zones",
        {"AvailabilityZones": [{"ZoneId": zone_id, "ZoneName": zone_name, "RegionName": region, "State": "available"}]},
        {key: [given]},
    )


def offerings(aws: Aws, offered: list[str], wanted: list[str], zone_id: str = ZONE_ID) -> None:
    aws.stub("ec2").add_response(
        "describe_instance_type_offerings",
        {
            "InstanceTypeOfferings": [
                {"InstanceType": t, "LocationType": "availability-zone-id", "Location": zone_id} for t in offered
            ]
        },
        {
            "LocationType": "availability-zone-id",
            "Filters": [{"Name": "location", "Values": [zone_id]}, {"Name": "instance-type", "Values": wanted}],
        },
    )


def instance_types(aws: Aws, types: list[str]) -> None:
    aws.stub("ec2").add_response(
        "describe_instance_types",
        {"InstanceTypes": [{"InstanceType": t, "VCpuInfo": {"DefaultVCpus": VCPUS[t]}} for t in types]},
        {"InstanceTypes": types},
    )


def quota(aws: Aws, code: str, value: float | None) -> None:
    """GetServiceQuota answers the account's value; without one, the default is asked."""
    stub = aws.stub("service-quotas")
    params = {"ServiceCode": "ec2", "QuotaCode": code}
    if value is None:
        stub.add_client_error("get_service_quota", "NoSuchResourceException", expected_params=params)
        stub.add_response("get_aws_default_service_quota", {"Quota": {"QuotaCode": code, "Value": 0.0}}, params)
    else:
        stub.add_response("get_service_quota", {"Quota": {"QuotaCode": code, "Value": value}}, params)


def fsx_quota(aws: Aws, value: float) -> None:
    aws.stub("service-quotas").add_response(
        "list_service_quotas",
        {
            "Quotas": [
                {"QuotaCode": "L-1A2B3C4D", "QuotaName": "File systems per account", "Value": 100.0},
                {"QuotaCode": "L-5E6F7A8B", "QuotaName": "Lustre Scratch storage capacity", "Value": value},
            ]
        },
        {"ServiceCode": "fsx"},
    )


WANTED = ["m6a.2xlarge", "r6a.8xlarge", "trn1.32xlarge"]


def account(
    aws: Aws,
    *,
    given: str = ZONE_ID,
    offered: tuple[str, ...] = tuple(WANTED),
    standard: float | None = 640,
    trn: tuple[str, float] | None = ("L-2C3B7624", 512),
    fsx: float = 100800,
) -> None:
    """The answers the checks ask for, in their order: zone, offerings, vCPUs, quotas (a block asks no Trn one)."""
    zone(aws, given)
    offerings(aws, list(offered), WANTED)
    instance_types(aws, WANTED)
    quota(aws, "L-1216C47A", standard)  # 2 x 32 + 8 = 72 vCPUs needed
    if trn is not None:
        quota(aws, *trn)  # 4 x 128 = 512 vCPUs needed
    fsx_quota(aws, fsx)


def healthy_account(aws: Aws, *, trn_quota: float = 512) -> None:
    account(aws, trn=("L-2C3B7624", trn_quota))


def problems(aws: Aws, properties: dict[str, Any] | None = None) -> list[str]:
    checks = handler.parse(properties or default_properties())
    return list(handler.problems_of(checks, aws, NOW))


def test_the_default_environment_on_a_healthy_account_passes(aws: Aws) -> None:
    healthy_account(aws)
    assert problems(aws) == []


def test_a_zone_without_trn1_is_refused_naming_the_zone_both_ways(aws: Aws) -> None:
    account(aws, offered=("m6a.2xlarge", "r6a.8xlarge"))
    assert problems(aws) == [
        "zone usw2-az4 (us-west-2d in this account) does not offer trn1.32xlarge (queue compute1); allowed: a zone "
        "that does (aws ec2 describe-instance-type-offerings --location-type availability-zone-id)"
    ]


def test_a_zone_given_by_name_is_resolved_to_its_id(aws: Aws) -> None:
    properties = default_properties() | {"Zone": ZONE_NAME}
    account(aws, given=ZONE_NAME)
    assert problems(aws, properties) == []


def test_quotas_below_the_largest_environment_are_refused(aws: Aws) -> None:
    account(aws, standard=None, trn=("L-2C3B7624", 256), fsx=1000)  # None: no applied value, the default (0) counts
    assert problems(aws) == [
        'Service Quotas: "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances" (L-1216C47A) is 0 vCPUs, '
        "the environment needs 72; allowed: a quota raised to at least that (Service Quotas console, or fewer/smaller "
        "nodes)",
        'Service Quotas: "Running On-Demand Trn instances" (L-2C3B7624) is 256 vCPUs, the environment needs 512; '
        "allowed: a quota raised to at least that (Service Quotas console, or fewer/smaller nodes)",
        'Service Quotas: "Lustre Scratch storage capacity" (L-5E6F7A8B) is 1000 GiB, the file system needs 1200; '
        "allowed: a quota raised to at least that, or a smaller storage.fsx_capacity_gib",
    ]


def test_spot_nodes_are_checked_against_the_spot_quota(aws: Aws) -> None:
    account(aws, trn=("L-6B0D517C", 128))
    (problem,) = problems(aws, default_properties(type="spot"))
    assert problem.startswith('Service Quotas: "All Trn Spot Instance Requests" (L-6B0D517C) is 128 vCPUs')


def reservation(**changes: Any) -> dict[str, Any]:
    found = {
        "CapacityReservationId": RESERVATION,
        "InstanceType": "trn1.32xlarge",
        "InstancePlatform": "Linux/UNIX",
        "AvailabilityZone": ZONE_NAME,
        "AvailabilityZoneId": ZONE_ID,
        "TotalInstanceCount": 4,
        "AvailableInstanceCount": 4,
        "State": "active",
        "ReservationType": "capacity-block",
        "StartDate": NOW - timedelta(hours=2),
    }
    return found | changes


def block_account(aws: Aws, found: dict[str, Any]) -> None:
    account(aws, trn=None)  # a block's nodes count against no vCPU quota
    aws.stub("ec2").add_response(
        "describe_capacity_reservations", {"CapacityReservations": [found]}, {"CapacityReservationIds": [RESERVATION]}
    )


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, []),
        ({"State": "scheduled", "StartDate": NOW + timedelta(minutes=30)}, []),  # starts while the deploy runs
        (
            {"State": "scheduled", "StartDate": NOW + timedelta(days=2)},
            [f"capacity reservation {RESERVATION} is scheduled, starting 2026-12-04 12:00 UTC; allowed: an active one"],
        ),
        ({"State": "expired"}, [f"capacity reservation {RESERVATION} is expired; allowed: an active one"]),
        (
            {"ReservationType": "default"},
            [
                f"capacity reservation {RESERVATION} is of type default, not capacity-block as compute.capacity.type "
                "capacity-block says"
            ],
        ),
        (
            {"InstanceType": "trn1n.32xlarge"},
            [f"capacity reservation {RESERVATION} holds trn1n.32xlarge, not trn1.32xlarge"],
        ),
        (
            {"AvailabilityZoneId": "usw2-az1", "AvailabilityZone": "us-west-2a"},
            [f"capacity reservation {RESERVATION} is in zone usw2-az1, not usw2-az4"],
        ),
        (
            {"TotalInstanceCount": 2},
            [
                f"capacity reservation {RESERVATION} holds 2 instances, the queue compute1 queue needs 4; "
                "allowed: compute.max_count at most 2"
            ],
        ),
    ],
    ids=["active", "starts-soon", "starts-later", "expired", "wrong-type", "instance-type", "zone", "too-small"],
)
def test_a_capacity_block_must_be_active_and_fit(aws: Aws, changes: dict[str, Any], expected: list[str]) -> None:
    block_account(aws, reservation(**changes))
    assert problems(aws, default_properties(type="capacity-block", reservation_id=RESERVATION)) == expected


TRN2_ZONE = ("use2-az3", "us-east-2c", "us-east-2")  # environments/trn2.yaml's zone
TRN2_WANTED = ["m6a.2xlarge", "r6a.8xlarge", "trn2.48xlarge"]


def trn2_account(aws: Aws, offered: list[str], trn_quota: float | None) -> None:
    zone(aws, TRN2_ZONE[0], TRN2_ZONE)
    offerings(aws, offered, TRN2_WANTED, zone_id=TRN2_ZONE[0])
    instance_types(aws, TRN2_WANTED)
    quota(aws, "L-1216C47A", 640)
    if trn_quota is not None:
        quota(aws, "L-2C3B7624", trn_quota)
    fsx_quota(aws, 100800)


def test_trn2_on_demand_needs_192_trn_vcpus_a_node_in_a_zone_that_offers_it(aws: Aws) -> None:
    """The Trn quota covers trn2 as trn1 (vCPUs: 192 a trn2.48xlarge); the zone must offer the type."""
    trn2_account(aws, ["m6a.2xlarge", "r6a.8xlarge"], trn_quota=128)
    assert problems(aws, default_properties("trn2", type="on-demand", reservation_id=None)) == [
        "zone use2-az3 (us-east-2c in this account) does not offer trn2.48xlarge (queue trn2); allowed: a zone that "
        "does (aws ec2 describe-instance-type-offerings --location-type availability-zone-id)",
        'Service Quotas: "Running On-Demand Trn instances" (L-2C3B7624) is 128 vCPUs, the environment needs 192; '
        "allowed: a quota raised to at least that (Service Quotas console, or fewer/smaller nodes)",
    ]


def test_the_trn2_environments_block_must_hold_trn2_in_its_zone(aws: Aws) -> None:
    """environments/trn2.yaml as it is: no Trn quota asked (a block is bought whole), its block checked."""
    trn2_account(aws, TRN2_WANTED, trn_quota=None)
    block = load_environment("trn2").compute.capacity.reservation_id
    found = reservation(
        CapacityReservationId=block,
        InstanceType="trn1.32xlarge",
        AvailabilityZone=TRN2_ZONE[1],
        AvailabilityZoneId=TRN2_ZONE[0],
        TotalInstanceCount=1,
        AvailableInstanceCount=1,
    )
    aws.stub("ec2").add_response(
        "describe_capacity_reservations", {"CapacityReservations": [found]}, {"CapacityReservationIds": [block]}
    )
    assert problems(aws, default_properties("trn2")) == [
        f"capacity reservation {block} holds trn1.32xlarge, not trn2.48xlarge"
    ]


def test_a_reservation_that_does_not_exist_is_one_line(aws: Aws) -> None:
    account(aws)
    aws.stub("ec2").add_client_error(
        "describe_capacity_reservations",
        "InvalidCapacityReservationId.NotFound",
        expected_params={"CapacityReservationIds": [RESERVATION]},
    )
    assert problems(aws, default_properties(type="reservation", reservation_id=RESERVATION)) == [
        f"capacity reservation {RESERVATION} does not exist in this account and region"
    ]


def test_a_custom_image_must_exist_and_be_available(aws: Aws) -> None:
    properties = default_properties() | {"CustomAmi": "ami-0123456789abcdef0"}
    for images, expected in (
        ([], "custom image ami-0123456789abcdef0 (compute.custom_ami) does not exist in this region"),
        ([{"ImageId": "ami-0123456789abcdef0", "State": "pending"}], "custom image ami-0123456789abcdef0 is pending"),
    ):
        healthy_account(aws)
        aws.stub("ec2").add_response("describe_images", {"Images": images}, {"ImageIds": ["ami-0123456789abcdef0"]})
        (problem,) = problems(aws, properties)
        assert problem.startswith(expected)


@dataclass
class Endpoint:
    """CloudFormation's pre-signed URL, served on the loopback address, and the answers it received."""

    url: str
    bodies: list[dict[str, Any]]


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    received: list[dict[str, Any]] = []

    class Recorder(BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            length = int(self.headers["Content-Length"])
            received.append(json.loads(self.rfile.read(length)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield Endpoint(f"http://127.0.0.1:{server.server_address[1]}/response", received)
    server.shutdown()


def cfn_event(request: str, url: str, properties: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "RequestType": request,
        "ResponseURL": url,
        "StackId": "arn:aws:cloudformation:us-west-2:123456789012:stack/trainium-default/1",
        "RequestId": "request-1",
        "LogicalResourceId": "Preflight",
        "ResourceType": "Custom::Preflight",
        "ResourceProperties": properties or default_properties(),
    }


def test_a_refusal_reaches_cloudformation_as_one_line(aws: Aws, endpoint: Endpoint) -> None:
    healthy_account(aws, trn_quota=0)

    handler.handler(cfn_event("Create", endpoint.url), None, clients=aws, now=lambda: NOW)

    (body,) = endpoint.bodies
    assert body["Status"] == "FAILED"
    assert body["Reason"].startswith('preflight: Service Quotas: "Running On-Demand Trn instances" (L-2C3B7624) is 0')
    assert "\n" not in body["Reason"] and len(body["Reason"]) <= handler.MAX_REASON
    assert (body["PhysicalResourceId"], body["LogicalResourceId"], body["RequestId"]) == (
        "preflight",
        "Preflight",
        "request-1",
    )


def test_aws_errors_and_deletes_are_answered_too(aws: Aws, endpoint: Endpoint) -> None:
    url = endpoint.url
    aws.stub("ec2").add_client_error(
        "describe_availability_zones", "UnauthorizedOperation", "You are not authorized to perform this operation."
    )
    handler.handler(cfn_event("Update", url), None, clients=aws, now=lambda: NOW)
    handler.handler(cfn_event("Delete", url), None, clients=aws, now=lambda: NOW)
    handler.handler(cfn_event("Create", url, {"Zone": ZONE_ID}), None, clients=aws, now=lambda: NOW)

    failed, deleted, malformed = endpoint.bodies
    assert failed["Status"] == "FAILED"
    assert failed["Reason"].startswith("preflight could not ask AWS: An error occurred (UnauthorizedOperation)")
    assert (deleted["Status"], deleted["Reason"]) == ("SUCCESS", "checked")
    assert malformed["Status"] == "FAILED" and malformed["Reason"].startswith("preflight: malformed properties")
