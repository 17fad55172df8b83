"""Pipeline stages on the neuron backend: neuronx-distributed's `NxDPPModel` runs the 1F1B schedule.

Its manual partition mode (`manual_pp_partition=True`) takes the model as a list of modules, each called with
one object and returning one, and a function placing each on a stage. The list here has one entry per stage:
this rank's (`StageModule`, around the `CausalLM` that holds only this stage's layers, under the global names
of the converter's pp_rank files) and placeholders for the others, which live on other ranks. So the
parameters the optimizer updates and the checkpoints save are the model's own, named as without stages;
`NxDPPModel` schedules, sends and receives, and nothing else.

Between stages travels the carry as a tuple (the hidden states and, for Mixtral, the balance loss's running
sums): NxD's serializer sends each of its tensors and sends back the gradient of each that requires one. The
labels reach only NxD's loss function (`manual_pp_loss_fn`), so the last stage's module hands its input on,
and the loss function runs that stage: its layers, the norm, the head and the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from training.model import parallel
from training.model.transformer import CausalLM, CausalLMOutput, StageCarry
from training.train.stages import StepResult, carry_of, flat


class StageModule(nn.Module):
    """This rank's stage as NxD's manual partition calls it; counts the capacity dispatch's dropped choices."""

    def __init__(self, model: CausalLM) -> None:
        super().__init__()
        self.model = model
        self.dropped: torch.Tensor | None = None
        self.validating = False

    def forward(self, received: Any) -> tuple[Any, ...]:
        if self.model.stage.last:
            return (received,)  # run by `loss`, where the labels are
        output = self.model.forward_stage(self._inputs(received))
        assert isinstance(output, StageCarry)
        self._count_dropped()
        return tuple(flat(output))

    def loss(self, received: Any, labels: torch.Tensor) -> torch.Tensor:
        """The last stage and its loss: with the balance loss in training, the language-model loss alone in
        validation (as the cpu backend's `forward_only`)."""
        output = self.model.forward_stage(self._inputs(received), labels)
        assert isinstance(output, CausalLMOutput) and output.loss is not None
        self._count_dropped()
        if self.validating and output.aux_loss is not None:
            return output.loss - output.aux_loss
        return output.loss

    def _inputs(self, received: Any) -> torch.Tensor | StageCarry:
        if self.model.stage.first:
            ids: torch.Tensor = received[0]  # NxD hands the first stage its micro batch of each model input
            return ids
        return carry_of(list(received))

    def _count_dropped(self) -> None:
        choices = self.model.dropped_choices()
        if choices is not None and not self.validating:
            self.dropped = choices.detach() if self.dropped is None else self.dropped + choices.detach()


def by_position(layers: Sequence[nn.Module], stages: int) -> dict[nn.Module, int]:
    """NxD's partition function: the list holds one module per stage, in stage order."""
    if len(layers) != stages:
        raise AssertionError(f"{len(layers)} stage modules for {stages} pipeline stages")
    return {layer: index for index, layer in enumerate(layers)}


class NxDPipeline:
    """`NxDPPModel` over this rank's stage: one for training (the step's micro batches) and, when asked, one
    for validation (its own count of micro batches, fixed in NxD's schedule)."""

    def __init__(self, model: CausalLM, micro_batches: int, *, zero1: bool) -> None:
        self.model, self.zero1 = model, zero1
        self.stage = StageModule(model)
        self._schedules: dict[int, Any] = {micro_batches: self._schedule(micro_batches)}

    def _schedule(self, micro_batches: int) -> Any:
        from neuronx_distributed.pipeline import NxDPPModel

        stage = self.model.stage
        layers = [self.stage if index == stage.index else nn.Identity() for index in range(stage.count)]
        return NxDPPModel(
            layers,
            num_microbatches=micro_batches,
            manual_pp_partition=True,
            manual_pp_stage_partition_fn=by_position,
            manual_pp_loss_fn=self.stage.loss,
            # NxD's optimizer wrapper averages the gradients over data parallelism (or ZeRO-1 reduce-scatters
            # them), not the pipeline; the loss stays on the device, read in the step closure.
            use_optimizer_wrapper=True,
            use_zero1_optimizer=self.zero1,
            return_loss_on_cpu=False,
        )

    def _run(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *, train: bool) -> torch.Tensor:
        """The micro batches' summed loss on the last stage, zero elsewhere."""
        count = len(batches)
        if count not in self._schedules:
            self._schedules[count] = self._schedule(count)
        schedule = self._schedules[count]
        inputs = torch.cat([ids for ids, _ in batches])  # on the host: NxD's loader moves each micro batch
        labels = torch.cat([targets for _, targets in batches])
        run = schedule.run_train if train else schedule.run_eval
        mean: torch.Tensor | None = run(inputs=inputs, labels=labels)
        if mean is None:  # not the last stage
            return torch.zeros((), device=parallel.device())
        return mean * count

    def train_step(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        self.stage.dropped = None
        loss_sum = self._run(batches, train=True)
        return StepResult(loss_sum, self.stage.dropped)

    def forward_only(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        self.stage.validating = True
        try:
            return self._run(batches, train=False)
        finally:
            self.stage.validating = False
