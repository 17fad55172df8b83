"""Job scripts rendered for the default environment and the bundled recipes: valid bash, clean under
shellcheck, and equal to the reviewed snapshots (`UPDATE_SNAPSHOTS=1` rewrites them after an intended change)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from stacks.config import load_environment
from stacks.pipeline_site import site_settings
from tests.support.system_tools import require_tool
from training.config.recipe import load_recipe
from training.config.site import Site
from training.pipeline.plan import STAGES, plan_run
from training.pipeline.scripts import render, stage_command, stage_time_minutes
from training.pipeline.submit import dependency_option
from training.software import BOOTSTRAP_SCRIPT, NODE_SOFTWARE

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOTS = Path(__file__).parent / "snapshots"
CLUSTER_RECIPES = ("llama31-8b-cpt", "mixtral-8x7b-sft")


def default_site(environment: str = "default") -> Site:
    """The site file the deploy writes for a bundled environment."""
    config = load_environment(environment, ROOT / "environments")
    release = NODE_SOFTWARE["neuron"].release(BOOTSTRAP_SCRIPT.read_text())
    settings = site_settings(
        config,
        neuron_release=release,
        results_uri="s3://RESULTS-BUCKET/results",
        file_system_uri="s3://RESULTS-BUCKET/fsx",
        compile_cache_store="s3://RESULTS-BUCKET/compile-cache",
        compile_cache_promoter="trainium-default-cache-promoter",
    )
    settings["setup"] = tuple(settings["setup"])
    return Site(**settings)


def rendered(recipe: str, site: Site) -> dict[str, str]:
    return render(plan_run(load_recipe(recipe), site, "RUN-ID"))


@pytest.mark.parametrize("recipe", CLUSTER_RECIPES)
def test_cluster_scripts_match_the_reviewed_snapshots(recipe: str) -> None:
    scripts = rendered(recipe, default_site())
    stages = ["fetch-tokenizer", "fetch", "prepare", "convert-in", "compile", "preflight", "train", "convert-out"]
    stages += ["evaluate", "sample", "export"]
    assert list(scripts) == stages
    folder = SNAPSHOTS / recipe
    if os.environ.get("UPDATE_SNAPSHOTS"):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for stage, text in scripts.items():
            (folder / f"{stage}.sbatch").write_text(text)
    expected = {p.stem: p.read_text() for p in sorted(folder.glob("*.sbatch"))}
    assert expected == scripts, "rendered job scripts changed: review, then run `make snapshots`"


def test_cluster_scripts_carry_the_cluster_settings() -> None:
    scripts = rendered("llama31-8b-cpt", default_site())
    for stage, text in scripts.items():
        assert f"#SBATCH --job-name=RUN-ID-{stage}\n" in text
        assert f"#SBATCH --output=/fsx/runs/RUN-ID/logs/{stage}-%j.out\n" in text
        queue = "compute1" if stage in ("compile", "preflight", "train") else "cpu"  # CPU stages hold no trn1 node
        assert "#SBATCH --exclusive\n" in text and f"#SBATCH --partition={queue}\n" in text
        assert "FI_PROVIDER=efa" in text and "--cache_dir=/fsx/neuron-cache" in text
        assert "gpu" not in text.lower() and "cuda" not in text.lower() and "nccl" not in text.lower()
    assert "#SBATCH --nodes=4\n" in scripts["train"] and "#SBATCH --requeue\n" in scripts["train"]
    assert "#SBATCH --nodes=4\n" in scripts["preflight"] and "#SBATCH --no-requeue\n" in scripts["preflight"]
    assert "--nproc_per_node 32" in scripts["train"] and '--node_rank "${SLURM_NODEID}"' in scripts["train"]
    assert (
        "'/fsx/envs/neuron-2.28.1/bin/neuron_parallel_compile --retry_failed_compilation /fsx/envs/neuron-"
        in scripts["compile"]
    )
    assert "--compile'" in scripts["compile"] and "--resume'" in scripts["train"]
    assert "/opt/slurm/bin/scontrol show hostnames" in scripts["train"]
    for stage, text in scripts.items():  # non-login shells on the cluster have neither on PATH
        commands = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        bare = re.findall(
            r"(?<![/\w-])(sbatch|srun|scontrol|scancel|squeue|neuron_parallel_compile|python3?) ", commands
        )
        assert not bare, f"{stage} runs {bare} from PATH"
    assert "--tp 32 \\\n    --kv-size-multiplier 4 \\\n    --target trn1 \\\n    --xser" in scripts["convert-in"]
    assert "--run-dir /fsx/runs/RUN-ID --output s3://RESULTS-BUCKET/results/RUN-ID --overwrite\n" in scripts["export"]
    assert "--input /fsx/runs/RUN-ID/hf --output /fsx/runs/RUN-ID/samples.json\n" in scripts["sample"]
    assert (
        "-m training evaluate --recipe /fsx/runs/RUN-ID/recipe.yaml --input /fsx/runs/RUN-ID/hf "
        "--base /fsx/models/Llama-3.1-8B --output /fsx/runs/RUN-ID\n"
    ) in scripts["evaluate"]
    assert "--output /fsx/runs/RUN-ID/data \\\n" in scripts["prepare"]


@pytest.mark.parametrize("recipe", [*CLUSTER_RECIPES, "tiny-llama-cpt", "tiny-mixtral-sft"])
@pytest.mark.parametrize("where", ["cluster", "local"])
def test_every_script_passes_bash_n_and_shellcheck(recipe: str, where: str, tmp_path: Path) -> None:
    site = default_site() if where == "cluster" else Site(runs_root=str(tmp_path / "runs"))
    for stage, text in rendered(recipe, site).items():
        script = tmp_path / f"{stage}.sbatch"
        script.write_text(text)
        syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
        assert syntax.returncode == 0, f"{stage}: {syntax.stderr}"
        lint = subprocess.run(
            [require_tool("shellcheck"), "-s", "bash", str(script)], capture_output=True, text=True, check=False
        )
        assert lint.returncode == 0, f"{stage}:\n{lint.stdout}"


def test_export_waits_for_sample_to_succeed_and_for_evaluate_only_to_end() -> None:
    """A failed evaluation gate still exports the run (the model, the samples, the evaluation table); only a
    failed sample or convert-out holds export back."""
    stages = {stage.name: stage for stage in STAGES}
    jobs = {"convert-out": "11", "evaluate": "12", "sample": "13"}
    assert dependency_option(stages["export"], jobs) == "--dependency=afterok:13,afterany:12"
    assert dependency_option(stages["evaluate"], jobs) == "--dependency=afterok:11"
    assert dependency_option(stages["sample"], jobs) == "--dependency=afterok:11"
    assert dependency_option(stages["export"], {"sample": "13"}) == "--dependency=afterok:13"  # evaluate was done
    assert dependency_option(stages["export"], {}) is None
    assert dependency_option(stages["prepare"], jobs) is None


def test_a_recipe_without_an_evaluate_section_has_no_evaluate_stage(tmp_path: Path) -> None:
    recipe = load_recipe("tiny-llama-cpt", ["evaluate="])
    assert recipe.evaluate is None
    scripts = render(plan_run(recipe, Site(runs_root=str(tmp_path)), "RUN-ID"))
    assert "evaluate" not in scripts and "export" in scripts
    without_base = load_recipe("tiny-llama-cpt", ["evaluate.base=false", "evaluate.max_drop="])
    command = render(plan_run(without_base, Site(runs_root=str(tmp_path)), "RUN-ID"))["evaluate"]
    assert "-m training evaluate" in command and "--base" not in command


def test_the_prepare_job_renders_each_source_with_its_options_quoted(tmp_path: Path) -> None:
    hostile = "it's $(touch PWNED)"
    recipe = load_recipe(
        "tiny-llama-cpt",
        [
            "prepare.source=",
            "prepare.seed=9",
            f'prepare.sources=[{{source: "{hostile}", weight: 3, max_records: 5, split: dev}}, '
            "{source: b, weight: 1}]",
        ],
    )
    plan = plan_run(recipe, default_site(), "RUN-ID")
    command = stage_command(plan, next(s for s in STAGES if s.name == "prepare"))
    words = shlex.split(command.replace("\\\n", " ").replace('"$(nproc)"', "N"))
    assert words[words.index("--seed") + 1] == "9"
    tail = words[words.index("--seed") + 2 :]
    assert tail == ["--source", hostile, "--weight", "3.0", "--split", "dev", "--max-documents", "5"] + [
        "--source",
        "b",
        "--weight",
        "1.0",
    ]
    assert words.count("--source") == 2


def test_the_compile_stage_restores_the_kept_cache_first_and_stages_what_it_compiled_last() -> None:
    scripts = rendered("llama31-8b-cpt", default_site())
    compile_script = scripts["compile"]
    restore = "/fsx/envs/neuron-2.28.1/bin/python -m training compile-cache restore --run-dir /fsx/runs/RUN-ID \\\n"
    save = "/fsx/envs/neuron-2.28.1/bin/python -m training compile-cache save --run-dir /fsx/runs/RUN-ID \\\n"
    # Restore before the compiler runs, save only once it succeeded (after the exit on failure), done after both.
    order = [
        compile_script.index(restore),
        compile_script.index("bin/neuron_parallel_compile --retry_failed_compilation"),
        compile_script.index('if [ "${status}" -ne 0 ]; then exit "${status}"; fi\n'),
        compile_script.index(save),
        compile_script.index("state/compile.done"),
    ]
    assert order == sorted(order)
    # Neither stops the compile stage: a cold compile is slower, never wrong.
    assert '|| echo "$(date -u +%FT%TZ) warning: compile cache not restored; the compile starts cold"' in compile_script
    for stage, text in scripts.items():
        assert ("compile-cache" in text) == (stage == "compile"), stage
    local = rendered("llama31-8b-cpt", default_site().model_copy(update={"compile_cache_store": None}))
    assert "compile-cache" not in local["compile"]
    assert "compile-cache" not in rendered("tiny-llama-cpt", Site())["compile"]  # no Neuron, no cache to keep


def test_the_preflight_job_has_a_time_limit_from_its_forecast_even_where_jobs_have_none() -> None:
    site = default_site()
    assert site.time_minutes == 0  # the default environment: no job has a limit
    llama = plan_run(load_recipe("llama31-8b-cpt"), site, "RUN-ID")
    limits = {stage.name: stage_time_minutes(stage, llama) for stage in llama.stages}
    # 15 minutes of loading and three times the forecast's two steps of 170.7 s
    assert limits["preflight"] == 33 and limits["train"] == 0 and limits["compile"] == 0
    assert "#SBATCH --time=33\n" in render(llama)["preflight"]
    short = plan_run(load_recipe("llama31-8b-cpt"), site.model_copy(update={"time_minutes": 20}), "RUN-ID")
    assert stage_time_minutes(next(s for s in short.stages if s.name == "preflight"), short) == 20
    mixtral = plan_run(load_recipe("mixtral-8x7b-sft"), site, "RUN-ID")
    assert stage_time_minutes(next(s for s in mixtral.stages if s.name == "preflight"), mixtral) == 30  # the least
