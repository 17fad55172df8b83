"""The cost table: computed from the environment's own settings, and the README shows exactly that output."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from stacks.application import ENVIRONMENTS_DIR
from stacks.config import load_environment
from stacks.cost import (
    IDLE_TARGET_USD_PER_HOUR,
    PARALLELCLUSTER_CUSTOM_METRICS,
    PARALLELCLUSTER_HEAD_NODE_ALARMS,
    cost_lines,
    idle_usd_per_hour,
    main,
    render_table,
)
from tests.support.repository import ROOT


@pytest.mark.parametrize("name", ["default", "trn2"])
def test_readme_cost_tables_are_the_command_output(name: str) -> None:
    readme = (ROOT / "README.md").read_text()
    marker = f"<!-- python -m stacks.cost --env {name} -->"
    match = re.search(re.escape(marker) + r"\n(.*?)<!-- end -->", readme, flags=re.DOTALL)
    assert match, f"README: the cost table's markers for {name} are missing"
    assert match.group(1) == render_table(load_environment(name, ENVIRONMENTS_DIR)), f"run `make cost ENV={name}`"


@pytest.mark.parametrize("name", ["default", "smoke"])
def test_an_unused_environment_costs_at_most_the_target(name: str) -> None:
    assert idle_usd_per_hour(load_environment(name, ENVIRONMENTS_DIR)) <= IDLE_TARGET_USD_PER_HOUR


def test_the_default_idles_on_head_node_file_system_nat_and_monitoring_only() -> None:
    config = load_environment("default", ENVIRONMENTS_DIR)
    billed_while_idle = {line.item.split(",")[0].split(" (")[0] for line in cost_lines(config) if line.idle}
    assert billed_while_idle == {
        "Head node m6a.2xlarge",
        "Head node root volume",
        "FSx for Lustre SCRATCH_2",
        "NAT gateway and its public IPv4 address",
        "CloudWatch: dashboard",
        "ParallelCluster: dashboard",
        "KMS key of the alarm topic",
    }
    # 0.3456 + 0.011 + 0.2301 + 0.045 + 0.005 + (3 + 5 x 0.10 + 14 x 0.30) / 730
    #   + (3 + 5 x 0.10 + 0.50 + 3 x 0.30 + 0.50) / 730 + 1 / 730
    assert round(idle_usd_per_hour(config), 3) == 0.656


def test_parallelclusters_own_alarms_and_metrics_are_counted_from_its_source() -> None:
    """The head node's alarms, as the installed ParallelCluster builds them (with CloudWatch logs on, as here)."""
    spec = importlib.util.find_spec("pcluster")
    assert spec is not None and spec.origin is not None
    # Read, not imported: the package's templates are written against CDK v1.
    stack = (Path(spec.origin).parent / "templates" / "cluster_stack.py").read_text()
    source = stack[stack.index("def _add_head_node_alarms") :]
    source = source[: source.index("\n    def ", 1)]
    alarms = re.findall(r'^\s+"(\w+)": \{$', source, flags=re.MULTILINE)
    alarms += re.findall(r"metrics_for_alarms\[(\w+)\] = ", source)
    assert len(alarms) == PARALLELCLUSTER_HEAD_NODE_ALARMS, alarms
    assert source.count("cloudwatch.CompositeAlarm(") == 1
    agent_metrics = re.findall(r'"CWAgent", "(\w+)"', source)
    assert len(agent_metrics) + source.count("CfnMetricFilter(") == PARALLELCLUSTER_CUSTOM_METRICS


def test_a_capacity_block_bills_its_nodes_while_idle() -> None:
    config = load_environment("default", ENVIRONMENTS_DIR)
    block = config.model_copy(
        update={
            "compute": config.compute.model_copy(
                update={"capacity": config.compute.capacity.model_copy(update={"type": "capacity-block"})}
            )
        }
    )
    assert idle_usd_per_hour(block) > 4 * 21.5  # every node of a block is static (and paid for)


def test_the_command_prints_the_table_and_the_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--env", "default"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(render_table(load_environment("default", ENVIRONMENTS_DIR)))
    assert "Idle: $0.66/h, within the $0.75/h target" in out
    assert main(["--env", "missing"]) == 2
    lines = capsys.readouterr().err.splitlines()  # one line through the entry points' user-error guard
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "environments/missing.yaml: no such environment file" in lines[0]
    with pytest.raises(SystemExit) as exit_info:
        main(["--environment", "default"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "error: unrecognized arguments: --environment default (see python -m stacks.cost --help)\n"
    )
