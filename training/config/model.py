"""The facts of a model that decide how it is cut, and the parallel degrees that cut it (torch-free).

Read by the checkpoint layouts (`training.formats.layouts`), the model, and the memory planner, which also
runs where torch is not installed (`cdk synth`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from training.config.loading import not_allowed
from training.errors import UserError

Format = Literal["nxd", "nemo"]
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
