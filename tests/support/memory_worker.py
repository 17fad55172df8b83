"""One rank of the memory planner's tests; run by `torchrun --standalone --nproc_per_node N`.

For every case of a JSON plan: the facade at the case's TP degree, a seeded model of the case's config, and
one forward pass on this data-parallel rank's batch under the saved-tensor probe. Writes, per rank, the
parameters the rank holds and the bytes autograd keeps for backward.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.support.saved_tensors import saved_for_backward
from tests.support.workers import worker_main
from training.config.model import ModelConfig
from training.model import parallel
from training.model.transformer import Execution, build_model


def run_case(case: dict[str, Any], out: Path) -> None:
    parallel.initialize(case["tp"], "cpu")
    try:
        model = build_model(
            ModelConfig.from_hf(case["config"]),
            seed=0,
            dtype=case["dtype"],
            kv_multiplier=case.get("kv_multiplier"),
            moe_dispatch=case.get("moe_dispatch"),
            capacity_factor=case.get("capacity_factor"),
            router_aux_loss=True,
            execution=Execution(**case.get("execution", {})),
        )
        generator = torch.Generator().manual_seed(parallel.dp_rank())
        ids = torch.randint(0, case["config"]["vocab_size"], (case["micro"], case["seq_len"]), generator=generator)
        with saved_for_backward(model) as saved:
            output = model(ids, ids)
        assert output.loss is not None and torch.isfinite(output.loss)
        result = {
            "tp_rank": parallel.tp_rank(),
            "parameters": sum(p.numel() for p in model.parameters()),  # a tied weight once
            "saved_bytes": saved.bytes,
        }
        target = out / case["name"] / f"rank_{parallel.world_rank():02d}.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(result))
    finally:
        parallel.destroy()


def main() -> None:
    worker_main(run_case)


if __name__ == "__main__":
    main()
