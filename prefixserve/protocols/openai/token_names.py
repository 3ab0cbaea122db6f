"""How a response names a token: its text (the logprobs' ``token``) and its own bytes (chat logprobs'
``bytes``).

A token's text is the tokenizer's decoding of it alone. Where the token holds only part of a
character (a byte-level BPE piece of a multi-byte character, or SentencePiece's byte fallback
``<0xE2>``) that text is U+FFFD, and its UTF-8 (``EF BF BD``) is not the token's bytes; OpenAI's
``bytes`` field exists so that a client can join such tokens' bytes back into the character. So the
bytes come from the vocabulary piece where the text is not whole: the byte-level alphabet mapped back
to bytes (``transformers``' ``bytes_to_unicode``), or the fallback piece's byte."""

from __future__ import annotations

import re
from typing import Any

_FALLBACK_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
REPLACEMENT = "\ufffd"


class TokenNames:
    """A tokenizer's token texts and token bytes, each worked out once a token."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._raw: dict[int, bytes] = {}
        self._alphabet: dict[str, int] | None = None  # byte-level BPE: a piece's character -> its byte

    def __call__(self, token_id: int) -> str:
        """The token's text (decoded alone)."""
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self.tokenizer.decode([token_id])
        return text

    def raw(self, token_id: int) -> bytes:
        """The token's own bytes: its text's UTF-8 where the text is whole, else its piece's bytes."""
        raw = self._raw.get(token_id)
        if raw is None:
            text = self(token_id)
            raw = text.encode("utf-8")
            if REPLACEMENT in text:
                raw = self._piece_bytes(token_id) or raw
            self._raw[token_id] = raw
        return raw

    def _piece_bytes(self, token_id: int) -> bytes | None:
        """The vocabulary piece's bytes (None where the piece is neither byte-level nor a fallback byte)."""
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return None
        fallback = _FALLBACK_PIECE.fullmatch(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        alphabet = self._byte_alphabet()
        if piece and all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
        return None

    def _byte_alphabet(self) -> dict[str, int]:
        if self._alphabet is None:
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self._alphabet = {c: b for b, c in bytes_to_unicode().items()}
        return self._alphabet


__all__ = ["TokenNames"]
