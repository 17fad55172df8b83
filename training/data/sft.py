"""`prepare sft`: chat examples to packed `input_ids` and `labels` blocks, written once, reused after.

Labels are -100 outside assistant turns (training.data.chat renders, training.data.packing packs). Several chat
sets (`mix`) are interleaved example by example by token share and seed (training.data.mixing); a mix's
validation split holds each source's validation examples whole, one source after the other.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from training.config.model import IGNORE_INDEX
from training.data.block_writer import BlockWriter
from training.data.chat import BadExample, ChatRenderer, validate_messages
from training.data.mixing import MixSource, MixStats, check_mix, concatenate, mix
from training.data.packing import Example, PackStats, pack_examples
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

WRITE_BATCH_BLOCKS = 256  # SFT blocks buffered per Arrow write


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


@dataclass(frozen=True)
class _SftPart:
    """Where one source's records of one split come from, and how many to read."""

    source: Source
    split: str
    limit: int | None


@dataclass(frozen=True)
class _SftPlan:
    """Each split's parts, the sources of a mix, and the fingerprint of the output they make."""

    train: list[_SftPart]
    validation: list[_SftPart]
    sources: list[Source]
    fingerprint: dict[str, Any]


@dataclass
class _Skipped:
    """Records read but not trained on, and why."""

    no_assistant_turn: int = 0
    bad_messages: int = 0
    read: ReadStats = field(default_factory=ReadStats)


def prepare_sft(options: SftOptions) -> dict[str, Any]:
    """Chat examples (of one chat set or a mix) to packed `input_ids` and `labels` (-100 outside assistant turns);
    returns the manifest."""
    options = _single_sft_source(options)
    check_common(options.seq_len, options.num_proc, options.max_examples, "--max-examples")
    parts = mix_parts(options.mix, options.max_examples, options.split, "--max-examples")
    tokenizer = load_tokenizer(options.tokenizer, num_threads=options.num_proc)
    renderer = ChatRenderer(tokenizer)
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    assert pad_id is not None  # ChatRenderer requires an EOS token
    plan = _plan(options, parts, tokenizer)
    plan.fingerprint["template"] = renderer.template
    if (manifest := reusable(options.out, plan.fingerprint, overwrite=options.overwrite)) is not None:
        return reused_manifest(options.out, manifest)

    import datasets

    splits = {"train": plan.train} | ({"validation": plan.validation} if plan.validation else {})
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
                listed = ", ".join(part.source.spec for part in split_parts)
                raise UserError(f"{name} split of --source {listed}: no block with an assistant token")
            produced[name] = writer.dataset()
        save_dataset(datasets.DatasetDict(produced), output)
        manifest = {
            "kind": "sft",
            "fingerprint": plan.fingerprint,
            "source": described(options.source, parts),
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
            manifest |= mix_manifest(parts, plan.sources, mix_stats, options.seed, "examples", "max_examples")
        write_manifest(output, manifest)
    return manifest


def _plan(options: SftOptions, parts: list[MixSource], tokenizer: LoadedTokenizer) -> _SftPlan:
    """The train and validation parts of one chat set or of a mix, and their fingerprint."""
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
        settings = fingerprint("sft", options, sources[0], options.split, tokenizer, exclude=exclude)
        settings["source"] = mix_fingerprint(parts, sources, "max_examples")
        settings["validation_source"] = [
            _validation_fingerprint(source, part.validation) for source, part in zip(sources, parts, strict=True)
        ]
        return _SftPlan(train, validation, sources, settings)
    source = resolve_source(options.source)
    train = [_SftPart(source, options.split, options.max_examples)]
    validation = []
    if options.validation:
        validation = [_SftPart(*_validation_source(source, options.validation), options.max_examples)]
    exclude = {"num_proc", "overwrite", "batch_size", "mix", "seed"}
    settings = fingerprint("sft", options, source, options.split, tokenizer, exclude=exclude)
    settings["validation_source"] = _validation_fingerprint(source, options.validation)
    return _SftPlan(train, validation, [], settings)


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
    skipped = _Skipped()
    pack_stats = PackStats()

    def tokens_of(example: Example) -> int:
        return min(example.input_ids.size, options.seq_len)  # what reaches a block (longer ones are truncated)

    streams = [_examples(options, renderer, part, skipped) for part in parts]
    if weights is not None:
        mixed, mix_stats = mix(streams, weights, tokens_of=tokens_of, seed=options.seed)
    else:
        mixed, mix_stats = concatenate(streams, tokens_of=tokens_of)
    trained_tokens = 0
    blocks = pack_examples((example for _, example in mixed), seq_len=options.seq_len, pad_id=pad_id, stats=pack_stats)
    with Progress(f"packing {parts[0].split if len(parts) == 1 else name}", "blocks") as progress:
        for group in batches(blocks, WRITE_BATCH_BLOCKS):
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
        "skipped_no_assistant_turn": skipped.no_assistant_turn,
        "skipped_bad_messages": skipped.bad_messages,
        "bad_records_skipped": skipped.read.bad_records,
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


def _examples(options: SftOptions, renderer: ChatRenderer, part: _SftPart, skipped: _Skipped) -> Iterator[Example]:
    """One part's conversations, validated and rendered a batch at a time; bad ones refused or counted."""
    records = iter_records(
        part.source,
        column=options.messages_column,
        split=part.split,
        skip_bad_records=options.skip_bad_records,
        stats=skipped.read,
    )
    record_number = 0
    for batch in batches(itertools.islice(records, part.limit), options.batch_size):
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
                skipped.bad_messages += 1
                continue
            # A leading assistant turn has no prompt and is not trained (see training.data.chat).
            if not any(m["role"] == "assistant" for m in conversation[1:]):
                skipped.no_assistant_turn += 1
                continue
            conversations.append(conversation)
        yield from renderer.tokenize(conversations)


def _single_sft_source(options: SftOptions) -> SftOptions:
    """A mix of one chat set is that chat set (same fingerprint, same output), with its validation data."""
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


def _validation_source(train: Source, validation: str) -> tuple[Source, str]:
    """A hub source takes a split name; a local source takes a path."""
    if train.is_local:
        return resolve_source(validation), "train"
    return train, validation


def _validation_fingerprint(train: Source, validation: str | None) -> dict[str, Any] | None:
    if not validation:
        return None
    source, split = _validation_source(train, validation)
    return source.fingerprint(split)
