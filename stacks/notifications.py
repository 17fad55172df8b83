"""Notifications: the one SNS topic every alarm and budget notice goes to, and its optional e-mail address."""

from __future__ import annotations

from aws_cdk import Aws, Duration, RemovalPolicy
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sns_subscriptions as subscriptions
from constructs import Construct

# The services that publish to the topic themselves: CloudWatch alarms and AWS Budgets.
PUBLISHING_SERVICES = ("cloudwatch.amazonaws.com", "budgets.amazonaws.com")


class Notifications(Construct):
    """An encrypted topic that CloudWatch alarms and AWS Budgets may publish to.

    The topic is encrypted with a key of its own: SNS's AWS-managed key cannot grant the publishing
    services, so their notices would be dropped.
    """

    def __init__(self, scope: Construct, construct_id: str, *, topic_name: str, email: str | None) -> None:
        super().__init__(scope, construct_id)
        self.key = kms.Key(
            self,
            "Key",
            description=f"Encrypts the notifications of {topic_name}",
            enable_key_rotation=True,
            removal_policy=RemovalPolicy.DESTROY,
            pending_window=Duration.days(7),
        )
        self.topic = sns.Topic(
            self, "Topic", topic_name=topic_name, master_key=self.key, enforce_ssl=True, display_name=topic_name
        )
        for service in PUBLISHING_SERVICES:
            principal = iam.ServicePrincipal(service)
            self.key.add_to_resource_policy(
                iam.PolicyStatement(
                    actions=["kms:Decrypt", "kms:GenerateDataKey*"],
                    principals=[principal],
                    resources=["*"],  # in a key policy, "*" is this key
                    conditions={"StringEquals": {"aws:SourceAccount": Aws.ACCOUNT_ID}},
                )
            )
            self.topic.add_to_resource_policy(
                iam.PolicyStatement(
                    actions=["sns:Publish"],
                    principals=[principal],
                    resources=[self.topic.topic_arn],
                    conditions={"StringEquals": {"aws:SourceAccount": Aws.ACCOUNT_ID}},
                )
            )
        if email is not None:
            self.topic.add_subscription(subscriptions.EmailSubscription(email))

    def grant_publish(self, grantee: iam.IGrantable) -> None:
        """Publish to the topic (a Lambda function's notices): the topic, and the two key actions SNS needs
        of a publisher (Topic.grant_publish would grant kms:GenerateDataKey*, a wildcard)."""
        iam.Grant.add_to_principal(grantee=grantee, actions=["sns:Publish"], resource_arns=[self.topic.topic_arn])
        self.key.grant(grantee, "kms:Decrypt", "kms:GenerateDataKey")
