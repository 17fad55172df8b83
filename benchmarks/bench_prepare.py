"""Pretraining data preparation: ours vs the reference approach vs the tokenizer's raw ceiling, one run.

    python benchmarks/bench_prepare.py [--megabytes 50] [--seq-len 8192] [--workdir DIR]

Generates a JSON-lines corpus of at least `--megabytes` MB (Zipf-distributed words, documents of varied
length) and a byte-level BPE tokenizer that, like Llama 3's, prepends BOS through its post-processor.
Then, on the same corpus and machine:

- reference: `datasets.load_dataset("json")`, `map(batched=True)` with 1000-document batches in one
  process, tokenizing with the tokenizer's `__call__` and grouping each batch into blocks (the remainder
  of every batch dropped), `labels` copied from `input_ids`, `save_to_disk` (REFERENCE.md section 3);
- ours: `training.data.pretrain.prepare_pretrain` (framing, carry-over packing, int32, manifest, save);
- ceiling: `tokenizers.Tokenizer.encode_batch` and `encode_batch_fast` over the in-memory texts with all
  cores, nothing else.

Prints tokens/s for each, the ratios, and the tokens each approach dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from itertools import chain
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"


def make_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz"
    vocabulary = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 10))) for _ in range(30_000)]
    weights = [1.0 / (rank + 1) for rank in range(len(vocabulary))]
    target = int(megabytes * 1_000_000)
    written = documents = 0
    with path.open("w", encoding="utf-8") as handle:
        while written < target:
            words = rng.choices(vocabulary, weights=weights, k=rng.randint(20, 3000))
            sentences = [" ".join(words[i : i + 15]).capitalize() + "." for i in range(0, len(words), 15)]
            line = json.dumps({"title": f"doc {documents}", "text": " ".join(sentences)}) + "\n"
            handle.write(line)
            written += len(line.encode())
            documents += 1
    return documents


def make_tokenizer(corpus: Path, directory: Path, vocab_size: int = 16_000) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    def sample() -> list[str]:
        with corpus.open(encoding="utf-8") as handle:
            return [json.loads(line)["text"] for _, line in zip(range(2000), handle, strict=False)]

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(sample(), trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS).save_pretrained(str(directory))


def run_reference(corpus: Path, tokenizer_dir: Path, seq_len: int, out: Path) -> tuple[float, int, int]:
    """(seconds, tokens kept in blocks, tokens dropped) of the reference example's approach."""
    import datasets
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    dropped = 0

    def tokenize(batch: dict) -> dict:
        return tokenizer(batch["text"])

    def group(batch: dict) -> dict:
        nonlocal dropped
        concatenated = {k: list(chain(*batch[k])) for k in batch}
        total = len(concatenated["input_ids"])
        kept = (total // seq_len) * seq_len
        dropped += total - kept
        result = {k: [t[i : i + seq_len] for i in range(0, kept, seq_len)] for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    started = time.perf_counter()
    raw = datasets.load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(out / "cache"))
    tokenized = raw.map(tokenize, batched=True, remove_columns=raw.column_names)
    grouped = tokenized.map(group, batched=True)
    grouped.save_to_disk(str(out / "dataset"))
    elapsed = time.perf_counter() - started
    return elapsed, len(grouped) * seq_len, dropped


def run_ours(corpus: Path, tokenizer_dir: Path, seq_len: int, out: Path) -> tuple[float, int, int]:
    from training.data.pretrain import PretrainOptions, prepare_pretrain

    started = time.perf_counter()
    manifest = prepare_pretrain(
        PretrainOptions(
            source=str(corpus), tokenizer=str(tokenizer_dir), seq_len=seq_len, out=out, num_proc=os.cpu_count() or 1
        )
    )
    elapsed = time.perf_counter() - started
    return elapsed, manifest["blocks"] * seq_len, manifest["dropped_tokens"]


def run_ceiling(corpus: Path, tokenizer_dir: Path) -> tuple[float, float, int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    with corpus.open(encoding="utf-8") as handle:
        texts = [json.loads(line)["text"] for line in handle]
    started = time.perf_counter()
    tokens = sum(len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False))
    batch_seconds = time.perf_counter() - started
    started = time.perf_counter()
    tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    fast_seconds = time.perf_counter() - started
    return batch_seconds, fast_seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=50.0)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--workdir", type=Path)
    arguments = parser.parse_args()
    workdir = arguments.workdir or Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    workdir.mkdir(parents=True, exist_ok=True)
    corpus, tokenizer_dir = workdir / "corpus.jsonl", workdir / "tokenizer"
    documents = make_corpus(corpus, arguments.megabytes)
    make_tokenizer(corpus, tokenizer_dir)
    print(f"corpus: {corpus.stat().st_size / 1e6:.1f} MB, {documents} documents; {os.cpu_count()} cores")

    for name in ("reference", "ours"):
        shutil.rmtree(workdir / name, ignore_errors=True)
    reference_seconds, reference_kept, reference_dropped = run_reference(
        corpus, tokenizer_dir, arguments.seq_len, workdir / "reference"
    )
    ours_seconds, _ours_kept, ours_dropped = run_ours(corpus, tokenizer_dir, arguments.seq_len, workdir / "ours")
    batch_seconds, fast_seconds, content_tokens = run_ceiling(corpus, tokenizer_dir)

    # Throughput is measured on the document content tokens, the same count for every approach.
    def rate(seconds: float) -> float:
        return content_tokens / seconds

    ceiling = rate(min(batch_seconds, fast_seconds))
    print(f"{'approach':<34}{'seconds':>9}{'Mtok/s':>9}{'dropped tokens':>16}")
    for label, seconds, dropped in (
        ("reference (datasets.map, 1 proc)", reference_seconds, str(reference_dropped)),
        ("ours (prepare pretrain)", ours_seconds, str(ours_dropped)),
        ("ceiling encode_batch", batch_seconds, "-"),
        ("ceiling encode_batch_fast", fast_seconds, "-"),
    ):
        print(f"{label:<34}{seconds:9.2f}{rate(seconds) / 1e6:9.2f}{dropped:>16}")
    print(f"ours / reference: {reference_seconds / ours_seconds:.2f}x (target >= 1.5x)")
    print(f"ours / ceiling (fastest of the two): {rate(ours_seconds) / ceiling:.0%} (target >= 80%)")
    print(f"ours dropped {ours_dropped} tokens (< one block of {arguments.seq_len}: only the final partial block)")
    print(f"reference dropped {reference_dropped} tokens ({reference_dropped / max(reference_kept, 1):.1%} of kept)")
    if arguments.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
