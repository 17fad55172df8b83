"""The job scripts of a run: one per stage, rendered from `assets/slurm/*.j2` with the plan's resolved recipe
and the site's settings. Every value from a recipe, site file or run id goes through one of the filters of
training.pipeline.quoting; the single-node stages' commands are composed here, the distributed ones (compile,
preflight, train) are the templates' own."""

from __future__ import annotations

import math
import os
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from training.config.backends import FACTS
from training.config.hardware import CHIPS, Hardware
from training.config.precision import NEURON_ENVIRONMENT
from training.config.recipe import Recipe
from training.config.site import Site
from training.config.tracking import tracking_environment
from training.pipeline import timeline
from training.pipeline.plan import TOKENIZER_DIR, RunPlan, Stage, processes_per_node, site_forecast, site_hardware
from training.pipeline.quoting import code_line, sbatch_value, shell_word
from training.pipeline.slurm_client import slurm_prefix
from training.train.watchdog import STOP_FILE

TEMPLATES = Path(os.environ.get("TRAINING_TEMPLATES", Path(__file__).resolve().parents[2] / "assets" / "slurm"))
# torchrun's rendezvous port (MASTER_PORT): one of these, chosen by the job id so that jobs sharing a first node
# (a site without `exclusive`, the local demo) do not collide. They lie below Linux's ephemeral ports (32768-60999,
# net.ipv4.ip_local_port_range), so no outgoing connection of the node holds one when the job starts, and the
# compute nodes reserve them as well (net.ipv4.ip_local_reserved_ports, as neuronx-distributed's launchers reserve
# their 44000): assets/node/on_node_configured.sh spells the same range (RENDEZVOUS_PORTS; a test holds them equal).
RENDEZVOUS_PORTS = range(31000, 31100)
COMMAND_BREAK = " \\\n    "  # between a command's options: one a line in the job script


def stage_command(plan: RunPlan, stage: Stage) -> str:
    """The command a single-node stage runs (the distributed ones are in `distributed.sbatch.j2`), every value
    shell-quoted: paths, sources and the interpreter come from the recipe and the site file."""
    command = STAGE_COMMANDS.get(stage.name)
    if command is None:
        raise ValueError(f"{stage.name} is a distributed stage")
    return command(plan, stage)


def fetch_command(plan: RunPlan, stage: Stage) -> str:
    from training.pipeline.hub import copy_destination

    q, run, site = shell_word, plan.run_dir, plan.site
    arguments = [f"{q(site_python(site))} -m training fetch --recipe {q(str(run / 'recipe.yaml'))}"]
    if stage.name == "fetch-tokenizer":
        arguments.append(f"--tokenizer-only --output {q(str(run / TOKENIZER_DIR))}")
    if site.hub_token_secret_arn:  # the ARN only: the job reads the token itself, into memory
        arguments.append(f"--token-secret-arn {q(site.hub_token_secret_arn)}")
    copy_to = copy_destination(Path(plan.resolved.model.config), site.models_dir, site.models_uri)
    if copy_to and stage.name == "fetch":
        arguments.append(f"--copy-to {q(copy_to)}")
    return COMMAND_BREAK.join(arguments)


def prepare_command(plan: RunPlan, stage: Stage) -> str:
    q, prepare = shell_word, plan.resolved.prepare
    if prepare is None:
        raise ValueError("the prepare stage of a recipe without a prepare section")
    limit = "--max-documents" if prepare.kind == "pretrain" else "--max-examples"
    arguments = [f"{q(site_python(plan.site))} -m training prepare {q(prepare.kind)}"]
    if not prepare.sources:
        arguments.append(f"--source {q(prepare.source)}")
    arguments += [
        f"--tokenizer {q(prepare.tokenizer)}",
        f"--seq-len {int(plan.resolved.batch.seq_len)}",
        f"--output {q(str(plan.run_dir / 'data'))}",
        '--num-proc "$(nproc)"',
    ]
    if prepare.validation:
        arguments.append(f"--validation {q(prepare.validation)}")
    if prepare.max_records:  # before the first --source of a mix: every source's default
        arguments.append(f"{limit} {int(prepare.max_records)}")
    if prepare.sources:
        arguments.append(f"--seed {int(prepare.seed)}")
    for part in prepare.sources or ():  # each --source followed by its own options
        arguments.append(f"--source {q(part.source)} --weight {q(repr(float(part.weight)))}")
        if part.split:
            arguments.append(f"  --split {q(part.split)}")
        if part.max_records:
            arguments.append(f"  {limit} {int(part.max_records)}")
        if part.validation:
            arguments.append(f"  --validation {q(part.validation)}")
    return COMMAND_BREAK.join(arguments)


def logical_core_size(recipe: Recipe, hardware: Hardware | None) -> int:
    """LNC: the instance type's, else the recipe generation's default (NEURON_LOGICAL_NC_CONFIG, `--lnc`)."""
    return hardware.logical_core_size if hardware is not None else CHIPS[recipe.generation].default_lnc


def compiler_target_flags(recipe: Recipe, hardware: Hardware | None) -> tuple[str, ...]:
    """neuronx-cc's target and logical core size, which must match the runtime's (NCC_EARG001 otherwise)."""
    return (f"--target={recipe.generation}", f"--lnc={logical_core_size(recipe, hardware)}")


def convert_in_command(plan: RunPlan, stage: Stage) -> str:
    q, resolved = shell_word, plan.resolved
    parallelism = resolved.parallelism
    arguments = [
        f"{q(site_python(plan.site))} -m training convert --from hf --to nxd",
        f"--input {q(resolved.model.config)}",
        f"--output {q(str(plan.run_dir / 'pretrained_weight'))}",
        f"--tp {int(parallelism.tp)}",
    ]
    if parallelism.pp > 1:
        arguments.append(f"--pp {int(parallelism.pp)}")
    if parallelism.kv_size_multiplier:
        arguments.append(f"--kv-size-multiplier {int(parallelism.kv_size_multiplier)}")
    if parallelism.fuse_qkv:
        arguments.append("--fuse-qkv")
    arguments.append(f"--target {q(resolved.generation)}")  # the K/V replica layout of the run's generation
    if resolved.checkpoint.xser:
        arguments.append("--xser")
    return COMMAND_BREAK.join(arguments)


def convert_out_command(plan: RunPlan, stage: Stage) -> str:
    q, run = shell_word, plan.run_dir
    return (
        f"{q(site_python(plan.site))} -m training convert --from nxd --to hf --input {q(str(run / 'checkpoints'))} "
        f"--output {q(str(run / 'hf'))}"
    )


def sample_command(plan: RunPlan, stage: Stage) -> str:
    q, run = shell_word, plan.run_dir
    return (
        f"{q(site_python(plan.site))} -m training sample --recipe {q(str(run / 'recipe.yaml'))} "
        f"--input {q(str(run / 'hf'))} --output {q(str(run / 'samples.json'))}"
    )


def evaluate_command(plan: RunPlan, stage: Stage) -> str:
    q, run, evaluate = shell_word, plan.run_dir, plan.resolved.evaluate
    base = f" --base {q(plan.resolved.model.config)}" if evaluate is not None and evaluate.base else ""
    return (
        f"{q(site_python(plan.site))} -m training evaluate --recipe {q(str(run / 'recipe.yaml'))} "
        f"--input {q(str(run / 'hf'))}{base} --output {q(str(run))}"
    )


def export_command(plan: RunPlan, stage: Stage) -> str:
    q, site = shell_word, plan.site
    results = f"{site.results.rstrip('/')}/{plan.run_id}"
    command = (
        f"{q(site_python(site))} -m training export --run-dir {q(str(plan.run_dir))} --output {q(results)} --overwrite"
    )
    if site.hub_push_repo:
        command += f"{COMMAND_BREAK}--push-to-hub {q(site.hub_push_repo)}"
        if site.hub_write_token_secret_arn:
            command += f" --hub-token-secret-arn {q(site.hub_write_token_secret_arn)}"
        if not site.hub_private:
            command += " --public"
    return command


STAGE_COMMANDS: dict[str, Callable[[RunPlan, Stage], str]] = {
    "fetch": fetch_command,
    "fetch-tokenizer": fetch_command,
    "prepare": prepare_command,
    "convert-in": convert_in_command,
    "convert-out": convert_out_command,
    "sample": sample_command,
    "evaluate": evaluate_command,
    "export": export_command,
}


def site_python(site: Site) -> str:
    """The interpreter the jobs run: the site's, else this one."""
    return site.python or sys.executable


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
    forecast = site_forecast(plan.recipe, plan.site, plan.model)
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
    python = site_python(site)
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
            # The generation's target and logical core size, the recipe's Neuron settings; the compile cache is
            # the site's, always the last flag.
            "neuron_cc_flags": " ".join(
                (
                    *compiler_target_flags(recipe, hardware),
                    *recipe.neuron.compiler_flags,
                    f"--cache_dir={site.compile_cache}",
                )
            ),
            "logical_nc_config": logical_core_size(recipe, hardware),
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
            # On XLA the compile stage traces every graph ahead of the run; TorchNeuron (torch-native) runs its two
            # steps as they are, a short canary of the run before the long job. (The cpu backend stands in for the
            # neuron one on the local Slurm's Neuron-like sites, the launcher's stand-in with it.)
            precompiles = stage.name == "compile" and site.neuron and FACTS[recipe.backend].precompiled
            context |= {
                "processes_per_node": processes_per_node(recipe, site),
                "rendezvous_ports": RENDEZVOUS_PORTS,
                "launcher": f"{os.path.dirname(python)}/neuron_parallel_compile" if precompiles else "",
                "retry_failed_compilation": recipe.neuron.retry_failed_compilation,
                "train_arguments": "--compile" if stage.name == "compile" else "--resume",
                # The Neuron compile cache kept in the results bucket (training.pipeline.compile_cache).
                "compile_cache_store": site.compile_cache_store if precompiles else None,
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
