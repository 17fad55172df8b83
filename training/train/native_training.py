"""The torch-native backend's training services (`training.train.backend.TrainingBackend`): FSDP2, torch's AdamW,
Distributed Checkpoint.

Data parallelism is FSDP2 (`fully_shard` over the mesh's "dp" dimension, each decoder layer a unit and the
model the root): parameters, gradients and optimizer state are sharded over the data-parallel ranks, which is
what ZeRO-1 shards and more (one fp32 replica has nothing to shard or cast: no FSDP2 then). Its mixed-precision
policy maps the recipe's regimes: `fp32` none, `bf16-mixed` bf16 parameters for compute with fp32 sharded
masters and an fp32 gradient reduction; `bf16-sr` (bf16 weights rounded stochastically, a neuronx-distributed
optimizer feature) is refused by the recipe on this backend.

The gradient norm and clipping follow the cpu backend's rules (sharded parameters summed over TP, replicated
ones once, stages summed), on each rank's local shards, summed over the data-parallel ranks FSDP2 spreads them
over. Pipeline parallelism is torch's own `torch.distributed.pipelining` (a `PipelineStage` per rank, the
`Schedule1F1B` schedule: `training.train.native_pipeline`), passing the carry the cpu backend's hand-written 1F1B
passes too.

Checkpoints are Distributed Checkpoint directories (`step_N/dcp/`: every rank writes its shards, resharded on
load to any layout), beside the shared layout's schedule, run position and random generators
(`training.train.checkpointing`).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as load_distributed
from torch.distributed.checkpoint.state_dict_saver import save as save_distributed
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Shard

from training.config.backends import Backend
from training.config.model import ModelSpec, Parallelism
from training.config.recipe import OptimizerSection, Precision, Recipe
from training.errors import UserError
from training.formats.distributed import DCP_DIRECTORY, TP_LAYOUT, tp_layout
from training.model import native_backend, parallel
from training.model.transformer import CausalLM, DecoderLayer, MoE
from training.train.backend import TrainingBackend
from training.train.checkpointing import (
    finish_saving,
    read_position,
    restore_rng_of,
    start_saving,
    step_directory,
)
from training.train.cpu_precision import MasterWeights
from training.train.native_pipeline import TorchPipeline
from training.train.optimizer import TrainingOptimizer, clip_by_global_norm, split_by_replication
from training.train.pp_schedule import PPSchedule

log = logging.getLogger(__name__)


def tp_dimension(tensor: torch.Tensor) -> int | None:
    """The dimension a parameter's TP shards split (its placement on the mesh's "tp" dimension); None when
    every TP rank holds all of it."""
    if not isinstance(tensor, DTensor):
        return None
    names = tensor.device_mesh.mesh_dim_names or ()
    placement = tensor.placements[names.index("tp")] if "tp" in names else None
    return placement.dim if isinstance(placement, Shard) else None


def mixed_precision(precision: Precision) -> MixedPrecisionPolicy:
    """FSDP2's policy for a recipe's precision regime (module docstring)."""
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_data_parallel(model: CausalLM, precision: Precision) -> None:
    """`fully_shard` each decoder layer, then the model, over the "dp" mesh dimension; under bf16-mixed the
    sharded parameters are fp32 (the masters) and FSDP2 casts them to bf16 for compute."""
    if precision == "bf16-mixed":
        model.float()
    mesh, policy = native_backend.mesh()["dp"], mixed_precision(precision)
    for module in model.modules():
        if isinstance(module, DecoderLayer):
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if parallel.pp_size() > 1:  # a pipeline stage runs `forward_stage`, never forward(): FSDP2 gathers the root's
        # parameters (the embedding, final norm and head) around forward() only, unless told of the other method
        register_fsdp_forward_method(model, "forward_stage")


def compile_decoder_layers(model: CausalLM) -> None:
    """With torch_native.compile: each decoder layer's forward compiled in place, as TorchTitan compiles its
    transformer blocks. The layers are the model's repeated work: one graph that `neuron` compiles once and every
    layer reuses (same code and shapes), static (`dynamic=False`: TorchNeuron's compiler rejects dynamic shapes).
    A dense layer is one whole graph (`fullgraph`, as TorchNeuron recommends); an MoE layer is not (fullgraph
    off): its experts' collectives are the cpu backend's autograd functions on the process group, which dynamo
    runs between graphs. Compiled after DTensor's tensor parallelism and FSDP2 are applied: the forward is traced
    with its DTensor collectives, FSDP2's hooks around it (gathering and freeing the layer's parameters) stay
    eager, and the module, its parameter names and its checkpoints stay the same."""
    compiler = native_backend.compiler()
    if compiler is None:
        return
    layers = {name: m for name, m in model.named_modules() if isinstance(m, DecoderLayer)}
    whole = {name: not isinstance(layer.mlp, MoE) for name, layer in layers.items()}
    for name, layer in layers.items():
        compiled = torch.compile(layer.forward, backend=compiler, dynamic=False, fullgraph=whole[name])
        layer.forward = functools.partial(_waited_input, compiled)  # type: ignore[method-assign]
    if parallel.world_rank() == 0:
        log.info(
            f"torch.compile: {len(layers)} decoder layers ({', '.join(layers)}) with backend {compiler}, "
            f"fullgraph {all(whole.values())}, static shapes"
        )


def _waited_input(compiled: Callable[..., Any], x: torch.Tensor, *rest: Any) -> Any:
    """The compiled layer on a plain tensor: the first layer's input is DTensor's asynchronous all-reduce of the
    embedding (an `AsyncCollectiveTensor`), whose gradient a compiled graph returns unplaced (torch 2.13: the
    embedding's backward then fails); copied here, eagerly and differentiably, the collective waited for."""
    if isinstance(x, AsyncCollectiveTensor):
        x = x.clone()
    return compiled(x, *rest)


class NativeOptimizer:
    """torch's AdamW over the FSDP2-sharded parameters, clipped by the model's global gradient norm."""

    master: MasterWeights | None = None  # FSDP2 keeps the fp32 masters (its sharded parameters) under bf16-mixed

    def __init__(
        self, model: CausalLM, groups: list[dict[str, Any]], settings: OptimizerSection, *, precision: Precision
    ) -> None:
        self.model, self.settings = model, settings
        names = {id(p): n for n, p in model.named_parameters()}
        group_names = [[names[id(p)] for p in group["params"]] for group in groups]
        sequence_parallel = {n for n, p in model.named_parameters() if getattr(p, "sequence_parallel_enabled", False)}
        if parallel.dp_size() > 1 or precision != "fp32":  # one replica in fp32: nothing to shard or cast (as
            # the planner counts it: `training.train.memory.fully_sharded`)
            shard_data_parallel(model, precision)
        compile_decoder_layers(model)  # the model is final: its layers placed over TP, sharded over DP
        parameters = dict(model.named_parameters())  # FSDP2's sharded parameters, under the same names
        groups = [{**g, "params": [parameters[n] for n in ns]} for g, ns in zip(groups, group_names, strict=True)]
        self.inner: Any = torch.optim.AdamW(groups, lr=settings.lr, betas=settings.betas, eps=settings.eps)
        self.sharded, self.replicated = split_by_replication(model, parameters)
        for name in sequence_parallel:  # FSDP2's parameters are new ones: marked again for the TP sum
            parallel.mark_sequence_parallel(parameters[name])

    def step(self) -> torch.Tensor:
        parallel.sum_sequence_parallel_gradients(self.sharded + self.replicated)
        grad_clip = self.settings.grad_clip
        norm = clip_by_global_norm(self.sharded, self.replicated, grad_clip, sharded_over_dp=parallel.dp_size() > 1)
        self.inner.step()
        return torch.tensor(norm, dtype=torch.float64)

    def state_dict(self) -> dict[str, Any]:
        return dict(get_optimizer_state_dict(self.model, self.inner))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.inner, state)


class NativeTraining:
    """The torch-native backend's `TrainingBackend` (module docstring)."""

    name: Backend = "torch-native"
    compiles_graphs = False  # eager

    def check_layout(self, spec: ModelSpec, parallelism: Parallelism) -> None:
        """Any layout the configuration allows runs here (the generation is checked where the world starts)."""

    def parallel_options(self, recipe: Recipe) -> dict[str, Any]:
        return {native_backend.COMPILE_OPTION: recipe.torch_native.compile}

    def pp_schedule(self, model: CausalLM, micro_batches: int, micro: int, seq_len: int, *, zero1: bool) -> PPSchedule:
        return TorchPipeline(model, micro_batches, micro, seq_len)

    def optimizer(
        self,
        model: CausalLM,
        groups: list[dict[str, Any]],
        settings: OptimizerSection,
        *,
        precision: Precision,
        seed: int,
    ) -> NativeOptimizer:
        return NativeOptimizer(model, groups, settings, precision=precision)

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
        target = start_saving(directory, step)
        state = {"model": get_model_state_dict(model), "optimizer": optimizer.state_dict()}
        save_distributed(state, checkpoint_id=target / DCP_DIRECTORY)
        shards: list[dict[str, tuple[int | None, int]]] = [{} for _ in range(parallel.world_size())]
        mine = {name: (tp_dimension(tensor), parallel.pp_rank()) for name, tensor in state["model"].items()}
        dist.all_gather_object(shards, mine)
        if parallel.world_rank() == 0:
            merged = {name: entry for part in shards for name, entry in part.items()}
            layout = tp_layout(merged, parallel.tp_size(), parallel.pp_size())
            (target / DCP_DIRECTORY / TP_LAYOUT).write_text(json.dumps(layout, indent=1) + "\n")
        finish_saving(directory, target, optimizer.scheduler.state_dict(), user_content, keep_last)
        return target

    def load_weights(self, directory: Path, step: int, model: CausalLM) -> None:
        state = {"model": get_model_state_dict(model)}
        load_distributed(state, checkpoint_id=self._checkpoint(directory, step))
        set_model_state_dict(model, state["model"])

    def load_training_state(self, directory: Path, step: int, optimizer: TrainingOptimizer) -> dict[str, Any]:
        target = step_directory(directory, step)
        scheduler_state, content = read_position(target)
        loaded = {"optimizer": optimizer.state_dict()}
        load_distributed(loaded, checkpoint_id=self._checkpoint(directory, step))
        optimizer.load_state_dict(loaded["optimizer"])
        optimizer.scheduler.load_state_dict(scheduler_state)
        restore_rng_of(target)
        return content

    @staticmethod
    def _checkpoint(directory: Path, step: int) -> Path:
        path = step_directory(directory, step) / DCP_DIRECTORY
        if not (path / ".metadata").is_file():
            raise UserError(
                f"{path}: no Distributed Checkpoint here; allowed: a checkpoint written by backend torch-native "
                "(a neuron or cpu checkpoint moves over through hf: `convert --to hf`, then model.pretrained)"
            )
        return path

    def compilations(self) -> int | None:
        return None

    def graph_counters(self) -> dict[str, int]:
        """With compiled decoder layers, dynamo's cumulative counts: the graphs it compiled (the layers share
        theirs; validation's no-grad forward is another; an MoE layer's are cut at its collectives) and the graph
        breaks between them (none in a dense layer)."""
        if native_backend.compiler() is None:
            return {}
        stats = torch._dynamo.utils.counters
        return {
            "compiled_graphs": int(stats["stats"]["unique_graphs"]),
            "graph_breaks": sum(stats["graph_break"].values()),
        }


TRAINING_BACKEND: TrainingBackend = NativeTraining()
