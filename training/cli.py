"""`python -m training ...`: one entry point for every step of the pipeline.

User mistakes (training.errors.UserError) are printed as one line, `error: ...`, with exit status 2;
nothing else is caught, so real bugs keep their traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from training.errors import UserError

DEFAULT_PRETRAIN_SOURCE = "wikicorpus:raw_en"  # the first source document's corpus
DEFAULT_PRETRAIN_SEQ_LEN = 8192  # Llama 3.1 8B block size in the reference example
DEFAULT_SFT_SOURCE = "HuggingFaceH4/no_robots"  # the second source document's chat data
DEFAULT_SFT_SEQ_LEN = 2048
DEFAULT_SFT_VALIDATION_SPLIT = "test"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m training", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prepare = commands.add_parser("prepare", help="tokenize and pack training data").add_subparsers(
        dest="kind", required=True
    )

    pretrain = prepare.add_parser("pretrain", help="a text corpus into fixed-length blocks for pretraining")
    _common_arguments(pretrain, DEFAULT_PRETRAIN_SOURCE, DEFAULT_PRETRAIN_SEQ_LEN)
    pretrain.add_argument("--text-column", default="text", help="column holding the document text (default: text)")
    pretrain.add_argument("--max-documents", type=int, help="stop after this many documents")
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

    sft = prepare.add_parser("sft", help="chat conversations into packed blocks with assistant-only labels")
    _common_arguments(sft, DEFAULT_SFT_SOURCE, DEFAULT_SFT_SEQ_LEN)
    sft.add_argument("--messages-column", default="messages", help="column of [{role, content}] lists")
    sft.add_argument(
        "--validation",
        help=f"validation data: a split name for a hub dataset (default: {DEFAULT_SFT_VALIDATION_SPLIT}), "
        "a file or directory for local data (default: none); 'none' to skip",
    )
    sft.add_argument("--max-examples", type=int, help="stop after this many examples per split")

    convert = commands.add_parser("convert", help="convert checkpoints between hf, nxd and nemo layouts")
    convert.add_argument("--from", dest="source_format", required=True, choices=("hf", "nxd", "nemo"))
    convert.add_argument("--to", dest="target_format", required=True, choices=("hf", "nxd", "nemo"))
    convert.add_argument("--input", required=True, type=Path, help="checkpoint directory to read")
    convert.add_argument("--output", required=True, type=Path, help="directory to write (created atomically)")
    convert.add_argument("--tp", type=int, help="tensor-parallel degree to write (nxd, nemo)")
    convert.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree to write (default: 1)")
    convert.add_argument(
        "--kv-size-multiplier",
        dest="kv_multiplier",
        type=int,
        help="KV head replication for nxd (default: smallest that fits)",
    )
    convert.add_argument("--fuse-qkv", action="store_true", help="nxd: one fused weight_qkv per layer")
    convert.add_argument("--xser", action="store_true", help="write torch_xla xser files (one file per tensor)")
    convert.add_argument("--config", type=Path, help="config.json for checkpoints that lack one")
    convert.add_argument("--force", action="store_true", help="read a step_N checkpoint without its 'done' marker")
    convert.add_argument(
        "--overwrite", action="store_true", help="replace an output directory holding another checkpoint"
    )
    convert.add_argument("--verify", action="store_true", help="read the output back and compare with the input")
    convert.add_argument(
        "--workers", type=int, default=min(8, os.cpu_count() or 1), help="threads cutting and writing shards"
    )
    convert.add_argument(
        "--max-shard-size", default="2GB", help="hf output shard size; shards are written in parallel (default: 2GB)"
    )

    train = commands.add_parser("train", help="train with a recipe (launch with torchrun, one process per worker)")
    train.add_argument("--recipe", required=True, help="recipe YAML file, or the name of a bundled recipe")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides, e.g. batch.micro=2")
    train.add_argument(
        "--resume",
        choices=("latest",),
        help="continue from the newest complete checkpoint in checkpoint.dir (a fresh start if there is none)",
    )
    train.add_argument(
        "--compile", action="store_true", help="run exactly 2 steps and save nothing (for neuron_parallel_compile)"
    )
    train.add_argument("--metrics", type=Path, help="JSON lines file (default: <checkpoint.dir>/metrics.jsonl)")

    submit = commands.add_parser("submit", help="submit a recipe's whole pipeline to Slurm as one dependency graph")
    submit.add_argument("--recipe", required=True, help="recipe YAML file, or the name of a bundled recipe")
    submit.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides, e.g. steps=100")
    submit.add_argument("--run-id", help="name of the run (default: <recipe>-<UTC time>); an existing run resumes")
    submit.add_argument("--env-file", type=Path, help="site settings YAML (runs root, results, python, partition...)")
    submit.add_argument("--dry-run", action="store_true", help="print the job scripts and the graph, submit nothing")
    for name, text in (
        ("status", "stages of a run with Slurm state, time and training progress"),
        ("cancel", "cancel every job of a run"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("--run-id", required=name == "cancel", help="run (default for status: the newest)")
        command.add_argument("--env-file", type=Path, help="site settings YAML (where the runs are)")

    sample = commands.add_parser("sample", help="greedy and top-k answers of a trained Hugging Face model")
    sample.add_argument("--recipe", required=True, help="recipe (prompts, chat format)")
    sample.add_argument("--model", required=True, type=Path, help="Hugging Face model directory")
    sample.add_argument("--out", required=True, type=Path, help="JSON file to write")

    export = commands.add_parser("export", help="copy a run's model, metrics, samples and logs to S3 or a directory")
    export.add_argument("--run-dir", required=True, type=Path)
    export.add_argument("--to", required=True, help="s3://bucket/prefix or a directory")
    export.add_argument("--with-checkpoints", action="store_true", help="also copy the training checkpoints")
    return parser


def parse_size(text: str) -> int:
    """'5GB', '500MB', '1024' -> bytes (decimal units, as Hugging Face uses them)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    upper = text.strip().upper()
    for unit, factor in units.items():
        if upper.endswith(unit) and upper[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(upper[: -len(unit)]) * factor)
    if upper.isdigit():
        return int(upper)
    raise UserError(f"--max-shard-size {text}: not a size; allowed: a number of bytes or e.g. 500MB, 5GB")


def _common_arguments(parser: argparse.ArgumentParser, source: str, seq_len: int) -> None:
    parser.add_argument(
        "--source",
        default=source,
        help=f"hub dataset NAME[:CONFIG], or a .jsonl/.parquet/.txt file or directory (default: {source})",
    )
    parser.add_argument("--tokenizer", required=True, help="directory of a Hugging Face fast tokenizer")
    parser.add_argument("--seq-len", type=int, default=seq_len, help=f"tokens per block (default: {seq_len})")
    parser.add_argument("--out", required=True, type=Path, help="output directory (datasets.load_from_disk)")
    parser.add_argument("--split", default="train", help="split of a hub dataset (default: train)")
    parser.add_argument(
        "--num-proc", type=int, default=os.cpu_count() or 1, help="tokenizer threads (default: all cores)"
    )
    parser.add_argument("--skip-bad-records", action="store_true", help="skip and count undecodable records")
    parser.add_argument("--overwrite", action="store_true", help="replace an output made from other inputs")


def main(argv: Sequence[str] | None = None) -> int:
    arguments = build_parser().parse_args(argv)
    try:
        if arguments.command == "train":
            return _train(arguments)
        if arguments.command in ("submit", "status", "cancel", "sample", "export"):
            return _pipeline(arguments)
        manifest = _run(arguments)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    summary = {k: v for k, v in manifest.items() if k not in ("fingerprint",)}
    print(json.dumps(summary, indent=2, sort_keys=True))
    return 0


def _run(arguments: argparse.Namespace) -> dict[str, Any]:
    if arguments.command == "convert":
        return _convert(arguments)
    from training.data.prepare import PretrainOptions, SftOptions, prepare_pretrain, prepare_sft
    from training.data.sources import resolve_source

    if arguments.kind == "pretrain":
        return prepare_pretrain(
            PretrainOptions(
                source=arguments.source,
                tokenizer=arguments.tokenizer,
                seq_len=arguments.seq_len,
                out=arguments.out,
                text_column=arguments.text_column,
                split=arguments.split,
                num_proc=arguments.num_proc,
                max_documents=arguments.max_documents,
                add_bos=arguments.add_bos,
                add_eos=arguments.add_eos,
                pad_final=arguments.pad_final,
                skip_bad_records=arguments.skip_bad_records,
                overwrite=arguments.overwrite,
            )
        )
    validation = arguments.validation
    if validation is None and not resolve_source(arguments.source).is_local:
        validation = DEFAULT_SFT_VALIDATION_SPLIT
    return prepare_sft(
        SftOptions(
            source=arguments.source,
            tokenizer=arguments.tokenizer,
            seq_len=arguments.seq_len,
            out=arguments.out,
            messages_column=arguments.messages_column,
            split=arguments.split,
            validation=None if validation in (None, "none") else validation,
            num_proc=arguments.num_proc,
            max_examples=arguments.max_examples,
            skip_bad_records=arguments.skip_bad_records,
            overwrite=arguments.overwrite,
        )
    )


def _convert(arguments: argparse.Namespace) -> dict[str, Any]:
    from training.formats.convert import ConvertOptions, convert

    return convert(
        ConvertOptions(
            source_format=arguments.source_format,
            target_format=arguments.target_format,
            input=arguments.input,
            output=arguments.output,
            tp=arguments.tp,
            pp=arguments.pp,
            kv_multiplier=arguments.kv_multiplier,
            fuse_qkv=arguments.fuse_qkv,
            xser=arguments.xser,
            config=arguments.config,
            force=arguments.force,
            overwrite=arguments.overwrite,
            verify=arguments.verify,
            max_shard_bytes=parse_size(arguments.max_shard_size),
            workers=arguments.workers,
        )
    )


def _train(arguments: argparse.Namespace) -> int:
    from training.train.loop import run_from_cli
    from training.train.recipe import load_recipe

    recipe = load_recipe(arguments.recipe, arguments.overrides)
    return run_from_cli(
        recipe, resume=arguments.resume == "latest", compile_only=arguments.compile, metrics=arguments.metrics
    )


def _pipeline(arguments: argparse.Namespace) -> int:
    from training.pipeline import runs

    if arguments.command == "sample":
        from training.pipeline.sample import sample
        from training.train.recipe import load_recipe

        sample(load_recipe(arguments.recipe), arguments.model, arguments.out)
        return 0
    if arguments.command == "export":
        from training.pipeline.export import export

        export(arguments.run_dir, arguments.to, with_checkpoints=arguments.with_checkpoints)
        return 0
    site = runs.load_site(arguments.env_file)
    if arguments.command == "submit":
        runs.submit(
            arguments.recipe, arguments.overrides, run_id=arguments.run_id, site=site, dry_run=arguments.dry_run
        )
        return 0
    run_dir = runs.find_run_dir(site, arguments.run_id)
    if arguments.command == "cancel":
        runs.cancel(run_dir)
        return 0
    rows = runs.print_status(run_dir)
    return 1 if any(row["state"] not in ("COMPLETED", *runs.ACTIVE_STATES) for row in rows) else 0
