"""Reading safetensors files lazily: the header checked as the format requires, each tensor a `LazyTensor`.

A header that lies would otherwise make the converter copy the wrong bytes as weights and succeed, so
every entry and the whole layout are checked before any tensor is read.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import torch

from training.formats.lazy import INT64_MAX, CheckpointError, LazyTensor, contiguous_stride, shown, shown_name

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


# The reference implementation refuses headers larger than this; so does this reader (no 2**64-byte reads).
SAFETENSORS_MAX_HEADER = 100_000_000
SAFETENSORS_ENTRY_KEYS = ("dtype", "shape", "data_offsets")


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
        tensors[name] = LazyTensor(path, start + begin, end - begin, dtype, shape_tuple, contiguous_stride(shape_tuple))
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
