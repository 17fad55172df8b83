"""The Trainium nodes' Neuron metrics (training/monitoring/neuron.py) from neuron-monitor's reports.

The reports are built from the format the Neuron Monitor User Guide documents (aws-neuron-sdk,
tools/neuron-sys-tools/neuron-monitor-user-guide.rst: "The JSON output format", "neuroncore_counters",
"memory_used", "instance_info", "neuron_hardware_info"), for a trn1.32xlarge: 16 devices of 2 NeuronCores, one
Neuron application (a torchrun worker) per NeuronCore. The long-running loop runs a stand-in `neuron-monitor`
executable that checks its config file and prints reports, since the real one needs Neuron devices.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml
from moto import mock_aws

from training.cli import main
from training.config.site import Site
from training.monitoring import cloudwatch
from training.monitoring.neuron import CONFIG, METRICS_PER_REPORT, config_text, follow, node_data, report_data

NAMESPACE = "Trainium/test"
REGION = "eu-central-1"
INSTANCE = "i-0011223344556677a"
GIB = 2**30


def runtime(pid: int, cores: dict[str, tuple[float, dict[str, int]]], *, error: str = "") -> dict[str, Any]:
    """One Neuron application's entry of `neuron_runtime_data`: per NeuronCore its utilisation and device memory
    by category (the guide's `neuroncore_memory_usage` categories)."""
    device = sum(sum(memory.values()) for _, memory in cores.values())
    return {
        "pid": pid,
        "address": "",
        "neuron_runtime_tag": str(pid),
        "error": error,
        "report": {
            "neuroncore_counters": {
                "period": 60.000113182,
                "neuroncores_in_use": {
                    core: {"neuroncore_utilization": utilization, "flops": 1234567891011}
                    for core, (utilization, _) in cores.items()
                },
                "error": "",
            },
            "memory_used": {
                "period": 60.00001,
                "neuron_runtime_used_bytes": {
                    "host": 6997643264,
                    "neuron_device": device,
                    "usage_breakdown": {
                        "host": {
                            "application_memory": 6996594688,
                            "constants": 0,
                            "dma_buffers": 1048576,
                            "tensors": 0,
                        },
                        "neuroncore_memory_usage": {core: memory for core, (_, memory) in cores.items()},
                    },
                },
                "loaded_models": [],
                "error": "",
            },
        },
    }


def memory(tensors: int, constants: int = 2 * GIB) -> dict[str, int]:
    return {
        "constants": constants,
        "model_code": 176285056,
        "model_shared_scratchpad": 0,
        "runtime_memory": 1048576,
        "tensors": tensors,
    }


def report(runtimes: list[dict[str, Any]], instance_id: str = INSTANCE) -> dict[str, Any]:
    return {
        "neuron_runtime_data": runtimes,
        "system_data": {},
        "instance_info": {
            "instance_name": "",
            "instance_id": instance_id,
            "instance_type": "trn1.32xlarge",
            "instance_availability_zone": "us-west-2d",
            "instance_availability_zone_id": "usw2-az4",
            "instance_region": "us-west-2",
            "ami_id": "ami-0011223344556677b",
            "subnet_id": "subnet-112233ee",
            "error": "",
        },
        "neuron_hardware_info": {
            "neuron_device_type": "trainium",
            "neuron_device_version": "v2",
            "neuroncore_version": "v2",
            "neuron_device_count": 16,
            "neuron_device_memory_size": 34359738368,
            "neuroncore_per_device_count": 2,
            "error": "",
        },
    }


def training_report() -> dict[str, Any]:
    """32 workers, one NeuronCore each; core 7 holds the most (rank 7's extra activations)."""
    runtimes = [
        runtime(1000 + core, {str(core): (80.0 + (core % 4), memory(10 * GIB + (GIB if core == 7 else 0)))})
        for core in range(32)
    ]
    return report(runtimes)


def by_name(data: list[cloudwatch.Datum]) -> dict[str, cloudwatch.Datum]:
    found = {d.name: d for d in data}
    assert len(found) == len(data), data
    return found


def test_a_training_report() -> None:
    data = by_name(report_data(training_report()))
    core_bytes = 2 * GIB + 176285056 + 1048576 + 10 * GIB
    assert data == {
        cloudwatch.NEURONCORE_UTILIZATION: cloudwatch.Datum(cloudwatch.NEURONCORE_UTILIZATION, 81.5, "Percent"),
        cloudwatch.NEURONCORE_MEMORY_USED: cloudwatch.Datum(
            cloudwatch.NEURONCORE_MEMORY_USED, core_bytes + GIB, "Bytes"
        ),
        cloudwatch.NEURON_DEVICE_MEMORY_USED: cloudwatch.Datum(
            cloudwatch.NEURON_DEVICE_MEMORY_USED, 32 * core_bytes + GIB, "Bytes"
        ),
    }
    assert len(data) == METRICS_PER_REPORT  # what the cost table counts per node


def test_one_application_on_several_cores_and_cores_shared_by_applications() -> None:
    shared = report(
        [
            runtime(1, {"0": (50.0, memory(GIB)), "1": (70.0, memory(3 * GIB))}),
            runtime(2, {"1": (70.0, memory(GIB, constants=0))}),  # more memory on core 1 from a second process
        ]
    )
    data = by_name(report_data(shared))
    assert data[cloudwatch.NEURONCORE_UTILIZATION].value == 60.0  # mean over cores 0 and 1
    per_core_1 = (2 * GIB + 176285056 + 1048576 + 3 * GIB) + (176285056 + 1048576 + GIB)
    assert data[cloudwatch.NEURONCORE_MEMORY_USED].value == per_core_1
    assert data[cloudwatch.NEURON_DEVICE_MEMORY_USED].value == sum(
        sum(m.values()) for m in (memory(GIB), memory(3 * GIB), memory(GIB, constants=0))
    )


def test_no_application_running_sends_no_utilisation_and_zero_memory() -> None:
    data = by_name(report_data(report([])))
    assert cloudwatch.NEURONCORE_UTILIZATION not in data
    assert data[cloudwatch.NEURONCORE_MEMORY_USED].value == 0
    assert data[cloudwatch.NEURON_DEVICE_MEMORY_USED].value == 0
    assert report_data({"neuron_runtime_data": None}) == report_data({})  # the key null or missing


def test_an_application_with_errors_sends_neither_utilisation_nor_partial_memory() -> None:
    broken = runtime(2, {}, error="Failed to connect to the Neuron Runtime")
    broken["report"] = {}
    data = report_data(report([runtime(1, {"0": (90.0, memory(GIB))}), broken]))
    assert data == []
    group_error = runtime(3, {"1": (90.0, memory(GIB))})
    group_error["report"]["neuroncore_counters"]["error"] = "counters unavailable"
    data = by_name(report_data(report([group_error])))
    assert cloudwatch.NEURONCORE_UTILIZATION not in data
    assert data[cloudwatch.NEURONCORE_MEMORY_USED].value == sum(memory(GIB).values())


def test_every_datum_is_sent_without_dimensions_and_with_the_instance() -> None:
    data = node_data(training_report())
    assert len(data) == 6
    assert [d.dimensions for d in data[::2]] == [{}, {}, {}]
    assert [d.dimensions for d in data[1::2]] == [{cloudwatch.INSTANCE_DIMENSION: INSTANCE}] * 3
    unknown = report([], instance_id="")
    unknown["instance_info"]["error"] = "IMDS unreachable"
    assert all(not d.dimensions for d in node_data(unknown))


def test_the_config_asks_for_a_minute_of_every_application() -> None:
    config = json.loads(config_text())
    assert config == CONFIG
    assert config["period"] == "60s"
    (runtimes,) = config["neuron_runtimes"]
    assert runtimes["tag_filter"] == ".*"
    assert {m["type"] for m in runtimes["metrics"]} == {"neuroncore_counters", "memory_used"}


def test_follow_skips_lines_that_are_not_reports() -> None:
    published: list[list[cloudwatch.Datum]] = []
    lines = ["", "neuron-monitor: warming up\n", "[1, 2]\n", json.dumps(training_report()) + "\n"]
    assert follow(lines, published.append) == 1
    assert len(published) == 1 and len(published[0]) == 6


# --- the long-running loop, with a stand-in neuron-monitor ----------------------------------------------------


@pytest.fixture
def neuron_node(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A site file and a stand-in neuron-monitor that checks it is given the config file, records it, prints two
    reports and exits 0, as neuron-monitor would if its devices went away."""
    reports = tmp_path / "reports.jsonl"
    reports.write_text(json.dumps(training_report()) + "\n" + json.dumps(report([])) + "\n")
    seen_config = tmp_path / "seen-config.json"
    monitor = tmp_path / "neuron-monitor"
    monitor.write_text(
        textwrap.dedent(
            f"""\
            #!{sys.executable}
            import shutil, sys
            assert sys.argv[1] == "-c", sys.argv
            shutil.copy(sys.argv[2], {str(seen_config)!r})
            sys.stdout.write(open({str(reports)!r}).read())
            """
        )
    )
    monitor.chmod(0o755)
    site_file = tmp_path / "site.yaml"
    site = Site(runs_root=str(tmp_path / "runs"), region=REGION, metrics_namespace=NAMESPACE)
    site_file.write_text(yaml.safe_dump(site.model_dump(mode="json")))
    return site_file, monitor, seen_config


def test_dry_run_prints_one_request_per_report_and_fails_when_neuron_monitor_exits(
    neuron_node: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    site_file, monitor, seen_config = neuron_node
    status = main(["monitor", "neuron", "--site", str(site_file), "--dry-run", "--neuron-monitor", str(monitor)])
    assert status == 1
    captured = capsys.readouterr()
    requests = [json.loads(line) for line in captured.out.splitlines()]
    assert [r["Namespace"] for r in requests] == [NAMESPACE, NAMESPACE]
    assert [len(r["MetricData"]) for r in requests] == [6, 4]  # the idle node: no utilisation
    assert json.loads(seen_config.read_text()) == CONFIG
    assert "neuron-monitor exited with status 0 after 2 published reports" in captured.err


def test_publishes_each_report_to_cloudwatch(
    neuron_node: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    site_file, monitor, _ = neuron_node
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(name, value)
    with mock_aws():
        assert main(["monitor", "neuron", "--site", str(site_file), "--neuron-monitor", str(monitor)]) == 1
        client = boto3.client("cloudwatch", region_name=REGION)
        listed = client.list_metrics(Namespace=NAMESPACE)["Metrics"]
        assert {(m["MetricName"], len(m["Dimensions"])) for m in listed} == {
            (name, dimensions)
            for name in (
                cloudwatch.NEURONCORE_UTILIZATION,
                cloudwatch.NEURONCORE_MEMORY_USED,
                cloudwatch.NEURON_DEVICE_MEMORY_USED,
            )
            for dimensions in (0, 1)
        }
        now = datetime.now(timezone.utc)
        window = {"StartTime": now - timedelta(minutes=5), "EndTime": now + timedelta(minutes=1), "Period": 60}
        instance = [{"Name": cloudwatch.INSTANCE_DIMENSION, "Value": INSTANCE}]
        core = client.get_metric_statistics(
            Namespace=NAMESPACE,
            MetricName=cloudwatch.NEURONCORE_MEMORY_USED,
            Dimensions=instance,
            Statistics=["Maximum", "SampleCount"],
            **window,
        )["Datapoints"]
        # Two reports: the training one's busiest core, then the idle node's 0.
        assert [(p["Maximum"], p["SampleCount"], p["Unit"]) for p in core] == [
            (2 * GIB + 176285056 + 1048576 + 11 * GIB, 2.0, "Bytes")
        ]
        utilization = client.get_metric_statistics(
            Namespace=NAMESPACE,
            MetricName=cloudwatch.NEURONCORE_UTILIZATION,
            Dimensions=instance,
            Statistics=["Average", "SampleCount"],
            **window,
        )["Datapoints"]
        assert [(p["Average"], p["SampleCount"], p["Unit"]) for p in utilization] == [(81.5, 1.0, "Percent")]


def test_a_missing_neuron_monitor_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    site_file = tmp_path / "site.yaml"
    site_file.write_text(yaml.safe_dump({"metrics_namespace": NAMESPACE}))
    absent = tmp_path / "absent" / "neuron-monitor"
    assert main(["monitor", "neuron", "--site", str(site_file), "--neuron-monitor", str(absent), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: neuron-monitor: not found at {absent} (installed by aws-neuronx-tools on Trainium nodes)"]
    assert not os.path.exists(absent)
