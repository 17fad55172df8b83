"""The run's forecast (training/train/forecast.py) with the environment's costs (stacks/cost.py, so here and not in
tests/training, which the neuron tier reruns without the CDK): the arithmetic against the figures it comes from, the
derived Mixtral band, the budget's refusal and its override at `submit`, and the `plan` output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stacks.config import load_environment
from stacks.cost import run_usd_per_hour
from tests.support.repository import ROOT
from training.cli import main
from training.config.hardware import DEFAULT_HARDWARE, HARDWARE
from training.config.model import flops_per_token
from training.config.recipe import load_recipe
from training.train.forecast import (
    PUBLISHED_RANGE,
    PUBLISHED_SEQ_PER_NODE,
    budget_refusal,
    forecast_of,
    markdown_row,
    mfu,
)
from training.train.memory import model_config

# The figures for the Llama recipe as it stood: 10,000 steps x 1,024 x 8,192 on 4 x trn1.32xlarge.
AS_IT_STOOD = ["steps=10000"]


def test_the_llama_recipe_as_it_stood_is_84_billion_tokens_20_days_and_41_thousand_dollars() -> None:
    recipe = load_recipe("llama31-8b-cpt", AS_IT_STOOD)
    nodes_only = forecast_of(recipe, DEFAULT_HARDWARE)
    assert nodes_only is not None
    assert nodes_only.tokens == 10_000 * 1024 * 8192 == 83_886_080_000
    assert nodes_only.throughput.expected == PUBLISHED_SEQ_PER_NODE == 1.50
    assert nodes_only.step_seconds == pytest.approx(1024 / 6.0)  # 1.50 seq/s x 4 nodes
    assert nodes_only.hours == pytest.approx(10_000 * 1024 / 6.0 / 3600)  # 474.1 h
    assert 19.5 < nodes_only.hours / 24 < 20.1
    assert nodes_only.usd == pytest.approx(nodes_only.hours * 4 * 21.50)  # $40,770
    environment = load_environment("default", ROOT / "environments")
    whole = forecast_of(recipe, DEFAULT_HARDWARE, run_usd_per_hour(environment, 4), "environment")
    assert whole is not None and 41_000 < whole.usd < 41_500  # head node, FSx, NAT, CloudWatch on top
    band = whole.as_dict()
    assert band["seq_per_second_per_node_band"] == list(PUBLISHED_RANGE)
    assert band["hours_band"][0] < band["hours"] < band["hours_band"][1]


def test_the_bundled_recipes_are_short_demonstrations() -> None:
    """The lengths the recipes state: Llama 200 steps (1.68 B tokens, about 9.5 h, about $830 in the default
    environment), Mixtral 300 steps (19.7 M tokens, under half an hour)."""
    environment = load_environment("default", ROOT / "environments")
    llama = load_recipe("llama31-8b-cpt")
    forecast = forecast_of(llama, DEFAULT_HARDWARE, run_usd_per_hour(environment, llama.nodes), "environment")
    assert forecast is not None and forecast.tokens == 200 * 1024 * 8192
    assert 9.4 < forecast.hours < 9.6 and 800 < forecast.usd < 850
    mixtral = forecast_of(load_recipe("mixtral-8x7b-sft"), DEFAULT_HARDWARE)
    assert mixtral is not None and mixtral.tokens == 300 * 32 * 2048 and mixtral.hours < 0.5


def test_mixtral_is_derived_from_the_published_mfu_band() -> None:
    """Nothing is published for Mixtral on Trainium: its band is the sequences/s at which it reaches the MFU
    that Llama's published 1.31, 1.50 and 1.67 sequences/s per node reach, from each model's FLOPs per token."""
    mixtral_recipe, llama_recipe = load_recipe("mixtral-8x7b-sft"), load_recipe("llama31-8b-cpt")
    mixtral_config, llama_config = model_config(mixtral_recipe), model_config(llama_recipe)
    assert mixtral_config is not None and llama_config is not None
    forecast = forecast_of(mixtral_recipe, DEFAULT_HARDWARE)
    assert forecast is not None
    peak = mixtral_recipe.peak_tflops_per_worker
    mixtral_flops, llama_flops = flops_per_token(mixtral_config, 2048), flops_per_token(llama_config, 8192)
    t = forecast.throughput
    published_figures = (PUBLISHED_RANGE[0], 1.50, PUBLISHED_RANGE[1])
    for derived, published in zip((t.low, t.expected, t.high), published_figures, strict=True):
        assert mfu(derived, mixtral_flops, 2048, peak, 32) == pytest.approx(mfu(published, llama_flops, 8192, peak, 32))
    assert mfu(1.50, llama_flops, 8192, peak, 32) == pytest.approx(0.234, abs=0.001)
    assert t.expected == pytest.approx(4.36, abs=0.01)
    assert t.source.startswith("derived, nothing published for Mixtral-8x7B-v0.1 at sequence 2048")


def test_the_forecast_counts_the_flops_the_training_job_reports_mfu_with() -> None:
    """One count, of the one parsed model config: the forecast's and the training job's MFU's."""
    from training.train import forecast, loop

    assert forecast.flops_per_token is loop.flops_per_token is flops_per_token
    llama = model_config(load_recipe("llama31-8b-cpt"))
    assert llama is not None and flops_per_token(llama, 8192) / 1e9 == pytest.approx(57.91, abs=0.01)


def test_the_planner_and_the_stacks_read_one_instance_table() -> None:
    """One row per Trainium type (prices for the forecast and the cost table, device counts for the preflight and
    the node health check, cores and HBM for the planner), whose derived figures are the published ones."""
    from stacks.config import ComputeConfig

    assert ComputeConfig.model_json_schema()["properties"]["instance_type"]["enum"] == list(HARDWARE)
    derived = {
        name: (h.generation, h.cores_per_node, h.hbm_gib_per_core, h.efa_devices, h.peak_bf16_tflops_per_core)
        for name, h in HARDWARE.items()
    }
    assert derived == {
        "trn1.2xlarge": ("trn1", 2, 16.0, 0, 95.0),
        "trn1.32xlarge": ("trn1", 32, 16.0, 8, 95.0),
        "trn1n.32xlarge": ("trn1", 32, 16.0, 16, 95.0),
        # Trn2 at its default LNC 2: 2 physical NeuronCore-v3 a process, 24 GiB and 2 x 667/8 TFLOPS each
        "trn2.3xlarge": ("trn2", 4, 24.0, 0, 166.75),
        "trn2.48xlarge": ("trn2", 64, 24.0, 16, 166.75),
    }
    trn2 = HARDWARE["trn2.48xlarge"]
    assert [trn2.cores_at(lnc) for lnc in (2, 1)] == [64, 128]  # NEURON_LOGICAL_NC_CONFIG 2 (default) or 1
    assert trn2.cores_per_node * trn2.peak_bf16_tflops_per_core == pytest.approx(10_672)  # 10.7 PFLOPS a node
    assert load_recipe("llama31-8b-cpt").peak_tflops_per_worker == DEFAULT_HARDWARE.peak_bf16_tflops_per_core
    assert load_recipe("llama31-8b-cpt", generation="trn2").peak_tflops_per_worker == trn2.peak_bf16_tflops_per_core


def test_budget_refusal_is_one_line_naming_both_numbers_and_the_override() -> None:
    forecast = forecast_of(load_recipe("llama31-8b-cpt", AS_IT_STOOD), DEFAULT_HARDWARE)
    assert forecast is not None
    assert budget_refusal(forecast, None, None) is None
    assert budget_refusal(forecast, 50_000, None) is None
    assert budget_refusal(forecast, 1000, 40_000) is not None  # accepted less than it costs
    problem = budget_refusal(forecast, 1000, None)
    assert problem == (
        "forecast: llama31-8b-cpt costs about $40,770 (19.8 days on 4 x trn1.32xlarge), above budget.monthly_usd "
        "1000; shorten steps, or set budget.accept_forecast_usd to at least 40771 to accept it"
    )
    assert budget_refusal(forecast, 1000, 40_771) is None  # the amount the line names is enough


def cluster_site(tmp_path: Path, **budget: float) -> Path:
    site = {"runs_root": str(tmp_path / "runs"), "neuron": True, "instance_type": "trn1.32xlarge", **budget}
    path = tmp_path / "site.yaml"
    path.write_text(json.dumps(site))
    return path


def test_submit_refuses_a_run_above_the_sites_budget_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    site = cluster_site(tmp_path, node_usd_per_hour=21.6, environment_usd_per_hour=0.7, budget_monthly_usd=500)
    assert main(["submit", "--recipe", "llama31-8b-cpt", "--dry-run", "--run-id", "r", "--site", str(site)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        "error: forecast: llama31-8b-cpt costs about $826 (9.5 h on 4 x trn1.32xlarge), above site "
        "budget_monthly_usd 500; shorten steps, or set the environment's budget.accept_forecast_usd (site "
        "budget_accept_forecast_usd) to at least 826 to accept it\n"
    )
    assert not (tmp_path / "runs").exists()


def test_submit_runs_what_the_budget_accepts_and_prints_its_forecast(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    site = cluster_site(tmp_path, budget_monthly_usd=500, budget_accept_forecast_usd=900)
    assert main(["submit", "--recipe", "llama31-8b-cpt", "--dry-run", "--run-id", "r", "--site", str(site)]) == 0
    err = capsys.readouterr().err
    assert err.startswith("forecast: 200 steps x 1024 x 8192 = 1.7 B tokens; at 1.50 seq/s per node")
    assert "about $815" in err and "(the training nodes' on-demand list price only)" in err
    assert "throughput: Neuron's published table, SDK 2.24" in err


def test_plan_prints_the_forecast(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--recipe", "llama31-8b-cpt", "--instance-type", "trn1.32xlarge", "steps=10000"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("forecast: 10,000 steps x 1024 x 8192 = 83.9 B tokens; at 1.50 seq/s per node")
    assert "19.8 days" in lines[-2] and "about $40,770" in lines[-2]
    assert lines[-1].startswith("throughput: Neuron's published table, SDK 2.24")
    assert main(["plan", "--recipe", "mixtral-8x7b-sft", "--instance-type", "trn1.32xlarge", "--json"]) == 0
    forecast = json.loads(capsys.readouterr().out)["forecast"]
    assert forecast["tokens"] == 300 * 32 * 2048 and forecast["steps"] == 300
    assert forecast["throughput_source"].startswith("derived")
    assert forecast["usd_band"][0] < forecast["usd"] < forecast["usd_band"][1]
    low, high = forecast["seq_per_second_per_node_band"]
    assert low < forecast["seq_per_second_per_node"] < high


def test_plan_shows_both_generations_side_by_side_each_with_its_recipe_settings(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Without --instance-type: each generation's training node, the recipe's settings for it applied; the trn2
    forecast scales the published trn1 figure by peak FLOPS (the same MFU)."""
    assert main(["plan", "--recipe", "llama31-8b-cpt"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["llama31-8b-cpt", "trn1", "trn2"]
    assert lines[1].split("  ")[0] == "nodes" and "4 x trn1.32xlarge" in lines[1] and "1 x trn2.48xlarge" in lines[1]
    assert "TP 32 x PP 1 x DP 4, K/V x4" in lines[2] and "TP 16 x PP 1 x DP 4, K/V x2" in lines[2]
    assert "of 16 GiB" in lines[3] and "of 24 GiB" in lines[3]
    assert any(line.startswith("llama31-8b-cpt on 1 x trn2.48xlarge: TP 16, PP 1, DP 4") for line in lines)
    assert main(["plan", "--recipe", "mixtral-8x7b-sft", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["generations"]
    assert [plans[g]["hardware"] for g in ("trn1", "trn2")] == ["trn1.32xlarge", "trn2.48xlarge"]
    trn2 = plans["trn2"]
    assert (trn2["nodes"], trn2["tp"], trn2["pp"], trn2["dp"], trn2["kv_size_multiplier"]) == (1, 16, 4, 1, 2)
    assert trn2["fits"] and trn2["headroom"] >= 0.10  # the bar for an unpublished layout
    llama = forecast_of(load_recipe("llama31-8b-cpt", generation="trn2"), HARDWARE["trn2.48xlarge"])
    assert llama is not None and "scaled by peak FLOPS to 166.75 TFLOPS a core" in llama.throughput.source
    assert llama.throughput.expected == pytest.approx(1.50 * 64 * 166.75 / (32 * 95))


def test_the_forecast_is_torch_free() -> None:
    """`cdk synth` forecasts the deploy's run where torch may not be installed."""
    code = "import sys, training.train.forecast; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


FORECAST_TABLE_ROWS = {
    "`llama31-8b-cpt`, 4 x trn1.32xlarge": ("llama31-8b-cpt", []),
    "`llama31-8b-cpt steps=10000` (as it stood)": ("llama31-8b-cpt", AS_IT_STOOD),
    "`mixtral-8x7b-sft`, 2 x trn1.32xlarge": ("mixtral-8x7b-sft", []),
}


def test_the_training_job_page_shows_the_bundled_recipes_forecasts() -> None:
    """docs/training-job.md's forecast table: the default environment's cost while training, as `cdk synth`
    prints it."""
    environment = load_environment("default", ROOT / "environments")
    page = (ROOT / "docs" / "training-job.md").read_text()
    for label, (name, overrides) in FORECAST_TABLE_ROWS.items():
        recipe = load_recipe(name, overrides)
        forecast = forecast_of(recipe, DEFAULT_HARDWARE, run_usd_per_hour(environment, recipe.nodes), "environment")
        assert forecast is not None
        assert markdown_row(label, forecast) + "\n" in page, markdown_row(label, forecast)
