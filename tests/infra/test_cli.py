"""The README's path: the pinned CDK CLI (`npx cdk synth -c env=NAME`), offline and without credentials."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.repository import ROOT
from tests.support.synthesis import ENVIRONMENT_NAMES, Synthesized

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)


def npx_cdk_synth(env_name: str, outdir: Path) -> subprocess.CompletedProcess[str]:
    environ = {
        **os.environ,
        "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "20",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        environ.pop(variable, None)
    return subprocess.run(
        ["npx", "--no-install", "cdk", "synth", "-c", f"env={env_name}", "--quiet", "--output", str(outdir)],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize("env_name", ENVIRONMENT_NAMES)
def test_cli_synth_gives_the_tests_template(env_name: str, synthesized: dict[str, Synthesized], tmp_path: Path) -> None:
    """Everything the other tests check about the in-process synth holds for what the CLI produces."""
    result = npx_cdk_synth(env_name, tmp_path)
    assert result.returncode == 0, result.stderr
    cli_template = json.loads((tmp_path / f"trainium-{env_name}.template.json").read_text())
    assert json.dumps(cli_template, sort_keys=True) == json.dumps(synthesized[env_name].template, sort_keys=True)


def test_cli_synth_of_an_unknown_environment_fails_with_one_line(tmp_path: Path) -> None:
    result = npx_cdk_synth("staging", tmp_path)
    assert result.returncode != 0
    assert result.stderr.splitlines()[0] == (
        "error: environments/staging.yaml: no such environment file; "
        f"available environments: {', '.join(ENVIRONMENT_NAMES)}"
    )
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []
