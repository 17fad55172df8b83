"""Who may read the Hugging Face Hub token secrets: the nodes of the CPU stages' queue, exactly those two secrets,
and nobody else in the stack; the site file carries their ARNs (never a token). Synthesized for real (cdk-nag
runs in the synth and fails it on any unacknowledged finding), read against the Service Authorization Reference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from stacks.config import ENVIRONMENTS_DIR, load_environment
from tests.support.iam_reference import Grant, covered_types, findings, grants
from tests.support.synthesis import Synthesized, synthesize_config

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)

READ_TOKEN = "arn:aws:secretsmanager:us-west-2:123456789012:secret:hf-read-AbC123"
WRITE_TOKEN = "arn:aws:secretsmanager:us-west-2:123456789012:secret:hf-write-XyZ789"


def environment_with_hub(directory: Path, name: str, **changes: Any) -> Synthesized:
    raw = yaml.safe_load((ENVIRONMENTS_DIR / "default.yaml").read_text())
    raw["hub"] = {"token_secret_arn": READ_TOKEN, "write_token_secret_arn": WRITE_TOKEN, "push_repo": "acme/cpt"}
    raw.update(changes)
    (directory / f"{name}.yaml").write_text(yaml.safe_dump(raw))
    outdir = directory / f"cdk-{name}"
    return synthesize_config(load_environment(name, directory), outdir)


@pytest.fixture(scope="module")
def with_hub(tmp_path_factory: pytest.TempPathFactory) -> Synthesized:
    """The default environment with both token secrets and a push repository (its own directory, its name)."""
    return environment_with_hub(tmp_path_factory.mktemp("hub"), "default")


def secret_grants(env: Synthesized) -> list[Grant]:
    return [g for g in grants(env.template, env.config.name) if any(a.startswith("secretsmanager:") for a in g.actions)]


def queue_policies(env: Synthesized) -> dict[str, list[Any]]:
    """Queue name -> its AdditionalIamPolicies in the cluster configuration, as the template has them."""
    (cluster,) = env.resources_of_type("Custom::PclusterCluster").values()
    configuration = cluster["Properties"]["ClusterConfiguration"]
    return {
        queue["Name"]: [p["Policy"] for p in queue["Iam"]["AdditionalIamPolicies"]]
        for queue in configuration["Scheduling"]["SlurmQueues"]
    }


def policy_of_queue(env: Synthesized, queue: str) -> str:
    (name,) = [
        n
        for n, r in env.resources_of_type("AWS::IAM::ManagedPolicy").items()
        if r["Properties"].get("Description", "").startswith(f"Nodes of queue {queue} ")
    ]
    return name


def test_only_the_cpu_queue_reads_exactly_the_two_token_secrets(with_hub: Synthesized) -> None:
    (grant,) = secret_grants(with_hub)  # one statement in the whole stack
    assert grant.actions == ("secretsmanager:GetSecretValue",)
    assert sorted(grant.resources) == sorted([READ_TOKEN, WRITE_TOKEN])
    policy = policy_of_queue(with_hub, "cpu")
    assert grant.where.startswith(f"{with_hub.config.name}:{policy}"), grant.where
    attached = queue_policies(with_hub)
    assert {"Ref": policy} in attached["cpu"]
    assert all({"Ref": policy} not in policies for queue, policies in attached.items() if queue != "cpu")
    (cluster,) = with_hub.resources_of_type("Custom::PclusterCluster").values()
    head = cluster["Properties"]["ClusterConfiguration"]["HeadNode"]["Iam"]["AdditionalIamPolicies"]
    assert {"Policy": {"Ref": policy}} not in head


def test_the_grants_follow_the_service_authorization_reference(with_hub: Synthesized) -> None:
    checked = grants(with_hub.template, with_hub.config.name)
    assert [line for grant in checked for line in findings(grant)] == []
    (grant,) = secret_grants(with_hub)
    assert covered_types([grant], "secretsmanager:getsecretvalue") == {"Secret"}


def test_the_cpu_queue_writes_base_models_under_the_prefix_the_file_system_imports(with_hub: Synthesized) -> None:
    policy = with_hub.resources_of_type("AWS::IAM::ManagedPolicy")[policy_of_queue(with_hub, "cpu")]
    statements = policy["Properties"]["PolicyDocument"]["Statement"]
    (objects,) = [s for s in statements if "s3:PutObject" in s["Action"]]
    assert sorted(objects["Action"]) == ["s3:DeleteObject", "s3:GetObject", "s3:PutObject"]
    assert json.dumps(objects["Resource"]).endswith('"/fsx/models/*"]]}')


def test_the_site_file_carries_the_secret_arns_and_the_model_copy_location(with_hub: Synthesized) -> None:
    (trigger,) = with_hub.resources_of_type("Custom::TrainingPipeline").values()
    site = json.dumps(trigger["Properties"]["SiteSettings"])
    for fact in (READ_TOKEN, WRITE_TOKEN, '\\"hub_push_repo\\":\\"acme/cpt\\"', '\\"models_dir\\":\\"/fsx/models\\"'):
        assert fact in site, site
    assert "/fsx/models" in site and '\\"hub_private\\":true' in site


def test_without_a_cpu_queue_the_trainium_queue_runs_the_fetch_and_gets_the_policy(tmp_path: Path) -> None:
    env = environment_with_hub(tmp_path, "nocpu", cpu_queue=None)
    (grant,) = secret_grants(env)
    policy = policy_of_queue(env, "compute1")
    assert grant.where.startswith(f"nocpu:{policy}") and {"Ref": policy} in queue_policies(env)["compute1"]


def test_an_environment_without_token_secrets_grants_no_secret(default_env: Synthesized) -> None:
    assert secret_grants(default_env) == []
    assert queue_policies(default_env)["cpu"][-1] == {"Ref": policy_of_queue(default_env, "cpu")}


def test_adding_the_token_secrets_on_day_2_leaves_the_cluster_configuration_as_it_is(
    with_hub: Synthesized, default_env: Synthesized
) -> None:
    """The CPU queue's own policy exists without secrets too (the model copy), so naming the secrets later changes
    that policy's statements only, never the configuration ParallelCluster compares on an update."""

    def configuration(env: Synthesized) -> Any:
        (cluster,) = env.resources_of_type("Custom::PclusterCluster").values()
        return cluster["Properties"]["ClusterConfiguration"]

    assert configuration(with_hub) == configuration(default_env)
