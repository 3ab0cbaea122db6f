"""A salted request's public part (``--cache-salt-scope``, ``docs/guides/tenants.md``) and its
Anthropic cache breakpoints, counted in the prompt's tokens as the engine runs them.

Under the "after-system" scope a chat's leading system messages are rendered alone and the tokens
that rendering shares with the whole prompt are public; an application's pinned prompt is public
too, and under either scope so is the prefix of a cache breakpoint marked ``"shared": true``. Blocks
wholly inside the public part are digested without the salt (``kv/block_pool.chain_digests``).
"""

from __future__ import annotations

from typing import Any

from prefixserve.config import CACHE_SALT_SCOPES
from prefixserve.engine.prompt_tokens import encode_prompt
from prefixserve.protocols.errors import APIError
from prefixserve.protocols.openai.request_models import ChatCompletionRequest, CompletionRequest
from prefixserve.protocols.openai.tools import Tools, conversation, template_knows_tools, template_kwargs

# ``ctx``: the route's ``prepare.OpenAIContext``; ``prep``: its ``prepare.Prepared`` (typed loosely:
# prepare.py imports this module)
OpenAIContext = Prepared = Any


def salt_scope(ctx: OpenAIContext, req: CompletionRequest | ChatCompletionRequest) -> str:
    """The request's cache-salt scope (its own, else the server's); a 400 for an unknown one."""
    scope = req.cache_salt_scope or ctx.cache_salt_scope
    if scope not in CACHE_SALT_SCOPES:
        known = ", ".join(CACHE_SALT_SCOPES)
        message = f"cache_salt_scope must be one of {known}, got {scope!r}"
        raise APIError(400, message, param="cache_salt_scope")
    return scope


def system_text(ctx: OpenAIContext, req: ChatCompletionRequest, tools: Tools | None) -> str | None:
    """The chat's leading system (or developer) messages through the template alone, with what the
    template writes beside them (the tools it renders itself): the text a salted chat's public part
    is read from. None where the chat opens with no such message or the template refuses them alone."""
    lead = []
    for m in req.messages:
        if m.role not in ("system", "developer"):
            break
        lead.append(m)
    if not lead:
        return None
    native = tools is not None and template_knows_tools(ctx.tokenizer, req.chat_template)
    extra = template_kwargs(req, tools, native)  # as the whole chat is rendered
    try:
        messages = conversation(lead, tools, native)
        text = ctx.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=False, **extra
        )
        return str(text)
    except Exception:  # a template that needs a user turn: nothing is public
        return None


def public_tokens(ctx: OpenAIContext, prep: Prepared, ids: list[int]) -> int:
    """How many of a salted prompt's ids, as the engine runs them (``engine_ids``), are public under
    its scope: the application's pinned prompt in front, or the ids the chat shares with its system
    messages rendered alone (a common prefix: text after them never counts). 0 under "prompt", for
    an unsalted request (nothing to share apart), or where nothing public leads."""
    if getattr(prep.req, "cache_salt", None) is None:
        return 0
    marked = [t for t, _, shared in prep.pin_texts if shared]  # breakpoints marked public, any scope
    public = max((shared_prefix(encode_prompt(ctx.tokenizer, t), ids) for t in marked), default=0)
    if prep.salt_scope != "after-system":
        return public
    if prep.application is not None:
        return max(public, len(ctx.engine_ids([], prep.application)))
    if prep.public_text is None:
        return public
    return max(public, shared_prefix(encode_prompt(ctx.tokenizer, prep.public_text), ids))


def pin_counts(ctx: OpenAIContext, prep: Prepared, ids: list[int]) -> list[tuple[int, float]]:
    """Each cache breakpoint as (the prompt tokens its prefix shares with ``ids``, as the engine runs
    them; seconds)."""
    return [(shared_prefix(encode_prompt(ctx.tokenizer, t), ids), ttl) for t, ttl, _ in prep.pin_texts]


def shared_prefix(head: list[int], ids: list[int]) -> int:
    """How many leading ids ``head`` and ``ids`` have in common."""
    n = 0
    for a, b in zip(head, ids, strict=False):
        if a != b:
            break
        n += 1
    return n


__all__ = ["pin_counts", "public_tokens", "salt_scope", "shared_prefix", "system_text"]
