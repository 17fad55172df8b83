"""The facts of a model that decide how it is cut, and the parallel degrees that cut it (torch-free).

Read by the checkpoint layouts (`training.formats.layouts`), the model, and the memory planner, which also
runs where torch is not installed (`cdk synth`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

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
    def from_config(cls, config: dict[str, Any]) -> ModelSpec:
        model_type = config.get("model_type")
        if model_type not in ARCHITECTURES:
            raise UserError(
                f"config.json: model_type {model_type!r} is not supported; allowed: {', '.join(ARCHITECTURES)}"
            )
        architecture = ARCHITECTURES[model_type]
        heads = int(config["num_attention_heads"])
        return cls(
            architecture="mixtral" if architecture == "mixtral" else "llama",
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            vocab_size=int(config["vocab_size"]),
            num_experts=int(config.get("num_local_experts", 0)) if architecture == "mixtral" else 0,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )


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
