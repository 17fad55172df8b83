"""The Llama / Mixtral model on the CPU facade against transformers, loaded from `convert --to nxd` output.

In-process at TP 1; at TP 2 and 4 one `torchrun` of 4 gloo processes runs every case (tests/support/
model_worker.py), TP 2 cases with 2 DP replicas on different batches. Compared: logits, loss, the Mixtral
auxiliary loss, gradients of one backward step merged with the layout's rules, the state dict against the
converter's rank files, and the write-back of that state dict through `convert --from nxd`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from tests.support.tiny_models import LLAMA3_ROPE_SCALING, llama, mixtral
from tests.support.workers import LOCAL, run_workers
from training.config.model import IGNORE_INDEX, ModelConfig, flops_per_token
from training.errors import UserError
from training.formats.convert import ConvertOptions, convert
from training.formats.layouts import ModelSpec, Parallelism, all_rules, default_kv_multiplier, hf_shapes
from training.model import parallel
from training.model.moe_dispatch import PREFIX_SUM_BLOCK, queue_positions
from training.model.native_backend import CPU_MODE
from training.model.transformer import Execution, build_model, initial_tensor

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)

WORKER = Path(__file__).resolve().parents[2] / "support" / "model_worker.py"
ATOL = 1e-5


# --- helpers ---------------------------------------------------------------------------------------------


def to_nxd(source: Path, out: Path, **options: Any) -> Path:
    convert(ConvertOptions(source_format="hf", target_format="nxd", input=source, output=out, **options))
    return out


def rank_file(directory: Path, tp_rank: int) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = torch.load(
        directory / "model" / f"dp_rank_00_tp_rank_{tp_rank:02d}_pp_rank_00.pt", weights_only=True
    )
    return state


def config_of(directory: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((directory / "config.json").read_text())
    return config


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors |= load_file(file)
    return tensors


def shifted(ids: torch.Tensor) -> torch.Tensor:
    """Labels aligned with positions: the target of position t is token t + 1; the last has none."""
    return torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), IGNORE_INDEX)], dim=1)


def checkpoint_named(model: PreTrainedModel, values: Callable[[torch.nn.Parameter], torch.Tensor]) -> dict[str, Any]:
    """Per-parameter values under the checkpoint's tensor names (transformers 5 stacks Mixtral's experts)."""
    named: dict[str, torch.Tensor] = {}
    for name, parameter in model.named_parameters():
        value = values(parameter)
        if ".mlp.experts.gate_up_proj" in name:
            prefix = name.replace("mlp.experts.gate_up_proj", "block_sparse_moe.experts.")
            for e, expert in enumerate(value):
                w1, w3 = expert.chunk(2, dim=0)
                named |= {f"{prefix}{e}.w1.weight": w1, f"{prefix}{e}.w3.weight": w3}
        elif ".mlp.experts.down_proj" in name:
            prefix = name.replace("mlp.experts.down_proj", "block_sparse_moe.experts.")
            named |= {f"{prefix}{e}.w2.weight": w2 for e, w2 in enumerate(value)}
        elif ".mlp.gate.weight" in name and model.config.model_type == "mixtral":
            named[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = value
        else:
            named[name] = value
    return named


def hf_reference(source: Path, ids: torch.Tensor) -> dict[str, Any]:
    """transformers' logits, loss (it shifts the labels itself), aux loss and checkpoint-named gradients."""
    model = AutoModelForCausalLM.from_pretrained(source)
    mixtral_model = model.config.model_type == "mixtral"
    output = model(ids, labels=ids, output_router_logits=True) if mixtral_model else model(ids, labels=ids)
    output.loss.backward()
    weights = checkpoint_named(model, lambda p: p.detach())
    assert all(torch.equal(weights[n], t) for n, t in hf_tensors(source).items()), "checkpoint name mapping"
    aux = model.config.router_aux_loss_coef * output.aux_loss if mixtral_model else None
    grads = checkpoint_named(model, lambda p: p.grad)
    return {"logits": output.logits.detach(), "loss": output.loss.detach(), "aux_loss": aux, "grads": grads}


def merge(spec: ModelSpec, parallelism: Parallelism, ranks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-rank tensors (TP order) -> Hugging Face tensors, by the layout's own merge rules."""
    merged: dict[str, torch.Tensor] = {}
    for rules in all_rules(spec, parallelism, "nxd"):
        for rule in rules:
            merged.update(zip(rule.sources, rule.merge([rank[rule.target] for rank in ranks]), strict=True))
    return merged


def write_nxd(directory: Path, config_source: Path, ranks: list[dict[str, torch.Tensor]]) -> Path:
    """A model's per-rank state dicts saved as an NxD checkpoint directory."""
    (directory / "model").mkdir(parents=True)
    for tp_rank, state in enumerate(ranks):
        torch.save(state, directory / "model" / f"dp_rank_00_tp_rank_{tp_rank:02d}_pp_rank_00.pt")
    shutil.copyfile(config_source / "config.json", directory / "config.json")
    return directory


def assert_identical(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> None:
    assert sorted(first) == sorted(second)
    for name, tensor in first.items():
        assert tensor.dtype == second[name].dtype and torch.equal(tensor, second[name]), name


@pytest.fixture
def single_process() -> Iterator[None]:
    parallel.initialize(1, "cpu")
    yield
    parallel.destroy()


# --- TP 1, in process ------------------------------------------------------------------------------------

# name: (model factory, model options; fuse_qkv is also the converter's)
TP1_CASES: dict[str, tuple[Callable[[Path], Path], dict[str, Any]]] = {
    "llama-gqa": (lambda d: llama(d), {}),
    "llama31-rope-scaling": (lambda d: llama(d, rope_scaling=LLAMA3_ROPE_SCALING), {}),
    "llama-tied-fused-qkv": (lambda d: llama(d, tied=True), {"fuse_qkv": True}),
    "mixtral-sparse": (lambda d: mixtral(d, layers=2), {"moe_dispatch": "sparse", "router_aux_loss": True}),
    "mixtral-dense": (lambda d: mixtral(d, layers=2), {"moe_dispatch": "dense", "router_aux_loss": True}),
    "mixtral-sliding-window": (lambda d: mixtral(d, layers=2, sliding_window=3), {"router_aux_loss": True}),
    # sequence parallelism, checkpointing and flash attention change how the layers run, never the result
    "llama-selective-flash": (
        lambda d: llama(d),
        {"execution": Execution(activation_checkpointing="selective", flash_attention=True)},
    ),
    # capacity-factor dispatch with a capacity that drops nothing (E / k: every expert can take every token)
    "mixtral-capacity": (lambda d: mixtral(d, layers=2), {"router_aux_loss": True, "capacity_factor": 2.0}),
    "mixtral-sp-full": (
        lambda d: mixtral(d, layers=2),
        {"router_aux_loss": True, "execution": Execution(sequence_parallel=True, activation_checkpointing="full")},
    ),
}


@pytest.mark.parametrize("case", list(TP1_CASES))
def test_tp1_logits_and_losses_equal_transformers(case: str, tmp_path: Path, single_process: None) -> None:
    make, options = TP1_CASES[case]
    source = make(tmp_path / "hf")
    nxd = to_nxd(source, tmp_path / "nxd", tp=1, fuse_qkv=options.get("fuse_qkv", False))
    model = build_model(ModelConfig.from_hf(config_of(source)), seed=None, **options)
    model.load_state_dict(rank_file(nxd, 0), strict=True)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    output = model(ids, shifted(ids))
    expected = hf_reference(source, ids)
    torch.testing.assert_close(output.logits, expected["logits"], rtol=0, atol=ATOL)
    torch.testing.assert_close(output.loss, expected["loss"], rtol=0, atol=ATOL)
    if expected["aux_loss"] is None:
        assert output.aux_loss is None
    else:
        assert output.aux_loss is not None and output.aux_loss > 0
        torch.testing.assert_close(output.aux_loss, expected["aux_loss"], rtol=0, atol=1e-7)


def test_llama3_rope_frequencies_are_transformers_and_matter(tmp_path: Path, single_process: None) -> None:
    """The scaled model's frequencies are transformers' bit for bit, and differ from unscaled ones in both bands."""
    scaled = AutoModelForCausalLM.from_pretrained(llama(tmp_path / "scaled", rope_scaling=LLAMA3_ROPE_SCALING))
    plain = AutoModelForCausalLM.from_pretrained(llama(tmp_path / "plain"))
    ours = build_model(ModelConfig.from_hf(config_of(tmp_path / "scaled")), seed=None).model.rope_frequencies
    assert torch.equal(ours, scaled.model.rotary_emb.inv_freq)
    assert (ours != plain.model.rotary_emb.inv_freq).all(), "both frequencies of the tiny model must be rescaled"


def test_tp1_state_dict_is_the_rank_file_and_writes_back(tmp_path: Path, single_process: None) -> None:
    source = mixtral(tmp_path / "hf", layers=2)
    nxd = to_nxd(source, tmp_path / "nxd", tp=1)
    model = build_model(ModelConfig.from_hf(config_of(source)), seed=None)
    model.load_state_dict(rank_file(nxd, 0), strict=True)
    assert_identical(model.state_dict(), rank_file(nxd, 0))
    written = write_nxd(tmp_path / "written", source, [model.state_dict()])
    convert(ConvertOptions(source_format="nxd", target_format="hf", input=written, output=tmp_path / "back"))
    assert_identical(hf_tensors(tmp_path / "back"), hf_tensors(source))


def test_bf16_parameters_follow_the_config(tmp_path: Path, single_process: None) -> None:
    source = llama(tmp_path / "hf", dtype=torch.bfloat16)
    config = config_of(source) | {"dtype": "bfloat16"}
    model = build_model(ModelConfig.from_hf(config), seed=None)
    model.load_state_dict(rank_file(to_nxd(source, tmp_path / "nxd", tp=1), 0), strict=True)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert build_model(ModelConfig.from_hf(config), dtype=torch.float32).model.norm.weight.dtype == torch.float32
    ids = torch.tensor([[1, 2, 3, 4]])
    output = model(ids, shifted(ids))
    assert output.logits.dtype == torch.float32 and torch.isfinite(output.loss)


def test_unsupported_config_is_one_clear_error(tmp_path: Path, single_process: None) -> None:
    config = config_of(llama(tmp_path / "hf"))
    with pytest.raises(UserError, match=r"rope_type 'yarn' is not supported; allowed: default, llama3"):
        build_model(
            ModelConfig.from_hf(config | {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}})
        )
    with pytest.raises(UserError, match=r"--kv-size-multiplier 3"):
        build_model(ModelConfig.from_hf(config), kv_multiplier=3)


def test_a_tp_degree_the_processes_cannot_hold_is_one_clear_error() -> None:
    with pytest.raises(UserError, match=r"tensor-parallel degree 2 must divide the number of processes \(1\)"):
        parallel.initialize(2, "cpu")
    assert not parallel.is_initialized()
    parallel.initialize(1, "cpu")  # and nothing was left behind
    assert (parallel.tp_size(), parallel.dp_size(), parallel.device()) == (1, 1, torch.device("cpu"))
    parallel.destroy()


def test_flops_count_the_weights_a_token_multiplies(tmp_path: Path) -> None:
    for source in (llama(tmp_path / "llama"), mixtral(tmp_path / "mixtral", layers=2)):
        config = config_of(source)
        spec = ModelSpec.from_config(config)
        total = sum(t.numel() for t in hf_tensors(source).values())
        h, i, v, layers = spec.hidden_size, spec.intermediate_size, spec.vocab_size, spec.num_layers
        idle_experts = layers * (spec.num_experts - 2) * 3 * h * i if spec.num_experts else 0
        active = total - v * h - layers * 2 * h - h - idle_experts  # no embedding lookup, no norms
        attention = 12 * layers * spec.num_heads * spec.head_dim * 128
        assert flops_per_token(ModelConfig.from_hf(config), 128) == 6 * active + attention


# --- TP 2 and 4: one torchrun of 4 processes --------------------------------------------------------------

# name: (model factory, convert options, model options, TP degree)
TP_CASES: dict[str, tuple[Callable[[Path], Path], dict[str, Any], dict[str, Any], int]] = {
    "llama-gqa-tp4-kv2": (lambda d: llama(d), {"kv_multiplier": 2}, {"kv_multiplier": 2}, 4),
    "llama31-tied-fused-tp4": (
        lambda d: llama(d, tied=True, rope_scaling=LLAMA3_ROPE_SCALING),
        {"fuse_qkv": True},
        {"fuse_qkv": True},
        4,
    ),
    "llama-gqa-tp2-dp2": (lambda d: llama(d, kv_heads=4), {}, {}, 2),  # 2 KV heads per rank
    # Trainium2's layout: a KV head's replicas on adjacent ranks, and the ranks sharing a head grouped so
    "llama-gqa-tp4-kv2-trn2": (
        lambda d: llama(d),
        {"kv_multiplier": 2, "target": "trn2"},
        {"kv_multiplier": 2, "generation": "trn2"},
        4,
    ),
    "llama-mqa-tp2-dp2-kv2-trn2-sp": (
        lambda d: llama(d, kv_heads=1),
        {"kv_multiplier": 2, "target": "trn2"},
        {"kv_multiplier": 2, "generation": "trn2", "execution": {"sequence_parallel": True}},
        2,
    ),
    "mixtral-tp2-dp2": (lambda d: mixtral(d, layers=2), {}, {"router_aux_loss": True}, 2),
    "mixtral-dense-tp4": (lambda d: mixtral(d, layers=2), {}, {"router_aux_loss": True, "moe_dispatch": "dense"}, 4),
    # the same models with sequence parallelism (and checkpointing, flash attention): the same numbers
    "llama-sp-tp4-kv2-selective": (
        lambda d: llama(d),
        {"kv_multiplier": 2},
        {"kv_multiplier": 2, "execution": {"sequence_parallel": True, "activation_checkpointing": "selective"}},
        4,
    ),
    "llama31-sp-tied-fused-tp2-dp2-flash": (
        lambda d: llama(d, tied=True, rope_scaling=LLAMA3_ROPE_SCALING),
        {"fuse_qkv": True},
        {"fuse_qkv": True, "execution": {"sequence_parallel": True, "flash_attention": True}},
        2,
    ),
    "mixtral-sp-tp2-dp2-full": (
        lambda d: mixtral(d, layers=2),
        {},
        {"router_aux_loss": True, "execution": {"sequence_parallel": True, "activation_checkpointing": "full"}},
        2,
    ),
    "mixtral-capacity-sp-tp2-dp2": (
        lambda d: mixtral(d, layers=2),
        {},
        {"router_aux_loss": True, "capacity_factor": 2.0, "execution": {"sequence_parallel": True}},
        2,
    ),
    "mixtral-dense-sp-tp4": (
        lambda d: mixtral(d, layers=2),
        {},
        {"router_aux_loss": True, "moe_dispatch": "dense", "execution": {"sequence_parallel": True}},
        4,
    ),
}
SWAPPED = "llama-tp4-swapped-query-heads"
WORLD = 4
# Every case again on the torch-native backend (DTensor layers on the CPU over gloo), in the same torchrun: where
# torch is one TorchNeuron is built for (2.13 and later). The neuron tier reruns this module under NxD's lock
# (torch 2.9), which the torch-native backend never runs on: there the cases are the cpu backend's only.
NATIVE = "@torch-native"
NATIVE_TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)
ALL_CASES = [*TP_CASES, *(name + NATIVE for name in TP_CASES if NATIVE_TORCH)]


def batches(tp: int) -> list[list[list[int]]]:
    """One batch [2, 8] per DP replica, different for each."""
    generator = torch.Generator().manual_seed(tp)
    return [torch.randint(0, 64, (2, 8), generator=generator).tolist() for _ in range(WORLD // tp)]


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Sources, converted checkpoints and the worker results of every case, after one torchrun."""
    root = tmp_path_factory.mktemp("tp")
    plan, cases = [], {}
    for name, (make, convert_options, model_options, tp) in TP_CASES.items():
        source = make(root / name / "hf")
        nxd = to_nxd(source, root / name / "nxd", tp=tp, **convert_options)
        cases[name] = {"source": source, "nxd": nxd, "tp": tp, "options": model_options}
        plan.append({"name": name, "checkpoint": str(nxd), "tp": tp, "batches": batches(tp), **model_options})
        if NATIVE_TORCH:
            cases[name + NATIVE] = cases[name]
            plan.append({**plan[-1], "name": name + NATIVE, "backend": "torch-native"})
    # A checkpoint whose first two ranks swapped their query heads: it still round-trips, but must not load
    # into the same model.
    swapped = shutil.copytree(cases["llama-gqa-tp4-kv2"]["nxd"], root / SWAPPED)
    first, second = rank_file(swapped, 0), rank_file(swapped, 1)
    key = "model.layers.0.self_attn.qkv_proj.weight_q"
    first[key], second[key] = second[key], first[key]
    for tp_rank, state in ((0, first), (1, second)):
        torch.save(state, swapped / "model" / f"dp_rank_00_tp_rank_{tp_rank:02d}_pp_rank_00.pt")
    plan.append({"name": SWAPPED, "checkpoint": str(swapped), "tp": 4, "batches": batches(4), "kv_multiplier": 2})

    results = run_workers(WORKER, plan, root, WORLD, timeout=600, environment={**LOCAL, CPU_MODE: "1"})
    for name in [*ALL_CASES, SWAPPED]:
        ranks = [torch.load(results / name / f"rank_{r:02d}.pt", weights_only=True) for r in range(WORLD)]
        cases[name] = {**cases.get(name, {}), "ranks": ranks}
    return cases


def replicas(ranks: list[dict[str, Any]], tp: int) -> list[list[dict[str, Any]]]:
    """Worker results grouped by DP replica, each in TP-rank order; checks the [DP, TP] rank arrangement."""
    groups = [ranks[start : start + tp] for start in range(0, len(ranks), tp)]
    for dp, group in enumerate(groups):
        assert [(r["dp_rank"], r["tp_rank"]) for r in group] == [(dp, t) for t in range(tp)]
    return groups


def layout(case: dict[str, Any]) -> tuple[ModelSpec, Parallelism]:
    options = case["options"]
    spec = ModelSpec.from_config(config_of(case["source"]))
    multiplier = options.get("kv_multiplier") or default_kv_multiplier(spec, case["tp"])
    generation = options.get("generation", "trn1")
    return spec, Parallelism(case["tp"], 1, multiplier, options.get("fuse_qkv", False), generation)


@pytest.mark.parametrize("name", ALL_CASES)
def test_tp_logits_losses_and_gradients_equal_transformers(name: str, tp_runs: dict[str, Any]) -> None:
    case = tp_runs[name]
    spec, parallelism = layout(case)
    for dp, group in enumerate(replicas(case["ranks"], case["tp"])):
        expected = hf_reference(case["source"], torch.tensor(batches(case["tp"])[dp]))
        for rank in group:  # every TP rank holds the full logits and the same losses
            torch.testing.assert_close(rank["logits"], expected["logits"], rtol=0, atol=ATOL)
            torch.testing.assert_close(rank["loss"], expected["loss"], rtol=0, atol=ATOL)
            if expected["aux_loss"] is not None:
                torch.testing.assert_close(rank["aux_loss"], expected["aux_loss"], rtol=0, atol=1e-7)
        grads = [rank["grads"] for rank in group]
        merged = merge(spec, parallelism, grads)
        assert sorted(merged) == sorted(expected["grads"])
        for hf_name, grad in merged.items():
            torch.testing.assert_close(grad, expected["grads"][hf_name], rtol=1e-4, atol=1e-6, msg=hf_name)
        # Replicated parameters carry the same complete gradient on every TP rank.
        for target in grads[0]:
            if target.endswith("norm.weight") or "linear_router" in target:
                assert all(torch.equal(g[target], grads[0][target]) for g in grads), target


def test_replicated_kv_heads_hold_the_complete_gradient_on_every_replica(tp_runs: dict[str, Any]) -> None:
    """With K/V repeated twice over 4 ranks, each copy's gradient is the head's whole gradient (as in NxD)."""
    case = tp_runs["llama-gqa-tp4-kv2"]
    spec, _ = layout(case)
    for layer in range(spec.num_layers):
        key = f"model.layers.{layer}.self_attn.qkv_proj.weight_k"
        stacked = torch.cat([rank["grads"][key] for rank in case["ranks"]])
        rows = spec.num_kv_heads * spec.head_dim
        torch.testing.assert_close(stacked[:rows], stacked[rows:], rtol=1e-5, atol=1e-7)
        assert stacked.abs().sum() > 0


@pytest.mark.parametrize("name", ALL_CASES)
def test_tp_state_dicts_are_the_converter_files_and_write_back(
    name: str, tp_runs: dict[str, Any], tmp_path: Path
) -> None:
    case = tp_runs[name]
    first_replica = replicas(case["ranks"], case["tp"])[0]
    for tp_rank, rank in enumerate(first_replica):
        assert_identical(rank["state_dict"], rank_file(case["nxd"], tp_rank))
    written = write_nxd(tmp_path / "written", case["source"], [rank["state_dict"] for rank in first_replica])
    generation = case["options"].get("generation")  # bare rank files record none: --target says
    back = ConvertOptions(source_format="nxd", target_format="hf", input=written, output=tmp_path / "back")
    convert(dataclasses.replace(back, target=generation))
    assert_identical(hf_tensors(tmp_path / "back"), hf_tensors(case["source"]))


@pytest.mark.parametrize("name", ALL_CASES)
def test_seeded_initialisation_is_the_same_model_at_every_tp(name: str, tp_runs: dict[str, Any]) -> None:
    case = tp_runs[name]
    spec, parallelism = layout(case)
    merged = merge(spec, parallelism, [r["seeded_state_dict"] for r in replicas(case["ranks"], case["tp"])[0]])
    std = config_of(case["source"])["initializer_range"]
    for hf_name, shape in hf_shapes(spec).items():
        assert torch.equal(merged[hf_name], initial_tensor(hf_name, shape, 7, std)), hf_name


def test_swapped_query_heads_give_other_logits(tp_runs: dict[str, Any]) -> None:
    """The TP comparisons are sensitive to the query-head permutation: a wrong one does not go unnoticed."""
    expected = hf_reference(tp_runs["llama-gqa-tp4-kv2"]["source"], torch.tensor(batches(4)[0]))
    logits = tp_runs[SWAPPED]["ranks"][0]["logits"]
    assert not torch.allclose(logits, expected["logits"], atol=1e-3)


# --- capacity-factor dispatch ------------------------------------------------------------------------------


def capacity_reference(moe: torch.nn.Module, x: torch.Tensor, capacity_factor: float) -> tuple[torch.Tensor, int]:
    """The capacity semantics spelled out token by token: each expert takes the first C choices in token
    order, a token's kept weights are renormalised, a token with none kept gets nothing."""
    experts = moe.expert_mlps.mlp_op
    gate_up, down = experts.gate_up_proj.weight, experts.down_proj.weight
    total, count, k = x.shape[0], gate_up.shape[0], moe.top_k
    capacity = min(total, math.ceil(total * k * capacity_factor / count))
    weights, chosen = torch.softmax(moe.router.linear_router(x).float(), dim=-1).topk(k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    taken = [0] * count
    output, dropped = torch.zeros_like(x), 0
    for t in range(total):
        kept = []
        for j in range(k):
            e = int(chosen[t, j])
            if taken[e] < capacity:
                taken[e] += 1
                kept.append(j)
            else:
                dropped += 1
        norm = sum(float(weights[t, j]) for j in kept)
        for j in kept:
            e = int(chosen[t, j])
            gate, up = (x[t] @ gate_up[e]).chunk(2)
            output[t] += (torch.nn.functional.silu(gate) * up) @ down[e] * float(weights[t, j]) / norm
    return output, dropped


@pytest.mark.parametrize("rows", [1, 37, PREFIX_SUM_BLOCK, PREFIX_SUM_BLOCK + 1, 2 * PREFIX_SUM_BLOCK + 300])
def test_queue_positions_are_the_running_count_without_cumsum(rows: int) -> None:
    """The matmul prefix sum equals torch.cumsum across block boundaries, and calls no cumsum (the op XLA
    lowers to the reduce-window neuronx-cc fails on)."""
    chosen = (torch.rand(rows, 8, generator=torch.Generator().manual_seed(rows)) < 0.3).long()
    with TorchCalls() as calls:
        positions = queue_positions(chosen)
    assert torch.equal(positions, torch.cumsum(chosen, dim=0) - 1)
    assert "cumsum" not in calls.names and "matmul" in calls.names


class TorchCalls(torch.overrides.TorchFunctionMode):
    """Records the names of the torch functions and tensor methods called inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_router_runs_in_fp32_in_a_bf16_model(tmp_path: Path, single_process: None) -> None:
    """As neuronx-distributed's router: logits, softmax and top-k in fp32 whatever the model's dtype, so
    bf16 rounding never flips a near-tie between experts; the capacity dispatch runs without any cumsum."""
    config = config_of(mixtral(tmp_path / "hf", layers=1))
    model = build_model(
        ModelConfig.from_hf(config), seed=3, dtype=torch.bfloat16, capacity_factor=1.0, router_aux_loss=True
    )
    moe = model.model.layers["0"].mlp
    x = torch.randn(40, config["hidden_size"], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with TorchCalls() as calls:
        output, logits = moe(x)
    assert output.dtype == torch.bfloat16 and logits.dtype == torch.float32
    weight = moe.router.linear_router.weight.float()
    torch.testing.assert_close(logits, x.float() @ weight.t(), rtol=1e-6, atol=1e-6)
    assert "cumsum" not in calls.names


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 2.0])
def test_capacity_dispatch_keeps_each_experts_first_tokens(
    capacity_factor: float, tmp_path: Path, single_process: None
) -> None:
    config = config_of(mixtral(tmp_path / "hf", layers=1))
    model = build_model(ModelConfig.from_hf(config), seed=3, capacity_factor=capacity_factor, router_aux_loss=True)
    moe = model.model.layers["0"].mlp
    x = torch.randn(40, config["hidden_size"], generator=torch.Generator().manual_seed(0))
    output, _ = moe(x)
    with torch.no_grad():
        expected, dropped = capacity_reference(moe, x, capacity_factor)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)
    assert int(moe.dropped) == dropped
    assert (dropped > 0) == (capacity_factor < 2.0)  # 4 experts, top 2: a factor of 2 drops nothing
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    result = model(ids, shifted(ids))
    assert result.dropped is not None and int(result.dropped) == int(moe.dropped)
    result.loss.backward()
    assert all(p.grad is not None for p in model.parameters())
