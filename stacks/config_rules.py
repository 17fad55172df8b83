"""The environment file's rules across keys, and the AWS and ParallelCluster facts they check: what the types
alone cannot express (a zone of the region, a capacity FSx accepts, a recipe the deploy can start, a run that fits
the NeuronCores and the budget). `stacks.config.load_environment` applies them; one line per violation.
"""

from __future__ import annotations

import re
import typing
from typing import TYPE_CHECKING, Any

from stacks.instance_types import CPU_INSTANCE_TYPES
from training.config.hardware import HARDWARE
from training.config.loading import ConfigError
from training.config.recipe import Recipe, bundled_recipes, load_recipe, resolve_recipe_path
from training.errors import UserError
from training.software import NODE_OPERATING_SYSTEMS, NODE_SOFTWARE
from training.train.forecast import budget_refusal
from training.train.memory import refusal

if TYPE_CHECKING:  # stacks.config applies these rules to its model: it imports this module
    from stacks.config import ComputeConfig, EnvironmentConfig

# Image.Os values that ParallelCluster 3.16 accepts, and the subset the Neuron bootstrap supports.
PARALLELCLUSTER_OPERATING_SYSTEMS = (
    "alinux2023",
    "ubuntu2204",
    "ubuntu2404",
    "rhel8",
    "rocky8",
    "rhel9",
    "rocky9",
)
NEURON_OPERATING_SYSTEMS = ("ubuntu2204", "ubuntu2404")

CLUSTER_NAME_PATTERN = re.compile(r"^[a-zA-Z][a-zA-Z0-9-]{0,59}$")
REGION_PATTERN = re.compile(r"^[a-z]{2}(-gov)?-[a-z]+-\d+$")
ZONE_ID_PATTERN = re.compile(r"^([a-z]+[0-9]+)-az[0-9]+$")
# How a zone ID abbreviates a region's direction words (us-west-2 -> usw2, ap-northeast-1 -> apne1).
ZONE_ID_DIRECTIONS = {"northeast": "ne", "northwest": "nw", "southeast": "se", "southwest": "sw"}
SCRATCH_2_SMALL_CAPACITY_GIB = 1200
SCRATCH_2_CAPACITY_STEP_GIB = 2400
# FSx for Lustre's default quota of scratch storage per account and region, adjustable through Service Quotas:
# the default of `storage.fsx_quota_gib`, which an account with a raised quota raises in its environment file.
SCRATCH_2_DEFAULT_QUOTA_GIB = 100800


def zone_id_prefix(region: str) -> str:
    """The prefix of `region`'s zone IDs: us-west-2 -> usw2, ap-northeast-1 -> apne1, us-gov-west-1 -> usgw1."""
    first, *words, number = region.split("-")
    return first + "".join(ZONE_ID_DIRECTIONS.get(word, word[:1]) for word in words) + number


def validate(config: EnvironmentConfig) -> list[str]:
    """Rules across keys and facts types alone cannot express; one line per violation."""
    problems: list[str] = []

    def bad(key: str, value: Any, allowed: str) -> None:
        problems.append(f"{key}: {value!r} is not allowed; allowed: {allowed}")

    if not REGION_PATTERN.match(config.region):
        bad("region", config.region, "an AWS region code such as 'us-west-2'")
    zone_id = ZONE_ID_PATTERN.match(config.availability_zone)
    if zone_id is not None and REGION_PATTERN.match(config.region):
        if zone_id.group(1) != zone_id_prefix(config.region):
            bad(
                "availability_zone",
                config.availability_zone,
                f"a zone ID of {config.region} ({zone_id_prefix(config.region)}-az1, ...) or a zone name",
            )
    elif not re.fullmatch(re.escape(config.region) + r"[a-z]", config.availability_zone):
        bad(
            "availability_zone",
            config.availability_zone,
            f"a zone of {config.region}: a name such as '{config.region}d' or a zone ID such as "
            f"'{zone_id_prefix(config.region) if REGION_PATTERN.match(config.region) else 'usw2'}-az4'",
        )
    if not CLUSTER_NAME_PATTERN.match(config.cluster_name):
        bad(
            "cluster_name",
            config.cluster_name,
            "a letter followed by up to 59 letters, digits or '-' (ParallelCluster's rule)",
        )
    elif config.cluster_name == config.stack_name:
        bad("cluster_name", config.cluster_name, f"any name other than the stack name {config.stack_name!r}")
    if config.os not in PARALLELCLUSTER_OPERATING_SYSTEMS:
        bad("os", config.os, f"{', '.join(NEURON_OPERATING_SYSTEMS)} (ParallelCluster rejects it)")
    elif config.os not in NEURON_OPERATING_SYSTEMS:
        bad("os", config.os, f"{', '.join(NEURON_OPERATING_SYSTEMS)} (the Neuron bootstrap supports only these)")
    elif _software_runs(config.compute) and config.os not in config.compute.node_software.operating_systems:
        software = config.compute.node_software
        bad(
            "os",
            config.os,
            f"{', '.join(software.operating_systems)} for the {software.backend} backend's {software.title}: its "
            f"wheels need Python {' or '.join(NODE_OPERATING_SYSTEMS[o].python for o in software.operating_systems)}"
            " (ParallelCluster does not run Ubuntu 26.04)",
        )
    if config.network.ssh_key_name == "":
        bad("network.ssh_key_name", "", "an EC2 key pair name, or omit the key to use SSM only")
    _validate_compute(config.compute, bad)
    if config.head_node.instance_type not in CPU_INSTANCE_TYPES:
        bad("head_node.instance_type", config.head_node.instance_type, ", ".join(CPU_INSTANCE_TYPES))
    if config.cpu_queue is not None:
        if config.cpu_queue.instance_type not in CPU_INSTANCE_TYPES:
            bad("cpu_queue.instance_type", config.cpu_queue.instance_type, ", ".join(CPU_INSTANCE_TYPES))
        if config.cpu_queue.queue_name == config.compute.queue_name:
            bad("cpu_queue.queue_name", config.cpu_queue.queue_name, "a name other than compute.queue_name")
    capacity = config.storage.fsx_capacity_gib
    if capacity != SCRATCH_2_SMALL_CAPACITY_GIB and (capacity <= 0 or capacity % SCRATCH_2_CAPACITY_STEP_GIB):
        bad("storage.fsx_capacity_gib", capacity, "1200 or a multiple of 2400 (2400, 4800, ...) for SCRATCH_2")
    elif capacity > config.storage.fsx_quota_gib:
        bad(
            "storage.fsx_capacity_gib",
            capacity,
            f"at most storage.fsx_quota_gib, {config.storage.fsx_quota_gib} GiB (FSx for Lustre's scratch storage "
            f"quota per account and region, {SCRATCH_2_DEFAULT_QUOTA_GIB} by default; raise both once Service "
            "Quotas has raised it)",
        )
    for key, value in config.tags.items():
        if key.lower().startswith("aws:") or not 1 <= len(key) <= 128 or len(value) > 256:
            bad(f"tags.{key}", value, "keys of 1-128 characters not starting with 'aws:', values up to 256")
    _validate_pipeline(config, bad, problems.append)
    wandb = config.tracking.wandb
    if wandb is not None and wandb.mode == "online" and wandb.api_key_secret_arn is None:
        problems.append(
            "tracking.wandb.api_key_secret_arn: missing for online mode; allowed: the ARN of a Secrets Manager secret "
            "holding the W&B API key (the nodes have no other key), or tracking.wandb.mode offline"
        )
    if config.hub.push_repo is not None and config.hub.write_token_secret_arn is None:
        bad("hub.push_repo", config.hub.push_repo, "a repository with hub.write_token_secret_arn set, or no push_repo")
    return problems


def _validate_pipeline(
    config: EnvironmentConfig, bad: typing.Callable[[str, Any, str], None], refuse: typing.Callable[[str], None]
) -> None:
    pipeline, compute = config.pipeline, config.compute
    bundled = [name for name in bundled_recipes() if not name.startswith("tiny-")]
    if pipeline.recipe not in bundled:
        bad("pipeline.recipe", pipeline.recipe, f"a bundled recipe ({', '.join(bundled)})")
    malformed = False
    for override in pipeline.overrides:
        if "=" not in override or override.startswith("="):
            bad("pipeline.overrides", override, "recipe overrides as 'section.key=value'")
            malformed = True
    if pipeline.recipe in bundled and not malformed:
        # The run would fail at submission, after the cluster is built: load the recipe with them now.
        try:
            hardware = HARDWARE.get(compute.instance_type)
            generation = None if hardware is None else hardware.generation  # its `generations` section applied
            recipe = load_recipe(pipeline.recipe, pipeline.overrides, generation=generation)
        except UserError as error:
            problems = error.problems if isinstance(error, ConfigError) else [str(error)]
            for problem in problems:
                detail = problem.removeprefix(f"{resolve_recipe_path(pipeline.recipe)}: ")
                bad("pipeline.overrides", list(pipeline.overrides), f"what recipe {pipeline.recipe} accepts ({detail})")
            return
        software = compute.node_software
        if _software_runs(compute) and recipe.backend != software.backend:
            bad(
                "pipeline.recipe",
                pipeline.recipe,
                f"a recipe on the queue's software ({software.title}, compute.backend {software.backend}): the "
                f"recipe runs backend {recipe.backend} on {recipe.generation}; set compute.backend: {recipe.backend} "
                f"or override backend={software.backend}",
            )
            return
        # A run the deploy starts must fit the NeuronCores' memory: refuse before any Trainium node bills.
        if pipeline.start_run and hardware is not None:
            try:
                too_big = refusal(recipe, hardware)
            except UserError as error:
                too_big = str(error)
            if too_big is not None:
                bad("pipeline.recipe", pipeline.recipe, f"a recipe that fits: {too_big}")
            over = _over_budget(config, recipe)
            if over is not None:
                refuse(over)


def _over_budget(config: EnvironmentConfig, recipe: Recipe) -> str | None:
    """The run the deploy would start, when its forecast costs more than budget.monthly_usd (one line)."""
    if config.budget.monthly_usd is None:
        return None
    from stacks.cost import run_forecast  # stacks.cost reads this module's EnvironmentConfig

    forecast = run_forecast(config, recipe)
    if forecast is None:
        return None
    return budget_refusal(forecast, config.budget.monthly_usd, config.budget.accept_forecast_usd)


def _software_runs(compute: ComputeConfig) -> bool:
    """Whether the queue's software is pinned and runs on its instance type (else `compute.backend` is the one
    problem)."""
    hardware = HARDWARE.get(compute.instance_type)
    software = compute.node_software
    return (hardware is None or hardware.generation in software.generations) and not software.unpinned()


def _validate_compute(compute: ComputeConfig, bad: typing.Callable[[str, Any, str], None]) -> None:
    facts = HARDWARE.get(compute.instance_type)
    if facts is None:
        bad("compute.instance_type", compute.instance_type, ", ".join(HARDWARE))
    _validate_capacity(compute, bad)
    if compute.min_count > compute.max_count:
        bad("compute.min_count", compute.min_count, f"at most compute.max_count ({compute.max_count})")
    if facts is None:
        return
    software = compute.node_software
    default = "" if compute.backend else f" (the default on {facts.generation})"
    if facts.generation not in software.generations:
        able = [name for name, other in NODE_SOFTWARE.items() if facts.generation in other.generations]
        bad(
            "compute.backend",
            software.backend,
            f"{' or '.join(able)} on {compute.instance_type} ({software.title} runs on "
            f"{', '.join(software.generations)} only)",
        )
    elif missing := software.unpinned():
        bad(
            "compute.backend",
            software.backend,
            f"neuron for now{default}: the bootstrap script's block for release {software.release()} is not pinned "
            f"yet (empty: {', '.join(missing)}); fill them in from Neuron's release artifacts page",
        )
    if compute.efa and not facts.efa:
        efa_types = ", ".join(name for name, f in HARDWARE.items() if f.efa)
        bad("compute.efa", True, f"false for {compute.instance_type}, which has no EFA (EFA types: {efa_types})")
    elif compute.max_count > 1 and not compute.efa:
        if facts.efa:
            allowed = f"efa: true for multi-node training on {compute.instance_type}, or max_count 1"
        else:
            allowed = f"1, since {compute.instance_type} has no EFA for multi-node training"
        bad("compute.max_count", compute.max_count, allowed)
    if compute.placement_group is False and compute.efa and not compute.capacity.reserved:
        bad(
            "compute.placement_group",
            False,
            "true (or omit) when EFA is on; EFA nodes belong in one placement group",
        )


def _validate_capacity(compute: ComputeConfig, bad: typing.Callable[[str, Any, str], None]) -> None:
    capacity = compute.capacity
    reservation, group = capacity.reservation_id, capacity.resource_group_arn
    if not capacity.reserved:
        for key, value in (("reservation_id", reservation), ("resource_group_arn", group)):
            if value is not None:
                bad(f"compute.capacity.{key}", value, f"nothing for {capacity.type} capacity (type: reservation?)")
    elif capacity.type == "reservation" and (reservation is None) == (group is None):
        bad(
            "compute.capacity",
            {k: v for k, v in (("reservation_id", reservation), ("resource_group_arn", group)) if v},
            "exactly one of reservation_id or resource_group_arn for type reservation",
        )
    elif capacity.type == "capacity-block":
        if reservation is None:
            bad("compute.capacity.reservation_id", None, "the Capacity Block's reservation id (cr-...)")
        if group is not None:
            bad("compute.capacity.resource_group_arn", group, "nothing for a Capacity Block (reservation_id only)")
        if compute.min_count not in (0, compute.max_count):
            bad(
                "compute.min_count",
                compute.min_count,
                f"omit it: every node of a Capacity Block is static (min = max_count = {compute.max_count})",
            )
        if compute.placement_group:
            bad("compute.placement_group", True, "false or omit: a Capacity Block is already placed together")
