"""Chat examples to tokens and labels: loss only on what the assistant says, including its EOS.

The tokenizer's own chat template renders the conversation when it has one. Without one, the Mixtral
format of the second source document is used:

    <s>[INST] {user} [/INST]{assistant}</s>[INST] {user} [/INST]{assistant}</s>

with a system message folded into the first user turn Llama-2 style
(`<<SYS>>\\n{system}\\n<</SYS>>\\n\\n{user}`).

Assistant spans are found by rendering: the text of the conversation up to and including assistant turn
i, minus the text up to turn i with the generation prompt. Tokens whose first character lies inside a
span are trained; everything else gets label -100. This needs the template to render a conversation as
an extension of its prefixes, which is checked for every example.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from training.config.model import IGNORE_INDEX
from training.data.packing import Example
from training.data.tokenization import LoadedTokenizer
from training.errors import UserError

ROLES = ("system", "user", "assistant")

MIXTRAL_FALLBACK_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)


class BadExample(ValueError):
    """A record whose `messages` cannot be used; skipped with --skip-bad-records, else reported."""


def validate_messages(messages: Any) -> list[dict[str, str]]:
    """Check the shape `[{role, content}, ...]` and return plain dicts."""
    if not isinstance(messages, list):
        raise BadExample(f"messages must be a list, got {type(messages).__name__}")
    clean = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise BadExample(f"message {index} must have a string 'content'")
        if message.get("role") not in ROLES:
            raise BadExample(f"message {index} has role {message.get('role')!r}; allowed: {', '.join(ROLES)}")
        clean.append({"role": message["role"], "content": message["content"]})
    return clean


def fold_system_message(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Llama-2 style: the system prompt becomes part of the first user turn (for the fallback template)."""
    systems = [m["content"] for m in messages if m["role"] == "system"]
    rest = [dict(m) for m in messages if m["role"] != "system"]
    if systems:
        first_user = next((m for m in rest if m["role"] == "user"), None)
        prompt = "<<SYS>>\n" + "\n\n".join(systems) + "\n<</SYS>>\n\n"
        if first_user is None:
            rest.insert(0, {"role": "user", "content": prompt})
        else:
            first_user["content"] = prompt + first_user["content"]
    return rest


class ChatRenderer:
    """Renders and tokenizes examples with one tokenizer and one template."""

    def __init__(self, tokenizer: LoadedTokenizer) -> None:
        self.tokenizer = tokenizer
        own = getattr(tokenizer.hf, "chat_template", None)
        self.uses_fallback = not own
        self.template = own or MIXTRAL_FALLBACK_TEMPLATE
        if tokenizer.eos_id is None:
            raise UserError(f"tokenizer {tokenizer.name} has no EOS token; SFT trains the assistant's EOS")
        if self.uses_fallback and tokenizer.bos_id is None:
            raise UserError(f"tokenizer {tokenizer.name} has no BOS token, which the Mixtral chat format needs")

    def render(self, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation text and the character spans of assistant turns."""
        if self.uses_fallback:
            messages = fold_system_message(messages)
        text = self._render(messages, generation_prompt=False)
        spans = []
        for index, message in enumerate(messages):
            # A conversation that opens with the assistant has no prompt for that turn: it stays context.
            if message["role"] != "assistant" or index == 0:
                continue
            before = self._render(messages[:index], generation_prompt=True)
            through = self._render(messages[: index + 1], generation_prompt=False)
            if not (through.startswith(before) and text.startswith(through)):
                raise UserError(
                    f"the chat template of {self.tokenizer.name} does not render a conversation as an extension "
                    "of its beginning, so assistant turns cannot be located"
                )
            spans.append((len(before), len(through)))
        return text, spans

    def tokenize(self, conversations: Sequence[list[dict[str, str]]]) -> list[Example]:
        """Examples for conversations that each contain at least one assistant turn."""
        rendered = [self.render(messages) for messages in conversations]
        encodings = self.tokenizer.backend.encode_batch([text for text, _ in rendered], add_special_tokens=False)
        examples = []
        for (_, spans), encoding in zip(rendered, encodings, strict=True):
            ids = np.asarray(encoding.ids, dtype=np.int32)
            starts = np.asarray([start for start, _ in encoding.offsets], dtype=np.int64)
            trained = np.zeros(ids.size, dtype=bool)
            for begin, end in spans:
                trained |= (starts >= begin) & (starts < end)
            labels = np.where(trained, ids, IGNORE_INDEX).astype(np.int32)
            examples.append(Example(input_ids=ids, labels=labels))
        return examples

    def prompt(self, user_message: str) -> str:
        """A one-turn conversation up to where the assistant's answer starts (for sampling)."""
        return self._render([{"role": "user", "content": user_message}], generation_prompt=True)

    def _render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        text = self.tokenizer.hf.apply_chat_template(
            messages, chat_template=self.template, tokenize=False, add_generation_prompt=generation_prompt
        )
        return str(text)
