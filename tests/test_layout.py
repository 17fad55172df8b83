"""The README's layout section names every module of the package, and names nothing that is not there."""

from __future__ import annotations

import re

from tests.support.repository import ROOT

TOP_LEVEL_PACKAGES = ("stacks", "training")


def layout_block() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Layout\n", 1)[1]
    return section.split("```", 2)[1]


def test_every_module_is_named_in_the_readme_layout() -> None:
    block = layout_block()
    named = set(re.findall(r"[\w-]+\.(?:py|sh|json)", block))
    modules = {
        path.name
        for package in TOP_LEVEL_PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py")
    }
    assert sorted(modules - named) == [], "modules missing from the README's layout section"


def test_every_folder_the_layout_names_exists() -> None:
    block = layout_block()
    folders = re.findall(r"^\s*([\w/-]+/)\s", block, flags=re.MULTILINE)
    training = ROOT / "training"
    missing = [f for f in folders if not any((base / f).is_dir() for base in (ROOT, training, ROOT / "tests"))]
    assert folders and missing == []
    stage_packages = {p.name + "/" for p in training.iterdir() if (p / "__init__.py").is_file()}
    assert stage_packages <= set(folders), "a subpackage of training/ is missing from the layout section"
