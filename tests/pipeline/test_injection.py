"""Nothing from a recipe, a site file, an override or a run id reaches a job script's shell unquoted.

The rendered scripts are run for real with bash, Slurm's and Python's commands replaced by recorders in
directories whose names are hostile too: every value arrives as one intact argument, nothing embedded in a
value runs, and a control character in any field is refused where it is read, with one line.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.system_tools import require_tool
from training.cli import main
from training.config.loading import ONE_LINE, ConfigError
from training.config.recipe import RECIPES_DIR, Recipe, load_recipe
from training.config.site import Site, load_site
from training.errors import UserError
from training.pipeline.plan import plan_run, processes_per_node
from training.pipeline.scripts import RENDEZVOUS_PORTS, render

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)

# A command substitution, a backtick command, both quotes and spaces: in a value, all of it is text.
PAYLOAD = "x $(touch PWNED) `touch PWNED_TICK` ' \" y"
# The same without whitespace or quotes, for what Slurm reads from `#SBATCH` lines and for the compile cache
# (one flag inside NEURON_CC_FLAGS); `${IFS}` would make the space if the shell ever expanded it.
TIGHT = "x$(touch${IFS}PWNED)`touch${IFS}PWNED_TICK`y"
MARKERS = {"PWNED", "PWNED_TICK"}
RUN_ID = "run-1.a_b"
JOB_ID = 7
CONTROL_CHARACTERS = ["\n", "\r", "\x00", "\t", "\x1b"]

# What every stand-in command does first: append its path, arguments and the two variables the scripts set for
# the Neuron tools to $RECORDS, one JSON line.
RECORD = (
    "import json, os, sys\n"
    "entry = {'argv': sys.argv[1:], 'cc_flags': os.environ.get('NEURON_CC_FLAGS'),"
    " 'path': os.environ['PATH'].split(':')[0]}\n"
    "with open(os.environ['RECORDS'], 'a') as records:\n"
    "    records.write(json.dumps(entry) + '\\n')\n"
)
SCONTROL = """case "$1 $2" in
    "show hostnames") echo node-1 ;;
    "show node") echo "NodeName=node-1 NodeAddr=127.0.0.1 State=ALLOCATED" ;;
esac
"""


@dataclass(frozen=True)
class World:
    """Hostile paths, the stand-ins living in them, and where the scripts run."""

    root: Path
    cwd: Path
    records: Path
    python: Path
    slurm_bin: Path
    runs_root: Path
    results: Path
    model: Path
    weights: Path
    tokenizer: Path
    cache: Path

    @property
    def run_dir(self) -> Path:
        return self.runs_root / RUN_ID


def stand_in(path: Path, then: str) -> None:
    """An executable that records how it was called, then runs `then` (shell code)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = f'{shlex.quote(sys.executable)} -c {shlex.quote(RECORD)} "$0" "$@"'
    path.write_text(f"#!/bin/bash\n{record}\n{then}")
    path.chmod(0o755)


@pytest.fixture
def world(tmp_path: Path) -> World:
    root = tmp_path
    python_bin = root / f"env {PAYLOAD}" / "bin"
    slurm_bin = root / f"slurm {PAYLOAD}"
    stand_in(python_bin / "python", 'exit "${FAKE_STATUS:-0}"\n')
    stand_in(python_bin / "neuron_parallel_compile", 'while [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n')
    stand_in(slurm_bin / "srun", 'while [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n')
    stand_in(slurm_bin / "scontrol", SCONTROL)
    cwd = root / "cwd"
    cwd.mkdir()
    return World(
        root=root,
        cwd=cwd,
        records=root / "records.jsonl",
        python=python_bin / "python",
        slurm_bin=slurm_bin,
        runs_root=root / f"runs{TIGHT}",
        results=root / f"results {PAYLOAD}",
        model=root / f"model {PAYLOAD}",
        weights=root / f"weights {PAYLOAD}",
        tokenizer=root / f"tokenizer {PAYLOAD}",
        cache=root / f"cache{TIGHT}",
    )


def hostile_site(world: World, *, neuron: bool) -> Site:
    return Site(
        name=PAYLOAD,
        runs_root=str(world.runs_root),
        results=str(world.results),
        python=str(world.python),
        setup=("echo setup ran > setup-ran",),
        slurm_bin=str(world.slurm_bin),
        partition="compute1",
        cpu_partition="cpu",
        exclusive=True,
        neuron=neuron,
        efa=neuron,
        compile_cache=str(world.cache),
        max_restarts=2,
        time_minutes=60,
    )


def hostile_recipe(world: World, name: str) -> Recipe:
    """A bundled tiny recipe whose name and every path and source are hostile, read from a file as a user's is."""
    raw = yaml.safe_load((RECIPES_DIR / f"{name}.yaml").read_text())
    raw["name"] = PAYLOAD
    raw["model"] = {"config": str(world.model), "pretrained": str(world.weights)}
    raw["prepare"] |= {"source": PAYLOAD, "tokenizer": str(world.tokenizer), "max_records": 5}
    if raw["prepare"]["kind"] == "sft":
        raw["prepare"]["validation"] = PAYLOAD
    path = world.root / "hostile-recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_recipe(str(path))


def run_script(world: World, stage: str, text: str, nodes: int, **environment: str) -> list[dict[str, Any]]:
    """Run one rendered job script as Slurm would start it; the stand-ins' records, in order."""
    script = world.root / "jobs" / f"{stage}.sbatch"
    script.parent.mkdir(exist_ok=True)
    script.write_text(text)
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert syntax.returncode == 0, f"{stage}: {syntax.stderr}"
    # Values such as '$(touch PWNED)' are single-quoted on purpose: shellcheck's note that they do not expand
    # (SC2016) is the point here, anything above a note is not.
    lint = subprocess.run(
        [require_tool("shellcheck"), "-s", "bash", "--severity=warning", str(script)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert lint.returncode == 0, f"{stage}:\n{lint.stdout}"
    world.records.unlink(missing_ok=True)
    (world.run_dir / "state").mkdir(parents=True, exist_ok=True)
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(world.root),
        "RECORDS": str(world.records),
        "SLURM_JOB_ID": str(JOB_ID),
        "SLURM_JOB_NODELIST": "node-1",
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_NODEID": "0",
        **environment,
    }
    result = subprocess.run(
        ["bash", str(script)], cwd=world.cwd, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert_nothing_ran(world)
    assert result.returncode == 0, f"{stage}:\n{result.stdout}\n{result.stderr}"
    return [json.loads(line) for line in world.records.read_text().splitlines()]


def assert_nothing_ran(world: World) -> None:
    ran = [str(path) for path in world.root.rglob("*") if path.name in MARKERS]
    assert not ran, f"an embedded command ran: {ran}"


def expected_python_argv(world: World, recipe: Recipe, site: Site, stage: str, nproc: str) -> list[str]:
    """The interpreter's arguments each stage must arrive at, value by value."""
    run, python = world.run_dir, str(world.python)
    if stage == "prepare":
        argv = [python, "-m", "training", "prepare", recipe.prepare.kind if recipe.prepare else ""]
        argv += ["--source", PAYLOAD, "--tokenizer", str(world.tokenizer), "--seq-len", str(recipe.batch.seq_len)]
        argv += ["--output", f"{run}/data", "--num-proc", nproc]
        if recipe.prepare and recipe.prepare.kind == "sft":
            return [*argv, "--validation", PAYLOAD, "--max-examples", "5"]
        return [*argv, "--max-documents", "5"]
    if stage == "convert-in":
        argv = [python, "-m", "training", "convert", "--from", "hf", "--to", "nxd", "--input", str(world.model)]
        argv += ["--output", f"{run}/pretrained_weight", "--tp", str(recipe.parallelism.tp)]
        argv += ["--pp", str(recipe.parallelism.pp)] if recipe.parallelism.pp > 1 else []
        return [*argv, "--target", recipe.generation]
    if stage in ("compile", "train"):
        argv = [python, "-m", "torch.distributed.run", "--nnodes", str(recipe.nodes), "--node_rank", "0"]
        argv += ["--nproc_per_node", str(processes_per_node(recipe, site)), "--master_addr", "127.0.0.1"]
        argv += ["--master_port", str(RENDEZVOUS_PORTS[JOB_ID % len(RENDEZVOUS_PORTS)]), "-m", "training", "train"]
        return argv + ["--recipe", f"{run}/recipe.yaml", "--compile" if stage == "compile" else "--resume"]
    if stage == "convert-out":
        argv = [python, "-m", "training", "convert", "--from", "nxd", "--to", "hf"]
        return argv + ["--input", f"{run}/checkpoints", "--output", f"{run}/hf"]
    if stage == "evaluate":  # the base model is the hostile model.config, one word
        argv = [python, "-m", "training", "evaluate", "--recipe", f"{run}/recipe.yaml", "--input", f"{run}/hf"]
        return argv + ["--base", str(world.model), "--output", str(run)]
    if stage == "sample":
        argv = [python, "-m", "training", "sample", "--recipe", f"{run}/recipe.yaml"]
        return argv + ["--input", f"{run}/hf", "--output", f"{run}/samples.json"]
    assert stage == "export"
    return [
        *(python, "-m", "training", "export", "--run-dir", str(run)),
        *("--output", f"{world.results}/{RUN_ID}", "--overwrite"),
    ]


@pytest.mark.parametrize("neuron", [False, True], ids=["local-like", "cluster-like"])
@pytest.mark.parametrize("recipe_name", ["tiny-llama-cpt", "tiny-mixtral-sft"])
def test_hostile_values_arrive_intact_and_never_run(world: World, recipe_name: str, neuron: bool) -> None:
    recipe = hostile_recipe(world, recipe_name)
    assert recipe.name == PAYLOAD and recipe.prepare is not None and recipe.prepare.source == PAYLOAD
    site = hostile_site(world, neuron=neuron)
    scripts = render(plan_run(recipe, site, RUN_ID))
    stages = ["prepare", "convert-in", "compile", "preflight", "train", "convert-out", "evaluate", "sample", "export"]
    assert list(scripts) == stages
    preflight = [str(world.python), "-m", "training", "preflight", "--run-dir", str(world.run_dir)]
    for stage, text in scripts.items():
        distributed = stage in ("compile", "train")
        records = run_script(world, stage, text, recipe.nodes if distributed or stage == "preflight" else 1)
        python_calls = [r for r in records if r["argv"][0] == str(world.python)]
        if stage == "preflight":  # on every node (srun), then once; the run directory one word each time
            node, decision = [r["argv"] for r in python_calls]
            assert node == [*preflight, "--node"], records
            if not neuron:
                assert decision == preflight, records
                continue
            # on Neuron the decision starts the canary: the srun after `--`, its torchrun one word for bash -c
            srun = str(world.slurm_bin / "srun")
            assert decision[: len(preflight) + 3] == [*preflight, "--canary", "--", srun], records
            assert decision[-3:-1] == ["bash", "-c"] and "--watch -- " in decision[-1], records
            assert (
                f"--compile --metrics {shlex.quote(str(world.run_dir))}/preflight/canary-metrics.jsonl"
                in (decision[-1])
            )
            continue
        if stage == "train":  # first: are these the checked nodes?
            assert python_calls[0]["argv"] == [*preflight, "--verify"]
            python_calls = python_calls[1:]
        assert len(python_calls) == 1, records
        call = python_calls[0]
        nproc = call["argv"][call["argv"].index("--num-proc") + 1] if stage == "prepare" else ""
        assert nproc.isdigit() == (stage == "prepare")  # `"$(nproc)"`, the one substitution meant to run
        assert call["argv"] == expected_python_argv(world, recipe, site, stage, nproc), stage
        assert (world.run_dir / "state" / f"{stage}.done").is_file()
        assert (world.cwd / "setup-ran").read_text() == "setup ran\n"  # the site's setup line ran, as code
        if neuron:  # the Neuron environment's directory first on PATH, the cache as one flag, both intact
            assert call["path"] == str(world.python.parent)
            assert call["cc_flags"] == f"--target=trn1 --lnc=1 --model-type=transformer --cache_dir={world.cache}"
        if distributed:
            srun = [r["argv"] for r in records if r["argv"][0] == str(world.slurm_bin / "srun")]
            assert len(srun) == 1 and srun[0][1:4] == ["--kill-on-bad-exit=1", "bash", "-c"]
            hosts = [r["argv"][1:] for r in records if r["argv"][0] == str(world.slurm_bin / "scontrol")]
            assert hosts == [["show", "hostnames", "node-1"], ["show", "node", "node-1"]]
            launched = [r["argv"][1:] for r in records if r["argv"][0].endswith("/neuron_parallel_compile")]
            retried = ["--retry_failed_compilation", *call["argv"]]  # the recipe's default, retry on
            assert launched == ([retried] if neuron and stage == "compile" else [])


def test_a_failed_training_job_requeues_itself_through_the_hostile_slurm_path(world: World) -> None:
    recipe = hostile_recipe(world, "tiny-llama-cpt")
    scripts = render(plan_run(recipe, hostile_site(world, neuron=True), RUN_ID))
    records = run_script(world, "train", scripts["train"], 1, FAKE_STATUS="1", SLURM_RESTART_COUNT="1")
    scontrol = [r["argv"][1:] for r in records if r["argv"][0] == str(world.slurm_bin / "scontrol")]
    assert scontrol[-1] == ["requeue", str(JOB_ID)]
    assert not (world.run_dir / "state" / "train.done").exists()


def test_the_submit_dry_run_renders_hostile_overrides_quoted(
    world: World, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CLI path: overrides parsed as YAML, then the same quoting."""
    site = world.root / "site.yaml"
    site.write_text(json.dumps({"runs_root": str(world.runs_root), "python": str(world.python)}))
    monkeypatch.chdir(world.cwd)
    overrides = [f"prepare.source={json.dumps(PAYLOAD)}", f"model.config={json.dumps(str(world.model))}"]
    command = ["submit", "--recipe", "tiny-llama-cpt", "--dry-run", "--run-id", RUN_ID, "--site", str(site)]
    assert main(command + overrides) == 0
    printed = capsys.readouterr().out
    assert f"--source {shlex.quote(PAYLOAD)}" in printed
    assert f"--input {shlex.quote(str(world.model))}" in printed
    assert_nothing_ran(world)


# --- refused where they are read, with one line -------------------------------------------------------------

RECIPE_STRINGS = [
    "name",
    "model.config",
    "model.pretrained",
    "data.path",
    "data.split",
    "data.validation_split",
    "checkpoint.dir",
    "prepare.source",
    "prepare.tokenizer",
    "prepare.validation",
]
SITE_STRINGS = [
    "name",
    "runs_root",
    "results",
    "python",
    "setup",
    "slurm_bin",
    "partition",
    "cpu_partition",
    "instance_type",
    "compile_cache",
]


def one_line(error: UserError) -> str:
    text = str(error)
    assert "\n" not in text and "\r" not in text, text
    return text


@pytest.mark.parametrize("character", CONTROL_CHARACTERS, ids=repr)
@pytest.mark.parametrize("key", RECIPE_STRINGS)
def test_a_control_character_in_a_recipe_override_is_refused(key: str, character: str) -> None:
    value = f"a{character}b"
    with pytest.raises(ConfigError) as raised:
        load_recipe("tiny-llama-cpt", [f"{key}={json.dumps(value)}"])  # YAML's double quotes spell the escape
    label = RECIPES_DIR / "tiny-llama-cpt.yaml"
    assert raised.value.problems == [f"{label}: {key}: {value!r} is not allowed; allowed: {ONE_LINE}"]
    one_line(raised.value)


@pytest.mark.parametrize("key", RECIPE_STRINGS)
def test_a_newline_in_a_recipe_file_is_refused(key: str, tmp_path: Path) -> None:
    raw = yaml.safe_load((RECIPES_DIR / "tiny-llama-cpt.yaml").read_text())
    section, _, leaf = key.rpartition(".")
    (raw[section] if section else raw)[leaf] = "first line\nsecond line"
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as raised:
        load_recipe(str(path))
    assert raised.value.problems == [f"{path}: {key}: 'first line\\nsecond line' is not allowed; allowed: {ONE_LINE}"]


def test_a_raw_newline_in_an_override_is_refused_before_it_is_parsed() -> None:
    with pytest.raises(UserError) as raised:
        load_recipe("tiny-llama-cpt", ["name=a\nb"])
    assert one_line(raised.value).startswith("override: 'name=a\\nb' is not allowed; allowed: section.key=value")


@pytest.mark.parametrize("character", CONTROL_CHARACTERS, ids=repr)
@pytest.mark.parametrize("key", SITE_STRINGS)
def test_a_control_character_in_the_site_file_is_refused(key: str, character: str, tmp_path: Path) -> None:
    value = f"a{character}b"
    path = tmp_path / "site.yaml"
    path.write_text(json.dumps({key: [value] if key == "setup" else value}))  # JSON, as the deployment writes it
    with pytest.raises(ConfigError) as raised:
        load_site(path)
    shown = f"{key}[0]" if key == "setup" else key
    assert len(raised.value.problems) == 1
    assert raised.value.problems[0].startswith(f"{path}: {shown}: {value!r} is not allowed; allowed: ")
    one_line(raised.value)


@pytest.mark.parametrize("run_id", ["a\nb", "run\n", "run\r", "run\x00", "a b", "a$(touch PWNED)", "-x", ""])
def test_a_run_id_that_is_not_a_plain_name_is_refused(run_id: str, world: World) -> None:
    recipe = load_recipe("tiny-llama-cpt")
    with pytest.raises(UserError) as raised:
        plan_run(recipe, hostile_site(world, neuron=False), run_id)
    assert one_line(raised.value).startswith(f"--run-id {run_id!r}: use letters, digits")


def test_a_recipe_name_that_cannot_start_a_run_id_is_named(world: World) -> None:
    recipe = hostile_recipe(world, "tiny-llama-cpt")
    with pytest.raises(UserError) as raised:
        plan_run(recipe, hostile_site(world, neuron=False), None)
    assert one_line(raised.value).startswith(f"name: {PAYLOAD!r} is not allowed; allowed: letters, digits")


# --- #SBATCH lines: Slurm parses them itself, so what it would split is refused, not quoted ------------------


def test_a_runs_root_that_slurm_would_split_is_refused(world: World) -> None:
    site = hostile_site(world, neuron=False).model_copy(update={"runs_root": str(world.root / f"runs {PAYLOAD}")})
    with pytest.raises(UserError) as raised:
        plan_run(load_recipe("tiny-llama-cpt"), site, RUN_ID)
    assert one_line(raised.value).startswith(f"runs_root: {str(world.root / f'runs {PAYLOAD}')!r} is not allowed")


@pytest.mark.parametrize("value", [PAYLOAD, "compute 1", "a#b", "a'b", 'a"b', "a\\b"])
@pytest.mark.parametrize("key", ["partition", "cpu_partition"])
def test_a_partition_that_slurm_would_split_is_refused(key: str, value: str, tmp_path: Path) -> None:
    path = tmp_path / "site.yaml"
    path.write_text(json.dumps({key: value}))
    with pytest.raises(ConfigError) as raised:
        load_site(path)
    assert raised.value.problems == [
        f"{path}: {key}: {value!r} is not allowed; allowed: a Slurm partition name of letters, digits, '_', '.' "
        "and '-' (several: comma-separated) (or omit it)"
    ]


@pytest.mark.parametrize("value", [PAYLOAD, "/fsx/neuron cache", "/fsx/'cache'", "/fsx/c\\d"])
def test_a_compile_cache_that_would_split_the_neuron_flags_is_refused(value: str, tmp_path: Path) -> None:
    path = tmp_path / "site.yaml"
    path.write_text(json.dumps({"compile_cache": value}))
    with pytest.raises(ConfigError) as raised:
        load_site(path)
    assert len(raised.value.problems) == 1 and raised.value.problems[0].startswith(
        f"{path}: compile_cache: {value!r} is not allowed; allowed: a directory path without whitespace"
    )


@pytest.mark.parametrize("only_single_node_stages", [False, True])
@pytest.mark.parametrize(
    "change",
    [{"setup": ("echo a\necho b",)}, {"python": "/usr/bin/python\n3"}, {"partition": "a b", "cpu_partition": None}],
    ids=["setup", "python", "partition"],
)
def test_the_filters_refuse_what_bypassed_the_settings(
    world: World, change: dict[str, Any], only_single_node_stages: bool
) -> None:
    """A value that skipped validation (a bug) fails the rendering instead of reaching a script, in the
    single-node stages' commands as in the templates."""
    broken = Site.model_construct(**(hostile_site(world, neuron=False).model_dump() | change))
    plan = plan_run(load_recipe("tiny-llama-cpt"), broken, RUN_ID)
    if only_single_node_stages:
        plan.stages = [stage for stage in plan.stages if not stage.distributed]
    with pytest.raises(ValueError):
        render(plan)
