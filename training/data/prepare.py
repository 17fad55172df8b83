"""`prepare pretrain` and `prepare sft`: token blocks ready for training, written once, reused after.

Pretraining (compared with the reference example, REFERENCE.md section 3): every document is framed as
BOS ... EOS so the model sees where documents end, the remainder of each batch carries over so only the
final partial block of the whole corpus is dropped, and `input_ids` are stored once as int32 (the loader
derives labels). Tokenization runs in the Rust tokenizer's thread pool (`--num-proc` threads) on batches
in input order, so the output is identical whatever the thread count.

Several sources (`mix`) are interleaved document by document (SFT: example by example) by token share and seed
(training.data.mixing); a mix of one source is the one-source path, with its fingerprint and its bytes. Every
manifest records `data_sha256`, the digest of the prepared Arrow files (`data_sha256` below).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from training.config.model import IGNORE_INDEX
from training.data.block_writer import BlockWriter
from training.data.chat import BadExample, ChatRenderer, validate_messages
from training.data.mixing import WEIGHTS_ARE, MixSource, MixStats, check_mix, concatenate, mix
from training.data.packing import BlockPacker, Example, PackStats, concatenate_documents, pack_examples
from training.data.sources import ReadStats, Source, iter_records, resolve_source
from training.data.tokenization import LoadedTokenizer, load_tokenizer
from training.errors import UserError
from training.logs import Progress
from training.outputs import MANIFEST, atomic_directory, reusable, scratch_directory, write_file, write_manifest

WRITE_BATCH_BLOCKS = 256  # SFT blocks buffered per Arrow write


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
class SftOptions:
    source: str
    tokenizer: str
    seq_len: int
    out: Path
    messages_column: str = "messages"
    split: str = "train"
    validation: str | None = None
    num_proc: int = 1
    max_examples: int | None = None
    skip_bad_records: bool = False
    overwrite: bool = False
    batch_size: int = 256
    mix: tuple[MixSource, ...] = ()  # several chat sets: `source`, `split`, `max_examples` are their defaults
    seed: int = 0  # decides a mix's interleaving


def prepare_pretrain(options: PretrainOptions) -> dict[str, Any]:
    """Tokenize, frame and pack a corpus (or a mix of corpora) into `[blocks, seq_len]` int32 `input_ids`;
    returns the manifest."""
    options = _single_pretrain_source(options)
    _check_common(options.seq_len, options.num_proc, options.max_documents, "--max-documents")
    parts = _mix_parts(options.mix, options.max_documents, options.split, "--max-documents")
    tokenizer = load_tokenizer(options.tokenizer, num_threads=options.num_proc)
    bos_id = _required_id(tokenizer, "bos", options.add_bos, "--no-add-bos")
    eos_id = _required_id(tokenizer, "eos", options.add_eos, "--no-add-eos")
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    if options.pad_final and pad_id is None:
        raise UserError(f"tokenizer {tokenizer.name} has neither a pad nor an EOS token to pad the final block with")
    sources = [resolve_source(part.source) for part in parts]
    source = sources[0] if parts else resolve_source(options.source)
    exclude = {"num_proc", "overwrite", "batch_size", "mix", "seed"}
    if parts:
        exclude = {"num_proc", "overwrite", "batch_size", "mix", "split", "max_documents"}
    fingerprint = _fingerprint("pretrain", options, source, options.split, tokenizer, exclude=exclude)
    if parts:
        fingerprint["source"] = _mix_fingerprint(parts, sources, "max_documents")
    if (manifest := reusable(options.out, fingerprint, overwrite=options.overwrite)) is not None:
        return _reused(options.out, manifest)

    started = time.monotonic()
    stats = ReadStats()
    documents = 0
    tokens = 0
    packer = BlockPacker(options.seq_len)
    separators = (bos_id is not None) + (eos_id is not None)
    with (
        atomic_directory(options.out, overwrite=options.overwrite) as output,
        scratch_directory(options.out) as scratch,
    ):
        writer = BlockWriter(scratch / "blocks.arrow", ("input_ids",), options.seq_len)
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
            for batch in _batches(documents_ids, options.batch_size):
                flat = concatenate_documents(batch, bos_id=bos_id, eos_id=eos_id)
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
            assert pad_id is not None
            padded, dropped = options.seq_len - packer.remainder, 0
            writer.write(input_ids=packer.final_block(pad_id))
        writer.close()
        if writer.rows == 0:
            raise UserError(
                f"--source {_described(options.source, parts)}: {tokens} tokens make no complete block of --seq-len "
                f"{options.seq_len}; use more data, a smaller --seq-len or --pad-final"
            )
        _save(writer.dataset(), output)
        manifest = {
            "kind": "pretrain",
            "fingerprint": fingerprint,
            "source": _described(options.source, parts),
            "split": options.split if not source.is_local and not parts else None,
            "tokenizer": {"name": tokenizer.name, "sha256": tokenizer.sha256},
            "seq_len": options.seq_len,
            "columns": {"input_ids": "int32"},
            "separators": {"bos_id": bos_id, "eos_id": eos_id},
            "documents": documents,
            "tokens": tokens,
            "blocks": writer.rows,
            "dropped_tokens": dropped,
            "padded_tokens": padded,
            "pad_id": pad_id if padded else None,
            "bad_records_skipped": stats.bad_records,
            "bad_record_examples": stats.examples_of_bad_records,
            "data_sha256": data_sha256(output),
            "elapsed_seconds": round(time.monotonic() - started, 3),
        }
        if mix_stats is not None:
            manifest |= _mix_manifest(parts, sources, mix_stats, options.seed, "documents", "max_documents")
        write_manifest(output, manifest)
    return manifest


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
    for batch in _batches(texts, options.batch_size):
        for encoding in tokenizer.backend.encode_batch_fast(batch, add_special_tokens=False):
            yield encoding.ids


@dataclass(frozen=True)
class _SftPart:
    """Where one source's records of one split come from, and how many to read."""

    source: Source
    split: str
    limit: int | None


def prepare_sft(options: SftOptions) -> dict[str, Any]:
    """Chat examples (of one chat set or a mix) to packed `input_ids` and `labels` (-100 outside assistant turns);
    returns the manifest."""
    options = _single_sft_source(options)
    _check_common(options.seq_len, options.num_proc, options.max_examples, "--max-examples")
    parts = _mix_parts(options.mix, options.max_examples, options.split, "--max-examples")
    tokenizer = load_tokenizer(options.tokenizer, num_threads=options.num_proc)
    renderer = ChatRenderer(tokenizer)
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    assert pad_id is not None  # ChatRenderer requires an EOS token
    if parts:
        sources = [resolve_source(part.source) for part in parts]
        train = [
            _SftPart(source, part.split or options.split, part.limit)
            for source, part in zip(sources, parts, strict=True)
        ]
        validation = [
            _SftPart(*_validation_source(source, part.validation), part.limit)
            for source, part in zip(sources, parts, strict=True)
            if part.validation
        ]
        exclude = {"num_proc", "overwrite", "batch_size", "mix", "split", "max_examples", "validation"}
        fingerprint = _fingerprint("sft", options, sources[0], options.split, tokenizer, exclude=exclude)
        fingerprint["source"] = _mix_fingerprint(parts, sources, "max_examples")
        fingerprint["validation_source"] = [
            _validation_fingerprint(source, part.validation) for source, part in zip(sources, parts, strict=True)
        ]
    else:
        source = resolve_source(options.source)
        train = [_SftPart(source, options.split, options.max_examples)]
        validation = []
        if options.validation:
            validation = [_SftPart(*_validation_source(source, options.validation), options.max_examples)]
        exclude = {"num_proc", "overwrite", "batch_size", "mix", "seed"}
        fingerprint = _fingerprint("sft", options, source, options.split, tokenizer, exclude=exclude)
        fingerprint["validation_source"] = _validation_fingerprint(source, options.validation)
    fingerprint["template"] = renderer.template
    if (manifest := reusable(options.out, fingerprint, overwrite=options.overwrite)) is not None:
        return _reused(options.out, manifest)

    import datasets

    splits = {"train": train} | ({"validation": validation} if validation else {})
    started = time.monotonic()
    split_manifests = {}
    mix_stats = MixStats(items=[], tokens=[])
    with (
        atomic_directory(options.out, overwrite=options.overwrite) as output,
        scratch_directory(options.out) as scratch,
    ):
        produced = {}
        for name, split_parts in splits.items():
            writer = BlockWriter(scratch / f"{name}.arrow", ("input_ids", "labels"), options.seq_len)
            weights = [part.weight for part in parts] if parts and name == "train" else None
            split_manifests[name], split_stats = _write_sft_split(
                options, renderer, pad_id, name, split_parts, weights, writer
            )
            mix_stats = split_stats if name == "train" else mix_stats
            writer.close()
            if writer.rows == 0:
                described = ", ".join(part.source.spec for part in split_parts)
                raise UserError(f"{name} split of --source {described}: no block with an assistant token")
            produced[name] = writer.dataset()
        _save(datasets.DatasetDict(produced), output)
        manifest = {
            "kind": "sft",
            "fingerprint": fingerprint,
            "source": _described(options.source, parts),
            "tokenizer": {"name": tokenizer.name, "sha256": tokenizer.sha256},
            "chat_template": "tokenizer" if not renderer.uses_fallback else "mixtral-fallback",
            "seq_len": options.seq_len,
            "columns": {"input_ids": "int32", "labels": "int32"},
            "pad_id": pad_id,
            "splits": split_manifests,
            "data_sha256": data_sha256(output),
            "elapsed_seconds": round(time.monotonic() - started, 3),
        }
        if parts:
            manifest |= _mix_manifest(parts, sources, mix_stats, options.seed, "examples", "max_examples")
        write_manifest(output, manifest)
    return manifest


def _write_sft_split(
    options: SftOptions,
    renderer: ChatRenderer,
    pad_id: int,
    name: str,
    parts: list[_SftPart],
    weights: list[float] | None,
    writer: BlockWriter,
) -> tuple[dict[str, Any], MixStats]:
    """One split's blocks: the examples of one source, of several in a mix (`weights`), or of several one after
    the other (no weights: a mix's validation split holds each source's validation examples whole)."""
    stats = ReadStats()
    skipped = {"no_assistant_turn": 0, "bad_messages": 0}
    pack_stats = PackStats()

    def examples(part: _SftPart) -> Iterator[Example]:
        records = iter_records(
            part.source,
            column=options.messages_column,
            split=part.split,
            skip_bad_records=options.skip_bad_records,
            stats=stats,
        )
        record_number = 0
        for batch in _batches(itertools.islice(records, part.limit), options.batch_size):
            conversations = []
            for messages in batch:
                record_number += 1
                try:
                    conversation = validate_messages(messages)
                except BadExample as error:
                    if not options.skip_bad_records:
                        raise UserError(
                            f"--source {part.source.spec}: record {record_number} has bad "
                            f"'{options.messages_column}': {error}; pass --skip-bad-records to skip such records"
                        ) from None
                    skipped["bad_messages"] += 1
                    continue
                # A leading assistant turn has no prompt and is not trained (see training.data.chat).
                if not any(m["role"] == "assistant" for m in conversation[1:]):
                    skipped["no_assistant_turn"] += 1
                    continue
                conversations.append(conversation)
            yield from renderer.tokenize(conversations)

    def tokens_of(example: Example) -> int:
        return min(example.input_ids.size, options.seq_len)  # what reaches a block (longer ones are truncated)

    streams = [examples(part) for part in parts]
    if weights is not None:
        mixed, mix_stats = mix(streams, weights, tokens_of=tokens_of, seed=options.seed)
    else:
        mixed, mix_stats = concatenate(streams, tokens_of=tokens_of)
    trained_tokens = 0
    blocks = pack_examples((example for _, example in mixed), seq_len=options.seq_len, pad_id=pad_id, stats=pack_stats)
    with Progress(f"packing {parts[0].split if len(parts) == 1 else name}", "blocks") as progress:
        for group in _batches(blocks, WRITE_BATCH_BLOCKS):
            ids = np.stack([ids for ids, _ in group])
            labels = np.stack([labels for _, labels in group])
            writer.write(input_ids=ids, labels=labels)
            trained = int(np.count_nonzero(labels != IGNORE_INDEX))
            trained_tokens += trained
            progress.update(len(group), trained_tokens=trained)
    single = parts[0].source if len(parts) == 1 else None
    manifest: dict[str, Any] = {
        "source": single.spec if single else ", ".join(part.source.spec for part in parts),
        "split": parts[0].split if single and not single.is_local else None,
        "examples": pack_stats.examples,
        "skipped_no_assistant_turn": skipped["no_assistant_turn"],
        "skipped_bad_messages": skipped["bad_messages"],
        "bad_records_skipped": stats.bad_records,
        "truncated_examples": pack_stats.truncated_examples,
        "dropped_untrained_blocks": pack_stats.dropped_untrained_blocks,
        "blocks": writer.rows,
        "trained_tokens": trained_tokens,
        "padding_tokens": pack_stats.padding_tokens,
    }
    if single is None:
        manifest["sources"] = [
            {
                "source": part.source.spec,
                "split": part.split if not part.source.is_local else None,
                "examples": count,
                "tokens": tokens,
                "token_share": round(share, 6),
            }
            for part, count, tokens, share in zip(
                parts, mix_stats.items, mix_stats.tokens, mix_stats.shares(), strict=True
            )
        ]
    return manifest, mix_stats


def _validation_source(train: Source, validation: str) -> tuple[Source, str]:
    """A hub source takes a split name; a local source takes a path."""
    if train.is_local:
        return resolve_source(validation), "train"
    return train, validation


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


def _reused(out: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """A completed output's manifest; one written before manifests recorded `data_sha256` gains it (in one
    rename, so a reader sees the old manifest or the new one)."""
    if "data_sha256" not in manifest:
        manifest = {**manifest, "data_sha256": data_sha256(out)}
        write_file(out / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return {**manifest, "reused": True}


def _single_pretrain_source(options: PretrainOptions) -> PretrainOptions:
    """A mix of one source is that source (same fingerprint, same output): its split and limit become the options'."""
    if len(options.mix) != 1:
        return options
    (part,) = options.mix
    check_mix(options.mix, "--max-documents")
    limit = part.limit if part.limit is not None else options.max_documents
    return replace(options, source=part.source, split=part.split or options.split, max_documents=limit, mix=())


def _single_sft_source(options: SftOptions) -> SftOptions:
    """As `_single_pretrain_source`, for a chat set (with its validation data)."""
    if len(options.mix) != 1:
        return options
    (part,) = options.mix
    check_mix(options.mix, "--max-examples")
    limit = part.limit if part.limit is not None else options.max_examples
    return replace(
        options,
        source=part.source,
        split=part.split or options.split,
        max_examples=limit,
        validation=part.validation or options.validation,
        mix=(),
    )


def _mix_parts(mix_sources: tuple[MixSource, ...], limit: int | None, split: str, limit_flag: str) -> list[MixSource]:
    """The sources of a mix with the command's defaults filled in (empty for one source), checked."""
    if not mix_sources:
        return []
    parts = [
        replace(part, split=part.split or split, limit=part.limit if part.limit is not None else limit)
        for part in mix_sources
    ]
    check_mix(parts, limit_flag)
    return parts


def _mix_fingerprint(parts: list[MixSource], sources: list[Source], limit_key: str) -> list[dict[str, Any]]:
    return [
        {"source": source.fingerprint(part.split or ""), "weight": part.weight, limit_key: part.limit}
        for part, source in zip(parts, sources, strict=True)
    ]


def _validation_fingerprint(train: Source, validation: str | None) -> dict[str, Any] | None:
    if not validation:
        return None
    source, split = _validation_source(train, validation)
    return source.fingerprint(split)


def _described(single: str, parts: list[MixSource]) -> str:
    """The manifest's `source`: the one source, or a mix's sources in order."""
    return ", ".join(part.source for part in parts) if parts else single


def _mix_manifest(
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


def _check_common(seq_len: int, num_proc: int, limit: int | None, limit_flag: str) -> None:
    if seq_len < 2:
        raise UserError(f"--seq-len {seq_len}: must be at least 2")
    if seq_len > MAX_SEQ_LEN:
        raise UserError(f"--seq-len {seq_len}: is not allowed; allowed: 2 to {MAX_SEQ_LEN} tokens")
    if num_proc < 1:
        raise UserError(f"--num-proc {num_proc}: must be at least 1")
    if limit is not None and limit < 1:
        raise UserError(f"{limit_flag} {limit}: must be at least 1")


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


def _fingerprint(
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


def _batches(values: Iterable[Any], size: int) -> Iterator[list[Any]]:
    iterator = iter(values)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


def _save(dataset: Any, output: Path) -> None:
    """`save_to_disk` into the temporary output directory (quietly: the run has its own progress bars)."""
    import datasets

    datasets.disable_progress_bars()
    try:
        dataset.save_to_disk(str(output), max_shard_size="500MB")
    finally:
        datasets.enable_progress_bars()
