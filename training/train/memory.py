"""Memory per NeuronCore before anything starts billing: `python -m training plan --recipe R`.

Pure arithmetic, torch-free (it also runs at `cdk synth`). Per core, for one training step:

- weights, gradients and optimizer state, from the parameters this core holds (exact per-rank counts, the
  replicated K/V heads included) and the precision regime (`training.config.precision`):
  bf16-mixed 2 + 4 + 16/DP bytes a parameter (bf16 weight, fp32 gradient accumulation, ZeRO-1 shard of the
  fp32 master weight, both AdamW moments and the reduce-scattered fp32 gradient); bf16-sr 2 + 2 + 8/DP;
  fp32 4 + 4 + 16/DP (without ZeRO-1 the moments alone, unsharded); on a fully sharded backend (FSDP2: the
  torch-native backend) 4/DP + 4/DP + 8/DP (the fp32 parameter, its fp32 gradient and both moments, all
  sharded), plus the units FSDP2 holds gathered at once (the current layer and the prefetched one: their
  weights and unreduced gradients in the compute dtype);
- activations: what autograd keeps for backward, term by term from what this project's layers save (the
  same operations as neuronx-distributed's: tests/training/train/test_memory.py holds the terms to within 10 %
  of the bytes measured on tiny models), for every layer of the stage and every micro batch in flight;
- the logits in fp32 and their gradient, and one layer's activations again as the backward working set
  (the recomputation of a checkpointed layer, the gradients of any);
- a reserve for the Neuron runtime (REFERENCE.md: keep 1.5-3 GiB).

A recipe fits when the total leaves at least `REQUIRED_HEADROOM` of the device memory free.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.config.backends import FACTS, MoeDispatch, default_moe_dispatch, flash_attention_fits
from training.config.hardware import DEFAULT_HARDWARE, Hardware
from training.config.model import (
    ActivationCheckpointing,
    ModelConfig,
    ModelSpec,
    default_kv_multiplier,
    layer_parameters,
)
from training.config.recipe import Precision, Recipe
from training.errors import UserError

GIB = 1024**3
RUNTIME_RESERVE_GIB = 2.0
REQUIRED_HEADROOM = 0.10
KNOWN_MODELS_DIR = Path(__file__).resolve().parent / "models"


@dataclass(frozen=True)
class Workload:
    """Everything the arithmetic needs: the model, how it is cut, and how a step runs."""

    spec: ModelSpec
    experts_per_token: int = 2
    tp: int = 1
    pp: int = 1
    dp: int = 1
    kv_multiplier: int = 1
    sequence_parallel: bool = False
    activation_checkpointing: ActivationCheckpointing = "none"
    flash_attention: bool = False
    precision: Precision = "bf16-mixed"
    zero1: bool = True
    fsdp: bool = False  # FSDP2 shards parameters, gradients and optimizer state over DP (and zero1 is off)
    micro: int = 1
    seq_len: int = 2048
    accumulation: int = 1  # micro batches per step on each data-parallel rank
    moe_dispatch: MoeDispatch = "dense"  # the Neuron backend's without a capacity factor (static shapes)
    capacity_factor: float | None = None  # the capacity dispatch's


# --- parameters and states -------------------------------------------------------------------------------


def layer_parameters_per_core(w: Workload) -> int:
    """Parameters of one decoder layer on one TP rank (the K/V heads as replicated, the router replicated)."""
    return layer_parameters(w.spec, w.tp, w.kv_multiplier).total


def parameters_per_core(w: Workload) -> int:
    """Parameters of the most loaded pipeline stage on one TP rank (embedding on the first stage; final norm
    and head on the last; all of them at PP 1)."""
    s = w.spec
    layers = s.num_layers // w.pp * layer_parameters_per_core(w)
    embedding = s.vocab_size * s.hidden_size // w.tp
    head = s.hidden_size + (0 if s.tie_word_embeddings and w.pp == 1 else embedding)
    return layers + embedding + head if w.pp == 1 else layers + max(embedding, head)


def state_bytes_per_parameter(w: Workload) -> dict[str, float]:
    """Bytes a parameter costs in weights, gradients and optimizer state (see the module docstring)."""
    if w.fsdp:
        return {"weights": 4 / w.dp, "gradients": 4 / w.dp, "optimizer state": 8 / w.dp}
    weight = 2 if w.precision != "fp32" else 4
    optimizer_dtype = 2 if w.precision == "bf16-sr" else 4
    gradient = 2 if w.precision == "bf16-sr" else 4
    # ZeRO-1's shard: the weight in the optimizer's dtype, two moments, the reduced gradient; else the moments
    optimizer = 4 * optimizer_dtype / w.dp if w.zero1 else 2 * optimizer_dtype
    return {"weights": weight, "gradients": gradient, "optimizer state": optimizer}


FSDP_UNITS_GATHERED = 2  # the layer computing and the one prefetched


def gathered_unit_bytes(w: Workload) -> int:
    """FSDP2's gathered layers: weights and their unreduced gradients in the compute dtype."""
    compute = 2 if w.precision == "bf16-mixed" else 4
    return FSDP_UNITS_GATHERED * layer_parameters_per_core(w) * 2 * compute


# --- activations ---------------------------------------------------------------------------------------


def _activation_bytes(w: Workload) -> int:
    return 2 if w.precision != "fp32" else 4


def _norm(tokens: int, w: Workload) -> int:
    """RMSNorm: its fp32 input, the reciprocal RMS, the normalised input and its output (the next linear's)."""
    b, h = _activation_bytes(w), w.spec.hidden_size
    return tokens * (4 * h + 4 + 2 * b * h)


def layer_activation_bytes(w: Workload, checkpointing: ActivationCheckpointing | None = None) -> int:
    """What autograd keeps of one decoder layer for one micro batch on one core."""
    mode = w.activation_checkpointing if checkpointing is None else checkpointing
    s, b = w.spec, _activation_bytes(w)
    tokens = w.micro * w.seq_len
    local = tokens // w.tp if w.sequence_parallel else tokens  # tokens in the sequence-parallel regions
    if mode == "full":
        return local * s.hidden_size * b  # the layer's input; the rest is recomputed
    a = s.num_heads // w.tp
    g = s.num_kv_heads * w.kv_multiplier // w.tp
    d, i = s.head_dim, s.intermediate_size // w.tp
    total = 2 * _norm(local, w)
    total += tokens * d * b * a  # o_proj's input (the rotation keeps only its cos/sin tables)
    if w.flash_attention:  # never recomputed: the kernel's backward recomputes its blocks itself
        total += tokens * (d * b * 3 * a + 4 * a)  # q, repeated k and v; fp32 log-sum-exp (output: o_proj's)
    elif mode == "selective":
        total += tokens * d * b * (a + 2 * g)  # the recomputed core's inputs: rotated q and k, v
    else:
        total += tokens * d * b * 3 * a  # q, repeated k and v
        total += w.micro * a * w.seq_len**2 * (4 + (b if b != 4 else 0))  # softmax in fp32 (and cast)
    activation = 3 if mode == "selective" else 4  # [gate|up], silu(gate) and the product; selective keeps two
    if not s.num_experts:
        return total + tokens * activation * i * b
    e, k, h = s.num_experts, w.experts_per_token, s.hidden_size
    total += local * (4 * e + 12 * k + 4)  # router softmax in fp32, top-k choices and renormalised weights
    if w.moe_dispatch == "dense":
        total += tokens * (e * (activation * i * b + 4 * h + 4) + 8 * k)  # every expert on every token
        if w.sequence_parallel:
            total += tokens * h * b  # the gathered tokens
    elif w.moe_dispatch == "capacity":
        rows = e * expert_capacity(w)  # every expert's slots, filled or not
        total += rows * (h * b + activation * i * b + 8)  # slot inputs, expert MLP, the slots' owners
        total += tokens * k * (4 * h + 17) + tokens * 8  # each choice's fp32 output, index, weight; sums
    else:
        # each token's k copies, expert outputs and weighted outputs; the sort's indices and the weights
        total += tokens * k * (3 * h * b + 20 + activation * i * b)
    return total


def expert_capacity(w: Workload) -> int:
    """Slots per expert of the capacity dispatch: ceil(tokens x top-k x factor / experts), at most the tokens."""
    tokens = w.micro * w.seq_len
    factor = w.capacity_factor if w.capacity_factor is not None else w.spec.num_experts / w.experts_per_token
    return min(tokens, math.ceil(tokens * w.experts_per_token * factor / w.spec.num_experts))


def _balance_loss(w: Workload) -> int:
    """The router balance loss, computed outside the layers (so kept whatever is checkpointed): its softmax
    and top-k over every token's router logits, per MoE layer."""
    s = w.spec
    return (
        w.micro * w.seq_len * (s.num_experts * _activation_bytes(w) + 8 * w.experts_per_token) if s.num_experts else 0
    )


def outside_layer_bytes(w: Workload) -> int:
    """Embedding, final norm, cross-entropy, rotary tables and the causal mask (one micro batch, one core)."""
    s, b = w.spec, _activation_bytes(w)
    tokens = w.micro * w.seq_len
    local = tokens // w.tp if w.sequence_parallel else tokens
    embedding = tokens * (8 + (b if w.tp > 1 else 0))  # the looked-up ids; the rank's row mask
    loss = tokens * (4 * s.vocab_size // w.tp + 9 + 4)  # fp32 softmax, target masks, the label mask
    tables = 2 * w.seq_len * s.head_dim * b
    mask = 0 if w.flash_attention else w.seq_len**2
    return embedding + _norm(local, w) + loss + tables + mask


def saved_activation_bytes(w: Workload) -> int:
    """All that autograd keeps after one micro batch's forward on the most loaded stage (what the
    measurement in tests/training/train/test_memory.py compares with)."""
    layers = w.spec.num_layers // w.pp
    return layers * (layer_activation_bytes(w) + _balance_loss(w)) + outside_layer_bytes(w)


def in_flight(w: Workload) -> int:
    """Micro batches whose activations a core holds at once: the first stage of a 1F1B pipeline holds PP."""
    return min(w.pp, max(1, w.accumulation)) if w.pp > 1 else 1


def logits_bytes(w: Workload) -> int:
    """The fp32 logits the step holds, their gradient and the head output's gradient (this rank's vocabulary)."""
    tokens, vocabulary = w.micro * w.seq_len, w.spec.vocab_size // w.tp
    return tokens * vocabulary * (8 + _activation_bytes(w))


# --- the plan --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryPlan:
    workload: Workload
    hardware: Hardware
    parameters: int
    breakdown: dict[str, float]  # bytes per core, in the order printed

    @property
    def total(self) -> float:
        return sum(self.breakdown.values())

    @property
    def hbm(self) -> float:
        return self.hardware.hbm_gib_per_core * GIB

    @property
    def headroom(self) -> float:
        """The fraction of device memory left."""
        return 1 - self.total / self.hbm

    @property
    def fits(self) -> bool:
        return self.headroom >= REQUIRED_HEADROOM


def plan(w: Workload, hardware: Hardware = DEFAULT_HARDWARE) -> MemoryPlan:
    parameters = parameters_per_core(w)
    per_parameter = state_bytes_per_parameter(w)
    breakdown = {name: parameters * size for name, size in per_parameter.items()}
    if w.fsdp:
        breakdown["gathered units"] = float(gathered_unit_bytes(w))
    breakdown["activations"] = float(in_flight(w) * saved_activation_bytes(w))
    breakdown["logits"] = float(logits_bytes(w))
    breakdown["backward working set"] = float(layer_activation_bytes(w, "none"))
    breakdown["runtime reserve"] = RUNTIME_RESERVE_GIB * GIB
    return MemoryPlan(w, hardware, parameters, breakdown)


# Changes tried in order of what they cost: memory-only changes first, then recomputation, then precision,
# then more nodes (money). Each is a recipe override, applied cumulatively until the plan fits.
def _fixes(w: Workload, recipe: Recipe, hardware: Hardware) -> list[tuple[str, dict[str, Any]]]:
    fixes: list[tuple[str, dict[str, Any]]] = []
    if not w.flash_attention and flash_attention_fits(recipe.backend, w.seq_len):
        fixes.append(("memory.flash_attention=true", {"flash_attention": True}))
    if not w.sequence_parallel and w.tp > 1 and w.seq_len % w.tp == 0:
        fixes.append(("parallelism.sequence_parallel=true", {"sequence_parallel": True}))
    if w.activation_checkpointing == "none":
        fixes.append(("memory.activation_checkpointing=selective", {"activation_checkpointing": "selective"}))
    if w.activation_checkpointing != "full":
        fixes.append(("memory.activation_checkpointing=full", {"activation_checkpointing": "full"}))
    if w.precision == "bf16-mixed":
        fixes.append(("precision=bf16-sr", {"precision": "bf16-sr"}))
    # Then pipeline stages on the same nodes (they cost a pipeline bubble, not money), then more nodes.
    pp, global_batch, micro = w.pp, recipe.batch.global_batch, recipe.batch.micro
    cores = recipe.nodes * hardware.cores_per_node
    while not w.spec.tie_word_embeddings and w.spec.num_layers % (pp * 2) == 0 and cores % (w.tp * pp * 2) == 0:
        pp *= 2
        dp = cores // (w.tp * pp)
        if global_batch % (micro * dp) == 0:
            fixes.append((f"parallelism.pp={pp}", {"pp": pp, "dp": dp, "accumulation": global_batch // (micro * dp)}))
    nodes = recipe.nodes
    for _ in range(3):
        nodes *= 2
        dp = nodes * hardware.cores_per_node // (w.tp * pp)
        if global_batch % (micro * dp) == 0:
            fixes.append((f"nodes={nodes}", {"dp": dp, "accumulation": global_batch // (micro * dp)}))
    return fixes


@dataclass(frozen=True)
class Fix:
    overrides: tuple[str, ...]
    plan: MemoryPlan | None  # the first plan that fits; None when nothing tried does


def cheapest_fix(w: Workload, recipe: Recipe, hardware: Hardware) -> Fix:
    overrides: list[str] = []
    for override, change in _fixes(w, recipe, hardware):
        w = dataclasses.replace(w, **change)
        key = override.partition("=")[0]
        overrides = [o for o in overrides if o.partition("=")[0] != key] + [override]  # a later value replaces
        candidate = plan(w, hardware)
        if candidate.fits:
            return Fix(tuple(overrides), candidate)
    return Fix(tuple(overrides), None)


# --- from a recipe ---------------------------------------------------------------------------------------


def model_config(recipe: Recipe) -> ModelConfig | None:
    """The recipe's config.json, parsed: its model.config directory if it is here, else a published model's
    facts bundled by directory name (training/train/models/), else None (nothing to plan with)."""
    for path in (
        Path(recipe.model.config) / "config.json",
        KNOWN_MODELS_DIR / f"{Path(recipe.model.config).name}.json",
    ):
        if path.is_file():
            return read_model_config(path)
    return None


def read_model_config(path: Path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads(path.read_text()), str(path))


def known_models() -> list[str]:
    return sorted(path.stem for path in KNOWN_MODELS_DIR.glob("*.json"))


def workload_of(
    recipe: Recipe, config: ModelConfig, hardware: Hardware, processes_per_node: int | None = None
) -> Workload:
    """The recipe's step on `hardware`, one process a NeuronCore unless `processes_per_node` says otherwise."""
    spec = config.spec
    tp, pp = recipe.parallelism.tp, recipe.parallelism.pp
    cores = recipe.nodes * (processes_per_node or hardware.cores_per_node)
    if cores % (tp * pp):
        raise UserError(
            f"parallelism.tp {tp} x parallelism.pp {pp} does not divide the {cores} NeuronCores of "
            f"{recipe.nodes} x {hardware.name}"
        )
    dp = cores // (tp * pp)
    return Workload(
        spec=spec,
        experts_per_token=config.experts_per_token,
        tp=tp,
        pp=pp,
        dp=dp,
        kv_multiplier=recipe.parallelism.kv_size_multiplier or default_kv_multiplier(spec, tp),
        sequence_parallel=recipe.parallelism.sequence_parallel,
        activation_checkpointing=recipe.memory.activation_checkpointing,
        flash_attention=recipe.memory.flash_attention,
        precision=recipe.precision,
        # what the training job runs: FSDP2 where it shards or casts (`training.train.native_training`), else
        # ZeRO-1 where it shards (`zero1_where_it_shards`)
        fsdp=fully_sharded(recipe, dp),
        zero1=recipe.optimizer.zero1 and dp > 1 and not fully_sharded(recipe, dp),
        micro=recipe.batch.micro,
        seq_len=recipe.batch.seq_len,
        accumulation=max(1, recipe.batch.global_batch // (recipe.batch.micro * dp)),
        moe_dispatch=moe_dispatch_of(recipe),
        capacity_factor=recipe.moe.capacity_factor,
    )


def fully_sharded(recipe: Recipe, dp: int) -> bool:
    return FACTS[recipe.backend].fully_sharded and (dp > 1 or recipe.precision != "fp32")


def moe_dispatch_of(recipe: Recipe) -> MoeDispatch:
    """What the training job runs (`training.model.transformer.build_model`'s default for the recipe)."""
    return default_moe_dispatch(recipe.backend, recipe.moe.capacity_factor)


def gib(value: float) -> float:
    return round(value / GIB, 2)


def refusal(recipe: Recipe, hardware: Hardware, config: ModelConfig | None = None) -> str | None:
    """One line when the recipe does not fit (None when it does, or when its model's config is unknown).
    `config`: the model's config when the caller has read it already (default: `model_config`)."""
    config = config or model_config(recipe)
    if config is None:
        return None
    w = workload_of(recipe, config, hardware)
    result = plan(w, hardware)
    if result.fits:
        return None
    fix = cheapest_fix(w, recipe, hardware)
    return (
        f"recipe {recipe.name} needs {gib(result.total)} GiB per NeuronCore of the {hardware.hbm_gib_per_core:g} GiB "
        f"on {hardware.name} ({result.headroom:.0%} headroom, {REQUIRED_HEADROOM:.0%} required); "
        + describe_fix(fix)
        + f" (python -m training plan --recipe {recipe.name})"
    )


def planned_gib_per_core(recipe: Recipe, hardware: Hardware, config: ModelConfig | None = None) -> float | None:
    """What the plan puts on each NeuronCore, in GiB; None when the model's config is not known. `config`: the
    model's config when the caller has read it already (default: `model_config`)."""
    config = config or model_config(recipe)
    if config is None:
        return None
    return gib(plan(workload_of(recipe, config, hardware), hardware).total)


def describe_fix(fix: Fix) -> str:
    if fix.plan is None:
        tried = " ".join(fix.overrides) or "nothing"
        return (
            f"nothing this recipe can set fits ({tried} still does not; pipeline parallelism does not run on "
            "Neuron yet)"
        )
    return f"cheapest fix: {' '.join(fix.overrides)} ({gib(fix.plan.total)} GiB, {fix.plan.headroom:.0%} headroom)"


def report(recipe: Recipe, hardware: Hardware, config: ModelConfig | None = None) -> tuple[dict[str, Any], str]:
    """The plan as --json gives it and as text; raises UserError when the model's config is not known.
    `config`: the model's config when the caller has read it already (default: `model_config`)."""
    config = config or model_config(recipe)
    if config is None:
        raise UserError(
            f"model.config {recipe.model.config}: no config.json there and not a bundled model "
            f"({', '.join(known_models())}); run where the model is, or set model.config to a copy of its directory"
        )
    w = workload_of(recipe, config, hardware)
    result = plan(w, hardware)
    fix = None if result.fits else cheapest_fix(w, recipe, hardware)
    data: dict[str, Any] = {
        "recipe": recipe.name,
        "hardware": hardware.name,
        "nodes": recipe.nodes,
        "tp": w.tp,
        "pp": w.pp,
        "dp": w.dp,
        "parameters_per_core": result.parameters,
        "breakdown_gib": {name: gib(value) for name, value in result.breakdown.items()},
        "per_core_gib": gib(result.total),
        "hbm_gib": hardware.hbm_gib_per_core,
        "headroom": round(result.headroom, 4),
        "required_headroom": REQUIRED_HEADROOM,
        "fits": result.fits,
        "fix": None
        if fix is None
        else {
            "overrides": list(fix.overrides),
            "per_core_gib": None if fix.plan is None else gib(fix.plan.total),
            "fits": fix.plan is not None,
        },
    }
    settings = [
        f"{w.precision}",
        "FSDP2" if w.fsdp else "ZeRO-1" if w.zero1 else "no ZeRO-1",
        "sequence parallel" if w.sequence_parallel else "no sequence parallel",
        f"{w.activation_checkpointing} checkpointing",
        "flash attention" if w.flash_attention else "no flash attention",
    ]
    lines = [
        f"{recipe.name} on {recipe.nodes} x {hardware.name}: TP {w.tp}, PP {w.pp}, DP {w.dp}, micro batch "
        f"{w.micro} x {w.seq_len} tokens; {', '.join(settings)}",
        f"per NeuronCore ({result.parameters / 1e6:.1f} M parameters):",
    ]
    lines += [f"  {name:<22}{gib(value):>8.2f} GiB" for name, value in result.breakdown.items()]
    verdict = "fits" if result.fits else f"does NOT fit (at least {REQUIRED_HEADROOM:.0%} headroom required)"
    lines.append(
        f"  {'total':<22}{gib(result.total):>8.2f} GiB of {hardware.hbm_gib_per_core:g} GiB, "
        f"{result.headroom:.0%} headroom: {verdict}"
    )
    if fix is not None:
        lines.append(describe_fix(fix))
    return data, "\n".join(lines)
