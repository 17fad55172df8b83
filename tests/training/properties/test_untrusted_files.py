"""Untrusted files: every reader validates before it trusts, and no pickle is ever executed.

Each bad input (a safetensors header that lies, a config.json or index with wrong keys, an out-of-range
`convert` option) must end in exit status 2 with exactly one `error: ...` line naming the file and the tensor,
key or option, and leave neither the output directory nor a hidden sibling (`.NAME.tmp-*`) behind. Each file
kind that is unpickled anywhere (NxD and NeMo rank files, Hugging Face .bin/.pt, a training checkpoint's model,
optimizer, schedule, position and random generator files) is replaced here by a pickle that would run
`touch PWNED` under a trusting loader; the payload must never run.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import struct
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.tiny_models import llama
from training.cli import main
from training.config.model import ModelConfig
from training.config.recipe import OptimizerSection, ScheduleSection
from training.errors import UserError
from training.formats.convert import ConvertOptions, convert
from training.formats.sharded import nxd_rank_file
from training.model import parallel
from training.model.transformer import build_model
from training.train import checkpointing
from training.train.backend import training_backend
from training.train.optimizer import TrainingOptimizer

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)

EMBED = "model.embed_tokens.weight"  # F32 [64, 32] in the tiny Llama
DTYPES = "F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL"
SHAPES = "a list of integers of 0 or more (with a product below 2**63)"
PLAIN_DATA = "allowed: a torch.save file of tensors, numbers, strings, lists, tuples and dicts"
NOT_A_STATE_DICT = (
    "holds an object of a class that is not loaded at its top level; "
    "allowed: a torch.save file of a dict of tensors (a state dict)"
)


# --- helpers ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llama(tmp_path_factory.mktemp("pristine") / "hf")


@pytest.fixture
def source(pristine: Path, tmp_path: Path) -> Path:
    """A fresh copy of the tiny Llama to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "hf"))


def to_nxd(source: Path, output: Path, *extra: str) -> list[str]:
    return ["--from", "hf", "--to", "nxd", "--input", str(source), "--output", str(output), "--tp", "2", *extra]


def to_hf(fmt: str, source: Path, output: Path) -> list[str]:
    return ["--from", fmt, "--to", "hf", "--input", str(source), "--output", str(output)]


def assert_no_output(output: Path) -> None:
    assert not output.exists()
    assert not list(output.parent.glob(f".{output.name}.*")), "a hidden sibling was left behind"


def refused(args: list[str], output: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """Runs `convert`; asserts exit 2, one `error:` line and no output; returns the message."""
    capsys.readouterr()
    assert main(["convert", *args]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert_no_output(output)
    return lines[0].removeprefix("error: ")


class Payload:
    """What a planted checkpoint would hold: unpickled by a trusting loader, it runs `touch MARKER`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[[str], int], tuple[str]]:
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


@pytest.fixture
def marker(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "PWNED"
    yield path
    assert not path.exists(), "the pickled payload ran"


def plant(path: Path, marker: Path, value: Any = None) -> Path:
    """Replace `path` with a torch.save file of `value` (default: the payload alone)."""
    torch.save(Payload(marker) if value is None else value, path)
    return path


def test_the_payload_runs_under_a_trusting_loader(tmp_path: Path) -> None:
    """The control: the pickles the other tests plant are live, so their not running means something."""
    marker = tmp_path / "PWNED"
    torch.load(plant(tmp_path / "evil.pt", marker), weights_only=False)
    assert marker.exists()


# --- safetensors headers ----------------------------------------------------------------------------------


def split_safetensors(path: Path) -> tuple[dict[str, Any], bytes]:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def write_safetensors(path: Path, header: bytes, data: bytes, length: int | None = None) -> None:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)


def edited(path: Path, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Rewrite the header after `change`, keeping the data bytes; returns the original header."""
    header, data = split_safetensors(path)
    original: dict[str, Any] = json.loads(json.dumps(header))
    change(header)
    write_safetensors(path, json.dumps(header).encode(), data)
    return original


def in_file_order(header: dict[str, Any]) -> list[str]:
    return sorted((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"])


def _set(key: str, value: Any, name: str = EMBED) -> Callable[[dict[str, Any]], None]:
    def change(header: dict[str, Any]) -> None:
        header[name][key] = value

    return change


def unknown_dtype(path: Path) -> str:
    edited(path, _set("dtype", "F8_E4M3"))
    return f"tensor {EMBED}: dtype: 'F8_E4M3' is not allowed; allowed: {DTYPES}"


def shape_of_strings(path: Path) -> str:
    edited(path, _set("shape", ["64", 32]))
    return f"tensor {EMBED}: shape: ['64', 32] is not allowed; allowed: {SHAPES}"


def negative_dimension(path: Path) -> str:
    edited(path, _set("shape", [-64, 32]))
    return f"tensor {EMBED}: shape: [-64, 32] is not allowed; allowed: {SHAPES}"


def offsets_reversed(path: Path) -> str:
    begin, end = edited(path, lambda h: h[EMBED].update(data_offsets=h[EMBED]["data_offsets"][::-1]))[EMBED][
        "data_offsets"
    ]
    return (
        f"tensor {EMBED}: data_offsets: [{end}, {begin}] is not allowed; allowed: [begin, end] with 0 <= begin <= end"
    )


def offsets_negative(path: Path) -> str:
    edited(path, _set("data_offsets", [-1, 8191]))
    return f"tensor {EMBED}: data_offsets: [-1, 8191] is not allowed; allowed: [begin, end] with 0 <= begin <= end"


def offsets_not_a_pair(path: Path) -> str:
    edited(path, _set("data_offsets", [0]))
    return f"tensor {EMBED}: data_offsets: [0] is not allowed; allowed: [begin, end] with 0 <= begin <= end"


def shape_disagrees_with_offsets(path: Path) -> str:
    """The file that used to convert with exit 0 and the wrong bytes: half the rows the offsets hold."""
    begin, end = edited(path, _set("shape", [32, 32]))[EMBED]["data_offsets"]
    return (
        f"tensor {EMBED}: data_offsets: [{begin}, {end}] is not allowed; allowed: a range of 4096 bytes "
        "(shape [32, 32] of F32), not 8192"
    )


def dtype_disagrees_with_offsets(path: Path) -> str:
    begin, end = edited(path, _set("dtype", "BF16"))[EMBED]["data_offsets"]
    return (
        f"tensor {EMBED}: data_offsets: [{begin}, {end}] is not allowed; allowed: a range of 4096 bytes "
        "(shape [64, 32] of BF16), not 8192"
    )


def overlapping(path: Path) -> str:
    header, _ = split_safetensors(path)
    previous, name = in_file_order(header)[:2]
    begin, end = header[name]["data_offsets"]
    edited(path, _set("data_offsets", [begin - 4, end - 4], name))
    return (
        f"tensor {name}: data_offsets: [{begin - 4}, {end - 4}] overlaps {previous}; allowed: a begin of {begin}, "
        "the end of the data before it (the format stores tensors back to back)"
    )


def gap(path: Path) -> str:
    header, data = split_safetensors(path)
    last = in_file_order(header)[-1]
    begin, end = header[last]["data_offsets"]
    header[last]["data_offsets"] = [begin + 4, end + 4]
    write_safetensors(path, json.dumps(header).encode(), data[:begin] + b"\0" * 4 + data[begin:])
    return (
        f"tensor {last}: data_offsets: [{begin + 4}, {end + 4}] leaves a gap before it; allowed: a begin of "
        f"{begin}, the end of the data before it (the format stores tensors back to back)"
    )


def trailing_bytes(path: Path) -> str:
    path.write_bytes(path.read_bytes() + b"\0" * 4)
    return "4 bytes after the last tensor's data; allowed: a file that ends with its last tensor"


def truncated(path: Path) -> str:
    header, _ = split_safetensors(path)
    last = in_file_order(header)[-1]
    data = path.read_bytes()
    path.write_bytes(data[:-4])
    return f"truncated ({last} ends at byte {len(data)}, the file has {len(data) - 4})"


def metadata_value_not_a_string(path: Path) -> str:
    edited(path, lambda h: h.update(__metadata__={"format": 1}))
    return "__metadata__: format: 1 is not allowed; allowed: a string (__metadata__ maps strings to strings)"


def metadata_not_a_map(path: Path) -> str:
    edited(path, lambda h: h.update(__metadata__=["pt"]))
    return "__metadata__: ['pt'] is not allowed; allowed: a map of strings to strings"


def entry_without_dtype(path: Path) -> str:
    edited(path, lambda h: h[EMBED].pop("dtype"))
    return f"tensor {EMBED}: dtype: required key is missing"


def entry_not_an_object(path: Path) -> str:
    edited(path, lambda h: h.update({EMBED: [1, 2]}))
    return f"tensor {EMBED}: [1, 2] is not allowed; allowed: an object with dtype, shape and data_offsets"


def header_past_the_end(path: Path) -> str:
    header, data = split_safetensors(path)
    encoded = json.dumps(header).encode()
    size = 8 + len(encoded) + len(data)
    write_safetensors(path, encoded, data, length=size - 7)
    return f"not a safetensors file or truncated (header length {size - 7} runs past the end of the file, {size} bytes)"


def header_over_the_limit(path: Path) -> str:
    with path.open("wb") as handle:  # sparse: the length is within the file, the file costs nothing
        handle.write(struct.pack("<Q", 200_000_000) + b"{}")
        handle.truncate(200_000_100)
    return "header length 200000000 is not allowed; allowed: at most 100000000 bytes"


def shorter_than_its_length(path: Path) -> str:
    path.write_bytes(b"abc")
    return "not a safetensors file (3 bytes, less than its 8-byte header length)"


def header_not_utf8(path: Path) -> str:
    write_safetensors(path, b'{"\xff": 1}', b"")
    return "header is not UTF-8 (invalid start byte at byte 10)"


def header_not_json(path: Path) -> str:
    write_safetensors(path, b"{not json", b"")
    return "header is not valid JSON (Expecting property name enclosed in double quotes, line 1 column 2)"


def header_not_an_object(path: Path) -> str:
    write_safetensors(path, b"[1, 2]", b"")
    return "header is a JSON list; allowed: a JSON object of tensor entries"


def duplicate_tensor(path: Path) -> str:
    header, data = split_safetensors(path)
    text = json.dumps(header)
    write_safetensors(path, f'{text[:-1]}, "{EMBED}": {json.dumps(header[EMBED])}}}'.encode(), data)
    return f"{EMBED} appears twice in the header; allowed: each name once"


SAFETENSORS_CASES: dict[str, Callable[[Path], str]] = {
    case.__name__.replace("_", "-"): case
    for case in (
        unknown_dtype,
        shape_of_strings,
        negative_dimension,
        offsets_reversed,
        offsets_negative,
        offsets_not_a_pair,
        shape_disagrees_with_offsets,
        dtype_disagrees_with_offsets,
        overlapping,
        gap,
        trailing_bytes,
        truncated,
        metadata_value_not_a_string,
        metadata_not_a_map,
        entry_without_dtype,
        entry_not_an_object,
        header_past_the_end,
        header_over_the_limit,
        shorter_than_its_length,
        header_not_utf8,
        header_not_json,
        header_not_an_object,
        duplicate_tensor,
    )
}


@pytest.mark.parametrize("case", list(SAFETENSORS_CASES))
def test_bad_safetensors_header(case: str, source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    weights = source / "model.safetensors"
    expected = SAFETENSORS_CASES[case](weights)
    output = tmp_path / "out"
    assert refused(to_nxd(source, output), output, capsys) == f"{weights}: {expected}"


def test_intact_header_written_with_padding_converts(source: Path, tmp_path: Path) -> None:
    """The validation accepts what the reference writer writes (space padding, metadata, any key order)."""
    header, data = split_safetensors(source / "model.safetensors")
    reordered = dict(reversed(list(header.items())))
    encoded = json.dumps(reordered).encode()
    write_safetensors(source / "model.safetensors", encoded + b" " * (-len(encoded) % 8), data)
    assert main(["convert", *to_nxd(source, tmp_path / "out")]) == 0


# --- config.json ----------------------------------------------------------------------------------------------


def _config(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda config: config.update({key: value})


def _without(*keys: str) -> Callable[[dict[str, Any]], Any]:
    return lambda config: [config.pop(key) for key in keys]


CONFIG_CASES: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "layers-as-text": (
        _config("num_hidden_layers", "two"),
        "num_hidden_layers: 'two' is not allowed; allowed: an integer above 0",
    ),
    "negative-size": (_config("hidden_size", -32), "hidden_size: -32 is not allowed; allowed: an integer above 0"),
    "zero-vocabulary": (_config("vocab_size", 0), "vocab_size: 0 is not allowed; allowed: an integer above 0"),
    "fractional-size": (
        _config("intermediate_size", 48.5),
        "intermediate_size: 48.5 is not allowed; allowed: an integer above 0",
    ),
    "missing-size": (_without("intermediate_size"), "intermediate_size: required key is missing"),
    "heads-not-dividing-hidden-size": (
        lambda config: (config.pop("head_dim"), config.update(hidden_size=36)),
        "hidden_size: 36 is not allowed; allowed: a multiple of num_attention_heads 8 (or a head_dim key)",
    ),
    "kv-heads-not-dividing-heads": (
        _config("num_key_value_heads", 3),
        "num_key_value_heads: 3 is not allowed; allowed: a divisor of num_attention_heads 8",
    ),
    "zero-head-dim": (_config("head_dim", 0), "head_dim: 0 is not allowed; allowed: an integer above 0"),
    "tied-as-text": (
        _config("tie_word_embeddings", "no"),
        "tie_word_embeddings: 'no' is not allowed; allowed: true or false",
    ),
    "mixtral-without-experts": (
        _config("model_type", "mixtral"),
        "num_local_experts: required key is missing",
    ),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_bad_config(case: str, source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    change, expected = CONFIG_CASES[case]
    path = source / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))
    output = tmp_path / "out"
    assert refused(to_nxd(source, output), output, capsys) == f"{path}: {expected}"


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"[1]", "top level is a JSON list; allowed: a JSON object"),
        (b"{", "not valid JSON (Expecting property name enclosed in double quotes, line 1 column 2)"),
        (b"\xff{}", "not UTF-8 text (invalid start byte at byte 0); allowed: a UTF-8 JSON file"),
    ],
    ids=["list", "not-json", "not-utf8"],
)
def test_unreadable_config(
    content: bytes, expected: str, source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (source / "config.json").write_bytes(content)
    output = tmp_path / "out"
    assert refused(to_nxd(source, output), output, capsys) == f"{source / 'config.json'}: {expected}"


def test_bad_config_given_with_config_option_is_named(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    override = tmp_path / "other-config.json"
    override.write_text(json.dumps({**json.loads((source / "config.json").read_text()), "num_hidden_layers": "two"}))
    output = tmp_path / "out"
    message = refused(to_nxd(source, output, "--config", str(override)), output, capsys)
    assert message == f"{override}: num_hidden_layers: 'two' is not allowed; allowed: an integer above 0"


def test_bad_config_of_an_nxd_checkpoint(source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = tmp_path / "nxd"
    convert(ConvertOptions(source_format="hf", target_format="nxd", input=source, output=checkpoint, tp=2))
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "num_attention_heads": -8}))
    output = tmp_path / "out"
    message = refused(to_hf("nxd", checkpoint, output), output, capsys)
    assert (
        message == f"{checkpoint / 'config.json'}: num_attention_heads: -8 is not allowed; allowed: an integer above 0"
    )


# --- index files ----------------------------------------------------------------------------------------------

FIRST, SECOND = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def sharded(source: Path) -> tuple[Path, dict[str, str]]:
    """The tiny model as two shards and an index; returns the index and its weight map."""
    tensors = load_file(source / "model.safetensors")
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:5]}, source / FIRST, metadata={"format": "pt"})
    save_file({n: tensors[n] for n in names[5:]}, source / SECOND, metadata={"format": "pt"})
    (source / "model.safetensors").unlink()
    weight_map = {n: FIRST if i < 5 else SECOND for i, n in enumerate(names)}
    index = source / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index, weight_map


def test_intact_index_converts(source: Path, tmp_path: Path) -> None:
    sharded(source)
    assert main(["convert", *to_nxd(source, tmp_path / "out")]) == 0


@pytest.mark.parametrize(
    "case",
    ["no-weight-map", "weight-map-list", "file-not-a-string", "parent", "absolute", "nested-parent", "absent", "bad"],
)
def test_bad_index(case: str, source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    index, weight_map = sharded(source)
    shutil.copyfile(source / FIRST, tmp_path / FIRST)  # a real shard outside the checkpoint, for `..` to find
    inside = f"a file inside {source} (a relative path without '..')"
    cases: dict[str, tuple[Any, str]] = {
        "no-weight-map": ({"metadata": {}}, "weight_map: required key is missing"),
        "weight-map-list": (
            {"weight_map": [FIRST]},
            f"weight_map: ['{FIRST}'] is not allowed; allowed: a map of tensor names to shard file names",
        ),
        "file-not-a-string": (
            {"weight_map": {EMBED: 1}},
            f"weight_map: {EMBED}: 1 is not allowed; allowed: a shard file name (a string)",
        ),
        "parent": (
            {"weight_map": {**weight_map, EMBED: f"../{FIRST}"}},
            f"weight_map: {EMBED}: '../{FIRST}' is not allowed; allowed: {inside}",
        ),
        "absolute": (
            {"weight_map": {**weight_map, EMBED: str(tmp_path / FIRST)}},
            f"weight_map: {EMBED}: '{tmp_path / FIRST}' is not allowed; allowed: {inside}",
        ),
        "nested-parent": (
            {"weight_map": {**weight_map, EMBED: f"sub/../../{FIRST}"}},
            f"weight_map: {EMBED}: 'sub/../../{FIRST}' is not allowed; allowed: {inside}",
        ),
        "absent": (
            {"weight_map": {**weight_map, EMBED: "model-00003-of-00003.safetensors"}},
            "names shard files that do not exist: model-00003-of-00003.safetensors",
        ),
        "bad": ("not json", "not valid JSON (Expecting value, line 1 column 1)"),
    }
    content, expected = cases[case]
    index.write_text(content if isinstance(content, str) else json.dumps(content))
    output = tmp_path / "out"
    assert refused(to_nxd(source, output), output, capsys) == f"{index}: {expected}"


def test_tensor_in_two_files(source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    extra = source / "extra.safetensors"
    save_file({EMBED: torch.zeros(64, 32)}, extra)
    output = tmp_path / "out"
    message = refused(to_nxd(source, output), output, capsys)
    assert message == f"{source / 'model.safetensors'}: tensor {EMBED} is also in {extra}; allowed: each in one file"


# --- convert options ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--tp", "0"], "--tp: 0 is not allowed; allowed: an integer of at least 1"),
        (["--tp", "-2"], "--tp: -2 is not allowed; allowed: an integer of at least 1"),
        (["--pp", "0"], "--pp: 0 is not allowed; allowed: an integer of at least 1"),
        (["--kv-size-multiplier", "0"], "--kv-size-multiplier: 0 is not allowed; allowed: an integer of at least 1"),
        (["--workers", "0"], "--workers: 0 is not allowed; allowed: an integer of at least 1"),
        (["--max-shard-size", "0"], "--max-shard-size: 0 is not allowed; allowed: at least 1 byte, e.g. 500MB or 5GB"),
        (
            ["--max-shard-size", "0.1B"],
            "--max-shard-size: 0 is not allowed; allowed: at least 1 byte, e.g. 500MB or 5GB",
        ),
        (
            ["--max-shard-size=-5GB"],
            "--max-shard-size -5GB: not a size; allowed: a number of bytes or e.g. 500MB, 5GB",
        ),
        (
            ["--max-shard-size", "lots"],
            "--max-shard-size lots: not a size; allowed: a number of bytes or e.g. 500MB, 5GB",
        ),
    ],
    ids=[
        "tp-0",
        "tp-negative",
        "pp-0",
        "kv-0",
        "workers-0",
        "shard-0",
        "shard-below-a-byte",
        "shard-negative",
        "shard-text",
    ],
)
def test_option_out_of_range(
    extra: list[str], expected: str, source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "out"
    args = ["--from", "hf", "--to", "nxd", "--input", str(source), "--output", str(output)]
    args += extra if "--tp" in extra else ["--tp", "2", *extra]
    assert refused(args, output, capsys) == expected


def test_option_out_of_range_is_refused_before_the_input_is_read(tmp_path: Path) -> None:
    options = ConvertOptions(
        source_format="nxd", target_format="hf", input=tmp_path / "absent", output=tmp_path / "out", workers=0
    )
    with pytest.raises(UserError, match=r"^--workers: 0 is not allowed"):
        convert(options)


# --- pickles read by convert: NxD, NeMo, Hugging Face .bin / .pt ------------------------------------------------


@pytest.fixture
def nxd_checkpoint(source: Path, tmp_path: Path) -> Path:
    checkpoint = tmp_path / "nxd"
    convert(ConvertOptions(source_format="hf", target_format="nxd", input=source, output=checkpoint, tp=2))
    return checkpoint


@pytest.mark.parametrize("tp", [0, 1])
def test_malicious_nxd_shard(
    tp: int, nxd_checkpoint: Path, marker: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shard = plant(nxd_rank_file(nxd_checkpoint, tp, 0), marker)
    output = tmp_path / "out"
    assert refused(to_hf("nxd", nxd_checkpoint, output), output, capsys) == f"{shard}: {NOT_A_STATE_DICT}"


def test_payload_among_real_tensors_stays_inert(
    source: Path, nxd_checkpoint: Path, marker: Path, tmp_path: Path
) -> None:
    """A state dict that also carries the payload converts; the payload is an inert stand-in, never run."""
    shard = nxd_rank_file(nxd_checkpoint, 1, 0)
    plant(shard, marker, {**torch.load(shard, weights_only=True), "extra": Payload(marker)})
    assert main(["convert", *to_hf("nxd", nxd_checkpoint, tmp_path / "back")]) == 0
    back, expected = load_file(tmp_path / "back" / "model.safetensors"), load_file(source / "model.safetensors")
    assert sorted(back) == sorted(expected) and all(torch.equal(back[n], expected[n]) for n in expected)


def test_malicious_xser_tensor_file(
    source: Path, marker: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = tmp_path / "nxd"
    convert(ConvertOptions(source_format="hf", target_format="nxd", input=source, output=checkpoint, tp=2, xser=True))
    folder = Path(f"{nxd_rank_file(checkpoint, 0, 0)}.tensors")
    plant(folder / "tensor_0.pt", marker)
    output = tmp_path / "out"
    assert refused(to_hf("nxd", checkpoint, output), output, capsys) == f"{folder}/tensor_0.pt: does not hold a tensor"


@pytest.mark.parametrize("where", ["whole-file", "state-dict"])
def test_malicious_nemo_checkpoint(
    where: str, source: Path, marker: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = tmp_path / "nemo"
    convert(ConvertOptions(source_format="hf", target_format="nemo", input=source, output=checkpoint, tp=2))
    file = checkpoint / "mp_rank_01" / "model_optim_rng.ckpt"
    plant(file, marker, None if where == "whole-file" else {"state_dict": Payload(marker), "epoch": 0})
    output = tmp_path / "out"
    assert refused(to_hf("nemo", checkpoint, output), output, capsys) == f"{file}: {NOT_A_STATE_DICT}"


def test_nemo_hyper_parameters_payload_stays_inert(source: Path, marker: Path, tmp_path: Path) -> None:
    checkpoint = tmp_path / "nemo"
    convert(ConvertOptions(source_format="hf", target_format="nemo", input=source, output=checkpoint, tp=2))
    file = checkpoint / "mp_rank_00" / "model_optim_rng.ckpt"
    plant(file, marker, {**torch.load(file, weights_only=True), "hyper_parameters": Payload(marker)})
    assert main(["convert", *to_hf("nemo", checkpoint, tmp_path / "back")]) == 0


@pytest.mark.parametrize("name", ["pytorch_model.bin", "consolidated.pt"])
def test_malicious_hf_torch_file(
    name: str, source: Path, marker: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (source / "model.safetensors").unlink()
    file = plant(source / name, marker)
    output = tmp_path / "out"
    assert refused(to_nxd(source, output), output, capsys) == f"{file}: {NOT_A_STATE_DICT}"


def test_damaged_pickle_is_one_line(nxd_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A pickle that breaks the unpickler mid-way (here: a dict built from a non-iterable) names the file."""
    shard = nxd_rank_file(nxd_checkpoint, 0, 0)
    torch.save({"weight": torch.zeros(2)}, shard)
    with zipfile.ZipFile(shard) as archive:
        records = {info.filename: archive.read(info) for info in archive.infolist()}
    pickle_name = next(n for n in records if n.endswith("data.pkl"))
    records[pickle_name] = b"\x80\x02cbuiltins\ndict\nK\x01\x85R."  # dict(1)
    with zipfile.ZipFile(shard, "w", zipfile.ZIP_STORED) as archive:
        for name, data in records.items():
            archive.writestr(name, data)
    output = tmp_path / "out"
    message = refused(to_hf("nxd", nxd_checkpoint, output), output, capsys)
    assert message.startswith(f"{shard}: corrupt pickle (")


def test_nxd_shard_of_another_shape(nxd_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shard = nxd_rank_file(nxd_checkpoint, 1, 0)
    state = torch.load(shard, weights_only=True)
    torch.save({**state, "model.norm.weight": torch.zeros(16)}, shard)
    output = tmp_path / "out"
    message = refused(to_hf("nxd", nxd_checkpoint, output), output, capsys)
    expected = "allowed: [32] (this model's tp 1 shard at 2-way tensor parallelism)"
    assert message == f"{shard}: tensor model.norm.weight: shape [16] is not allowed; {expected}"


# --- training checkpoints: model, optimizer, schedule, position, random generators ------------------------------


@pytest.fixture
def single_process() -> Iterator[None]:
    parallel.initialize(1, "cpu")
    yield
    parallel.destroy()


CPU = training_backend("cpu")


def trainer(config: dict[str, Any]) -> tuple[Any, TrainingOptimizer]:
    model = build_model(ModelConfig.from_hf(config), seed=0)
    return model, TrainingOptimizer(model, OptimizerSection(lr=1e-3), ScheduleSection(), 4, backend=CPU)


def resume(directory: Path, config: dict[str, Any]) -> dict[str, Any]:
    """What the training loop does on --resume: weights, then the optimizer built on them, then its state."""
    model = build_model(ModelConfig.from_hf(config), seed=1)
    CPU.load_weights(directory, 1, model)
    optimizer = TrainingOptimizer(model, OptimizerSection(lr=1e-3), ScheduleSection(), 4, backend=CPU)
    return CPU.load_training_state(directory, 1, optimizer)


CHECKPOINT_FILES = {
    "model": "model/dp_rank_00_tp_rank_00_pp_rank_00.pt",
    "optimizer": "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt",
    "rng": "rng/rank_00000.pt",
    "scheduler": "scheduler.pt",
    "user-content": "user_content.pt",
}


@pytest.mark.parametrize("kind", list(CHECKPOINT_FILES))
@pytest.mark.usefixtures("single_process")
def test_malicious_training_checkpoint_file(kind: str, source: Path, marker: Path, tmp_path: Path) -> None:
    config = json.loads((source / "config.json").read_text())
    model, optimizer = trainer(config)
    directory = tmp_path / "checkpoints"
    CPU.save_checkpoint(directory, 1, model, optimizer, {"step": 1, "consumed_samples": 8}, keep_last=2, xser=False)
    assert resume(directory, config)["step"] == 1  # intact: resumes
    file = plant(directory / "step_1" / CHECKPOINT_FILES[kind], marker)
    with pytest.raises(UserError) as raised:
        resume(directory, config)
    assert str(raised.value) == f"{file}: refused to unpickle posix.system (it could run code); {PLAIN_DATA}"


def rng_draws() -> list[Any]:
    return [random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.normal(), torch.rand(3)]


def same_draws(actual: list[Any], expected: list[Any]) -> bool:
    return actual[:4] == expected[:4] and torch.equal(actual[4], expected[4])


@pytest.mark.usefixtures("single_process")
def test_random_generators_resume_exactly(tmp_path: Path) -> None:
    """Saved as tensors and plain data, loaded with weights_only, every generator continues where it was,
    including the cached second normal value of Python's and numpy's Gaussian samplers."""
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    random.gauss(0, 1), np.random.normal()  # leaves a cached value in each
    path = tmp_path / "rank_00000.pt"
    torch.save(checkpointing.rng_state(), path)
    expected = rng_draws()
    rng_draws()
    checkpointing.restore_rng(path)
    assert same_draws(rng_draws(), expected)


@pytest.mark.usefixtures("single_process")
def test_a_checkpoint_of_the_earlier_rng_form_still_resumes_exactly(tmp_path: Path) -> None:
    """Earlier versions saved `random.getstate()` and `np.random.get_state()` as they are (numpy's key as an
    array): a run saved then resumes after an upgrade, with the same draws."""
    random.seed(4), np.random.seed(4), torch.manual_seed(4)
    random.gauss(0, 1), np.random.normal()
    path = tmp_path / "rank_00000.pt"
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}, path)
    expected = rng_draws()
    rng_draws()
    checkpointing.restore_rng(path)
    assert same_draws(rng_draws(), expected)


@pytest.mark.usefixtures("single_process")
def test_random_generator_file_of_another_form_is_one_line(source: Path, marker: Path, tmp_path: Path) -> None:
    config = json.loads((source / "config.json").read_text())
    model, optimizer = trainer(config)
    directory = tmp_path / "checkpoints"
    CPU.save_checkpoint(directory, 1, model, optimizer, {"step": 1}, keep_last=2, xser=False)
    rng = directory / "step_1" / "rng" / "rank_00000.pt"
    torch.save({"torch": torch.get_rng_state()}, rng)
    with pytest.raises(UserError) as raised:
        resume(directory, config)
    assert str(raised.value) == (
        f"{rng}: not a random generator state this version writes ('python'); allowed: the rng file of a "
        "checkpoint saved by this training code"
    )
    # what rebuilds a numpy array is allowed there, nothing beyond it: an array of objects is refused
    torch.save({"torch": torch.get_rng_state(), "numpy": np.array([Payload(marker)], dtype=object)}, rng)
    with pytest.raises(UserError, match=rf"^{rng}: refused to unpickle "):
        resume(directory, config)
    assert not marker.exists()


@pytest.mark.usefixtures("single_process")
def test_training_checkpoint_of_another_shape_is_one_line(source: Path, tmp_path: Path) -> None:
    config = json.loads((source / "config.json").read_text())
    model, optimizer = trainer(config)
    directory = tmp_path / "checkpoints"
    CPU.save_checkpoint(directory, 1, model, optimizer, {"step": 1}, keep_last=2, xser=False)
    file = directory / "step_1" / CHECKPOINT_FILES["model"]
    state = torch.load(file, weights_only=True)
    torch.save({**state, EMBED: torch.zeros(3, 3)}, file)
    with pytest.raises(UserError) as raised:
        resume(directory, config)
    assert str(raised.value) == f"{file}: {EMBED}: [3, 3] is not allowed; allowed: a tensor of shape [64, 32]"
    torch.save({**state, "step": "one"}, directory / "step_1" / "user_content.pt")
    torch.save(state, file)
    with pytest.raises(UserError) as raised:
        resume(directory, config)
    assert str(raised.value).startswith(f"{directory / 'step_1' / 'user_content.pt'}: step: 'one' is not allowed")


def test_resume_refuses_a_planted_rng_file_end_to_end(
    llama_world_tp1: dict[str, Path], marker: Path, tmp_path: Path
) -> None:
    """`python -m training train --resume` on a checkpoint whose rng file was replaced: exit 2, one error line."""
    world = llama_world_tp1
    checkpoints = tmp_path / "checkpoints"
    command = [sys.executable, "-m", "training", "train", "--recipe", "tiny-llama-cpt"]
    command += [
        f"model.config={world['hf']}",
        "model.pretrained=",
        f"data.path={world['data']}",
        f"checkpoint.dir={checkpoints}",
        "parallelism.tp=1",
        "checkpoint.every=1",
    ]
    first = subprocess.run([*command, "steps=2"], capture_output=True, text=True, timeout=300, check=False)
    assert first.returncode == 0, first.stderr[-3000:]
    rng = plant(checkpoints / "step_2" / "rng" / "rank_00000.pt", marker)
    again = subprocess.run([*command, "steps=3", "--resume"], capture_output=True, text=True, timeout=300, check=False)
    assert again.returncode == 2, again.stderr[-3000:]
    assert "Traceback" not in again.stderr
    errors = [line for line in again.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: {rng}: refused to unpickle posix.system (it could run code); {PLAIN_DATA}"]
