"""A torch-native training checkpoint (Distributed Checkpoint) read as the NxD rank files it holds.

The torch-native backend saves `step_N/dcp/` (global tensors, each rank's shards) and, beside it,
`step_N/dcp/tp_layout.json`: the TP and PP degrees and, per parameter, the dimension its TP shards split (None:
replicated) and its pipeline stage. Every parameter's TP shard is the NxD rank file's tensor (the layers' local
tensors are), so cutting each global tensor along that dimension gives the NxD rank files back, and the converter
reads them as it reads any NxD checkpoint: there stays one definition of every layout (`training.formats.layouts`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from training.errors import UserError

DCP_DIRECTORY = "dcp"
TP_LAYOUT = "tp_layout.json"
MODEL_PREFIX = "model."  # the checkpoint's state is {"model": ..., "optimizer": ...}, flattened by DCP
# the run's position (its generation), the completeness marker, the model's config when one was put there
COPIED = ("user_content.pt", "done", "config.json")


def is_distributed(step: Path) -> bool:
    return (step / DCP_DIRECTORY / ".metadata").is_file()


def tp_layout(shards: dict[str, tuple[int | None, int]], tp: int, pp: int) -> dict[str, Any]:
    """The record written beside the checkpoint: per parameter (dimension split over TP or None, stage)."""
    return {"tp": tp, "pp": pp, "parameters": {name: list(entry) for name, entry in sorted(shards.items())}}


def write_nxd_view(step: Path, output: Path) -> Path:
    """`output` as an NxD step directory (`model/` rank files, the run's position) of the DCP checkpoint `step`."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import load

    from training.formats.sharded import nxd_rank_file  # the module that reads what this one writes

    record_path = step / DCP_DIRECTORY / TP_LAYOUT
    try:
        record = json.loads(record_path.read_text())
        tp, pp, parameters = int(record["tp"]), int(record["pp"]), dict(record["parameters"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UserError(f"{record_path}: {error}; allowed: the record the torch-native backend writes") from None
    metadata = FileSystemReader(str(step / DCP_DIRECTORY)).read_metadata()
    ranks: dict[tuple[int, int], dict[str, torch.Tensor]] = {(t, s): {} for t in range(tp) for s in range(pp)}
    for name, (dimension, stage) in parameters.items():
        stored = metadata.state_dict_metadata.get(MODEL_PREFIX + name)
        if not isinstance(stored, TensorStorageMetadata):
            raise UserError(f"{step / DCP_DIRECTORY}: no tensor {name}; allowed: a complete torch-native checkpoint")
        tensor = torch.empty(stored.size, dtype=stored.properties.dtype)
        load({"model": {name: tensor}}, checkpoint_id=step / DCP_DIRECTORY, no_dist=True)
        pieces = tensor.chunk(tp, dim=dimension) if dimension is not None else [tensor] * tp
        for tp_rank, piece in enumerate(pieces):
            ranks[(tp_rank, stage)][name] = piece.clone()
    for (tp_rank, stage), state in ranks.items():
        path = nxd_rank_file(output, tp_rank, stage)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
    for name in COPIED:
        if (step / name).is_file():
            shutil.copy2(step / name, output / name)
    return output
