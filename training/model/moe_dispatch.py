"""How Mixtral's MoE block runs its experts, one function per dispatch, chosen by name through `DISPATCHES`.

Every dispatch takes the block's routed tokens (this TP rank's view: all tokens, their top-k routing weights
and experts) and this rank's I/tp columns of every expert, and returns the partial outputs before the TP sum,
with the choices it dropped (None when it drops none). "sparse" runs each expert on its tokens only (dynamic
shapes); "dense" runs every expert on every token with zero weight where not chosen (static shapes for XLA,
E/k times the expert FLOPs); "capacity" gives each expert C = min(T, ceil(T * k * capacity_factor / E)) slots,
filled in token order, drops a choice beyond its expert's capacity and renormalises the token's remaining
weights (neuronx-distributed's capacity-factor semantics): static shapes at about capacity_factor times the
useful FLOPs. All three compute the same function while nothing is dropped. The names are
`training.config.backends.MOE_DISPATCHES`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from training.config.backends import MoeDispatch

Activation = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Routed:
    """One MoE block's routed tokens as every dispatch takes them, and the experts' weights."""

    tokens: torch.Tensor  # [T, H]
    weights: torch.Tensor  # [T, k] the renormalised routing weights (fp32)
    experts: torch.Tensor  # [T, k] the chosen experts
    gate_up: torch.Tensor  # [E, H, 2I/tp]
    down: torch.Tensor  # [E, I/tp, H]


class Dispatch(Protocol):
    def __call__(
        self, routed: Routed, activation: Activation, capacity_factor: float | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


def dense(routed: Routed, activation: Activation, capacity_factor: float | None) -> tuple[torch.Tensor, None]:
    """Every expert on every token, weighted by a dense [T, E] matrix of the routing weights."""
    tokens, weights, gate_up, down = routed.tokens, routed.weights, routed.gate_up, routed.down
    matrix = torch.zeros(tokens.shape[0], gate_up.shape[0], dtype=weights.dtype, device=tokens.device)
    matrix = matrix.scatter(1, routed.experts, weights)
    # batched matmuls over the experts, the tokens broadcast (no copy of them or of the weights is kept)
    every = tokens.expand(gate_up.shape[0], *tokens.shape)
    outputs = torch.bmm(activation(torch.bmm(every, gate_up)), down)  # [E, T, H]
    return (outputs.to(matrix.dtype) * matrix.t().unsqueeze(-1)).sum(0).to(tokens.dtype), None


def sparse(routed: Routed, activation: Activation, capacity_factor: float | None) -> tuple[torch.Tensor, None]:
    """Token choices grouped by expert with one sort, each expert's rows a contiguous slice."""
    tokens, gate_up, down = routed.tokens, routed.gate_up, routed.down
    top_k = routed.experts.shape[1]
    choices = routed.experts.reshape(-1)
    order = torch.argsort(choices, stable=True)
    counts = torch.bincount(choices, minlength=gate_up.shape[0]).tolist()
    token = order // top_k
    rows_in_order = tokens[token]
    expert_outputs: list[torch.Tensor] = []
    # unbind, not gate_up[e]: its backward stacks once instead of zero-filling a full copy per expert.
    per_expert = zip(gate_up.unbind(0), down.unbind(0), torch.split(rows_in_order, counts), strict=True)
    for expert_gate_up, expert_down, rows in per_expert:
        if rows.shape[0]:
            expert_outputs.append(activation(rows @ expert_gate_up) @ expert_down)
    chosen = routed.weights.reshape(-1)[order, None]
    weighted = (torch.cat(expert_outputs) * chosen).to(tokens.dtype)
    return torch.zeros_like(tokens).index_add(0, token, weighted), None


def capacity(
    routed: Routed, activation: Activation, capacity_factor: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's first C chosen tokens (in token order) in slots [E, C]; the rest dropped."""
    assert capacity_factor is not None
    tokens, weights, top_experts, gate_up, down = (
        routed.tokens,
        routed.weights,
        routed.experts,
        routed.gate_up,
        routed.down,
    )
    total, experts, top_k = tokens.shape[0], gate_up.shape[0], top_experts.shape[1]
    slots_per_expert = min(total, math.ceil(total * top_k * capacity_factor / experts))
    chosen = F.one_hot(top_experts, experts).sum(dim=1)  # [T, E]: 1 where the token chose the expert
    position = queue_positions(chosen)  # the token's place in its expert's queue
    kept = (chosen * (position < slots_per_expert)).gather(1, top_experts).bool()  # [T, k]
    dropped = (~kept).sum()
    slot = top_experts * slots_per_expert + position.gather(1, top_experts)  # [T, k]: the choice's slot
    # Which token fills each slot (static shapes: dropped choices go to one extra, discarded slot; slots
    # never filled read a zero row appended after the tokens).
    slots = experts * slots_per_expert
    owner = torch.full((slots + 1,), total, dtype=torch.long, device=tokens.device)
    numbers = torch.arange(total, device=tokens.device).unsqueeze(1).expand_as(slot)
    owner = owner.scatter(0, torch.where(kept, slot, slots).flatten(), numbers.flatten())[:slots]
    padded = torch.cat([tokens, tokens.new_zeros(1, tokens.shape[1])])
    inputs = padded[owner].view(experts, slots_per_expert, -1)
    outputs = torch.bmm(activation(torch.bmm(inputs, gate_up)), down).view(slots, -1)
    kept_weights = weights * kept
    kept_weights = kept_weights / kept_weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)
    partial = torch.zeros_like(tokens, dtype=weights.dtype)
    for choice in range(top_k):
        safe = torch.where(kept[:, choice], slot[:, choice], 0)
        partial = partial + outputs[safe].to(weights.dtype) * kept_weights[:, choice, None]
    return partial.to(tokens.dtype), dropped


DISPATCHES: dict[MoeDispatch, Dispatch] = {"sparse": sparse, "dense": dense, "capacity": capacity}

PREFIX_SUM_BLOCK = 2048  # rows per lower-triangular matmul of `queue_positions` (a 16 MiB fp32 matrix)


def queue_positions(chosen: torch.Tensor) -> torch.Tensor:
    """For a [T, E] 0/1 matrix, each row's count of ones in its column up to and including it, minus one.

    The running sum is a matmul with a lower-triangular matrix of ones, block by block of 2048 rows with the
    previous blocks' totals carried, not `torch.cumsum`: XLA lowers that to a T-wide reduce-window, which
    neuronx-cc has failed to compile (aws-neuron-sdk issues 767 and 778), and neuronx-distributed's
    capacity-factor MoE computes its prefix sums with matmuls too. fp32 counts are exact below 2**24 rows.
    """
    counts = chosen.to(torch.float32)
    carried = counts.new_zeros(1, counts.shape[1])
    blocks = []
    for block in torch.split(counts, PREFIX_SUM_BLOCK):
        lower = torch.ones(block.shape[0], block.shape[0], dtype=torch.float32, device=block.device).tril()
        running = lower @ block + carried
        blocks.append(running)
        carried = running[-1:]
    return torch.cat(blocks).to(torch.long) - 1
