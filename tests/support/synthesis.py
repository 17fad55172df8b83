"""Real, in-process CDK synthesis of an environment with the project's cdk.json context, as `npx cdk synth`
makes it: the template and cdk-nag's report the infra tests read."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aws_cdk import App

from stacks.application import ENVIRONMENTS_DIR, build_app
from stacks.config import EnvironmentConfig, load_environment
from tests.support.repository import ROOT

ENVIRONMENT_NAMES = sorted(path.stem for path in ENVIRONMENTS_DIR.glob("*.yaml"))


@dataclass(frozen=True)
class Synthesized:
    config: EnvironmentConfig
    outdir: Path
    template: dict[str, Any]
    validation_report: dict[str, Any]

    def resources_of_type(self, resource_type: str) -> dict[str, dict[str, Any]]:
        return {k: v for k, v in self.template["Resources"].items() if v["Type"] == resource_type}

    def only(self, resource_type: str) -> dict[str, Any]:
        (resource,) = self.resources_of_type(resource_type).values()
        return resource


# What the CDK CLI adds to the context of every synth; cfn-lint reads the path metadata it turns on.
CLI_CONTEXT = {
    "aws:cdk:enable-path-metadata": True,
    "aws:cdk:enable-asset-metadata": True,
    "aws:cdk:version-reporting": True,
}


def cdk_json_context() -> dict[str, Any]:
    """Feature flags and settings exactly as `npx cdk` passes them, so tests see the templates users get."""
    return {**json.loads((ROOT / "cdk.json").read_text())["context"], **CLI_CONTEXT}


def synthesize(name: str, outdir: Path) -> Synthesized:
    return synthesize_config(load_environment(name, ENVIRONMENTS_DIR), outdir)


def synthesize_config(config: EnvironmentConfig, outdir: Path) -> Synthesized:
    """An environment's template and cdk-nag report, its file in environments/ or elsewhere."""
    app = App(outdir=str(outdir), context={**cdk_json_context(), "env": config.name})
    stack = build_app(app, config)
    app.synth()
    template = json.loads((outdir / f"{stack.stack_name}.template.json").read_text())
    report = json.loads((outdir / "validation-report.json").read_text())
    return Synthesized(config=config, outdir=outdir, template=template, validation_report=report)
