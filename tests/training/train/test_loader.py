"""The loader's start-of-training checks of prepared data against the recipe: the kind of data (pretrain, sft)
and whether one step's global batch, and one validation, fit in the split's blocks. The end-to-end refusals
through the CLI are in tests/training/properties/test_bad_inputs.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from training.errors import UserError
from training.outputs import MANIFEST
from training.train.batches import BatchPlan
from training.train.loader import check_data_kind, prepared_kind

DATA = Path("/data/blocks")


def refusal(check: Callable[..., None], *args: Any, **kwargs: Any) -> str:
    with pytest.raises(UserError) as raised:
        check(*args, **kwargs)
    return str(raised.value)


def test_the_recipes_kind_is_data_kind_else_prepare_kind_else_unchecked() -> None:
    check_data_kind(DATA, "sft", data_kind=None, prepare_kind="sft")
    check_data_kind(DATA, "sft", data_kind="sft", prepare_kind="pretrain")  # continued pretraining on SFT blocks
    check_data_kind(DATA, "pretrain", data_kind=None, prepare_kind=None)  # no prepare section, no data.kind
    check_data_kind(DATA, "sft", data_kind=None, prepare_kind=None)
    assert refusal(check_data_kind, DATA, "sft", data_kind=None, prepare_kind="pretrain") == (
        "data.path /data/blocks: holds `prepare sft` data, but the recipe trains on pretrain data (prepare.kind "
        "pretrain); allowed: data made by `prepare pretrain`, or set data.kind to sft to train on sft data on purpose"
    )
    assert refusal(check_data_kind, DATA, "pretrain", data_kind="sft", prepare_kind="sft") == (
        "data.path /data/blocks: holds `prepare pretrain` data, but the recipe trains on sft data (data.kind sft); "
        "allowed: data made by `prepare sft`, or set data.kind to pretrain to train on pretrain data on purpose"
    )
    assert refusal(check_data_kind, DATA, "pretrain", data_kind="sft", prepare_kind=None).endswith("on purpose")


def test_prepared_kind_reads_the_manifest_and_nothing_else(tmp_path: Path) -> None:
    assert prepared_kind(tmp_path) is None  # no manifest yet
    (tmp_path / MANIFEST).write_text("{not json")
    assert prepared_kind(tmp_path) is None  # the training job reports it
    (tmp_path / MANIFEST).write_text(json.dumps({"kind": "convert"}))
    assert prepared_kind(tmp_path) is None
    (tmp_path / MANIFEST).write_text(json.dumps({"kind": "sft", "seq_len": 4}))
    assert prepared_kind(tmp_path) == "sft"


def test_a_global_batch_may_take_every_block_but_not_more() -> None:
    plan = BatchPlan(global_batch=8, micro=2, dp=2)
    plan.check_rows(DATA, "train", 8, 64)
    assert refusal(plan.check_rows, DATA, "train", 7, 64) == (
        "batch.global: 8 is not allowed; allowed: at most the 7 sequences of 64 tokens (batch.seq_len) in the train "
        "split of data.path /data/blocks, so that no step takes a block twice; or prepare more data"
    )


def test_steps_beyond_the_data_still_wrap_into_the_next_epoch() -> None:
    """Only one step needing more blocks than there are is refused: many steps cycle over the data, each epoch
    in its own order, every block once an epoch."""
    plan = BatchPlan(global_batch=8, micro=2, dp=2)
    plan.check_rows(DATA, "train", 12, 64)
    step_2 = [i for d in range(2) for m in range(2) for i in plan.sample_indices(2, d, m)]
    assert step_2 == list(range(16, 24))  # samples 16 to 23 of 12 blocks: epoch 1, positions 4 to 11


def test_a_validation_reads_at_most_the_blocks_of_its_split() -> None:
    plan = BatchPlan(global_batch=8, micro=2, dp=2)
    plan.check_validation_rows(DATA, "validation", 12, 3)  # 3 x 2 x 2 = 12 blocks
    assert refusal(plan.check_validation_rows, DATA, "validation", 12, 4) == (
        "data.validation_batches: 4 is not allowed; allowed: at most 3: each takes batch.micro 2 x 2 data-parallel "
        "ranks = 4 of the 12 sequences of the validation split of data.path /data/blocks, and a validation reads "
        "each block once"
    )
    assert refusal(plan.check_validation_rows, DATA, "validation", 3, 1) == (
        "data.validation_split: 'validation' is not allowed; allowed: a split of at least batch.micro 2 x 2 "
        "data-parallel ranks = 4 sequences; the 3 sequences of the validation split of data.path /data/blocks are "
        "fewer"
    )
