"""Training recipes: one typed YAML per run, with `key=value` overrides from the command line.

A recipe names everything a training job needs (model, data, parallelism, batch, optimizer, schedule,
checkpoints, backend) so the compile run and the real run read the same file and cannot drift apart.
Every problem is reported at once as `recipe FILE: key: problem (allowed: ...)` before anything starts.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from training.errors import UserError

RECIPES_DIR = Path(__file__).parent / "recipes"
Decay = Literal["linear", "cosine", "constant"]
Precision = Literal["bf16", "fp32"]
BackendName = Literal["cpu", "neuron"]


@dataclass(frozen=True)
class ModelSection:
    config: str  # Hugging Face model directory (config.json, tokenizer files)
    pretrained: str | None = None  # `convert --to nxd` output; None starts from random weights


@dataclass(frozen=True)
class DataSection:
    path: str  # output directory of `python -m training prepare`
    split: str = "train"


@dataclass(frozen=True)
class ParallelismSection:
    tp: int = 1
    kv_size_multiplier: int | None = None  # None: the smallest that fits (as `convert` chooses)
    fuse_qkv: bool = False


@dataclass(frozen=True)
class BatchSection:
    global_batch: int
    micro: int = 1
    seq_len: int = 2048


@dataclass(frozen=True)
class OptimizerSection:
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    zero1: bool = True


@dataclass(frozen=True)
class ScheduleSection:
    warmup_steps: int = 0
    decay: Decay = "linear"
    min_lr: float = 0.0


@dataclass(frozen=True)
class CheckpointSection:
    dir: str
    every: int = 0  # 0: only at the end
    keep_last: int = 2
    xser: bool = False


@dataclass(frozen=True)
class PrepareSection:
    """How the pipeline's prepare stage makes `data.path` (arguments of `python -m training prepare`)."""

    kind: Literal["pretrain", "sft"]
    source: str  # hub dataset NAME[:CONFIG], or a local file/directory
    tokenizer: str | None = None  # default: model.config
    validation: str | None = None  # sft: a split name or a local file
    max_records: int | None = None  # stop after this many documents/examples (smoke runs)


@dataclass(frozen=True)
class SampleSection:
    """The sample stage's check of the trained model: greedy and top-k continuations of a few prompts."""

    prompts: tuple[str, ...] = ("The capital of France is", "Explain what a GPU is in one sentence.")
    max_new_tokens: int = 48
    top_k: int = 50
    seed: int = 0


@dataclass(frozen=True)
class Recipe:
    name: str
    model: ModelSection
    data: DataSection
    batch: BatchSection
    optimizer: OptimizerSection
    checkpoint: CheckpointSection
    steps: int
    parallelism: ParallelismSection = field(default_factory=ParallelismSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    backend: BackendName = "neuron"
    precision: Precision = "bf16"
    seed: int = 42
    log_every: int = 1
    # Hardware peak for the MFU estimate, per worker process (a NeuronCore-v2 is 95 TFLOPS bf16).
    peak_tflops_per_worker: float = 95.0
    nodes: int = 1  # nodes of the training (and compile) job
    prepare: PrepareSection | None = None  # how the pipeline makes the data (None: data.path exists)
    sample: SampleSection = field(default_factory=SampleSection)


# YAML spells `global` (a Python keyword) for the global batch size.
_ALIASES = {"global": "global_batch"}


def resolve_recipe_path(name_or_path: str) -> Path:
    """A file path, or the name of a bundled recipe (`llama31-8b-cpt` -> training/train/recipes/llama31-8b-cpt.yaml)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    bundled = RECIPES_DIR / f"{name_or_path}.yaml"
    if bundled.is_file():
        return bundled
    available = ", ".join(sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
    raise UserError(f"--recipe {name_or_path}: no such file or bundled recipe (bundled: {available})")


def load_recipe(name_or_path: str, overrides: typing.Sequence[str] = ()) -> Recipe:
    """The recipe with `section.key=value` overrides applied (values parsed as YAML), validated."""
    path = resolve_recipe_path(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise UserError(f"recipe {path}: not valid YAML ({error})".replace("\n", " ")) from None
    if not isinstance(raw, dict):
        raise UserError(f"recipe {path}: expected a mapping of sections, got {type(raw).__name__}")
    for override in overrides:
        apply_override(raw, override, path)
    problems: list[str] = []
    recipe = build_dataclass(Recipe, raw, "", problems)
    if not problems:
        problems += validate(recipe)
    if problems:
        raise UserError(f"recipe {path}: " + "; ".join(problems))
    return typing.cast(Recipe, recipe)


def apply_override(raw: dict[str, Any], override: str, path: Path) -> None:
    key, separator, value = override.partition("=")
    if not separator or not key:
        raise UserError(f"override {override!r}: expected section.key=value (e.g. batch.micro=2)")
    node = raw
    *parents, leaf = key.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"override {override!r}: {part} in recipe {path} is not a section")
        node = child
    try:
        node[leaf] = yaml.safe_load(value) if value else None
    except yaml.YAMLError:
        node[leaf] = value


def validate(recipe: Recipe) -> list[str]:
    """Checks that need no files: the ones that need the model or data run at start-up (`training.train.loop`)."""
    problems = []

    def positive(key: str, value: float) -> None:
        if value <= 0:
            problems.append(f"{key}: {value} must be > 0")

    positive("steps", recipe.steps)
    positive("batch.global", recipe.batch.global_batch)
    positive("batch.micro", recipe.batch.micro)
    positive("batch.seq_len", recipe.batch.seq_len)
    positive("parallelism.tp", recipe.parallelism.tp)
    positive("optimizer.lr", recipe.optimizer.lr)
    positive("log_every", recipe.log_every)
    positive("nodes", recipe.nodes)
    if recipe.batch.micro > 0 and recipe.batch.global_batch % recipe.batch.micro:
        problems.append(
            f"batch.micro: {recipe.batch.micro} does not divide batch.global {recipe.batch.global_batch} "
            f"(allowed: a divisor, e.g. {_divisors(recipe.batch.global_batch)})"
        )
    if recipe.schedule.warmup_steps < 0 or recipe.schedule.warmup_steps > recipe.steps:
        problems.append(f"schedule.warmup_steps: {recipe.schedule.warmup_steps} must be within 0..steps")
    if recipe.checkpoint.every < 0 or recipe.checkpoint.keep_last < 1:
        problems.append("checkpoint: every must be >= 0 and keep_last >= 1")
    if recipe.backend == "cpu" and recipe.precision != "fp32":
        problems.append("precision: bf16 needs backend neuron (the CPU backend runs fp32)")
    if recipe.schedule.min_lr > recipe.optimizer.lr:
        problems.append(f"schedule.min_lr: {recipe.schedule.min_lr} is above optimizer.lr {recipe.optimizer.lr}")
    return problems


def recipe_as_dict(recipe: Recipe) -> dict[str, Any]:
    """The resolved recipe as YAML would spell it (for run records and logs)."""
    data = dataclasses.asdict(recipe)
    data["batch"]["global"] = data["batch"].pop("global_batch")
    return typing.cast(dict[str, Any], json.loads(json.dumps(data)))


def _divisors(number: int) -> str:
    return ", ".join(str(d) for d in range(1, number + 1) if number % d == 0)


def build_dataclass(cls: type, raw: Any, prefix: str, problems: list[str]) -> Any:
    """The frozen dataclass `cls` from a YAML mapping; unknown keys, missing keys and wrong types go to `problems`."""
    if not isinstance(raw, dict):
        problems.append(f"{prefix.rstrip('.') or 'recipe'}: expected a mapping, got {raw!r}")
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    known_problems = len(problems)
    for key, value in raw.items():
        name = _ALIASES.get(str(key), str(key))
        if name not in fields:
            allowed = ", ".join({v: k for k, v in _ALIASES.items()}.get(n, n) for n in fields)
            problems.append(f"{prefix}{key}: unknown key (allowed: {allowed})")
            continue
        values[name] = _coerce(hints[name], value, f"{prefix}{key}", problems)
    for name, spec in fields.items():
        if name not in values and spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            problems.append(f"{prefix}{ {v: k for k, v in _ALIASES.items()}.get(name, name) }: missing")
    return cls(**values) if len(problems) == known_problems else None


def _coerce(hint: Any, value: Any, key: str, problems: list[str]) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return build_dataclass(typing.cast(type, hint), value, f"{key}.", problems)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(inner, value, key, problems)
    if origin is Literal:
        if value not in args:
            problems.append(f"{key}: {value!r} is not allowed (allowed: {', '.join(map(str, args))})")
        return value
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if not isinstance(value, list | tuple):
            problems.append(f"{key}: expected a list, got {value!r}")
            return value
        return tuple(_coerce(args[0], v, key, problems) for v in value)
    if origin is tuple:
        if not isinstance(value, list | tuple) or len(value) != len(args):
            problems.append(f"{key}: expected a list of {len(args)} numbers, got {value!r}")
            return value
        return tuple(_coerce(a, v, key, problems) for a, v in zip(args, value, strict=True))
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint in (str, bool) and isinstance(value, hint):
        return value
    problems.append(f"{key}: expected {getattr(hint, '__name__', hint)}, got {value!r}")
    return value
