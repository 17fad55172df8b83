"""`submit` parses the model's config.json once: the memory check, the budget, the throughput floor and the
preflight's time limit all take the one object the run plan carries (files opened, counted by an audit hook)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from training.cli import main
from training.config.recipe import load_recipe
from training.train.memory import KNOWN_MODELS_DIR

OPENED: list[str] = []
COUNTING = {"on": False}


def count_opens(event: str, args: tuple[object, ...]) -> None:
    if COUNTING["on"] and event == "open" and isinstance(args[0], str | Path):
        OPENED.append(str(args[0]))


sys.addaudithook(count_opens)  # hooks cannot be removed; this one counts only while a test turns it on


@pytest.mark.parametrize("recipe", ["llama31-8b-cpt", "mixtral-8x7b-sft"])
def test_submit_reads_the_models_config_once(recipe: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    site_file = tmp_path / "site.yaml"
    site = {"runs_root": str(tmp_path / "runs"), "neuron": True, "instance_type": "trn1.32xlarge", "preflight": True}
    site_file.write_text(json.dumps(site))
    command = ["submit", "--recipe", recipe, "--dry-run", "--run-id", "r", "--site", str(site_file)]
    OPENED.clear()
    COUNTING["on"] = True
    try:
        status = main(command)
    finally:
        COUNTING["on"] = False
    assert status == 0, capsys.readouterr().err
    model = Path(load_recipe(recipe).model.config)  # not here: the bundled copy of its config.json is read
    own = {str(model / "config.json"), str(KNOWN_MODELS_DIR / f"{model.name}.json")}
    assert [path for path in OPENED if path in own] == [str(KNOWN_MODELS_DIR / f"{model.name}.json")]
    assert "#SBATCH --time" in capsys.readouterr().out  # the scripts were rendered, the preflight's among them
