"""Tiny, self-made stand-ins for what the cluster downloads: a tokenizer trained on the spot, random
Llama and Mixtral models, a text corpus and chat conversations. The local demo and the tests use them
(no hub access on the development machines); the real loading code paths are unchanged.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

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
    fast: Any = PreTrainedTokenizerFast  # untyped in transformers 5
    hf = fast(tokenizer_object=tokenizer, bos_token=bos, eos_token=eos)
    if chat_template:
        hf.chat_template = chat_template
    hf.save_pretrained(str(directory))
    return directory


def sample_conversations(count: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """Chat conversations in the `messages` format of HuggingFaceH4/no_robots (optional system turn)."""
    rng = random.Random(seed)
    documents = sample_documents(count * 3, seed=seed + 1)
    conversations = []
    for index in range(count):
        turns = [{"role": "system", "content": "be brief"}] if index % 3 == 0 else []
        for turn in range(1 + index % 2):
            turns.append({"role": "user", "content": "question " + documents[3 * index + turn][:80]})
            turns.append({"role": "assistant", "content": "answer " + documents[3 * index + 2][: rng.randint(20, 200)]})
        conversations.append(turns)
    return conversations


def tiny_model(
    directory: Path, tokenizer: Path, *, architecture: str = "llama", layers: int = 2, kv_heads: int = 2, seed: int = 0
) -> Path:
    """A random Hugging Face model sized for CPU tests, its vocabulary the tokenizer's, saved with it (8 query
    heads sharing `kv_heads` KV heads)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    loaded = AutoTokenizer.from_pretrained(str(tokenizer))
    common: dict[str, Any] = {
        "vocab_size": len(loaded),
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 256,
        "bos_token_id": loaded.bos_token_id,
        "eos_token_id": loaded.eos_token_id,
        "tie_word_embeddings": False,
    }
    torch.manual_seed(seed)
    if architecture == "llama":
        model: Any = LlamaForCausalLM(LlamaConfig(**common))
    elif architecture == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common))
    else:
        raise ValueError(f"architecture {architecture!r}: allowed llama, mixtral")
    model.save_pretrained(str(directory))
    loaded.save_pretrained(str(directory))
    return directory


def make_tiny_sources(root: Path, architecture: str, *, documents: int = 400) -> dict[str, Path]:
    """What the pipeline starts from, under `root`: `tokenizer`, an `hf` model (with the tokenizer), and a
    `corpus.jsonl` (llama) or `chats.jsonl` (mixtral) in the formats `prepare` reads."""
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(root / "tokenizer")
    hf = tiny_model(root / "hf", tokenizer, architecture=architecture)
    if architecture == "llama":
        data = write_jsonl(root / "corpus.jsonl", ({"text": text} for text in sample_documents(documents)))
    else:
        data = write_jsonl(root / "chats.jsonl", ({"messages": c} for c in sample_conversations(documents)))
    return {"tokenizer": tokenizer, "hf": hf, "source": data}


def build_tiny_world(root: Path, architecture: str, *, tp: int, pp: int = 1, seq_len: int = 64) -> dict[str, Path]:
    """The tiny sources plus what the pipeline's first stages make of them: prepared `data` and the
    `pretrained_weight` (nxd at `tp` x `pp`) written by the converter."""
    from training.data.pretrain import PretrainOptions, prepare_pretrain
    from training.data.sft import SftOptions, prepare_sft
    from training.formats.convert import ConvertOptions, convert

    world = make_tiny_sources(root, architecture)
    data, source, tokenizer = root / "data", str(world["source"]), str(world["tokenizer"])
    if architecture == "llama":
        prepare_pretrain(PretrainOptions(source=source, tokenizer=tokenizer, seq_len=seq_len, out=data))
    else:
        prepare_sft(SftOptions(source=source, tokenizer=tokenizer, seq_len=seq_len, out=data))
    pretrained = root / "pretrained_weight"
    convert(ConvertOptions(source_format="hf", target_format="nxd", input=world["hf"], output=pretrained, tp=tp, pp=pp))
    return {**world, "data": data, "pretrained": pretrained}
