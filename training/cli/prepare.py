"""`prepare pretrain` and `prepare sft`: tokenize and pack training data, one source or a mix of several (each
`--source` followed by its own options)."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from training.cli.common import Subcommands, add_command, add_group, options_from, print_summary
from training.data.mixing import MixSource
from training.errors import UserError

DEFAULT_PRETRAIN_SOURCE = "wikicorpus:raw_en"  # the first source document's corpus
DEFAULT_PRETRAIN_SEQ_LEN = 8192  # Llama 3.1 8B block size in the reference example
DEFAULT_SFT_SOURCE = "HuggingFaceH4/no_robots"  # the second source document's chat data
DEFAULT_SFT_SEQ_LEN = 2048
DEFAULT_SFT_VALIDATION_SPLIT = "test"

EXAMPLES = {
    "prepare pretrain": "{prog} prepare pretrain --tokenizer /fsx/models/Llama-3.1-8B --output /fsx/data/wikicorpus-8k",
    "prepare sft": "{prog} prepare sft --tokenizer /fsx/models/Mixtral-8x7B-v0.1 --output /fsx/data/no-robots-2k",
}


def add_arguments(commands: Subcommands, prog: str) -> None:
    kinds = add_group(commands, "prepare", "tokenize and pack training data", prog, list(EXAMPLES.values()), "kind")
    pretrain = add_command(
        kinds,
        "pretrain",
        "a text corpus into fixed-length blocks for pretraining",
        prog,
        EXAMPLES["prepare pretrain"],
        run_pretrain,
    )
    _common_arguments(pretrain, DEFAULT_PRETRAIN_SOURCE, DEFAULT_PRETRAIN_SEQ_LEN)
    pretrain.add_argument("--text-column", default="text", help="column holding the document text (default: text)")
    pretrain.add_argument(
        "--max-documents",
        type=int,
        action=PerSourceOption,
        help="stop after this many documents (after a --source: of that source; default: all)",
    )
    pretrain.add_argument(
        "--add-bos", action=argparse.BooleanOptionalAction, default=True, help="BOS before every document"
    )
    pretrain.add_argument(
        "--add-eos", action=argparse.BooleanOptionalAction, default=True, help="EOS after every document"
    )
    pretrain.add_argument(
        "--pad-final",
        action="store_true",
        help="pad the final partial block (pad token, else EOS) instead of dropping it",
    )

    sft = add_command(
        kinds,
        "sft",
        "chat conversations into packed blocks with assistant-only labels",
        prog,
        EXAMPLES["prepare sft"],
        run_sft,
    )
    _common_arguments(sft, DEFAULT_SFT_SOURCE, DEFAULT_SFT_SEQ_LEN)
    sft.add_argument("--messages-column", default="messages", help="column of [{role, content}] lists")
    sft.add_argument(
        "--validation",
        action=PerSourceOption,
        help=f"validation data: a split name for a hub dataset (default: {DEFAULT_SFT_VALIDATION_SPLIT}), "
        "a file or directory for local data (default: none); 'none' to skip; after a --source of a mix: that "
        "source's (a mix's validation split holds each source's validation examples whole)",
    )
    sft.add_argument(
        "--max-examples",
        type=int,
        action=PerSourceOption,
        help="stop after this many examples per split (after a --source: of that source; default: all)",
    )


def _common_arguments(parser: argparse.ArgumentParser, source: str, seq_len: int) -> None:
    parser.set_defaults(mix=None)
    parser.add_argument(
        "--source",
        action=SourceOption,
        help="hub dataset NAME[:CONFIG], or a .jsonl/.parquet/.txt file or directory; repeat it to mix several "
        f"(default: {source})",
    )
    parser.add_argument(
        "--weight",
        type=float,
        action=PerSourceOption,
        help="after a --source of a mix: its share of the tokens, relative to the other weights (default: equal)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="decides the interleaving of a mix (default: 0; one source ignores it)"
    )
    parser.add_argument("--tokenizer", required=True, help="directory of a Hugging Face fast tokenizer")
    parser.add_argument("--seq-len", type=int, default=seq_len, help=f"tokens per block (default: {seq_len})")
    parser.add_argument("--output", required=True, type=Path, help="directory to write (datasets.load_from_disk)")
    parser.add_argument(
        "--split",
        default="train",
        action=PerSourceOption,
        help="split of a hub dataset (after a --source: of that source; default: train)",
    )
    parser.add_argument(
        "--num-proc", type=int, default=os.cpu_count() or 1, help="tokenizer threads (default: all cores)"
    )
    parser.add_argument("--skip-bad-records", action="store_true", help="skip and count undecodable records")
    parser.add_argument("--overwrite", action="store_true", help="replace an output made from other inputs")


class SourceOption(argparse.Action):
    """`--source` starts one source of a mix; the options of `PerSourceOption` after it are that source's."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        namespace.mix = [*(namespace.mix or []), {"source": values}]


class PerSourceOption(argparse.Action):
    """An option given after a `--source` belongs to that source; before the first `--source` it is the default
    of every source (`--weight` has no such default: it always weighs the source before it)."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        if not namespace.mix:
            if self.dest == "weight":
                raise argparse.ArgumentError(self, f"{values}: a weight without a source; put it after its --source")
            setattr(namespace, self.dest, values)
            return
        current = namespace.mix[-1]
        if self.dest in current:
            raise argparse.ArgumentError(self, f"given twice for --source {current['source']}")
        current[self.dest] = values


def _check_seed(arguments: argparse.Namespace) -> None:
    if arguments.seed < 0:
        raise UserError(f"--seed {arguments.seed}: must be 0 or more")


def run_pretrain(arguments: argparse.Namespace) -> int:
    from training.data.pretrain import PretrainOptions, prepare_pretrain

    _check_seed(arguments)
    mix = _mix(arguments, DEFAULT_PRETRAIN_SOURCE, "max_documents")
    return print_summary(
        prepare_pretrain(options_from(PretrainOptions, arguments, source=mix[0].source, out=arguments.output, mix=mix))
    )


def run_sft(arguments: argparse.Namespace) -> int:
    from training.data.sft import SftOptions, prepare_sft

    _check_seed(arguments)
    mix = _sft_validation(_mix(arguments, DEFAULT_SFT_SOURCE, "max_examples"), arguments.validation)
    # Each source's validation data is resolved into the mix; the options' own default stays unused.
    options = options_from(SftOptions, arguments, source=mix[0].source, out=arguments.output, mix=mix, validation=None)
    return print_summary(prepare_sft(options))


def _mix(arguments: argparse.Namespace, default_source: str, limit: str) -> tuple[MixSource, ...]:
    """The `--source` options in order, each with the options given after it (the default source if none)."""
    given = arguments.mix or [{"source": default_source}]
    weighted = [entry for entry in given if "weight" in entry]
    if weighted and len(weighted) != len(given):
        missing = next(entry["source"] for entry in given if "weight" not in entry)
        raise UserError(f"--source {missing}: has no --weight; give every source of a mix a weight, or none (equal)")
    return tuple(
        MixSource(
            source=entry["source"],
            weight=entry.get("weight", 1.0),
            limit=entry.get(limit),
            split=entry.get("split"),
            validation=entry.get("validation"),
        )
        for entry in given
    )


def _sft_validation(mix: tuple[MixSource, ...], default: str | None) -> tuple[MixSource, ...]:
    """Each chat set's validation data: its own `--validation`, else the one before the first `--source`, else
    the hub default split (local data: none); 'none' for none."""
    from training.data.sources import resolve_source

    local = [part for part in mix if resolve_source(part.source).is_local]
    if default not in (None, "none") and len(local) > 1 and any(part.validation is None for part in local):
        raise UserError(
            f"--validation {default}: before the first --source it would be the validation file of every local "
            "source of the mix; give it after the --source it belongs to"
        )
    resolved = []
    for part in mix:
        validation = part.validation or default
        if validation is None and part not in local:
            validation = DEFAULT_SFT_VALIDATION_SPLIT
        resolved.append(replace(part, validation=None if validation in (None, "none") else validation))
    return tuple(resolved)
