"""The `neuron` backend, executed: neuronx-distributed's layers, ZeRO-1 optimizer and checkpointing on
torch-xla's CPU device at TP 1, against the `cpu` backend and against neuronx-distributed's own loader."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.neuron.one_rank import free_port, one_rank_neuron_backend
from training.config.model import ModelConfig
from training.formats.convert import ConvertOptions, convert
from training.formats.lazy import lazy_tensors
from training.formats.torch_reader import open_checkpoint_file
from training.local.tiny import build_tiny_world
from training.train.loop import CHANGE_GRAPH_AT_STEP, KILL_AT_STEP
from training.train.watchdog import read_stop

# Relative tolerance of the neuron backend's per-step loss and gradient norm against the cpu backend's: both
# run fp32, but torch-xla fuses differently and the neuron AdamW keeps its bias corrections on the device
# (capturable form), so the last bits differ. Within one backend, runs are bit-identical (resume test).
TOLERANCE = 1e-5
STEPS = 7  # checkpoints at steps 3 and 6 and at the schedule's last step, 7, where the linear decay reaches 0
CHECKPOINT_EVERY = 3
MICRO_BATCHES = 4  # global batch 8 in micro batches of 2 on one data-parallel rank
GRAD_CLIP = 0.5
READS_PER_STEP = 2  # loss and gradient norm, read in a step closure once the step's graph has run


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    root = tmp_path_factory.mktemp("worlds")
    return {name: build_tiny_world(root / name, name, tp=1) for name in ("llama", "mixtral")}


RECIPES = {"llama": "tiny-llama-cpt", "mixtral": "tiny-mixtral-sft"}


def train(
    world: dict[str, Path], architecture: str, backend: str, checkpoints: Path, *extra: str, resume: bool = False
) -> subprocess.CompletedProcess[str]:
    overrides = [
        f"model.config={world['hf']}",
        f"model.pretrained={world['pretrained']}",
        f"data.path={world['data']}",
        f"checkpoint.dir={checkpoints}",
        "parallelism.tp=1",
        # The tiny Mixtral recipe has two stages; on XLA:CPU stages cannot exchange anything (collectives
        # between processes are no-ops there): tests/neuron/test_pipeline.py runs them under NxD's CPU mode.
        "parallelism.pp=1",
        f"steps={STEPS}",
        f"checkpoint.every={CHECKPOINT_EVERY}",
        "checkpoint.keep_last=3",
        "batch.global=8",
        "batch.micro=2",
        f"backend={backend}",
        "precision=fp32",
        # Below the tiny models' gradient norms (0.6 to 1.2), and not torch-xla's ZeRO-1 default of 1.0: the
        # backends agree only if ZeRO-1 clips at the recipe's value.
        f"optimizer.grad_clip={GRAD_CLIP}",
        *extra,
    ]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    command += ["-m", "training", "train", "--recipe", RECIPES[architecture], *overrides]
    command += ["--resume"] if resume else []
    return subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)


def metrics(checkpoints: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (checkpoints / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(worlds: dict[str, dict[str, Path]], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each tiny recipe once per backend, same settings (at DP 1 the job runs without ZeRO-1, as NxD's
    launchers do; `test_zero1_keeps_each_regimes_dtypes` runs NxD's ZeRO-1 optimizer itself)."""
    done: dict[str, Path] = {}
    for architecture, world in worlds.items():
        for backend in ("cpu", "neuron"):
            checkpoints = tmp_path_factory.mktemp(f"{architecture}-{backend}")
            result = train(world, architecture, backend, checkpoints)
            assert result.returncode == 0, result.stderr[-4000:]
            if backend == "neuron":  # NxD logs its groups each time it creates them: once per job
                output = result.stdout + result.stderr
                assert output.count("tp_groups: replica_groups") == 1, output[-4000:]
                assert result.stderr.count("(step 1) step_loss") == 1  # each line logged once
            done[f"{architecture}-{backend}"] = checkpoints
    return done


@pytest.mark.parametrize("architecture", ["llama", "mixtral"])
def test_neuron_backend_trains_as_the_cpu_backend(architecture: str, runs: dict[str, Path]) -> None:
    cpu, neuron = metrics(runs[f"{architecture}-cpu"]), metrics(runs[f"{architecture}-neuron"])
    assert [r["step"] for r in neuron] == [r["step"] for r in cpu] == list(range(1, STEPS + 1))
    assert any(r["grad_norm"] > GRAD_CLIP for r in cpu)  # clipping happened
    for expected, actual in zip(cpu, neuron, strict=True):
        assert actual["loss"] == pytest.approx(expected["loss"], rel=TOLERANCE), (expected, actual)
        assert actual["grad_norm"] == pytest.approx(expected["grad_norm"], rel=TOLERANCE), (expected, actual)
        assert actual["lr"] == expected["lr"]
    if architecture == "llama":
        assert neuron[-1]["lr"] == 0.0  # the linear schedule's last step, which must not compile a new graph


MEMORY_SETTINGS = {
    "llama": ["parallelism.sequence_parallel=true", "memory.activation_checkpointing=selective"],
    # with a capacity factor that drops nothing (4 experts, top 2): the capacity dispatch's static shapes
    "mixtral": ["parallelism.sequence_parallel=true", "memory.activation_checkpointing=full", "moe.capacity_factor=2"],
}


@pytest.mark.parametrize("architecture", ["llama", "mixtral"])
def test_sequence_parallel_and_checkpointing_train_as_without(
    architecture: str, worlds: dict[str, dict[str, Path]], runs: dict[str, Path], tmp_path: Path
) -> None:
    """NxD's sequence-parallel layers (sequence-first activations, the embedding's reduce-scatter, the
    optimizer's sum of the norms' gradients) and its activation checkpointing wrapper, on XLA:CPU at TP 1:
    the same losses and gradient norms as the cpu backend without them. (At TP 2 NxD's sequence-parallel
    QKV layer needs XLA tensors, which NxD's CPU mode does not give: tests/neuron/test_cpu_mode.py.)"""
    result = train(worlds[architecture], architecture, "neuron", tmp_path, *MEMORY_SETTINGS[architecture])
    assert result.returncode == 0, result.stderr[-4000:]
    for expected, actual in zip(metrics(runs[f"{architecture}-cpu"]), metrics(tmp_path), strict=True):
        assert actual["loss"] == pytest.approx(expected["loss"], rel=TOLERANCE), (expected, actual)
        assert actual["grad_norm"] == pytest.approx(expected["grad_norm"], rel=TOLERANCE), (expected, actual)


def test_graph_discipline(runs: dict[str, Path]) -> None:
    """Counted by torch-xla itself (`torch_xla.debug.metrics`, recorded per step in metrics.jsonl): one graph
    execution per micro batch and one for the optimizer step, no compilation after step 2, and no device-to-host
    transfer inside a step (only the step closure's two reads, after the graph ran). Saving a checkpoint is
    between steps: NxD's save runs graphs of its own (compiled once, at the first save) and copies to the host."""
    records = metrics(runs["llama-neuron"])
    saved_before = {step + 1 for step in range(CHECKPOINT_EVERY, STEPS, CHECKPOINT_EVERY)}
    first_save = min(saved_before)
    for previous, record in itertools.pairwise(records):
        step = record["step"]
        compilations = record["xla_compilations"] - previous["xla_compilations"]
        if step > 2:
            assert compilations == (1 if step == first_save else 0), (step, compilations)
        if step not in saved_before:
            executions = record["xla_executions"] - previous["xla_executions"]
            transfers = record["xla_transfers_to_host"] - previous["xla_transfers_to_host"]
            assert executions == MICRO_BATCHES + 1, (step, executions)
            assert transfers == READS_PER_STEP, (step, transfers)
    # The watch (training.train.watchdog) agrees: the first save's graphs are a first use, not a cache miss.
    assert [r["late_compilations"] for r in records] == [0] * STEPS
    assert not any("late_compilation_step" in r for r in records)


LATE_STEP = 5


@pytest.mark.parametrize("fatal", [False, True])
def test_a_graph_compiled_after_step_2_is_a_late_compilation_and_fatal_when_asked(
    fatal: bool, worlds: dict[str, dict[str, Path]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step graph gets one more operation at step 5 (CHANGE_GRAPH_AT_STEP), as a graph changed since the
    compile stage: torch-xla compiles it, the record of step 5 counts it and names the step; with
    neuron.fail_on_late_compile the job ends there with that one line, recorded as its stop."""
    monkeypatch.setenv(CHANGE_GRAPH_AT_STEP, str(LATE_STEP))
    extra = ["neuron.fail_on_late_compile=true"] if fatal else []
    result = train(worlds["llama"], "llama", "neuron", tmp_path, *extra)
    records = {r["step"]: r for r in metrics(tmp_path)}
    assert [records[s]["late_compilations"] for s in range(1, LATE_STEP)] == [0] * (LATE_STEP - 1)
    assert records[LATE_STEP]["late_compilations"] == 1 and records[LATE_STEP]["late_compilation_step"] == LATE_STEP
    line = f"train compiled a graph at step {LATE_STEP}: the compile cache missed (the training step's graph"
    assert line in result.stderr
    stop = read_stop(tmp_path)
    if not fatal:
        assert result.returncode == 0, result.stderr[-4000:]
        assert stop is None and records[STEPS]["late_compilations"] == 1  # counted once, the run goes on
        return
    assert result.returncode != 0 and max(records) == LATE_STEP
    assert stop is not None and stop["step"] == LATE_STEP
    assert stop["reason"].startswith(line) and stop["reason"].endswith("(neuron.fail_on_late_compile)")
    assert f"error: {stop['reason']}" in result.stderr.splitlines()


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        from safetensors.torch import load_file

        tensors.update(load_file(file))
    return tensors


def test_resume_continues_exactly(
    worlds: dict[str, dict[str, Path]], runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after step 5, resumed from the step-3 checkpoint: every later step and the final weights equal
    the uninterrupted run's, bit for bit (weights, optimizer state, schedule, RNG and data position restored)."""
    checkpoints = tmp_path / "resumed"
    world = worlds["llama"]
    monkeypatch.setenv(KILL_AT_STEP, "5")  # the training job SIGKILLs itself after step 5
    first = train(world, "llama", "neuron", checkpoints)
    assert first.returncode != 0
    monkeypatch.delenv(KILL_AT_STEP)
    second = train(world, "llama", "neuron", checkpoints, resume=True)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "resumed from step 3" in second.stderr
    assert (checkpoints / "step_3" / "rng" / "rank_00000.pt").is_file()  # NxD saves no RNG state; we do
    straight = {r["step"]: r for r in metrics(runs["llama-neuron"])}
    resumed = [r for r in metrics(checkpoints) if r["step"] > 3][-(STEPS - 3) :]
    assert [r["step"] for r in resumed] == list(range(4, STEPS + 1))
    for record in resumed:
        assert (record["loss"], record["grad_norm"]) == (
            straight[record["step"]]["loss"],
            straight[record["step"]]["grad_norm"],
        )
    for which in (runs["llama-neuron"], checkpoints):
        convert(ConvertOptions(source_format="nxd", target_format="hf", input=which, output=which / "hf"))
    expected, actual = hf_tensors(runs["llama-neuron"] / "hf"), hf_tensors(checkpoints / "hf")
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[name], actual[name]) for name in expected)


class _Payload:
    """Unpickling this runs a shell command: what a file planted on shared storage could hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def assert_refused_in_one_line(result: subprocess.CompletedProcess[str], planted: Path, marker: Path) -> None:
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: {planted}: refused to unpickle posix.system (it could run code); allowed: a torch.save file of "
        "tensors, numbers, strings, lists, tuples and dicts"
    ], result.stderr[-3000:]
    assert not marker.exists()


@pytest.mark.parametrize("part", ["model", "optim", "scheduler.pt", "user_content.pt"])
def test_a_planted_pickle_in_a_checkpoint_never_reaches_nxds_loader(
    part: str, worlds: dict[str, dict[str, Path]], runs: dict[str, Path], tmp_path: Path
) -> None:
    """NxD's `load_checkpoint` unpickles with weights_only=False: every file it would read for this rank is
    read the safe way first, so `--resume` stops with one line and the payload never runs."""
    checkpoints = tmp_path / "planted"
    shutil.copytree(runs["llama-neuron"], checkpoints)
    step = checkpoints / f"step_{STEPS}"
    planted = step / part if part.endswith(".pt") else next((step / part).glob("*.pt"))
    marker = tmp_path / "PWNED"
    torch.save({"state": _Payload(marker)}, planted)
    result = train(worlds["llama"], "llama", "neuron", checkpoints, resume=True)
    assert_refused_in_one_line(result, planted, marker)


@pytest.fixture(scope="module")
def xser_run(worlds: dict[str, dict[str, Path]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Llama run again, its checkpoints saved by NxD's xser format."""
    checkpoints = tmp_path_factory.mktemp("xser") / "checkpoints"
    result = train(worlds["llama"], "llama", "neuron", checkpoints, "checkpoint.xser=true")
    assert result.returncode == 0, result.stderr[-4000:]
    assert list((checkpoints / f"step_{STEPS}" / "model").glob("*.pt.tensors"))  # xser: one file per tensor
    return checkpoints


def test_a_planted_pickle_in_an_xser_tensor_file_never_reaches_nxds_loader(
    worlds: dict[str, dict[str, Path]], xser_run: Path, tmp_path: Path
) -> None:
    checkpoints = tmp_path / "planted"
    shutil.copytree(xser_run, checkpoints)
    tensors = next((checkpoints / f"step_{STEPS}" / "model").glob("*.pt.tensors"))
    planted = sorted(tensors.glob("*.pt"))[0]
    marker = tmp_path / "PWNED"
    torch.save(_Payload(marker), planted)
    result = train(worlds["llama"], "llama", "neuron", checkpoints, "checkpoint.xser=true", resume=True)
    assert_refused_in_one_line(result, planted, marker)


def test_xser_checkpoints_convert_like_plain_ones(runs: dict[str, Path], xser_run: Path) -> None:
    """`convert --from nxd` reads what training saved through neuronx-distributed, plain and xser alike."""
    checkpoints = xser_run
    plain = runs["llama-neuron"]
    for which in (plain, checkpoints):
        if not (which / "hf-final").exists():
            convert(ConvertOptions(source_format="nxd", target_format="hf", input=which, output=which / "hf-final"))
    expected, actual = hf_tensors(plain / "hf-final"), hf_tensors(checkpoints / "hf-final")
    assert expected.keys() == actual.keys() and all(torch.equal(expected[k], actual[k]) for k in expected)


@pytest.fixture
def neuron_backend() -> Iterator[None]:
    with one_rank_neuron_backend():
        yield


@pytest.mark.parametrize("xser", [False, True], ids=["plain", "xser"])
def test_neuronx_distributed_loads_what_convert_writes(
    xser: bool, worlds: dict[str, dict[str, Path]], neuron_backend: None, tmp_path: Path
) -> None:
    """NxD's own `load_checkpoint` reads `convert --to nxd` output into the model, bit-exact."""
    from neuronx_distributed.trainer import load_checkpoint

    from training.formats.hf import read_config
    from training.model.transformer import build_model

    world = worlds["llama"]
    output = tmp_path / "pretrained_weight"
    convert(ConvertOptions(source_format="hf", target_format="nxd", input=world["hf"], output=output, tp=1, xser=xser))
    config, _ = read_config(world["hf"], None)
    model = build_model(ModelConfig.from_hf(config), seed=None)
    load_checkpoint(str(output.parent), tag=output.name, model=model, strict=True)
    written = dict(lazy_tensors(open_checkpoint_file(output / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt")))
    loaded = {name: tensor.cpu() for name, tensor in model.state_dict().items()}
    assert written.keys() == loaded.keys()
    assert all(torch.equal(written[name].load(), loaded[name]) for name in written)


@pytest.mark.parametrize("architecture", ["llama", "mixtral"])
def test_placement_keeps_parallel_attributes_and_tied_weights(
    architecture: str, worlds: dict[str, dict[str, Path]], neuron_backend: None
) -> None:
    """On the XLA device every sharded parameter still carries NxD's tensor-parallel attributes (ZeRO-1's
    gradient norm reads them; the MoE experts included), and tied embedding and head are one tensor."""
    from training.formats.hf import read_config
    from training.formats.layouts import replicated_targets
    from training.model.transformer import build_model

    config, _ = read_config(worlds[architecture]["hf"], None)
    model = build_model(ModelConfig.from_hf({**config, "tie_word_embeddings": True}), seed=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.device.type == "xla"
    replicated = replicated_targets(model.spec, model.parallelism, "nxd")
    sharded = [name for name, _ in model.named_parameters() if name not in replicated]
    assert sharded and any("expert" in name for name in sharded) == (architecture == "mixtral")
    unmarked = [
        n for n, p in model.named_parameters() if n in sharded and not getattr(p, "tensor_model_parallel", False)
    ]
    assert unmarked == []


def test_a_run_for_trn1_is_refused_on_a_trn2_host(
    worlds: dict[str, dict[str, Path]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """NxD lays the K/V replicas out for the host's generation (here trn2, through NxD's override): a recipe
    for trn1 stops at start, with one line, before anything is launched."""
    from training.cli import main

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    world = worlds["llama"]
    arguments = ["train", "--recipe", "tiny-llama-cpt", f"model.config={world['hf']}", f"data.path={world['data']}"]
    arguments += [f"checkpoint.dir={tmp_path / 'ckpt'}", "parallelism.tp=4", "backend=neuron", "precision=fp32"]
    assert main(arguments) == 2
    error = capsys.readouterr().err.strip()
    assert error == (
        "error: generation: 'trn1' is not allowed; allowed: trn2, this host's Trainium generation "
        "(neuronx-distributed lays the K/V replicas out for it; a checkpoint moves to another generation through "
        "hf: `convert --to nxd --target`)"
    )
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    ("precision", "expected"), [("bf16-mixed", torch.float32), ("bf16-sr", torch.bfloat16)], ids=["mixed", "sr"]
)
def test_zero1_keeps_each_regimes_dtypes(
    precision: str, expected: torch.dtype, worlds: dict[str, dict[str, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """NxD's ZeRO-1 optimizer (torch-xla's underneath) on bf16 weights: fp32 master weight shards and AdamW state
    under bf16-mixed; bf16 ones under bf16-sr, where only stochastic rounding keeps the small updates."""
    from training.config.recipe import OptimizerSection, ScheduleSection
    from training.formats.hf import read_config
    from training.model import parallel
    from training.model.transformer import build_model
    from training.train.backend import training_backend
    from training.train.neuron_training import neuron_trainer_options
    from training.train.optimizer import TrainingOptimizer

    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    settings = OptimizerSection(lr=1e-3)
    parallel.initialize(1, "neuron", neuron_options=neuron_trainer_options(settings, precision=precision))  # type: ignore[arg-type]
    try:
        config, _ = read_config(worlds["llama"]["hf"], None)
        model = build_model(ModelConfig.from_hf(config), seed=0, dtype=torch.bfloat16)
        optimizer = TrainingOptimizer(
            model,
            settings,
            ScheduleSection(),
            10,
            backend=training_backend("neuron"),
            precision=precision,  # type: ignore[arg-type]
        )
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0)).to(parallel.device())
        model(ids, ids).loss.backward()
        optimizer.step()
        parallel.mark_step()
        zero1 = optimizer.inner.optimizer
        shards = [p for group in zero1.base_optimizer.param_groups for p in group["params"]]
        moments = [t for s in zero1.base_optimizer.state.values() for k, t in s.items() if k.startswith("exp_avg")]
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert shards and {p.dtype for p in shards} == {expected}
        assert len(moments) == 2 * len(shards) and {t.dtype for t in moments} == {expected}
    finally:
        parallel.destroy()


# The main environment's interpreter: the torch-native backend runs on the torch TorchNeuron is built for (2.13),
# not on this tier's NxD lock (torch 2.9). `make test` builds it before the tier runs.
ROOT = Path(__file__).resolve().parents[2]
MAIN_PYTHON = ROOT / ".venv" / "bin" / "python"
CONTINUED_STEPS = 3


def test_an_nxd_trained_checkpoint_continues_on_torch_native(
    worlds: dict[str, dict[str, Path]], runs: dict[str, Path], tmp_path: Path
) -> None:
    """The neuron backend's trained Llama (NxD's layers, optimizer and checkpoint) goes through Hugging Face to the
    torch-native backend, which continues it with the losses the cpu backend (the reference both backends equal)
    computes from the same weights."""
    world = worlds["llama"]
    hf = tmp_path / "hf"
    config = world["hf"] / "config.json"
    convert(
        ConvertOptions(source_format="nxd", target_format="hf", input=runs["llama-neuron"], output=hf, config=config)
    )
    pretrained = tmp_path / "pretrained"
    convert(ConvertOptions(source_format="hf", target_format="nxd", input=hf, output=pretrained, tp=1))
    continued: dict[str, list[dict[str, Any]]] = {}
    for backend in ("cpu", "torch-native"):
        checkpoints = tmp_path / backend
        overrides = [
            f"model.config={world['hf']}",
            f"model.pretrained={pretrained}",
            f"data.path={world['data']}",
            f"checkpoint.dir={checkpoints}",
            "parallelism.tp=1",
            "parallelism.pp=1",
            f"steps={CONTINUED_STEPS}",
            "batch.global=8",
            "batch.micro=2",
            "precision=fp32",
            f"backend={backend}",
        ]
        command = [str(MAIN_PYTHON), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
        command += ["-m", "training", "train", "--recipe", RECIPES["llama"], *overrides]
        # the main environment's own packages and this checkout, none of this tier's stand-ins
        environment = {**os.environ, "TORCH_NATIVE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=600, check=False, env=environment, cwd=ROOT
        )
        assert result.returncode == 0, result.stderr[-4000:]
        continued[backend] = metrics(checkpoints)
    first_trained = metrics(runs["llama-neuron"])[0]["loss"]
    assert continued["cpu"][0]["loss"] < first_trained  # it continues the trained model, not the pretrained one
    for expected, actual in zip(continued["cpu"], continued["torch-native"], strict=True):
        assert actual["loss"] == pytest.approx(expected["loss"], rel=TOLERANCE), (expected, actual)
        assert actual["grad_norm"] == pytest.approx(expected["grad_norm"], rel=TOLERANCE), (expected, actual)
