"""Site settings files: the same strict loading as environment files and recipes."""

from __future__ import annotations

from pathlib import Path

import pytest

from training.config.loading import ConfigError
from training.config.site import Site, load_site


def test_no_file_means_the_local_defaults() -> None:
    assert load_site(None) == Site()


def test_a_json_site_file_loads(tmp_path: Path) -> None:
    # The deployment writes the file as one line of JSON (valid YAML).
    path = tmp_path / "site.yaml"
    path.write_text('{"runs_root": "/fsx/runs", "processes_per_node": 32, "setup": ["source x"], "neuron": true}')
    site = load_site(path)
    assert (site.runs_root, site.processes_per_node, site.setup, site.neuron) == ("/fsx/runs", 32, ("source x",), True)


def test_every_problem_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "site.yaml"
    path.write_text("partition: compute1\nprocesses_per_node: 0\nneuron: yes please\nqueue: x\npartition: other\n")
    with pytest.raises(ConfigError) as raised:
        load_site(path)
    assert raised.value.problems == [
        f"{path}: partition: appears twice (lines 1 and 5); allowed: each key once",
    ]
    path.write_text("processes_per_node: 0\nneuron: yes please\nqueue: x\n")
    with pytest.raises(ConfigError) as raised:
        load_site(path)
    assert raised.value.problems == [
        f"{path}: processes_per_node: 0 is not allowed; allowed: an integer above 0 (or omit it)",
        f"{path}: neuron: 'yes please' is not allowed; allowed: true or false",
        f"{path}: queue: unknown key; allowed keys here: name, runs_root, results, python, setup, slurm_bin, "
        "partition, cpu_partition, processes_per_node, instance_type, exclusive, neuron, backend, efa, compile_cache, "
        "compile_cache_store, compile_cache_promoter, max_restarts, preflight, time_minutes, region, "
        "metrics_namespace, tracking, models_dir, models_uri, hub_token_secret_arn, hub_write_token_secret_arn, "
        "hub_push_repo, hub_private, node_usd_per_hour, environment_usd_per_hour, budget_monthly_usd, "
        "budget_accept_forecast_usd",
    ]


def test_the_hub_settings_are_checked(tmp_path: Path) -> None:
    """The site file names secrets by their complete ARN (the node policy grants exactly that ARN), never a token."""
    path = tmp_path / "site.yaml"
    path.write_text("hub_token_secret_arn: hf_0123456789abcdef\nhub_push_repo: no-owner\nmodels_uri: /fsx/models\n")
    with pytest.raises(ConfigError) as raised:
        load_site(path)
    assert raised.value.problems == [
        f"{path}: models_uri: '/fsx/models' is not allowed; allowed: an S3 URI such as s3://bucket/fsx/models "
        "(or omit it)",
        f"{path}: hub_token_secret_arn: 'hf_0123456789abcdef' is not allowed; allowed: a Secrets Manager secret's "
        "complete ARN (arn:aws:secretsmanager:REGION:ACCOUNT:secret:NAME-XXXXXX) (or omit it)",
        f"{path}: hub_push_repo: 'no-owner' is not allowed; allowed: a Hub model repository as owner/name, e.g. "
        "meta-llama/Llama-3.1-8B (or omit it)",
    ]
    arn = "arn:aws:secretsmanager:us-west-2:123456789012:secret:hf-read-AbC123"
    path.write_text(f"hub_token_secret_arn: {arn}\nhub_push_repo: acme/cpt\nmodels_uri: s3://bucket/fsx/models\n")
    site = load_site(path)
    assert (site.hub_token_secret_arn, site.hub_push_repo, site.hub_private) == (arn, "acme/cpt", True)


def test_the_region_and_the_metrics_namespace_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "site.yaml"
    path.write_text('region: Oregon\nmetrics_namespace: "Trainium default"\n')
    with pytest.raises(ConfigError) as raised:
        load_site(path)
    assert raised.value.problems == [
        f"{path}: region: 'Oregon' is not allowed; allowed: an AWS region such as us-west-2",
        f"{path}: metrics_namespace: 'Trainium default' is not allowed; allowed: a CloudWatch namespace "
        "such as Trainium/default (1 to 255 of letters, digits and . - _ / # :)",
    ]
    path.write_text("region: us-west-2\nmetrics_namespace: Trainium/default\n")
    site = load_site(path)
    assert (site.region, site.metrics_namespace) == ("us-west-2", "Trainium/default")


def test_the_tracking_settings_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "site.yaml"
    path.write_text(
        "tracking:\n  mlflow:\n    tracking_uri: 'http://mlflow host:5000'\n"
        "  wandb:\n    project: llama\n    api_key_secret_arn: wandb-key\n    mode: shared\n"
    )
    with pytest.raises(ConfigError) as raised:
        load_site(path)
    assert raised.value.problems == [
        f"{path}: tracking.mlflow.tracking_uri: 'http://mlflow host:5000' is not allowed; allowed: an MLflow tracking "
        "URI without whitespace or quotes: http(s)://host:port, file:///path, or a SageMaker MLflow tracking server "
        "ARN (arn:aws:sagemaker:REGION:ACCOUNT:mlflow-tracking-server/NAME)",
        f"{path}: tracking.wandb.api_key_secret_arn: 'wandb-key' is not allowed; allowed: a Secrets Manager "
        "secret's complete ARN (arn:aws:secretsmanager:REGION:ACCOUNT:secret:NAME-XXXXXX) (or omit it)",
        f"{path}: tracking.wandb.mode: 'shared' is not allowed; allowed: online, offline",
    ]
    path.write_text("tracking:\n  mlflow:\n    tracking_uri: file:///fsx/mlruns\n")
    site = load_site(path)
    assert site.tracking.mlflow is not None and site.tracking.wandb is None
    assert (site.tracking.mlflow.tracking_uri, site.tracking.mlflow.experiment) == (
        "file:///fsx/mlruns",
        "trainium-training",
    )
