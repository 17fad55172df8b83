"""Reading tensors lazily, one at a time, with plain file reads: safetensors, torch.save files, xser.

Memory-mapping a checkpoint would be simpler, but every page it touches stays in the process's
resident set while the file is mapped, so converting a 16 GB model would still show 16 GB resident.
Here a tensor's bytes are read (`os.pread`) only when asked for and freed with the tensor, so a
conversion holds about one layer. Opening a file reads only its index (safetensors header or the
pickle of a torch.save archive); unpickling never runs code from the file: unknown globals become
inert stand-ins, which is enough to find the tensors of NeMo/Lightning checkpoints.
"""

from __future__ import annotations

import builtins
import json
import mmap
import os
import pickle
import struct
import weakref
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


# Legacy typed-storage class names that torch.save writes into its pickle, and their element types.
STORAGE_DTYPES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "UntypedStorage": torch.uint8,
}


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read as what it claims to be (missing, truncated, corrupt)."""


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
        if self.stride != _contiguous_stride(self.shape) or not self.shape:
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


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


# --- safetensors ----------------------------------------------------------------------------------------


def open_safetensors(path: Path) -> dict[str, LazyTensor]:
    """The tensors of a safetensors file, from its header; checks the file is long enough for all of them."""
    try:
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError, MemoryError, OverflowError):
        raise CheckpointError(f"{path}: not a safetensors file (header unreadable or truncated)") from None
    start, size = 8 + length, path.stat().st_size
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        if start + end > size:
            raise CheckpointError(f"{path}: truncated ({name} ends at byte {start + end}, the file has {size})")
        shape = tuple(entry["shape"])
        dtype = SAFETENSORS_DTYPES[entry["dtype"]]
        tensors[name] = LazyTensor(path, start + begin, end - begin, dtype, shape, _contiguous_stride(shape))
    return tensors


# --- torch.save archives ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class _StorageType:
    name: str


@dataclass
class TensorReference:
    """Stand-in for torch_xla.utils.serialization.TensorReference (xser)."""

    tid: int = -1

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.tid = int(state.get("tid", -1))


class Opaque:
    """Stand-in for any other global in a checkpoint pickle: accepts anything, does nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __call__(self, *args: Any, **kwargs: Any) -> Opaque:
        return Opaque(*args)


class _LazyUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, locate: Callable[[_StorageRef], tuple[int, int]], path: Path) -> None:
        import io

        super().__init__(io.BytesIO(data))
        self._locate = locate
        self._path = path

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise CheckpointError(f"{self._path}: unsupported persistent id in pickle")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise CheckpointError(f"{self._path}: unsupported storage type in pickle")
        return _StorageRef(str(key), STORAGE_DTYPES[storage_type.name], int(numel))

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2") or (module, name) == (
            "torch._utils",
            "_rebuild_tensor",
        ):
            return self._rebuild
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return lambda data, *args: data
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(name)
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if (module, name) == ("torch_xla.utils.serialization", "TensorReference"):
            return TensorReference
        if module == "builtins" and name in ("dict", "list", "tuple", "set", "frozenset", "int", "float", "str"):
            return getattr(builtins, name)
        return Opaque

    def _rebuild(self, storage: _StorageRef, storage_offset: int, size: Any, stride: Any, *args: Any) -> LazyTensor:
        offset, length = self._locate(storage)
        expected = storage.numel * storage.dtype.itemsize
        if length != expected:
            raise CheckpointError(f"{self._path}: storage {storage.key} holds {length} bytes, expected {expected}")
        return LazyTensor(self._path, offset, length, storage.dtype, tuple(size), tuple(stride), int(storage_offset))


def open_torch_file(path: Path) -> Any:
    """The object a torch.save archive holds, with every tensor as a LazyTensor (nothing else is read)."""
    try:
        archive = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (zipfile.BadZipFile, OSError):
        raise CheckpointError(f"{path}: not a readable torch.save archive (truncated or corrupt)") from None
    with archive:
        names = archive.namelist()
        pickles = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
        if not pickles:
            raise CheckpointError(f"{path}: not a torch.save archive (no data.pkl)")
        prefix = pickles[0][: -len("data.pkl")]
        records = {info.filename: info for info in archive.infolist()}
        with path.open("rb") as handle:

            def locate(storage: _StorageRef) -> tuple[int, int]:
                info = records.get(f"{prefix}data/{storage.key}")
                if info is None:
                    raise CheckpointError(f"{path}: storage {storage.key} is missing from the archive")
                if info.compress_type != zipfile.ZIP_STORED:
                    raise CheckpointError(f"{path}: compressed storage records are not supported")
                handle.seek(info.header_offset)
                local = handle.read(30)
                if len(local) < 30 or local[:4] != b"PK\x03\x04":
                    raise CheckpointError(f"{path}: corrupt archive (bad local header)")
                name_length, extra_length = struct.unpack("<HH", local[26:30])
                return info.header_offset + 30 + name_length + extra_length, info.file_size

            try:
                return _LazyUnpickler(archive.read(pickles[0]), locate, path).load()
            except (pickle.UnpicklingError, EOFError, zipfile.BadZipFile) as error:
                raise CheckpointError(f"{path}: corrupt pickle ({error})") from None


def open_xser(path: Path) -> Any:
    """An xser checkpoint: the main archive's TensorReferences resolved to the tensors of `X.tensors/`."""
    root = open_torch_file(path)
    folder = Path(f"{path}.tensors")

    def resolve(value: Any) -> Any:
        if isinstance(value, TensorReference):
            tensor = open_torch_file(folder / f"tensor_{value.tid}.pt")
            if not isinstance(tensor, LazyTensor):
                raise CheckpointError(f"{folder}/tensor_{value.tid}.pt: does not hold a tensor")
            return tensor
        if isinstance(value, dict):
            return {k: resolve(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(resolve(v) for v in value)
        return value

    return resolve(root)


def open_checkpoint_file(path: Path) -> Any:
    """Plain torch.save or xser, decided by the presence of the `.tensors` folder beside the file."""
    return open_xser(path) if Path(f"{path}.tensors").is_dir() else open_torch_file(path)


def lazy_tensors(value: Any, prefix: str = "") -> Iterator[tuple[str, LazyTensor]]:
    """(dotted path, tensor) of every tensor in a nested structure."""
    if isinstance(value, LazyTensor):
        yield prefix, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from lazy_tensors(item, f"{prefix}.{key}" if prefix else str(key))
