"""`prepare pretrain` end to end on corpora written by the tests, with a tokenizer trained by the tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as parquet
import pytest
from transformers import AutoTokenizer

from tests.support.repository import ROOT
from training import outputs
from training.cli import main
from training.data.pretrain import PretrainOptions, prepare_pretrain
from training.errors import UserError
from training.local.tiny import sample_documents, train_tokenizer, write_jsonl

DOCUMENTS = sample_documents(120)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "corpus.jsonl", ({"id": i, "text": d} for i, d in enumerate(DOCUMENTS)))


def options(corpus: Path, tokenizer: Path, out: Path, **changes: object) -> PretrainOptions:
    return replace(
        PretrainOptions(source=str(corpus), tokenizer=str(tokenizer), seq_len=64, out=out, batch_size=7), **changes
    )


def blocks_of(out: Path) -> np.ndarray:
    """The stored `input_ids` as they are on disk (Arrow fixed-size lists), without type conversion."""
    column = datasets.load_from_disk(str(out)).data.table.column("input_ids").combine_chunks()
    return column.flatten().to_numpy().reshape(-1, column.type.list_size)


def framed_documents(tokenizer_dir: Path, documents: list[str]) -> list[int]:
    """The expected stream, built independently: one `encode` call per document, BOS ... EOS around it."""
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    stream: list[int] = []
    for document in documents:
        stream += [
            tokenizer.bos_token_id,
            *tokenizer.encode(document, add_special_tokens=False),
            tokenizer.eos_token_id,
        ]
    return stream


def test_blocks_are_the_framed_documents_minus_only_the_final_partial_block(
    corpus: Path, llama_tokenizer: Path, tmp_path: Path
) -> None:
    manifest = prepare_pretrain(options(corpus, llama_tokenizer, tmp_path / "out"))
    blocks = blocks_of(tmp_path / "out")
    expected = framed_documents(llama_tokenizer, DOCUMENTS)
    assert blocks.dtype == np.int32 and blocks.shape[1] == 64
    assert blocks.ravel().tolist() == expected[: blocks.size]
    assert len(expected) - blocks.size == manifest["dropped_tokens"] < 64
    assert manifest["documents"] == len(DOCUMENTS)
    assert manifest["tokens"] == len(expected)
    assert manifest["blocks"] == len(blocks)


def test_dataset_stores_input_ids_once_as_int32(corpus: Path, llama_tokenizer: Path, tmp_path: Path) -> None:
    prepare_pretrain(options(corpus, llama_tokenizer, tmp_path / "out"))
    dataset = datasets.load_from_disk(str(tmp_path / "out"))
    assert dataset.column_names == ["input_ids"]
    assert dataset.features["input_ids"] == datasets.List(datasets.Value("int32"), length=64)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    for key in ("source", "tokenizer", "seq_len", "documents", "tokens", "blocks", "dropped_tokens", "elapsed_seconds"):
        assert key in manifest
    assert len(manifest["tokenizer"]["sha256"]) == 64
    assert manifest["kind"] == "pretrain"  # what the training job holds against the recipe's kind


def test_output_is_identical_whatever_the_thread_count(corpus: Path, llama_tokenizer: Path, tmp_path: Path) -> None:
    outputs = []
    for threads in (1, 2, 3):
        out = tmp_path / f"out-{threads}"
        prepare_pretrain(options(corpus, llama_tokenizer, out, num_proc=threads, batch_size=5 + threads))
        outputs.append(blocks_of(out).tobytes())
    assert outputs[0] == outputs[1] == outputs[2]


def test_documents_can_be_left_unframed(corpus: Path, llama_tokenizer: Path, tmp_path: Path) -> None:
    prepare_pretrain(options(corpus, llama_tokenizer, tmp_path / "out", add_bos=False, add_eos=False))
    tokenizer = AutoTokenizer.from_pretrained(str(llama_tokenizer))
    expected = [t for d in DOCUMENTS for t in tokenizer.encode(d, add_special_tokens=False)]
    blocks = blocks_of(tmp_path / "out")
    assert blocks.ravel().tolist() == expected[: blocks.size]


def test_final_block_can_be_padded(corpus: Path, llama_tokenizer: Path, tmp_path: Path) -> None:
    manifest = prepare_pretrain(options(corpus, llama_tokenizer, tmp_path / "out", pad_final=True))
    expected = framed_documents(llama_tokenizer, DOCUMENTS)
    blocks = blocks_of(tmp_path / "out")
    assert manifest["dropped_tokens"] == 0
    assert blocks.ravel().tolist() == expected + [manifest["pad_id"]] * manifest["padded_tokens"]


def test_every_local_format_gives_the_same_blocks(corpus: Path, llama_tokenizer: Path, tmp_path: Path) -> None:
    text_file = tmp_path / "formats" / "corpus.txt"
    text_file.parent.mkdir()
    text_file.write_text("\n".join(DOCUMENTS) + "\n", encoding="utf-8")
    parquet.write_table(pa.table({"text": DOCUMENTS}), tmp_path / "corpus.parquet")
    split_dir = tmp_path / "split"
    split_dir.mkdir()
    write_jsonl(split_dir / "part-0.jsonl", ({"text": d} for d in DOCUMENTS[:50]))
    write_jsonl(split_dir / "part-1.jsonl", ({"text": d} for d in DOCUMENTS[50:]))
    results = []
    for index, source in enumerate((corpus, text_file, tmp_path / "corpus.parquet", split_dir)):
        out = tmp_path / f"out-{index}"
        prepare_pretrain(options(source, llama_tokenizer, out))
        results.append(blocks_of(out).tobytes())
    assert len(set(results)) == 1


def test_max_documents_limits_the_input(corpus: Path, llama_tokenizer: Path, tmp_path: Path) -> None:
    manifest = prepare_pretrain(options(corpus, llama_tokenizer, tmp_path / "out", max_documents=30))
    assert manifest["documents"] == 30
    assert (
        blocks_of(tmp_path / "out").ravel().tolist()
        == framed_documents(llama_tokenizer, DOCUMENTS[:30])[: manifest["blocks"] * 64]
    )


def test_rerun_reuses_a_completed_output(corpus: Path, llama_tokenizer: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = prepare_pretrain(options(corpus, llama_tokenizer, out))
    stamp = (out / "manifest.json").stat().st_mtime_ns
    again = prepare_pretrain(options(corpus, llama_tokenizer, out, num_proc=2))
    assert again["reused"] is True and again["blocks"] == first["blocks"]
    assert (out / "manifest.json").stat().st_mtime_ns == stamp


def test_changed_inputs_are_refused_unless_overwrite(corpus: Path, llama_tokenizer: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    prepare_pretrain(options(corpus, llama_tokenizer, out))
    with pytest.raises(UserError, match=r"different inputs \(settings\)"):
        prepare_pretrain(options(corpus, llama_tokenizer, out, seq_len=32))
    manifest = prepare_pretrain(options(corpus, llama_tokenizer, out, seq_len=32, overwrite=True))
    assert manifest["seq_len"] == 32 and blocks_of(out).shape[1] == 32


def test_interrupted_run_leaves_nothing_that_looks_complete(llama_tokenizer: Path, tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    write_jsonl(source / "a.jsonl", ({"text": d} for d in DOCUMENTS))
    (source / "b.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "broken \xff here"}\n')
    with pytest.raises(UserError):
        prepare_pretrain(options(source, llama_tokenizer, tmp_path / "out"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]


def test_leftovers_of_a_killed_run_are_removed(corpus: Path, llama_tokenizer: Path, tmp_path: Path) -> None:
    killed = subprocess.Popen(["true"])
    killed.wait()
    stale = tmp_path / outputs.sibling_name("out", "tmp", replace(outputs.current_owner(), pid=killed.pid))
    stale.mkdir()
    (stale / "data-00000-of-00001.arrow").write_bytes(b"partial")
    prepare_pretrain(options(corpus, llama_tokenizer, tmp_path / "out"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "out"]


# --- bad input: one line, non-zero exit, no output ---------------------------------------------------------


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    status = main(["prepare", "pretrain", *args])
    return status, capsys.readouterr().err


def assert_rejected(args: list[str], out: Path, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, error = run_cli([*args, "--output", str(out)], capsys)
    assert status == 2
    assert error == f"error: {message}\n"
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def test_missing_file(llama_tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.jsonl"
    assert_rejected(
        ["--source", str(missing), "--tokenizer", str(llama_tokenizer)],
        tmp_path / "out",
        f"--source {missing}: no such file or directory",
        capsys,
    )


def test_unknown_dataset(
    llama_tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets
    import huggingface_hub

    # As on a machine without the hub. The libraries read HF_HUB_OFFLINE when imported, which this session
    # did already: without their constants set too, they would try the network (about 20 s of retries).
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    status, error = run_cli(
        ["--source", "no-such-org/no-such-corpus", "--tokenizer", str(llama_tokenizer), "--output", str(out)], capsys
    )
    assert status == 2
    assert error.startswith(
        "error: --source no-such-org/no-such-corpus: cannot load dataset split 'train' "
        "(no network access to the hub?): "
    )
    assert error.count("\n") == 1 and not (tmp_path / "out").exists()


def test_missing_text_column(llama_tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_jsonl(tmp_path / "c.jsonl", [{"body": "hello"}])
    assert_rejected(
        ["--source", str(source), "--tokenizer", str(llama_tokenizer)],
        tmp_path / "out",
        f"{source}: line 1: no column 'text' (found: body); choose it with the column option",
        capsys,
    )


def test_empty_corpus(llama_tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "empty.jsonl"
    source.write_text("\n")
    assert_rejected(
        ["--source", str(source), "--tokenizer", str(llama_tokenizer)],
        tmp_path / "out",
        f"--source {source}: the corpus is empty (no documents in 'text')",
        capsys,
    )


def test_corpus_smaller_than_one_block(
    llama_tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(tmp_path / "c.jsonl", [{"text": "ab"}])
    status, error = run_cli(
        ["--source", str(source), "--tokenizer", str(llama_tokenizer), "--output", str(tmp_path / "out")], capsys
    )
    assert status == 2 and "make no complete block of --seq-len 8192" in error and not (tmp_path / "out").exists()


def test_undecodable_bytes_name_file_and_offset(
    llama_tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "c.jsonl"
    first = b'{"text": "good line"}\n'
    source.write_bytes(first + b'{"text": "bad \xc3\x28 byte"}\n')
    offset = len(first) + len(b'{"text": "bad ')
    assert_rejected(
        ["--source", str(source), "--tokenizer", str(llama_tokenizer)],
        tmp_path / "out",
        f"{source}: byte offset {offset}: not valid UTF-8; "
        "fix the file or pass --skip-bad-records to skip such records",
        capsys,
    )


def test_undecodable_records_can_be_skipped_and_counted(llama_tokenizer: Path, tmp_path: Path) -> None:
    source = tmp_path / "c.jsonl"
    good = "".join(json.dumps({"text": d}) + "\n" for d in DOCUMENTS).encode()
    source.write_bytes(good + b'{"text": "bad \xff"}\n' + b"not json\n")
    manifest = prepare_pretrain(options(source, llama_tokenizer, tmp_path / "out", skip_bad_records=True))
    assert manifest["bad_records_skipped"] == 2
    assert manifest["documents"] == len(DOCUMENTS)
    assert manifest["bad_record_examples"][0] == f"{source}: byte offset {len(good) + 14}"


@pytest.mark.parametrize(
    ("bos", "eos", "missing", "flag"),
    [(None, "<|end_of_text|>", "BOS", "--no-add-bos"), ("<|begin_of_text|>", None, "EOS", "--no-add-eos")],
)
def test_tokenizer_without_separator(
    bos: str | None,
    eos: str | None,
    missing: str,
    flag: str,
    corpus: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    tokenizer = train_tokenizer(tmp_path / "tokenizer", bos=bos, eos=eos)
    out = tmp_path / "out"
    status, error = run_cli(["--source", str(corpus), "--tokenizer", str(tokenizer), "--output", str(out)], capsys)
    assert status == 2
    assert error == (
        f"error: tokenizer {tokenizer} has no {missing} token to separate documents; "
        f"use a tokenizer that defines one, or pass {flag}\n"
    )
    assert not out.exists()


def test_seq_len_below_two(
    corpus: Path, llama_tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_rejected(
        ["--source", str(corpus), "--tokenizer", str(llama_tokenizer), "--seq-len", "1"],
        tmp_path / "out",
        "--seq-len 1: must be at least 2",
        capsys,
    )


def test_module_entry_point_prints_one_line_and_exits_non_zero(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "training",
            "prepare",
            "pretrain",
            "--source",
            str(tmp_path / "x.jsonl"),
            "--tokenizer",
            str(tmp_path),
            "--output",
            str(tmp_path / "out"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )
    assert result.returncode == 2
    assert (
        result.stderr
        == f"error: --tokenizer {tmp_path}: no tokenizer.json (a fast Hugging Face tokenizer is required)\n"
    )
