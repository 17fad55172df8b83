"""Recipes, batch plans and the learning-rate schedule: the pure parts of the training job."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from training.errors import UserError
from training.train.loader import BatchPlan
from training.train.optimizer import learning_rate
from training.train.recipe import RECIPES_DIR, ScheduleSection, load_recipe, recipe_as_dict


@pytest.mark.parametrize("name", sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
def test_bundled_recipes_load(name: str) -> None:
    recipe = load_recipe(name)
    assert recipe.name == name
    assert recipe_as_dict(recipe)["batch"]["global"] == recipe.batch.global_batch


def test_document_recipes_keep_the_documents_settings() -> None:
    llama = load_recipe("llama31-8b-cpt")
    assert (llama.parallelism.tp, llama.batch.global_batch, llama.batch.micro, llama.batch.seq_len) == (
        32,
        1024,
        1,
        8192,
    )
    assert (llama.optimizer.lr, llama.schedule.warmup_steps, llama.schedule.decay) == (1.5e-4, 100, "linear")
    assert (llama.optimizer.eps, llama.optimizer.weight_decay, llama.optimizer.grad_clip) == (1e-6, 0.01, 1.0)
    mixtral = load_recipe("mixtral-8x7b-sft")
    assert (mixtral.batch.seq_len, mixtral.batch.global_batch, mixtral.optimizer.lr) == (2048, 32, 1e-5)
    assert (mixtral.schedule.decay, mixtral.schedule.min_lr, mixtral.schedule.warmup_steps) == ("cosine", 1e-6, 10)


def test_overrides_are_parsed_as_yaml() -> None:
    recipe = load_recipe("tiny-llama-cpt", ["batch.micro=4", "optimizer.lr=1e-5", "model.pretrained=", "seed=7"])
    assert (recipe.batch.micro, recipe.optimizer.lr, recipe.model.pretrained, recipe.seed) == (4, 1e-5, None, 7)


def test_every_problem_is_reported_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(UserError) as caught:
        load_recipe("tiny-llama-cpt", ["optimizer.momentum=0.9", "backend=gpu", "steps=ten"])
    message = str(caught.value)
    assert "\n" not in message
    assert "optimizer.momentum: unknown key (allowed: lr, betas, eps, weight_decay, grad_clip, zero1)" in message
    assert "backend: 'gpu' is not allowed (allowed: cpu, neuron)" in message
    assert "steps: expected int, got 'ten'" in message
    missing = tmp_path / "r.yaml"
    missing.write_text("name: x\n")
    with pytest.raises(UserError, match="model: missing; data: missing"):
        load_recipe(str(missing))
    with pytest.raises(UserError, match="no such file or bundled recipe"):
        load_recipe("no-such-recipe")
    with pytest.raises(UserError, match=r"expected section\.key=value"):
        load_recipe("tiny-llama-cpt", ["steps"])


def test_micro_batch_must_divide_global_batch_over_data_parallel_ranks() -> None:
    with pytest.raises(UserError, match=r"batch.global 8 is not a multiple of batch.micro 2 x data-parallel ranks 3"):
        BatchPlan(8, 2, 3).check()
    with pytest.raises(UserError, match=r"batch.micro: 3 does not divide batch.global 8"):
        load_recipe("tiny-llama-cpt", ["batch.micro=3"])


def test_batch_plan_covers_each_global_batch_exactly_once_in_order() -> None:
    plan = BatchPlan(global_batch=12, micro=2, dp=3)
    assert plan.accumulation == 2
    for step in range(3):
        seen = [i for d in range(3) for m in range(2) for i in plan.sample_indices(step, d, m)]
        assert seen == list(range(12 * step, 12 * (step + 1)))


def test_schedule_warms_up_then_decays_to_min_lr() -> None:
    linear, cosine = ScheduleSection(100, "linear", 0.0), ScheduleSection(10, "cosine", 1e-6)
    assert learning_rate(1, 1.5e-4, linear, 1000) == pytest.approx(1.5e-6)  # the log line users know
    assert learning_rate(100, 1.5e-4, linear, 1000) == pytest.approx(1.5e-4)
    assert learning_rate(550, 1.5e-4, linear, 1000) == pytest.approx(0.75e-4)
    assert learning_rate(1000, 1.5e-4, linear, 1000) == pytest.approx(0.0)
    middle = 1e-6 + (1e-5 - 1e-6) * 0.5 * (1 + math.cos(math.pi * 0.5))
    assert learning_rate(55, 1e-5, cosine, 100) == pytest.approx(middle)
    assert learning_rate(100, 1e-5, cosine, 100) == pytest.approx(1e-6)
    assert learning_rate(5, 1e-5, ScheduleSection(0, "constant"), 100) == 1e-5
