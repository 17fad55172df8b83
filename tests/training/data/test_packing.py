"""The pure packing functions: framing, carry-over between batches, SFT block placement."""

from __future__ import annotations

import numpy as np
import pytest

from training.config.model import IGNORE_INDEX
from training.data.packing import BlockPacker, Example, PackStats, concatenate_documents, pack_examples


def test_documents_are_framed_with_bos_and_eos() -> None:
    flat = concatenate_documents([[5, 6], [], [7]], bos_id=1, eos_id=2)
    assert flat.dtype == np.int32
    assert flat.tolist() == [1, 5, 6, 2, 1, 2, 1, 7, 2]


@pytest.mark.parametrize(
    ("bos", "eos", "expected"), [(None, 2, [5, 6, 2, 7, 2]), (1, None, [1, 5, 6, 1, 7]), (None, None, [5, 6, 7])]
)
def test_separators_can_be_left_out(bos: int | None, eos: int | None, expected: list[int]) -> None:
    assert concatenate_documents([[5, 6], [7]], bos_id=bos, eos_id=eos).tolist() == expected


def test_remainder_carries_across_batches() -> None:
    packer = BlockPacker(4)
    stream = np.arange(23, dtype=np.int32)
    blocks = [packer.add(part) for part in np.split(stream, [3, 4, 11, 12, 20])]
    assert np.concatenate(blocks).ravel().tolist() == list(range(20))
    assert packer.remainder == 3
    assert packer.final_block(pad_id=-1).tolist() == [[20, 21, 22, -1]]
    assert packer.remainder == 0


def test_seq_len_below_two_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        BlockPacker(1)


def example(ids: list[int], trained: list[bool]) -> Example:
    ids_array = np.asarray(ids, dtype=np.int32)
    return Example(ids_array, np.where(np.asarray(trained), ids_array, IGNORE_INDEX).astype(np.int32))


def test_examples_are_never_split_across_blocks() -> None:
    stats = PackStats()
    examples = [
        example([1, 2, 3], [False, True, True]),
        example([4, 5], [False, True]),
        example([6, 7, 8], [False, False, True]),
    ]
    blocks = list(pack_examples(examples, seq_len=5, pad_id=0, stats=stats))
    assert [ids.tolist() for ids, _ in blocks] == [[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]]
    assert [labels.tolist() for _, labels in blocks] == [[-100, 2, 3, -100, 5], [-100, -100, 8, -100, -100]]
    assert stats.padding_tokens == 2 and stats.examples == 3


def test_long_examples_are_truncated_and_counted() -> None:
    stats = PackStats()
    blocks = list(pack_examples([example([1, 2, 3, 4, 5, 6], [True] * 6)], seq_len=4, pad_id=0, stats=stats))
    assert [ids.tolist() for ids, _ in blocks] == [[1, 2, 3, 4]]
    assert stats.truncated_examples == 1


def test_blocks_without_trained_tokens_never_appear() -> None:
    stats = PackStats()
    examples = [example([1, 2, 3, 4], [False] * 4), example([5, 6], [False, True])]
    blocks = list(pack_examples(examples, seq_len=4, pad_id=0, stats=stats))
    assert [ids.tolist() for ids, _ in blocks] == [[5, 6, 0, 0]]
    assert stats.dropped_untrained_blocks == 1
