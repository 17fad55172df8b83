"""Start-up of a training job that loads weights, as it was (every layer and `initialize_weights` draw random
weights, then the checkpoint overwrites them) and as it is (nothing is initialised), in one run.

    python benchmarks/startup.py [--rounds 3]

Prints, "before" against "after" with their ratio:

1. the tiny recipes (tiny-llama-cpt at TP 2, tiny-mixtral-sft at PP 2: two processes under torchrun, from a
   `convert --to nxd` output, on the CPU backend): seconds from launching the job to its first step's
   metrics record, the largest per-rank peak host memory (ru_maxrss), the model build's seconds and the
   random values it makes (counted at torch's dispatcher, tests/support/random_values.py). "before" is the
   same job with the model built seeded, as `_run` built it before; rounds alternate the two;
2. a bigger model (Llama-shaped, ~156M parameters, one process): build plus `load_pretrained`, time and peak
   host memory;
3. extrapolated to the real recipes (llama31-8b-cpt: Llama 3.1 8B at TP 32; mixtral-8x7b-sft: Mixtral 8x7B
   at TP 32 x PP 2) on neuronx-distributed, from the layout's tensor shapes: the random values a rank made
   at start-up (each NxD layer draws its full fp32 master weight, `initialize_weights` every full fp32
   tensor), the largest transient tensor, and per node; the same formula on the tiny recipes is printed
   next to the measured count (CPU backend: the layers draw their shards);
4. the safety pass before NxD's loader on resume: bytes and time it read from the tiny job's checkpoint
   (every file whole before, the pickles now), and the second read of the real recipes' per-rank
   checkpoints (weights and ZeRO-1 optimizer shard, from `python -m training plan`) it no longer makes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODES = ("before", "after")
RECIPES = {"tiny-llama-cpt": ("llama", 2, 1), "tiny-mixtral-sft": ("mixtral", 1, 2)}  # architecture, tp, pp
REAL = ("llama31-8b-cpt", "mixtral-8x7b-sft")
GIB = 2**30
BIGGER = {
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}


def peak_rss() -> int:
    """This process's peak resident memory in bytes: the kernel's high-water mark of its address space
    (`VmHWM`), which is `getrusage(RUSAGE_SELF).ru_maxrss` except that ru_maxrss also keeps the peak of the
    parent's memory copied at fork (a child of this benchmark would report the benchmark's own peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --- 1. the tiny recipes' jobs ----------------------------------------------------------------------------


def job(recipe_name: str, mode: str, overrides: list[str], results: Path) -> None:
    """One rank of the job (run by torchrun): the training job itself, its model built as `mode` says."""
    from tests.support.random_values import random_values
    from training.config.recipe import load_recipe
    from training.train import loop

    recipe = load_recipe(recipe_name, overrides)
    build = loop.build_model
    measured: dict[str, Any] = {}

    def instrumented(config: dict[str, Any], **options: Any) -> Any:
        if mode == "before":
            options["seed"] = recipe.seed  # what `_run` passed before, loading weights or not
        with random_values():  # its first use costs a second or two of set-up: not the build's
            torch.empty(1).normal_(generator=torch.Generator())
        torch.distributed.barrier()  # the build's time, not the ranks' skew (it creates process groups)
        with random_values() as made:
            start = time.perf_counter()
            model = build(config, **options)
            measured["build_seconds"] = time.perf_counter() - start
        measured["random_bytes"] = made.bytes
        return model

    loop.build_model = instrumented  # type: ignore[assignment]
    loop.train(loop.TrainOptions(recipe=recipe))
    rank = int(os.environ.get("RANK", "0"))
    tp, pp = RECIPES[recipe_name][1:]
    record = {"rank": rank, "tp_rank": rank % tp, "pp_rank": rank // tp if pp > 1 else 0, "peak_rss": peak_rss()}
    (results / f"rank_{rank}.json").write_text(json.dumps(measured | record))


def launch_job(recipe: str, mode: str, world: dict[str, Path], work: Path) -> dict[str, Any]:
    checkpoints, results = work / "checkpoints", work / "results"
    results.mkdir(parents=True)
    overrides = [
        f"model.config={world['hf']}",
        f"model.pretrained={world['pretrained']}",
        f"data.path={world['data']}",
        f"checkpoint.dir={checkpoints}",
        "steps=2",
    ]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
    command += ["--job", recipe, mode, str(results), *overrides]
    launched = time.time()
    subprocess.run(command, check=True, capture_output=True, text=True)
    first = json.loads((checkpoints / "metrics.jsonl").read_text().splitlines()[0])
    ranks = [json.loads(p.read_text()) for p in sorted(results.glob("rank_*.json"))]
    return {
        "startup_seconds": first["time"] - launched,
        "peak_rss": max(r["peak_rss"] for r in ranks),
        "build_seconds": max(r["build_seconds"] for r in ranks),
        "random_bytes": {(r["tp_rank"], r["pp_rank"]): r["random_bytes"] for r in ranks},
        "checkpoint": checkpoints / "step_2",
    }


def tiny_recipes(rounds: int, work: Path) -> dict[str, dict[str, list[dict[str, Any]]]]:
    from training.local.tiny import build_tiny_world

    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for recipe, (architecture, tp, pp) in RECIPES.items():
        world = build_tiny_world(work / recipe / "world", architecture, tp=tp, pp=pp)
        runs[recipe] = {mode: [] for mode in MODES}
        for index in range(rounds):
            order = MODES if index % 2 == 0 else MODES[::-1]
            for mode in order:
                runs[recipe][mode].append(launch_job(recipe, mode, world, work / recipe / f"{mode}-{index}"))
    return runs


# --- 2. a bigger model in one process ---------------------------------------------------------------------


def bigger_build(mode: str, hf: Path, pretrained: Path, out: Path) -> None:
    """Build (as `mode` says) and load the bigger model, in this process; write time and peak memory."""
    from training.config.model import ModelConfig
    from training.formats.hf import read_config
    from training.model import parallel
    from training.model.transformer import build_model
    from training.train.checkpointing import load_pretrained

    config, config_path = read_config(hf, None)
    parallel.initialize(1, "cpu")
    baseline = peak_rss()
    start = time.perf_counter()
    model = build_model(ModelConfig.from_hf(config), seed=0 if mode == "before" else None)
    built = time.perf_counter() - start
    load_pretrained(pretrained, config_path, model)
    total = time.perf_counter() - start
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    result = {"build": built, "total": total, "peak": peak_rss(), "baseline": baseline, "parameters": parameters}
    out.write_text(json.dumps(result))
    parallel.destroy()


def bigger_model(rounds: int, work: Path) -> dict[str, list[dict[str, Any]]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from training.formats.convert import ConvertOptions, convert

    hf, pretrained = work / "bigger" / "hf", work / "bigger" / "nxd"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**BIGGER)).save_pretrained(str(hf))
    convert(ConvertOptions(source_format="hf", target_format="nxd", input=hf, output=pretrained, tp=1))
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for index in range(rounds):
        for mode in MODES if index % 2 == 0 else MODES[::-1]:
            out = work / "bigger" / f"{mode}-{index}.json"
            command = [sys.executable, __file__, "--bigger", mode, str(hf), str(pretrained), str(out)]
            subprocess.run(command, check=True, capture_output=True, text=True)
            runs[mode].append(json.loads(out.read_text()))
    return runs


# --- 3. the real recipes, from the layout -----------------------------------------------------------------


def initialisation(config: dict[str, Any], tp: int, pp: int, kv: int, dtype_bytes: int, nxd: bool) -> dict[int, Any]:
    """Per pipeline stage, what one rank's seeded build draws, from the layout's tensor shapes (no tensor is
    made: shards are sized on the meta device): `layers` bytes drawn by the layers' constructors (NxD: each
    parallel layer its full fp32 master weight; cpu backend: its shard in the parameter dtype; both: the
    experts' shards and the router, in the parameter dtype), `seeded` by `initialize_weights` (every full HF
    tensor of the stage, fp32), `transient` the largest block of full tensors alive at once."""
    from training.config.model import ModelSpec, Parallelism
    from training.formats.layouts import all_rules, hf_shapes

    spec = ModelSpec.from_config(config)
    shapes = hf_shapes(spec)
    stages: dict[int, Any] = {}
    for rules in all_rules(spec, Parallelism(tp=tp, pp=pp, kv_multiplier=kv, fuse_qkv=False), "nxd"):
        for rule in rules:
            stage = stages.setdefault(rule.stage, {"layers": 0, "seeded": 0, "transient": 0, "parameters": 0})
            full = sum(torch.Size(shapes[s]).numel() for s in rule.sources)
            shard = rule.split([torch.empty(shapes[s], device="meta") for s in rule.sources], 0).numel()
            stage["parameters"] += shard
            if rule.target.endswith("norm.weight"):
                continue  # ones, not random
            stage["seeded"] += 4 * full
            if "expert_mlps" in rule.target or "linear_router" in rule.target or not nxd:
                stage["layers"] += dtype_bytes * shard
                stage["transient"] = max(stage["transient"], 4 * full)
            else:
                stage["layers"] += 4 * full
                stage["transient"] = max(stage["transient"], 4 * full + dtype_bytes * full)  # master and its cast
    return stages


def real_recipes() -> list[dict[str, Any]]:
    from training.config.hardware import DEFAULT_HARDWARE
    from training.config.model import default_kv_multiplier
    from training.config.precision import PARAMETER_DTYPE
    from training.config.recipe import load_recipe
    from training.model.transformer import DTYPES
    from training.train import memory

    hardware = DEFAULT_HARDWARE
    rows = []
    for name in REAL:
        recipe = load_recipe(name)
        config = memory.model_config(recipe)
        assert config is not None, name
        workload = memory.workload_of(recipe, config, hardware)
        tp, pp = recipe.parallelism.tp, recipe.parallelism.pp
        kv = recipe.parallelism.kv_size_multiplier or default_kv_multiplier(workload.spec, tp)
        dtype_bytes = torch.empty((), dtype=DTYPES[PARAMETER_DTYPE[recipe.precision]]).element_size()
        stages = initialisation(config, tp, pp, kv, dtype_bytes, nxd=True)
        worst = max(stages.values(), key=lambda s: s["layers"] + s["seeded"])
        plan, _ = memory.report(recipe, hardware)
        checkpoint = (plan["breakdown_gib"]["weights"] + plan["breakdown_gib"]["optimizer state"]) * GIB
        rows.append(
            {
                "recipe": name,
                "layout": f"TP {tp}" + (f" x PP {pp}" if pp > 1 else ""),
                "parameters_per_rank": memory.parameters_per_core(workload),
                "random_bytes_per_rank": worst["layers"] + worst["seeded"],
                "transient_per_rank": worst["transient"],
                "ranks_per_node": hardware.cores_per_node,
                "checkpoint_bytes_per_rank": checkpoint,
            }
        )
    return rows


def generation_rate() -> float:
    """Bytes per second torch draws N(0, 1) fp32 values at on this machine (what `initialize_weights` does)."""
    tensor = torch.empty(64 * 2**20 // 4)
    start = time.perf_counter()
    for _ in range(4):
        tensor.normal_()
    return 4 * tensor.numel() * 4 / (time.perf_counter() - start)


# --- 4. the safety pass ----------------------------------------------------------------------------------


def read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar")


RANK_FILE = "dp_rank_00_tp_rank_00_pp_rank_00.pt"


def safety_pass(files: list[Path], rounds: int) -> dict[str, dict[str, float]]:
    """The files checked as before (every file whole) and as now (`data=False`: the pickles)."""
    from training.train.checkpointing import load_plain

    result = {}
    for mode, data in (("before", True), ("after", False)):
        times, read = [], 0
        for _ in range(rounds):
            start, before = time.perf_counter(), read_bytes()
            for path in files:
                load_plain(path, data=data)
            times.append(time.perf_counter() - start)
            read = read_bytes() - before
        result[mode] = {"bytes": read, "seconds": statistics.median(times), "files": len(files)}
    result["size"] = {"bytes": sum(p.stat().st_size for p in files)}
    return result


# --- report ------------------------------------------------------------------------------------------------


def ratio(before: float, after: float) -> str:
    return f"{before / after:.2f}x" if after else "inf"


def line(what: str, before: float, after: float, unit: str, scale: float = 1.0, digits: int = 2) -> None:
    shown = f"{before / scale:.{digits}f} {unit} -> {after / scale:.{digits}f} {unit}"
    print(f"    {what:<24}{shown:>34}  ({ratio(before, after)})")


def median_of(records: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(record[key]) for record in records)


def report_tiny(runs: dict[str, dict[str, list[dict[str, Any]]]], work: Path) -> None:
    from training.config.model import ModelSpec, default_kv_multiplier
    from training.formats.hf import read_config

    for recipe, modes in runs.items():
        b, a = modes["before"], modes["after"]
        print(f"  {recipe}:")
        line("launch to first step", median_of(b, "startup_seconds"), median_of(a, "startup_seconds"), "s")
        spread = {m: ", ".join(f"{r['startup_seconds']:.1f}" for r in modes[m]) for m in MODES}
        print(f"      (each run, s: before {spread['before']}; after {spread['after']}: imports and torchrun dominate)")
        line("peak memory, worst rank", median_of(b, "peak_rss"), median_of(a, "peak_rss"), "MiB", 2**20, 1)
        line("model build", median_of(b, "build_seconds"), median_of(a, "build_seconds"), "ms", 1e-3, 1)
        _, tp, pp = RECIPES[recipe]
        config, _ = read_config(work / recipe / "world" / "hf", None)
        kv = default_kv_multiplier(ModelSpec.from_config(config), tp)
        formula = initialisation(config, tp, pp, kv, 4, nxd=False)
        for (tp_rank, pp_rank), drawn in sorted(b[0]["random_bytes"].items()):
            expected = formula[pp_rank]["layers"] + formula[pp_rank]["seeded"]
            after = a[0]["random_bytes"][(tp_rank, pp_rank)]
            print(f"    random values, rank tp {tp_rank} pp {pp_rank}: {drawn} B -> {after} B (formula: {expected} B)")


def report_real(rate: float) -> None:
    for row in real_recipes():
        node, per_rank = row["ranks_per_node"], row["random_bytes_per_rank"]
        print(f"  {row['recipe']} ({row['layout']}, {row['parameters_per_rank'] / 1e6:.0f}M parameters per rank):")
        print(
            f"    random values drawn     {per_rank / GIB:6.1f} GiB per rank, {node * per_rank / GIB:6.0f} GiB per "
            f"node ({node} ranks), {per_rank / rate:.0f} s per rank at this machine's rate"
        )
        transient = row["transient_per_rank"]
        print(
            f"    largest transient       {transient / GIB:6.2f} GiB per rank, "
            f"{node * transient / GIB:6.0f} GiB per node"
        )
        again = row["checkpoint_bytes_per_rank"]
        print(
            f"    second read on resume   {again / GIB:6.2f} GiB per rank, {node * again / GIB:6.0f} GiB per node "
            "(weights + ZeRO-1 optimizer shard, as planned)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--job", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.add_argument("--bigger", nargs=4, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.job:
        recipe, mode, results, *overrides = arguments.job
        return job(recipe, mode, overrides, Path(results))
    if arguments.bigger:
        mode, hf, pretrained, out = arguments.bigger
        return bigger_build(mode, Path(hf), Path(pretrained), Path(out))

    with tempfile.TemporaryDirectory(prefix="bench-startup-") as directory:
        work = Path(directory)
        print(f"1. tiny recipes, CPU backend, 2 processes each, before -> after, median of {arguments.rounds} rounds")
        runs = tiny_recipes(arguments.rounds, work)
        report_tiny(runs, work)

        print("\n2. Llama-shaped model, ~156M parameters, fp32, one process: build + load_pretrained, median")
        bigger = bigger_model(arguments.rounds, work)
        b, a = bigger["before"], bigger["after"]
        print(
            f"    parameters {median_of(b, 'parameters') / GIB:.2f} GiB; peak memory "
            f"{median_of(b, 'baseline') / GIB:.2f} GiB before building"
        )
        line("build", median_of(b, "build"), median_of(a, "build"), "s")
        line("build + load", median_of(b, "total"), median_of(a, "total"), "s")
        line("peak host memory", median_of(b, "peak"), median_of(a, "peak"), "GiB", GIB)
        growth = [{"growth": r["peak"] - r["baseline"]} for r in b], [{"growth": r["peak"] - r["baseline"]} for r in a]
        line("  of it, for the model", median_of(growth[0], "growth"), median_of(growth[1], "growth"), "GiB", GIB)

        rate = generation_rate()
        print(
            "\n3. the real recipes on neuronx-distributed, before (now: 0); "
            f"N(0, 1) fp32 drawn at {rate / GIB:.2f} GiB/s here"
        )
        report_real(rate)

        step = runs["tiny-llama-cpt"]["after"][0]["checkpoint"]
        checkpoints = {
            "tiny-llama-cpt step_2, rank 0's files": [
                *(step / part / RANK_FILE for part in ("model", "optim")),
                *(step / name for name in ("scheduler.pt", "user_content.pt")),
            ],
            "the ~156M model's rank file": [work / "bigger" / "nxd" / "model" / RANK_FILE],
        }
        print("\n4. the safety pass before NxD's loader (files in the page cache), median")
        for name, files in checkpoints.items():
            checked = safety_pass(files, arguments.rounds)
            b_pass, a_pass = checked["before"], checked["after"]
            print(f"  {name} ({checked['size']['bytes'] / 2**20:.2f} MiB):")
            line("bytes read", b_pass["bytes"], a_pass["bytes"], "KiB", 1024, 1)
            line("time", b_pass["seconds"], a_pass["seconds"], "ms", 1e-3, 2)


if __name__ == "__main__":
    main()
