"""The layout pages match the tree: docs/layout.md names every module of the package and nothing that is not
there; the README's short layout names every top-level folder and every subpackage of training/."""

from __future__ import annotations

import re
import subprocess

from tests.support.repository import ROOT

TOP_LEVEL_PACKAGES = ("stacks", "training")


def fenced_block(page: str, heading: str) -> str:
    """The first fenced block after `heading` (a whole heading line, e.g. "## Layout")."""
    section = ("\n" + (ROOT / page).read_text()).split(f"\n{heading}\n", 1)[1]
    return section.split("```", 2)[1]


def module_map() -> str:
    return fenced_block("docs/layout.md", "# Layout: every module and what it holds")


def readme_layout() -> str:
    return fenced_block("README.md", "## Layout")


def subpackages() -> set[str]:
    training = ROOT / "training"
    return {p.name + "/" for p in training.iterdir() if (p / "__init__.py").is_file()}


def test_every_module_is_named_in_the_module_map() -> None:
    block = module_map()
    named = set(re.findall(r"[\w-]+\.(?:py|sh|json)", block))
    modules = {
        path.name
        for package in TOP_LEVEL_PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py")
    }
    assert sorted(modules - named) == [], "modules missing from docs/layout.md"


def test_every_folder_the_module_map_names_exists() -> None:
    block = module_map()
    folders = re.findall(r"^\s*([\w/-]+/)\s", block, flags=re.MULTILINE)
    bases = (ROOT, ROOT / "training", ROOT / "tests")
    missing = [f for f in folders if not any((base / f).is_dir() for base in bases)]
    assert folders and missing == []
    assert subpackages() <= set(folders), "a subpackage of training/ is missing from docs/layout.md"


def test_the_readme_layout_names_every_top_level_folder_and_subpackage() -> None:
    block = readme_layout()
    folders = set(re.findall(r"^([\w-]+/)\s", block, flags=re.MULTILINE))
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    top_level = {line.split("/", 1)[0] + "/" for line in tracked.splitlines() if "/" in line}
    top_level = {folder for folder in top_level if not folder.startswith(".")}
    assert sorted(top_level - folders) == [], "top-level folders missing from the README's layout"
    assert sorted(f for f in folders if not (ROOT / f).is_dir()) == [], "the README's layout names a missing folder"
    mentioned = set(re.findall(r"\b([\w-]+/)", block))
    assert sorted(subpackages() - mentioned) == [], "a subpackage of training/ is missing from the README's layout"
