"""The baked image's recipe: a `pcluster build-image` configuration that the real ParallelCluster schema accepts,
whose one component is the bake script the deploy ships next to the bootstrap (the same pins, one place)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from pcluster.schemas.imagebuilder_schema import ImageBuilderSchema

from stacks.application import ENVIRONMENTS_DIR
from stacks.cluster import BAKE_SCRIPT_FILE
from stacks.config import load_environment
from stacks.node_image import build_image_configuration, main
from tests.infra.test_day2 import node_files_deployment, uploaded_files
from tests.support.synthesis import Synthesized
from training.software import NODE_SOFTWARE

POLICY = "arn:aws:iam::123456789012:policy/parallelcluster/trainium-default-ComputeNodePolicy"
PARENT = "ami-0123456789abcdef0"


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-west-2")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_the_configuration_passes_parallelclusters_schema() -> None:
    config = load_environment("default", ENVIRONMENTS_DIR)
    configuration = build_image_configuration(config, bucket="results", parent_image=PARENT, node_policy_arn=POLICY)
    loaded = ImageBuilderSchema().load(configuration)
    assert loaded.build.parent_image == PARENT
    (component,) = loaded.build.components
    assert (component.type, component.value) == ("script", f"s3://results/cluster/{BAKE_SCRIPT_FILE}")
    assert configuration["Build"]["UpdateOsPackages"] == {"Enabled": False}  # the driver's kernel stays
    assert configuration["Image"]["Name"] == f"trn1-llama-neuron-{NODE_SOFTWARE['neuron'].release().replace('.', '-')}"


def test_the_schema_refuses_what_the_command_must_not_print() -> None:
    """The same schema, fed a component that is not a URL, refuses it: the check above can fail."""
    config = load_environment("default", ENVIRONMENTS_DIR)
    configuration = build_image_configuration(config, bucket="results", parent_image=PARENT, node_policy_arn=POLICY)
    configuration["Build"]["Components"][0]["Value"] = "bake_neuron_image.sh"
    with pytest.raises(Exception, match="https' or 's3' prefix"):
        ImageBuilderSchema().load(configuration)


def test_the_command_prints_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--env", "default", "--bucket", "results", "--node-policy-arn", POLICY, "--parent-image", PARENT]
    assert main(argv) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["Build"]["Iam"] == {"AdditionalIamPolicies": [{"Policy": POLICY}]}
    assert main(["--env", "missing", *argv[2:]]) == 2


def test_the_deploy_ships_the_bake_script(default_env: Synthesized, tmp_path: Path) -> None:
    files = uploaded_files(default_env.outdir, default_env.template, node_files_deployment(default_env.template))
    script = files[BAKE_SCRIPT_FILE].decode()
    assert "aws s3 cp --only-show-errors" in script and "/cluster/on_node_configured.sh" in script
    assert f"--bake --node-type compute --neuron-release {NODE_SOFTWARE['neuron'].release()}" in script
    rendered = tmp_path / BAKE_SCRIPT_FILE
    rendered.write_text(script)
    assert subprocess.run(["bash", "-n", str(rendered)], check=False).returncode == 0
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (make tools installs it)")
    checked = subprocess.run([shellcheck, str(rendered)], capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stdout
