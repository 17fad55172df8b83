"""The README and the reference pages under docs/ link only to what exists: every relative link names an existing
file, and a link to a heading (`page.md#anchor`) names a heading the page has, as GitHub derives its anchors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.repository import ROOT

DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", flags=re.IGNORECASE)


def unfenced(text: str) -> str:
    """The text outside fenced code blocks, where a `#` line is a comment, not a heading."""
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans, where a bracket is not a link."""
    return re.sub(r"`[^`\n]*`", "", unfenced(text))


def relative_links(text: str) -> list[str]:
    return [target for target in LINK.findall(prose(text)) if not SCHEME.match(target)]


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#* *$", unfenced(page.read_text()), flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def test_the_pages_are_there() -> None:
    assert len(PAGES) > 1 and all(page.is_file() for page in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in relative_links(page.read_text()):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no such heading in {resolved.relative_to(ROOT).as_posix()}")
    assert broken == [], broken


def test_the_readme_lists_every_reference_page() -> None:
    """A page under docs/ that the README's Reference list does not name is a page nobody finds."""
    section = (ROOT / "README.md").read_text().split("\n## Reference\n", 1)[1].split("\n## ", 1)[0]
    listed = {target.partition("#")[0] for target in relative_links(section)}
    assert {f"docs/{page.name}" for page in DOCS.glob("*.md")} <= listed
