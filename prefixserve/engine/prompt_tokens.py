"""A text prompt's token ids, as vLLM takes them, and a pinned system prompt put in front of them.

vLLM encodes a completion's text with the tokenizer's special tokens, so a Llama-family model sees its
BOS first; a chat rendered by its template already opens with the BOS as text, and encoding that with
the special tokens would give two, so one goes. A pinned prompt (``system_prompts.py``) is encoded
the same way; put in front of a prompt that does not start with it, the prompt's own BOS goes, so a
sequence has one BOS, at its start. Tokenizers that add no special tokens (the default model's) are
unchanged by all of it. The engine's intake, the offline API's batch tokenizing, the server's
tokenizing off the engine thread, the batch planner and the replica router all go through here, so
they agree on every prompt's ids (and so on its prefix-cache digests).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=8)
def added_bos(tokenizer: Any) -> int | None:
    """The id the tokenizer puts in front of a text it encodes with its special tokens, or None."""
    with_special = tokenizer(["a"], add_special_tokens=True)["input_ids"][0]
    plain = tokenizer(["a"], add_special_tokens=False)["input_ids"][0]
    if len(with_special) > len(plain) and with_special[1:] == plain[: len(with_special) - 1]:
        return int(with_special[0])
    return None


def _one_bos(ids: Sequence[int], bos: int | None) -> list[int]:
    ids = list(ids)
    if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        return ids[1:]  # a rendered chat's own BOS, and the tokenizer's
    return ids


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """``text``'s token ids with the tokenizer's special tokens, one BOS at most in front."""
    return _one_bos(tokenizer.encode(text, add_special_tokens=True), added_bos(tokenizer))


def encode_prompts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """``encode_prompt`` of each text, in one batch call (a fast tokenizer encodes on all cores)."""
    bos = added_bos(tokenizer)
    return [_one_bos(ids, bos) for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]]


def keep_last(ids: list[int], keep: int | None, max_tokens: int | None, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: a prompt's last ``keep`` ids (left truncation); -1 keeps as many
    as leave room in the context for ``max_tokens`` (for one token where it is None)."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max(1, max_model_len - (max_tokens or 1))
    return ids[-keep:] if len(ids) > keep else ids


def behind_pinned(head: list[int], ids: list[int], tokenizer: Any) -> list[int]:
    """``ids`` with the pinned prompt ``head`` in front: as they are if they start with it, else
    ``head`` then ``ids`` less a leading BOS that ``head`` opens with too."""
    if ids[: len(head)] == head:
        return ids
    bos = added_bos(tokenizer) if tokenizer is not None else None
    if bos is not None and ids[:1] == [bos] and head[:1] == [bos]:
        ids = ids[1:]
    return head + ids


__all__ = ["added_bos", "behind_pinned", "encode_prompt", "encode_prompts", "keep_last"]
