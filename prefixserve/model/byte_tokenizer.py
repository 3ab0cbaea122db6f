"""A tokenizer built in code, for dummy models when the default model's tokenizer is not installed.

Dummy weights exist for benchmarks at real sizes; their prompts must still be text (chat templates,
PML schemas, stop strings), so a dummy model always has a tokenizer. This one is byte-level: one
token per UTF-8 byte, no merges (prompts run about 4x as many tokens as words; benchmarks size their
text in tokens), plus the ChatML special tokens and template the default model uses. It is built
with the ``tokenizers`` library (transformers' own dependency): nothing is downloaded or shipped.
"""

from __future__ import annotations

from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


def byte_tokenizer() -> Any:
    """A transformers fast tokenizer: 3 special tokens (ids 0-2), then the 256 bytes (ids 3-258)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS),
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer
