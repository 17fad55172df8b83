"""The dashboard, the alarms and their topic, as synthesized, checked against CloudWatch's API rules."""

from __future__ import annotations

import json
import re
from typing import Any

import botocore.session
import pytest
from botocore.validate import ParamValidator

from stacks.monitoring import ALARM_METRICS, FSX_FREE_ALARM_FRACTION, GIB, THROUGHPUT_FLOOR_PERIODS
from stacks.training_environment import memory_plan_line
from tests.support.repository import ROOT
from tests.support.synthesis import Synthesized
from training.config.hardware import HARDWARE
from training.config.recipe import load_recipe
from training.monitoring import cloudwatch as names
from training.train.memory import planned_gib_per_core

ALARMS = (
    "training-stalled",
    "stage-failed",
    "late-compilation",
    "throughput-below-floor",
    "fsx-low-free-capacity",
    "head-node-unhealthy",
)
# What the cluster's publishers send (training/monitoring/cloudwatch.py) and the dashboard must show.
SHOWN = (
    names.TRAINING_LOSS,
    names.VALIDATION_LOSS,
    names.TOKENS_PER_SECOND,
    names.MFU,
    names.GRADIENT_NORM,
    names.LEARNING_RATE,
    names.MOE_DROPPED_TOKENS,
    names.LATE_COMPILATIONS,
    names.THROUGHPUT_FRACTION,
    names.BELOW_THROUGHPUT_FLOOR,
    names.STAGE_SECONDS,
    names.SLURM_JOBS,
    names.TRAINING_JOBS_RUNNING,
    names.FAILED_STAGES,
    names.SLURM_NODES,
    names.NEURONCORE_UTILIZATION,
    names.NEURONCORE_MEMORY_USED,
)


def alarms_of(env: Synthesized) -> dict[str, dict[str, Any]]:
    prefix = f"{env.config.stack_name}-"
    return {
        r["Properties"]["AlarmName"].removeprefix(prefix): r["Properties"]
        for r in env.resources_of_type("AWS::CloudWatch::Alarm").values()
    }


def alarm_topic(env: Synthesized) -> tuple[str, dict[str, Any]]:
    """The alarm topic (a budget's guard has a second one)."""
    ((logical, topic),) = [
        (k, v)
        for k, v in env.resources_of_type("AWS::SNS::Topic").items()
        if v["Metadata"]["aws:cdk:path"].endswith("/Notifications/Topic/Resource")
    ]
    return logical, topic


def topic_ref(env: Synthesized) -> dict[str, str]:
    return {"Ref": alarm_topic(env)[0]}


def resolved(value: Any) -> Any:
    """A template value with CloudFormation's functions replaced by plausible strings (what the API gets)."""
    if isinstance(value, dict):
        if set(value) <= {"Ref", "Fn::GetAtt", "Fn::Join", "Fn::Sub"} and len(value) == 1:
            key, argument = next(iter(value.items()))
            if key == "Fn::Join":
                return argument[0].join(str(resolved(part)) for part in argument[1])
            return "arn:aws:sns:us-west-2:123456789012:resolved" if key == "Ref" else "i-0123456789abcdef0"
        return {k: resolved(v) for k, v in value.items()}
    if isinstance(value, list):
        return [resolved(v) for v in value]
    return value


def dashboard_body(env: Synthesized) -> dict[str, Any]:
    body = env.only("AWS::CloudWatch::Dashboard")["Properties"]["DashboardBody"]
    return dict(json.loads(resolved(body)))


@pytest.mark.parametrize("env_name", ["default", "smoke"])
def test_every_alarm_notifies_the_topic_when_it_fires_and_clears(
    env_name: str, synthesized: dict[str, Synthesized]
) -> None:
    env = synthesized[env_name]
    alarms = alarms_of(env)
    assert sorted(alarms) == sorted(ALARMS)
    for properties in alarms.values():
        assert properties["AlarmActions"] == [topic_ref(env)]
        assert properties["OKActions"] == [topic_ref(env)]
        assert properties["TreatMissingData"] == "notBreaching"
        assert properties["AlarmDescription"]


@pytest.mark.parametrize("env_name", ["default", "smoke"])
def test_alarms_are_valid_put_metric_alarm_requests(env_name: str, synthesized: dict[str, Synthesized]) -> None:
    """CloudFormation calls PutMetricAlarm with these properties: botocore's model of that API accepts them,
    and CloudWatch's rules on periods and metric-math ids hold (at most a day evaluated; ids referenced exist)."""
    model = botocore.session.get_session().get_service_model("cloudwatch")
    shape = model.operation_model("PutMetricAlarm").input_shape
    for name, properties in alarms_of(synthesized[env_name]).items():
        request = resolved(properties)
        report = ParamValidator().validate(request, shape)
        assert not report.has_errors(), f"{name}: {report.generate_report()}"
        periods = [q["MetricStat"]["Period"] for q in request["Metrics"] if "MetricStat" in q]
        periods += [q["Period"] for q in request["Metrics"] if "Period" in q]
        for period in periods:
            assert period % 60 == 0 and period * request["EvaluationPeriods"] <= 86400, name
        ids = {q["Id"] for q in request["Metrics"]}
        for query in request["Metrics"]:
            for reference in re.findall(r"\b([a-z][a-zA-Z0-9_]*)\b", query.get("Expression", "")):
                assert reference in ids | {"IF", "FILL", "AND"}, f"{name}: {reference} is no metric id"
        assert sum(q.get("ReturnData", True) for q in request["Metrics"]) == 1, name


def test_the_cost_table_counts_every_metric_the_alarms_read(default_env: Synthesized) -> None:
    read = [q for alarm in alarms_of(default_env).values() for q in alarm["Metrics"] if "MetricStat" in q]
    assert len(read) == ALARM_METRICS


@pytest.mark.parametrize("env_name", ["default", "smoke"])
def test_stall_alarm_waits_the_configured_minutes_for_a_step_while_training_runs(
    env_name: str, synthesized: dict[str, Synthesized]
) -> None:
    env = synthesized[env_name]
    queries = {q["Id"]: q for q in alarms_of(env)["training-stalled"]["Metrics"]}
    window = env.config.monitoring.stall_minutes * 60
    namespace = f"Trainium/{env.config.name}"
    running, steps = queries["running"]["MetricStat"], queries["steps"]["MetricStat"]
    assert running["Metric"] == {"MetricName": names.TRAINING_JOBS_RUNNING, "Namespace": namespace}
    assert (running["Stat"], running["Period"]) == ("Minimum", window)  # ran through the whole window
    assert steps["Metric"] == {"MetricName": names.TRAINING_STEP, "Namespace": namespace}
    assert (steps["Stat"], steps["Period"]) == ("SampleCount", window)  # steps logged in the window
    (expression,) = [q for q in queries.values() if "Expression" in q]
    assert expression["Expression"] == "IF(FILL(running, 0) > 0 AND FILL(steps, 0) == 0, 1, 0)"


def test_smoke_stalls_after_its_own_window_and_mails_its_address(smoke_env: Synthesized) -> None:
    assert smoke_env.config.monitoring.stall_minutes == 15
    subscriptions = [r["Properties"] for r in smoke_env.resources_of_type("AWS::SNS::Subscription").values()]
    mail = [s for s in subscriptions if s["Protocol"] == "email"]
    assert [(s["Endpoint"], s["TopicArn"]) for s in mail] == [("trainium-alerts@example.com", topic_ref(smoke_env))]


def test_default_has_no_mail_subscription(default_env: Synthesized) -> None:
    assert default_env.config.monitoring.alarm_email is None
    assert not default_env.resources_of_type("AWS::SNS::Subscription")


def test_a_late_compilation_alarms_at_once_and_a_floor_only_when_held(default_env: Synthesized) -> None:
    """LateCompilations is the process's running count: any value above 0 in five minutes fires. The floor's flag
    must be 1 at every logged step (its Minimum) for THROUGHPUT_FLOOR_PERIODS periods in a row."""
    late = alarms_of(default_env)["late-compilation"]
    (query,) = late["Metrics"]
    stat = query["MetricStat"]
    assert (stat["Metric"]["MetricName"], stat["Stat"], stat["Period"]) == (names.LATE_COMPILATIONS, "Maximum", 300)
    assert "Dimensions" not in stat["Metric"]  # the series every run sends
    assert (late["ComparisonOperator"], late["Threshold"], late["EvaluationPeriods"]) == ("GreaterThanThreshold", 0, 1)
    floor = alarms_of(default_env)["throughput-below-floor"]
    (query,) = floor["Metrics"]
    stat = query["MetricStat"]
    assert (stat["Metric"]["MetricName"], stat["Stat"], stat["Period"]) == (
        names.BELOW_THROUGHPUT_FLOOR,
        "Minimum",
        300,
    )
    assert (floor["ComparisonOperator"], floor["Threshold"]) == ("GreaterThanOrEqualToThreshold", 1)
    assert floor["EvaluationPeriods"] == floor["DatapointsToAlarm"] == THROUGHPUT_FLOOR_PERIODS
    for alarm in (late, floor):
        assert alarm["TreatMissingData"] == "notBreaching"  # no training job: nothing to alarm on


def test_fsx_alarm_fires_under_a_tenth_of_the_capacity(default_env: Synthesized) -> None:
    alarm = alarms_of(default_env)["fsx-low-free-capacity"]
    (query,) = alarm["Metrics"]
    assert query["MetricStat"]["Metric"]["MetricName"] == "FreeDataStorageCapacity"
    assert query["MetricStat"]["Metric"]["Dimensions"][0]["Value"] == {
        "Ref": default_env.template["Outputs"]["FileSystemId"]["Value"]["Ref"]
    }
    assert alarm["ComparisonOperator"] == "LessThanThreshold"
    capacity = default_env.config.storage.fsx_capacity_gib
    assert alarm["Threshold"] == pytest.approx(capacity * GIB * FSX_FREE_ALARM_FRACTION)
    # FSx's Sum over one minute is the whole file system's free bytes at any number of storage targets; the
    # Minimum is the fullest target's, and a longer period would add several minutes' samples together.
    assert (query["MetricStat"]["Stat"], query["MetricStat"]["Period"]) == ("Sum", 60)
    assert alarm["EvaluationPeriods"] == alarm["DatapointsToAlarm"] == 5


def test_topic_is_encrypted_and_open_to_cloudwatch_and_budgets_of_this_account_only(default_env: Synthesized) -> None:
    topic = alarm_topic(default_env)[1]["Properties"]
    assert "KmsMasterKeyId" in topic
    key = default_env.only("AWS::KMS::Key")["Properties"]
    assert key["EnableKeyRotation"] is True
    statements = (
        key["KeyPolicy"]["Statement"]
        + default_env.only("AWS::SNS::TopicPolicy")["Properties"]["PolicyDocument"]["Statement"]
    )
    for service in ("cloudwatch.amazonaws.com", "budgets.amazonaws.com"):
        granted = [
            s for s in statements if isinstance(s["Principal"], dict) and service in str(s["Principal"].get("Service"))
        ]
        assert {tuple(sorted(s["Action"])) if isinstance(s["Action"], list) else s["Action"] for s in granted} == {
            ("kms:Decrypt", "kms:GenerateDataKey*"),
            "sns:Publish",
        }, service
        for statement in granted:
            assert statement["Condition"] == {"StringEquals": {"aws:SourceAccount": {"Ref": "AWS::AccountId"}}}


def test_dashboard_shows_every_published_metric_and_the_aws_ones(default_env: Synthesized) -> None:
    body = dashboard_body(default_env)
    text = json.dumps(body)
    for metric in SHOWN:
        assert f'"{metric}"' in text or f'\\"{metric}\\"' in text, metric
    for namespace, metric in (("AWS/FSx", "FreeDataStorageCapacity"), ("AWS/EC2", "StatusCheckFailed")):
        assert any(m[:2] == [namespace, metric] for w in body["widgets"] for m in w["properties"].get("metrics", [])), (
            metric
        )
    assert body["widgets"][0]["type"] == "alarm" and len(body["widgets"][0]["properties"]["alarms"]) == len(ALARMS)


def test_dashboard_widgets_fit_the_grid_without_overlapping(default_env: Synthesized) -> None:
    cells: set[tuple[int, int]] = set()
    for widget in dashboard_body(default_env)["widgets"]:
        assert widget["x"] >= 0 and widget["x"] + widget["width"] <= 24
        mine = {
            (x, y)
            for x in range(widget["x"], widget["x"] + widget["width"])
            for y in range(widget["y"], widget["y"] + widget["height"])
        }
        assert not cells & mine
        cells |= mine


def test_dashboard_draws_the_recipes_memory_plan_beside_the_fullest_core(default_env: Synthesized) -> None:
    config = default_env.config
    hardware = HARDWARE[config.compute.instance_type]
    planned = planned_gib_per_core(load_recipe(config.pipeline.recipe, config.pipeline.overrides), hardware)
    assert planned is not None and 0 < planned < hardware.hbm_gib_per_core
    assert memory_plan_line(config) is not None
    (widget,) = [w for w in dashboard_body(default_env)["widgets"] if "memory" in w["properties"].get("title", "")]
    lines = sorted(a["value"] for a in widget["properties"]["annotations"]["horizontal"])
    assert lines == pytest.approx([planned * GIB, hardware.hbm_gib_per_core * GIB])


def test_the_monitoring_page_draws_the_dashboard_as_it_is_built(default_env: Synthesized) -> None:
    """docs/monitoring.md's picture of the dashboard names every widget, in the order the dashboard has them."""
    page = (ROOT / "docs" / "monitoring.md").read_text()
    marker = page.index("<!-- dashboard layout")
    picture = page[page.index("```", marker) : page.index("```", page.index("```", marker) + 3)]
    titles = [w["properties"]["title"].split(" (")[0] for w in dashboard_body(default_env)["widgets"]]
    positions = [picture.find(title) for title in titles]
    assert -1 not in positions, [t for t, p in zip(titles, positions, strict=True) if p == -1]
    assert positions == sorted(positions), titles
