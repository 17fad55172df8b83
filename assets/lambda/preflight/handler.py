"""Preflight: refuse in seconds, before anything bills, an environment the account cannot run.

A Lambda-backed CloudFormation custom resource that the NAT gateway, the file system and the cluster depend
on. On Create and Update it asks AWS what only the account knows, and fails with one line naming every problem:

- the zone (a name or an ID; names differ per account, IDs do not) offers every instance type the environment
  uses (DescribeInstanceTypeOfferings by zone ID);
- the account's Service Quotas cover the vCPUs of every queue at its largest, per instance family and purchase
  option, and the FSx for Lustre scratch capacity;
- a capacity reservation or Capacity Block is active (or, for a block, scheduled to start within the hour),
  of the environment's type, instance type and zone, and holds at least the queue's largest node count;
- a custom image exists and is available.

Delete does nothing. Only the standard library and boto3 (the Lambda Python runtime's).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

MAX_REASON = 3000  # CloudFormation refuses a response body over 4 KiB
PHYSICAL_ID = "preflight"
# EC2's vCPU quotas per family and purchase option (Service Quotas, service code ec2). Families not listed
# have other quotas; the deploy then relies on ParallelCluster's own launch checks for them.
STANDARD_FAMILIES = frozenset("acdhimrtz")
VCPU_QUOTAS = {
    ("trn", "on-demand"): ("L-2C3B7624", "Running On-Demand Trn instances"),
    ("trn", "spot"): ("L-6B0D517C", "All Trn Spot Instance Requests"),
    ("standard", "on-demand"): ("L-1216C47A", "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances"),
    ("standard", "spot"): ("L-34B43A08", "All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests"),
}
# FSx's scratch capacity quota is found by name: its code is not in AWS's public docs.
FSX_SCRATCH_QUOTA_WORDS = ("lustre", "scratch", "capacity")
# A Capacity Block bought for later is refused unless it starts within this long (the deploy's own length).
BLOCK_START_GRACE = timedelta(hours=1)
# EFA has no Service Quota of its own: its interfaces count as the instances' network interfaces, which the
# instance types define (ParallelCluster adds one per network card).

ClientFactory = Callable[[str], Any]


def aws_client(service: str) -> Any:
    return boto3.client(service, config=Config(retries={"mode": "standard", "max_attempts": 5}))


@dataclass(frozen=True)
class Nodes:
    """One kind of node at its largest: a queue (or the head node), its type, count and purchase option."""

    role: str
    instance_type: str
    count: int
    purchase: str  # on-demand, spot, reservation or capacity-block


@dataclass(frozen=True)
class Checks:
    zone: str
    nodes: tuple[Nodes, ...]
    fsx_scratch_gib: int
    capacity_type: str
    reservation_id: str
    resource_group_arn: str
    custom_ami: str


def parse(raw: Mapping[str, Any]) -> Checks:
    """The resource properties (CloudFormation passes numbers as strings)."""
    try:
        nodes = tuple(
            Nodes(str(n["Role"]), str(n["InstanceType"]), int(n["Count"]), str(n["Purchase"])) for n in raw["Nodes"]
        )
        return Checks(
            zone=str(raw["Zone"]),
            nodes=nodes,
            fsx_scratch_gib=int(raw["FsxScratchGib"]),
            capacity_type=str(raw.get("CapacityType", "on-demand")),
            reservation_id=str(raw.get("CapacityReservationId", "")),
            resource_group_arn=str(raw.get("CapacityResourceGroupArn", "")),
            custom_ami=str(raw.get("CustomAmi", "")),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"preflight: malformed properties ({error!r})") from None


# --- the checks: each returns problems, one line each ---------------------------------------------------


def resolve_zone(ec2: Any, zone: str) -> tuple[str, str]:
    """(zone ID, zone name) of a zone given either way."""
    key = "ZoneIds" if "-az" in zone else "ZoneNames"
    (found,) = ec2.describe_availability_zones(**{key: [zone]})["AvailabilityZones"]
    return str(found["ZoneId"]), str(found["ZoneName"])


def zone_label(zone_id: str, zone_name: str) -> str:
    return f"zone {zone_id} ({zone_name} in this account)"


def offering_problems(ec2: Any, zone_id: str, zone_name: str, nodes: Sequence[Nodes]) -> list[str]:
    wanted = sorted({n.instance_type for n in nodes})
    pages = ec2.get_paginator("describe_instance_type_offerings").paginate(
        LocationType="availability-zone-id",
        Filters=[{"Name": "location", "Values": [zone_id]}, {"Name": "instance-type", "Values": wanted}],
    )
    offered = {o["InstanceType"] for page in pages for o in page["InstanceTypeOfferings"]}
    return [
        f"{zone_label(zone_id, zone_name)} does not offer {t} ({roles_of(nodes, t)}); allowed: a zone that does "
        "(aws ec2 describe-instance-type-offerings --location-type availability-zone-id)"
        for t in wanted
        if t not in offered
    ]


def roles_of(nodes: Sequence[Nodes], instance_type: str) -> str:
    return ", ".join(n.role for n in nodes if n.instance_type == instance_type)


def family_of(instance_type: str) -> str | None:
    """The vCPU quota family of an instance type: trn, standard, or None for one this check does not cover."""
    family = instance_type.split(".")[0]
    if family.startswith("trn"):
        return "trn"
    return "standard" if family[:1] in STANDARD_FAMILIES else None


def quota_value(quotas: Any, service: str, code: str) -> float | None:
    """The account's value of a quota, its default when the account has none applied, None if unknown."""
    for call in (quotas.get_service_quota, quotas.get_aws_default_service_quota):
        try:
            return float(call(ServiceCode=service, QuotaCode=code)["Quota"]["Value"])
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") != "NoSuchResourceException":
                raise
    return None


def vcpu_problems(ec2: Any, quotas: Any, nodes: Sequence[Nodes]) -> list[str]:
    """vCPUs every queue needs at its largest, per quota, against the account's quota."""
    types = sorted({n.instance_type for n in nodes})
    described = ec2.describe_instance_types(InstanceTypes=types)["InstanceTypes"]
    vcpus = {t["InstanceType"]: int(t["VCpuInfo"]["DefaultVCpus"]) for t in described}
    needed: dict[tuple[str, str], int] = {}
    for n in nodes:
        family = family_of(n.instance_type)
        if n.purchase == "capacity-block" or family is None:
            continue  # a block is bought whole, outside the vCPU quotas
        purchase = "spot" if n.purchase == "spot" else "on-demand"  # a reservation runs on-demand instances
        needed[(family, purchase)] = needed.get((family, purchase), 0) + n.count * vcpus[n.instance_type]
    problems = []
    for key, count in sorted(needed.items()):
        code, name = VCPU_QUOTAS[key]
        value = quota_value(quotas, "ec2", code)
        if value is not None and value < count:
            problems.append(
                f'Service Quotas: "{name}" ({code}) is {value:g} vCPUs, the environment needs {count}; '
                "allowed: a quota raised to at least that (Service Quotas console, or fewer/smaller nodes)"
            )
    return problems


def fsx_problems(quotas: Any, capacity_gib: int) -> list[str]:
    pages = quotas.get_paginator("list_service_quotas").paginate(ServiceCode="fsx")
    for page in pages:
        for quota in page["Quotas"]:
            name = str(quota["QuotaName"])
            if all(word in name.lower() for word in FSX_SCRATCH_QUOTA_WORDS) and quota["Value"] < capacity_gib:
                return [
                    f'Service Quotas: "{name}" ({quota["QuotaCode"]}) is {quota["Value"]:g} GiB, the file system '
                    f"needs {capacity_gib}; allowed: a quota raised to at least that, or a smaller "
                    "storage.fsx_capacity_gib"
                ]
    return []


def reservation_problems(ec2: Any, rgroups: Any, checks: Checks, zone_id: str, now: datetime) -> list[str]:
    """The reservation or block the Trainium queue launches into fits it."""
    if not (checks.reservation_id or checks.resource_group_arn):
        return []
    queue = checks.nodes[0]
    ids = [checks.reservation_id] if checks.reservation_id else group_reservations(rgroups, checks.resource_group_arn)
    if not ids:
        return [f"capacity resource group {checks.resource_group_arn} holds no capacity reservation"]
    try:
        found = ec2.describe_capacity_reservations(CapacityReservationIds=ids)["CapacityReservations"]
    except ClientError as error:
        if error.response.get("Error", {}).get("Code", "").startswith("InvalidCapacityReservationId"):
            return [f"capacity reservation {', '.join(ids)} does not exist in this account and region"]
        raise
    problems, total = [], 0
    want_type = "capacity-block" if checks.capacity_type == "capacity-block" else "default"
    for reservation in found:
        rid, state = reservation["CapacityReservationId"], reservation["State"]
        start = reservation.get("StartDate")
        starts_soon = state == "scheduled" and start is not None and start - now <= BLOCK_START_GRACE
        if state != "active" and not starts_soon:
            when = f", starting {start:%Y-%m-%d %H:%M} UTC" if state == "scheduled" and start is not None else ""
            problems.append(f"capacity reservation {rid} is {state}{when}; allowed: an active one")
        if reservation.get("ReservationType", "default") != want_type:
            problems.append(
                f"capacity reservation {rid} is of type {reservation.get('ReservationType', 'default')}, "
                f"not {want_type} as compute.capacity.type {checks.capacity_type} says"
            )
        if reservation["InstanceType"] != queue.instance_type:
            problems.append(
                f"capacity reservation {rid} holds {reservation['InstanceType']}, not {queue.instance_type}"
            )
        if reservation.get("AvailabilityZoneId") != zone_id:
            problems.append(
                f"capacity reservation {rid} is in zone {reservation.get('AvailabilityZoneId')}, not {zone_id}"
            )
        total += int(reservation["TotalInstanceCount"])
    if total < queue.count:
        problems.append(
            f"capacity reservation {', '.join(ids)} holds {total} instances, the {queue.role} queue needs "
            f"{queue.count}; allowed: compute.max_count at most {total}"
        )
    return problems


def group_reservations(rgroups: Any, group_arn: str) -> list[str]:
    pages = rgroups.get_paginator("list_group_resources").paginate(Group=group_arn)
    arns = [r["Identifier"]["ResourceArn"] for page in pages for r in page.get("Resources", [])]
    return sorted(arn.rsplit("/", 1)[-1] for arn in arns if ":capacity-reservation/" in arn)


def image_problems(ec2: Any, ami: str) -> list[str]:
    if not ami:
        return []
    try:
        images = ec2.describe_images(ImageIds=[ami])["Images"]
    except ClientError as error:
        if error.response.get("Error", {}).get("Code", "").startswith("InvalidAMIID"):
            images = []
        else:
            raise
    if not images:
        return [f"custom image {ami} (compute.custom_ami) does not exist in this region or is not shared with it"]
    state = images[0].get("State")
    return [] if state == "available" else [f"custom image {ami} is {state}; allowed: an available image"]


def problems_of(checks: Checks, clients: ClientFactory, now: datetime) -> list[str]:
    ec2, quotas = clients("ec2"), clients("service-quotas")
    zone_id, zone_name = resolve_zone(ec2, checks.zone)
    problems = offering_problems(ec2, zone_id, zone_name, checks.nodes)
    problems += vcpu_problems(ec2, quotas, checks.nodes)
    problems += fsx_problems(quotas, checks.fsx_scratch_gib)
    if checks.reservation_id or checks.resource_group_arn:
        problems += reservation_problems(ec2, clients("resource-groups"), checks, zone_id, now)
    problems += image_problems(ec2, checks.custom_ami)
    return problems


# --- the custom resource --------------------------------------------------------------------------------


def one_line(text: str, limit: int = MAX_REASON) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 5] + " ..."


def outcome(event: Mapping[str, Any], clients: ClientFactory, now: datetime) -> tuple[str, str]:
    """(SUCCESS or FAILED, reason) of one request."""
    if event["RequestType"] == "Delete":
        return "SUCCESS", ""
    try:
        problems = problems_of(parse(event.get("ResourceProperties") or {}), clients, now)
    except ValueError as error:
        return "FAILED", one_line(str(error))
    except (ClientError, BotoCoreError) as error:
        return "FAILED", one_line(f"preflight could not ask AWS: {error}")
    if problems:
        return "FAILED", one_line("preflight: " + "; ".join(problems))
    return "SUCCESS", ""


def respond(event: Mapping[str, Any], status: str, reason: str) -> None:
    """Answer CloudFormation at the request's pre-signed URL."""
    body = json.dumps(
        {
            "Status": status,
            "Reason": reason or "checked",
            "PhysicalResourceId": event.get("PhysicalResourceId", PHYSICAL_ID),
            "StackId": event["StackId"],
            "RequestId": event["RequestId"],
            "LogicalResourceId": event["LogicalResourceId"],
            "NoEcho": False,
            "Data": {},
        }
    ).encode()
    request = urllib.request.Request(
        event["ResponseURL"], data=body, method="PUT", headers={"Content-Type": "", "Content-Length": str(len(body))}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()


def handler(
    event: Mapping[str, Any],
    context: Any = None,
    *,
    clients: ClientFactory = aws_client,
    now: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
) -> None:
    try:
        status, reason = outcome(event, clients, now())
    except Exception as error:  # CloudFormation waits an hour for an answer that never comes
        status, reason = "FAILED", one_line(f"preflight failed: {error!r}")
    print(json.dumps({"RequestType": event.get("RequestType"), "Status": status, "Reason": reason}))
    respond(event, status, reason)
