"""Numeric settings are range-checked where they are read: a recipe (file or `key=value` override) or a site
file with a value no run could use is refused before anything starts, with one line naming the key and what
is allowed; a split of the data that does not exist is refused when the data is opened."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.repository import ROOT
from training.config.loading import ConfigError
from training.config.recipe import RECIPES_DIR, load_recipe
from training.config.site import load_site
from training.errors import UserError

LABEL = RECIPES_DIR / "tiny-llama-cpt.yaml"
FINITE_ABOVE_0 = "a finite number above 0"
FINITE_0_OR_MORE = "a finite number, 0 or more"
BETA = "a number from 0 up to, not including, 1"
SEED = "0 to 4294967295"

# (overrides of tiny-llama-cpt, the one problem line after the file name)
RECIPE_CASES: dict[str, tuple[list[str], str]] = {
    "lr NaN": (["optimizer.lr=.nan"], f"optimizer.lr: nan is not allowed; allowed: {FINITE_ABOVE_0}"),
    "lr NaN, other spelling": (["optimizer.lr=.NaN"], f"optimizer.lr: nan is not allowed; allowed: {FINITE_ABOVE_0}"),
    "lr NaN as a word": (["optimizer.lr=nan"], f"optimizer.lr: nan is not allowed; allowed: {FINITE_ABOVE_0}"),
    "lr infinite": (["optimizer.lr=.inf"], f"optimizer.lr: inf is not allowed; allowed: {FINITE_ABOVE_0}"),
    "lr overflowing to infinity": (
        ["optimizer.lr=1e999"],
        f"optimizer.lr: inf is not allowed; allowed: {FINITE_ABOVE_0}",
    ),
    "lr minus infinity": (["optimizer.lr=-.inf"], f"optimizer.lr: -inf is not allowed; allowed: {FINITE_ABOVE_0}"),
    "lr zero": (["optimizer.lr=0.0"], f"optimizer.lr: 0.0 is not allowed; allowed: {FINITE_ABOVE_0}"),
    "lr underflowing to zero": (
        ["optimizer.lr=1e-400"],
        f"optimizer.lr: 0.0 is not allowed; allowed: {FINITE_ABOVE_0}",
    ),
    "min_lr NaN": (["schedule.min_lr=.nan"], f"schedule.min_lr: nan is not allowed; allowed: {FINITE_0_OR_MORE}"),
    "min_lr infinite": (["schedule.min_lr=.inf"], f"schedule.min_lr: inf is not allowed; allowed: {FINITE_0_OR_MORE}"),
    "min_lr negative": (
        ["schedule.min_lr=-1.0e-5"],
        f"schedule.min_lr: -1e-05 is not allowed; allowed: {FINITE_0_OR_MORE}",
    ),
    "min_lr above lr": (
        ["schedule.min_lr=0.01"],
        "schedule.min_lr: 0.01 is not allowed; allowed: at most optimizer.lr (0.003)",
    ),
    "beta1 of 1": (["optimizer.betas=[1.0, 0.999]"], f"optimizer.betas[0]: 1.0 is not allowed; allowed: {BETA}"),
    "beta2 above 1": (["optimizer.betas=[0.9, 1.5]"], f"optimizer.betas[1]: 1.5 is not allowed; allowed: {BETA}"),
    "beta negative": (["optimizer.betas=[-0.1, 0.999]"], f"optimizer.betas[0]: -0.1 is not allowed; allowed: {BETA}"),
    "beta NaN": (["optimizer.betas=[0.9, .nan]"], f"optimizer.betas[1]: nan is not allowed; allowed: {BETA}"),
    "eps zero": (["optimizer.eps=0.0"], f"optimizer.eps: 0.0 is not allowed; allowed: {FINITE_ABOVE_0}"),
    "eps infinite": (["optimizer.eps=.inf"], f"optimizer.eps: inf is not allowed; allowed: {FINITE_ABOVE_0}"),
    "weight decay negative": (
        ["optimizer.weight_decay=-0.1"],
        f"optimizer.weight_decay: -0.1 is not allowed; allowed: {FINITE_0_OR_MORE}",
    ),
    "weight decay NaN": (
        ["optimizer.weight_decay=.nan"],
        f"optimizer.weight_decay: nan is not allowed; allowed: {FINITE_0_OR_MORE}",
    ),
    "grad clip negative": (
        ["optimizer.grad_clip=-1.0"],
        f"optimizer.grad_clip: -1.0 is not allowed; allowed: {FINITE_0_OR_MORE}",
    ),
    "grad clip infinite": (
        ["optimizer.grad_clip=.inf"],
        f"optimizer.grad_clip: inf is not allowed; allowed: {FINITE_0_OR_MORE}",
    ),
    "capacity factor zero": (
        ["moe.capacity_factor=0.0"],
        f"moe.capacity_factor: 0.0 is not allowed; allowed: {FINITE_ABOVE_0} (or omit it)",
    ),
    "capacity factor NaN": (
        ["moe.capacity_factor=.nan"],
        f"moe.capacity_factor: nan is not allowed; allowed: {FINITE_ABOVE_0} (or omit it)",
    ),
    "capacity factor infinite": (
        ["moe.capacity_factor=.inf"],
        f"moe.capacity_factor: inf is not allowed; allowed: {FINITE_ABOVE_0} (or omit it)",
    ),
    "peak TFLOPS infinite": (
        ["peak_tflops_per_worker=.inf"],
        f"peak_tflops_per_worker: inf is not allowed; allowed: {FINITE_ABOVE_0}",
    ),
    "tp zero": (["parallelism.tp=0"], "parallelism.tp: 0 is not allowed; allowed: an integer above 0"),
    "pp negative": (["parallelism.pp=-2"], "parallelism.pp: -2 is not allowed; allowed: an integer above 0"),
    "kv multiplier zero": (
        ["parallelism.kv_size_multiplier=0"],
        "parallelism.kv_size_multiplier: 0 is not allowed; allowed: an integer above 0 (or omit it)",
    ),
    "nodes zero": (["nodes=0"], "nodes: 0 is not allowed; allowed: an integer above 0"),
    "steps negative": (["steps=-5"], "steps: -5 is not allowed; allowed: an integer above 0"),
    "steps NaN": (["steps=.nan"], "steps: nan is not allowed; allowed: an integer"),
    "warmup negative": (["schedule.warmup_steps=-1"], "schedule.warmup_steps: -1 is not allowed; allowed: 0 or more"),
    "global batch zero": (["batch.global=0"], "batch.global: 0 is not allowed; allowed: 1 to 1048576 sequences"),
    "global batch absurd": (
        ["batch.global=1000000000000", "batch.micro=7"],
        "batch.global: 1000000000000 is not allowed; allowed: 1 to 1048576 sequences",
    ),
    "micro batch zero": (["batch.micro=0"], "batch.micro: 0 is not allowed; allowed: an integer above 0"),
    "seq_len one": (["batch.seq_len=1"], "batch.seq_len: 1 is not allowed; allowed: 2 to 1048576 tokens"),
    "seq_len absurd": (
        ["batch.seq_len=1048577"],
        "batch.seq_len: 1048577 is not allowed; allowed: 2 to 1048576 tokens",
    ),
    "checkpoint every negative": (["checkpoint.every=-10"], "checkpoint.every: -10 is not allowed; allowed: 0 or more"),
    "keep_last zero": (
        ["checkpoint.keep_last=0"],
        "checkpoint.keep_last: 0 is not allowed; allowed: an integer above 0",
    ),
    "validation batches zero": (
        ["data.validation_batches=0"],
        "data.validation_batches: 0 is not allowed; allowed: an integer above 0",
    ),
    "validation every negative": (
        ["data.validation_every=-1"],
        "data.validation_every: -1 is not allowed; allowed: 0 or more",
    ),
    "log_every zero": (["log_every=0"], "log_every: 0 is not allowed; allowed: an integer above 0"),
    "seed negative": (["seed=-1"], f"seed: -1 is not allowed; allowed: {SEED}"),
    "seed beyond 32 bits": (["seed=4294967296"], f"seed: 4294967296 is not allowed; allowed: {SEED}"),
    "sample seed negative": (["sample.seed=-1"], f"sample.seed: -1 is not allowed; allowed: {SEED}"),
    "max_records zero": (
        ["prepare.max_records=0"],
        "prepare.max_records: 0 is not allowed; allowed: an integer above 0 (or omit it)",
    ),
    "max_new_tokens zero": (
        ["sample.max_new_tokens=0"],
        "sample.max_new_tokens: 0 is not allowed; allowed: an integer above 0",
    ),
    "top_k zero": (["sample.top_k=0"], "sample.top_k: 0 is not allowed; allowed: an integer above 0"),
}


@pytest.mark.parametrize("case", list(RECIPE_CASES))
def test_a_recipe_value_out_of_range_is_one_line(case: str) -> None:
    overrides, problem = RECIPE_CASES[case]
    with pytest.raises(ConfigError) as raised:
        load_recipe("tiny-llama-cpt", overrides)
    assert raised.value.problems == [f"{LABEL}: {problem}"]


def test_out_of_range_values_in_a_recipe_file_are_all_reported(tmp_path: Path) -> None:
    text = (RECIPES_DIR / "tiny-llama-cpt.yaml").read_text()
    text = text.replace("lr: 3.0e-3", "lr: .nan").replace("grad_clip: 1.0", "grad_clip: -.inf")
    path = tmp_path / "recipe.yaml"
    path.write_text(text + "seed: -7\n")
    with pytest.raises(ConfigError) as raised:
        load_recipe(str(path))
    assert raised.value.problems == [
        f"{path}: optimizer.lr: nan is not allowed; allowed: {FINITE_ABOVE_0}",
        f"{path}: optimizer.grad_clip: -inf is not allowed; allowed: {FINITE_0_OR_MORE}",
        f"{path}: seed: -7 is not allowed; allowed: {SEED}",
    ]


def test_the_edges_of_every_range_are_allowed() -> None:
    recipe = load_recipe(
        "tiny-llama-cpt",
        [
            "optimizer.betas=[0.0, 0.999999]",
            "optimizer.weight_decay=0",
            "optimizer.grad_clip=0",
            "schedule.min_lr=0.003",  # equal to optimizer.lr
            "seed=4294967295",
            "sample.seed=0",
            "batch.seq_len=2",
            "batch.global=1048576",
            "batch.micro=1",
            "checkpoint.every=0",
            "moe.capacity_factor=1e-3",
        ],
    )
    assert recipe.optimizer.betas == (0.0, 0.999999) and recipe.schedule.min_lr == recipe.optimizer.lr
    assert (recipe.seed, recipe.batch.seq_len, recipe.batch.global_batch) == (4294967295, 2, 1048576)


@pytest.mark.parametrize("value", [".nan", ".inf"])
def test_the_cli_refuses_a_non_finite_learning_rate_with_one_error_line(value: str) -> None:
    """`python -m training train optimizer.lr=.nan` stops before any process group: one line, exit 2."""
    result = subprocess.run(
        [sys.executable, "-m", "training", "train", "--recipe", "tiny-llama-cpt", f"optimizer.lr={value}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {LABEL}: optimizer.lr: "), result.stderr
    assert lines[0].endswith(f"is not allowed; allowed: {FINITE_ABOVE_0}")


# --- site file ----------------------------------------------------------------------------------------------

SITE_CASES: dict[str, tuple[dict[str, object], str]] = {
    "negative time limit": (
        {"time_minutes": -1},
        "time_minutes: -1 is not allowed; allowed: 0 (no limit) to 35791394 minutes",
    ),
    "time limit beyond Slurm's 32-bit seconds": (
        {"time_minutes": 35791395},
        "time_minutes: 35791395 is not allowed; allowed: 0 (no limit) to 35791394 minutes",
    ),
    "negative restarts": ({"max_restarts": -1}, "max_restarts: -1 is not allowed; allowed: 0 to 65535"),
    "restarts beyond Slurm's 16-bit count": (
        {"max_restarts": 65536},
        "max_restarts: 65536 is not allowed; allowed: 0 to 65535",
    ),
    "no processes per node": (
        {"processes_per_node": 0},
        "processes_per_node: 0 is not allowed; allowed: an integer above 0 (or omit it)",
    ),
    "time limit as text": ({"time_minutes": "1:00:00"}, "time_minutes: '1:00:00' is not allowed; allowed: an integer"),
}


@pytest.mark.parametrize("case", list(SITE_CASES))
def test_a_site_value_out_of_range_is_one_line(case: str, tmp_path: Path) -> None:
    settings, problem = SITE_CASES[case]
    path = tmp_path / "site.yaml"
    path.write_text(json.dumps(settings))
    with pytest.raises(ConfigError) as raised:
        load_site(path)
    assert raised.value.problems == [f"{path}: {problem}"]


def test_the_site_limits_themselves_are_allowed(tmp_path: Path) -> None:
    path = tmp_path / "site.yaml"
    path.write_text(json.dumps({"time_minutes": 35791394, "max_restarts": 65535}))
    site = load_site(path)
    assert (site.time_minutes, site.max_restarts) == (35791394, 65535)
    path.write_text(json.dumps({"time_minutes": 0, "max_restarts": 0}))
    assert (load_site(path).time_minutes, load_site(path).max_restarts) == (0, 0)


# --- the data's splits --------------------------------------------------------------------------------------


def prepared(path: Path, kind: str, splits: tuple[str, ...] | None) -> Path:
    """A minimal `prepare` output: a manifest and blocks of 4 tokens, one dataset (pretrain) or named splits."""
    import datasets

    from training.outputs import MANIFEST

    blocks = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 4], [5, 6, 7, 8]]})
    data = blocks if splits is None else datasets.DatasetDict({split: blocks for split in splits})
    data.save_to_disk(str(path))
    (path / MANIFEST).write_text(json.dumps({"kind": kind, "seq_len": 4}))
    return path


def test_a_validation_split_that_pretraining_data_lacks_is_refused(tmp_path: Path) -> None:
    """Pretraining data is one dataset (its training blocks); validating on it would look like generalisation."""
    from training.train.loader import TrainingData

    data = prepared(tmp_path / "data", "pretrain", None)
    assert len(TrainingData(data, "train", 4)) == 2
    with pytest.raises(UserError) as raised:
        TrainingData(data, "validation", 4)
    assert str(raised.value) == (
        f"data.split: 'validation' is not allowed; allowed: a split that data.path {data} has: train"
    )
    with pytest.raises(UserError) as raised:
        TrainingData(data, "validation", 4, key="data.validation_split")
    assert str(raised.value).startswith("data.validation_split: 'validation' is not allowed; allowed: a split")


def test_a_split_missing_from_sft_data_names_the_splits_there(tmp_path: Path) -> None:
    from training.train.loader import TrainingData

    data = prepared(tmp_path / "data", "sft", ("train", "validation"))
    assert len(TrainingData(data, "validation", 4)) == 2
    with pytest.raises(UserError) as raised:
        TrainingData(data, "test", 4, key="data.validation_split")
    assert str(raised.value) == (
        f"data.validation_split: 'test' is not allowed; allowed: a split that data.path {data} has: train, validation"
    )
