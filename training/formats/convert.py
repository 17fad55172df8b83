"""`python -m training convert`: Hugging Face <-> NxD / NeMo, streamed one layer at a time.

The converter never loads a whole model: each group (embedding, one layer, final norm and head) is
read, re-cut and written before the next is touched, and every rank's file is written at the same time.
With `--verify` the output is read back, converted back to Hugging Face tensors and compared with the
input's SHA-256 checksums, shapes and dtypes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import hashlib
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from training.config.hardware import DEFAULT_GENERATION, Generation
from training.config.loading import not_allowed
from training.config.model import Parallelism, check_parallelism, default_kv_multiplier
from training.errors import UserError
from training.formats.hf import HfSource, HfTarget, Source, copy_companions
from training.formats.layouts import Rule, all_rules
from training.formats.lazy import nbytes, release_mappings
from training.formats.sharded import GENERATION_KEY, ShardedSource, ShardedTarget
from training.logs import Progress
from training.outputs import atomic_directory, files_fingerprint, reusable, write_manifest

M_MMAP_THRESHOLD = -3  # mallopt parameter, from glibc's malloc.h
CheckpointFormat = Literal["hf", "nxd", "nemo"]
FORMATS: tuple[CheckpointFormat, ...] = ("hf", "nxd", "nemo")


@dataclass(frozen=True)
class ConvertOptions:
    source_format: CheckpointFormat
    target_format: CheckpointFormat
    input: Path
    output: Path
    tp: int | None = None
    pp: int = 1
    kv_multiplier: int | None = None
    fuse_qkv: bool = False
    target: Generation | None = None  # the nxd side's Trainium generation (its K/V layout); default trn1
    xser: bool = False
    config: Path | None = None
    force: bool = False
    overwrite: bool = False
    verify: bool = False
    max_shard_bytes: int = 2 * 10**9
    workers: int = min(8, os.cpu_count() or 1)


def check_options(options: ConvertOptions) -> None:
    """Refuse degrees, sizes and counts that can never work before any file is read (a zero would otherwise
    surface as a division by zero, or as an output of no shards)."""
    ranges = (
        ("--tp", options.tp, True),
        ("--pp", options.pp, False),
        ("--kv-size-multiplier", options.kv_multiplier, True),
        ("--workers", options.workers, False),
    )
    for flag, value, optional in ranges:
        if value is None and optional:
            continue
        if type(value) is not int or value < 1:
            raise UserError(not_allowed(flag, value, "an integer of at least 1"))
    if type(options.max_shard_bytes) is not int or options.max_shard_bytes < 1:
        raise UserError(not_allowed("--max-shard-size", options.max_shard_bytes, "at least 1 byte, e.g. 500MB or 5GB"))


def convert(options: ConvertOptions) -> dict[str, Any]:
    """Convert a checkpoint; returns the manifest written beside the output."""
    check_options(options)
    return_freed_memory_to_the_system()
    if options.source_format == options.target_format:
        raise UserError(f"--from and --to are both {options.source_format}; nothing to convert")
    if "hf" not in (options.source_format, options.target_format):
        raise UserError("one side must be hf (convert nxd <-> nemo through hf)")
    source = open_source(options.source_format, options.input, options.config, options)
    parallelism = target_parallelism(options, source)
    check_parallelism(source.spec, parallelism, _layout(options, source))
    groups = all_rules(source.spec, parallelism, _layout(options, source))
    fingerprint = {
        "from": options.source_format,
        "to": options.target_format,
        "input": _fingerprint_files(source.directory),
        "parallelism": parallelism.__dict__ if options.target_format != "hf" else None,
        "xser": options.xser,
        "max_shard_bytes": options.max_shard_bytes if options.target_format == "hf" else None,
    }
    if (manifest := reusable(options.output, fingerprint, overwrite=options.overwrite)) is not None:
        return {**manifest, "reused": True}

    started = time.monotonic()
    plan = source.plan()
    hf_names = {name for name, _, _ in plan}
    with atomic_directory(options.output, overwrite=options.overwrite) as output:
        target: HfTarget | ShardedTarget
        if options.target_format == "hf":
            target = HfTarget(
                output, plan, [rule.sources for rules in groups for rule in rules], options.max_shard_bytes
            )
        else:
            target = ShardedTarget(
                options.target_format, output, source.spec, parallelism, xser=options.xser, workers=options.workers
            )
        progress = Progress(f"{options.source_format} -> {options.target_format}", "layers", total=len(groups))
        if isinstance(target, HfTarget):
            checksums = write_hf(
                groups, source, target, hf_names, verify=options.verify, workers=options.workers, progress=progress
            )
        else:
            checksums = write_sharded(groups, source, target, hf_names, verify=options.verify, progress=progress)
        progress.close()
        target.close()
        companions = copy_companions(source.directory, source.config_path, output)
        verified = verify(options.target_format, output, checksums, options) if options.verify else None
        manifest = {
            "kind": "convert",
            "fingerprint": fingerprint,
            "from": options.source_format,
            "to": options.target_format,
            "input": str(options.input),
            "architecture": source.spec.architecture,
            "parallelism": {
                "tp": parallelism.tp,
                "pp": parallelism.pp,
                "kv_size_multiplier": parallelism.kv_multiplier,
                "fuse_qkv": parallelism.fuse_qkv,
            },
            GENERATION_KEY: parallelism.generation if options.target_format == "nxd" else None,
            "xser": options.xser,
            "tensors": len(plan),
            "bytes": sum(nbytes(dtype, shape) for _, dtype, shape in plan),
            "companion_files": companions,
            "verified_tensors": verified,
            "elapsed_seconds": round(time.monotonic() - started, 3),
        }
        write_manifest(output, manifest)
    return manifest


def return_freed_memory_to_the_system() -> None:
    """Serve large allocations from mmap so freed shards leave the process (glibc only; else no-op).

    glibc raises its mmap threshold after large frees, after which freed shard buffers stay in the heap
    and the resident set grows layer after layer although nothing is alive.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):
        pass


def open_source(fmt: CheckpointFormat, directory: Path, config: Path | None, options: ConvertOptions) -> Source:
    if not directory.exists():
        raise UserError(f"--input {directory}: no such directory")
    if fmt == "hf":
        return HfSource(directory, config)
    return ShardedSource(fmt, directory, config, force=options.force, generation=options.target)


def target_parallelism(options: ConvertOptions, source: Source) -> Parallelism:
    """The layout to write (to nxd/nemo), or the one read (from nxd/nemo)."""
    if isinstance(source, ShardedSource):
        return source.parallelism  # its generation: the one it records, else --target's
    if options.tp is None:
        raise UserError(f"--tp is required when converting to {options.target_format}")
    multiplier = 1
    if options.target_format == "nxd":
        multiplier = options.kv_multiplier or default_kv_multiplier(source.spec, options.tp)
    generation = options.target or DEFAULT_GENERATION
    return Parallelism(options.tp, options.pp, multiplier, options.fuse_qkv, generation)


def write_hf(
    groups: Sequence[Sequence[Rule]],
    source: Source,
    target: HfTarget,
    hf_names: set[str],
    *,
    verify: bool,
    workers: int,
    progress: Progress,
) -> dict[str, str]:
    """Every rule, the rules of each output file in order, files in parallel; checksums if verifying."""
    per_file: dict[int, list[Rule]] = {}
    last_rule_of_group = {id(rules[-1]): rules for rules in groups}
    assigned: set[str] = set()  # a tied LM head's rule names the embedding a second time
    for rules in groups:
        for rule in rules:
            names = [name for name in rule.sources if name in hf_names and name not in assigned]
            if names:
                assigned.update(names)
                per_file.setdefault(target.location[names[0]], []).append(rule)
    checksums: dict[str, str] = {}
    lock = threading.Lock()

    def write_file(rules: list[Rule]) -> None:
        for rule in rules:
            found = write_hf_rule(rule, source, target, hf_names, verify)
            release_mappings()
            with lock:
                checksums.update(found)
                if id(rule) in last_rule_of_group:
                    progress.update(1)

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(per_file)))) as pool:
        for job in [pool.submit(write_file, rules) for rules in per_file.values()]:
            job.result()
    return checksums


def write_sharded(
    groups: Sequence[Sequence[Rule]],
    source: Source,
    target: ShardedTarget,
    hf_names: set[str],
    *,
    verify: bool,
    progress: Progress,
) -> dict[str, str]:
    """Every rule in order into the rank files; from Hugging Face files, plain rows and column blocks are
    copied without loading the tensor (unless verifying). Returns the checksums if verifying."""
    checksums: dict[str, str] = {}
    for rules in groups:
        for rule in rules:
            if not (
                isinstance(source, HfSource)
                and not verify
                and (
                    target.write_rule_ranges(rule, source.lazy(rule))
                    or target.write_rule_columns(rule, source.lazy(rule))
                )
            ):
                tensors = source.read([rule])
                if verify:
                    checksums |= {name: tensor_sha256(t) for name, t in tensors.items() if name in hf_names}
                target.write_rule(rule, tensors)
                del tensors
            release_mappings()
        progress.update(1)
    return checksums


def write_hf_rule(rule: Rule, source: Source, target: HfTarget, hf_names: set[str], verify: bool) -> dict[str, str]:
    """A rule's Hugging Face tensors (their checksums if verifying); plain concatenations streamed, not loaded."""
    ranges = source.read_ranges(rule) if isinstance(source, ShardedSource) and not verify else None
    if ranges is not None:
        for name in rule.sources:
            if name in hf_names:
                target.write_ranges(name, ranges[name])
        return {}
    blocks = source.read_column_blocks(rule) if isinstance(source, ShardedSource) and not verify else None
    if blocks is not None:
        if rule.sources[0] in hf_names:
            target.write_pieces(rule.sources[0], blocks)
        return {}
    tensors = {name: tensor for name, tensor in source.read([rule]).items() if name in hf_names}
    target.write(tensors)
    return {name: tensor_sha256(t) for name, t in tensors.items()} if verify else {}


def verify(fmt: CheckpointFormat, output: Path, checksums: dict[str, str], options: ConvertOptions) -> int:
    """Read the output back as a source and compare every Hugging Face tensor with the input's checksum (before
    the manifest that records an nxd output's generation is written: the options tell it)."""
    written = open_source(fmt, output, options.config, dataclasses.replace(options, force=True))
    plan = {name: (dtype, shape) for name, dtype, shape in written.plan()}
    groups: Sequence[Sequence[Rule]] = (
        written.groups if isinstance(written, ShardedSource) else all_rules(written.spec, Parallelism(), "nxd")
    )
    checked = 0
    for rules in groups:
        for name, tensor in written.read(rules).items():
            if name not in checksums:
                continue
            if (tensor.dtype, tuple(tensor.shape)) != plan[name] or tensor_sha256(tensor) != checksums[name]:
                raise UserError(f"verification failed: {name} differs from the input after conversion")
            checked += 1
    missing = set(checksums) - {n for n in plan}
    if missing:
        raise UserError(f"verification failed: output lacks {', '.join(sorted(missing)[:3])}")
    return checked


def tensor_sha256(tensor: torch.Tensor) -> str:
    data = tensor.contiguous().view(torch.uint8) if tensor.dim() else tensor.reshape(1).view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def _layout(options: ConvertOptions, source: Source) -> Literal["nxd", "nemo"]:
    if isinstance(source, ShardedSource):
        return source.layout
    return "nemo" if options.target_format == "nemo" else "nxd"


def _fingerprint_files(directory: Path) -> dict[str, Any]:
    return files_fingerprint(directory, sorted(p.relative_to(directory) for p in directory.rglob("*") if p.is_file()))
