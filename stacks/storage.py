"""Storage: the results bucket that outlives the stack, and the scratch Lustre file system linked to it."""

from __future__ import annotations

from typing import Any

from aws_cdk import Aws, Duration, RemovalPolicy
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_fsx as fsx
from aws_cdk import aws_iam as iam
from aws_cdk import aws_s3 as s3
from constructs import Construct

NONCURRENT_VERSION_DAYS = 30
INCOMPLETE_UPLOAD_DAYS = 7
# Lustre server ports FSx documents for client and intra-file-system traffic.
LUSTRE_PORTS = (ec2.Port.tcp(988), ec2.Port.tcp_range(1018, 1023))


class Storage(Construct):
    """S3 results bucket (kept on destroy) and FSx for Lustre SCRATCH_2 importing from / exporting to it.

    The file system is created here rather than by ParallelCluster so that a cluster update can never
    replace it, and passed to the cluster by id.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        fsx_capacity_gib: int,
        fsx_s3_prefix: str,
        vpc: ec2.IVpc,
        subnet: ec2.ISubnet,
        client_security_group: ec2.ISecurityGroup,
    ) -> None:
        super().__init__(scope, construct_id)
        self.bucket = s3.Bucket(
            self,
            "Results",
            encryption=s3.BucketEncryption.S3_MANAGED,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            enforce_ssl=True,
            versioned=True,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            removal_policy=RemovalPolicy.RETAIN,
            # Versioning protects results from an overwrite; old versions and abandoned multipart uploads
            # (an interrupted export of a large checkpoint) would otherwise bill forever.
            lifecycle_rules=[
                s3.LifecycleRule(
                    id="ExpireOldVersionsAndAbandonedUploads",
                    noncurrent_version_expiration=Duration.days(NONCURRENT_VERSION_DAYS),
                    abort_incomplete_multipart_upload_after=Duration.days(INCOMPLETE_UPLOAD_DAYS),
                )
            ],
        )

        self.file_system_security_group = ec2.SecurityGroup(
            self,
            "FileSystemSecurityGroup",
            vpc=vpc,
            description="FSx for Lustre: Lustre ports from cluster nodes",
            allow_all_outbound=True,
        )
        # Traffic between the file servers themselves is opened by LustreFileSystem (988-1023 within the group).
        for port in LUSTRE_PORTS:
            self.file_system_security_group.add_ingress_rule(client_security_group, port, "Lustre from cluster nodes")

        self.fsx_s3_prefix = fsx_s3_prefix
        repository = f"s3://{self.bucket.bucket_name}/{fsx_s3_prefix}"
        self.file_system = fsx.LustreFileSystem(
            self,
            "FileSystem",
            vpc=vpc,
            vpc_subnet=subnet,
            security_group=self.file_system_security_group,
            storage_capacity_gib=fsx_capacity_gib,
            lustre_configuration=fsx.LustreConfiguration(
                deployment_type=fsx.LustreDeploymentType.SCRATCH_2,
                import_path=repository,
                export_path=repository,
                auto_import_policy=fsx.LustreAutoImportPolicy.NEW_CHANGED_DELETED,
            ),
            removal_policy=RemovalPolicy.DESTROY,
        )
        if self.bucket.policy is not None:
            # FSx reads the bucket when it is created, so the bucket policy must exist first.
            self.file_system.node.add_dependency(self.bucket.policy)
            # The kept bucket keeps its rules too: TLS only, and nobody but the deployment writes node code.
            self.bucket.policy.apply_removal_policy(RemovalPolicy.RETAIN)

    # Access to storage, as statements the stack hands to the constructs that need it (like a Lambda
    # function's `initial_policy`), so they lead the principal's policy.

    def results_access(
        self, *, read_prefixes: tuple[str, ...], write_prefixes: tuple[str, ...] = ()
    ) -> list[iam.PolicyStatement]:
        """List the results bucket; read objects under `read_prefixes`, put and delete under `write_prefixes`."""
        statements = [
            iam.PolicyStatement(actions=["s3:ListBucket"], resources=[self.bucket.bucket_arn]),
            iam.PolicyStatement(
                actions=["s3:GetObject"], resources=[self.bucket.arn_for_objects(f"{p}*") for p in read_prefixes]
            ),
        ]
        if write_prefixes:
            statements.append(
                iam.PolicyStatement(
                    actions=["s3:PutObject", "s3:DeleteObject"],
                    resources=[self.bucket.arn_for_objects(f"{prefix}*") for prefix in write_prefixes],
                )
            )
        return statements

    def protect_executed_code(
        self, *, code_prefixes: tuple[str, ...], code_writer: iam.IRole, imported: tuple[str, ...]
    ) -> None:
        """Nodes run, as root, what lands under these keys: the shipped code and node files (`code_prefixes`,
        written only by `code_writer`, the deployment's role) and the file system folders FSx imports and
        jobs execute (`imported`: the shared environment, the pipeline's sources, the compile cache; nobody
        writes those through S3). Everyone else, administrators included, is denied writing them."""
        self._deny_writes(
            "OnlyTheDeploymentWritesNodeCode",
            [f"{prefix}*" for prefix in code_prefixes],
            conditions={"ArnNotEquals": {"aws:PrincipalArn": code_writer.role_arn}},
        )
        self._deny_writes("NobodyWritesExecutedFileSystemFolders", [f"{self.fsx_s3_prefix}/{f}/*" for f in imported])

    def _deny_writes(self, sid: str, keys: list[str], conditions: dict[str, Any] | None = None) -> None:
        """A bucket policy statement denying everyone (but whom `conditions` exempt) writing these keys."""
        self.bucket.add_to_resource_policy(
            iam.PolicyStatement(
                sid=sid,
                effect=iam.Effect.DENY,
                principals=[iam.AnyPrincipal()],
                actions=["s3:PutObject", "s3:DeleteObject", "s3:DeleteObjectVersion"],
                resources=[self.bucket.arn_for_objects(key) for key in keys],
                conditions=conditions,
            )
        )

    def results_read_access(self, prefix: str) -> list[iam.PolicyStatement]:
        """Read the results bucket's objects under `prefix` only."""
        return [iam.PolicyStatement(actions=["s3:GetObject"], resources=[self.bucket.arn_for_objects(f"{prefix}*")])]

    def export_access(self) -> list[iam.PolicyStatement]:
        """Start data repository tasks (exports to the bucket) on this file system and follow them."""
        fsx_arn = f"arn:{Aws.PARTITION}:fsx:{Aws.REGION}:{Aws.ACCOUNT_ID}"
        tasks = f"{fsx_arn}:task/*"  # a task's id exists only once it is created
        return [
            iam.PolicyStatement(
                actions=["fsx:CreateDataRepositoryTask"],
                resources=[f"{fsx_arn}:file-system/{self.file_system.file_system_id}", tasks],
            ),
            # No resource-level permissions (Service Authorization Reference): granted on a task ARN, it is denied.
            iam.PolicyStatement(actions=["fsx:DescribeDataRepositoryTasks"], resources=["*"]),
        ]
