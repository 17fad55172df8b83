"""Training step time on CPU, in one run: our model (tp=1, the training job's code) against transformers' model
of the same config and weights, and our model's activation checkpointing against none.

    python benchmarks/bench_train.py [--steps 10] [--rounds 3] [--models llama mixtral] [--threads N] [--profile]

A step is forward, backward and an AdamW update on one batch, as the training job does it. All models get
the same weights (ours loaded from the converter's nxd output) and the same batches; rounds alternate the
models so a slow spell of the machine hits all of them, and each model's median step counts. Prints:

- ours (flash attention, the kernel transformers' sdpa attention uses too) against transformers
  (target: within 1.1x), with the spread of the per-round ratios: on a busy machine a single median moves by
  more than the target's margin, and the spread shows whether a difference is the code or the machine;
- with `--profile`, where the time goes: the operators whose time per step differs most between ours and
  transformers (torch.profiler, self CPU time);
- selective and full activation checkpointing against none, all with materialised attention scores (the
  planner's terms), with the bytes autograd keeps for backward (tests/support/saved_tensors.py) and how much
  of them each saves (targets: selective at most 1.15x the step time, full at most 1.4x).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

COMMON: dict[str, Any] = {
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}
BATCH, SEQ_LEN = 4, 256


def hf_model(architecture: str, directory: Path) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    if architecture == "llama":
        model: Any = LlamaForCausalLM(LlamaConfig(**COMMON))
    else:
        model = MixtralForCausalLM(MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **COMMON))
    model.save_pretrained(str(directory))
    return model


def our_model(directory: Path, work: Path, **execution: Any) -> Any:
    from training.config.model import ModelConfig
    from training.formats.convert import ConvertOptions, convert
    from training.formats.hf import read_config
    from training.model.transformer import Execution, build_model
    from training.train.checkpointing import load_pretrained

    weights = work / "nxd"
    if not weights.is_dir():
        convert(ConvertOptions(source_format="hf", target_format="nxd", input=directory, output=weights, tp=1))
    config, config_path = read_config(directory, None)
    model = build_model(ModelConfig.from_hf(config), seed=None, router_aux_loss=False, execution=Execution(**execution))
    load_pretrained(weights, config_path, model)
    return model


def saved_bytes(model: Any, input_ids: torch.Tensor) -> int:
    from tests.support.saved_tensors import saved_for_backward
    from training.train.loader import shift_labels

    with saved_for_backward(model) as saved:
        loss = model(input_ids, shift_labels(input_ids)).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return saved.bytes


def rounds_of(
    models: dict[str, tuple[Any, bool]], batches: list[torch.Tensor], steps: int, rounds: int
) -> dict[str, list[float]]:
    """Each round's median step time per model, rounds alternating between the models after one warm-up pass
    each, so a slow spell of the machine hits all of them."""
    for model, ours in models.values():
        step_times(model, batches, ours)  # warm-up: allocator, first-call overheads
    measured: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(rounds):
        for name, (model, ours) in models.items():
            measured[name].append(statistics.median(step_times(model, batches * (steps // 2), ours)))
    return measured


def spread(ours: list[float], reference: list[float]) -> str:
    """The per-round ratios' minimum, median and maximum."""
    ratios = sorted(o / r for o, r in zip(ours, reference, strict=True))
    return f"per-round ratios {ratios[0]:.2f} / {statistics.median(ratios):.2f} / {ratios[-1]:.2f} (min / median / max)"


def operator_times(model: Any, batches: list[torch.Tensor], ours: bool) -> dict[str, float]:
    """Self CPU seconds per step of each operator (torch.profiler) over the given batches."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        step_times(model, batches, ours)
    return {event.key: event.self_cpu_time_total / 1e6 / len(batches) for event in profiler.key_averages()}


def where_the_time_goes(reference: dict[str, float], ours: dict[str, float], top: int = 12) -> list[str]:
    """The operators whose time per step differs most, with both times in milliseconds."""
    names = sorted(set(reference) | set(ours), key=lambda name: -abs(ours.get(name, 0) - reference.get(name, 0)))
    lines = [f"  total: transformers {sum(reference.values()) * 1e3:.1f} ms, ours {sum(ours.values()) * 1e3:.1f} ms"]
    for name in names[:top]:
        mine, theirs = ours.get(name, 0) * 1e3, reference.get(name, 0) * 1e3
        lines.append(f"  {name[:58]:58s} transformers {theirs:7.1f} ms  ours {mine:7.1f} ms  ({mine - theirs:+.1f})")
    return lines


def step_times(model: Any, batches: list[torch.Tensor], ours: bool) -> list[float]:
    from training.train.loader import shift_labels

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for input_ids in batches:
        started = time.perf_counter()
        loss = model(input_ids, shift_labels(input_ids)).loss if ours else model(input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="measured steps per round and model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=["llama", "mixtral"], choices=["llama", "mixtral"])
    parser.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's own choice)")
    parser.add_argument("--profile", action="store_true", help="also print where the step time goes, per operator")
    arguments = parser.parse_args()
    if arguments.threads:
        torch.set_num_threads(arguments.threads)
    from training.model import parallel

    parallel.initialize(tp=1, backend="cpu")
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, COMMON["vocab_size"], (BATCH, SEQ_LEN), generator=generator) for _ in range(2)]
    print(f"{BATCH} x {SEQ_LEN} tokens per step, fp32, {torch.get_num_threads()} threads; median step in seconds")
    mib = 2**20
    for architecture in arguments.models:
        with tempfile.TemporaryDirectory() as folder:
            work = Path(folder)
            reference = hf_model(architecture, work / "hf").train()
            models = {
                "transformers": (reference, False),
                "ours": (our_model(work / "hf", work, flash_attention=True).train(), True),
            }
            for mode in ("none", "selective", "full"):
                models[mode] = (our_model(work / "hf", work, activation_checkpointing=mode).train(), True)
            measured = rounds_of(models, batches, arguments.steps, arguments.rounds)
            times = {name: statistics.median(values) for name, values in measured.items()}
            print(
                f"{architecture}: ours {times['ours']:.4f}, transformers {times['transformers']:.4f}: "
                f"ours is {times['ours'] / times['transformers']:.2f}x the transformers step time (target <= 1.1x); "
                + spread(measured["ours"], measured["transformers"])
            )
            if arguments.profile:
                profiled = {
                    name: operator_times(models[name][0], batches, models[name][1]) for name in ("transformers", "ours")
                }
                print(f"{architecture}: where the step time goes (self CPU time per step, largest differences)")
                print("\n".join(where_the_time_goes(profiled["transformers"], profiled["ours"])))
            kept = {mode: saved_bytes(models[mode][0], batches[0]) for mode in ("none", "selective", "full")}
            for mode, target in (("selective", 1.15), ("full", 1.4)):
                print(
                    f"{architecture}: {mode} checkpointing {times[mode]:.4f} against none {times['none']:.4f}: "
                    f"{times[mode] / times['none']:.2f}x the step time (target <= {target}x); keeps "
                    f"{kept[mode] / mib:.1f} MiB for backward instead of {kept['none'] / mib:.1f} MiB "
                    f"({1 - kept[mode] / kept['none']:.0%} saved)"
                )
    parallel.destroy()


if __name__ == "__main__":
    main()
