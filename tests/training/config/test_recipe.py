"""Recipes, batch plans and the learning-rate schedule: the pure parts of the training job."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from training.config.recipe import (
    RECIPES_DIR,
    ScheduleSection,
    load_recipe,
    recipe_as_dict,
    sparse_dispatch_compiled,
)
from training.errors import UserError
from training.train.batches import BatchPlan
from training.train.optimizer import learning_rate


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
    # the document's fork: test_mixtral.sh's weight decay 0.1 and betas, bf16 with stochastic rounding,
    # full activation checkpointing, gradient clipping at 1.0
    assert (mixtral.optimizer.weight_decay, mixtral.optimizer.betas, mixtral.optimizer.grad_clip) == (
        0.1,
        (0.9, 0.95),
        1.0,
    )
    assert (mixtral.precision, mixtral.memory.activation_checkpointing) == ("bf16-sr", "full")


def test_overrides_are_parsed_as_yaml() -> None:
    recipe = load_recipe("tiny-llama-cpt", ["batch.micro=4", "optimizer.lr=1e-5", "model.pretrained=", "seed=7"])
    assert (recipe.batch.micro, recipe.optimizer.lr, recipe.model.pretrained, recipe.seed) == (4, 1e-5, None, 7)


def test_every_problem_is_reported_at_once_one_line_each(tmp_path: Path) -> None:
    with pytest.raises(UserError) as caught:
        load_recipe("tiny-llama-cpt", ["optimizer.momentum=0.9", "backend=gpu", "steps=ten"])
    label = str(RECIPES_DIR / "tiny-llama-cpt.yaml")
    assert str(caught.value).splitlines() == [
        f"{label}: optimizer.momentum: unknown key; allowed keys here: lr, betas, eps, weight_decay, grad_clip, zero1",
        f"{label}: steps: 'ten' is not allowed; allowed: an integer",
        f"{label}: backend: 'gpu' is not allowed; allowed: cpu, neuron, torch-native",
    ]
    missing = tmp_path / "r.yaml"
    missing.write_text("name: x\n")
    with pytest.raises(UserError) as caught:
        load_recipe(str(missing))
    assert [line.split(": ", 1)[1] for line in str(caught.value).splitlines()] == [
        f"{key}: required key is missing" for key in ("model", "data", "batch", "optimizer", "checkpoint", "steps")
    ]
    with pytest.raises(
        UserError, match=r"--recipe: 'no-such-recipe' is not allowed; allowed: a recipe file or a bundled"
    ):
        load_recipe("no-such-recipe")
    with pytest.raises(UserError, match=r"override: 'steps' is not allowed; allowed: section\.key=value"):
        load_recipe("tiny-llama-cpt", ["steps"])


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (["steps=0"], "steps: 0 is not allowed; allowed: an integer above 0"),
        (["optimizer.lr=-1.0e-4"], "optimizer.lr: -0.0001 is not allowed; allowed: a finite number above 0"),
        (["optimizer.betas=[0.9]"], "optimizer.betas: [0.9] is not allowed; allowed: a list of 2 numbers"),
        (["sample.prompts=[1]"], "sample.prompts[0]: 1 is not allowed; allowed: a string"),
        (["parallelism.tp=true"], "parallelism.tp: True is not allowed; allowed: an integer"),
        (["checkpoint.keep_last=0"], "checkpoint.keep_last: 0 is not allowed; allowed: an integer above 0"),
        (["schedule.warmup_steps=30"], "schedule.warmup_steps: 30 is not allowed; allowed: 0 to steps (20)"),
        (["schedule.min_lr=1"], "schedule.min_lr: 1.0 is not allowed; allowed: at most optimizer.lr (0.003)"),
        (
            ["data.validation_every=10"],
            "data.validation_every: 10 is not allowed; allowed: 0, or set data.validation_split as well",
        ),
        (["precision=bf16"], "precision: 'bf16' is not allowed; allowed: fp32, bf16-mixed, bf16-sr"),
        (
            ["precision=bf16-mixed", "optimizer.zero1=false"],
            "precision: 'bf16-mixed' is not allowed; allowed: bf16-sr or fp32 with optimizer.zero1 false "
            "(bf16-mixed keeps its fp32 master weights in ZeRO-1's shards)",
        ),
        (
            ["parallelism.sequence_parallel=true", "batch.seq_len=63"],
            "batch.seq_len: 63 is not allowed; allowed: a multiple of parallelism.tp (2) with "
            "parallelism.sequence_parallel",
        ),
        (
            ["backend=neuron", "memory.flash_attention=true"],
            "batch.seq_len: 64 is not allowed; allowed: a multiple of 2048 with memory.flash_attention on backend "
            "neuron (the NKI kernel's tile)",
        ),
        (
            ["memory.activation_checkpointing=some"],
            "memory.activation_checkpointing: 'some' is not allowed; allowed: none, selective, full",
        ),
        (
            ["torch_native.compile=true"],
            "torch_native.compile: True is not allowed; allowed: false on backend cpu (torch.compile of the decoder "
            "layers is backend torch-native's)",
        ),
        (["model=3"], "model: 3 is not allowed; allowed: a mapping of keys"),
        (["generation=trn3"], "generation: 'trn3' is not allowed; allowed: trn1, trn2"),
        (["generations=[1]"], "generations: [1] is not allowed; allowed: a mapping of generation to settings"),
        (
            ["generations.trn9={nodes: 1}"],
            "generations.trn9: {'nodes': 1} is not allowed; allowed: a mapping of trn1 or trn2 to settings",
        ),
    ],
)
def test_each_recipe_rule_rejects_with_one_line(overrides: list[str], problem: str) -> None:
    with pytest.raises(UserError) as caught:
        load_recipe("tiny-llama-cpt", overrides)
    assert str(caught.value) == f"{RECIPES_DIR / 'tiny-llama-cpt.yaml'}: {problem}"


def test_a_compiled_run_asks_for_a_static_moe_dispatch() -> None:
    """The rule the recipe alone cannot check (its model's experts): the torch-native backend refuses it as the
    model is built (tests/training/train/test_native.py runs it), in this line."""
    recipe = load_recipe("tiny-mixtral-sft", ["backend=torch-native", "torch_native.compile=true"])
    assert recipe.torch_native.compile and recipe.moe.capacity_factor is None  # the recipe alone passes
    assert sparse_dispatch_compiled() == (
        "torch_native.compile: True is not allowed; allowed: false with a Mixtral model's sparse MoE dispatch "
        "(dynamic shapes: each expert's token count changes every step), or set moe.capacity_factor (the capacity "
        "dispatch: static shapes)"
    )


COMPILER_FLAG = (
    "one compiler flag starting with '-', its value joined with '=' (e.g. --model-type=transformer), without "
    "whitespace, quotes or backslashes; not --cache_dir, --target or --lnc (the site's compile_cache, the "
    "generation and the instance type set them)"
)


def test_the_document_recipes_carry_nxds_neuron_settings_per_model() -> None:
    llama, mixtral = load_recipe("llama31-8b-cpt").neuron, load_recipe("mixtral-8x7b-sft").neuron
    assert (llama.compiler_flags, llama.inflight_requests, llama.retry_failed_compilation) == (
        ("--model-type=transformer",),
        3,
        True,
    )
    assert (mixtral.compiler_flags, mixtral.inflight_requests, mixtral.retry_failed_compilation) == (
        ("--model-type=transformer", "--enable-saturate-infinity"),
        7,
        True,
    )
    # A recipe without the section gets NxD's Llama values, retry on.
    assert load_recipe("tiny-llama-cpt").neuron == llama


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (
            '["--cache_dir=/tmp/cache"]',
            f"neuron.compiler_flags[0]: '--cache_dir=/tmp/cache' is not allowed; allowed: {COMPILER_FLAG}",
        ),
        (
            '["-O1", "--cache-dir=/x"]',
            f"neuron.compiler_flags[1]: '--cache-dir=/x' is not allowed; allowed: {COMPILER_FLAG}",
        ),
        (
            '["--target=trn2"]',
            f"neuron.compiler_flags[0]: '--target=trn2' is not allowed; allowed: {COMPILER_FLAG}",
        ),
        ('["--lnc=1"]', f"neuron.compiler_flags[0]: '--lnc=1' is not allowed; allowed: {COMPILER_FLAG}"),
        (
            '["--model-type transformer"]',
            f"neuron.compiler_flags[0]: '--model-type transformer' is not allowed; allowed: {COMPILER_FLAG}",
        ),
        ('["transformer"]', f"neuron.compiler_flags[0]: 'transformer' is not allowed; allowed: {COMPILER_FLAG}"),
        ("[\"--flag='x'\"]", f"neuron.compiler_flags[0]: \"--flag='x'\" is not allowed; allowed: {COMPILER_FLAG}"),
        ('["-"]', f"neuron.compiler_flags[0]: '-' is not allowed; allowed: {COMPILER_FLAG}"),
        ("[3]", "neuron.compiler_flags[0]: 3 is not allowed; allowed: a string"),
        (
            "--enable-saturate-infinity",
            "neuron.compiler_flags: '--enable-saturate-infinity' is not allowed; allowed: a list of strings",
        ),
    ],
)
def test_a_bad_compiler_flag_is_refused_in_one_line(value: str, problem: str) -> None:
    with pytest.raises(UserError) as caught:
        load_recipe("tiny-llama-cpt", [f"neuron.compiler_flags={value}"])
    assert str(caught.value) == f"{RECIPES_DIR / 'tiny-llama-cpt.yaml'}: {problem}"


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        ("neuron.inflight_requests=0", "neuron.inflight_requests: 0 is not allowed; allowed: an integer above 0"),
        (
            "neuron.retry_failed_compilation=1",
            "neuron.retry_failed_compilation: 1 is not allowed; allowed: true or false",
        ),
        (
            "neuron.cache_dir=/x",
            "neuron.cache_dir: unknown key; allowed keys here: compiler_flags, inflight_requests, "
            "retry_failed_compilation, fail_on_late_compile",
        ),
        (
            "neuron.fail_on_late_compile=1",
            "neuron.fail_on_late_compile: 1 is not allowed; allowed: true or false",
        ),
        (
            "throughput.floor_fraction=0",
            "throughput.floor_fraction: 0 is not allowed; allowed: a number above 0, at most 1",
        ),
        (
            "throughput.floor_fraction=1.5",
            "throughput.floor_fraction: 1.5 is not allowed; allowed: a number above 0, at most 1",
        ),
        (
            "throughput.expected_tokens_per_second_per_node=-3",
            "throughput.expected_tokens_per_second_per_node: -3 is not allowed; allowed: a finite number above 0 "
            "(or omit it)",
        ),
        (
            "throughput.window_steps=0",
            "throughput.window_steps: 0 is not allowed; allowed: an integer above 0",
        ),
    ],
)
def test_the_other_neuron_settings_are_refused_in_one_line(override: str, problem: str) -> None:
    with pytest.raises(UserError) as caught:
        load_recipe("tiny-llama-cpt", [override])
    assert str(caught.value) == f"{RECIPES_DIR / 'tiny-llama-cpt.yaml'}: {problem}"


def test_duplicate_keys_are_an_error(tmp_path: Path) -> None:
    recipe = tmp_path / "twice.yaml"
    recipe.write_text((RECIPES_DIR / "tiny-llama-cpt.yaml").read_text() + "steps: 40\n")
    with pytest.raises(UserError) as caught:
        load_recipe(str(recipe))
    first = next(i for i, line in enumerate(recipe.read_text().splitlines(), 1) if line.startswith("steps:"))
    last = len(recipe.read_text().splitlines())
    assert str(caught.value) == f"{recipe}: steps: appears twice (lines {first} and {last}); allowed: each key once"


def test_an_override_whose_aliases_explode_is_one_line() -> None:
    levels = ["&x0 [" + ", ".join(["v"] * 10) + "]"]
    levels += [f"&x{n} [" + ", ".join([f"*x{n - 1}"] * 10) + "]" for n in range(1, 5)]
    bomb = "[" + ", ".join(levels) + "]"  # the last level alone stands for 10^5 values
    with pytest.raises(UserError) as caught:
        load_recipe("tiny-llama-cpt", [f"model.config={bomb}"])
    assert str(caught.value) == (
        "override model.config: anchors and aliases expand to more than 10,000 values; "
        "allowed: at most 10,000 values once aliases are expanded"
    )


def test_micro_batch_must_divide_global_batch_over_data_parallel_ranks() -> None:
    with pytest.raises(UserError, match=r"batch.global 8 is not a multiple of batch.micro 2 x data-parallel ranks 3"):
        BatchPlan(8, 2, 3).check()
    with pytest.raises(
        UserError, match=r"batch.micro: 3 is not allowed; allowed: a divisor of batch.global 8 \(1, 2, 4, 8\)"
    ):
        load_recipe("tiny-llama-cpt", ["batch.micro=3"])


def test_batch_plan_covers_each_global_batch_exactly_once_in_order() -> None:
    plan = BatchPlan(global_batch=12, micro=2, dp=3)
    assert plan.accumulation == 2
    for step in range(3):
        seen = [i for d in range(3) for m in range(2) for i in plan.sample_indices(step, d, m)]
        assert seen == list(range(12 * step, 12 * (step + 1)))


def test_schedule_warms_up_then_decays_to_min_lr() -> None:
    linear = ScheduleSection(warmup_steps=100, decay="linear", min_lr=0.0)
    cosine = ScheduleSection(warmup_steps=10, decay="cosine", min_lr=1e-6)
    assert learning_rate(1, 1.5e-4, linear, 1000) == pytest.approx(1.5e-6)  # the log line users know
    assert learning_rate(100, 1.5e-4, linear, 1000) == pytest.approx(1.5e-4)
    assert learning_rate(550, 1.5e-4, linear, 1000) == pytest.approx(0.75e-4)
    assert learning_rate(1000, 1.5e-4, linear, 1000) == pytest.approx(0.0)
    middle = 1e-6 + (1e-5 - 1e-6) * 0.5 * (1 + math.cos(math.pi * 0.5))
    assert learning_rate(55, 1e-5, cosine, 100) == pytest.approx(middle)
    assert learning_rate(100, 1e-5, cosine, 100) == pytest.approx(1e-6)
    assert learning_rate(5, 1e-5, ScheduleSection(warmup_steps=0, decay="constant"), 100) == 1e-5


def test_a_generation_section_applies_under_the_command_lines_overrides() -> None:
    """`generations.trn2` over the recipe when loaded for trn2 (as `submit` on a trn2 site loads it), the command
    line's overrides over both; the loaded recipe keeps no section, and its MFU peak is the generation's."""
    trn1, trn2 = load_recipe("llama31-8b-cpt"), load_recipe("llama31-8b-cpt", generation="trn2")
    assert (trn1.generation, trn1.nodes, trn1.parallelism.tp, trn1.parallelism.kv_size_multiplier) == ("trn1", 4, 32, 4)
    assert (trn2.generation, trn2.nodes, trn2.parallelism.tp, trn2.parallelism.kv_size_multiplier) == ("trn2", 1, 16, 2)
    assert trn2.parallelism.sequence_parallel and trn2.batch == trn1.batch  # the rest is the recipe's
    assert (trn1.peak_tflops_per_worker, trn2.peak_tflops_per_worker) == (95.0, 166.75)
    overridden = load_recipe("llama31-8b-cpt", ["nodes=2", "parallelism.tp=8"], generation="trn2")
    assert (overridden.nodes, overridden.parallelism.tp, overridden.parallelism.kv_size_multiplier) == (2, 8, 2)
    assert trn2.generations == {} and "generations" not in recipe_as_dict(trn2)
    assert load_recipe("llama31-8b-cpt", ["generation=trn2"]) == trn2  # an override chooses the section too
