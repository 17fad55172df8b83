"""Day-2 changes through ParallelCluster's own update check.

A `cdk deploy` of a changed environment updates `Custom::PclusterCluster`, whose provider runs ParallelCluster's
update-cluster: it compares the deployed configuration with the new one in `ConfigPatch` and refuses the update
(the deploy fails and rolls back) when a change's update policy does not allow it while the compute fleet runs.
Here that class, from the installed aws-parallelcluster package, compares the configuration of the default
environment with the one of an environment carrying every change a user makes on day 2, for a cluster whose
compute fleet runs: ParallelCluster reads that status from its DynamoDB table, which moto serves.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import boto3
import pytest
import yaml
from moto import mock_aws
from pcluster.aws.aws_api import AWSApi
from pcluster.config.config_patch import ConfigPatch
from pcluster.models.cluster import Cluster
from pcluster.models.cluster_resources import ClusterStack
from pcluster.schemas.cluster_schema import ClusterSchema

from stacks.application import ENVIRONMENTS_DIR
from stacks.cluster import bootstrap_arguments
from stacks.config import PARALLELCLUSTER_VERSION, EnvironmentConfig, load_environment
from stacks.pcluster_config import build_cluster_configuration
from stacks.pipeline_site import shared_env_path
from stacks.training_environment import cluster_settings, node_health
from tests.infra.test_pcluster_config import RESOURCES, resolved_configuration
from tests.support.synthesis import Synthesized, synthesize_config

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)

CLUSTER = "trn1-llama"
FINGERPRINT = "0123456789ABCDEF0123456789ABCDEF01234567"
# Every change of the environment file a user makes while the cluster runs jobs: more nodes (and one kept warm),
# another recipe and run, alarm mail, a budget, the Neuron apt key's fingerprint. The code, the job templates,
# the lock and the bootstrap script change on day 2 too: tests/infra/test_day2.py shows they leave the cluster's
# properties identical, so their patch is empty.
DAY2_CHANGES: dict[str, Any] = {
    "compute": {"min_count": 1, "max_count": 8},
    "cpu_queue": {"max_count": 4},
    "pipeline": {"recipe": "mixtral-8x7b-sft", "overrides": ["steps=100"], "run": 2},
    "monitoring": {"alarm_email": "ops@example.com"},
    "budget": {"monthly_usd": 20000},
    "neuron": {"apt_key_fingerprint": FINGERPRINT},
}
COMPUTE_RESOURCE = "Scheduling.SlurmQueues[compute1].ComputeResources[trn1-32xlarge]"
CPU_RESOURCE = "Scheduling.SlurmQueues[cpu].ComputeResources[r6a-8xlarge]"


def merged(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """`base` with `changes` merged in, section by section."""
    data = copy.deepcopy(base)
    for key, value in changes.items():
        data[key] = merged(data.get(key) or {}, value) if isinstance(value, dict) else value
    return data


def environment(directory: Path, changes: dict[str, Any], base: str = "default") -> EnvironmentConfig:
    """environments/<base>.yaml with `changes`, written as a user would write it and loaded by the real loader."""
    directory.mkdir(parents=True)
    data = merged(yaml.safe_load((ENVIRONMENTS_DIR / f"{base}.yaml").read_text()), changes)
    (directory / f"{base}.yaml").write_text(yaml.safe_dump(data))
    return load_environment(base, directory)


@pytest.fixture(scope="module")
def day2_envs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Synthesized]:
    """The day-2 environment synthesized for real, with the default queue update strategy and with TERMINATE."""
    variants = {
        "default strategy": DAY2_CHANGES,
        "TERMINATE": merged(DAY2_CHANGES, {"compute": {"queue_update_strategy": "TERMINATE"}}),
    }
    result = {}
    for name, changes in variants.items():
        directory = tmp_path_factory.mktemp("day2")
        result[name] = synthesize_config(environment(directory / "environments", changes), directory / "cdk.out")
    return result


@pytest.fixture
def fleet(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """ParallelCluster's DynamoDB table of the cluster (moto), holding the compute fleet status set by the test."""
    for key, value in {
        "AWS_DEFAULT_REGION": "us-west-2",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_EC2_METADATA_DISABLED": "true",
    }.items():
        monkeypatch.setenv(key, value)
    with mock_aws():
        AWSApi.reset()
        table = f"parallelcluster-{CLUSTER}"
        dynamodb = boto3.client("dynamodb", region_name="us-west-2")
        dynamodb.create_table(
            TableName=table,
            KeySchema=[{"AttributeName": "Id", "KeyType": "HASH"}],
            AttributeDefinitions=[{"AttributeName": "Id", "AttributeType": "S"}],
            BillingMode="PAY_PER_REQUEST",
        )

        def set_status(status: str) -> None:
            data = {"status": {"S": status}, "lastStatusUpdatedTime": {"S": "2026-12-01 10:00:00+00:00"}}
            dynamodb.put_item(TableName=table, Item={"Id": {"S": "COMPUTE_FLEET"}, "Data": {"M": data}})

        set_status("RUNNING")
        yield set_status
        AWSApi.reset()


def config_patch(base: dict[str, Any], target: dict[str, Any]) -> ConfigPatch:
    """ParallelCluster's patch from the deployed configuration to the new one, as update-cluster builds it: both
    loaded through the cluster schema, the cluster known by its stack (tagged with the version that made it)."""
    schema = ClusterSchema(cluster_name=CLUSTER)
    deployed = schema.load(copy.deepcopy(base))
    wanted = schema.load(copy.deepcopy(target))
    stack = ClusterStack(
        {
            "StackName": CLUSTER,
            "StackStatus": "UPDATE_COMPLETE",
            "Tags": [{"Key": "parallelcluster:version", "Value": PARALLELCLUSTER_VERSION}],
        }
    )
    cluster = Cluster(CLUSTER, config=yaml.safe_dump(base), stack=stack)
    return ConfigPatch(cluster=cluster, base_config=deployed.source_config, target_config=wanted.source_config)


class Row(NamedTuple):
    parameter: str
    old: Any
    new: Any
    check: str
    policy: str


def rows_of(report: list[list[Any]]) -> list[Row]:
    """`ConfigPatch.check()`'s report rows (after its header), as update-cluster prints them."""
    header, *rows = report
    assert header[:5] == ["param_path", "parameter", "old value", "new value", "check"]
    return [Row(ConfigPatch.build_config_param_path(row[0], row[1]), row[2], row[3], row[4], row[7]) for row in rows]


def policies(patch: ConfigPatch) -> dict[str, str]:
    """Each changed parameter and its update policy."""
    return {ConfigPatch.build_config_param_path(c.path, c.key): c.update_policy.name for c in patch.changes}


def strategy_of(configuration: dict[str, Any]) -> str:
    return str(configuration["Scheduling"]["SlurmSettings"]["QueueUpdateStrategy"])


def assert_no_running_job_is_killed(patch: ConfigPatch, environment_file: dict[str, Any]) -> None:
    """What a reviewer asks of a day-2 change: ParallelCluster can apply it (nothing UNSUPPORTED, which fails the
    deploy), and it replaces no running node at once unless the environment file asks for TERMINATE."""
    assert "UNSUPPORTED" not in policies(patch).values(), policies(patch)
    if strategy_of(patch.target_config) == "TERMINATE":
        assert environment_file["compute"]["queue_update_strategy"] == "TERMINATE"


def test_every_day2_change_is_applied_while_jobs_run(
    default_env: Synthesized, day2_envs: dict[str, Synthesized], fleet: Callable[[str], None]
) -> None:
    """The default strategy is DRAIN: the changes are allowed with the fleet running, and none replaces a node."""
    base = resolved_configuration(default_env)
    target = resolved_configuration(day2_envs["default strategy"])
    patch = config_patch(base, target)
    assert patch.cluster.has_running_capacity(), "the check is made against a running fleet"
    assert strategy_of(base) == strategy_of(target) == "DRAIN"
    assert_no_running_job_is_killed(patch, DAY2_CHANGES)
    assert "QUEUE_UPDATE_STRATEGY" not in policies(patch).values()

    allowed, report = patch.check()
    assert allowed is True
    assert rows_of(report) == [
        Row(f"{COMPUTE_RESOURCE}.MaxCount", 4, 8, "SUCCEEDED", "RESIZE_UPDATE_STRATEGY_ON_REMOVE"),
        Row(f"{COMPUTE_RESOURCE}.MinCount", 0, 1, "SUCCEEDED", "RESIZE_UPDATE_STRATEGY_ON_REMOVE"),
        Row(f"{CPU_RESOURCE}.MaxCount", 2, 4, "SUCCEEDED", "RESIZE_UPDATE_STRATEGY_ON_REMOVE"),
    ]
    # The bootstrap the nodes run is named by fixed keys and arguments: the same in both configurations.
    assert base["HeadNode"]["CustomActions"] == target["HeadNode"]["CustomActions"]


def test_terminate_set_in_the_environment_file_is_applied_and_replaces_running_nodes(
    default_env: Synthesized, day2_envs: dict[str, Synthesized], fleet: Callable[[str], None]
) -> None:
    """With TERMINATE written in the environment file the same deploy is allowed; ParallelCluster then replaces
    running nodes at once, so it also allows what DRAIN refuses while jobs run: removing capacity."""
    base = resolved_configuration(default_env)
    target = resolved_configuration(day2_envs["TERMINATE"])
    assert strategy_of(target) == "TERMINATE"
    patch = config_patch(base, target)
    assert_no_running_job_is_killed(patch, merged(DAY2_CHANGES, {"compute": {"queue_update_strategy": "TERMINATE"}}))
    allowed, report = patch.check()
    assert allowed is True
    # The strategy itself is no reported change (ParallelCluster ignores its update); the counts are.
    assert [row.parameter for row in rows_of(report)] == [
        f"{COMPUTE_RESOURCE}.MaxCount",
        f"{COMPUTE_RESOURCE}.MinCount",
        f"{CPU_RESOURCE}.MaxCount",
    ]

    fewer = copy.deepcopy(base)
    fewer["Scheduling"]["SlurmQueues"][0]["ComputeResources"][0]["MaxCount"] = 2
    for strategy, expected in (("DRAIN", "ACTION NEEDED"), ("TERMINATE", "SUCCEEDED")):
        fewer["Scheduling"]["SlurmSettings"]["QueueUpdateStrategy"] = strategy
        allowed, report = config_patch(base, fewer).check()
        (row,) = rows_of(report)
        assert (row.parameter, row.check, allowed) == (f"{COMPUTE_RESOURCE}.MaxCount", expected, strategy != "DRAIN")
        reason = report[1][5]
        if strategy == "DRAIN":
            assert reason == "All compute nodes must be stopped or QueueUpdateStrategy must be set to TERMINATE"


def test_a_stopped_fleet_allows_what_drain_refuses(default_env: Synthesized, fleet: Callable[[str], None]) -> None:
    """The way to remove capacity without TERMINATE: stop the compute fleet first (pcluster update-compute-fleet,
    or the budget's stop), deploy, start it again."""
    base = resolved_configuration(default_env)
    fewer = copy.deepcopy(base)
    fewer["Scheduling"]["SlurmQueues"][0]["ComputeResources"][0]["MaxCount"] = 2
    assert config_patch(base, fewer).check()[0] is False
    fleet("STOPPED")
    assert config_patch(base, fewer).check()[0] is True


def test_the_dependency_setting_reaches_a_cluster_deployed_without_it_while_jobs_run(
    default_env: Synthesized, fleet: Callable[[str], None]
) -> None:
    """`DependencyParameters=kill_invalid_depend` (a failed stage's dependants cancelled): ParallelCluster's own
    patch lets an environment deployed before it take it on a running fleet."""
    target = resolved_configuration(default_env)
    assert target["Scheduling"]["SlurmSettings"]["CustomSlurmSettings"] == [
        {"DependencyParameters": "kill_invalid_depend"}
    ]
    base = copy.deepcopy(target)
    del base["Scheduling"]["SlurmSettings"]["CustomSlurmSettings"]
    fleet("RUNNING")
    patch = config_patch(base, target)
    assert patch.check()[0] is True
    assert policies(patch) == {"Scheduling.SlurmSettings.CustomSlurmSettings": "SUPPORTED"}


# --- which settings need what ---------------------------------------------------------------------------------


def pure_configuration(config: EnvironmentConfig) -> dict[str, Any]:
    """The cluster configuration of `config` with placeholder ids and the bootstrap arguments the stack derives
    from it (the arguments are part of what ParallelCluster compares)."""
    software = config.compute.node_software
    release = software.release()
    arguments = bootstrap_arguments(
        neuron_release=release,
        shared_env=shared_env_path(config, release),
        requirements_uri=f"s3://bucket/cluster/{software.lock.name}",
        node_settings_uri="s3://bucket/cluster/node-settings.json",
        health=node_health(config),
        environment_name=config.name,
    )
    return build_cluster_configuration(
        cluster_settings(config), dataclasses.replace(RESOURCES, bootstrap_args=arguments)
    )


# Environment keys a user may be tempted to change on a running cluster, and what ParallelCluster 3.16.1 says.
# UNSUPPORTED: only a new cluster (destroy, deploy); COMPUTE_FLEET_STOP / MANAGED_PLACEMENT_GROUP and removals
# (RESIZE_UPDATE_STRATEGY_ON_REMOVE under DRAIN): stop the compute fleet first; QUEUE_UPDATE_STRATEGY: the
# queue's nodes are replaced (drained first under DRAIN).
SETTING_POLICIES: dict[str, tuple[dict[str, Any], bool, set[str]]] = {
    "head_node.instance_type": ({"head_node": {"instance_type": "m6a.4xlarge"}}, False, {"UNSUPPORTED"}),
    "head_node.root_volume_gib": ({"head_node": {"root_volume_gib": 200}}, False, {"UNSUPPORTED"}),
    "os": ({"os": "ubuntu2404"}, False, {"UNSUPPORTED"}),
    # The Trainium queue's type, EFA and name are bootstrap arguments (device counts, the prolog's partition),
    # which the CPU queue's bootstrap shares.
    "compute.instance_type": (
        {"compute": {"instance_type": "trn1n.32xlarge"}},
        False,
        {"UNSUPPORTED", "RESIZE_UPDATE_STRATEGY_ON_REMOVE", "QUEUE_UPDATE_STRATEGY"},
    ),
    "compute.efa": (
        {"compute": {"efa": False, "max_count": 1}},
        False,
        {"UNSUPPORTED", "QUEUE_UPDATE_STRATEGY", "MANAGED_PLACEMENT_GROUP", "RESIZE_UPDATE_STRATEGY_ON_REMOVE"},
    ),
    "compute.queue_name": (
        {"compute": {"queue_name": "trn"}},
        False,
        {"UNSUPPORTED", "RESIZE_UPDATE_STRATEGY_ON_REMOVE", "QUEUE_UPDATE_STRATEGY"},
    ),
    "compute.scaledown_idle_minutes": ({"compute": {"scaledown_idle_minutes": 30}}, False, {"COMPUTE_FLEET_STOP"}),
    "compute.max_count (lower)": ({"compute": {"max_count": 2}}, False, {"RESIZE_UPDATE_STRATEGY_ON_REMOVE"}),
    # A node kept warm needs as much more room: MinCount up only with MaxCount up by at least as much.
    "compute.min_count (alone)": ({"compute": {"min_count": 1}}, False, {"RESIZE_UPDATE_STRATEGY_ON_REMOVE"}),
    "compute.min_count (with max_count)": (
        {"compute": {"min_count": 1, "max_count": 5}},
        True,
        {"RESIZE_UPDATE_STRATEGY_ON_REMOVE"},
    ),
    "compute.root_volume_gib": ({"compute": {"root_volume_gib": 2048}}, True, {"QUEUE_UPDATE_STRATEGY"}),
    "cpu_queue.instance_type": (
        {"cpu_queue": {"instance_type": "m6a.8xlarge"}},
        False,
        {"RESIZE_UPDATE_STRATEGY_ON_REMOVE"},
    ),
    "cpu_queue.root_volume_gib": ({"cpu_queue": {"root_volume_gib": 300}}, True, {"QUEUE_UPDATE_STRATEGY"}),
    "logging.retention_days": ({"logging": {"retention_days": 30}}, True, {"SUPPORTED"}),
    "tags": ({"tags": {"team": "ml"}}, True, {"SUPPORTED_UNLESS_ADC"}),
}


@pytest.mark.parametrize("setting", SETTING_POLICIES)
def test_what_each_setting_needs_on_a_running_cluster(
    setting: str, tmp_path: Path, fleet: Callable[[str], None]
) -> None:
    """The same check on single changes, for docs/operations.md's table; it reports the head node's instance type as
    UNSUPPORTED, which is what the day-2 tests above would catch had a day-2 change reached such a field."""
    changes, allowed, expected = SETTING_POLICIES[setting]
    base = pure_configuration(load_environment("default", ENVIRONMENTS_DIR))
    patch = config_patch(base, pure_configuration(environment(tmp_path / "environments", changes)))
    assert set(policies(patch).values()) == expected, policies(patch)
    assert patch.check()[0] is allowed
    if "UNSUPPORTED" in expected:
        with pytest.raises(AssertionError):
            assert_no_running_job_is_killed(patch, changes)


def test_another_software_set_for_the_trainium_queue_needs_a_new_cluster(
    tmp_path: Path, fleet: Callable[[str], None], torchneuron_pinned: Path
) -> None:
    """`compute.backend` chooses the release, the shared environment and the lock every node's bootstrap is given
    (the head node's included), so switching a trn2 cluster between NxD and TorchNeuron is a new cluster, as
    docs/operations.md says: ParallelCluster refuses the update while the fleet runs, and with it stopped."""
    # On demand: the capacity is the same on both sides, and ParallelCluster's check of a Capacity Block asks EC2
    # (DescribeCapacityReservations), which moto does not serve.
    trn2 = {"os": "ubuntu2404", "compute": {"capacity": {"type": "on-demand", "reservation_id": None}}}
    nxd = environment(tmp_path / "nxd", merged(trn2, {"compute": {"backend": "neuron"}}), base="trn2")
    native_changes = {"compute": {"backend": "torch-native"}, "pipeline": {"overrides": []}}
    native = environment(tmp_path / "native", merged(trn2, native_changes), base="trn2")
    assert (nxd.compute.node_software.backend, native.compute.node_software.backend) == ("neuron", "torch-native")
    for status in ("RUNNING", "STOPPED"):
        fleet(status)
        patch = config_patch(pure_configuration(nxd), pure_configuration(native))
        assert policies(patch) == {
            "HeadNode.CustomActions.OnNodeConfigured.Args": "UNSUPPORTED",
            "Scheduling.SlurmQueues[trn2].CustomActions.OnNodeConfigured.Args": "QUEUE_UPDATE_STRATEGY",
            "Scheduling.SlurmQueues[cpu].CustomActions.OnNodeConfigured.Args": "QUEUE_UPDATE_STRATEGY",
        }
        assert patch.check()[0] is False
