"""``gpu_memory_utilization`` on a GPU (vLLM's --gpu-memory-utilization): the engine's weights, KV pool
and steps stay within the share of the GPU's memory it was given."""

from __future__ import annotations

import pytest
import torch

from prefixserve import LLM, SamplingParams


@pytest.mark.gpu
def test_the_engine_stays_within_its_share_of_the_gpu() -> None:
    """On a GPU: weights, KV pool and steps of an 8B-shaped model stay under the share asked for."""
    free, total = torch.cuda.mem_get_info()
    others = total - free  # held before the engine starts (the CUDA context, other processes)
    share = 0.3
    llm = LLM(model="dummy:llama-3.1-8b", progress=False, gpu_memory_utilization=share, max_num_seqs=64)
    torch.cuda.reset_peak_memory_stats()  # loading's transient peak is not the steps'
    try:
        pool = llm.engine.pool.num_blocks
        outs = llm.generate([{"prompt_token_ids": list(range(100, 1100))}] * 8, SamplingParams(max_tokens=32))
        assert all(len(o.outputs[0].token_ids) == 32 for o in outs)
        used = torch.cuda.max_memory_reserved() + others
        assert used <= share * total * 1.02, (used / 2**30, share * total / 2**30, pool)
        assert pool * 16 >= 64 * 1024, pool  # a real pool, not a sliver: the share left room for it
    finally:
        llm.shutdown()
