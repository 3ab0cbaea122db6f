"""The families on a GPU: tiny random Qwen3 and Gemma 3 checkpoints (power-of-two heads, as the Triton
kernels take) in fp32 on CUDA; logits equal HF's on the same device, and greedy tokens of prompts
sharing a prefix three windows long equal with the Triton shared-segment and window kernels (attention
"triton", piecewise graphs) and with the reference backend."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefixserve import LLM, SamplingParams
from tests.conftest import assert_pool_empty
from tests.test_model_families import WINDOW, _prompt, tiny_checkpoint

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["qwen3_sliding", "gemma3_text"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    name = request.param
    directory = tmp_path_factory.mktemp(name)
    return name, directory, tiny_checkpoint(name, directory, head_dim=32, num_attention_heads=4)


def _llm(directory: Path, attention: str, keep_sliding_kv: bool = False) -> LLM:
    return LLM(
        keep_sliding_kv=keep_sliding_kv,
        model=str(directory),
        dtype="float32",
        device="cuda",
        attention=attention,
        num_kv_blocks=256,
        block_size=16,
        max_num_batched_tokens=128,
        progress=False,
    )


def test_greedy_tokens_equal_with_the_gpu_kernels(family) -> None:
    _, directory, hf = family
    prefix = _prompt(5, 3 * WINDOW + 7)
    prompts = [{"prompt_token_ids": prefix + _prompt(20 + i, 5 + 3 * i)} for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = _llm(directory, "reference", keep_sliding_kv=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    for keep in (True, False):  # every layer's KV kept; the sliding layers' pages given back
        fast = _llm(directory, "triton", keep)  # always the shared-segment path (auto may skip one)
        assert fast.engine.runner.kv.layout.frees_sliding is not keep
        for _ in range(2):  # the second round: the prefix from the cache
            assert [o.outputs[0].token_ids for o in fast.generate(prompts, params)] == want, keep
        graphs = fast.engine.graphs  # decode steps replayed from graphs, sliding layers inside them
        assert graphs is not None and graphs.captures >= 1, keep
        assert_pool_empty(fast)
    hf = hf.cuda()
    ids = prompts[0]["prompt_token_ids"]
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids], device="cuda"), max_new_tokens=24, min_new_tokens=24, do_sample=False
        )
    assert out[0, len(ids) :].tolist() == want[0]
    assert (
        fast.metrics()["attention_kv_tokens_read_total"] < fast.metrics()["attention_kv_tokens_logical_total"]
    )
    assert_pool_empty(fast)
