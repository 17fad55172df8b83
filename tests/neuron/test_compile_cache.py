"""The compile stage compiles every graph the training stage runs, so the real run never stops to compile.

On Trainium `neuron_parallel_compile` runs the compile stage (`train --compile`: two steps, nothing saved) and
fills the Neuron compiler's cache, keyed by each graph's hash, which the training stage then reads. Here both
stages run on torch-xla's CPU device against one torch-xla persistent compilation cache. That cache cannot
load executables on the CPU device (each hit is a `PersistentCacheDeserializeFailure`, then compiled again),
but it writes one file per graph it has not seen, named by the graph's hash: a file the training stage adds
is a graph the compile stage did not compile, which on Trainium is a compilation in the middle of the run.

The tiny recipes run with validation and checkpoints (every 3 steps of 7, as a real run has them), on one
process: pipeline stages cannot exchange activations on XLA:CPU (tests/neuron/test_pipeline.py runs them
under NxD's CPU mode, where nothing is traced), so the Mixtral recipe runs here without stages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from training.local.tiny import build_tiny_world

RECIPES = {"llama": "tiny-llama-cpt", "mixtral": "tiny-mixtral-sft"}
# Mixtral with the capacity dispatch, whose dropped fraction is logged with the step's loss (as the real recipe)
EXTRA = {"llama": (), "mixtral": ("moe.capacity_factor=2.0",)}
# Every graph a run compiles, counted by torch-xla's analysis (PT_XLA_DEBUG_LEVEL=2) of these runs:
GRAPHS = {
    "set-up": 2,  # NxD's model-parallel groups, its optimizer's construction
    "forward and backward": 2,  # the first micro batch (it creates the gradients), the others (they add to them)
    "optimizer step": 2,  # step 1 (AdamW creates its state), then the same graph every step
    "validation": 2,  # every validation batch, then the mean
    "checkpoint save": 1,  # the rendezvous NxD's save starts with
}


def run_stage(world: dict[str, Path], architecture: str, cache: Path, checkpoints: Path, *extra: str) -> None:
    overrides = [
        f"model.config={world['hf']}",
        f"model.pretrained={world['pretrained']}",
        f"data.path={world['data']}",
        "data.validation_split=train",  # the same blocks as a stand-in validation split: only the graphs count
        "data.validation_every=3",
        "data.validation_batches=2",
        f"checkpoint.dir={checkpoints}",
        "checkpoint.every=3",
        "parallelism.tp=1",
        "parallelism.pp=1",
        "steps=7",
        "batch.global=8",
        "batch.micro=2",
        "backend=neuron",
        "precision=fp32",
        *EXTRA[architecture],
    ]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    command += ["-m", "training", "train", "--recipe", RECIPES[architecture], *overrides, *extra]
    environment = {**os.environ, "XLA_PERSISTENT_CACHE_PATH": str(cache), "XLA_PERSISTENT_CACHE_READ_ONLY": "0"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False, env=environment)
    assert result.returncode == 0, result.stderr[-4000:]


def graphs(cache: Path) -> set[str]:
    return {path.name for path in cache.iterdir()} if cache.is_dir() else set()


@pytest.mark.parametrize("architecture", ["llama", "mixtral"])
def test_training_compiles_nothing_the_compile_stage_did_not(architecture: str, tmp_path: Path) -> None:
    world = build_tiny_world(tmp_path / "world", architecture, tp=1)
    cache = tmp_path / "cache"
    run_stage(world, architecture, cache, tmp_path / "compile", "--compile")
    compiled = graphs(cache)
    assert len(compiled) == sum(GRAPHS.values()), sorted(compiled)
    run_stage(world, architecture, cache, tmp_path / "train", "--resume")
    assert graphs(cache) - compiled == set()
    records = [json.loads(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "validation_loss" in r] == [3, 6, 7]
    assert all(("moe_dropped" in r) == (architecture == "mixtral") for r in records)
