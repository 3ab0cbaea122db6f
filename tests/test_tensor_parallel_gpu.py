"""Tensor parallelism on GPUs (NCCL): greedy outputs over 2 GPUs equal one GPU's, decode steps under
CUDA graphs with their all-reduces captured. Needs 2 CUDA GPUs (skipped elsewhere)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefixserve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


@pytest.mark.parametrize("attention", ["auto", "triton_paged"])
def test_two_gpus_equal_one_under_cuda_graphs(tiny_config_path: Path, attention: str) -> None:
    shared = [(7 * i) % 40000 + 100 for i in range(200)]
    prompts = [{"prompt_token_ids": [*shared, 1000 + j, 2000 + j]} for j in range(6)]
    prompts.append({"prompt_token_ids": [5, 6, 7]})
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    kwargs = dict(
        model=f"dummy:{tiny_config_path}",
        dtype="float32",
        attention=attention,
        num_kv_blocks=256,
        progress=False,
    )
    single = LLM(**kwargs)
    want = [o.outputs[0].token_ids for o in single.generate(prompts, params)]
    del single
    with LLM(tensor_parallel_size=2, **kwargs) as tp:
        got = [o.outputs[0].token_ids for o in tp.generate(prompts, params)]
        assert got == want
        assert tp.engine.graphs is not None and tp.engine.graphs.captures > 0, "decode left CUDA graphs"
