"""The model card export writes into `hf/README.md`: read back with huggingface_hub as the Hub reads it.

The run directory is made by the project's own commands where they are cheap (`prepare`, `sample`, the run
plan `submit` writes as `recipe.yaml`) and a tiny random model stands in for the trained one; the files of the
stages that are expensive or not here (the fetch record of the base model, the evaluation) are written as
their producers write them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import yaml
from huggingface_hub import ModelCard

from training.cli import main
from training.config.recipe import load_recipe, recipe_as_dict
from training.config.site import Site
from training.errors import UserError
from training.local.tiny import sample_documents, tiny_model, write_jsonl
from training.pipeline import card, card_inputs
from training.pipeline.export import export
from training.pipeline.plan import plan_run
from training.software import (
    BOOTSTRAP_SCRIPT,
    CLUSTER_LOCK,
    ENV_MARKER,
    NODE_SOFTWARE,
    Pins,
    running_pins,
)

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)

REPO_ID = "meta-llama/Llama-3.1-8B"
EVALUATION = {
    "tasks": {
        "hellaswag": {"metric": "acc_norm", "trained": 0.5125, "base": 0.52, "delta_points": -0.75, "limit": 400},
        "arc_easy": {"metric": "acc", "trained": 0.61, "base": 0.6, "delta_points": 1.0, "limit": 400},
    },
    "gate": {"max_drop": 2.0, "passed": True, "failures": []},
}


@dataclass(frozen=True)
class Made:
    """What the run's stages made once; each test copies the run directory before changing it."""

    run: Path
    base: Path


def metrics_lines(steps: int) -> str:
    return "".join(
        json.dumps({"step": s, "loss": 5.0 - 0.1 * s, "lr": 1e-3, "tokens_per_second": 512.0, "mfu": 0.3}) + "\n"
        for s in range(1, steps + 1)
    )


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Made:
    from training.local.tiny import train_tokenizer

    root = tmp_path_factory.mktemp("card")
    tokenizer = train_tokenizer(root / "tokenizer")
    base = tiny_model(root / "base", tokenizer)
    # As the fetch stage records a model it downloaded from the Hub.
    (base / card_inputs.FETCH_MANIFEST).write_text(
        json.dumps({"repo_id": REPO_ID, "revision": "d04e592bb4f6aa9cfee91e2e20afa771667e1d4b", "license": "llama3.1"})
    )
    (base / "LICENSE").write_text("LLAMA 3.1 COMMUNITY LICENSE AGREEMENT\n")
    (base / "USE_POLICY.md").write_text("# Llama 3.1 Acceptable Use Policy\n")
    corpus = write_jsonl(root / "corpus.jsonl", ({"text": t} for t in sample_documents(120)))
    overrides = [f"model.config={base}", f"prepare.source={corpus}", "steps=3"]
    recipe = load_recipe("tiny-llama-cpt", overrides)
    site = Site(runs_root=str(root / "runs"))
    plan = plan_run(recipe, site, "run-1")
    run = plan.run_dir
    run.mkdir(parents=True)
    settings = recipe_as_dict(plan.resolved)
    # What `submit` writes before the first sbatch.
    (run / "recipe.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
    record = {
        "run_id": plan.run_id,
        "recipe": recipe.name,
        "recipe_file": "tiny-llama-cpt",
        "overrides": overrides,
        "settings": settings,
        "site": site.model_dump(mode="json"),
        "stages": [s.name for s in plan.stages],
        "submissions": [],
    }
    (run / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    prepare = ["prepare", "pretrain", "--source", str(corpus), "--tokenizer", str(tokenizer)]
    assert main([*prepare, "--output", str(run / "data"), "--seq-len", "32", "--num-proc", "1"]) == 0
    # convert copies neither
    not_converted = shutil.ignore_patterns(card_inputs.FETCH_MANIFEST, "LICENSE", "USE_POLICY.md")
    shutil.copytree(base, run / "hf", ignore=not_converted)  # the trained model
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "metrics.jsonl").write_text(metrics_lines(6))
    sample = ["sample", "--recipe", str(run / "recipe.yaml"), "--input", str(run / "hf")]
    assert main([*sample, "--output", str(run / "samples.json")]) == 0
    (run / "evaluation.json").write_text(json.dumps(EVALUATION, indent=2) + "\n")
    (run / "evaluation.md").write_text("| task | trained | base |\n")
    return Made(run, base)


@pytest.fixture
def run_dir(made: Made, tmp_path: Path) -> Path:
    """A copy of the made run whose recipe points at a copy of the base model, both this test's to change."""
    base = shutil.copytree(made.base, tmp_path / "base")
    run = shutil.copytree(made.run, tmp_path / "runs" / made.run.name)
    recipe = (run / "recipe.yaml").read_text().replace(str(made.base), str(base)).replace(str(made.run), str(run))
    (run / "recipe.yaml").write_text(recipe)
    return run


def exported_card(destination: Path) -> tuple[ModelCard, str]:
    text = (destination / "hf" / "README.md").read_text()
    return ModelCard.load(destination / "hf" / "README.md"), text


def test_the_card_carries_the_licence_the_base_model_and_the_runs_provenance(run_dir: Path, tmp_path: Path) -> None:
    export(run_dir, str(tmp_path / "results"))
    parsed, text = exported_card(tmp_path / "results")
    assert parsed.data.license == "llama3.1" and parsed.data.base_model == REPO_ID
    assert parsed.data.library_name == "transformers" and parsed.data.pipeline_tag == "text-generation"
    assert {"trainium", "continued-pretraining", "llama"} <= set(parsed.data.tags)
    assert parsed.data.datasets is None  # a local corpus is no Hub dataset
    results = {r.dataset_type: (r.metric_type, r.metric_value) for r in parsed.data.eval_results}
    assert results == {"hellaswag": ("acc_norm", 0.5125), "arc_easy": ("acc", 0.61)}

    prepared = json.loads((run_dir / "data" / "manifest.json").read_text())
    assert prepared["tokenizer"]["sha256"] in text
    assert f"| Tokens | {prepared['tokens']:,} |" in text
    assert "d04e592bb4f6aa9cfee91e2e20afa771667e1d4b" in text
    run = json.loads((run_dir / "run.json").read_text())
    assert all(f"- `{override}`" in text for override in run["overrides"])
    assert (run_dir / "recipe.yaml").read_text() in text
    assert f"| Neuron SDK release | `{NODE_SOFTWARE['neuron'].release(BOOTSTRAP_SCRIPT.read_text())}` |" in text
    assert hashlib.sha256(CLUSTER_LOCK.read_bytes()).hexdigest() in text
    assert f"| `torch` | `{metadata.version('torch')}` |" in text
    assert "| `hellaswag` | `acc_norm` | 0.52 | 0.5125 | -0.75 | 400 |" in text
    assert "Gate (largest drop allowed: 2 points): **passed**." in text
    samples = json.loads((run_dir / "samples.json").read_text())["samples"]
    assert samples and all(s["prompt"] in text and s["greedy"].strip() in text for s in samples)

    assert "](metrics.png)" in text  # rendered from hf/ alone: the picture is inside it
    assert (tmp_path / "results" / "hf" / "metrics.png").read_bytes() == (run_dir / "metrics.png").read_bytes()
    for name in ("LICENSE", "USE_POLICY.md"):  # the licence travels with the weights
        assert (tmp_path / "results" / "hf" / name).read_bytes() == (tmp_path / "base" / name).read_bytes()
        assert f"[{name}]({name})" in text
    manifest = json.loads((tmp_path / "results" / "manifest.json").read_text())
    assert {"hf/README.md", "hf/metrics.png", "hf/LICENSE", "evaluation.json", "evaluation.md"} <= set(
        manifest["files"]
    )


def test_exports_of_the_same_run_write_the_same_card_and_reuse_the_output(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    export(run_dir, str(tmp_path / "first"))
    written = (run_dir / "hf" / "README.md").stat().st_mtime_ns
    capsys.readouterr()
    export(run_dir, str(tmp_path / "first"))
    assert json.loads(capsys.readouterr().out)["reused"] is True
    export(run_dir, str(tmp_path / "second"))
    assert (run_dir / "hf" / "README.md").stat().st_mtime_ns == written  # not rewritten
    first, second = (tmp_path / name / "hf" / "README.md" for name in ("first", "second"))
    assert first.read_bytes() == second.read_bytes()
    assert card.card_text(card_inputs.read_inputs(run_dir, plot=True)).encode() == first.read_bytes()


def change_evaluation(run: Path, base: Path) -> str:
    failed = {**EVALUATION, "gate": {"max_drop": 0.5, "passed": False, "failures": ["hellaswag dropped 0.75 points"]}}
    (run / "evaluation.json").write_text(json.dumps(failed))
    return "**failed**"


def change_licence(run: Path, base: Path) -> str:
    record = json.loads((base / card_inputs.FETCH_MANIFEST).read_text())
    (base / card_inputs.FETCH_MANIFEST).write_text(json.dumps({**record, "license": "llama3.2"}))
    return "license: llama3.2"


def change_data(run: Path, base: Path) -> str:
    manifest = json.loads((run / "data" / "manifest.json").read_text())
    (run / "data" / "manifest.json").write_text(json.dumps({**manifest, "data_sha256": "5" * 64}))
    return "5" * 64


def change_samples(run: Path, base: Path) -> str:
    record = {"top_k": 5, "samples": [{"prompt": "p", "greedy": "g", "top_k": "k"}]}
    (run / "samples.json").write_text(json.dumps(record))
    return "Top-5 sampling"


@pytest.mark.parametrize("change", [change_evaluation, change_licence, change_data, change_samples])
def test_a_changed_input_of_the_card_changes_the_card_and_the_exports_fingerprint(
    change: Any, run_dir: Path, tmp_path: Path
) -> None:
    destination = tmp_path / "results"
    export(run_dir, str(destination))
    before = json.loads((destination / "manifest.json").read_text())["fingerprint"]
    shown = change(run_dir, tmp_path / "base")
    with pytest.raises(UserError, match="different inputs"):  # a rerun no longer finds its output reusable
        export(run_dir, str(destination))
    export(run_dir, str(destination), overwrite=True)
    assert json.loads((destination / "manifest.json").read_text())["fingerprint"] != before
    assert shown in exported_card(destination)[1]


def test_a_run_with_only_its_model_gets_a_card_that_says_what_did_not_run(tmp_path: Path, made: Made) -> None:
    run = tmp_path / "bare"
    shutil.copytree(made.run / "hf", run / "hf")
    (run / "run.json").write_text(json.dumps({"run_id": "bare"}) + "\n")
    export(run, str(tmp_path / "results"))
    parsed, text = exported_card(tmp_path / "results")
    assert parsed.data.license == "unknown" and parsed.data.base_model is None and parsed.data.eval_results is None
    for section in ("Training data", "Training loss", "Evaluation", "Samples"):
        assert f"## {section}\n\nNot run:" in text, section
    assert "licence is not recorded" in text and not (tmp_path / "results" / "hf" / "metrics.png").exists()


def test_a_base_model_without_a_fetch_record_is_named_by_its_own_files(tmp_path: Path, made: Made) -> None:
    fetched = shutil.ignore_patterns(card_inputs.FETCH_MANIFEST, "LICENSE", "USE_POLICY.md")
    base = shutil.copytree(made.base, tmp_path / "Mixtral-8x7B", ignore=fetched)
    unknown = card_inputs.read_base_model(base)
    assert (unknown.name, unknown.hub_id, unknown.license, unknown.licence_files) == (
        "Mixtral-8x7B",
        None,
        "unknown",
        (),
    )
    assert "no `fetch-manifest.json`" in (unknown.note or "") and "not recorded" in (unknown.note or "")

    (base / card_inputs.FETCH_MANIFEST).write_text("{not json")  # a damaged record counts as none
    (base / "README.md").write_text("---\nlicense: apache-2.0\nlanguage: [fr, en]\n---\n\n# Mixtral\n")
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "_name_or_path": "mistralai/Mixtral-8x7B-v0.1"}))
    found = card_inputs.read_base_model(base)
    assert (found.hub_id, found.license, found.model_type) == ("mistralai/Mixtral-8x7B-v0.1", "apache-2.0", "llama")
    inputs = card_inputs.CardInputs(run_id="r", recipe_name=None, base=found)
    parsed = ModelCard(card.card_text(inputs))
    assert (parsed.data.license, parsed.data.base_model) == ("apache-2.0", "mistralai/Mixtral-8x7B-v0.1")


def test_a_damaged_input_is_reported_in_its_section_and_the_export_goes_on(
    run_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (run_dir / "evaluation.json").write_text('{"tasks": ')
    (run_dir / "samples.json").write_text("[1, 2]\n")
    with caplog.at_level(logging.WARNING, logger="training"):
        export(run_dir, str(tmp_path / "results"))
    text = exported_card(tmp_path / "results")[1]
    assert "## Evaluation\n\nNot available: evaluation.json: JSONDecodeError" in text
    assert "## Samples\n\nNot available: samples.json: not a JSON object" in text
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2 and all(w.startswith("model card: ") for w in warnings)


def test_a_mix_names_its_sources_shares_and_hub_datasets(made: Made) -> None:
    manifest = json.loads((made.run / "data" / "manifest.json").read_text())
    mix = [
        {"source": "HuggingFaceFW/fineweb-edu:sample-10BT", "weight": 0.7, "token_share": 0.6843},
        {"source": "/fsx/data/code.jsonl", "weight": 0.3, "token_share": 0.3157},
    ]
    data = card_inputs.data_from_manifest({**manifest, "sources": mix, "data_sha256": "a" * 64})
    base = card_inputs.read_base_model(made.base)
    inputs = card_inputs.CardInputs(run_id="r", recipe_name="mix", base=base, data=data)
    text = card.card_text(inputs)
    assert ModelCard(text).data.datasets == ["HuggingFaceFW/fineweb-edu"]
    assert "| `HuggingFaceFW/fineweb-edu:sample-10BT` | 0.7 | 0.6843 |" in text
    assert "| `/fsx/data/code.jsonl` | 0.3 | 0.3157 |" in text and "a" * 64 in text


def test_model_output_cannot_break_out_of_its_block_or_a_table() -> None:
    samples = card_inputs.Samples(3, (card_inputs.Sample("```\n# heading", "a ````` b", "c | d"),))
    evaluation = card_inputs.Evaluation((card_inputs.TaskResult("x|y", "acc", 0.5, None, None, None),), None, None, ())
    base = card_inputs.read_base_model(None)
    inputs = card_inputs.CardInputs(run_id="r", recipe_name=None, base=base, samples=samples, evaluation=evaluation)
    text = card.card_text(inputs)
    assert "``````text\na ````` b\n``````" in text and "````text\n```\n# heading\n````" in text
    assert "| `x\\|y` | `acc` | n/a | 0.5 | n/a | all |" in text
    assert "The gate's verdict is not recorded." in text


def test_the_pins_come_from_the_environment_marker_else_from_the_shipped_source(tmp_path: Path) -> None:
    marker = f"neuron_release=2.28.1\nrequirements_sha256={'b' * 64}\nbuilt=2026-01-01T00:00:00Z\n"
    (tmp_path / ENV_MARKER).write_text(marker)
    marked = running_pins(tmp_path)
    assert marked == Pins("2.28.1", "b" * 64, f"the job's Python environment ({tmp_path / ENV_MARKER})")
    shipped = running_pins(tmp_path / "no-marker")
    assert shipped is not None and shipped.neuron_release == NODE_SOFTWARE["neuron"].release(
        BOOTSTRAP_SCRIPT.read_text()
    )
    assert shipped.lock_sha256 == hashlib.sha256(CLUSTER_LOCK.read_bytes()).hexdigest()
    assert running_pins(tmp_path / "no-marker", root=tmp_path / "installed-without-source") is None
    # A torch-native run's card names the TorchNeuron release and lock the trn2 nodes install.
    native = running_pins(tmp_path / "no-marker", backend="torch-native")
    software = NODE_SOFTWARE["torch-native"]
    assert native is not None and native.neuron_release == software.release() != shipped.neuron_release
    assert native.lock_sha256 == hashlib.sha256(software.lock.read_bytes()).hexdigest()


def test_a_recipe_that_no_longer_loads_is_named_once_and_the_card_still_written(
    run_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (run_dir / "recipe.yaml").write_text("name: edited-by-hand\nsteps: many\n")
    with caplog.at_level(logging.WARNING, logger="training"):
        inputs = card_inputs.read_inputs(run_dir, plot=False)
    assert inputs.base.name == "not recorded" and inputs.recipe_yaml == "name: edited-by-hand\nsteps: many\n"
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warning.startswith(f"model card: {run_dir / 'recipe.yaml'} does not load (") and "steps" in warning
