"""A Trainium node's Neuron devices, every minute, from the Neuron monitoring tool `neuron-monitor`.

`python -m training monitor neuron` (a systemd service on each Trainium compute node, installed by
assets/node/on_node_configured.sh) starts `neuron-monitor -c <CONFIG>` (aws-neuronx-tools), reads the JSON report
it prints on each line of its stdout every PERIOD, and publishes each report's metrics at once. It exits non-zero
when neuron-monitor exits (systemd restarts it).

The report format and the configuration keys are those of the Neuron Monitor User Guide
(aws-neuron-sdk, tools/neuron-sys-tools/neuron-monitor-user-guide.rst: "Configuration file example", "The JSON
output format", "neuroncore_counters", "memory_used", "instance_info"). Per report (training/monitoring/cloudwatch.py):
- NeuronCoreUtilization (Percent): the mean of `neuroncore_utilization` over the cores in use
  (`neuroncore_counters.neuroncores_in_use`) of every Neuron application; none when no core is in use or an
  application's counters could not be read (no datum rather than a made-up 0).
- NeuronCoreMemoryUsed (Bytes): the most device memory any one NeuronCore holds, each core's being the sum of its
  categories in `memory_used.neuron_runtime_used_bytes.usage_breakdown.neuroncore_memory_usage` over the
  applications: the number to compare with a memory plan's GiB per NeuronCore (training/train/memory.py).
- NeuronDeviceMemoryUsed (Bytes): `neuron_runtime_used_bytes.neuron_device` summed over the applications.
Both memory metrics are 0 when no Neuron application runs, and left out when one application's memory could not be
read (a total missing a part would look like a smaller one). Every datum is sent without dimensions and with
`InstanceId` (`instance_info.instance_id`, which neuron-monitor always reports).
"""

from __future__ import annotations

import json
import logging
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from training.config.site import Site
from training.errors import UserError
from training.monitoring.cloudwatch import (
    INSTANCE_DIMENSION,
    NEURON_DEVICE_MEMORY_USED,
    NEURONCORE_MEMORY_USED,
    NEURONCORE_UTILIZATION,
    Datum,
    MetricsClient,
    cloudwatch_client,
    print_requests,
    put_metrics,
    with_dimension,
)

log = logging.getLogger(__name__)

NEURON_MONITOR = "/opt/aws/neuron/bin/neuron-monitor"  # aws-neuronx-tools; not on a systemd unit's PATH
PERIOD = "60s"
# The metrics a report gives (report_data): utilisation, the fullest core's memory, the node's device memory.
METRICS_PER_REPORT = 3
CONFIG: dict[str, Any] = {
    "period": PERIOD,
    "neuron_runtimes": [
        {"tag_filter": ".*", "metrics": [{"type": "neuroncore_counters"}, {"type": "memory_used"}]},
    ],
}


def config_text(period: str = PERIOD) -> str:
    """neuron-monitor's configuration file; `period` in its format ("60s", "1s")."""
    return json.dumps({**CONFIG, "period": period}, indent=2, sort_keys=True) + "\n"


def _group(runtime: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    """A runtime's metric group, or None when the runtime or the group reports an error or is missing."""
    if runtime.get("error"):
        return None
    group = (runtime.get("report") or {}).get(name)
    if not isinstance(group, Mapping) or group.get("error"):
        return None
    return group


def report_data(report: Mapping[str, Any]) -> list[Datum]:
    """The metrics of one neuron-monitor report (without the InstanceId copies)."""
    runtimes = [r for r in report.get("neuron_runtime_data") or [] if isinstance(r, Mapping)]
    data: list[Datum] = []

    utilization: dict[str, float] = {}
    counters_complete = True
    for runtime in runtimes:
        counters = _group(runtime, "neuroncore_counters")
        if counters is None:
            counters_complete = False
            continue
        for core, values in (counters.get("neuroncores_in_use") or {}).items():
            value = (values or {}).get("neuroncore_utilization")
            if isinstance(value, (int, float)):
                utilization[core] = max(float(value), utilization.get(core, 0.0))
    if utilization and counters_complete:
        data.append(Datum(NEURONCORE_UTILIZATION, sum(utilization.values()) / len(utilization), "Percent"))

    memory = runtime_memory(runtimes)
    if memory is None:
        return data
    per_core, device_total = memory
    data.append(Datum(NEURONCORE_MEMORY_USED, max(per_core.values(), default=0.0), "Bytes"))
    data.append(Datum(NEURON_DEVICE_MEMORY_USED, device_total, "Bytes"))
    return data


def runtime_memory(runtimes: Iterable[Mapping[str, Any]]) -> tuple[dict[str, float], float] | None:
    """Per NeuronCore the bytes its categories hold, summed over the applications, and the device total; None
    when one application's memory could not be read (a total missing a part would look like a smaller one)."""
    per_core: dict[str, float] = {}
    device_total = 0.0
    for runtime in runtimes:
        memory = _group(runtime, "memory_used")
        used = (memory or {}).get("neuron_runtime_used_bytes")
        if not isinstance(used, Mapping):
            log.warning("neuron-monitor: no memory_used from runtime %s: %s", runtime.get("pid"), _errors(runtime))
            return None
        device_total += float(used.get("neuron_device") or 0)
        cores = (used.get("usage_breakdown") or {}).get("neuroncore_memory_usage") or {}
        for core, categories in cores.items():
            held = sum(float(v) for v in (categories or {}).values() if isinstance(v, (int, float)))
            per_core[core] = per_core.get(core, 0.0) + held
    return per_core, device_total


def core_memory(report: Mapping[str, Any]) -> dict[str, float] | None:
    """One report's bytes per NeuronCore (what a memory plan's GiB per NeuronCore compares with); None when an
    application's memory could not be read."""
    runtimes = [r for r in report.get("neuron_runtime_data") or [] if isinstance(r, Mapping)]
    memory = runtime_memory(runtimes)
    return None if memory is None else memory[0]


def _errors(runtime: Mapping[str, Any]) -> str:
    report = runtime.get("report") or {}
    found = [runtime.get("error")] + [g.get("error") for g in report.values() if isinstance(g, Mapping)]
    return "; ".join(str(e) for e in found if e) or "missing"


def instance_id(report: Mapping[str, Any]) -> str | None:
    value = (report.get("instance_info") or {}).get("instance_id")
    return value if isinstance(value, str) and value.startswith("i-") else None


def node_data(report: Mapping[str, Any]) -> list[Datum]:
    """What one report publishes: each datum without dimensions and again with the instance's id."""
    data = report_data(report)
    instance = instance_id(report)
    if instance is None:
        log.warning("neuron-monitor reported no instance id (%s): sent without InstanceId", _instance_error(report))
        return data
    return with_dimension(data, INSTANCE_DIMENSION, instance)


def _instance_error(report: Mapping[str, Any]) -> str:
    return str((report.get("instance_info") or {}).get("error") or "no instance_info")


def follow(lines: Iterable[str], publish: Callable[[list[Datum]], None]) -> int:
    """Publish every report among `lines` (one JSON object each); the number published. A line that is not a
    report is logged and skipped; a failed publish is logged and the next report tried."""
    published = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            report = json.loads(line)
        except json.JSONDecodeError as error:
            log.warning("neuron-monitor printed a line that is not JSON (%s): %.200s", error, line)
            continue
        if not isinstance(report, Mapping):
            log.warning("neuron-monitor printed JSON that is not a report: %.200s", line)
            continue
        data = node_data(report)
        if not data:
            continue
        try:
            publish(data)
        except Exception as error:  # botocore's errors (throttling, network): the next minute tries again
            if not _is_aws_error(error):
                raise
            log.warning("could not publish Neuron metrics: %s", error)
            continue
        published += 1
    return published


def _is_aws_error(error: Exception) -> bool:
    from botocore.exceptions import BotoCoreError, ClientError

    return isinstance(error, (BotoCoreError, ClientError))


def monitor_neuron(
    site: Site, namespace: str, *, dry_run: bool, executable: str = NEURON_MONITOR, client: MetricsClient | None = None
) -> int:
    """Run neuron-monitor and publish its reports to `namespace` until it exits; the exit status to return (never
    0: the monitor is meant to run for ever, so its end is a failure for systemd to restart)."""
    if not Path(executable).is_file():
        raise UserError(f"neuron-monitor: not found at {executable} (installed by aws-neuronx-tools on Trainium nodes)")
    if dry_run:

        def publish(data: list[Datum]) -> None:
            print_requests(namespace, data)

    else:
        metrics = client or cloudwatch_client(site.region)

        def publish(data: list[Datum]) -> None:
            put_metrics(metrics, namespace, data)

    with tempfile.TemporaryDirectory(prefix="neuron-monitor-") as directory:
        config = Path(directory) / "monitor.conf"
        config.write_text(config_text())
        log.info("starting %s -c %s (period %s), publishing to %s", executable, config, PERIOD, namespace)
        process = subprocess.Popen([executable, "-c", str(config)], stdout=subprocess.PIPE, text=True, bufsize=1)
        try:
            assert process.stdout is not None
            published = follow(process.stdout, publish)
            status = process.wait()
        finally:
            if process.poll() is None:  # we failed, not neuron-monitor: it must not outlive us
                process.terminate()
                process.wait(timeout=30)
    log.error("neuron-monitor exited with status %s after %d published reports", status, published)
    return status if status else 1
