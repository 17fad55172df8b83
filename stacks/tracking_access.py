"""What the Trainium nodes may do for the experiment trackers of the environment file: nothing beyond them.

The training job (on the Trainium queue only) reads W&B's API key from its one secret and, for a SageMaker
managed MLflow tracking server, makes the MLflow requests of training.train.trackers on that one server (the
sagemaker-mlflow plugin signs each request; IAM authorizes it as `sagemaker-mlflow:<Request>`). A plain MLflow
URL or file store needs no IAM.
"""

from __future__ import annotations

from aws_cdk import aws_iam as iam

from training.config.tracking import Tracking, sagemaker_mlflow_arn

# The requests MlflowSender makes (MlflowClient calls -> REST requests of MLflow's tracking API): find or create
# the experiment, find the run of a requeued job or create it, log parameters and metrics, mark it running or
# finished, and read the run for its artifact location when logging artifacts. Sorted, as the template has them.
SAGEMAKER_MLFLOW_ACTIONS = (
    "sagemaker-mlflow:CreateExperiment",
    "sagemaker-mlflow:CreateRun",
    "sagemaker-mlflow:GetExperimentByName",
    "sagemaker-mlflow:GetRun",
    "sagemaker-mlflow:LogBatch",
    "sagemaker-mlflow:SearchRuns",
    "sagemaker-mlflow:UpdateRun",
)


def tracking_access(tracking: Tracking) -> list[iam.PolicyStatement]:
    """Least privilege for the configured trackers (an empty list when none needs AWS)."""
    statements = []
    if tracking.wandb is not None and tracking.wandb.api_key_secret_arn:
        secret = tracking.wandb.api_key_secret_arn
        statements.append(iam.PolicyStatement(actions=["secretsmanager:GetSecretValue"], resources=[secret]))
    if tracking.mlflow is not None and sagemaker_mlflow_arn(tracking.mlflow.tracking_uri):
        statements.append(
            iam.PolicyStatement(actions=list(SAGEMAKER_MLFLOW_ACTIONS), resources=[tracking.mlflow.tracking_uri])
        )
    return statements
