"""Output directories that are either complete or absent.

Every command writes into a hidden temporary sibling and renames it into place at the end, with a
`manifest.json` describing what it did. A rerun with the same inputs finds that manifest and reuses the
output; an interrupted run leaves only a temporary sibling, which the next run removes.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from training.errors import UserError

MANIFEST = "manifest.json"


def read_manifest(directory: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads((directory / MANIFEST).read_text()))
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def reusable(final: Path, fingerprint: dict[str, Any], *, overwrite: bool) -> dict[str, Any] | None:
    """The manifest of a completed output made from the same inputs, or None if it must be (re)built."""
    if not final.exists():
        return None
    manifest = read_manifest(final)
    if manifest is not None and manifest.get("fingerprint") == fingerprint:
        return manifest
    if overwrite:
        return None
    if manifest is None:
        raise UserError(
            f"{final} already exists and was not written by this tool; choose another --output or pass --overwrite"
        )
    differing = sorted(
        key
        for key in fingerprint.keys() | manifest.get("fingerprint", {}).keys()
        if fingerprint.get(key) != manifest.get("fingerprint", {}).get(key)
    )
    raise UserError(
        f"{final} already holds an output made with different inputs ({', '.join(differing)}); "
        "choose another --output or pass --overwrite"
    )


@contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `final`; on success it replaces `final`, on failure it is removed."""
    final = final.absolute()
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_siblings(final)
    temporary = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    try:
        yield temporary
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    if final.exists():
        retired = final.parent / f".{final.name}.old-{os.getpid()}"
        final.rename(retired)
        temporary.rename(final)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        temporary.rename(final)


@contextmanager
def scratch_directory(final: Path) -> Iterator[Path]:
    """A hidden sibling for intermediate files, removed afterwards whatever happens."""
    final = final.absolute()
    scratch = final.parent / f".{final.name}.scratch-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _remove_stale_siblings(final: Path) -> None:
    """Leftovers of runs that were killed: their process no longer exists."""
    for sibling in final.parent.glob(f".{final.name}.*-*"):
        kind, _, pid = sibling.name.rpartition("-")
        if not kind.endswith((".tmp", ".old", ".scratch")) or not pid.isdigit():
            continue
        if int(pid) != os.getpid() and not _process_alive(int(pid)):
            shutil.rmtree(sibling, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
