"""Mixture-of-experts families on a GPU: tiny random Qwen3-MoE, Mixtral, gpt-oss and Gemma 4 MoE
checkpoints (power-of-two heads, as the Triton attention kernels take) in fp32 on CUDA, through the
fused MoE kernels (inside the decode graphs but for gpt-oss, whose sinks keep attention eager): greedy
tokens equal HF's on the same device, and equal with the shared-segment kernels (prefix cache and
repeat) and with the reference backend."""

from __future__ import annotations

import pytest
import torch

from prefixserve import LLM, SamplingParams
from tests.conftest import assert_pool_empty
from tests.test_moe_families import _prompt, tiny_checkpoint

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "gpt_oss", "gemma4_moe"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    name = request.param
    if name.startswith("gemma4"):
        pytest.importorskip("transformers.models.gemma4", reason="this transformers has no Gemma 4")
    directory = tmp_path_factory.mktemp(name)
    sizes = {"head_dim": 32, "num_attention_heads": 4}
    if name.startswith("gemma4"):
        sizes["global_head_dim"] = 32
    return name, directory, tiny_checkpoint(name, directory, **sizes)


def _run_setup(directory, count: int, tokens: int) -> tuple[list[dict], SamplingParams, dict]:
    """``count`` prompts sharing a 60-token prefix, greedy params for ``tokens`` tokens, and the fp32
    CUDA engine arguments of the checkpoint in ``directory``."""
    prefix = _prompt(5, 60)
    prompts = [{"prompt_token_ids": prefix + _prompt(20 + i, 5 + 3 * i)} for i in range(count)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens)
    args = {"model": str(directory), "dtype": "float32", "device": "cuda", "num_kv_blocks": 256}
    args |= {"block_size": 16, "max_num_batched_tokens": 128, "progress": False}
    return prompts, params, args


def test_greedy_tokens_equal_hf_and_with_sharing(family) -> None:
    name, directory, hf = family
    prompts, params, args = _run_setup(directory, 8, 24)
    plain = LLM(attention="reference", enable_prefix_caching=False, **args)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    sinks = name == "gpt_oss"  # sinks: the Triton kernels' LSE, no decode graphs
    fast = LLM(attention="triton", **args)
    for _ in range(2):  # the second round: the prefix from the cache
        assert [o.outputs[0].token_ids for o in fast.generate(prompts, params)] == want
    if not sinks:
        assert fast.engine.graphs is not None and fast.engine.graphs.captures >= 1
    assert_pool_empty(fast)
    hf = hf.cuda()
    ids = prompts[0]["prompt_token_ids"]
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids], device="cuda"), max_new_tokens=24, min_new_tokens=24, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
    assert out[0, len(ids) :].tolist() == want[0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_gpus_equal_one(family) -> None:
    """Tensor parallelism over 2 GPUs (NCCL and the peer all-reduce): each expert's intermediate columns
    split over the ranks, the fused MoE kernels on each shard; greedy fp32 tokens equal one GPU's."""
    name, directory, _ = family
    prompts, params, args = _run_setup(directory, 6, 16)
    one = LLM(**args)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    del one
    with LLM(tensor_parallel_size=2, **args) as two:
        got = [o.outputs[0].token_ids for o in two.generate(prompts, params)]
    assert got == want, name


def test_parts_summed_by_the_norm_give_the_combined_logprobs(family) -> None:
    """Each MoE layer handing its k weighted expert outputs to the next norm (``fused.moe_parts_to_norm``,
    on by default) gives the tokens and logprobs that the combine kernel gives, to the bit, through
    prefill, graphed decode and the prefix cache."""
    from prefixserve.model import fused

    _, directory, _ = family
    prompts, params, args = _run_setup(directory, 6, 16)
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, logprobs=2)
    runs = {}
    for on in (False, True):
        with fused.moe_parts_to_norm(on):
            llm = LLM(attention="triton", **args)
            outs = [o.outputs[0] for o in llm.generate(prompts, params)]
            runs[on] = [(o.token_ids, o.token_logprobs, o.top_logprobs) for o in outs]
            llm.shutdown()
    assert runs[True] == runs[False]
