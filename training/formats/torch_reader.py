"""Reading torch.save archives and xser checkpoints lazily: the pickle read, every tensor a `LazyTensor`.

Opening a file reads only its pickle; unpickling never runs code from the file: unknown globals become
inert stand-ins, which is enough to find the tensors of NeMo/Lightning checkpoints. A pickle is checked
before it is used (every tensor's bytes inside the file and of the size its shape and dtype say), and
any damage is a CheckpointError naming the file.
"""

from __future__ import annotations

import builtins
import pickle
import struct
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from training.formats.lazy import INT64_MAX, CheckpointError, LazyTensor, shown, shown_name

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
