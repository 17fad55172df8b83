"""Mixing several sources into one stream by token share, deterministically by seed. Pure and streaming.

A weight is a share of tokens: with weights 3 and 1, three quarters of the mixed tokens come from the first
source. The mixer is a weighted fair queue: every source holds its next item, and the next item taken is the
one with the smallest key `(tokens taken from that source + u * tokens of the item) / weight`, where `u` in
[0, 1) is drawn from `random.Random(seed)` once per item. The key lies between the source's tokens per unit of
weight before and after the item, so at every point source i leads source j (in tokens per unit of weight) by at
most one item of each: `t_i / w_i - t_j / w_j <= L_i / w_i + L_j / w_j` with L the longest item; realised shares
are the weights up to about one document per source. The seed decides the order within that bound: another
seed, another interleaving. `random.Random.random()` keeps its sequence for a seed across Python versions, so
the output is bit-reproducible.

The mix ends when the first source runs out (its data or its limit): past that point the others could only
continue by leaving the weights, so the shares stay the weights and the manifest names the source that ended it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from training.errors import UserError

Item = TypeVar("Item")
WEIGHTS_ARE = "token shares"  # what a weight means, as the manifest records it


@dataclass(frozen=True)
class MixSource:
    """One source of a mix as the command line or the recipe names it; None means the command's default."""

    source: str
    weight: float = 1.0
    limit: int | None = None  # max documents (pretrain) or examples (sft) read from this source
    split: str | None = None
    validation: str | None = None  # sft only


@dataclass
class MixStats:
    """What the mixer took from each source, and which source ended the mix."""

    items: list[int]
    tokens: list[int]
    ended_by: int | None = None

    def shares(self) -> list[float]:
        total = sum(self.tokens)
        return [count / total if total else 0.0 for count in self.tokens]


@dataclass
class _Head(Generic[Item]):
    item: Item
    tokens: int
    key: float


def check_mix(sources: Sequence[MixSource], limit_flag: str) -> None:
    """The refusals a mix shares between the command line and the recipe: one line each."""
    seen: set[str] = set()
    for mix_source in sources:
        if not 0 < mix_source.weight < math.inf:  # refuses NaN too
            raise UserError(f"--weight {mix_source.weight} of --source {mix_source.source}: must be a positive number")
        if mix_source.limit is not None and mix_source.limit < 1:
            raise UserError(f"{limit_flag} {mix_source.limit} of --source {mix_source.source}: must be at least 1")
        key = f"{mix_source.source}\0{mix_source.split}"
        if key in seen:
            raise UserError(
                f"--source {mix_source.source}: given twice; each source (and split) may appear once in a mix"
            )
        seen.add(key)


def mix(
    streams: Sequence[Iterable[Item]], weights: Sequence[float], *, tokens_of: Callable[[Item], int], seed: int
) -> tuple[Iterator[tuple[int, Item]], MixStats]:
    """(source index, item) in mixed order, and the statistics it fills in as it is consumed."""
    if len(streams) != len(weights) or not streams:
        raise ValueError("one weight per stream, at least one stream")
    stats = MixStats(items=[0] * len(streams), tokens=[0] * len(streams))
    return _mixed(list(streams), list(weights), tokens_of, random.Random(seed), stats), stats


def _mixed(
    streams: list[Iterable[Item]],
    weights: list[float],
    tokens_of: Callable[[Item], int],
    rng: random.Random,
    stats: MixStats,
) -> Iterator[tuple[int, Item]]:
    iterators = [iter(stream) for stream in streams]
    heads: list[_Head[Item] | None] = [None] * len(streams)

    def refill(index: int) -> bool:
        item = next(iterators[index], None)  # items are token lists or examples, never None
        if item is None:
            stats.ended_by = index
            return False
        tokens = tokens_of(item)
        heads[index] = _Head(item, tokens, (stats.tokens[index] + rng.random() * tokens) / weights[index])
        return True

    for index in range(len(streams)):
        if not refill(index):
            return
    while True:
        index = min(range(len(heads)), key=lambda i: (_key(heads[i]), i))
        head = heads[index]
        assert head is not None
        stats.items[index] += 1
        stats.tokens[index] += head.tokens
        yield index, head.item
        if not refill(index):
            return


def _key(head: _Head[Item] | None) -> float:
    assert head is not None  # every head is filled while the mix runs
    return head.key


def concatenate(
    streams: Sequence[Iterable[Item]], *, tokens_of: Callable[[Item], int]
) -> tuple[Iterator[tuple[int, Item]], MixStats]:
    """(source index, item) of every stream whole, one after the other, counted as `mix` counts."""
    stats = MixStats(items=[0] * len(streams), tokens=[0] * len(streams))

    def chained() -> Iterator[tuple[int, Item]]:
        for index, stream in enumerate(streams):
            for item in stream:
                stats.items[index] += 1
                stats.tokens[index] += tokens_of(item)
                yield index, item

    return chained(), stats
