"""`convert`: checkpoints between the hf, nxd and nemo layouts."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from training.cli.common import Subcommands, add_command, options_from, print_summary
from training.config.hardware import GENERATIONS
from training.errors import UserError

EXAMPLES = {
    "convert": "{prog} convert --from hf --to nxd --input /fsx/models/Llama-3.1-8B --output /fsx/ckpt/llama --tp 32",
}
FORMATS = ("hf", "nxd", "nemo")


def add_arguments(commands: Subcommands, prog: str) -> None:
    convert = add_command(
        commands, "convert", "convert checkpoints between hf, nxd and nemo layouts", prog, EXAMPLES["convert"], run
    )
    convert.add_argument(
        "--from", dest="source_format", required=True, choices=FORMATS, help="layout of the input checkpoint"
    )
    convert.add_argument("--to", dest="target_format", required=True, choices=FORMATS, help="layout to write")
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
    convert.add_argument(
        "--target",
        choices=GENERATIONS,
        help="nxd: the Trainium generation whose K/V replica layout to write (default: trn1); an nxd input's is "
        "the one it records",
    )
    convert.add_argument("--xser", action="store_true", help="write torch_xla xser files (one file per tensor)")
    convert.add_argument("--config", type=Path, help="config.json for checkpoints that lack one")
    convert.add_argument("--force", action="store_true", help="read a step_N checkpoint without its 'done' marker")
    convert.add_argument(
        "--overwrite", action="store_true", help="replace an output directory holding another checkpoint"
    )
    convert.add_argument("--verify", action="store_true", help="read the output back and compare with the input")
    convert.add_argument(
        "--workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="threads cutting and writing shards (default: %(default)s)",
    )
    convert.add_argument(
        "--max-shard-size", default="2GB", help="hf output shard size; shards are written in parallel (default: 2GB)"
    )


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


def run(arguments: argparse.Namespace) -> int:
    from training.formats.convert import ConvertOptions, convert

    options = options_from(ConvertOptions, arguments, max_shard_bytes=parse_size(arguments.max_shard_size))
    return print_summary(convert(options))
