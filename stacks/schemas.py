"""`python -m stacks.schemas`: write the JSON Schemas of the environment file and the recipe.

Generated from the same models that load the files, so an editor (through the `# yaml-language-server:
$schema=...` line at the top of every bundled YAML) completes and checks exactly what `cdk synth` and
`python -m training` accept by type; the domain rules across keys stay in the loaders.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import BaseModel

from stacks.config import SCHEMA_FILE as ENVIRONMENT_SCHEMA
from stacks.config import EnvironmentConfig
from training.config.loading import schema_text
from training.config.recipe import SCHEMA_FILE as RECIPE_SCHEMA
from training.config.recipe import Recipe

SCHEMAS: dict[Path, tuple[type[BaseModel], str]] = {
    ENVIRONMENT_SCHEMA: (EnvironmentConfig, "Trainium training environment (environments/NAME.yaml)"),
    RECIPE_SCHEMA: (Recipe, "Training recipe (python -m training train --recipe FILE)"),
}


def main() -> int:
    for path, (model, title) in SCHEMAS.items():
        text = schema_text(model, title)
        changed = not path.is_file() or path.read_text(encoding="utf-8") != text
        if changed:
            path.write_text(text, encoding="utf-8")
        print(f"{path}: {'written' if changed else 'unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
