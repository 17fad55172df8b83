"""Flash attention on the neuron backend: neuronx-distributed's `nki_flash_attn_func` (its autograd function,
layouts and checks) over the stand-in NKI kernels (`tests/neuron/standins`: exact attention in the kernels'
layouts, each launch counted), on torch-xla's CPU device.

The kernels' contract is in the stand-in's comments. Here: NxD's wrapper with them equals torch's attention in
output and gradients, in both input layouts; and through the project's model, the flash forward kernel never
runs again in backward under selective activation checkpointing (it is outside every recomputed module),
while full checkpointing, which recomputes whole layers, runs it once per layer there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import neuron_standins  # type: ignore[import-not-found]  # on the tier's path
import pytest
import torch
import torch.nn.functional as F

from tests.neuron.one_rank import one_rank_neuron_backend

SEQ = 2048  # NxD's wrapper takes multiples of 2048 only (the kernel's KV tile)
BATCH, HEADS, HEAD_DIM = 2, 2, 16
LAYERS = 2
RTOL, ATOL = 1e-5, 1e-5  # fp32: both exact, summed in different orders


def xla_device() -> torch.device:
    import torch_xla

    return torch.device(torch_xla.device())


def run_graphs() -> None:
    import torch_xla

    torch_xla.sync()


# torch's autograd engine makes its per-device queues at the process's first backward, counting the devices
# that exist then: an XLA tensor's backward after a CPU-only one fails with "device_ready_queues_ ... INTERNAL
# ASSERT FAILED". So the XLA device is created on import, during collection, before any test's backward.
xla_device()


def labelled(label: str) -> Callable[[str], str]:
    """An `assert_close` message: the mismatch report under a label."""
    return lambda report: f"{label}: {report}"


def to_kernel_layout(transpose_nki_inputs: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """[B, H, S, d] to what `nki_flash_attn_func` takes: [B, H, d, S] with `transpose_nki_inputs`, else as is."""
    if transpose_nki_inputs:
        return lambda t: t.transpose(-1, -2).contiguous()
    return lambda t: t


@pytest.mark.parametrize(
    ("transpose_nki_inputs", "softmax_scale"),
    [(True, None), (True, 0.3), (False, None), (False, 0.3)],
    ids=["transposed-default-scale", "transposed-scale", "sequence-major-default-scale", "sequence-major-scale"],
)
def test_nxd_flash_attention_equals_torch_attention(transpose_nki_inputs: bool, softmax_scale: float | None) -> None:
    from neuronx_distributed.kernels.flash_attn import nki_flash_attn_func

    generator = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=generator) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(leaves[0], leaves[1], leaves[2], is_causal=True, scale=softmax_scale)
    expected.backward(dout)

    device, layout = xla_device(), to_kernel_layout(transpose_nki_inputs)
    inputs = [layout(t).to(device).requires_grad_() for t in (q, k, v)]
    neuron_standins.KERNEL_CALLS.clear()
    output: torch.Tensor = nki_flash_attn_func(
        *inputs,
        softmax_scale=softmax_scale,
        causal=True,
        mixed_precision=True,
        transpose_nki_inputs=transpose_nki_inputs,
    )
    assert dict(neuron_standins.KERNEL_CALLS) == {"flash_fwd": 1}
    output.backward(dout.to(device))
    assert dict(neuron_standins.KERNEL_CALLS) == {"flash_fwd": 1, "flash_attn_bwd": 1}
    run_graphs()

    assert output.shape == (BATCH, HEADS, SEQ, HEAD_DIM)  # [B, H, S, d] whichever layout went in
    torch.testing.assert_close(output.cpu(), expected.detach(), rtol=RTOL, atol=ATOL)
    for name, leaf, given in zip("qkv", leaves, inputs, strict=True):
        assert given.grad is not None and given.grad.shape == given.shape, name
        gradient = given.grad.cpu()
        gradient = gradient.transpose(-1, -2) if transpose_nki_inputs else gradient
        torch.testing.assert_close(gradient, leaf.grad, rtol=RTOL, atol=ATOL, msg=labelled(f"d{name}"))


CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped: the model repeats K/V to q's heads for the kernel
    "max_position_embeddings": SEQ,
    "tie_word_embeddings": False,
}


def forward_then_backward(checkpointing: str, flash: bool) -> tuple[dict[str, int], float, dict[str, torch.Tensor]]:
    """The tiny Llama's forward and backward on one sequence: the kernel launches during backward alone, the
    loss and the gradients."""
    from training.config.model import ModelConfig
    from training.model import parallel
    from training.model.transformer import Execution, build_model

    execution = Execution(activation_checkpointing=checkpointing, flash_attention=flash)  # type: ignore[arg-type]
    model = build_model(ModelConfig.from_hf(CONFIG), seed=0, execution=execution)
    ids = torch.randint(0, CONFIG["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))
    ids = ids.to(parallel.device())
    neuron_standins.KERNEL_CALLS.clear()
    loss = model(ids, ids).loss
    assert loss is not None
    forward = dict(neuron_standins.KERNEL_CALLS)
    assert forward == ({"flash_fwd": LAYERS} if flash else {}), forward
    neuron_standins.KERNEL_CALLS.clear()
    loss.backward()
    backward = dict(neuron_standins.KERNEL_CALLS)
    parallel.mark_step()
    gradients = {name: p.grad.cpu() for name, p in model.named_parameters() if p.grad is not None}
    return backward, float(loss.detach().cpu()), gradients


Run = dict[str, tuple[dict[str, int], float, dict[str, torch.Tensor]]]
RUNS = {"selective-flash": ("selective", True), "full-flash": ("full", True), "selective-core": ("selective", False)}


@pytest.fixture(scope="module")
def runs() -> Iterator[Run]:
    """Each setting's forward and backward, in this process as a one-rank torchrun job on the neuron backend."""
    with one_rank_neuron_backend():
        yield {name: forward_then_backward(*setting) for name, setting in RUNS.items()}


def test_selective_checkpointing_never_runs_the_flash_forward_again(runs: Run) -> None:
    """Issue 26: the flash kernel keeps what its backward needs (q, k, v, output, lse), so no recomputed
    region may contain it: with selective checkpointing, backward launches the backward kernel once per
    layer and the forward kernel not at all."""
    backward, loss, gradients = runs["selective-flash"]
    assert backward.get("flash_fwd", 0) == 0, backward
    assert backward == {"flash_attn_bwd": LAYERS}, backward
    assert torch.isfinite(torch.tensor(loss)) and gradients
    assert all(torch.isfinite(g).all() for g in gradients.values())


def test_full_checkpointing_runs_the_flash_forward_once_per_layer_in_backward(runs: Run) -> None:
    """The control: the count does see a recomputed flash forward (full checkpointing reruns each layer)."""
    backward, _, _ = runs["full-flash"]
    assert backward == {"flash_fwd": LAYERS, "flash_attn_bwd": LAYERS}, backward


def test_the_model_with_flash_attention_trains_as_without(runs: Run) -> None:
    """Through the model's own layout handling (heads, rotary embedding on [B, heads, d, S], grouped K/V): the
    same loss and gradients as the materialised core attention, both under selective checkpointing."""
    _, flash_loss, flash_gradients = runs["selective-flash"]
    _, core_loss, core_gradients = runs["selective-core"]
    assert flash_loss == pytest.approx(core_loss, rel=1e-5)
    assert flash_gradients.keys() == core_gradients.keys()
    for name, gradient in core_gradients.items():
        torch.testing.assert_close(flash_gradients[name], gradient, rtol=RTOL, atol=ATOL, msg=labelled(name))
