"""Expected throughput of a recipe on Trainium against Neuron's published figure, from the project's MFU model.

    python benchmarks/throughput_model.py [--recipe llama31-8b-cpt] [--nodes N] [--instance-type trn1.32xlarge]

Nothing is timed and nothing calls AWS. The training job logs MFU as model FLOPs per token
(`training.config.model.flops_per_token` of the recipe's config at its sequence length) x tokens/s,
over `peak_tflops_per_worker` x the workers (one per NeuronCore, `training/config/hardware.py`); this prints what
that model makes of three throughputs of Llama 3.1 8B at sequence 8192 on trn1.32xlarge:

- Neuron's published figure: 1.50 sequences/s per node (SDK 2.24's performance table, 32 nodes, TP 32, ZeRO-1,
  global batch 1024; 1.31-1.67 across SDK 2.20-2.24);
- the first source document's measurement: 5.33 sequences/s on 4 nodes (its second and last step; the first
  printed 4.62), TP 32, ZeRO-1, sequence 8192, global batch 1024;
- the goal for the first real run: at least the published figure per node;

each as sequences/s and tokens/s per node, the MFU it implies, the step time of the recipe's global batch on
its nodes, and the hours and on-demand dollars of the recipe's steps. The published figure also checks the
model: its MFU against Neuron's "about 23 %", the FLOPs per token against "about 57.9 GFLOP".
For a recipe of another model or sequence length (Mixtral) nothing is published: it prints the throughput
the recipe needs to reach the MFU that the Llama figures imply.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from training.config.hardware import HARDWARE  # noqa: E402
from training.config.model import flops_per_token  # noqa: E402
from training.config.recipe import Recipe, load_recipe  # noqa: E402
from training.errors import UserError, report  # noqa: E402
from training.train.memory import known_models, model_config  # noqa: E402

# The figures below are the sources' own, typed once here (REFERENCE.md section 11 "Neuron's published
# training throughput", and the first source document's training log).
REFERENCE_RECIPE = "llama31-8b-cpt"  # the recipe the published and measured figures are for
PUBLISHED_MODEL = "Llama-3.1-8B"  # model.config's directory name
PUBLISHED_SEQ_LEN = 8192
PUBLISHED_INSTANCE_TYPE = "trn1.32xlarge"
PUBLISHED_SEQ_PER_NODE = 1.50  # Neuron performance table, SDK 2.24: 32 x trn1.32xlarge, TP 32, ZeRO-1, GBS 1024
PUBLISHED_RANGE = (1.31, 1.67)  # sequences/s per node across SDK 2.20-2.24
PUBLISHED_MFU = 0.23  # "about 23 % MFU at 3,040 BF16 TFLOPS per instance"
PUBLISHED_GFLOP_PER_TOKEN = 57.9  # "about 57.9 GFLOP per token at sequence 8192"
PUBLISHED_TFLOPS_PER_INSTANCE = 3040.0
# The first source document (seeds/000): `throughput : 5.33 seq/s` at step 2 of `sbatch --nodes 4`.
DOCUMENT_SEQ_PER_SECOND = 5.33
DOCUMENT_NODES = 4


@dataclass(frozen=True)
class ThroughputModel:
    """What turns a throughput into MFU, step time and cost for one recipe on its nodes."""

    recipe: str
    model: str  # model.config's directory name
    nodes: int
    instance_type: str
    workers_per_node: int  # one training process per NeuronCore
    seq_len: int
    global_batch: int
    steps: int
    flops_per_token: float  # flops_per_token of the recipe's config at its sequence length
    peak_tflops_per_worker: float  # the recipe's
    usd_per_node_hour: float  # on-demand list price (training/config/hardware.py)

    @property
    def peak_flops_per_node(self) -> float:
        return self.peak_tflops_per_worker * 1e12 * self.workers_per_node

    @property
    def published_applies(self) -> bool:
        """Neuron's figure and the document's are for this model at this sequence length on this instance type."""
        return (self.model, self.seq_len, self.instance_type) == (
            PUBLISHED_MODEL,
            PUBLISHED_SEQ_LEN,
            PUBLISHED_INSTANCE_TYPE,
        )


@dataclass(frozen=True)
class Row:
    label: str
    seq_per_node: float
    tokens_per_node: float
    mfu: float
    step_seconds: float
    hours: float  # of the recipe's steps
    usd: float  # the training nodes' on-demand price for those hours


def throughput_model(
    recipe_name: str = REFERENCE_RECIPE, nodes: str | None = None, instance_type: str = PUBLISHED_INSTANCE_TYPE
) -> ThroughputModel:
    """The recipe's model (`nodes` as the recipe override `nodes=N`); UserError for a bad recipe or node count."""
    recipe: Recipe = load_recipe(recipe_name, [] if nodes is None else [f"nodes={nodes}"])
    config = model_config(recipe)
    if config is None:
        raise UserError(
            f"model.config {recipe.model.config}: no config.json there and not a bundled model "
            f"({', '.join(known_models())}); set model.config to a copy of the model's directory"
        )
    facts = HARDWARE[instance_type]
    return ThroughputModel(
        recipe=recipe.name,
        model=Path(recipe.model.config).name,
        nodes=recipe.nodes,
        instance_type=instance_type,
        workers_per_node=facts.cores_per_node,
        seq_len=recipe.batch.seq_len,
        global_batch=recipe.batch.global_batch,
        steps=recipe.steps,
        flops_per_token=flops_per_token(config, recipe.batch.seq_len),
        peak_tflops_per_worker=recipe.peak_tflops_per_worker,
        usd_per_node_hour=facts.usd_per_hour,
    )


def mfu(model: ThroughputModel, seq_per_node: float) -> float:
    """The training job's MFU (training/train/loop.py): FLOPs per token x tokens/s over the workers' peak."""
    return model.flops_per_token * seq_per_node * model.seq_len / model.peak_flops_per_node


def seq_per_node_at(model: ThroughputModel, utilization: float) -> float:
    """The sequences/s per node at which the recipe reaches `utilization` MFU."""
    return utilization * model.peak_flops_per_node / (model.flops_per_token * model.seq_len)


def row(model: ThroughputModel, label: str, seq_per_node: float) -> Row:
    step_seconds = model.global_batch / (seq_per_node * model.nodes)
    hours = model.steps * step_seconds / 3600
    return Row(
        label=label,
        seq_per_node=seq_per_node,
        tokens_per_node=seq_per_node * model.seq_len,
        mfu=mfu(model, seq_per_node),
        step_seconds=step_seconds,
        hours=hours,
        usd=hours * model.nodes * model.usd_per_node_hour,
    )


def rows(model: ThroughputModel, reference: ThroughputModel) -> list[Row]:
    """Published, document and goal for the Llama figures' own setting; otherwise the throughput at the MFU each
    Llama figure implies on `reference` (the Llama recipe), the goal being the published one's."""
    document_per_node = DOCUMENT_SEQ_PER_SECOND / DOCUMENT_NODES
    if model.published_applies:
        return [
            row(model, "published (SDK 2.24, 32 nodes)", PUBLISHED_SEQ_PER_NODE),
            row(model, f"document ({DOCUMENT_SEQ_PER_SECOND} seq/s, {DOCUMENT_NODES} nodes)", document_per_node),
            row(model, "goal for the first run (at least)", PUBLISHED_SEQ_PER_NODE),
        ]
    published_mfu = mfu(reference, PUBLISHED_SEQ_PER_NODE)
    document_mfu = mfu(reference, document_per_node)
    return [
        row(model, f"at Llama's published MFU ({published_mfu:.1%})", seq_per_node_at(model, published_mfu)),
        row(model, f"at Llama's document MFU ({document_mfu:.1%})", seq_per_node_at(model, document_mfu)),
        row(model, "goal for the first run (at least)", seq_per_node_at(model, published_mfu)),
    ]


def markdown_table(model: ThroughputModel, table: Sequence[Row]) -> str:
    """The rows as docs/training-job.md shows them (a test keeps its table equal to this)."""
    lines = [
        f"| {model.model}, {model.nodes} x {model.instance_type}, seq {model.seq_len}, global batch "
        f"{model.global_batch} | seq/s per node | tokens/s per node | MFU | step (s) | {model.steps:,} steps (h) "
        f"| USD ({model.nodes} x ${model.usd_per_node_hour:.2f}/h) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in table:
        lines.append(
            f"| {r.label} | {r.seq_per_node:.2f} | {r.tokens_per_node:,.0f} | {r.mfu:.1%} | {r.step_seconds:.1f} "
            f"| {r.hours:,.1f} | ${r.usd:,.0f} |"
        )
    return "\n".join(lines) + "\n"


def render(model: ThroughputModel, reference: ThroughputModel) -> str:
    per_node_peak = model.peak_flops_per_node / 1e12
    table = rows(model, reference)
    lines = [
        f"{model.recipe}: {model.model}, {model.nodes} x {model.instance_type} ({model.workers_per_node} "
        f"NeuronCores each), seq {model.seq_len}, global batch {model.global_batch}, {model.steps:,} steps",
        f"model FLOPs per token: {model.flops_per_token / 1e9:.2f} GFLOP (flops_per_token: 6 x active "
        "weights + 12 x layers x heads x head_dim x seq)",
        f"peak: {model.peak_tflops_per_worker:g} BF16 TFLOPS per NeuronCore (the recipe's peak_tflops_per_worker) x "
        f"{model.workers_per_node} = {per_node_peak:,.0f} TFLOPS per node",
        "MFU = FLOPs per token x tokens/s per node / peak per node (the training job's metric)",
        "",
        markdown_table(model, table),
    ]
    goal = table[-1]
    lines.append(
        f"goal: at least {goal.seq_per_node:.2f} seq/s per node, {goal.seq_per_node * model.nodes:.2f} seq/s on "
        f"{model.nodes} nodes ({goal.step_seconds:.1f} s a step, {goal.mfu:.1%} MFU; {model.steps:,} steps in "
        f"{goal.hours:,.1f} h{f' = {goal.hours / 24:.1f} days' if goal.hours >= 48 else ''}, "
        f"${goal.usd:,.0f} on demand)"
    )
    if model.published_applies:
        published, document = table[0], table[1]
        low, high = PUBLISHED_RANGE
        inside = "inside" if low <= document.seq_per_node <= high else "outside"
        lines.append(
            f"document / published: {document.seq_per_node / published.seq_per_node:.3f} "
            f"({DOCUMENT_SEQ_PER_SECOND} / {DOCUMENT_NODES} = {document.seq_per_node:.4f} seq/s per node, {inside} "
            f"the published {low}-{high} across SDK 2.20-2.24)"
        )
        # Neuron's 57.9 GFLOP counts what flops_per_token counts: 6 x the weights a token multiplies
        # (7.50 G: attention, MLP, LM head; 45.0 GFLOP) plus the attention scores over the whole sequence,
        # causal half not discounted (12 x 32 layers x 4096 x 8192 = 12.9 GFLOP). 6 x weights alone would be
        # 45.0 GFLOP and put the published figure at 18 % MFU instead of Neuron's 23 %.
        gflop = model.flops_per_token / 1e9
        lines.append(
            f"check against Neuron's figures: {gflop:.2f} against about {PUBLISHED_GFLOP_PER_TOKEN} GFLOP per token "
            f"({gflop / PUBLISHED_GFLOP_PER_TOKEN:.4f}x); {per_node_peak:,.0f} against "
            f"{PUBLISHED_TFLOPS_PER_INSTANCE:,.0f} TFLOPS per instance; published MFU {published.mfu:.1%} against "
            f"about {PUBLISHED_MFU:.0%}"
        )
    else:
        lines.append(
            f"no published figure for {model.model} at seq {model.seq_len} on {model.instance_type}: the rows are "
            f"the throughput at the MFU of the {reference.recipe} figures (useful FLOPs only: the top-k experts a "
            "token uses, pipeline bubbles and dispatch padding count as lost)"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=REFERENCE_RECIPE, help="a bundled recipe's name or a recipe file")
    parser.add_argument("--nodes", help="training nodes (default: the recipe's `nodes`)")
    parser.add_argument(
        "--instance-type",
        default=PUBLISHED_INSTANCE_TYPE,
        choices=sorted(HARDWARE),
        help=f"the training nodes (default: {PUBLISHED_INSTANCE_TYPE}, the published figure's)",
    )
    arguments = parser.parse_args(argv)
    try:
        model = throughput_model(arguments.recipe, arguments.nodes, arguments.instance_type)
        reference = throughput_model(REFERENCE_RECIPE, instance_type=PUBLISHED_INSTANCE_TYPE)
    except UserError as error:
        report(error)
        return 2
    print(render(model, reference), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
