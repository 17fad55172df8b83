"""Bad inputs to `python -m training` as a new user (or someone probing it) gives them: each ends in exactly one
`error:` line naming the input and what is allowed, exit status 2, and nothing left behind (no output, no
temporary sibling, no checkpoint directory). Malformed checkpoints and safetensors are in
tests/training/properties/test_untrusted_files.py, settings out of range in
tests/training/properties/test_setting_ranges.py, the environment file in tests/infra/test_config.py."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from training.cli import main
from training.data.sft import SftOptions, prepare_sft
from training.local.tiny import build_tiny_world, write_jsonl

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)

LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ (DEBUG|INFO|WARNING|ERROR) ")  # training.logs


@dataclass(frozen=True)
class Bad:
    """A command line (`{world}` and `{tmp}` are filled in) and a fragment its one error line must hold."""

    argv: str
    says: str


def prepare(kind: str, extra: str) -> str:
    return (
        f"prepare {kind} --source {{world}}/corpus.jsonl --tokenizer {{world}}/tokenizer --output {{tmp}}/out {extra}"
    )


def train(extra: str) -> str:
    world = "model.config={world}/hf model.pretrained={world}/pretrained_weight data.path={world}/data"
    return f"train --recipe tiny-llama-cpt {world} checkpoint.dir={{tmp}}/checkpoints parallelism.tp=1 {extra}"


SITE = "--site {tmp}/site.yaml"

CASES: dict[str, Bad] = {
    # argparse's own complaints, as one line
    "no command": Bad("", "the following arguments are required: COMMAND"),
    "unknown command": Bad("fly", "invalid choice: 'fly'"),
    "unknown prepare kind": Bad("prepare poems --output {tmp}/out", "invalid choice: 'poems'"),
    "missing --tokenizer": Bad("prepare pretrain --output {tmp}/out", "the following arguments are required"),
    "--seq-len not a number": Bad(prepare("pretrain", "--seq-len many"), "argument --seq-len: invalid int value"),
    "unknown option": Bad(prepare("pretrain", "--colour red"), "unrecognized arguments: --colour red"),
    "plan on an unknown instance": Bad("plan --recipe tiny-llama-cpt --instance-type p5.48xlarge", "invalid choice"),
    # prepare
    "--seq-len 0": Bad(prepare("pretrain", "--seq-len 0"), "--seq-len 0: must be at least 2"),
    "--seq-len -5": Bad(prepare("sft", "--seq-len -5"), "--seq-len -5: must be at least 2"),
    "--seq-len absurd": Bad(prepare("pretrain", "--seq-len 1000000000000"), "allowed: 2 to 1048576 tokens"),
    "--num-proc 0": Bad(prepare("pretrain", "--num-proc 0"), "--num-proc 0: must be at least 1"),
    "output below a regular file": Bad(
        "prepare pretrain --source {world}/corpus.jsonl --tokenizer {world}/tokenizer --output {tmp}/a-file/out",
        "allowed: a path whose parents are directories, not files",
    ),
    "output is a foreign directory": Bad(
        "prepare pretrain --source {world}/corpus.jsonl --tokenizer {world}/tokenizer --output {tmp}/foreign",
        "was not written by this tool",
    ),
    "tokenizer directory missing": Bad(
        "prepare pretrain --source {world}/corpus.jsonl --tokenizer {tmp}/nothing --output {tmp}/out",
        "--tokenizer {tmp}/nothing: no such directory",
    ),
    "source file missing": Bad(
        "prepare sft --source {tmp}/nothing.jsonl --tokenizer {world}/tokenizer --output {tmp}/out",
        "no such file or directory",
    ),
    "source empty": Bad(
        "prepare pretrain --source {tmp}/empty.jsonl --tokenizer {world}/tokenizer --output {tmp}/out",
        "the corpus is empty",
    ),
    "source not JSON": Bad(
        "prepare sft --source {tmp}/not-json.jsonl --tokenizer {world}/tokenizer --output {tmp}/out",
        "not valid JSON",
    ),
    "source not UTF-8": Bad(
        "prepare pretrain --source {tmp}/latin1.jsonl --tokenizer {world}/tokenizer --output {tmp}/out",
        "not valid UTF-8",
    ),
    "sft source without messages": Bad(prepare("sft", "--seq-len 64"), "no column 'messages'"),
    # train (before any process group or checkpoint exists)
    "recipe unknown": Bad("train --recipe gpt-5", "allowed: a recipe file or a bundled recipe"),
    "override without =": Bad(train("steps"), "allowed: section.key=value"),
    "override of an unknown key": Bad(train("optimizer.momentum=0.9"), "optimizer.momentum: unknown key"),
    "backend unknown": Bad(train("backend=gpu"), "backend: 'gpu' is not allowed; allowed: cpu, neuron, torch-native"),
    "steps not a number": Bad(train("steps=ten"), "steps: 'ten' is not allowed; allowed: an integer"),
    "checkpoint.dir is a file": Bad(
        "train --recipe tiny-llama-cpt model.config={world}/hf model.pretrained= data.path={world}/data "
        "checkpoint.dir={tmp}/a-file parallelism.tp=1",
        "checkpoint.dir {tmp}/a-file: is a file",
    ),
    "data.path missing": Bad(train("data.path={tmp}/no-data"), "data.path {tmp}/no-data: no such directory"),
    "model.config missing": Bad(train("model.config={tmp}/no-model"), "model.config {tmp}/no-model: no such"),
    "pretrained missing": Bad(train("model.pretrained={tmp}/no-weights"), "model.pretrained {tmp}/no-weights"),
    "tp beyond the launched processes": Bad(train("parallelism.tp=2"), "does not divide the 1 launched processes"),
    "seq_len unlike the data's": Bad(
        train("batch.seq_len=128"), "batch.seq_len 128 differs from the data's seq_len 64"
    ),
    "sft data for a pretraining recipe": Bad(
        train("data.path={world}/sft-data"), "but the recipe trains on pretrain data (prepare.kind pretrain)"
    ),
    "pretraining data for data.kind sft": Bad(
        train("data.kind=sft"), "holds `prepare pretrain` data, but the recipe trains on sft data (data.kind sft)"
    ),
    "data.kind not a kind": Bad(train("data.kind=chat"), "data.kind: 'chat' is not allowed; allowed: pretrain, sft"),
    "global batch beyond the data's blocks": Bad(train("batch.global=4096"), "batch.global: 4096 is not allowed"),
    "validation beyond its split's blocks": Bad(
        train("data.validation_split=train data.validation_every=2 data.validation_batches=4096"),
        "data.validation_batches: 4096 is not allowed",
    ),
    # plan
    "plan of an unknown model": Bad(
        "plan --recipe tiny-llama-cpt model.config={tmp}/My-Model", "{tmp}/My-Model: no config.json there"
    ),
    # submit, status, cancel and the site file
    "submit an unknown recipe": Bad(f"submit --recipe nope --dry-run {SITE}", "allowed: a recipe file"),
    "submit with a malformed override": Bad(f"submit --recipe tiny-llama-cpt --dry-run steps {SITE}", "key=value"),
    "submit with data.kind unlike prepare.kind": Bad(
        f"submit --recipe tiny-llama-cpt --dry-run data.kind=sft {SITE}",
        "data.kind: 'sft' is not allowed; allowed: pretrain as prepare.kind",
    ),
    "submit of sft data for data.kind pretrain": Bad(
        f"submit --recipe tiny-llama-cpt --dry-run prepare= data.path={{world}}/sft-data data.kind=pretrain {SITE}",
        "but the recipe trains on pretrain data (data.kind pretrain)",
    ),
    "submit with a run id with a space": Bad(
        f"submit --recipe tiny-llama-cpt --dry-run --run-id a&b {SITE}", "--run-id 'a&b'"
    ),
    "site file missing": Bad("status --site {tmp}/no-site.yaml", "{tmp}/no-site.yaml: cannot read"),
    "site file not YAML": Bad("status --site {tmp}/broken.yaml", "{tmp}/broken.yaml: not valid YAML"),
    "site file not UTF-8": Bad("status --site {tmp}/latin1.yaml", "{tmp}/latin1.yaml: not UTF-8 text"),
    "site file with a key twice": Bad("status --site {tmp}/twice.yaml", "runs_root: appears twice (lines 1 and 2)"),
    "site file with a stray colon": Bad(
        "status --site {tmp}/stray-colon.yaml", "mapping values are not allowed here at line 1, column 16"
    ),
    "status of a run outside runs_root": Bad(f"status --run-id .. {SITE}", "--run-id '..'"),
    "cancel of a path instead of a run": Bad(f"cancel --run-id ../../etc {SITE}", "--run-id '../../etc'"),
    "validation split the data lacks": Bad(
        train("data.validation_split=validation data.validation_every=2"), "data.validation_split: 'validation'"
    ),
    "a split the data lacks": Bad(train("data.split=test"), "data.split: 'test' is not allowed"),
    "learning rate not a number": Bad(train("optimizer.lr=.nan"), "optimizer.lr"),
    "learning rate infinite": Bad(train("optimizer.lr=.inf"), "optimizer.lr"),
    "recipe file not YAML": Bad("train --recipe {tmp}/broken.yaml", "{tmp}/broken.yaml: not valid YAML"),
    "recipe file not UTF-8": Bad("train --recipe {tmp}/latin1.yaml", "{tmp}/latin1.yaml: not UTF-8 text"),
    "recipe file whose aliases explode": Bad(
        "train --recipe {tmp}/aliases.yaml", "{tmp}/aliases.yaml: anchors and aliases expand to more than 10,000"
    ),
    "site file whose aliases explode": Bad(
        "status --site {tmp}/aliases.yaml", "{tmp}/aliases.yaml: anchors and aliases expand to more than 10,000"
    ),
    "site file with an unknown key": Bad("status --site {tmp}/unknown-key.yaml", "colour: unknown key"),
    "site file with a wrong type": Bad("status --site {tmp}/wrong-type.yaml", "python: 3 is not allowed"),
    "site file not a mapping": Bad("status --site {tmp}/list.yaml", "top level must be a mapping"),
    "status of an unknown run": Bad(f"status --run-id nope {SITE}", "no run.json"),
    "cancel of an unknown run": Bad(f"cancel --run-id nope {SITE}", "no run.json"),
    "status without any run": Bad(f"status {SITE}", "no runs under"),
    # sample and export
    "sample from a missing model": Bad(
        "sample --recipe tiny-llama-cpt --input {tmp}/no-model --output {tmp}/out", "not a Hugging Face model"
    ),
    "export of a missing run": Bad("export --run-dir {tmp}/no-run --output {tmp}/out", "no run.json"),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bad-inputs")
    build_tiny_world(root, "llama", tp=1)
    # `prepare sft` data for the same model: 64 short chats to train on, one (a single block) to validate on.
    chats = [
        [{"role": "user", "content": f"question {n}"}, {"role": "assistant", "content": f"answer {n}"}]
        for n in range(64)
    ]
    source = write_jsonl(root / "chats.jsonl", ({"messages": c} for c in chats))
    one = write_jsonl(root / "one-chat.jsonl", [{"messages": chats[0]}])
    tokenizer = str(root / "tokenizer")
    prepare_sft(SftOptions(str(source), tokenizer, seq_len=64, out=root / "sft-data", validation=str(one)))
    return root


def populate(tmp: Path) -> None:
    """The bad files and paths the cases name."""
    (tmp / "a-file").write_text("a regular file\n")
    (tmp / "foreign").mkdir()
    (tmp / "foreign" / "notes.txt").write_text("someone else's\n")
    (tmp / "empty.jsonl").write_text("")
    (tmp / "not-json.jsonl").write_text('{"messages": [}\n')
    (tmp / "latin1.jsonl").write_bytes('{"text": "caf\xe9"}\n'.encode("latin-1"))
    (tmp / "site.yaml").write_text(f"runs_root: {tmp / 'runs'}\n")
    (tmp / "broken.yaml").write_text("runs_root: [unclosed\n")
    (tmp / "latin1.yaml").write_bytes("name: caf\xe9\n".encode("latin-1"))
    (tmp / "unknown-key.yaml").write_text("colour: red\n")
    (tmp / "wrong-type.yaml").write_text("python: 3\n")
    (tmp / "list.yaml").write_text("- a\n- b\n")
    (tmp / "twice.yaml").write_text("runs_root: a\nruns_root: b\n")
    (tmp / "stray-colon.yaml").write_text("python: python3: -u\n")
    # Ten aliases of ten, five levels deep: 10^5 values from five lines.
    (tmp / "aliases.yaml").write_text(
        "".join(f"x{n}: &x{n} [{', '.join([f'*x{n - 1}' if n else 'v'] * 10)}]\n" for n in range(5))
    )


def tree(root: Path) -> set[str]:
    return {str(path.relative_to(root)) for path in root.rglob("*")}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_and_leaves_nothing(
    name: str, world: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    case = CASES[name]
    populate(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = tree(tmp_path)
    argv = case.argv.format(world=world, tmp=tmp_path).split()
    status = run(argv)
    error = capsys.readouterr().err
    lines = [line for line in error.splitlines() if line.strip() and not LOG_LINE.match(line)]
    assert len(lines) == 1, error
    assert lines[0].startswith("error: ") and case.says.format(tmp=tmp_path) in lines[0], lines[0]
    assert status == 2
    assert tree(tmp_path) == before, tree(tmp_path) ^ before


def run(argv: list[str]) -> int:
    """The CLI's exit status: returned by `main`, or argparse's own exit."""
    try:
        return main(argv)
    except SystemExit as exit:
        return int(exit.code or 0)


def blocks(data: Path, split: str = "train") -> int:
    """The blocks `prepare` recorded for a split (pretraining data is one split)."""
    manifest = json.loads((data / "manifest.json").read_text())
    return int(manifest["blocks"] if manifest["kind"] == "pretrain" else manifest["splits"][split]["blocks"])


def test_data_unfit_for_the_recipe_is_named_in_one_exact_line(
    world: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Data of the other kind, and a step or a validation needing more blocks than the split has, are refused
    before any process group exists: the line names data.path, the key, what was found and what is allowed."""
    monkeypatch.chdir(tmp_path)
    pretrain, sft = world / "data", world / "sft-data"
    rows, validation_rows = blocks(pretrain), blocks(sft, "validation")
    pairs = rows // 2 + 1  # micro batches of 2 that take more than the rows
    assert validation_rows < 2  # below one validation micro batch of 2
    validate = "data.validation_every=2 data.validation_split={split}"
    cases = {
        "data.path={world}/sft-data": (
            f"data.path {sft}: holds `prepare sft` data, but the recipe trains on pretrain data (prepare.kind "
            "pretrain); allowed: data made by `prepare pretrain`, or set data.kind to sft to train on sft data on "
            "purpose"
        ),
        "prepare.kind=sft": (
            f"data.path {pretrain}: holds `prepare pretrain` data, but the recipe trains on sft data (prepare.kind "
            "sft); allowed: data made by `prepare sft`, or set data.kind to pretrain to train on pretrain data on "
            "purpose"
        ),
        f"batch.global={2 * pairs}": (
            f"batch.global: {2 * pairs} is not allowed; allowed: at most the {rows} sequences of 64 tokens "
            f"(batch.seq_len) in the train split of data.path {pretrain}, so that no step takes a block twice; or "
            "prepare more data"
        ),
        validate.format(split="train") + f" data.validation_batches={pairs}": (
            f"data.validation_batches: {pairs} is not allowed; allowed: at most {rows // 2}: each takes "
            f"batch.micro 2 x 1 data-parallel ranks = 2 of the {rows} sequences of the train split of data.path "
            f"{pretrain}, and a validation reads each block once"
        ),
        "data.path={world}/sft-data data.kind=sft " + validate.format(split="validation"): (
            "data.validation_split: 'validation' is not allowed; allowed: a split of at least batch.micro 2 x 1 "
            f"data-parallel ranks = 2 sequences; the {validation_rows} sequences of the validation split of "
            f"data.path {sft} are fewer"
        ),
    }
    for overrides, expected in cases.items():
        status = run(train(overrides).format(world=world, tmp=tmp_path).split())
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not LOG_LINE.match(line)]
        assert (status, lines) == (2, [f"error: {expected}"]), overrides
    assert not (tmp_path / "checkpoints").exists()


def test_data_kind_trains_on_data_of_the_other_kind_on_purpose(
    world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Continued pretraining on SFT blocks: `data.kind: sft` says so, and the run and its submission go ahead."""
    monkeypatch.chdir(tmp_path)
    populate(tmp_path)
    on_purpose = "data.path={world}/sft-data data.kind=sft"
    assert run(train(f"{on_purpose} steps=2").format(world=world, tmp=tmp_path).split()) == 0
    assert (tmp_path / "checkpoints").is_dir()
    submit = f"submit --recipe tiny-llama-cpt --dry-run prepare= {on_purpose} {SITE}"
    assert run(submit.format(world=world, tmp=tmp_path).split()) == 0
