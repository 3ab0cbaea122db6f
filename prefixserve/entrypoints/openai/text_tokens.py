"""Which leading output tokens wrote the first characters of an output's text.

Logprobs are per token and texts per character; a message's logprobs are its text's alone (not a
tool call's written after it, nor a thinking model's reasoning before it), and a reasoning chunk's
are its own. A character may take several tokens and a skipped special token none, so the count
decodes as the detokenizer does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class TextTokens:
    """Counts, for one output, the leading tokens whose text lies within its first ``chars``."""

    tokenizer: Any
    skip_special: bool = True
    counted: int = 0  # tokens known to lie within the text asked about so far (it only grows)

    def within(self, ids: Sequence[int], chars: int) -> int:
        if self.tokenizer is None:
            return len(ids)
        k = self.counted
        while (
            k < len(ids)
            and len(self.tokenizer.decode(ids[: k + 1], skip_special_tokens=self.skip_special)) <= chars
        ):
            k += 1
        self.counted = k
        return k


__all__ = ["TextTokens"]
