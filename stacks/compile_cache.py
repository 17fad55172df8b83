"""The compile cache that outlives the environment: its promoter function, and who may touch which half of it.

Under `<prefix>/` of the results bucket (kept on destroy): `staging/<key>/<run id>/`, which the Trainium nodes write
after a compile (training.pipeline.compile_cache.save), and `promoted/<key>/`, which they restore from before the
next one. Only the promoter's role may write `promoted/` (a bucket policy denies everyone else, administrators
included): it copies a staged cache there after checking every object against its manifest. Nodes never write
what nodes execute.
"""

from __future__ import annotations

from pathlib import Path

from aws_cdk import Duration
from aws_cdk import aws_iam as iam
from aws_cdk import aws_s3 as s3
from constructs import Construct

from stacks.handler_functions import handler_function

HANDLER_DIR = Path(__file__).resolve().parents[1] / "assets" / "lambda" / "compile_cache_promoter"
COMPILE_CACHE_PREFIX = "compile-cache"
STAGING = f"{COMPILE_CACHE_PREFIX}/staging/"
PROMOTED = f"{COMPILE_CACHE_PREFIX}/promoted/"
# Staged copies are promoted within minutes; what a failed promotion leaves expires.
STAGING_DAYS = 14


def promoter_name(stack_name: str) -> str:
    """The function's name, known before deployment so the site file can name it (environment names are at most
    31 characters, so this is at most 55 of Lambda's 64)."""
    return f"{stack_name}-cache-promoter"


class CompileCache(Construct):
    def __init__(
        self, scope: Construct, construct_id: str, *, bucket: s3.Bucket, function_name: str, log_retention_days: int
    ) -> None:
        super().__init__(scope, construct_id)
        self.bucket = bucket
        self.role = iam.Role(
            self,
            "PromoterRole",
            assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"),
            description="Compile cache promoter: reads staged compile caches, writes the promoted ones",
        )
        # Read (at the version it checked) what nodes staged; write, list and clean up the promoted copies.
        self.role.add_to_policy(
            iam.PolicyStatement(
                actions=["s3:GetObject", "s3:GetObjectVersion"], resources=[bucket.arn_for_objects(f"{STAGING}*")]
            )
        )
        self.role.add_to_policy(
            iam.PolicyStatement(
                actions=["s3:PutObject", "s3:DeleteObject"], resources=[bucket.arn_for_objects(f"{PROMOTED}*")]
            )
        )
        self.role.add_to_policy(
            iam.PolicyStatement(
                actions=["s3:ListBucket"],
                resources=[bucket.bucket_arn],
                conditions={"StringLike": {"s3:prefix": [f"{PROMOTED}*", f"{STAGING}*"]}},
            )
        )
        self.function = handler_function(
            self,
            "Promoter",
            description="Promotes a staged Neuron compile cache after checking every file's SHA-256",
            handler_dir=HANDLER_DIR,
            role=self.role,
            logs_id="PromoterLogs",
            log_retention_days=log_retention_days,
            # Copies within S3 (no data through the function unless an object lacks a full-object checksum).
            timeout=Duration.minutes(15),
            environment={"BUCKET": bucket.bucket_name, "PREFIX": COMPILE_CACHE_PREFIX},
            function_name=function_name,
        )
        bucket.add_lifecycle_rule(
            id="ExpireStagedCompileCaches", prefix=STAGING, expiration=Duration.days(STAGING_DAYS)
        )
        bucket.add_to_resource_policy(
            iam.PolicyStatement(
                sid="OnlyThePromoterWritesPromotedCompileCaches",
                effect=iam.Effect.DENY,
                principals=[iam.AnyPrincipal()],
                actions=["s3:PutObject", "s3:DeleteObject", "s3:DeleteObjectVersion"],
                resources=[bucket.arn_for_objects(f"{PROMOTED}*")],
                conditions={"ArnNotEquals": {"aws:PrincipalArn": self.role.role_arn}},
            )
        )

    @property
    def store_uri(self) -> str:
        return f"s3://{self.bucket.bucket_name}/{COMPILE_CACHE_PREFIX}"

    def node_access(self) -> list[iam.PolicyStatement]:
        """What the compile stage's nodes need: stage a cache, read the promoted ones, ask for a promotion."""
        return [
            iam.PolicyStatement(actions=["s3:PutObject"], resources=[self.bucket.arn_for_objects(f"{STAGING}*")]),
            iam.PolicyStatement(actions=["s3:GetObject"], resources=[self.bucket.arn_for_objects(f"{PROMOTED}*")]),
            iam.PolicyStatement(actions=["lambda:InvokeFunction"], resources=[self.function.function_arn]),
        ]
