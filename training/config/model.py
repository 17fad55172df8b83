"""The facts of a model (torch-free): its config.json parsed once, how it is cut, its sizes and FLOPs.

`ModelConfig.from_hf` reads a Hugging Face `config.json` at the boundary of a run; that one object goes to the
model builder, the FLOPs estimate (MFU, the forecast) and the memory planner, which also runs where torch is
not installed (`cdk synth`). `ModelSpec` (the shapes that decide how a model is cut) is what the checkpoint
layouts (`training.formats.layouts`) read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from training.config.hardware import CHIPS, DEFAULT_GENERATION, Generation
from training.config.loading import not_allowed
from training.errors import UserError

Format = Literal["nxd", "nemo"]
# What activation checkpointing recomputes in backward (the recipe's memory.activation_checkpointing): nothing,
# the attention core and the MLP activation, or each whole decoder layer.
ActivationCheckpointing = Literal["none", "selective", "full"]
IGNORE_INDEX = -100  # Hugging Face's label of a position without a target: no loss (prompt tokens, block padding)
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "mixtral": "mixtral"}


@dataclass(frozen=True)
class ModelSpec:
    """The shapes that decide how a model is cut, read from its Hugging Face `config.json`."""

    architecture: Literal["llama", "mixtral"]
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_experts: int = 0
    tie_word_embeddings: bool = False

    @classmethod
    def from_config(cls, config: dict[str, Any], source: str = "config.json") -> ModelSpec:
        """The spec of a parsed config.json, checked first: `source` (the file) and the key name every problem,
        since a wrong size would otherwise surface as a shape error deep in a conversion or a training run."""
        model_type = config.get("model_type")
        if model_type not in ARCHITECTURES:
            raise UserError(
                f"{source}: model_type {model_type!r} is not supported; allowed: {', '.join(ARCHITECTURES)}"
            )
        architecture = ARCHITECTURES[model_type]
        sizes = {key: _required_size(config, key, source) for key in REQUIRED_SIZES}
        heads, hidden_size = sizes["num_attention_heads"], sizes["hidden_size"]
        kv_heads = _size(config, "num_key_value_heads", source) or heads
        if heads % kv_heads:
            raise UserError(
                f"{source}: {not_allowed('num_key_value_heads', kv_heads, f'a divisor of num_attention_heads {heads}')}"
            )
        head_dim = _size(config, "head_dim", source)
        if head_dim is None and hidden_size % heads:
            allowed = f"a multiple of num_attention_heads {heads} (or a head_dim key)"
            raise UserError(f"{source}: {not_allowed('hidden_size', hidden_size, allowed)}")
        experts = _required_size(config, "num_local_experts", source) if architecture == "mixtral" else 0
        tied = config.get("tie_word_embeddings", False)
        if tied is not None and not isinstance(tied, bool):
            raise UserError(f"{source}: {not_allowed('tie_word_embeddings', tied, 'true or false')}")
        return cls(
            architecture="mixtral" if architecture == "mixtral" else "llama",
            num_layers=sizes["num_hidden_layers"],
            hidden_size=hidden_size,
            intermediate_size=sizes["intermediate_size"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim or hidden_size // heads,
            vocab_size=sizes["vocab_size"],
            num_experts=experts,
            tie_word_embeddings=bool(tied),
        )


# The sizes every supported config.json states; each a whole number above 0.
REQUIRED_SIZES = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")


def _size(config: dict[str, Any], key: str, source: str) -> int | None:
    """An optional size from config.json (absent or null: None), refused unless an integer above 0."""
    value = config.get(key)
    if value is not None and (type(value) is not int or value < 1):
        raise UserError(f"{source}: {not_allowed(key, value, 'an integer above 0')}")
    return value


def _required_size(config: dict[str, Any], key: str, source: str) -> int:
    if key not in config:
        raise UserError(f"{source}: {key}: required key is missing")
    value = config[key]
    if type(value) is not int or value < 1:
        raise UserError(f"{source}: {not_allowed(key, value, 'an integer above 0')}")
    return value


@dataclass(frozen=True)
class Parallelism:
    tp: int = 1
    pp: int = 1
    kv_multiplier: int = 1
    fuse_qkv: bool = False
    generation: Generation = DEFAULT_GENERATION  # where NxD puts a KV head's replicas (training.config.hardware)

    @property
    def kv_replicas_adjacent(self) -> bool:
        return CHIPS[self.generation].kv_replicas_adjacent

    def ranks(self) -> list[tuple[int, int]]:
        """(tp, pp) of every rank, pipeline stage major."""
        return [(tp, pp) for pp in range(self.pp) for tp in range(self.tp)]


def check_parallelism(spec: ModelSpec, parallelism: Parallelism, layout: Format) -> None:
    """Refuse degrees that do not divide the model, naming the dimension and the values that would work."""
    tp, pp, multiplier = parallelism.tp, parallelism.pp, parallelism.kv_multiplier
    if tp < 1 or pp < 1 or multiplier < 1:
        raise UserError("--tp, --pp and --kv-size-multiplier must be at least 1")
    problems = tp_problems(spec, tp, layout)
    if problems:
        valid = [t for t in range(1, 129) if not tp_problems(spec, t, layout)]
        raise UserError(f"--tp {tp}: {problems[0]}; --tp values that fit this model: {', '.join(map(str, valid))}")
    if layout == "nxd" and multiplier not in kv_multipliers(spec, tp):
        allowed = ", ".join(map(str, kv_multipliers(spec, tp)))
        raise UserError(
            f"--kv-size-multiplier {multiplier}: {spec.num_kv_heads} KV heads x {multiplier} do not spread evenly "
            f"over {tp} ranks with whole query-head groups; allowed with --tp {tp}: {allowed}"
        )
    if spec.num_layers % pp:
        valid = [p for p in range(1, spec.num_layers + 1) if spec.num_layers % p == 0]
        raise UserError(
            f"--pp {pp}: {spec.num_layers} layers do not split evenly into {pp} stages; "
            f"allowed: {', '.join(map(str, valid))}"
        )


def kv_multipliers(spec: ModelSpec, tp: int) -> list[int]:
    """Replication factors m for NxD's GQA layer: kv*m divisible by tp, query group divisible by m."""
    group = spec.num_heads // spec.num_kv_heads
    return [m for m in range(1, group + 1) if (spec.num_kv_heads * m) % tp == 0 and group % m == 0]


def tp_problems(spec: ModelSpec, tp: int, layout: Format) -> list[str]:
    problems = []
    for name, size in (
        ("query heads", spec.num_heads),
        ("vocabulary size", spec.vocab_size),
        ("intermediate size", spec.intermediate_size),
    ):
        if size % tp:
            problems.append(f"{name} {size} is not divisible by {tp}")
    if layout == "nemo" and spec.num_kv_heads % tp:
        problems.append(f"{spec.num_kv_heads} KV heads are not divisible by {tp} (NeMo does not replicate KV heads)")
    if layout == "nxd" and not problems and not kv_multipliers(spec, tp):
        problems.append(f"no KV-size multiplier spreads {spec.num_kv_heads} KV heads over {tp} ranks")
    return problems


def default_kv_multiplier(spec: ModelSpec, tp: int) -> int:
    """The smallest multiplier that gives every rank a KV head (4 for Llama 3 8B at TP 32)."""
    fits = kv_multipliers(spec, tp)
    return fits[0] if fits else 1


# --- the rest of config.json the model needs --------------------------------------------------------------

ROPE_TYPES = ("default", "llama3")
DEFAULT_ROPE_THETA = {"llama": 10000.0, "mixtral": 1e6}


@dataclass(frozen=True)
class Rope:
    theta: float
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """The facts of a Hugging Face `config.json` the model needs, checked once: read at the boundary of a run
    and handed, as this object, to the model builder, the FLOPs estimate and the memory planner."""

    spec: ModelSpec
    rms_norm_eps: float
    rope: Rope
    initializer_range: float
    pad_token_id: int | None
    experts_per_token: int
    router_aux_loss_coef: float
    output_router_logits: bool
    sliding_window: int | None
    dtype: str | None  # the config's `dtype`/`torch_dtype` as written; the model checks it when it builds in it

    @classmethod
    def from_hf(cls, config: dict[str, Any], source: str = "config.json") -> ModelConfig:
        spec = ModelSpec.from_config(config, source)
        if config.get("hidden_act", "silu") != "silu":
            raise UserError(f"{source}: hidden_act {config['hidden_act']!r} is not supported; allowed: silu")
        for flag in ("attention_bias", "mlp_bias"):
            if config.get(flag):
                raise UserError(f"{source}: {flag} true is not supported (the NxD layout has no biases)")
        return cls(
            spec=spec,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6 if spec.architecture == "llama" else 1e-5)),
            rope=_rope(config, spec, source),
            initializer_range=float(config.get("initializer_range", 0.02)),
            pad_token_id=config.get("pad_token_id"),
            experts_per_token=int(config.get("num_experts_per_tok", 2)),
            router_aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)),
            output_router_logits=bool(config.get("output_router_logits", False)),
            sliding_window=config.get("sliding_window"),
            dtype=config.get("dtype") or config.get("torch_dtype"),
        )


def _rope(config: dict[str, Any], spec: ModelSpec, source: str) -> Rope:
    """RoPE settings from transformers 5's `rope_parameters` or the older `rope_theta` + `rope_scaling`."""
    parameters = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise UserError(f"{source}: rope_type {kind!r} is not supported; allowed: {', '.join(ROPE_TYPES)}")
    theta = float(parameters.get("rope_theta", config.get("rope_theta", DEFAULT_ROPE_THETA[spec.architecture])))
    if kind == "default":
        return Rope(theta=theta)
    return Rope(
        theta=theta,
        type=kind,
        factor=float(parameters["factor"]),
        low_freq_factor=float(parameters["low_freq_factor"]),
        high_freq_factor=float(parameters["high_freq_factor"]),
        original_max_position_embeddings=int(
            parameters.get("original_max_position_embeddings", config.get("max_position_embeddings", 8192))
        ),
    )


# --- sizes and FLOPs -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerParameters:
    """The weights of one decoder layer on one TP rank, by part (the K/V heads as replicated)."""

    attention: int  # q, k, v and o
    mlp: int  # one gated MLP: the layer's, or one expert's
    experts: int  # 0: a dense layer, one MLP
    router: int
    norms: int

    @property
    def total(self) -> int:
        return self.attention + (self.experts or 1) * self.mlp + self.router + self.norms

    def active(self, experts_per_token: int) -> int:
        """The weights a token multiplies by: attention, the router and the MLPs it is routed to (no norms)."""
        routed = experts_per_token if self.experts else 1
        return self.attention + self.router + routed * self.mlp


def layer_parameters(spec: ModelSpec, tp: int = 1, kv_multiplier: int = 1) -> LayerParameters:
    """One decoder layer's parameters on one of `tp` ranks: what the planner holds per core and what the FLOPs
    estimate multiplies (at TP 1)."""
    h, d = spec.hidden_size, spec.head_dim
    attention = 2 * h * spec.num_heads * d // tp + 2 * h * d * spec.num_kv_heads * kv_multiplier // tp
    mlp = 3 * h * spec.intermediate_size // tp
    router = h * spec.num_experts  # replicated on every rank
    return LayerParameters(attention, mlp, spec.num_experts, router, norms=2 * h)


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token for MFU: 6 x N_active + 12 x L x (heads x head_dim) x seq_len.

    N_active counts the weights a token multiplies by: attention (q, k, v, o), the MLP (Mixtral: the router
    and top-k of the E experts) and the LM head; not the embedding lookup or norms. The second term is
    the attention scores and weighted sum (2 matmuls, 2 FLOPs per multiply-add, x3 for forward + backward)
    over the full sequence, the causal half not discounted (the PaLM convention).
    """
    spec = config.spec
    active = spec.num_layers * layer_parameters(spec).active(config.experts_per_token)
    active += spec.vocab_size * spec.hidden_size
    return float(6 * active + 12 * spec.num_layers * spec.num_heads * spec.head_dim * seq_len)
