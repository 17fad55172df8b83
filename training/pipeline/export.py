"""`python -m training export`: the run's results to where they outlive the cluster.

An S3 URI on AWS (the results bucket, which `cdk destroy` keeps), a local directory in the demo. Copies the
final Hugging Face model, metrics, samples, logs and the run record; not the training checkpoints, which
stay on the file system of the run (export them with `--with-checkpoints`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from training.errors import UserError

EXPORTED = ("hf", "checkpoints/metrics.jsonl", "samples.json", "logs", "run.json", "recipe.yaml")


def files_to_export(run_dir: Path, with_checkpoints: bool) -> list[Path]:
    """Every file to copy, relative to the run directory."""
    names = list(EXPORTED) + (["checkpoints"] if with_checkpoints else [])
    found: set[Path] = set()
    for name in names:
        path = run_dir / name
        if path.is_file():
            found.add(Path(name))
        elif path.is_dir():
            found.update(p.relative_to(run_dir) for p in path.rglob("*") if p.is_file())
    return sorted(found)


def export(run_dir: Path, destination: str, *, with_checkpoints: bool = False) -> dict[str, Any]:
    if not (run_dir / "run.json").is_file():
        raise UserError(f"--run-dir {run_dir}: no run.json (not a run directory)")
    files = files_to_export(run_dir, with_checkpoints)
    if destination.startswith("s3://"):
        _to_s3(run_dir, files, destination)
    else:
        target = Path(destination)
        for relative in files:
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(run_dir / relative, target / relative)
    summary = {
        "destination": destination,
        "files": len(files),
        "bytes": sum((run_dir / f).stat().st_size for f in files),
    }
    print(json.dumps(summary))
    return summary


def _to_s3(run_dir: Path, files: list[Path], destination: str) -> None:
    import boto3

    bucket, _, prefix = destination[len("s3://") :].partition("/")
    if not bucket:
        raise UserError(f"--output {destination}: expected s3://bucket/prefix")
    client = boto3.client("s3")
    for relative in files:
        key = f"{prefix.rstrip('/')}/{relative.as_posix()}" if prefix else relative.as_posix()
        client.upload_file(str(run_dir / relative), bucket, key)
