"""Applications' system prompts (RelayAttention): each one's KV computed once and never evicted.

``pin_system_prompt`` runs the prompt through the engine and holds its full blocks; this module also
holds what such a held prompt is (``SystemPromptKV``) and how a system prompt's text becomes tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from prefixserve.engine.prompt_tokens import encode_prompt
from prefixserve.promptcache.pml import is_pml_prompt
from prefixserve.sampling.params import SamplingParams


@dataclass(slots=True)
class SystemPromptKV:
    """An application's system prompt whose KV is computed once and never evicted."""

    name: str
    token_ids: list[int]
    blocks: list[int]  # the pool pages held by the pin: its full blocks (and their sliding pages' tail)
    digests: list[bytes]  # their prefix-cache digests (a request that starts with the prompt reuses them)


def opens_own_system(role: str, content: str) -> bool:
    """Does a chat opening with this message bring its own system prompt (then an application's
    pinned one is not put in front), or a Prompt Cache document (which takes none)?"""
    return role in ("system", "developer") or is_pml_prompt(content)


def system_prompt_text(tokenizer: Any, text: str) -> str:
    """A system prompt as the chat template renders it at the start of a chat (a chat rendered with
    it as its system message starts with this text, unless the template wrote more into it)."""
    template = getattr(tokenizer, "chat_template", None)
    return _rendered(tokenizer, template, text) if template else text


@lru_cache(maxsize=32)
def _rendered(tokenizer: Any, template: str, text: str) -> str:
    """Rendered once per (tokenizer, template, prompt): every chat naming an application asks."""
    return str(tokenizer.apply_chat_template([{"role": "system", "content": text}], tokenize=False))


def opens_with_pinned(tokenizer: Any, rendered: str, system: str | None) -> bool:
    """Does a rendered chat open with the pinned ``system`` prompt as pinned? Only then may the
    engine take it as the application's (its KV leads the chat); a template that writes more into
    that turn (the tools) makes it another prompt."""
    return system is not None and rendered.startswith(system_prompt_text(tokenizer, system))


def render_system_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a system prompt as the chat template renders it at the start of a chat."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so it cannot pin a system prompt given as text")
    return encode_prompt(tokenizer, system_prompt_text(tokenizer, text))


def pin_system_prompt(engine: Any, name: str, text: str) -> SystemPromptKV:
    """Compute an application's system prompt KV once and hold its full blocks for good (``engine``:
    the Engine, which imports this module).

    Pinned blocks carry a reference of their own, so they are never evicted; any request whose
    prompt starts with these tokens (named by ``application=`` or not) finds them in the prefix index.
    """
    if not engine.config.enable_prefix_caching:
        raise ValueError("pinned system prompts need the prefix cache (enable_prefix_caching=True)")
    if not name or name in engine.system_prompt_kv:
        raise ValueError(f"application name {name!r} is empty or already pinned")
    if engine.requests:
        raise RuntimeError("pin system prompts at start-up, before any request is queued")
    tokens = engine.render_system_prompt(text)
    if not tokens or len(tokens) >= engine.max_model_len:
        raise ValueError(f"system prompt of application {name!r} is empty or longer than the context")
    # Start-up work, not traffic: the metrics are put back as they were afterwards.
    saved = engine.stats.save(engine.runner)
    request_id = f"__pin__{name}"
    req = engine.add_request(request_id, params=SamplingParams(max_tokens=1), prompt_token_ids=tokens)
    while request_id in engine.requests:
        engine.step()
    # The finished prompt's full blocks are now free but indexed: take them out of reach of eviction.
    digests = engine.blocks.digests(req.sequences[0], len(tokens) // engine.config.block_size)
    blocks = engine.pool.lookup(digests)
    if len(blocks) != len(digests):
        raise RuntimeError(f"pinning {name!r}: {len(digests) - len(blocks)} blocks were evicted at once")
    engine.pool.acquire(blocks)
    blocks += engine.blocks.hold_sliding_tail(digests)  # the sliding pages a hit of it needs
    if engine.blocks.states is not None:  # a hybrid resumes a hit from its linear layers' snapshots
        engine.blocks.states.pin(digests)
    engine.stats.restore(saved, engine.runner)
    held = SystemPromptKV(name, tokens, blocks, list(digests))
    engine.system_prompt_kv[name] = held
    return held


__all__ = [
    "SystemPromptKV",
    "opens_own_system",
    "opens_with_pinned",
    "pin_system_prompt",
    "render_system_prompt",
    "system_prompt_text",
]
