"""``bad_words``: strings a sample's output may never contain, banned token by token (vLLM's semantics).

Each word is encoded as it would stand at the start of the text and after a space (two token sequences
where they differ). A one-token sequence is banned everywhere; a longer one bans its last token where
the output so far ends with the rest of it. Only output tokens count, as in vLLM: a word may still
complete one that the prompt began.

The check reads a sample's last output tokens on the host. Under launch-ahead the token just sampled
is still on the device, so a step with rows holding multi-token words samples after the tokens ahead
of it have arrived (``waits_for_tokens``), as grammar rows do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from prefixserve.sampling.min_tokens import TokenBan
from prefixserve.sampling.params import BAD_WORDS, SamplingParams, flags_of


class Asked(Protocol):
    """What the ban reads of a request (the engine's ``Request``): its words, encoded at intake."""

    bad_words_ids: list[list[int]] | None


class Sampling(Protocol):
    """What the ban reads of a sampling sequence (the engine's ``Sequence``)."""

    num_prompt_tokens: int
    token_ids: Any
    request: Asked


def encode_bad_words(words: Sequence[str], tokenizer: Any) -> list[list[int]]:
    """Each word's token ids at the start of the text and after a space, distinct, in order."""
    out: list[list[int]] = []
    for word in words:
        bare = word.lstrip()
        for text in (bare, " " + bare):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return out


def waits_for_tokens(samplers: Sequence[Sampling], params: Sequence[SamplingParams]) -> bool:
    """Does a step's sampling read the tokens ahead of it (a multi-token bad word)?"""
    if not flags_of(params) & BAD_WORDS:
        return False
    return any(any(len(w) > 1 for w in s.request.bad_words_ids or ()) for s in samplers)


def bad_words_ban(
    samplers: Sequence[Sampling], indices: Sequence[int], params: Sequence[SamplingParams]
) -> TokenBan | None:
    """The tokens each sample row may not choose next (``samplers[i]`` samples the token at
    ``indices[i]`` of its ids, with ``params[i]``), or None when no row has bad words."""
    if not flags_of(params) & BAD_WORDS:
        return None
    rows: list[int] = []
    ids: list[int] = []
    for r, (seq, at) in enumerate(zip(samplers, indices, strict=True)):
        for word in seq.request.bad_words_ids or ():
            lead = len(word) - 1
            if lead == 0 or (
                at - seq.num_prompt_tokens >= lead and list(seq.token_ids[at - lead : at]) == word[:-1]
            ):
                rows.append(r)
                ids.append(word[-1])
    return TokenBan(rows, ids) if rows else None


def joined(a: TokenBan | None, b: TokenBan | None) -> TokenBan | None:
    """Both bans at once."""
    if a is None or b is None:
        return a or b
    return TokenBan(
        a.rows + b.rows, a.ids + b.ids, a.forced_rows + b.forced_rows, a.forced_ids + b.forced_ids
    )


__all__ = ["bad_words_ban", "encode_bad_words", "joined", "waits_for_tokens"]
