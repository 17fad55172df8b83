"""Loading a Hugging Face tokenizer directory and identifying it (name and content hash) for manifests."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.errors import UserError

# Files that define a tokenizer's behaviour; hashed in this order so the hash is stable.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


@dataclass(frozen=True)
class LoadedTokenizer:
    hf: Any  # transformers.PreTrainedTokenizerFast
    name: str
    sha256: str

    @property
    def backend(self) -> Any:
        """The Rust `tokenizers.Tokenizer`: batch encoding without Python per-token work."""
        return self.hf.backend_tokenizer

    @property
    def bos_id(self) -> int | None:
        return _token_id(self.hf.bos_token_id)

    @property
    def eos_id(self) -> int | None:
        return _token_id(self.hf.eos_token_id)

    @property
    def pad_id(self) -> int | None:
        return _token_id(self.hf.pad_token_id)


def load_tokenizer(directory: str, *, num_threads: int) -> LoadedTokenizer:
    """A fast tokenizer from a local directory (on the cluster, the model's own tokenizer files)."""
    path = Path(directory)
    if not path.is_dir():
        raise UserError(f"--tokenizer {directory}: no such directory")
    if not (path / "tokenizer.json").is_file():
        raise UserError(f"--tokenizer {directory}: no tokenizer.json (a fast Hugging Face tokenizer is required)")
    # The Rust thread pool reads this once, at its first use in the process.
    os.environ["RAYON_NUM_THREADS"] = str(num_threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(path))
    except Exception as error:  # transformers raises many types for unreadable tokenizer files
        raise UserError(f"--tokenizer {directory}: cannot load the tokenizer ({error})") from None
    if not getattr(hf, "is_fast", False):
        raise UserError(f"--tokenizer {directory}: not a fast tokenizer")
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        file = path / name
        if file.is_file():
            digest.update(name.encode() + b"\0" + file.read_bytes())
    return LoadedTokenizer(hf=hf, name=str(hf.name_or_path), sha256=digest.hexdigest())


def _token_id(value: Any) -> int | None:
    return int(value) if isinstance(value, int) else None
