"""Training step time on CPU: our model (tp=1, the training job's code) against transformers' model of the
same config and weights, in one run.

    python benchmarks/bench_train.py [--steps 10] [--rounds 3] [--models llama mixtral]

A step is forward, backward and an AdamW update on one batch, as the training job does it. Both models get
the same weights (ours loaded from the converter's nxd output) and the same batches; rounds alternate the
two models so a slow spell of the machine hits both, and each model's median step counts. Prints the ratio
(target: ours within 1.1x of transformers).
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


def our_model(directory: Path, work: Path) -> Any:
    from training.formats.convert import ConvertOptions, convert
    from training.formats.hf import read_config
    from training.model.transformer import build_model
    from training.train.checkpointing import load_pretrained

    weights = work / "nxd"
    convert(ConvertOptions(source_format="hf", target_format="nxd", input=directory, output=weights, tp=1))
    config, config_path = read_config(directory, None)
    model = build_model(config, seed=None, router_aux_loss=False)
    load_pretrained(weights, config_path, model)
    return model


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
    arguments = parser.parse_args()
    from training.model import parallel

    parallel.initialize(tp=1, backend="cpu")
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, COMMON["vocab_size"], (BATCH, SEQ_LEN), generator=generator) for _ in range(2)]
    print(f"{BATCH} x {SEQ_LEN} tokens per step, fp32, {torch.get_num_threads()} threads; median step in seconds")
    for architecture in arguments.models:
        with tempfile.TemporaryDirectory() as folder:
            work = Path(folder)
            reference = hf_model(architecture, work / "hf").train()
            ours = our_model(work / "hf", work).train()
            step_times(ours, batches, True)  # warm-up: allocator, first-call overheads
            step_times(reference, batches, False)
            measured: dict[str, list[float]] = {"ours": [], "transformers": []}
            for _ in range(arguments.rounds):
                measured["ours"] += step_times(ours, batches * (arguments.steps // 2), True)
                measured["transformers"] += step_times(reference, batches * (arguments.steps // 2), False)
            ours_median = statistics.median(measured["ours"])
            reference_median = statistics.median(measured["transformers"])
            print(
                f"{architecture}: ours {ours_median:.4f}, transformers {reference_median:.4f}: "
                f"ours is {ours_median / reference_median:.2f}x the transformers step time (target <= 1.1x)"
            )
    parallel.destroy()


if __name__ == "__main__":
    main()
