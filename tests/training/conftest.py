"""Tokenizers trained inside the tests (no hub access): Llama-3-style and chat-template variants."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
HEADER_START, HEADER_END, END_OF_TURN = "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"

# A Llama-3-like chat template (headers per turn, <|eot_id|> closing each turn).
LLAMA3_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def sample_documents(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(2, 8))) for _ in range(400)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 120))) for _ in range(count)]


def write_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def train_tokenizer(
    directory: Path,
    *,
    bos: str | None = BOS,
    eos: str | None = EOS,
    extra_specials: tuple[str, ...] = (),
    chat_template: str | None = None,
) -> Path:
    """A byte-level BPE tokenizer whose post-processor prepends BOS, as Llama 3's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [token for token in (bos, eos) if token] + list(extra_specials)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(sample_documents(300) + ["question answer system be brief"] * 20, trainer)
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos, eos_token=eos)
    if chat_template:
        hf.chat_template = chat_template
    hf.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="session")
def llama_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer-llama"))


@pytest.fixture(scope="session")
def chat_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer(
        tmp_path_factory.mktemp("tokenizer-chat"),
        eos=END_OF_TURN,
        extra_specials=(HEADER_START, HEADER_END),
        chat_template=LLAMA3_STYLE_TEMPLATE,
    )
