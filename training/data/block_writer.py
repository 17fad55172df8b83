"""Streaming fixed-length int32 rows to disk and publishing them as a `datasets.save_to_disk` dataset."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt


class BlockWriter:
    """Appends `[rows, seq_len]` int32 arrays column by column to one Arrow file in a scratch directory."""

    def __init__(self, path: Path, columns: tuple[str, ...], seq_len: int) -> None:
        import datasets
        from datasets.arrow_writer import ArrowWriter

        self.path = path
        self.columns = columns
        self.seq_len = seq_len
        self.features = datasets.Features(
            {name: datasets.List(datasets.Value("int32"), length=seq_len) for name in columns}
        )
        self._writer = ArrowWriter(features=self.features, path=str(path))
        self.rows = 0

    def write(self, **arrays: npt.NDArray[np.int32]) -> None:
        import pyarrow as pa

        if sorted(arrays) != sorted(self.columns):
            raise ValueError(f"expected columns {self.columns}, got {tuple(arrays)}")
        rows = {array.shape[0] for array in arrays.values()}
        (count,) = rows
        if count == 0:
            return
        table = pa.table(
            {
                name: pa.FixedSizeListArray.from_arrays(
                    pa.array(np.ascontiguousarray(arrays[name], dtype=np.int32).ravel()), self.seq_len
                )
                for name in self.columns
            },
            schema=self.features.arrow_schema,
        )
        self._writer.write_table(table)
        self.rows += count

    def close(self) -> None:
        self._writer.finalize()
        self._writer.close()

    def dataset(self) -> Any:
        """The written rows as a memory-mapped `datasets.Dataset`."""
        import datasets

        return datasets.Dataset.from_file(str(self.path))
