"""Environment files: the shipped ones load, and every validation rule rejects bad input with one clear line."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from stacks.application import ENVIRONMENTS_DIR
from stacks.config import ConfigError, EnvironmentConfig, load_environment
from stacks.pipeline_site import site_settings
from tests.support.repository import ROOT
from tests.support.synthesis import ENVIRONMENT_NAMES

BASE: dict[str, Any] = yaml.safe_load((ENVIRONMENTS_DIR / "default.yaml").read_text())


def write_environment(directory: Path, changes: dict[str, Any], name: str = "candidate") -> Path:
    """default.yaml with `changes` applied; dotted keys address nested mappings, None deletes."""
    data = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        target = data
        for parent in parents:
            target = target.setdefault(parent, {})
        if value is None:
            target.pop(leaf, None)
        else:
            target[leaf] = value
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def problems_for(tmp_path: Path, changes: dict[str, Any]) -> list[str]:
    write_environment(tmp_path, changes)
    with pytest.raises(ConfigError) as raised:
        load_environment("candidate", tmp_path)
    return raised.value.problems


@pytest.mark.parametrize("name", ENVIRONMENT_NAMES)
def test_shipped_environments_load(name: str) -> None:
    assert isinstance(load_environment(name, ENVIRONMENTS_DIR), EnvironmentConfig)


def test_default_reproduces_the_first_document() -> None:
    config = load_environment("default", ENVIRONMENTS_DIR)
    assert (config.region, config.availability_zone) == ("us-west-2", "usw2-az4")  # the zone by ID
    assert (config.head_node.instance_type, config.head_node.root_volume_gib) == ("m6a.2xlarge", 100)
    assert config.compute.root_volume_gib == 1024
    assert config.cpu_queue is not None and config.cpu_queue.instance_type == "r6a.8xlarge"
    assert (config.compute.instance_type, config.compute.efa, config.compute.max_count) == ("trn1.32xlarge", True, 4)
    assert config.compute.min_count == 0
    assert config.compute.placement_group_enabled is True
    assert (config.storage.fsx_capacity_gib, config.storage.mount_dir) == (1200, "/fsx")


def test_a_recipe_that_does_not_fit_is_refused_only_when_the_deploy_would_start_it(env_dir: Path) -> None:
    """An environment that starts no run (start_run: false) may name any recipe; the refusal comes when a deploy
    would start it (rule "pipeline recipe that does not fit the NeuronCores"), and again at `submit`."""
    text = (ENVIRONMENTS_DIR / "default.yaml").read_text().replace("recipe: llama31-8b-cpt", "recipe: mixtral-8x7b-sft")
    (env_dir / "idle.yaml").write_text(text)
    assert load_environment("idle", env_dir).pipeline.recipe == "mixtral-8x7b-sft"


def test_a_run_above_the_budget_starts_when_the_environment_accepts_its_forecast(env_dir: Path) -> None:
    """The override of rule "pipeline run forecast above the monthly budget": budget.accept_forecast_usd at
    least the forecast; the site file the deploy writes carries the budget, the acceptance and the costs."""
    long_run = {"pipeline.start_run": True, "pipeline.overrides": ["steps=10000"], "budget.monthly_usd": 1000}
    write_environment(env_dir, {**long_run, "budget.accept_forecast_usd": 41304})  # what the refusal names
    config = load_environment("candidate", env_dir)
    site = site_settings(config, neuron_release="2.28.1", results_uri="s3://b/results", file_system_uri="s3://b/fsx")
    assert (site["budget_monthly_usd"], site["budget_accept_forecast_usd"]) == (1000, 41304)
    assert site["node_usd_per_hour"] == pytest.approx(21.61, abs=0.01)  # trn1.32xlarge and its 1 TiB root volume
    assert 0.5 < site["environment_usd_per_hour"] < 1.0  # head node, FSx, NAT, CloudWatch
    write_environment(env_dir, {**long_run, "budget.monthly_usd": 50000})
    assert load_environment("candidate", env_dir).budget.monthly_usd == 50000  # within the budget: no refusal
    write_environment(env_dir, {"budget.monthly_usd": 1000, "pipeline.overrides": ["steps=10000"]})
    assert load_environment("candidate", env_dir).pipeline.start_run is False  # no run started: nothing to refuse


def test_smoke_environment_has_no_efa() -> None:
    config = load_environment("smoke", ENVIRONMENTS_DIR)
    assert (config.compute.instance_type, config.compute.efa, config.compute.max_count) == ("trn1.2xlarge", False, 1)
    assert config.compute.placement_group_enabled is False


# One case per validation rule: (changes to default.yaml, the exact line expected).
RULES = {
    "unknown key": (
        {"compute.gpus": 8},
        "environments-under-test/candidate.yaml: compute.gpus: unknown key; allowed keys here: "
        "instance_type, queue_name, min_count, max_count, efa, placement_group, capacity, "
        "root_volume_gib, scaledown_idle_minutes, queue_update_strategy, backend, custom_ami",
    ),
    "unknown top-level key": (
        {"vpc": {"cidr": "10.0.0.0/16"}},
        "environments-under-test/candidate.yaml: vpc: unknown key; allowed keys here: region, availability_zone, "
        "cluster_name, os, network, head_node, compute, cpu_queue, storage, logging, monitoring, budget, pipeline, "
        "neuron, tracking, hub, tags",
    ),
    "pipeline recipe not bundled": (
        {"pipeline.recipe": "gpt-oss"},
        "environments-under-test/candidate.yaml: pipeline.recipe: 'gpt-oss' is not allowed; allowed: a bundled "
        "recipe (llama31-8b-cpt, mixtral-8x7b-sft)",
    ),
    "pipeline recipe that does not fit the NeuronCores": (
        {
            "pipeline.recipe": "mixtral-8x7b-sft",
            "pipeline.start_run": True,
            # without its pipeline stages, checkpointing and stochastic rounding
            "pipeline.overrides": ["parallelism.pp=1", "memory.activation_checkpointing=none", "precision=bf16-mixed"],
        },
        "environments-under-test/candidate.yaml: pipeline.recipe: 'mixtral-8x7b-sft' is not allowed; allowed: a "
        "recipe that fits: recipe mixtral-8x7b-sft needs 27.41 GiB per NeuronCore of the 16 GiB on trn1.32xlarge "
        "(-71% headroom, 10% required); cheapest fix: memory.flash_attention=true "
        "memory.activation_checkpointing=full precision=bf16-sr (13.28 GiB, 17% "
        "headroom) (python -m training plan --recipe mixtral-8x7b-sft)",
    ),
    "pipeline run forecast above the monthly budget": (
        {"pipeline.start_run": True, "pipeline.overrides": ["steps=10000"], "budget.monthly_usd": 1000},
        "environments-under-test/candidate.yaml: forecast: llama31-8b-cpt costs about $41,304 (19.8 days on 4 x "
        "trn1.32xlarge), above budget.monthly_usd 1000; shorten steps, or set budget.accept_forecast_usd to at "
        "least 41304 to accept it",
    ),
    "pipeline override without =": (
        {"pipeline.overrides": ["steps"]},
        "environments-under-test/candidate.yaml: pipeline.overrides: 'steps' is not allowed; allowed: recipe "
        "overrides as 'section.key=value'",
    ),
    "pipeline timeout beyond CloudFormation's hour": (
        {"pipeline.timeout_minutes": 90},
        "environments-under-test/candidate.yaml: pipeline.timeout_minutes: 90 is not allowed; allowed: 1 to 55 "
        "(CloudFormation waits an hour)",
    ),
    "wrong type": (
        {"compute.max_count": "four"},
        "environments-under-test/candidate.yaml: compute.max_count: 'four' is not allowed; allowed: an integer",
    ),
    "missing required key": (
        {"cluster_name": None},
        "environments-under-test/candidate.yaml: cluster_name: required key is missing",
    ),
    "fsx capacity": (
        {"storage.fsx_capacity_gib": 1000},
        "environments-under-test/candidate.yaml: storage.fsx_capacity_gib: 1000 is not allowed; "
        "allowed: 1200 or a multiple of 2400 (2400, 4800, ...) for SCRATCH_2",
    ),
    "fsx capacity not a multiple of 2400": (
        {"storage.fsx_capacity_gib": 3600},
        "environments-under-test/candidate.yaml: storage.fsx_capacity_gib: 3600 is not allowed; "
        "allowed: 1200 or a multiple of 2400 (2400, 4800, ...) for SCRATCH_2",
    ),
    "fsx capacity negative": (
        {"storage.fsx_capacity_gib": -2400},
        "environments-under-test/candidate.yaml: storage.fsx_capacity_gib: -2400 is not allowed; "
        "allowed: 1200 or a multiple of 2400 (2400, 4800, ...) for SCRATCH_2",
    ),
    "fsx capacity beyond the scratch quota": (
        {"storage.fsx_capacity_gib": 103200},
        "environments-under-test/candidate.yaml: storage.fsx_capacity_gib: 103200 is not allowed; "
        "allowed: at most storage.fsx_quota_gib, 100800 GiB (FSx for Lustre's scratch storage quota per account "
        "and region, 100800 by default; raise both once Service Quotas has raised it)",
    ),
    "fsx capacity beyond a raised quota": (
        {"storage.fsx_capacity_gib": 204000, "storage.fsx_quota_gib": 201600},
        "environments-under-test/candidate.yaml: storage.fsx_capacity_gib: 204000 is not allowed; "
        "allowed: at most storage.fsx_quota_gib, 201600 GiB (FSx for Lustre's scratch storage quota per account "
        "and region, 100800 by default; raise both once Service Quotas has raised it)",
    ),
    "fsx quota beyond CloudFormation's integers": (
        {"storage.fsx_quota_gib": 2**31},
        "environments-under-test/candidate.yaml: storage.fsx_quota_gib: 2147483648 is not allowed; "
        "allowed: 1200 to 2147483647 GiB",
    ),
    "compute root volume beyond gp3's 16 TiB": (
        {"compute.root_volume_gib": 16385},
        "environments-under-test/candidate.yaml: compute.root_volume_gib: 16385 is not allowed; "
        "allowed: 40 to 16384 GiB (Neuron recommends at least 512 on compute nodes)",
    ),
    "head node root volume below the image": (
        {"head_node.root_volume_gib": 39},
        "environments-under-test/candidate.yaml: head_node.root_volume_gib: 39 is not allowed; "
        "allowed: 40 to 16384 GiB (Neuron recommends at least 512 on compute nodes)",
    ),
    "cpu queue root volume beyond gp3's 16 TiB": (
        {"cpu_queue.root_volume_gib": 20000},
        "environments-under-test/candidate.yaml: cpu_queue.root_volume_gib: 20000 is not allowed; "
        "allowed: 40 to 16384 GiB (Neuron recommends at least 512 on compute nodes)",
    ),
    "compute nodes negative": (
        {"compute.min_count": -1},
        "environments-under-test/candidate.yaml: compute.min_count: -1 is not allowed; "
        "allowed: 0 (scale to zero) or more",
    ),
    "no cpu nodes": (
        {"cpu_queue.max_count": 0},
        "environments-under-test/candidate.yaml: cpu_queue.max_count: 0 is not allowed; allowed: 1 or more",
    ),
    "pipeline run zero": (
        {"pipeline.run": 0},
        "environments-under-test/candidate.yaml: pipeline.run: 0 is not allowed; allowed: a run number of 1 or more",
    ),
    "pipeline timeout zero": (
        {"pipeline.timeout_minutes": 0},
        "environments-under-test/candidate.yaml: pipeline.timeout_minutes: 0 is not allowed; allowed: 1 to 55 "
        "(CloudFormation waits an hour)",
    ),
    "newline in a tag": (
        {"tags.project": "trainium\nrm -rf /"},
        "environments-under-test/candidate.yaml: tags.project: 'trainium\\nrm -rf /' is not allowed; allowed: one "
        "line of text without control characters (newline, carriage return, tab, NUL, escape)",
    ),
    "newline in a pipeline override": (
        {"pipeline.overrides": ["steps=100\nname=x"]},
        "environments-under-test/candidate.yaml: pipeline.overrides[0]: 'steps=100\\nname=x' is not allowed; "
        "allowed: one line of text without control characters (newline, carriage return, tab, NUL, escape)",
    ),
    "recipe override out of range": (
        {"pipeline.overrides": ["optimizer.lr=.nan"]},
        "environments-under-test/candidate.yaml: pipeline.overrides: ['optimizer.lr=.nan'] is not allowed; allowed: "
        "what recipe llama31-8b-cpt accepts (optimizer.lr: nan is not allowed; allowed: a finite number above 0)",
    ),
    "cluster name pattern": (
        {"cluster_name": "1st_cluster"},
        "environments-under-test/candidate.yaml: cluster_name: '1st_cluster' is not allowed; "
        "allowed: a letter followed by up to 59 letters, digits or '-' (ParallelCluster's rule)",
    ),
    "cluster name equals stack name": (
        {"cluster_name": "trainium-candidate"},
        "environments-under-test/candidate.yaml: cluster_name: 'trainium-candidate' is not allowed; "
        "allowed: any name other than the stack name 'trainium-candidate'",
    ),
    "min count above max count": (
        {"compute.min_count": 5},
        "environments-under-test/candidate.yaml: compute.min_count: 5 is not allowed; "
        "allowed: at most compute.max_count (4)",
    ),
    "efa on a type without efa": (
        {"compute.instance_type": "trn1.2xlarge", "compute.max_count": 1},
        "environments-under-test/candidate.yaml: compute.efa: True is not allowed; allowed: false for trn1.2xlarge, "
        "which has no EFA (EFA types: trn1.32xlarge, trn1n.32xlarge, trn2.48xlarge)",
    ),
    "multi-node on a type without efa": (
        {"compute.instance_type": "trn1.2xlarge", "compute.efa": False, "compute.max_count": 2},
        "environments-under-test/candidate.yaml: compute.max_count: 2 is not allowed; "
        "allowed: 1, since trn1.2xlarge has no EFA for multi-node training",
    ),
    "multi-node with efa off": (
        {"compute.efa": False},
        "environments-under-test/candidate.yaml: compute.max_count: 4 is not allowed; "
        "allowed: efa: true for multi-node training on trn1.32xlarge, or max_count 1",
    ),
    "unknown compute instance type": (
        {"compute.instance_type": "p4d.24xlarge"},
        "environments-under-test/candidate.yaml: compute.instance_type: 'p4d.24xlarge' is not allowed; "
        "allowed: trn1.2xlarge, trn1.32xlarge, trn1n.32xlarge, trn2.3xlarge, trn2.48xlarge",
    ),
    "availability zone outside the region": (
        {"availability_zone": "us-east-1a"},
        "environments-under-test/candidate.yaml: availability_zone: 'us-east-1a' is not allowed; "
        "allowed: a zone of us-west-2: a name such as 'us-west-2d' or a zone ID such as 'usw2-az4'",
    ),
    "zone ID of another region": (
        {"availability_zone": "use1-az4"},
        "environments-under-test/candidate.yaml: availability_zone: 'use1-az4' is not allowed; "
        "allowed: a zone ID of us-west-2 (usw2-az1, ...) or a zone name",
    ),
    "os rejected by parallelcluster": (
        {"os": "ubuntu2004"},
        "environments-under-test/candidate.yaml: os: 'ubuntu2004' is not allowed; "
        "allowed: ubuntu2204, ubuntu2404 (ParallelCluster rejects it)",
    ),
    "os without neuron bootstrap": (
        {"os": "alinux2023"},
        "environments-under-test/candidate.yaml: os: 'alinux2023' is not allowed; "
        "allowed: ubuntu2204, ubuntu2404 (the Neuron bootstrap supports only these)",
    ),
    "torchneuron on trainium1": (
        {"compute.backend": "torch-native"},
        "environments-under-test/candidate.yaml: compute.backend: 'torch-native' is not allowed; allowed: neuron on "
        "trn1.32xlarge (TorchNeuron (Neuron's native PyTorch backend, PyTorch 2.13) runs on trn2 only)",
    ),
    "torchneuron before its block is pinned": (
        {"compute.instance_type": "trn2.48xlarge", "compute.max_count": 1},
        "environments-under-test/candidate.yaml: compute.backend: 'torch-native' is not allowed; allowed: neuron for "
        "now (the default on trn2): the bootstrap script's block for release 2.34.0 is not pinned yet (empty: "
        "TORCHNEURON_DKMS_VERSION, TORCHNEURON_COLLECTIVES_VERSION, TORCHNEURON_RUNTIME_LIB_VERSION, "
        "TORCHNEURON_TOOLS_VERSION, TORCHNEURON_TORCH_NEURONX_VERSION, TORCHNEURON_NEURONX_CC_VERSION, "
        "TORCHNEURON_NKI_VERSION); fill them in from Neuron's release artifacts page",
    ),
    "recipe on another backend than the queue's software": (
        {"compute.instance_type": "trn2.48xlarge", "compute.max_count": 1, "compute.backend": "neuron"},
        "environments-under-test/candidate.yaml: pipeline.recipe: 'llama31-8b-cpt' is not allowed; allowed: a "
        "recipe on the queue's software (Neuron 2.28 (neuronx-distributed, PyTorch/XLA 2.9), compute.backend "
        "neuron): the recipe runs backend torch-native on trn2; set compute.backend: torch-native or override "
        "backend=neuron",
    ),
    "placement group off with efa": (
        {"compute.placement_group": False},
        "environments-under-test/candidate.yaml: compute.placement_group: False is not allowed; "
        "allowed: true (or omit) when EFA is on; EFA nodes belong in one placement group",
    ),
    "scale-down idle time": (
        {"compute.scaledown_idle_minutes": 0},
        "environments-under-test/candidate.yaml: compute.scaledown_idle_minutes: 0 is not allowed; "
        "allowed: 1 or more minutes",
    ),
    "log retention": (
        {"logging.retention_days": 10},
        "environments-under-test/candidate.yaml: logging.retention_days: 10 is not allowed; allowed: one of "
        "[1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653]",
    ),
    "capacity block without its reservation": (
        {"compute.capacity": {"type": "capacity-block"}},
        "environments-under-test/candidate.yaml: compute.capacity.reservation_id: None is not allowed; "
        "allowed: the Capacity Block's reservation id (cr-...)",
    ),
    "capacity block with dynamic nodes": (
        {
            "compute.capacity": {"type": "capacity-block", "reservation_id": "cr-0123456789abcdef0"},
            "compute.min_count": 2,
        },
        "environments-under-test/candidate.yaml: compute.min_count: 2 is not allowed; "
        "allowed: omit it: every node of a Capacity Block is static (min = max_count = 4)",
    ),
    "capacity block in a placement group": (
        {
            "compute.capacity": {"type": "capacity-block", "reservation_id": "cr-0123456789abcdef0"},
            "compute.placement_group": True,
        },
        "environments-under-test/candidate.yaml: compute.placement_group: True is not allowed; "
        "allowed: false or omit: a Capacity Block is already placed together",
    ),
    "reservation by both id and group": (
        {
            "compute.capacity": {
                "type": "reservation",
                "reservation_id": "cr-0123456789abcdef0",
                "resource_group_arn": "arn:aws:resource-groups:us-west-2:123456789012:group/trn1",
            }
        },
        "environments-under-test/candidate.yaml: compute.capacity: {'reservation_id': 'cr-0123456789abcdef0', "
        "'resource_group_arn': 'arn:aws:resource-groups:us-west-2:123456789012:group/trn1'} is not allowed; "
        "allowed: exactly one of reservation_id or resource_group_arn for type reservation",
    ),
    "reservation id on on-demand capacity": (
        {"compute.capacity": {"reservation_id": "cr-0123456789abcdef0"}},
        "environments-under-test/candidate.yaml: compute.capacity.reservation_id: 'cr-0123456789abcdef0' is not "
        "allowed; allowed: nothing for on-demand capacity (type: reservation?)",
    ),
    "malformed reservation id": (
        {"compute.capacity": {"type": "capacity-block", "reservation_id": "cb-123"}},
        "environments-under-test/candidate.yaml: compute.capacity.reservation_id: 'cb-123' is not allowed; "
        "allowed: a reservation id such as cr-0123456789abcdef0",
    ),
    "head node type": (
        {"head_node.instance_type": "p5.48xlarge"},
        "environments-under-test/candidate.yaml: head_node.instance_type: 'p5.48xlarge' is not allowed; allowed: "
        "m6a.xlarge, m6a.2xlarge, m6a.4xlarge, m6a.8xlarge, r6a.2xlarge, r6a.4xlarge, r6a.8xlarge, r6a.12xlarge, "
        "r6a.16xlarge",
    ),
    "cpu queue named like the trainium queue": (
        {"cpu_queue.queue_name": "compute1"},
        "environments-under-test/candidate.yaml: cpu_queue.queue_name: 'compute1' is not allowed; "
        "allowed: a name other than compute.queue_name",
    ),
    "recipe override the recipe refuses": (
        {"pipeline.overrides": ["batch.micro=0"]},
        "environments-under-test/candidate.yaml: pipeline.overrides: ['batch.micro=0'] is not allowed; allowed: "
        "what recipe llama31-8b-cpt accepts (batch.micro: 0 is not allowed; allowed: an integer above 0)",
    ),
    "capacity type": (
        {"compute.capacity": {"type": "RESERVED"}},
        "environments-under-test/candidate.yaml: compute.capacity.type: 'RESERVED' is not allowed; "
        "allowed: on-demand, spot, reservation or capacity-block",
    ),
    "budget of nothing": (
        {"budget.monthly_usd": 0},
        "environments-under-test/candidate.yaml: budget.monthly_usd: 0 is not allowed; "
        "allowed: a number of US dollars above 0",
    ),
    "negative budget": (
        {"budget.monthly_usd": -5},
        "environments-under-test/candidate.yaml: budget.monthly_usd: -5 is not allowed; "
        "allowed: a number of US dollars above 0",
    ),
    "budget that is not a number": (
        {"budget.monthly_usd": "lots"},
        "environments-under-test/candidate.yaml: budget.monthly_usd: 'lots' is not allowed; "
        "allowed: a number (or omit it)",
    ),
    "stop at 0 percent": (
        {"budget.monthly_usd": 2500, "budget.stop_fleet_at_percent": 0},
        "environments-under-test/candidate.yaml: budget.stop_fleet_at_percent: 0 is not allowed; "
        "allowed: 1 to 1000 (percent of monthly_usd), or null",
    ),
    "stop beyond 1000 percent": (
        {"budget.monthly_usd": 2500, "budget.stop_fleet_at_percent": 1001},
        "environments-under-test/candidate.yaml: budget.stop_fleet_at_percent: 1001 is not allowed; "
        "allowed: 1 to 1000 (percent of monthly_usd), or null",
    ),
    "alarm e-mail that is no address": (
        {"monitoring.alarm_email": "ops at example"},
        "environments-under-test/candidate.yaml: monitoring.alarm_email: 'ops at example' is not allowed; "
        "allowed: an e-mail address such as ops@example.com",
    ),
    "stall window shorter than the head node's minute timer can tell": (
        {"monitoring.stall_minutes": 4},
        "environments-under-test/candidate.yaml: monitoring.stall_minutes: 4 is not allowed; "
        "allowed: 5 to 1440 minutes",
    ),
    "stall window longer than CloudWatch evaluates": (
        {"monitoring.stall_minutes": 1441},
        "environments-under-test/candidate.yaml: monitoring.stall_minutes: 1441 is not allowed; "
        "allowed: 5 to 1440 minutes",
    ),
    "queue update strategy ParallelCluster has but a deploy cannot use": (
        {"compute.queue_update_strategy": "COMPUTE_FLEET_STOP"},
        "environments-under-test/candidate.yaml: compute.queue_update_strategy: 'COMPUTE_FLEET_STOP' is not "
        "allowed; allowed: DRAIN (running jobs finish first) or TERMINATE (running nodes are replaced)",
    ),
    "Neuron apt key fingerprint as gpg shows it to people": (
        {"neuron.apt_key_fingerprint": "0123 4567 89AB CDEF 0123  4567 89AB CDEF 0123 4567"},
        "environments-under-test/candidate.yaml: neuron.apt_key_fingerprint: '0123 4567 89AB CDEF 0123  4567 89AB "
        "CDEF 0123 4567' is not allowed; allowed: the key's fingerprint: 40 hexadecimal digits without spaces, as "
        "gpg prints it",
    ),
    "Hub token secret named without the suffix Secrets Manager appends (IAM would grant another ARN)": (
        {"hub.token_secret_arn": "arn:aws:secretsmanager:us-west-2:123456789012:secret:hf-token"},
        "environments-under-test/candidate.yaml: hub.token_secret_arn: "
        "'arn:aws:secretsmanager:us-west-2:123456789012:secret:hf-token' is not allowed; allowed: a Secrets Manager "
        "secret's complete ARN (arn:aws:secretsmanager:REGION:ACCOUNT:secret:NAME-XXXXXX) (or omit it)",
    ),
    "Hub push without a write token": (
        {"hub.push_repo": "acme/llama-cpt"},
        "environments-under-test/candidate.yaml: hub.push_repo: 'acme/llama-cpt' is not allowed; allowed: a "
        "repository with hub.write_token_secret_arn set, or no push_repo",
    ),
    "Hub push repository that is not owner/name": (
        {
            "hub.push_repo": "llama-cpt",
            "hub.write_token_secret_arn": "arn:aws:secretsmanager:us-west-2:123456789012:secret:hf-write-AbCdEf",
        },
        "environments-under-test/candidate.yaml: hub.push_repo: 'llama-cpt' is not allowed; allowed: a Hub model "
        "repository as owner/name, e.g. meta-llama/Llama-3.1-8B (or omit it)",
    ),
    "stop at a fractional percent": (
        {"budget.monthly_usd": 2500, "budget.stop_fleet_at_percent": 50.5},
        "environments-under-test/candidate.yaml: budget.stop_fleet_at_percent: 50.5 is not allowed; "
        "allowed: an integer (or omit it)",
    ),
}


@pytest.fixture
def env_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory of candidate files, shown to the user relative to the working directory."""
    directory = tmp_path / "environments-under-test"
    directory.mkdir()
    monkeypatch.chdir(tmp_path)
    return directory


@pytest.mark.parametrize("rule", list(RULES))
def test_each_rule_rejects_with_one_clear_line(rule: str, env_dir: Path) -> None:
    changes, expected = RULES[rule]
    assert problems_for(env_dir, changes) == [expected]


TORCHNEURON_ON_2204 = (
    "environments-under-test/candidate.yaml: os: 'ubuntu2204' is not allowed; allowed: ubuntu2404 for the "
    "torch-native backend's TorchNeuron (Neuron's native PyTorch backend, PyTorch 2.13): its wheels need Python 3.12 "
    "(ParallelCluster does not run Ubuntu 26.04)"
)


def test_a_pinned_torchneuron_block_makes_trn2_queues_native(env_dir: Path, torchneuron_pinned: Path) -> None:
    """Once the TorchNeuron block is pinned, a trn2 queue installs it by default and the recipes train there on
    torch-native; Ubuntu 22.04 and a recipe left on neuron are refused in one line each, and a trn2 queue told
    `backend: neuron` keeps NxD with the recipe overridden alike."""
    trn2 = {"compute.instance_type": "trn2.48xlarge", "compute.max_count": 1}
    write_environment(env_dir, {**trn2, "os": "ubuntu2404"})
    config = load_environment("candidate", env_dir)
    assert config.compute.node_software.backend == "torch-native" and config.compute.backend is None
    assert problems_for(env_dir, trn2) == [TORCHNEURON_ON_2204]
    mismatch = problems_for(env_dir, {**trn2, "os": "ubuntu2404", "pipeline.overrides": ["backend=neuron"]})
    assert mismatch == [
        "environments-under-test/candidate.yaml: pipeline.recipe: 'llama31-8b-cpt' is not allowed; allowed: a recipe "
        "on the queue's software (TorchNeuron (Neuron's native PyTorch backend, PyTorch 2.13), compute.backend "
        "torch-native): the recipe runs backend neuron on trn2; set compute.backend: neuron or override "
        "backend=torch-native"
    ]
    write_environment(env_dir, {**trn2, "compute.backend": "neuron", "pipeline.overrides": ["backend=neuron"]})
    assert load_environment("candidate", env_dir).compute.node_software.backend == "neuron"


def test_an_account_with_a_raised_scratch_quota_may_use_it(env_dir: Path) -> None:
    write_environment(env_dir, {"storage.fsx_capacity_gib": 204000, "storage.fsx_quota_gib": 204000})
    assert load_environment("candidate", env_dir).storage.fsx_capacity_gib == 204000


def test_every_problem_is_reported_at_once(env_dir: Path) -> None:
    problems = problems_for(env_dir, {"storage.fsx_capacity_gib": 1000, "compute.min_count": 9, "os": "rhel8"})
    assert [line.split(": ")[1] for line in problems] == ["os", "compute.min_count", "storage.fsx_capacity_gib"]


def test_unknown_environment_lists_the_available_ones(env_dir: Path) -> None:
    write_environment(env_dir, {}, name="prod")
    with pytest.raises(ConfigError) as raised:
        load_environment("staging", env_dir)
    assert str(raised.value) == (
        "environments-under-test/staging.yaml: no such environment file; available environments: prod"
    )


def run_app(context_env: str, outdir: Path, workdir: Path) -> subprocess.CompletedProcess[str]:
    """The CDK entry point exactly as the CLI runs it (context and output dir passed via the environment), in
    `workdir` with the environment files of its `environments/` folder, so nothing is written into the project's."""
    environ = {
        **os.environ,
        "CDK_OUTDIR": str(outdir),
        "CDK_CONTEXT_JSON": json.dumps({"env": context_env, "environments_dir": "environments"}),
        # As the Makefile does: jsii's Node 20 end-of-life banner would otherwise precede every message.
        "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "20",
    }
    return subprocess.run(
        [sys.executable, str(ROOT / "app.py")], cwd=workdir, env=environ, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow  # a CDK app in a subprocess
def test_app_rejects_bad_environment_without_traceback_or_output(tmp_path: Path) -> None:
    (tmp_path / "environments").mkdir()
    write_environment(tmp_path / "environments", {"storage.fsx_capacity_gib": 1000}, name="zz-invalid-under-test")
    result = run_app("zz-invalid-under-test", tmp_path / "out", tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: environments/zz-invalid-under-test.yaml: storage.fsx_capacity_gib: 1000 is not allowed; "
        "allowed: 1200 or a multiple of 2400 (2400, 4800, ...) for SCRATCH_2"
    )
    assert "Traceback" not in result.stderr
    # The CDK App creates its output directory when constructed; nothing may be written into it.
    assert not any((tmp_path / "out").iterdir())


@pytest.mark.slow  # a CDK app in a subprocess
def test_app_names_an_unknown_environment_in_one_line(tmp_path: Path) -> None:
    """The CDK entry point through the entry points' user-error guard: one line, exit status 1, no output."""
    (tmp_path / "environments").mkdir()
    result = run_app("zz-no-such-environment", tmp_path / "out", tmp_path)
    assert result.returncode == 1
    assert result.stderr.startswith("error: environments/zz-no-such-environment.yaml: no such environment file; ")
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert not any((tmp_path / "out").iterdir())


@pytest.mark.slow  # a CDK app in a subprocess
def test_synth_refuses_a_run_forecast_above_the_budget_in_one_line(tmp_path: Path) -> None:
    """`cdk synth` of an environment whose deploy would start the 10,000-step Llama run on a $1,000 budget."""
    changes = {"pipeline.start_run": True, "pipeline.overrides": ["steps=10000"], "budget.monthly_usd": 1000}
    (tmp_path / "environments").mkdir()
    write_environment(tmp_path / "environments", changes, name="zz-over-budget-under-test")
    result = run_app("zz-over-budget-under-test", tmp_path / "out", tmp_path)
    assert result.returncode == 1
    assert result.stderr == (
        "error: environments/zz-over-budget-under-test.yaml: forecast: llama31-8b-cpt costs about $41,304 (19.8 "
        "days on 4 x trn1.32xlarge), above budget.monthly_usd 1000; shorten steps, or set budget.accept_forecast_usd "
        "to at least 41304 to accept it\n"
    )
    assert not any((tmp_path / "out").iterdir())


def test_a_file_that_is_not_utf8_or_not_yaml_is_one_line(env_dir: Path) -> None:
    path = write_environment(env_dir, {})
    path.write_bytes(path.read_bytes() + "# caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError) as raised:
        load_environment("candidate", env_dir)
    assert str(raised.value).startswith("environments-under-test/candidate.yaml: not UTF-8 text (invalid")
    assert "\n" not in str(raised.value)
    path.write_text("region: [us-west-2\n")
    with pytest.raises(ConfigError) as raised:
        load_environment("candidate", env_dir)
    assert str(raised.value) == (
        "environments-under-test/candidate.yaml: not valid YAML: expected ',' or ']', but got '<stream end>' at "
        "line 2, column 1 (while parsing a flow sequence)"
    )


def test_duplicate_keys_are_reported_with_their_lines(env_dir: Path) -> None:
    path = write_environment(env_dir, {})
    path.write_text(path.read_text() + "region: eu-west-1\n")
    first = next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.startswith("region:"))
    last = len(path.read_text().splitlines())
    with pytest.raises(ConfigError) as raised:
        load_environment("candidate", env_dir)
    assert raised.value.problems == [
        f"environments-under-test/candidate.yaml: region: appears twice (lines {first} and {last}); "
        "allowed: each key once"
    ]


# Ten aliases of ten aliases, five levels deep: 10^5 values from 50 lines (the "billion laughs" of YAML).
ALIAS_BOMB = "".join(
    f"x{level}: &x{level} [{', '.join([f'*x{level - 1}' if level else 'v'] * 10)}]\n" for level in range(5)
)


def test_anchors_and_aliases_that_expand_past_the_bound_are_one_line(env_dir: Path) -> None:
    path = write_environment(env_dir, {})
    path.write_text(ALIAS_BOMB + path.read_text())
    with pytest.raises(ConfigError) as raised:
        load_environment("candidate", env_dir)
    assert raised.value.problems == [
        "environments-under-test/candidate.yaml: anchors and aliases expand to more than 10,000 values; "
        "allowed: at most 10,000 values once aliases are expanded"
    ]
    # A file that contains itself expands without end: the same line, not a RecursionError.
    path.write_text("region: &r [*r]\n")
    with pytest.raises(ConfigError, match="anchors and aliases expand to more than 10,000 values"):
        load_environment("candidate", env_dir)


def test_anchors_and_aliases_within_the_bound_still_work(env_dir: Path) -> None:
    path = write_environment(env_dir, {"head_node.root_volume_gib": None})
    text = path.read_text().replace("root_volume_gib: 200", "root_volume_gib: &cpu_root 200", 1)
    path.write_text(text.replace("head_node:\n", "head_node:\n  root_volume_gib: *cpu_root\n", 1))
    config = load_environment("candidate", env_dir)
    assert config.head_node.root_volume_gib == config.cpu_queue.root_volume_gib == 200


def test_environment_objects_are_frozen() -> None:
    config = load_environment("default", ENVIRONMENTS_DIR)
    with pytest.raises(ValueError, match="frozen"):
        config.compute.max_count = 8  # type: ignore[misc]
