"""`make demo`: both recipes' tiny variants end to end on a real Slurm on this machine, no AWS account.

Starts the project's local Slurm, makes a tiny random Llama and Mixtral with a self-trained tokenizer, a
small corpus and a chat set (nothing is downloaded), submits both pipelines (and the Llama one again in
Trainium2's K/V layout) with the same job templates the cluster uses, waits, prints a summary and stops the
daemons it started.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

from training.config.site import Site
from training.errors import ArgumentParser, guarded
from training.local.tiny import make_tiny_sources
from training.logs import setup_logging
from training.pipeline.status import stage_states
from training.pipeline.submit import submit, wait

log = logging.getLogger(__name__)
RECIPES = {"tiny-llama-cpt": ("llama", "work/tiny-llama"), "tiny-mixtral-sft": ("mixtral", "work/tiny-mixtral")}
# The runs: each tiny recipe, and the Llama one again in Trainium2's K/V layout (its `generations.trn2` section).
RUNS = (("tiny-llama-cpt", ()), ("tiny-mixtral-sft", ()), ("tiny-llama-cpt", ("generation=trn2",)))


def summarize(run_dir: Path, results: Path, seconds: float) -> bool:
    rows = stage_states(run_dir)
    completed = all(row["state"] == "COMPLETED" for row in rows)
    print(f"\n== {run_dir.name}: {'COMPLETED' if completed else 'FAILED'} in {seconds:.0f} s")
    for row in rows:
        print(f"   {row['stage']:<12} {row['state']:<10} {row['elapsed']:>9}  {row.get('note', '')}")
        for line in row.get("log_tail", []):
            print(f"      | {line}")
    metrics = run_dir / "checkpoints" / "metrics.jsonl"
    if metrics.is_file():
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        first, last = records[0], records[-1]
        print(f"   loss: first {first['loss']:.4f} (step 1), last {last['loss']:.4f} (step {last['step']})")
    samples = run_dir / "samples.json"
    if samples.is_file():
        for sample in json.loads(samples.read_text())["samples"][:2]:
            print(f"   sample: {sample['prompt']!r} -> {sample['greedy']!r}")
    exported = results / run_dir.name
    if completed:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(exported / "hf"))
        print(f"   final model: {exported / 'hf'} ({type(model).__name__}, loads with from_pretrained)")
    print(f"   run directory: {run_dir}\n   results: {exported}")
    plot = exported / "metrics.png"
    if plot.is_file():
        print(f"   plot of loss and throughput: {plot}")
    if (exported / "tensorboard").is_dir():
        print(f"   TensorBoard: tensorboard --logdir {exported / 'tensorboard'}")
    return completed


def run_id(recipe: str, overrides: tuple[str, ...], stamp: str) -> str:
    """`tiny-llama-cpt-20261206-101500`, with the generation when an override names one (`...-trn2-...`)."""
    generations = [o.partition("=")[2] for o in overrides if o.startswith("generation=")]
    return "-".join([recipe, *generations, stamp])


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 every stage of every run completed, 1 a run failed, 2 user error (argparse's own included)."""
    parser = ArgumentParser(prog="python -m training.local.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3, help="local Slurm nodes (default 3)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds to wait for the runs")
    parser.add_argument("--keep-slurm", action="store_true", help="leave the local Slurm running afterwards")
    arguments = parser.parse_args(argv)
    return guarded(lambda: run(arguments.nodes, arguments.timeout, keep_slurm=arguments.keep_slurm), status=2)


def run(nodes: int, timeout: float, keep_slurm: bool) -> int:
    """The runs on a local Slurm of `nodes` nodes, each given `timeout` seconds."""
    from training.local.slurm import start

    setup_logging()
    for architecture, root in RECIPES.values():
        log.info(f"making {root}: tokenizer, random {architecture} model, data source")
        make_tiny_sources(Path(root), architecture)
    slurm = start(Path(".local-slurm"), nodes=nodes)
    # Slurm by its prefix, as on ParallelCluster (/opt/slurm/bin), not on PATH.
    site = Site(runs_root="work/runs", results="work/results", slurm_bin=str(slurm.bin_dir))
    try:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        started = time.monotonic()
        run_dirs = [
            Path(submit(recipe, list(extra), run_id=run_id(recipe, extra, stamp), site=site, dry_run=False)["run_dir"])
            for recipe, extra in RUNS
        ]
        ok = True
        for run_dir in run_dirs:
            wait(run_dir, timeout=timeout)
            ok &= summarize(run_dir, Path(site.results).absolute(), time.monotonic() - started)
    finally:
        if not keep_slurm:
            slurm.stop()
    print("\ndemo " + ("passed: every stage of every run COMPLETED" if ok else "FAILED (see above)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
