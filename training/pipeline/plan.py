"""A run as one graph of Slurm jobs: fetch the tokenizer -> prepare || fetch the model -> convert, then compile ->
preflight -> train -> convert back -> evaluate || sample -> export.

This module plans a run: its stages (`STAGES`, each one Slurm job, with its `afterok`/`afterany` dependencies),
the checks `submit` makes before anything is queued (launch shape, memory, budget), and the resolved recipe every
job reads (`RunPlan.resolved`: the recipe with its paths made absolute and placed in the run directory).
training.pipeline.scripts renders the plan's job scripts and training.pipeline.submit queues them.

Export waits for evaluate with `afterany`, not `afterok`: a failed evaluation gate (or a failed evaluate job)
still leaves the run's model, samples and evaluation table exported to the results bucket; what would publish
the model reads the gate from `evaluation.json` (training.pipeline.evaluate.publish_blocker) instead.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from training import outputs
from training.config.backends import FACTS
from training.config.hardware import DEFAULT_HARDWARE, HARDWARE, Generation, Hardware
from training.config.loading import not_allowed
from training.config.model import ModelConfig
from training.config.recipe import PrepareSection, Recipe
from training.config.site import Site
from training.errors import UserError
from training.pipeline.hub import complete_fetch
from training.pipeline.quoting import SBATCH_UNSAFE
from training.pipeline.run_record import RUN_ID
from training.train.batches import BatchPlan
from training.train.forecast import Forecast, budget_refusal, forecast_of
from training.train.memory import model_config, refusal

RUN_ID_STAMP = "%Y%m%d-%H%M%S"
TOKENIZER_DIR = "tokenizer"  # the fetch-tokenizer stage's output in the run directory


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
    recipe: Recipe  # as the user wrote it (with the overrides)
    resolved: Recipe  # the run's recipe, paths resolved: what every job reads (the run's recipe.yaml)
    site: Site
    stages: list[Stage] = field(default_factory=list)
    model: ModelConfig | None = None  # the model's config.json, parsed once (None: not planned, or unknown)


def site_hardware(site: Site) -> Hardware | None:
    """The facts of the site's instance type; None when the site names none (the local demo)."""
    if site.instance_type is None:
        return None
    if site.instance_type not in HARDWARE:
        raise UserError(f"site instance_type {site.instance_type!r} is not supported; allowed: {', '.join(HARDWARE)}")
    return HARDWARE[site.instance_type]


def site_generation(site: Site) -> Generation | None:
    """The Trainium generation of the site's instance type; None for a site that names none."""
    hardware = site_hardware(site)
    return None if hardware is None else hardware.generation


def check_launch(recipe: Recipe, site: Site) -> None:
    """Refuse, in one line, a site whose processes per node cannot run the recipe (what the training job would
    refuse at start-up, after its nodes were paid for)."""
    per_node = processes_per_node(recipe, site)
    hardware = site_hardware(site)
    if hardware is not None and recipe.generation != hardware.generation:
        raise UserError(
            not_allowed(
                "generation",
                recipe.generation,
                f"{hardware.generation}, the generation of the site's {hardware.name} (or omit it: submit takes it "
                "from the site)",
            )
        )
    on_trainium = FACTS[recipe.backend].on_trainium
    if site.backend is not None and on_trainium and recipe.backend != site.backend:
        raise UserError(
            not_allowed(
                "backend",
                recipe.backend,
                f"{site.backend}, the backend the site's nodes have software for (its recipes pick it by generation; "
                f"a cluster for {recipe.backend} is an environment with compute.backend: {recipe.backend})",
            )
        )
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


def planned_model(recipe: Recipe) -> ModelConfig | None:
    """The model's config.json, read once for the run's checks and forecast: only on Trainium (the CPU backend,
    tests and the local demo, has no device memory or price to plan), None when the model is not known."""
    return model_config(recipe) if FACTS[recipe.backend].on_trainium else None


def check_memory(plan: RunPlan) -> None:
    """Refuse a Neuron recipe that does not fit the NeuronCores' memory, before any job is submitted."""
    if not FACTS[plan.recipe.backend].on_trainium:
        return
    if plan.model is None:
        where = plan.recipe.model.config
        print(f"warning: memory not planned: no config.json in model.config {where}", file=sys.stderr)
        return
    problem = refusal(plan.recipe, site_hardware(plan.site) or DEFAULT_HARDWARE, plan.model)
    if problem is not None:
        raise UserError(problem)


def site_forecast(recipe: Recipe, site: Site, model: ModelConfig | None) -> Forecast | None:
    """The run's forecast at the site's cost while training (its nodes' list price when the site has none);
    None for the local demo (no instance type), the CPU backend or an unknown model (`model` None)."""
    hardware = site_hardware(site)
    if hardware is None or model is None:
        return None
    if site.node_usd_per_hour is None:
        return forecast_of(recipe, hardware, config=model)
    usd = recipe.nodes * site.node_usd_per_hour + (site.environment_usd_per_hour or 0.0)
    basis = "the site's training nodes" + (" and the rest of the environment" if site.environment_usd_per_hour else "")
    return forecast_of(recipe, hardware, usd, basis, config=model)


def check_budget(plan: RunPlan) -> None:
    """Refuse, in one line, a run forecast above the site's monthly budget; else print the forecast."""
    site = plan.site
    forecast = site_forecast(plan.recipe, site, plan.model)
    if forecast is None:
        return
    keys = ("site budget_monthly_usd", "the environment's budget.accept_forecast_usd (site budget_accept_forecast_usd)")
    problem = budget_refusal(forecast, site.budget_monthly_usd, site.budget_accept_forecast_usd, keys)
    if problem is not None:
        raise UserError(problem)
    print(forecast.describe(), file=sys.stderr)


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


def plan_run(recipe: Recipe, site: Site, run_id: str | None) -> RunPlan:
    """The run's directory, resolved recipe and stages; pure apart from reading the clock for a new id and the
    manifest of data that exists already."""
    run_id = new_run_id(recipe) if run_id is None else run_id
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
    # prepare reads the tokenizer the fetch-tokenizer stage downloads, unless the recipe names another one or the
    # whole model is there already (a new environment importing the bucket's copy: nothing to download)
    fetches_tokenizer = (
        recipe.model.hub is not None
        and recipe.prepare is not None
        and not recipe.prepare.tokenizer
        and complete_fetch(Path(recipe.model.config), recipe.model.hub) is None
    )
    skipped = {"prepare"} if recipe.prepare is None else set()
    skipped |= {"fetch"} if recipe.model.hub is None else set()
    skipped |= set() if fetches_tokenizer else {"fetch-tokenizer"}
    skipped |= {"convert-in"} if recipe.model.pretrained is None else set()
    skipped |= {"evaluate"} if recipe.evaluate is None else set()
    skipped |= set() if site.preflight else {"preflight"}
    stages = [s for s in STAGES if s.name not in skipped]
    model = planned_model(recipe)
    resolved = resolve_recipe(recipe, site, run_dir, model, fetches_tokenizer=fetches_tokenizer)
    return RunPlan(run_id, run_dir, recipe, resolved, site, stages, model)


def new_run_id(recipe: Recipe) -> str:
    """The recipe's name and the time; a name that cannot start a run id is refused by its key."""
    stamp = datetime.now(timezone.utc).strftime(RUN_ID_STAMP)
    run_id = f"{recipe.name}-{stamp}"
    if not RUN_ID.fullmatch(run_id):
        longest = 64 - len(stamp) - 1
        raise UserError(
            not_allowed(
                "name",
                recipe.name,
                f"letters, digits, '.', '_' and '-' (at most {longest}) to start a run id, or pass --run-id",
            )
        )
    return run_id


def resolve_recipe(
    recipe: Recipe, site: Site, run_dir: Path, config: ModelConfig | None, *, fetches_tokenizer: bool
) -> Recipe:
    """The recipe every job of the run reads: local paths absolute, the run's own outputs (data, converted
    weights, checkpoints) in its directory, and the throughput floor's expected figure filled in."""
    data = recipe.data.model_copy(update={"path": str(Path(recipe.data.path).absolute())})
    prepare = recipe.prepare
    if prepare is not None:
        if recipe.data.kind not in (None, prepare.kind):  # the train stage would refuse what prepare makes
            raise UserError(
                not_allowed(
                    "data.kind",
                    recipe.data.kind,
                    f"{prepare.kind} as prepare.kind (the prepare stage makes the run's data), or no data.kind",
                )
            )
        data = recipe.data.model_copy(update={"path": str(run_dir / "data")})
        tokenizer = run_dir / TOKENIZER_DIR if fetches_tokenizer else Path(prepare.tokenizer or recipe.model.config)
        prepare = resolve_prepare(prepare, tokenizer)
    else:
        check_prepared_kind(recipe, Path(data.path))
    model = recipe.model.model_copy(update={"config": str(Path(recipe.model.config).absolute())})
    if recipe.model.pretrained is not None:
        model = model.model_copy(update={"pretrained": str(run_dir / "pretrained_weight")})
    expected = expected_tokens_per_node(recipe, site, config)
    update: dict[str, object] = {
        "model": model,
        "data": data,
        "prepare": prepare,
        "checkpoint": recipe.checkpoint.model_copy(update={"dir": str(run_dir / "checkpoints")}),
        "throughput": recipe.throughput.model_copy(update={"expected_tokens_per_second_per_node": expected}),
    }
    if recipe.evaluate is not None:
        include = tuple(str(Path(directory).absolute()) for directory in recipe.evaluate.include)
        update["evaluate"] = recipe.evaluate.model_copy(update={"include": include})
    return recipe.model_copy(update=update)


def resolve_prepare(prepare: PrepareSection, tokenizer: Path) -> PrepareSection:
    """The prepare stage's sources (local ones absolute) and the tokenizer it reads."""
    update: dict[str, object] = {"tokenizer": str(tokenizer.absolute())}
    if prepare.source is not None:
        update["source"] = absolute_if_local(prepare.source)
    if prepare.sources is not None:
        update["sources"] = tuple(
            part.model_copy(update={"source": absolute_if_local(part.source)}) for part in prepare.sources
        )
    return prepare.model_copy(update=update)


def check_prepared_kind(recipe: Recipe, data_path: Path) -> None:
    """Refuse data of the other kind than the recipe's data.kind, when the data exists already."""
    if recipe.data.kind is None or not (data_path / outputs.MANIFEST).is_file():
        return
    # Imported here: the loader needs torch, which only a recipe with data to check pays for.
    from training.train.loader import check_data_kind, prepared_kind

    if (found := prepared_kind(data_path)) is not None:
        check_data_kind(data_path, found, data_kind=recipe.data.kind, prepare_kind=None)


def expected_tokens_per_node(recipe: Recipe, site: Site, model: ModelConfig | None) -> float | None:
    """The throughput floor's expected figure: the recipe's, else the run's forecast on the site's instance type
    (None for the local demo, the CPU backend or a model without a known config.json: no floor)."""
    if recipe.throughput.expected_tokens_per_second_per_node is not None:
        return recipe.throughput.expected_tokens_per_second_per_node
    forecast = site_forecast(recipe, site, model)
    return None if forecast is None else round(forecast.throughput.expected * recipe.batch.seq_len, 1)


def absolute_if_local(source: str) -> str:
    return str(Path(source).absolute()) if Path(source).exists() else source
