"""``bad_words``: strings a sample's output may never contain, banned token by token (vLLM's semantics).

Each word is encoded as it would stand at the start of the text and after a space (two token sequences
where they differ). A one-token sequence is banned everywhere; a longer one bans its last token where
the output so far ends with the rest of it. Only output tokens count, as in vLLM: a word may still
complete one that the prompt began.

The check reads a sample's last output tokens on the host. Under launch-ahead the token just sampled
is still on the device, so a step with rows holding multi-token words samples after the tokens ahead
of it have arrived (``waits_for_tokens``), as grammar rows do.

A request rule (``BadWordsRule``, ``rules.py``): intake encodes a request's words (its state, in
``Request.rules["bad_words"]``), each step bans by them, and a multi-token word makes a step wait.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from prefixserve.sampling.params import BAD_WORDS, SamplingParams, flags_of
from prefixserve.sampling.rules import RequestRule, RuleRequest
from prefixserve.sampling.token_ban import TokenBan

NAME = "bad_words"  # the rule's name: its state, the request's encoded words, is ``Request.rules[NAME]``


class Asked(Protocol):
    """What the ban reads of a request (the engine's ``Request``): its rules' states."""

    rules: dict[str, Any]


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
    return any(any(len(w) > 1 for w in s.request.rules.get(NAME, ())) for s in samplers)


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
        for word in seq.request.rules.get(NAME, ()):
            lead = len(word) - 1
            if lead == 0 or (
                at - seq.num_prompt_tokens >= lead and list(seq.token_ids[at - lead : at]) == word[:-1]
            ):
                rows.append(r)
                ids.append(word[-1])
    return TokenBan(rows, ids) if rows else None


class BadWordsRule(RequestRule):
    """``bad_words`` as a request rule: the words encoded at intake, each step's ban by them."""

    name = NAME

    def check(self, params: SamplingParams, tokenizer: Any) -> None:
        if params.bad_words and tokenizer is None:
            raise ValueError(
                "bad_words needs a tokenizer: this model has none (ban token ids with logit_bias)"
            )

    def admit(self, request: RuleRequest, tokenizer: Any) -> list[list[int]] | None:
        words = request.params.bad_words
        return encode_bad_words(words, tokenizer) if words else None

    def waits(
        self, samplers: Sequence[Sampling], indices: Sequence[int], params: Sequence[SamplingParams]
    ) -> bool:
        return waits_for_tokens(samplers, params)

    def ban(
        self, samplers: Sequence[Sampling], indices: Sequence[int], params: Sequence[SamplingParams]
    ) -> TokenBan | None:
        return bad_words_ban(samplers, indices, params)


__all__ = ["NAME", "BadWordsRule", "bad_words_ban", "encode_bad_words", "waits_for_tokens"]
