"""The layout rules alone: every split is undone exactly by its merge, and the GQA permutation is NxD's."""

from __future__ import annotations

import pytest
import torch

from training.errors import UserError
from training.formats.layouts import (
    ModelSpec,
    Parallelism,
    all_rules,
    check_parallelism,
    default_kv_multiplier,
    hf_shapes,
    nxd_key_value,
    query_head_order,
    stage_of_layer,
)
from training.model.cpu_groups import kv_shared_groups

LLAMA3_8B = ModelSpec("llama", 32, 4096, 14336, 32, 8, 128, 128256)


def tiny(architecture: str = "llama", heads: int = 8, kv: int = 2, layers: int = 2, experts: int = 0) -> ModelSpec:
    return ModelSpec(architecture, layers, 32, 48, heads, kv, 4, 64, num_experts=experts)  # type: ignore[arg-type]


def test_llama3_8b_query_heads_follow_the_reference_formula() -> None:
    order = query_head_order(LLAMA3_8B, Parallelism(tp=32, kv_multiplier=4))
    assert order == [[4 * (r % 8) + r // 8] for r in range(32)]
    assert default_kv_multiplier(LLAMA3_8B, 32) == 4


def test_each_rank_holds_the_query_heads_of_its_kv_heads() -> None:
    spec = tiny(heads=8, kv=2)
    for tp, multiplier in ((4, 2), (8, 4), (2, 1), (1, 1)):
        parallelism = Parallelism(tp=tp, kv_multiplier=multiplier)
        order = query_head_order(spec, parallelism)
        assert sorted(h for heads in order for h in heads) == list(range(8))
        kv_per_rank = spec.num_kv_heads * multiplier // tp
        for rank, heads in enumerate(order):
            # K/V are tiled [h0, h1, h0, h1, ...] and cut evenly: the KV heads this rank holds.
            held = {(rank * kv_per_rank + i) % spec.num_kv_heads for i in range(kv_per_rank)}
            assert {h // (spec.num_heads // spec.num_kv_heads) for h in heads} == held


def test_on_trn2_a_kv_heads_replicas_sit_on_adjacent_ranks_and_queries_stay_in_order() -> None:
    """neuronx-distributed-training's Llama 3 8B trn2 layout (TP 16, kv_replicator 2): rank r holds KV head r // 2
    (`repeat_interleave`) and, in Hugging Face order, query heads 2r and 2r + 1; trn1 tiles the same replicas."""
    trn2 = Parallelism(tp=16, kv_multiplier=2, generation="trn2")
    assert query_head_order(LLAMA3_8B, trn2) == [[2 * r, 2 * r + 1] for r in range(16)]
    trn1 = Parallelism(tp=16, kv_multiplier=2)
    assert query_head_order(LLAMA3_8B, trn1) == [
        [4 * (r % 8) + 2 * (r // 8), 4 * (r % 8) + 2 * (r // 8) + 1] for r in range(16)
    ]
    spec = tiny(heads=8, kv=2)
    keys = torch.arange(2 * spec.head_dim, dtype=torch.float32).reshape(2 * spec.head_dim, 1)  # row h*d.. is head h
    for generation, held in (("trn1", [0, 1, 0, 1]), ("trn2", [0, 0, 1, 1])):
        split, merge = nxd_key_value(spec, Parallelism(tp=4, kv_multiplier=2, generation=generation))  # type: ignore[arg-type]
        shards = [split([keys], rank) for rank in range(4)]
        assert [int(shard[0, 0]) // spec.head_dim for shard in shards] == held, generation
        assert torch.equal(merge(shards)[0], keys)


@pytest.mark.parametrize("generation", ["trn1", "trn2"])
def test_the_cpu_backends_kv_groups_are_the_ranks_holding_one_head(generation: str) -> None:
    """As NxD's `arrange_kv_groups` (its own code is compared in the neuron tier): strided on trn1, consecutive on
    trn2, within each TP group of the world."""
    expected = {"trn1": [[0, 2], [1, 3], [4, 6], [5, 7]], "trn2": [[0, 1], [2, 3], [4, 5], [6, 7]]}
    assert kv_shared_groups(4, 8, 2, adjacent=generation == "trn2") == expected[generation]
    spec = tiny(heads=8, kv=2)
    parallelism = Parallelism(tp=4, kv_multiplier=2, generation=generation)  # type: ignore[arg-type]
    split, _ = nxd_key_value(spec, parallelism)
    keys = torch.randn(2 * spec.head_dim, 3)
    for group in kv_shared_groups(4, 4, 2, adjacent=parallelism.kv_replicas_adjacent):
        assert all(torch.equal(split([keys], rank), split([keys], group[0])) for rank in group)


def random_sources(spec: ModelSpec, groups: list, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator).to(dtype) for name, shape in hf_shapes(spec).items()}


CASES = [
    ("nxd", tiny(), Parallelism(tp=4, kv_multiplier=2)),
    ("nxd", tiny(), Parallelism(tp=8, kv_multiplier=4, fuse_qkv=True)),
    ("nxd", tiny(), Parallelism(tp=4, kv_multiplier=2, generation="trn2")),
    ("nxd", tiny(), Parallelism(tp=8, kv_multiplier=4, fuse_qkv=True, generation="trn2")),
    ("nxd", tiny(heads=8, kv=8), Parallelism(tp=2, pp=2)),
    ("nxd", tiny("mixtral", experts=4, layers=4), Parallelism(tp=2, pp=2, kv_multiplier=1)),
    ("nemo", tiny(), Parallelism(tp=2, pp=2)),
    ("nemo", tiny("mixtral", experts=4, layers=4), Parallelism(tp=2, pp=2)),
]


@pytest.mark.parametrize(("layout", "spec", "parallelism"), CASES)
def test_split_then_merge_gives_back_every_tensor(layout: str, spec: ModelSpec, parallelism: Parallelism) -> None:
    groups = all_rules(spec, parallelism, layout)  # type: ignore[arg-type]
    sources = random_sources(spec, groups, torch.bfloat16)
    seen = set()
    for rules in groups:
        for rule in rules:
            shards = [rule.split([sources[name] for name in rule.sources], rank) for rank in range(parallelism.tp)]
            assert len(shards) == parallelism.tp
            assert len({tuple(s.shape) for s in shards}) == 1, f"{rule.target}: ranks differ in shape"
            for name, merged in zip(rule.sources, rule.merge(shards), strict=True):
                assert merged.dtype == sources[name].dtype and torch.equal(merged, sources[name]), name
            seen.update(rule.sources)
    assert seen == set(sources)


def test_layers_are_split_contiguously_over_stages() -> None:
    spec, parallelism = tiny(layers=4), Parallelism(pp=2)
    assert [stage_of_layer(spec, parallelism, layer) for layer in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_nemo_key_value_interleaves_heads() -> None:
    spec = tiny(heads=4, kv=2)
    (rule,) = [r for r in all_rules(spec, Parallelism(tp=1), "nemo")[1] if r.target.endswith("key_value.weight")]
    k = torch.arange(2 * 4 * 32, dtype=torch.float32).reshape(8, 32)
    v = -k
    fused = rule.split([k, v], 0)
    assert torch.equal(fused[:4], k[:4]) and torch.equal(fused[4:8], v[:4]) and torch.equal(fused[8:12], k[4:])


@pytest.mark.parametrize(
    ("spec", "parallelism", "layout", "message"),
    [
        (
            tiny(heads=6, kv=2),
            Parallelism(tp=4),
            "nxd",
            "--tp 4: query heads 6 is not divisible by 4; --tp values that fit this model: 1, 2",
        ),
        (
            tiny(),
            Parallelism(tp=4, kv_multiplier=1),
            "nxd",
            "--kv-size-multiplier 1: 2 KV heads x 1 do not spread evenly over 4 ranks with whole query-head groups; "
            "allowed with --tp 4: 2, 4",
        ),
        (
            tiny(),
            Parallelism(tp=4),
            "nemo",
            "--tp 4: 2 KV heads are not divisible by 4 (NeMo does not replicate KV heads); "
            "--tp values that fit this model: 1, 2",
        ),
        (tiny(layers=3), Parallelism(pp=2), "nxd", "--pp 2: 3 layers do not split evenly into 2 stages; allowed: 1, 3"),
    ],
)
def test_degrees_that_do_not_fit_are_refused_with_valid_values(
    spec: ModelSpec, parallelism: Parallelism, layout: str, message: str
) -> None:
    with pytest.raises(UserError) as raised:
        check_parallelism(spec, parallelism, layout)  # type: ignore[arg-type]
    assert str(raised.value) == message


def test_unknown_architecture_is_refused() -> None:
    with pytest.raises(UserError, match=r"model_type 'gpt2' is not supported; allowed: llama, mistral, mixtral"):
        ModelSpec.from_config({"model_type": "gpt2"})
