"""Llama 3.x and Mixtral, written once against `training.model.parallel`, parameters held in the NxD layout.

The per-rank `state_dict()` is exactly what `training.formats.layouts` defines for "nxd" (`all_rules(spec,
Parallelism(tp, kv_multiplier, fuse_qkv), "nxd")`): a rank file written by `python -m training convert --to
nxd` loads with `load_state_dict(strict=True)`, and a state dict saved per rank converts back to Hugging
Face. The numerics follow transformers' LlamaForCausalLM / MixtralForCausalLM: RMSNorm in fp32, RoPE
(incl. Llama 3.1's "llama3" scaling), grouped-query causal attention, SiLU-gated MLP, and for Mixtral a
top-k router (softmax, top-k, renormalise) with the load-balancing auxiliary loss.

Batches are packed blocks: causal attention over the whole sequence, positions 0..S-1, no padding mask.

One module on purpose, over the 500 lines the project allows otherwise: it is the model a reader holds in their
head (nanoGPT's model.py), every layer beside the others it feeds, and the builder that puts them on the device.
What varies by name lives elsewhere: the config's parsing and FLOPs (`training.config.model`), the MoE
dispatches (`training.model.moe_dispatch`), the parallel layers (`training.model.parallel`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from training.config.backends import FACTS, MoeDispatch, default_moe_dispatch
from training.config.model import (
    IGNORE_INDEX,
    ActivationCheckpointing,
    ModelConfig,
    ModelSpec,
    Parallelism,
    Rope,
    check_parallelism,
    default_kv_multiplier,
)
from training.errors import UserError
from training.formats.layouts import all_rules, hf_shapes
from training.model import parallel
from training.model.moe_dispatch import DISPATCHES, Routed

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


def parameter_dtype(value: torch.dtype | str | None) -> torch.dtype:
    """The torch dtype of a name (the config's, or the caller's override); fp32 when none is given."""
    if value is None:
        return torch.float32
    if isinstance(value, torch.dtype):
        return value
    if value not in DTYPES:
        raise UserError(f"dtype {value!r} is not supported; allowed: {', '.join(DTYPES)}")
    return DTYPES[value]


@dataclass(frozen=True)
class Execution:
    """How the layers run, not what they hold: parameters and layout are the same for every choice, so a
    checkpoint trained with one loads into any other.

    sequence_parallel: the activations between attention and MLP (norms, residuals) are [S/tp, B, H], each
        TP rank its slice of the sequence (sequence first, as neuronx-distributed lays them out).
    activation_checkpointing: "selective" recomputes the attention core (with flash attention nothing of the
        attention: the kernel's own backward recomputes its blocks) and the MLP activation in backward,
        "full" each decoder layer (the MoE block included), keeping only its input.
    flash_attention: attention that never holds the S x S scores; otherwise scores and probabilities are
        materialised (the math neuronx-distributed's core attention does).
    """

    sequence_parallel: bool = False
    activation_checkpointing: ActivationCheckpointing = "none"
    flash_attention: bool = False


@dataclass(frozen=True)
class Experts:
    """How Mixtral's MoE block runs its experts (see `MoE`); the parameters are the same for every choice."""

    dispatch: MoeDispatch = "sparse"
    capacity_factor: float | None = None  # the capacity dispatch's

    def __post_init__(self) -> None:
        if self.dispatch == "capacity" and self.capacity_factor is None:
            raise ValueError("the capacity dispatch needs a capacity_factor")


def inverse_frequencies(rope: Rope, head_dim: int) -> torch.Tensor:
    """RoPE frequencies (fp32); "llama3" divides the low frequencies by `factor` and blends the middle band."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    frequencies = 1.0 / (rope.theta**exponents)
    if rope.type == "default":
        return frequencies
    old_context = rope.original_max_position_embeddings
    low_wavelength = old_context / rope.low_freq_factor  # longer waves than this are scaled down fully
    high_wavelength = old_context / rope.high_freq_factor  # shorter waves than this are kept
    wavelength = 2 * math.pi / frequencies
    scaled = torch.where(wavelength > low_wavelength, frequencies / rope.factor, frequencies)
    smooth = (old_context / wavelength - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    middle = ~(wavelength < high_wavelength) * ~(wavelength > low_wavelength)
    return torch.where(middle, blended, scaled)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """RoPE on the head dimension `dim` of x (cos and sin laid out like x's last two dimensions)."""
    first, second = x.chunk(2, dim=dim)
    return x * cos + torch.cat((-second, first), dim=dim) * sin


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, *, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps
        if sequence_parallel:  # it sees this rank's slice of the sequence only
            parallel.mark_sequence_parallel(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalised in fp32, scaled in the input dtype (what transformers does, so bf16 rounding matches).
        x32 = x.float()
        normalised = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normalised.to(x.dtype)


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d), causal) v over [B, heads, S, d], the S x S scores materialised: the part
    selective checkpointing recomputes (neuronx-distributed's `CoreAttention`).

    K and V arrive with their own (fewer) heads; each KV head serves `group` consecutive query heads.
    """

    def __init__(self, head_dim: int, group: int) -> None:
        super().__init__()
        self.scale, self.group = head_dim**-0.5, group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
        scores = (q @ k.transpose(-1, -2)) * self.scale
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
        probabilities = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return probabilities @ v


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int, scale: float, *, transposed: bool
) -> torch.Tensor:
    """The flash kernel over [B, heads, d, S] inputs when `transposed` (the layout the NKI kernel reads, so NxD's
    wrapper transposes nothing: `transpose_nki_inputs=True`, its default "for better perf"), else over
    [B, heads, S, d] (the layout torch's CPU kernel reads); returns [B, heads, S, d].

    A plain function, never a module, so no activation checkpointing can wrap it: the kernel keeps only q, k,
    v, its output and the log-sum-exp, and its backward kernel recomputes the scores blockwise itself. Running
    its forward again in backward (as a recomputed module would) costs a whole attention forward per layer
    and saves almost nothing; neuronx-distributed and its training library call it outside `CoreAttention`.
    """
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    output: torch.Tensor = parallel.nki_flash_attn_func(
        q, k, v, softmax_scale=scale, causal=True, mixed_precision=True, transpose_nki_inputs=transposed
    )
    return output


def attention_mask(length: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """[S, S] booleans, True where query i may NOT attend to key j: later keys, and keys beyond the sliding
    window if any. Made once per forward and shared by every layer (backward keeps one copy)."""
    distance = torch.arange(length, device=device)[:, None] - torch.arange(length, device=device)
    blocked = distance < 0
    if sliding_window is not None:
        blocked |= distance >= sliding_window
    return blocked


class Attention(nn.Module):
    """Grouped-query attention; each rank's query heads use its own (possibly replicated) KV heads.

    Input and output are [B, S, H], or [S/tp, B, H] under sequence parallelism.
    """

    def __init__(self, config: ModelConfig, parallelism: Parallelism, execution: Execution) -> None:
        super().__init__()
        spec, tp = config.spec, parallelism.tp
        self.head_dim = spec.head_dim
        self.heads = spec.num_heads // tp
        self.kv_heads = spec.num_kv_heads * parallelism.kv_multiplier // tp
        self.sequence_first = execution.sequence_parallel
        self.qkv_proj = parallel.GQAQKVColumnParallelLinear(
            spec.hidden_size,
            [spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim],
            bias=False,
            gather_output=False,
            dtype=parameter_dtype(config.dtype),
            sequence_parallel_enabled=execution.sequence_parallel,
            kv_size_multiplier=parallelism.kv_multiplier,
            fuse_qkv=parallelism.fuse_qkv,
        )
        # local query heads come in consecutive groups per KV head
        self.group = self.heads // self.kv_heads
        self.flash, self.sliding_window = execution.flash_attention, config.sliding_window
        # the kernel's own layout, so no transpose copies q, k and v (training.config.backends)
        self.flash_transposed = FACTS[parallel.backend()].flash_reads_transposed
        self.core_attention = CoreAttention(spec.head_dim, self.group)
        self.o_proj = parallel.RowParallelLinear(
            spec.num_heads * spec.head_dim,
            spec.hidden_size,
            bias=False,
            input_is_parallel=True,
            dtype=parameter_dtype(config.dtype),
            sequence_parallel_enabled=execution.sequence_parallel,
            sequence_dimension=0 if execution.sequence_parallel else None,
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self.qkv_proj(x)
        first, second = q.shape[:2]  # (B, S), or (S, B) sequence first
        if self.flash:
            length = first if self.sequence_first else second
            if self.sliding_window is not None and self.sliding_window < length:
                raise UserError(
                    f"memory.flash_attention: the model's sliding_window {self.sliding_window} is shorter than the "
                    f"sequence ({length}); flash attention is causal over the whole sequence; set it to false"
                )
        if self.flash and self.flash_transposed:
            order = (1, 2, 3, 0) if self.sequence_first else (0, 2, 3, 1)  # to [B, heads, d, S]
            q, k, v = (t.view(first, second, -1, self.head_dim).permute(order) for t in (q, k, v))
            q, k = _rotate(q, cos.t(), sin.t(), dim=-2), _rotate(k, cos.t(), sin.t(), dim=-2)
        else:
            order = (1, 2, 0, 3) if self.sequence_first else (0, 2, 1, 3)  # to [B, heads, S, d]
            q, k, v = (t.view(first, second, -1, self.head_dim).permute(order) for t in (q, k, v))
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if self.flash:
            context = flash_attention(q, k, v, self.group, self.head_dim**-0.5, transposed=self.flash_transposed)
        else:
            assert mask is not None
            context = self.core_attention(q, k, v, mask)
        back = (2, 0, 1, 3) if self.sequence_first else (0, 2, 1, 3)
        output: torch.Tensor = self.o_proj(context.permute(back).reshape(first, second, -1))
        return output


class GatedActivation(nn.Module):
    """silu(gate) * up from the [gate | up] columns: the MLP activation selective checkpointing recomputes."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class MLP(nn.Module):
    """SiLU-gated MLP; `gate_up_proj` holds this rank's gate rows then its up rows."""

    def __init__(self, config: ModelConfig, execution: Execution) -> None:
        super().__init__()
        h, i = config.spec.hidden_size, config.spec.intermediate_size
        sequence_parallel = execution.sequence_parallel
        dimension = 0 if sequence_parallel else None
        self.gate_up_proj = parallel.ColumnParallelLinear(
            h,
            2 * i,
            bias=False,
            gather_output=False,
            dtype=parameter_dtype(config.dtype),
            stride=2,
            sequence_parallel_enabled=sequence_parallel,
            sequence_dimension=dimension,
        )
        self.activation = GatedActivation()
        self.down_proj = parallel.RowParallelLinear(
            i,
            h,
            bias=False,
            input_is_parallel=True,
            dtype=parameter_dtype(config.dtype),
            sequence_parallel_enabled=sequence_parallel,
            sequence_dimension=dimension,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.down_proj(self.activation(self.gate_up_proj(x)))
        return output


class _Weight(nn.Module):
    """One stacked expert weight, registered under the module path neuronx-distributed gives it, and marked
    as this rank's shard on `dim` (as NxD's own expert modules mark theirs)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, *, dim: int, stride: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype))
        if self.weight.device.type != "meta":  # as the parallel layers: nothing to initialise when built on meta
            with torch.no_grad():
                self.weight.normal_(std=0.02)
        parallel.set_tensor_model_parallel_attributes(
            self.weight, is_parallel=True, dim=dim, stride=stride, num_partitions=parallel.tp_size()
        )


class _ExpertWeights(nn.Module):
    def __init__(self, config: ModelConfig, tp: int) -> None:
        super().__init__()
        e, h, part = config.spec.num_experts, config.spec.hidden_size, config.spec.intermediate_size // tp
        # [gate | up] columns of this rank: split on the last dimension in two interleaved parts (stride 2).
        self.gate_up_proj = _Weight((e, h, 2 * part), parameter_dtype(config.dtype), dim=2, stride=2)
        self.down_proj = _Weight((e, part, h), parameter_dtype(config.dtype), dim=1, stride=1)


class _ExpertMLPs(nn.Module):
    def __init__(self, config: ModelConfig, tp: int) -> None:
        super().__init__()
        self.mlp_op = _ExpertWeights(config, tp)


class _Router(nn.Module):
    def __init__(self, config: ModelConfig, sequence_parallel: bool) -> None:
        super().__init__()
        spec = config.spec
        self.linear_router = nn.Linear(
            spec.hidden_size, spec.num_experts, bias=False, dtype=parameter_dtype(config.dtype)
        )
        if sequence_parallel:  # routes this rank's slice of the tokens only
            parallel.mark_sequence_parallel(self.linear_router.weight)


class MoE(nn.Module):
    """Mixtral's sparse MoE: softmax over the router logits, top-k, renormalised, weighted sum of experts.

    The router is replicated; each rank holds I/tp columns of every expert and the partial outputs are
    summed over TP. The routing weights enter the TP region like activations do, so the router's gradient
    is complete on every rank. `experts.dispatch` names how the experts run (`training.model.moe_dispatch`:
    sparse, dense or capacity; the same function while nothing is dropped). `dropped` holds the number of
    choices the capacity dispatch dropped in the last forward.
    """

    def __init__(self, config: ModelConfig, tp: int, experts: Experts, execution: Execution) -> None:
        super().__init__()
        self.top_k, self.dispatch, self.capacity_factor = (
            config.experts_per_token,
            experts.dispatch,
            experts.capacity_factor,
        )
        self.run_experts = DISPATCHES[experts.dispatch]
        self.dropped: torch.Tensor | None = None
        self.sequence_parallel = execution.sequence_parallel
        self.router = _Router(config, execution.sequence_parallel)
        self.expert_mlps = _ExpertMLPs(config, tp)
        self.activation = GatedActivation()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the output and the router logits of every token ([tokens, E], for the auxiliary loss).

        Under sequence parallelism each rank routes its own tokens, then tokens and routing weights are
        gathered for the experts (each rank holds I/tp columns of every expert) and the partial outputs are
        reduce-scattered back to the sequence slices.
        """
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        # The router in fp32, as neuronx-distributed's (bf16 logits would flip near-tied expert choices).
        logits = F.linear(tokens.float(), self.router.linear_router.weight.float())
        top_weights, top_experts = F.softmax(logits, dim=-1).topk(self.top_k, dim=-1)
        top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        if self.sequence_parallel:
            local = parallel.gather_from_sequence_parallel_region(tokens)
            weights = parallel.gather_from_sequence_parallel_region(top_weights)
            top_experts = parallel.gather_from_sequence_parallel_region(top_experts)
            # every rank computes the balance loss of all tokens: each takes back its own slice's gradient
            logits = parallel.gather_from_sequence_parallel_region(logits, to_model_parallel=False)
        else:
            local = parallel.copy_to_tensor_model_parallel_region(tokens)
            weights = parallel.copy_to_tensor_model_parallel_region(top_weights)
        experts = self.expert_mlps.mlp_op
        gate_up, down = (parallel.local_view(w.weight) for w in (experts.gate_up_proj, experts.down_proj))
        routed = Routed(local, weights, top_experts, gate_up, down)
        partial, self.dropped = self.run_experts(routed, self.activation, self.capacity_factor)
        if self.sequence_parallel:
            return parallel.reduce_scatter_to_sequence_parallel_region(partial).view(shape), logits
        return parallel.reduce_from_tensor_model_parallel_region(partial).view(shape), logits


def balance_sums(
    router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top-k choices per expert, router probability per expert, rows) summed over layers and tokens: what the
    balance loss needs, additive over layers, so pipeline stages pass their running sums on."""
    chosen = torch.zeros(num_experts, device=router_logits[0].device)
    probability = torch.zeros(num_experts, device=router_logits[0].device)
    rows = 0
    for logits in router_logits:
        probabilities = F.softmax(logits, dim=-1)
        picks = probabilities.topk(top_k, dim=-1).indices
        chosen = chosen + F.one_hot(picks, num_experts).sum(dim=(0, 1)).float()
        probability = probability + probabilities.float().sum(dim=0)
        rows += logits.shape[0]
    return chosen, probability, torch.tensor(float(rows), device=chosen.device)


def balance_loss(chosen: torch.Tensor, probability: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Switch-Transformer balance loss, as transformers' Mixtral computes it:
    E * sum_e (fraction of top-k choices going to e) * (mean router probability of e)."""
    return chosen.shape[0] * torch.sum((chosen / rows) * (probability / rows))


@dataclass(frozen=True)
class Stage:
    """This rank's pipeline stage: which layers it holds (contiguous, as the converter splits them)."""

    index: int = 0
    count: int = 1

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def layers(self, total: int) -> range:
        per_stage = total // self.count
        return range(self.index * per_stage, (self.index + 1) * per_stage)


@dataclass
class StageCarry:
    """What a pipeline stage hands the next: the hidden states and the balance loss's running sums."""

    hidden: torch.Tensor
    balance: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # chosen, probability, rows


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        parallelism: Parallelism,
        experts: Experts,
        execution: Execution,
    ) -> None:
        super().__init__()
        h, eps, sequence_parallel = config.spec.hidden_size, config.rms_norm_eps, execution.sequence_parallel
        self.input_layernorm = RMSNorm(h, eps, parameter_dtype(config.dtype), sequence_parallel=sequence_parallel)
        self.self_attn = Attention(config, parallelism, execution)
        self.post_attention_layernorm = RMSNorm(
            h, eps, parameter_dtype(config.dtype), sequence_parallel=sequence_parallel
        )
        self.mlp: nn.Module = (
            MoE(config, parallelism.tp, experts, execution)
            if config.spec.architecture == "mixtral"
            else MLP(config, execution)
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        output = self.mlp(self.post_attention_layernorm(x))
        if isinstance(output, tuple):
            return x + output[0], output[1]
        return x + output, None


class Decoder(nn.Module):
    """The layers of this rank's stage (all of them without pipeline parallelism), under their global indices;
    the embedding on the first stage, the final norm on the last."""

    def __init__(
        self,
        config: ModelConfig,
        parallelism: Parallelism,
        experts: Experts,
        execution: Execution,
        stage: Stage = Stage(),
    ) -> None:
        super().__init__()
        spec = config.spec
        self.execution, self.sliding_window, self.tp = execution, config.sliding_window, parallelism.tp
        if stage.first:
            self.embed_tokens = parallel.ParallelEmbedding(
                spec.vocab_size,
                spec.hidden_size,
                padding_idx=config.pad_token_id,
                dtype=parameter_dtype(config.dtype),
                sequence_parallel_enabled=execution.sequence_parallel,
            )
        self.layers = nn.ModuleDict(
            {
                str(index): DecoderLayer(config, parallelism, experts, execution)
                for index in stage.layers(spec.num_layers)
            }
        )
        if stage.last:
            self.norm = RMSNorm(
                spec.hidden_size,
                config.rms_norm_eps,
                parameter_dtype(config.dtype),
                sequence_parallel=execution.sequence_parallel,
            )
        frequencies = inverse_frequencies(config.rope, spec.head_dim)
        self.rope_frequencies: torch.Tensor
        self.register_buffer("rope_frequencies", frequencies, persistent=False)  # not part of the layout

    def sequence_length(self, hidden: torch.Tensor) -> int:
        return hidden.shape[0] * self.tp if self.execution.sequence_parallel else hidden.shape[1]

    def run_layers(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """This stage's layers on hidden states [B, S, H] (sequence parallel: [S/tp, B, H]); also returns each
        MoE layer's router logits."""
        length = self.sequence_length(x)
        positions = torch.arange(length, device=x.device, dtype=torch.float32)
        angles = positions[:, None] * self.rope_frequencies.float()[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        # one mask for all layers (flash attention needs none)
        mask = None if self.execution.flash_attention else attention_mask(length, self.sliding_window, x.device)
        router_logits = []
        for layer in self.layers.values():
            x, logits = layer(x, cos, sin, mask)
            if logits is not None:
                router_logits.append(logits)
        return x, router_logits


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # fp32, this rank's vocabulary slice [B, S, V/tp]
    loss: torch.Tensor | None  # mean over labelled tokens (+ aux_loss when present)
    aux_loss: torch.Tensor | None  # router load-balancing loss, already times router_aux_loss_coef
    dropped: torch.Tensor | None = None  # capacity dispatch: token-expert choices dropped, all layers


class CausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        parallelism: Parallelism,
        *,
        experts: Experts,
        router_aux_loss: bool,
        execution: Execution = Execution(),
        stage: Stage = Stage(),
    ) -> None:
        super().__init__()
        self.config, self.parallelism, self.router_aux_loss = config, parallelism, router_aux_loss
        self.execution, self.stage = execution, stage
        spec = config.spec
        self.model = Decoder(config, parallelism, experts, execution, stage)
        if stage.last:
            self.lm_head = parallel.ColumnParallelLinear(
                spec.hidden_size,
                spec.vocab_size,
                bias=False,
                gather_output=False,
                dtype=parameter_dtype(config.dtype),
                sequence_parallel_enabled=execution.sequence_parallel,
                sequence_dimension=0 if execution.sequence_parallel else None,
            )
        self.tie_weights()
        expected = {
            rule.target for rules in all_rules(spec, parallelism, "nxd") for rule in rules if rule.stage == stage.index
        }
        if set(self.state_dict()) != expected:
            raise AssertionError(f"model parameters differ from the nxd layout: {set(self.state_dict()) ^ expected}")

    @property
    def spec(self) -> ModelSpec:
        return self.config.spec

    @property
    def parameter_dtype(self) -> torch.dtype:
        return parameter_dtype(self.config.dtype)

    def tie_weights(self) -> None:
        """Head and embedding as one parameter when the config ties them (both are split on the vocabulary rows
        the same way, so each rank shares its shard)."""
        if self.spec.tie_word_embeddings and self.stage.first and self.stage.last:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> CausalLMOutput:
        """`labels[t]` is the target of position t (already shifted); IGNORE_INDEX marks positions without one."""
        output = self.forward_stage(input_ids, labels)
        assert isinstance(output, CausalLMOutput), "forward() runs the whole model: use forward_stage per stage"
        return output

    def forward_stage(
        self, inputs: torch.Tensor | StageCarry, labels: torch.Tensor | None = None
    ) -> CausalLMOutput | StageCarry:
        """This stage's part of the forward pass: token ids on the first stage, the previous stage's carry on
        the others; the carry for the next stage, or the output on the last."""
        if self.stage.first:
            assert isinstance(inputs, torch.Tensor)
            hidden, balance = self.model.embed_tokens(inputs), None
        else:
            assert isinstance(inputs, StageCarry)
            hidden, balance = inputs.hidden, inputs.balance
        hidden, router_logits = self.model.run_layers(hidden)
        if router_logits and self.router_aux_loss:
            sums = balance_sums(router_logits, self.spec.num_experts, self.config.experts_per_token)
            balance = sums if balance is None else (balance[0] + sums[0], balance[1] + sums[1], balance[2] + sums[2])
        if not self.stage.last:
            return StageCarry(hidden, balance)
        logits = self.lm_head(self.model.norm(hidden))
        if self.execution.sequence_parallel:
            logits = logits.transpose(0, 1)  # [S, B, V/tp] -> [B, S, V/tp], as the labels
        logits = logits.float()
        aux_loss = None if balance is None else self.config.router_aux_loss_coef * balance_loss(*balance)
        loss = None
        if labels is not None:
            losses = parallel.parallel_cross_entropy(logits, labels)
            loss = losses.sum() / (labels != IGNORE_INDEX).sum().clamp_min(1)
            if aux_loss is not None:
                loss = loss + aux_loss
        return CausalLMOutput(logits=logits, loss=loss, aux_loss=aux_loss, dropped=self.dropped_choices())

    def dropped_choices(self) -> torch.Tensor | None:
        """The capacity dispatch's dropped token-expert choices in this stage's last forward (None without it)."""
        counts = [m.dropped for m in self.model.modules() if isinstance(m, MoE) and m.dropped is not None]
        return torch.stack(counts).sum() if counts else None


def gather_logits(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits on every TP rank (for tests and sampling)."""
    return parallel.gather_from_tensor_model_parallel_region(logits)


def build_model(
    config: ModelConfig,
    *,
    kv_multiplier: int | None = None,
    fuse_qkv: bool = False,
    dtype: torch.dtype | str | None = None,
    seed: int | None = 0,
    moe_dispatch: MoeDispatch | None = None,
    router_aux_loss: bool | None = None,
    execution: Execution = Execution(),
    capacity_factor: float | None = None,
) -> CausalLM:
    """The model for this rank, on `parallel.device()`; the TP degree is the initialized facade's.

    kv_multiplier: K/V replication of the GQA layer (default: the smallest that fits, as the converter's).
    fuse_qkv: one `weight_qkv` per layer instead of `weight_q/k/v`; must match the checkpoint.
    dtype: parameter dtype (default: the config's `dtype`/`torch_dtype`, else fp32).
    seed: initialise deterministically (see `initialize_weights`). None: for weights loaded next (every
        parameter, e.g. a strict `load_state_dict`), nothing is initialised, not even by the layers'
        constructors: the model is built on the meta device as neuronx-distributed's trainer builds one
        (`parallel.init_on_device`), then each parameter gets uninitialised storage (`parallel.materialize`).
    moe_dispatch: "sparse", "dense" or "capacity" (`training.model.moe_dispatch`); default: the backend's
        (`training.config.backends.default_moe_dispatch`: capacity when `capacity_factor` is given).
    router_aux_loss: add Mixtral's load-balancing loss (default: the config's `output_router_logits`).
    execution: sequence parallelism, activation checkpointing, flash attention (see `Execution`).
    """
    parameters = parameter_dtype(dtype if dtype is not None else config.dtype)
    if parameters not in NAMES:
        raise UserError(f"dtype {parameters} is not supported; allowed: {', '.join(DTYPES)}")
    model_config = dataclasses.replace(config, dtype=NAMES[parameters])
    spec, tp, pp = model_config.spec, parallel.tp_size(), parallel.pp_size()
    multiplier = kv_multiplier or default_kv_multiplier(spec, tp)
    parallelism = Parallelism(tp, pp, multiplier, fuse_qkv, generation=parallel.generation())
    check_parallelism(spec, parallelism, "nxd")
    if pp > 1 and spec.tie_word_embeddings:
        raise UserError(
            "parallelism.pp: tied embeddings (tie_word_embeddings: true) are not supported with pipeline stages; "
            "allowed: pp 1 for this model"
        )
    stage = Stage(parallel.pp_rank(), pp)
    experts = Experts(moe_dispatch or default_moe_dispatch(parallel.backend(), capacity_factor), capacity_factor)
    aux = model_config.output_router_logits if router_aux_loss is None else router_aux_loss
    building: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if seed is None:  # on the meta device: no layer initialises anything (see `parallel.init_on_device`)
        building = parallel.init_on_device(torch.device("meta"), force_custom_init_on_device=True)
    with building:
        model = CausalLM(
            model_config,
            parallelism,
            experts=experts,
            router_aux_loss=aux,
            execution=execution,
            stage=stage,
        )
    if seed is None:
        parallel.materialize(model, torch.device("cpu"))
    else:
        initialize_weights(model, seed)
    recomputed = RECOMPUTED.get(execution.activation_checkpointing)
    if recomputed:
        parallel.apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, recomputed))
    parallel.move_model_to_device(model, parallel.device())
    # NxD 2.28 re-ties only Hugging Face models (its search for shared parameters in other modules starts a new
    # record in every submodule and finds none), so tie again on the device.
    model.tie_weights()
    return model


# The modules whose forward activation checkpointing runs again in backward, by setting.
RECOMPUTED: dict[ActivationCheckpointing, tuple[type[nn.Module], ...]] = {
    "selective": (CoreAttention, GatedActivation),
    "full": (DecoderLayer,),
}


def initial_tensor(name: str, shape: Sequence[int], seed: int, std: float) -> torch.Tensor:
    """The full Hugging Face tensor `name` at initialisation: ones for norms, else N(0, std) seeded by name."""
    if name.endswith("norm.weight"):
        return torch.ones(tuple(shape))
    generator = torch.Generator().manual_seed((seed << 32) ^ zlib.crc32(name.encode()))
    return torch.empty(tuple(shape)).normal_(0.0, std, generator=generator)


def initialize_weights(model: CausalLM, seed: int) -> None:
    """Each parameter := this rank's shard (by the layout's split rules) of a full tensor seeded by its HF name.

    So a model starts from the same weights whatever its TP degree, KV replication or QKV fusion. Each
    full tensor exists only while its rule is applied.
    """
    spec, rank = model.spec, parallel.tp_rank()
    shapes = hf_shapes(spec)
    parameters = dict(model.named_parameters(remove_duplicate=False))
    padding = model.config.pad_token_id
    with torch.no_grad():
        for rules in all_rules(spec, model.parallelism, "nxd"):
            for rule in rules:
                if rule.stage != model.stage.index:
                    continue
                sources = [initial_tensor(n, shapes[n], seed, model.config.initializer_range) for n in rule.sources]
                if padding is not None and rule.sources == ("model.embed_tokens.weight",):
                    sources[0][padding] = 0  # as transformers initialises nn.Embedding(padding_idx=...)
                parallel.local_view(parameters[rule.target]).copy_(rule.split(sources, rank))
