"""The CPU backend's world: torch.distributed on gloo and the [PP, DP, TP] process groups, as neuronx-distributed
arranges them.

Part of the CPU backend (`training.model.cpu_backend` presents its names to the facade); the collectives and the
layers ask this module for their groups.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import HashStore, PrefixStore, Store
from torch.distributed import ProcessGroup
from torch.distributed.rendezvous import rendezvous as env_rendezvous

from training.config.hardware import CHIPS, DEFAULT_GENERATION, Generation
from training.errors import UserError


@dataclass
class _State:
    tp: int
    pp: int
    tp_group: ProcessGroup
    dp_group: ProcessGroup
    pp_group: ProcessGroup
    owns_world: bool
    kv_replicas_adjacent: bool = False  # where NxD puts a KV head's replicas on this generation
    kv_groups: dict[int, ProcessGroup] = field(default_factory=dict)


_state: _State | None = None
_generation = 0
_store: tuple[Store, int, int] | None = None


def _launcher_store() -> tuple[Store, int, int]:
    """torchrun's key-value store (env:// from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), opened once."""
    global _store
    if _store is None:
        _store = next(env_rendezvous("env://"))
    return _store


def start_gloo_world() -> None:
    """The default process group on gloo: over torchrun's store (env://) when launched by it, else a one-process
    world. A fresh key prefix per start: a process may start again after its group was destroyed (the tests run
    several cases in one torchrun, on either backend), and old rendezvous keys must not be reused."""
    global _generation
    _generation += 1
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        store, rank, world = _launcher_store()
        prefixed = PrefixStore(f"training.model.parallel.{_generation}", store)
        dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=world)
    else:
        dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)


def initialize(tp: int, pp: int, options: Mapping[str, Any], generation: Generation = DEFAULT_GENERATION) -> None:
    """gloo over env:// under torchrun (RANK, WORLD_SIZE, MASTER_ADDR), else a one-process world.

    `options` configure neuronx-distributed's trainer; nothing here uses them. `generation` places the ranks
    that share a KV head (`kv_shared_group`)."""
    global _state
    owns_world = not dist.is_initialized()
    if owns_world:
        start_gloo_world()
    world = dist.get_world_size()
    if tp < 1 or pp < 1 or world % (tp * pp):
        if owns_world:
            dist.destroy_process_group()
        degrees = f"tensor-parallel degree {tp}" + (f" x pipeline degree {pp}" if pp != 1 else "")
        raise UserError(f"{degrees} must divide the number of processes ({world})")
    # [PP, DP, TP] row-major, as neuronx-distributed arranges ranks: TP groups are consecutive ranks.
    dp = world // (tp * pp)

    def at(p: int, d: int, t: int) -> int:
        return (p * dp + d) * tp + t

    grid = [(p, d, t) for p in range(pp) for d in range(dp) for t in range(tp)]
    tp_group = _own_group([[at(p, d, t) for t in range(tp)] for p, d, t in grid if t == 0])
    dp_group = _own_group([[at(p, d, t) for d in range(dp)] for p, d, t in grid if d == 0])
    pp_group = _own_group([[at(p, d, t) for p in range(pp)] for p, d, t in grid if p == 0])
    adjacent = CHIPS[generation].kv_replicas_adjacent
    _state = _State(tp, pp, tp_group, dp_group, pp_group, owns_world, kv_replicas_adjacent=adjacent)


def _own_group(partition: list[list[int]]) -> ProcessGroup:
    """Create every group of a partition of the ranks (a collective call); return this rank's."""
    mine: ProcessGroup | None = None
    for ranks in partition:
        group: ProcessGroup = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    assert mine is not None, f"rank {dist.get_rank()} is in none of {partition}"
    return mine


def destroy() -> None:
    global _state
    if _state is None:
        return
    if _state.owns_world:
        dist.destroy_process_group()
    else:
        for group in {_state.tp_group, _state.dp_group, _state.pp_group, *_state.kv_groups.values()}:
            dist.destroy_process_group(group)
    _state = None


def _get() -> _State:
    assert _state is not None, "the CPU parallel backend is not initialized"  # the facade says so to its callers
    return _state


def tp_rank() -> int:
    return dist.get_rank() % _get().tp


def tp_size() -> int:
    return _get().tp


def tp_group() -> ProcessGroup:
    return _get().tp_group


def dp_rank() -> int:
    return dist.get_rank() // _get().tp % dp_size()


def dp_size() -> int:
    return dist.get_world_size() // (_get().tp * _get().pp)


def dp_group() -> ProcessGroup:
    return _get().dp_group


def pp_rank() -> int:
    return dist.get_rank() // (_get().tp * dp_size())


def pp_size() -> int:
    return _get().pp


def pp_group() -> ProcessGroup:
    return _get().pp_group


def kv_shared_groups(tp: int, world: int, multiplier: int, adjacent: bool) -> list[list[int]]:
    """The TP ranks holding the same KV head when K/V are repeated `multiplier` times, as NxD's
    `arrange_kv_groups` builds them: r, r + tp/m, ... where the replicas are tiled (trn1); m consecutive ranks
    where they are adjacent (trn2)."""
    heads = tp // multiplier
    if adjacent:
        return [
            [start + h * multiplier + i for i in range(multiplier)]
            for start in range(0, world, tp)
            for h in range(heads)
        ]
    return [[start + h + i * heads for i in range(multiplier)] for start in range(0, world, tp) for h in range(heads)]


def kv_shared_group(multiplier: int) -> ProcessGroup:
    """This rank's group of `kv_shared_groups`; created on first use (every rank builds the same layers in the
    same order, so creation stays collective)."""
    state = _get()
    if multiplier not in state.kv_groups:
        groups = kv_shared_groups(state.tp, dist.get_world_size(), multiplier, state.kv_replicas_adjacent)
        state.kv_groups[multiplier] = _own_group(groups)
    return state.kv_groups[multiplier]
