"""The repository's root, for the tests that read its files or run its scripts from it."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
