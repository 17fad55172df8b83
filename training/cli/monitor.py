"""`monitor cluster|neuron`: the cluster's metrics published to CloudWatch (the site's metrics_namespace and
region)."""

from __future__ import annotations

import argparse

from training.cli.common import Subcommands, add_command, add_group, add_site_argument, site_file
from training.monitoring.neuron import NEURON_MONITOR

EXAMPLES = {
    "monitor cluster": "{prog} monitor cluster --site /fsx/pipeline/site-default.yaml --dry-run",
    "monitor neuron": "{prog} monitor neuron --site /fsx/pipeline/site-default.yaml",
}


def add_arguments(commands: Subcommands, prog: str) -> None:
    targets = add_group(
        commands,
        "monitor",
        "publish the cluster's metrics to CloudWatch (the site's metrics_namespace and region)",
        prog,
        list(EXAMPLES.values()),
        "target",
    )
    cluster = add_command(
        targets,
        "cluster",
        "one pass on the head node: Slurm jobs and nodes, running training jobs, failed stages of the newest run",
        prog,
        EXAMPLES["monitor cluster"],
        run,
    )
    neuron = add_command(
        targets,
        "neuron",
        "on a Trainium node, until neuron-monitor exits: NeuronCore utilisation and device memory every minute",
        prog,
        EXAMPLES["monitor neuron"],
        run,
    )
    for command in (cluster, neuron):
        add_site_argument(command)
        command.add_argument(
            "--dry-run", action="store_true", help="print the PutMetricData requests as JSON lines, send nothing"
        )
    neuron.add_argument(
        "--neuron-monitor",
        default=NEURON_MONITOR,
        metavar="PATH",
        help="the neuron-monitor executable (default: %(default)s, from aws-neuronx-tools)",
    )


def run(arguments: argparse.Namespace) -> int:
    """`monitor neuron`: exit status 1 once neuron-monitor has exited."""
    from training.config.site import load_site
    from training.monitoring.cloudwatch import required_namespace

    path = site_file(arguments.site)
    site = load_site(path)
    namespace = required_namespace(site, str(path or "the local site defaults"))
    if arguments.target == "cluster":
        from training.monitoring.cluster import monitor_cluster

        monitor_cluster(site, namespace, dry_run=arguments.dry_run)
        return 0
    from training.monitoring.neuron import monitor_neuron

    return monitor_neuron(site, namespace, dry_run=arguments.dry_run, executable=arguments.neuron_monitor)
