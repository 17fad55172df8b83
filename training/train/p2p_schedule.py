"""The 1F1B pipeline schedule over torch.distributed point-to-point messages (the cpu backend's; the torch-native
backend runs torch.distributed.pipelining instead: `training.train.native_pipeline`).

Each rank holds one stage (`CausalLM.stage`: contiguous layers, the embedding on the first stage, the final norm
and head on the last). One optimizer step runs M micro batches: stage s first runs PP - s - 1 forward passes
(warm-up), then alternates one forward and one backward pass, then finishes the backward passes (cool-down), so
at most PP micro batches' activations are held at once: the schedule neuronx-distributed's `NxDPPModel` runs on
the neuron backend. A forward message and a backward message cross between neighbours in the steady phase; each
exchange posts its sends and receives together (`torch.distributed.batch_isend_irecv`), so neither side can
block the other.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from training.model import parallel
from training.model.transformer import CausalLM, CausalLMOutput, StageCarry
from training.train.pp_schedule import Batches, CarryShape, StepResult, carry_of, flat


class Pipe:
    """Messages to this rank's neighbouring stages (same TP and DP ranks)."""

    def __init__(self, model: CausalLM, shape: CarryShape) -> None:
        ranks = dist.get_process_group_ranks(parallel.pp_group())
        stage = model.stage.index
        self.previous = ranks[stage - 1] if stage > 0 else None
        self.next = ranks[stage + 1] if stage + 1 < len(ranks) else None
        self.shape, self.device = shape, parallel.device()

    def exchange(
        self, send: list[tuple[list[torch.Tensor], int]], receive: list[tuple[list[torch.Tensor], int]]
    ) -> None:
        operations = [dist.P2POp(dist.isend, t.contiguous(), peer) for tensors, peer in send for t in tensors]
        operations += [dist.P2POp(dist.irecv, t, peer) for tensors, peer in receive for t in tensors]
        if operations:
            for request in dist.batch_isend_irecv(operations):
                request.wait()

    def forward_buffers(self) -> list[torch.Tensor]:
        return self.shape.buffers(self.device)

    def backward_buffers(self) -> list[torch.Tensor]:
        hidden, *balance = self.shape.buffers(self.device)
        return [hidden] if not balance else [hidden, balance[1]]  # gradients of hidden and probability only


def _received(tensors: list[torch.Tensor]) -> StageCarry:
    """A received carry as leaves whose gradients go back: the hidden states and the router probabilities."""
    tensors[0].requires_grad_(True)
    if len(tensors) > 1:
        tensors[2].requires_grad_(True)
    return carry_of(tensors)


def _differentiable(carry: StageCarry) -> list[torch.Tensor]:
    return [carry.hidden] if carry.balance is None else [carry.hidden, carry.balance[1]]


class OneFOneB:
    """The 1F1B schedule (module docstring) of this rank's stage of one model."""

    def __init__(self, model: CausalLM, shape: CarryShape) -> None:
        self.model, self.shape = model, shape

    def train_step(self, batches: Batches) -> StepResult:
        return train_step(self.model, batches, self.shape)

    def forward_only(self, batches: Batches) -> torch.Tensor:
        return forward_only(self.model, batches, self.shape)


def train_step(model: CausalLM, batches: Batches, shape: CarryShape) -> StepResult:
    """Forward and backward of every micro batch of one step on this stage, 1F1B; gradients accumulate in the
    parameters, each micro batch's loss scaled by 1 / len(batches) as without stages."""
    stage, count = model.stage.index, model.stage.count
    pipe = Pipe(model, shape)
    micro_batches = len(batches)
    device = parallel.device()
    loss_sum = torch.zeros((), device=device)
    dropped: torch.Tensor | None = None
    in_flight: deque[tuple[StageCarry | None, torch.Tensor | StageCarry]] = deque()

    def receive_forward() -> StageCarry | None:
        if pipe.previous is None:
            return None
        buffers = pipe.forward_buffers()
        pipe.exchange([], [(buffers, pipe.previous)])
        return _received(buffers)

    def forward(index: int, received: StageCarry | None) -> torch.Tensor | StageCarry:
        nonlocal loss_sum, dropped
        ids, targets = (t.to(device) for t in batches[index])
        output = model.forward_stage(ids if received is None else received, targets if model.stage.last else None)
        choices = model.dropped_choices()
        if choices is not None:
            dropped = choices.detach() if dropped is None else dropped + choices.detach()
        if isinstance(output, CausalLMOutput):
            assert output.loss is not None
            loss_sum = loss_sum + output.loss.detach()
            return output.loss / micro_batches
        return output

    def backward(produced: torch.Tensor | StageCarry, gradients: list[torch.Tensor] | None) -> None:
        if isinstance(produced, torch.Tensor):
            produced.backward()  # type: ignore[no-untyped-call]
        else:
            assert gradients is not None
            outputs = _differentiable(produced)
            pairs = [(o, g) for o, g in zip(outputs, gradients, strict=True) if o.requires_grad]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

    def gradients_of(received: StageCarry | None) -> list[torch.Tensor] | None:
        if received is None:
            return None
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in _differentiable(received)]

    def send_forward(produced: torch.Tensor | StageCarry, receive_backward: bool) -> list[torch.Tensor] | None:
        send = [] if pipe.next is None else [(flat(produced), pipe.next)]  # type: ignore[arg-type]
        buffers = pipe.backward_buffers() if receive_backward and pipe.next is not None else None
        pipe.exchange(send, [] if buffers is None else [(buffers, pipe.next)])  # type: ignore[list-item]
        return buffers

    def send_backward(gradients: list[torch.Tensor] | None, receive_forward: bool) -> StageCarry | None:
        send = [] if gradients is None or pipe.previous is None else [(gradients, pipe.previous)]
        buffers = pipe.forward_buffers() if receive_forward and pipe.previous is not None else None
        pipe.exchange(send, [] if buffers is None else [(buffers, pipe.previous)])  # type: ignore[list-item]
        return None if buffers is None else _received(buffers)

    warmup = min(count - stage - 1, micro_batches)
    for index in range(warmup):
        received = receive_forward()
        produced = forward(index, received)
        send_forward(produced, receive_backward=False)
        in_flight.append((received, produced))
    steady = micro_batches - warmup
    received = receive_forward() if steady else None
    for step in range(steady):
        produced = forward(warmup + step, received)
        in_flight.append((received, produced))
        gradients = send_forward(produced, receive_backward=True)
        oldest_received, oldest_produced = in_flight.popleft()
        backward(oldest_produced, gradients)
        received = send_backward(gradients_of(oldest_received), receive_forward=step < steady - 1)
    for _ in range(warmup):
        buffers = pipe.backward_buffers() if pipe.next is not None else None
        pipe.exchange([], [] if buffers is None else [(buffers, pipe.next)])  # type: ignore[list-item]
        oldest_received, oldest_produced = in_flight.popleft()
        backward(oldest_produced, buffers)
        send_backward(gradients_of(oldest_received), receive_forward=False)
    return StepResult(loss_sum, dropped)


def forward_only(model: CausalLM, batches: Batches, shape: CarryShape) -> torch.Tensor:
    """The language-model loss (no balance loss) summed over micro batches, without gradients (validation);
    on the last stage, zero elsewhere."""
    pipe = Pipe(model, shape)
    device = parallel.device()
    total = torch.zeros((), device=device)
    with torch.no_grad():
        for ids, targets in batches:
            received = None
            if pipe.previous is not None:
                buffers = pipe.forward_buffers()
                pipe.exchange([], [(buffers, pipe.previous)])
                received = carry_of(buffers)
            output = model.forward_stage(ids.to(device) if received is None else received, targets.to(device))
            if isinstance(output, CausalLMOutput):
                assert output.loss is not None
                total += output.loss - output.aux_loss if output.aux_loss is not None else output.loss
            else:
                assert pipe.next is not None
                pipe.exchange([(flat(output), pipe.next)], [])
    return total
