"""The CPU backend's training services (`training.train.backend.TrainingBackend`): torch.distributed over gloo.

Pipeline parallelism runs the 1F1B schedule over gloo point-to-point messages. Each rank holds one stage
(`CausalLM.stage`: contiguous layers, the embedding on the first stage, the final norm and head on the last).
One optimizer step runs M micro batches: stage s first runs PP - s - 1 forward passes (warm-up), then
alternates one forward and one backward pass, then finishes the backward passes (cool-down), so at most PP
micro batches' activations are held at once: the schedule neuronx-distributed's `NxDPPModel` runs on the
neuron backend. A forward message and a backward message cross between neighbours in the steady phase; each
exchange posts its sends and receives together (`torch.distributed.batch_isend_irecv`), so neither side can
block the other.

The optimizer step sums the sequence-parallel gradients over TP, averages over data parallelism, clips by the
global norm and updates; ZeRO-1 shards the optimizer state over the data-parallel ranks with torch's
ZeroRedundancyOptimizer, `bf16-mixed` keeps fp32 master weights and `bf16-sr` rounds stochastically
(`training.train.cpu_precision`). Checkpoints are plain torch.save rank files in neuronx-distributed's layout
(`training.train.checkpointing`), every file read back the safe way and checked before any state changes.
"""

from __future__ import annotations

import shutil
from collections import deque
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from training.config.backends import Backend
from training.config.model import ModelSpec, Parallelism
from training.config.recipe import OptimizerSection, Precision, Recipe
from training.errors import UserError
from training.formats.layouts import replicated_targets
from training.formats.lazy import shown
from training.formats.sharded import nxd_rank_file
from training.model import parallel
from training.model.transformer import CausalLM, CausalLMOutput, StageCarry
from training.train.backend import TrainingBackend
from training.train.checkpointing import (
    DONE,
    load_mapping,
    load_plain,
    optimizer_file,
    prune,
    restore_rng_of,
    save_atomically,
    save_rng,
    step_directory,
)
from training.train.cpu_precision import MasterWeights, StochasticRoundingAdamW
from training.train.optimizer import TrainingOptimizer
from training.train.pp_schedule import Batches, CarryShape, PPSchedule, StepResult, carry_of, carry_shape, flat

# --- pipeline parallelism: 1F1B over gloo --------------------------------------------------------------------


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


# --- the optimizer's backend part -----------------------------------------------------------------------------


class CpuOptimizer:
    """AdamW (or the stochastically rounding one) over the parameter groups, with master weights under
    bf16-mixed and torch's ZeRO-1 when asked and data parallelism shards."""

    def __init__(
        self,
        model: CausalLM,
        groups: list[dict[str, Any]],
        settings: OptimizerSection,
        *,
        precision: Precision,
        seed: int,
    ) -> None:
        self.settings = settings
        defaults: dict[str, Any] = {"lr": settings.lr, "betas": settings.betas, "eps": settings.eps}
        self.master = MasterWeights(model.parameters()) if precision == "bf16-mixed" else None
        if self.master is not None:
            master = self.master
            groups = [{**group, "params": [master.of(p) for p in group["params"]]} for group in groups]
        optimizer_class: Any = torch.optim.AdamW
        if precision == "bf16-sr":
            optimizer_class, defaults = StochasticRoundingAdamW, {**defaults, "seed": seed}
        self.inner: Any
        if settings.zero1 and parallel.dp_size() > 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.inner = ZeroRedundancyOptimizer(
                groups, optimizer_class=optimizer_class, process_group=parallel.dp_group(), **defaults
            )
        else:
            self.inner = optimizer_class(groups, **defaults)
        replicated = replicated_targets(model.spec, model.parallelism, "nxd")
        names = {name: self._trained(p) for name, p in model.named_parameters()}
        self.sharded = [p for n, p in names.items() if n not in replicated or parallel.tp_size() == 1]
        self.replicated = [p for n, p in names.items() if n in replicated and parallel.tp_size() > 1]

    def _trained(self, parameter: nn.Parameter) -> nn.Parameter:
        """The tensor the optimizer updates for a model parameter (its fp32 master copy under bf16-mixed)."""
        return self.master.of(parameter) if self.master is not None else parameter

    def step(self) -> torch.Tensor:
        trained = self.sharded + self.replicated
        parallel.sum_sequence_parallel_gradients(trained)
        self._average_over_data_parallel(trained)
        norm = torch.tensor(self._clip(), dtype=torch.float64)
        self.inner.step()
        if self.master is not None:
            self.master.copy_to_model()
        return norm

    def _average_over_data_parallel(self, trained: list[nn.Parameter]) -> None:
        if parallel.dp_size() == 1:
            return
        for parameter in trained:
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad, group=parallel.dp_group())
                parameter.grad /= parallel.dp_size()

    def _clip(self) -> float:
        """Global L2 norm over the whole model: sharded parameters summed over TP, replicated ones once."""

        def squares(parameters: list[nn.Parameter]) -> torch.Tensor:
            total = torch.zeros((), dtype=torch.float64)
            for parameter in parameters:
                if parameter.grad is not None:
                    total += parameter.grad.detach().double().pow(2).sum()
            return total

        sharded = squares(self.sharded)
        if parallel.tp_size() > 1:
            dist.all_reduce(sharded, group=parallel.tp_group())
        stage = sharded + squares(self.replicated)
        if parallel.pp_size() > 1:  # every stage holds other parameters
            dist.all_reduce(stage, group=parallel.pp_group())
        norm = float(stage.sqrt())
        if self.settings.grad_clip > 0 and norm > self.settings.grad_clip:
            scale = self.settings.grad_clip / (norm + 1e-6)
            for parameter in self.sharded + self.replicated:
                if parameter.grad is not None:
                    parameter.grad.mul_(scale)
        return norm

    def _local(self) -> Any:
        """The optimizer holding this rank's state: the local shard of torch's ZeRO-1 wrapper."""
        return getattr(self.inner, "optim", self.inner)

    def state_dict(self) -> dict[str, Any]:
        state = dict(self._local().state_dict())
        if self.master is not None:
            state["master_weights"] = self.master.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        masters = state.pop("master_weights", None)
        if self.master is not None:
            if masters is None:
                raise UserError(
                    "the checkpoint's optimizer state has no fp32 master weights (saved under another precision)"
                )
            self.master.load_state_dict(masters)
        self._local().load_state_dict(state)


# --- checkpoint rank files ------------------------------------------------------------------------------------


def _barrier() -> None:
    if dist.is_initialized() and parallel.world_size() > 1:
        dist.barrier()


def _checked_weights(path: Path, model: CausalLM) -> dict[str, Any]:
    state = load_plain(path)
    expected = model.state_dict()
    if not isinstance(state, dict) or set(state) != set(expected):
        names = sorted(set(expected) ^ set(state)) if isinstance(state, dict) else []
        detail = f" (differs in {', '.join(map(shown, names[:3]))})" if names else ""
        raise UserError(f"{path}: not this model's state dict{detail}; allowed: a checkpoint of this recipe's model")
    for name, tensor in expected.items():
        loaded = state[name]
        if not isinstance(loaded, torch.Tensor) or loaded.shape != tensor.shape:
            found = list(loaded.shape) if isinstance(loaded, torch.Tensor) else type(loaded).__name__
            raise UserError(f"{path}: {name}: {found} is not allowed; allowed: a tensor of shape {list(tensor.shape)}")
    return state


class CpuTraining:
    """The CPU backend's `TrainingBackend` (module docstring)."""

    name: Backend = "cpu"
    compiles_graphs = False

    def check_layout(self, spec: ModelSpec, parallelism: Parallelism) -> None:
        """Any layout the configuration allows runs here."""

    def parallel_options(self, recipe: Recipe) -> dict[str, Any]:
        return {}

    def pp_schedule(self, model: CausalLM, micro_batches: int, micro: int, seq_len: int, *, zero1: bool) -> PPSchedule:
        return OneFOneB(model, carry_shape(model, micro, seq_len))

    def optimizer(
        self,
        model: CausalLM,
        groups: list[dict[str, Any]],
        settings: OptimizerSection,
        *,
        precision: Precision,
        seed: int,
    ) -> CpuOptimizer:
        return CpuOptimizer(model, groups, settings, precision=precision, seed=seed)

    def save_checkpoint(
        self,
        directory: Path,
        step: int,
        model: CausalLM,
        optimizer: TrainingOptimizer,
        user_content: dict[str, Any],
        *,
        keep_last: int,
        xser: bool,
    ) -> Path:
        target = step_directory(directory, step)
        rank, tp, dp, pp = parallel.world_rank(), parallel.tp_rank(), parallel.dp_rank(), parallel.pp_rank()
        if rank == 0 and target.exists():
            shutil.rmtree(target)  # left by a run killed while saving this step: never marked done
        _barrier()
        if dp == 0:
            save_atomically(model.state_dict(), nxd_rank_file(target, tp, pp))
        save_atomically(optimizer.state_dict(), optimizer_file(target))
        save_rng(target)
        if rank == 0:
            save_atomically(optimizer.scheduler.state_dict(), target / "scheduler.pt")
            save_atomically(user_content, target / "user_content.pt")
        _barrier()
        if rank == 0:
            (target / DONE).write_text("1\n")
            (directory / "newest").write_text(f"{target.name}\n")
            prune(directory, keep_last)
        _barrier()
        return target

    def load_weights(self, directory: Path, step: int, model: CausalLM) -> None:
        path = nxd_rank_file(step_directory(directory, step), parallel.tp_rank(), parallel.pp_rank())
        model.load_state_dict(_checked_weights(path, model))

    def load_training_state(self, directory: Path, step: int, optimizer: TrainingOptimizer) -> dict[str, Any]:
        target = step_directory(directory, step)
        # Every file is read and checked before any state is changed.
        optimizer_state = load_mapping(optimizer_file(target), "the optimizer's state dict")
        scheduler_state = load_mapping(target / "scheduler.pt", "the schedule's state ({'last_epoch': step})")
        content = load_mapping(target / "user_content.pt", "the run's position ({'step': step, ...})")
        for path, state, key in (
            (target / "scheduler.pt", scheduler_state, "last_epoch"),
            (target / "user_content.pt", content, "step"),
        ):
            if type(state.get(key)) is not int or state[key] < 0:
                raise UserError(
                    f"{path}: {key}: {shown(state.get(key))} is not allowed; allowed: a step number, 0 or more"
                )
        optimizer.load_state_dict(optimizer_state)
        optimizer.scheduler.load_state_dict(scheduler_state)
        restore_rng_of(target)
        return content

    def compilations(self) -> int | None:
        return None  # nothing is compiled

    def graph_counters(self) -> dict[str, int]:
        return {}


TRAINING_BACKEND: TrainingBackend = CpuTraining()
