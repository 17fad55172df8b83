"""Day-2 safety: a deploy of new training code must never touch the cluster's configuration.

ParallelCluster cannot update the head node's `OnNodeConfigured` (update policy UNSUPPORTED), so a cluster
configuration that changed with the code would fail the next `cdk deploy` at UPDATE. Here the project is
copied, its training code, job templates and locked requirement set are edited, and the copy is synthesized
for real: the cluster custom resource's properties must be identical, while the pipeline sees the new code.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import ROOT
from tests.infra.conftest import CLI_CONTEXT, Synthesized

PROJECT_PARTS = ("app.py", "cdk.json", "pyproject.toml", "stacks", "training", "assets", "environments")
SYNTH = """
import json, sys
from pathlib import Path
from aws_cdk import App
from stacks.application import build_app
from stacks.config import load_environment

context = {**json.loads(Path("cdk.json").read_text())["context"], **json.loads(sys.argv[2]), "env": "default"}
app = App(outdir=sys.argv[1], context=context)
stack = build_app(app, load_environment("default"))
app.synth()
print(stack.stack_name)
"""


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path}: {old!r} not found"
    path.write_text(text.replace(old, new, 1))


def synthesize_copy(project: Path, outdir: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", SYNTH, str(outdir), json.dumps(CLI_CONTEXT)],
        cwd=project,
        env={"PATH": "/usr/bin:/bin", "HOME": str(project), "PYTHONPATH": str(project)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    stack_name = done.stdout.split()[-1]
    return dict(json.loads((outdir / f"{stack_name}.template.json").read_text()))


def only(template: dict[str, Any], resource_type: str) -> dict[str, Any]:
    (resource,) = (r for r in template["Resources"].values() if r["Type"] == resource_type)
    return resource


def test_a_code_template_or_lock_change_leaves_the_cluster_configuration_unchanged(
    default_env: Synthesized, tmp_path: Path
) -> None:
    project = tmp_path / "project"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".mypy_cache")
    for part in PROJECT_PARTS:
        source = ROOT / part
        if source.is_dir():
            shutil.copytree(source, project / part, ignore=ignore)
        else:
            project.mkdir(exist_ok=True)
            shutil.copy2(source, project / part)
    edit(project / "training/train/loop.py", '"""', '"""A change to the training loop.\n\n')
    edit(project / "assets/slurm/base.sbatch.j2", "set -euo pipefail\n", "set -euo pipefail\nulimit -n 65536\n")
    edit(project / "assets/node/cluster-requirements.txt", "transformers==4.57.6", "transformers==4.57.5")

    changed = synthesize_copy(project, tmp_path / "cdk.out")

    cluster = only(changed, "Custom::PclusterCluster")
    assert cluster["Properties"] == default_env.only("Custom::PclusterCluster")["Properties"]
    # The edits were seen: the pipeline ships the new source, the node files hold the new lock.
    old_pipeline = default_env.only("Custom::TrainingPipeline")["Properties"]
    new_pipeline = only(changed, "Custom::TrainingPipeline")["Properties"]
    assert new_pipeline["SourceHash"] != old_pipeline["SourceHash"]
    assert new_pipeline["Run"] == old_pipeline["Run"] == "1"  # and so no new run: the run id stays the same
