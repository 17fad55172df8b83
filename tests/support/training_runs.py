"""The training job run on a tiny world (training.local.tiny) as a user runs it: its recipe overrides, one
torchrun of it, and the metrics it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def world_overrides(world: dict[str, Path], checkpoints: Path, *extra: str) -> list[str]:
    """Recipe overrides that train on a tiny world with checkpoints in `checkpoints`."""
    return [
        f"model.config={world['hf']}",
        f"model.pretrained={world['pretrained']}",
        f"data.path={world['data']}",
        f"checkpoint.dir={checkpoints}",
        *extra,
    ]


def torchrun(
    recipe: str, overrides: list[str], *, processes: int, env: dict[str, str] | None = None, resume: bool = False
) -> subprocess.CompletedProcess[str]:
    """`python -m training train` under torchrun with `processes` ranks on this machine."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    command += ["-m", "training", "train", "--recipe", recipe, *overrides] + (["--resume"] if resume else [])
    return subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=300, check=False
    )


def metrics(checkpoints: Path) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl."""
    return [json.loads(line) for line in (checkpoints / "metrics.jsonl").read_text().splitlines()]
