"""Packing token streams into fixed-length blocks. Pure and in memory bounded by one block of carry-over.

Pretraining: documents are concatenated (with their BOS/EOS separators) and cut into blocks; the
remainder carries over to the next batch, so only the final partial block of the whole run is lost.
SFT: whole examples are placed into blocks in order; an example that does not fit starts a new block and
the rest of the old one is padded, so no example is split across blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from training.config.model import IGNORE_INDEX

TokenArray = npt.NDArray[np.int32]


def concatenate_documents(documents: Sequence[Sequence[int]], *, bos_id: int | None, eos_id: int | None) -> TokenArray:
    """One flat int32 array: [BOS] doc [EOS] [BOS] doc [EOS] ... (a separator is omitted when its id is None)."""
    extra = (bos_id is not None) + (eos_id is not None)
    lengths = np.fromiter((len(d) for d in documents), dtype=np.int64, count=len(documents)) + extra
    flat = np.empty(int(lengths.sum()), dtype=np.int32)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    if bos_id is not None:
        flat[starts] = bos_id
    if eos_id is not None:
        flat[ends - 1] = eos_id
    first = starts + (bos_id is not None)
    for document, start in zip(documents, first.tolist(), strict=True):
        flat[start : start + len(document)] = document
    return flat


class BlockPacker:
    """Cuts a stream of token arrays into `[n, seq_len]` blocks, carrying the remainder between calls."""

    def __init__(self, seq_len: int) -> None:
        if seq_len < 2:
            raise ValueError("seq_len must be at least 2")
        self.seq_len = seq_len
        self._carry: TokenArray = np.empty(0, dtype=np.int32)

    def add(self, tokens: TokenArray) -> npt.NDArray[np.int32]:
        """Blocks completed by `tokens` (possibly none)."""
        stream = np.concatenate([self._carry, tokens]) if self._carry.size else tokens
        full = (stream.size // self.seq_len) * self.seq_len
        self._carry = stream[full:].copy()
        return stream[:full].reshape(-1, self.seq_len)

    @property
    def remainder(self) -> int:
        return int(self._carry.size)

    def final_block(self, pad_id: int) -> TokenArray:
        """The last partial block padded with `pad_id` (empty if nothing remains)."""
        if not self._carry.size:
            return np.empty((0, self.seq_len), dtype=np.int32)
        block = np.full(self.seq_len, pad_id, dtype=np.int32)
        block[: self._carry.size] = self._carry
        self._carry = np.empty(0, dtype=np.int32)
        return block.reshape(1, self.seq_len)


@dataclass(frozen=True)
class Example:
    """One tokenized chat example: labels are IGNORE_INDEX where no loss is taken."""

    input_ids: TokenArray
    labels: TokenArray

    @property
    def trained_tokens(self) -> int:
        return int(np.count_nonzero(self.labels != IGNORE_INDEX))


@dataclass
class PackStats:
    examples: int = 0
    truncated_examples: int = 0
    dropped_untrained_blocks: int = 0
    padding_tokens: int = 0


def pack_examples(
    examples: Iterable[Example], *, seq_len: int, pad_id: int, stats: PackStats
) -> Iterator[tuple[TokenArray, TokenArray]]:
    """(input_ids, labels) blocks of exactly `seq_len`, each with at least one trained token."""
    ids_parts: list[TokenArray] = []
    label_parts: list[TokenArray] = []
    used = 0

    def flush() -> Iterator[tuple[TokenArray, TokenArray]]:
        nonlocal used
        if not ids_parts:
            return
        padding = seq_len - used
        ids = np.concatenate([*ids_parts, np.full(padding, pad_id, dtype=np.int32)])
        labels = np.concatenate([*label_parts, np.full(padding, IGNORE_INDEX, dtype=np.int32)])
        ids_parts.clear()
        label_parts.clear()
        used = 0
        if np.any(labels != IGNORE_INDEX):
            stats.padding_tokens += padding
            yield ids, labels
        else:
            stats.dropped_untrained_blocks += 1

    for example in examples:
        stats.examples += 1
        ids, labels = example.input_ids, example.labels
        if ids.size > seq_len:
            stats.truncated_examples += 1
            ids, labels = ids[:seq_len], labels[:seq_len]
        if used + ids.size > seq_len:
            yield from flush()
        ids_parts.append(ids)
        label_parts.append(labels)
        used += ids.size
    yield from flush()
