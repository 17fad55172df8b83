"""`convert` on tiny random Hugging Face models: exact round trips, bad input.

That the sharded weights compute the Hugging Face logits and gradients is tested with the real model in
test_model.py.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tests.support.tiny_models import llama, mixtral
from training.cli import main
from training.errors import UserError
from training.formats import sharded
from training.formats.convert import ConvertOptions, convert
from training.formats.layouts import ModelSpec, Parallelism, all_rules


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors |= load_file(file)
    return tensors


def assert_identical(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> None:
    assert sorted(first) == sorted(second)
    for name, tensor in first.items():
        assert tensor.dtype == second[name].dtype, name
        assert torch.equal(tensor, second[name]), name


def round_trip(source: Path, tmp_path: Path, layout: str, **options: Any) -> Path:
    sharded, back = tmp_path / f"{layout}-out", tmp_path / "hf-back"
    convert(ConvertOptions(source_format="hf", target_format=layout, input=source, output=sharded, **options))  # type: ignore[arg-type]
    convert(
        ConvertOptions(source_format=layout, target_format="hf", input=sharded, output=back, max_shard_bytes=20_000)
    )  # type: ignore[arg-type]
    return back


LLAMA_CASES = {
    "gqa-8q-2kv-tp4-m2": ({"heads": 8, "kv_heads": 2}, {"tp": 4, "kv_multiplier": 2}),
    "gqa-8q-2kv-tp8-m4": ({"heads": 8, "kv_heads": 2}, {"tp": 8, "kv_multiplier": 4}),
    "mha-8q-8kv-tp2": ({"heads": 8, "kv_heads": 8}, {"tp": 2}),
    "fused-qkv-tp4": ({"heads": 8, "kv_heads": 2}, {"tp": 4, "fuse_qkv": True}),
    "xser-tp2-pp2": ({"heads": 8, "kv_heads": 2, "layers": 4}, {"tp": 2, "pp": 2, "xser": True}),
    "bf16-tp4": ({"heads": 8, "kv_heads": 2, "dtype": torch.bfloat16}, {"tp": 4}),
    "tied-embeddings-tp2": ({"heads": 8, "kv_heads": 2, "tied": True}, {"tp": 2}),
}


@pytest.mark.parametrize("case", list(LLAMA_CASES))
def test_llama_hf_to_nxd_to_hf_is_bit_exact(case: str, tmp_path: Path) -> None:
    model_options, convert_options = LLAMA_CASES[case]
    source = llama(tmp_path / "hf", **model_options)
    back = round_trip(source, tmp_path, "nxd", **convert_options)
    assert_identical(hf_tensors(source), hf_tensors(back))


def test_a_trn1_checkpoint_moves_to_trn2_and_back_through_hf_bit_exactly(tmp_path: Path) -> None:
    """trn1 -> hf -> trn2 -> hf -> trn1: every file the same tensors as the start; each nxd output records its
    generation, and an nxd input is refused a --target other than the one it records."""
    source = llama(tmp_path / "hf", heads=8, kv_heads=2)
    steps = [
        ("hf", "nxd", "trn1"),
        ("nxd", "hf", None),
        ("hf", "nxd", "trn2"),
        ("nxd", "hf", None),
        ("hf", "nxd", "trn1"),
    ]
    current = source
    outputs = []
    for index, (frm, to, target) in enumerate(steps):
        output = tmp_path / f"{index}-{to}{'-' + target if target else ''}"
        options = {"tp": 4, "kv_multiplier": 2, "target": target, "verify": True} if to == "nxd" else {}
        manifest = convert(ConvertOptions(source_format=frm, target_format=to, input=current, output=output, **options))  # type: ignore[arg-type]
        assert manifest["generation"] == target
        outputs.append(output)
        current = output
    assert_identical(hf_tensors(source), hf_tensors(outputs[1]))
    assert_identical(hf_tensors(source), hf_tensors(outputs[3]))
    for first, last in zip(
        sorted((outputs[0] / "model").iterdir()), sorted((outputs[4] / "model").iterdir()), strict=True
    ):
        assert_identical(torch.load(first, weights_only=True), torch.load(last, weights_only=True))
    trn1_k = torch.load(outputs[0] / "model" / "dp_rank_00_tp_rank_01_pp_rank_00.pt", weights_only=True)
    trn2_k = torch.load(outputs[2] / "model" / "dp_rank_00_tp_rank_01_pp_rank_00.pt", weights_only=True)
    key = "model.layers.0.self_attn.qkv_proj.weight_k"
    head_rows = hf_tensors(source)["model.layers.0.self_attn.k_proj.weight"].chunk(2)
    assert torch.equal(trn1_k[key], head_rows[1]) and torch.equal(trn2_k[key], head_rows[0])  # rank 1: tiled/adjacent
    assert sharded.recorded_generation(outputs[2]) == "trn2"
    with pytest.raises(UserError, match=r"^--target trn1: .* was written for trn2 \(its K/V replicas are laid out"):
        convert(
            ConvertOptions(
                source_format="nxd", target_format="hf", input=outputs[2], output=tmp_path / "x", target="trn1"
            )
        )


@pytest.mark.parametrize("layout", ["nxd", "nemo"])
def test_streamed_paths_are_exact_across_many_row_blocks(
    layout: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row ranges, column shards read in row blocks and column merges written in row blocks, with blocks
    of a few rows so every block boundary and the double buffering are exercised."""
    monkeypatch.setattr(sharded, "ROW_BLOCK_BYTES", 3 * 32 * 4)
    source = llama(tmp_path / "hf", heads=8, kv_heads=8, layers=2)
    back = round_trip(source, tmp_path, layout, tp=2)
    assert_identical(hf_tensors(source), hf_tensors(back))


@pytest.mark.parametrize("layout", ["nxd", "nemo"])
def test_mixtral_round_trips_at_tp2_pp2(layout: str, tmp_path: Path) -> None:
    source = mixtral(tmp_path / "hf")
    back = round_trip(source, tmp_path, layout, tp=2, pp=2)
    assert_identical(hf_tensors(source), hf_tensors(back))


@pytest.mark.parametrize("xser", [False, True])
def test_llama_hf_to_nemo_to_hf_is_bit_exact(xser: bool, tmp_path: Path) -> None:
    source = llama(tmp_path / "hf", layers=4)
    back = round_trip(source, tmp_path, "nemo", tp=2, pp=2, xser=xser)
    assert_identical(hf_tensors(source), hf_tensors(back))


def test_output_loads_with_transformers_and_gives_the_same_logits(tmp_path: Path) -> None:
    source = llama(tmp_path / "hf")
    back = round_trip(source, tmp_path, "nxd", tp=4)
    assert (back / "model.safetensors.index.json").is_file(), "small max shard size must give several shards"
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    expected = AutoModelForCausalLM.from_pretrained(source)(ids).logits
    assert torch.equal(AutoModelForCausalLM.from_pretrained(back)(ids).logits, expected)


def test_hf_output_files_are_balanced_and_written_in_parallel(tmp_path: Path) -> None:
    source = llama(tmp_path / "hf", layers=4)
    sharded, back = tmp_path / "nxd", tmp_path / "back"
    convert(ConvertOptions(source_format="hf", target_format="nxd", input=source, output=sharded, tp=2))
    convert(
        ConvertOptions(
            source_format="nxd", target_format="hf", input=sharded, output=back, max_shard_bytes=60_000, workers=2
        )
    )
    index = json.loads((back / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    sizes = [(back / f).stat().st_size for f in files]
    assert len(files) == -(-index["metadata"]["total_size"] // 60_000)
    assert max(sizes) < 1.5 * min(sizes), sizes
    # one rule's tensors stay together: gate and up of a layer are in the same file
    assert (
        index["weight_map"]["model.layers.1.mlp.gate_proj.weight"]
        == index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    )
    assert_identical(hf_tensors(source), hf_tensors(back))


def test_nxd_output_has_the_documented_files(tmp_path: Path) -> None:
    source = llama(tmp_path / "hf")
    out = tmp_path / "nxd"
    manifest = convert(ConvertOptions(source_format="hf", target_format="nxd", input=source, output=out, tp=4, pp=1))
    names = sorted(p.name for p in (out / "model").iterdir())
    assert names == [f"dp_rank_00_tp_rank_{r:02d}_pp_rank_00.pt" for r in range(4)]
    assert (out / "config.json").is_file() and manifest["parallelism"]["kv_size_multiplier"] == 2
    rank = torch.load(out / "model" / names[1], weights_only=True, mmap=True)
    assert "model.layers.0.self_attn.qkv_proj.weight_k" in rank
    assert rank["model.layers.1.mlp.gate_up_proj.weight"].shape == (2 * 48 // 4, 32)


def test_nemo_output_has_the_documented_files(tmp_path: Path) -> None:
    source = llama(tmp_path / "hf", layers=4)
    out = tmp_path / "nemo"
    convert(ConvertOptions(source_format="hf", target_format="nemo", input=source, output=out, tp=2, pp=2))
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [
        f"tp_rank_{t:02d}_pp_rank_{p:03d}" for t in range(2) for p in range(2)
    ]
    checkpoint = torch.load(out / "tp_rank_01_pp_rank_001" / "model_optim_rng.ckpt", weights_only=True)
    assert checkpoint["pytorch-lightning_version"] == "1.9.5"
    keys = set(checkpoint["state_dict"])
    assert "model.language_model.output_layer.weight" in keys
    assert "model.language_model.encoder.layers.1.self_attention.key_value.weight" in keys
    assert not any("embedding" in key for key in keys), "the embedding belongs to the first stage only"


# --- verification, checkpoints of training runs, reuse -----------------------------------------------------


def test_verify_reads_the_output_back(tmp_path: Path) -> None:
    source = llama(tmp_path / "hf")
    manifest = convert(
        ConvertOptions(source_format="hf", target_format="nxd", input=source, output=tmp_path / "o", tp=4, verify=True)
    )
    assert manifest["verified_tensors"] == manifest["tensors"] == len(hf_tensors(source))


def training_run(tmp_path: Path) -> tuple[Path, Path]:
    source = llama(tmp_path / "hf")
    convert(ConvertOptions(source_format="hf", target_format="nxd", input=source, output=tmp_path / "weights", tp=2))
    run = tmp_path / "run"
    for step, done in ((5, True), (10, False)):
        shutil.copytree(tmp_path / "weights" / "model", run / f"step_{step}" / "model")
        if done:
            (run / f"step_{step}" / "done").touch()
    shutil.copyfile(source / "config.json", run / "config.json")
    return source, run


def test_a_step_without_done_marker_is_refused_unless_forced(tmp_path: Path) -> None:
    source, run = training_run(tmp_path)
    options = ConvertOptions(source_format="nxd", target_format="hf", input=run / "step_10", output=tmp_path / "out")
    with pytest.raises(UserError, match=r"step_10: checkpoint has no 'done' marker .*pass --force"):
        convert(options)
    convert(replace(options, force=True))
    assert_identical(hf_tensors(source), hf_tensors(tmp_path / "out"))


def test_a_run_directory_resolves_to_its_latest_complete_step(tmp_path: Path) -> None:
    source, run = training_run(tmp_path)
    manifest = convert(ConvertOptions(source_format="nxd", target_format="hf", input=run, output=tmp_path / "out"))
    assert manifest["architecture"] == "llama"
    assert_identical(hf_tensors(source), hf_tensors(tmp_path / "out"))


def test_rerun_reuses_and_a_different_checkpoint_is_refused(tmp_path: Path) -> None:
    source = llama(tmp_path / "hf")
    options = ConvertOptions(source_format="hf", target_format="nxd", input=source, output=tmp_path / "out", tp=2)
    convert(options)
    assert convert(options)["reused"] is True
    with pytest.raises(UserError, match=r"already holds an output made with different inputs \(parallelism\)"):
        convert(replace(options, tp=4))
    assert convert(replace(options, tp=4, overwrite=True))["parallelism"]["tp"] == 4


# --- bad input: one line, non-zero exit, no output --------------------------------------------------------


def cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()  # drop what building the test model printed
    assert main(["convert", *args]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and error.count("\n") == 1
    return error.removeprefix("error: ").strip()


def to_nxd(source: Path, out: Path, *extra: str) -> list[str]:
    return ["--from", "hf", "--to", "nxd", "--input", str(source), "--output", str(out), *extra]


def test_missing_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = llama(tmp_path / "hf")
    (source / "config.json").unlink()
    message = cli(to_nxd(source, tmp_path / "out", "--tp", "2"), capsys)
    assert message.startswith(f"{source / 'config.json'}: missing")
    assert not (tmp_path / "out").exists()


def test_index_naming_absent_shard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = llama(tmp_path / "hf")
    tensors = load_file(source / "model.safetensors")
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:5]}, source / "model-00001-of-00002.safetensors")
    weight_map = {
        n: ("model-00001-of-00002.safetensors" if i < 5 else "model-00002-of-00002.safetensors")
        for i, n in enumerate(names)
    }
    (source / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (source / "model.safetensors").unlink()
    message = cli(to_nxd(source, tmp_path / "out", "--tp", "2"), capsys)
    index = source / "model.safetensors.index.json"
    assert message == f"{index}: names shard files that do not exist: model-00002-of-00002.safetensors"


def test_truncated_shard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = llama(tmp_path / "hf")
    weights = source / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    message = cli(to_nxd(source, tmp_path / "out", "--tp", "2"), capsys)
    assert message.startswith(f"{weights}: truncated")
    assert not (tmp_path / "out").exists()


def test_tp_that_does_not_divide_heads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = llama(tmp_path / "hf")
    message = cli(to_nxd(source, tmp_path / "out", "--tp", "3"), capsys)
    assert message == "--tp 3: query heads 8 is not divisible by 3; --tp values that fit this model: 1, 2, 4, 8"


def test_kv_replication_that_does_not_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = llama(tmp_path / "hf")
    message = cli(to_nxd(source, tmp_path / "out", "--tp", "8", "--kv-size-multiplier", "2"), capsys)
    assert message.startswith("--kv-size-multiplier 2: 2 KV heads x 2 do not spread evenly over 8 ranks")
    assert message.endswith("allowed with --tp 8: 4")


def test_unknown_architecture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = llama(tmp_path / "hf")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    message = cli(to_nxd(source, tmp_path / "out", "--tp", "2"), capsys)
    expected = "model_type 'gpt_neox' is not supported; allowed: llama, mistral, mixtral"
    assert message == f"{source / 'config.json'}: {expected}"


def test_mixed_dtypes_where_one_is_required(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = llama(tmp_path / "hf")
    tensors = load_file(source / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"].to(
        torch.bfloat16
    )
    save_file(tensors, source / "model.safetensors")
    message = cli(to_nxd(source, tmp_path / "out", "--tp", "2", "--fuse-qkv"), capsys)
    assert message.startswith("model.layers.0.self_attn.qkv_proj.weight_qkv needs one dtype but")
    assert "model.layers.0.self_attn.k_proj.weight is torch.bfloat16" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_output_holding_another_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = llama(tmp_path / "hf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"someone else's weights")
    message = cli(to_nxd(source, out, "--tp", "2"), capsys)
    expected = "choose another --output (--overwrite replaces only this tool's outputs and empty directories)"
    assert message == f"{out} already exists and was not written by this tool; {expected}"
    assert (out / "model.safetensors").read_bytes() == b"someone else's weights"


def test_rules_cover_every_tensor_of_the_checkpoint(tmp_path: Path) -> None:
    source = mixtral(tmp_path / "hf", layers=2)
    spec = ModelSpec.from_config(json.loads((source / "config.json").read_text()))
    named = {n for rules in all_rules(spec, Parallelism(tp=2), "nemo") for r in rules for n in r.sources}
    assert named == set(hf_tensors(source))
