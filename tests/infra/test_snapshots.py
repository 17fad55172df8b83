"""Template snapshots (asset hashes masked) so every infrastructure change shows up as a readable PR diff.

After an intended change, run `make snapshots` and commit the updated files in tests/infra/snapshots/.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.synthesis import ENVIRONMENT_NAMES, Synthesized, synthesize

SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
ASSET_HASH = re.compile(r"[0-9a-f]{64}")


def masked(template: dict[str, Any]) -> str:
    """Stable text of a template: asset hashes and the CDK version fingerprint replaced by placeholders."""
    template = json.loads(json.dumps(template))
    metadata = template.get("Resources", {}).get("CDKMetadata", {}).get("Properties", {})
    if "Analytics" in metadata:
        metadata["Analytics"] = "<cdk-version-analytics>"
    text = json.dumps(template, indent=2, sort_keys=True) + "\n"
    return ASSET_HASH.sub("<asset-hash>", text)


@pytest.mark.parametrize("env_name", ENVIRONMENT_NAMES)
def test_template_matches_snapshot(env_name: str, synthesized: dict[str, Synthesized]) -> None:
    snapshot = SNAPSHOTS / f"{env_name}.template.json"
    current = masked(synthesized[env_name].template)
    if os.environ.get("UPDATE_SNAPSHOTS") == "1":
        SNAPSHOTS.mkdir(exist_ok=True)
        snapshot.write_text(current)
    assert snapshot.is_file(), f"no snapshot for {env_name}; run `make snapshots` and commit it"
    assert current == snapshot.read_text(), f"{snapshot.name} is out of date; review the diff, then `make snapshots`"


def test_every_snapshot_belongs_to_an_environment() -> None:
    assert sorted(path.name.removesuffix(".template.json") for path in SNAPSHOTS.glob("*.json")) == ENVIRONMENT_NAMES


def test_masking_hides_only_volatile_values() -> None:
    template = {"Resources": {"A": {"Properties": {"Key": "a" * 64 + ".sh", "Size": 1200}}}}
    assert json.loads(masked(template)) == {
        "Resources": {"A": {"Properties": {"Key": "<asset-hash>.sh", "Size": 1200}}}
    }


def test_synth_is_deterministic(default_env: Synthesized, tmp_path: Path) -> None:
    again = synthesize("default", tmp_path / "again")
    assert json.dumps(again.template, sort_keys=True) == json.dumps(default_env.template, sort_keys=True)
