"""`python -m training train --recipe R`: the torchrun job both recipes run, on Neuron or on the CPU backend.

Launch one process per worker with torchrun (one per NeuronCore on Trainium); a single process without
torchrun also works. Everything is decided by the recipe: the compile run (`--compile`, for
`neuron_parallel_compile`) differs from the real run only in running two steps and saving nothing.
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

from training.config.loading import not_allowed
from training.config.model import (
    ModelConfig,
    ModelSpec,
    Parallelism,
    check_parallelism,
    default_kv_multiplier,
    flops_per_token,
)
from training.config.precision import PARAMETER_DTYPE
from training.config.recipe import Recipe, recipe_as_dict
from training.errors import UserError
from training.formats.hf import copy_companions, read_config
from training.model import parallel
from training.model.transformer import CausalLM, Execution, build_model
from training.train import stages
from training.train.batches import BatchPlan
from training.train.checkpointing import (
    latest_complete_step,
    load_pretrained,
    load_training_state,
    load_weights,
    save_checkpoint,
)
from training.train.loader import TrainingData, check_data_kind
from training.train.metrics import open_metrics
from training.train.optimizer import TrainingOptimizer, neuron_trainer_options, zero1_where_it_shards
from training.train.watchdog import (
    CHECKPOINT,
    COMPILE_STEPS,
    STEP,
    STOP_FILE,
    VALIDATION,
    CompileWatch,
    RunStopped,
    floor_line,
    floor_verdict,
    late_compile_line,
    write_stop,
)

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


def check_model_fits(recipe: Recipe, spec: ModelSpec) -> Parallelism:
    """The TP layout the recipe asks for, or one line saying why it cannot be (before any process group)."""
    wanted = recipe.parallelism
    multiplier = wanted.kv_size_multiplier or default_kv_multiplier(spec, wanted.tp)
    parallelism = Parallelism(tp=wanted.tp, pp=wanted.pp, kv_multiplier=multiplier, fuse_qkv=wanted.fuse_qkv)
    try:
        check_parallelism(spec, parallelism, "nxd")
    except UserError as error:
        which = f"parallelism.pp {wanted.pp}" if spec.num_layers % wanted.pp else f"parallelism.tp {wanted.tp}"
        raise UserError(f"{which}: {error}") from None
    if recipe.backend == "neuron" and multiplier > 1:
        from training.model.neuron_backend import platform_target

        target = platform_target()
        if target != "trn1":
            # Our layout (and the converter's) tiles the K/V replicas over the ranks as NxD does on trn1; on
            # later generations NxD's `arrange_kv_groups` puts them on consecutive ranks instead.
            raise UserError(
                not_allowed(
                    "parallelism.kv_size_multiplier",
                    multiplier,
                    f"1 on {target}: replicated K/V heads are laid out for trn1 only; use a TP degree that "
                    f"divides the {spec.num_kv_heads} KV heads",
                )
            )
    return parallelism


def execution_of(recipe: Recipe) -> Execution:
    return Execution(
        sequence_parallel=recipe.parallelism.sequence_parallel,
        activation_checkpointing=recipe.memory.activation_checkpointing,
        flash_attention=recipe.memory.flash_attention,
    )


def load_model_config(recipe: Recipe) -> tuple[ModelConfig, Path]:
    """The run's model config, parsed once here (the builder, the FLOPs estimate and the checks take it), and
    the config.json it was read from."""
    directory = Path(recipe.model.config)
    if not directory.is_dir():
        raise UserError(f"model.config {directory}: no such directory (a Hugging Face model with config.json)")
    config, path = read_config(directory, None)
    return ModelConfig.from_hf(config, str(path)), path


def train(options: TrainOptions) -> dict[str, Any]:
    """Runs the recipe on this process's rank; returns a summary (on every rank)."""
    recipe = options.recipe
    config, config_path = load_model_config(recipe)
    parallelism = check_model_fits(recipe, config.spec)
    if recipe.model.pretrained and not Path(recipe.model.pretrained).is_dir():
        raise UserError(f"model.pretrained {recipe.model.pretrained}: no such directory (a `convert --to nxd` output)")
    checkpoints = Path(recipe.checkpoint.dir)
    if checkpoints.exists() and not checkpoints.is_dir():
        raise UserError(f"checkpoint.dir {checkpoints}: is a file; allowed: a directory, or a path to create")
    data_path = Path(recipe.data.path)
    if not data_path.is_dir():
        raise UserError(f"data.path {data_path}: no such directory (run `python -m training prepare` first)")
    shuffle_seed = recipe.seed if recipe.data.shuffle else None
    data = TrainingData(data_path, recipe.data.split, recipe.batch.seq_len, shuffle_seed=shuffle_seed, key="data.split")
    prepare_kind = recipe.prepare.kind if recipe.prepare is not None else None
    check_data_kind(data_path, data.kind, data_kind=recipe.data.kind, prepare_kind=prepare_kind)
    validation = None
    if recipe.data.validation_split is not None:  # opened even when unused, so a split that is not there is said
        validation = TrainingData(
            data_path, recipe.data.validation_split, recipe.batch.seq_len, key="data.validation_split"
        )
    if not recipe.data.validation_every:
        validation = None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model_parallel = recipe.parallelism.tp * recipe.parallelism.pp
    if world % model_parallel:
        degrees = f"parallelism.tp {recipe.parallelism.tp}" + (
            f" x parallelism.pp {recipe.parallelism.pp}" if recipe.parallelism.pp > 1 else ""
        )
        raise UserError(
            f"{degrees} does not divide the {world} launched processes "
            "(launch a multiple of tp x pp with torchrun --nproc_per_node)"
        )
    plan = BatchPlan(recipe.batch.global_batch, recipe.batch.micro, world // model_parallel)
    plan.check()
    plan.check_rows(data_path, recipe.data.split, len(data), recipe.batch.seq_len)
    if validation is not None:
        assert recipe.data.validation_split is not None
        plan.check_validation_rows(
            data_path, recipe.data.validation_split, len(validation), recipe.data.validation_batches
        )
    recipe = zero1_where_it_shards(recipe, plan.dp)
    options = dataclasses.replace(options, recipe=recipe)

    neuron_options = neuron_trainer_options(
        recipe.optimizer, precision=recipe.precision, sequence_parallel=recipe.parallelism.sequence_parallel
    )
    parallel.initialize(
        tp=recipe.parallelism.tp, backend=recipe.backend, neuron_options=neuron_options, pp=recipe.parallelism.pp
    )
    try:
        return _run(options, config, config_path, parallelism, plan, data, validation)
    finally:
        parallel.destroy()


def _run(
    options: TrainOptions,
    config: ModelConfig,
    config_path: Path,
    parallelism: Parallelism,
    plan: BatchPlan,
    data: TrainingData,
    validation: TrainingData | None = None,
) -> dict[str, Any]:
    recipe = options.recipe
    _seed_everything(recipe.seed)
    checkpoint_dir = Path(recipe.checkpoint.dir)
    rank = parallel.world_rank()
    resume_step = latest_complete_step(checkpoint_dir) if options.resume and not options.compile_only else None
    loads_weights = resume_step is not None or bool(recipe.model.pretrained)
    model = build_model(
        config,
        kv_multiplier=parallelism.kv_multiplier,
        fuse_qkv=parallelism.fuse_qkv,
        dtype=PARAMETER_DTYPE[recipe.precision],
        seed=None if loads_weights else recipe.seed,  # None: no random initialisation of weights loaded next
        router_aux_loss=True,
        execution=execution_of(recipe),
        capacity_factor=recipe.moe.capacity_factor,
    )
    if resume_step is not None:
        load_weights(checkpoint_dir, resume_step, model)
    elif recipe.model.pretrained:
        load_pretrained(Path(recipe.model.pretrained), config_path, model)
    # Built after the weights are loaded: ZeRO-1 derives its fp32 master copy from the parameters.
    optimizer = TrainingOptimizer(
        model, recipe.optimizer, recipe.schedule, recipe.steps, precision=recipe.precision, seed=recipe.seed
    )
    start = 0
    if resume_step is not None:
        content = load_training_state(checkpoint_dir, resume_step, optimizer)
        start = int(content["step"])
    if rank == 0 and not options.compile_only:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        (checkpoint_dir / STOP_FILE).unlink(missing_ok=True)  # an earlier process's stop, resubmitted since
        copy_companions(config_path.parent, config_path, checkpoint_dir)  # so `convert --from nxd` stands alone
    last = COMPILE_STEPS if options.compile_only else recipe.steps
    token_flops = flops_per_token(config, recipe.batch.seq_len)
    metrics = None
    if rank == 0:  # JSON lines, TensorBoard, CloudWatch (training.train.metrics)
        metrics = open_metrics(
            checkpoint_dir,
            first_step=start + 1,
            compile_only=options.compile_only,
            path=options.metrics,
            recipe_settings=recipe_as_dict(recipe),
        )
        log.info(
            f"training {recipe.name}: steps {start + 1}..{last} of {recipe.steps}, tp {parallelism.tp}, "
            f"dp {plan.dp}, {plan.accumulation} micro batches of {plan.micro} per rank and step"
            + (f", resumed from step {start}" if resume_step is not None else "")
        )
    device = parallel.device()
    pipeline = None
    if parallel.pp_size() > 1:
        pipeline = stages.pipeline(
            model, plan.accumulation, plan.micro, recipe.batch.seq_len, zero1=recipe.optimizer.zero1
        )
    losses: list[float] = []
    # the capacity dispatch's token-expert choices per step and data-parallel rank, to log the dropped fraction
    choices_per_step = 0
    if recipe.moe.capacity_factor is not None and model.spec.num_experts:
        tokens = plan.accumulation * plan.micro * recipe.batch.seq_len
        choices_per_step = tokens * model.config.experts_per_token * model.spec.num_layers
    window = _Window(time.perf_counter())
    completed = False
    # Rank 0 watches the run's graphs (Neuron only: the CPU backend compiles none) and its throughput.
    watch = CompileWatch(start) if rank == 0 and parallel.backend() == "neuron" and not options.compile_only else None
    floor = recipe.throughput
    expected = floor.expected_tokens_per_second_per_node if not options.compile_only else None
    nodes = _nodes()
    per_node: list[tuple[int, float]] = []
    below: list[bool] = [False]  # the floor's last verdict: a warning when it changes, not at every step
    stop: list[str] = []  # the reason rank 0 stops the job, set by a watch below

    def watch_compilations(done: int, phase: str, count: int | None = None) -> None:
        """After `phase` of step `done` ran; `count`: the compilations so far, if already read."""
        if watch is None:
            return
        count = compilations() if count is None else count
        if count is None:
            return
        late = watch.observe(done, phase, count)
        if late:
            line = late_compile_line(done, late, phase)
            log.warning(line)
            if recipe.neuron.fail_on_late_compile and not stop:
                stop.append(f"{line} (neuron.fail_on_late_compile)")

    def watch_throughput(done: int, record: dict[str, Any]) -> None:
        tokens = record["tokens_per_second"] / nodes
        record["tokens_per_second_per_node"] = round(tokens, 2)
        if expected is None:
            return
        per_node.append((done, tokens))
        del per_node[: -floor.window_steps]  # the window is all the verdict reads
        verdict = floor_verdict(
            per_node,
            start=start,
            expected=expected,
            floor_fraction=floor.floor_fraction,
            warmup_steps=floor.warmup_steps,
            window_steps=floor.window_steps,
        )
        if verdict.fraction is None or verdict.tokens_per_node is None:
            return
        record["throughput_fraction"] = float(f"{verdict.fraction:.6g}")  # significant digits: far below is tiny
        record["below_throughput_floor"] = int(verdict.below)
        line = floor_line(verdict.tokens_per_node, expected, verdict.fraction, floor.floor_fraction)
        if verdict.below != below[0]:
            (log.warning if verdict.below else log.info)(f"throughput at step {done}: {line}")
            below[0] = verdict.below
        if verdict.below and floor.cancel_below_floor and not stop:
            stop.append(f"throughput below the floor at step {done}: {line} (throughput.cancel_below_floor)")

    def report(
        done: int,
        loss_tensor: torch.Tensor,
        norm_tensor: torch.Tensor,
        learning_rate: float,
        validation_tensor: torch.Tensor | None,
        dropped_tensor: torch.Tensor | None,
    ) -> None:
        """Runs once the step's graph has run (a step closure on Neuron), so reading the values costs no graph."""
        loss = float(loss_tensor)
        elapsed = time.perf_counter() - window.start
        record = _metrics_record(recipe, plan, done, loss, learning_rate, float(norm_tensor), elapsed, window.steps)
        if validation_tensor is not None:
            record["validation_loss"] = round(float(validation_tensor), 6)
        if dropped_tensor is not None:
            record["moe_dropped"] = round(float(dropped_tensor), 6)  # fraction of the step's expert choices
        peak_flops = recipe.peak_tflops_per_worker * 1e12 * parallel.world_size()
        record["mfu"] = round(token_flops * record["tokens_per_second"] / peak_flops, 6)
        counters = graph_counters()
        record.update(counters)
        if rank == 0:
            watch_compilations(done, VALIDATION if validation_tensor is not None else STEP, counters.get(COMPILED))
            if watch is not None:
                record.update(watch.fields())
            watch_throughput(done, record)
        losses.append(loss)
        if metrics is not None:
            metrics.write(record)
            log.info(
                f"(step {done}) step_loss : {loss:.4f} learning_rate : {learning_rate:.2e} "
                f"throughput : {record['seq_per_second']:.2f} seq/s"
            )
        window.start, window.steps = time.perf_counter(), 0

    try:
        for step in range(start, last):
            batches = [
                data.batch(plan.sample_indices(step, parallel.dp_rank(), micro_step))
                for micro_step in range(plan.accumulation)
            ]
            if pipeline is not None:
                result = pipeline.train_step(batches)
                total = stages.from_last_stage(result.loss_sum)
                dropped = None if result.dropped is None else stages.over_stages(result.dropped)
            else:
                total, dropped = _accumulate(model, batches)
            learning_rate = optimizer.lr
            grad_norm = optimizer.step()
            loss = _data_parallel_mean(total / plan.accumulation)
            if _graph_change_injected(step + 1):
                loss = loss + torch.zeros((), device=device)  # the same value, one more operation: a new graph
            dropped_fraction = None if dropped is None else _data_parallel_mean(dropped / choices_per_step)
            done = step + 1
            window.steps += 1
            validating = validation is not None and (done % recipe.data.validation_every == 0 or done == last)
            logging = done % recipe.log_every == 0 or done == last or validating
            values = (done, loss, grad_norm, learning_rate)
            if logging and not validating:
                parallel.add_step_closure(report, (*values, None, dropped_fraction))
            # The optimizer step's graph, the same whatever else the step does (validation, logging, saving), so
            # the compile stage's two steps compile every graph the run needs; the closure runs after it.
            parallel.mark_step()
            watch_compilations(done, STEP)
            _stop_if_asked(stop, checkpoint_dir, done)
            if validating:
                assert validation is not None
                validation_loss = _validation_loss(
                    model, validation, plan, recipe.data.validation_batches, device, pipeline
                )
                parallel.add_step_closure(report, (*values, validation_loss, dropped_fraction))
                parallel.mark_step()  # the validation mean's own small graph
                watch_compilations(done, VALIDATION)
                _stop_if_asked(stop, checkpoint_dir, done)
            if not options.compile_only and _checkpoint_due(recipe, done):
                user_content = {"step": done, "consumed_samples": done * plan.global_batch}
                save_checkpoint(
                    checkpoint_dir,
                    done,
                    model,
                    optimizer,
                    user_content,
                    keep_last=recipe.checkpoint.keep_last,
                    xser=recipe.checkpoint.xser,
                )
                if rank == 0:
                    log.info(f"checkpoint step_{done} saved in {checkpoint_dir}")
                watch_compilations(done, CHECKPOINT)
                _stop_if_asked(stop, checkpoint_dir, done)
            _fault_injection(done, checkpoint_dir)
        if options.compile_only:
            # What a checkpoint save runs on the device besides copies to the host: neuronx-distributed's save
            # starts with a rendezvous, a small collective graph. Compiled here (the compile stage saves nothing),
            # not at the run's first checkpoint.
            parallel.rendezvous("compile stage: the checkpoint save's graph")
        completed = True
    finally:
        if metrics is not None:
            metrics.close(completed=completed)
    first, final = (losses[0], losses[-1]) if losses else (float("nan"), float("nan"))
    return {"steps": last, "started_at": start, "first_loss": first, "last_loss": final}


def _accumulate(
    model: CausalLM, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor | None]:
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


def _validation_loss(
    model: CausalLM,
    validation: TrainingData,
    plan: BatchPlan,
    batches: int,
    device: torch.device,
    pipeline: stages.Pipeline | None,
) -> torch.Tensor:
    """The language-model loss (no router loss) over the first `batches` micro batches per data-parallel rank
    of the validation split: the same blocks every time, so the values compare across steps."""
    blocks = [
        range((b * plan.dp + parallel.dp_rank()) * plan.micro, (b * plan.dp + parallel.dp_rank() + 1) * plan.micro)
        for b in range(batches)
    ]
    if pipeline is not None:
        total = stages.from_last_stage(pipeline.forward_only([validation.batch(b) for b in blocks]))
        return _data_parallel_mean(total / batches)
    losses = []  # summed after the last batch (as in `_accumulate`): every batch is the same graph
    with torch.no_grad():
        for block in blocks:
            input_ids, targets = validation.batch(block)
            output = model(input_ids.to(device), targets.to(device))
            assert output.loss is not None
            losses.append(output.loss - output.aux_loss if output.aux_loss is not None else output.loss)
            parallel.mark_step()
    return _data_parallel_mean(torch.stack(losses).sum() / batches)


@dataclass
class _Window:
    """The logging window: when it started and how many steps it has counted (for seq/s)."""

    start: float
    steps: int = 0


def _checkpoint_due(recipe: Recipe, step: int) -> bool:
    every = recipe.checkpoint.every
    return step == recipe.steps or (every > 0 and step % every == 0)


def _metrics_record(
    recipe: Recipe,
    plan: BatchPlan,
    step: int,
    loss: float,
    learning_rate: float,
    grad_norm: float,
    elapsed: float,
    steps: int,
) -> dict[str, Any]:
    sequences = plan.global_batch * steps / max(elapsed, 1e-9)
    return {
        "step": step,
        "loss": round(loss, 6),
        "lr": learning_rate,
        "grad_norm": round(grad_norm, 6),
        "seq_per_second": round(sequences, 4),
        "tokens_per_second": round(sequences * recipe.batch.seq_len, 2),
        "time": time.time(),
    }


def _data_parallel_mean(value: torch.Tensor) -> torch.Tensor:
    """The mean over the data-parallel ranks (each rank saw its own slice of the global batch), on the device."""
    if parallel.dp_size() == 1:
        return value
    value = value.clone()
    dist.all_reduce(value, group=parallel.dp_group())
    return value / parallel.dp_size()


COMPILED = "xla_compilations"


def compilations() -> int | None:
    """On Neuron, the graphs this process has compiled so far (torch-xla compiles in `mark_step` itself, before
    the graph runs asynchronously: no wait); None on the CPU backend, which compiles none."""
    if parallel.backend() != "neuron":
        return None
    import torch_xla.debug.metrics as xla_metrics

    data = xla_metrics.metric_data("CompileTime")
    return int(data[0]) if data else 0


def _nodes() -> int:
    """Nodes of the launched job: torchrun's processes over those of one node (1 without torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return max(1, world // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))))


def _stop_if_asked(stop: list[str], checkpoint_dir: Path, step: int) -> None:
    """Rank 0 ends the job when a watch asked it to: the reason recorded first (the job script does not requeue a
    stopped job), then raised; torchrun ends the other ranks."""
    if not stop:
        return
    write_stop(checkpoint_dir, stop[0], step)
    raise RunStopped(stop[0])  # the CLI's `error:` line


def _graph_change_injected(step: int) -> bool:
    return os.environ.get(CHANGE_GRAPH_AT_STEP) == str(step)


def graph_counters() -> dict[str, int]:
    """On Neuron, torch-xla's cumulative counts of graph compilations, executions and device-to-host transfers
    (a step that compiles after the first two is a recompilation: each costs minutes on Trainium)."""
    if parallel.backend() != "neuron":
        return {}
    import torch_xla.core.xla_model as xla_model
    import torch_xla.debug.metrics as xla_metrics

    # Executions are counted when they finish, and graphs run asynchronously: wait for the step's last one
    # (the values read before this may come from an earlier graph), or a busy host would see it in the next step.
    xla_model.wait_device_ops()

    def count(name: str) -> int:
        data = xla_metrics.metric_data(name)
        return int(data[0]) if data else 0

    return {
        COMPILED: count("CompileTime"),
        "xla_executions": count("ExecuteTime"),
        "xla_transfers_to_host": count("TransferFromDeviceTime"),
    }


def _seed_everything(seed: int) -> None:
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
