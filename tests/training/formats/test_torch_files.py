"""Streaming torch/xser/safetensors writers: files must read back exactly as torch.save / save_file output.

Independent readers are the oracles: real `torch.load` for torch files, `safetensors` for safetensors files and
`training.formats.torch_reader.open_xser` (which needs no torch_xla) for xser checkpoints.
"""

from __future__ import annotations

import gc
import json
import os
import pickletools
import re
import struct
import subprocess
import sys
import types
import weakref
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.utils.serialization import config as serialization_config

from training.formats import torch_writer
from training.formats.lazy import CheckpointError, LazyTensor
from training.formats.safetensors_writer import SafetensorsWriter, safetensors_save_order
from training.formats.torch_reader import Opaque, open_checkpoint_file, open_torch_file, open_xser
from training.formats.torch_writer import TorchFileWriter, XserWriter

REPO = Path(__file__).resolve().parents[3]
# Makes torch compute each storage's offset from the previous one (miniz's layout rules) instead of reading
# its local header; with TORCH_SERIALIZATION_DEBUG=1 torch also asserts both agree.
OFFSETS_FROM_LAYOUT = serialization_config.patch({"load.calculate_storage_offsets": True})  # type: ignore[attr-defined]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so NaNs and -0.0 compare exactly."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(actual: Any, expected: Any) -> None:
    assert isinstance(actual, torch.Tensor), type(actual)
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    assert torch.equal(bits(actual), bits(expected))


def assert_same_tree(actual: Any, expected: Any) -> None:
    if isinstance(expected, torch.Tensor):
        assert_same(actual, expected)
    elif isinstance(expected, dict):
        assert type(actual) is type(expected)
        assert list(actual) == list(expected)
        for key in expected:
            assert_same_tree(actual[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_same_tree(a, e)
    else:
        assert actual == expected


def sample(dtype: torch.dtype, seed: int = 0, shape: tuple[int, ...] = (6, 10)) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point:
        tensor = torch.randn(shape, generator=generator).to(dtype)
        tensor.view(-1)[:3] = torch.tensor([float("nan"), -0.0, float("inf")]).to(dtype)
        return tensor
    info = torch.iinfo(dtype)
    tensor = torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=generator, dtype=dtype)
    tensor.view(-1)[:2] = torch.tensor([info.min, info.max], dtype=dtype)
    return tensor


def variants(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Contiguous tensors, views of every kind (transposed, strided, offset, expanded), 0-d and empty tensors."""
    base = sample(dtype)
    return {
        "full": base,
        "transposed": base.t(),
        "strided": base[1:, ::3],
        "row": base[2],
        "scalar": base[1, 1],
        "expanded": base[0:1].expand(4, 10),
        "empty": base[:0],
        "empty3d": torch.zeros((3, 0, 2), dtype=dtype),
    }


def all_dtype_state() -> dict[str, torch.Tensor]:
    return {f"{str(dtype)[6:]}.{name}": t for dtype in DTYPES for name, t in variants(dtype).items()}


def write_torch(path: Path, state: dict[str, torch.Tensor], root: Any = None) -> Path:
    with TorchFileWriter(path) as writer:
        for key, tensor in state.items():
            writer.add(key, tensor)
        writer.close(root)
    return path


def torch_loads(path: Path) -> list[Any]:
    """The file as real PyTorch reads it, with and without memory-mapping."""
    return [torch.load(path, weights_only=True), torch.load(path, weights_only=True, mmap=True)]


def materialize(value: Any) -> Any:
    """`value` with every LazyTensor loaded (the tensor_reader's nesting: dicts, lists, tuples)."""
    if isinstance(value, LazyTensor):
        return value.load()
    if isinstance(value, dict):
        return type(value)((key, materialize(item)) for key, item in value.items())
    if isinstance(value, list | tuple):
        return type(value)(materialize(item) for item in value)
    return value


def records(path: Path) -> dict[str, bytes]:
    """Zip records without the archive-name prefix (Python's zipfile also checks every CRC here)."""
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None
        return {info.filename.split("/", 1)[1]: archive.read(info) for info in archive.infolist()}


# ---- TorchFileWriter -------------------------------------------------------------------------------------


def test_round_trip_every_dtype_view_scalar_and_empty_matches_torch_save(tmp_path: Path) -> None:
    state = all_dtype_state()
    reference = tmp_path / "reference.pt"
    torch.save(state, reference)
    expected = torch.load(reference, weights_only=True)
    path = write_torch(tmp_path / "streamed.pt", state)

    for loaded in torch_loads(path):
        assert list(loaded) == list(state)
        for key in state:
            assert_same(loaded[key], expected[key])
            assert_same(loaded[key], state[key])
            assert loaded[key].is_contiguous()


def test_records_match_torch_save_byte_for_byte_and_are_64_byte_aligned(tmp_path: Path) -> None:
    state = {f"{str(dtype)[6:]}": sample(dtype, seed=i) for i, dtype in enumerate(DTYPES)}
    state |= {"scalar": torch.tensor(1.5), "empty": torch.zeros(0, 4, dtype=torch.bfloat16)}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    torch.save(state, tmp_path / "a" / "model.pt")
    path = write_torch(tmp_path / "b" / "model.pt", state)

    ours, theirs = records(path), records(tmp_path / "a" / "model.pt")
    assert set(ours) == set(theirs)
    for name in theirs:
        if name != ".data/serialization_id":  # torch's id hashes names with std::hash; ours is deterministic too
            assert ours[name] == theirs[name], name
    assert ours["data.pkl"] == theirs["data.pkl"]  # the pickle itself is identical
    assert len(ours[".data/serialization_id"]) == 40 and ours[".data/serialization_id"].isdigit()

    with zipfile.ZipFile(path) as archive:
        assert all(name.startswith("model/") for name in archive.namelist())  # torch's archive name rule
    reader = torch._C.PyTorchFileReader(str(path))
    offsets = [reader.get_record_offset(name) for name in ours]  # type: ignore[attr-defined]
    assert offsets and all(offset % 64 == 0 for offset in offsets)


def test_torch_offset_arithmetic_and_meta_loading_match_the_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {"a": sample(torch.float32), "empty": torch.zeros(0), "b": sample(torch.int8)[::2], "s": torch.tensor(3)}
    path = write_torch(tmp_path / "x.pt", state)
    assert records(path)[".format_version"] == b"1"

    monkeypatch.setenv("TORCH_SERIALIZATION_DEBUG", "1")
    with OFFSETS_FROM_LAYOUT:
        loaded = torch.load(path, mmap=True, weights_only=True)
    for key in state:
        assert_same(loaded[key], state[key])
    meta = torch.load(path, map_location="meta", weights_only=True)
    assert {k: (v.shape, v.dtype, v.device.type) for k, v in meta.items()} == {
        k: (v.shape, v.dtype, "meta") for k, v in state.items()
    }


def test_nemo_root_wrapper(tmp_path: Path) -> None:
    state = {
        "model.embedding.word_embeddings.weight": sample(torch.bfloat16),
        "model.final_norm": sample(torch.float32),
    }

    def nemo(state_dict: dict[str, torch.Tensor]) -> object:
        return {"state_dict": state_dict, "pytorch-lightning_version": "1.9.5", "epoch": 0, "global_step": 0}

    path = write_torch(tmp_path / "model_weights.ckpt", state, root=nemo)
    for loaded in torch_loads(path):
        assert_same_tree(loaded, nemo(state))
    reference = tmp_path / "reference.ckpt"
    torch.save(nemo(state), reference)
    assert records(path)["data.pkl"] == records(reference)["data.pkl"]


def test_two_writers_open_at_once_with_interleaved_adds(tmp_path: Path) -> None:
    ranks = [
        {f"layers.{layer}.w": sample(torch.float16, seed=10 * rank + layer) for layer in range(4)} for rank in (0, 1)
    ]
    writers = [TorchFileWriter(tmp_path / f"rank_{rank}.pt") for rank in (0, 1)]
    for layer in range(4):
        for rank, writer in enumerate(writers):
            writer.add(f"layers.{layer}.w", ranks[rank][f"layers.{layer}.w"])
    for writer in writers:
        writer.close()
    for rank in (0, 1):
        for loaded in torch_loads(tmp_path / f"rank_{rank}.pt"):
            assert_same_tree(loaded, ranks[rank])


def test_root_that_reorders_or_drops_tensors_still_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"a": sample(torch.float32, seed=1), "b": sample(torch.int32, seed=2), "c": sample(torch.uint8, seed=3)}
    reordered = write_torch(tmp_path / "reordered.pt", state, root=lambda s: {"c": s["c"], "a": s["a"], "b": s["b"]})
    dropped = write_torch(tmp_path / "dropped.pt", state, root=lambda s: [s["c"]])
    # Without `.format_version`, torch reads every local header instead of computing offsets in file order.
    assert ".format_version" not in records(reordered) and ".format_version" not in records(dropped)
    monkeypatch.setenv("TORCH_SERIALIZATION_DEBUG", "1")
    with OFFSETS_FROM_LAYOUT:
        assert_same_tree(torch.load(reordered, mmap=True, weights_only=True), {k: state[k] for k in "cab"})
        assert_same_tree(torch.load(dropped, mmap=True, weights_only=True), [state["c"]])


def test_same_content_gives_identical_files(tmp_path: Path) -> None:
    state = all_dtype_state()
    (tmp_path / "1").mkdir()
    (tmp_path / "2").mkdir()
    first = write_torch(tmp_path / "1" / "shard.pt", state)
    second = write_torch(tmp_path / "2" / "shard.pt", state)
    assert first.read_bytes() == second.read_bytes()


def test_zip64_records_and_offsets_are_read_by_torch_and_zipfile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Files over 4 GiB need zip64 fields; lowering the threshold exercises the same code on small data.
    monkeypatch.setattr(torch_writer, "ZIP64_LIMIT", 300)
    state = {"big": sample(torch.float32, shape=(40, 10)), "small": sample(torch.int8, seed=1), "e": torch.zeros(0)}
    path = write_torch(tmp_path / "zip64.pt", state)
    with zipfile.ZipFile(path) as archive:
        infos = {info.filename.split("/", 1)[1]: info for info in archive.infolist()}
        assert infos["data/0"].file_size == 1600 and infos["data/1"].header_offset > 300
        assert infos["data/0"].extra[:2] == b"\x01\x00" and infos["data/1"].extra[:2] == b"\x01\x00"
    records(path)  # CRCs and sizes check out
    for loaded in (torch.load(path, mmap=True, weights_only=True), torch.load(path, weights_only=True)):
        assert_same_tree(loaded, state)


def test_writer_keeps_no_reference_to_added_tensors(tmp_path: Path) -> None:
    tensor = sample(torch.float32)
    view = tensor.t()
    alive = weakref.ref(tensor)
    with TorchFileWriter(tmp_path / "x.pt") as writer:
        writer.add("w", view)
        del tensor, view
        gc.collect()
        assert alive() is None


_MEMORY_SCRIPT = r"""
import sys
from pathlib import Path
import torch
from training.formats.torch_writer import TorchFileWriter

UNIT = 16 << 20  # one 16 MB tensor

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak resident set size

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

def measure(run):
    reset_peak()
    base = status("VmRSS")
    run()
    return (status("VmHWM") - base) / UNIT

out = Path(sys.argv[1])
with TorchFileWriter(out / "warmup.pt") as w:
    w.add("w", torch.ones(10)[::2])

def contiguous():
    with TorchFileWriter(out / "contiguous.pt") as w:
        for i in range(20):
            t = torch.empty(UNIT // 4).fill_(i)
            w.add(f"t{i}", t)
            del t

def views():
    with TorchFileWriter(out / "views.pt") as w:
        for i in range(10):
            base = torch.empty(2048, 2048).fill_(i)
            w.add(f"t{i}", base.t())  # non-contiguous: written in 8 MB pieces
            del base

def control():
    tensors = [torch.empty(UNIT // 4).fill_(i) for i in range(3)]
    del tensors

print(measure(contiguous), measure(views), measure(control))
"""


def test_peak_memory_stays_near_one_tensor(tmp_path: Path) -> None:
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS")
    # A fixed mmap threshold makes glibc return every freed 16 MB block at once, so RSS is live memory.
    env = {**os.environ, "PYTHONPATH": str(REPO), "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    result = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True, check=True
    )
    contiguous, views, control = map(float, result.stdout.split())
    assert control > 2.9  # the measurement does see three live 16 MB tensors
    assert contiguous < 1.5  # 20 tensors written, about one alive at a time
    assert views < 2.0  # the view's base plus one 8 MB piece, never a full copy on top
    assert_same(torch.load(tmp_path / "views.pt", mmap=True, weights_only=True)["t9"], torch.full((2048, 2048), 9.0))
    assert (tmp_path / "contiguous.pt").stat().st_size > 20 * (16 << 20)


def test_exception_removes_partial_file(tmp_path: Path) -> None:
    path = tmp_path / "partial.pt"
    with pytest.raises(RuntimeError, match="boom"), TorchFileWriter(path) as writer:
        writer.add("a", sample(torch.float32))
        raise RuntimeError("boom")
    assert not path.exists()


def test_tensor_not_added_in_root_is_rejected_and_file_removed(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    writer = TorchFileWriter(path)
    writer.add("a", sample(torch.float32))
    with pytest.raises(ValueError, match="add"):
        writer.close(lambda state: {"a": state["a"], "stray": torch.ones(2)})
    assert not path.exists()


def test_invalid_adds_raise(tmp_path: Path) -> None:
    with TorchFileWriter(tmp_path / "x.pt") as writer:
        writer.add("a", torch.ones(2))
        with pytest.raises(ValueError, match="duplicate"):
            writer.add("a", torch.ones(2))
        with pytest.raises(ValueError, match="unsupported dtype"):
            writer.add("c", torch.ones(2, dtype=torch.complex64))
        with pytest.raises(ValueError, match="meta"):
            writer.add("m", torch.ones(2, device="meta"))
    for loaded in torch_loads(tmp_path / "x.pt"):
        assert_same_tree(loaded, {"a": torch.ones(2)})
    with pytest.raises(ValueError, match="closed"):
        writer.add("b", torch.ones(2))


# ---- damaged files (read with training.formats.torch_reader and safetensors_reader) ----------------------


@pytest.mark.parametrize("cut", [0.5, 0.97])
def test_truncated_file_raises_checkpoint_error_naming_the_path(tmp_path: Path, cut: float) -> None:
    path = write_torch(tmp_path / "model.pt", {"a": sample(torch.float32, shape=(64, 64))})
    assert_same(materialize(open_torch_file(path))["a"], sample(torch.float32, shape=(64, 64)))  # intact: reads
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(CheckpointError, match=re.escape(str(path))):
        open_torch_file(path)


def test_garbage_empty_and_missing_files_raise_checkpoint_error(tmp_path: Path) -> None:
    for name, data in (("empty.pt", b""), ("garbage.pt", b"not a checkpoint" * 10), ("missing.pt", None)):
        path = tmp_path / name
        if data is not None:
            path.write_bytes(data)
        with pytest.raises(CheckpointError, match=re.escape(str(path))):
            open_torch_file(path)


def test_legacy_and_compressed_files_raise_checkpoint_error_instead_of_wrong_data(tmp_path: Path) -> None:
    state = {"a": sample(torch.float32), "b": sample(torch.int64, seed=1)}
    legacy = tmp_path / "legacy.pt"
    torch.save(state, legacy, _use_new_zipfile_serialization=False)
    compressed = tmp_path / "compressed.pt"
    source_path = write_torch(tmp_path / "x.pt", state)
    with zipfile.ZipFile(source_path) as source, zipfile.ZipFile(compressed, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            target.writestr(info.filename, source.read(info))
    assert_same_tree(torch.load(compressed, weights_only=True), state)  # a valid file, just not a streamable one
    with pytest.raises(CheckpointError, match=re.escape(f"{legacy}: not a readable torch.save archive")):
        open_torch_file(legacy)
    with pytest.raises(CheckpointError, match=re.escape(f"{compressed}: compressed storage records")):
        open_torch_file(compressed)


# ---- xser ------------------------------------------------------------------------------------------------


class _RefuseTorchXla:
    """A meta path finder under which `import torch_xla` fails: what these tests read must not need it."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torch_xla" or name.startswith("torch_xla."):
            raise ImportError(f"{name} imported while reading a checkpoint")


@pytest.fixture(autouse=True)
def without_torch_xla(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts without torch_xla in sys.modules, whatever earlier tests of the process imported (in the
    neuron tier, accelerate imports it with transformers), and cannot import it; restored afterwards."""
    for name in [n for n in sys.modules if n == "torch_xla" or n.startswith("torch_xla.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_RefuseTorchXla(), *sys.meta_path])


def fake_torch_xla(monkeypatch: pytest.MonkeyPatch) -> type:
    """A module tree standing in for torch_xla in tests only; its TensorReference is torch_xla's class."""

    class TensorReference:
        def __init__(self, tid: int) -> None:
            self.tid = tid

    TensorReference.__module__ = "torch_xla.utils.serialization"
    TensorReference.__qualname__ = "TensorReference"
    package, utils, serialization = (
        types.ModuleType(n) for n in ("torch_xla", "torch_xla.utils", "torch_xla.utils.serialization")
    )
    serialization.TensorReference = TensorReference  # type: ignore[attr-defined]
    utils.serialization = serialization  # type: ignore[attr-defined]
    package.utils = utils  # type: ignore[attr-defined]
    for module in (package, utils, serialization):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return TensorReference


def torch_xla_save(data: Any, path: Path, reference: type) -> None:
    """What `torch_xla.utils.serialization.save` does: tensors numbered in traversal order, one file each."""
    tensors_dir = Path(f"{path}.tensors")
    tensors_dir.mkdir()
    count = 0

    def rewrite(value: Any) -> Any:
        nonlocal count
        if isinstance(value, torch.Tensor):
            torch.save(value, tensors_dir / f"tensor_{count}.pt")
            count += 1
            return reference(count - 1)
        if isinstance(value, dict):
            return type(value)((k, rewrite(v)) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return type(value)(rewrite(v) for v in value)
        return value

    torch.save(rewrite(data), path)


def torch_xla_load(path: Path, reference: type[Any]) -> Any:
    """What `torch_xla.utils.serialization.load` does (with the pickle trusted)."""
    ref_data = torch.load(path, weights_only=False)

    def resolve(value: Any) -> Any:
        if type(value) is reference:
            return torch.load(Path(f"{path}.tensors") / f"tensor_{value.tid}.pt", weights_only=True)
        if isinstance(value, dict):
            return type(value)((k, resolve(v)) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return type(value)(resolve(v) for v in value)
        return value

    return resolve(ref_data)


def xser_state() -> dict[str, torch.Tensor]:
    return {"embed": sample(torch.bfloat16), "proj": sample(torch.float32, seed=1).t(), "step": torch.tensor(7)}


def test_xser_round_trip_with_nemo_root(tmp_path: Path) -> None:
    state = xser_state()
    path = tmp_path / "tp_rank_00_pp_rank_000"

    def nemo(refs: dict[str, Any]) -> object:
        return {"state_dict": refs, "pytorch-lightning_version": "1.9.5", "epoch": 0, "global_step": 0}

    with XserWriter(path) as writer:
        for tid, (key, tensor) in enumerate(state.items()):
            writer.add(key, tensor)
            assert (tmp_path / f"{path.name}.tensors" / f"tensor_{tid}.pt").is_file()  # written at add()
        assert not path.exists()
        writer.close(nemo)

    assert sorted(p.name for p in Path(f"{path}.tensors").iterdir()) == ["tensor_0.pt", "tensor_1.pt", "tensor_2.pt"]
    pickled = records(path)["data.pkl"]
    globals_ = {arg for op, arg, _ in pickletools.genops(pickled) if op.name == "GLOBAL"}
    assert globals_ == {"torch_xla.utils.serialization TensorReference"}
    assert_same(torch.load(Path(f"{path}.tensors") / "tensor_1.pt", weights_only=True), state["proj"])

    assert_same_tree(materialize(open_xser(path)), nemo(state))
    assert_same_tree(materialize(open_checkpoint_file(path)), nemo(state))  # the `.tensors` folder marks xser
    assert "torch_xla" not in sys.modules


def test_xser_writer_output_loads_with_torch_xla_semantics(tmp_path: Path) -> None:
    state = xser_state()
    path = tmp_path / "ckpt.pt"
    with XserWriter(path) as writer:
        for key, tensor in state.items():
            writer.add(key, tensor)
    with pytest.MonkeyPatch.context() as monkeypatch:
        reference = fake_torch_xla(monkeypatch)
        raw = torch.load(path, weights_only=False)
        assert [type(v) for v in raw.values()] == [reference] * 3 and [
            getattr(v, "tid", None) for v in raw.values()
        ] == [0, 1, 2]
        assert_same_tree(torch_xla_load(path, reference), state)
    assert "torch_xla" not in sys.modules


def test_open_xser_reads_a_checkpoint_laid_out_by_torch_xla(tmp_path: Path) -> None:
    state = xser_state()
    data = {"model": OrderedDict(state), "optimizer": [state["step"], {"lr": 0.1}], "epoch": 3}
    path = tmp_path / "tp_rank_00_pp_rank_00"
    with pytest.MonkeyPatch.context() as monkeypatch:
        torch_xla_save(data, path, fake_torch_xla(monkeypatch))
    assert sorted(p.name for p in Path(f"{path}.tensors").iterdir()) == [f"tensor_{i}.pt" for i in range(4)]
    assert "torch_xla" not in sys.modules  # open_xser must not need it
    loaded = materialize(open_xser(path))
    # open_xser rebuilds mappings as plain dicts, so the OrderedDict comes back as a dict with the same order.
    assert_same_tree(loaded, {**data, "model": dict(state)})
    assert "torch_xla" not in sys.modules


class Unsafe:
    ran = False

    def __init__(self) -> None:
        self.payload = 1  # non-empty state, so unpickling the real class calls __setstate__

    def __setstate__(self, state: Any) -> None:
        Unsafe.ran = True


def test_xser_root_keeps_other_globals_and_open_xser_runs_no_code_from_them(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    with XserWriter(path) as writer:
        writer.add("a", torch.ones(2))
        writer.close(lambda refs: {"a": refs["a"], "evil": Unsafe()})
    globals_ = {arg for op, arg, _ in pickletools.genops(records(path)["data.pkl"]) if op.name == "GLOBAL"}
    assert globals_ == {"torch_xla.utils.serialization TensorReference", f"{__name__} Unsafe"}
    loaded = open_xser(path)
    assert not Unsafe.ran
    assert type(loaded["evil"]) is Opaque
    assert_same(loaded["a"].load(), torch.ones(2))
    try:  # control: a trusting unpickler does run Unsafe's code
        with pytest.MonkeyPatch.context() as monkeypatch:
            fake_torch_xla(monkeypatch)
            assert type(torch.load(path, weights_only=False)["evil"]) is Unsafe
        assert Unsafe.ran
    finally:
        Unsafe.ran = False


def test_open_xser_missing_tensor_file_raises_checkpoint_error(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    with XserWriter(path) as writer:
        writer.add("a", torch.ones(2))
        writer.add("b", torch.zeros(3))
    (Path(f"{path}.tensors") / "tensor_1.pt").unlink()
    with pytest.raises(CheckpointError, match=r"tensor_1\.pt: missing"):
        open_xser(path)


def test_xser_exception_removes_partial_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    with pytest.raises(RuntimeError, match="boom"), XserWriter(path) as writer:
        writer.add("a", torch.ones(2))
        raise RuntimeError("boom")
    assert not path.exists() and not Path(f"{path}.tensors").exists()


# ---- safetensors -----------------------------------------------------------------------------------------


def safetensors_state() -> dict[str, torch.Tensor]:
    # Deliberately not in save_file's order (descending dtype alignment, then name).
    return {
        "z.mask": sample(torch.bool),
        "b.weight": sample(torch.bfloat16, seed=1).t(),
        "a.weight": sample(torch.bfloat16, seed=2),
        "ids": sample(torch.int64, seed=3)[:, ::2],
        "scale": torch.tensor(0.5, dtype=torch.float16),
        "empty": torch.zeros(0, 3),
        "f32": sample(torch.float32, seed=4),
        "q": sample(torch.int8, seed=5),
        "u": sample(torch.uint8, seed=6),
        "i32": sample(torch.int32, seed=7),
    }


def write_safetensors(path: Path, state: dict[str, torch.Tensor], plan: Any, metadata: Any = None) -> Path:
    with SafetensorsWriter(path, plan, metadata) as writer:
        for name, _, _ in plan:
            writer.add(name, state[name])
    return path


def split_safetensors(path: Path) -> tuple[dict[str, Any], bytes]:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    assert length % 8 == 0  # padded with spaces so the tensor data starts 8-byte aligned
    return json.loads(data[8 : 8 + length]), data[8 + length :]


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}, {"note": 'ÿ "quoted" \\ \n\t\x01 ✓'}])
def test_safetensors_stream_is_byte_identical_to_save_file(tmp_path: Path, metadata: Any) -> None:
    state = safetensors_state()
    plan = safetensors_save_order([(k, v.dtype, tuple(v.shape)) for k, v in state.items()])
    ours = write_safetensors(tmp_path / "ours.safetensors", state, plan, metadata)
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "theirs.safetensors", metadata=metadata)
    assert ours.read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()
    assert split_safetensors(ours)[0].get("__metadata__") == metadata


def test_safetensors_with_several_metadata_keys_matches_save_file_up_to_key_order(tmp_path: Path) -> None:
    # save_file writes metadata from a Rust HashMap, in a different order on every run; we sort the keys.
    state = safetensors_state()
    metadata = {"format": "pt", "converted_by": "converter", "a": "1"}
    plan = safetensors_save_order([(k, v.dtype, tuple(v.shape)) for k, v in state.items()])
    ours = write_safetensors(tmp_path / "ours.safetensors", state, plan, metadata)
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "theirs.safetensors", metadata=metadata)
    (our_header, our_data), (their_header, their_data) = map(split_safetensors, (ours, tmp_path / "theirs.safetensors"))
    assert our_header == their_header and our_data == their_data
    assert list(our_header["__metadata__"]) == sorted(metadata)


def test_safetensors_any_plan_order_loads(tmp_path: Path) -> None:
    state = safetensors_state()
    plan = [(k, v.dtype, tuple(v.shape)) for k, v in state.items()]
    path = write_safetensors(tmp_path / "x.safetensors", state, plan, {"format": "pt"})
    loaded = load_file(path)
    assert sorted(loaded) == sorted(state)
    for key in state:
        assert_same(loaded[key], state[key])
    with safe_open(path, framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
        assert list(handle.keys()) == sorted(state)
        for key in state:
            assert_same(handle.get_tensor(key), state[key])


def test_safetensors_empty_plan_matches_save_file(tmp_path: Path) -> None:
    ours = write_safetensors(tmp_path / "ours.safetensors", {}, [])
    save_file({}, tmp_path / "theirs.safetensors")
    assert ours.read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()


def test_safetensors_rejects_wrong_order_shape_dtype_and_missing_tensors(tmp_path: Path) -> None:
    plan = [("a", torch.float32, (2, 3)), ("b", torch.int8, (4,))]
    path = tmp_path / "x.safetensors"
    cases = [
        ("b", torch.zeros(4, dtype=torch.int8), "expected 'a' next"),
        ("a", torch.zeros(3, 2), r"plan says torch.float32 \(2, 3\)"),
        ("a", torch.zeros(2, 3, dtype=torch.float16), "plan says"),
    ]
    for name, tensor, message in cases:
        writer = SafetensorsWriter(path, plan)
        with pytest.raises(ValueError, match=message):
            writer.add(name, tensor)
        writer.abort()
    writer = SafetensorsWriter(path, plan)
    writer.add("a", torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"1 planned tensors were not written: \['b'\]"):
        writer.close()
    assert not path.exists()
    with SafetensorsWriter(path, plan) as writer:
        writer.add("a", torch.zeros(2, 3))
        writer.add("b", torch.zeros(4, dtype=torch.int8))
        with pytest.raises(ValueError, match="not in the plan"):
            writer.add("c", torch.zeros(1))
    assert set(load_file(path)) == {"a", "b"}
    with pytest.raises(ValueError, match="duplicate"):
        SafetensorsWriter(tmp_path / "dup.safetensors", [("a", torch.float32, (1,)), ("a", torch.float32, (1,))])
