"""The JSON Schemas editors use for the environment files and recipes: current, referenced, and in agreement
with the loaders, checked with a real JSON Schema validator (what a YAML language server runs)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from stacks.config import ENVIRONMENTS_DIR, load_environment
from stacks.schemas import SCHEMAS
from training.config.loading import ConfigError, schema_text
from training.config.recipe import RECIPES_DIR, load_recipe

HEADER = "# yaml-language-server: $schema="
BUNDLED = sorted(ENVIRONMENTS_DIR.glob("*.yaml")) + sorted(RECIPES_DIR.glob("*.yaml"))


def validator_for(document: Path) -> jsonschema.protocols.Validator:
    first = document.read_text().splitlines()[0]
    assert first.startswith(HEADER), f"{document}: first line must be '{HEADER}<schema>'"
    schema_path = (document.parent / first.removeprefix(HEADER)).resolve()
    assert schema_path in SCHEMAS, f"{document}: {schema_path} is not one of the generated schemas"
    schema = json.loads(schema_path.read_text())
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    return validator_class(schema)


@pytest.mark.parametrize("path", list(SCHEMAS), ids=lambda p: p.name)
def test_checked_in_schemas_are_current(path: Path) -> None:
    model, title = SCHEMAS[path]
    assert path.read_text() == schema_text(model, title), f"{path} is stale: run `make schemas` and commit it"


@pytest.mark.parametrize("document", BUNDLED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_bundled_file_references_its_schema_and_is_valid(document: Path) -> None:
    validator = validator_for(document)
    errors = [error.message for error in validator.iter_errors(yaml.safe_load(document.read_text()))]
    assert errors == []


def edited(document: Path, change: dict[str, Any]) -> dict[str, Any]:
    data = copy.deepcopy(yaml.safe_load(document.read_text()))
    for dotted, value in change.items():
        *parents, leaf = dotted.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return dict(data)


# Each mistake is refused by the schema (in the editor) and by the loader (at synth or at job start).
MISTAKES = [
    (ENVIRONMENTS_DIR / "default.yaml", {"compute.gpus": 8}),
    (ENVIRONMENTS_DIR / "default.yaml", {"compute.max_count": "four"}),
    (ENVIRONMENTS_DIR / "default.yaml", {"compute.max_count": 0}),
    (ENVIRONMENTS_DIR / "default.yaml", {"compute.capacity": {"type": "RESERVED"}}),
    (ENVIRONMENTS_DIR / "default.yaml", {"pipeline.timeout_minutes": 90}),
    (ENVIRONMENTS_DIR / "default.yaml", {"logging.retention_days": 10}),
    (ENVIRONMENTS_DIR / "default.yaml", {"storage.mount_dir": "fsx"}),
    (RECIPES_DIR / "llama31-8b-cpt.yaml", {"batch.micro": 0}),
    (RECIPES_DIR / "llama31-8b-cpt.yaml", {"optimizer.momentum": 0.9}),
    (RECIPES_DIR / "llama31-8b-cpt.yaml", {"backend": "gpu"}),
    (RECIPES_DIR / "llama31-8b-cpt.yaml", {"optimizer.betas": [0.9]}),
]


@pytest.mark.parametrize(("document", "change"), MISTAKES, ids=lambda v: str(v) if isinstance(v, dict) else v.name)
def test_schema_and_loader_refuse_the_same_mistakes(document: Path, change: dict[str, Any], tmp_path: Path) -> None:
    data = edited(document, change)
    assert list(validator_for(document).iter_errors(data)), f"the schema accepts {change}"
    candidate = tmp_path / "candidate.yaml"
    candidate.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError):
        if document.parent == ENVIRONMENTS_DIR:
            load_environment("candidate", tmp_path)
        else:
            load_recipe(str(candidate))
