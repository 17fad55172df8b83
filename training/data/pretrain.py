"""`prepare pretrain`: token blocks ready for training, written once, reused after.

Compared with the reference example (REFERENCE.md section 3): every document is framed as BOS ... EOS so the
model sees where documents end, the remainder of each batch carries over so only the final partial block of the
whole corpus is dropped, and `input_ids` are stored once as int32 (the loader derives labels). Tokenization runs
in the Rust tokenizer's thread pool (`--num-proc` threads) on batches in input order, so the output is identical
whatever the thread count. Several sources (`mix`) are interleaved document by document by token share and seed
(training.data.mixing).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from training.data.block_writer import BlockWriter
from training.data.mixing import MixSource, MixStats, check_mix, mix
from training.data.packing import BlockPacker, concatenate_documents
from training.data.prepared import (
    batches,
    check_common,
    data_sha256,
    described,
    fingerprint,
    mix_fingerprint,
    mix_manifest,
    mix_parts,
    reused_manifest,
    save_dataset,
)
from training.data.sources import ReadStats, Source, iter_records, resolve_source
from training.data.tokenization import LoadedTokenizer, load_tokenizer
from training.errors import UserError
from training.logs import Progress
from training.outputs import atomic_directory, reusable, scratch_directory, write_manifest


@dataclass(frozen=True)
class PretrainOptions:
    source: str
    tokenizer: str
    seq_len: int
    out: Path
    text_column: str = "text"
    split: str = "train"
    num_proc: int = 1
    max_documents: int | None = None
    add_bos: bool = True
    add_eos: bool = True
    pad_final: bool = False
    skip_bad_records: bool = False
    overwrite: bool = False
    batch_size: int = 1000
    mix: tuple[MixSource, ...] = ()  # several sources: `source`, `split`, `max_documents` are their defaults
    seed: int = 0  # decides a mix's interleaving


@dataclass(frozen=True)
class _Framing:
    """The ids around each document and the one the final block is padded with."""

    bos_id: int | None
    eos_id: int | None
    pad_id: int | None


@dataclass(frozen=True)
class _Packed:
    """What packing the documents into the block writer gave."""

    documents: int
    tokens: int
    dropped: int
    padded: int
    mix_stats: MixStats | None


def prepare_pretrain(options: PretrainOptions) -> dict[str, Any]:
    """Tokenize, frame and pack a corpus (or a mix of corpora) into `[blocks, seq_len]` int32 `input_ids`;
    returns the manifest."""
    options = _single_pretrain_source(options)
    check_common(options.seq_len, options.num_proc, options.max_documents, "--max-documents")
    parts = mix_parts(options.mix, options.max_documents, options.split, "--max-documents")
    tokenizer = load_tokenizer(options.tokenizer, num_threads=options.num_proc)
    framing = _framing(tokenizer, options)
    sources = [resolve_source(part.source) for part in parts]
    source = sources[0] if parts else resolve_source(options.source)
    exclude = {"num_proc", "overwrite", "batch_size", "mix", "seed"}
    if parts:
        exclude = {"num_proc", "overwrite", "batch_size", "mix", "split", "max_documents"}
    settings = fingerprint("pretrain", options, source, options.split, tokenizer, exclude=exclude)
    if parts:
        settings["source"] = mix_fingerprint(parts, sources, "max_documents")
    if (manifest := reusable(options.out, settings, overwrite=options.overwrite)) is not None:
        return reused_manifest(options.out, manifest)

    started = time.monotonic()
    stats = ReadStats()
    with (
        atomic_directory(options.out, overwrite=options.overwrite) as output,
        scratch_directory(options.out) as scratch,
    ):
        writer = BlockWriter(scratch / "blocks.arrow", ("input_ids",), options.seq_len)
        packed = _pack(tokenizer, options, framing, source, parts, sources, writer, stats)
        writer.close()
        if writer.rows == 0:
            raise UserError(
                f"--source {described(options.source, parts)}: {packed.tokens} tokens make no complete block of "
                f"--seq-len {options.seq_len}; use more data, a smaller --seq-len or --pad-final"
            )
        save_dataset(writer.dataset(), output)
        manifest = {
            "kind": "pretrain",
            "fingerprint": settings,
            "source": described(options.source, parts),
            "split": options.split if not source.is_local and not parts else None,
            "tokenizer": {"name": tokenizer.name, "sha256": tokenizer.sha256},
            "seq_len": options.seq_len,
            "columns": {"input_ids": "int32"},
            "separators": {"bos_id": framing.bos_id, "eos_id": framing.eos_id},
            "documents": packed.documents,
            "tokens": packed.tokens,
            "blocks": writer.rows,
            "dropped_tokens": packed.dropped,
            "padded_tokens": packed.padded,
            "pad_id": framing.pad_id if packed.padded else None,
            "bad_records_skipped": stats.bad_records,
            "bad_record_examples": stats.examples_of_bad_records,
            "data_sha256": data_sha256(output),
            "elapsed_seconds": round(time.monotonic() - started, 3),
        }
        if packed.mix_stats is not None:
            manifest |= mix_manifest(parts, sources, packed.mix_stats, options.seed, "documents", "max_documents")
        write_manifest(output, manifest)
    return manifest


def _framing(tokenizer: LoadedTokenizer, options: PretrainOptions) -> _Framing:
    bos_id = _required_id(tokenizer, "bos", options.add_bos, "--no-add-bos")
    eos_id = _required_id(tokenizer, "eos", options.add_eos, "--no-add-eos")
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    if options.pad_final and pad_id is None:
        raise UserError(f"tokenizer {tokenizer.name} has neither a pad nor an EOS token to pad the final block with")
    return _Framing(bos_id, eos_id, pad_id)


def _pack(
    tokenizer: LoadedTokenizer,
    options: PretrainOptions,
    framing: _Framing,
    source: Source,
    parts: list[MixSource],
    sources: list[Source],
    writer: BlockWriter,
    stats: ReadStats,
) -> _Packed:
    """Every document (of one source or mixed from several) framed and packed into `writer`'s blocks."""
    documents = 0
    tokens = 0
    packer = BlockPacker(options.seq_len)
    separators = (framing.bos_id is not None) + (framing.eos_id is not None)
    mix_stats: MixStats | None = None
    if parts:
        streams = [
            _document_ids(tokenizer, mixed, part.split or options.split, part.limit, options, stats)
            for mixed, part in zip(sources, parts, strict=True)
        ]
        mixed_documents, mix_stats = mix(
            streams, [part.weight for part in parts], tokens_of=lambda ids: len(ids) + separators, seed=options.seed
        )
        documents_ids: Iterator[list[int]] = (ids for _, ids in mixed_documents)
    else:
        documents_ids = _document_ids(tokenizer, source, options.split, options.max_documents, options, stats)
    with Progress("tokenizing", "docs") as progress:
        for batch in batches(documents_ids, options.batch_size):
            flat = concatenate_documents(batch, bos_id=framing.bos_id, eos_id=framing.eos_id)
            writer.write(input_ids=packer.add(flat))
            documents += len(batch)
            tokens += flat.size
            progress.update(len(batch), tokens=flat.size)
    # A mix ends at its first source that runs out: one without a document ends it before anything is taken.
    if documents == 0 or (mix_stats is not None and not mix_stats.items[mix_stats.ended_by or 0]):
        empty = parts[mix_stats.ended_by or 0].source if mix_stats is not None else options.source
        raise UserError(f"--source {empty}: the corpus is empty (no documents in '{options.text_column}')")
    dropped = packer.remainder
    padded = 0
    if options.pad_final and dropped:
        assert framing.pad_id is not None
        padded, dropped = options.seq_len - packer.remainder, 0
        writer.write(input_ids=packer.final_block(framing.pad_id))
    return _Packed(documents, tokens, dropped, padded, mix_stats)


def _document_ids(
    tokenizer: LoadedTokenizer,
    source: Source,
    split: str,
    limit: int | None,
    options: PretrainOptions,
    stats: ReadStats,
) -> Iterator[list[int]]:
    """The token ids of each document of one source, tokenized a batch at a time (in the Rust thread pool)."""
    texts = iter_records(
        source, column=options.text_column, split=split, skip_bad_records=options.skip_bad_records, stats=stats
    )
    texts = itertools.islice(_only_strings(texts, options.text_column, options.skip_bad_records, stats), limit)
    for batch in batches(texts, options.batch_size):
        for encoding in tokenizer.backend.encode_batch_fast(batch, add_special_tokens=False):
            yield encoding.ids


def _single_pretrain_source(options: PretrainOptions) -> PretrainOptions:
    """A mix of one source is that source (same fingerprint, same output): its split and limit become the options'."""
    if len(options.mix) != 1:
        return options
    (part,) = options.mix
    check_mix(options.mix, "--max-documents")
    limit = part.limit if part.limit is not None else options.max_documents
    return replace(options, source=part.source, split=part.split or options.split, max_documents=limit, mix=())


def _required_id(tokenizer: LoadedTokenizer, kind: str, wanted: bool, opt_out: str) -> int | None:
    if not wanted:
        return None
    token_id = tokenizer.bos_id if kind == "bos" else tokenizer.eos_id
    if token_id is None:
        raise UserError(
            f"tokenizer {tokenizer.name} has no {kind.upper()} token to separate documents; "
            f"use a tokenizer that defines one, or pass {opt_out}"
        )
    return token_id


def _only_strings(values: Iterable[Any], column: str, skip: bool, stats: ReadStats) -> Iterator[str]:
    for index, value in enumerate(values):
        if isinstance(value, str):
            yield value
        elif skip:
            stats.skip(f"record {index + 1}: '{column}' is {type(value).__name__}")
        else:
            raise UserError(
                f"record {index + 1}: column '{column}' holds {type(value).__name__}, not text; "
                "pass --skip-bad-records to skip such records"
            )
