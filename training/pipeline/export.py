"""`python -m training export`: the run's results to where they outlive the cluster.

An S3 URI on AWS (the results bucket, which `cdk destroy` keeps), a local directory in the demo. Copies the
final Hugging Face model, metrics (the JSON lines, the TensorBoard event files and `metrics.png`), samples,
the evaluation (`evaluation.json`, `evaluation.md`, also when its gate failed), logs and the run record;
not the training checkpoints, which stay on the file system of the run (export them with
`--with-checkpoints`).

`metrics.png` (training.pipeline.plot) is drawn from `checkpoints/metrics.jsonl` into the run directory
first and exported like the other files; it is rewritten only when the picture changes, so its modification
time, part of the export's fingerprint, stays the same and a rerun still reuses a complete export. A run
whose metrics cannot be drawn (none logged, a damaged file, a run directory that is not writable) is
exported without the plot, with a warning.

The model card `hf/README.md` (training.pipeline.card) is written next, with a copy of the plot beside it so
the card renders from `hf/` alone; the same rule keeps its modification time while its text is unchanged, and
any change of what it reports (an evaluation, new samples, another base-model record) changes the fingerprint.
A run without `hf/` has no card; one whose card cannot be written is exported without it, with a warning.

Both ends say when an export is complete. A local export is written beside its destination and renamed
into place (training.outputs), so the directory holds a whole export or nothing; its `manifest.json`
lets a rerun from the same files reuse it. S3 has no rename: the manifest is deleted, the objects are
uploaded, those of an earlier export that this one lacks are deleted, and `manifest.json` goes up last,
so a reader that finds the manifest finds exactly the objects it lists; a rerun after a kill uploads
everything again over the same keys.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from training import outputs
from training.errors import UserError

log = logging.getLogger(__name__)
METRICS = "checkpoints/metrics.jsonl"
PLOT = "metrics.png"
CARD = Path("hf") / "README.md"  # the model card, written by write_card
EXPORTED = (
    "hf",
    METRICS,
    "tensorboard",
    "wandb",  # a W&B run's local files (training.train.trackers), which `wandb sync` uploads later
    PLOT,
    "samples.json",
    "evaluation.json",  # training.pipeline.evaluate's report and table, exported whether its gate passed or not
    "evaluation.md",
    "logs",
    "run.json",
    "recipe.yaml",
    "timeline.jsonl",  # each stage's start and end (training.pipeline.timeline), up to the export's own start
)


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


def export(
    run_dir: Path, destination: str, *, with_checkpoints: bool = False, overwrite: bool = False
) -> dict[str, Any]:
    if not (run_dir / "run.json").is_file():
        raise UserError(f"--run-dir {run_dir}: no run.json (not a run directory)")
    run_id = json.loads((run_dir / "run.json").read_text()).get("run_id")
    drawn = draw_plot(run_dir, run_id)
    carded = write_card(run_dir, drawn)
    stale = ({Path(PLOT)} if not drawn else set()) | ({CARD} if not carded else set())  # never a stale one
    stale |= {CARD.parent / PLOT} if not (drawn and carded) else set()
    files = [f for f in files_to_export(run_dir, with_checkpoints) if f not in stale]
    manifest = {
        "kind": "export",
        "fingerprint": outputs.files_fingerprint(run_dir, files),
        "run_id": run_id,
        "files": [relative.as_posix() for relative in files],
        "bytes": sum((run_dir / f).stat().st_size for f in files),
    }
    reused = False
    if destination.startswith("s3://"):
        _to_s3(run_dir, files, destination, manifest)
    else:
        reused = _to_directory(run_dir, files, Path(destination), manifest, overwrite=overwrite)
    summary = {"destination": destination, "files": len(files), "bytes": manifest["bytes"], "reused": reused}
    print(json.dumps(summary))
    return summary


def draw_plot(run_dir: Path, run_id: str | None) -> bool:
    """`metrics.png` in the run directory from its metrics, if it has any; False (with a warning) if not."""
    metrics = run_dir / METRICS
    if not metrics.is_file():
        return False
    from training.pipeline.plot import plot_metrics

    try:
        plot_metrics(metrics, run_dir / PLOT, run_id=run_id or run_dir.name)
    except UserError as error:
        log.warning(f"exporting without {PLOT}: {error}")
        return False
    except OSError as error:
        log.warning(f"exporting without {PLOT}: {error.filename or run_dir}: {error.strerror or error}")
        return False
    return True


def write_card(run_dir: Path, drawn: bool) -> bool:
    """The model card in `hf/` (training.pipeline.card); False (with a warning) when it cannot be written."""
    from training.pipeline import card

    try:
        return card.write_card(run_dir, plot=drawn) is not None
    except OSError as error:
        log.warning(f"exporting without {CARD}: {error.filename or run_dir}: {error.strerror or error}")
        return False


def _to_directory(run_dir: Path, files: list[Path], target: Path, manifest: dict[str, Any], *, overwrite: bool) -> bool:
    if outputs.reusable(target, manifest["fingerprint"], overwrite=overwrite) is not None:
        return True
    with outputs.atomic_directory(target, overwrite=overwrite) as partial:
        for relative in files:
            (partial / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(run_dir / relative, partial / relative)
        outputs.write_manifest(partial, manifest)
    return False


def _to_s3(run_dir: Path, files: list[Path], destination: str, manifest: dict[str, Any]) -> None:
    import boto3

    bucket, _, prefix = destination[len("s3://") :].partition("/")
    if not bucket:
        raise UserError(f"--output {destination}: expected s3://bucket/prefix")
    client = boto3.client("s3")

    def key(name: str) -> str:
        return f"{prefix.rstrip('/')}/{name}" if prefix.strip("/") else name

    client.delete_object(Bucket=bucket, Key=key(outputs.MANIFEST))  # incomplete until the new one is up
    for count, relative in enumerate(files):
        outputs.kill_point(f"uploaded-{count}")
        client.upload_file(str(run_dir / relative), bucket, key(relative.as_posix()))
    if prefix.strip("/"):  # objects an earlier export left that this one does not have (never a whole bucket)
        wanted = {key(relative.as_posix()) for relative in files}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key("")):
            for stale in (o["Key"] for o in page.get("Contents", []) if o["Key"] not in wanted):
                client.delete_object(Bucket=bucket, Key=stale)
    client.put_object(
        Bucket=bucket,
        Key=key(outputs.MANIFEST),
        Body=(json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode(),
        ContentType="application/json",
    )
