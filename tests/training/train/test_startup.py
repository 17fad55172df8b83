"""Start-up of a run that loads weights: no random initialisation, and the same model as an initialised one.

Random values are counted at torch's dispatcher (tests/support/random_values.py): every seeded random
operation whoever calls it (torch.nn.init, a layer's constructor, `initialize_weights`), not a count of
calls to our own code.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.model_equality import assert_same_model, bits, parameter_bytes, read_bytes
from tests.support.random_values import random_values
from tests.support.tiny_models import llama, mixtral
from tests.support.training_runs import world_overrides
from training.config.model import ModelConfig
from training.config.recipe import load_recipe
from training.errors import UserError
from training.formats.convert import ConvertOptions, convert
from training.formats.hf import read_config
from training.model import parallel
from training.model.transformer import Execution, build_model
from training.train.checkpointing import load_plain, load_pretrained
from training.train.loop import TrainOptions, train

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)


@pytest.fixture
def single_process() -> Iterator[None]:
    parallel.initialize(1, "cpu")
    yield
    parallel.destroy()


# name: (model factory, build_model options; fuse_qkv is also the converter's)
CASES: dict[str, tuple[Callable[[Path], Path], dict[str, Any]]] = {
    "llama": (lambda d: llama(d), {}),
    "llama-tied-fused-qkv": (lambda d: llama(d, tied=True), {"fuse_qkv": True}),
    "mixtral-sequence-parallel-recomputed": (
        lambda d: mixtral(d, layers=2),
        {"router_aux_loss": True, "execution": Execution(sequence_parallel=True, activation_checkpointing="full")},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_model_built_for_loading_makes_no_random_values_and_loads_as_an_initialised_one(
    case: str, tmp_path: Path, single_process: None
) -> None:
    make, options = CASES[case]
    source = make(tmp_path / "hf")
    pretrained = tmp_path / "nxd"
    convert(
        ConvertOptions(
            source_format="hf",
            target_format="nxd",
            input=source,
            output=pretrained,
            tp=1,
            fuse_qkv=options.get("fuse_qkv", False),
        )
    )
    config, config_path = read_config(source, None)
    with random_values() as fresh:
        initialised = build_model(ModelConfig.from_hf(config), seed=0, **options)
    with random_values() as loading:
        built = build_model(ModelConfig.from_hf(config), seed=None, **options)
    # The fresh path draws every parameter at least once (the layers' own draws, then `initialize_weights`).
    assert fresh.operations and fresh.bytes > parameter_bytes(initialised)
    assert loading.operations == [] and loading.bytes == 0
    assert {p.device.type for p in built.parameters()} == {"cpu"}
    for model in (initialised, built):
        load_pretrained(pretrained, config_path, model)
    assert_same_model(initialised, built)
    ids = torch.randint(0, config["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
    expected, actual = initialised(ids, ids), built(ids, ids)
    assert torch.equal(bits(actual.logits), bits(expected.logits))
    assert actual.loss is not None and expected.loss is not None
    assert torch.equal(bits(actual.loss), bits(expected.loss))


def run(world: dict[str, Path], checkpoints: Path, *overrides: str, resume: bool = False) -> dict[str, Any]:
    settings = world_overrides(world, checkpoints, "parallelism.tp=1", "checkpoint.every=1", *overrides)
    return train(TrainOptions(recipe=load_recipe("tiny-llama-cpt", settings), resume=resume))


def test_the_training_job_draws_no_random_values_when_it_loads_weights(
    llama_world_tp1: dict[str, Path], tmp_path: Path
) -> None:
    """The whole job, in this process: from pretrained weights and resumed, nothing random runs at all (the
    tiny recipe trains in fp32: no stochastic rounding); from random weights, the initialisation does."""
    checkpoints = tmp_path / "ckpt"
    with random_values() as pretrained:
        run(llama_world_tp1, checkpoints, "steps=2")
    with random_values() as resumed:
        summary = run(llama_world_tp1, checkpoints, "steps=3", resume=True)
    assert summary["started_at"] == 2
    with random_values() as fresh:
        run(llama_world_tp1, tmp_path / "fresh", "steps=2", "model.pretrained=")
    assert pretrained.operations == [] and resumed.operations == []
    assert fresh.operations and fresh.bytes > 0
    # and the resumed run trained on: its step 3 follows the steps of the pretrained run
    records = [json.loads(line) for line in (checkpoints / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 2, 3]


class _Payload:
    """Unpickling this runs a shell command: what a file planted on shared storage could hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_checking_a_pickle_reads_the_pickle_not_the_tensors(tmp_path: Path) -> None:
    """The safety pass before NxD's loader (`data=False`): the pickle is unpickled the safe way, the tensors'
    bytes are mapped and never read; a planted pickle is still refused in one line, in every format."""
    path = tmp_path / "rank.pt"
    generator = torch.Generator().manual_seed(0)
    torch.save({f"w{i}": torch.randn(1024, 1024, generator=generator) for i in range(4)}, path)  # 16 MiB
    before = read_bytes()
    checked = load_plain(path, data=False)
    read = read_bytes() - before
    assert read < path.stat().st_size / 100, read
    assert checked.keys() == {"w0", "w1", "w2", "w3"}
    before = read_bytes()
    load_plain(path)
    assert read_bytes() - before >= path.stat().st_size  # what the pass read before
    marker = tmp_path / "PWNED"
    for legacy in (False, True):
        planted = tmp_path / f"planted-{legacy}.pt"
        torch.save({"state": _Payload(marker)}, planted, _use_new_zipfile_serialization=not legacy)
        with pytest.raises(UserError, match=rf"^{planted}: refused to unpickle posix.system \(it could run code\)"):
            load_plain(planted, data=False)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(UserError, match=rf"^{truncated}: not a readable torch.save file, truncated or corrupt"):
        load_plain(truncated, data=False)
    assert not marker.exists()


def test_a_checkpoint_of_another_generation_is_refused_at_resume_in_one_line(tmp_path: Path) -> None:
    """The checkpoint records the generation its K/V replicas are laid out for (user_content.pt); one saved before
    it did so is trn1's. Resuming it for trn2 is one line saying what to do; without replicas it loads anywhere."""
    from training.config.model import Parallelism
    from training.train.loop import check_resumed_generation

    recipe = load_recipe("tiny-llama-cpt", generation="trn2")
    replicated, plain = Parallelism(tp=4, kv_multiplier=2, generation="trn2"), Parallelism(tp=2, generation="trn2")
    for name, content in (("step_2", {"step": 2, "generation": "trn1"}), ("step_4", {"step": 4})):
        (tmp_path / name).mkdir()
        torch.save(content, tmp_path / name / "user_content.pt")
        with pytest.raises(UserError) as refused:
            check_resumed_generation(tmp_path / name, recipe, replicated)
        assert str(refused.value) == (
            f"checkpoint.dir {tmp_path / name}: saved for trn1 (its K/V replicas are laid out for it); this run is "
            "for trn2: resume it on trn1, or convert it through hf (`convert --from nxd --to hf`, then `--to nxd "
            "--target trn2`) and train from that as model.pretrained"
        )
        check_resumed_generation(tmp_path / name, recipe, plain)  # no replicas: the same files on either
    torch.save(
        {"step": 6, "generation": "trn2"}, (tmp_path / "step_6").mkdir() or tmp_path / "step_6" / "user_content.pt"
    )
    check_resumed_generation(tmp_path / "step_6", recipe, replicated)
