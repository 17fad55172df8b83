"""`prepare pretrain` and `prepare sft`: token blocks ready for training, written once, reused after.

Pretraining (compared with the reference example, REFERENCE.md section 3): every document is framed as
BOS ... EOS so the model sees where documents end, the remainder of each batch carries over so only the
final partial block of the whole corpus is dropped, and `input_ids` are stored once as int32 (the loader
derives labels). Tokenization runs in the Rust tokenizer's thread pool (`--num-proc` threads) on batches
in input order, so the output is identical whatever the thread count.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from training.data.block_writer import BlockWriter
from training.data.chat import BadExample, ChatRenderer, validate_messages
from training.data.packing import IGNORE_INDEX, BlockPacker, Example, PackStats, concatenate_documents, pack_examples
from training.data.sources import ReadStats, Source, iter_records, resolve_source
from training.data.tokenization import LoadedTokenizer, load_tokenizer
from training.errors import UserError
from training.logs import Progress
from training.outputs import atomic_directory, reusable, scratch_directory, write_manifest

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


def prepare_pretrain(options: PretrainOptions) -> dict[str, Any]:
    """Tokenize, frame and pack a corpus into `[blocks, seq_len]` int32 `input_ids`; returns the manifest."""
    _check_common(options.seq_len, options.num_proc, options.max_documents, "--max-documents")
    tokenizer = load_tokenizer(options.tokenizer, num_threads=options.num_proc)
    bos_id = _required_id(tokenizer, "bos", options.add_bos, "--no-add-bos")
    eos_id = _required_id(tokenizer, "eos", options.add_eos, "--no-add-eos")
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    if options.pad_final and pad_id is None:
        raise UserError(f"tokenizer {tokenizer.name} has neither a pad nor an EOS token to pad the final block with")
    source = resolve_source(options.source)
    fingerprint = _fingerprint(
        "pretrain", options, source, options.split, tokenizer, exclude={"num_proc", "overwrite", "batch_size"}
    )
    if (manifest := reusable(options.out, fingerprint, overwrite=options.overwrite)) is not None:
        return {**manifest, "reused": True}

    started = time.monotonic()
    stats = ReadStats()
    documents = 0
    tokens = 0
    packer = BlockPacker(options.seq_len)
    with (
        atomic_directory(options.out, overwrite=options.overwrite) as output,
        scratch_directory(options.out) as scratch,
    ):
        writer = BlockWriter(scratch / "blocks.arrow", ("input_ids",), options.seq_len)
        texts = iter_records(
            source,
            column=options.text_column,
            split=options.split,
            skip_bad_records=options.skip_bad_records,
            stats=stats,
        )
        texts = itertools.islice(
            _only_strings(texts, options.text_column, options.skip_bad_records, stats), options.max_documents
        )
        with Progress("tokenizing", "docs") as progress:
            for batch in _batches(texts, options.batch_size):
                encodings = tokenizer.backend.encode_batch_fast(batch, add_special_tokens=False)
                flat = concatenate_documents([e.ids for e in encodings], bos_id=bos_id, eos_id=eos_id)
                writer.write(input_ids=packer.add(flat))
                documents += len(batch)
                tokens += flat.size
                progress.update(len(batch), tokens=flat.size)
        if documents == 0:
            raise UserError(f"--source {options.source}: the corpus is empty (no documents in '{options.text_column}')")
        dropped = packer.remainder
        padded = 0
        if options.pad_final and dropped:
            assert pad_id is not None
            padded, dropped = options.seq_len - packer.remainder, 0
            writer.write(input_ids=packer.final_block(pad_id))
        writer.close()
        if writer.rows == 0:
            raise UserError(
                f"--source {options.source}: {tokens} tokens make no complete block of --seq-len {options.seq_len}; "
                "use more data, a smaller --seq-len or --pad-final"
            )
        _save(writer.dataset(), output)
        manifest = {
            "kind": "pretrain",
            "fingerprint": fingerprint,
            "source": options.source,
            "split": options.split if not source.is_local else None,
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
            "elapsed_seconds": round(time.monotonic() - started, 3),
        }
        write_manifest(output, manifest)
    return manifest


def prepare_sft(options: SftOptions) -> dict[str, Any]:
    """Chat examples to packed `input_ids` and `labels` (-100 outside assistant turns); returns the manifest."""
    _check_common(options.seq_len, options.num_proc, options.max_examples, "--max-examples")
    tokenizer = load_tokenizer(options.tokenizer, num_threads=options.num_proc)
    renderer = ChatRenderer(tokenizer)
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    assert pad_id is not None  # ChatRenderer requires an EOS token
    source = resolve_source(options.source)
    splits = {"train": (source, options.split)}
    if options.validation:
        splits["validation"] = _validation_source(source, options.validation)
    fingerprint = _fingerprint(
        "sft", options, source, options.split, tokenizer, exclude={"num_proc", "overwrite", "batch_size"}
    )
    fingerprint["validation_source"] = (
        splits["validation"][0].fingerprint(splits["validation"][1]) if "validation" in splits else None
    )
    fingerprint["template"] = renderer.template
    if (manifest := reusable(options.out, fingerprint, overwrite=options.overwrite)) is not None:
        return {**manifest, "reused": True}

    import datasets

    started = time.monotonic()
    split_manifests = {}
    with (
        atomic_directory(options.out, overwrite=options.overwrite) as output,
        scratch_directory(options.out) as scratch,
    ):
        produced = {}
        for name, (split_source, split) in splits.items():
            writer = BlockWriter(scratch / f"{name}.arrow", ("input_ids", "labels"), options.seq_len)
            split_manifests[name] = _write_sft_split(options, renderer, pad_id, split_source, split, writer)
            writer.close()
            if writer.rows == 0:
                raise UserError(f"{name} split of --source {split_source.spec}: no block with an assistant token")
            produced[name] = writer.dataset()
        _save(datasets.DatasetDict(produced), output)
        manifest = {
            "kind": "sft",
            "fingerprint": fingerprint,
            "source": options.source,
            "tokenizer": {"name": tokenizer.name, "sha256": tokenizer.sha256},
            "chat_template": "tokenizer" if not renderer.uses_fallback else "mixtral-fallback",
            "seq_len": options.seq_len,
            "columns": {"input_ids": "int32", "labels": "int32"},
            "pad_id": pad_id,
            "splits": split_manifests,
            "elapsed_seconds": round(time.monotonic() - started, 3),
        }
        write_manifest(output, manifest)
    return manifest


def _write_sft_split(
    options: SftOptions, renderer: ChatRenderer, pad_id: int, source: Source, split: str, writer: BlockWriter
) -> dict[str, Any]:
    stats = ReadStats()
    skipped = {"no_assistant_turn": 0, "bad_messages": 0}
    pack_stats = PackStats()
    records = iter_records(
        source, column=options.messages_column, split=split, skip_bad_records=options.skip_bad_records, stats=stats
    )
    records = itertools.islice(records, options.max_examples)

    def examples() -> Iterator[Example]:
        record_number = 0
        for batch in _batches(records, options.batch_size):
            conversations = []
            for messages in batch:
                record_number += 1
                try:
                    conversation = validate_messages(messages)
                except BadExample as error:
                    if not options.skip_bad_records:
                        raise UserError(
                            f"--source {source.spec}: record {record_number} has bad '{options.messages_column}': "
                            f"{error}; pass --skip-bad-records to skip such records"
                        ) from None
                    skipped["bad_messages"] += 1
                    continue
                # A leading assistant turn has no prompt and is not trained (see training.data.chat).
                if not any(m["role"] == "assistant" for m in conversation[1:]):
                    skipped["no_assistant_turn"] += 1
                    continue
                conversations.append(conversation)
            yield from renderer.tokenize(conversations)

    trained_tokens = 0
    blocks = pack_examples(examples(), seq_len=options.seq_len, pad_id=pad_id, stats=pack_stats)
    with Progress(f"packing {split}", "blocks") as progress:
        for group in _batches(blocks, WRITE_BATCH_BLOCKS):
            ids = np.stack([ids for ids, _ in group])
            labels = np.stack([labels for _, labels in group])
            writer.write(input_ids=ids, labels=labels)
            trained = int(np.count_nonzero(labels != IGNORE_INDEX))
            trained_tokens += trained
            progress.update(len(group), trained_tokens=trained)
    return {
        "source": source.spec,
        "split": split if not source.is_local else None,
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


def _validation_source(train: Source, validation: str) -> tuple[Source, str]:
    """A hub source takes a split name; a local source takes a path."""
    if train.is_local:
        return resolve_source(validation), "train"
    return train, validation


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
