"""The memory planner (`training.train.memory`, `python -m training plan`) against what the model really holds
and against the configurations known to run on trn1 (REFERENCE.md section 9).

Parameters per rank equal the built model's at TP 1, 2 and 4; the activation terms are within 10 % of the
bytes autograd keeps for backward, measured on tiny models (tests/support/saved_tensors.py) for every
combination of precision, checkpointing, flash attention, sequence parallelism and MoE dispatch tried here.
TP 2 and 4 run in one torchrun of 4 gloo processes (tests/support/memory_worker.py).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.repository import ROOT
from tests.support.workers import LOCAL, run_workers
from training.cli import main
from training.config.hardware import DEFAULT_HARDWARE
from training.config.model import ModelConfig, ModelSpec, default_kv_multiplier
from training.config.recipe import load_recipe
from training.train.memory import (
    GIB,
    KNOWN_MODELS_DIR,
    REQUIRED_HEADROOM,
    Workload,
    cheapest_fix,
    layer_parameters_per_core,
    model_config,
    parameters_per_core,
    plan,
    refusal,
    saved_activation_bytes,
    state_bytes_per_parameter,
    workload_of,
)
from training.train.optimizer import zero1_where_it_shards

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)

WORKER = ROOT / "tests" / "support" / "memory_worker.py"
WORLD = 4
MICRO, SEQ_LEN = 2, 64
LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
MIXTRAL: dict[str, Any] = {**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
CONFIGS = {"llama": LLAMA, "llama-tied": {**LLAMA, "tie_word_embeddings": True}, "mixtral": MIXTRAL}
DTYPES = {"float32": "fp32", "bfloat16": "bf16-mixed"}
TOLERANCE = 0.10
CAPACITY_FACTOR = 1.25  # drops some choices of the tiny model's skewed router


def workload(case: dict[str, Any]) -> Workload:
    config, execution = case["config"], case.get("execution", {})
    model = ModelConfig.from_hf(config)
    spec = model.spec
    return Workload(
        spec=spec,
        experts_per_token=model.experts_per_token,
        tp=case["tp"],
        kv_multiplier=case.get("kv_multiplier") or default_kv_multiplier(spec, case["tp"]),
        sequence_parallel=execution.get("sequence_parallel", False),
        activation_checkpointing=execution.get("activation_checkpointing", "none"),
        flash_attention=execution.get("flash_attention", False),
        precision=DTYPES[case["dtype"]],  # type: ignore[arg-type]
        micro=case["micro"],
        seq_len=case["seq_len"],
        moe_dispatch=case.get("moe_dispatch") or "sparse",
        capacity_factor=case.get("capacity_factor"),
    )


def cases() -> list[dict[str, Any]]:
    """Every checkpointing mode x flash attention x sequence parallelism at TP 2 and 4, both dtypes, both
    models (Mixtral in all three MoE dispatches), plus the parameter-count cases."""
    plan = []
    for model, tp, dtype, mode, flash, sp in itertools.product(
        ("llama", "mixtral"), (2, 4), DTYPES, ("none", "selective", "full"), (False, True), (False, True)
    ):
        if model == "mixtral" and (dtype == "bfloat16" or flash):
            continue  # the attention terms are the Llama cases'; Mixtral adds the MoE block
        for dispatch in ("sparse", "dense", "capacity") if model == "mixtral" else (None,):
            execution = {"activation_checkpointing": mode, "flash_attention": flash, "sequence_parallel": sp}
            name = f"{model}-tp{tp}-{dtype}-{mode}{'-flash' if flash else ''}{'-sp' if sp else ''}"
            plan.append(
                {
                    "name": name + (f"-{dispatch}" if dispatch else ""),
                    "config": CONFIGS[model],
                    "tp": tp,
                    "dtype": dtype,
                    "micro": MICRO,
                    "seq_len": SEQ_LEN,
                    "moe_dispatch": dispatch,
                    "capacity_factor": CAPACITY_FACTOR if dispatch == "capacity" else None,
                    "execution": execution,
                }
            )
    for model, tp, multiplier in (("llama-tied", 2, None), ("llama", 4, 2), ("mixtral", 4, None)):
        plan.append(
            {
                "name": f"parameters-{model}-tp{tp}",
                "config": CONFIGS[model],
                "tp": tp,
                "dtype": "float32",
                "micro": 1,
                "seq_len": 8,
                "kv_multiplier": multiplier,
            }
        )
    return plan


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("memory")
    plan = cases()
    results = run_workers(WORKER, plan, root, WORLD, timeout=900, environment=LOCAL)
    return {
        case["name"]: [json.loads((results / case["name"] / f"rank_{r:02d}.json").read_text()) for r in range(WORLD)]
        for case in plan
    }


ACTIVATION_CASES = [case for case in cases() if not case["name"].startswith("parameters-")]


@pytest.mark.parametrize("case", ACTIVATION_CASES, ids=lambda case: case["name"])
def test_activation_terms_match_the_saved_bytes(case: dict[str, Any], measured: dict[str, Any]) -> None:
    planned = saved_activation_bytes(workload(case))
    for rank in measured[case["name"]]:
        assert planned == pytest.approx(rank["saved_bytes"], rel=TOLERANCE), (rank, planned)


@pytest.mark.parametrize("case", [c for c in cases() if c["name"].startswith("parameters-")], ids=lambda c: c["name"])
def test_parameters_per_core_are_the_built_models(case: dict[str, Any], measured: dict[str, Any]) -> None:
    for rank in measured[case["name"]]:
        assert parameters_per_core(workload(case)) == rank["parameters"]


# --- the plan against what is known to run on trn1 (REFERENCE.md section 9) ---------------------------------


def known(name: str) -> ModelSpec:
    return ModelSpec.from_config(json.loads((KNOWN_MODELS_DIR / f"{name}.json").read_text()))


# name: (workload, the published or estimated GiB per core it must stay below)
KNOWN_TO_RUN = {
    "llama3-8b-tp32-kv4-sp-selective-flash-4-nodes": Workload(
        spec=known("Llama-3.1-8B"), tp=32, dp=4, kv_multiplier=4, sequence_parallel=True,
        activation_checkpointing="selective", flash_attention=True, seq_len=8192, accumulation=256,
    ),
    "mixtral-tp8-pp8-sr-full-2-nodes": Workload(
        spec=known("Mixtral-8x7B-v0.1"), tp=8, pp=8, dp=1, activation_checkpointing="full", precision="bf16-sr",
        seq_len=2048, accumulation=32,
    ),
    "mixtral-tp32-pp4-sp-full-mixed-8-nodes": Workload(
        spec=known("Mixtral-8x7B-v0.1"), tp=32, pp=4, dp=2, kv_multiplier=4, sequence_parallel=True,
        activation_checkpointing="full", seq_len=4096, accumulation=16,
    ),
    "mixtral-tp32-pp4-16-nodes": Workload(
        spec=known("Mixtral-8x7B-v0.1"), tp=32, pp=4, dp=4, kv_multiplier=4, sequence_parallel=True,
        activation_checkpointing="full", seq_len=4096, accumulation=8,
    ),
    "llama31-70b-tp32-pp8-dp4": Workload(
        spec=known("Llama-3.1-70B"), tp=32, pp=8, dp=4, kv_multiplier=4, sequence_parallel=True,
        activation_checkpointing="selective", flash_attention=True, seq_len=8192, accumulation=256,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(KNOWN_TO_RUN))
def test_configurations_known_to_run_fit(name: str) -> None:
    result = plan(KNOWN_TO_RUN[name])
    assert result.fits, {k: round(v / GIB, 2) for k, v in result.breakdown.items()}


def test_the_reference_llama_settings_cost_what_reference_md_estimates() -> None:
    """REFERENCE.md: about 6.4 GiB per core for Llama 3 8B at TP 32 with SP, selective checkpointing and flash."""
    total = plan(KNOWN_TO_RUN["llama3-8b-tp32-kv4-sp-selective-flash-4-nodes"]).total / GIB
    assert 5.5 < total < 7.5


# The bundled Mixtral recipe before pipeline parallelism and the document's memory settings.
MIXTRAL_AS_IT_STOOD = [
    "parallelism.pp=1",
    "parallelism.sequence_parallel=false",
    "memory.activation_checkpointing=none",
    "moe.capacity_factor=null",
    "precision=bf16-mixed",
]


@pytest.mark.parametrize(
    ("recipe", "overrides"),
    [
        # the bundled Llama recipe as it was before sequence parallelism, checkpointing and flash attention
        (
            "llama31-8b-cpt",
            [
                "parallelism.sequence_parallel=false",
                "memory.activation_checkpointing=none",
                "memory.flash_attention=false",
            ],
        ),
        ("mixtral-8x7b-sft", MIXTRAL_AS_IT_STOOD),
    ],
)
def test_the_first_two_recipes_as_they_stood_are_refused(recipe: str, overrides: list[str]) -> None:
    result = plan(workload_of(load_recipe(recipe, overrides), model_config_of(recipe), DEFAULT_HARDWARE))
    assert not result.fits and result.total > 25 * GIB  # REFERENCE.md: about 26.6 and 35.2 GiB


def model_config_of(recipe: str) -> ModelConfig:
    config = model_config(load_recipe(recipe))
    assert config is not None, "the bundled recipes' models are known to the planner"
    return config


def test_llama_recipe_fits_four_nodes_with_headroom() -> None:
    recipe = load_recipe("llama31-8b-cpt")
    assert recipe.nodes == 4
    result = plan(workload_of(recipe, model_config_of("llama31-8b-cpt"), DEFAULT_HARDWARE))
    assert result.fits and result.headroom >= REQUIRED_HEADROOM
    assert refusal(recipe, DEFAULT_HARDWARE) is None


def test_the_cheapest_fix_is_the_first_set_of_changes_that_fits() -> None:
    """From the Llama recipe without flash attention and sequence parallelism: flash attention alone is not
    enough (the norms and residuals of 8192 tokens stay), both are; the fixed recipe plans the same."""
    broken = ["memory.flash_attention=false", "parallelism.sequence_parallel=false"]
    recipe = load_recipe("llama31-8b-cpt", broken)
    config = model_config_of("llama31-8b-cpt")
    fix = cheapest_fix(workload_of(recipe, config, DEFAULT_HARDWARE), recipe, DEFAULT_HARDWARE)
    assert fix.overrides == ("memory.flash_attention=true", "parallelism.sequence_parallel=true")
    assert fix.plan is not None and fix.plan.fits
    fixed = load_recipe("llama31-8b-cpt", broken + list(fix.overrides))
    assert plan(workload_of(fixed, config, DEFAULT_HARDWARE)).total == fix.plan.total


def test_mixtral_recipe_fits_two_nodes_with_headroom() -> None:
    """TP 32 x PP 2 with sequence parallelism, full checkpointing and bf16-sr (the recipe's justification), and
    the document's TP 8 x PP 8 as an override: both fit 2 nodes with the required headroom."""
    recipe = load_recipe("mixtral-8x7b-sft")
    assert (recipe.nodes, recipe.parallelism.tp, recipe.parallelism.pp, recipe.precision) == (2, 32, 2, "bf16-sr")
    chosen = plan(workload_of(recipe, model_config_of("mixtral-8x7b-sft"), DEFAULT_HARDWARE))
    assert chosen.fits and chosen.headroom >= 0.30
    assert refusal(recipe, DEFAULT_HARDWARE) is None
    documents = ["parallelism.tp=8", "parallelism.pp=8", "parallelism.kv_size_multiplier=1"]
    documents.append("parallelism.sequence_parallel=false")
    document = load_recipe("mixtral-8x7b-sft", documents)
    result = plan(workload_of(document, model_config_of("mixtral-8x7b-sft"), DEFAULT_HARDWARE))
    assert result.fits and REQUIRED_HEADROOM <= result.headroom < chosen.headroom


def test_the_cheapest_fix_adds_pipeline_stages_before_nodes() -> None:
    """Llama 3.1 70B on the 8B recipe's 4 nodes: with every memory setting it still does not fit at PP 1, so
    the fix splits the layers over stages on the same nodes rather than buying more; the fix's recipe plans
    as it says."""
    recipe = load_recipe("llama31-8b-cpt", ["model.config=/fsx/models/Llama-3.1-70B"])
    config = model_config(recipe)
    assert config is not None
    fix = cheapest_fix(workload_of(recipe, config, DEFAULT_HARDWARE), recipe, DEFAULT_HARDWARE)
    assert fix.overrides[-1].startswith("parallelism.pp=") and not any(o.startswith("nodes=") for o in fix.overrides)
    assert fix.plan is not None and fix.plan.fits
    fixed = load_recipe("llama31-8b-cpt", ["model.config=/fsx/models/Llama-3.1-70B", *fix.overrides])
    assert plan(workload_of(fixed, config, DEFAULT_HARDWARE)).total == fix.plan.total


def test_refusal_is_one_line_with_the_fix() -> None:
    problem = refusal(load_recipe("mixtral-8x7b-sft", MIXTRAL_AS_IT_STOOD), DEFAULT_HARDWARE)
    assert problem is not None and "\n" not in problem
    assert problem.startswith("recipe mixtral-8x7b-sft needs 36.")
    assert "GiB per NeuronCore of the 16 GiB on trn1.32xlarge" in problem
    assert "(python -m training plan --recipe mixtral-8x7b-sft)" in problem


def test_plan_command_prints_the_breakdown_and_exits_by_fit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--recipe", "llama31-8b-cpt"]) == 0
    text = capsys.readouterr().out
    for line in ("weights", "gradients", "optimizer state", "activations", "logits", "runtime reserve", "total"):
        assert f"  {line}" in text
    assert "headroom: fits\nforecast: " in text  # the verdict, then the run's forecast (tests/infra/test_forecast.py)
    assert (
        main(
            ["plan", "--recipe", "mixtral-8x7b-sft", "--instance-type", "trn1.32xlarge", "--json", *MIXTRAL_AS_IT_STOOD]
        )
        == 1
    )
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is False and data["hbm_gib"] == 16.0 and data["per_core_gib"] > 30
    assert data["headroom"] == pytest.approx(1 - data["per_core_gib"] / data["hbm_gib"], abs=1e-3)
    assert data["fix"]["overrides"] and data["parameters_per_core"] > 1e9


def test_zero1_is_planned_and_run_only_where_data_parallelism_shards_it(caplog: pytest.LogCaptureFixture) -> None:
    """Mixtral at TP 32 x PP 2 on 2 nodes has DP 1: the job turns ZeRO-1 off in one log line (as NxD's Mixtral
    launcher does) and the planner counts the optimizer state it really keeps; at DP 2 ZeRO-1 stays on."""
    recipe = load_recipe("mixtral-8x7b-sft")
    assert recipe.optimizer.zero1
    with caplog.at_level("INFO"):
        off = zero1_where_it_shards(recipe, dp=1)
    assert not off.optimizer.zero1 and recipe.optimizer.zero1  # a copy; the recipe itself is unchanged
    assert [r.getMessage() for r in caplog.records] == [
        "optimizer.zero1: off for this run: data parallelism is 1, so there is no optimizer state to shard"
    ]
    assert zero1_where_it_shards(recipe, dp=2) is recipe
    config = model_config(recipe)
    assert config is not None
    staged = workload_of(recipe, config, DEFAULT_HARDWARE)
    assert staged.dp == 1 and not staged.zero1
    unstaged_recipe = load_recipe("mixtral-8x7b-sft", ["parallelism.pp=1"])
    unstaged = workload_of(unstaged_recipe, config, DEFAULT_HARDWARE)
    assert unstaged.dp == 2 and unstaged.zero1


def test_plan_of_an_unknown_model_is_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--recipe", "llama31-8b-cpt", f"model.config={tmp_path / 'My-Model'}"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "no config.json there and not a bundled model" in error, error


def test_the_planner_is_torch_free() -> None:
    """`cdk synth` plans the pipeline's recipe where torch may not be installed."""
    code = "import sys, training.train.memory; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_submit_refuses_a_recipe_that_does_not_fit_before_writing_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # the local site keeps its runs in ./work/runs
    assert main(["submit", "--recipe", "mixtral-8x7b-sft", "--dry-run", *MIXTRAL_AS_IT_STOOD]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and error.startswith("error: recipe mixtral-8x7b-sft needs "), error
    assert not (tmp_path / "work").exists()
    assert main(["submit", "--recipe", "llama31-8b-cpt", "--dry-run"]) == 0  # the bundled recipes fit
    assert main(["submit", "--recipe", "mixtral-8x7b-sft", "--dry-run"]) == 0


@pytest.mark.parametrize("model", ["llama", "mixtral"])
def test_checkpointing_keeps_less_as_planned(model: str, measured: dict[str, Any]) -> None:
    """Selective keeps less than none and full less than selective, measured, by the amounts the plan says."""
    kept = {}
    for mode in ("none", "selective", "full"):
        name = f"{model}-tp2-float32-{mode}-sp" + ("-sparse" if model == "mixtral" else "")
        case = next(c for c in ACTIVATION_CASES if c["name"] == name)
        kept[mode] = (measured[name][0]["saved_bytes"], saved_activation_bytes(workload(case)))
    assert kept["none"][0] > kept["selective"][0] > kept["full"][0]
    for less, more in (("selective", "none"), ("full", "selective")):
        measured_drop, planned_drop = kept[more][0] - kept[less][0], kept[more][1] - kept[less][1]
        assert planned_drop == pytest.approx(measured_drop, rel=TOLERANCE)


def test_fsdp2_shards_what_zero1_shards_and_more() -> None:
    """On the torch-native backend the planner counts FSDP2: the fp32 parameter, gradient and both moments all
    sharded over DP (16/DP bytes a parameter), plus the two gathered layers; ZeRO-1 keeps bf16 weights and fp32
    gradients whole on every rank."""
    zero1 = load_recipe("llama31-8b-cpt")
    native = load_recipe("llama31-8b-cpt", ["backend=torch-native"])
    config = model_config(zero1)
    assert config is not None
    w_zero1 = workload_of(zero1, config, DEFAULT_HARDWARE)
    w_native = workload_of(native, config, DEFAULT_HARDWARE)
    assert w_native.fsdp and not w_native.zero1 and w_zero1.zero1 and not w_zero1.fsdp
    assert sum(state_bytes_per_parameter(w_native).values()) == 16 / w_native.dp
    assert sum(state_bytes_per_parameter(w_native).values()) < sum(state_bytes_per_parameter(w_zero1).values())
    planned = plan(w_native, DEFAULT_HARDWARE)
    layer = layer_parameters_per_core(w_native)
    assert planned.breakdown["gathered units"] == 2 * layer * 2 * 2  # two layers, weights and gradients, bf16
    assert planned.total < plan(w_zero1, DEFAULT_HARDWARE).total
    # one fp32 replica has nothing to shard or cast: the backend runs without FSDP2, and the plan says so
    single = load_recipe("llama31-8b-cpt", ["backend=torch-native", "precision=fp32", "nodes=1"])
    assert workload_of(single, config, DEFAULT_HARDWARE, processes_per_node=32).dp == 1
    assert not workload_of(single, config, DEFAULT_HARDWARE, processes_per_node=32).fsdp
