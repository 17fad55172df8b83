"""Checkpoint layouts: which Hugging Face tensor becomes which shard of which rank, and back.

The one definition shared by the converter and by the training job's loader and saver. Everything here
is pure tensor arithmetic (no files), organised as rules: a rule takes the Hugging Face tensors it names
and returns one tensor per tensor-parallel rank (`split`), and turns the per-rank tensors back into the
Hugging Face tensors (`merge`). Facts behind each rule: REFERENCE.md sections 5 (neuronx-distributed)
and 6 (NeMo Megatron).

NxD, Mixtral: the experts are stacked and fused the way neuronx-distributed's MoE modules hold them
(`mlp.expert_mlps.mlp_op.gate_up_proj.weight` [E, H, 2I] split on its last dim with gate and up halves
per rank, `down_proj.weight` [E, I, H] split on dim 1), and the router
(`mlp.router.linear_router.weight` [E, H]) is replicated on every rank.

One module on purpose: the NxD and NeMo rules share the head permutations and the split/merge pairs, and
keeping every layout in one file is what makes it the single definition.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

# The model facts and parallel degrees are torch-free (the memory planner runs at `cdk synth`); re-exported here.
from training.config.model import (  # noqa: F401  (the rest re-exported for older imports)
    ARCHITECTURES,
    Format,
    ModelSpec,
    Parallelism,
    check_parallelism,
    default_kv_multiplier,
    kv_multipliers,
    tp_problems,
)


def stage_of_layer(spec: ModelSpec, parallelism: Parallelism, layer: int) -> tuple[int, int]:
    """(pipeline stage, local layer index): layers are split contiguously over stages."""
    per_stage = spec.num_layers // parallelism.pp
    return layer // per_stage, layer % per_stage


def hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of the Hugging Face checkpoint and its shape."""
    h, d, i = spec.hidden_size, spec.head_dim, spec.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        shapes |= {
            f"{p}input_layernorm.weight": (h,),
            f"{p}post_attention_layernorm.weight": (h,),
            f"{p}self_attn.q_proj.weight": (spec.num_heads * d, h),
            f"{p}self_attn.k_proj.weight": (spec.num_kv_heads * d, h),
            f"{p}self_attn.v_proj.weight": (spec.num_kv_heads * d, h),
            f"{p}self_attn.o_proj.weight": (h, spec.num_heads * d),
        }
        if spec.architecture == "llama":
            shapes |= {
                f"{p}mlp.gate_proj.weight": (i, h),
                f"{p}mlp.up_proj.weight": (i, h),
                f"{p}mlp.down_proj.weight": (h, i),
            }
        else:
            shapes[f"{p}block_sparse_moe.gate.weight"] = (spec.num_experts, h)
            for e in range(spec.num_experts):
                expert = f"{p}block_sparse_moe.experts.{e}."
                shapes |= {f"{expert}w1.weight": (i, h), f"{expert}w3.weight": (i, h), f"{expert}w2.weight": (h, i)}
    return shapes


# --- rules --------------------------------------------------------------------------------------------

# A split computes one rank's shard at a time, so a converter holds one shard, not all of them.
Split = Callable[[Sequence[torch.Tensor], int], torch.Tensor]
Merge = Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]


@dataclass(frozen=True)
class Rule:
    """Hugging Face tensors `sources` <-> one tensor per TP rank stored under `target` on `stage`."""

    sources: tuple[str, ...]
    target: str
    stage: int
    split: Split = field(compare=False)
    merge: Merge = field(compare=False)


@dataclass(frozen=True)
class Concatenate:
    """Merge of an even split: the rank shards concatenated along `dim`.

    A class rather than a lambda so a reader can recognise it and fill the result shard by shard.
    """

    dim: int

    def __call__(self, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.cat(list(shards), dim=self.dim)]


@dataclass(frozen=True)
class Unfuse:
    """Merge of a fused rule: cut each rank's shard into its parts (`sizes` along `dim`), merge each part."""

    parts: tuple[Merge, ...]
    sizes: tuple[int, ...]
    dim: int

    def __call__(self, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        pieces = [torch.split(shard, list(self.sizes), dim=self.dim) for shard in shards]
        return [merge([p[index] for p in pieces])[0] for index, merge in enumerate(self.parts)]


@dataclass(frozen=True)
class Chunk:
    """Even split of one source along `dim`; a class so writers can copy dim-0 chunks file to file."""

    dim: int
    tp: int

    def __call__(self, sources: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
        return torch.chunk(sources[0], self.tp, dim=self.dim)[rank]


@dataclass(frozen=True)
class Fuse:
    """Each source split by its own rule, the rank's pieces concatenated along `dim`."""

    parts: tuple[Split, ...]
    dim: int

    def __call__(self, sources: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
        pieces = [split([source], rank) for split, source in zip(self.parts, sources, strict=True)]
        return torch.cat(pieces, dim=self.dim)


def chunk(dim: int, tp: int) -> tuple[Split, Merge]:
    """Even split along `dim` (column/row-parallel linear, vocab-parallel embedding)."""
    return Chunk(dim, tp), Concatenate(dim)


@dataclass(frozen=True)
class Replicate:
    """The same tensor on every rank; a class so the training job can tell replicated parameters apart."""

    def __call__(self, sources: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
        return sources[0]


def replicate(tp: int) -> tuple[Split, Merge]:
    """The same tensor on every rank (norms, the MoE router in NxD); merge takes rank 0's copy."""
    return (Replicate(), lambda shards: [shards[0]])


def replicated_targets(spec: ModelSpec, parallelism: Parallelism, layout: Format) -> set[str]:
    """Names of the tensors every TP rank holds whole (counted once in a gradient norm)."""
    return {
        rule.target
        for rules in all_rules(spec, parallelism, layout)
        for rule in rules
        if isinstance(rule.split, Replicate)
    }


def query_head_order(spec: ModelSpec, parallelism: Parallelism) -> list[list[int]]:
    """Query heads held by each TP rank in neuronx-distributed's GQA layout.

    K/V are repeated `m` times and cut evenly, so rank r holds the replicas at positions [r*c, (r+1)*c)
    (c = kv*m/tp). On trn1 the replicas are tiled: position p is KV head p % kv, replica p // kv; on trn2 they are
    adjacent: position p is KV head p // m, replica p % m. The query heads of KV head j are split into m equal
    parts; replica k of head j takes part k. For Llama 3 8B at TP 32 on trn1 (m = 4) rank r holds query head
    4*(r % 8) + r // 8; on trn2 every rank holds its own block of query heads in order.
    """
    kv, m, tp = spec.num_kv_heads, parallelism.kv_multiplier, parallelism.tp
    group = spec.num_heads // kv
    part = group // m
    per_rank = kv * m // tp
    order = []
    for rank in range(tp):
        heads: list[int] = []
        for position in range(rank * per_rank, (rank + 1) * per_rank):
            head, replica = kv_position(position, kv, m, parallelism.kv_replicas_adjacent)
            heads += range(head * group + replica * part, head * group + (replica + 1) * part)
        order.append(heads)
    return order


def kv_position(position: int, kv: int, m: int, adjacent: bool) -> tuple[int, int]:
    """(KV head, replica) at `position` of the K/V weight repeated `m` times (module docstring of query_head_order)."""
    return (position // m, position % m) if adjacent else (position % kv, position // kv)


def _head_rows(tensor: torch.Tensor, heads: Sequence[int], head_dim: int) -> torch.Tensor:
    return torch.cat([tensor[h * head_dim : (h + 1) * head_dim] for h in heads], dim=0)


def _heads_in_order(order: list[list[int]]) -> bool:
    """True when rank r simply holds the r-th block of heads (always so without KV replication)."""
    flat = [h for heads in order for h in heads]
    return flat == list(range(len(flat)))


def nxd_query(spec: ModelSpec, parallelism: Parallelism) -> tuple[Split, Merge]:
    order = query_head_order(spec, parallelism)
    if _heads_in_order(order):
        return chunk(0, parallelism.tp)  # the same split, recognisable as rows to copy file to file
    inverse = _inverse_order(order, spec.head_dim)
    return (
        lambda sources, rank: _head_rows(sources[0], order[rank], spec.head_dim),
        lambda shards: [torch.cat(list(shards), dim=0)[inverse]],
    )


def nxd_output(spec: ModelSpec, parallelism: Parallelism) -> tuple[Split, Merge]:
    """o_proj columns follow the query heads of each rank."""
    order = query_head_order(spec, parallelism)
    if _heads_in_order(order):
        return chunk(1, parallelism.tp)
    inverse = _inverse_order(order, spec.head_dim)
    return (
        lambda sources, rank: _head_rows(sources[0].t(), order[rank], spec.head_dim).t(),
        lambda shards: [torch.cat(list(shards), dim=1)[:, inverse]],
    )


def _inverse_order(order: list[list[int]], head_dim: int) -> torch.Tensor:
    """Row index that puts rank-ordered query rows back in Hugging Face head order."""
    flat = [h for heads in order for h in heads]
    positions = torch.empty(len(flat), dtype=torch.long)
    positions[torch.tensor(flat)] = torch.arange(len(flat))
    return (positions[:, None] * head_dim + torch.arange(head_dim)[None, :]).reshape(-1)


def nxd_key_value(spec: ModelSpec, parallelism: Parallelism) -> tuple[Split, Merge]:
    """Repeat `m` times (tiled on trn1, adjacent on trn2), cut evenly; merge keeps replica 0 of every head."""
    tp, m, d, kv = parallelism.tp, parallelism.kv_multiplier, spec.head_dim, spec.num_kv_heads
    per_rank = kv * m // tp
    if m == 1:
        return chunk(0, tp)  # rank r holds KV heads [r * per_rank, (r + 1) * per_rank)
    adjacent = parallelism.kv_replicas_adjacent

    def split(sources: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
        positions = range(rank * per_rank, (rank + 1) * per_rank)
        return _head_rows(sources[0], [kv_position(p, kv, m, adjacent)[0] for p in positions], d)

    # Replica 0 of head j sits at position j (tiled) or j*m (adjacent) of the repeated weight.
    first_replicas = [j * m if adjacent else j for j in range(kv)]
    return split, lambda shards: [_head_rows(torch.cat(list(shards), dim=0), first_replicas, d)]


def fused(parts: Sequence[tuple[Split, Merge]], sizes: Sequence[int], dim: int) -> tuple[Split, Merge]:
    """Several sources, each split by its own rule, concatenated per rank along `dim`.

    `sizes` are the per-rank sizes of the parts along `dim`, needed to take a fused shard apart.
    """
    return Fuse(tuple(split for split, _ in parts), dim), Unfuse(tuple(merge for _, merge in parts), tuple(sizes), dim)


def nxd_expert_gate_up(spec: ModelSpec, tp: int) -> tuple[Split, Merge]:
    """Sources [w1 of every expert..., w3 of every expert...] ([I, H] each) <-> [E, H, 2I/tp] per rank."""
    experts, part = spec.num_experts, spec.intermediate_size // tp

    def split(sources: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
        rows = slice(rank * part, (rank + 1) * part)
        gate = torch.stack([w[rows].t() for w in sources[:experts]])
        up = torch.stack([w[rows].t() for w in sources[experts:]])
        return torch.cat([gate, up], dim=2)

    def merge(shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        halves = [torch.split(shard, part, dim=2) for shard in shards]
        gate = torch.cat([h[0] for h in halves], dim=2)
        up = torch.cat([h[1] for h in halves], dim=2)
        return [w.t() for w in gate.unbind(0)] + [w.t() for w in up.unbind(0)]

    return split, merge


def nxd_expert_down(spec: ModelSpec, tp: int) -> tuple[Split, Merge]:
    """Sources [w2 of every expert] ([H, I] each) <-> [E, I/tp, H] per rank."""
    part = spec.intermediate_size // tp

    def split(sources: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
        return torch.stack([w[:, rank * part : (rank + 1) * part].t() for w in sources])

    def merge(shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [w.t() for w in torch.cat(list(shards), dim=1).unbind(0)]

    return split, merge


def nemo_key_value(spec: ModelSpec, tp: int) -> tuple[Split, Merge]:
    """cat(k, v) re-ordered per KV head as [k_h0; v_h0; k_h1; v_h1; ...], then cut evenly."""
    kv, d = spec.num_kv_heads, spec.head_dim
    per_rank = kv // tp

    def split(sources: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
        k, v = sources
        heads = range(rank * per_rank, (rank + 1) * per_rank)
        return torch.cat([t[h * d : (h + 1) * d] for h in heads for t in (k, v)], dim=0)

    def merge(shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        pairs = torch.cat(list(shards), dim=0).reshape(kv, 2, d, -1)
        return [pairs[:, 0].reshape(kv * d, -1), pairs[:, 1].reshape(kv * d, -1)]

    return split, merge


# --- the layouts --------------------------------------------------------------------------------------

RuleParts = list[tuple[tuple[str, ...], str, tuple[Split, Merge]]]


def layer_rules(spec: ModelSpec, parallelism: Parallelism, layout: Format, layer: int) -> list[Rule]:
    """Rules of one transformer layer; the unit the converter streams."""
    stage, local = stage_of_layer(spec, parallelism, layer)
    hf = f"model.layers.{layer}."
    parts = _nxd_layer(spec, parallelism, hf) if layout == "nxd" else _nemo_layer(spec, parallelism.tp, hf, local)
    return [Rule(sources, target, stage, *functions) for sources, target, functions in parts]


def global_rules(spec: ModelSpec, parallelism: Parallelism, layout: Format) -> tuple[list[Rule], list[Rule]]:
    """(rules before the first layer, rules after the last): embedding; final norm and LM head.

    A tied LM head is written as a copy of the embedding (both layouts keep a separate output layer)
    and not written back to Hugging Face.
    """
    tp, last = parallelism.tp, parallelism.pp - 1
    names = {
        "nxd": ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"),
        "nemo": (
            "model.language_model.embedding.word_embeddings.weight",
            "model.language_model.encoder.final_layernorm.weight",
            "model.language_model.output_layer.weight",
        ),
    }[layout]
    head_source = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
    first = [Rule(("model.embed_tokens.weight",), names[0], 0, *chunk(0, tp))]
    final = [
        Rule(("model.norm.weight",), names[1], last, *replicate(tp)),
        Rule((head_source,), names[2], last, *chunk(0, tp)),
    ]
    return first, final


def all_rules(spec: ModelSpec, parallelism: Parallelism, layout: Format) -> list[list[Rule]]:
    """Rules grouped in streaming order: embedding, each layer, final norm and head."""
    first, final = global_rules(spec, parallelism, layout)
    return [first, *(layer_rules(spec, parallelism, layout, i) for i in range(spec.num_layers)), final]


def _nxd_layer(spec: ModelSpec, parallelism: Parallelism, hf: str) -> RuleParts:
    tp = parallelism.tp
    attention = f"{hf}self_attn."
    q, k, v = (f"{attention}{name}_proj.weight" for name in ("q", "k", "v"))
    qkv = f"{attention}qkv_proj."
    query, key_value = nxd_query(spec, parallelism), nxd_key_value(spec, parallelism)
    rules: RuleParts
    if parallelism.fuse_qkv:
        q_rows = spec.num_heads * spec.head_dim // tp
        kv_rows = spec.num_kv_heads * parallelism.kv_multiplier * spec.head_dim // tp
        sizes = [q_rows, kv_rows, kv_rows]
        rules = [((q, k, v), f"{qkv}weight_qkv", fused([query, key_value, key_value], sizes, 0))]
    else:
        rules = [((q,), f"{qkv}weight_q", query), ((k,), f"{qkv}weight_k", key_value)]
        rules.append(((v,), f"{qkv}weight_v", key_value))
    rules += [
        ((f"{attention}o_proj.weight",), f"{attention}o_proj.weight", nxd_output(spec, parallelism)),
        ((f"{hf}input_layernorm.weight",), f"{hf}input_layernorm.weight", replicate(tp)),
        ((f"{hf}post_attention_layernorm.weight",), f"{hf}post_attention_layernorm.weight", replicate(tp)),
    ]
    if spec.architecture == "llama":
        mlp, part = f"{hf}mlp.", spec.intermediate_size // tp
        gate_up = fused([chunk(0, tp), chunk(0, tp)], [part, part], 0)
        return rules + [
            ((f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight"), f"{mlp}gate_up_proj.weight", gate_up),
            ((f"{mlp}down_proj.weight",), f"{mlp}down_proj.weight", chunk(1, tp)),
        ]
    moe, experts = f"{hf}block_sparse_moe.", range(spec.num_experts)
    gates = tuple(f"{moe}experts.{e}.w1.weight" for e in experts)
    ups = tuple(f"{moe}experts.{e}.w3.weight" for e in experts)
    downs = tuple(f"{moe}experts.{e}.w2.weight" for e in experts)
    stacked = f"{hf}mlp.expert_mlps.mlp_op."
    return rules + [
        ((f"{moe}gate.weight",), f"{hf}mlp.router.linear_router.weight", replicate(tp)),
        (gates + ups, f"{stacked}gate_up_proj.weight", nxd_expert_gate_up(spec, tp)),
        (downs, f"{stacked}down_proj.weight", nxd_expert_down(spec, tp)),
    ]


def _nemo_layer(spec: ModelSpec, tp: int, hf: str, local: int) -> RuleParts:
    nemo = f"model.language_model.encoder.layers.{local}."
    attention = f"{hf}self_attn."
    rules: RuleParts = [
        ((f"{hf}input_layernorm.weight",), f"{nemo}input_layernorm.weight", replicate(tp)),
        ((f"{attention}q_proj.weight",), f"{nemo}self_attention.query.weight", chunk(0, tp)),
        (
            (f"{attention}k_proj.weight", f"{attention}v_proj.weight"),
            f"{nemo}self_attention.key_value.weight",
            nemo_key_value(spec, tp),
        ),
        ((f"{attention}o_proj.weight",), f"{nemo}self_attention.dense.weight", chunk(1, tp)),
        ((f"{hf}post_attention_layernorm.weight",), f"{nemo}post_attention_layernorm.weight", replicate(tp)),
    ]
    if spec.architecture == "llama":
        mlp = f"{hf}mlp."
        return rules + [
            ((f"{mlp}gate_proj.weight",), f"{nemo}mlp.dense_h_to_4h.weight", chunk(0, tp)),
            ((f"{mlp}up_proj.weight",), f"{nemo}mlp.dense_h_to_4h_2.weight", chunk(0, tp)),
            ((f"{mlp}down_proj.weight",), f"{nemo}mlp.dense_4h_to_h.weight", chunk(1, tp)),
        ]
    moe = f"{hf}block_sparse_moe."
    rules.append(((f"{moe}gate.weight",), f"{nemo}mlp.router.gate.weight", chunk(1, tp)))
    for e in range(spec.num_experts):
        expert, target = f"{moe}experts.{e}.", f"{nemo}mlp.experts.{e}."
        rules += [
            ((f"{expert}w1.weight",), f"{target}dense_h_to_4h.weight", chunk(0, tp)),
            ((f"{expert}w3.weight",), f"{target}dense_h_to_4h_2.weight", chunk(0, tp)),
            ((f"{expert}w2.weight",), f"{target}dense_4h_to_h.weight", chunk(1, tp)),
        ]
    return rules
