"""The CPU backend's bf16 regimes (`training.config.precision` says what each regime is): an AdamW that rounds
stochastically to bf16 (bf16-sr) and fp32 master copies of bf16 weights (bf16-mixed). On Neuron the runtime
and neuronx-distributed's optimizer do both.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn


def stochastic_round(value: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """fp32 -> bf16, rounding up with probability equal to the dropped fraction (unbiased on average).

    bf16 is the upper 16 bits of fp32: add uniform noise below them and truncate. The noise acts on the
    magnitude bits, so negative values round symmetrically.
    """
    bits = value.detach().float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, generator=generator, device=bits.device)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)


class StochasticRoundingAdamW(torch.optim.Optimizer):
    """AdamW on bf16 parameters with bf16 moments; the update is computed in fp32 and every result is rounded
    stochastically to bf16. The noise is a function of (seed, step, parameter number), so a resumed run draws
    what the uninterrupted one did."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        seed: int = 0,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.seed = seed

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        assert closure is None, "StochasticRoundingAdamW takes no closure"
        number = 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for parameter in group["params"]:
                number += 1
                if parameter.grad is None:
                    continue
                state = self.state[parameter]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(parameter)
                    state["exp_avg_sq"] = torch.zeros_like(parameter)
                state["step"] += 1
                step = int(state["step"])
                key = zlib.crc32(f"{self.seed}/{step}/{number}".encode())
                generator = torch.Generator(device=parameter.device).manual_seed(key)
                grad = parameter.grad.float()
                exp_avg = state["exp_avg"].float().mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                corrected = exp_avg / (1 - beta1**step)
                denominator = (exp_avg_sq / (1 - beta2**step)).sqrt_().add_(group["eps"])
                updated = parameter.float().mul_(1 - group["lr"] * group["weight_decay"])
                updated.addcdiv_(corrected, denominator, value=-group["lr"])
                parameter.copy_(stochastic_round(updated, generator))
                state["exp_avg"].copy_(stochastic_round(exp_avg, generator))
                state["exp_avg_sq"].copy_(stochastic_round(exp_avg_sq, generator))


class MasterWeights:
    """fp32 master copies of bf16 parameters (CPU side of bf16-mixed): gradients are accumulated into the
    copies in fp32 as each backward produces them, the optimizer updates the copies, and the bf16 weights
    are rounded from them after every step."""

    def __init__(self, parameters: Iterable[nn.Parameter]) -> None:
        self.copies: dict[nn.Parameter, nn.Parameter] = {}
        for parameter in parameters:
            if parameter in self.copies:
                continue
            master = nn.Parameter(parameter.detach().float().clone())
            if getattr(parameter, "sequence_parallel_enabled", False):
                master.sequence_parallel_enabled = True  # type: ignore[attr-defined]
            self.copies[parameter] = master
            parameter.register_post_accumulate_grad_hook(self._accumulate)  # type: ignore[no-untyped-call]

    def of(self, parameter: nn.Parameter) -> nn.Parameter:
        return self.copies[parameter]

    def _accumulate(self, parameter: torch.Tensor) -> None:
        assert isinstance(parameter, nn.Parameter) and parameter.grad is not None
        master = self.copies[parameter]
        if master.grad is None:
            master.grad = parameter.grad.float()
        else:
            master.grad.add_(parameter.grad)
        parameter.grad = None  # the bf16 gradient is gone as soon as it is added

    @torch.no_grad()
    def copy_to_model(self) -> None:
        for parameter, master in self.copies.items():
            parameter.copy_(master)

    def state_dict(self) -> list[torch.Tensor]:
        return [master.detach().clone() for master in self.copies.values()]

    def load_state_dict(self, masters: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for master, saved in zip(self.copies.values(), masters, strict=True):
                master.copy_(saved)
        self.copy_to_model()
