"""Multi-rank test cases: a worker script runs every case of a JSON plan on each rank under torchrun.

Used by the tensor-parallel model tests (model_worker.py), the memory planner's tests (memory_worker.py) and
the neuron tier's CPU-mode tests.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tests.support.repository import ROOT


def run_workers(
    worker: Path,
    plan: list[dict[str, Any]],
    root: Path,
    processes: int,
    *,
    timeout: int,
    environment: Mapping[str, str] | None = None,
) -> Path:
    """One torchrun of `processes` ranks of `worker` over `plan`, its environment updated with `environment`;
    returns the directory of their results."""
    plan_file, results = root / "plan.json", root / "results"
    plan_file.write_text(json.dumps(plan))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    command += [str(worker), "--plan", str(plan_file), "--out", str(results)]
    environ = {**os.environ, **(environment or {})}
    finished = subprocess.run(command, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=timeout)
    assert finished.returncode == 0, finished.stderr[-4000:]
    return results


def worker_main(run_case: Callable[[dict[str, Any], Path], None]) -> None:
    """A worker script's entry point: `--plan FILE --out DIR`, each case of the plan in turn."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    arguments = parser.parse_args()
    for case in json.loads(arguments.plan.read_text()):
        run_case(case, arguments.out)


# The repository on the workers' import path, one thread each (the ranks share two cores).
LOCAL = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
