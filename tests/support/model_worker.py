"""One rank of the tensor-parallel model tests; run by `torchrun --standalone --nproc_per_node N`.

For every case of a JSON plan: initialise the facade (the case's backend, default cpu) at its TP degree,
load this rank's file of an NxD checkpoint (strict), run one forward and backward on this DP replica's
batch, and save what the test compares: gathered logits, loss, aux loss, per-parameter gradients, the
state dict after loading and the state dict of a freshly seeded model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.support.workers import worker_main
from training.config.model import IGNORE_INDEX, ModelConfig
from training.config.recipe import OptimizerSection
from training.model import parallel
from training.model.transformer import Execution, build_model, gather_logits
from training.train.neuron_training import neuron_trainer_options


def run_case(case: dict[str, Any], out: Path) -> None:
    backend = case.get("backend", "cpu")  # "neuron" in the neuron tier, under NxD's CPU mode
    trainer = neuron_trainer_options(OptimizerSection(lr=1e-3))
    parallel.initialize(case["tp"], backend, neuron_options=trainer, generation=case.get("generation", "trn1"))
    try:
        checkpoint = Path(case["checkpoint"])
        config = json.loads((checkpoint / "config.json").read_text())
        options = {
            "kv_multiplier": case.get("kv_multiplier"),
            "fuse_qkv": bool(case.get("fuse_qkv", False)),
            "moe_dispatch": case.get("moe_dispatch"),
            "router_aux_loss": case.get("router_aux_loss"),
            "execution": Execution(**case.get("execution", {})),
            "capacity_factor": case.get("capacity_factor"),
        }
        tp_rank, dp_rank = parallel.tp_rank(), parallel.dp_rank()
        rank_file = f"dp_rank_00_tp_rank_{tp_rank:02d}_pp_rank_00.pt"
        model = build_model(ModelConfig.from_hf(config), seed=None, **options)
        model.load_state_dict(torch.load(checkpoint / "model" / rank_file, weights_only=True), strict=True)
        loaded = local_state(model)

        ids = torch.tensor(case["batches"][dp_rank])
        labels = torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), IGNORE_INDEX)], dim=1)
        output = model(ids, labels)
        output.loss.backward()
        parallel.sum_sequence_parallel_gradients(model.parameters())  # what the optimizer does first
        grads = {
            name: parallel.local_view(p.grad).clone() for name, p in model.named_parameters(remove_duplicate=False)
        }

        norm = None
        if backend == "neuron":  # neuronx-distributed's own TP-aware norm, from the parameters' attributes
            from neuronx_distributed.parallel_layers.grads import get_grad_norm

            norm = float(get_grad_norm(list(model.parameters())))
        seeded = build_model(ModelConfig.from_hf(config), seed=case.get("seed", 7), **options)
        result = {
            "tp_rank": tp_rank,
            "dp_rank": dp_rank,
            "logits": gather_logits(output.logits.detach()),
            "loss": output.loss.detach(),
            "aux_loss": None if output.aux_loss is None else output.aux_loss.detach(),
            "grads": grads,
            "grad_norm": norm,
            "state_dict": loaded,
            "seeded_state_dict": local_state(seeded),
        }
        directory = out / case["name"]
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(result, directory / f"rank_{parallel.world_rank():02d}.pt")
    finally:
        parallel.destroy()


def local_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as rank files hold it (a DTensor's local shard on the torch-native backend)."""
    return {name: parallel.local_view(tensor).clone() for name, tensor in model.state_dict().items()}


def main() -> None:
    torch.manual_seed(0)
    worker_main(run_case)


if __name__ == "__main__":
    main()
