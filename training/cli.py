"""`python -m training ...`: one entry point for every step of the pipeline.

One convention for every subcommand: `--input` for the one path a command reads, `--output` for what it
writes, `--run-dir` for a run directory, `--site FILE` (or $TRAINING_SITE) for the site settings. Results
(JSON summaries, the `status` table) go to stdout, logs to stderr (`training.logs`). User mistakes
(training.errors.UserError), the operating system's refusals (a read-only or full disk, a missing
permission, a file where a directory is needed), undecodable text and argparse's own complaints are printed
as one line, `error: ...`, with exit status 2; nothing else is caught, so real bugs keep their traceback.
Also installed as the console script `trainium-training`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from training.config.recipe import bundled_recipes
from training.data.mixing import MixSource
from training.errors import UserError, decode_error, os_error, report
from training.logs import LEVEL_VARIABLE, setup_logging
from training.monitoring.neuron import NEURON_MONITOR

DEFAULT_PRETRAIN_SOURCE = "wikicorpus:raw_en"  # the first source document's corpus
DEFAULT_PRETRAIN_SEQ_LEN = 8192  # Llama 3.1 8B block size in the reference example
DEFAULT_SFT_SOURCE = "HuggingFaceH4/no_robots"  # the second source document's chat data
DEFAULT_SFT_SEQ_LEN = 2048
DEFAULT_SFT_VALIDATION_SPLIT = "test"


SCRIPT = "trainium-training"  # the console script ([project.scripts] in pyproject.toml)
PACKAGE = "trainium-training-environments"
SITE_VARIABLE = "TRAINING_SITE"  # default of --site
EXAMPLES = {  # one per subcommand, shown by --help; {prog} is `python -m training` or the console script
    "prepare pretrain": "{prog} prepare pretrain --tokenizer /fsx/models/Llama-3.1-8B --output /fsx/data/wikicorpus-8k",
    "prepare sft": "{prog} prepare sft --tokenizer /fsx/models/Mixtral-8x7B-v0.1 --output /fsx/data/no-robots-2k",
    "convert": "{prog} convert --from hf --to nxd --input /fsx/models/Llama-3.1-8B --output /fsx/ckpt/llama --tp 32",
    "train": "torchrun --nproc_per_node 32 -m training train --recipe llama31-8b-cpt --resume",
    "plan": "{prog} plan --recipe llama31-8b-cpt memory.activation_checkpointing=none --json",
    "submit": "{prog} submit --recipe llama31-8b-cpt --site /fsx/pipeline/site-default.yaml steps=100",
    "status": "{prog} status --site /fsx/pipeline/site-default.yaml",
    "cancel": "{prog} cancel --run-id llama31-8b-cpt-20250601-120000 --site /fsx/pipeline/site-default.yaml",
    "sample": "{prog} sample --recipe RUN_DIR/recipe.yaml --input RUN_DIR/hf --output RUN_DIR/samples.json",
    "evaluate": "{prog} evaluate --recipe RUN_DIR/recipe.yaml --input RUN_DIR/hf --base /fsx/models/Llama-3.1-8B "
    "--output RUN_DIR",
    "fetch": "{prog} fetch --recipe RUN_DIR/recipe.yaml --token-secret-arn SECRET_ARN --copy-to s3://BUCKET/fsx/models/M",
    "export": "{prog} export --run-dir RUN_DIR --output s3://BUCKET/results/RUN_ID --push-to-hub OWNER/NAME",
    "compile-cache restore": "{prog} compile-cache restore --run-dir /fsx/runs/llama31-8b-cpt-20250601-120000",
    "compile-cache save": "{prog} compile-cache save --run-dir /fsx/runs/llama31-8b-cpt-20250601-120000",
    "preflight": "{prog} preflight --run-dir /fsx/runs/llama31-8b-cpt-20250601-120000 --node",
    "monitor cluster": "{prog} monitor cluster --site /fsx/pipeline/site-default.yaml --dry-run",
    "monitor neuron": "{prog} monitor neuron --site /fsx/pipeline/site-default.yaml",
}


def program_name() -> str:
    """`trainium-training` when run as the console script, else `python -m training`."""
    return SCRIPT if Path(sys.argv[0]).name == SCRIPT else "python -m training"


def package_version() -> str:
    """The installed distribution's version, else the one in pyproject.toml (a source checkout)."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        found = (
            re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.MULTILINE) if pyproject.is_file() else None
        )
        return found.group(1) if found else "unknown"


def _epilog(prog: str) -> str:
    examples = "\n".join(f"  {example.format(prog=prog)}" for example in EXAMPLES.values())
    return (
        f"bundled recipes (--recipe NAME): {', '.join(bundled_recipes()) or '(none)'}\n\n"
        f"examples:\n{examples}\n\n"
        f"environment:\n"
        f"  {SITE_VARIABLE:<20}site settings file used when --site is not given (submit, status, cancel, monitor)\n"
        f"  {LEVEL_VARIABLE:<20}log level: DEBUG, INFO (default), WARNING or ERROR; logs go to stderr"
    )


def _command(commands: Any, name: str, text: str, prog: str, example: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(
        name,
        help=text,
        description=text,
        epilog=f"example:\n  {example.format(prog=prog)}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # flags are spelled out: an abbreviation would break when a flag is added
    )
    return parser


class _Parser(argparse.ArgumentParser):
    """argparse's complaints as this CLI's other errors: one `error:` line saying where help is, exit 2
    (subcommands' parsers are built from the same class)."""

    def error(self, message: str) -> NoReturn:
        report(UserError(f"{message} (see {self.prog} --help)"))
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    prog = program_name()
    parser = _Parser(
        prog=prog,
        description=__doc__.splitlines()[0],
        epilog=_epilog(prog),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    prepare = commands.add_parser(
        "prepare",
        help="tokenize and pack training data",
        description="tokenize and pack training data",
        epilog="examples:\n"
        + "\n".join(f"  {EXAMPLES[k].format(prog=prog)}" for k in ("prepare pretrain", "prepare sft")),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    ).add_subparsers(dest="kind", required=True, metavar="KIND")

    pretrain = _command(
        prepare,
        "pretrain",
        "a text corpus into fixed-length blocks for pretraining",
        prog,
        EXAMPLES["prepare pretrain"],
    )
    _common_arguments(pretrain, DEFAULT_PRETRAIN_SOURCE, DEFAULT_PRETRAIN_SEQ_LEN)
    pretrain.add_argument("--text-column", default="text", help="column holding the document text (default: text)")
    pretrain.add_argument(
        "--max-documents",
        type=int,
        action=_PerSourceOption,
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

    sft = _command(
        prepare,
        "sft",
        "chat conversations into packed blocks with assistant-only labels",
        prog,
        EXAMPLES["prepare sft"],
    )
    _common_arguments(sft, DEFAULT_SFT_SOURCE, DEFAULT_SFT_SEQ_LEN)
    sft.add_argument("--messages-column", default="messages", help="column of [{role, content}] lists")
    sft.add_argument(
        "--validation",
        action=_PerSourceOption,
        help=f"validation data: a split name for a hub dataset (default: {DEFAULT_SFT_VALIDATION_SPLIT}), "
        "a file or directory for local data (default: none); 'none' to skip; after a --source of a mix: that "
        "source's (a mix's validation split holds each source's validation examples whole)",
    )
    sft.add_argument(
        "--max-examples",
        type=int,
        action=_PerSourceOption,
        help="stop after this many examples per split (after a --source: of that source; default: all)",
    )

    formats = ("hf", "nxd", "nemo")
    convert = _command(
        commands, "convert", "convert checkpoints between hf, nxd and nemo layouts", prog, EXAMPLES["convert"]
    )
    convert.add_argument(
        "--from", dest="source_format", required=True, choices=formats, help="layout of the input checkpoint"
    )
    convert.add_argument("--to", dest="target_format", required=True, choices=formats, help="layout to write")
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
        "--workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="threads cutting and writing shards (default: %(default)s)",
    )
    convert.add_argument(
        "--max-shard-size", default="2GB", help="hf output shard size; shards are written in parallel (default: 2GB)"
    )

    recipe_help = "recipe YAML file, or the name of a bundled recipe (listed by --help)"
    train = _command(
        commands, "train", "train with a recipe (launch with torchrun, one process per worker)", prog, EXAMPLES["train"]
    )
    train.add_argument("--recipe", required=True, help=recipe_help)
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides, e.g. batch.micro=2")
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in checkpoint.dir if there is one (else start fresh)",
    )
    train.add_argument(
        "--compile", action="store_true", help="run exactly 2 steps and save nothing (for neuron_parallel_compile)"
    )
    train.add_argument("--metrics", type=Path, help="JSON lines file (default: <checkpoint.dir>/metrics.jsonl)")

    plan = _command(
        commands,
        "plan",
        "memory per NeuronCore of a recipe against the device's (and the cheapest fix when it does not fit); the run's "
        "tokens, time and cost",
        prog,
        EXAMPLES["plan"],
    )
    plan.add_argument("--recipe", required=True, help=recipe_help)
    plan.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides, e.g. nodes=8")
    plan.add_argument(
        "--instance-type",
        default="trn1.32xlarge",
        choices=["trn1.32xlarge", "trn1n.32xlarge", "trn1.2xlarge"],
        help="the training nodes (default: trn1.32xlarge)",
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")

    site_help = (
        f"site settings YAML: runs root, results, python, partition... (default: ${SITE_VARIABLE}, "
        "else local defaults: runs in work/runs)"
    )
    submit = _command(
        commands,
        "submit",
        "submit a recipe's whole pipeline to Slurm as one dependency graph",
        prog,
        EXAMPLES["submit"],
    )
    submit.add_argument("--recipe", required=True, help=recipe_help)
    submit.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides, e.g. steps=100")
    submit.add_argument("--run-id", help="name of the run (default: <recipe>-<UTC time>); an existing run resumes")
    submit.add_argument("--site", type=Path, metavar="FILE", help=site_help)
    submit.add_argument("--dry-run", action="store_true", help="print the job scripts and the graph, submit nothing")
    for name, text in (
        ("status", "stages of a run with Slurm state, time and training progress"),
        ("cancel", "cancel every job of a run"),
    ):
        command = _command(commands, name, text, prog, EXAMPLES[name])
        command.add_argument(
            "--run-id",
            required=name == "cancel",
            help="the run" + (" (default: the newest)" if name == "status" else ""),
        )
        command.add_argument("--site", type=Path, metavar="FILE", help=site_help)

    sample = _command(
        commands, "sample", "greedy and top-k answers of a trained Hugging Face model", prog, EXAMPLES["sample"]
    )
    sample.add_argument("--recipe", required=True, help="recipe (prompts, chat format): " + recipe_help)
    sample.add_argument("--input", required=True, type=Path, help="Hugging Face model directory to read")
    sample.add_argument("--output", required=True, type=Path, help="JSON file to write")

    evaluate = _command(
        commands,
        "evaluate",
        "lm-evaluation-harness tasks of the recipe on a trained model and its base, with the recipe's gate",
        prog,
        EXAMPLES["evaluate"],
    )
    evaluate.add_argument("--recipe", required=True, help="recipe (its evaluate section): " + recipe_help)
    evaluate.add_argument("--input", required=True, type=Path, help="Hugging Face model directory to evaluate")
    evaluate.add_argument(
        "--base",
        type=Path,
        help="base model directory to compare with (default: the recipe's model.config when evaluate.base is true)",
    )
    evaluate.add_argument(
        "--output", required=True, type=Path, help="directory for evaluation.json and evaluation.md (the run's)"
    )

    export = _command(
        commands,
        "export",
        "copy a run's model, metrics, samples and logs to S3 or a directory",
        prog,
        EXAMPLES["export"],
    )
    export.add_argument("--run-dir", required=True, type=Path, help="run directory (<runs_root>/<run-id>)")
    export.add_argument("--output", required=True, help="where to copy: s3://bucket/prefix or a directory")
    export.add_argument("--with-checkpoints", action="store_true", help="also copy the training checkpoints")
    export.add_argument(
        "--overwrite", action="store_true", help="replace a local export made from other files (S3: always replaced)"
    )

    export.add_argument(
        "--push-to-hub", metavar="OWNER/NAME", help="then push hf/ to this Hub repository (created private)"
    )
    export.add_argument(
        "--hub-token-secret-arn", metavar="ARN", help="Secrets Manager secret holding the Hub write token for the push"
    )
    export.add_argument("--public", action="store_true", help="create the Hub repository public instead of private")
    export.add_argument(
        "--push-despite-gate", action="store_true", help="push although the run's evaluation gate failed"
    )

    compile_cache = commands.add_parser(
        "compile-cache",
        help="keep the Neuron compile cache in the results bucket (the compile stage's first and last commands)",
        description="keep the Neuron compile cache in the results bucket, by a key of what decides the graphs",
        epilog="examples:\n"
        + "\n".join(f"  {EXAMPLES[k].format(prog=prog)}" for k in ("compile-cache restore", "compile-cache save")),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    ).add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, text in (
        ("restore", "before compiling: the promoted cache of the run's key into the site's compile_cache, verified"),
        ("save", "after compiling: the cache's finished entries to staging, then promoted by the deployment"),
    ):
        command = _command(compile_cache, action, text, prog, EXAMPLES[f"compile-cache {action}"])
        command.add_argument("--run-dir", required=True, type=Path, help="run directory (<runs_root>/<run-id>)")

    fetch = _command(
        commands,
        "fetch",
        "download the recipe's base model from the Hugging Face Hub (model.hub) into model.config, verified",
        prog,
        EXAMPLES["fetch"],
    )
    fetch.add_argument("--recipe", required=True, help="recipe with model.hub: " + recipe_help)
    fetch.add_argument(
        "--token-secret-arn", metavar="ARN", help="Secrets Manager secret holding the Hub token (gated models)"
    )
    fetch.add_argument("--copy-to", metavar="S3_URI", help="also upload the model there (s3://bucket/prefix)")
    fetch.add_argument("--overwrite", action="store_true", help="replace an earlier fetch of another revision")
    fetch.add_argument(
        "--tokenizer-only",
        action="store_true",
        help="only the tokenizer and configuration files (what `prepare` reads), into --output",
    )
    fetch.add_argument("--output", metavar="DIR", help="with --tokenizer-only: where (default: model.config)")

    preflight = _command(
        commands,
        "preflight",
        "the preflight stage's checks of the training nodes (run by its job: --node on every node, then once)",
        prog,
        EXAMPLES["preflight"],
    )
    preflight.add_argument("--run-dir", required=True, type=Path, help="run directory (<runs_root>/<run-id>)")
    step = preflight.add_mutually_exclusive_group()
    step.add_argument("--node", action="store_true", help="this node's checks, written to <run>/preflight/<node>.json")
    step.add_argument(
        "--verify", action="store_true", help="in the training job: say whether it runs on the checked nodes"
    )
    step.add_argument(
        "--canary",
        action="store_true",
        help="the decision, which runs COMMAND (the canary's srun) on a Neuron site once the other checks passed",
    )
    step.add_argument(
        "--watch",
        action="store_true",
        help="on every node: run COMMAND (the canary's torchrun) while neuron-monitor samples the device memory",
    )
    preflight.add_argument("wrapped", nargs="*", metavar="COMMAND", help="after `--`: what --canary or --watch runs")

    monitor = commands.add_parser(
        "monitor",
        help="publish the cluster's metrics to CloudWatch (the site's metrics_namespace and region)",
        description="publish the cluster's metrics to CloudWatch (the site's metrics_namespace and region)",
        epilog="examples:\n"
        + "\n".join(f"  {EXAMPLES[k].format(prog=prog)}" for k in ("monitor cluster", "monitor neuron")),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    ).add_subparsers(dest="target", required=True, metavar="TARGET")
    cluster = _command(
        monitor,
        "cluster",
        "one pass on the head node: Slurm jobs and nodes, running training jobs, failed stages of the newest run",
        prog,
        EXAMPLES["monitor cluster"],
    )
    neuron = _command(
        monitor,
        "neuron",
        "on a Trainium node, until neuron-monitor exits: NeuronCore utilisation and device memory every minute",
        prog,
        EXAMPLES["monitor neuron"],
    )
    for command in (cluster, neuron):
        command.add_argument("--site", type=Path, metavar="FILE", help=site_help)
        command.add_argument(
            "--dry-run", action="store_true", help="print the PutMetricData requests as JSON lines, send nothing"
        )
    neuron.add_argument(
        "--neuron-monitor",
        default=NEURON_MONITOR,
        metavar="PATH",
        help="the neuron-monitor executable (default: %(default)s, from aws-neuronx-tools)",
    )
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


class _SourceOption(argparse.Action):
    """`--source` starts one source of a mix; the options of `_PerSourceOption` after it are that source's."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        namespace.mix = [*(namespace.mix or []), {"source": values}]


class _PerSourceOption(argparse.Action):
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


def _common_arguments(parser: argparse.ArgumentParser, source: str, seq_len: int) -> None:
    parser.set_defaults(mix=None)
    parser.add_argument(
        "--source",
        action=_SourceOption,
        help="hub dataset NAME[:CONFIG], or a .jsonl/.parquet/.txt file or directory; repeat it to mix several "
        f"(default: {source})",
    )
    parser.add_argument(
        "--weight",
        type=float,
        action=_PerSourceOption,
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
        action=_PerSourceOption,
        help="split of a hub dataset (after a --source: of that source; default: train)",
    )
    parser.add_argument(
        "--num-proc", type=int, default=os.cpu_count() or 1, help="tokenizer threads (default: all cores)"
    )
    parser.add_argument("--skip-bad-records", action="store_true", help="skip and count undecodable records")
    parser.add_argument("--overwrite", action="store_true", help="replace an output made from other inputs")


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 done, 1 `status` of a failed run, a `plan` that does not fit, an `evaluate` whose gate
    failed, `monitor neuron` once neuron-monitor has exited or a `preflight` that found a problem, 2 user error
    (argparse's own errors included)."""
    arguments = build_parser().parse_args(argv)
    try:
        setup_logging(training=arguments.command == "train")
        if arguments.command == "train":
            return _train(arguments)
        if arguments.command == "plan":
            return _plan(arguments)
        if arguments.command == "evaluate":
            return _evaluate(arguments)
        if arguments.command in ("submit", "status", "cancel", "sample", "export", "fetch"):
            return _pipeline(arguments)
        if arguments.command == "monitor":
            return _monitor(arguments)
        if arguments.command == "compile-cache":
            return _compile_cache(arguments)
        if arguments.command == "preflight":
            return _preflight(arguments)
        manifest = _run(arguments)
    except UserError as error:
        report(error)
        return 2
    except OSError as error:
        report(os_error(error))
        return 2
    except UnicodeDecodeError as error:
        report(decode_error(error))
        return 2
    summary = {k: v for k, v in manifest.items() if k not in ("fingerprint",)}
    print(json.dumps(summary, indent=2, sort_keys=True))
    return 0


def _run(arguments: argparse.Namespace) -> dict[str, Any]:
    if arguments.command == "convert":
        return _convert(arguments)
    from training.data.prepare import PretrainOptions, SftOptions, prepare_pretrain, prepare_sft

    if arguments.seed < 0:
        raise UserError(f"--seed {arguments.seed}: must be 0 or more")
    if arguments.kind == "pretrain":
        mix = _mix(arguments, DEFAULT_PRETRAIN_SOURCE, "max_documents")
        return prepare_pretrain(
            PretrainOptions(
                source=mix[0].source,
                tokenizer=arguments.tokenizer,
                seq_len=arguments.seq_len,
                out=arguments.output,
                text_column=arguments.text_column,
                split=arguments.split,
                num_proc=arguments.num_proc,
                max_documents=arguments.max_documents,
                add_bos=arguments.add_bos,
                add_eos=arguments.add_eos,
                pad_final=arguments.pad_final,
                skip_bad_records=arguments.skip_bad_records,
                overwrite=arguments.overwrite,
                mix=mix,
                seed=arguments.seed,
            )
        )
    mix = _sft_validation(_mix(arguments, DEFAULT_SFT_SOURCE, "max_examples"), arguments.validation)
    return prepare_sft(
        SftOptions(
            source=mix[0].source,
            tokenizer=arguments.tokenizer,
            seq_len=arguments.seq_len,
            out=arguments.output,
            messages_column=arguments.messages_column,
            split=arguments.split,
            num_proc=arguments.num_proc,
            max_examples=arguments.max_examples,
            skip_bad_records=arguments.skip_bad_records,
            overwrite=arguments.overwrite,
            mix=mix,
            seed=arguments.seed,
        )
    )


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
    from training.config.recipe import load_recipe
    from training.train.loop import run_from_cli

    recipe = load_recipe(arguments.recipe, arguments.overrides)
    return run_from_cli(recipe, resume=arguments.resume, compile_only=arguments.compile, metrics=arguments.metrics)


def _plan(arguments: argparse.Namespace) -> int:
    from training.config.recipe import load_recipe
    from training.train.forecast import forecast_of
    from training.train.memory import HARDWARE, report

    recipe = load_recipe(arguments.recipe, arguments.overrides)
    hardware = HARDWARE[arguments.instance_type]
    data, text = report(recipe, hardware)
    forecast = forecast_of(recipe, hardware)
    data["forecast"] = None if forecast is None else forecast.as_dict()
    if forecast is not None:
        text += "\n" + forecast.describe()
    print(json.dumps(data, indent=2) if arguments.json else text)
    return 0 if data["fits"] else 1


def _evaluate(arguments: argparse.Namespace) -> int:
    from training.config.recipe import load_recipe
    from training.pipeline.evaluate import evaluate

    recipe = load_recipe(arguments.recipe)
    if recipe.evaluate is None:
        raise UserError(f"--recipe {arguments.recipe}: no evaluate section (tasks and limits to run)")
    base = arguments.base
    if base is None and recipe.evaluate.base:
        base = Path(recipe.model.config)
    report = evaluate(recipe.evaluate, arguments.input, base, arguments.output)
    print(json.dumps({"tasks": report["tasks"], "gate": report["gate"]}, indent=2, sort_keys=True))
    if not report["gate"]["passed"]:
        print(f"error: evaluation gate failed: {'; '.join(report['gate']['failures'])}", file=sys.stderr)
        return 1
    return 0


def site_file(given: Path | None, environ: Mapping[str, str] = os.environ) -> Path | None:
    """--site, else $TRAINING_SITE, else None (the local defaults)."""
    if given is not None:
        return given
    from_environment = environ.get(SITE_VARIABLE, "").strip()
    return Path(from_environment) if from_environment else None


def _monitor(arguments: argparse.Namespace) -> int:
    from training.config.site import load_site
    from training.monitoring.cloudwatch import required_namespace

    path = site_file(arguments.site)
    site = load_site(path)
    namespace = required_namespace(site, str(path or "the local site defaults"))
    if arguments.target == "cluster":
        from training.monitoring.cluster import monitor_cluster

        monitor_cluster(site, namespace, dry_run=arguments.dry_run)
        return 0
    from training.monitoring.neuron import monitor_neuron

    return monitor_neuron(site, namespace, dry_run=arguments.dry_run, executable=arguments.neuron_monitor)


def _compile_cache(arguments: argparse.Namespace) -> int:
    from training.pipeline import compile_cache

    action = compile_cache.save if arguments.action == "save" else compile_cache.restore
    print(json.dumps(action(arguments.run_dir), sort_keys=True))
    return 0


def _preflight(arguments: argparse.Namespace) -> int:
    from training.pipeline import preflight

    if arguments.node:
        return preflight.run_node(arguments.run_dir)
    if arguments.verify:
        return preflight.verify_nodes(arguments.run_dir)
    if bool(arguments.wrapped) != (arguments.canary or arguments.watch):
        raise UserError("preflight: a COMMAND after `--` goes with --canary or --watch, and only with them")
    if arguments.watch:
        return preflight.watch_canary(arguments.run_dir, arguments.wrapped)
    return preflight.run_job(arguments.run_dir, arguments.wrapped or None)


def _pipeline(arguments: argparse.Namespace) -> int:
    from training.pipeline import run_record, status, submit
    from training.pipeline.slurm_client import ACTIVE_STATES

    if arguments.command == "sample":
        from training.config.recipe import load_recipe
        from training.pipeline.sample import sample

        sample(load_recipe(arguments.recipe), arguments.input, arguments.output)
        return 0
    if arguments.command == "export":
        from training.pipeline.export import export

        if arguments.push_to_hub is not None:
            from training.pipeline.hub import check_hub_repo

            check_hub_repo("--push-to-hub", arguments.push_to_hub)
        export(
            arguments.run_dir,
            arguments.output,
            with_checkpoints=arguments.with_checkpoints,
            overwrite=arguments.overwrite,
        )
        if arguments.push_to_hub is not None:
            from training.pipeline.hub import push_model, read_token

            token = read_token(arguments.hub_token_secret_arn) if arguments.hub_token_secret_arn else None
            push_model(
                arguments.run_dir,
                arguments.push_to_hub,
                token=token,
                private=not arguments.public,
                despite_gate=arguments.push_despite_gate,
            )
        return 0
    if arguments.command == "fetch":
        from training.config.recipe import load_recipe
        from training.pipeline.hub import fetch_model, read_token, tokenizer_source

        recipe = load_recipe(arguments.recipe)
        if recipe.model.hub is None:
            raise UserError(f"--recipe {arguments.recipe}: no model.hub section (where to download the model from)")
        if arguments.copy_to is not None and not arguments.copy_to.startswith("s3://"):
            raise UserError(f"--copy-to {arguments.copy_to!r} is not allowed; allowed: s3://bucket/prefix")
        if arguments.output is not None and not arguments.tokenizer_only:
            raise UserError("--output is not allowed without --tokenizer-only (the model goes to model.config)")
        if arguments.tokenizer_only and arguments.copy_to is not None:
            raise UserError("--copy-to is not allowed with --tokenizer-only (only a whole model is copied)")
        token = read_token(arguments.token_secret_arn) if arguments.token_secret_arn else None
        source = tokenizer_source(recipe.model.hub) if arguments.tokenizer_only else recipe.model.hub
        result = fetch_model(
            source,
            Path(arguments.output or recipe.model.config),
            token=token,
            copy_to=arguments.copy_to,
            overwrite=arguments.overwrite,
        )
        print(json.dumps({k: v for k, v in result.items() if k != "files"}, sort_keys=True))
        return 0
    from training.config.site import load_site

    site = load_site(site_file(arguments.site))
    if arguments.command == "submit":
        submit.submit(
            arguments.recipe, arguments.overrides, run_id=arguments.run_id, site=site, dry_run=arguments.dry_run
        )
        return 0
    run_dir = run_record.find_run_dir(site, arguments.run_id)
    if arguments.command == "cancel":
        submit.cancel(run_dir)
        return 0
    rows = status.print_status(run_dir)
    return 1 if any(row["state"] not in ("COMPLETED", *ACTIVE_STATES) for row in rows) else 0
