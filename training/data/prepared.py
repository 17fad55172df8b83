"""What `prepare pretrain` and `prepare sft` share: a prepared output's checks, fingerprint, save, digest and reuse,
and a mix's parts and manifest.

Every manifest records `data_sha256`, the digest of the prepared Arrow files (`data_sha256` below); a mix of one
source is the one-source path, with its fingerprint and its bytes (training.data.mixing mixes several).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from training.data.mixing import WEIGHTS_ARE, MixSource, MixStats, check_mix
from training.data.sources import Source
from training.data.tokenization import LoadedTokenizer
from training.errors import UserError
from training.outputs import MANIFEST, write_file


def data_sha256(directory: Path) -> str:
    """SHA-256 of a prepared output's content: every `.arrow` file under it in sorted relative-path order, each
    as its POSIX relative path, a NUL, its bytes. `save_to_disk`'s state.json is left out (it holds a random
    fingerprint, different on every save), as are the manifest and dataset_info.json (derived metadata)."""
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*.arrow"), key=lambda p: p.relative_to(directory).as_posix()):
        digest.update(path.relative_to(directory).as_posix().encode() + b"\0")
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def reused_manifest(out: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """A completed output's manifest; one written before manifests recorded `data_sha256` gains it (in one
    rename, so a reader sees the old manifest or the new one)."""
    if "data_sha256" not in manifest:
        manifest = {**manifest, "data_sha256": data_sha256(out)}
        write_file(out / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return {**manifest, "reused": True}


def mix_parts(mix_sources: tuple[MixSource, ...], limit: int | None, split: str, limit_flag: str) -> list[MixSource]:
    """The sources of a mix with the command's defaults filled in (empty for one source), checked."""
    if not mix_sources:
        return []
    parts = [
        replace(part, split=part.split or split, limit=part.limit if part.limit is not None else limit)
        for part in mix_sources
    ]
    check_mix(parts, limit_flag)
    return parts


def mix_fingerprint(parts: list[MixSource], sources: list[Source], limit_key: str) -> list[dict[str, Any]]:
    """A mix's part of the fingerprint: each source's own fingerprint, weight and limit, in order."""
    return [
        {"source": source.fingerprint(part.split or ""), "weight": part.weight, limit_key: part.limit}
        for part, source in zip(parts, sources, strict=True)
    ]


def described(single: str, parts: list[MixSource]) -> str:
    """The manifest's `source`: the one source, or a mix's sources in order."""
    return ", ".join(part.source for part in parts) if parts else single


def mix_manifest(
    parts: list[MixSource], sources: list[Source], stats: MixStats, seed: int, count_key: str, limit_key: str
) -> dict[str, Any]:
    """Per source what was asked (weight, limit) and what it gave (count, tokens, realised token share)."""
    total_weight = sum(part.weight for part in parts)
    assert stats.ended_by is not None  # a mix always ends at a source that ran out
    ended = parts[stats.ended_by]
    at_limit = ended.limit is not None and stats.items[stats.ended_by] == ended.limit
    return {
        "sources": [
            {
                "source": part.source,
                "split": part.split if not source.is_local else None,
                "weight": part.weight,
                "target_share": round(part.weight / total_weight, 6),
                limit_key: part.limit,
                count_key: count,
                "tokens": tokens,
                "token_share": round(share, 6),
            }
            for part, source, count, tokens, share in zip(
                parts, sources, stats.items, stats.tokens, stats.shares(), strict=True
            )
        ],
        "mix": {
            "seed": seed,
            "weights_are": WEIGHTS_ARE,
            "ended_by": ended.source,
            "end_reason": limit_key if at_limit else "exhausted",
        },
    }


# Far beyond any model's context (Llama 3.1: 131072 tokens); blocks are Arrow fixed-size lists (32-bit sizes).
MAX_SEQ_LEN = 1 << 20


def check_common(seq_len: int, num_proc: int, limit: int | None, limit_flag: str) -> None:
    """Refuse the settings both commands take before anything is read."""
    if seq_len < 2:
        raise UserError(f"--seq-len {seq_len}: must be at least 2")
    if seq_len > MAX_SEQ_LEN:
        raise UserError(f"--seq-len {seq_len}: is not allowed; allowed: 2 to {MAX_SEQ_LEN} tokens")
    if num_proc < 1:
        raise UserError(f"--num-proc {num_proc}: must be at least 1")
    if limit is not None and limit < 1:
        raise UserError(f"{limit_flag} {limit}: must be at least 1")


def fingerprint(
    kind: str, options: Any, source: Source, split: str, tokenizer: LoadedTokenizer, *, exclude: set[str]
) -> dict[str, Any]:
    """Everything that determines the output bytes (not, e.g., the thread count)."""
    settings = {k: v for k, v in asdict(options).items() if k not in exclude | {"source", "tokenizer", "out"}}
    return {
        "kind": kind,
        "settings": settings,
        "source": source.fingerprint(split),
        "tokenizer_sha256": tokenizer.sha256,
    }


def batches(values: Iterable[Any], size: int) -> Iterator[list[Any]]:
    """`values` in lists of `size` (the last one shorter)."""
    iterator = iter(values)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


def save_dataset(dataset: Any, output: Path) -> None:
    """`save_to_disk` into the temporary output directory (quietly: the run has its own progress bars)."""
    import datasets

    datasets.disable_progress_bars()
    try:
        dataset.save_to_disk(str(output), max_shard_size="500MB")
    finally:
        datasets.enable_progress_bars()
