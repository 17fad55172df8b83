# mypy: disable-error-code="empty-body"
# (the declared functions below have no body of their own: `@neuron(...)` gives each one its body.)
"""The parallel facade: the model is written once against these names, a backend chosen at start-up runs them.

Three interchangeable backends with the same tensor-parallel semantics:

- `cpu` (`training.model.cpu_backend`): torch.distributed on gloo, autograd functions for the collectives. It is
  what the tests run; forward and backward equal single-process math.
- `neuron` (`training.model.neuron_backend`): each name maps one-to-one onto neuronx-distributed and torch-xla.
- `torch-native` (`training.model.native_backend`): native PyTorch, the layers' weights DTensors on a TP mesh
  (`ColwiseParallel`, `RowwiseParallel`, `loss_parallel`), on TorchNeuron's `neuron` device or on the CPU.

Each name is declared once, below, as a typed function with a docstring and a `@neuron(module, attribute)`
line naming what it is on Trainium (a neuronx-distributed class or function, release 2.28). The declaration is
the contract: the `neuron` backend imports `module.attribute` and calls it with the caller's arguments; the
`cpu` backend presents the same name with exactly the declared signature; tests/training/model/test_parallel_facade.py
checks both, and checks the declarations against neuronx-distributed's own source.
One module over 500 lines because it is one thing, the facade: every name declared in one place, where the
test checks them against NxD's signatures; the implementations live in the backends.

Rank arrangement (both backends, as neuronx-distributed's `initialize_model_parallel`): the world is
[DP, TP] row-major, so a TP group is `tp` consecutive global ranks and a DP group is the ranks with the same
TP rank, `tp` apart.

Gradient contract the training loop relies on: after `backward()`, a parameter replicated over the TP group
(norms, the MoE router, a row-parallel bias) holds the same, complete gradient on every TP rank, and a
sharded parameter holds the gradient of its own shard (the replicated K/V heads of the GQA layer hold the
complete gradient of their head on every replica, as neuronx-distributed does). The loop therefore only
averages over the DP group. One exception, sequence parallelism: a replicated parameter that sees only this
rank's slice of the sequence (the norms; the MoE router) carries `sequence_parallel_enabled = True` and holds
the gradient of that slice; `sum_sequence_parallel_gradients` completes it (neuronx-distributed's optimizer
does the same when its configuration says `sequence_parallel`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from training.config.backends import BACKENDS, Backend
from training.config.hardware import DEFAULT_GENERATION, Generation
from training.config.model import IGNORE_INDEX
from training.errors import UserError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


# Where the neuron backend finds each name (aws-neuron/neuronx-distributed src/neuronx_distributed/..., torch-xla).
LAYERS = "neuronx_distributed.parallel_layers.layers"
QKV_LINEAR = "neuronx_distributed.modules.qkv_linear"
MAPPINGS = "neuronx_distributed.parallel_layers.mappings"
LOSS_FUNCTIONS = "neuronx_distributed.parallel_layers.loss_functions"
PARALLEL_STATE = "neuronx_distributed.parallel_layers.parallel_state"
PARALLEL_UTILS = "neuronx_distributed.parallel_layers.utils"
MODEL_UTILS = "neuronx_distributed.utils.model_utils"
TRAINER = "neuronx_distributed.trainer"
NXD_UTILS = "neuronx_distributed.utils"
ACTIVATION_CHECKPOINT = "neuronx_distributed.utils.activation_checkpoint"
FLASH_ATTENTION = "neuronx_distributed.kernels.flash_attn"
XLA_MODEL = "torch_xla.core.xla_model"

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class Declaration:
    """One name of the facade: the declared signature, and the neuronx-distributed / torch-xla name it stands for.

    Calling convention (both backends): positional-only parameters (`/`) are passed by position, so their names
    are ours; every other parameter is passed by name, so its name is the neuronx-distributed one.
    """

    name: str  # the facade's name, and the cpu backend's
    module: str  # the neuron backend's: `getattr(importlib.import_module(module), attribute)`
    attribute: str
    signature: inspect.Signature
    modifies_input: bool  # the neuron implementation changes its first argument in place

    def call(self, implementation: Callable[..., Any], arguments: inspect.BoundArguments) -> Any:
        arguments.apply_defaults()
        positional, keywords = [], {}
        for name, value in arguments.arguments.items():
            if self.signature.parameters[name].kind is inspect.Parameter.POSITIONAL_ONLY:
                positional.append(value)
            else:
                keywords[name] = value
        return implementation(*positional, **keywords)


DECLARATIONS: dict[str, Declaration] = {}


def neuron(
    module: str, attribute: str | None = None, *, modifies_input: bool = False
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Declare the function below as a facade name that is `module.attribute` (default: its own name) on Neuron.

    The declared function's signature and docstring are the contract; its body is this wrapper, which binds
    the arguments to the signature (defaults filled in) and calls the active backend's implementation.
    """

    def declare(function: Callable[P, R]) -> Callable[P, R]:
        declaration = Declaration(
            function.__name__, module, attribute or function.__name__, inspect.signature(function), modifies_input
        )
        DECLARATIONS[declaration.name] = declaration

        @functools.wraps(function)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            implementation = _backend().resolve(declaration)
            result: R = declaration.call(implementation, declaration.signature.bind(*args, **kwargs))
            return result

        return run

    return declare


class ParallelBackend(Protocol):
    """What a backend module provides; `training.model.cpu_backend`, `training.model.neuron_backend` and
    `training.model.native_backend` conform."""

    def initialize(self, tp: int, pp: int, options: Mapping[str, Any], generation: Generation) -> None: ...
    def destroy(self) -> None: ...
    def resolve(self, declaration: Declaration) -> Callable[..., Any]:
        """The implementation of a declared name (a class or a function), called as `Declaration.call` says."""
        ...

    def complete_materialized(self, model: nn.Module) -> None:
        """After `materialize`: what this backend's layers set up only when they initialise their weights."""
        ...


_active: ParallelBackend | None = None
_active_name: Backend | None = None
_active_generation: Generation = DEFAULT_GENERATION


def _load(backend: Backend) -> ParallelBackend:
    # Imported on demand: the Neuron backend needs packages that exist only on Trainium hosts.
    if backend == "cpu":
        from training.model import cpu_backend

        return cpu_backend
    if backend == "torch-native":
        from training.model import native_backend

        return native_backend
    from training.model import neuron_backend

    return neuron_backend


def initialize(
    tp: int = 1,
    backend: Backend = "cpu",
    neuron_options: Mapping[str, Any] | None = None,
    pp: int = 1,
    generation: Generation = DEFAULT_GENERATION,
) -> None:
    """Start torch.distributed if needed (env:// under torchrun, a one-process world otherwise) and the groups
    (the world is [PP, DP, TP] row-major).

    `neuron_options`: keyword arguments of neuronx-distributed's `neuronx_distributed_config` besides the TP
    degree (optimizer and mixed-precision settings); that call creates the model-parallel groups, once.
    `generation`: the Trainium generation the model's K/V replicas are laid out for; the cpu backend groups the
    ranks sharing a KV head as NxD does on it, the neuron backend refuses a host of another generation.
    """
    global _active, _active_name, _active_generation
    if backend not in BACKENDS:
        raise UserError(f"parallel backend {backend!r} is not supported; allowed: {', '.join(BACKENDS)}")
    if _active is not None:
        raise RuntimeError(f"the {_active_name} parallel backend is already initialized; call destroy() first")
    implementation = _load(backend)
    implementation.initialize(tp, pp, dict(neuron_options or {}), generation)
    _active, _active_name, _active_generation = implementation, backend, generation


def destroy() -> None:
    """Tear down the groups (and the process group if `initialize` created it); safe to call twice."""
    global _active, _active_name, _active_generation
    if _active is not None:
        _active.destroy()
    _active, _active_name, _active_generation = None, None, DEFAULT_GENERATION


def is_initialized() -> bool:
    return _active is not None


def generation() -> Generation:
    """The Trainium generation the initialized world lays K/V replicas out for (`initialize`)."""
    _backend()
    return _active_generation


def backend() -> Backend:
    _backend()
    assert _active_name is not None
    return _active_name


def _backend() -> ParallelBackend:
    if _active is None:
        raise RuntimeError("training.model.parallel is not initialized; call parallel.initialize(tp, backend) first")
    return _active


# --- ranks, groups, device (both backends run torch.distributed, so the world is its own) ------------------


def world_rank() -> int:
    _backend()
    return dist.get_rank()


def world_size() -> int:
    _backend()
    return dist.get_world_size()


@neuron(PARALLEL_STATE, "get_tensor_model_parallel_rank")
def tp_rank() -> int:
    """This process's rank in its TP group (global rank modulo `tp`)."""


@neuron(PARALLEL_STATE, "get_tensor_model_parallel_size")
def tp_size() -> int:
    """The tensor-parallel degree."""


@neuron(PARALLEL_STATE, "get_tensor_model_parallel_group")
def tp_group() -> ProcessGroup:
    """The `tp` consecutive global ranks this process shares its layers' shards with."""


@neuron(PARALLEL_STATE, "get_data_parallel_rank")
def dp_rank() -> int:
    """This process's rank in its DP group (global rank divided by `tp`, modulo the DP degree)."""


@neuron(PARALLEL_STATE, "get_data_parallel_size")
def dp_size() -> int:
    """The data-parallel degree (world size divided by `tp x pp`)."""


@neuron(PARALLEL_STATE, "get_data_parallel_group")
def dp_group() -> ProcessGroup:
    """The ranks with this process's TP rank, `tp` apart: the replicas of its shards."""


@neuron(PARALLEL_STATE, "get_pipeline_model_parallel_rank")
def pp_rank() -> int:
    """This process's pipeline stage (global rank divided by tp x dp)."""


@neuron(PARALLEL_STATE, "get_pipeline_model_parallel_size")
def pp_size() -> int:
    """The number of pipeline stages."""


@neuron(PARALLEL_STATE, "get_pipeline_model_parallel_group")
def pp_group() -> ProcessGroup:
    """The ranks with this process's TP and DP ranks, one per stage, `tp x dp` apart."""


@neuron(NXD_UTILS, "get_device")
def device() -> torch.device:
    """Where parameters and batches live: the CPU, or this process's NeuronCore (an XLA device; the CPU in
    neuronx-distributed's CPU mode, `NXD_CPU_MODE=1`)."""


@neuron(NXD_UTILS)
def mark_step() -> None:
    """End of a lazily traced step (cuts and runs the XLA graph on Neuron; nothing on CPU or in NxD's CPU mode)."""


@neuron(XLA_MODEL)
def add_step_closure(closure: Callable[..., Any], args: tuple[Any, ...] = ()) -> None:
    """Run `closure(*args)` once the current graph has run, when reading its tensors costs no extra graph
    (at the next `mark_step` on Neuron; at once on CPU, where values are always ready)."""


@neuron(XLA_MODEL)
def rendezvous(tag: str, /, payload: bytes = b"") -> Any:
    """Wait until every process has got here (torch-xla's rendezvous, a small collective graph of its own on
    Neuron: neuronx-distributed's checkpoint save starts with one; a barrier on CPU)."""


@neuron(PARALLEL_UTILS)
def set_tensor_model_parallel_attributes(
    tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int, num_partitions: int = -1
) -> None:
    """Mark a parameter that is not one of the parallel layers' as this rank's shard of a tensor split on `dim`
    over `num_partitions` ranks: neuronx-distributed's gradient norm and ZeRO-1 read these attributes (a
    parameter without them counts as replicated)."""


@neuron(MODEL_UTILS)
def move_model_to_device(model: nn.Module, device: torch.device) -> None:
    """`model.to(device)` keeping what a plain `.to` loses on XLA: neuronx-distributed's tensor-parallel
    parameter attributes, and weights shared between modules (they would become two tensors)."""


# --- building a model whose weights are loaded next: no random initialisation ----------------------------


@neuron(MODEL_UTILS)
@contextmanager
def init_on_device(
    device: torch.device, include_buffers: bool = False, force_custom_init_on_device: bool = False
) -> Iterator[None]:
    """Inside, every parameter a module registers is moved to `device` as it is registered (buffers too with
    `include_buffers`); attributes and shared parameters are kept.

    With `torch.device("meta")` this is how neuronx-distributed builds a model without initialising it (its
    trainer's `meta_device_init`, trainer/trainer.py `initialize_parallel_model`, calls it so, with
    `force_custom_init_on_device=True`): every parallel layer registers its weight first and initialises it
    only when it is not on the meta device (parallel_layers/layers.py: ParallelEmbedding, ColumnParallelLinear,
    RowParallelLinear; modules/qkv_linear.py: GQAQKVColumnParallelLinear), so neither the full-size fp32
    master weight each rank builds nor the random values are made. The cpu backend's layers check the same.
    `force_custom_init_on_device` picks NxD's own implementation over accelerate's (which, NxD notes, turns
    `requires_grad=False` back on and breaks shared weights); the cpu backend has one implementation.
    `materialize` gives the parameters storage.
    """


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give every meta parameter (built under `init_on_device(torch.device("meta"))`) uninitialised storage on
    `device`, for weights loaded next: neuronx-distributed's `reinit_model(model, device, param_init_fn)`
    (utils/model_utils.py: `torch.empty_like(param, device=device)` per parameter) with a `param_init_fn` that
    does nothing. Unlike it, every attribute of a parameter is kept (its `preserve_parallel_attributes` keeps
    four named ones) and a parameter shared by two modules stays one tensor (its `preserve_shared_weights`
    re-ties only Hugging Face models); then the backend restores what its layers set only when initialising.
    Every value is garbage until loaded: a caller loads all of them (a strict state dict) before any use.
    (`torch.empty` of the shape, not `empty_like`: from the meta device that goes through torch's Python
    references, whose first use imports sympy, a second at start-up.)
    """
    made: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # the meta parameter kept alive: ids stay unique
    for module in model.modules():
        for name, parameter in module._parameters.items():
            if parameter is None or parameter.device.type != "meta":
                continue
            if id(parameter) not in made:
                empty = _empty_like(parameter, device)
                storage = nn.Parameter(empty, parameter.requires_grad)
                storage.__dict__.update({k: v for k, v in parameter.__dict__.items() if k != "requires_grad"})
                made[id(parameter)] = (parameter, storage)
            module._parameters[name] = made[id(parameter)][1]
    _backend().complete_materialized(model)


def _empty_like(parameter: torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(parameter, DTensor):  # the torch-native backend's: storage for this rank's shard only
        local = torch.empty(parameter.to_local().shape, dtype=parameter.dtype, device=device)
        return DTensor.from_local(
            local,
            parameter.device_mesh,
            parameter.placements,
            run_check=False,
            shape=parameter.shape,
            stride=parameter.stride(),
        )
    return torch.empty(parameter.shape, dtype=parameter.dtype, device=device)


def local_view(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter, sharing its storage: the tensor itself, or a DTensor's local tensor
    (the torch-native backend's parallel weights), which is what the layouts' per-rank rules describe."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


# --- layers: neuronx-distributed's constructor arguments and semantics ------------------------------------


@neuron(LAYERS)
def ColumnParallelLinear(
    input_size: int,
    output_size: int,
    bias: bool = True,
    gather_output: bool = True,
    dtype: torch.dtype = torch.float32,
    stride: int = 1,
    sequence_parallel_enabled: bool = False,
    sequence_dimension: int | None = None,
) -> nn.Module:
    """y = x A^T + b with A split by rows (output features): rank r holds rows [r*O/tp, (r+1)*O/tp).

    `gather_output=False` leaves each rank with its slice of y. `stride` only shapes neuronx-distributed's
    own random initialisation (interleaved parts such as gate/up); the CPU backend accepts and ignores it.
    The bias is [O] when the output is gathered, else [O/tp].

    `sequence_parallel_enabled`: x is this rank's slice of the sequence (dimension `sequence_dimension`); it is
    gathered over the TP group for the product and only the slice is kept for backward, which gathers it
    again and reduce-scatters the input gradient.
    """


@neuron(LAYERS)
def RowParallelLinear(
    input_size: int,
    output_size: int,
    bias: bool = True,
    input_is_parallel: bool = False,
    dtype: torch.dtype = torch.float32,
    sequence_parallel_enabled: bool = False,
    sequence_dimension: int | None = None,
) -> nn.Module:
    """y = sum over ranks of x_r A_r^T, A split by columns; the output is all-reduced, the bias [O] added once.

    `input_is_parallel=False` takes the full x and scatters it (each rank its slice of the input features).
    `sequence_parallel_enabled` (needs `input_is_parallel`): the sum is reduce-scattered along
    `sequence_dimension` instead, each rank keeping its slice of the sequence.
    """


@neuron(LAYERS)
def ParallelEmbedding(
    num_embeddings: int,
    embedding_dim: int,
    padding_idx: int | None = None,
    dtype: torch.dtype = torch.float32,
    sequence_parallel_enabled: bool = False,
) -> nn.Module:
    """Vocabulary-parallel lookup: rank r holds rows [r*V/tp, (r+1)*V/tp); the rows are summed over ranks.

    The `padding_idx` row gets no gradient (as in torch.nn.Embedding), on the rank that holds it.
    `sequence_parallel_enabled`: ids [B, S] give [S/tp, B, H], this rank's slice of the sequence-first sum
    (a reduce-scatter instead of the all-reduce).
    """


@neuron(QKV_LINEAR)
def GQAQKVColumnParallelLinear(
    input_size: int,
    output_sizes: list[int],
    bias: bool = True,
    gather_output: bool = True,
    dtype: torch.dtype = torch.float32,
    sequence_parallel_enabled: bool = False,
    kv_size_multiplier: int = 1,
    fuse_qkv: bool = True,
) -> nn.Module:
    """Q, K and V projections; returns (q, k, v). `output_sizes` = [query features, key/value features].

    `sequence_parallel_enabled`: the input is [S/tp, B, H], this rank's slice of the sequence (dimension 0),
    gathered for the products as ColumnParallelLinear does.

    K and V are repeated `kv_size_multiplier` times and then split over the TP ranks, so a model with fewer
    KV heads than ranks gives every rank one (REFERENCE.md section 5); each rank's query heads belong to its
    own KV heads. Parameters: `weight_q`, `weight_k`, `weight_v`, or `weight_qkv` = cat(q, k, v) per rank
    when `fuse_qkv`.
    """


# --- loss -------------------------------------------------------------------------------------------------


@neuron(LOSS_FUNCTIONS, "parallel_cross_entropy", modifies_input=True)
def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, /) -> torch.Tensor:
    """-log softmax(logits)[target] per token, from this rank's vocabulary slice of the logits ([..., V/tp]).

    A target in no rank's slice (IGNORE_INDEX) gives the log-sum-exp; `parallel_cross_entropy` zeroes it.
    neuronx-distributed's version subtracts the maximum from its input in place; the neuron backend passes it a
    copy, so on both backends the caller's logits stay untouched.
    """


def parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy from this rank's vocabulary slice of the logits ([..., V/tp]) and full labels.

    Positions labelled IGNORE_INDEX (-100) get a loss of 0 here (and no gradient), on both backends;
    averaging over the remaining tokens is the caller's choice. The logits are not modified.
    """
    losses = vocab_parallel_cross_entropy(vocab_parallel_logits, labels)
    return losses * (labels != IGNORE_INDEX).to(losses.dtype)


# --- collectives with their autograd (Megatron's mappings) -----------------------------------------------


@neuron(MAPPINGS)
def copy_to_tensor_model_parallel_region(tensor: torch.Tensor, /) -> torch.Tensor:
    """Identity forward; gradients summed over the TP group (entering a region where ranks use partial weights)."""


@neuron(MAPPINGS)
def reduce_from_tensor_model_parallel_region(tensor: torch.Tensor, /) -> torch.Tensor:
    """Partial results summed over the TP group; gradient passed through unchanged."""


@neuron(MAPPINGS)
def gather_from_tensor_model_parallel_region(tensor: torch.Tensor, /) -> torch.Tensor:
    """Slices concatenated along the last dimension in TP-rank order; the gradient is sliced back."""


@neuron(MAPPINGS)
def scatter_to_tensor_model_parallel_region(tensor: torch.Tensor, /) -> torch.Tensor:
    """This rank's slice of the last dimension; gradients gathered back."""


@neuron(MAPPINGS)
def gather_from_sequence_parallel_region(
    tensor: torch.Tensor, /, sequence_dimension: int = 0, to_model_parallel: bool = True
) -> torch.Tensor:
    """The sequence slices concatenated along `sequence_dimension` in TP-rank order. Backward: the gradients are
    reduce-scattered (`to_model_parallel`: each rank computed a partial result from the whole sequence) or
    just sliced (not: every rank computed the same result)."""


@neuron(MAPPINGS)
def reduce_scatter_to_sequence_parallel_region(tensor: torch.Tensor, /, sequence_dimension: int = 0) -> torch.Tensor:
    """Partial results summed over the TP group, each rank keeping its slice of `sequence_dimension`;
    the gradient is gathered back."""


# --- memory: recomputation and attention that keeps no S x S scores --------------------------------------


@neuron(ACTIVATION_CHECKPOINT)
def apply_activation_checkpointing(model: nn.Module, /, check_fn: Callable[[nn.Module], bool]) -> None:
    """Every submodule `check_fn` accepts keeps only its inputs for backward and runs its forward again there.

    Parameter names and the state dict stay as they were (neuronx-distributed's wrapper hides its prefix).
    """


@neuron(FLASH_ATTENTION)
def nki_flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    /,
    softmax_scale: float | None = None,
    causal: bool = True,
    mixed_precision: bool = True,
    transpose_nki_inputs: bool = True,
) -> torch.Tensor:
    """softmax(q k^T * scale, causal) v without materialising the S x S scores, forward or backward.

    q, k, v are [B, heads, head_dim, S] with `transpose_nki_inputs` (the kernel's own layout, nothing to
    transpose: neuronx-distributed's default), else [B, heads, S, head_dim]; K and V with as many heads as q;
    the result is [B, heads, S, head_dim]. `mixed_precision`: softmax statistics in fp32. On Neuron this is the
    NKI kernel (sequences in multiples of 2048); on CPU, torch's flash attention kernel.
    """


# --- sequence-parallel gradients (both backends: the TP group is a torch.distributed group) ---------------


def mark_sequence_parallel(parameter: torch.Tensor) -> None:
    """A replicated parameter used on this rank's sequence slice only: its gradient is summed over TP."""
    parameter.sequence_parallel_enabled = True  # type: ignore[attr-defined]  # the attribute NxD reads


def sum_sequence_parallel_gradients(parameters: Iterable[torch.Tensor]) -> None:
    """Sum the gradients of the marked parameters over the TP group (before any data-parallel reduction)."""
    if tp_size() == 1:
        return
    for parameter in parameters:
        if getattr(parameter, "sequence_parallel_enabled", False) and parameter.grad is not None:
            dist.all_reduce(local_view(parameter.grad), group=tp_group())  # a DTensor's: this rank's slice
