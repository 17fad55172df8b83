"""`python -m training sample`: the trained model's answers to a few prompts, greedy and top-k.

The dependable check of the documents' last step, on CPU with transformers (REFERENCE.md section 2). For an
SFT recipe the prompt is wrapped in the same chat format the data was prepared with, so the answer shows
whether the assistant turn was learned.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from training import outputs
from training.config.recipe import Recipe
from training.errors import UserError

log = logging.getLogger(__name__)


def prompt_text(recipe: Recipe, tokenizer_directory: Path, prompt: str) -> str:
    if recipe.prepare is None or recipe.prepare.kind != "sft":
        return prompt
    from training.data.chat import ChatRenderer
    from training.data.tokenization import load_tokenizer

    renderer = ChatRenderer(load_tokenizer(str(tokenizer_directory), num_threads=1))
    return renderer.prompt(prompt)


def sample(recipe: Recipe, model_directory: Path, output: Path) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (model_directory / "config.json").is_file():
        raise UserError(f"--input {model_directory}: not a Hugging Face model directory (no config.json)")
    tokenizer = AutoTokenizer.from_pretrained(str(model_directory))
    model: Any = AutoModelForCausalLM.from_pretrained(str(model_directory))
    model.eval()
    settings = recipe.sample
    results = []
    for prompt in settings.prompts:
        text = prompt_text(recipe, model_directory, prompt)
        # No token_type_ids: causal models take none, and the cluster's transformers refuses unused inputs.
        encoded = tokenizer(
            text,
            return_tensors="pt",
            return_token_type_ids=False,
            add_special_tokens=not text.startswith(tokenizer.bos_token or "\0"),
        )
        length = encoded["input_ids"].shape[1]
        common: dict[str, Any] = {"max_new_tokens": settings.max_new_tokens, "pad_token_id": tokenizer.eos_token_id}
        with torch.no_grad():
            greedy = model.generate(**encoded, do_sample=False, **common)
            torch.manual_seed(settings.seed)
            top_k = model.generate(**encoded, do_sample=True, top_k=settings.top_k, **common)
        results.append(
            {
                "prompt": prompt,
                "greedy": tokenizer.decode(greedy[0, length:], skip_special_tokens=True),
                "top_k": tokenizer.decode(top_k[0, length:], skip_special_tokens=True),
            }
        )
    outputs.write_file(
        output,
        json.dumps({"model": str(model_directory), "top_k": settings.top_k, "samples": results}, indent=2) + "\n",
    )
    for result in results:
        log.info(f"prompt: {result['prompt']!r} greedy: {result['greedy']!r} top-{settings.top_k}: {result['top_k']!r}")
    log.info(f"{len(results)} samples written to {output}")
    return results
