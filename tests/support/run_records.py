"""Run records (`run.json`) as `submit` writes them, for tests of what reads them back (status, timeline)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from training.config.recipe import load_recipe, recipe_as_dict


def write_run_record(run_dir: Path, stages: Sequence[str], overrides: Sequence[str] = ()) -> None:
    """A record of the tiny Llama recipe with `overrides` (`section.key=value`), no submission yet."""
    settings = recipe_as_dict(load_recipe("tiny-llama-cpt", overrides))
    run = {"run_id": run_dir.name, "settings": settings, "stages": list(stages), "submissions": [], "site": {}}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.json").write_text(json.dumps(run))
