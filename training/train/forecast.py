"""What a run will take before it starts: tokens, steps, time and cost (`plan`, `submit`, `cdk synth`).

Pure arithmetic, torch-free. Tokens = steps x global batch x sequence length; time = steps x global batch /
(sequences/s per node x nodes); cost = hours x what the environment costs per training hour (the caller's:
the site's or the environment's figure, else the training nodes' list price alone).

The throughput per node is data with its source (`EXPECTED`): Neuron's published figure where there is one
(Llama 3.1 8B at sequence 8192 on trn1.32xlarge). For any other model it is derived: the MFU band of that
published figure (SDK 2.20-2.24: 1.31 to 1.67 sequences/s per node, 20.4 % to 26.1 % MFU, 23.4 % at 2.24's
1.50) applied to the model's FLOPs per token at the recipe's sequence length, over the recipe's peak per
NeuronCore. Mixtral 8x7B has no published Trainium figure, so its band is this derivation: it assumes the
MoE dispatch (capacity factor 2 computes twice the useful expert FLOPs) and the pipeline bubble cost no more
than Llama's dense layers lose, which puts a real run nearer the band's low end or below it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.config.backends import FACTS
from training.config.hardware import TRAINIUM1, Hardware
from training.config.model import ModelConfig, flops_per_token
from training.config.recipe import Recipe
from training.train.memory import KNOWN_MODELS_DIR, model_config, read_model_config

# Neuron's performance table (trn1.32xlarge, 32 nodes, TP 32, ZeRO-1, global batch 1024, sequence 8192).
PUBLISHED_MODEL = "Llama-3.1-8B"  # model.config's directory name
PUBLISHED_SEQ_LEN = 8192
PUBLISHED_CORES_PER_NODE = 32  # trn1.32xlarge's NeuronCores; other types scale by their peak FLOPS
PUBLISHED_PEAK_TFLOPS_PER_CORE = TRAINIUM1.peak_bf16_tflops_per_logical_core
PUBLISHED_SEQ_PER_NODE = 1.50  # SDK 2.24
PUBLISHED_RANGE = (1.31, 1.67)  # SDK 2.20-2.24
PUBLISHED_SOURCE = (
    "Neuron's published table, SDK 2.24 (1.31-1.67 across 2.20-2.24; the first source document measured 5.33 "
    "seq/s on 4 nodes, 1.33 a node)"
)
HOURS_PER_DAY = 24


@dataclass(frozen=True)
class Throughput:
    """Sequences/s per node of one trn1.32xlarge-sized node (32 NeuronCores), with its band and source."""

    expected: float
    low: float
    high: float
    source: str

    def per_node(self, cores_per_node: int, peak_tflops_per_core: float) -> Throughput:
        """On a node of `cores_per_node` cores of that peak: the published node's MFU, scaled by peak FLOPS."""
        scale = cores_per_node * peak_tflops_per_core / (PUBLISHED_CORES_PER_NODE * PUBLISHED_PEAK_TFLOPS_PER_CORE)
        source = self.source
        if peak_tflops_per_core != PUBLISHED_PEAK_TFLOPS_PER_CORE:
            source += f"; at the published MFU, scaled by peak FLOPS to {peak_tflops_per_core:g} TFLOPS a core"
        return Throughput(self.expected * scale, self.low * scale, self.high * scale, source)


# Keyed by (model.config's directory name, sequence length): the figures measured or published.
EXPECTED: dict[tuple[str, int], Throughput] = {
    (PUBLISHED_MODEL, PUBLISHED_SEQ_LEN): Throughput(
        PUBLISHED_SEQ_PER_NODE, PUBLISHED_RANGE[0], PUBLISHED_RANGE[1], PUBLISHED_SOURCE
    ),
}


def mfu(seq_per_node: float, flops: float, seq_len: int, peak_tflops_per_core: float, cores: int) -> float:
    return flops * seq_per_node * seq_len / (peak_tflops_per_core * 1e12 * cores)


def seq_per_node_at(utilization: float, flops: float, seq_len: int, peak_tflops_per_core: float, cores: int) -> float:
    return utilization * peak_tflops_per_core * 1e12 * cores / (flops * seq_len)


def expected_throughput(
    model: str, config: ModelConfig, seq_len: int, peak_tflops_per_core: float, cores_per_node: int
) -> Throughput:
    """The published figure for `model` at `seq_len`, else one derived from its MFU band (module docstring)."""
    known = EXPECTED.get((model, seq_len))
    if known is not None:
        return known.per_node(cores_per_node, peak_tflops_per_core)
    reference = flops_per_token(_published_config(), PUBLISHED_SEQ_LEN)
    flops = flops_per_token(config, seq_len)

    def published_mfu(seq: float) -> float:
        return mfu(seq, reference, PUBLISHED_SEQ_LEN, PUBLISHED_PEAK_TFLOPS_PER_CORE, PUBLISHED_CORES_PER_NODE)

    def at(seq: float) -> float:
        return seq_per_node_at(published_mfu(seq), flops, seq_len, peak_tflops_per_core, cores_per_node)

    low, high = PUBLISHED_RANGE
    utilization = (published_mfu(value) for value in (low, PUBLISHED_SEQ_PER_NODE, high))
    band = "-".join(f"{u:.1%}" for u in utilization)
    source = (
        f"derived, nothing published for {model} at sequence {seq_len}: {PUBLISHED_MODEL}'s published MFU band "
        f"({band}) at {flops / 1e9:.1f} GFLOP per token"
    )
    return Throughput(at(PUBLISHED_SEQ_PER_NODE), at(low), at(high), source)


@functools.cache
def _published_config() -> ModelConfig:
    return read_model_config(KNOWN_MODELS_DIR / f"{PUBLISHED_MODEL}.json")


@dataclass(frozen=True)
class Forecast:
    recipe: str
    instance_type: str
    nodes: int
    steps: int
    global_batch: int
    seq_len: int
    throughput: Throughput  # per node of `instance_type`
    usd_per_hour: float  # what the environment costs while this run trains
    cost_basis: str  # what usd_per_hour includes

    @property
    def tokens(self) -> int:
        return self.steps * self.global_batch * self.seq_len

    def hours_at(self, seq_per_node: float) -> float:
        return self.steps * self.global_batch / (seq_per_node * self.nodes) / 3600

    @property
    def hours(self) -> float:
        return self.hours_at(self.throughput.expected)

    @property
    def usd(self) -> float:
        return self.hours * self.usd_per_hour

    @property
    def step_seconds(self) -> float:
        return self.global_batch / (self.throughput.expected * self.nodes)

    def as_dict(self) -> dict[str, Any]:
        t = self.throughput
        return {
            "tokens": self.tokens,
            "steps": self.steps,
            "seq_per_second_per_node": round(t.expected, 3),
            "seq_per_second_per_node_band": [round(t.low, 3), round(t.high, 3)],
            "throughput_source": t.source,
            "step_seconds": round(self.step_seconds, 1),
            "hours": round(self.hours, 1),
            "hours_band": [round(self.hours_at(t.high), 1), round(self.hours_at(t.low), 1)],
            "usd_per_hour": round(self.usd_per_hour, 2),
            "usd": round(self.usd),
            "usd_band": [round(self.hours_at(seq) * self.usd_per_hour) for seq in (t.high, t.low)],
            "cost_basis": self.cost_basis,
        }

    def describe(self) -> str:
        """Two lines: the run's size and duration, then the throughput's source."""
        t = self.throughput
        fast, slow = self.hours_at(t.high), self.hours_at(t.low)
        return (
            f"forecast: {self.steps:,} steps x {self.global_batch} x {self.seq_len} = {token_count(self.tokens)} "
            "tokens; "
            f"at {t.expected:.2f} seq/s per node ({t.low:.2f}-{t.high:.2f}) on {self.nodes} x {self.instance_type}: "
            f"{self.step_seconds:.1f} s a step, {duration(self.hours)} ({duration(fast)}-{duration(slow)}), "
            f"about ${self.usd:,.0f} (${fast * self.usd_per_hour:,.0f}-${slow * self.usd_per_hour:,.0f}) at "
            f"${self.usd_per_hour:,.2f}/h ({self.cost_basis})\n"
            f"throughput: {t.source}"
        )


def token_count(tokens: int) -> str:
    return f"{tokens / 1e9:.1f} B" if tokens >= 1e9 else f"{tokens / 1e6:.1f} M"


def duration(hours: float) -> str:
    if hours < 1:
        return f"{hours * 60:.0f} min"
    return f"{hours / HOURS_PER_DAY:.1f} days" if hours >= 48 else f"{hours:.1f} h"


ENVIRONMENT_KEYS = ("budget.monthly_usd", "budget.accept_forecast_usd")


def budget_refusal(
    forecast: Forecast,
    monthly_usd: float | None,
    accepted_usd: float | None,
    keys: tuple[str, str] = ENVIRONMENT_KEYS,
) -> str | None:
    """One line when the forecast costs more than the monthly budget and no one accepted that much. `keys`:
    the budget's and the acceptance's names where the user sets them (the environment file's by default)."""
    if monthly_usd is None or forecast.usd <= monthly_usd:
        return None
    if accepted_usd is not None and forecast.usd <= accepted_usd:
        return None
    return (
        f"forecast: {forecast.recipe} costs about ${forecast.usd:,.0f} ({duration(forecast.hours)} on {forecast.nodes} "
        f"x {forecast.instance_type}), above {keys[0]} {monthly_usd:g}; shorten steps, or set {keys[1]} to at "
        f"least {math.ceil(forecast.usd)} to accept it"
    )


NODES_ONLY = "the training nodes' on-demand list price only"


def forecast_of(
    recipe: Recipe,
    hardware: Hardware,
    usd_per_hour: float | None = None,
    cost_basis: str = "the caller's cost per hour",
    config: ModelConfig | None = None,
) -> Forecast | None:
    """The recipe's forecast on `hardware`; None for the CPU backend or a model whose config.json is unknown.
    `usd_per_hour`: the environment's cost while training, `cost_basis` what it includes (default: the nodes'
    list price x nodes)."""
    if not FACTS[recipe.backend].on_trainium:
        return None
    config = config or model_config(recipe)
    if config is None:
        return None
    throughput = expected_throughput(
        Path(recipe.model.config).name,
        config,
        recipe.batch.seq_len,
        recipe.peak_tflops_per_worker,
        hardware.cores_per_node,
    )
    return Forecast(
        recipe=recipe.name,
        instance_type=hardware.name,
        nodes=recipe.nodes,
        steps=recipe.steps,
        global_batch=recipe.batch.global_batch,
        seq_len=recipe.batch.seq_len,
        throughput=throughput,
        usd_per_hour=recipe.nodes * hardware.usd_per_hour if usd_per_hour is None else usd_per_hour,
        cost_basis=cost_basis if usd_per_hour is not None else NODES_ONLY,
    )


def markdown_row(label: str, forecast: Forecast) -> str:
    """The forecast as a row of docs/training-job.md's table (a test keeps its rows equal to these)."""
    t = forecast.throughput
    kind = "published" if t.source == PUBLISHED_SOURCE else f"derived, {t.low:.2f}-{t.high:.2f}"
    fast, slow = forecast.hours_at(t.high), forecast.hours_at(t.low)
    return (
        f"| {label} | {forecast.steps:,} x {forecast.global_batch} x {forecast.seq_len} "
        f"| {token_count(forecast.tokens)} | {t.expected:.2f} ({kind}) | {forecast.step_seconds:.1f} s "
        f"| {duration(forecast.hours)} ({duration(fast)}-{duration(slow)}) | about ${forecast.usd:,.0f} |"
    )
