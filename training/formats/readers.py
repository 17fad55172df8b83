"""Reading tensors lazily, one at a time, with plain file reads: safetensors, torch.save files, xser.

Memory-mapping a checkpoint would be simpler, but every page it touches stays in the process's
resident set while the file is mapped, so converting a 16 GB model would still show 16 GB resident.
Here a tensor's bytes are read (`os.pread`) only when asked for and freed with the tensor, so a
conversion holds about one layer. Opening a file reads only its index (safetensors header or the
pickle of a torch.save archive); unpickling never runs code from the file: unknown globals become
inert stand-ins, which is enough to find the tensors of NeMo/Lightning checkpoints. Files are untrusted: a
header or pickle is checked before it is used (every tensor's bytes inside the file and of the size its
shape and dtype say), and any damage is a CheckpointError naming the file.
"""

from __future__ import annotations

import builtins
import json
import math
import mmap
import os
import pickle
import struct
import weakref
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from training.errors import UserError

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


# The reference implementation refuses headers larger than this; so does this reader (no 2**64-byte reads).
SAFETENSORS_MAX_HEADER = 100_000_000
SAFETENSORS_ENTRY_KEYS = ("dtype", "shape", "data_offsets")
INT64_MAX = 2**63 - 1


def open_safetensors(path: Path) -> dict[str, LazyTensor]:
    """The tensors of a safetensors file, from its header, checked as the format requires before it is used.

    A header that lies (offsets that disagree with shape and dtype, overlapping or out-of-file ranges) would
    otherwise make the converter copy the wrong bytes as weights and succeed; every violation is a
    CheckpointError naming the file and the tensor.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(
                    f"{path}: not a safetensors file ({size} bytes, less than its 8-byte header length)"
                )
            (length,) = struct.unpack("<Q", prefix)
            if length > size - 8:
                raise CheckpointError(
                    f"{path}: not a safetensors file or truncated (header length {length} runs past the end of the "
                    f"file, {size} bytes)"
                )
            if length > SAFETENSORS_MAX_HEADER:
                raise CheckpointError(
                    f"{path}: header length {length} is not allowed; allowed: at most {SAFETENSORS_MAX_HEADER} bytes"
                )
            raw = handle.read(length)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    return _safetensors_tensors(path, _safetensors_header(path, raw), 8 + length, size)


def _safetensors_header(path: Path, raw: bytes) -> dict[str, Any]:
    """The header as a JSON object whose names each appear once (JSON would silently keep the last)."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for key, value in pairs:
            if key in found:
                raise CheckpointError(f"{path}: {shown_name(key)} appears twice in the header; allowed: each name once")
            found[key] = value
        return found

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=unique)
    except CheckpointError:
        raise
    except UnicodeDecodeError as error:
        raise CheckpointError(f"{path}: header is not UTF-8 ({error.reason} at byte {8 + error.start})") from None
    except json.JSONDecodeError as error:
        raise CheckpointError(
            f"{path}: header is not valid JSON ({error.msg}, line {error.lineno} column {error.colno})"
        ) from None
    except (ValueError, RecursionError):  # numbers too long to convert, nesting too deep
        raise CheckpointError(f"{path}: header is not valid JSON") from None
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{path}: header is a JSON {type(header).__name__}; allowed: a JSON object of tensor entries"
        )
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict):
        raise CheckpointError(
            f"{path}: __metadata__: {shown(metadata)} is not allowed; allowed: a map of strings to strings"
        )
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise CheckpointError(
                f"{path}: __metadata__: {shown_name(key)}: {shown(value)} is not allowed; allowed: a string "
                "(__metadata__ maps strings to strings)"
            )
    return header


def _safetensors_tensors(path: Path, header: dict[str, Any], start: int, size: int) -> dict[str, LazyTensor]:
    """Each entry checked (dtype, shape, offsets within the data and matching shape x dtype), then the whole:
    tensors stored back to back from the first data byte to the last, as the format requires."""
    data_size = size - start
    tensors: dict[str, LazyTensor] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {shown_name(name)}"
        if not isinstance(entry, dict):
            raise CheckpointError(
                f"{where}: {shown(entry)} is not allowed; allowed: an object with dtype, shape and data_offsets"
            )
        for key in SAFETENSORS_ENTRY_KEYS:
            if key not in entry:
                raise CheckpointError(f"{where}: {key}: required key is missing")
        dtype_name, shape, offsets = (entry[key] for key in SAFETENSORS_ENTRY_KEYS)
        if not isinstance(dtype_name, str) or dtype_name not in SAFETENSORS_DTYPES:
            raise CheckpointError(
                f"{where}: dtype: {shown(dtype_name)} is not allowed; allowed: {', '.join(SAFETENSORS_DTYPES)}"
            )
        if not (
            isinstance(shape, list)
            and all(type(dim) is int and dim >= 0 for dim in shape)
            and math.prod(max(dim, 1) for dim in shape) <= INT64_MAX
        ):
            raise CheckpointError(
                f"{where}: shape: {shown(shape)} is not allowed; allowed: a list of integers of 0 or more "
                "(with a product below 2**63)"
            )
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(offset) is int for offset in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise CheckpointError(
                f"{where}: data_offsets: {shown(offsets)} is not allowed; allowed: [begin, end] with 0 <= begin <= end"
            )
        begin, end = offsets
        if end > data_size:
            raise CheckpointError(
                f"{path}: truncated ({shown_name(name)} ends at byte {start + end}, the file has {size})"
            )
        dtype = SAFETENSORS_DTYPES[dtype_name]
        expected = math.prod(shape) * dtype.itemsize
        if end - begin != expected:
            raise CheckpointError(
                f"{where}: data_offsets: [{begin}, {end}] is not allowed; allowed: a range of {expected} bytes "
                f"(shape {shape} of {dtype_name}), not {end - begin}"
            )
        shape_tuple = tuple(shape)
        tensors[name] = LazyTensor(
            path, start + begin, end - begin, dtype, shape_tuple, _contiguous_stride(shape_tuple)
        )
        spans.append((begin, end, name))
    position, previous = 0, ""
    for begin, end, name in sorted(spans):
        if begin != position:
            problem = f"overlaps {shown_name(previous)}" if begin < position else "leaves a gap before it"
            raise CheckpointError(
                f"{path}: tensor {shown_name(name)}: data_offsets: [{begin}, {end}] {problem}; allowed: a begin of "
                f"{position}, the end of the data before it (the format stores tensors back to back)"
            )
        position, previous = end, name
    if position != data_size:
        raise CheckpointError(
            f"{path}: {data_size - position} bytes after the last tensor's data; allowed: a file that ends with its "
            "last tensor"
        )
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
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CheckpointError(f"{self._path}: unsupported persistent id in pickle")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise CheckpointError(f"{self._path}: unsupported storage type in pickle")
        if not isinstance(key, str) or type(numel) is not int or numel < 0:
            raise CheckpointError(f"{self._path}: storage {shown(key)} of {shown(numel)} elements in pickle is invalid")
        return _StorageRef(key, STORAGE_DTYPES[storage_type.name], numel)

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

    def _rebuild(self, storage: Any, storage_offset: Any, size: Any, stride: Any, *args: Any) -> LazyTensor:
        """A tensor's place in the file, once its view is known to lie inside its storage (a view reaching past
        it would read other tensors' bytes, or past the end of the file)."""
        if not isinstance(storage, _StorageRef):
            raise CheckpointError(f"{self._path}: a tensor in the pickle has no storage")
        offset, length = self._locate(storage)
        expected = storage.numel * storage.dtype.itemsize
        if length != expected:
            raise CheckpointError(
                f"{self._path}: storage {shown_name(storage.key)} holds {length} bytes, expected {expected}"
            )
        if not (
            _naturals(size)
            and _naturals(stride)
            and len(size) == len(stride)
            and type(storage_offset) is int
            and storage_offset >= 0
        ):
            raise CheckpointError(
                f"{self._path}: a tensor of storage {shown_name(storage.key)} has an invalid view (size {shown(size)}, "
                f"stride {shown(stride)}, offset {shown(storage_offset)})"
            )
        if all(size):
            reach = storage_offset + sum((extent - 1) * step for extent, step in zip(size, stride, strict=True)) + 1
            if reach > storage.numel:
                raise CheckpointError(
                    f"{self._path}: a tensor of storage {shown_name(storage.key)} reaches element {reach - 1}, "
                    f"past its {storage.numel} elements"
                )
        return LazyTensor(self._path, offset, length, storage.dtype, tuple(size), tuple(stride), storage_offset)


def _naturals(value: Any) -> bool:
    """A tuple or list of integers of 0 or more, as a tensor's size and stride are pickled."""
    return isinstance(value, tuple | list) and all(type(item) is int and 0 <= item <= INT64_MAX for item in value)


# What unpickling a damaged or hostile pickle with this module's stand-ins can raise: all of it is the file's fault.
_UNPICKLING_ERRORS = (
    pickle.UnpicklingError,
    EOFError,
    zipfile.BadZipFile,
    zlib.error,
    NotImplementedError,
    ValueError,
    TypeError,
    AttributeError,
    KeyError,
    IndexError,
    struct.error,
    OverflowError,
    MemoryError,
    RecursionError,
)


def open_torch_file(path: Path) -> Any:
    """The object a torch.save archive holds, with every tensor as a LazyTensor (nothing else is read)."""
    try:
        archive = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (zipfile.BadZipFile, OSError, ValueError, struct.error, OverflowError, EOFError, NotImplementedError):
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
                    raise CheckpointError(f"{path}: storage {shown_name(storage.key)} is missing from the archive")
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
            except CheckpointError:
                raise
            except _UNPICKLING_ERRORS as error:
                reason = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
                raise CheckpointError(f"{path}: corrupt pickle ({reason})") from None


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
