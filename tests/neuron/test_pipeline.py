"""Pipeline parallelism on the neuron backend: neuronx-distributed's `NxDPPModel` (1F1B over its own sends and
receives) around this project's stages, under NxD's CPU mode (`NXD_CPU_MODE=1`: its layers and pipeline
communication on CPU tensors over gloo), two stages at TP 1 in two processes, through the real training job.

XLA:CPU cannot run this: NxD sends between stages with torch-xla's all_gather, which across processes is a
no-op there. So the schedule, the stage partition, what crosses the stage boundary (hidden states and, for
Mixtral, the balance loss's sums, with their gradients), NxD's loss function and its validation pass run for
real; the compiled graphs and the collectives over NeuronLink and EFA need Trainium.

torch-xla's ZeRO-1 needs XLA tensors, so these runs use NxD's optimizer without it (`optimizer.zero1=false`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from training.formats.convert import ConvertOptions, convert
from training.local.tiny import build_tiny_world

TOLERANCE = 1e-5  # the backends reduce in different orders (fp32)
STEPS = 4
RECIPES = {"llama": "tiny-llama-cpt", "mixtral": "tiny-mixtral-sft"}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    from training.data.sft import SftOptions, prepare_sft

    root = tmp_path_factory.mktemp("pp-worlds")
    worlds = {name: build_tiny_world(root / name, name, tp=1, pp=2) for name in RECIPES}
    mixtral = worlds["mixtral"]  # prepared again with a validation split
    source, tokenizer = str(mixtral["source"]), str(mixtral["tokenizer"])
    mixtral["data"] = root / "mixtral-data"
    prepare_sft(SftOptions(source=source, tokenizer=tokenizer, seq_len=64, out=mixtral["data"], validation=source))
    return worlds


def train(
    world: dict[str, Path], architecture: str, backend: str, checkpoints: Path, *, resume: bool = False
) -> subprocess.CompletedProcess[str]:
    overrides = [
        f"model.config={world['hf']}",
        f"model.pretrained={world['pretrained']}",
        f"data.path={world['data']}",
        f"checkpoint.dir={checkpoints}",
        "parallelism.tp=1",
        "parallelism.pp=2",
        f"steps={STEPS}",
        "checkpoint.every=2",
        "batch.global=8",
        "batch.micro=2",  # 4 micro batches a step through 2 stages
        f"backend={backend}",
        "precision=fp32",
        "optimizer.zero1=false",
        "optimizer.grad_clip=0.5",
    ]
    if architecture == "mixtral":  # the capacity dispatch's counts travel too; validation through run_eval
        overrides += ["moe.capacity_factor=1.0", "data.validation_split=validation", "data.validation_every=2"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command += ["-m", "training", "train", "--recipe", RECIPES[architecture], *overrides]
    command += ["--resume"] if resume else []
    environment = {**os.environ, "NXD_CPU_MODE": "1"}
    return subprocess.run(command, capture_output=True, text=True, env=environment, timeout=900, check=False)


def metrics(checkpoints: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (checkpoints / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(worlds: dict[str, dict[str, Path]], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    done: dict[str, Path] = {}
    for architecture, world in worlds.items():
        for backend in ("cpu", "neuron"):
            checkpoints = tmp_path_factory.mktemp(f"pp-{architecture}-{backend}")
            result = train(world, architecture, backend, checkpoints)
            assert result.returncode == 0, result.stderr[-6000:]
            done[f"{architecture}-{backend}"] = checkpoints
    return done


@pytest.mark.parametrize("architecture", list(RECIPES))
def test_nxd_pipeline_trains_as_the_cpu_schedule(architecture: str, runs: dict[str, Path]) -> None:
    """Loss, gradient norm (NxD's, over both stages), validation loss and dropped expert choices per step."""
    cpu, neuron = metrics(runs[f"{architecture}-cpu"]), metrics(runs[f"{architecture}-neuron"])
    assert [r["step"] for r in neuron] == [r["step"] for r in cpu] == list(range(1, STEPS + 1))
    assert any(r["grad_norm"] > 0.5 for r in cpu)  # clipping happened, at the norm over both stages
    for expected, actual in zip(cpu, neuron, strict=True):
        for key in ("loss", "grad_norm", "validation_loss", "moe_dropped"):
            assert (key in actual) == (key in expected), (key, expected, actual)
            if key in expected:
                assert actual[key] == pytest.approx(expected[key], rel=TOLERANCE, abs=1e-7), (key, expected, actual)
    if architecture == "mixtral":
        assert sum("validation_loss" in r for r in neuron) == 2
        assert any(r["moe_dropped"] > 0 for r in neuron)  # at factor 1 some choices are over capacity


@pytest.mark.parametrize("architecture", list(RECIPES))
def test_each_stage_saves_its_pp_rank_file_and_converts_back(
    architecture: str, runs: dict[str, Path], tmp_path: Path
) -> None:
    """NxD's checkpointing writes one file per stage under the converter's names; `convert --from nxd` joins
    them into the same Hugging Face weights as the cpu schedule's run."""
    neuron = runs[f"{architecture}-neuron"]
    files = sorted(p.name for p in (neuron / f"step_{STEPS}" / "model").iterdir())
    assert files == [f"dp_rank_00_tp_rank_00_pp_rank_{pp:02d}.pt" for pp in (0, 1)]
    weights = {}
    for backend in ("cpu", "neuron"):
        output = tmp_path / backend
        convert(
            ConvertOptions(
                source_format="nxd", target_format="hf", input=runs[f"{architecture}-{backend}"], output=output
            )
        )
        from safetensors.torch import load_file

        weights[backend] = {k: v for f in sorted(output.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert weights["neuron"].keys() == weights["cpu"].keys()
    for name, tensor in weights["cpu"].items():
        torch.testing.assert_close(weights["neuron"][name], tensor, rtol=1e-4, atol=1e-6, msg=name)


def test_killed_pipeline_resumes_bit_identically(
    worlds: dict[str, dict[str, Path]], runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 (the last stage) SIGKILLs itself after step 3; `--resume` loads each stage's step-2 files through
    NxD's `load_checkpoint` and steps 3 and 4 and the final weights equal the uninterrupted run's, bit for bit."""
    from training.train.loop import KILL_AT_STEP, KILL_RANK

    checkpoints = tmp_path / "resumed"
    monkeypatch.setenv(KILL_AT_STEP, "3")
    monkeypatch.setenv(KILL_RANK, "1")
    first = train(worlds["mixtral"], "mixtral", "neuron", checkpoints)
    assert first.returncode != 0
    monkeypatch.delenv(KILL_AT_STEP)
    second = train(worlds["mixtral"], "mixtral", "neuron", checkpoints, resume=True)
    assert second.returncode == 0, second.stderr[-6000:]
    assert "resumed from step 2" in second.stderr
    straight = {r["step"]: r for r in metrics(runs["mixtral-neuron"])}
    resumed = [r for r in metrics(checkpoints) if r["step"] > 2][-2:]
    assert [r["step"] for r in resumed] == [3, 4]
    for record in resumed:
        expected = straight[record["step"]]
        assert (record["loss"], record["grad_norm"]) == (expected["loss"], expected["grad_norm"])
    for pp in (0, 1):
        name = f"step_{STEPS}/model/dp_rank_00_tp_rank_00_pp_rank_{pp:02d}.pt"
        expected_weights = torch.load(runs["mixtral-neuron"] / name, weights_only=True)
        actual_weights = torch.load(checkpoints / name, weights_only=True)
        assert expected_weights.keys() == actual_weights.keys()
        assert all(torch.equal(expected_weights[k], actual_weights[k]) for k in expected_weights), pp
