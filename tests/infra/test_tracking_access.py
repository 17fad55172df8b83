"""The trackers' access: the Trainium queue's nodes alone may read the W&B key's one secret and make the MLflow
requests of the training job on the one SageMaker MLflow server, checked in the synthesized template against
the Service Authorization Reference and ParallelCluster's own validation. The actions are the requests that
training.train.trackers really makes, recorded by a stand-in MLflow server on 127.0.0.1."""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml
from mlflow.protos.service_pb2 import MlflowService
from mlflow.utils.rest_utils import _REST_API_PATH_PREFIX, extract_api_info_for_service

from stacks.application import ENVIRONMENTS_DIR
from stacks.config import load_environment
from stacks.pipeline_site import site_settings
from stacks.tracking_access import SAGEMAKER_MLFLOW_ACTIONS
from tests.infra.test_config_patch import (
    assert_no_running_job_is_killed,
    config_patch,
    environment,
    fleet,  # noqa: F401  # the fixture: ParallelCluster's fleet status, served by moto
)
from tests.infra.test_config_patch import (
    policies as update_policies,
)
from tests.infra.test_pcluster_config import account_of, resolved_configuration
from tests.infra.test_validators import awssolutions_report
from tests.support.iam_reference import expand_action, findings, grants
from tests.support.pcluster_offline import errors_of, run_offline_validation
from tests.support.synthesis import Synthesized, synthesize_config
from training.config.loading import ConfigError
from training.config.site import Site
from training.config.tracking import MlflowTracking, Tracking, WandbTracking
from training.train.trackers import MlflowSender, RunFacts, close_trackers

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)

SERVER_ARN = "arn:aws:sagemaker:us-west-2:123456789012:mlflow-tracking-server/llama-runs"
SECRET_ARN = "arn:aws:secretsmanager:us-west-2:123456789012:secret:wandb-api-key-Ab12Cd"
TRACKING = {
    "mlflow": {"tracking_uri": SERVER_ARN, "experiment": "llama"},
    "wandb": {"project": "llama", "api_key_secret_arn": SECRET_ARN},
}


@pytest.fixture(scope="module")
def tracked(tmp_path_factory: pytest.TempPathFactory) -> Synthesized:
    """The default environment with both trackers, synthesized for real."""
    directory = tmp_path_factory.mktemp("tracked")
    return synthesize_config(environment(directory / "environments", {"tracking": TRACKING}), directory / "cdk.out")


def policies(env: Synthesized) -> dict[str, dict[str, Any]]:
    return env.resources_of_type("AWS::IAM::ManagedPolicy")


def trainium_queue_policy_prefix(env: Synthesized) -> str:
    """The logical id of the policy only the Trainium queue's nodes get (the cluster's `QueuePolicy-<queue>`)."""
    return f"ClusterQueuePolicy{env.config.compute.queue_name}"


def statements_granting(env: Synthesized, *services: str) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for name, resource in env.template["Resources"].items():
        document = resource.get("Properties", {}).get("PolicyDocument", {})
        for statement in document.get("Statement", []):
            actions = statement.get("Action", [])
            actions = [actions] if isinstance(actions, str) else actions
            if any(action.split(":")[0] in services for action in actions):
                found.append((name, statement))
    return found


def test_the_trainium_nodes_alone_get_exactly_the_trackers_access(tracked: Synthesized) -> None:
    (policy_name,) = [name for name in policies(tracked) if name.startswith(trainium_queue_policy_prefix(tracked))]
    assert statements_granting(tracked, "secretsmanager", "sagemaker-mlflow") == [
        (policy_name, {"Action": "secretsmanager:GetSecretValue", "Effect": "Allow", "Resource": SECRET_ARN}),
        (policy_name, {"Action": list(SAGEMAKER_MLFLOW_ACTIONS), "Effect": "Allow", "Resource": SERVER_ARN}),
    ]
    configuration = resolved_configuration(tracked)
    trainium, cpu = configuration["Scheduling"]["SlurmQueues"]
    assert trainium["Name"] == tracked.config.compute.queue_name
    training_policy = f"arn:aws:iam::123456789012:policy/parallelcluster/{policy_name}"
    assert {"Policy": training_policy} in trainium["Iam"]["AdditionalIamPolicies"]
    assert {"Policy": training_policy} not in cpu["Iam"]["AdditionalIamPolicies"]
    assert {"Policy": training_policy} not in configuration["HeadNode"]["Iam"]["AdditionalIamPolicies"]
    report = run_offline_validation(
        configuration, cluster_name=tracked.config.cluster_name, region=tracked.config.region, **account_of(tracked)
    )
    assert errors_of(report.findings) == []
    assert awssolutions_report(tracked)["violations"] == []  # cdk-nag: nothing new to acknowledge


def test_every_tracker_action_is_one_of_the_reference_on_the_servers_type(tracked: Synthesized) -> None:
    for action in SAGEMAKER_MLFLOW_ACTIONS:
        assert expand_action(action) == [action.lower()], action
    checked = [
        grant
        for grant in grants(tracked.template, "tracked")
        if grant.where.startswith(f"tracked:{trainium_queue_policy_prefix(tracked)}")
        and any(action.split(":")[0] in ("secretsmanager", "sagemaker-mlflow") for action in grant.actions)
    ]
    assert len(checked) == 2
    assert [line for grant in checked for line in findings(grant)] == []


def test_the_site_file_carries_the_trackers_to_the_train_job(tracked: Synthesized) -> None:
    site = Site.model_validate(
        site_settings(tracked.config, neuron_release="2.28.1", results_uri="s3://b/r", file_system_uri="s3://b/fsx")
    )
    assert site.tracking == Tracking.model_validate(TRACKING)
    (pipeline,) = [r for r in tracked.template["Resources"].values() if "SiteSettings" in r.get("Properties", {})]
    assert SERVER_ARN in json.dumps(pipeline["Properties"]["SiteSettings"])


@pytest.mark.usefixtures("fleet")
def test_adding_trackers_is_applied_while_jobs_run(default_env: Synthesized, tracked: Synthesized) -> None:
    """ParallelCluster's own update check, the compute fleet running: the Trainium queue has its own policy in
    every environment (the compile cache), so the trackers' grants change only that policy's statements and
    nothing of the cluster configuration (no fleet stop, no node replaced)."""
    patch = config_patch(resolved_configuration(default_env), resolved_configuration(tracked))
    assert update_policies(patch) == {}
    assert_no_running_job_is_killed(patch, yaml.safe_load((ENVIRONMENTS_DIR / "default.yaml").read_text()))


def test_without_trackers_no_access(default_env: Synthesized) -> None:
    assert statements_granting(default_env, "secretsmanager", "sagemaker-mlflow") == []
    assert default_env.config.tracking.configured is False


def test_online_wandb_needs_its_secret(tmp_path: Path) -> None:
    directory = tmp_path / "environments"
    directory.mkdir()
    default = (Path(__file__).resolve().parents[2] / "environments" / "default.yaml").read_text()
    (directory / "online.yaml").write_text(default + "tracking:\n  wandb:\n    project: llama\n")
    with pytest.raises(ConfigError) as error:
        load_environment("online", directory)
    (problem,) = error.value.problems
    assert problem.endswith(
        "online.yaml: tracking.wandb.api_key_secret_arn: missing for online mode; allowed: the ARN of a Secrets "
        "Manager secret holding the W&B API key (the nodes have no other key), or tracking.wandb.mode offline"
    )
    offline = default + "tracking:\n  wandb:\n    project: llama\n    mode: offline\n"
    (directory / "offline.yaml").write_text(offline)
    assert load_environment("offline", directory).tracking.wandb == WandbTracking(project="llama", mode="offline")


# --- the requests the MLflow tracker makes ----------------------------------------------------------------


class StandInMlflow(ThreadingHTTPServer):
    """Enough of MLflow's REST API on 127.0.0.1 for one run of the tracker; keeps the RPC name of each request."""

    def __init__(self, artifacts: Path, existing_run: bool) -> None:
        self.requests: list[str] = []
        by_path = {path: request.__name__ for request, (path, _) in _endpoints().items()}
        run = {
            "info": {
                "run_id": uuid.uuid4().hex,  # MLflow's client keeps each run id's artifact location
                "experiment_id": "1",
                "status": "RUNNING",
                "artifact_uri": artifacts.as_uri(),
                "lifecycle_stage": "active",
            },
            "data": {"params": [{"key": "steps", "value": "2"}]},
        }
        answers: dict[str, Any] = {
            "GetExperimentByName": (404, {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "none"}),
            "CreateExperiment": (200, {"experiment_id": "1"}),
            "SearchRuns": (200, {"runs": [run]} if existing_run else {}),
            "CreateRun": (200, {"run": run}),
            "GetRun": (200, {"run": run}),
            "UpdateRun": (200, {"run_info": run["info"]}),
            "LogBatch": (200, {}),
        }
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                name = by_path.get(urlparse(self.path).path, self.path)
                server.requests.append(name)
                status, body = answers.get(name, (501, {"error_code": "NOT_IMPLEMENTED", "message": name}))
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST

            def log_message(self, *arguments: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def _endpoints() -> dict[Any, tuple[str, str]]:
    return dict(extract_api_info_for_service(MlflowService, _REST_API_PATH_PREFIX))


@pytest.mark.parametrize("existing_run", [False, True], ids=["new-run", "requeued-run"])
def test_the_granted_actions_are_the_requests_the_tracker_makes(
    tmp_path: Path, existing_run: bool, caplog: pytest.LogCaptureFixture
) -> None:
    server = StandInMlflow(tmp_path / "artifacts", existing_run)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 2.0}\n')
    facts = RunFacts(run_id="llama-1", settings={"steps": 2, "optimizer": {"lr": 0.1}}, run_dir=tmp_path)
    tracking = MlflowTracking(tracking_uri=f"http://127.0.0.1:{server.server_port}", experiment="llama")
    sender = MlflowSender(tracking, facts)
    sender.write(1, time.time(), {"train/loss": 2.0})
    close_trackers([sender], [metrics], completed=True, timeout=30)
    server.shutdown()
    assert not sender.failed, [r.getMessage() for r in caplog.records]
    assert set(server.requests) <= {action.split(":")[1] for action in SAGEMAKER_MLFLOW_ACTIONS}
    expected = {"GetExperimentByName", "CreateExperiment", "SearchRuns", "GetRun", "UpdateRun", "LogBatch"}
    assert set(server.requests) == expected | ({"CreateRun"} if not existing_run else set())
    assert (tmp_path / "artifacts" / "metrics.jsonl").read_text() == metrics.read_text()
