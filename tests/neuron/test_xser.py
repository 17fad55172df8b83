"""Our streaming xser writer against torch-xla's own reader (`torch_xla.utils.serialization.load`)."""

from __future__ import annotations

from pathlib import Path

import torch

from training.formats.torch_writer import XserWriter


def test_torch_xla_loads_what_our_xser_writer_writes(tmp_path: Path) -> None:
    from torch_xla.utils.serialization import load

    generator = torch.Generator().manual_seed(0)
    state = {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=generator).to(torch.bfloat16),
        "model.norm.weight": torch.ones(8),
        "steps": torch.arange(5, dtype=torch.int64),
    }
    path = tmp_path / "dp_rank_00_tp_rank_00_pp_rank_00.pt"
    writer = XserWriter(path)
    for key, tensor in state.items():
        writer.add(key, tensor)
    writer.close()
    loaded = load(str(path))
    assert loaded.keys() == state.keys()
    for key, tensor in state.items():
        assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key].cpu(), tensor)
