"""The neuron backend's training services (`training.train.backend.TrainingBackend`): neuronx-distributed.

Pipeline parallelism: NxD's `NxDPPModel` runs the 1F1B schedule. Its manual partition mode
(`manual_pp_partition=True`) takes the model as a list of modules, each called with one object and returning
one, and a function placing each on a stage. The list here has one entry per stage: this rank's (`StageModule`,
around the `CausalLM` that holds only this stage's layers, under the global names of the converter's pp_rank
files) and placeholders for the others, which live on other ranks. So the parameters the optimizer updates and
the checkpoints save are the model's own, named as without stages; `NxDPPModel` schedules, sends and receives,
and nothing else. Between stages travels the carry as a tuple (`training.train.pp_schedule.flat`): NxD's
serializer sends each of its tensors and sends back the gradient of each that requires one. The labels reach
only NxD's loss function (`manual_pp_loss_fn`), so the last stage's module hands its input on, and the loss
function runs that stage: its layers, the norm, the head and the loss.

The optimizer: NxD's wrapper does the data-parallel reduction, the TP-aware clipping and ZeRO-1 (with fp32
master weights, derived from the parameters when the wrapper is built: so the pretrained weights are loaded
first). Checkpoints: NxD's own `save_checkpoint` / `load_checkpoint` (xser files when asked), every file of
this rank checked the safe way before NxD's loader unpickles it. Graph counters: torch-xla's metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training.config.backends import Backend
from training.config.model import ModelSpec, Parallelism
from training.config.precision import neuron_mixed_precision_config
from training.config.recipe import OptimizerSection, Precision, Recipe
from training.model import parallel
from training.model.transformer import CausalLM, CausalLMOutput, StageCarry
from training.train.backend import TrainingBackend
from training.train.checkpointing import load_plain, restore_rng_of, save_rng, step_directory
from training.train.cpu_precision import MasterWeights
from training.train.optimizer import TrainingOptimizer
from training.train.pp_schedule import Batches, StepResult, carry_of, flat
from training.train.watchdog import COMPILED

# --- pipeline parallelism: NxDPPModel ------------------------------------------------------------------------


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


class NxDSchedule:
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

    def _run(self, batches: Batches, *, train: bool) -> torch.Tensor:
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

    def train_step(self, batches: Batches) -> StepResult:
        self.stage.dropped = None
        loss_sum = self._run(batches, train=True)
        return StepResult(loss_sum, self.stage.dropped)

    def forward_only(self, batches: Batches) -> torch.Tensor:
        self.stage.validating = True
        try:
            return self._run(batches, train=False)
        finally:
            self.stage.validating = False


# --- the optimizer ---------------------------------------------------------------------------------------------


def neuron_trainer_options(
    settings: OptimizerSection, *, precision: Precision = "bf16-mixed", sequence_parallel: bool = False
) -> dict[str, Any]:
    """neuronx-distributed's trainer configuration for this optimizer (`parallel.initialize(neuron_options=)`).

    `sequence_parallel` makes NxD's optimizer sum the sequence-parallel parameters' gradients over TP first.
    """
    return {
        "sequence_parallel": sequence_parallel,
        "optimizer_config": {
            "zero_one_enabled": settings.zero1,
            "grad_clipping": settings.grad_clip > 0,
            "max_grad_norm": settings.grad_clip,
        },
        "mixed_precision_config": neuron_mixed_precision_config(precision),
    }


class NeuronOptimizer:
    """neuronx-distributed's optimizer wrapper (ZeRO-1 with fp32 master weights and grad accumulation), built from
    the process's one trainer configuration."""

    master: MasterWeights | None = None  # NxD's ZeRO-1 keeps the master weights

    def __init__(self, groups: list[dict[str, Any]], settings: OptimizerSection, *, precision: Precision) -> None:
        from neuronx_distributed.trainer import initialize_parallel_optimizer

        from training.model import neuron_backend

        defaults: dict[str, Any] = {"lr": settings.lr, "betas": settings.betas, "eps": settings.eps}
        # The learning rate as a device tensor (`training.train.optimizer.Schedule`), which AdamW takes in its
        # capturable form: bias corrections and step counts stay on the device too, nothing is read back during
        # the step. (NxD's CPU mode keeps the parameters on the host, where AdamW has no capturable form.)
        if parallel.device().type != "cpu":
            learning_rate = torch.tensor([settings.lr], dtype=torch.float32, device=parallel.device())
            defaults = {**defaults, "lr": learning_rate, "foreach": False, "capturable": True}
        if settings.zero1:
            # NxD hands ZeRO-1 `grad_clipping` but never the norm, so torch-xla's default max_norm=1.0 would apply.
            defaults["max_norm"] = settings.grad_clip
            if precision == "bf16-sr":
                # torch-xla's ZeRO-1 keeps its weight shards and AdamW state in fp32 unless told otherwise: bf16-sr
                # keeps them in bf16 (the runtime rounds stochastically), which is what makes it 8 bytes a parameter.
                defaults["optimizer_dtype"] = torch.bfloat16
        config = neuron_backend.trainer_config()
        self.inner: Any = initialize_parallel_optimizer(config, torch.optim.AdamW, groups, **defaults)

    def step(self) -> torch.Tensor:
        self.inner.step()  # reduces over DP, clips with the TP-aware norm, updates
        norm: torch.Tensor = self.inner.grad_norm if self.inner.grad_norm is not None else torch.tensor(float("nan"))
        return norm

    def state_dict(self) -> dict[str, Any]:
        return dict(self.inner.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        state.pop("master_weights", None)
        self.inner.load_state_dict(state)


# --- checkpoints -------------------------------------------------------------------------------------------------


def refuse_planted_pickles(target: Path) -> None:
    """neuronx-distributed's `load_checkpoint` (and torch-xla's xser loader under it) unpickles with
    `weights_only=False`. Before it reads this rank's files, each is unpickled here the safe way, which runs
    no code and refuses any class but tensors, plain data and xser's tensor references: a file planted on
    shared storage is one line, and never reaches NxD's loader.

    Only the pickles are read here: code can hide in a file's pickle alone (a torch.save file is a zip of the
    pickle and raw tensor bytes), and the tensors' bytes are memory-mapped, never touched (`load_plain`'s
    `data=False`), so the checkpoint's data is read once, by NxD. Reading it all here as well cost a second
    read of every rank's weights and optimizer state (benchmarks/startup.py measures both)."""
    from torch_xla.utils.serialization import TensorReference

    rank = f"tp_rank_{parallel.tp_rank():02d}_pp_rank_{parallel.pp_rank():02d}"
    owned = [f"model/dp_rank_00_{rank}", f"optim/dp_rank_{parallel.dp_rank():02d}_{rank}"]
    files = [target / "scheduler.pt", target / "user_content.pt"]
    for prefix in owned:
        for path in sorted(target.glob(f"{prefix}*")):  # NAME.pt, NAME.pt.info.pt, NAME.pt.tensors/ (xser)
            files += sorted(path.glob("*.pt")) if path.is_dir() else [path]
    with torch.serialization.safe_globals([TensorReference]):
        for path in files:
            if path.is_file():
                load_plain(path, data=False)


class NeuronTraining:
    """The neuron backend's `TrainingBackend` (module docstring)."""

    name: Backend = "neuron"
    compiles_graphs = True

    def check_layout(self, spec: ModelSpec, parallelism: Parallelism) -> None:
        """Before any process group: the host is of the generation the K/V replicas are laid out for."""
        from training.model.neuron_backend import check_generation

        check_generation(parallelism.generation)

    def parallel_options(self, recipe: Recipe) -> dict[str, Any]:
        return neuron_trainer_options(
            recipe.optimizer, precision=recipe.precision, sequence_parallel=recipe.parallelism.sequence_parallel
        )

    def pp_schedule(self, model: CausalLM, micro_batches: int, micro: int, seq_len: int, *, zero1: bool) -> NxDSchedule:
        return NxDSchedule(model, micro_batches, zero1=zero1)

    def optimizer(
        self,
        model: CausalLM,
        groups: list[dict[str, Any]],
        settings: OptimizerSection,
        *,
        precision: Precision,
        seed: int,
    ) -> NeuronOptimizer:
        return NeuronOptimizer(groups, settings, precision=precision)

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
        from neuronx_distributed.trainer import save_checkpoint as nxd_save

        target = step_directory(directory, step)
        nxd_save(
            str(directory),
            tag=target.name,
            model=model,
            optimizer=optimizer.inner,
            scheduler=optimizer.scheduler,
            user_content=user_content,
            use_xser=xser,
            num_kept_ckpts=keep_last,
            zero1_optimizer=optimizer.settings.zero1,
        )
        save_rng(target)  # NxD saves no random generator state; ours goes beside its files
        return target

    def load_weights(self, directory: Path, step: int, model: CausalLM) -> None:
        from neuronx_distributed.trainer import load_checkpoint as nxd_load

        target = step_directory(directory, step)
        refuse_planted_pickles(target)
        nxd_load(str(directory), tag=target.name, model=model, strict=True)

    def load_training_state(self, directory: Path, step: int, optimizer: TrainingOptimizer) -> dict[str, Any]:
        from neuronx_distributed.trainer import load_checkpoint as nxd_load

        target = step_directory(directory, step)
        refuse_planted_pickles(target)
        loaded = nxd_load(str(directory), tag=target.name, optimizer=optimizer.inner, scheduler=optimizer.scheduler)
        restore_rng_of(target)
        return dict(loaded or {})

    def compilations(self) -> int | None:
        """torch-xla compiles in `mark_step` itself, before the graph runs asynchronously: no wait."""
        import torch_xla.debug.metrics as xla_metrics

        data = xla_metrics.metric_data("CompileTime")
        return int(data[0]) if data else 0

    def graph_counters(self) -> dict[str, int]:
        """torch-xla's cumulative counts of graph compilations, executions and device-to-host transfers (a step
        that compiles after the first two is a recompilation: each costs minutes on Trainium)."""
        import torch_xla.core.xla_model as xla_model
        import torch_xla.debug.metrics as xla_metrics

        # Executions are counted when they finish, and graphs run asynchronously: wait for the step's last one
        # (the values read before this may come from an earlier graph), or a busy host would see it in the next
        # step.
        xla_model.wait_device_ops()

        def count(name: str) -> int:
            data = xla_metrics.metric_data(name)
            return int(data[0]) if data else 0

        return {
            COMPILED: count("CompileTime"),
            "xla_executions": count("ExecuteTime"),
            "xla_transfers_to_host": count("TransferFromDeviceTime"),
        }


TRAINING_BACKEND: TrainingBackend = NeuronTraining()
