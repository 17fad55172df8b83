"""`python -m training train --recipe R`: the torchrun job both recipes run, on Neuron or on the CPU backend.

Launch one process per worker with torchrun (one per NeuronCore on Trainium); a single process without
torchrun also works. Everything is decided by the recipe: the compile run (`--compile`, for
`neuron_parallel_compile`) differs from the real run only in running two steps and saving nothing.

`train` chooses the training backend once (`training.train.backend`), checks the run's inputs
(`training.train.run_inputs`), starts the parallel layers, and hands the backend to a `Trainer`: each step, then
validation, logging and checkpointing when each is due.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from training.config.hardware import DEFAULT_GENERATION
from training.config.model import Parallelism, flops_per_token
from training.config.precision import PARAMETER_DTYPE
from training.config.recipe import Recipe, recipe_as_dict
from training.errors import UserError
from training.formats.hf import copy_companions
from training.formats.sharded import GENERATION_KEY, recorded_generation
from training.model import parallel
from training.model.transformer import CausalLM, build_model
from training.train.backend import TrainingBackend, training_backend
from training.train.checkpointing import latest_complete_step, load_pretrained
from training.train.metrics import open_metrics
from training.train.optimizer import TrainingOptimizer
from training.train.pp_schedule import Batches, PPSchedule, from_last_stage, over_stages
from training.train.run_inputs import RunInputs, execution_of, run_inputs
from training.train.step_report import StepReport
from training.train.watchdog import CHECKPOINT, COMPILE_STEPS, STEP, STOP_FILE, VALIDATION, CompileWatch

log = logging.getLogger(__name__)
# Fault injection for tests of resume and requeue: the given rank SIGKILLs itself after finishing the step,
# once per checkpoint directory.
KILL_AT_STEP = "TRAINING_KILL_AT_STEP"
KILL_RANK = "TRAINING_KILL_RANK"
# Fault injection for the late-compilation tests: the step's graph gets one more operation at this step (the
# values stay the same), as a graph changed since the compile stage would.
CHANGE_GRAPH_AT_STEP = "TRAINING_CHANGE_GRAPH_AT_STEP"


@dataclass(frozen=True)
class TrainOptions:
    recipe: Recipe
    resume: bool = False  # continue from the newest complete checkpoint in checkpoint.dir, if there is one
    compile_only: bool = False
    metrics: Path | None = None  # JSON lines; default <checkpoint.dir>/metrics.jsonl (training.train.metrics)


def train(options: TrainOptions) -> dict[str, Any]:
    """Runs the recipe on this process's rank; returns a summary (on every rank)."""
    backend = training_backend(options.recipe.backend)  # the one choice of the training services' backend
    inputs = run_inputs(options.recipe, backend)
    recipe = inputs.recipe
    parallel.initialize(
        tp=recipe.parallelism.tp,
        backend=backend.name,
        neuron_options=backend.parallel_options(recipe),
        pp=recipe.parallelism.pp,
        generation=recipe.generation,
    )
    try:
        return Trainer.prepare(dataclasses.replace(options, recipe=recipe), backend, inputs).run()
    finally:
        parallel.destroy()


@dataclass(frozen=True)
class StepValues:
    """One optimizer step's values on the device, read in the report's step closure."""

    done: int
    loss: torch.Tensor
    grad_norm: torch.Tensor
    learning_rate: float
    dropped: torch.Tensor | None  # fraction of the step's expert choices dropped (capacity dispatch)


@dataclass
class Trainer:
    """One process's run from its start step to the last: the step, then validation, logging and the checkpoint
    when each is due."""

    options: TrainOptions
    backend: TrainingBackend
    inputs: RunInputs
    model: CausalLM
    optimizer: TrainingOptimizer
    start: int
    report: StepReport
    pp: PPSchedule | None  # this rank's stage's schedule under pipeline parallelism

    @classmethod
    def prepare(cls, options: TrainOptions, backend: TrainingBackend, inputs: RunInputs) -> Trainer:
        """The model and optimizer built and restored (from a checkpoint when resuming), the metrics opened."""
        recipe = options.recipe
        seed_everything(recipe.seed)
        directory = Path(recipe.checkpoint.dir)
        resume_step = latest_complete_step(directory) if options.resume and not options.compile_only else None
        model = _model(recipe, inputs, backend, resume_step)
        # Built after the weights are loaded: ZeRO-1 derives its fp32 master copy from the parameters.
        optimizer = TrainingOptimizer(
            model,
            recipe.optimizer,
            recipe.schedule,
            recipe.steps,
            backend=backend,
            precision=recipe.precision,
            seed=recipe.seed,
        )
        start = 0
        if resume_step is not None:
            start = int(backend.load_training_state(directory, resume_step, optimizer)["step"])
        if parallel.world_rank() == 0 and not options.compile_only:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / STOP_FILE).unlink(missing_ok=True)  # an earlier process's stop, resubmitted since
            copy_companions(inputs.config_path.parent, inputs.config_path, directory)  # `convert --from nxd` alone
        report = _step_report(options, backend, inputs, start)
        pp = None
        if parallel.pp_size() > 1:
            plan = inputs.plan
            pp = backend.pp_schedule(
                model, plan.accumulation, plan.micro, recipe.batch.seq_len, zero1=recipe.optimizer.zero1
            )
        return cls(options, backend, inputs, model, optimizer, start, report, pp)

    @property
    def last(self) -> int:
        return COMPILE_STEPS if self.options.compile_only else self.options.recipe.steps

    @property
    def directory(self) -> Path:
        return Path(self.options.recipe.checkpoint.dir)

    def run(self) -> dict[str, Any]:
        """Every step of this process; a summary (on every rank)."""
        if self.report.metrics is not None:
            plan, recipe = self.inputs.plan, self.options.recipe
            log.info(
                f"training {recipe.name}: steps {self.start + 1}..{self.last} of {recipe.steps}, "
                f"tp {self.inputs.parallelism.tp}, dp {plan.dp}, {plan.accumulation} micro batches of {plan.micro} "
                "per rank and step" + (f", resumed from step {self.start}" if self.start else "")
            )
        completed = False
        self.report.window.start = time.perf_counter()  # the first logged step's seq/s counts from here
        try:
            for step in range(self.start, self.last):
                values = self.step(step)
                self.validate_and_log(values)
                self.checkpoint(values.done)
                _fault_injection(values.done, self.directory)
            if self.options.compile_only:
                # What a checkpoint save runs on the device besides copies to the host: neuronx-distributed's save
                # starts with a rendezvous, a small collective graph. Compiled here (the compile stage saves
                # nothing), not at the run's first checkpoint.
                parallel.rendezvous("compile stage: the checkpoint save's graph")
            completed = True
        finally:
            if self.report.metrics is not None:
                self.report.metrics.close(completed=completed)
        losses = self.report.losses
        first, final = (losses[0], losses[-1]) if losses else (float("nan"), float("nan"))
        return {"steps": self.last, "started_at": self.start, "first_loss": first, "last_loss": final}

    def step(self, step: int) -> StepValues:
        """Forward and backward of the step's micro batches, then the optimizer step."""
        plan, data = self.inputs.plan, self.inputs.data
        batches = [
            data.batch(plan.sample_indices(step, parallel.dp_rank(), micro_step))
            for micro_step in range(plan.accumulation)
        ]
        if self.pp is not None:
            result = self.pp.train_step(batches)
            total = from_last_stage(result.loss_sum)
            dropped = None if result.dropped is None else over_stages(result.dropped)
        else:
            total, dropped = _accumulate(self.model, batches)
        learning_rate = self.optimizer.lr
        grad_norm = self.optimizer.step()
        loss = _data_parallel_mean(total / plan.accumulation)
        if _graph_change_injected(step + 1):
            loss = loss + torch.zeros((), device=parallel.device())  # the same value, one more operation: a new graph
        choices = _choices_per_step(self.options.recipe, self.inputs, self.model)
        dropped_fraction = None if dropped is None else _data_parallel_mean(dropped / choices)
        self.report.window.steps += 1
        return StepValues(step + 1, loss, grad_norm, learning_rate, dropped_fraction)

    def validate_and_log(self, values: StepValues) -> None:
        """The step's graph run, its record logged when due, and validation when due (its own small graph)."""
        recipe, done = self.options.recipe, values.done
        validating = self.inputs.validation is not None and (
            done % recipe.data.validation_every == 0 or done == self.last
        )
        logging_due = done % recipe.log_every == 0 or done == self.last or validating
        closure_values = (done, values.loss, values.grad_norm, values.learning_rate)
        if logging_due and not validating:
            parallel.add_step_closure(self.report, (*closure_values, None, values.dropped))
        # The optimizer step's graph, the same whatever else the step does (validation, logging, saving), so
        # the compile stage's two steps compile every graph the run needs; the closure runs after it.
        parallel.mark_step()
        self.report.compilations(done, STEP)
        self.report.stop_if_asked(self.directory, done)
        if validating:
            validation_loss = self.validation_loss()
            parallel.add_step_closure(self.report, (*closure_values, validation_loss, values.dropped))
            parallel.mark_step()  # the validation mean's own small graph
            self.report.compilations(done, VALIDATION)
            self.report.stop_if_asked(self.directory, done)

    def validation_loss(self) -> torch.Tensor:
        """The language-model loss (no router loss) over the first `validation_batches` micro batches per
        data-parallel rank of the validation split: the same blocks every time, so the values compare across
        steps."""
        plan, validation = self.inputs.plan, self.inputs.validation
        batches = self.options.recipe.data.validation_batches
        assert validation is not None
        rank = parallel.dp_rank()
        first_rows = [(b * plan.dp + rank) * plan.micro for b in range(batches)]
        blocks = [range(first, first + plan.micro) for first in first_rows]
        if self.pp is not None:
            total = from_last_stage(self.pp.forward_only([validation.batch(b) for b in blocks]))
            return _data_parallel_mean(total / batches)
        device = parallel.device()
        losses = []  # summed after the last batch (as in `_accumulate`): every batch is the same graph
        with torch.no_grad():
            for block in blocks:
                input_ids, targets = validation.batch(block)
                output = self.model(input_ids.to(device), targets.to(device))
                assert output.loss is not None
                losses.append(output.loss - output.aux_loss if output.aux_loss is not None else output.loss)
                parallel.mark_step()
        return _data_parallel_mean(torch.stack(losses).sum() / batches)

    def checkpoint(self, done: int) -> None:
        """The checkpoint of step `done`, when due (never in the compile run)."""
        recipe = self.options.recipe
        every = recipe.checkpoint.every
        if self.options.compile_only or not (done == recipe.steps or (every > 0 and done % every == 0)):
            return
        user_content = {
            "step": done,
            "consumed_samples": done * self.inputs.plan.global_batch,
            GENERATION_KEY: recipe.generation,  # the K/V layout of its rank files
        }
        self.backend.save_checkpoint(
            self.directory,
            done,
            self.model,
            self.optimizer,
            user_content,
            keep_last=recipe.checkpoint.keep_last,
            xser=recipe.checkpoint.xser,
        )
        if parallel.world_rank() == 0:
            log.info(f"checkpoint step_{done} saved in {self.directory}")
        self.report.compilations(done, CHECKPOINT)
        self.report.stop_if_asked(self.directory, done)


def _model(recipe: Recipe, inputs: RunInputs, backend: TrainingBackend, resume_step: int | None) -> CausalLM:
    """This rank's model, its weights from the checkpoint to resume, the pretrained weights, or the seed."""
    loads_weights = resume_step is not None or bool(recipe.model.pretrained)
    model = build_model(
        inputs.config,
        kv_multiplier=inputs.parallelism.kv_multiplier,
        fuse_qkv=inputs.parallelism.fuse_qkv,
        dtype=PARAMETER_DTYPE[recipe.precision],
        seed=None if loads_weights else recipe.seed,  # None: no random initialisation of weights loaded next
        router_aux_loss=True,
        execution=execution_of(recipe),
        capacity_factor=recipe.moe.capacity_factor,
    )
    if resume_step is not None:
        check_resumed_generation(Path(recipe.checkpoint.dir) / f"step_{resume_step}", recipe, inputs.parallelism)
        backend.load_weights(Path(recipe.checkpoint.dir), resume_step, model)
    elif recipe.model.pretrained:
        load_pretrained(Path(recipe.model.pretrained), inputs.config_path, model)
    return model


def check_resumed_generation(step_dir: Path, recipe: Recipe, parallelism: Parallelism) -> None:
    """Refuse, in one line, a checkpoint whose K/V replicas are laid out for another generation."""
    recorded = recorded_generation(step_dir) or DEFAULT_GENERATION  # a checkpoint from before the record: trn1's
    if parallelism.kv_multiplier > 1 and recorded != recipe.generation:
        raise UserError(
            f"checkpoint.dir {step_dir}: saved for {recorded} (its K/V replicas are laid out for it); this run is "
            f"for {recipe.generation}: resume it on {recorded}, or convert it through hf (`convert --from nxd --to "
            f"hf`, then `--to nxd --target {recipe.generation}`) and train from that as model.pretrained"
        )


def _step_report(options: TrainOptions, backend: TrainingBackend, inputs: RunInputs, start: int) -> StepReport:
    """The report of the logged steps; rank 0 writes the metrics (JSON lines, TensorBoard, CloudWatch) and
    watches the run's graphs (when the backend compiles any) and its throughput."""
    recipe, rank0 = options.recipe, parallel.world_rank() == 0
    metrics = None
    if rank0:
        metrics = open_metrics(
            Path(recipe.checkpoint.dir),
            first_step=start + 1,
            compile_only=options.compile_only,
            path=options.metrics,
            recipe_settings=recipe_as_dict(recipe),
        )
    watched = rank0 and backend.compiles_graphs and not options.compile_only
    return StepReport(
        recipe=recipe,
        plan=inputs.plan,
        backend=backend,
        start=start,
        flops_per_token=flops_per_token(inputs.config, recipe.batch.seq_len),
        metrics=metrics,
        watch=CompileWatch(start) if watched else None,
        expected=recipe.throughput.expected_tokens_per_second_per_node if not options.compile_only else None,
    )


def _choices_per_step(recipe: Recipe, inputs: RunInputs, model: CausalLM) -> int:
    """The capacity dispatch's token-expert choices per step and data-parallel rank (0 without it), to log the
    dropped fraction."""
    if recipe.moe.capacity_factor is None or not model.spec.num_experts:
        return 0
    tokens = inputs.plan.accumulation * inputs.plan.micro * recipe.batch.seq_len
    return tokens * model.config.experts_per_token * model.spec.num_layers


def _accumulate(model: CausalLM, batches: Batches) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward and backward of each micro batch into the same gradients; the summed loss, and the capacity
    dispatch's dropped expert choices (None without it).

    One graph per micro batch on Neuron, and the same graph for every micro batch after the first (which
    creates the gradients the others add to): the sums are taken over the micro batches' own outputs after
    the last one, so they belong to the optimizer step's graph and no micro batch starts from a fresh zero.
    """
    device = parallel.device()
    losses: list[torch.Tensor] = []
    dropped: list[torch.Tensor] = []
    for input_ids, targets in batches:
        output = model(input_ids.to(device), targets.to(device))
        assert output.loss is not None
        (output.loss / len(batches)).backward()
        losses.append(output.loss.detach())
        if output.dropped is not None:
            dropped.append(output.dropped.detach())
        parallel.mark_step()  # a step of N micro batches is never traced as one graph
    return torch.stack(losses).sum(), torch.stack(dropped).sum() if dropped else None


def _data_parallel_mean(value: torch.Tensor) -> torch.Tensor:
    """The mean over the data-parallel ranks (each rank saw its own slice of the global batch), on the device."""
    if parallel.dp_size() == 1:
        return value
    value = value.clone()
    dist.all_reduce(value, group=parallel.dp_group())
    return value / parallel.dp_size()


def _graph_change_injected(step: int) -> bool:
    return os.environ.get(CHANGE_GRAPH_AT_STEP) == str(step)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _fault_injection(step: int, checkpoint_dir: Path) -> None:
    """Once per checkpoint directory (a marker remembers it), so the resumed run goes past the step."""
    if os.environ.get(KILL_AT_STEP) != str(step) or os.environ.get(KILL_RANK, "0") != str(parallel.world_rank()):
        return
    marker = checkpoint_dir / f".fault-injected-at-step-{step}"
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    log.warning(f"fault injection: rank {parallel.world_rank()} kills itself after step {step}")
    os.kill(os.getpid(), signal.SIGKILL)


def run_from_cli(recipe: Recipe, *, resume: bool, compile_only: bool, metrics: Path | None) -> int:
    summary = train(TrainOptions(recipe=recipe, resume=resume, compile_only=compile_only, metrics=metrics))
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"recipe": recipe_as_dict(recipe)["name"], **summary}), flush=True)
    return 0
