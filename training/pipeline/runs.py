"""A run as one graph of Slurm jobs: fetch the tokenizer -> prepare || fetch the model -> convert, then compile ->
train -> convert back -> evaluate || sample -> export.

`submit` renders one job script per stage from the recipe and the site settings (`assets/slurm/*.j2`),
submits them with `afterok` dependencies (independent stages in parallel) and records the run in
`<runs_root>/<run_id>/run.json`, rewritten in one rename after each sbatch; a rerun after a killed submit
adopts the jobs it had queued (found by their scripts' paths) and submits the rest. Each job touches
`state/<stage>.done` as its last act, so a failed or cancelled run is resumed from its first unfinished
stage by submitting the same run id again.

Export waits for evaluate with `afterany`, not `afterok`: a failed evaluation gate (or a failed evaluate job)
still leaves the run's model, samples and evaluation table exported to the results bucket; what would publish
the model reads the gate from `evaluation.json` (training.pipeline.evaluate.publish_blocker) instead.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from training import outputs
from training.config.hardware import DEFAULT_HARDWARE, HARDWARE, Hardware
from training.config.loading import has_control_characters, not_allowed
from training.config.precision import NEURON_ENVIRONMENT
from training.config.recipe import Recipe, load_recipe, recipe_as_dict
from training.config.site import Site
from training.config.tracking import tracking_environment
from training.errors import UserError
from training.pipeline import timeline
from training.pipeline.hub import complete_fetch
from training.train.batches import BatchPlan
from training.train.forecast import Forecast, budget_refusal, forecast_of
from training.train.memory import model_config, refusal
from training.train.metrics import METRICS_FILE, read_metrics
from training.train.watchdog import STOP_FILE, floor_line, late_compile_line, read_stop

TEMPLATES = Path(os.environ.get("TRAINING_TEMPLATES", Path(__file__).resolve().parents[2] / "assets" / "slurm"))
ACTIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "RESIZING", "SUSPENDED"}
RUN_ID = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")  # \Z, unlike $, refuses a trailing newline
RUN_ID_STAMP = "%Y%m%d-%H%M%S"
TOKENIZER_DIR = "tokenizer"  # the fetch-tokenizer stage's output in the run directory
# What Slurm's own parser of `#SBATCH` lines would split, unquote, end as a comment or expand (`%j` in a log
# path): such a value cannot be quoted for the shell there, so it is refused instead.
SBATCH_UNSAFE = re.compile(r"[\s'\"\\#%\x00-\x1f\x7f]")
# torchrun's rendezvous port (MASTER_PORT): one of these, chosen by the job id so that jobs sharing a first node
# (a site without `exclusive`, the local demo) do not collide. They lie below Linux's ephemeral ports (32768-60999,
# net.ipv4.ip_local_port_range), so no outgoing connection of the node holds one when the job starts, and the
# compute nodes reserve them as well (net.ipv4.ip_local_reserved_ports, as neuronx-distributed's launchers reserve
# their 44000): assets/node/on_node_configured.sh spells the same range (RENDEZVOUS_PORTS; a test holds them equal).
RENDEZVOUS_PORTS = range(31000, 31100)


@dataclass(frozen=True)
class Stage:
    name: str
    after: tuple[str, ...]  # Slurm `afterok`: these must have succeeded
    distributed: bool = False
    after_any: tuple[str, ...] = ()  # Slurm `afterany`: these must have ended, successfully or not


STAGES = (
    # Recipes with model.hub: the tokenizer first (seconds; prepare reads it), the whole model beside prepare.
    Stage("fetch-tokenizer", ()),
    Stage("fetch", ()),
    Stage("prepare", ("fetch-tokenizer",)),
    Stage("convert-in", ("fetch",)),
    Stage("compile", ("prepare", "convert-in", "fetch"), distributed=True),
    # The training nodes checked before training starts (training/pipeline/preflight.py); site.preflight: false
    # skips it, and train then waits for compile itself.
    Stage("preflight", ("compile",), distributed=True),
    Stage("train", ("compile", "preflight"), distributed=True),
    Stage("convert-out", ("train",)),
    Stage("evaluate", ("convert-out",)),
    Stage("sample", ("convert-out",)),
    Stage("export", ("sample",), after_any=("evaluate",)),
)


@dataclass
class RunPlan:
    run_id: str
    run_dir: Path
    recipe: Recipe
    settings: dict[str, Any]  # the run's recipe, paths resolved: what every job reads
    site: Site
    stages: list[Stage] = field(default_factory=list)


def site_hardware(site: Site) -> Hardware | None:
    """The facts of the site's instance type; None when the site names none (the local demo)."""
    if site.instance_type is None:
        return None
    if site.instance_type not in HARDWARE:
        raise UserError(f"site instance_type {site.instance_type!r} is not supported; allowed: {', '.join(HARDWARE)}")
    return HARDWARE[site.instance_type]


def check_launch(recipe: Recipe, site: Site) -> None:
    """Refuse, in one line, a site whose processes per node cannot run the recipe (what the training job would
    refuse at start-up, after its nodes were paid for)."""
    per_node = processes_per_node(recipe, site)
    hardware = site_hardware(site)
    if hardware is not None and site.neuron and per_node > hardware.cores_per_node:
        raise UserError(
            f"site processes_per_node {per_node} is more than the {hardware.cores_per_node} NeuronCores of "
            f"{hardware.name} (one process a NeuronCore); omit it to use all of them"
        )
    world = per_node * recipe.nodes
    tp, pp = recipe.parallelism.tp, recipe.parallelism.pp
    if world % (tp * pp):
        raise UserError(
            f"parallelism.tp {tp} x parallelism.pp {pp} does not divide the {world} processes of {recipe.nodes} "
            f"node(s) x {per_node} (site processes_per_node{'' if site.processes_per_node else ', by default'})"
        )
    BatchPlan(recipe.batch.global_batch, recipe.batch.micro, world // (tp * pp)).check(processes=world)


def check_memory(recipe: Recipe, site: Site) -> None:
    """Refuse a Neuron recipe that does not fit the NeuronCores' memory, before any job is submitted."""
    if recipe.backend != "neuron":
        return  # the CPU backend (tests, the local demo) has no device memory to plan
    hardware = site_hardware(site) or DEFAULT_HARDWARE
    config = model_config(recipe)
    if config is None:
        print(f"warning: memory not planned: no config.json in model.config {recipe.model.config}", file=sys.stderr)
        return
    problem = refusal(recipe, hardware, config)
    if problem is not None:
        raise UserError(problem)


def site_forecast(recipe: Recipe, site: Site) -> Forecast | None:
    """The run's forecast at the site's cost while training (its nodes' list price when the site has none);
    None for the local demo (no instance type), the CPU backend or an unknown model."""
    hardware = site_hardware(site)
    if hardware is None:
        return None
    if site.node_usd_per_hour is None:
        return forecast_of(recipe, hardware)
    usd = recipe.nodes * site.node_usd_per_hour + (site.environment_usd_per_hour or 0.0)
    basis = "the site's training nodes" + (" and the rest of the environment" if site.environment_usd_per_hour else "")
    return forecast_of(recipe, hardware, usd, basis)


def check_budget(recipe: Recipe, site: Site) -> None:
    """Refuse, in one line, a run forecast above the site's monthly budget; else print the forecast."""
    forecast = site_forecast(recipe, site)
    if forecast is None:
        return
    keys = ("site budget_monthly_usd", "the environment's budget.accept_forecast_usd (site budget_accept_forecast_usd)")
    problem = budget_refusal(forecast, site.budget_monthly_usd, site.budget_accept_forecast_usd, keys)
    if problem is not None:
        raise UserError(problem)
    print(forecast.describe(), file=sys.stderr)


def plan_run(recipe: Recipe, site: Site, run_id: str | None) -> RunPlan:
    """The run's directory, resolved recipe and stages; pure apart from reading the clock for a new id and the
    manifest of data that exists already."""
    if run_id is None:
        stamp = datetime.now(timezone.utc).strftime(RUN_ID_STAMP)
        run_id = f"{recipe.name}-{stamp}"
        if not RUN_ID.fullmatch(run_id):  # the run id comes from the recipe's name: name that key
            longest = 64 - len(stamp) - 1
            raise UserError(
                not_allowed(
                    "name",
                    recipe.name,
                    f"letters, digits, '.', '_' and '-' (at most {longest}) to start a run id, or pass --run-id",
                )
            )
    if not RUN_ID.fullmatch(run_id):
        raise UserError(f"--run-id {run_id!r}: use letters, digits, '.', '_' and '-' (at most 64)")
    runs_root = Path(site.runs_root).absolute()
    if SBATCH_UNSAFE.search(str(runs_root)):
        raise UserError(
            not_allowed(
                "runs_root",
                str(runs_root),
                "a directory path without whitespace, quotes, '\\', '#' or '%' (Slurm reads the job's log path "
                "from its #SBATCH --output line itself)",
            )
        )
    run_dir = runs_root / run_id
    settings = recipe_as_dict(recipe)
    settings["model"]["config"] = str(Path(recipe.model.config).absolute())
    skipped = {"prepare"} if recipe.prepare is None else set()
    skipped |= {"fetch"} if recipe.model.hub is None else set()
    # prepare reads the tokenizer the fetch-tokenizer stage downloads, unless the recipe names another one or the
    # whole model is there already (a new environment importing the bucket's copy: nothing to download)
    fetches_tokenizer = (
        recipe.model.hub is not None
        and recipe.prepare is not None
        and not recipe.prepare.tokenizer
        and complete_fetch(Path(recipe.model.config), recipe.model.hub) is None
    )
    skipped |= set() if fetches_tokenizer else {"fetch-tokenizer"}
    skipped |= {"convert-in"} if recipe.model.pretrained is None else set()
    skipped |= {"evaluate"} if recipe.evaluate is None else set()
    skipped |= set() if site.preflight else {"preflight"}
    stages = [s for s in STAGES if s.name not in skipped]
    if recipe.prepare is not None:
        if recipe.data.kind not in (None, recipe.prepare.kind):  # the train stage would refuse what prepare makes
            raise UserError(
                not_allowed(
                    "data.kind",
                    recipe.data.kind,
                    f"{recipe.prepare.kind} as prepare.kind (the prepare stage makes the run's data), or no data.kind",
                )
            )
        settings["data"]["path"] = str(run_dir / "data")
        if recipe.prepare.source is not None:
            settings["prepare"]["source"] = _absolute_if_local(recipe.prepare.source)
        for part in settings["prepare"]["sources"] or ():
            part["source"] = _absolute_if_local(part["source"])
        tokenizer = (
            run_dir / TOKENIZER_DIR if fetches_tokenizer else Path(recipe.prepare.tokenizer or recipe.model.config)
        )
        settings["prepare"]["tokenizer"] = str(tokenizer.absolute())
    else:
        data_path = Path(recipe.data.path).absolute()
        if recipe.data.kind is not None and (data_path / outputs.MANIFEST).is_file():
            # Imported here: the loader needs torch, which only a recipe with data to check pays for.
            from training.train.loader import check_data_kind, prepared_kind

            if (found := prepared_kind(data_path)) is not None:
                check_data_kind(data_path, found, data_kind=recipe.data.kind, prepare_kind=None)
        settings["data"]["path"] = str(data_path)
    if recipe.model.pretrained is not None:
        settings["model"]["pretrained"] = str(run_dir / "pretrained_weight")
    settings["checkpoint"]["dir"] = str(run_dir / "checkpoints")
    settings["throughput"]["expected_tokens_per_second_per_node"] = expected_tokens_per_node(recipe, site)
    if recipe.evaluate is not None:
        settings["evaluate"]["include"] = [str(Path(directory).absolute()) for directory in recipe.evaluate.include]
    return RunPlan(run_id, run_dir, recipe, settings, site, stages)


def expected_tokens_per_node(recipe: Recipe, site: Site) -> float | None:
    """The throughput floor's expected figure: the recipe's, else the run's forecast on the site's instance type
    (None for the local demo, the CPU backend or a model without a known config.json: no floor)."""
    if recipe.throughput.expected_tokens_per_second_per_node is not None:
        return recipe.throughput.expected_tokens_per_second_per_node
    forecast = site_forecast(recipe, site)
    return None if forecast is None else round(forecast.throughput.expected * recipe.batch.seq_len, 1)


def _absolute_if_local(source: str) -> str:
    return str(Path(source).absolute()) if Path(source).exists() else source


def shell_word(value: Any) -> str:
    """Jinja2 filter `shell`: one value as one shell word. A control character cannot have got this far (the
    settings refuse them when they are read); here it would be a bug, so it fails loudly."""
    text = str(value)
    if has_control_characters(text):
        raise ValueError(f"control character in a value rendered into a job script: {text!r}")
    return shlex.quote(text)


def sbatch_value(value: Any) -> str:
    """Jinja2 filter `sbatch`: a value of an `#SBATCH` line, which Slurm parses itself and the shell never
    sees, so it is checked instead of quoted (runs_root, the run id and the partitions are refused earlier)."""
    text = str(value)
    if SBATCH_UNSAFE.search(text):
        raise ValueError(f"#SBATCH value that Slurm would split or reinterpret: {text!r}")
    return text


def code_line(value: Any) -> str:
    """Jinja2 filter `line`: a line of shell code written as it is (the site file's `setup`), which must stay one
    line."""
    text = str(value)
    if has_control_characters(text):
        raise ValueError(f"control character in a line of shell code: {text!r}")
    return text


def stage_command(plan: RunPlan, stage: Stage) -> str:
    """The command a single-node stage runs (the distributed ones are in `distributed.sbatch.j2`), every value
    shell-quoted: paths, sources and the interpreter come from the recipe and the site file."""
    q = shell_word
    python, run, settings = q(_python(plan.site)), plan.run_dir, plan.settings
    if stage.name in ("fetch", "fetch-tokenizer"):
        from training.pipeline.hub import copy_destination

        site = plan.site
        arguments = [f"{python} -m training fetch --recipe {q(str(run / 'recipe.yaml'))}"]
        if stage.name == "fetch-tokenizer":
            arguments.append(f"--tokenizer-only --output {q(str(run / TOKENIZER_DIR))}")
        if site.hub_token_secret_arn:  # the ARN only: the job reads the token itself, into memory
            arguments.append(f"--token-secret-arn {q(site.hub_token_secret_arn)}")
        copy_to = copy_destination(Path(settings["model"]["config"]), site.models_dir, site.models_uri)
        if copy_to and stage.name == "fetch":
            arguments.append(f"--copy-to {q(copy_to)}")
        return " \\\n    ".join(arguments)
    if stage.name == "prepare":
        prepare = settings["prepare"]
        limit = "--max-documents" if prepare["kind"] == "pretrain" else "--max-examples"
        arguments = [f"{python} -m training prepare {q(prepare['kind'])}"]
        if not prepare.get("sources"):
            arguments.append(f"--source {q(prepare['source'])}")
        arguments += [
            f"--tokenizer {q(prepare['tokenizer'])}",
            f"--seq-len {int(settings['batch']['seq_len'])}",
            f"--output {q(str(run / 'data'))}",
            '--num-proc "$(nproc)"',
        ]
        if prepare.get("validation"):
            arguments.append(f"--validation {q(prepare['validation'])}")
        if prepare.get("max_records"):  # before the first --source of a mix: every source's default
            arguments.append(f"{limit} {int(prepare['max_records'])}")
        if prepare.get("sources"):
            arguments.append(f"--seed {int(prepare['seed'])}")
        for part in prepare.get("sources") or ():  # each --source followed by its own options
            arguments.append(f"--source {q(part['source'])} --weight {q(repr(float(part['weight'])))}")
            if part.get("split"):
                arguments.append(f"  --split {q(part['split'])}")
            if part.get("max_records"):
                arguments.append(f"  {limit} {int(part['max_records'])}")
            if part.get("validation"):
                arguments.append(f"  --validation {q(part['validation'])}")
        return " \\\n    ".join(arguments)
    if stage.name == "convert-in":
        parallelism = settings["parallelism"]
        arguments = [
            f"{python} -m training convert --from hf --to nxd",
            f"--input {q(settings['model']['config'])}",
            f"--output {q(str(run / 'pretrained_weight'))}",
            f"--tp {int(parallelism['tp'])}",
        ]
        if parallelism.get("pp", 1) > 1:
            arguments.append(f"--pp {int(parallelism['pp'])}")
        if parallelism.get("kv_size_multiplier"):
            arguments.append(f"--kv-size-multiplier {int(parallelism['kv_size_multiplier'])}")
        if parallelism.get("fuse_qkv"):
            arguments.append("--fuse-qkv")
        if settings["checkpoint"].get("xser"):
            arguments.append("--xser")
        return " \\\n    ".join(arguments)
    if stage.name == "convert-out":
        return (
            f"{python} -m training convert --from nxd --to hf --input {q(str(run / 'checkpoints'))} "
            f"--output {q(str(run / 'hf'))}"
        )
    if stage.name == "sample":
        return (
            f"{python} -m training sample --recipe {q(str(run / 'recipe.yaml'))} --input {q(str(run / 'hf'))} "
            f"--output {q(str(run / 'samples.json'))}"
        )
    if stage.name == "evaluate":
        base = f" --base {q(settings['model']['config'])}" if settings["evaluate"]["base"] else ""
        return (
            f"{python} -m training evaluate --recipe {q(str(run / 'recipe.yaml'))} --input {q(str(run / 'hf'))}"
            f"{base} --output {q(str(run))}"
        )
    if stage.name == "export":
        results = f"{plan.site.results.rstrip('/')}/{plan.run_id}"
        command = f"{python} -m training export --run-dir {q(str(run))} --output {q(results)} --overwrite"
        site = plan.site
        if site.hub_push_repo:
            command += f" \\\n    --push-to-hub {q(site.hub_push_repo)}"
            if site.hub_write_token_secret_arn:
                command += f" --hub-token-secret-arn {q(site.hub_write_token_secret_arn)}"
            if not site.hub_private:
                command += " --public"
        return command
    raise ValueError(f"{stage.name} is a distributed stage")


def _python(site: Site) -> str:
    return site.python or sys.executable


def processes_per_node(recipe: Recipe, site: Site) -> int:
    """The site's setting; else one process per NeuronCore of the site's instance type; else (no instance type
    known: the local demo) the model-parallel ranks (TP x PP) spread evenly over the recipe's nodes, else one TP
    group a node."""
    if site.processes_per_node:
        return site.processes_per_node
    hardware = site_hardware(site)
    if hardware is not None:
        return hardware.cores_per_node
    model_parallel = recipe.parallelism.tp * recipe.parallelism.pp
    return model_parallel // recipe.nodes if model_parallel % recipe.nodes == 0 else recipe.parallelism.tp


# The preflight's time limit: its checks take seconds; the canary loads the model and runs two steps. Time for a
# slow load (minutes of FSx reads) and three times the two steps' forecast: a hung rendezvous or collective then
# frees the training nodes within the hour instead of holding them without end (a site's `time_minutes` 0).
PREFLIGHT_LOAD_MINUTES = 15
PREFLIGHT_MIN_MINUTES = 30


def stage_time_minutes(stage: Stage, plan: RunPlan) -> int:
    """The job's `--time` (0: no limit): the site's, but a bounded one for the preflight."""
    limit = plan.site.time_minutes
    if stage.name != "preflight":
        return limit
    forecast = site_forecast(plan.recipe, plan.site) if plan.recipe.backend == "neuron" else None
    two_steps = 0.0 if forecast is None else 2 * forecast.step_seconds / 60
    bounded = max(PREFLIGHT_MIN_MINUTES, math.ceil(PREFLIGHT_LOAD_MINUTES + 3 * two_steps))
    return min(limit, bounded) if limit else bounded


def render(plan: RunPlan) -> dict[str, str]:
    """Job script per stage, in submission order: every value from a recipe, site file or run id goes through
    one of the filters `shell` (quoted), `sbatch` (checked) or `line` (the site's own code, checked)."""
    import jinja2

    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined, keep_trailing_newline=True
    )
    environment.filters["shell"] = shell_word
    environment.filters["sbatch"] = sbatch_value
    environment.filters["line"] = code_line
    environment.filters["script"] = shlex.quote  # a composed command, its values already quoted with `shell`
    site, recipe = plan.site, plan.recipe
    hardware = site_hardware(site)
    scripts = {}
    python = _python(site)
    slurm = slurm_prefix(site.slurm_bin)
    for stage in plan.stages:
        if not re.fullmatch(r"[a-z-]+", stage.name):
            raise ValueError(f"stage name {stage.name!r} is written unquoted into job scripts")
        context: dict[str, Any] = {
            "run_id": plan.run_id,
            "run_dir": str(plan.run_dir),
            "stage": stage.name,
            "recipe_name": recipe.name,
            "site_name": site.name,
            "nodes": recipe.nodes if stage.distributed else 1,
            "time_minutes": stage_time_minutes(stage, plan),
            "exclusive": site.exclusive,
            "partition": site.partition if stage.distributed else site.cpu_partition or site.partition,
            "requeue": stage.name == "train",
            "setup": site.setup,
            "neuron": site.neuron,
            "efa": site.efa,
            "compile_cache": site.compile_cache,
            "region": site.region,
            "metrics_namespace": site.metrics_namespace,
            # MLflow and W&B settings (no secret among them): the train stage reports to them.
            "tracking": tracking_environment(site.tracking) if stage.name == "train" else None,
            # The recipe's Neuron settings; the compile cache is the site's, always the last flag.
            "neuron_cc_flags": " ".join((*recipe.neuron.compiler_flags, f"--cache_dir={site.compile_cache}")),
            "inflight_requests": recipe.neuron.inflight_requests,
            "cpus_per_task": hardware.vcpus if stage.distributed and hardware is not None else None,
            "python": python,
            "python_bin": os.path.dirname(python),
            "scontrol": f"{slurm}scontrol",
            "srun": f"{slurm}srun",
            "slurm_bin": site.slurm_bin,
            "timeline_file": timeline.TIMELINE_FILE,
            "bootstrap_end_file": timeline.BOOTSTRAP_END_FILE,
            "stop_file": STOP_FILE,
        }
        if stage.distributed:
            context |= {
                "processes_per_node": processes_per_node(recipe, site),
                "rendezvous_ports": RENDEZVOUS_PORTS,
                "launcher": f"{os.path.dirname(python)}/neuron_parallel_compile"
                if stage.name == "compile" and site.neuron
                else "",
                "retry_failed_compilation": recipe.neuron.retry_failed_compilation,
                "train_arguments": "--compile" if stage.name == "compile" else "--resume",
                # The Neuron compile cache kept in the results bucket (training.pipeline.compile_cache).
                "compile_cache_store": site.compile_cache_store if stage.name == "compile" and site.neuron else None,
                "max_restarts": site.max_restarts,
                "precision": recipe.precision,
                "precision_environment": NEURON_ENVIRONMENT[recipe.precision],
            }
            template = "preflight.sbatch.j2" if stage.name == "preflight" else "distributed.sbatch.j2"
            scripts[stage.name] = environment.get_template(template).render(context)
        else:
            context["command"] = stage_command(plan, stage)
            scripts[stage.name] = environment.get_template("single.sbatch.j2").render(context)
    return scripts


# --- Slurm ----------------------------------------------------------------------------------------------


def slurm_prefix(slurm_bin: str | None) -> str:
    """What goes before a Slurm command's name: its directory, or nothing to find it on PATH."""
    return f"{slurm_bin.rstrip('/')}/" if slurm_bin else ""


def _run_slurm(slurm_bin: str | None, *command: str) -> subprocess.CompletedProcess[str]:
    executable = slurm_prefix(slurm_bin) + command[0]
    try:
        return subprocess.run([executable, *command[1:]], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        where = f"in slurm_bin {slurm_bin}" if slurm_bin else "on PATH (set slurm_bin in the site file)"
        raise UserError(f"{command[0]}: not found {where}; run on a Slurm head node or start the local Slurm") from None


def _slurm(slurm_bin: str | None, *command: str) -> str:
    result = _run_slurm(slurm_bin, *command)
    if result.returncode:
        raise UserError(f"{' '.join(command[:2])} failed: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout


def job_info(job_id: str, slurm_bin: str | None = None) -> dict[str, str]:
    """`scontrol show job -o` as a dict; empty when Slurm no longer knows the job."""
    result = _run_slurm(slurm_bin, "scontrol", "show", "job", "-o", job_id)
    if result.returncode or not result.stdout.strip():
        return {}
    fields: dict[str, str] = {}
    for token in result.stdout.split():
        key, _, value = token.partition("=")
        fields.setdefault(key, value)
    return fields


def run_slurm_bin(run: dict[str, Any]) -> str | None:
    """Where the Slurm that runs a recorded run keeps its commands (the submitting site's)."""
    return (run.get("site") or {}).get("slurm_bin")


def read_run(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "run.json"
    if not path.is_file():
        raise UserError(f"{run_dir}: no run.json (not a run submitted by `python -m training submit`)")
    return dict(json.loads(path.read_text()))


def latest_jobs(run: dict[str, Any]) -> dict[str, str]:
    """Stage -> the job id of its newest submission."""
    jobs: dict[str, str] = {}
    for submission in run.get("submissions", []):
        jobs.update(submission["jobs"])
    return jobs


def submit(recipe_file: str, overrides: list[str], *, run_id: str | None, site: Site, dry_run: bool) -> dict[str, Any]:
    recipe = load_recipe(recipe_file, overrides)
    check_launch(recipe, site)
    check_memory(recipe, site)
    check_budget(recipe, site)
    plan = plan_run(recipe, site, run_id)
    scripts = render(plan)
    if dry_run:
        for stage in plan.stages:
            after = [a for a in stage.after if a in scripts] + [f"{a} (ended)" for a in stage.after_any if a in scripts]
            print(f"# ---- {stage.name} (after: {', '.join(after) or 'nothing'})\n{scripts[stage.name]}")
        return {"run_id": plan.run_id, "run_dir": str(plan.run_dir), "dry_run": True, "stages": list(scripts)}
    previous = read_run(plan.run_dir) if (plan.run_dir / "run.json").is_file() else None
    if previous is not None and previous["settings"] != plan.settings:
        raise UserError(
            f"run {plan.run_id} was submitted with other settings; submit with a new --run-id "
            f"(or the same recipe and overrides to resume it)"
        )
    done = {s.name for s in plan.stages if (plan.run_dir / "state" / f"{s.name}.done").exists()}
    todo = stages_to_submit(plan.stages, done)
    if not todo:
        print(f"run {plan.run_id} has finished every stage; nothing submitted")
        return {"run_id": plan.run_id, "run_dir": str(plan.run_dir), "jobs": {}, "submitted": False}
    queued = queued_jobs(plan.run_dir, site.slurm_bin) if previous is not None else {}
    todo = stages_to_submit(plan.stages, done, set(queued))
    if all(stage.name in queued for stage in todo):
        print(f"run {plan.run_id} is queued or running (jobs {', '.join(queued.values())}); nothing submitted")
        return {"run_id": plan.run_id, "run_dir": str(plan.run_dir), "jobs": queued, "submitted": False}
    for folder in ("jobs", "logs", "state"):
        (plan.run_dir / folder).mkdir(parents=True, exist_ok=True)
    outputs.write_file(plan.run_dir / "recipe.yaml", yaml.safe_dump(plan.settings, sort_keys=False))
    run = previous or {
        "run_id": plan.run_id,
        "recipe": recipe.name,
        "recipe_file": str(Path(recipe_file).absolute()) if Path(recipe_file).exists() else recipe_file,
        "overrides": overrides,
        "settings": plan.settings,
        "site": site.model_dump(mode="json"),
        "stages": [s.name for s in plan.stages],
        "submissions": [],
    }
    # Recorded before the first sbatch and after each one, so a kill loses at most the id of the job just
    # submitted: a rerun adopts it (and `cancel` finds it) by its script's path in Slurm's queue.
    kept = {stage.name: queued[stage.name] for stage in todo if stage.name in queued}
    submission: dict[str, Any] = {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "jobs": dict(kept)}
    run["submissions"].append(submission)
    _record(plan.run_dir, run)
    jobs: dict[str, str] = {}
    for stage in todo:
        if stage.name in kept:
            continue
        script = plan.run_dir / "jobs" / f"{stage.name}.sbatch"
        outputs.write_file(script, scripts[stage.name])
        dependency = dependency_option(stage, submission["jobs"])
        command = ["sbatch", "--parsable"] + ([dependency] if dependency else [])
        jobs[stage.name] = _slurm(site.slurm_bin, *command, str(script)).strip().split(";")[0]
        outputs.kill_point(f"submitted-{stage.name}")
        submission["jobs"][stage.name] = jobs[stage.name]
        _record(plan.run_dir, run)
    resumed = f" (resuming at {todo[0].name})" if previous is not None else ""
    also = f"; kept queued or running: {', '.join(f'{s}={j}' for s, j in kept.items())}" if kept else ""
    print(f"run {plan.run_id}: submitted {', '.join(f'{s}={j}' for s, j in jobs.items())}{resumed}{also}")
    return {"run_id": plan.run_id, "run_dir": str(plan.run_dir), "jobs": jobs, "kept": kept, "submitted": True}


def stages_to_submit(stages: Sequence[Stage], done: set[str], queued: Collection[str] = ()) -> list[Stage]:
    """The unfinished stages; the preflight again whenever a training job is to be submitted, since it may get
    other nodes than those checked before (not for a training job still queued: its preflight pinned it)."""
    again = {"preflight"} if "train" not in done and "train" not in queued else set()
    return [stage for stage in stages if stage.name not in done or stage.name in again]


def dependency_option(stage: Stage, jobs: dict[str, str]) -> str | None:
    """sbatch's `--dependency` for a stage given the jobs submitted so far (stages finished earlier have none):
    `afterok` on what must succeed, `afterany` on what must only have ended, both required (a comma)."""
    parts = []
    for kind, names in (("afterok", stage.after), ("afterany", stage.after_any)):
        ids = [jobs[name] for name in names if name in jobs]
        if ids:
            parts.append(f"{kind}:{':'.join(ids)}")
    return f"--dependency={','.join(parts)}" if parts else None


def _record(run_dir: Path, run: dict[str, Any]) -> None:
    outputs.write_file(run_dir / "run.json", json.dumps(run, indent=2) + "\n")


def queued_jobs(run_dir: Path, slurm_bin: str | None) -> dict[str, str]:
    """Stage -> the newest queued or running job whose batch script is this run's, recorded or not."""
    found: dict[str, str] = {}
    scripts = {str(run_dir / "jobs" / f"{stage.name}.sbatch"): stage.name for stage in STAGES}
    listing = _slurm(slurm_bin, "squeue", "--noheader", "--format=%i|%T|%o")
    for line in listing.splitlines():
        job, _, rest = line.strip().partition("|")
        state, _, command = rest.partition("|")
        stage = scripts.get(command)
        if stage is not None and state in ACTIVE_STATES and job.isdigit():
            found[stage] = max(found.get(stage, job), job, key=int)
    return found


def find_run_dir(site: Site, run_id: str | None) -> Path:
    root = Path(site.runs_root).absolute()
    if run_id:
        if not RUN_ID.fullmatch(run_id):  # a name under runs_root, never a path out of it
            raise UserError(f"--run-id {run_id!r}: use letters, digits, '.', '_' and '-' (at most 64)")
        return root / run_id
    runs = sorted((p for p in root.glob("*/run.json")), key=lambda p: p.stat().st_mtime) if root.is_dir() else []
    if not runs:
        raise UserError(f"no runs under {root}")
    return runs[-1].parent


def stage_states(run_dir: Path) -> list[dict[str, Any]]:
    """Per stage: job id, Slurm state, elapsed time, and for the training stage the last logged metrics."""
    run = read_run(run_dir)
    jobs = latest_jobs(run)
    rows = []
    for stage in run["stages"]:
        job = jobs.get(stage, "")
        info = job_info(job, run_slurm_bin(run)) if job else {}
        done = (run_dir / "state" / f"{stage}.done").exists()
        state = info.get("JobState") or ("COMPLETED" if done else "UNKNOWN")
        row: dict[str, Any] = {"stage": stage, "job": job, "state": state, "elapsed": info.get("RunTime", "")}
        if info.get("Reason") and info["Reason"] != "None":
            row["reason"] = info["Reason"]
        if stage == "train" and (run_dir / "checkpoints" / METRICS_FILE).is_file():
            try:
                total_steps = (run.get("settings") or {}).get("steps")
                progress = training_progress(run_dir / "checkpoints" / METRICS_FILE, total_steps)
            except UserError as error:
                row["note"] = str(error)
            else:
                if state not in ACTIVE_STATES:  # an ETA only while the job is queued or running
                    progress["eta_seconds"] = progress["seconds_per_step"] = None
                row["metrics"] = progress
                eta = progress["eta_seconds"]
                total = progress["total_steps"] or "?"
                speed = progress["tokens_per_second"]
                row["note"] = (
                    f"step {progress['step']}/{total} loss {progress['loss']:.4f}"
                    + (f" {speed:,.0f} tokens/s" if speed is not None else "")
                    + (f" ETA {format_duration(eta)}" if eta else "")
                )
        if stage == "evaluate" and (run_dir / "evaluation.json").is_file():
            row["note"] = evaluation_note(run_dir / "evaluation.json")
        if stage == "preflight" and (run_dir / "preflight.json").is_file():
            from training.pipeline.preflight import note

            row["note"] = note(run_dir / "preflight.json")
        if state not in ("COMPLETED", "PENDING", "RUNNING", "UNKNOWN") and job:
            log = run_dir / "logs" / f"{stage}-{job}.out"
            row["log"] = str(log)
            row["log_tail"] = log.read_text(errors="replace").splitlines()[-10:] if log.is_file() else []
        rows.append(row)
    return rows


def evaluation_note(path: Path) -> str:
    """One line of the evaluate stage's outcome for `status`: the gate's verdict and the worst difference."""
    try:
        report = json.loads(path.read_text())
        verdict, rows = report["gate"], report["tasks"]
    except (ValueError, KeyError, TypeError):
        return f"{path}: not an evaluation report"
    deltas = [(row["delta_points"], name) for name, row in rows.items() if row.get("delta_points") is not None]
    worst = f"; lowest difference {min(deltas)[0]:+.2f} points ({min(deltas)[1]})" if deltas else ""
    if verdict.get("max_drop") is None:
        return f"{len(rows)} tasks evaluated, no gate{worst}"
    if verdict.get("passed"):
        return f"gate passed (max_drop {verdict['max_drop']:g}){worst}"
    return f"gate FAILED: {'; '.join(verdict['failures'])}"


ETA_WINDOW = 20  # intervals between logged steps whose pace the ETA assumes


def eta_seconds(points: Sequence[tuple[int, float]], total_steps: int, window: int = ETA_WINDOW) -> float | None:
    """Seconds from the last logged step to step `total_steps`, at the median pace (seconds per step) of the last
    `window` intervals between logged (step, time) points in step order. The median ignores the one long
    interval a restart leaves (requeue, resume: loading, compiling). 0 once the last step is logged; None
    without two points a step apart to measure a pace."""
    if not points:
        return None
    last_step = points[-1][0]
    if last_step >= total_steps:
        return 0.0
    recent = points[-(window + 1) :]
    paces = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in itertools.pairwise(recent) if s1 > s0 and t1 > t0]
    if not paces:
        return None
    return statistics.median(paces) * (total_steps - last_step)


def format_duration(seconds: float) -> str:
    """'45s', '5m10s', '2h05m', '3d04h'."""
    whole = round(seconds)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def training_progress(metrics: Path, total_steps: int | None) -> dict[str, Any]:
    """The last logged values of a training job's metrics file (the validation loss from the last step that
    measured it) and the ETA of step `total_steps` (None when unknown)."""
    records = read_metrics(metrics)
    last = records[-1]
    progress: dict[str, Any] = {"step": int(last["step"]), "total_steps": total_steps}
    for key in ("loss", "lr", "grad_norm", "tokens_per_second", "seq_per_second", "mfu", "moe_dropped"):
        progress[key] = last.get(key)
    validated = [r for r in records if r.get("validation_loss") is not None]
    if validated:
        progress["validation_loss"] = validated[-1]["validation_loss"]
        progress["validation_step"] = validated[-1]["step"]
    timed = [(int(r["step"]), float(r["time"])) for r in records if isinstance(r.get("time"), int | float)]
    progress["seconds_per_step"] = None
    progress["eta_seconds"] = eta_seconds(timed, total_steps) if total_steps else None
    if progress["eta_seconds"] and total_steps:
        progress["seconds_per_step"] = progress["eta_seconds"] / (total_steps - progress["step"])
    return progress


def describe_progress(progress: dict[str, Any]) -> str:
    """One line of a training job's last logged values, for `status`."""
    total = progress.get("total_steps")
    parts = [f"loss {progress['loss']:.4f}"]
    if progress.get("validation_loss") is not None:
        parts.append(f"validation loss {progress['validation_loss']:.4f} (step {progress['validation_step']})")
    if progress.get("lr") is not None:
        parts.append(f"learning rate {progress['lr']:.2e}")
    if progress.get("grad_norm") is not None:
        parts.append(f"grad norm {progress['grad_norm']:.3f}")
    if progress.get("tokens_per_second") is not None:
        parts.append(f"{progress['tokens_per_second']:,.0f} tokens/s")
    if progress.get("mfu") is not None:
        parts.append(f"MFU {100 * progress['mfu']:.1f}%")
    if progress.get("moe_dropped") is not None:
        parts.append(f"MoE dropped {100 * progress['moe_dropped']:.2f}%")
    line = f"train at step {progress['step']}" + (f" of {total}" if total else "") + ": " + ", ".join(parts)
    eta = progress.get("eta_seconds")
    if eta:
        line += f"; ETA {format_duration(eta)} ({progress['seconds_per_step']:.2f} s/step recently)"
    return line


def train_records(run_dir: Path) -> list[dict[str, Any]]:
    """The train stage's metrics records, none while it has logged no step."""
    try:
        return read_metrics(run_dir / "checkpoints" / METRICS_FILE)
    except UserError:
        return []  # no step logged yet (the table's note says why when there is a file)


def watch_lines(run_dir: Path) -> list[str]:
    """What the training job found in itself (training.train.watchdog): its stop, a late compilation, its
    throughput against the expected figure."""
    settings = read_run(run_dir).get("settings") or {}
    stop = read_stop(run_dir / "checkpoints")
    lines = [f"train stopped, not requeued: {stop['reason']}"] if stop else []
    records = train_records(run_dir)
    late = [r for r in records if r.get("late_compilations")]
    if late and not (stop and "compile cache missed" in stop["reason"]):
        last = late[-1]
        lines.append(
            late_compile_line(int(last.get("late_compilation_step", last["step"])), int(last["late_compilations"]))
        )
    throughput = settings.get("throughput") or {}
    expected = throughput.get("expected_tokens_per_second_per_node")
    measured = [r for r in records if r.get("throughput_fraction") is not None]
    if expected and measured:
        fraction = float(measured[-1]["throughput_fraction"])
        line = floor_line(fraction * float(expected), float(expected), fraction, float(throughput["floor_fraction"]))
        lines.append(f"throughput at step {measured[-1]['step']}: {line}")
    elif expected and records:
        lines.append(
            f"throughput: expected {float(expected):,.0f} tokens/s per node, compared after "
            f"{throughput.get('warmup_steps')} steps of warm-up and a window of {throughput.get('window_steps')}"
        )
    return lines


def timeline_lines(run_dir: Path) -> list[str]:
    """The "time to first step" block (training.pipeline.timeline), from the run's timeline and metrics."""
    events = timeline.read_timeline(run_dir)
    if not events:
        return []
    attempts = timeline.latest_attempts(events)
    train = attempts.get(timeline.TRAIN)
    first = timeline.first_step_time(train_records(run_dir), train.start) if train is not None else None
    return timeline.describe(read_run(run_dir)["stages"], attempts, first)


def unavailable_nodes(sinfo_reasons: str) -> str | None:
    """One line from `sinfo --list-reasons --format=%E|%T|%N`: why nodes are down or drained, e.g.
    ParallelCluster's "(Code:InsufficientInstanceCapacity)Failure when resuming nodes"; None if none are."""
    problems: dict[str, list[str]] = {}
    for line in sinfo_reasons.splitlines():
        reason, _, rest = line.partition("|")
        state, _, nodes = rest.partition("|")
        if reason.strip() and nodes.strip():
            problems.setdefault(f"{reason.strip()} ({state.strip().lower()})", []).append(nodes.strip())
    if not problems:
        return None
    return "; ".join(f"{reason}: {','.join(nodes)}" for reason, nodes in problems.items())


def partition_problem(run: dict[str, Any]) -> str | None:
    """Why nodes of the run's partitions (Trainium and CPU stages) cannot start, from Slurm's node reasons
    (capacity, quota, health)."""
    site = run.get("site") or {}
    partitions = ",".join(dict.fromkeys(p for p in (site.get("partition"), site.get("cpu_partition")) if p))
    command = ["sinfo", "--noheader", "--list-reasons", "--format=%E|%T|%N"]
    result = _run_slurm(run_slurm_bin(run), *command, *(["--partition", partitions] if partitions else []))
    if result.returncode:
        return None
    problem = unavailable_nodes(result.stdout)
    return f"nodes of partition {partitions or '(default)'} cannot start: {problem}" if problem else None


def print_status(run_dir: Path) -> list[dict[str, Any]]:
    rows = stage_states(run_dir)
    print(f"run {run_dir.name} ({run_dir})")
    if any(row["state"] == "PENDING" for row in rows):
        problem = partition_problem(read_run(run_dir))
        if problem:
            print(problem)
    print(f"{'stage':<12} {'job':>8} {'state':<12} {'elapsed':>10}  note")
    for row in rows:
        note = row.get("note") or row.get("reason") or ""
        print(f"{row['stage']:<12} {row['job']:>8} {row['state']:<12} {row['elapsed']:>10}  {note}")
    for row in rows:
        if row.get("metrics"):
            print(describe_progress(row["metrics"]))
    for line in watch_lines(run_dir) + timeline_lines(run_dir):
        print(line)
    for row in rows:
        if row.get("log"):
            print(f"\n{row['stage']} ended {row['state']}; last lines of {row['log']}:")
            print("\n".join(f"  {line}" for line in row["log_tail"]))
    return rows


def cancel(run_dir: Path) -> list[str]:
    """Cancel the run's queued and running jobs; a failed scancel is an error, never ignored.

    Jobs Slurm has finished or forgotten are left out: scancel fails on an id it no longer knows. Jobs of
    the run's scripts that run.json does not record (a submit killed right after an sbatch) are found in
    Slurm's queue and cancelled too.
    """
    run = read_run(run_dir)
    slurm_bin = run_slurm_bin(run)
    every = sorted({j for submission in run["submissions"] for j in submission["jobs"].values()}, key=int)
    recorded = {job for job in every if job_info(job, slurm_bin).get("JobState") in ACTIVE_STATES}
    jobs = sorted(recorded | set(queued_jobs(run_dir, slurm_bin).values()), key=int)
    if jobs:
        _slurm(slurm_bin, "scancel", *jobs)
    print(f"run {run_dir.name}: cancelled jobs {', '.join(jobs) or '(none active)'}")
    return jobs


def wait(run_dir: Path, timeout: float, poll: float = 1.0) -> list[dict[str, Any]]:
    """Stage states once no job of the run is queued or running (or the timeout passed)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = stage_states(run_dir)
        if not any(row["state"] in ACTIVE_STATES for row in rows) or time.monotonic() > deadline:
            return rows
        time.sleep(poll)
