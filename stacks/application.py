"""Build the CDK app for one environment; shared by `app.py` and the tests so both synthesize the same."""

from __future__ import annotations

from pathlib import Path

from aws_cdk import App, Validations
from cdk_nag import AwsSolutionsChecks

from stacks.config import ENVIRONMENTS_DIR, EnvironmentConfig, load_environment
from stacks.nag import acknowledge_reviewed_findings
from stacks.training_environment import TrainingEnvironmentStack, cpu_stages_queue

DEFAULT_ENVIRONMENT = "default"


def build_app(app: App, config: EnvironmentConfig) -> TrainingEnvironmentStack:
    """Add the environment's stack and the cdk-nag AwsSolutions checks with their reviewed acknowledgements."""
    stack = TrainingEnvironmentStack(app, config=config)
    acknowledge_reviewed_findings(
        stack,
        cpu_stages_queue=cpu_stages_queue(config),
        fsx_s3_prefix=config.storage.fsx_s3_prefix,
        trainium_queue=config.compute.queue_name,
    )
    Validations.of(app).add_plugins(AwsSolutionsChecks(app))
    return stack


def environment_from_context(app: App, directory: Path = ENVIRONMENTS_DIR) -> EnvironmentConfig:
    """The environment chosen with `-c env=NAME` (default: `default`), read from `-c environments_dir=DIR`
    when given (a folder of environment files kept elsewhere, e.g. the tests' temporary ones)."""
    name = app.node.try_get_context("env") or DEFAULT_ENVIRONMENT
    folder = app.node.try_get_context("environments_dir")
    return load_environment(str(name), Path(str(folder)) if folder else directory)
