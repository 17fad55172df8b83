"""The budget guard in the synthesized template: the budget, its notifications and subscribers, the stop
function's least-privilege policy; cfn-lint finds nothing and cdk-nag (run during synth) nothing unacknowledged.

One environment with a budget is synthesized in full (cfn-lint, cdk-nag); the variants are built as stacks
and read with CDK's assertions, which is enough to see which resources exist.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from aws_cdk import App, Stack
from aws_cdk import aws_budgets as budgets
from aws_cdk.assertions import Template

from stacks.budget import BudgetGuard
from stacks.config import ENVIRONMENTS_DIR, EnvironmentConfig, load_environment
from stacks.notifications import Notifications
from stacks.training_environment import TrainingEnvironmentStack
from tests.infra.test_validators import cfn_lint
from tests.support.synthesis import Synthesized, cdk_json_context, synthesize_config

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)

NAME = "budgeted"
MONTHLY_USD = 2500.5
STOP_PERCENT = 90


def environment(directory: Path, budget: dict[str, Any] | None) -> EnvironmentConfig:
    """default.yaml with `budget`, as environment `NAME` of `directory`."""
    data = yaml.safe_load((ENVIRONMENTS_DIR / "default.yaml").read_text())
    data.pop("budget", None)
    if budget is not None:
        data["budget"] = budget
    (directory / f"{NAME}.yaml").write_text(yaml.safe_dump(data))
    return load_environment(NAME, directory)


@pytest.fixture(scope="module")
def budgeted(tmp_path_factory: pytest.TempPathFactory) -> Synthesized:
    directory = tmp_path_factory.mktemp("environments")
    config = environment(directory, {"monthly_usd": MONTHLY_USD, "stop_fleet_at_percent": STOP_PERCENT})
    return synthesize_config(config, tmp_path_factory.mktemp("cdk-budgeted"))


def logical_id(env: Synthesized, resource_type: str, path_part: str) -> str:
    (found,) = (
        key
        for key, resource in env.resources_of_type(resource_type).items()
        if path_part in resource.get("Metadata", {}).get("aws:cdk:path", "")
    )
    return found


def test_budget_is_the_monthly_usd_cost_of_the_account(budgeted: Synthesized) -> None:
    budget = budgeted.only("AWS::Budgets::Budget")["Properties"]["Budget"]
    assert budget == {
        "BudgetName": "trainium-budgeted",
        "BudgetType": "COST",
        "TimeUnit": "MONTHLY",
        "BudgetLimit": {"Amount": MONTHLY_USD, "Unit": "USD"},
    }  # no CostFilters: the whole account (see BudgetGuard's docstring)


def test_notifications_at_80_and_100_go_to_the_alarm_topic_and_the_stop_percent_to_the_guard(
    budgeted: Synthesized,
) -> None:
    alarm_topic = logical_id(budgeted, "AWS::SNS::Topic", "/Notifications/Topic")
    guard_topic = logical_id(budgeted, "AWS::SNS::Topic", "/Budget/GuardTopic")
    notifications = budgeted.only("AWS::Budgets::Budget")["Properties"]["NotificationsWithSubscribers"]
    assert [
        (n["Notification"], n["Subscribers"]) for n in notifications
    ] == [
        (
            {"NotificationType": "ACTUAL", "ComparisonOperator": "GREATER_THAN", "Threshold": percent,
             "ThresholdType": "PERCENTAGE"},
            [{"SubscriptionType": "SNS", "Address": {"Ref": topic}}],
        )
        for percent, topic in ((80, alarm_topic), (STOP_PERCENT, guard_topic), (100, alarm_topic))
    ]  # fmt: skip


def test_only_the_stop_function_subscribes_to_the_guard_topic(budgeted: Synthesized) -> None:
    guard_topic = logical_id(budgeted, "AWS::SNS::Topic", "/Budget/GuardTopic")
    function = logical_id(budgeted, "AWS::Lambda::Function", "/Budget/Stop/")
    on_guard = [
        s["Properties"]
        for s in budgeted.resources_of_type("AWS::SNS::Subscription").values()
        if s["Properties"]["TopicArn"] == {"Ref": guard_topic}
    ]
    assert on_guard == [
        {"Protocol": "lambda", "TopicArn": {"Ref": guard_topic}, "Endpoint": {"Fn::GetAtt": [function, "Arn"]}}
    ]
    properties = budgeted.template["Resources"][function]["Properties"]
    alarm_topic = logical_id(budgeted, "AWS::SNS::Topic", "/Notifications/Topic")
    assert properties["Environment"]["Variables"] == {
        "CLUSTER_NAME": budgeted.config.cluster_name,
        "ALARM_TOPIC_ARN": {"Ref": alarm_topic},
    }
    assert properties["Handler"] == "handler.handler"


def test_guard_topic_is_encrypted_and_only_budgets_of_this_account_publish(budgeted: Synthesized) -> None:
    guard_topic = logical_id(budgeted, "AWS::SNS::Topic", "/Budget/GuardTopic")
    key = logical_id(budgeted, "AWS::KMS::Key", "/Notifications/Key")
    assert budgeted.template["Resources"][guard_topic]["Properties"]["KmsMasterKeyId"] == {"Fn::GetAtt": [key, "Arn"]}
    (policy,) = (
        p["Properties"]["PolicyDocument"]["Statement"]
        for p in budgeted.resources_of_type("AWS::SNS::TopicPolicy").values()
        if p["Properties"]["Topics"] == [{"Ref": guard_topic}]
    )
    allowed = [{k: v for k, v in s.items() if k != "Sid"} for s in policy if s["Effect"] == "Allow"]
    assert allowed == [
        {
            "Action": "sns:Publish",
            "Condition": {"StringEquals": {"aws:SourceAccount": {"Ref": "AWS::AccountId"}}},
            "Effect": "Allow",
            "Principal": {"Service": "budgets.amazonaws.com"},
            "Resource": {"Ref": guard_topic},
        }
    ]


def test_stop_function_may_touch_exactly_the_clusters_status_table(budgeted: Synthesized) -> None:
    role = logical_id(budgeted, "AWS::IAM::Role", "/Budget/StopRole/")
    (policy,) = (
        p["Properties"]
        for p in budgeted.resources_of_type("AWS::IAM::Policy").values()
        if p["Properties"]["Roles"] == [{"Ref": role}]
    )
    statements = policy["PolicyDocument"]["Statement"]
    table = {
        "Fn::Join": [
            "",
            [
                "arn:",
                {"Ref": "AWS::Partition"},
                ":dynamodb:",
                {"Ref": "AWS::Region"},
                ":",
                {"Ref": "AWS::AccountId"},
                f":table/parallelcluster-{budgeted.config.cluster_name}",
            ],
        ]
    }
    assert {"Action": ["dynamodb:GetItem", "dynamodb:UpdateItem"], "Effect": "Allow", "Resource": table} in statements
    dynamodb = [s for s in statements if any(a.startswith("dynamodb:") for a in _actions(s))]
    assert len(dynamodb) == 1
    alarm_topic = logical_id(budgeted, "AWS::SNS::Topic", "/Notifications/Topic")
    assert {"Action": "sns:Publish", "Effect": "Allow", "Resource": {"Ref": alarm_topic}} in statements
    # Nothing else: publish's key grant and its own log group.
    services = sorted({a.split(":")[0] for s in statements for a in _actions(s)})
    assert services == ["dynamodb", "kms", "logs", "sns"]
    assert budgeted.template["Resources"][role]["Properties"].get("ManagedPolicyArns") is None


def _actions(statement: dict[str, Any]) -> list[str]:
    actions = statement["Action"]
    return [actions] if isinstance(actions, str) else list(actions)


def test_stop_function_logs_to_its_own_group_with_the_retention(budgeted: Synthesized) -> None:
    function = logical_id(budgeted, "AWS::Lambda::Function", "/Budget/Stop/")
    group = logical_id(budgeted, "AWS::Logs::LogGroup", "/Budget/StopLogs/")
    properties = budgeted.template["Resources"][function]["Properties"]
    assert properties["LoggingConfig"] == {"LogGroup": {"Ref": group}}
    retention = budgeted.template["Resources"][group]["Properties"]["RetentionInDays"]
    assert retention == budgeted.config.logging.retention_days


def test_cfn_lint_reports_nothing(budgeted: Synthesized) -> None:
    templates = sorted(budgeted.outdir.glob("*.template.json"))
    result = cfn_lint(*templates)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_cdk_nag_has_no_unacknowledged_findings(budgeted: Synthesized) -> None:
    (report,) = (r for r in budgeted.validation_report["pluginReports"] if r["pluginName"] == "AwsSolutions")
    assert report["conclusion"] == "success"
    assert report["violations"] == []


def guard_only(stop_at_percent: int | None) -> Template:
    """The construct alone in a stack: enough to see its resources, without the environment's synth."""
    stack = Stack(App(), "Guard")
    notifications = Notifications(stack, "Notifications", topic_name="alarms", email=None)
    BudgetGuard(
        stack,
        "Budget",
        budget_name="guarded",
        monthly_usd=100,
        stop_at_percent=stop_at_percent,
        cluster_name="c1",
        notifications=notifications,
        log_retention_days=7,
    )
    return Template.from_stack(stack)


def test_notify_only_has_no_function_and_no_guard_topic() -> None:
    template = guard_only(None)
    template.resource_count_is("AWS::Lambda::Function", 0)
    template.resource_count_is("AWS::SNS::Topic", 1)
    (budget,) = template.find_resources("AWS::Budgets::Budget").values()
    thresholds = [n["Notification"]["Threshold"] for n in budget["Properties"]["NotificationsWithSubscribers"]]
    assert thresholds == [80, 100]


def test_stop_at_100_percent_routes_that_notification_to_the_guard() -> None:
    template = guard_only(100)
    template.resource_count_is("AWS::Lambda::Function", 1)
    (budget,) = template.find_resources("AWS::Budgets::Budget").values()
    topics = template.find_resources("AWS::SNS::Topic")
    (guard,) = (key for key in topics if key.startswith("BudgetGuardTopic"))
    (alarms,) = (key for key in topics if key.startswith("NotificationsTopic"))
    routes = [
        (n["Notification"]["Threshold"], n["Subscribers"][0]["Address"])
        for n in budget["Properties"]["NotificationsWithSubscribers"]
    ]
    assert routes == [(80, {"Ref": alarms}), (100, {"Ref": guard})]


def test_no_budget_without_monthly_usd() -> None:
    config = load_environment("default", ENVIRONMENTS_DIR)
    assert config.budget.monthly_usd is None
    stack = TrainingEnvironmentStack(App(context=cdk_json_context()), config=config)
    assert not [c for c in stack.node.find_all() if isinstance(c, budgets.CfnBudget)]
    assert stack.node.try_find_child("Budget") is None
