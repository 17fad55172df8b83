"""How a global batch is cut over the data-parallel ranks, torch-free: `submit` checks a run's batch with the
same rule the training job applies at start, before any node is paid for."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from training.config.loading import not_allowed
from training.errors import UserError


@dataclass(frozen=True)
class BatchPlan:
    """How a global batch is cut: `accumulation` micro batches of `micro` samples on each of `dp` ranks."""

    global_batch: int
    micro: int
    dp: int

    @property
    def accumulation(self) -> int:
        return self.global_batch // (self.micro * self.dp)

    def check(self, processes: int | None = None) -> None:
        """`processes`: the launch's process count, named in the line when `submit` checks before launching."""
        if self.global_batch % (self.micro * self.dp):
            ranks = (
                f"the {self.dp} data-parallel ranks of {processes} processes"
                if processes
                else f"data-parallel ranks {self.dp}"
            )
            raise UserError(
                f"batch.global {self.global_batch} is not a multiple of batch.micro {self.micro} x {ranks} "
                f"(= {self.micro * self.dp}); change batch.global or batch.micro"
            )

    def check_rows(self, path: Path, split: str, rows: int, seq_len: int) -> None:
        """One step takes each of its blocks once: a global batch beyond the split's blocks is refused (steps
        beyond the first epoch wrap around, as intended; one step repeating blocks would not be)."""
        if self.global_batch > rows:
            raise UserError(
                not_allowed(
                    "batch.global",
                    self.global_batch,
                    f"at most the {rows} sequences of {seq_len} tokens (batch.seq_len) in the {split} split of "
                    f"data.path {path}, so that no step takes a block twice; or prepare more data",
                )
            )

    def check_validation_rows(self, path: Path, split: str, rows: int, batches: int) -> None:
        """A validation reads the first `batches x micro x dp` blocks of its split (`_validation_loss` in
        training.train.loop); more than the split has would count blocks twice."""
        per_batch = self.micro * self.dp
        if batches * per_batch <= rows:
            return
        where = f"the {rows} sequences of the {split} split of data.path {path}"
        if per_batch > rows:
            raise UserError(
                not_allowed(
                    "data.validation_split",
                    split,
                    f"a split of at least batch.micro {self.micro} x {self.dp} data-parallel ranks = {per_batch} "
                    f"sequences; {where} are fewer",
                )
            )
        raise UserError(
            not_allowed(
                "data.validation_batches",
                batches,
                f"at most {rows // per_batch}: each takes batch.micro {self.micro} x {self.dp} data-parallel ranks "
                f"= {per_batch} of {where}, and a validation reads each block once",
            )
        )

    def sample_indices(self, step: int, dp_rank: int, micro_step: int) -> range:
        """Run-wide sample numbers of one micro batch (0-based step)."""
        start = step * self.global_batch + dp_rank * (self.global_batch // self.dp) + micro_step * self.micro
        return range(start, start + self.micro)
