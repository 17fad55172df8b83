"""Streaming writers for `torch.save` files and torch_xla xser checkpoints (one `torch.save` file per tensor).

A checkpoint converter holds about one transformer layer in memory while it writes every tensor-parallel
rank's shard, so all writers here take tensors one at a time, put each tensor's bytes on disk at once and
keep only its name, dtype and shape. Nothing here renames files: callers write into a temporary directory.
Nothing here reads checkpoints either: `training.formats.torch_reader` does (`open_torch_file`, `open_xser`).

`TorchFileWriter` lays the zip archive out record for record as PyTorch's own writer (miniz, called from
`caffe2/serialize/inline_container.cc`) does: every record's data starts on a 64-byte boundary (an "FB"
extra field padded with "Z"), zip64 fields appear under miniz's rules and the data descriptors follow
miniz's sizes, so `torch.load(..., mmap=True)` and torch's offset arithmetic
(`torch.utils.serialization.config.load.calculate_storage_offsets`, `map_location="meta"`) both work.
`data.pkl` is byte-identical to `torch.save`'s for the same object. What differs: the `data/<n>` records
come first (they are streamed) and `data.pkl` and the small metadata records last; views are stored as
compact copies (torch.save keeps the whole base storage and the view's strides); and
`.data/serialization_id` is a deterministic hash, so the same content always gives the same bytes.

xser is `torch.save` files (one per tensor plus a pickle of references), so both writers live here; the byte
path they share with the safetensors writer is `training.formats.streaming`.
"""

from __future__ import annotations

import collections
import hashlib
import io
import pickle
import pickletools
import shutil
import struct
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Final

import torch

from training.formats.lazy import FileRange
from training.formats.streaming import Writer, prepare_tensor, range_chunks, tensor_bytes

__all__ = ["ZIP64_LIMIT", "TorchFileWriter", "XserTensorReference", "XserWriter"]

# Legacy typed-storage class per dtype: `torch.save` names these in each storage's persistent id, and the
# weights_only unpickler allows exactly these classes.
_STORAGE_CLASSES: Final[dict[torch.dtype, str]] = {
    torch.float64: "DoubleStorage",
    torch.float32: "FloatStorage",
    torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage",
    torch.int64: "LongStorage",
    torch.int32: "IntStorage",
    torch.int16: "ShortStorage",
    torch.int8: "CharStorage",
    torch.uint8: "ByteStorage",
    torch.bool: "BoolStorage",
}

_ALIGNMENT: Final = 64  # torch's default `config.save.storage_alignment`, needed for mmap
_FORMAT_VERSION: Final = b"1"  # storages are numbered in the order the pickle first references them
_ARCHIVE_VERSION: Final = b"3\n"  # what torch 2.x writes as `version` for eager `torch.save` files
ZIP64_LIMIT = 0xFFFFFFFF  # miniz switches a field to zip64 at >= this value (a variable so tests can lower it)

_LOCAL_HEADER: Final = struct.Struct("<IHHHHHIIIHH")
_CENTRAL_HEADER: Final = struct.Struct("<IHHHHHHIIIHHHHHII")
_UTF8_FLAG: Final = 0x0800
_DESCRIPTOR_FLAG: Final = 0x0008

_XLA_TENSOR_REFERENCE: Final = ("torch_xla.utils.serialization", "TensorReference")


class XserTensorReference:
    """Stand-in for `torch_xla.utils.serialization.TensorReference`, so xser files need no torch_xla.

    Pickled by `XserWriter` under torch_xla's exact class path (same `__dict__`, `{"tid": n}`); readers see
    torch_xla's class (`training.formats.torch_reader.open_xser` reads these files without torch_xla).
    """

    def __init__(self, tid: int) -> None:
        self.tid = tid

    def __repr__(self) -> str:
        return f"XserTensorReference(tid={self.tid})"


# Globals whose pickled name is rewritten: (module, qualname) as pickle writes it -> name torch_xla uses.
_GLOBAL_ALIASES: Final[dict[tuple[str, str], tuple[str, str]]] = {
    (XserTensorReference.__module__, XserTensorReference.__qualname__): _XLA_TENSOR_REFERENCE,
}


def _archive_name(path: Path) -> str:
    """The zip's top-level folder, named like torch's writer: file name up to its last dot."""
    name = path.name
    if not name.isascii():
        return "archive"  # torch writes non-ASCII paths through a Python stream, which it calls "archive"
    stem = name[: name.rfind(".")] if "." in name else name
    return stem or "archive"


class _StorageRef:
    """What the pickle refers to instead of a storage: the record key, storage class and element count."""

    __slots__ = ("key", "numel", "storage_class")

    def __init__(self, key: str, storage_class: type, numel: int) -> None:
        self.key = key
        self.storage_class = storage_class
        self.numel = numel


def _storage_class(dtype: torch.dtype) -> type:
    try:
        storage_class: type = getattr(torch, _STORAGE_CLASSES[dtype])
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype}; supported: {sorted(map(str, _STORAGE_CLASSES))}") from None
    return storage_class


class _ZipWriter:
    """Appends stored (uncompressed) records to a zip the way PyTorch's miniz-based writer lays them out."""

    def __init__(self, file: BinaryIO, prefix: str) -> None:
        self._file = file
        self._prefix = prefix
        self._pos = 0
        # (name, crc, size, local header offset, flags) per record, for the central directory.
        self._entries: list[tuple[bytes, int, int, int, int]] = []

    def _write(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._pos += len(data)

    def write_record(self, name: str, chunks: Iterable[bytes | memoryview], size: int) -> int:
        """Writes one record (its data 64-byte aligned) and returns its CRC-32."""
        full_name = f"{self._prefix}/{name}".encode()
        offset = self._pos
        zip64 = b""
        if size >= ZIP64_LIMIT or offset >= ZIP64_LIMIT:
            # miniz writes the uncompressed size, a compressed size of 0 (not yet known) and the offset.
            fields = struct.pack("<QQ", size, 0) if size >= ZIP64_LIMIT else b""
            fields += struct.pack("<Q", offset) if offset >= ZIP64_LIMIT else b""
            zip64 = struct.pack("<HH", 1, len(fields)) + fields
        data_start = offset + _LOCAL_HEADER.size + len(full_name) + len(zip64) + 4
        padding = -data_start % _ALIGNMENT
        extra = zip64 + b"FB" + struct.pack("<H", padding) + b"Z" * padding
        flags = _UTF8_FLAG | (_DESCRIPTOR_FLAG if size else 0)
        # Version, method, time, date, CRC and sizes are 0 here, as in torch's files; the CRC and sizes
        # follow the data in a descriptor and are repeated in the central directory.
        self._write(_LOCAL_HEADER.pack(0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(full_name), len(extra)))
        self._write(full_name + extra)
        crc = 0
        written = 0
        for chunk in chunks:
            crc = zlib.crc32(chunk, crc)
            self._write(chunk)
            written += len(chunk)
            del chunk  # a view's copied piece must be freed before the next one is made
        if written != size:
            raise RuntimeError(f"record {name}: wrote {written} bytes, expected {size}")
        if size:
            if zip64:
                self._write(struct.pack("<IIQQ", 0x08074B50, crc, size, size))
            else:
                self._write(struct.pack("<IIII", 0x08074B50, crc, size, size))
        self._entries.append((full_name, crc, size, offset, flags))
        return crc

    def finish(self) -> None:
        """Writes the central directory and the zip64 and classic end records (torch always writes both)."""
        cd_offset = self._pos
        for full_name, crc, size, offset, flags in self._entries:
            fields = struct.pack("<QQ", size, size) if size >= ZIP64_LIMIT else b""
            fields += struct.pack("<Q", offset) if offset >= ZIP64_LIMIT else b""
            zip64 = struct.pack("<HH", 1, len(fields)) + fields if fields else b""
            size32 = min(size, 0xFFFFFFFF)
            name_len, extra_len, offset32 = len(full_name), len(zip64), min(offset, 0xFFFFFFFF)
            header = _CENTRAL_HEADER.pack(
                0x02014B50, 0, 0, flags, 0, 0, 0, crc, size32, size32, name_len, extra_len, 0, 0, 0, 0, offset32
            )
            self._write(header + full_name + zip64)
        cd_size = self._pos - cd_offset
        count = len(self._entries)
        eocd64_offset = self._pos
        self._write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x002D, 0, 0, count, count, cd_size, cd_offset))
        self._write(struct.pack("<IIQI", 0x07064B50, 0, eocd64_offset, 1))
        count16, cd_size32, cd_offset32 = min(count, 0xFFFF), min(cd_size, 0xFFFFFFFF), min(cd_offset, 0xFFFFFFFF)
        self._write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count16, count16, cd_size32, cd_offset32, 0))


class _StatePickler(pickle.Pickler):
    """Pickles placeholder tensors exactly as `torch.save` pickles real ones (protocol 2)."""

    def __init__(self, file: io.BytesIO, refs: dict[int, _StorageRef]) -> None:
        super().__init__(file, protocol=2)
        self._refs = refs
        self.storage_order: list[str] = []

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is _StorageRef:
            self.storage_order.append(obj.key)
            return ("storage", obj.storage_class, obj.key, "cpu", obj.numel)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            ref = self._refs.get(id(obj))
            if ref is None:
                raise ValueError("only the tensors in the state passed to root() can be saved; add() the others")
            args: tuple[Any, ...] = (ref, 0, tuple(obj.shape), obj.stride(), False, collections.OrderedDict())
            return (torch._utils._rebuild_tensor_v2, args)
        return NotImplemented


def _rename_globals(data: bytes) -> bytes:
    """Rewrites GLOBAL opcodes of stand-in classes to the names of the classes they stand in for."""
    if not any(qualname.encode() in data for _, qualname in _GLOBAL_ALIASES):
        return data
    out = bytearray()
    last = 0
    for opcode, arg, pos in pickletools.genops(data):
        if opcode.name != "GLOBAL" or pos is None:
            continue
        module, _, name = str(arg).partition(" ")
        alias = _GLOBAL_ALIASES.get((module, name))
        if alias is None:
            continue
        end = pos + 1 + len(module.encode()) + 1 + len(name.encode()) + 1
        out += data[last:pos] + b"c" + f"{alias[0]}\n{alias[1]}\n".encode()
        last = end
    out += data[last:]
    return bytes(out)


class TorchFileWriter(Writer):
    """Streams tensors into a file that `torch.load` (also with `mmap=True, weights_only=True`) reads as
    if `torch.save(root(state), path)` had written it, holding only one tensor (or an 8 MB piece of a
    non-contiguous view) in memory at a time.

    Each `add` becomes one storage record with contiguous strides: views are saved as compact copies, a
    tensor added twice is stored twice, and `requires_grad` is not kept. Use as a context manager so an
    exception removes the partial file (a failed `add` or `close` removes it too: the archive is unusable).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file: BinaryIO | None = open(self.path, "wb")  # noqa: SIM115 - closed by close()/abort()
        self._zip = _ZipWriter(self._file, _archive_name(self.path))
        self._state: dict[str, torch.Tensor] = {}  # key -> meta tensor standing in for the written one
        self._refs: dict[int, _StorageRef] = {}  # id(meta tensor) -> its record
        self._crcs: list[int] = []

    def is_open(self) -> bool:
        return self._file is not None

    def _open_file(self) -> BinaryIO:
        if self._file is None:
            raise ValueError(f"{self.path}: writer is closed")
        return self._file

    def add(self, key: str, tensor: torch.Tensor) -> None:
        """Writes the tensor's bytes now; only its dtype and shape are kept."""
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        _storage_class(tensor.dtype)  # refuse unsupported dtypes before writing anything
        tensor = prepare_tensor(tensor)
        self._record(key, tensor_bytes(tensor), tensor.dtype, tuple(tensor.shape))

    def add_pieces(self, key: str, pieces: Iterable[torch.Tensor], dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        """Like `add`, for a tensor given as consecutive row-major pieces, each written as it comes."""

        def chunks() -> Iterator[memoryview]:
            for piece in pieces:
                if piece.dtype != dtype:
                    raise ValueError(f"{self.path}: a piece of {key!r} is {piece.dtype}, expected {dtype}")
                yield from tensor_bytes(prepare_tensor(piece))

        self._record(key, chunks(), dtype, shape)

    def add_ranges(self, key: str, ranges: Sequence[FileRange], dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        """Like `add`, for a tensor whose row-major bytes are `ranges` of other files (copied, never loaded)."""
        if (
            any(r.dtype != dtype for r in ranges)
            or sum(r.length for r in ranges) != torch.Size(shape).numel() * dtype.itemsize
        ):
            raise ValueError(f"{self.path}: the pieces of {key!r} do not add up to {dtype} {shape}")
        self._record(key, range_chunks(ranges), dtype, shape)

    def _record(self, key: str, chunks: Iterable[memoryview], dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        """One storage record from `chunks`, and the placeholder the pickle will refer to it by."""
        self._open_file()
        if key in self._state:
            raise ValueError(f"{self.path}: duplicate key {key!r}")
        numel = torch.Size(shape).numel()
        storage_key = str(len(self._state))
        try:
            self._crcs.append(self._zip.write_record(f"data/{storage_key}", chunks, numel * dtype.itemsize))
        except BaseException:
            self.abort()
            raise
        placeholder = torch.empty(shape, dtype=dtype, device="meta")
        self._state[key] = placeholder
        self._refs[id(placeholder)] = _StorageRef(storage_key, _storage_class(dtype), numel)

    def close(self, root: Callable[[dict[str, torch.Tensor]], object] | None = None) -> None:
        """Writes the pickle of `root(state)` (default: `state`, a dict key -> tensor in `add` order) and the
        zip's directory. The tensors `root` sees are meta-device placeholders for the written ones."""
        file = self._open_file()
        try:
            state = dict(self._state)
            obj = state if root is None else root(state)
            buffer = io.BytesIO()
            pickler = _StatePickler(buffer, self._refs)
            pickler.dump(obj)
            self._write_small("data.pkl", _rename_globals(buffer.getvalue()))
            # torch's offset arithmetic assumes the pickle meets storages 0, 1, 2, ... in file order; a root
            # that reorders or drops tensors gets no `.format_version`, so torch reads every header instead.
            if pickler.storage_order == [str(i) for i in range(len(self._state))]:
                self._write_small(".format_version", _FORMAT_VERSION)
            self._write_small(".storage_alignment", str(_ALIGNMENT).encode())
            self._write_small("byteorder", sys.byteorder.encode())
            self._write_small("version", _ARCHIVE_VERSION)
            self._write_small(".data/serialization_id", self._serialization_id())
            self._zip.finish()
            file.close()
        except BaseException:
            self.abort()
            raise
        self._file = None
        self._state.clear()
        self._refs.clear()

    def abort(self) -> None:
        """Closes and deletes the partial file."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self.path.unlink(missing_ok=True)
        self._state.clear()
        self._refs.clear()

    def _write_small(self, name: str, data: bytes) -> None:
        crc = self._zip.write_record(name, [data], len(data))
        if data:
            self._crcs.append(crc)

    def _serialization_id(self) -> bytes:
        """40 digits like torch's (names hash + CRC hash), but deterministic for the same content."""
        names = sorted(entry[0] for entry in self._zip._entries)
        names_hash = hashlib.blake2b(b"\n".join(names), digest_size=8).digest()
        crc_hash = hashlib.blake2b(struct.pack(f"<{len(self._crcs)}I", *self._crcs), digest_size=8).digest()
        return f"{int.from_bytes(names_hash, 'little'):020d}{int.from_bytes(crc_hash, 'little'):020d}".encode()


def _tensors_dir(path: Path) -> Path:
    return Path(f"{path}.tensors")


def _info_file(path: Path) -> Path:
    return path.with_name(path.name + ".info.pt")


def _tensor_file(path: Path, tid: int) -> Path:
    return _tensors_dir(path) / f"tensor_{tid}.pt"


class XserWriter(Writer):
    """Streams a torch_xla xser checkpoint: tensor `tid` goes to `<path>.tensors/tensor_<tid>.pt` at `add`
    (tids in `add` order), and `close` writes `<path>` with each tensor replaced by a
    `torch_xla.utils.serialization.TensorReference(tid)`, as `torch_xla.utils.serialization.save` does.

    torch_xla numbers tensors in the traversal order of the saved object; `root` keeps that order as long as
    it does not reorder the state. An existing `<path>.tensors` folder is replaced, as torch_xla does.
    `close` also writes `<path>.info.pt` ({tid: dtype, shape, expert_model_parallel}), which neuronx-distributed
    writes beside its own xser files and requires to load them once model parallelism is initialized.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._dir = _tensors_dir(self.path)
        if self._dir.is_dir():
            shutil.rmtree(self._dir)
        self._dir.mkdir()
        self._refs: dict[str, XserTensorReference] | None = {}
        self._info: dict[int, dict[str, Any]] = {}

    def is_open(self) -> bool:
        return self._refs is not None

    def _open_refs(self) -> dict[str, XserTensorReference]:
        if self._refs is None:
            raise ValueError(f"{self.path}: writer is closed")
        return self._refs

    def add(self, key: str, tensor: torch.Tensor) -> None:
        """Writes the tensor's own `torch.save`-format file now."""
        self._tensor_file(key, tensor.dtype, tuple(tensor.shape), lambda writer: writer.add(key, tensor))

    def add_pieces(self, key: str, pieces: Iterable[torch.Tensor], dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        """Like `add`, for a tensor given as consecutive row-major pieces."""
        self._tensor_file(key, dtype, shape, lambda writer: writer.add_pieces(key, pieces, dtype, shape))

    def add_ranges(self, key: str, ranges: Sequence[FileRange], dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        """Like `add`, for a tensor whose row-major bytes are `ranges` of other files."""
        self._tensor_file(key, dtype, shape, lambda writer: writer.add_ranges(key, ranges, dtype, shape))

    def _tensor_file(
        self, key: str, dtype: torch.dtype, shape: tuple[int, ...], write: Callable[[TorchFileWriter], None]
    ) -> None:
        refs = self._open_refs()
        if key in refs:
            raise ValueError(f"{self.path}: duplicate key {key!r}")
        tid = len(refs)
        with TorchFileWriter(_tensor_file(self.path, tid)) as writer:
            write(writer)
            writer.close(lambda state: state[key])
        refs[key] = XserTensorReference(tid)
        self._info[tid] = {"dtype": dtype, "shape": torch.Size(shape), "expert_model_parallel": False}

    def close(self, root: Callable[[dict[str, Any]], object] | None = None) -> None:
        """Writes the main file: `root(state)` (default `state`), where `state` maps each key, in `add` order,
        to its `XserTensorReference` (pickled as torch_xla's `TensorReference`)."""
        refs = self._open_refs()
        state: dict[str, Any] = dict(refs)
        obj = state if root is None else root(state)
        with TorchFileWriter(self.path) as writer:
            writer.close(lambda _: obj)
        with TorchFileWriter(_info_file(self.path)) as writer:
            writer.close(lambda _: self._info)
        self._refs = None

    def abort(self) -> None:
        """Deletes the partial checkpoint (main file and tensor folder)."""
        self._refs = None
        self.path.unlink(missing_ok=True)
        _info_file(self.path).unlink(missing_ok=True)
        shutil.rmtree(self._dir, ignore_errors=True)
