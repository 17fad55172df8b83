"""Outputs on storage shared by several machines: who may remove a hidden sibling, what `--overwrite` may
replace, a kill at every step of publishing followed by a rerun, and writers racing for one output."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.moto_server import moto_endpoint
from tests.support.repository import ROOT
from tests.support.tiny_models import llama
from training import outputs
from training.cli import main
from training.errors import UserError
from training.local.tiny import sample_conversations, sample_documents, tiny_model, train_tokenizer, write_jsonl
from training.outputs import Owner, atomic_directory, owner_is_gone, reusable, sibling_name, write_manifest

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)

FINGERPRINT = {"inputs": "new"}


def me(**changes: object) -> Owner:
    return dataclasses.replace(outputs.current_owner(), **changes)


def hidden(final: Path) -> list[str]:
    """Every hidden sibling of `final`, whatever its kind or naming."""
    return sorted(p.name for p in final.parent.iterdir() if p.name.startswith(f".{final.name}."))


def complete_output(directory: Path, fingerprint: dict[str, str], payload: str = "weights") -> Path:
    directory.mkdir()
    (directory / "payload").write_text(payload)
    write_manifest(directory, {"kind": "test", "fingerprint": fingerprint})
    return directory


def leftover(final: Path, kind: str, owner: Owner) -> Path:
    path = final.parent / sibling_name(final.name, kind, owner)
    path.mkdir()
    (path / "partial").write_text("half written")
    return path


def exited_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    child = subprocess.Popen(["sleep", "60"])
    yield child
    child.kill()
    child.wait()


# --- who may remove a hidden sibling -------------------------------------------------------------------


def test_the_owner_is_recorded_in_the_name_and_read_back() -> None:
    owner = me(host="ip-10-0-1-5.ec2.internal")
    name = sibling_name("out", "tmp", owner)
    assert name.startswith(".out.tmp-ip-10-0-1-5.ec2.internal-")
    assert outputs.parse_sibling("out", name) == ("tmp", owner)
    assert outputs.parse_sibling("out", ".out.tmp-12345") == ("tmp", None)  # an earlier version's naming
    assert outputs.parse_sibling("out", sibling_name("out.v2", "tmp", owner)) is None
    assert outputs.parse_sibling("out", ".out.lock") is None


GONE = {
    # label: (owner's changes from this process, pid -> start time of a live process or None)
    "this process": ({}, False),
    "this pid with another token (an earlier process had our pid)": ({"token": "0badcafe"}, True),
    "another live process": ({"pid": 4242, "start": 77}, False),
    "another process that exited": ({"pid": 4242, "start": 77}, True),
    "pid now used by a process started later": ({"pid": 4242, "start": 76}, True),
    "start time unknown, pid alive": ({"pid": 4242, "start": 0}, False),
    "another host, pid exited there or not": ({"host": "other-node", "pid": 4242}, False),
    "same host name, other boot or pid namespace": ({"machine": "0" * 12, "pid": 4242}, False),
}


@pytest.mark.parametrize("case", list(GONE))
def test_only_a_writer_that_is_provably_gone_counts_as_gone(case: str) -> None:
    changes, expected = GONE[case]

    def start_of(pid: int) -> int | None:
        assert pid == 4242
        if case == "another process that exited":
            return None
        return 77

    assert owner_is_gone(me(**changes), me(), start_of) is expected


@pytest.mark.parametrize("other", [{"host": "other-node"}, {"machine": "f" * 12}], ids=["other-host", "other-boot"])
def test_a_sibling_of_another_machine_with_a_live_owner_is_kept(
    other: dict[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its pid means nothing here: no such process runs on this machine, yet the writer lives on its own."""
    final = tmp_path / "out"
    kept = [leftover(final, kind, me(pid=exited_pid(), **other)) for kind in ("tmp", "old", "scratch")]
    caplog.set_level(logging.WARNING, logger="training.outputs")
    assert reusable(final, FINGERPRINT, overwrite=False) is None
    with atomic_directory(final) as output:
        write_manifest(output, {"kind": "test", "fingerprint": FINGERPRINT})
    assert all(path.is_dir() and (path / "partial").exists() for path in kept)
    assert (final / "manifest.json").is_file()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3 and all("\n" not in w and "delete it once that run is gone" in w for w in warnings)


def test_leftovers_of_a_dead_writer_on_this_machine_are_removed(tmp_path: Path) -> None:
    final = complete_output(tmp_path / "out", FINGERPRINT)
    dead = me(pid=exited_pid(), token="0badcafe")
    for kind in ("tmp", "old", "scratch"):
        leftover(final, kind, dead)
    assert reusable(final, FINGERPRINT, overwrite=False) is not None
    assert hidden(final) == []
    assert (final / "payload").read_text() == "weights"


def test_a_reused_pid_is_told_apart_by_token_and_start_time(tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    final = tmp_path / "out"
    start = outputs.process_start(sleeper.pid)
    assert start  # running, start time known
    earlier_holder_of_our_pid = leftover(final, "tmp", me(token="0badcafe"))
    earlier_holder_of_its_pid = leftover(final, "tmp", me(pid=sleeper.pid, start=start - 1, token="0badcafe"))
    its_own = leftover(final, "scratch", me(pid=sleeper.pid, start=start, token="0badcafe"))
    assert reusable(final, FINGERPRINT, overwrite=False) is None
    assert not earlier_holder_of_our_pid.exists() and not earlier_holder_of_its_pid.exists()
    assert its_own.is_dir()


def test_an_exited_process_not_yet_reaped_is_gone() -> None:
    child = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + 10
        while outputs.process_start(child.pid) is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert outputs.process_start(child.pid) is None
        assert Path(f"/proc/{child.pid}").exists()  # a zombie: its pid is still taken
    finally:
        child.wait()


# --- what --overwrite may replace -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["files", "another tool's manifest", "a file", "a symlink"])
def test_overwrite_refuses_anything_but_our_outputs_in_one_line(kind: str, tmp_path: Path) -> None:
    final = tmp_path / "out"
    if kind == "a file":
        final.write_text("notes")
    elif kind == "a symlink":
        final.symlink_to(complete_output(tmp_path / "elsewhere", {"inputs": "old"}))
    else:
        final.mkdir()
        (final / ("manifest.json" if kind == "another tool's manifest" else "model.safetensors")).write_text("{}")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(UserError) as refused:
        reusable(final, FINGERPRINT, overwrite=True)
    message = str(refused.value)
    assert "\n" not in message
    assert message == (
        f"{final} already exists and was not written by this tool; choose another --output "
        "(--overwrite replaces only this tool's outputs and empty directories)"
    )
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("overwrite", [True, False])
def test_an_empty_directory_may_be_written_over(overwrite: bool, tmp_path: Path) -> None:
    final = tmp_path / "out"
    final.mkdir()
    assert reusable(final, FINGERPRINT, overwrite=overwrite) is None
    with atomic_directory(final, overwrite=overwrite) as output:
        write_manifest(output, {"kind": "test", "fingerprint": FINGERPRINT})
    assert outputs.read_manifest(final) == {"kind": "test", "fingerprint": FINGERPRINT}
    assert hidden(final) == []


def test_overwrite_replaces_our_output_and_leaves_nothing_beside_it(tmp_path: Path) -> None:
    final = complete_output(tmp_path / "out", {"inputs": "old"}, payload="old")
    with pytest.raises(UserError, match=r"different inputs \(inputs\)"):
        reusable(final, FINGERPRINT, overwrite=False)
    assert reusable(final, FINGERPRINT, overwrite=True) is None
    with atomic_directory(final, overwrite=True) as output:
        (output / "payload").write_text("new")
        write_manifest(output, {"kind": "test", "fingerprint": FINGERPRINT})
    assert (final / "payload").read_text() == "new"
    assert hidden(final) == []


def test_a_replacement_whose_new_copy_vanished_puts_the_old_one_back(tmp_path: Path) -> None:
    final = complete_output(tmp_path / "out", {"inputs": "old"}, payload="old")
    with pytest.raises(FileNotFoundError), atomic_directory(final, overwrite=True) as output:
        write_manifest(output, {"kind": "test", "fingerprint": FINGERPRINT})
        shutil.rmtree(output)  # as a careless cleaner elsewhere would
    assert (final / "payload").read_text() == "old"
    assert hidden(final) == []


def test_a_copy_set_aside_by_a_killed_replacement_is_restored_first(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    final = tmp_path / "out"
    killed = me(pid=exited_pid(), token="0badcafe")
    complete_output(final.parent / sibling_name("out", "old", killed), {"inputs": "old"}, payload="old")
    leftover(final, "tmp", killed)
    caplog.set_level(logging.WARNING, logger="training.outputs")
    assert reusable(final, {"inputs": "old"}, overwrite=False) == {"kind": "test", "fingerprint": {"inputs": "old"}}
    assert (final / "payload").read_text() == "old"
    assert hidden(final) == []
    assert any("restored the complete copy" in r.getMessage() for r in caplog.records)


def test_a_set_aside_copy_is_kept_when_something_else_took_the_name(tmp_path: Path) -> None:
    final = tmp_path / "out"
    killed = me(pid=exited_pid(), token="0badcafe")
    old = complete_output(final.parent / sibling_name("out", "old", killed), {"inputs": "old"}, payload="old")
    final.mkdir()
    (final / "notes").write_text("a user's")
    with pytest.raises(UserError, match="was not written by this tool"):
        reusable(final, FINGERPRINT, overwrite=True)
    assert (old / "payload").read_text() == "old"


# --- racing writers: rename(2) lets exactly one publish --------------------------------------------------


@pytest.mark.parametrize(
    "theirs, overwrite, outcome",
    [
        (FINGERPRINT, False, "theirs kept, success"),
        ({"inputs": "other"}, False, "refused"),
        ({"inputs": "other"}, True, "ours replaces theirs"),
    ],
)
def test_a_writer_that_loses_the_race_sees_the_winners_output(
    theirs: dict[str, str], overwrite: bool, outcome: str, tmp_path: Path
) -> None:
    final = tmp_path / "out"

    def write_ours() -> None:
        with atomic_directory(final, overwrite=overwrite) as output:
            (output / "payload").write_text("ours")
            write_manifest(output, {"kind": "test", "fingerprint": FINGERPRINT})
            complete_output(final, theirs, payload="theirs")  # the other writer publishes first

    if outcome == "refused":
        with pytest.raises(UserError) as refused:
            write_ours()
        assert "\n" not in str(refused.value) and "different inputs (inputs)" in str(refused.value)
    else:
        write_ours()
    assert (final / "payload").read_text() == ("ours" if outcome == "ours replaces theirs" else "theirs")
    assert hidden(final) == []


# --- every output-writing command, killed at each step of publishing, then rerun ---------------------------


@dataclasses.dataclass(frozen=True)
class World:
    tokenizer: Path
    corpus: Path
    chats: Path
    hf: Path
    nxd: Path
    models: dict[str, Path]  # "new" and "old": Hugging Face models with the tokenizer, for `sample`
    runs: dict[str, Path]  # "new" and "old": finished run directories, for `export`


INPUTS = ("new", "old")


def finished_run(directory: Path, model: Path, run_id: str) -> Path:
    """A run directory as the pipeline leaves it after the sample stage."""
    shutil.copytree(model, directory / "hf")
    (directory / "checkpoints").mkdir()
    (directory / "checkpoints" / "metrics.jsonl").write_text('{"step": 1, "loss": 9.5}\n')
    (directory / "logs").mkdir()
    (directory / "logs" / "train-7.out").write_text(f"{run_id} trained\n")
    if run_id.endswith("old"):  # a file only the earlier export has
        (directory / "logs" / "train-6.out").write_text("killed\n")
    (directory / "samples.json").write_text(json.dumps({"samples": [run_id]}) + "\n")
    (directory / "recipe.yaml").write_text(f"name: {run_id}\n")
    (directory / "run.json").write_text(json.dumps({"run_id": run_id}) + "\n")
    return directory


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    root = tmp_path_factory.mktemp("world")
    tokenizer = train_tokenizer(root / "tokenizer")
    corpus = write_jsonl(root / "corpus.jsonl", ({"text": t} for t in sample_documents(150)))
    chats = write_jsonl(root / "chats.jsonl", ({"messages": c} for c in sample_conversations(60)))
    hf = llama(root / "hf")
    nxd = root / "nxd"
    assert main(["convert", "--from", "hf", "--to", "nxd", "--input", str(hf), "--output", str(nxd), "--tp", "2"]) == 0
    models = {inputs: tiny_model(root / f"model-{inputs}", tokenizer, seed=seed) for seed, inputs in enumerate(INPUTS)}
    runs = {inputs: finished_run(root / f"run-{inputs}", models[inputs], f"run-{inputs}") for inputs in INPUTS}
    return World(tokenizer, corpus, chats, hf, nxd, models, runs)


# Each command with the inputs of the output the test wants ("new") and of an earlier one ("old").
COMMANDS: dict[str, Callable[[World, Path, str], list[str]]] = {
    "prepare pretrain": lambda w, out, inputs: [
        *("prepare", "pretrain", "--source", str(w.corpus), "--tokenizer", str(w.tokenizer), "--output", str(out)),
        *("--num-proc", "1", "--seq-len", "64" if inputs == "new" else "32"),
    ],
    "prepare sft": lambda w, out, inputs: [
        *("prepare", "sft", "--source", str(w.chats), "--tokenizer", str(w.tokenizer), "--output", str(out)),
        *("--num-proc", "1", "--seq-len", "64" if inputs == "new" else "48"),
    ],
    "convert --to nxd": lambda w, out, inputs: [
        *("convert", "--from", "hf", "--to", "nxd", "--input", str(w.hf), "--output", str(out)),
        *("--tp", "2" if inputs == "new" else "4"),
    ],
    "convert --to hf": lambda w, out, inputs: [
        *("convert", "--from", "nxd", "--to", "hf", "--input", str(w.nxd), "--output", str(out)),
        *("--max-shard-size", "2GB" if inputs == "new" else "20000"),
    ],
    "export": lambda w, out, inputs: ["export", "--run-dir", str(w.runs[inputs]), "--output", str(out)],
}


def contents(directory: Path) -> dict[str, object]:
    """Every file's bytes, minus what legitimately differs between two runs: the elapsed time in our
    manifest and the random fingerprint `datasets` gives a dataset in state.json."""
    files: dict[str, object] = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        name = str(path.relative_to(directory))
        if path.name in ("manifest.json", "state.json"):
            recorded = json.loads(path.read_text())
            files[name] = {k: v for k, v in recorded.items() if k not in ("elapsed_seconds", "_fingerprint")}
        else:
            files[name] = path.read_bytes()
    return files


@pytest.fixture(scope="module")
def uninterrupted(world: World, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], dict[str, object]]:
    """The contents of an uninterrupted run's output, per command and inputs (made once, on demand)."""
    made: dict[tuple[str, str], dict[str, object]] = {}

    def contents_of(command: str, inputs: str) -> dict[str, object]:
        if (command, inputs) not in made:
            out = tmp_path_factory.mktemp("uninterrupted") / "out"
            assert main(COMMANDS[command](world, out, inputs)) == 0
            made[command, inputs] = contents(out)
        return made[command, inputs]

    return contents_of


def run(args: list[str], **environment: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "training", *args],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **environment},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


# kill point -> whether the killed run replaces an earlier output, and what it must leave behind
# (between-renames: as on a file system that cannot swap two directories; after-rename: swapped in one step)
KILLS = {
    "before-rename": (False, "no output, its temporary directory"),
    "between-renames": (True, "no output, the set-aside old one and the temporary directory"),
    "after-rename": (True, "the new output, the old one under the temporary name"),
}
TWO_RENAMES = {outputs.EXCHANGE: "0"}


@pytest.mark.parametrize("point", list(KILLS))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_killed_command_and_its_rerun_leave_exactly_the_uninterrupted_output(
    command: str,
    point: str,
    world: World,
    uninterrupted: Callable[[str, str], dict[str, object]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "out"
    replacing, _ = KILLS[point]
    overwrite = ["--overwrite"] if replacing else []
    if replacing:
        assert main(COMMANDS[command](world, out, "old")) == 0
    two_renames = TWO_RENAMES if point == "between-renames" else {}
    killed = run(COMMANDS[command](world, out, "new") + overwrite, **{outputs.KILL_AT: point}, **two_renames)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    kinds = [name.removeprefix(".out.").partition("-")[0] for name in hidden(out)]
    if point == "before-rename":
        assert not out.exists() and "tmp" in kinds
    elif point == "between-renames":
        assert not out.exists() and "old" in kinds and "tmp" in kinds
    else:
        assert contents(out) == uninterrupted(command, "new") and kinds == ["tmp"]

    capsys.readouterr()
    assert main(COMMANDS[command](world, out, "new") + overwrite) == 0
    assert contents(out) == uninterrupted(command, "new")
    assert hidden(out) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_killed_replacement_rerun_without_overwrite_gets_the_old_output_back(
    world: World,
    uninterrupted: Callable[[str, str], dict[str, object]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "out"
    assert main(COMMANDS["convert --to nxd"](world, out, "old")) == 0
    killed = run(
        [*COMMANDS["convert --to nxd"](world, out, "new"), "--overwrite"],
        **{outputs.KILL_AT: "between-renames"},
        **TWO_RENAMES,
    )
    assert killed.returncode == -signal.SIGKILL
    capsys.readouterr()
    assert main(COMMANDS["convert --to nxd"](world, out, "old")) == 0
    assert json.loads(capsys.readouterr().out)["reused"] is True
    assert contents(out) == uninterrupted("convert --to nxd", "old")
    assert hidden(out) == []


# `sample` rewrites one file: a kill leaves the earlier file whole, the rerun the uninterrupted one.


def sample_command(world: World, out: Path, inputs: str) -> list[str]:
    return ["sample", "--recipe", "tiny-llama-cpt", "--input", str(world.models[inputs]), "--output", str(out)]


@pytest.mark.parametrize("earlier", [False, True], ids=["first", "replacing"])
def test_a_killed_sample_leaves_the_earlier_file_and_its_rerun_the_uninterrupted_one(
    earlier: bool, world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uninterrupted = tmp_path / "uninterrupted" / "samples.json"
    assert main(sample_command(world, uninterrupted, "new")) == 0
    out = tmp_path / "run" / "samples.json"
    if earlier:
        assert main(sample_command(world, out, "old")) == 0
        before = out.read_bytes()
        assert before != uninterrupted.read_bytes()
    killed = run(sample_command(world, out, "new"), **{outputs.KILL_AT: "before-rename"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert out.read_bytes() == before if earlier else not out.exists()
    assert [name.removeprefix(".samples.json.").partition("-")[0] for name in hidden(out)] == ["tmp"]

    capsys.readouterr()
    assert main(sample_command(world, out, "new")) == 0
    assert out.read_bytes() == uninterrupted.read_bytes()
    assert sorted(p.name for p in out.parent.iterdir()) == ["samples.json"]


# `export` to S3 has no rename: objects first, the manifest last. moto's standalone server stands in for S3,
# so a subprocess killed in the middle of an upload writes to the same "bucket" as its rerun.


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    with moto_endpoint() as endpoint:
        yield endpoint


@pytest.fixture
def bucket(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh bucket; this process and the commands it starts reach it through AWS_ENDPOINT_URL."""
    import boto3

    credentials = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing"}
    for name, value in {**credentials, "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3_endpoint}.items():
        monkeypatch.setenv(name, value)
    resource = boto3.resource("s3")
    created = resource.create_bucket(Bucket=f"results-{secrets.token_hex(4)}")
    return created


def objects(bucket: Any, prefix: str) -> dict[str, bytes]:
    return {o.key.removeprefix(prefix): o.get()["Body"].read() for o in bucket.objects.filter(Prefix=prefix)}


def exported_to_s3(bucket: Any, prefix: str) -> dict[str, object]:
    """What a reader of the export may rely on: nothing without the manifest, then every object it lists."""
    found = objects(bucket, prefix)
    if outputs.MANIFEST not in found:
        return {}
    manifest = json.loads(found.pop(outputs.MANIFEST))
    assert sorted(found) == manifest["files"]
    return {"manifest": manifest, **found}


def test_an_export_to_s3_is_every_file_and_then_its_manifest(world: World, bucket: Any) -> None:
    run_dir = world.runs["new"]
    result = run(["export", "--run-dir", str(run_dir), "--output", f"s3://{bucket.name}/results/r1"])
    assert result.returncode == 0, result.stderr
    exported = exported_to_s3(bucket, "results/r1/")
    manifest = exported.pop("manifest")
    assert manifest["kind"] == "export" and manifest["run_id"] == "run-new"
    assert exported == {name: (run_dir / name).read_bytes() for name in manifest["files"]}
    assert {"hf/config.json", "samples.json", "run.json", "checkpoints/metrics.jsonl"} <= exported.keys()


@pytest.mark.parametrize("earlier", [False, True], ids=["first", "replacing"])
def test_a_killed_export_to_s3_has_no_manifest_and_its_rerun_completes_it(
    earlier: bool, world: World, bucket: Any
) -> None:
    destination = ["--output", f"s3://{bucket.name}/results/r1"]
    if earlier:
        assert run(["export", "--run-dir", str(world.runs["old"]), *destination]).returncode == 0
        assert exported_to_s3(bucket, "results/r1/")["manifest"]["run_id"] == "run-old"
    command = ["export", "--run-dir", str(world.runs["new"]), *destination]
    killed = run(command, **{outputs.KILL_AT: "uploaded-3"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert exported_to_s3(bucket, "results/r1/") == {}  # a reader sees no complete export, not a mix
    assert len(objects(bucket, "results/r1/")) >= 3

    assert run(command).returncode == 0
    exported = exported_to_s3(bucket, "results/r1/")
    assert exported.pop("manifest")["run_id"] == "run-new"
    assert exported == {name: (world.runs["new"] / name).read_bytes() for name in exported}


# --- writers started together -------------------------------------------------------------------------------


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def start_together(commands: list[list[str]]) -> list[subprocess.CompletedProcess[str]]:
    environment = {**os.environ, "HF_HUB_OFFLINE": "1"}
    started = [
        subprocess.Popen(
            [sys.executable, "-m", "training", *args],
            cwd=ROOT,
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in commands
    ]
    finished = []
    for process in started:
        stdout, stderr = process.communicate(timeout=300)
        finished.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    return finished


def test_two_writers_of_the_same_output_end_with_one_complete_copy(
    world: World, uninterrupted: Callable[[str, str], dict[str, object]], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    args = COMMANDS["prepare pretrain"](world, out, "new")
    results = start_together([args, args])
    # Whoever publishes second finds the first one's output, made from the same inputs, and keeps it.
    assert [result.returncode for result in results] == [0, 0], [error_lines(r.stderr) for r in results]
    assert contents(out) == uninterrupted("prepare pretrain", "new")
    assert hidden(out) == []


def test_two_writers_with_different_inputs_one_wins_the_other_gets_one_line(
    world: World, uninterrupted: Callable[[str, str], dict[str, object]], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    results = start_together([COMMANDS["convert --to nxd"](world, out, inputs) for inputs in ("new", "old")])
    assert sorted(result.returncode for result in results) == [0, 2], [result.stderr for result in results]
    winner = "new" if results[0].returncode == 0 else "old"
    loser = results[1] if winner == "new" else results[0]
    assert error_lines(loser.stderr) == [
        f"error: {out} already holds an output made with different inputs (parallelism); "
        "choose another --output or pass --overwrite"
    ]
    assert contents(out) == uninterrupted("convert --to nxd", winner)
    assert hidden(out) == []


def test_a_reader_always_finds_a_complete_output_while_it_is_replaced(tmp_path: Path) -> None:
    """Where the file system swaps two directories in one step (this machine's does), a reader polling the
    output while it is replaced 40 times never finds it missing or without its manifest."""
    final, missing, done = tmp_path / "out", [], threading.Event()

    def write(generation: int) -> None:
        with outputs.atomic_directory(final, overwrite=True) as directory:
            (directory / "payload").write_text(str(generation))
            outputs.write_manifest(directory, {"kind": "test", "fingerprint": {"generation": generation}})

    def read() -> None:
        while not done.is_set():
            if not (final / outputs.MANIFEST).is_file():
                missing.append(1)

    write(0)
    reader = threading.Thread(target=read)
    reader.start()
    try:
        for generation in range(1, 41):
            write(generation)
    finally:
        done.set()
        reader.join()
    assert missing == []
    assert (final / "payload").read_text() == "40" and hidden(final) == []
