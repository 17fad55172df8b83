"""Start-up on the neuron backend: a model built for loading runs none of neuronx-distributed's initialisation
(its layers built on the meta device, as NxD's trainer builds them) and, loaded, is the initialised model
loaded; the safety pass before NxD's loader reads the pickles only, not the checkpoint's data."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.neuron.one_rank import one_rank_neuron_backend
from tests.support.model_equality import assert_same_model, bits, parameter_bytes, read_bytes
from tests.support.random_values import random_values
from tests.support.tiny_models import llama, mixtral
from training.formats.convert import ConvertOptions, convert
from training.formats.hf import read_config


@pytest.fixture
def neuron_backend() -> Iterator[None]:
    with one_rank_neuron_backend():
        yield


@pytest.mark.parametrize("fuse_qkv", [False, True], ids=["qkv", "fused-qkv"])
@pytest.mark.parametrize("architecture", ["llama", "mixtral"])
def test_a_model_built_for_loading_is_the_initialised_model_loaded(
    architecture: str, fuse_qkv: bool, tmp_path: Path, neuron_backend: None
) -> None:
    """Every parameter attribute NxD's gradient norm and ZeRO-1 read is there (the GQA weights', which NxD's
    meta branch leaves out, included), on the XLA device, with the same values once loaded."""
    from training.config.model import ModelConfig
    from training.model.transformer import build_model
    from training.train.checkpointing import load_pretrained

    source = (llama if architecture == "llama" else mixtral)(tmp_path / "hf")
    pretrained = tmp_path / "nxd"
    options = ConvertOptions(
        source_format="hf", target_format="nxd", input=source, output=pretrained, tp=1, fuse_qkv=fuse_qkv
    )
    convert(options)
    config, config_path = read_config(source, None)
    with random_values() as fresh:
        initialised = build_model(ModelConfig.from_hf(config), seed=0, fuse_qkv=fuse_qkv)
    with random_values() as loading:
        built = build_model(ModelConfig.from_hf(config), seed=None, fuse_qkv=fuse_qkv)
    assert fresh.bytes > parameter_bytes(initialised)  # NxD's layers and `initialize_weights` both draw
    assert loading.operations == [] and loading.bytes == 0
    assert {p.device.type for p in built.parameters()} == {"xla"}
    for model in (initialised, built):
        load_pretrained(pretrained, config_path, model)
    assert_same_model(initialised, built)
    ids = torch.randint(0, config["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
    expected, actual = initialised(ids.to("xla"), ids.to("xla")), built(ids.to("xla"), ids.to("xla"))
    assert torch.equal(bits(actual.logits), bits(expected.logits))


@pytest.mark.parametrize("xser", [False, True], ids=["plain", "xser"])
def test_the_safety_pass_reads_the_pickles_not_the_tensors(xser: bool, tmp_path: Path, neuron_backend: None) -> None:
    """Each rank's files are checked before NxD's loader reads them; the check reads the pickles (a few KB),
    not the weights and optimizer state again (here 32 MiB, read once by NxD)."""
    from torch_xla.utils.serialization import save as xser_save

    from training.train.checkpointing import load_plain
    from training.train.neuron_training import refuse_planted_pickles

    step = tmp_path / "step_1"
    generator = torch.Generator().manual_seed(0)
    model = {f"layer.{i}.weight": torch.randn(1024, 1024, generator=generator) for i in range(4)}
    optimizer = {"state": {i: {"exp_avg": torch.randn(1024, 1024, generator=generator)} for i in range(4)}}
    for part, state in (("model/dp_rank_00", model), ("optim/dp_rank_00", optimizer)):
        path = step / f"{part}_tp_rank_00_pp_rank_00.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        if xser:
            xser_save(state, str(path))
        else:
            torch.save(state, path)
    torch.save({"last_epoch": 1}, step / "scheduler.pt")
    torch.save({"step": 1}, step / "user_content.pt")
    files = [p for p in step.rglob("*") if p.is_file()]
    data = sum(p.stat().st_size for p in files)
    assert data > 32 * 2**20

    before = read_bytes()
    refuse_planted_pickles(step)
    checked = read_bytes() - before
    before = read_bytes()
    for path in files:  # what the safety pass read before: every file whole
        from torch_xla.utils.serialization import TensorReference

        with torch.serialization.safe_globals([TensorReference]):
            load_plain(path)
    whole = read_bytes() - before
    assert whole >= data
    assert checked < data / 100, (checked, data)
