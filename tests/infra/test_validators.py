"""The community validators over every synthesized template: cfn-lint and cdk-nag AwsSolutions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stacks.nag import (
    ACKNOWLEDGEMENTS,
    Acknowledgement,
    compile_cache_acknowledgements,
    pipeline_acknowledgements,
    queue_acknowledgements,
)
from stacks.training_environment import cpu_stages_queue
from tests.support.synthesis import ENVIRONMENT_NAMES, Synthesized

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)

CFN_LINT = str(Path(sys.executable).parent / "cfn-lint")


def cfn_lint(*templates: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CFN_LINT, "--format", "parseable", *map(str, templates)], capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("env_name", ENVIRONMENT_NAMES)
def test_cfn_lint_reports_nothing(env_name: str, synthesized: dict[str, Synthesized]) -> None:
    templates = sorted(synthesized[env_name].outdir.glob("*.template.json"))
    assert templates, "synth produced no template"
    # No rule is disabled globally; the single scoped exception lives in stacks/network.py with its reason.
    result = cfn_lint(*templates)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_cfn_lint_does_find_problems(tmp_path: Path) -> None:
    """Guard against a linter that silently checks nothing: a known-bad template must fail."""
    bad = tmp_path / "bad.template.json"
    bad.write_text('{"Resources": {"Bucket": {"Type": "AWS::S3::Bucket", "Properties": {"BucketNam": "x"}}}}')
    result = cfn_lint(bad)
    assert result.returncode != 0 and "BucketNam" in result.stdout


def awssolutions_report(env: Synthesized) -> dict:
    (report,) = (r for r in env.validation_report["pluginReports"] if r["pluginName"] == "AwsSolutions")
    return report


@pytest.mark.parametrize("env_name", ENVIRONMENT_NAMES)
def test_cdk_nag_has_no_unacknowledged_findings(env_name: str, synthesized: dict[str, Synthesized]) -> None:
    report = awssolutions_report(synthesized[env_name])
    assert report["conclusion"] == "success"
    assert report["violations"] == []


@pytest.mark.parametrize("env_name", ENVIRONMENT_NAMES)
def test_every_acknowledgement_is_used_and_has_a_specific_reason(
    env_name: str, synthesized: dict[str, Synthesized]
) -> None:
    env = synthesized[env_name]
    suppressed = {
        (construct["constructPath"].split("/", 1)[1].removesuffix("/Resource"), violation["ruleName"])
        for violation in awssolutions_report(env)["suppressedViolations"]
        for construct in violation["violatingConstructs"]
    }
    acknowledgements = (
        *ACKNOWLEDGEMENTS,
        *pipeline_acknowledgements(env.config.region),
        *queue_acknowledgements(cpu_stages_queue(env.config), env.config.storage.fsx_s3_prefix),
        *compile_cache_acknowledgements(env.config.compute.queue_name),
    )

    def covers(ack: Acknowledgement, path: str, rule: str) -> bool:
        # An acknowledgement on a construct covers the findings of its children (a role and its policy).
        return ack.rule == rule and (path == ack.path or path.startswith(ack.path + "/"))

    # Every suppressed finding has a reviewed reason; stale acknowledgements hide future findings, so
    # each one must still match a real finding.
    uncovered = [(p, r) for p, r in suppressed if not any(covers(ack, p, r) for ack in acknowledgements)]
    assert uncovered == []
    stale = [ack for ack in acknowledgements if not any(covers(ack, path, rule) for path, rule in suppressed)]
    assert stale == []
    for ack in acknowledgements:
        assert len(ack.reason) > 60 and ("environment" in ack.reason or "this" in ack.reason), ack
