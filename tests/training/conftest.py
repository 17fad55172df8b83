"""The tiny worlds the training tests share, each built once per session (and per xdist worker): tokenizers
trained inside the tests (no hub access), Llama-3-style and chat-template variants, and the tiny Llama and
Mixtral worlds of training.local.tiny with their prepared data and converted weights. Tests read them and
write into their own tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest

from training.local.tiny import (
    END_OF_TURN,
    HEADER_END,
    HEADER_START,
    LLAMA3_STYLE_TEMPLATE,
    build_tiny_world,
    train_tokenizer,
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


@pytest.fixture(scope="session")
def llama_world_tp1(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Llama world, its weights converted at TP 1."""
    return build_tiny_world(tmp_path_factory.mktemp("tiny-llama-tp1"), "llama", tp=1)


@pytest.fixture(scope="session")
def llama_world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Llama world, its weights converted at TP 2 (as the recipe trains)."""
    return build_tiny_world(tmp_path_factory.mktemp("tiny-llama"), "llama", tp=2)


@pytest.fixture(scope="session")
def mixtral_world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Mixtral world at TP 1 and PP 2, as its recipe trains."""
    return build_tiny_world(tmp_path_factory.mktemp("tiny-mixtral"), "mixtral", tp=1, pp=2)
