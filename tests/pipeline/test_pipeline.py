"""The whole pipeline on the real local Slurm, with the job scripts the cluster runs, under ParallelCluster's
shell conditions (tests/support/parallelcluster_shell.py: Slurm only under the site's prefix, Python only by
its path): both tiny recipes end to end, submitted by the pipeline custom resource's SSM script, a training job
on 2 nodes killed, requeued and resumed to the weights of the uninterrupted one-node run, a failing stage that
cancels its dependants, a failed run resumed by resubmitting it, failed preflights, and a run cancelled by the
custom resource's script."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM

from tests.support.parallelcluster_shell import (
    load_pipeline_handler,
    load_pipeline_trigger_module,
    non_login_environment,
    parallelcluster_path,
    run_script,
)
from training import outputs
from training.config.site import Site
from training.errors import UserError
from training.formats.sharded import recorded_generation
from training.local.tiny import make_tiny_sources
from training.pipeline import timeline
from training.pipeline.run_record import latest_jobs, read_run
from training.pipeline.slurm_client import ACTIVE_STATES, job_info
from training.pipeline.status import print_status, stage_states, unavailable_nodes
from training.pipeline.submit import cancel, queued_jobs, submit, wait
from training.train.loop import KILL_AT_STEP

TIMEOUT = 600
ROOT = Path(__file__).resolve().parents[2]
handler = load_pipeline_handler()
parsing = load_pipeline_trigger_module("trigger_properties")
scripts = load_pipeline_trigger_module("trigger_scripts")


@pytest.fixture(scope="module")
def node_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return parallelcluster_path(tmp_path_factory.mktemp("node-bin"))


@pytest.fixture(scope="module")
def slurm(local_slurm: Any, node_path: str) -> Iterator[Any]:
    """The session's local Slurm; this process (and so every job it submits) sees no Slurm and no Python on
    PATH and no SLURM_CONF, as on a ParallelCluster node: only the site's `slurm_bin` reaches Slurm."""
    saved = dict(os.environ)
    os.environ["PATH"] = node_path
    os.environ.pop("SLURM_CONF", None)
    yield local_slurm
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    root = tmp_path_factory.mktemp("sources")
    return {name: make_tiny_sources(root / name, name) for name in ("llama", "mixtral")}


def overrides(world: dict[str, Path], *extra: str) -> list[str]:
    return [f"model.config={world['hf']}", f"prepare.source={world['source']}", *extra]


def run(recipe: str, world: dict[str, Path], site: Site, run_id: str, *extra: str) -> Path:
    result = submit(recipe, overrides(world, *extra), run_id=run_id, site=site, dry_run=False)
    return Path(result["run_dir"])


def states(run_dir: Path) -> dict[str, str]:
    return {row["stage"]: row["state"] for row in wait(run_dir, timeout=TIMEOUT)}


def model_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted((step_dir / "model").glob("*.pt")):
        tensors |= {f"{file.name}:{k}": v for k, v in torch.load(file, weights_only=True).items()}
    return tensors


@pytest.fixture(scope="module")
def mount(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared file system's mount point; the source the custom resource would fetch is already on it."""
    root = tmp_path_factory.mktemp("fsx")
    (root / "pipeline").mkdir()
    (root / "pipeline" / f"source-{SOURCE_HASH}").symlink_to(ROOT, target_is_directory=True)
    return root


SOURCE_HASH = "0123abcd"
# Tests of the training stage skip the evaluate stage (the reference runs and its own tests cover it).
NO_EVALUATION = "evaluate=null"


@pytest.fixture(scope="module")
def site(slurm: Any, mount: Path) -> Site:
    return Site(
        runs_root=str(mount / "runs"),
        results=str(mount.parent / f"{mount.name}-results"),
        python=sys.executable,
        slurm_bin=str(slurm.bin_dir),
    )


def custom_resource_properties(site: Site, mount: Path, recipe: str, recipe_overrides: list[str], run: int = 1) -> Any:
    """The pipeline custom resource's properties for this machine's "cluster"."""
    return parsing.parse_properties(
        {
            "HeadNodeInstanceId": "i-0123456789abcdef0",
            "ClusterName": "local",
            "StartRun": "true",
            "Recipe": recipe,
            "RecipeOverrides": recipe_overrides,
            "SourceBucket": "results-bucket",
            "SourceKey": f"pipeline/source/{SOURCE_HASH}/",
            "SourceHash": SOURCE_HASH,
            "Run": "1",
            "SiteSettings": json.dumps(site.model_dump(mode="json")),
            "FileSystemId": "fs-0123456789abcdef0",
            "FileSystemMountDir": str(mount),
            "OutputBucket": "results-bucket",
            "OutputPrefix": "pipeline/ssm-output/",
            "TimeoutSeconds": "600",
            "EnvironmentName": "local",
        }
    )


def head_node_script(script: str, node_path: str, tmp_path: Path) -> Any:
    """Run an SSM script on the "head node": a non-login shell with no Slurm and no Python on PATH."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return run_script(script, non_login_environment(node_path, home), cwd=home)


@pytest.fixture(scope="module")
def reference_runs(
    slurm: Any,
    sources: dict[str, dict[str, Path]],
    site: Site,
    mount: Path,
    node_path: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Path]:
    """Both tiny recipes (10 steps, checkpoints every 5), submitted together by the custom resource's SSM
    script and run to the end."""
    submitted = {}
    for name, recipe in (("llama", "tiny-llama-cpt"), ("mixtral", "tiny-mixtral-sft")):
        props = custom_resource_properties(
            site, mount, recipe, overrides(sources[name], "steps=10", "checkpoint.every=5")
        )
        done = head_node_script(
            scripts.submit_script(props, name), node_path, tmp_path_factory.mktemp(f"submit-{name}")
        )
        assert done.returncode == 0, done.stdout + done.stderr
        record = scripts.parse_run_line(done.stdout)
        assert record is not None and record["run_id"] == name, done.stdout
        submitted[name] = Path(site.runs_root) / name
    # Submitting a run that is queued or running does nothing.
    again = submit(
        "tiny-llama-cpt",
        overrides(sources["llama"], "steps=10", "checkpoint.every=5"),
        run_id="llama",
        site=site,
        dry_run=False,
    )
    assert again["submitted"] is False
    return submitted


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_tiny_pipeline_completes_every_stage(name: str, reference_runs: dict[str, Path], site: Site) -> None:
    run_dir = reference_runs[name]
    assert set(states(run_dir).values()) == {"COMPLETED"}, stage_states(run_dir)
    record = json.loads((run_dir / "run.json").read_text())
    stages = ["prepare", "convert-in", "compile", "preflight", "train", "convert-out", "evaluate", "sample", "export"]
    assert record["stages"] == stages
    assert len(record["submissions"]) == 1 and set(record["submissions"][0]["jobs"]) == set(record["stages"])
    # The preflight passed (not a Neuron site: the write speed only) and the training job ran on its nodes.
    checked = json.loads((run_dir / "preflight.json").read_text())
    train_job = record["submissions"][0]["jobs"]["train"]
    assert checked["failure"] is None and checked["pinned"] == f"job {train_job} pinned to {checked['nodelist']}"
    train = job_info(train_job, site.slurm_bin)
    assert train["NodeList"] == train["ReqNodeList"] == checked["nodelist"]
    assert (
        f"preflight: training on the checked nodes {checked['nodelist']}"
        in (run_dir / "logs" / f"train-{train_job}.out").read_text()
    )
    for node in checked["nodes"]:
        checks = checked["results"][node]["checks"]
        assert checks["devices"] == "not applicable (not a Neuron site)"
        assert checks["checkpoint_write"]["bytes_per_second"] > 0 and not checks["checkpoint_write"]["judged"]
    exported = Path(site.results) / name
    model = AutoModelForCausalLM.from_pretrained(exported / "hf")
    assert model.config.num_hidden_layers == 2
    samples = json.loads((exported / "samples.json").read_text())["samples"]
    assert samples and all(s["greedy"] for s in samples)
    metrics = [json.loads(line) for line in (exported / "checkpoints" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 11)) and metrics[-1]["loss"] < metrics[0]["loss"]
    assert (
        (exported / "logs").is_dir() and (exported / "run.json").is_file() and (exported / "timeline.jsonl").is_file()
    )
    card = ModelCard.load(exported / "hf" / "README.md")  # the model card, as the Hub reads it
    assert card.data.license == "unknown" and card.data.pipeline_tag == "text-generation"  # a base without record
    assert {"continued-pretraining" if name == "llama" else "supervised-fine-tuning", "trainium"} <= set(card.data.tags)
    prepared = json.loads((run_dir / "data" / "manifest.json").read_text())
    assert prepared["tokenizer"]["sha256"] in card.text and samples[0]["greedy"].strip() in card.text
    assert "](metrics.png)" in card.text and (exported / "hf" / "metrics.png").is_file()
    evaluation = json.loads((exported / "evaluation.json").read_text())  # the real harness, the local task
    assert list(evaluation["tasks"]) == ["tiny_choice"] and evaluation["tasks"]["tiny_choice"]["limit"] == 24
    assert evaluation["tasks"]["tiny_choice"]["base"] is not None and evaluation["gate"]["max_drop"] == 50
    assert "| tiny_choice | acc |" in (exported / "evaluation.md").read_text()
    # Each stage's job recorded its start and end once in the run's timeline, in the order they ran.
    attempts = timeline.latest_attempts(timeline.read_timeline(run_dir))
    assert sorted(attempts) == sorted(stages) and all(
        a.seconds is not None and a.seconds >= 0 for a in attempts.values()
    )
    assert attempts["compile"].end <= attempts["train"].start <= attempts["train"].end <= attempts["export"].start  # type: ignore[operator]


@pytest.mark.parametrize(("name", "recipe"), [("llama", "tiny-llama-cpt"), ("mixtral", "tiny-mixtral-sft")])
def test_killed_training_job_is_requeued_and_ends_with_identical_weights(
    name: str, recipe: str, reference_runs: dict[str, Path], sources: dict[str, dict[str, Path]], site: Site
) -> None:
    """Both on 2 nodes, killed after step 7 of 10, requeued and resumed from step 5, end bit for bit with the
    weights of the uninterrupted run on 1 node. Llama: 2 nodes x 1 process at TP 2, one TP group across the nodes
    (the same math as 1 node x 2 processes); Mixtral: two pipeline stages, one a node."""
    layouts = {"llama": (site.model_copy(update={"processes_per_node": 1}), ("nodes=2",)), "mixtral": (site, ())}
    two_nodes, nodes = layouts[name]
    os.environ[KILL_AT_STEP] = "7"  # sbatch exports the environment: rank 0 SIGKILLs itself after step 7, once
    try:
        extra = ("steps=10", "checkpoint.every=5", NO_EVALUATION, *nodes)
        run_dir = run(recipe, sources[name], two_nodes, f"{name}-killed", *extra)
    finally:
        del os.environ[KILL_AT_STEP]
    assert set(states(run_dir).values()) == {"COMPLETED"}, stage_states(run_dir)
    job = json.loads((run_dir / "run.json").read_text())["submissions"][0]["jobs"]["train"]
    assert job_info(job, site.slurm_bin).get("Restarts") == "1"
    log = (run_dir / "logs" / f"train-{job}.out").read_text()
    assert "fault injection: rank 0 kills itself after step 7" in log and "requeued to resume" in log
    assert "resumed from step 5" in log
    assert "#SBATCH --nodes=2" in (run_dir / "jobs" / "train.sbatch").read_text()
    if name == "llama":
        assert "2 nodes x 1 processes" in log
    expected = model_tensors(reference_runs[name] / "checkpoints" / "step_10")
    actual = model_tensors(run_dir / "checkpoints" / "step_10")
    assert expected.keys() == actual.keys()
    assert all(torch.equal(value, actual[key]) for key, value in expected.items())


def test_a_run_below_its_throughput_floor_stops_with_the_reason_not_requeued_and_status_shows_it(
    slurm: Any, sources: dict[str, dict[str, Path]], site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    """An expected figure no CPU reaches, with throughput.cancel_below_floor: the train job stops at the first full
    window after the warm-up, is not requeued, its dependants are cancelled, and `status` prints the reason, actual
    against expected and the time to first step from the jobs' own timeline."""
    floor = (
        "throughput.expected_tokens_per_second_per_node=1e12",
        "throughput.warmup_steps=2",
        "throughput.window_steps=2",
        "throughput.cancel_below_floor=true",
    )
    run_dir = run("tiny-llama-cpt", sources["llama"], site, "llama-below-floor", "steps=10", *floor)
    final = states(run_dir)
    assert final["compile"] == "COMPLETED" and final["train"] == "FAILED", final
    assert {final[s] for s in ("convert-out", "evaluate", "sample", "export")} == {"CANCELLED"}
    job = recorded_jobs(run_dir)["train"]
    assert job_info(job, site.slurm_bin).get("Restarts") == "0"
    reason = "throughput below the floor at step 4: actual "
    assert f"train stopped, not requeued: {reason}" in (run_dir / "logs" / f"train-{job}.out").read_text()
    print_status(run_dir)
    printed = capsys.readouterr().out.splitlines()
    assert any(line.startswith(f"train stopped, not requeued: {reason}") for line in printed), printed
    assert any(
        line.startswith("throughput at step 4: actual ") and "per node against expected 1,000,000,000,000 (0%)" in line
        for line in printed
    ), printed
    block = printed[printed.index("time to first step:") + 1 : printed.index("")]  # the failed job's log follows
    names = [line.split()[0] for line in block]
    assert names == ["bootstrap", "prepare", "convert-in", "compile", "preflight", "train", "first-step", "total"], (
        printed
    )
    events = timeline.read_timeline(run_dir)
    assert [(e["stage"], e["event"]) for e in events if e["stage"] in ("compile", "train")] == [
        ("compile", "start"),
        ("compile", "end"),
        ("train", "start"),  # no end: the job failed
    ]


def test_failed_stage_cancels_its_dependants_and_resubmitting_resumes(
    slurm: Any, sources: dict[str, dict[str, Path]], site: Site, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The model directory appears only after the first submission: convert-in fails, prepare (given the
    tokenizer) succeeds, everything after them is cancelled at once; resubmitting runs only what is left."""
    late = tmp_path / "late-model"
    world = {**sources["llama"], "hf": late}
    extra = ("steps=4", "checkpoint.every=2", f"prepare.tokenizer={sources['llama']['tokenizer']}", NO_EVALUATION)
    run_dir = run("tiny-llama-cpt", world, site, "llama-failing", *extra)
    first = states(run_dir)
    assert first["prepare"] == "COMPLETED" and first["convert-in"] == "FAILED"
    cancelled = ("compile", "preflight", "train", "convert-out", "sample", "export")
    assert {first[s] for s in cancelled} == {"CANCELLED"}
    assert print_status(run_dir)
    printed = capsys.readouterr().out
    assert "convert-in ended FAILED; last lines of" in printed and f"--input {late}: no such directory" in printed

    shutil.copytree(sources["llama"]["hf"], late)
    resumed = submit("tiny-llama-cpt", overrides(world, *extra), run_id="llama-failing", site=site, dry_run=False)
    assert list(resumed["jobs"]) == ["convert-in", *cancelled]
    assert resumed["kept"] == {}  # nothing of the failed run was queued any more
    assert set(states(run_dir).values()) == {"COMPLETED"}, stage_states(run_dir)


def test_a_failed_evaluation_still_samples_and_exports_and_status_shows_it(
    slurm: Any, sources: dict[str, dict[str, Path]], site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    """Export waits for evaluate with `afterany`: the evaluate job fails (a task the harness does not know),
    sample and export still run, the export has no evaluation, and what would publish the model is told why."""
    from training.pipeline.evaluate import publish_blocker

    extra = ("steps=2", "checkpoint.every=2", "evaluate.tasks=[{name: no_such_task, limit: 1}]")
    run_dir = run("tiny-llama-cpt", sources["llama"], site, "llama-evaluate-fails", *extra)
    final = states(run_dir)
    assert final["evaluate"] == "FAILED" and final["sample"] == final["export"] == "COMPLETED", final
    exported = Path(site.results) / "llama-evaluate-fails"
    assert (exported / "samples.json").is_file() and not (exported / "evaluation.json").exists()
    assert (
        publish_blocker(run_dir, evaluated=True)
        == f"{run_dir / 'evaluation.json'}: no evaluation (the evaluate stage did not finish)"
    )
    print_status(run_dir)
    printed = capsys.readouterr().out
    assert "evaluate ended FAILED; last lines of" in printed and "'no_such_task' not known" in printed


NEURON_TOOLS = ROOT / "tests" / "support" / "neuron_tools"


@pytest.fixture(scope="module")
def neuron_site(site: Site, tmp_path_factory: pytest.TempPathFactory) -> Site:
    """The site as a Neuron site: the Neuron environment's directory (its `python`, and the stand-ins for
    neuron_parallel_compile and nccom-test beside it, as the environment and aws-neuronx-tools put them on the
    job's PATH), EFA, one process a node."""
    tmp_path = tmp_path_factory.mktemp("neuron-site")
    environment = tmp_path / "neuron-env" / "bin"
    environment.mkdir(parents=True)
    (environment / "python").write_text(f'#!/bin/bash\nexec {sys.executable} "$@"\n')
    (environment / "python").chmod(0o755)
    for tool in NEURON_TOOLS.iterdir():
        (environment / tool.name).symlink_to(tool)
    update = {"python": str(environment / "python"), "neuron": True, "efa": True, "processes_per_node": 1}
    return site.model_copy(update={**update, "compile_cache": str(tmp_path / "neuron-cache")})


# The preflight tests share one run: the first to come submits it whole, the others resubmit it after its failed
# preflight, which runs the preflight and what follows it again (prepare, convert-in and compile are kept).
PREFLIGHT_RUN = "llama-neuron-preflight"
PREFLIGHT_SETTINGS = ("steps=2", "checkpoint.every=2", "nodes=2")


def preflight_drained(slurm: Any) -> dict[str, str]:
    """Nodes a preflight drained, with the reason."""
    reasons = {}
    for line in slurm.run("scontrol", "show", "node", "--oneliner").stdout.splitlines():
        name = line.split("NodeName=", 1)[1].split(" ", 1)[0]
        reason = line.split(" Reason=", 1)[1].split(" [", 1)[0] if " Reason=" in line else ""
        if reason.startswith("preflight:"):
            reasons[name] = reason
    return reasons


@pytest.mark.parametrize(
    ("busbw", "line", "drained"),
    [
        (  # its own all-reduce slow: that node is named and drained
            "1:5.0",
            "preflight: node {slow}: all-reduce within the node bus bandwidth 5.0 GB/s below the floor 21.1 GB/s of "
            "trn1.32xlarge",
            True,
        ),
        (  # each node's own above its floor, the all-reduce across both below EFA's: both named, none drained
            "1:22.0",
            "preflight: nodes {nodes}: all-reduce across 2 nodes bus bandwidth 22.0 GB/s below the floor 23.3 GB/s of "
            "trn1.32xlarge (each node's own checks passed; none drained)",
            False,
        ),
    ],
    ids=["slow-node", "slow-across-nodes"],
)
def test_a_slow_node_fails_the_preflight_in_one_line_and_training_never_starts(
    busbw: str,
    line: str,
    drained: bool,
    slurm: Any,
    sources: dict[str, dict[str, Path]],
    neuron_site: Site,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Neuron site of 2 nodes with their devices (a fake tree); the nccom-test stand-in reports the second
    node's bus bandwidth as given (across nodes: the lower one, learnt over srun in the job's allocation as the
    real Slurm mode runs): the preflight fails in one line with the node and the number, drains a node it can
    name with that reason, and the training job and everything after it is cancelled."""
    from tests.assets.test_on_node_configured import fake_device_tree

    monkeypatch.setenv("DEVICE_ROOT", str(fake_device_tree(tmp_path / "devices", neuron=16, efa=8)))
    monkeypatch.setenv("NCCOM_TEST_STANDIN_BUSBW", busbw)  # sbatch exports the environment to the jobs
    run_dir = run("tiny-llama-cpt", sources["llama"], neuron_site, PREFLIGHT_RUN, *PREFLIGHT_SETTINGS)
    try:
        final = states(run_dir)
        assert final["compile"] == "COMPLETED" and final["preflight"] == "FAILED", final
        assert {final[s] for s in ("train", "convert-out", "evaluate", "sample", "export")} == {"CANCELLED"}
        checked = json.loads((run_dir / "preflight.json").read_text())
        expected = line.format(slow=checked["nodes"][1], nodes=",".join(checked["nodes"]))
        assert checked["failure"] == (f"{expected} (drained)" if drained else expected) and "pinned" not in checked
        assert checked["results"][checked["nodes"][0]]["problems"] == []
        assert preflight_drained(slurm) == ({checked["nodes"][1]: expected} if drained else {})
        assert ("DRAIN" in slurm.node_states()[checked["nodes"][1]]) == drained
        print_status(run_dir)
        printed = capsys.readouterr().out
        job = latest_jobs(read_run(run_dir))["preflight"]
        assert f"{'preflight':<12} {job:>8} {'FAILED':<12}" in printed
        assert printed.count(expected) >= 2  # the stage's note and the tail of its log
    finally:
        for node in preflight_drained(slurm):  # the other tests share the cluster
            slurm.run("scontrol", "update", f"NodeName={node}", "State=RESUME")


def test_compiled_graphs_above_the_memory_plan_fail_the_preflight_and_drain_no_node(
    slurm: Any,
    sources: dict[str, dict[str, Path]],
    neuron_site: Site,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Neuron site of 2 nodes whose checks pass: the canary runs the compile stage's torchrun without
    neuron_parallel_compile on both (two steps, its metrics in <run>/preflight, none in the run's training files)
    while the neuron-monitor stand-in reports 15.2 GiB on a NeuronCore of the second node: the preflight fails in
    one line with the node and both figures, no node is drained, and training never starts."""
    from tests.assets.test_on_node_configured import fake_device_tree
    from training.config.hardware import DEFAULT_HARDWARE
    from training.config.recipe import load_recipe
    from training.pipeline import preflight
    from training.train.memory import planned_gib_per_core

    monkeypatch.setenv("DEVICE_ROOT", str(fake_device_tree(tmp_path / "devices", neuron=16, efa=8)))
    monkeypatch.setenv("NEURON_MONITOR_STANDIN_CORE_GIB", "1:15.2")  # node 0: the stand-in's 1.0 GiB
    run_dir = run("tiny-llama-cpt", sources["llama"], neuron_site, PREFLIGHT_RUN, *PREFLIGHT_SETTINGS)
    try:
        final = states(run_dir)
        assert final["compile"] == "COMPLETED" and final["preflight"] == "FAILED", final
        assert {final[s] for s in ("train", "convert-out", "evaluate", "sample", "export")} == {"CANCELLED"}
        checked = json.loads((run_dir / "preflight.json").read_text())
        first, second = checked["nodes"]
        canary = checked["canary"]
        planned = planned_gib_per_core(load_recipe(str(run_dir / "recipe.yaml")), DEFAULT_HARDWARE)
        assert planned is not None and canary["planned_gib_per_core"] == planned and canary["status"] == 0
        expected = (
            f"preflight: node {second}: the compiled graphs hold 15.2 GiB on a NeuronCore, above the plan's "
            f"{planned:.1f} GiB (+10% allowed) (not the node's fault; none drained)"
        )
        assert checked["failure"] == expected and "pinned" not in checked and "drained" not in checked
        assert canary["results"][first]["status"] == 0 and canary["results"][first]["peak_core_bytes"] == 2**30
        assert canary["memory"] == {second: expected.split(": ", 2)[2].split(" (not")[0]}
        assert preflight_drained(slurm) == {} and not any("DRAIN" in s for s in slurm.node_states().values())
        # the canary ran its two steps, with their metrics apart from the run's training files
        steps = [json.loads(line)["step"] for line in (run_dir / "preflight" / preflight.CANARY_METRICS).open()]
        assert steps == [1, 2]
        compile_metrics = (run_dir / "checkpoints" / "metrics-compile.jsonl").read_text().splitlines()
        assert len(compile_metrics) == 2  # the compile stage's, not appended to by the canary
        assert not (run_dir / "checkpoints" / "metrics.jsonl").exists()
        print_status(run_dir)
        assert expected in capsys.readouterr().out
    finally:
        for node in preflight_drained(slurm):
            slurm.run("scontrol", "update", f"NodeName={node}", "State=RESUME")


RUNUSER = shutil.which("runuser", path="/usr/sbin:/sbin:/usr/bin:/bin")  # the test's own PATH is a node's


def test_a_jobs_owner_may_pin_its_pending_job_but_only_an_operator_drains(slurm: Any) -> None:
    """What the preflight relies on, as Slurm decides it for a user who is no Slurm operator (ParallelCluster's
    cluster user): `scontrol update JobId=... ReqNodeList=...` of the user's own pending job is allowed, a drain
    is refused (the preflight then tries `sudo -n`)."""
    import tempfile

    assert RUNUSER is not None, "runuser (util-linux) is missing"
    shared = Path(tempfile.mkdtemp(prefix="pin-check-", dir="/tmp"))
    try:
        shared.chmod(0o755)
        conf = shared / "slurm.conf"
        shutil.copy(slurm.state_dir / "slurm.conf", conf)
        conf.chmod(0o644)
        (shared / "held.sh").write_text(f"#!/bin/bash\n#SBATCH --output={shared}/held-%j.out\ntrue\n")

        def as_nobody(*command: str) -> subprocess.CompletedProcess[str]:
            environment = {"PATH": "/usr/bin:/bin", "SLURM_CONF": str(conf)}
            runuser = [RUNUSER, "-u", "nobody", "--", "/usr/bin/env", *(f"{k}={v}" for k, v in environment.items())]
            return subprocess.run([*runuser, *command], capture_output=True, text=True, timeout=30, check=False)

        submitted = as_nobody("sbatch", "--parsable", "--hold", f"--chdir={shared}", str(shared / "held.sh"))
        assert submitted.returncode == 0, submitted.stderr
        job = submitted.stdout.strip()
        try:
            node = slurm.nodes[-1]
            assert as_nobody("scontrol", "update", f"JobId={job}", f"ReqNodeList={node}").returncode == 0
            assert f"ReqNodeList={node} " in slurm.run("scontrol", "show", "job", "-o", job).stdout
            refused = as_nobody("scontrol", "update", f"NodeName={node}", "State=DRAIN", "Reason=pin check")
            assert refused.returncode != 0 and "DRAIN" not in slurm.node_states()[node], refused.stderr
        finally:
            slurm.run("scancel", job, check=False)
    finally:
        shutil.rmtree(shared, ignore_errors=True)


# On Trainium2's K/V layout (the tiny recipe's trn2 section: TP 4 over 2 nodes, each KV head on 2 adjacent ranks),
# so that layout runs end to end on every CI run: converted, trained, saved and converted back.
KILLED_SUBMIT_SETTINGS = ("steps=4", "checkpoint.every=2", NO_EVALUATION, "generation=trn2")


def submit_killed_after(stage: str, run_id: str, world: dict[str, Path], site: Site, tmp_path: Path) -> Any:
    """`python -m training submit`, SIGKILLed right after `stage`'s sbatch, before run.json records its job."""
    site_file = tmp_path / "site.yaml"
    site_file.write_text(yaml.safe_dump(site.model_dump(mode="json")))
    command = ["submit", "--recipe", "tiny-llama-cpt", "--site", str(site_file), "--run-id", run_id]
    return subprocess.run(
        [sys.executable, "-m", "training", *command, *overrides(world, *KILLED_SUBMIT_SETTINGS)],
        cwd=ROOT,
        env={**os.environ, outputs.KILL_AT: f"submitted-{stage}"},
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def recorded_jobs(run_dir: Path) -> dict[str, str]:
    return latest_jobs(json.loads((run_dir / "run.json").read_text()))


def test_a_killed_submit_is_completed_by_its_rerun_with_one_job_per_stage(
    slurm: Any, sources: dict[str, dict[str, Path]], site: Site, tmp_path: Path
) -> None:
    """Killed after compile's sbatch: run.json names prepare and convert-in only, yet compile is queued. The
    rerun keeps that job (found by its script in Slurm's queue) and submits the rest behind it: every stage
    runs exactly once and the run completes."""
    killed = submit_killed_after("compile", "llama-killed-submit", sources["llama"], site, tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    run_dir = Path(site.runs_root) / "llama-killed-submit"
    assert list(recorded_jobs(run_dir)) == ["prepare", "convert-in"]
    compile_job = queued_jobs(run_dir, site.slurm_bin).get("compile")
    assert compile_job is not None and compile_job not in recorded_jobs(run_dir).values()

    world = overrides(sources["llama"], *KILLED_SUBMIT_SETTINGS)
    result = submit("tiny-llama-cpt", world, run_id="llama-killed-submit", site=site, dry_run=False)
    assert result["kept"]["compile"] == compile_job  # with prepare and convert-in while they are queued
    assert list(result["jobs"]) == ["preflight", "train", "convert-out", "sample", "export"]  # none kept
    rerun = Path(result["run_dir"])
    assert set(states(rerun).values()) == {"COMPLETED"}, stage_states(rerun)
    assert recorded_jobs(run_dir)["compile"] == compile_job
    logs = sorted(p.name.rsplit("-", 1)[0] for p in (run_dir / "logs").glob("*.out"))
    stages = json.loads((run_dir / "run.json").read_text())["stages"]
    assert logs == sorted(stages), logs  # one job per stage, none submitted twice
    # The trn2 layout throughout: the converter's output and the checkpoints record it, the model comes back whole.
    converted = json.loads((run_dir / "pretrained_weight" / "manifest.json").read_text())
    assert (
        converted["generation"],
        converted["parallelism"]["tp"],
        converted["parallelism"]["kv_size_multiplier"],
    ) == (
        "trn2",
        4,
        2,
    )
    assert recorded_generation(run_dir / "checkpoints" / "step_4") == "trn2"
    assert "2 nodes x 2 processes" in next((run_dir / "logs").glob("train-*.out")).read_text()
    exported = AutoModelForCausalLM.from_pretrained(Path(site.results) / "llama-killed-submit" / "hf")
    assert exported.config.num_key_value_heads == 2


def test_cancel_finds_the_job_a_killed_submit_did_not_record(
    slurm: Any, sources: dict[str, dict[str, Path]], site: Site, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    killed = submit_killed_after("prepare", "llama-killed-early", sources["llama"], site, tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    run_dir = Path(site.runs_root) / "llama-killed-early"
    assert recorded_jobs(run_dir) == {}
    job = queued_jobs(run_dir, site.slurm_bin)["prepare"]
    assert cancel(run_dir) == [job]
    assert queued_jobs(run_dir, site.slurm_bin) == {}
    assert f"cancelled jobs {job}" in capsys.readouterr().out


def test_custom_resource_cancel_stops_every_job_of_the_run(
    slurm: Any,
    sources: dict[str, dict[str, Path]],
    site: Site,
    mount: Path,
    node_path: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Delete's cancel script, on the "head node": it cancels what is queued or running; cancelling again,
    with nothing left to cancel, succeeds too (a finished run must not block the Delete)."""
    from training.cli import main

    props = custom_resource_properties(
        site, mount, "tiny-llama-cpt", overrides(sources["llama"], "steps=4", "checkpoint.every=2")
    )
    submitted = head_node_script(scripts.submit_script(props, "llama-cancelled"), node_path, tmp_path)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    run_dir = Path(site.runs_root) / "llama-cancelled"

    cancelled = head_node_script(scripts.cancel_script(props, "llama-cancelled"), node_path, tmp_path)

    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    jobs = json.loads((run_dir / "run.json").read_text())["submissions"][0]["jobs"]
    assert f"cancelled jobs {', '.join(sorted(jobs.values(), key=int))}" in cancelled.stdout
    final = states(run_dir)
    assert final["train"] == "CANCELLED" and not set(final.values()) & ACTIVE_STATES
    again = head_node_script(scripts.cancel_script(props, "llama-cancelled"), node_path, tmp_path)
    assert again.returncode == 0 and "cancelled jobs (none active)" in again.stdout, again.stderr
    site_file = mount / "pipeline" / "site-local.yaml"
    monkeypatch.setenv("TRAINING_SITE", str(site_file))  # instead of --site
    assert main(["status", "--run-id", "llama-cancelled"]) == 1
    assert "CANCELLED" in capsys.readouterr().out


def test_a_slurm_command_outside_the_site_prefix_is_not_found(site: Site, slurm: Any) -> None:
    """The conditions above are real: without the prefix, this process cannot reach Slurm."""
    assert shutil.which("sbatch") is None and shutil.which("python3") is None
    with pytest.raises(UserError, match="sbatch: not found on PATH"):
        submit("tiny-llama-cpt", [], run_id="no-slurm", site=site.model_copy(update={"slurm_bin": None}), dry_run=False)


def test_unavailable_nodes_are_one_line_per_reason() -> None:
    reasons = (
        "(Code:InsufficientInstanceCapacity)Failure when resuming nodes|down~|compute1-dy-trn1-[1-3]\n"
        "(Code:InsufficientInstanceCapacity)Failure when resuming nodes|down~|compute1-dy-trn1-4\n"
        "neuron devices missing|drained|compute1-st-trn1-1\n"
    )
    assert unavailable_nodes(reasons) == (
        "(Code:InsufficientInstanceCapacity)Failure when resuming nodes (down~): "
        "compute1-dy-trn1-[1-3],compute1-dy-trn1-4; neuron devices missing (drained): compute1-st-trn1-1"
    )
    assert unavailable_nodes("") is None


def test_status_says_why_nodes_cannot_start(
    slurm: Any,
    sources: dict[str, dict[str, Path]],
    site: Site,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A node ParallelCluster could not launch is DOWN with its launch error as the reason: a run waiting for
    it shows that reason in one line of `training status`."""
    reason = "(Code:InsufficientInstanceCapacity)Failure when resuming nodes"
    node = slurm.nodes[-1]
    slurm.run("scontrol", "update", f"NodeName={node}", "State=DOWN", f"Reason={reason}")
    try:
        run_dir = run(
            "tiny-llama-cpt", sources["llama"], site, "llama-no-capacity", "steps=2", "nodes=3", "batch.global=12"
        )
        print_status(run_dir)
        cancel(run_dir)
    finally:
        slurm.run("scontrol", "update", f"NodeName={node}", "State=RESUME")
    printed = capsys.readouterr().out.splitlines()
    expected = f"nodes of partition (default) cannot start: {reason} (down): {node}"
    assert expected in printed, printed
