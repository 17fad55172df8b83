"""Tensor parallelism 2 on the neuron backend, under neuronx-distributed's CPU mode (`NXD_CPU_MODE=1`: NxD's
layers on CPU tensors, collectives over gloo), against the cpu backend: same logits, loss and gradients, and
NxD's own TP-aware gradient norm equals the true norm (it reads the parameters' tensor-parallel attributes).
XLA:CPU cannot check this: its collectives across processes are no-ops."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.workers import run_workers
from training.formats.convert import ConvertOptions, convert
from training.formats.hf import read_config
from training.formats.layouts import ModelSpec, Parallelism, replicated_targets
from training.local.tiny import tiny_model, train_tokenizer

WORKER = Path(__file__).resolve().parents[1] / "support" / "model_worker.py"
TP = 2
RTOL, ATOL = 1e-5, 1e-6  # fp32; the two backends reduce in different orders


# NxD's activation checkpointing wrapper (selective for Llama, every decoder layer for Mixtral). Sequence
# parallelism cannot run here: NxD's GQA layer gathers the sequence with torch-xla's all_gather directly,
# which takes XLA tensors only; tests/neuron/test_backend.py runs it on XLA:CPU at TP 1 instead.
VARIANTS: dict[str, dict[str, dict[str, Any]]] = {
    "llama": {"": {}, "-selective": {"activation_checkpointing": "selective"}},
    "mixtral": {"": {}, "-full": {"activation_checkpointing": "full"}},
}
CASES = [f"{architecture}{variant}" for architecture, variants in VARIANTS.items() for variant in variants]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("cpu-mode")
    tokenizer = train_tokenizer(root / "tokenizer")
    plan = []
    generator = torch.Generator().manual_seed(0)
    for architecture in ("llama", "mixtral"):
        hf = tiny_model(root / architecture / "hf", tokenizer, architecture=architecture)
        checkpoint = root / architecture / "nxd"
        convert(ConvertOptions(source_format="hf", target_format="nxd", input=hf, output=checkpoint, tp=TP))
        vocab = read_config(hf, None)[0]["vocab_size"]
        batches = [torch.randint(0, vocab, (2, 24), generator=generator).tolist()]
        for variant, execution in VARIANTS[architecture].items():
            for backend in ("cpu", "neuron"):
                plan.append(
                    {
                        "name": f"{architecture}{variant}-{backend}",
                        "tp": TP,
                        "checkpoint": str(checkpoint),
                        "batches": batches,
                        "backend": backend,
                        "router_aux_loss": architecture == "mixtral",
                        "execution": execution,
                    }
                )
    run_workers(WORKER, plan, root, TP, timeout=600, environment={"NXD_CPU_MODE": "1"})
    return {
        case["name"]: [
            torch.load(root / "results" / case["name"] / f"rank_{r:02d}.pt", weights_only=False) for r in range(TP)
        ]
        for case in plan
    } | {
        "_config": [
            {
                "llama": read_config(root / "llama" / "hf", None)[0],
                "mixtral": read_config(root / "mixtral" / "hf", None)[0],
            }
        ]
    }


@pytest.mark.parametrize("case", CASES)
def test_tp2_equals_the_cpu_backend(case: str, results: dict[str, list[dict[str, Any]]]) -> None:
    for cpu, neuron in zip(results[f"{case}-cpu"], results[f"{case}-neuron"], strict=True):
        assert torch.allclose(neuron["logits"], cpu["logits"], rtol=RTOL, atol=ATOL)
        assert torch.allclose(neuron["loss"], cpu["loss"], rtol=RTOL, atol=ATOL)
        assert neuron["grads"].keys() == cpu["grads"].keys()
        for name, grad in cpu["grads"].items():
            assert torch.allclose(neuron["grads"][name], grad, rtol=RTOL, atol=ATOL), name


@pytest.mark.parametrize("architecture", ["llama", "mixtral"])
def test_nxd_gradient_norm_at_tp2_is_the_true_norm(architecture: str, results: dict[str, list[dict[str, Any]]]) -> None:
    config = results["_config"][0][architecture]
    spec = ModelSpec.from_config(config)
    replicated = replicated_targets(spec, Parallelism(tp=TP, kv_multiplier=1, fuse_qkv=False), "nxd")
    ranks = results[f"{architecture}-cpu"]
    squares = sum(
        float(g.double().pow(2).sum()) for rank in ranks for n, g in rank["grads"].items() if n not in replicated
    )
    squares += sum(float(g.double().pow(2).sum()) for n, g in ranks[0]["grads"].items() if n in replicated)
    true_norm = squares**0.5
    for rank in results[f"{architecture}-neuron"]:
        assert rank["grad_norm"] == pytest.approx(true_norm, rel=1e-5)


# --- Trainium2: a KV head's replicas on adjacent ranks --------------------------------------------------------

TRN2_WORLD = 4
TRN2_TP = (2, 4)  # one KV head: replicated 2 and 4 times


@pytest.fixture(scope="module")
def trn2_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """NxD's GQA layer and kv-shared groups as NxD builds them for trn2 (its NEURON_PLATFORM_TARGET_OVERRIDE, which
    the torch-neuronx stand-in honours as the real one does), against the cpu backend's trn2 layout: a model with
    one KV head at TP 2 (2 data-parallel replicas) and TP 4, from checkpoints converted with --target trn2."""
    root = tmp_path_factory.mktemp("trn2")
    tokenizer = train_tokenizer(root / "tokenizer")
    hf = tiny_model(root / "hf", tokenizer, architecture="llama", kv_heads=1)
    vocab = read_config(hf, None)[0]["vocab_size"]
    generator = torch.Generator().manual_seed(1)
    plan = []
    for tp in TRN2_TP:
        checkpoint = root / f"nxd-tp{tp}"
        convert(
            ConvertOptions(source_format="hf", target_format="nxd", input=hf, output=checkpoint, tp=tp, target="trn2")
        )
        batches = [torch.randint(0, vocab, (2, 24), generator=generator).tolist() for _ in range(TRN2_WORLD // tp)]
        for backend in ("cpu", "neuron"):
            name = f"tp{tp}-{backend}"
            common = {"tp": tp, "checkpoint": str(checkpoint), "batches": batches, "generation": "trn2"}
            plan.append({"name": name, "backend": backend, **common})
    environment = {"NXD_CPU_MODE": "1", "NEURON_PLATFORM_TARGET_OVERRIDE": "trn2"}
    run_workers(WORKER, plan, root, TRN2_WORLD, timeout=600, environment=environment)
    return {
        case["name"]: [
            torch.load(root / "results" / case["name"] / f"rank_{r:02d}.pt", weights_only=False)
            for r in range(TRN2_WORLD)
        ]
        for case in plan
    }


@pytest.mark.parametrize("tp", TRN2_TP)
def test_trn2_kv_replicas_equal_the_cpu_backend(tp: int, trn2_results: dict[str, list[dict[str, Any]]]) -> None:
    for cpu, neuron in zip(trn2_results[f"tp{tp}-cpu"], trn2_results[f"tp{tp}-neuron"], strict=True):
        assert (cpu["tp_rank"], cpu["dp_rank"]) == (neuron["tp_rank"], neuron["dp_rank"])
        assert torch.allclose(neuron["logits"], cpu["logits"], rtol=RTOL, atol=ATOL)
        assert torch.allclose(neuron["loss"], cpu["loss"], rtol=RTOL, atol=ATOL)
        assert neuron["grads"].keys() == cpu["grads"].keys()
        for name, grad in cpu["grads"].items():
            assert torch.allclose(neuron["grads"][name], grad, rtol=RTOL, atol=ATOL), name
    # The replicas of the one KV head, on every rank, loaded the same weights; within a data-parallel replica they
    # got the same gradient (the head's whole one, summed over the ranks holding it).
    key = "model.layers.0.self_attn.qkv_proj.weight_k"
    ranks = trn2_results[f"tp{tp}-neuron"]
    assert all(torch.equal(rank["state_dict"][key], ranks[0]["state_dict"][key]) for rank in ranks)
    for dp in {rank["dp_rank"] for rank in ranks}:
        replica = [rank["grads"][key] for rank in ranks if rank["dp_rank"] == dp]
        assert len(replica) == tp and all(torch.allclose(g, replica[0], rtol=RTOL, atol=ATOL) for g in replica)


@pytest.mark.parametrize("generation", ["trn1", "trn2"])
@pytest.mark.parametrize(("world", "tp", "multiplier"), [(4, 4, 2), (8, 4, 2), (8, 8, 4), (16, 8, 2)])
def test_kv_shared_groups_are_nxds(generation: str, world: int, tp: int, multiplier: int) -> None:
    """The cpu backend's groups of ranks sharing a KV head are NxD's `arrange_kv_groups` for the generation."""
    from neuronx_distributed.parallel_layers.parallel_state import arrange_kv_groups
    from neuronx_distributed.utils.utils import hardware

    from training.model.cpu_groups import kv_shared_groups

    expected = arrange_kv_groups(world // tp, tp, multiplier, hardware_type=hardware(generation))
    assert kv_shared_groups(tp, world, multiplier, adjacent=generation == "trn2") == expected
