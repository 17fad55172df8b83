"""The post-deploy trigger: ships this commit's training code to the results bucket and, once the cluster
exists, has the head node submit the recipe's Slurm pipeline; on destroy, cancels the run and exports the
runs from FSx to S3 before the file system is deleted.

CloudFormation waits only for the submission (seconds), never for training: the custom resource's handlers
(`assets/lambda/pipeline_trigger/handler.py`) poll an SSM command and an FSx export task, bounded by
`pipeline.timeout_minutes`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aws_cdk import CustomResource, Duration, IgnoreStrategy, Stack
from aws_cdk import aws_fsx as fsx
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_s3_deployment as s3_deployment
from aws_cdk import aws_sns as sns
from aws_cdk import aws_stepfunctions as sfn
from aws_cdk import custom_resources as cr
from constructs import Construct

from stacks.config import PipelineConfig
from stacks.log_groups import log_group_with_retention

ROOT = Path(__file__).resolve().parent.parent
HANDLER_DIR = ROOT / "assets" / "lambda" / "pipeline_trigger"
# What the head node needs to run the pipeline: the package, the job templates, the project metadata.
SOURCE_PARTS = ("training", "assets", "pyproject.toml")
# Never shipped from those parts: what only a developer machine needs (local Slurm, demo, tiny models),
# caches and hidden files. Tests and benchmarks are not among SOURCE_PARTS.
SOURCE_NEVER = ("training/local", "training/local/**", "__pycache__", "*.pyc", ".*")
# The one definition of what is shipped, as CDK asset exclude patterns (globs; the last pattern that
# matches a path decides; a pattern without '/' matches a base name at any depth; '*' skips hidden names):
# everything, but SOURCE_PARTS, but not SOURCE_NEVER. The upload applies it, and so does `source_files`.
SOURCE_EXCLUDE = (
    "*",
    ".*",
    *(f"!{part}" for part in SOURCE_PARTS),
    *(f"!{part}/**" for part in SOURCE_PARTS),
    *SOURCE_NEVER,
)
SSM_OUTPUT_PREFIX = "pipeline/ssm-output/"
SOURCE_PREFIX = "pipeline/source/"
# The id CDK gives the one BucketDeployment handler of a stack (a fixed UUID and the memory limit).
BUCKET_DEPLOYMENT_HANDLER = "Custom::CDKBucketDeployment8693BB64968944B69AAFB0CC9EB8756C512MiB"


@dataclass(frozen=True)
class SharedEnvironment:
    """The head node's shared Neuron environment, which the pipeline brings up to date before a new run."""

    path: str
    neuron_release: str
    requirements: str  # its locked requirement set, as a path in the shipped source (assets/node/...)


def source_files(root: Path = ROOT) -> list[Path]:
    """The shipped files, relative to `root`, in a stable order: what CDK stages for the upload, selected
    by CDK's own matcher with SOURCE_EXCLUDE and walked as CDK does (an excluded directory is not entered)."""
    root = root.resolve()
    ignores = IgnoreStrategy.glob(str(root), list(SOURCE_EXCLUDE)).ignores

    def walk(directory: Path) -> Iterator[Path]:
        for path in sorted(directory.iterdir(), key=lambda p: p.name):
            if ignores(str(path)):
                continue
            if path.is_dir():
                yield from walk(path)
            elif path.is_file():
                yield path.relative_to(root)

    return list(walk(root))


def source_hash(root: Path = ROOT) -> str:
    """SHA-256 of the shipped files' names and contents: where a new run's code is (a run starts only when the
    environment file's `pipeline.run` changes, never because the code did)."""
    digest = hashlib.sha256()
    for relative in source_files(root):
        digest.update(f"{relative.as_posix()}\0".encode())
        digest.update((root / relative).read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


class PipelineTrigger(Construct):
    """The deploy trigger of the training pipeline, tied to the stack's lifecycle (see the module docstring).
    Its construct id stays "Pipeline" in the stack, which keeps the resources' logical ids.

    `handler_access` is what the stack grants the handlers on the cluster and the storage (commands to the
    head node, their output in the bucket, exports of the file system); it leads the handler role's policy.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        environment_name: str,
        cluster_name: str,
        pipeline: PipelineConfig,
        shared_environment: SharedEnvironment,
        site_settings: Mapping[str, Any],
        log_retention_days: int,
        bucket: s3.IBucket,
        file_system: fsx.IFileSystem,
        file_system_mount_dir: str,
        head_node_instance_id: str,
        deployment_logs: logs.ILogGroup,
        handler_access: Sequence[iam.PolicyStatement],
        notice_topic: sns.ITopic,
    ) -> None:
        super().__init__(scope, construct_id)
        digest = source_hash()
        prefix = f"{SOURCE_PREFIX}{digest}/"
        self.source = self._ship_source(bucket, prefix, deployment_logs)
        self.handler_role = iam.Role(
            self,
            "HandlerRole",
            assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"),
            description=f"Pipeline trigger of {cluster_name}: its head node, bucket and file system only",
        )
        for statement in handler_access:
            self.handler_role.add_to_policy(statement)
        timeout = Duration.minutes(pipeline.timeout_minutes)
        self.provider = self._provider(timeout, log_retention_days)
        self.resource = CustomResource(
            self,
            "Resource",
            resource_type="Custom::TrainingPipeline",
            service_token=self.provider.service_token,
            properties={
                "EnvironmentName": environment_name,
                "ClusterName": cluster_name,
                "HeadNodeInstanceId": head_node_instance_id,
                "StartRun": "true" if pipeline.start_run else "false",
                "Run": str(pipeline.run),
                "ExportOptimizerState": "true" if pipeline.export_optimizer_state else "false",
                "Recipe": pipeline.recipe,
                "RecipeOverrides": list(pipeline.overrides),
                "SourceBucket": bucket.bucket_name,
                "SourceKey": prefix,
                "SourceHash": digest,
                "SiteSettings": Stack.of(self).to_json_string(dict(site_settings)),
                "SharedEnvironmentPath": shared_environment.path,
                "NeuronRelease": shared_environment.neuron_release,
                "RequirementsInSource": shared_environment.requirements,
                "FileSystemId": file_system.file_system_id,
                "FileSystemMountDir": file_system_mount_dir,
                "OutputBucket": bucket.bucket_name,
                "OutputPrefix": SSM_OUTPUT_PREFIX,
                "TimeoutSeconds": str(int(timeout.to_seconds())),
                # A run that cannot start is a notice here, never a failed deploy (see the handler).
                "NoticeTopicArn": notice_topic.topic_arn,
            },
        )
        # The code must be in the bucket before the head node fetches it.
        self.resource.node.add_dependency(self.source)
        self._accept_redundant_role_dependencies()
        self.run_id = self.resource.get_att_string("RunId")
        self.run_dir = self.resource.get_att_string("RunDir")
        self.job_ids = self.resource.get_att_string("JobIds")
        self.run_status = self.resource.get_att_string("RunStatus")

    def _ship_source(
        self, bucket: s3.IBucket, prefix: str, deployment_logs: logs.ILogGroup
    ) -> s3_deployment.BucketDeployment:
        """This commit's shipped files under `prefix` of the bucket, where the head node fetches them."""
        return s3_deployment.BucketDeployment(
            self,
            "Source",
            sources=[s3_deployment.Source.asset(str(ROOT), exclude=list(SOURCE_EXCLUDE))],
            destination_bucket=bucket,
            destination_key_prefix=prefix,
            prune=False,  # earlier commits' sources stay: their runs may still read them
            retain_on_delete=True,
            memory_limit=512,
            log_group=deployment_logs,  # the handler's own log group would outlive the stack, unexpiring
        )

    def _provider(self, timeout: Duration, log_retention_days: int) -> cr.Provider:
        """The Provider framework around the two handlers (`handler.on_event`, `handler.is_complete`), each
        on the handler role, logging to a log group of its own."""
        handler_code = lambda_.Code.from_asset(str(HANDLER_DIR), exclude=["__pycache__", "*.pyc"])
        functions = {}
        for name, entry in (("OnEvent", "handler.on_event"), ("IsComplete", "handler.is_complete")):
            log_group = log_group_with_retention(self, f"{name}Logs", log_retention_days)
            log_group.grant_write(self.handler_role)  # its own log groups, not the broad basic-execution policy
            functions[name] = lambda_.Function(
                self,
                name,
                runtime=lambda_.Runtime.PYTHON_3_14,
                handler=entry,
                code=handler_code,
                role=self.handler_role,
                timeout=Duration.minutes(1),
                memory_size=256,
                log_group=log_group,
            )
        # The handlers fail with their own reason at `timeout`; the framework's bound comes later.
        return cr.Provider(
            self,
            "Provider",
            on_event_handler=functions["OnEvent"],
            is_complete_handler=functions["IsComplete"],
            query_interval=Duration.seconds(10),
            total_timeout=Duration.seconds(timeout.to_seconds() + 120),
            log_group=log_group_with_retention(self, "ProviderLogs", log_retention_days),
        )

    def _accept_redundant_role_dependencies(self) -> None:
        """Scope cfn-lint's W3005 exception to the Lambda functions and the state machine built here and
        CDK's BucketDeployment handler: CDK writes both `DependsOn` and `Fn::GetAtt` to their roles (harmless,
        not ours to change); only these resources ignore only that rule."""
        deployment = Stack.of(self).node.try_find_child(BUCKET_DEPLOYMENT_HANDLER)
        scopes = [self, deployment] if deployment is not None else [self]
        for scope in scopes:
            for construct in scope.node.find_all():
                if isinstance(construct, lambda_.CfnFunction | sfn.CfnStateMachine):
                    construct.add_metadata("cfn-lint", {"config": {"ignore_checks": ["W3005"]}})
