"""Streaming writer for safetensors files: the header is written up front from a plan, then each tensor's bytes.

Its byte path is the one the torch writers use (`training.formats.streaming`); reading is
`training.formats.safetensors_reader`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Final

import torch

from training.formats.lazy import FileRange
from training.formats.streaming import Writer, prepare_tensor, range_chunks, tensor_bytes

__all__ = ["SafetensorsPlan", "SafetensorsWriter", "safetensors_save_order"]

# safetensors dtype names, in the order of the Rust `Dtype` enum; `save_file` sorts by descending position.
_SAFETENSORS_DTYPES: Final[dict[torch.dtype, str]] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
}
_SAFETENSORS_RANK: Final = {dtype: rank for rank, dtype in enumerate(_SAFETENSORS_DTYPES)}

SafetensorsPlan = Sequence[tuple[str, torch.dtype, tuple[int, ...]]]


def safetensors_save_order(plan: SafetensorsPlan) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The plan in the order `safetensors.torch.save_file` lays tensors out (descending dtype alignment, then
    name). A `SafetensorsWriter` given this order writes the same bytes as `save_file` whenever the metadata
    has at most one key: `save_file` writes several keys in a random order (a Rust HashMap), we sort them."""
    for _, dtype, _ in plan:
        _safetensors_dtype(dtype)
    return sorted(plan, key=lambda entry: (-_SAFETENSORS_RANK[entry[1]], entry[0]))


def _safetensors_dtype(dtype: torch.dtype) -> str:
    try:
        return _SAFETENSORS_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype} for safetensors") from None


class SafetensorsWriter(Writer):
    """Streams a safetensors file whose header is written up front from a plan of (name, dtype, shape).

    Tensors are stored in plan order; any order is a valid file, and `safetensors_save_order(plan)` gives
    the order `save_file` uses. Use as a context manager so an exception removes the partial file.
    """

    def __init__(self, path: Path, plan: SafetensorsPlan, metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        header: dict[str, Any] = {}
        if metadata is not None:
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
                raise ValueError("safetensors metadata must map str to str")
            header["__metadata__"] = {key: metadata[key] for key in sorted(metadata)}
        offset = 0
        for name, dtype, shape in plan:
            shape = tuple(int(dim) for dim in shape)
            st_dtype = _safetensors_dtype(dtype)
            if name in header or name == "__metadata__":
                raise ValueError(f"{self.path}: duplicate or reserved tensor name {name!r}")
            if any(dim < 0 for dim in shape):
                raise ValueError(f"{self.path}: negative dimension in shape {shape} of {name!r}")
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            header[name] = {
                "dtype": st_dtype,
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            entries.append((name, dtype, shape))
            offset += nbytes
        encoded = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as the reference writer pads it
        self._plan = entries
        self._next = 0
        self._file: BinaryIO | None = open(self.path, "wb")  # noqa: SIM115 - closed by close()/abort()
        try:
            self._file.write(struct.pack("<Q", len(encoded)) + encoded)
        except BaseException:
            self.abort()
            raise

    def is_open(self) -> bool:
        return self._file is not None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Writes the next planned tensor's bytes now; name, dtype and shape must match the plan."""
        _, dtype, shape = self._expect(name)
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(
                f"{self.path}: {name!r} is {tensor.dtype} {tuple(tensor.shape)}, the plan says {dtype} {shape}"
            )
        self._write_pieces(name, [tensor], torch.Size(shape).numel())

    def add_pieces(self, name: str, pieces: Iterable[torch.Tensor]) -> None:
        """Writes the next planned tensor given as consecutive row-major pieces, each written as it comes."""
        _, dtype, shape = self._expect(name)

        def checked() -> Iterator[torch.Tensor]:
            for piece in pieces:
                if piece.dtype != dtype:
                    raise ValueError(f"{self.path}: a piece of {name!r} is {piece.dtype}, the plan says {dtype}")
                yield piece

        self._write_pieces(name, checked(), torch.Size(shape).numel())

    def add_ranges(self, name: str, ranges: Sequence[FileRange]) -> None:
        """Writes the next planned tensor as byte ranges of other files, copied by the kernel (as `cp` does)."""
        _, dtype, shape = self._expect(name)
        file = self._file
        assert file is not None
        expected = torch.Size(shape).numel() * dtype.itemsize
        try:
            if any(r.dtype != dtype for r in ranges) or sum(r.length for r in ranges) != expected:
                raise ValueError(f"{self.path}: the pieces of {name!r} do not add up to {dtype} {shape}")
            for chunk in range_chunks(ranges):
                file.write(chunk)
        except BaseException:
            self.abort()
            raise
        self._next += 1

    def _expect(self, name: str) -> tuple[str, torch.dtype, tuple[int, ...]]:
        if self._file is None:
            raise ValueError(f"{self.path}: writer is closed")
        if self._next >= len(self._plan):
            raise ValueError(f"{self.path}: {name!r} is not in the plan (all {len(self._plan)} tensors written)")
        expected = self._plan[self._next]
        if name != expected[0]:
            raise ValueError(f"{self.path}: expected {expected[0]!r} next (plan order), got {name!r}")
        return expected

    def _write_pieces(self, name: str, pieces: Iterable[torch.Tensor], numel: int) -> None:
        file = self._file
        assert file is not None
        written = 0
        try:
            for piece in pieces:
                written += piece.numel()
                for chunk in tensor_bytes(prepare_tensor(piece)):
                    file.write(chunk)
                    del chunk  # a view's copied piece must be freed before the next one is made
            if written != numel:
                raise ValueError(f"{self.path}: {name!r} got {written} elements, the plan says {numel}")
        except BaseException:
            self.abort()
            raise
        self._next += 1

    def close(self) -> None:
        """Finishes the file; raises `ValueError` (and removes the file) if planned tensors were not written."""
        if self._file is None:
            raise ValueError(f"{self.path}: writer is closed")
        if self._next != len(self._plan):
            missing = [name for name, _, _ in self._plan[self._next :]]
            self.abort()
            raise ValueError(f"{self.path}: {len(missing)} planned tensors were not written: {missing[:5]}")
        self._file.close()
        self._file = None

    def abort(self) -> None:
        """Closes and deletes the partial file."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self.path.unlink(missing_ok=True)
