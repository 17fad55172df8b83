"""Reading what `prepare` wrote, in an order that depends only on the step, so a resumed run continues
exactly where it stopped (the reference restarts its data from sample 0).

Sample k of the run is in epoch `k // n` at position `k % n` (n blocks); with shuffling, that position maps
through the epoch's permutation, drawn from a generator seeded with (seed, epoch), so every epoch has its
own order and the block of sample k is a pure function of k. The global batch of step s is samples
[s * G, (s + 1) * G); data-parallel rank d takes the d-th contiguous slice of it, in micro batches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training.config.loading import not_allowed
from training.config.model import IGNORE_INDEX
from training.errors import UserError
from training.outputs import MANIFEST

# `prepare pretrain` writes one dataset, not a dictionary of splits: its blocks are the training split.
SINGLE_SPLIT = "train"


class TrainingData:
    """The blocks of one split of a `prepare` output, as (input_ids, targets) tensors.

    A split the output does not have is refused, never replaced by another: validation on the training blocks
    would report a loss that looks like generalisation. `key` names the recipe key that chose the split.
    """

    def __init__(
        self,
        path: Path,
        split: str,
        seq_len: int,
        *,
        shuffle_seed: int | None = None,
        key: str = "data.split",
    ) -> None:
        self.shuffle_seed = shuffle_seed
        self._orders: dict[int, np.ndarray] = {}
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            raise UserError(f"data.path {path}: no {MANIFEST}; run `python -m training prepare` first")
        manifest: dict[str, Any] = json.loads(manifest_path.read_text())
        kind = manifest.get("kind")
        if kind not in ("pretrain", "sft"):
            raise UserError(f"data.path {path}: {MANIFEST} is a {kind!r} output, not prepare pretrain/sft")
        self.kind = str(kind)
        if manifest.get("seq_len") != seq_len:
            raise UserError(
                f"batch.seq_len {seq_len} differs from the data's seq_len {manifest.get('seq_len')} ({path}); "
                "set batch.seq_len to it or prepare the data again"
            )
        import datasets

        loaded = datasets.load_from_disk(str(path))
        splits = list(loaded) if isinstance(loaded, datasets.DatasetDict) else [SINGLE_SPLIT]
        if split not in splits:
            raise UserError(not_allowed(key, split, f"a split that data.path {path} has: {', '.join(splits)}"))
        if isinstance(loaded, datasets.DatasetDict):
            loaded = loaded[split]
        self.dataset = loaded.with_format("numpy")
        self.has_labels = "labels" in self.dataset.column_names
        if len(self.dataset) == 0:
            raise UserError(f"data.path {path}: the {split} split has no blocks")

    def __len__(self) -> int:
        return len(self.dataset)

    def row(self, sample: int) -> int:
        """The block of run-wide sample `sample`."""
        epoch, position = divmod(sample, len(self.dataset))
        if self.shuffle_seed is None:
            return position
        if epoch not in self._orders:
            if len(self._orders) > 1:  # a batch spans at most two epochs
                del self._orders[min(self._orders)]
            self._orders[epoch] = np.random.default_rng([self.shuffle_seed, epoch]).permutation(len(self.dataset))
        return int(self._orders[epoch][position])

    def batch(self, samples: range) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [n, S] and targets [n, S]: targets[t] is the token to predict at t (IGNORE_INDEX: none)."""
        rows = [self.row(index) for index in samples]
        columns = self.dataset[rows]
        input_ids = torch.from_numpy(np.asarray(columns["input_ids"], dtype=np.int64))
        labels = torch.from_numpy(np.asarray(columns["labels"], dtype=np.int64)) if self.has_labels else input_ids
        return input_ids, shift_labels(labels)


def check_data_kind(path: Path, found: str, *, data_kind: str | None, prepare_kind: str | None) -> None:
    """Blocks of `prepare sft` train only the assistant tokens (their labels), those of `prepare pretrain` every
    token: given to a recipe of the other kind they would train the wrong objective without a word. The kind the
    recipe trains on is `data.kind`, else `prepare.kind`; a recipe with neither is not checked."""
    expected, key = (data_kind, "data.kind") if data_kind is not None else (prepare_kind, "prepare.kind")
    if expected is None or found == expected:
        return
    raise UserError(
        f"data.path {path}: holds `prepare {found}` data, but the recipe trains on {expected} data ({key} "
        f"{expected}); allowed: data made by `prepare {expected}`, or set data.kind to {found} to train on "
        f"{found} data on purpose"
    )


def prepared_kind(path: Path) -> str | None:
    """The kind (pretrain, sft) a `prepare` output's manifest records; None where there is no readable manifest
    yet (the training job reports what is wrong with it)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    kind = manifest.get("kind") if isinstance(manifest, dict) else None
    return kind if kind in ("pretrain", "sft") else None


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face labels (aligned with the inputs) to next-token targets; the last position has none."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    return targets
