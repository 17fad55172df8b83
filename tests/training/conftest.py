"""Tokenizers trained inside the tests (no hub access): Llama-3-style and chat-template variants; recipe
overrides for the tiny worlds."""

from __future__ import annotations

from pathlib import Path

import pytest

from training.local.tiny import (  # noqa: F401  (re-exported for the tests)
    BOS,
    END_OF_TURN,
    EOS,
    HEADER_END,
    HEADER_START,
    LLAMA3_STYLE_TEMPLATE,
    sample_documents,
    train_tokenizer,
    write_jsonl,
)


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


def world_overrides(world: dict[str, Path], checkpoints: Path, *extra: str) -> list[str]:
    """Recipe overrides that train on a tiny world (training.local.tiny) with checkpoints in `checkpoints`."""
    return [
        f"model.config={world['hf']}",
        f"model.pretrained={world['pretrained']}",
        f"data.path={world['data']}",
        f"checkpoint.dir={checkpoints}",
        *extra,
    ]
