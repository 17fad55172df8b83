"""The precision regimes on the CPU backend: which dtype every weight, gradient and optimizer state has, fp32
gradient accumulation under bf16-mixed, and stochastic rounding that is unbiased where rounding to nearest
loses small updates. (The same dtypes under neuronx-distributed's ZeRO-1: tests/neuron/test_backend.py.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.tiny_models import llama
from training.config.model import ModelConfig
from training.config.precision import PARAMETER_DTYPE
from training.config.recipe import OptimizerSection, Precision, ScheduleSection
from training.model import parallel
from training.model.transformer import build_model
from training.train.backend import training_backend
from training.train.cpu_precision import StochasticRoundingAdamW, stochastic_round
from training.train.optimizer import TrainingOptimizer

CPU = training_backend("cpu")


@pytest.fixture
def single_process() -> Iterator[None]:
    parallel.initialize(1, "cpu")
    yield
    parallel.destroy()


def backward_twice(model: torch.nn.Module) -> None:
    """Two micro batches into the same gradients, as the training loop accumulates them."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        ids = torch.randint(0, 64, (2, 8), generator=generator)
        model(ids, ids).loss.backward()


# regime: (parameters, gradients the optimizer reads, AdamW moments, what the optimizer updates)
EXPECTED = {
    "fp32": (torch.float32, torch.float32, torch.float32, torch.float32),
    "bf16-mixed": (torch.bfloat16, torch.float32, torch.float32, torch.float32),
    "bf16-sr": (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16),
}


@pytest.mark.parametrize("precision", list(EXPECTED))
def test_every_tensor_has_the_regimes_dtype(precision: Precision, tmp_path: Path, single_process: None) -> None:
    config = json.loads((llama(tmp_path / "hf") / "config.json").read_text())
    model = build_model(ModelConfig.from_hf(config), seed=0, dtype=PARAMETER_DTYPE[precision])
    optimizer = TrainingOptimizer(
        model, OptimizerSection(lr=1e-2), ScheduleSection(), 10, backend=CPU, precision=precision
    )
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    backward_twice(model)
    parameters, gradients, moments, updated = EXPECTED[precision]
    trained = [p for group in optimizer.inner.param_groups for p in group["params"]]
    assert {p.dtype for p in model.parameters()} == {parameters}
    assert {p.dtype for p in trained} == {updated}
    assert {p.grad.dtype for p in trained if p.grad is not None} == {gradients}
    if precision == "bf16-mixed":  # accumulated into the fp32 copies, none left on the bf16 weights
        assert all(p.grad is None for p in model.parameters())
    optimizer.step()
    states = [t for state in optimizer.inner.state.values() for k, t in state.items() if k.startswith("exp_avg")]
    assert len(states) == 2 * len(trained) and {t.dtype for t in states} == {moments}
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters() if not n.endswith("norm.weight"))
    if precision == "bf16-mixed":  # the bf16 weights are the fp32 masters rounded
        assert optimizer.master is not None
        assert all(torch.equal(p, optimizer.master.of(p).to(p.dtype)) for p in model.parameters())


def test_mixed_accumulates_micro_batch_gradients_in_fp32(tmp_path: Path, single_process: None) -> None:
    """The fp32 sum of each micro batch's bf16 gradient, not a bf16 running sum (which rounds every add)."""
    config = json.loads((llama(tmp_path / "hf") / "config.json").read_text())
    model = build_model(ModelConfig.from_hf(config), seed=0, dtype=torch.bfloat16)
    singles = []
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 64, (2, 8), generator=generator) for _ in range(2)]
    for ids in batches:
        model.zero_grad(set_to_none=True)
        model(ids, ids).loss.backward()
        singles.append({n: p.grad.clone() for n, p in model.named_parameters()})
    optimizer = TrainingOptimizer(
        model, OptimizerSection(lr=1e-2), ScheduleSection(), 10, backend=CPU, precision="bf16-mixed"
    )
    model.zero_grad(set_to_none=True)
    for ids in batches:
        model(ids, ids).loss.backward()
    assert optimizer.master is not None
    for name, parameter in model.named_parameters():
        expected = singles[0][name].float() + singles[1][name].float()
        assert torch.equal(optimizer.master.of(parameter).grad, expected), name


def test_stochastic_rounding_is_unbiased_where_nearest_rounding_is_not() -> None:
    value = torch.full((200_000,), 1.0 + 2**-10)  # an eighth of the way from 1 to the next bf16 value, 1 + 2**-7
    rounded = stochastic_round(value, torch.Generator().manual_seed(0)).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert float(rounded.mean()) == pytest.approx(1.0 + 2**-10, abs=2e-5)
    assert float(value.to(torch.bfloat16).float().mean()) == 1.0  # to nearest: the update is lost
    negative = stochastic_round(-value, torch.Generator().manual_seed(1)).float()
    assert float(negative.mean()) == pytest.approx(-(1.0 + 2**-10), abs=2e-5)


def test_stochastic_rounding_adamw_keeps_updates_below_half_a_bf16_step() -> None:
    """A constant gradient with a learning rate far below bf16's resolution at 1.0: AdamW with rounding to
    nearest never moves the weights; with stochastic rounding they move by about the fp32 update on average."""
    steps, lr = 50, 2**-12  # Adam's first steps move each weight by ~lr; half a bf16 step at 1.0 is 2**-8
    weights = {}
    for name, optimizer_class in (("sr", StochasticRoundingAdamW), ("nearest", torch.optim.AdamW)):
        parameter = torch.nn.Parameter(torch.ones(10_000, dtype=torch.bfloat16))
        optimizer = optimizer_class([parameter], lr=lr)
        for _ in range(steps):
            parameter.grad = torch.ones_like(parameter)
            optimizer.step()
        weights[name] = parameter.detach().float()
    assert torch.equal(weights["nearest"], torch.ones(10_000))
    assert float(weights["sr"].mean()) == pytest.approx(1.0 - steps * lr, rel=2e-3)
