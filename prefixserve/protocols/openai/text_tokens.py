"""Which leading output tokens wrote the first characters of an output's text.

Logprobs are per token and texts per character; a message's logprobs are its text's alone (not a
tool call's written after it, nor a thinking model's reasoning before it), and a reasoning chunk's
are its own. A character may take several tokens and a skipped special token none, so the count
decodes as the detokenizer does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

WINDOW = 8  # tokens of context before each token decoded (more than any character's bytes take)


@dataclass
class TextTokens:
    """Counts, for one output, the leading tokens whose text lies within its first ``chars``.

    The text's length after each token is found incrementally: the length after the token before,
    plus what decoding a short window ending with the token adds to the same window without it
    (both decodes start at one token, so a tokenizer's leading-space rule or a half character at
    the window's start cancels out). Each token costs two decodes of a few tokens, so a stream of
    n tokens costs O(n), where decoding every prefix whole cost O(n^2) on the server's loop."""

    tokenizer: Any
    skip_special: bool = True
    counted: int = 0  # tokens known to lie within the text asked about so far (it only grows)
    lengths: list[int] = field(default_factory=lambda: [0])  # text length after each leading token

    def within(self, ids: Sequence[int], chars: int) -> int:
        if self.tokenizer is None:
            return len(ids)
        k = self.counted
        while k < len(ids) and self._length(ids, k + 1) <= chars:
            k += 1
        self.counted = k
        return k

    def _length(self, ids: Sequence[int], k: int) -> int:
        """The length of ``decode(ids[:k])``."""
        lengths = self.lengths
        while len(lengths) <= k:
            j = len(lengths)  # the next prefix: ids[:j]
            start = max(0, j - 1 - WINDOW)
            decode = self.tokenizer.decode
            grown = len(decode(ids[start:j], skip_special_tokens=self.skip_special))
            before = len(decode(ids[start : j - 1], skip_special_tokens=self.skip_special))
            lengths.append(lengths[-1] + grown - before)
        return lengths[k]


__all__ = ["TextTokens"]
