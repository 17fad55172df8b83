"""`python -m training train` on the CPU backend, launched by torchrun as on the cluster: tiny recipes learn,
a killed run resumes to bit-identical weights and optimizer state, bad recipes stop with one line."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.training_runs import metrics, torchrun, world_overrides
from training.cli import main
from training.formats.convert import ConvertOptions, convert
from training.train.loader import TrainingData
from training.train.loop import KILL_AT_STEP

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)

LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ (DEBUG|INFO|WARNING|ERROR) ")  # training.logs


@pytest.mark.parametrize(
    ("recipe", "world_fixture"), [("tiny-llama-cpt", "llama_world"), ("tiny-mixtral-sft", "mixtral_world")]
)
def test_tiny_recipe_learns_at_tp2(
    recipe: str, world_fixture: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    world = request.getfixturevalue(world_fixture)
    result = torchrun(recipe, world_overrides(world, tmp_path / "ckpt"), processes=2)
    assert result.returncode == 0, result.stderr[-3000:]
    records = metrics(tmp_path / "ckpt")
    assert [r["step"] for r in records] == list(range(1, 21))
    losses = [r["loss"] for r in records]
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5, losses
    assert all(r["grad_norm"] > 0 and r["seq_per_second"] > 0 and 0 < r["mfu"] < 1 for r in records)
    # Logs go to stderr, every line with its rank; the summary (rank 0's last line) alone goes to stdout.
    logged = [line for line in result.stderr.splitlines() if LOG_LINE.match(line)]
    assert logged and all(re.search(r" \[rank [01]/2\] ", line) for line in logged), result.stderr[-3000:]
    steps = [line for line in logged if "step_loss : " in line]
    assert len(steps) == 20 and all(" INFO [rank 0/2] (step " in line for line in steps), steps
    assert "learning_rate : " in steps[-1] and steps[-1].endswith(" seq/s")
    assert json.loads(result.stdout.splitlines()[-1])["steps"] == 20
    # The final checkpoint is a complete nxd checkpoint the converter turns back into a transformers model.
    assert (tmp_path / "ckpt" / "step_20" / "done").is_file()
    convert(ConvertOptions(source_format="nxd", target_format="hf", input=tmp_path / "ckpt", output=tmp_path / "hf"))
    AutoModelForCausalLM.from_pretrained(tmp_path / "hf")


def test_first_step_loss_is_the_transformers_loss_of_the_pretrained_weights(
    llama_world: dict[str, Path], tmp_path: Path
) -> None:
    """Proves the pretrained weights are loaded and the labels shifted as transformers shifts them."""
    result = torchrun("tiny-llama-cpt", world_overrides(llama_world, tmp_path / "ckpt", "steps=2"), processes=2)
    assert result.returncode == 0, result.stderr[-3000:]
    logged = metrics(tmp_path / "ckpt")[0]["loss"]
    reference = AutoModelForCausalLM.from_pretrained(llama_world["hf"])
    data = TrainingData(llama_world["data"], "train", 64, shuffle_seed=42)  # the recipe's seed
    losses = []
    for start in range(0, 8, 2):  # global batch 8 in micro batches of 2, as the recipe runs it
        input_ids, _ = data.batch(range(start, start + 2))
        with torch.no_grad():
            losses.append(float(reference(input_ids, labels=input_ids).loss))
    assert logged == pytest.approx(sum(losses) / len(losses), rel=1e-5)


def test_shuffled_order_is_a_new_permutation_each_epoch_and_a_pure_function_of_the_sample(
    llama_world: dict[str, Path],
) -> None:
    """Resume stays bit-identical because the block of sample k depends on k alone, yet epochs differ."""
    data = TrainingData(llama_world["data"], "train", 64, shuffle_seed=42)
    n = len(data)
    epochs = [[data.row(k) for k in range(e * n, (e + 1) * n)] for e in range(3)]
    assert all(sorted(order) == list(range(n)) for order in epochs)
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(n))
    fresh = TrainingData(llama_world["data"], "train", 64, shuffle_seed=42)
    assert [fresh.row(k) for k in reversed(range(3 * n))] == [r for order in epochs for r in order][::-1]
    other_seed = TrainingData(llama_world["data"], "train", 64, shuffle_seed=7)
    assert [other_seed.row(k) for k in range(n)] != epochs[0]
    in_order = TrainingData(llama_world["data"], "train", 64)
    assert [in_order.row(k) for k in range(2 * n)] == list(range(n)) * 2


def test_validation_loss_is_the_language_model_loss_on_the_validation_blocks(
    mixtral_world: dict[str, Path], tmp_path: Path
) -> None:
    """Logged every `validation_every` steps and at the end, with the step's record; at the last step it equals
    transformers' loss of the final weights on the same validation blocks (no router loss in it)."""
    from training.data.sft import SftOptions, prepare_sft

    data = tmp_path / "data"
    source, tokenizer = str(mixtral_world["source"]), str(mixtral_world["tokenizer"])
    prepare_sft(SftOptions(source=source, tokenizer=tokenizer, seq_len=64, out=data, validation=source))
    extra = ("steps=5", f"data.path={data}", "data.validation_split=validation", "data.validation_every=2")
    overrides = [*world_overrides(mixtral_world, tmp_path / "ckpt"), *extra]
    overrides.remove(f"data.path={mixtral_world['data']}")
    result = torchrun("tiny-mixtral-sft", overrides, processes=2)
    assert result.returncode == 0, result.stderr[-3000:]
    records = metrics(tmp_path / "ckpt")
    assert [r["step"] for r in records if "validation_loss" in r] == [2, 4, 5]
    convert(ConvertOptions(source_format="nxd", target_format="hf", input=tmp_path / "ckpt", output=tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    validation = TrainingData(data, "validation", 64)
    losses = []
    for batch in range(4):  # data.validation_batches micro batches of 2 on the one data-parallel rank
        input_ids, targets = validation.batch(range(batch * 2, batch * 2 + 2))
        labels = torch.cat([input_ids[:, :1], targets[:, :-1]], dim=1)  # back to transformers' aligned labels
        with torch.no_grad():
            losses.append(float(model(input_ids, labels=labels).loss))
    assert records[-1]["validation_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-4)


def tensors_of(step_dir: Path) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for file in sorted((step_dir / "model").glob("*.pt")) + sorted((step_dir / "optim").glob("*.pt")):
        flat = _flatten(torch.load(file, weights_only=True), f"{file.parent.name}/{file.name}")
        found.update(flat)
    return found


def _flatten(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}"))
        return out
    if isinstance(value, list | tuple):
        out = {}
        for index, item in enumerate(value):
            out.update(_flatten(item, f"{prefix}.{index}"))
        return out
    return {prefix: value}


@pytest.mark.parametrize(
    ("tp", "processes", "settings"),
    [
        (2, 2, []),
        (1, 2, []),
        # the memory settings and bf16 regimes of the real recipes, at toy size
        (2, 2, ["precision=bf16-sr", "parallelism.sequence_parallel=true", "memory.activation_checkpointing=full"]),
        (1, 2, ["precision=bf16-mixed", "memory.activation_checkpointing=selective", "memory.flash_attention=true"]),
        (1, 2, ["parallelism.pp=2"]),  # two pipeline stages
    ],
    ids=["tp2", "tp1-dp2-zero1", "tp2-sp-full-bf16-sr", "tp1-dp2-zero1-selective-flash-bf16-mixed", "pp2"],
)
def test_killed_run_resumes_to_identical_weights_and_optimizer_state(
    tp: int, processes: int, settings: list[str], llama_world: dict[str, Path], tmp_path: Path
) -> None:
    pretrained = llama_world["pretrained"]
    pp = 2 if "parallelism.pp=2" in settings else 1
    if (tp, pp) != (2, 1):
        pretrained = tmp_path / f"pretrained-tp{tp}-pp{pp}"
        options = ConvertOptions(
            source_format="hf", target_format="nxd", input=llama_world["hf"], output=pretrained, tp=tp, pp=pp
        )
        convert(options)
    common = [f"parallelism.tp={tp}", "steps=6", "checkpoint.every=3", f"model.pretrained={pretrained}", *settings]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    result = torchrun("tiny-llama-cpt", world_overrides(llama_world, straight, *common), processes=processes)
    assert result.returncode == 0, result.stderr[-3000:]

    killed = torchrun(
        "tiny-llama-cpt", world_overrides(llama_world, resumed, *common), processes=processes, env={KILL_AT_STEP: "5"}
    )
    assert killed.returncode != 0
    assert (resumed / "step_3" / "done").is_file() and not (resumed / "step_6").exists()
    # A checkpoint interrupted before its `done` marker (a copy of step 3 without it) must be ignored.
    shutil.copytree(resumed / "step_3", resumed / "step_5")
    (resumed / "step_5" / "done").unlink()

    again = torchrun("tiny-llama-cpt", world_overrides(llama_world, resumed, *common), processes=processes, resume=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from step 3" in again.stderr
    expected, actual = tensors_of(straight / "step_6"), tensors_of(resumed / "step_6")
    assert expected.keys() == actual.keys() and len(expected) > 10
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, actual[key]), key
        else:
            assert value == actual[key], key
    assert [r["loss"] for r in metrics(straight)][3:] == [r["loss"] for r in metrics(resumed)][-3:]


def test_compile_mode_runs_two_steps_and_saves_nothing(llama_world: dict[str, Path], tmp_path: Path) -> None:
    command = [sys.executable, "-m", "training", "train", "--recipe", "tiny-llama-cpt", "--compile"]
    # tp 1 from random weights (`model.pretrained=` unsets it): a single process, no torchrun.
    overrides = world_overrides(llama_world, tmp_path / "ckpt", "parallelism.tp=1", "model.pretrained=")
    result = subprocess.run(command + overrides, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [
        json.loads(line)["step"] for line in (tmp_path / "ckpt" / "metrics-compile.jsonl").read_text().splitlines()
    ] == [1, 2]
    assert not list((tmp_path / "ckpt").glob("step_*"))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("parallelism.tp=3", "parallelism.tp 3: "),
        ("data.path=/nonexistent/data", "data.path /nonexistent/data: no such directory"),
        ("batch.micro=3", "batch.micro: 3 is not allowed; allowed: a divisor of batch.global 8 (1, 2, 4, 8)"),
        ("batch.seq_len=128", "batch.seq_len 128 differs from the data's seq_len 64"),
        ("optimizer.betas=0.9", "optimizer.betas: 0.9 is not allowed; allowed: a list of 2 numbers"),
        ("batch.global=6", "parallelism.tp 2 does not divide the 1 launched processes"),
    ],
)
def test_bad_recipe_fails_at_start_with_one_line(
    override: str, message: str, llama_world: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["train", "--recipe", "tiny-llama-cpt", *world_overrides(llama_world, tmp_path / "ckpt"), override]
    assert main(args) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and error.startswith("error: ") and message in error, error
    assert not (tmp_path / "ckpt").exists()


def test_capacity_dispatch_logs_the_dropped_fraction(mixtral_world: dict[str, Path], tmp_path: Path) -> None:
    """A capacity factor below what the router needs drops choices, and the metrics say how many; one that
    fits every choice drops none."""
    fractions = {}
    for factor in (0.5, 2.0):
        checkpoints = tmp_path / f"cf-{factor}"
        overrides = world_overrides(mixtral_world, checkpoints, "steps=3", f"moe.capacity_factor={factor}")
        result = torchrun("tiny-mixtral-sft", overrides, processes=2)
        assert result.returncode == 0, result.stderr[-3000:]
        fractions[factor] = [record["moe_dropped"] for record in metrics(checkpoints)]
    assert all(0 < fraction < 1 for fraction in fractions[0.5]), fractions
    assert fractions[2.0] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("recipe", "world_fixture", "tp"),
    [
        ("tiny-llama-cpt", "llama_world", 1),
        ("tiny-llama-cpt", "llama_world", 2),
        ("tiny-mixtral-sft", "mixtral_world", 2),
    ],
    ids=["llama-tp1", "llama-tp2", "mixtral-tp2"],
)
def test_two_pipeline_stages_train_as_one(
    recipe: str, world_fixture: str, tp: int, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """PP 2 (1F1B over 4 micro batches a step) against PP 1: the same loss and gradient norm every step, and
    the same weights after, converted back from each run's stage files by `convert --from nxd`."""
    world = request.getfixturevalue(world_fixture)
    runs = {}
    for pp in (1, 2):
        pretrained = tmp_path / f"pretrained-pp{pp}"
        convert(
            ConvertOptions(source_format="hf", target_format="nxd", input=world["hf"], output=pretrained, tp=tp, pp=pp)
        )
        checkpoints = tmp_path / f"pp{pp}"
        overrides = world_overrides(world, checkpoints, f"parallelism.tp={tp}", f"parallelism.pp={pp}", "steps=4")
        result = torchrun(recipe, [*overrides, f"model.pretrained={pretrained}"], processes=tp * pp)
        assert result.returncode == 0, result.stderr[-3000:]
        convert(ConvertOptions(source_format="nxd", target_format="hf", input=checkpoints, output=tmp_path / f"hf{pp}"))
        runs[pp] = metrics(checkpoints)
    for single, staged in zip(runs[1], runs[2], strict=True):
        assert staged["loss"] == pytest.approx(single["loss"], rel=1e-5), (single, staged)
        assert staged["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-4), (single, staged)
    expected, actual = (AutoModelForCausalLM.from_pretrained(tmp_path / f"hf{pp}").state_dict() for pp in (1, 2))
    assert expected.keys() == actual.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=1e-4, atol=1e-6, msg=name)
