"""Training recipes: one typed YAML per run, with `key=value` overrides from the command line.

A recipe names everything a training job needs (model, data, parallelism, batch, optimizer, schedule,
checkpoints, backend), so the compile run, the real run and every pipeline stage read the same file and
cannot drift apart. Every problem is reported before anything starts, one line each.

One module on purpose, a little over the 500 lines the project allows otherwise: it is the recipe's schema, one
section model per YAML section with each key's rule beside it, and the schema file `make schemas` writes is
generated from it; the cross-section rules stay next to the sections they read.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, Strict
from pydantic_core import PydanticCustomError

from training.config.backends import FACTS, Backend, flash_attention_fits
from training.config.hardware import CHIPS, DEFAULT_GENERATION, GENERATIONS, TRAINIUM1, Generation
from training.config.loading import (
    ONE_LINE,
    Allowed,
    Bool,
    ConfigError,
    Fraction,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Str,
    StrictModel,
    Text,
    YamlSyntaxError,
    _yaml_number,
    build,
    check,
    has_control_characters,
    not_allowed,
    parse_yaml,
    read_mapping,
)
from training.config.model import ActivationCheckpointing
from training.errors import UserError

RECIPES_DIR = Path(__file__).resolve().parent.parent / "train" / "recipes"
SCHEMA_FILE = RECIPES_DIR / "recipe.schema.json"
Decay = Literal["linear", "cosine", "constant"]
Precision = Literal["fp32", "bf16-mixed", "bf16-sr"]
# As `prepare --seq-len` allows: far beyond any model's context; blocks are Arrow lists with 32-bit sizes.
MAX_SEQ_LEN = 1 << 20
# Sequences per optimizer step: far beyond any published LLM batch; keeps the divisor hint below instant.
MAX_GLOBAL_BATCH = 1 << 20
SeqLen = Annotated[int, Strict(), Field(ge=2, le=MAX_SEQ_LEN), Allowed(f"2 to {MAX_SEQ_LEN} tokens")]
GlobalBatch = Annotated[int, Strict(), Field(ge=1, le=MAX_GLOBAL_BATCH), Allowed(f"1 to {MAX_GLOBAL_BATCH} sequences")]
# numpy's legacy seeding (`np.random.seed`, which the training job calls) takes 32-bit unsigned seeds only.
Seed = Annotated[int, Strict(), Field(ge=0, le=2**32 - 1), Allowed(f"0 to {2**32 - 1}")]
# Flags the site owns: the compile cache is where the site keeps it (its `compile_cache`), for every recipe alike;
# the target and the logical core size are the generation's and the instance type's (they must match the runtime's).
SITE_COMPILER_FLAGS = ("--cache_dir", "--target", "--lnc", "--logical-nc-config")


def _not_a_site_flag(flag: str) -> str:
    name = flag.partition("=")[0].lstrip("-").replace("-", "_")
    if any(name == owned.lstrip("-").replace("-", "_") for owned in SITE_COMPILER_FLAGS):
        raise PydanticCustomError("site_compiler_flag", "a flag the site sets")
    return flag


# One item of NEURON_CC_FLAGS, a single string that the Neuron tools split on whitespace: one flag an item, its
# value joined with `=` (neuronx-cc reads `--model-type=transformer` as `--model-type transformer`).
CompilerFlag = Annotated[
    str,
    Strict(),
    Field(pattern=r"""^-[^\s'"\\\x00-\x1f\x7f]+$"""),
    AfterValidator(_not_a_site_flag),
    Allowed(
        "one compiler flag starting with '-', its value joined with '=' (e.g. --model-type=transformer), without "
        "whitespace, quotes or backslashes; not --cache_dir, --target or --lnc (the site's compile_cache, the "
        "generation and the instance type set them)"
    ),
]


# The Hub's names: an owner and a repository, each of letters, digits, '-', '_' and '.' (96 at most).
HUB_REPO_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$"
HUB_REPO_ALLOWED = "a Hub model repository as owner/name, e.g. meta-llama/Llama-3.1-8B"
HubRepo = Annotated[str, Strict(), Field(pattern=HUB_REPO_PATTERN), Allowed(HUB_REPO_ALLOWED)]
HubRevision = Annotated[
    str,
    Strict(),
    Field(pattern=r"^[0-9a-f]{40}$"),
    Allowed("a commit id of the repository: 40 lowercase hexadecimal digits (a branch or tag can move)"),
]
HubPattern = Annotated[
    str,
    Strict(),
    Field(pattern=r"^[^\x00-\x1f\x7f]{1,200}$"),
    Allowed("a file name pattern of the repository (fnmatch: '*' also matches '/'), e.g. *.safetensors"),
]


class HubSource(StrictModel):
    """Where the pipeline's fetch stage downloads `model.config` from: a Hub repository at one commit."""

    repo: HubRepo
    revision: HubRevision = Field(description="the commit to download, pinned so every run trains the same weights")
    include: tuple[HubPattern, ...] = Field(
        ("*.json", "*.safetensors", "tokenizer.model", "*.md", "LICENSE*"),
        description="files of the repository to download: configuration, weights, tokenizer, model card, licence",
    )
    exclude: tuple[HubPattern, ...] = Field(
        ("original/*", "consolidated*"),
        description="files left out although `include` matches them (the original non-Hugging-Face checkpoints)",
    )


class ModelSection(StrictModel):
    config: Str = Field(description="Hugging Face model directory (config.json, tokenizer files)")
    hub: HubSource | None = Field(
        None, description="download model.config from the Hugging Face Hub (the fetch stage); omit if it exists"
    )
    pretrained: Str | None = Field(None, description="`convert --to nxd` output; omit to start from random weights")


class DataSection(StrictModel):
    path: Str = Field(description="output directory of `python -m training prepare`")
    kind: Literal["pretrain", "sft"] | None = Field(
        None,
        description="which kind of prepared data (`prepare pretrain` or `prepare sft`) the recipe trains on; "
        "default: prepare.kind. Set it to train on data of the other kind on purpose (e.g. continued pretraining "
        "on SFT blocks) or to have a recipe without a prepare section checked",
    )
    split: Str = "train"
    shuffle: Bool = Field(
        True, description="a new seeded order each epoch; the data position stays a function of the step"
    )
    validation_split: Str | None = Field(None, description="a split of data.path for the validation loss")
    validation_every: NonNegativeInt = Field(0, description="steps between validation losses; 0: none")
    validation_batches: PositiveInt = Field(4, description="micro batches per data-parallel rank in one validation")


class ParallelismSection(StrictModel):
    tp: PositiveInt = Field(1, description="tensor-parallel degree")
    pp: PositiveInt = Field(1, description="pipeline stages (contiguous layers each, 1F1B schedule)")
    kv_size_multiplier: PositiveInt | None = Field(
        None, description="KV head replication; omit for the smallest that fits (as `convert` chooses)"
    )
    fuse_qkv: Bool = False
    sequence_parallel: Bool = Field(
        False,
        description="split the activations outside attention and MLP over the TP ranks along the sequence "
        "(neuronx-distributed's sequence_parallel_enabled)",
    )


class MemorySection(StrictModel):
    """What the backward pass keeps: every byte here is per NeuronCore (`python -m training plan` adds it up)."""

    activation_checkpointing: ActivationCheckpointing = Field(
        "none",
        description="recompute in the backward pass instead of keeping: selective = the attention core and the "
        "MLP activation, full = each decoder layer",
    )
    flash_attention: Bool = Field(
        False, description="attention that never holds the S x S scores (NKI flash attention on Neuron)"
    )


class MoeSection(StrictModel):
    """Mixture-of-experts settings (ignored by dense models)."""

    capacity_factor: PositiveFloat | None = Field(
        None,
        description="expert capacity = ceil(tokens x top-k x factor / experts) per micro batch; choices beyond it "
        "are dropped and counted (moe_dropped in the metrics). Omit: nothing dropped, every expert runs every token "
        "on Neuron",
    )


class NeuronSection(StrictModel):
    """The Neuron compiler's and runtime's settings of the recipe's Slurm jobs (on a site with `neuron: true`).

    The defaults are neuronx-distributed's Llama training example's (REFERENCE.md section 7); a model that needs
    others says so in its recipe (mixtral-8x7b-sft: NxD's Mixtral run's)."""

    compiler_flags: tuple[CompilerFlag, ...] = Field(
        ("--model-type=transformer",),
        description="NEURON_CC_FLAGS of every job, one flag an item (a value joined with '='); the site's "
        "--cache_dir=<compile_cache> is added after them",
    )
    inflight_requests: PositiveInt = Field(
        3,
        description="NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS: executions the Neuron runtime accepts before "
        "the host waits for one to finish",
    )
    # On by default: without it, a graph that failed to compile once is recorded in the shared compile cache as a
    # failure, and every later compile run of the graph (a resubmitted or resumed run) stops at that record
    # instead of compiling it again; with it, a failure that has since been fixed (a compiler or code update, a
    # node that ran out of host memory) compiles, and a lasting one still fails the stage.
    retry_failed_compilation: Bool = Field(
        True,
        description="run the compile stage as `neuron_parallel_compile --retry_failed_compilation`: compile "
        "again the graphs the cache records as failed",
    )
    fail_on_late_compile: Bool = Field(
        False,
        description="stop the training job, with one line naming the step, when it compiles a graph the compile "
        "stage did not (a step graph after the process's first two steps, or a validation or checkpoint graph a "
        "second time): the compile cache missed, and each miss costs minutes of every node",
    )


class TorchNativeSection(StrictModel):
    """Settings of the torch-native backend (TorchNeuron on Trainium2; the CPU over gloo with TORCH_NATIVE_CPU=1)."""

    compile: Bool = Field(
        False,
        description="torch.compile each decoder layer's forward (backend neuron; aot_eager on the CPU) with static "
        "shapes, after tensor parallelism and FSDP2 are applied; a Mixtral model then needs moe.capacity_factor "
        "(the capacity dispatch: TorchNeuron's compiler takes no dynamic shapes). Default: eager",
    )


# The throughput floor's fraction of the expected figure: above 0 (0 would be no floor: omit the expectation
# instead), at most 1.
FloorFraction = Annotated[
    float,
    Strict(),
    Field(gt=0, le=1, allow_inf_nan=False),
    BeforeValidator(_yaml_number),
    Allowed("a number above 0, at most 1"),
]


class ThroughputSection(StrictModel):
    """The throughput floor of the training job: after a warm-up, the median tokens/s per node of a window of
    logged steps below `floor_fraction` of the expected figure is an alarm (metric BelowThroughputFloor), a line
    in `status`, and with `cancel_below_floor` the job's end."""

    expected_tokens_per_second_per_node: PositiveFloat | None = Field(
        None,
        description="what one node should do; default: the run's forecast (`submit` resolves it from the model, "
        "the sequence length and the site's instance type); none known (the CPU backend, an unknown model): no floor",
    )
    # Half: the published figure's band is 0.87-1.11 of its expected value and a healthy run stays inside it; a
    # derived figure (a model nothing is published for) may be optimistic by a fifth or more. Below half, something
    # is broken (a recompiling graph, a slow node or link, a host-bound data loader), not a little slow.
    floor_fraction: FloorFraction = Field(0.5, description="the floor, a fraction of the expected tokens/s per node")
    warmup_steps: NonNegativeInt = Field(
        10,
        description="steps of each training process before the floor applies (its first steps load graphs and "
        "weights; a resumed process warms up again)",
    )
    window_steps: PositiveInt = Field(
        5, description="logged steps whose median is compared with the floor (one slow checkpoint step is not)"
    )
    cancel_below_floor: Bool = Field(
        False, description="stop the training job (not requeued) with the reason when the window is below the floor"
    )


class BatchSection(StrictModel):
    global_batch: GlobalBatch = Field(alias="global", description="sequences per optimizer step")
    micro: PositiveInt = Field(1, description="sequences per forward/backward on one data-parallel rank")
    seq_len: SeqLen = 2048


class OptimizerSection(StrictModel):
    lr: PositiveFloat = Field(description="peak learning rate")
    betas: tuple[Fraction, Fraction] = (0.9, 0.999)
    eps: PositiveFloat = 1e-8
    weight_decay: NonNegativeFloat = Field(0.0, description="AdamW decay, never on norms and biases")
    grad_clip: NonNegativeFloat = Field(1.0, description="global gradient-norm clip; 0 turns clipping off")
    zero1: Bool = Field(True, description="shard optimizer state over data-parallel ranks (ZeRO-1)")


class ScheduleSection(StrictModel):
    warmup_steps: NonNegativeInt = 0
    decay: Decay = "linear"
    min_lr: NonNegativeFloat = 0.0


class CheckpointSection(StrictModel):
    dir: Str
    every: NonNegativeInt = Field(0, description="steps between checkpoints; 0 saves only at the end")
    keep_last: PositiveInt = 2
    xser: Bool = Field(False, description="torch_xla xser files (one file per tensor)")


class PrepareSource(StrictModel):
    """One source of a mix (`prepare.sources`): `--source` with the options after it."""

    source: Str = Field(description="hub dataset NAME[:CONFIG], or a local file or directory")
    weight: PositiveFloat = Field(description="its share of the tokens, relative to the other weights")
    max_records: PositiveInt | None = Field(None, description="read at most this many documents or examples of it")
    split: Str | None = Field(None, description="split of a hub dataset; default: train")
    validation: Str | None = Field(None, description="sft: its validation split name or local file")


class PrepareSection(StrictModel):
    """How the pipeline's prepare stage makes `data.path` (arguments of `python -m training prepare`)."""

    kind: Literal["pretrain", "sft"]
    source: Str | None = Field(None, description="hub dataset NAME[:CONFIG], or a local file or directory")
    sources: tuple[PrepareSource, ...] | None = Field(
        None,
        min_length=1,
        description="instead of source: several sources mixed by token share (the mix ends when one runs out)",
    )
    seed: Seed = Field(0, description="decides the interleaving of prepare.sources")
    tokenizer: Str | None = Field(None, description="tokenizer directory; default: model.config")
    validation: Str | None = Field(None, description="sft: a split name or a local file")
    max_records: PositiveInt | None = Field(None, description="stop after this many documents or examples")


class SampleSection(StrictModel):
    """The sample stage's check of the trained model: greedy and top-k continuations of a few prompts."""

    prompts: tuple[Text, ...] = Field(
        ("The capital of France is", "Explain what a GPU is in one sentence."),
        description="free text (newlines allowed): only the sample stage's Python reads them, from recipe.yaml",
    )
    max_new_tokens: PositiveInt = 48
    top_k: PositiveInt = 50
    seed: Seed = 0


# lm-eval task names: letters, digits and `_ - .` (its registry's names; never a path or a glob).
TaskName = Annotated[
    str,
    Strict(),
    Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"),
    Allowed("an lm-evaluation-harness task name (letters, digits, '_', '-', '.')"),
]
EvalDtype = Literal["float32", "bfloat16", "float16"]


class EvaluationTask(StrictModel):
    """One lm-evaluation-harness task of the evaluate stage, on the first `limit` documents."""

    name: TaskName
    limit: PositiveInt = Field(description="documents evaluated (the first N of the task's evaluation split)")
    num_fewshot: NonNegativeInt | None = Field(None, description="few-shot examples; default: the task's own")
    metric: TaskName | None = Field(
        None, description="the metric compared with the base (e.g. acc_norm); default: the task's first"
    )


class EvaluateSection(StrictModel):
    """The evaluate stage after convert-out: lm-evaluation-harness on the trained model and the base model,
    with a gate that fails the stage (and keeps export from publishing) when a task drops too far."""

    tasks: tuple[EvaluationTask, ...] = Field(description="tasks, each with its document limit")
    base: Bool = Field(True, description="also evaluate the base model (model.config) and report the difference")
    max_drop: NonNegativeFloat | None = Field(
        None,
        description="the gate: fail when a task's metric is worse than the base's by more than this many points "
        "(hundredths: percentage points of an accuracy); null: no gate",
    )
    batch_size: PositiveInt = Field(8, description="requests per forward pass")
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: EvalDtype = Field("float32", description="weights' dtype while evaluating")
    apply_chat_template: Bool = Field(
        False, description="wrap every prompt in the tokenizer's chat template (a chat model's evaluation)"
    )
    include: tuple[Str, ...] = Field(
        (), description="directories of more task YAML files (the package's local tasks are always included)"
    )


class Recipe(StrictModel):
    name: Str
    model: ModelSection
    data: DataSection
    batch: BatchSection
    optimizer: OptimizerSection
    checkpoint: CheckpointSection
    steps: PositiveInt
    parallelism: ParallelismSection = ParallelismSection()
    memory: MemorySection = MemorySection()
    moe: MoeSection = MoeSection()
    neuron: NeuronSection = NeuronSection()
    torch_native: TorchNativeSection = TorchNativeSection()
    throughput: ThroughputSection = ThroughputSection()
    schedule: ScheduleSection = ScheduleSection()
    backend: Backend = "neuron"
    generation: Annotated[Generation, Allowed(", ".join(GENERATIONS))] = Field(
        DEFAULT_GENERATION,
        description="the Trainium generation the run is for: the K/V layout of its checkpoints, the compiler "
        "target; `submit` sets it from the site's instance type",
    )
    generations: dict[Generation, dict[str, Any]] = Field(
        default_factory=dict,
        exclude=True,
        description="settings per generation, applied over the rest when the recipe is loaded for that generation "
        "(before command-line overrides), e.g. trn2: {nodes: 1, parallelism: {tp: 16}}",
    )
    precision: Precision = Field(
        "bf16-mixed",
        description="bf16-mixed: bf16 weights, fp32 master weights and gradient accumulation (ZeRO-1); bf16-sr: "
        "bf16 weights, gradients and optimizer state with stochastic rounding; fp32",
    )
    seed: Seed = 42
    log_every: PositiveInt = 1
    peak_tflops_per_worker: PositiveFloat = Field(
        TRAINIUM1.peak_bf16_tflops_per_logical_core,
        description="hardware peak per worker process for the MFU estimate; default: the generation's logical "
        "NeuronCore (trn1: 95 bf16 TFLOPS, trn2 at LNC 2: 166.75)",
    )
    nodes: PositiveInt = Field(1, description="nodes of the training (and compile) job")
    prepare: PrepareSection | None = Field(None, description="how the pipeline makes the data; omit if it exists")
    sample: SampleSection = SampleSection()
    evaluate: EvaluateSection | None = Field(None, description="the evaluate stage; omit to skip it")


def bundled_recipes() -> list[str]:
    return sorted(path.stem for path in RECIPES_DIR.glob("*.yaml"))


def resolve_recipe_path(name_or_path: str) -> Path:
    """A file path, or the name of a bundled recipe (`llama31-8b-cpt` -> training/train/recipes/llama31-8b-cpt.yaml)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    bundled = RECIPES_DIR / f"{name_or_path}.yaml"
    if bundled.is_file():
        return bundled
    raise ConfigError(
        [not_allowed("--recipe", name_or_path, f"a recipe file or a bundled recipe ({', '.join(bundled_recipes())})")]
    )


def load_recipe(
    name_or_path: str, overrides: typing.Sequence[str] = (), generation: Generation | None = None
) -> Recipe:
    """The recipe for `generation` (default: its own `generation`, or an override's), its `generations` section
    for that generation applied, then the `section.key=value` overrides (values parsed as YAML), validated."""
    path = resolve_recipe_path(name_or_path)
    label = str(path)
    raw = read_mapping(path, label)
    for override in overrides:  # first for what they say of the generation and its sections
        apply_override(raw, override, label)
    sections = generation_sections(raw, label)
    chosen = generation or raw.get("generation", DEFAULT_GENERATION)
    if chosen in sections:
        merge_into(raw, sections[chosen])
    if chosen in GENERATIONS and "peak_tflops_per_worker" not in raw:
        raw["peak_tflops_per_worker"] = CHIPS[chosen].peak_bf16_tflops_per_logical_core
    raw["generation"] = chosen
    for override in overrides:  # then again, over the generation's section
        apply_override(raw, override, label)
    recipe = build(Recipe, raw, label)
    check(label, validate, recipe)
    return recipe


def generation_sections(raw: dict[str, Any], label: str) -> dict[str, dict[str, Any]]:
    """The recipe's `generations` section, taken out of it (the loaded recipe holds the chosen one applied)."""
    sections = raw.pop("generations", None) or {}
    if not isinstance(sections, dict):
        raise ConfigError([f"{label}: {not_allowed('generations', sections, 'a mapping of generation to settings')}"])
    for name, section in sections.items():
        if name not in GENERATIONS or not isinstance(section, dict):
            allowed = f"a mapping of {' or '.join(GENERATIONS)} to settings"
            raise ConfigError([f"{label}: {not_allowed(f'generations.{name}', section, allowed)}"])
    return sections


def merge_into(raw: dict[str, Any], section: dict[str, Any]) -> None:
    """`section`'s keys over `raw`'s, mappings merged key by key."""
    for key, value in section.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            merge_into(raw[key], value)
        else:
            raw[key] = value


def apply_override(raw: dict[str, Any], override: str, label: str) -> None:
    if has_control_characters(override):
        raise UserError(not_allowed("override", override, f"section.key=value as {ONE_LINE}"))
    key, separator, value = override.partition("=")
    if not separator or not key:
        raise UserError(not_allowed("override", override, "section.key=value (e.g. batch.micro=2)"))
    node = raw
    *parents, leaf = key.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(not_allowed("override", override, f"a key inside a section; {part} in {label} is a value"))
        node = child
    try:
        node[leaf] = parse_yaml(value, f"override {key}") if value else None
    except YamlSyntaxError:
        node[leaf] = value


def validate(recipe: Recipe) -> list[str]:
    """Rules across keys; the ones that need the model or data files run at start-up (`training.train.loop`)."""
    problems = []
    if recipe.batch.global_batch % recipe.batch.micro:
        divisors = ", ".join(
            str(d) for d in range(1, recipe.batch.global_batch + 1) if recipe.batch.global_batch % d == 0
        )
        problems.append(
            not_allowed(
                "batch.micro", recipe.batch.micro, f"a divisor of batch.global {recipe.batch.global_batch} ({divisors})"
            )
        )
    if recipe.schedule.warmup_steps > recipe.steps:
        problems.append(
            not_allowed("schedule.warmup_steps", recipe.schedule.warmup_steps, f"0 to steps ({recipe.steps})")
        )
    if recipe.precision == "bf16-mixed" and not recipe.optimizer.zero1:
        problems.append(
            not_allowed(
                "precision",
                recipe.precision,
                "bf16-sr or fp32 with optimizer.zero1 false "
                "(bf16-mixed keeps its fp32 master weights in ZeRO-1's shards)",
            )
        )
    if recipe.backend == "torch-native" and recipe.precision == "bf16-sr":
        problems.append(
            not_allowed(
                "precision",
                recipe.precision,
                "fp32 or bf16-mixed on backend torch-native (FSDP2's mixed precision: bf16 compute, fp32 masters "
                "and reduction; stochastic rounding is neuronx-distributed's optimizer's)",
            )
        )
    if recipe.torch_native.compile and recipe.backend != "torch-native":
        problems.append(
            not_allowed(
                "torch_native.compile",
                recipe.torch_native.compile,
                f"false on backend {recipe.backend} (torch.compile of the decoder layers is backend torch-native's)",
            )
        )
    if recipe.parallelism.sequence_parallel and recipe.batch.seq_len % recipe.parallelism.tp:
        problems.append(
            not_allowed(
                "batch.seq_len",
                recipe.batch.seq_len,
                f"a multiple of parallelism.tp ({recipe.parallelism.tp}) with parallelism.sequence_parallel",
            )
        )
    block = FACTS[recipe.backend].flash_attention_block
    if recipe.memory.flash_attention and not flash_attention_fits(recipe.backend, recipe.batch.seq_len):
        problems.append(
            not_allowed(
                "batch.seq_len",
                recipe.batch.seq_len,
                f"a multiple of {block} with memory.flash_attention on backend {recipe.backend} "
                "(the NKI kernel's tile)",
            )
        )
    if recipe.data.validation_every and recipe.data.validation_split is None:
        problems.append(
            not_allowed(
                "data.validation_every", recipe.data.validation_every, "0, or set data.validation_split as well"
            )
        )
    if recipe.prepare is not None:
        problems += _prepare_problems(recipe.prepare)
    if recipe.schedule.min_lr > recipe.optimizer.lr:
        problems.append(
            not_allowed("schedule.min_lr", recipe.schedule.min_lr, f"at most optimizer.lr ({recipe.optimizer.lr})")
        )
    if recipe.evaluate is not None:
        problems += _evaluate_problems(recipe.evaluate)
    return problems


def sparse_dispatch_compiled() -> str:
    """torch_native.compile's rule the recipe alone cannot check (whether the model has experts is its config's):
    a Mixtral model's sparse dispatch runs each expert on a token count that changes every step, dynamic shapes
    that a static compile (`dynamic=False`, as TorchNeuron's compiler requires) recompiles for each new count.
    The torch-native backend refuses it as the model is built (`training.model.native_backend`)."""
    return not_allowed(
        "torch_native.compile",
        True,
        "false with a Mixtral model's sparse MoE dispatch (dynamic shapes: each expert's token count changes every "
        "step), or set moe.capacity_factor (the capacity dispatch: static shapes)",
    )


def _evaluate_problems(evaluate: EvaluateSection) -> list[str]:
    problems = []
    if not evaluate.tasks:
        problems.append(not_allowed("evaluate.tasks", [], "at least one task"))
    names = [task.name for task in evaluate.tasks]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        problems.append(not_allowed("evaluate.tasks", repeated, "each task once"))
    if evaluate.max_drop is not None and not evaluate.base:
        problems.append(
            not_allowed("evaluate.max_drop", evaluate.max_drop, "null, or set evaluate.base true (the gate compares)")
        )
    return problems


def _prepare_problems(prepare: PrepareSection) -> list[str]:
    """One source or a mix, not both; each source of a mix once; a mix's validation data is per source."""
    if (prepare.source is None) == (prepare.sources is None):
        given = "both" if prepare.source is not None else "neither"
        return [not_allowed("prepare.source", given, "exactly one of prepare.source and prepare.sources")]
    if prepare.sources is None:
        return []
    problems = []
    seen = set()
    for index, part in enumerate(prepare.sources):
        if (part.source, part.split) in seen:
            problems.append(not_allowed(f"prepare.sources[{index}].source", part.source, "a source not listed before"))
        seen.add((part.source, part.split))
    if prepare.validation is not None:
        problems.append(
            not_allowed("prepare.validation", prepare.validation, "nothing with prepare.sources (set each source's)")
        )
    return problems


def recipe_as_dict(recipe: Recipe) -> dict[str, Any]:
    """The resolved recipe as its YAML spells it (for run records, logs and the file every job reads)."""
    return recipe.model_dump(mode="json", by_alias=True)
