"""Pinned system prompts (RelayAttention): an application's system prompt, computed once, never evicted.

``Engine.pin_system_prompt`` runs the prompt through the engine and holds its full blocks; this module
holds what a pin is and how a system prompt's text becomes tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class PinnedPrompt:
    """An application's system prompt whose KV is computed once and never evicted."""

    name: str
    token_ids: list[int]
    blocks: list[int]  # the full blocks, held by the pin
    digests: list[bytes]  # their prefix-cache digests (a request that starts with the prompt reuses them)


def render_system_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a system prompt as the chat template renders it at the start of a chat."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so it cannot pin a system prompt given as text")
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template([{"role": "system", "content": text}], tokenize=False)
    else:
        rendered = text
    return tokenizer.encode(rendered, add_special_tokens=False)


__all__ = ["PinnedPrompt", "render_system_prompt"]
