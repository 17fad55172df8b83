"""`prepare sft`: chat examples to packed blocks whose labels cover exactly the assistant turns."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest
from transformers import AutoTokenizer

from training.cli import main
from training.config.model import IGNORE_INDEX
from training.data.sft import SftOptions, prepare_sft
from training.errors import UserError
from training.local.tiny import BOS, END_OF_TURN, EOS, train_tokenizer, write_jsonl

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "question one"}, {"role": "assistant", "content": "answer one"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "question two"},
        {"role": "assistant", "content": "answer two"},
        {"role": "user", "content": "question three"},
        {"role": "assistant", "content": "answer three"},
    ],
    [{"role": "user", "content": "a question nobody answers"}],
    [{"role": "user", "content": "question four"}, {"role": "assistant", "content": "answer four is longer " * 3}],
]
ANSWERED = [c for c in CONVERSATIONS if any(m["role"] == "assistant" for m in c)]


@pytest.fixture
def chats(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "chats.jsonl", ({"messages": c, "prompt_id": i} for i, c in enumerate(CONVERSATIONS)))


def options(source: Path, tokenizer: Path, out: Path, **changes: Any) -> SftOptions:
    return replace(
        SftOptions(source=str(source), tokenizer=str(tokenizer), seq_len=256, out=out, batch_size=2), **changes
    )


def rows(out: Path, split: str = "train") -> list[tuple[list[int], list[int]]]:
    dataset = datasets.load_from_disk(str(out))[split]
    return [(row["input_ids"], row["labels"]) for row in dataset]


def trained_runs(labels: list[int]) -> list[list[int]]:
    """Maximal runs of consecutive trained positions."""
    runs: list[list[int]] = []
    previous = IGNORE_INDEX
    for label in labels:
        if label != IGNORE_INDEX:
            if previous == IGNORE_INDEX:
                runs.append([])
            runs[-1].append(label)
        previous = label
    return runs


@pytest.mark.parametrize(("fixture", "end_of_turn"), [("llama_tokenizer", EOS), ("chat_tokenizer", END_OF_TURN)])
def test_labels_cover_exactly_the_assistant_turns_and_their_eos(
    fixture: str, end_of_turn: str, chats: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    tokenizer_dir = request.getfixturevalue(fixture)
    manifest = prepare_sft(options(chats, tokenizer_dir, tmp_path / "out"))
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    runs = []
    for input_ids, labels in rows(tmp_path / "out"):
        trained = [(t, label) for t, label in zip(input_ids, labels, strict=True) if label != IGNORE_INDEX]
        assert all(t == label for t, label in trained), "a label differs from its input id"
        runs += trained_runs(labels)
    expected = [m["content"] + end_of_turn for c in ANSWERED for m in c if m["role"] == "assistant"]
    assert [tokenizer.decode(run) for run in runs] == expected
    assert manifest["splits"]["train"]["trained_tokens"] == sum(len(run) for run in runs)


def test_fallback_format_is_mixtral_with_the_system_prompt_folded_in(
    chats: Path, llama_tokenizer: Path, tmp_path: Path
) -> None:
    manifest = prepare_sft(options(chats, llama_tokenizer, tmp_path / "out"))
    assert manifest["chat_template"] == "mixtral-fallback"
    tokenizer = AutoTokenizer.from_pretrained(str(llama_tokenizer))
    text = "".join(tokenizer.decode(ids) for ids, _ in rows(tmp_path / "out"))
    assert (
        f"{BOS}[INST] <<SYS>>\nbe brief\n<</SYS>>\n\nquestion two [/INST]answer two{EOS}"
        f"[INST] question three [/INST]answer three{EOS}"
    ) in text


def test_tokenizer_template_is_used_when_present(chats: Path, chat_tokenizer: Path, tmp_path: Path) -> None:
    manifest = prepare_sft(options(chats, chat_tokenizer, tmp_path / "out"))
    assert manifest["chat_template"] == "tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(str(chat_tokenizer))
    first_ids, _ = rows(tmp_path / "out")[0]
    assert tokenizer.decode(first_ids).startswith(
        f"{BOS}<|start_header_id|>user<|end_header_id|>\n\nquestion one{END_OF_TURN}"
        f"<|start_header_id|>assistant<|end_header_id|>\n\nanswer one{END_OF_TURN}"
    )


def test_examples_are_whole_within_blocks_and_blocks_are_trained(
    chats: Path, llama_tokenizer: Path, tmp_path: Path
) -> None:
    prepare_sft(options(chats, llama_tokenizer, tmp_path / "out", seq_len=40))
    tokenizer = AutoTokenizer.from_pretrained(str(llama_tokenizer))
    for input_ids, labels in rows(tmp_path / "out"):
        assert len(input_ids) == len(labels) == 40
        assert input_ids[0] == tokenizer.bos_token_id, "a block must start with the start of an example"
        assert any(label != IGNORE_INDEX for label in labels)


def test_examples_without_assistant_turn_are_skipped_and_counted(
    chats: Path, llama_tokenizer: Path, tmp_path: Path
) -> None:
    manifest = prepare_sft(options(chats, llama_tokenizer, tmp_path / "out"))
    split = manifest["splits"]["train"]
    assert split["skipped_no_assistant_turn"] == 1
    assert split["examples"] == len(ANSWERED)


def test_long_examples_are_truncated_and_counted(llama_tokenizer: Path, tmp_path: Path) -> None:
    long_answer = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "answer " * 50}]
    source = write_jsonl(tmp_path / "c.jsonl", [{"messages": long_answer}, {"messages": CONVERSATIONS[0]}])
    manifest = prepare_sft(options(source, llama_tokenizer, tmp_path / "out", seq_len=40))
    split = manifest["splits"]["train"]
    assert split["truncated_examples"] == 1
    assert split["blocks"] == 2
    first_ids, first_labels = rows(tmp_path / "out")[0]
    assert len(first_ids) == 40 and first_labels[-1] != IGNORE_INDEX


def test_validation_split_is_kept(chats: Path, llama_tokenizer: Path, tmp_path: Path) -> None:
    validation = write_jsonl(tmp_path / "validation.jsonl", [{"messages": CONVERSATIONS[0]}])
    manifest = prepare_sft(options(chats, llama_tokenizer, tmp_path / "out", validation=str(validation)))
    dataset = datasets.load_from_disk(str(tmp_path / "out"))
    assert sorted(dataset) == ["train", "validation"]
    assert dataset["validation"].num_rows == manifest["splits"]["validation"]["blocks"] == 1
    assert dataset["train"].features["labels"] == datasets.List(datasets.Value("int32"), length=256)
    on_disk = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["kind"] == on_disk["kind"] == "sft"  # what the training job holds against the recipe's kind


def test_output_is_identical_whatever_the_thread_count(chats: Path, llama_tokenizer: Path, tmp_path: Path) -> None:
    prepare_sft(options(chats, llama_tokenizer, tmp_path / "one", num_proc=1))
    prepare_sft(options(chats, llama_tokenizer, tmp_path / "two", num_proc=2, batch_size=3))
    assert rows(tmp_path / "one") == rows(tmp_path / "two")


def test_bad_messages_are_reported_or_skipped(llama_tokenizer: Path, tmp_path: Path) -> None:
    source = write_jsonl(
        tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[0]}, {"messages": [{"role": "robot", "content": "beep"}]}]
    )
    with pytest.raises(UserError, match=r"record 2 has bad 'messages': message 0 has role 'robot'"):
        prepare_sft(options(source, llama_tokenizer, tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    manifest = prepare_sft(options(source, llama_tokenizer, tmp_path / "out", skip_bad_records=True))
    assert manifest["splits"]["train"]["skipped_bad_messages"] == 1


def test_missing_messages_column_is_one_line(
    llama_tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(tmp_path / "c.jsonl", [{"conversation": []}])
    tokenizer = str(llama_tokenizer)
    status = main(
        ["prepare", "sft", "--source", str(source), "--tokenizer", tokenizer, "--output", str(tmp_path / "out")]
    )
    assert status == 2
    assert capsys.readouterr().err == (
        f"error: {source}: line 1: no column 'messages' (found: conversation); choose it with the column option\n"
    )
    assert not (tmp_path / "out").exists()


def test_tokenizer_without_eos_is_rejected(chats: Path, tmp_path: Path) -> None:
    tokenizer = train_tokenizer(tmp_path / "tokenizer", eos=None)
    with pytest.raises(UserError, match="has no EOS token; SFT trains the assistant's EOS"):
        prepare_sft(options(chats, tokenizer, tmp_path / "out"))


def test_no_trained_block_at_all_is_an_error(llama_tokenizer: Path, tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[2]}])
    with pytest.raises(UserError, match="no block with an assistant token"):
        prepare_sft(options(source, llama_tokenizer, tmp_path / "out"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


def test_manifest_counts_match_the_blocks(chats: Path, llama_tokenizer: Path, tmp_path: Path) -> None:
    manifest = prepare_sft(options(chats, llama_tokenizer, tmp_path / "out"))
    ids = np.asarray([ids for ids, _ in rows(tmp_path / "out")])
    labels = np.asarray([labels for _, labels in rows(tmp_path / "out")])
    split = manifest["splits"]["train"]
    assert split["trained_tokens"] == int(np.count_nonzero(labels != IGNORE_INDEX))
    # With the fallback format every EOS that is not padding ends an assistant turn and is trained.
    assert split["padding_tokens"] == int(np.count_nonzero((ids == manifest["pad_id"]) & (labels == IGNORE_INDEX)))
