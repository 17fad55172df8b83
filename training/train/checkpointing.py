"""Training checkpoints in neuronx-distributed's layout, so `convert --from nxd` reads them directly.

    <dir>/step_<N>/model/dp_rank_00_tp_rank_XX_pp_rank_00.pt   weights (the nxd layout of training.formats.layouts)
    <dir>/step_<N>/optim/dp_rank_DD_tp_rank_XX_pp_rank_00.pt   each rank's optimizer state (ZeRO-1 shard)
    <dir>/step_<N>/scheduler.pt, user_content.pt               schedule; step and data position
    <dir>/step_<N>/rng/rank_WWWWW.pt                            every rank's random generators
    <dir>/step_<N>/done                                         written last: the checkpoint is complete

Each training backend writes and reads its rank files (`TrainingBackend.save_checkpoint`: here for the CPU
backend, neuronx-distributed's `save_checkpoint` with xser files when asked on Neuron); this module holds what
they share: the layout, the safe reader every file goes through, the random generators' files, and the reader
of pretrained weights (the converter's, on every backend, so there is one reader of the layout).
"""

from __future__ import annotations

import pickle
import random
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training.errors import UserError
from training.formats.lazy import CheckpointError, shown
from training.formats.sharded import STEP_DIR, ShardedSource
from training.model import parallel
from training.model.transformer import CausalLM

DONE = "done"


def step_directory(directory: Path, step: int) -> Path:
    return directory / f"step_{step}"


def complete_steps(directory: Path) -> list[int]:
    """Steps with a `done` marker, ascending; a checkpoint interrupted before `done` is not one of them."""
    if not directory.is_dir():
        return []
    found = (STEP_DIR.match(p.name) for p in directory.iterdir() if (p / DONE).is_file())
    return sorted(int(m.group(1)) for m in found if m)


def latest_complete_step(directory: Path) -> int | None:
    steps = complete_steps(directory)
    return steps[-1] if steps else None


def save_atomically(value: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    torch.save(value, partial)
    partial.replace(path)


def prune(directory: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` complete checkpoints; drop older ones and any unfinished older than them."""
    complete = complete_steps(directory)
    if not complete:
        return
    kept = set(complete[-keep_last:])
    for path in directory.iterdir():
        match = STEP_DIR.match(path.name)
        if match and int(match.group(1)) not in kept and int(match.group(1)) < complete[-1]:
            shutil.rmtree(path, ignore_errors=True)


def optimizer_file(target: Path) -> Path:
    dp, tp, pp = parallel.dp_rank(), parallel.tp_rank(), parallel.pp_rank()
    return target / "optim" / f"dp_rank_{dp:02d}_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"


def restore_rng(path: Path) -> None:
    """Set every generator from a rank's rng file. Files of earlier versions hold numpy's state as an array:
    only what rebuilds a plain numpy array is allowed besides plain data (PyTorch's documented way to load
    one with `weights_only`), so such a checkpoint still resumes and nothing else is unpickled."""
    from numpy._core.multiarray import _reconstruct

    with torch.serialization.safe_globals([_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]):
        state = load_plain(path)
    _restore_rng(state, path)


def rng_file(target: Path) -> Path:
    """This rank's random generators' file in a checkpoint."""
    return target / "rng" / f"rank_{parallel.world_rank():05d}.pt"


def save_rng(target: Path) -> None:
    save_atomically(rng_state(), rng_file(target))


def restore_rng_of(target: Path) -> None:
    """This rank's generators from its rng file in a checkpoint, if it has one."""
    if rng_file(target).is_file():
        restore_rng(rng_file(target))


def load_plain(path: Path, *, data: bool = True) -> Any:
    """torch.load that can never run code from the file: `weights_only` unpickles tensors and plain data
    (numbers, strings, lists, tuples, dicts) and refuses every other global, so a pickle planted on shared
    storage is reported instead of executed. Refusals and damage are one line naming the file.

    `data=False` checks the pickle without reading the tensors' bytes: they are memory-mapped (torch.load's
    `mmap`) and stay unread unless used. Only torch.save's zip files can be mapped; any other file (the
    legacy format, or not a torch.save file at all) is read as it is."""
    try:
        mapped = not data and zipfile.is_zipfile(path)
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
    except pickle.UnpicklingError as error:
        found = re.search(r"GLOBAL ([\w.]+)", str(error))
        what = f"refused to unpickle {found.group(1)} (it could run code)" if found else "refused to unpickle it"
        raise UserError(
            f"{path}: {what}; allowed: a torch.save file of tensors, numbers, strings, lists, tuples and dicts"
        ) from None
    except (RuntimeError, EOFError, ValueError) as error:  # torch's zip reader: truncated or not an archive
        reason = str(error).splitlines()[0][:120] if str(error) else type(error).__name__
        raise UserError(f"{path}: not a readable torch.save file, truncated or corrupt ({reason})") from None


def load_mapping(path: Path, what: str) -> dict[str, Any]:
    """`load_plain` of a file that must hold a dict."""
    value = load_plain(path)
    if not isinstance(value, dict):
        raise UserError(f"{path}: holds a {type(value).__name__}; allowed: a dict, {what}")
    return value


def barrier() -> None:
    if torch.distributed.is_initialized() and parallel.world_size() > 1:
        torch.distributed.barrier()


def start_saving(directory: Path, step: int) -> Path:
    """`step`'s directory, emptied of what a run killed while saving it left (never marked done); every rank
    waits for that before writing."""
    target = step_directory(directory, step)
    if parallel.world_rank() == 0 and target.exists():
        shutil.rmtree(target)
    barrier()
    return target


def finish_saving(
    directory: Path, target: Path, schedule: dict[str, Any], user_content: dict[str, Any], keep_last: int
) -> None:
    """What every backend's checkpoint holds beside its rank files (the random generators, the schedule, the
    run's position), then, once every rank has written, the `done` marker, `newest` and the pruning."""
    save_rng(target)
    if parallel.world_rank() == 0:
        save_atomically(schedule, target / "scheduler.pt")
        save_atomically(user_content, target / "user_content.pt")
    barrier()
    if parallel.world_rank() == 0:
        (target / DONE).write_text("1\n")
        (directory / "newest").write_text(f"{target.name}\n")
        prune(directory, keep_last)
    barrier()


def read_position(target: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The schedule's state and the run's position (user content) of a checkpoint, both checked."""
    scheduler_state = load_mapping(target / "scheduler.pt", "the schedule's state ({'last_epoch': step})")
    content = load_mapping(target / "user_content.pt", "the run's position ({'step': step, ...})")
    for path, state, key in (
        (target / "scheduler.pt", scheduler_state, "last_epoch"),
        (target / "user_content.pt", content, "step"),
    ):
        if type(state.get(key)) is not int or state[key] < 0:
            raise UserError(f"{path}: {key}: {shown(state.get(key))} is not allowed; allowed: a step number, 0 or more")
    return scheduler_state, content


def load_pretrained(directory: Path, config_path: Path, model: CausalLM) -> None:
    """This rank's shard of a `convert --to nxd` output (plain or xser), checked against the model's layout."""
    try:
        # Every tensor's shape is checked against the model's parameter below.
        source = ShardedSource("nxd", directory, config_path, force=False, check_shapes=False)
    except CheckpointError as error:
        raise UserError(f"model.pretrained {directory}: {error}") from None
    wanted, found = model.parallelism, source.parallelism
    describe = "tp {0.tp}, pp {0.pp}, kv_size_multiplier {0.kv_multiplier}, fuse_qkv {0.fuse_qkv}".format
    if found.kv_multiplier > 1 and found.generation != wanted.generation:  # the replicas sit elsewhere
        raise UserError(
            f"model.pretrained {directory}: its K/V replicas are laid out for {found.generation}; the run is for "
            f"{wanted.generation}: convert again with --target {wanted.generation}"
        )
    if (found.tp, found.pp, found.kv_multiplier, found.fuse_qkv) != (
        wanted.tp,
        wanted.pp,
        wanted.kv_multiplier,
        wanted.fuse_qkv,
    ):
        raise UserError(
            f"model.pretrained {directory}: written for {describe(found)}; the recipe trains at {describe(wanted)}: "
            "convert again with those options"
        )
    tensors = source.ranks[(parallel.tp_rank(), parallel.pp_rank())]
    state = model.state_dict()
    missing = set(state) - set(tensors)
    if missing:
        raise UserError(f"model.pretrained {directory}: lacks {', '.join(sorted(missing)[:3])}")
    with torch.no_grad():
        for name, tensor in state.items():
            parameter = parallel.local_view(tensor)
            loaded = tensors[name].load()
            if tuple(loaded.shape) != tuple(parameter.shape):
                raise UserError(
                    f"model.pretrained {directory}: {name} is {tuple(loaded.shape)}, the model needs "
                    f"{tuple(parameter.shape)} (a checkpoint of another model?)"
                )
            parameter.copy_(loaded.to(parameter.dtype))


def rng_state() -> dict[str, Any]:
    """Every generator's state as tensors, ints, floats, strings and dicts only, so that `weights_only` loads it
    back: Python's Mersenne Twister words and numpy's key as int64 tensors (numpy arrays would need a pickled
    numpy global), torch's as its ByteTensor."""
    version, words, gauss_next = random.getstate()
    numpy_state = np.random.get_state(legacy=False)
    return {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "words": torch.tensor(words, dtype=torch.int64), "gauss_next": gauss_next},
        "numpy": {
            "bit_generator": numpy_state["bit_generator"],
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
    }


def _earlier_rng_form(state: Any) -> Any:
    """Earlier versions saved `random.getstate()` and `np.random.get_state()` as they are: the same values in
    `rng_state`'s form; any other value is returned unchanged."""
    if not (
        isinstance(state, dict) and isinstance(state.get("python"), tuple) and isinstance(state.get("numpy"), tuple)
    ):
        return state
    version, words, gauss_next = state["python"]
    bit_generator, key, pos, has_gauss, gauss = state["numpy"]
    return {
        "torch": state.get("torch"),
        "python": {"version": version, "words": torch.tensor(words, dtype=torch.int64), "gauss_next": gauss_next},
        "numpy": {
            "bit_generator": bit_generator,
            "key": torch.from_numpy(np.asarray(key, dtype=np.uint32).astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "gauss": gauss,
        },
    }


def _restore_rng(state: Any, path: Path) -> None:
    """Sets the generators from `rng_state`'s form, after checking it is that form (any other is one line)."""
    try:
        state = _earlier_rng_form(state)
        torch_state, python, numpy_state = state["torch"], state["python"], state["numpy"]
        words, key = python["words"], numpy_state["key"]
        if not (
            isinstance(torch_state, torch.Tensor)
            and torch_state.dtype == torch.uint8
            and isinstance(words, torch.Tensor)
            and isinstance(key, torch.Tensor)
            and words.dtype == key.dtype == torch.int64
            and int(words.min()) >= 0
            and int(key.min()) >= 0
            and int(key.max()) < 2**32
            and (python["gauss_next"] is None or isinstance(python["gauss_next"], float))
        ):
            raise ValueError("values of the wrong type or range")
        python_state = (int(python["version"]), tuple(int(word) for word in words.tolist()), python["gauss_next"])
        numpy_dict = {
            "bit_generator": str(numpy_state["bit_generator"]),
            "state": {"key": key.numpy().astype(np.uint32), "pos": int(numpy_state["pos"])},
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        }
        torch.set_rng_state(torch_state)
        random.setstate(python_state)
        np.random.set_state(numpy_dict)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError, OverflowError) as error:
        reason = str(error).splitlines()[0][:120] if str(error) else type(error).__name__
        raise UserError(
            f"{path}: not a random generator state this version writes ({reason}); allowed: the rng file of a "
            "checkpoint saved by this training code"
        ) from None
