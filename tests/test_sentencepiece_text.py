"""An output's text after its prompt, as vLLM gives it: a SentencePiece output's first word keeps its
leading space (" Paris.", where decoding the output alone gives "Paris."), because the detokenizer
decodes the output after the prompt's last ids. A byte-level tokenizer's text is unchanged by that."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.detokenizer import IncrementalDetokenizer
from tests.conftest import TINY_CONFIG

WORDS = ["<unk>", "<s>", "</s>", "▁The", "▁capital", "▁of", "▁France", "▁is", "▁Paris", ".", "▁a", "▁city"]


def _metaspace_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    core.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def test_the_first_word_keeps_its_space_after_the_prompt() -> None:
    tok = _metaspace_tokenizer()
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    out = [WORDS.index("▁Paris"), WORDS.index(".")]
    assert tok.decode(out) == "Paris."  # alone, SentencePiece strips the first word's space
    d = IncrementalDetokenizer(tok, context=prompt[-5:])
    assert d.add(out[0]) + d.add(out[1]) == " Paris." and d.full_text == " Paris."
    assert IncrementalDetokenizer(tok, context=[999_999]).add(out) == "Paris."  # undecodable: no context


@pytest.fixture(scope="module")
def metaspace_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("spm")
    _metaspace_tokenizer().save_pretrained(directory)
    config = dict(TINY_CONFIG, vocab_size=len(WORDS), eos_token_id=2)
    (directory / "config.json").write_text(json.dumps(config))
    return directory / "config.json"


def test_engine_text_continues_the_prompt(metaspace_model: Path) -> None:
    llm = LLM(
        model=f"dummy:{metaspace_model}", device="cpu", dtype="float32", num_kv_blocks=64, progress=False
    )
    tok = llm.get_tokenizer()
    prompt = "The capital of France is"
    ids = tok.encode(prompt, add_special_tokens=False)
    params = SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias={0: -100, 1: -100, 2: -100}
    )
    for out in (llm.generate(prompt, params)[0], [*llm.stream(prompt, params)][-1]):
        c = out.outputs[0]
        assert c.text == tok.decode(ids + list(c.token_ids))[len(tok.decode(ids)) :]
        assert c.text.startswith(" ")  # every word here opens with its space
