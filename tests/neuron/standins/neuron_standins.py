"""Stand-ins for the Neuron SDK's binary packages, so neuronx-distributed's Python code runs on XLA:CPU.

`torch_neuronx`, `neuronxcc` and `libneuronxla` wrap the Neuron compiler and runtime, which exist only on
Trainium hosts (their PyPI entries are placeholders). neuronx-distributed imports them at module level for
tracing, NKI kernels and compilation. Every module and attribute under those names is a placeholder class:
importing, subclassing, decorating and annotating work, a placeholder's attributes and items are
placeholders, and `get_platform_target()` answers "trn1" (or, as the real one does,
NEURON_PLATFORM_TARGET_OVERRIDE). The exceptions are the two NKI flash attention kernels NxD's
`nki_flash_attn_func` launches and their `FlashConfig` (`STANDIN_ATTRIBUTES`): exact attention
in plain torch ops on the tensors' own device, in the kernels' layouts, each launch counted (`KERNEL_CALLS`).
`libneuronxla.libneuronpjrt_path` stays absent on purpose: its presence would switch torch-xla to the
Neuron PJRT plugin. The real torch_neuronx also registers `torch.classes.neuron.*` from its C++ library;
NxD uses them as annotations, so the stand-in registers placeholders. Three differences of the CPU device are
bridged too: see `_host_world_size`, `_rendezvous_across_processes` and `_all_reduce_across_processes`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ROOTS = frozenset({"torch_neuronx", "neuronxcc", "libneuronxla"})
ABSENT = frozenset({"libneuronxla.libneuronpjrt_path"})
PLATFORM = "trn1"


class _PlaceholderType(type):
    """Any attribute of a placeholder class is another placeholder class."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return placeholder(f"{cls.__qualname__}.{name}")


def placeholder(name: str) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        self.arguments = (args, kwargs)

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Used as a decorator (`@nki.jit`, `@nki.jit(...)`): hand back what it decorates.
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return placeholder(name)()

    def __getattr__(self: Any, attribute: str) -> Any:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return placeholder(f"{name}.{attribute}")()

    def __getitem__(self: Any, key: Any) -> Any:
        return placeholder(f"{name}[]")()

    namespace = {"__init__": __init__, "__call__": __call__, "__getattr__": __getattr__, "__getitem__": __getitem__}
    return _PlaceholderType(name, (), {**namespace, "__module__": name})


def _platform_target(*args: Any, **kwargs: Any) -> str:
    # As torch-neuronx's: NEURON_PLATFORM_TARGET_OVERRIDE first (how a test pretends to be another generation).
    return os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE") or PLATFORM


# --- NKI flash attention --------------------------------------------------------------------------------------

KERNEL_CALLS: Counter[str] = Counter()  # launches per kernel name, for tests: `KERNEL_CALLS["flash_fwd"]`
P_MAX = 128  # nl.tile_size.pmax: the partitions of an SBUF tile, the first axis of lse's tiles


@dataclass(frozen=True)
class FlashConfig:
    """`neuronxcc.nki.kernels.attention.FlashConfig`: the kernel's performance settings and its layout switch."""

    seq_tile_size: int = 2048
    attn_core_tile_size: int = 256
    training: bool = True
    should_transpose_v: bool = False
    lse_dtype: str = ""


class NkiKernel:
    """An `@nki.jit` kernel: `kernel[grid]` launches it over an SPMD grid; the stand-in runs the whole grid at
    once (one count per launch) and checks the grid is the one the real kernel's programs would cover.

    The contract, as neuronx-distributed 2.28 uses the kernels (neuronx_distributed/kernels/flash_attn.py, "L"
    below) and as the kernels themselves declare it (`neuronxcc.nki.kernels` is published as
    aws-neuron/nki-samples, src/nki_samples/reference/attention.py: `flash_fwd`, `flash_attn_bwd`, `FlashConfig`):

    - L18 imports `flash_fwd, flash_attn_bwd` from `neuronxcc.nki.kernels`, L8 `FlashConfig` from
      `neuronxcc.nki.kernels.attention`; both are launched over an SPMD grid of one program per (batch, head):
      `flash_fwd[bs, num_heads](...)` (L58) and `flash_attn_bwd[bs, num_heads](...)` (L83), `num_heads` being
      q's heads (L32, L72). (The trn2 path, lnc 2, launches over `nl.nc(lnc) * ...`, L51/L76: not stood in.)
    - Layouts into the forward. `nki_flash_attn_func` (L192-197): with `transpose_nki_inputs` (NxD's default)
      the caller already gives q, k, v as [B, H, d, S]; without, it gives [B, H, S, d] and
      `kernel_utils.permute` (kernel_utils.py L23-25) transposes all three to [B, H, d, S]. Then
      `NKIAttnFunc.forward` (L114-117) passes v unchanged with `transpose_nki_inputs` ([B, H, d, S], and
      `FlashConfig(should_transpose_v=True)`, L40-44) or `v.permute(0, 1, 3, 2)` without ([B, H, S, d], config
      None unless the XLA bf16 flags ask for `lse_dtype="bfloat16"`). q and k are always [B, H, d, S]. This is
      the kernel's own declaration: "q (bs, n_heads, d, seq_q), k (bs, nk_heads, d, seq_k), v (bs, nv_heads, d,
      seq_v) if config.should_transpose_v else (bs, nv_heads, seq_v, d)".
    - The forward returns `(o, lse)` (L58): o is [B, H, S, d] (the kernel: "o: shape (bs, n_heads, seq_q, d)"),
      the autograd output, which is why `NKIAttnFunc.backward` transposes both it and its gradient dout
      (L142-143) before the backward kernel. lse is [B, H, 128, S/128] (the kernel: "(bs, n_heads,
      nl.tile_size.pmax, seq // nl.tile_size.pmax) if training"): lse[b, h, p, t] is the natural log-sum-exp
      of the scaled, masked scores of query t * 128 + p (the kernel's accumulator is 128 partitions x query
      tiles), in `config.lse_dtype` if set, else fp32 under `mixed_precision`, else q's dtype. The scale is
      `softmax_scale`, which NKIAttnFunc always sets (L108-109: d ** -0.5 by default, d = q.shape[-2]).
      `config.training=False` (never from NxD) returns o alone.
    - The backward (L141-159, L83): q, k, v as saved by the forward (L128: the [B, H, d, S] ones, v before the
      transposition of L117), o and dy transposed to [B, H, d, S], the forward's lse and seed; it returns
      (dq, dk, dv) as [B, H, d, S] (the kernel: "out_dq_ref ... (bs, nheads, head_size, seq)", q's dtype), which
      L159 hands back as the gradients of NKIAttnFunc's q, k, v, i.e. in their layout. The kernel's steps:
      D = rowsum(dy * o); P = exp(scale * q^T k (masked) - lse); dV = P^T dy; dP = dy V^T; dS = P * (dP - D);
      dQ = scale * dS K; dK = scale * dS^T Q. It recomputes the scores from the lse, never runs the forward.
    - Sequences: the kernel needs seq_k divisible by `config.seq_tile_size` (2048) and seq_q by 128; NxD
      refuses other lengths itself (L199-200). head_dim <= 128. GQA: the forward's grid would be over KV
      heads (query heads `head_id * group + i` share KV head `head_id`); NxD launches over q's heads, so K and V
      come with as many heads as q (the model repeats them), which the backward requires anyway.

    The stand-ins compute that exactly in fp32 with torch ops on the tensors' device (XLA:CPU in the tier);
    `mixed_precision`'s bf16 matmul inputs on the Tensor Engine are not imitated (the fp32 accumulation is), so
    the tier compares flash attention with exact references. Dropout, logit bias and sliding windows (which
    NxD's training path never passes) are refused."""

    def __init__(self, name: str, body: Callable[..., Any]) -> None:
        self.name, self.body = name, body

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        grid = tuple(grid) if isinstance(grid, tuple | list) else (grid,)
        if not all(isinstance(size, int) for size in grid):
            raise NotImplementedError(f"{self.name} stand-in: grid {grid!r}; allowed: integers (no nl.nc(), lnc 1)")

        def launch(*args: Any, **kwargs: Any) -> Any:
            KERNEL_CALLS[self.name] += 1
            return self.body(grid, *args, **kwargs)

        return launch

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{self.name} stand-in: launch it over a grid, {self.name}[batch, heads](...)")

    def __repr__(self) -> str:
        return f"<NKI kernel stand-in {self.name}>"


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _unsupported(name: str, **options: Any) -> None:
    for option, (value, default) in options.items():
        if value != default:
            raise NotImplementedError(f"{name} stand-in: {option}={value!r}; allowed: {default!r}")


def _scores(q: Any, k: Any, scale: float, causal: bool) -> Any:
    """scale * q k^T over q [B, H, Sq, d] and k [B, H, Sk, d] in fp32, later keys at -inf if causal."""
    import torch

    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        positions = torch.arange(q.shape[-2], device=q.device)
        later = positions[None, :] > positions[:, None]
        scores = scores.masked_fill(later, float("-inf"))
    return scores


def _lse_tiles(lse: Any) -> Any:
    """[B, H, S] -> [B, H, 128, S/128]: element (p, t) is query t * 128 + p."""
    b, h, s = lse.shape
    return lse.reshape(b, h, s // P_MAX, P_MAX).transpose(-1, -2)


def _flash_fwd(
    grid: tuple[int, ...],
    q: Any,
    k: Any,
    v: Any,
    seed: Any,
    logit_bias: Any = None,
    softmax_scale: float | None = None,
    use_causal_mask: bool = True,
    sliding_window: int = -1,
    mixed_precision: bool = True,
    dropout_p: float = 0.0,
    config: FlashConfig | None = None,
) -> Any:
    import torch

    config = config or FlashConfig()
    _unsupported("flash_fwd", logit_bias=(logit_bias, None), sliding_window=(sliding_window, -1))
    _unsupported("flash_fwd", dropout_p=(dropout_p, 0.0))
    b, h, d, seq_q = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[-1]
    _expect(tuple(k.shape) == (b, kv_heads, d, seq_k), f"flash_fwd: k {tuple(k.shape)}, expected (b, h, d, seq)")
    v_shape = (b, kv_heads, d, seq_k) if config.should_transpose_v else (b, kv_heads, seq_k, d)
    _expect(tuple(v.shape) == v_shape, f"flash_fwd: v {tuple(v.shape)}, expected {v_shape} ({config})")
    _expect(q.dtype == k.dtype == v.dtype, f"flash_fwd: dtypes {q.dtype}, {k.dtype}, {v.dtype}; one expected")
    _expect(h % kv_heads == 0 and d <= P_MAX, f"flash_fwd: {h} heads over {kv_heads} KV heads, head_dim {d}")
    _expect(grid == (b, kv_heads), f"flash_fwd: grid {grid}, expected (batch, kv heads) = {(b, kv_heads)}")
    _expect(seq_k % config.seq_tile_size == 0, f"flash_fwd: seq_k {seq_k} not a multiple of the tile size")
    _expect(seq_q % P_MAX == 0, f"flash_fwd: seq_q {seq_q} not a multiple of {P_MAX}")
    _expect(not config.training or seed is None or tuple(seed.shape) == (1,), "flash_fwd: seed shape (1,)")
    scale = softmax_scale or d**-0.5
    group = h // kv_heads
    q32 = q.float().transpose(-1, -2)  # [B, H, Sq, d]
    k32 = k.float().transpose(-1, -2).repeat_interleave(group, dim=1)
    v32 = (v.float().transpose(-1, -2) if config.should_transpose_v else v.float()).repeat_interleave(group, dim=1)
    scores = _scores(q32, k32, scale, use_causal_mask)
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, Sq]
    output = (torch.exp(scores - lse[..., None]) @ v32).to(q.dtype)  # [B, H, Sq, d]
    if not config.training:
        return output
    lse_dtype = getattr(torch, config.lse_dtype) if config.lse_dtype else torch.float32 if mixed_precision else q.dtype
    return output, _lse_tiles(lse).to(lse_dtype)


def _flash_attn_bwd(
    grid: tuple[int, ...],
    q_ref: Any,
    k_ref: Any,
    v_ref: Any,
    o_ref: Any,
    dy_ref: Any,
    lse_ref: Any,
    seed_ref: Any,
    logit_bias_ref: Any = None,
    use_causal_mask: bool = False,
    mixed_precision: bool = False,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
) -> tuple[Any, Any, Any]:
    import torch

    _unsupported("flash_attn_bwd", logit_bias_ref=(logit_bias_ref, None), dropout_p=(dropout_p, 0.0))
    b, h, d, seq_q = q_ref.shape
    seq_k = k_ref.shape[-1]
    for name, tensor, seq in (("k", k_ref, seq_k), ("v", v_ref, seq_k), ("o", o_ref, seq_q), ("dy", dy_ref, seq_q)):
        _expect(tuple(tensor.shape) == (b, h, d, seq), f"flash_attn_bwd: {name} {tuple(tensor.shape)}")
        _expect(tensor.dtype == q_ref.dtype, f"flash_attn_bwd: {name} is {tensor.dtype}, q {q_ref.dtype}")
    lse_shape = (b, h, P_MAX, seq_q // P_MAX)
    _expect(tuple(lse_ref.shape) == lse_shape, f"flash_attn_bwd: lse {tuple(lse_ref.shape)}, expected {lse_shape}")
    _expect(grid == (b, h), f"flash_attn_bwd: grid {grid}, expected (batch, heads) = {(b, h)}")
    _expect(seq_q % P_MAX == 0 and seq_k % P_MAX == 0, "flash_attn_bwd: sequences in multiples of 128")
    scale = softmax_scale or d**-0.5
    q, k, v, o, dy = (t.float().transpose(-1, -2) for t in (q_ref, k_ref, v_ref, o_ref, dy_ref))  # [B, H, S, d]
    lse = lse_ref.float().transpose(-1, -2).reshape(b, h, seq_q)
    probabilities = torch.exp(_scores(q, k, scale, use_causal_mask) - lse[..., None])  # from the saved lse
    rowsum = (dy * o).sum(dim=-1, keepdim=True)  # D = rowsum(dy * o)
    dv = probabilities.transpose(-1, -2) @ dy
    dscores = probabilities * (dy @ v.transpose(-1, -2) - rowsum)
    dq = (dscores @ k) * scale
    dk = (dscores.transpose(-1, -2) @ q) * scale
    dq, dk, dv = (t.transpose(-1, -2).to(q_ref.dtype) for t in (dq, dk, dv))  # [B, H, d, S], q's dtype
    return dq, dk, dv


flash_fwd = NkiKernel("flash_fwd", _flash_fwd)
flash_attn_bwd = NkiKernel("flash_attn_bwd", _flash_attn_bwd)

# Real attributes of the stand-in modules (every other name stays a placeholder).
STANDIN_ATTRIBUTES: dict[str, Any] = {
    "neuronxcc.nki.kernels.flash_fwd": flash_fwd,
    "neuronxcc.nki.kernels.flash_attn_bwd": flash_attn_bwd,
    "neuronxcc.nki.kernels.attention.flash_fwd": flash_fwd,
    "neuronxcc.nki.kernels.attention.flash_attn_bwd": flash_attn_bwd,
    "neuronxcc.nki.kernels.attention.FlashConfig": FlashConfig,
}


class StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or f"{self.__name__}.{name}" in ABSENT:
            raise AttributeError(name)
        value: Any = STANDIN_ATTRIBUTES.get(f"{self.__name__}.{name}")
        if value is None:
            value = _platform_target if name == "get_platform_target" else placeholder(name)
        setattr(self, name, value)
        return value


def _host_world_size(module: types.ModuleType) -> None:
    """On the CPU device NxD's `get_local_world_size` takes torch-xla's pre-PJRT path, which reads the number of
    hosts from `xenv.HOST_WORLD_SIZE` (a name torch-xla 2.9 no longer defines); on Trainium (PJRT_DEVICE=NEURON)
    it asks the runtime instead. Define the name and the value torchrun's variables imply."""
    module.HOST_WORLD_SIZE = "HOST_WORLD_SIZE"  # type: ignore[attr-defined]
    hosts = int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    os.environ.setdefault("HOST_WORLD_SIZE", str(max(hosts, 1)))


def _rendezvous_across_processes(module: types.ModuleType) -> None:
    """On Trainium torch-xla's `rendezvous` waits for every worker and exchanges their payloads (the Neuron
    runtime's collectives). On XLA:CPU each process is a world of its own, so under NxD's CPU mode (several
    processes over gloo) it would return at once, and NxD's checkpointing relies on it: rank 0 creates the
    directories and marks a save done while the others write, and a worker that looks before rank 0 has
    marked it removes its own files as an interrupted save's. There it is what it is on Trainium: a
    rendezvous of all processes (torch.distributed's default group)."""
    if int(os.environ.get("NXD_CPU_MODE", "0")) <= 0:
        return
    on_this_device = module.rendezvous

    def rendezvous(tag: str, payload: bytes = b"", replicas: Any = None) -> Any:
        import torch.distributed as dist

        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return on_this_device(tag, payload, replicas or [])
        payloads: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(payloads, payload)
        return payloads

    module.rendezvous = rendezvous  # type: ignore[attr-defined]


def _all_reduce_across_processes(module: types.ModuleType) -> None:
    """On Trainium torch-xla's `all_reduce` over replica groups is the Neuron runtime's collective across the
    workers (through the Neuron PJRT plugin). Under NxD's CPU mode NxD's GQA layer still calls it directly, on CPU
    tensors, to sum the K/V output gradients over the ranks that hold one KV head (`qkv_linear_utils`, with
    `get_kv_shared_replica_groups()`); on XLA:CPU each process is a world of its own and the sum would silently
    be this rank's alone. There it is what it is on Trainium: a sum within each replica group, over gloo."""
    if int(os.environ.get("NXD_CPU_MODE", "0")) <= 0:
        return
    on_this_device = module.all_reduce
    made: dict[Any, Any] = {}

    def all_reduce(
        reduce_type: str, inputs: Any, scale: float = 1.0, groups: Any = None, pin_layout: bool = True
    ) -> Any:
        import torch.distributed as dist

        tensors = inputs if isinstance(inputs, list) else [inputs]
        local = not (dist.is_initialized() and dist.get_world_size() > 1)
        if local or any(t.device.type != "cpu" for t in tensors):
            return on_this_device(reduce_type, inputs, scale=scale, groups=groups, pin_layout=pin_layout)
        if reduce_type != module.REDUCE_SUM:
            raise NotImplementedError(f"stand-in all_reduce across processes: {reduce_type!r} (only sum)")
        # Groups are made once per world (a process may start another) and replica-group list, by every rank.
        key = (id(dist.group.WORLD), tuple(tuple(ranks) for ranks in groups or ()))
        if key not in made:
            made[key] = [(ranks, dist.new_group(list(ranks))) for ranks in key[1]]
        mine = next((group for ranks, group in made[key] if dist.get_rank() in ranks), None)
        results = []
        for tensor in tensors:
            summed = tensor.clone()
            dist.all_reduce(summed, group=mine)
            results.append(summed * scale if scale != 1.0 else summed)
        return results if isinstance(inputs, list) else results[0]

    module.all_reduce = all_reduce  # type: ignore[attr-defined]


def _collectives_across_processes(module: types.ModuleType) -> None:
    _rendezvous_across_processes(module)
    _all_reduce_across_processes(module)


AFTER_IMPORT = {
    "torch_xla.core.xla_env_vars": _host_world_size,
    "torch_xla.core.xla_model": _collectives_across_processes,
}


class _Amended(importlib.abc.Loader):
    """The real module, with the stand-in's additions applied once it has run."""

    def __init__(self, loader: Any, amend: Any) -> None:
        self.loader, self.amend = loader, amend

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        created: types.ModuleType | None = self.loader.create_module(spec)
        return created

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        self.amend(module)


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname in AFTER_IMPORT:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _Amended(spec.loader, AFTER_IMPORT[fullname])
            return spec
        if fullname in ABSENT or fullname.split(".")[0] not in ROOTS:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__ == "torch_neuronx":
            import torch

            torch.classes.neuron = StandInModule("torch.classes.neuron")  # type: ignore[attr-defined]


def install() -> None:
    if not any(isinstance(finder, StandInFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, StandInFinder())
