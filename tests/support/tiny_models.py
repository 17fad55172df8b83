"""Tiny random Hugging Face checkpoints (Llama with GQA, Mixtral with 4 experts) written by the tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

# Llama 3.1's RoPE scaling with a short original context, so both the scaled and the smoothed bands occur
# among the tiny model's frequencies.
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def llama(
    directory: Path,
    *,
    heads: int = 8,
    kv_heads: int = 2,
    layers: int = 2,
    dtype: torch.dtype = torch.float32,
    tied: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    seed: int = 0,
) -> Path:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        rope_theta=10000.0,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(directory)
    return directory


def mixtral(directory: Path, *, layers: int = 4, sliding_window: int | None = None, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        sliding_window=sliding_window,
        router_aux_loss_coef=0.02,
    )
    MixtralForCausalLM(config).save_pretrained(directory)
    return directory
