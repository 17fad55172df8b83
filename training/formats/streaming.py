"""The writers' shared byte path: a tensor's bytes (or other files' byte ranges) as chunks, and the writer base.

Every writer in `training.formats` puts a tensor's bytes on disk at once and keeps only its name, dtype and
shape; this module is how: a non-contiguous view is copied through one reused staging buffer per thread, at
most `CHUNK_BYTES` at a time, so writing a view costs neither a full copy nor fresh pages.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any, Final, TypeVar, cast

import torch

from training.formats.lazy import FileRange

CHUNK_BYTES: Final = 8 << 20  # largest temporary copy made when a non-contiguous view is written

_COPY_BUFFERS = threading.local()


def copy_buffer() -> torch.Tensor:
    """This thread's staging buffer: reused, so copying a view costs no fresh pages (no page faults)."""
    buffer: torch.Tensor | None = getattr(_COPY_BUFFERS, "buffer", None)
    if buffer is None:
        buffer = _COPY_BUFFERS.buffer = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
    return buffer


def contiguous_pieces(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """Contiguous parts of `tensor` in row-major order, each valid only until the next is requested.

    A non-contiguous view is copied through this thread's staging buffer, at most `CHUNK_BYTES` at a time.
    """
    if tensor.is_contiguous():  # includes 0-d and empty tensors
        yield tensor
        return
    row_bytes = tensor[0].numel() * tensor.element_size()
    if row_bytes > CHUNK_BYTES and tensor.dim() > 1:
        for row in tensor:
            yield from contiguous_pieces(row)
        return
    step = max(1, CHUNK_BYTES // max(row_bytes, 1))
    buffer = copy_buffer()
    for start in range(0, tensor.shape[0], step):
        piece = tensor[start : start + step]
        staged = buffer[: piece.numel() * piece.element_size()].view(piece.dtype).view(piece.shape)
        yield staged.copy_(piece)


def tensor_bytes(tensor: torch.Tensor) -> Iterator[memoryview]:
    """The tensor's elements as raw bytes in row-major order, without materializing a full copy of a view."""
    for piece in contiguous_pieces(tensor):
        if piece.numel():
            yield piece.reshape(-1).view(torch.uint8).numpy().data
        del piece  # release this copy before the next one is made


def prepare_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor whose bytes can be read through numpy (no autograd, neg or conj flags)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type == "meta":
        raise ValueError("a meta tensor has no data to write")
    tensor = tensor.detach().resolve_conj().resolve_neg()
    return tensor if tensor.device.type == "cpu" else tensor.cpu()


def range_chunks(ranges: Sequence[FileRange]) -> Iterator[memoryview]:
    """The bytes of `ranges` in order, read through this thread's staging buffer (as `cp` copies).

    Each chunk is only valid until the next is requested. copy_file_range would save a copy, but the zip
    records need a CRC of the bytes, and a fresh buffer per tensor would cost a page fault per page.
    """
    view = memoryview(cast(Any, copy_buffer().numpy()))
    for piece in ranges:
        with piece.path.open("rb") as source:
            offset, remaining = piece.offset, piece.length
            while remaining:
                read = os.preadv(source.fileno(), [view[: min(remaining, len(view))]], offset)
                if read <= 0:
                    raise ValueError(f"{piece.path}: ends before byte {offset + remaining}")
                yield view[:read]
                offset += read
                remaining -= read


_W = TypeVar("_W", bound="Writer")


class Writer:
    """Context-manager behaviour shared by the writers: finish on success, remove the partial file on error."""

    def is_open(self) -> bool:
        """Whether `close` or `abort` is still to come."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def __enter__(self: _W) -> _W:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self.abort()
        elif self.is_open():
            self.close()
