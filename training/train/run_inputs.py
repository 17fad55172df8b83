"""What a training run reads and checks before any process group starts: the model, the data, the batch plan.

Every problem is one line naming the recipe key, raised before torchrun's processes build anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from training.config.model import ModelConfig, ModelSpec, Parallelism, check_parallelism, default_kv_multiplier
from training.config.recipe import Recipe
from training.errors import UserError
from training.formats.hf import read_config
from training.model.transformer import Execution
from training.train.backend import TrainingBackend
from training.train.batches import BatchPlan
from training.train.loader import TrainingData, check_data_kind
from training.train.optimizer import zero1_where_it_shards


@dataclass(frozen=True)
class RunInputs:
    """A run's checked inputs; `recipe` as the run trains it (ZeRO-1 off where it would not shard)."""

    recipe: Recipe
    config: ModelConfig  # the model's config.json, parsed once
    config_path: Path
    parallelism: Parallelism
    plan: BatchPlan
    data: TrainingData
    validation: TrainingData | None  # None when the run validates nothing


def check_model_fits(recipe: Recipe, spec: ModelSpec, backend: TrainingBackend) -> Parallelism:
    """The TP layout the recipe asks for, or one line saying why it cannot be (before any process group)."""
    wanted = recipe.parallelism
    multiplier = wanted.kv_size_multiplier or default_kv_multiplier(spec, wanted.tp)
    parallelism = Parallelism(wanted.tp, wanted.pp, multiplier, wanted.fuse_qkv, generation=recipe.generation)
    try:
        check_parallelism(spec, parallelism, "nxd")
    except UserError as error:
        which = f"parallelism.pp {wanted.pp}" if spec.num_layers % wanted.pp else f"parallelism.tp {wanted.tp}"
        raise UserError(f"{which}: {error}") from None
    backend.check_layout(spec, parallelism)
    return parallelism


def execution_of(recipe: Recipe) -> Execution:
    return Execution(
        sequence_parallel=recipe.parallelism.sequence_parallel,
        activation_checkpointing=recipe.memory.activation_checkpointing,
        flash_attention=recipe.memory.flash_attention,
    )


def load_model_config(recipe: Recipe) -> tuple[ModelConfig, Path]:
    """The run's model config, parsed once here (the builder, the FLOPs estimate and the checks take it), and
    the config.json it was read from."""
    directory = Path(recipe.model.config)
    if not directory.is_dir():
        raise UserError(f"model.config {directory}: no such directory (a Hugging Face model with config.json)")
    config, path = read_config(directory, None)
    return ModelConfig.from_hf(config, str(path)), path


def _check_paths(recipe: Recipe) -> None:
    if recipe.model.pretrained and not Path(recipe.model.pretrained).is_dir():
        raise UserError(f"model.pretrained {recipe.model.pretrained}: no such directory (a `convert --to nxd` output)")
    checkpoints = Path(recipe.checkpoint.dir)
    if checkpoints.exists() and not checkpoints.is_dir():
        raise UserError(f"checkpoint.dir {checkpoints}: is a file; allowed: a directory, or a path to create")
    if not Path(recipe.data.path).is_dir():
        raise UserError(f"data.path {recipe.data.path}: no such directory (run `python -m training prepare` first)")


def _open_data(recipe: Recipe) -> tuple[TrainingData, TrainingData | None]:
    data_path = Path(recipe.data.path)
    shuffle_seed = recipe.seed if recipe.data.shuffle else None
    data = TrainingData(data_path, recipe.data.split, recipe.batch.seq_len, shuffle_seed=shuffle_seed, key="data.split")
    prepare_kind = recipe.prepare.kind if recipe.prepare is not None else None
    check_data_kind(data_path, data.kind, data_kind=recipe.data.kind, prepare_kind=prepare_kind)
    validation = None
    if recipe.data.validation_split is not None:  # opened even when unused, so a split that is not there is said
        validation = TrainingData(
            data_path, recipe.data.validation_split, recipe.batch.seq_len, key="data.validation_split"
        )
    return data, validation if recipe.data.validation_every else None


def _batch_plan(recipe: Recipe, data: TrainingData, validation: TrainingData | None) -> BatchPlan:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model_parallel = recipe.parallelism.tp * recipe.parallelism.pp
    if world % model_parallel:
        degrees = f"parallelism.tp {recipe.parallelism.tp}" + (
            f" x parallelism.pp {recipe.parallelism.pp}" if recipe.parallelism.pp > 1 else ""
        )
        raise UserError(
            f"{degrees} does not divide the {world} launched processes "
            "(launch a multiple of tp x pp with torchrun --nproc_per_node)"
        )
    data_path = Path(recipe.data.path)
    plan = BatchPlan(recipe.batch.global_batch, recipe.batch.micro, world // model_parallel)
    plan.check()
    plan.check_rows(data_path, recipe.data.split, len(data), recipe.batch.seq_len)
    if validation is not None:
        assert recipe.data.validation_split is not None
        plan.check_validation_rows(
            data_path, recipe.data.validation_split, len(validation), recipe.data.validation_batches
        )
    return plan


def run_inputs(recipe: Recipe, backend: TrainingBackend) -> RunInputs:
    """The recipe's inputs, checked in the order a user fixes them: the model, the paths, the data, the plan."""
    config, config_path = load_model_config(recipe)
    parallelism = check_model_fits(recipe, config.spec, backend)
    _check_paths(recipe)
    data, validation = _open_data(recipe)
    plan = _batch_plan(recipe, data, validation)
    recipe = zero1_where_it_shards(recipe, plan.dp)
    return RunInputs(recipe, config, config_path, parallelism, plan, data, validation)
