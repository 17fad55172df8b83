"""The torch-native backend's pipeline schedule: torch's own `torch.distributed.pipelining`.

Each rank's stage (`CausalLM.stage`) is a `PipelineStage` over the PP process group; one optimizer step's micro
batches run through `Schedule1F1B` (the schedule the cpu backend's `training.train.p2p_schedule` writes out by hand
and neuronx-distributed runs on the neuron backend), validation through a forward-only `ScheduleGPipe`.

What travels between stages is the shared carry (`training.train.pp_schedule`): the hidden states and, for Mixtral's
balance loss, its running sums. The stages are declared with example tensors (static metadata: no shape-inference
pass, which would run the model once more), in which the hidden states and the router probabilities carry
gradients back and the choice and row counts do not. The loss stays the model's own: the last stage's module
takes its micro batch's targets as a keyword argument (the schedule splits keyword arguments per micro batch and
hands them to the stage) and returns `forward_stage`'s loss, vocabulary-parallel cross entropy plus the balance
loss; the schedule's loss function only scales it by 1 / micro batches, as the unstaged model accumulates.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from training.model import parallel
from training.model.transformer import CausalLM, CausalLMOutput
from training.train.pp_schedule import Batches, StepResult, carry_of, carry_shape, flat

log = logging.getLogger(__name__)

Schedule = Schedule1F1B | ScheduleGPipe


class StageModule(nn.Module):
    """This rank's stage as a pipeline stage calls it: tensors in (the token ids on the first stage, the carry's
    tensors elsewhere), tensors out (the carry's, or the micro batch's loss on the last stage). What the schedule
    does not hand back, each micro batch's losses and dropped expert choices, is recorded as the stage runs."""

    def __init__(self, model: CausalLM) -> None:
        super().__init__()
        self.model = model
        self.losses: list[torch.Tensor] = []  # training loss (with the balance loss), per micro batch
        self.language_losses: list[torch.Tensor] = []  # without the balance loss (validation)
        self.dropped: torch.Tensor | None = None

    def reset(self) -> None:
        self.losses, self.language_losses, self.dropped = [], [], None

    def forward(self, *inputs: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        received = inputs[0] if self.model.stage.first else carry_of(inputs)
        output = self.model.forward_stage(received, labels)
        choices = self.model.dropped_choices()
        if choices is not None:
            self.dropped = choices.detach() if self.dropped is None else self.dropped + choices.detach()
        if not isinstance(output, CausalLMOutput):
            return tuple(t.contiguous() for t in flat(output))  # gloo sends contiguous tensors only
        assert output.loss is not None
        self.losses.append(output.loss.detach())
        aux = output.aux_loss
        self.language_losses.append((output.loss if aux is None else output.loss - aux).detach())
        return output.loss


def examples(model: CausalLM, micro: int, seq_len: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The stage's input and output tensors as shapes (on the meta device), for `PipelineStage`'s static metadata:
    which tensors travel, and which of them carry gradients back (the hidden states and router probabilities)."""

    def carry() -> tuple[torch.Tensor, ...]:
        tensors = carry_shape(model, micro, seq_len).buffers(torch.device("meta"))
        tensors[0].requires_grad_(True)  # the hidden states
        if len(tensors) > 1:
            tensors[2].requires_grad_(True)  # the router probabilities (chosen, probability, rows)
        return tuple(tensors)

    stage = model.stage
    ids = torch.empty((micro, seq_len), dtype=torch.long, device="meta")
    loss = torch.empty((), device="meta", requires_grad=True)
    return (ids,) if stage.first else carry(), (loss,) if stage.last else carry()


class TorchPipeline:
    """The `PPSchedule` of this rank's stage on torch.distributed.pipelining (module docstring)."""

    def __init__(self, model: CausalLM, micro_batches: int, micro: int, seq_len: int) -> None:
        self.model, self.module = model, StageModule(model)
        self.examples = examples(model, micro, seq_len)
        self.schedules: dict[tuple[int, bool], Schedule] = {}
        schedule = self.schedule(micro_batches, training=True)
        if parallel.world_rank() == 0:
            log.info(
                f"pipeline: torch.distributed.pipelining {type(schedule).__name__}, {model.stage.count} stages, "
                f"{micro_batches} micro batches per step"
            )

    def stage(self) -> PipelineStage:
        """A stage over the PP group (its ranks in stage order), its tensors declared up front (`examples`)."""
        inputs, outputs = self.examples
        stage = self.model.stage
        return PipelineStage(
            self.module,
            stage.index,
            stage.count,
            parallel.device(),
            input_args=inputs,
            output_args=outputs,
            group=parallel.pp_group(),
        )

    def schedule(self, micro_batches: int, *, training: bool) -> Schedule:
        """The schedule of `micro_batches` per step, made once: 1F1B for training (GPipe, the same arithmetic,
        when there are fewer micro batches than stages, which 1F1B refuses), a forward-only GPipe for validation.
        Each has its own stage: a stage holds one schedule's receive buffers."""
        key = (micro_batches, training)
        if key not in self.schedules:
            if not training:
                self.schedules[key] = ScheduleGPipe(self.stage(), micro_batches)
            else:
                kind = Schedule1F1B if micro_batches >= self.model.stage.count else ScheduleGPipe
                self.schedules[key] = kind(  # the stage returns the model's loss: the loss function only scales it
                    self.stage(), micro_batches, loss_fn=lambda loss, _targets: loss / micro_batches, scale_grads=False
                )
        return self.schedules[key]

    def run(self, batches: Batches, *, training: bool) -> None:
        """The micro batches through the schedule: the token ids into the first stage, the targets into the last
        (concatenated: the schedule splits them again along the batch dimension, into equal micro batches)."""
        self.module.reset()
        schedule = self.schedule(len(batches), training=training)
        stage, device = self.model.stage, parallel.device()
        ids = (torch.cat([i for i, _ in batches]).to(device),) if stage.first else ()
        targets = torch.cat([t for _, t in batches]).to(device) if stage.last else None
        labels: dict[str, Any] = {} if targets is None else {"labels": targets}
        target = targets if training else None  # the schedule hands the loss function a target: unused there
        schedule.step(*ids, target=target, return_outputs=False, **labels)

    def train_step(self, batches: Batches) -> StepResult:
        self.run(batches, training=True)
        return StepResult(self.total(self.module.losses), self.module.dropped)

    def forward_only(self, batches: Batches) -> torch.Tensor:
        with torch.no_grad():
            self.run(batches, training=False)
        return self.total(self.module.language_losses)

    @staticmethod
    def total(losses: list[torch.Tensor]) -> torch.Tensor:
        """The micro batches' losses summed (the last stage's; zero on the others)."""
        return sum(losses, torch.zeros((), device=parallel.device()))
