"""The evaluate stage runs the real lm-evaluation-harness, offline, on tiny models and the package's local task:
the numbers, the gate in both directions, the files it writes, the CLI's exit status, and bad inputs as one line.

Two tiny Llamas with known answers on `tiny_choice` (training/pipeline/tasks): `flat` (a zero output layer:
every next token equally likely, so the shorter wrong choice wins: accuracy 0) and `copier` (the residual
stream is the token's embedding and the output layer that embedding, scaled: it repeats its last token, as
the right choice does: accuracy 1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.support.run_records import write_run_record
from training.config.recipe import EvaluateSection, load_recipe
from training.errors import UserError
from training.local.tiny import tiny_model
from training.pipeline.evaluate import (
    EVALUATION_JSON,
    EVALUATION_MD,
    evaluate,
    load_model,
    memory_refusal,
    publish_blocker,
    weight_bytes,
)

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)

ROOT = Path(__file__).resolve().parents[3]
TINY_TASK = {"name": "tiny_choice", "limit": 12}


def _edited(directory: Path, tokenizer: Path, edit: str) -> Path:
    from transformers import AutoModelForCausalLM

    tiny_model(directory, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(str(directory))
    with torch.no_grad():
        if edit == "flat":
            model.lm_head.weight.zero_()
        else:  # copier
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            model.lm_head.weight.copy_(1000 * model.model.embed_tokens.weight)
    model.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, llama_tokenizer: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("evaluate-models")
    return {name: _edited(root / name, llama_tokenizer, name) for name in ("flat", "copier")}


def settings(**values: object) -> EvaluateSection:
    return EvaluateSection.model_validate({"tasks": [TINY_TASK], **values})


def test_a_worse_trained_model_fails_the_gate_and_the_results_are_written(
    models: dict[str, Path], tmp_path: Path
) -> None:
    started = time.monotonic()
    report = evaluate(settings(max_drop=10.0), models["flat"], models["copier"], tmp_path)
    elapsed = time.monotonic() - started
    row = report["tasks"]["tiny_choice"]
    assert row == {
        "metric": "acc",
        "trained": 0.0,
        "base": 1.0,
        "delta_points": -100.0,
        "limit": 12,
        "higher_is_better": True,
    }
    assert report["gate"]["passed"] is False and report["gate"]["max_drop"] == 10.0
    (failure,) = report["gate"]["failures"]
    assert failure.startswith("tiny_choice: acc 100.00 points worse than the base") and "12 documents" in failure
    written = json.loads((tmp_path / EVALUATION_JSON).read_text())
    assert written["tasks"] == report["tasks"] and written["gate"] == report["gate"]
    assert written["lm_eval_version"] == "0.4.13" and 0 < written["elapsed_seconds"] <= elapsed
    table = (tmp_path / EVALUATION_MD).read_text()
    assert "| task | metric | base | trained | difference |" in table
    assert "| tiny_choice | acc | 100.00 | 0.00 | -100.00 |" in table
    assert "Gate failed:" in table
    assert publish_blocker(tmp_path, evaluated=True) == f"evaluation gate failed: {failure}"
    assert elapsed < 30, f"the tiny evaluation takes {elapsed:.1f}s; it runs in every CI run"


def test_a_better_trained_model_passes_and_no_base_means_no_gate(models: dict[str, Path], tmp_path: Path) -> None:
    report = evaluate(settings(max_drop=0.0), models["copier"], models["flat"], tmp_path / "a")
    assert report["tasks"]["tiny_choice"]["delta_points"] == 100.0
    assert report["gate"] == {"max_drop": 0.0, "passed": True, "failures": []}
    assert publish_blocker(tmp_path / "a", evaluated=True) is None
    alone = evaluate(settings(base=False), models["copier"], None, tmp_path / "b")
    assert alone["tasks"]["tiny_choice"] | {"trained": None} == {
        "metric": "acc",
        "trained": None,
        "base": None,
        "delta_points": None,
        "limit": 12,
        "higher_is_better": True,
    }
    assert alone["gate"] == {"max_drop": None, "passed": True, "failures": []}
    assert "| tiny_choice | acc |  | 100.00 |  |" in (tmp_path / "b" / EVALUATION_MD).read_text()


def test_the_chat_template_path_and_the_few_shot_count(tmp_path: Path, chat_tokenizer: Path) -> None:
    model = _edited(tmp_path / "chat", chat_tokenizer, "flat")
    section = settings(
        tasks=[{"name": "tiny_choice", "limit": 4, "num_fewshot": 1}], apply_chat_template=True, base=False
    )
    report = evaluate(section, model, None, tmp_path / "out")
    # Flat next-token probabilities prefer the shorter (wrong) choice in any prompt format.
    assert report["tasks"]["tiny_choice"]["trained"] == 0.0 and report["tasks"]["tiny_choice"]["limit"] == 4


def test_the_chat_template_is_the_tokenizer_s_own_else_the_sft_format(
    models: dict[str, Path], tmp_path: Path, chat_tokenizer: Path
) -> None:
    """What `simple_evaluate(apply_chat_template=True)` asks the harness's model for: the tokenizer's template, else
    the format `prepare sft` renders chats in (the tiny Llama tokenizer, like Mixtral's base model, has none)."""
    from training.data.chat import MIXTRAL_FALLBACK_TEMPLATE
    from training.local.tiny import BOS, LLAMA3_STYLE_TEMPLATE

    chat = settings(apply_chat_template=True)
    fallback = load_model(models["flat"], chat)
    assert fallback.chat_template(True) == MIXTRAL_FALLBACK_TEMPLATE
    assert fallback.apply_chat_template([{"role": "user", "content": "q a"}]) == f"{BOS}[INST] q a [/INST]"
    assert load_model(tiny_model(tmp_path / "chat", chat_tokenizer), chat).chat_template(True) == LLAMA3_STYLE_TEMPLATE
    assert load_model(models["flat"], settings()).chat_template(True) is None


def test_the_cli_exits_1_naming_the_task_drop_and_limit(models: dict[str, Path], tmp_path: Path) -> None:
    recipe = yaml.safe_load((ROOT / "training/train/recipes/tiny-llama-cpt.yaml").read_text())
    recipe["model"]["config"] = str(models["copier"])
    recipe["evaluate"] = {"tasks": [TINY_TASK], "max_drop": 5}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    command = [sys.executable, "-m", "training", "evaluate", "--recipe", str(path), "--input", str(models["flat"])]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [*command, "--output", str(tmp_path / "run")], capture_output=True, text=True, env=environment
    )
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: evaluation gate failed: tiny_choice: acc 100.00 points worse than the base (100.00 -> 0.00) on 12 "
        "documents (limit), more than max_drop 5"
    ]
    assert json.loads(result.stdout)["gate"]["passed"] is False
    assert (tmp_path / "run" / EVALUATION_JSON).is_file() and (tmp_path / "run" / EVALUATION_MD).is_file()


def test_bad_inputs_are_one_line_and_leave_nothing(models: dict[str, Path], tmp_path: Path) -> None:
    output = tmp_path / "out"
    with pytest.raises(UserError, match=r"^evaluate.tasks: 'no_such_task' not known; allowed: a task of lm-eval 0\.4"):
        evaluate(settings(tasks=[{"name": "no_such_task", "limit": 1}]), models["flat"], None, output)
    with pytest.raises(UserError, match=r"^--input .*missing: not a Hugging Face model directory \(no config.json\)$"):
        evaluate(settings(), tmp_path / "missing", None, output)
    with pytest.raises(UserError, match=r"^--base .*missing: not a Hugging Face model directory"):
        evaluate(settings(), models["flat"], tmp_path / "missing", output)
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "config.json").write_text("{}")
    with pytest.raises(UserError, match=r"^--base .*config-only: no \*\.safetensors weights"):
        evaluate(settings(), models["flat"], tmp_path / "config-only", output)
    with pytest.raises(UserError, match=r"needs a base model: pass --base DIR$"):
        evaluate(settings(max_drop=1.0), models["flat"], None, output)
    assert not output.exists()
    with pytest.raises(UserError, match=r"^evaluate.tasks tiny_choice metric: 'f1' is not reported; allowed: acc$"):
        evaluate(settings(tasks=[{"name": "tiny_choice", "limit": 1, "metric": "f1"}]), models["flat"], None, output)
    assert not (output / EVALUATION_JSON).exists()


def test_a_model_that_cannot_fit_the_node_is_refused_before_loading(models: dict[str, Path], tmp_path: Path) -> None:
    size = weight_bytes(models["flat"], "float32")
    from safetensors.torch import load_file

    tensors = [t for path in models["flat"].glob("*.safetensors") for t in load_file(str(path)).values()]
    assert size == 4 * sum(t.numel() for t in tensors)
    assert weight_bytes(models["flat"], "bfloat16") * 2 == size
    problem = memory_refusal(models["flat"], "float32", 2**30, "--input")
    assert problem is not None and problem.startswith(f"--input {models['flat']}: needs 8 GiB in float32")
    assert memory_refusal(models["flat"], "float32", 64 * 2**30, "--input") is None
    with pytest.raises(UserError, match=r"the node has 1 GiB; allowed: a node with more memory"):
        evaluate(settings(), models["flat"], None, tmp_path, node_bytes=2**30)


def test_recipe_rules_of_the_evaluate_section(tmp_path: Path) -> None:
    from training.config.loading import ConfigError

    def load(evaluate: object, **recipe_changes: object) -> None:
        recipe = yaml.safe_load((ROOT / "training/train/recipes/tiny-llama-cpt.yaml").read_text())
        recipe["evaluate"] = evaluate
        recipe.update(recipe_changes)
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump(recipe))
        load_recipe(str(path))

    bad = {
        "no tasks": ({"tasks": []}, "evaluate.tasks: [] is not allowed; allowed: at least one task"),
        "a task twice": ({"tasks": [TINY_TASK, TINY_TASK]}, "each task once"),
        "a gate without a base": ({"tasks": [TINY_TASK], "base": False, "max_drop": 1}, "set evaluate.base true"),
        "no limit": ({"tasks": [{"name": "tiny_choice"}]}, "evaluate.tasks[0].limit: required key is missing"),
        "a path as a task": ({"tasks": [{"name": "../x", "limit": 1}]}, "an lm-evaluation-harness task name"),
        "a negative gate": ({"tasks": [TINY_TASK], "max_drop": -1}, "evaluate.max_drop"),
    }
    for case, (section, message) in bad.items():
        with pytest.raises(ConfigError) as caught:
            load(section)
        assert message in str(caught.value), case
        assert len(str(caught.value).splitlines()) == 1, case


def test_the_bundled_recipes_name_tasks_of_the_installed_harness() -> None:
    from lm_eval.tasks import TaskManager

    from training.pipeline.evaluate import LOCAL_TASKS

    known = set(TaskManager(include_path=str(LOCAL_TASKS)).all_tasks)
    for name in ("llama31-8b-cpt", "mixtral-8x7b-sft", "tiny-llama-cpt", "tiny-mixtral-sft"):
        section = load_recipe(name).evaluate
        assert section is not None and section.tasks, name
        assert {task.name for task in section.tasks} <= known, name


def test_status_shows_the_gate_of_the_evaluate_stage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from training.pipeline.status import print_status, stage_states

    run_dir = tmp_path / "run-1"
    write_run_record(run_dir, ["evaluate"])
    failure = "tiny_choice: acc 100.00 points worse than the base (100.00 -> 0.00) on 12 documents (limit), more"
    report = {
        "tasks": {"tiny_choice": {"metric": "acc", "trained": 0.0, "base": 1.0, "delta_points": -100.0, "limit": 12}},
        "gate": {"max_drop": 5.0, "passed": False, "failures": [failure]},
    }
    (run_dir / EVALUATION_JSON).write_text(json.dumps(report))
    (row,) = print_status(run_dir)
    assert row["note"] == f"gate FAILED: {failure}" and row["note"] in capsys.readouterr().out
    report["gate"] = {"max_drop": 200.0, "passed": True, "failures": []}
    (run_dir / EVALUATION_JSON).write_text(json.dumps(report))
    (row,) = stage_states(run_dir)
    assert row["note"] == "gate passed (max_drop 200); lowest difference -100.00 points (tiny_choice)"
