"""What activation checkpointing runs again in backward, counted at the operator level.

With flash attention on, neither `selective` nor `none` may run the flash kernel's forward in backward (its
own backward kernel recomputes the score blocks; a recomputed module around it would run the whole forward a
second time for almost no memory saved); `full` recomputes each layer, the kernel included. `selective`
still recomputes the MLP activation, so the counter sees recomputation where there is some.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from training.config.model import ModelConfig
from training.model import parallel
from training.model.transformer import Execution, build_model

LAYERS = 2
CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
# torch's CPU flash attention kernel: forward and backward are separate operators
FLASH_FORWARD = "_scaled_dot_product_flash_attention_for_cpu.default"
SILU_FORWARD = "silu.default"


class OperatorCounts(TorchDispatchMode):
    """Counts every aten operator that runs inside it (instrumentation of torch; our code runs as it is)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func.__name__)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def single_process() -> Iterator[None]:
    parallel.initialize(1, "cpu")
    yield
    parallel.destroy()


def backward_counts(checkpointing: str, flash: bool) -> Counter[str]:
    execution = Execution(activation_checkpointing=checkpointing, flash_attention=flash)  # type: ignore[arg-type]
    model = build_model(ModelConfig.from_hf(CONFIG), seed=0, execution=execution)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(0))
    loss = model(ids, ids).loss
    assert loss is not None
    with OperatorCounts() as counting:
        loss.backward()
    return counting.counts


@pytest.mark.parametrize(
    ("checkpointing", "flash_in_backward", "activation_in_backward"),
    [("none", 0, 0), ("selective", 0, LAYERS), ("full", LAYERS, LAYERS)],
)
def test_flash_kernel_never_runs_again_in_backward_under_selective(
    checkpointing: str, flash_in_backward: int, activation_in_backward: int, single_process: None
) -> None:
    counts = backward_counts(checkpointing, flash=True)
    assert counts[FLASH_FORWARD] == flash_in_backward
    assert counts[SILU_FORWARD] == activation_in_backward


def test_selective_recomputes_the_attention_core_without_flash(single_process: None) -> None:
    """Without flash attention the materialised attention core is what selective recomputes: its softmax
    runs again in backward, once per layer."""
    selective = backward_counts("selective", flash=False)
    plain = backward_counts("none", flash=False)
    assert selective["_softmax.default"] - plain["_softmax.default"] == LAYERS
