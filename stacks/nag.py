"""The reviewed cdk-nag acknowledgements: every accepted AwsSolutions finding, with why it is accepted.

This is the one place to review them. Any other finding fails `cdk synth` and the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Acknowledgment, Stack, Validations

from stacks.pipeline_trigger import BUCKET_DEPLOYMENT_HANDLER


@dataclass(frozen=True)
class Acknowledgement:
    path: str  # construct path below the stack
    rule: str
    reason: str


PUT_METRIC_DATA = "AwsSolutions-IAM5[Resource::*]"


def objects_under(prefix: str) -> str:
    """cdk-nag's rule id for a statement on the results bucket's objects under `prefix`."""
    return f"AwsSolutions-IAM5[Resource::<StorageResultsB2A4FB2E.Arn>/{prefix}*]"


# What each node role may do under which prefix of the results bucket (stacks/training_environment.py).
NODE_OBJECT_ACCESS = {
    "Cluster/HeadNodePolicy": {
        "pipeline/source/": "reads the training code this environment's runs were submitted with (one folder "
        "per source hash, not known at deploy time)",
        "cluster/": "reads the node files of this environment (the bootstrap script, the locked requirement set "
        "and the node settings) while bootstrapping",
        "results/": "reads each run's results under results/<run id>/ of this environment's bucket; run ids are "
        "not known at deploy time",
        "pipeline/ssm-output/": "SSM writes the output of this environment's pipeline commands with the head "
        "node's role; the command ids in the keys are not known at deploy time",
    },
    "Cluster/ComputeNodePolicy": {
        "cluster/": "reads the node files of this environment (the bootstrap script, the locked requirement set "
        "and the node settings)",
        "results/": "the export stage writes (and reads back) each run's results under results/<run id>/ of "
        "this environment's bucket; run ids are not known at deploy time",
    },
}

ACKNOWLEDGEMENTS = (
    Acknowledgement(
        "Preflight/Role",
        "AwsSolutions-IAM5[Resource::*]",
        "this environment's preflight only reads: ec2:Describe* (zones, instance type offerings and types, "
        "capacity reservations, images) and servicequotas:Get*/List* have no resource-level permissions "
        "(Service Authorization Reference).",
    ),
    Acknowledgement(
        "Storage/Results",
        "AwsSolutions-S1",
        "Results bucket is written only by this environment's node roles and FSx export; server access logs "
        "would need a second retained bucket per environment. Accounts that require object-level audit "
        "enable CloudTrail S3 data events account-wide instead.",
    ),
    *(
        Acknowledgement(policy, objects_under(prefix), reason)
        for policy, prefixes in NODE_OBJECT_ACCESS.items()
        for prefix, reason in prefixes.items()
    ),
    *(
        Acknowledgement(
            policy,
            PUT_METRIC_DATA,
            "cloudwatch:PutMetricData has no resource-level permissions; the statement is limited to this "
            "environment's metric namespace by the cloudwatch:namespace condition.",
        )
        for policy in ("Cluster/HeadNodePolicy", "Cluster/ComputeNodePolicy")
    ),
)


BASIC_EXECUTION = (
    "AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/AWSLambdaBasicExecutionRole]"
)


def pipeline_acknowledgements(region: str) -> tuple[Acknowledgement, ...]:
    """The post-deploy trigger's findings: CDK-managed framework code, and the handler role's scoped wildcards."""
    deployment = (
        "CDK's BucketDeployment handler (runtime, role and policy managed by aws-cdk-lib) copies this commit's "
        "training code from the CDK asset bucket to the pipeline/source/ prefix of this environment's bucket; "
        "its actions are CDK's grantRead/grantWrite sets on exactly those two buckets."
    )
    provider = (
        "CDK's custom-resource Provider framework (functions, waiter state machine, roles managed by "
        "aws-cdk-lib): its roles may only invoke this environment's two pipeline handlers (:* is their versions); it "
        "carries no data, and the handlers log to their own log groups."
    )
    handler = {
        "Resource::*": "ssm:GetCommandInvocation, ssm:DescribeInstanceInformation and "
        "fsx:DescribeDataRepositoryTasks have no resource-level permissions (Service Authorization Reference); "
        "they read only the status of this trigger's commands, of the head node and of its export tasks.",
        "Resource::<StorageResultsB2A4FB2E.Arn>/pipeline/ssm-output/*": "reads the output of its own SSM "
        "commands under one prefix of this environment's bucket (key names are per command).",
        "Resource::arn:<AWS::Partition>:ec2:<AWS::Region>:<AWS::AccountId>:instance/*": "ssm:SendCommand is "
        "limited by the ssm:resourceTag conditions to the instance tagged as this cluster's head node (its id "
        "is known only after the cluster exists).",
        "Resource::arn:<AWS::Partition>:fsx:<AWS::Region>:<AWS::AccountId>:task/*": "the export task of this "
        "file system gets its id when created; creating one is allowed only on this file system's ARN.",
    }
    bucket_actions = ("s3:Abort*", "s3:DeleteObject*", "s3:GetBucket*", "s3:GetObject*", "s3:List*")
    bucket_resources = (
        "<StorageResultsB2A4FB2E.Arn>/*",
        f"arn:aws:s3:::cdk-hnb659fds-assets-<AWS::AccountId>-{region}/*",
    )
    framework_functions = (
        "PipelineIsComplete2E67271D",
        "PipelineOnEvent98D05BAA",
        "PipelineProviderframeworkisComplete92DCF7DE",
        "PipelineProviderframeworkonTimeout036420E7",
    )
    return (
        Acknowledgement(BUCKET_DEPLOYMENT_HANDLER, "AwsSolutions-L1", deployment),
        Acknowledgement(f"{BUCKET_DEPLOYMENT_HANDLER}/ServiceRole", BASIC_EXECUTION, deployment),
        *(
            Acknowledgement(f"{BUCKET_DEPLOYMENT_HANDLER}/ServiceRole", f"AwsSolutions-IAM5[Action::{a}]", deployment)
            for a in bucket_actions
        ),
        *(
            Acknowledgement(f"{BUCKET_DEPLOYMENT_HANDLER}/ServiceRole", f"AwsSolutions-IAM5[Resource::{r}]", deployment)
            for r in bucket_resources
        ),
        *(
            Acknowledgement("Pipeline/HandlerRole", f"AwsSolutions-IAM5[{rule}]", reason)
            for rule, reason in handler.items()
        ),
        Acknowledgement("Pipeline/Provider", BASIC_EXECUTION, provider),
        *(
            Acknowledgement("Pipeline/Provider", f"AwsSolutions-IAM5[Resource::<{f}.Arn>:*]", provider)
            for f in framework_functions
        ),
        Acknowledgement("Pipeline/Provider", "AwsSolutions-SF1", provider + " Each poll is logged by the handlers."),
        Acknowledgement("Pipeline/Provider", "AwsSolutions-SF2", provider + " X-Ray adds nothing to a 3-step poll."),
    )


# The per-queue policies (Cluster/QueuePolicy-<queue>, stacks/cluster.py): what the CPU stages' queue may do under
# which prefix of the file system's part of the bucket (storage.fsx_s3_prefix).
CPU_STAGES_OBJECT_ACCESS = {
    "models/": "the fetch stage copies each base model it downloads to <fsx prefix>/models/<model>/, the prefix "
    "the file system imports /fsx/models from, and reads back the copy's fetch-manifest.json; model names come "
    "from the recipes this environment runs, not known at deploy time",
}


def queue_acknowledgements(cpu_stages_queue: str, fsx_s3_prefix: str) -> tuple[Acknowledgement, ...]:
    """The findings of the CPU stages' queue policy (stacks/training_environment.py: cpu_stages_queue)."""
    return tuple(
        Acknowledgement(f"Cluster/QueuePolicy-{cpu_stages_queue}", objects_under(f"{fsx_s3_prefix}/{folder}"), reason)
        for folder, reason in CPU_STAGES_OBJECT_ACCESS.items()
    )


# The compile cache in the bucket (stacks/compile_cache.py): who may do what under which of its prefixes.
COMPILE_CACHE_ACCESS = {
    "CompileCache/PromoterRole": {
        "compile-cache/staging/": "the promoter reads the compile caches this environment's Trainium nodes "
        "staged, under staging/<key>/<run id>/ (keys and run ids are not known at deploy time)",
        "compile-cache/promoted/": "the promoter writes this environment's promoted compile cache of each key "
        "under promoted/<key>/ and removes the files an earlier promotion of that key left; it is the only "
        "principal the bucket policy lets write there",
    },
    "Cluster/QueuePolicy-{trainium_queue}": {
        "compile-cache/staging/": "this environment's compile stage uploads what it compiled under "
        "staging/<key>/<run id>/ (PutObject only: no read, no delete; keys are per graph settings and run)",
        "compile-cache/promoted/": "this environment's compile stage reads the promoted compile cache of its key "
        "(GetObject only: the bucket policy denies every principal but the promoter writing there)",
    },
}


def compile_cache_acknowledgements(trainium_queue: str) -> tuple[Acknowledgement, ...]:
    return tuple(
        Acknowledgement(path.format(trainium_queue=trainium_queue), objects_under(prefix), reason)
        for path, prefixes in COMPILE_CACHE_ACCESS.items()
        for prefix, reason in prefixes.items()
    )


def acknowledge_reviewed_findings(
    stack: Stack, *, cpu_stages_queue: str, fsx_s3_prefix: str, trainium_queue: str
) -> None:
    """Attach each acknowledgement to the narrowest construct it concerns."""
    for acknowledgement in (
        *ACKNOWLEDGEMENTS,
        *pipeline_acknowledgements(stack.region),
        *queue_acknowledgements(cpu_stages_queue, fsx_s3_prefix),
        *compile_cache_acknowledgements(trainium_queue),
    ):
        construct = stack.node.find_child(acknowledgement.path.split("/")[0])
        for part in acknowledgement.path.split("/")[1:]:
            construct = construct.node.find_child(part)
        Validations.of(construct).acknowledge(
            Acknowledgment(id=f"AwsSolutions::{acknowledgement.rule}", reason=acknowledgement.reason)
        )
