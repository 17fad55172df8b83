"""Experiment trackers a training run also reports to (MLflow, Weights & Biases), each optional.

One definition for the environment file (`tracking:`), the site file the deployment writes from it, and the
training job, which gets the settings as JSON in `TRAINING_TRACKING` (training.train.trackers). No secret is
ever part of them: W&B's API key stays in Secrets Manager and only its ARN is written here.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

from pydantic import Field, Strict

from training.config.loading import Allowed, Str, StrictModel
from training.secrets import SecretArn

TRACKING_VARIABLE = "TRAINING_TRACKING"  # what the train stage's job script exports
# The tracking URI of a SageMaker managed MLflow tracking server: its ARN (the sagemaker-mlflow plugin's scheme).
SAGEMAKER_MLFLOW_ARN = re.compile(
    r"^arn:(?P<partition>aws[a-z-]*):sagemaker:(?P<region>[a-z]{2}(-gov)?-[a-z]+-\d+):(?P<account>\d{12}):"
    r"mlflow-tracking-server/(?P<name>[A-Za-z0-9](-*[A-Za-z0-9]){0,255})$"
)

TrackingUri = Annotated[
    str,
    Strict(),
    Field(pattern=r"^[^\s'\"\\]+$"),
    Allowed(
        "an MLflow tracking URI without whitespace or quotes: http(s)://host:port, file:///path, or a SageMaker "
        "MLflow tracking server ARN (arn:aws:sagemaker:REGION:ACCOUNT:mlflow-tracking-server/NAME)"
    ),
]
WandbName = Annotated[
    str,
    Strict(),
    Field(pattern=r"^[A-Za-z0-9_.-]{1,128}$"),
    Allowed("1 to 128 of letters, digits, '_', '.' and '-'"),
]


class MlflowTracking(StrictModel):
    tracking_uri: TrackingUri = Field(
        description="where runs are recorded: an MLflow server URL, file:///path, or a SageMaker managed MLflow "
        "tracking server ARN (the nodes get access to exactly that server)"
    )
    experiment: Str = Field("trainium-training", description="experiment the runs go to (created when missing)")


class WandbTracking(StrictModel):
    project: WandbName
    entity: WandbName | None = Field(None, description="team or user; default: the API key's default entity")
    api_key_secret_arn: SecretArn | None = Field(
        None,
        description="Secrets Manager secret whose value is the W&B API key as plain text; read by the training "
        "job at run time (the Trainium nodes may read exactly this secret); omit in offline mode",
    )
    base_url: Annotated[
        str | None,
        Strict(),
        Field(pattern=r"^https?://[^\s'\"\\]+$"),
        Allowed("an http(s) URL without whitespace or quotes, such as https://wandb.example.com"),
    ] = Field(None, description="a dedicated or self-managed W&B server; default: W&B's own")
    mode: Literal["online", "offline"] = Field(
        "online", description="offline: write the run to <run_dir>/wandb only (`wandb sync` uploads it later)"
    )


class Tracking(StrictModel):
    mlflow: MlflowTracking | None = Field(None, description="omit for no MLflow")
    wandb: WandbTracking | None = Field(None, description="omit for no Weights & Biases")

    @property
    def configured(self) -> bool:
        return self.mlflow is not None or self.wandb is not None


def sagemaker_mlflow_arn(tracking_uri: str) -> re.Match[str] | None:
    """The parts of a SageMaker MLflow tracking server ARN, or None for any other tracking URI."""
    return SAGEMAKER_MLFLOW_ARN.match(tracking_uri)


def tracking_environment(tracking: Tracking) -> str | None:
    """The value of TRAINING_TRACKING for these settings (None: no tracker, nothing to export)."""
    if not tracking.configured:
        return None
    return json.dumps(tracking.model_dump(mode="json", exclude_none=True), sort_keys=True, separators=(",", ":"))
