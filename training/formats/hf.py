"""Hugging Face checkpoint directories: config.json with safetensors, .bin or .pt weights.

A source yields Hugging Face tensors group by group (embedding, each layer, final norm and head), a target
consumes them in the same order; `training.formats.convert` streams one into the other. `Source` is the
protocol every source follows: this module's and the sharded ones of `training.formats.sharded`.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

import torch

from training.config.model import ModelSpec
from training.errors import UserError
from training.formats.layouts import Rule, hf_shapes
from training.formats.lazy import FileRange, LazyTensor, lazy_tensors, nbytes, shown, shown_name
from training.formats.safetensors_reader import open_safetensors
from training.formats.safetensors_writer import SafetensorsWriter
from training.formats.torch_reader import Opaque, open_torch_file

CONFIG = "config.json"
# Copied beside converted weights so the output is usable on its own (transformers, the reverse direction).
COMPANION_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
)
# Buffers some old Hugging Face checkpoints carry; recomputed by every model, never converted.
IGNORED_HF_TENSORS = re.compile(r".*\.rotary_emb\.inv_freq$")


class Source(Protocol):
    spec: ModelSpec
    directory: Path
    config_path: Path

    def plan(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]: ...

    def read(self, rules: Sequence[Rule]) -> dict[str, torch.Tensor]: ...


def read_config(directory: Path, override: Path | None) -> tuple[dict[str, Any], Path]:
    """The model's config.json: `--config` if given, else beside the weights (or one or two levels up).

    Checked before it is returned (a JSON object whose model type and sizes `ModelSpec` accepts), so every
    caller's problems name this file and the key.
    """
    candidates = (
        [override] if override else [directory / CONFIG, directory.parent / CONFIG, directory.parent.parent / CONFIG]
    )
    for candidate in candidates:
        if candidate and candidate.is_file():
            config = read_json_object(candidate)
            ModelSpec.from_config(config, str(candidate))
            return config, candidate
    where = override if override else directory / CONFIG
    raise UserError(
        f"{where}: missing; the model's config.json is required (pass --config for checkpoints without one)"
    )


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file whose top level is an object; anything else is one line naming the file."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as error:
        raise UserError(
            f"{path}: not UTF-8 text ({error.reason} at byte {error.start}); allowed: a UTF-8 JSON file"
        ) from None
    except json.JSONDecodeError as error:
        raise UserError(f"{path}: not valid JSON ({error.msg}, line {error.lineno} column {error.colno})") from None
    except (ValueError, RecursionError):  # numbers too long to convert, nesting too deep
        raise UserError(f"{path}: not valid JSON") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: top level is a JSON {type(data).__name__}; allowed: a JSON object")
    return data


def read_weight_map(index_path: Path) -> dict[str, str]:
    """An index file's tensor -> shard map, refused unless every shard is a plain relative path inside the
    checkpoint's directory: a name such as `../x` or `/etc/x` would read files the checkpoint does not own."""
    index = read_json_object(index_path)
    if "weight_map" not in index:
        raise UserError(f"{index_path}: weight_map: required key is missing")
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict):
        raise UserError(
            f"{index_path}: weight_map: {shown(weight_map)} is not allowed; allowed: a map of tensor names to "
            "shard file names"
        )
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise UserError(
                f"{index_path}: weight_map: {shown_name(name)}: {shown(file)} is not allowed; allowed: a shard file "
                "name (a string)"
            )
        parts = PurePosixPath(file).parts
        if not parts or PurePosixPath(file).is_absolute() or ".." in parts:
            raise UserError(
                f"{index_path}: weight_map: {shown_name(name)}: {shown(file, 300)} is not allowed; allowed: a file "
                f"inside {index_path.parent} (a relative path without '..')"
            )
    return weight_map


def hf_names_in_order(spec: ModelSpec, groups: Sequence[Sequence[Rule]]) -> list[str]:
    """Hugging Face names in streaming order, each once (a tied head reuses the embedding)."""
    seen: dict[str, None] = {}
    for rules in groups:
        for rule in rules:
            seen.update(dict.fromkeys(rule.sources))
    return list(seen)


def state_dict_in(root: Any, path: Path) -> dict[Any, Any]:
    """The dict of tensors a torch.save file holds; any other top level (a stand-in for a class the safe
    unpickler did not load, a bare tensor, a list) is refused by name of the file."""
    if not isinstance(root, dict):
        kind = "an object of a class that is not loaded" if isinstance(root, Opaque) else f"a {type(root).__name__}"
        raise UserError(
            f"{path}: holds {kind} at its top level; allowed: a torch.save file of a dict of tensors (a state dict)"
        )
    return root


# --- Hugging Face ------------------------------------------------------------------------------------------


class HfSource:
    """config.json plus safetensors (single or sharded), pytorch_model*.bin, or one consolidated .pt."""

    def __init__(self, directory: Path, config_override: Path | None) -> None:
        self.directory = directory
        self.config, self.config_path = read_config(directory, config_override)
        self.spec = ModelSpec.from_config(self.config, str(self.config_path))
        self.tensors = self._open_weights()
        shapes = hf_shapes(self.spec)
        missing = [name for name in shapes if name not in self.tensors]
        if missing:
            raise UserError(f"{directory}: missing tensors for this config, e.g. {', '.join(missing[:3])}")
        for name, shape in shapes.items():
            if self.tensors[name].shape != shape:
                raise UserError(
                    f"{directory}: {name} has shape {list(self.tensors[name].shape)}, config.json implies {list(shape)}"
                )
        self.unexpected = sorted(n for n in self.tensors if n not in shapes and not IGNORED_HF_TENSORS.match(n))
        if self.unexpected:
            raise UserError(f"{directory}: tensors this converter does not know, e.g. {', '.join(self.unexpected[:3])}")

    def _open_weights(self) -> dict[str, LazyTensor]:
        d = self.directory
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index_path = d / index_name
            if index_path.is_file():
                weight_map = read_weight_map(index_path)
                absent = sorted({f for f in weight_map.values() if not (d / f).is_file()})
                if absent:
                    shown_files = ", ".join(shown_name(f) for f in absent[:5]) + (", ..." if len(absent) > 5 else "")
                    raise UserError(f"{index_path}: names shard files that do not exist: {shown_files}")
                return self._open_files([d / f for f in sorted(set(weight_map.values()))])
        files = sorted(d.glob("*.safetensors")) or sorted(d.glob("pytorch_model*.bin")) or sorted(d.glob("*.pt"))
        if not files:
            raise UserError(f"{d}: no weights found (*.safetensors, pytorch_model*.bin or a consolidated .pt)")
        return self._open_files(files)

    @staticmethod
    def _open_files(files: Sequence[Path]) -> dict[str, LazyTensor]:
        """Every file's tensors; a name found in two files is refused (which one holds the weights?)."""
        tensors: dict[str, LazyTensor] = {}
        for file in files:
            if file.suffix == ".safetensors":
                found = open_safetensors(file)
            else:
                root = open_torch_file(file)
                state = root.get("state_dict", root) if isinstance(root, dict) else root
                found = dict(lazy_tensors(state_dict_in(state, file)))
            twice = sorted(found.keys() & tensors.keys())
            if twice:
                first = tensors[twice[0]].path
                raise UserError(f"{file}: tensor {shown_name(twice[0])} is also in {first}; allowed: each in one file")
            tensors |= found
        return tensors

    def plan(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return [(name, self.tensors[name].dtype, self.tensors[name].shape) for name in hf_shapes(self.spec)]

    def lazy(self, rule: Rule) -> dict[str, LazyTensor]:
        return {name: self.tensors[name] for name in rule.sources}

    def read(self, rules: Sequence[Rule]) -> dict[str, torch.Tensor]:
        names = dict.fromkeys(source for rule in rules for source in rule.sources)
        return {name: self.tensors[name].load() for name in names}


PlanEntry = tuple[str, torch.dtype, tuple[int, ...]]


class HfTarget:
    """Sharded safetensors with `model.safetensors.index.json`, config and tokenizer files beside them.

    Shards split only between rules, so one rule's tensors land in one file, and files can be written
    concurrently (one writer per file: the kernel serialises writes to a single file).
    """

    def __init__(
        self, directory: Path, plan: Sequence[PlanEntry], groups: Sequence[Sequence[str]], max_shard_bytes: int
    ) -> None:
        self.directory = directory
        self.shards = split_plan(plan, groups, max_shard_bytes)
        count = len(self.shards)
        self.files = [
            f"model-{i + 1:05d}-of-{count:05d}.safetensors" if count > 1 else "model.safetensors" for i in range(count)
        ]
        self.location = {name: index for index, shard in enumerate(self.shards) for name, _, _ in shard}
        self.total_bytes = sum(nbytes(dtype, shape) for _, dtype, shape in plan)
        self._writers: dict[int, SafetensorsWriter] = {}
        self._lock = threading.Lock()

    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            self._writer_for(name).add(name, tensor)

    def write_ranges(self, name: str, ranges: Sequence[FileRange]) -> None:
        self._writer_for(name).add_ranges(name, ranges)

    def write_pieces(self, name: str, pieces: Iterable[torch.Tensor]) -> None:
        self._writer_for(name).add_pieces(name, pieces)

    def _writer_for(self, name: str) -> SafetensorsWriter:
        index = self.location[name]
        with self._lock:
            if index not in self._writers:
                path = self.directory / self.files[index]
                self._writers[index] = SafetensorsWriter(path, self.shards[index], metadata={"format": "pt"})
            return self._writers[index]

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        if len(self.files) > 1:
            index = {
                "metadata": {"total_size": self.total_bytes},
                "weight_map": {name: self.files[i] for name, i in sorted(self.location.items())},
            }
            (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def split_plan(plan: Sequence[PlanEntry], groups: Sequence[Sequence[str]], max_bytes: int) -> list[list[PlanEntry]]:
    """The fewest files of at most `max_bytes` (one rule may exceed it alone), balanced in size, cut only
    between groups (the tensors of one rule)."""
    entries = {entry[0]: entry for entry in plan}
    sized: list[tuple[list[PlanEntry], int]] = []
    seen: set[str] = set()
    for group in groups:
        members = [entries[name] for name in group if name in entries and name not in seen]
        seen.update(entry[0] for entry in members)
        if members:
            sized.append((members, sum(nbytes(dtype, shape) for _, dtype, shape in members)))
    total = sum(size for _, size in sized)
    count = max(1, -(-total // max_bytes))
    target = total / count
    shards: list[list[PlanEntry]] = [[]]
    size = 0
    for members, group_size in sized:
        # Start the next file when this group would end closer to the next file's share than to this one's.
        if shards[-1] and size + group_size / 2 > target and len(shards) < count:
            shards.append([])
            size = 0
        shards[-1] += members
        size += group_size
    return shards


def copy_companions(source: Path, config_path: Path, target: Path) -> list[str]:
    """config.json and the tokenizer/generation files beside the weights, so the output stands alone."""
    shutil.copyfile(config_path, target / CONFIG)
    copied = [CONFIG]
    for name in COMPANION_FILES:
        for folder in (source, config_path.parent):
            if (folder / name).is_file():
                shutil.copyfile(folder / name, target / name)
                copied.append(name)
                break
    return copied
