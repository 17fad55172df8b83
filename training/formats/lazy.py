"""Tensors read lazily, one at a time, with plain file reads: where a tensor's bytes are, and reading them.

Memory-mapping a checkpoint would be simpler, but every page it touches stays in the process's
resident set while the file is mapped, so converting a 16 GB model would still show 16 GB resident.
Here a tensor's bytes are read (`os.pread`) only when asked for and freed with the tensor, so a
conversion holds about one layer. The file formats that give a `LazyTensor` are
`training.formats.safetensors_reader` and `training.formats.torch_reader`. Files are untrusted: any damage
is a CheckpointError naming the file.
"""

from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from training.errors import UserError

INT64_MAX = 2**63 - 1


class CheckpointError(UserError, ValueError):
    """A checkpoint file that cannot be read as what it claims to be (missing, truncated, corrupt, malformed).

    A UserError, so one that escapes a reader's caller is still reported as one `error:` line, never a traceback.
    """


def shown(value: Any, limit: int = 60) -> str:
    """A value read from an untrusted file as a short repr: it cannot break a one-line message or flood it."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def shown_name(name: str) -> str:
    """A name read from an untrusted file: as it is when printable and short, else as a short repr."""
    return name if name.isprintable() and len(name) <= 200 else shown(name)


@dataclass(frozen=True)
class FileRange:
    """Bytes of a file: a piece of a tensor that can be copied as is."""

    path: Path
    offset: int
    length: int
    dtype: torch.dtype


@dataclass(frozen=True)
class LazyTensor:
    """Where a tensor's bytes are; `load()` reads exactly those bytes."""

    path: Path
    offset: int  # byte offset of the storage in the file
    storage_bytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int = 0  # in elements

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape)

    def row_range(self, start: int, count: int) -> FileRange | None:
        """Where rows [start, start + count) lie in the file, if the tensor is stored plainly (row-major)."""
        if self.stride != contiguous_stride(self.shape) or not self.shape:
            return None
        row_bytes = self.nbytes // self.shape[0] if self.shape[0] else 0
        begin = self.offset + self.storage_offset * self.dtype.itemsize + start * row_bytes
        return FileRange(self.path, begin, count * row_bytes, self.dtype)

    def load(self) -> torch.Tensor:
        """The tensor; large ones are views of a private file mapping (see `release_mappings`)."""
        itemsize = self.dtype.itemsize
        if self.storage_bytes >= MAP_MIN_BYTES and self.offset % itemsize == 0:
            mapping = _mapping(self.path)
            if self.offset + self.storage_bytes > len(mapping):
                raise CheckpointError(f"{self.path}: truncated (a tensor's data ends past the end of the file)")
            storage = torch.frombuffer(
                mapping, dtype=self.dtype, count=self.storage_bytes // itemsize, offset=self.offset
            )
            return torch.as_strided(storage, self.shape, self.stride, self.storage_offset)
        buffer = torch.empty(self.storage_bytes, dtype=torch.uint8)
        with self.path.open("rb") as handle:
            read_into(handle.fileno(), buffer, self.offset, self.path)
        storage = buffer.view(self.dtype)
        tensor = torch.as_strided(storage, self.shape, self.stride, self.storage_offset)
        whole = self.storage_offset == 0 and tensor.is_contiguous() and tensor.numel() == storage.numel()
        return tensor if whole else tensor.clone()


def read_into(fd: int, buffer: torch.Tensor, offset: int, path: Path) -> None:
    """Fill the uint8 `buffer` with the file's bytes from `offset` (one preadv returns at most about 2 GiB)."""
    view, done = memoryview(cast(Any, buffer.numpy())), 0
    while done < len(view):
        read = os.preadv(fd, [view[done:]], offset + done)
        if read <= 0:
            raise CheckpointError(f"{path}: truncated (a tensor's data ends past the end of the file)")
        done += read


# Tensors at least this large are mapped instead of read: no copy, no zeroed pages to fault in.
MAP_MIN_BYTES = 1 << 20
# Weak: a mapping lives as long as a tensor uses it (torch holds a reference), and is unmapped after.
_MAPPINGS: weakref.WeakValueDictionary[Path, mmap.mmap] = weakref.WeakValueDictionary()


def _mapping(path: Path) -> mmap.mmap:
    mapping = _MAPPINGS.get(path)
    if mapping is None:
        with path.open("rb") as handle:
            # Copy-on-write: the tensors are writable for torch, the file is never modified.
            mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        _MAPPINGS[path] = mapping
    return mapping


def release_mappings() -> None:
    """Drop the resident pages of every mapped checkpoint file still in use.

    Called between shards so the process holds about one shard: the pages stay in the kernel's page
    cache, not in this process's resident set, and are read again from it if touched.
    """
    for mapping in list(_MAPPINGS.values()):
        mapping.madvise(mmap.MADV_DONTNEED)


def nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Size in bytes of a tensor of this dtype and shape."""
    return torch.Size(shape).numel() * dtype.itemsize


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def lazy_tensors(value: Any, prefix: str = "") -> Iterator[tuple[str, LazyTensor]]:
    """(dotted path, tensor) of every tensor in a nested structure."""
    if isinstance(value, LazyTensor):
        yield prefix, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from lazy_tensors(item, f"{prefix}.{key}" if prefix else str(key))
