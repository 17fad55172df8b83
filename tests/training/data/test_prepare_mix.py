"""`prepare` with several sources: mixed by token share, deterministically by seed, with `data_sha256`."""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest
from transformers import AutoTokenizer

from training.cli import main
from training.config.model import IGNORE_INDEX
from training.config.recipe import load_recipe
from training.data.mixing import MixSource, mix
from training.data.prepared import data_sha256
from training.data.pretrain import PretrainOptions, prepare_pretrain
from training.data.sft import SftOptions, prepare_sft
from training.errors import UserError
from training.local.tiny import sample_documents, write_jsonl

BIG = sample_documents(300, seed=1)
SMALL = sample_documents(40, seed=2)


@pytest.fixture
def corpora(tmp_path: Path) -> tuple[Path, Path]:
    big = write_jsonl(tmp_path / "big.jsonl", ({"text": d} for d in BIG))
    small = write_jsonl(tmp_path / "small.jsonl", ({"text": d} for d in SMALL))
    return big, small


def pretrain(tokenizer: Path, out: Path, *mix: MixSource, **changes: Any) -> PretrainOptions:
    base = PretrainOptions(source="unused", tokenizer=str(tokenizer), seq_len=64, out=out, batch_size=16, mix=mix)
    return replace(base, **changes)


def arrow_bytes(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*.arrow"))}


def column(out: Path, name: str, split: str | None = None) -> np.ndarray:
    """A stored int32 column as `[rows, seq_len]`, read from its Arrow table."""
    dataset = datasets.load_from_disk(str(out))
    table = (dataset[split] if split else dataset).data.table.column(name).combine_chunks()
    return table.flatten().to_numpy().reshape(-1, table.type.list_size)


def framed(tokenizer: Path, documents: list[str]) -> list[tuple[int, ...]]:
    """Each document as the stream holds it, BOS ... EOS, tokenized independently of `prepare`."""
    loaded = AutoTokenizer.from_pretrained(str(tokenizer))
    return [(loaded.bos_token_id, *loaded.encode(d, add_special_tokens=False), loaded.eos_token_id) for d in documents]


def test_a_mix_is_byte_identical_twice_and_another_seed_interleaves_otherwise(
    corpora: tuple[Path, Path], llama_tokenizer: Path, tmp_path: Path
) -> None:
    big, small = corpora
    mix = (MixSource(str(big), weight=3.0), MixSource(str(small), weight=1.0))
    first = prepare_pretrain(pretrain(llama_tokenizer, tmp_path / "one", *mix, seed=7))
    second = prepare_pretrain(pretrain(llama_tokenizer, tmp_path / "two", *mix, seed=7))
    other = prepare_pretrain(pretrain(llama_tokenizer, tmp_path / "other", *mix, seed=8))
    assert arrow_bytes(tmp_path / "one") == arrow_bytes(tmp_path / "two")
    assert first["data_sha256"] == second["data_sha256"] == data_sha256(tmp_path / "one")
    assert (tmp_path / "one" / "state.json").read_text() != (tmp_path / "two" / "state.json").read_text()
    assert arrow_bytes(tmp_path / "one") != arrow_bytes(tmp_path / "other")
    assert other["data_sha256"] != first["data_sha256"]
    assert other["mix"]["seed"] == 8 and first["mix"]["seed"] == 7


def test_the_stream_interleaves_whole_documents_each_source_in_order(
    corpora: tuple[Path, Path], llama_tokenizer: Path, tmp_path: Path
) -> None:
    big, small = corpora
    mix = (MixSource(str(big), weight=1.0), MixSource(str(small), weight=1.0))
    manifest = prepare_pretrain(pretrain(llama_tokenizer, tmp_path / "out", *mix))
    stream = column(tmp_path / "out", "input_ids").ravel().tolist()
    queues = [framed(llama_tokenizer, BIG), framed(llama_tokenizer, SMALL)]
    taken = [0, 0]
    position = 0
    while position < len(stream):  # each next document is the next one of one of the sources
        matches = [
            i for i, queue in enumerate(queues) if taken[i] < len(queue) and _starts(stream, position, queue[taken[i]])
        ]
        assert matches, f"no source's next document at token {position}"
        taken[matches[0]] += 1
        position += len(queues[matches[0]][taken[matches[0]] - 1])
    assert taken == [s["documents"] for s in manifest["sources"]]
    assert taken[1] == len(SMALL) and 0 < taken[0] < len(BIG)  # the small source ended the mix


def _starts(stream: list[int], position: int, document: tuple[int, ...]) -> bool:
    """`document` is at `position` (or its beginning is, where the final partial block was dropped)."""
    window = stream[position : position + len(document)]
    return window == list(document[: len(window)])


def test_realised_token_shares_are_the_weights_up_to_one_document_per_source(
    corpora: tuple[Path, Path], llama_tokenizer: Path, tmp_path: Path
) -> None:
    big, small = corpora
    mix = (MixSource(str(big), weight=1.0), MixSource(str(small), weight=3.0))
    manifest = prepare_pretrain(pretrain(llama_tokenizer, tmp_path / "out", *mix))
    first, second = manifest["sources"]
    # The mixer's bound: each source's tokens per unit of weight differ from another's by at most the two sources'
    # longest documents per unit of weight (a key never exceeds the share after its document).
    longest = [max(map(len, framed(llama_tokenizer, docs))) for docs in (BIG, SMALL)]
    assert abs(first["tokens"] / 1.0 - second["tokens"] / 3.0) <= longest[0] / 1.0 + longest[1] / 3.0
    assert first["target_share"] == 0.25 and second["target_share"] == 0.75
    # In shares: about 200 tokens of one document against ~6,000 in all, so within 0.05 of the weights.
    assert abs(first["token_share"] - 0.25) < 0.05 and abs(second["token_share"] - 0.75) < 0.05
    assert first["tokens"] + second["tokens"] == manifest["tokens"]
    assert first["documents"] + second["documents"] == manifest["documents"]
    assert manifest["mix"] == {
        "seed": 0,
        "weights_are": "token shares",
        "ended_by": str(small),
        "end_reason": "exhausted",
    }
    assert manifest["source"] == f"{big}, {small}"


def test_a_source_limit_ends_the_mix_at_that_source(
    corpora: tuple[Path, Path], llama_tokenizer: Path, tmp_path: Path
) -> None:
    big, small = corpora
    mix = (MixSource(str(big), weight=1.0, limit=25), MixSource(str(small), weight=1.0))
    manifest = prepare_pretrain(pretrain(llama_tokenizer, tmp_path / "out", *mix))
    limited, other = manifest["sources"]
    assert limited["documents"] == 25 and limited["max_documents"] == 25
    assert other["documents"] < len(SMALL) and other["max_documents"] is None
    assert manifest["mix"]["ended_by"] == str(big) and manifest["mix"]["end_reason"] == "max_documents"


def test_a_mix_of_one_source_is_the_single_source_path(
    corpora: tuple[Path, Path], llama_tokenizer: Path, tmp_path: Path
) -> None:
    big, _ = corpora
    plain = prepare_pretrain(pretrain(llama_tokenizer, tmp_path / "plain", source=str(big), max_documents=50))
    one = prepare_pretrain(pretrain(llama_tokenizer, tmp_path / "one", MixSource(str(big), weight=2.0, limit=50)))
    assert arrow_bytes(tmp_path / "plain") == arrow_bytes(tmp_path / "one")
    assert {k: v for k, v in one.items() if k != "elapsed_seconds"} == {
        k: v for k, v in plain.items() if k != "elapsed_seconds"
    }
    assert "sources" not in one and "mix" not in one
    again = prepare_pretrain(pretrain(llama_tokenizer, tmp_path / "one", source=str(big), max_documents=50))
    assert again["reused"] is True


def test_an_output_without_data_sha256_gains_it_when_reused(
    corpora: tuple[Path, Path], llama_tokenizer: Path, tmp_path: Path
) -> None:
    big, _ = corpora
    options = pretrain(llama_tokenizer, tmp_path / "out", source=str(big))
    made = prepare_pretrain(options)
    manifest_path = tmp_path / "out" / "manifest.json"
    older = {k: v for k, v in json.loads(manifest_path.read_text()).items() if k != "data_sha256"}
    manifest_path.write_text(json.dumps(older))  # as an earlier version wrote it
    reused = prepare_pretrain(options)
    assert reused["reused"] and reused["data_sha256"] == made["data_sha256"]
    assert json.loads(manifest_path.read_text())["data_sha256"] == made["data_sha256"]


def test_data_sha256_follows_the_data(corpora: tuple[Path, Path], llama_tokenizer: Path, tmp_path: Path) -> None:
    big, _ = corpora
    one = prepare_pretrain(pretrain(llama_tokenizer, tmp_path / "a", source=str(big)))
    two = prepare_pretrain(pretrain(llama_tokenizer, tmp_path / "b", source=str(big)))
    fewer = prepare_pretrain(pretrain(llama_tokenizer, tmp_path / "c", source=str(big), max_documents=100))
    assert one["data_sha256"] == two["data_sha256"] != fewer["data_sha256"]


# --- SFT ------------------------------------------------------------------------------------------------------


def chat(topic: str, index: int) -> dict[str, Any]:
    answer = f"{topic} answer {index} " + "more words " * (index % 5)
    question = {"role": "user", "content": f"{topic} question {index}"}
    return {"messages": [question, {"role": "assistant", "content": answer}]}


@pytest.fixture
def chat_sets(tmp_path: Path) -> dict[str, Path]:
    return {
        name: write_jsonl(tmp_path / f"{name}.jsonl", (chat(name, i) for i in range(count)))
        for name, count in (("alpha", 60), ("beta", 30), ("alpha-val", 4), ("beta-val", 3))
    }


def sft(tokenizer: Path, out: Path, *mix: MixSource, **changes: Any) -> SftOptions:
    base = SftOptions(source="unused", tokenizer=str(tokenizer), seq_len=128, out=out, batch_size=8, mix=mix)
    return replace(base, **changes)


def test_sft_mixes_chat_sets_by_token_share_with_each_validation_set_whole(
    chat_sets: dict[str, Path], chat_tokenizer: Path, tmp_path: Path
) -> None:
    mix = (
        MixSource(str(chat_sets["alpha"]), weight=1.0, validation=str(chat_sets["alpha-val"])),
        MixSource(str(chat_sets["beta"]), weight=1.0, validation=str(chat_sets["beta-val"])),
    )
    manifest = prepare_sft(sft(chat_tokenizer, tmp_path / "one", *mix, seed=3))
    again = prepare_sft(sft(chat_tokenizer, tmp_path / "two", *mix, seed=3))
    other = prepare_sft(sft(chat_tokenizer, tmp_path / "other", *mix, seed=4))
    assert manifest["data_sha256"] == again["data_sha256"] != other["data_sha256"]
    assert arrow_bytes(tmp_path / "one") == arrow_bytes(tmp_path / "two")
    alpha, beta = manifest["sources"]
    assert beta["examples"] == 30 and alpha["examples"] < 60  # beta runs out first and ends the mix
    assert manifest["mix"]["ended_by"] == str(chat_sets["beta"])
    assert abs(alpha["token_share"] - 0.5) < 0.05  # one example is ~20 tokens of ~1,300
    assert manifest["splits"]["train"]["examples"] == alpha["examples"] + beta["examples"]
    validation = manifest["splits"]["validation"]
    assert [s["examples"] for s in validation["sources"]] == [4, 3] and validation["examples"] == 7
    trained = column(tmp_path / "one", "labels", "train")
    assert np.count_nonzero(trained != IGNORE_INDEX) == manifest["splits"]["train"]["trained_tokens"]


def test_sft_mix_of_one_is_the_single_source_path(
    chat_sets: dict[str, Path], chat_tokenizer: Path, tmp_path: Path
) -> None:
    plain = prepare_sft(
        sft(chat_tokenizer, tmp_path / "plain", source=str(chat_sets["alpha"]), validation=str(chat_sets["alpha-val"]))
    )
    alone = MixSource(str(chat_sets["alpha"]), validation=str(chat_sets["alpha-val"]))
    one = prepare_sft(sft(chat_tokenizer, tmp_path / "one", alone))
    assert arrow_bytes(tmp_path / "plain") == arrow_bytes(tmp_path / "one")
    assert one["fingerprint"] == plain["fingerprint"] and one["data_sha256"] == plain["data_sha256"]


# --- the command line and the recipe --------------------------------------------------------------------------


def cli(arguments: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        status = main(arguments)
    except SystemExit as exit:  # argparse's refusals end the process, as for any option it rejects
        status = int(exit.code or 0)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_the_command_line_mix_is_the_api_mix(
    corpora: tuple[Path, Path], llama_tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    big, small = corpora
    command = ["prepare", "pretrain", "--tokenizer", str(llama_tokenizer), "--seq-len", "64", "--seed", "5"]
    command += ["--max-documents", "30", "--source", str(big), "--weight", "3", "--max-documents", "200"]
    command += ["--source", str(small), "--weight", "1", "--output", str(tmp_path / "cli")]
    status, out, _ = cli(command, capsys)
    assert status == 0
    mix = (MixSource(str(big), weight=3.0, limit=200), MixSource(str(small), weight=1.0, limit=30))
    api = prepare_pretrain(pretrain(llama_tokenizer, tmp_path / "api", *mix, seed=5))
    assert json.loads(out)["data_sha256"] == api["data_sha256"]
    assert [s["max_documents"] for s in api["sources"]] == [200, 30]


@pytest.mark.parametrize(
    ("middle", "message"),
    [
        (["--source", "BIG", "--weight", "0", "--source", "SMALL", "--weight", "1"], "--weight 0.0 of --source BIG"),
        (["--source", "BIG", "--weight", "-2", "--source", "SMALL", "--weight", "1"], "--weight -2.0 of --source BIG"),
        (["--source", "BIG", "--weight", "nan", "--source", "SMALL", "--weight", "1"], "--weight nan of --source BIG"),
        (["--weight", "2", "--source", "BIG"], "a weight without a source"),
        (["--source", "BIG", "--weight", "1", "--weight", "2"], "argument --weight: given twice for --source BIG"),
        (["--source", "BIG", "--weight", "1", "--source", "SMALL"], "--source SMALL: has no --weight"),
        (["--source", "BIG", "--source", "BIG"], "--source BIG: given twice"),
        (["--source", "BIG", "--source", "MISSING"], "--source MISSING: no such file or directory"),
        (["--source", "BIG", "--max-documents", "0", "--source", "SMALL"], "--max-documents 0 of --source BIG"),
        (["--source", "BIG", "--source", "SMALL", "--seed", "-1"], "--seed -1: must be 0 or more"),
    ],
    ids=["zero", "negative", "nan", "no-source", "twice", "unweighted", "duplicate", "unknown", "limit", "seed"],
)
def test_bad_mixes_are_one_line_and_leave_nothing(
    middle: list[str],
    message: str,
    corpora: tuple[Path, Path],
    llama_tokenizer: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    big, small = corpora
    names = {"BIG": str(big), "SMALL": str(small), "MISSING": str(tmp_path / "missing.jsonl")}
    middle = [names.get(word, word) for word in middle]
    for name, path in names.items():
        message = message.replace(name, path)
    out = tmp_path / "out"
    command = ["prepare", "pretrain", "--tokenizer", str(llama_tokenizer), *middle, "--output", str(out)]
    status, printed, error = cli(command, capsys)
    assert status == 2 and not printed
    assert error.startswith("error: ") and message in error and error.count("\n") == 1, error
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_an_empty_source_of_a_mix_is_named(corpora: tuple[Path, Path], llama_tokenizer: Path, tmp_path: Path) -> None:
    big, _ = corpora
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(UserError, match=f"--source {empty}: the corpus is empty"):
        prepare_pretrain(pretrain(llama_tokenizer, tmp_path / "out", MixSource(str(big)), MixSource(str(empty))))
    assert not (tmp_path / "out").exists()


def tiny_recipe(*overrides: str) -> Any:
    return load_recipe("tiny-llama-cpt", list(overrides))


def test_the_recipe_takes_one_source_or_a_mix(tmp_path: Path) -> None:
    both = "prepare.sources=[{source: a.jsonl, weight: 1}]"
    with pytest.raises(UserError, match=re.escape("prepare.source: 'both' is not allowed; allowed: exactly one of")):
        tiny_recipe(both)
    with pytest.raises(UserError, match=re.escape("prepare.source: 'neither' is not allowed")):
        tiny_recipe("prepare.source=")
    with pytest.raises(UserError, match=r"prepare.sources\[1\].source: 'a' is not allowed; allowed: a source not"):
        tiny_recipe("prepare.source=", "prepare.sources=[{source: a, weight: 1}, {source: a, weight: 2}]")
    with pytest.raises(
        UserError, match=r"prepare.sources\[0\].weight: 0 is not allowed; allowed: a finite number above 0\Z"
    ):
        tiny_recipe("prepare.source=", "prepare.sources=[{source: a, weight: 0}]")
    with pytest.raises(UserError, match=re.escape("prepare.validation: 'test' is not allowed")):
        tiny_recipe("prepare.source=", both, "prepare.validation=test")


# --- the mixer on its own -------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_mixer_keeps_every_source_within_one_item_of_its_weight_at_every_point(seed: int) -> None:
    import random

    rng = random.Random(100 + seed)
    streams = [[rng.randint(1, 50) for _ in range(count)] for count in (400, 300, 500)]
    weights = [1.0, 2.5, 0.5]
    mixed, stats = mix(streams, weights, tokens_of=lambda length: length, seed=seed)
    taken = [0, 0, 0]
    order = []
    for index, length in mixed:
        taken[index] += length
        order.append(index)
        # The bound the key gives (training.data.mixing): source i ahead of j by at most one item of each.
        for i, j in itertools.permutations(range(3), 2):
            assert taken[i] / weights[i] - taken[j] / weights[j] <= 50 / weights[i] + 50 / weights[j]
    assert taken == stats.tokens and stats.items == [order.count(i) for i in range(3)]
    assert stats.ended_by is not None and stats.items[stats.ended_by] == len(streams[stats.ended_by])
    again, _ = mix(streams, weights, tokens_of=lambda length: length, seed=seed)
    other, _ = mix(streams, weights, tokens_of=lambda length: length, seed=seed + 10)
    assert [i for i, _ in again] == order != [i for i, _ in other]


def test_the_mixer_keeps_each_source_in_its_own_order() -> None:
    streams = [[("a", n) for n in range(20)], [("b", n) for n in range(20)]]
    mixed, _ = mix(streams, [1.0, 1.0], tokens_of=lambda item: 3, seed=5)
    items = [item for _, item in mixed]
    for name in "ab":
        numbers = [n for source, n in items if source == name]
        assert numbers == list(range(len(numbers)))


# --- SFT on the command line ----------------------------------------------------------------------------------


def test_the_sft_command_line_gives_each_chat_set_its_own_validation(
    chat_sets: dict[str, Path], chat_tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    command = ["prepare", "sft", "--tokenizer", str(chat_tokenizer), "--seq-len", "128", "--seed", "3"]
    command += ["--source", str(chat_sets["alpha"]), "--weight", "1", "--validation", str(chat_sets["alpha-val"])]
    command += ["--source", str(chat_sets["beta"]), "--weight", "1", "--validation", str(chat_sets["beta-val"])]
    status, out, _ = cli([*command, "--output", str(tmp_path / "cli")], capsys)
    assert status == 0
    mix_sources = (
        MixSource(str(chat_sets["alpha"]), validation=str(chat_sets["alpha-val"])),
        MixSource(str(chat_sets["beta"]), validation=str(chat_sets["beta-val"])),
    )
    api = prepare_sft(sft(chat_tokenizer, tmp_path / "api", *mix_sources, seed=3, batch_size=256))
    assert json.loads(out)["data_sha256"] == api["data_sha256"]
    assert json.loads(out)["splits"]["validation"]["examples"] == 7


def test_a_validation_file_before_the_first_source_of_a_local_mix_is_refused(
    chat_sets: dict[str, Path], chat_tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    command = ["prepare", "sft", "--tokenizer", str(chat_tokenizer), "--validation", str(chat_sets["alpha-val"])]
    command += ["--source", str(chat_sets["alpha"]), "--source", str(chat_sets["beta"]), "--output", str(out)]
    status, printed, error = cli(command, capsys)
    assert status == 2 and not printed and error.count("\n") == 1
    assert error.startswith(f"error: --validation {chat_sets['alpha-val']}: before the first --source it would be")
    assert not out.exists()


def test_an_unknown_hub_dataset_in_a_mix_is_one_line(
    corpora: tuple[Path, Path],
    llama_tokenizer: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import huggingface_hub

    # As in test_prepare_pretrain: the libraries read HF_HUB_OFFLINE at import, so their constants are set too.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    big, _ = corpora
    out = tmp_path / "out"
    command = ["prepare", "pretrain", "--tokenizer", str(llama_tokenizer), "--source", str(big)]
    command += ["--source", "no-such-org/no-such-corpus", "--split", "dev", "--output", str(out)]
    status, printed, error = cli(command, capsys)
    assert status == 2 and not printed and error.count("\n") == 1
    assert error.startswith("error: --source no-such-org/no-such-corpus: cannot load dataset split 'dev' ")
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
