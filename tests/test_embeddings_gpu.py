"""Embeddings on the GPU path (Triton attention, CUDA graphs, launch-ahead), float32: shared inputs
give the vectors of the same inputs with nothing shared, for "last" and "mean" pooling, in a first
pass (each document's blocks computed once, the chunks behind it) and a second (every prompt cached
but its last token, so the last rows run in decode-sized, graphed steps). Skipped without CUDA."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch

from prefixserve import LLM, PoolingParams
from tests.conftest import TINY_CONFIG, assert_pool_empty

pytestmark = pytest.mark.gpu


def _inputs(salt: str | None) -> list[dict[str, Any]]:
    rng = random.Random(0)
    out = []
    for d, doc_len in enumerate((5, 16, 100, 333)):
        doc = [rng.randrange(100, 20000) for _ in range(doc_len)]
        for c, tail in enumerate((1, 7, 40)):
            item: dict[str, Any] = {
                "prompt_token_ids": doc + [rng.randrange(100, 20000) for _ in range(tail)]
            }
            if salt is not None:
                item["cache_salt"] = f"{salt}-{d}-{c}"
            out.append(item)
    return out


def _vectors(llm: LLM, inputs: list[dict[str, Any]], pooling: str) -> tuple[torch.Tensor, int]:
    outs = llm.embed(inputs, PoolingParams(pooling=pooling, normalize=False))
    return torch.tensor([o.outputs.embedding for o in outs]), sum(o.num_cached_tokens for o in outs)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_shared_embeddings_equal_unshared_on_the_gpu(tmp_path, pooling: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(TINY_CONFIG, hidden_size=256, num_attention_heads=4)))
    llm = LLM(model=f"dummy:{path}", device="cuda", dtype="float32", num_kv_blocks=2048, progress=False)
    assert llm.engine.graphs is not None and llm.engine.async_scheduling
    want, _ = _vectors(llm, _inputs("alone"), pooling)
    for _ in ("first pass", "second pass"):
        got, cached = _vectors(llm, _inputs(None), pooling)
        assert cached > 0
        assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    assert_pool_empty(llm)
