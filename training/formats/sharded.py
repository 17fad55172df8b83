"""Sharded checkpoint directories: neuronx-distributed (NxD) and NeMo Megatron, one file per rank.

One module because reading and writing both formats share the rank-file naming, the inference of the
parallel degrees from the files, and the row-block streaming (pread row blocks, column merges written
block by block) that keeps memory flat whatever the model size. Tensor layouts come from
`training.formats.layouts`, file formats from `training.formats.torch_reader` and `training.formats.torch_writer`.
"""

from __future__ import annotations

import queue
import re
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import torch

from training.config.hardware import DEFAULT_GENERATION, GENERATIONS, Generation
from training.config.model import Format, ModelSpec, Parallelism, check_parallelism
from training.errors import UserError
from training.formats.distributed import is_distributed, write_nxd_view
from training.formats.hf import hf_names_in_order, read_config, state_dict_in
from training.formats.layouts import Chunk, Concatenate, Fuse, Rule, Unfuse, all_rules, hf_shapes
from training.formats.lazy import CheckpointError, FileRange, LazyTensor, lazy_tensors, read_into, release_mappings
from training.formats.torch_reader import open_checkpoint_file
from training.formats.torch_writer import TorchFileWriter, XserWriter
from training.outputs import MANIFEST, read_manifest

# Where an NxD checkpoint records the Trainium generation its K/V layout is for: the converter's manifest, or the
# training checkpoint's user_content.pt (beside step and data position). Neither: an older trn1 checkpoint.
GENERATION_KEY = "generation"
USER_CONTENT = "user_content.pt"
NEMO_CHECKPOINT_META = {"pytorch-lightning_version": "1.9.5", "epoch": 0, "global_step": 0}
NXD_FILE = re.compile(r"^dp_rank_(\d+)_tp_rank_(\d+)_pp_rank_(\d+)\.pt$")
NEMO_DIR = re.compile(r"^(?:tp_rank_(\d+)_pp_rank_(\d+)|mp_rank_(\d+))$")
STEP_DIR = re.compile(r"^step_(\d+)$")


def recorded_generation(directory: Path) -> Generation | None:
    """The generation an NxD checkpoint directory records (the module's GENERATION_KEY note); None if none."""
    recorded: Any = None
    if (directory / MANIFEST).is_file():
        manifest = read_manifest(directory)
        if manifest is None:
            raise UserError(f"{directory / MANIFEST}: not JSON; allowed: the converter's manifest")
        recorded = manifest.get(GENERATION_KEY)
    elif (directory / USER_CONTENT).is_file():
        content = open_checkpoint_file(directory / USER_CONTENT)
        recorded = content.get(GENERATION_KEY) if isinstance(content, dict) else None
    if recorded is not None and recorded not in GENERATIONS:
        raise UserError(f"{directory}: records generation {recorded!r}; allowed: {', '.join(GENERATIONS)}")
    return cast("Generation | None", recorded)


def nxd_rank_file(directory: Path, tp: int, pp: int) -> Path:
    return directory / "model" / f"dp_rank_00_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"


def nemo_rank_file(directory: Path, tp: int, pp: int, pipeline: int) -> Path:
    folder = f"tp_rank_{tp:02d}_pp_rank_{pp:03d}" if pipeline > 1 else f"mp_rank_{tp:02d}"
    return directory / folder / "model_optim_rng.ckpt"


def _holds_weights(directory: Path) -> bool:
    """NxD rank files, or a torch-native Distributed Checkpoint (`training.formats.distributed`)."""
    return (directory / "model").is_dir() or (directory / "dcp" / ".metadata").is_file()


def resolve_nxd_directory(directory: Path, *, force: bool) -> Path:
    """A directory holding `model/`: given directly, a `step_N` of a training run, or the run's root."""
    if not directory.is_dir():
        raise UserError(f"{directory}: no such directory")
    if STEP_DIR.match(directory.name) and not (directory / "done").exists() and not force:
        raise UserError(
            f"{directory}: checkpoint has no 'done' marker (incomplete save?); pass --force to read it anyway"
        )
    if _holds_weights(directory):
        return directory
    steps = sorted(
        (int(m.group(1)), p) for p in directory.iterdir() if (m := STEP_DIR.match(p.name)) and _holds_weights(p)
    )
    complete = [p for _, p in steps if (p / "done").exists() or force]
    if complete:
        return complete[-1]
    if steps:
        raise UserError(
            f"{directory}: no step_N checkpoint has a 'done' marker; pass --force to read the latest anyway"
        )
    raise UserError(f"{directory}: no NxD checkpoint (expected model/dp_rank_*_tp_rank_*_pp_rank_*.pt)")


class ShardedSource:
    """An NxD or NeMo checkpoint; degrees and QKV options are inferred from the files."""

    def __init__(
        self,
        layout: Format,
        directory: Path,
        config_override: Path | None,
        *,
        force: bool,
        check_shapes: bool = True,
        generation: Generation | None = None,
    ) -> None:
        """`check_shapes=False` is for a reader that checks every tensor's shape itself (the training loader):
        the check works the shapes out on meta tensors, whose first use imports parts of torch (seconds).
        `generation`: what an NxD checkpoint that records none was written for (default trn1); one that records
        its generation is refused another."""
        self.layout = layout
        self.generation = generation
        self.directory = resolve_nxd_directory(directory, force=force) if layout == "nxd" else directory
        self._view: tempfile.TemporaryDirectory[str] | None = None
        if layout == "nxd" and is_distributed(self.directory):  # a torch-native checkpoint: its NxD rank files
            self._view = tempfile.TemporaryDirectory(prefix="nxd-view-")
            if config_override is None and not (self.directory / "config.json").is_file():
                raise UserError(f"{self.directory}: a training checkpoint holds no config.json; pass --config")
            self.directory = write_nxd_view(self.directory, Path(self._view.name))
        if layout == "nemo" and not directory.is_dir():
            raise UserError(f"{directory}: no such directory")
        self.config, self.config_path = read_config(self.directory, config_override)
        self.spec = ModelSpec.from_config(self.config, str(self.config_path))
        files = self._rank_files()
        first = self._tensors_in(files[(0, 0)])
        self.parallelism = self._infer_parallelism(files, first)
        check_parallelism(self.spec, self.parallelism, layout)
        self.ranks: dict[tuple[int, int], dict[str, LazyTensor]] = {
            rank: first if rank == (0, 0) else self._tensors_in(file) for rank, file in files.items()
        }
        self.groups = all_rules(self.spec, self.parallelism, layout)
        if check_shapes:
            self._check_shards(files)

    def _check_shards(self, files: dict[tuple[int, int], Path]) -> None:
        """Every rank's tensor has the shape this model's layout gives it and one dtype across ranks: a
        shard of another shape would be cut into wrong rows, or stop a write halfway with a traceback."""
        shapes = hf_shapes(self.spec)
        # Every layer is cut alike: the shapes are worked out (on meta tensors) once per kind of tensor and rank.
        known: dict[tuple[str, int], list[int]] = {}
        for rules in self.groups:
            for rule in rules:
                sources = [torch.empty(shapes[name], device="meta") for name in rule.sources]
                kind = re.sub(r"\d+", "#", rule.target) + repr([shapes[name] for name in rule.sources])
                dtypes = set()
                for tp in range(self.parallelism.tp):
                    file = files[(tp, rule.stage)]
                    tensor = self.ranks[(tp, rule.stage)].get(rule.target)
                    if tensor is None:
                        raise UserError(f"{file}: tensor {rule.target}: missing; this model's layout needs it")
                    if (kind, tp) not in known:
                        known[(kind, tp)] = list(rule.split(sources, tp).shape)
                    expected = known[(kind, tp)]
                    if list(tensor.shape) != expected:
                        raise UserError(
                            f"{file}: tensor {rule.target}: shape {list(tensor.shape)} is not allowed; allowed: "
                            f"{expected} (this model's tp {tp} shard at {self.parallelism.tp}-way tensor parallelism)"
                        )
                    dtypes.add(tensor.dtype)
                if len(dtypes) > 1:
                    listing = ", ".join(sorted(str(dtype) for dtype in dtypes))
                    raise UserError(f"{self.directory}: {rule.target} has different dtypes across ranks ({listing})")

    def _tensors_in(self, file: Path) -> dict[str, LazyTensor]:
        """A rank file's tensors by name, read by the safe unpickler; a file without a state dict is refused."""
        root = open_checkpoint_file(file)
        if self.layout == "nemo" and isinstance(root, dict) and "state_dict" in root:
            root = root["state_dict"]
        return dict(lazy_tensors(state_dict_in(root, file)))

    def _rank_files(self) -> dict[tuple[int, int], Path]:
        files: dict[tuple[int, int], Path] = {}
        if self.layout == "nxd":
            for path in sorted((self.directory / "model").glob("*.pt")):
                if (match := NXD_FILE.match(path.name)) and int(match.group(1)) == 0:
                    files[(int(match.group(2)), int(match.group(3)))] = path
        else:
            for folder in sorted(p for p in self.directory.iterdir() if p.is_dir()):
                if not (match := NEMO_DIR.match(folder.name)):
                    continue
                tp = int(match.group(1) if match.group(1) is not None else match.group(3))
                pp = int(match.group(2) or 0)
                files[(tp, pp)] = _nemo_checkpoint_in(folder)
        if not files:
            expected = (
                "model/dp_rank_00_tp_rank_*_pp_rank_*.pt"
                if self.layout == "nxd"
                else "tp_rank_*_pp_rank_*/ or mp_rank_*/"
            )
            raise UserError(f"{self.directory}: no {self.layout} checkpoint files ({expected})")
        tps = 1 + max(tp for tp, _ in files)
        pps = 1 + max(pp for _, pp in files)
        absent = [f"tp {tp} pp {pp}" for pp in range(pps) for tp in range(tps) if (tp, pp) not in files]
        if absent:
            raise UserError(f"{self.directory}: rank files missing for {', '.join(absent[:4])}")
        return files

    def _infer_parallelism(self, files: dict[tuple[int, int], Path], first: dict[str, LazyTensor]) -> Parallelism:
        tp = 1 + max(t for t, _ in files)
        pp = 1 + max(p for _, p in files)
        if self.layout == "nemo":
            return Parallelism(tp=tp, pp=pp)
        prefix = "model.layers.0.self_attn.qkv_proj."
        fuse = f"{prefix}weight_qkv" in first
        if fuse:
            q_rows = self.spec.num_heads * self.spec.head_dim // tp
            kv_rows = ((first[f"{prefix}weight_qkv"].shape or (0,))[0] - q_rows) // 2
        elif f"{prefix}weight_k" in first:
            kv_rows = (first[f"{prefix}weight_k"].shape or (0,))[0]  # a 0-d tensor: refused by the shape check
        else:
            raise UserError(f"{files[(0, 0)]}: no {prefix}weight_k or weight_qkv; not an NxD Llama/Mixtral checkpoint")
        multiplier = max(kv_rows * tp // (self.spec.num_kv_heads * self.spec.head_dim), 1)
        recorded = recorded_generation(self.directory)
        if recorded is not None and self.generation not in (None, recorded) and multiplier > 1:
            raise UserError(
                f"--target {self.generation}: {self.directory} was written for {recorded} (its K/V replicas are "
                f"laid out for it); convert it to hf, then to nxd with --target {self.generation}"
            )
        generation = recorded or self.generation or DEFAULT_GENERATION
        return Parallelism(tp=tp, pp=pp, kv_multiplier=multiplier, fuse_qkv=fuse, generation=generation)

    def _shards(self, rule: Rule) -> list[LazyTensor]:
        shards = []
        for tp in range(self.parallelism.tp):
            tensor = self.ranks[(tp, rule.stage)].get(rule.target)
            if tensor is None:
                raise UserError(f"{self.directory}: rank tp {tp} pp {rule.stage} has no {rule.target}")
            shards.append(tensor)
        return shards

    def plan(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        shapes = hf_shapes(self.spec)
        dtypes: dict[str, torch.dtype] = {}
        for rules in self.groups:
            for rule in rules:
                dtype = self._shards(rule)[0].dtype
                dtypes |= dict.fromkeys(rule.sources, dtype)
        return [
            (name, dtypes[name], shapes[name]) for name in hf_names_in_order(self.spec, self.groups) if name in shapes
        ]

    def read_ranges(self, rule: Rule) -> dict[str, list[FileRange]] | None:
        """For merges that concatenate along dim 0: each Hugging Face tensor as byte ranges of the rank files.

        Such a tensor is the rank pieces' bytes one after the other, so it can be copied file to file
        by the kernel, as `cp` does, without passing through this process. None for other merges.
        """
        merge, shards = rule.merge, self._shards(rule)
        if isinstance(merge, Concatenate) and merge.dim == 0:
            parts: list[tuple[int, int]] = [(0, shards[0].shape[0] if shards[0].shape else 0)]
        elif (
            isinstance(merge, Unfuse)
            and merge.dim == 0
            and all(isinstance(part, Concatenate) and part.dim == 0 for part in merge.parts)
        ):
            starts = [sum(merge.sizes[:k]) for k in range(len(merge.sizes))]
            parts = list(zip(starts, merge.sizes, strict=True))
        else:
            return None
        ranges: dict[str, list[FileRange]] = {name: [] for name in rule.sources}
        for shard in shards:
            for name, (start, count) in zip(rule.sources, parts, strict=True):
                piece = shard.row_range(start, count)
                if piece is None:
                    return None
                ranges[name].append(piece)
        return ranges

    def read_column_blocks(self, rule: Rule) -> Iterator[torch.Tensor] | None:
        """For a merge that concatenates one tensor along dim 1: the result in row blocks, else None."""
        merge, shards = rule.merge, self._shards(rule)
        if not (isinstance(merge, Concatenate) and merge.dim == 1 and len(rule.sources) == 1):
            return None
        if not all(plainly_stored_matrix(shard) and shard.shape[0] == shards[0].shape[0] for shard in shards):
            return None
        return column_merged_blocks(shards, ROW_BLOCK_BYTES)

    def read(self, rules: Sequence[Rule]) -> dict[str, torch.Tensor]:
        result: dict[str, torch.Tensor] = {}
        for rule in rules:
            try:
                merged = streamed_merge(rule.merge, self._shards(rule)) or rule.merge(
                    [s.load() for s in self._shards(rule)]
                )
            except CheckpointError as error:
                raise UserError(str(error)) from None
            result |= dict(zip(rule.sources, merged, strict=True))
            release_mappings()  # merged tensors are copies; the shards' pages can go
        return result


ROW_BLOCK_BYTES = 8 << 20


def row_blocks(tensor: torch.Tensor, max_bytes: int, after_each: Callable[[], None]) -> Iterator[torch.Tensor]:
    """A tensor in row blocks of about `max_bytes`, calling `after_each` once a block has been used.

    A shard cut from a mapped file along dim 1 touches the source's pages row by row; writing it in
    blocks and dropping the pages after each keeps only one block's pages resident.
    """
    if tensor.dim() == 0 or tensor.shape[0] == 0:
        yield tensor.reshape(-1)
        after_each()
        return
    # A view's rows are spread over stride(0) elements of its source: that span is what gets touched.
    row_bytes = max(1, tensor[0].numel(), abs(tensor.stride(0))) * tensor.element_size()
    step = max(1, max_bytes // row_bytes)
    for start in range(0, tensor.shape[0], step):
        yield tensor[start : start + step]
        after_each()


class RowReader:
    """Reads row blocks of plainly stored 2-d tensors with pread into two reused buffers.

    Cutting columns from a file mapping faults every page in once per reader and rank; reading each row
    block once into memory that is already resident costs one copy and no page faults. Two buffers let
    the next block be read while the previous one is still being written out.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._buffers: list[torch.Tensor] = []

    def rows_per_block(self, lazy: LazyTensor) -> int:
        return max(1, self.max_bytes // max(1, lazy.nbytes // max(1, lazy.shape[0])))

    def blocks(self, lazy: LazyTensor, step: int | None = None) -> Iterator[torch.Tensor]:
        """The rows of `lazy` in blocks of `step` rows; each block is valid until the next but one."""
        rows = lazy.shape[0]
        step = step or self.rows_per_block(lazy)
        row_bytes = lazy.nbytes // lazy.shape[0]
        if not self._buffers or self._buffers[0].numel() < step * row_bytes:
            self._buffers = [torch.empty(step * row_bytes, dtype=torch.uint8) for _ in range(2)]
        whole = lazy.row_range(0, rows)
        if whole is None:
            raise ValueError(f"{lazy.path}: tensor is not stored plainly")
        with whole.path.open("rb") as handle:
            for index, first in enumerate(range(0, rows, step)):
                block_rows = min(step, rows - first)
                buffer = self._buffers[index % 2][: block_rows * row_bytes]
                read_into(handle.fileno(), buffer, whole.offset + first * row_bytes, whole.path)
                yield buffer.view(lazy.dtype).view(block_rows, *lazy.shape[1:])


def plainly_stored_matrix(lazy: LazyTensor) -> bool:
    return len(lazy.shape) == 2 and lazy.shape[0] > 0 and lazy.row_range(0, lazy.shape[0]) is not None


def column_merged_blocks(shards: Sequence[LazyTensor], max_bytes: int) -> Iterator[torch.Tensor]:
    """Shards concatenated along dim 1, produced in row blocks of about `max_bytes`.

    Each block's rows are read from every shard with pread; the result is never whole in memory. Each
    block is valid until the next is requested.
    """
    readers = [RowReader(max(1, max_bytes // len(shards))) for _ in shards]
    step = min(reader.rows_per_block(shard) for reader, shard in zip(readers, shards, strict=True))
    streams = [reader.blocks(shard, step) for reader, shard in zip(readers, shards, strict=True)]
    rows, width = shards[0].shape[0], sum(shard.shape[1] for shard in shards)
    output = torch.empty(step * width, dtype=shards[0].dtype)
    for start in range(0, rows, step):
        block = output[: min(step, rows - start) * width].view(-1, width)
        column = 0
        for stream, shard in zip(streams, shards, strict=True):
            block[:, column : column + shard.shape[1]].copy_(next(stream))
            column += shard.shape[1]
        yield block


def split_ranges(split: Any, sources: Sequence[LazyTensor], rank: int) -> tuple[list[FileRange], int] | None:
    """(byte ranges, rows) of one rank's shard when it is rows of the sources stored plainly, else None."""
    if isinstance(split, Chunk) and split.dim == 0 and len(sources) == 1 and sources[0].shape:
        rows = sources[0].shape[0] // split.tp
        piece = sources[0].row_range(rank * rows, rows)
        return ([piece], rows) if piece is not None else None
    if isinstance(split, Fuse) and split.dim == 0:
        ranges: list[FileRange] = []
        total = 0
        for part, source in zip(split.parts, sources, strict=True):
            found = split_ranges(part, [source], rank)
            if found is None:
                return None
            ranges += found[0]
            total += found[1]
        return ranges, total
    return None


def streamed_merge(merge: Callable[..., list[torch.Tensor]], shards: Sequence[LazyTensor]) -> list[torch.Tensor] | None:
    """Concatenating merges done shard by shard into preallocated outputs, dropping each shard's pages.

    Holds the result and one shard instead of the result and all shards; None for other merges.
    """
    parts: tuple[Concatenate, ...]
    if isinstance(merge, Concatenate):
        parts, sizes, fused_dim = (merge,), None, 0
    elif isinstance(merge, Unfuse) and all(isinstance(part, Concatenate) for part in merge.parts):
        parts, sizes, fused_dim = tuple(cast(Concatenate, p) for p in merge.parts), list(merge.sizes), merge.dim
    else:
        return None
    outputs: list[torch.Tensor] = []
    for rank, lazy in enumerate(shards):
        shard = lazy.load()
        pieces = torch.split(shard, sizes, dim=fused_dim) if sizes else (shard,)
        if not outputs:
            for part, piece in zip(parts, pieces, strict=True):
                shape = list(piece.shape)
                shape[part.dim] *= len(shards)
                outputs.append(torch.empty(shape, dtype=piece.dtype))
        for part, piece, output in zip(parts, pieces, outputs, strict=True):
            size = piece.shape[part.dim]
            output.narrow(part.dim, rank * size, size).copy_(piece)
        del shard, pieces
        release_mappings()
    return outputs


def _nemo_checkpoint_in(folder: Path) -> Path:
    """`model_optim_rng.ckpt`, else the training checkpoint with the highest step in its name."""
    if (folder / "model_optim_rng.ckpt").is_file():
        return folder / "model_optim_rng.ckpt"
    candidates = sorted(
        folder.glob("*.ckpt"), key=lambda p: int(m.group(1)) if (m := re.search(r"step=(\d+)", p.name)) else -1
    )
    if not candidates:
        raise UserError(f"{folder}: no model_optim_rng.ckpt or *.ckpt")
    return candidates[-1]


class ShardedTarget:
    """Writes every rank's file at once, tensor by tensor: the working set is one tensor and its shards."""

    def __init__(
        self, layout: Format, directory: Path, spec: ModelSpec, parallelism: Parallelism, *, xser: bool, workers: int
    ) -> None:
        check_parallelism(spec, parallelism, layout)
        self.layout, self.parallelism = layout, parallelism
        writer_type: Callable[[Path], TorchFileWriter | XserWriter] = XserWriter if xser else TorchFileWriter
        self.writers: dict[tuple[int, int], TorchFileWriter | XserWriter] = {}
        for tp, pp in parallelism.ranks():
            path = (
                nxd_rank_file(directory, tp, pp)
                if layout == "nxd"
                else nemo_rank_file(directory, tp, pp, parallelism.pp)
            )
            path.parent.mkdir(parents=True, exist_ok=True)
            self.writers[(tp, pp)] = writer_type(path)
        self.pool = ThreadPoolExecutor(max_workers=workers)
        self.rank_pool: ThreadPoolExecutor | None = None  # one thread per rank, for write_rule_columns
        self.row_reader = RowReader(ROW_BLOCK_BYTES)

    def write_rule(self, rule: Rule, tensors: dict[str, torch.Tensor]) -> None:
        """Each rank's shard is cut and written by a worker thread (torch copies and file writes release the GIL)."""
        sources = [tensors[name] for name in rule.sources]
        if len({t.dtype for t in sources}) > 1:
            listing = ", ".join(f"{n} is {t.dtype}" for n, t in zip(rule.sources, sources, strict=True))
            raise UserError(f"{rule.target} needs one dtype but {listing}")

        def write_shard(tp: int) -> None:
            shard = rule.split(sources, tp)
            pieces = row_blocks(shard, ROW_BLOCK_BYTES, after_each=release_mappings)
            self.writers[(tp, rule.stage)].add_pieces(rule.target, pieces, shard.dtype, tuple(shard.shape))

        for job in [self.pool.submit(write_shard, tp) for tp in range(self.parallelism.tp)]:
            job.result()

    def write_rule_ranges(self, rule: Rule, sources: dict[str, LazyTensor]) -> bool:
        """Copy each rank's shard file to file when it is rows of the sources; False if it is not."""
        per_rank = [
            split_ranges(rule.split, [sources[name] for name in rule.sources], tp) for tp in range(self.parallelism.tp)
        ]
        if any(ranges is None for ranges in per_rank) or len({sources[name].dtype for name in rule.sources}) > 1:
            return False
        dtype = sources[rule.sources[0]].dtype
        row_shape = sources[rule.sources[0]].shape[1:]

        def write_shard(tp: int) -> None:
            shard_ranges, rows = cast(tuple[list[FileRange], int], per_rank[tp])
            self.writers[(tp, rule.stage)].add_ranges(rule.target, shard_ranges, dtype, (rows, *row_shape))

        for job in [self.pool.submit(write_shard, tp) for tp in range(self.parallelism.tp)]:
            job.result()
        return True

    def write_rule_columns(self, rule: Rule, sources: dict[str, LazyTensor]) -> bool:
        """Column-parallel shards (an even split on dim 1) from one pass over the source's rows.

        Each row block is read once and every rank, in its own thread, writes its columns of it; False
        for other rules or sources not stored plainly.
        """
        split, tp = rule.split, self.parallelism.tp
        if not (isinstance(split, Chunk) and split.dim == 1 and len(rule.sources) == 1):
            return False
        lazy = sources[rule.sources[0]]
        if not plainly_stored_matrix(lazy) or lazy.shape[1] % tp:
            return False
        rows, width = lazy.shape[0], lazy.shape[1] // tp
        feeds: list[queue.SimpleQueue[torch.Tensor | None]] = [queue.SimpleQueue() for _ in range(tp)]
        consumed = threading.Semaphore(0)

        def columns(rank: int) -> Iterator[torch.Tensor]:
            while (block := feeds[rank].get()) is not None:
                yield block[:, rank * width : (rank + 1) * width]
                consumed.release()  # asked for the next block: done with this one

        def write_shard(rank: int) -> None:
            self.writers[(rank, rule.stage)].add_pieces(rule.target, columns(rank), lazy.dtype, (rows, width))

        if self.rank_pool is None:
            self.rank_pool = ThreadPoolExecutor(max_workers=tp)
        jobs = [self.rank_pool.submit(write_shard, rank) for rank in range(tp)]

        def wait_for_ranks(count: int) -> None:
            for _ in range(count):
                while not consumed.acquire(timeout=0.1):
                    if failed := [job for job in jobs if job.done()]:
                        failed[0].result()  # raises the writer's error
                        raise RuntimeError(f"{rule.target}: a rank stopped before its last block")

        try:
            pending = 0
            for block in self.row_reader.blocks(lazy):  # reads the next block while ranks write this one
                wait_for_ranks(pending)
                for feed in feeds:
                    feed.put(block)
                pending = tp
            wait_for_ranks(pending)
        finally:
            for feed in feeds:
                feed.put(None)
        for job in jobs:
            job.result()
        return True

    def close(self) -> None:
        def wrap(state: dict[str, torch.Tensor]) -> object:
            return {"state_dict": state, **NEMO_CHECKPOINT_META} if self.layout == "nemo" else state

        for writer in self.writers.values():
            writer.close(wrap)
        self.pool.shutdown()
        if self.rank_pool is not None:
            self.rank_pool.shutdown()
