"""Text prompts' token ids as vLLM takes them: the tokenizer's BOS in front, once.

A tokenizer that adds a BOS (a Llama's) is built here (bytes, no merges, ``<s>`` first); a dummy model
whose config sits beside its files takes it. The default model's tokenizer adds none, so nothing
changes for it (its ids are checked too).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.engine.prompt_tokens import added_bos, behind_pinned, encode_prompt, encode_prompts
from prefixserve.model.loader import load_tokenizer
from tests.conftest import TINY_CONFIG

BOS = 0
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def _bos_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({ch: len(specials) + i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)]
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("bos")
    _bos_tokenizer().save_pretrained(directory)
    (directory / "config.json").write_text(json.dumps(dict(TINY_CONFIG, vocab_size=512, eos_token_id=1)))
    return directory / "config.json"


def test_one_bos_in_front() -> None:
    tok = _bos_tokenizer()
    assert added_bos(tok) == BOS
    plain = tok.encode("hi there", add_special_tokens=False)
    assert encode_prompt(tok, "hi there") == [BOS, *plain]
    assert encode_prompt(tok, "<s>hi there") == [BOS, *plain]  # a rendered chat's BOS: not a second
    assert encode_prompts(tok, ["hi there", "<s>hi there"]) == [[BOS, *plain]] * 2
    head = encode_prompt(tok, "<s>[system] Be brief.\n")
    assert behind_pinned(head, [BOS, *plain], tok) == head + plain
    assert behind_pinned(head, head + plain, tok) == head + plain  # already behind it
    default = load_tokenizer(None)  # the default model's: adds nothing, so nothing changes
    assert added_bos(default) is None
    assert encode_prompt(default, "hi there") == default.encode("hi there", add_special_tokens=False)


def test_engine_prompts_open_with_one_bos(bos_model: Path) -> None:
    llm = LLM(
        model=f"dummy:{bos_model}",
        device="cpu",
        dtype="float32",
        num_kv_blocks=128,
        progress=False,
        system_prompts={"shop": "Be brief."},
    )
    tok = llm.get_tokenizer()
    params = SamplingParams(max_tokens=2, temperature=0.0)
    plain = tok.encode("Hello world", add_special_tokens=False)
    alone = llm.generate("Hello world", params)[0]
    batch = llm.generate(["Hello world", "Bye"], params)  # the offline API's batch tokenizing
    chat = llm.chat([{"role": "user", "content": "Hello world"}], params)[0]  # the template's BOS
    pinned = llm.generate("Hello world", params, application="shop")[0]
    for out in (alone, batch[0], chat, pinned):
        ids = list(out.prompt_token_ids)
        assert ids[0] == BOS and BOS not in ids[1:], ids
    assert list(alone.prompt_token_ids) == list(batch[0].prompt_token_ids) == [BOS, *plain]
    assert list(pinned.prompt_token_ids)[-len(plain) :] == plain
    assert pinned.num_cached_tokens > 0  # the pinned prompt's blocks lead it


def test_a_chats_add_special_tokens_as_vllm_takes_it() -> None:
    """A chat whose template writes no BOS: unset or true puts the tokenizer's in front (once), false
    encodes the rendered text alone; /tokenize's messages count the same ids."""
    from prefixserve.protocols.openai.prepare import OpenAIContext, prepare_chat, prompt_ids

    tok = _bos_tokenizer()
    tok.chat_template = TEMPLATE.replace("{{ bos_token }}", "")
    ctx = OpenAIContext(model="m", tokenizer=tok, system_prompts={})
    messages = [{"role": "user", "content": "hi there"}]
    firsts = {}
    for flag in (None, True, False):
        body = {"messages": messages} | ({} if flag is None else {"add_special_tokens": flag})
        prep = prepare_chat(ctx, body)
        ids = prompt_ids(ctx, prep, prep.prompts[0])
        assert ids is not None and ids.count(BOS) <= 1
        firsts[flag] = ids[0]
    assert firsts == {None: BOS, True: BOS, False: tok.encode("[", add_special_tokens=False)[0]}
