"""The budget guard: an AWS Budgets cost budget whose notices go to the alarm topic, and which stops the
cluster's compute fleet (ParallelCluster's compute-fleet stop) when actual cost reaches the stop percent.

The stop itself is `assets/lambda/budget_guard/handler.py`: it sets the fleet status that clustermgtd on
the head node acts on, then tells the alarm topic what it did.
"""

from __future__ import annotations

from pathlib import Path

from aws_cdk import Aws, Duration
from aws_cdk import aws_budgets as budgets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sns_subscriptions as subscriptions
from constructs import Construct

from stacks.handler_functions import handler_function
from stacks.notifications import Notifications

HANDLER_DIR = Path(__file__).resolve().parent.parent / "assets" / "lambda" / "budget_guard"
# Every budget notifies at these percentages of its amount, on actual (not forecast) cost.
NOTICE_PERCENTS = (80, 100)
# ParallelCluster's status table of a cluster (pcluster.constants.PCLUSTER_DYNAMODB_PREFIX + cluster name).
FLEET_STATUS_TABLE_PREFIX = "parallelcluster-"


def fleet_status_table_arn(cluster_name: str) -> str:
    """The ARN of the table whose COMPUTE_FLEET item `pcluster update-compute-fleet` writes."""
    return f"arn:{Aws.PARTITION}:dynamodb:{Aws.REGION}:{Aws.ACCOUNT_ID}:table/{FLEET_STATUS_TABLE_PREFIX}{cluster_name}"


class BudgetGuard(Construct):
    """A monthly USD cost budget of the whole account, notices at 80 % and 100 % of it, and the fleet stop.

    The budget counts the account's entire cost, not this stack's: one environment is deployed per account
    (one reviewed environment file per account), and a filter on this stack's tags would count nothing until
    someone activates those tags as cost-allocation tags by hand in the Billing console, so a filtered budget
    would silently never fire.

    AWS Budgets allows one SNS subscriber per notification. The notification at `stop_at_percent` goes to a
    guard topic of its own, which only the stop function subscribes to; the function forwards the budget's
    message and what it did to the alarm topic. The other notifications go to the alarm topic directly.
    With `stop_at_percent` None there is no guard topic and no function: the budget only notifies.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        budget_name: str,
        monthly_usd: float,
        stop_at_percent: int | None,
        cluster_name: str,
        notifications: Notifications,
        log_retention_days: int,
    ) -> None:
        super().__init__(scope, construct_id)
        self.guard_topic: sns.Topic | None = None
        self.function: lambda_.Function | None = None
        if stop_at_percent is not None:
            self.guard_topic = self._guard_topic(f"{budget_name}-budget-guard", notifications)
            self.function = self._stop_function(cluster_name, notifications, log_retention_days)
            self.guard_topic.add_subscription(subscriptions.LambdaSubscription(self.function))

        def subscriber_of(percent: int) -> sns.ITopic:
            if self.guard_topic is not None and percent == stop_at_percent:
                return self.guard_topic
            return notifications.topic

        percents = sorted({*NOTICE_PERCENTS, *([stop_at_percent] if stop_at_percent is not None else [])})
        self.budget = budgets.CfnBudget(
            self,
            "Budget",
            budget=budgets.CfnBudget.BudgetDataProperty(
                budget_name=budget_name,
                budget_type="COST",
                time_unit="MONTHLY",
                budget_limit=budgets.CfnBudget.SpendProperty(amount=monthly_usd, unit="USD"),
            ),
            notifications_with_subscribers=[
                budgets.CfnBudget.NotificationWithSubscribersProperty(
                    notification=budgets.CfnBudget.NotificationProperty(
                        notification_type="ACTUAL",
                        comparison_operator="GREATER_THAN",
                        threshold=percent,
                        threshold_type="PERCENTAGE",
                    ),
                    subscribers=[
                        budgets.CfnBudget.SubscriberProperty(
                            subscription_type="SNS", address=subscriber_of(percent).topic_arn
                        )
                    ],
                )
                for percent in percents
            ],
        )
        # Budgets must be allowed to publish before its first notice: the topics' policies and the key's first
        # (the topics themselves are referenced already).
        self.budget.node.add_dependency(notifications.key)
        for topic in (notifications.topic, self.guard_topic):
            if topic is not None and (policy := topic.node.try_find_child("Policy")) is not None:
                self.budget.node.add_dependency(policy)

    def _guard_topic(self, topic_name: str, notifications: Notifications) -> sns.Topic:
        """The topic of the stop notification: encrypted with the notifications' key, whose policy already lets
        AWS Budgets use it, and published to by AWS Budgets of this account only."""
        topic = sns.Topic(
            self,
            "GuardTopic",
            topic_name=topic_name,
            display_name=topic_name,
            master_key=notifications.key,
            enforce_ssl=True,
        )
        topic.add_to_resource_policy(
            iam.PolicyStatement(
                actions=["sns:Publish"],
                principals=[iam.ServicePrincipal("budgets.amazonaws.com")],
                resources=[topic.topic_arn],
                conditions={"StringEquals": {"aws:SourceAccount": Aws.ACCOUNT_ID}},
            )
        )
        return topic

    def _stop_function(
        self, cluster_name: str, notifications: Notifications, log_retention_days: int
    ) -> lambda_.Function:
        role = iam.Role(
            self,
            "StopRole",
            assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"),
            description=f"Budget guard of {cluster_name}: its compute fleet status and the alarm topic only",
        )
        role.add_to_policy(
            iam.PolicyStatement(
                actions=["dynamodb:GetItem", "dynamodb:UpdateItem"],
                resources=[fleet_status_table_arn(cluster_name)],
            )
        )
        notifications.grant_publish(role)  # its notices: what it did, and the budget's message
        return handler_function(
            self,
            "Stop",
            description=f"Stops the compute fleet of {cluster_name} when the budget's stop notification arrives",
            handler_dir=HANDLER_DIR,
            role=role,
            logs_id="StopLogs",
            log_retention_days=log_retention_days,
            timeout=Duration.minutes(1),
            environment={"CLUSTER_NAME": cluster_name, "ALARM_TOPIC_ARN": notifications.topic.topic_arn},
        )
