"""A model too large for its GPUs is refused before any weight is allocated, with the numbers and the
rank count that would fit; the KV pool leaves room for a step. Meta-device models: no memory used."""

from __future__ import annotations

import pytest
import torch

from prefixserve.model.config import ModelConfig
from prefixserve.model.llama import LlamaForCausalLM
from prefixserve.model.loader import CONFIG_DIR
from prefixserve.model.memory_fit import (
    FIXED_RESERVE,
    GiB,
    check_kv_fits,
    check_weights_fit,
    step_reserve,
    weight_bytes,
)
from prefixserve.model.parallel import Shard

GPU = torch.device("cuda", 0)


def _meta_model(name: str, shard: Shard) -> LlamaForCausalLM:
    config = ModelConfig.from_json(CONFIG_DIR / f"{name}.json")
    with torch.device("meta"):
        return LlamaForCausalLM(config, shard).to(torch.bfloat16)


def _free(monkeypatch: pytest.MonkeyPatch, free_gib: float, total_gib: float = 79.2) -> None:
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda device=None: (int(free_gib * GiB), int(total_gib * GiB))
    )


def test_weight_bytes_counts_each_rank_once() -> None:
    whole = weight_bytes(_meta_model("llama-3.1-70b", Shard()))
    half = weight_bytes(_meta_model("llama-3.1-70b", Shard(0, 2)))
    assert 140 * 10**9 < whole < 142 * 10**9  # 70.6B parameters in bf16
    assert abs(half - whole / 2) < 0.01 * whole  # all but the norms split in two


def test_70b_refused_on_one_gpu_and_fits_on_two(monkeypatch: pytest.MonkeyPatch) -> None:
    _free(monkeypatch, 78.5)
    with pytest.raises(
        ValueError, match=r"need 131\.\d GiB .* tensor_parallel_size=1 .* use tensor_parallel_size >= 2"
    ):
        check_weights_fit(_meta_model("llama-3.1-70b", Shard()), GPU, Shard())
    check_weights_fit(_meta_model("llama-3.1-70b", Shard(0, 2)), GPU, Shard(0, 2))  # 65.7 GiB a GPU fits
    _free(monkeypatch, 40.0)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 .* use tensor_parallel_size >= 4"):
        check_weights_fit(_meta_model("llama-3.1-70b", Shard(0, 2)), GPU, Shard(0, 2))
    check_weights_fit(_meta_model("llama-3.1-70b", Shard()), torch.device("cpu"), Shard())  # CPU: not checked


def test_step_reserve_and_kv_refusal() -> None:
    local = Shard(0, 2).local_config(ModelConfig.from_json(CONFIG_DIR / "llama-3.1-70b.json"))
    reserve = step_reserve(local, torch.bfloat16, 2048, 256)
    assert 1.5 * GiB < reserve < 3 * GiB  # activations of 2048 tokens, 256 rows of fp32 logits, 1 GiB
    # what a 70B rank at TP=2 needed on 2 x H100 with 16,384-token steps (docs/kernels.md §8): a 2.86 GiB
    # activation peak, 0.95 GiB the allocator held unallocated when the next allocation failed
    assert step_reserve(local, torch.bfloat16, 16384, 256) >= (2.86 + 0.95) * GiB + FIXED_RESERVE
    check_kv_fits(128, 16, 2048, GPU)
    with pytest.raises(
        ValueError,
        match=r"room for 100 KV blocks \(1600 tokens\).*max_num_batched_tokens=2048: use more GPUs",
    ):
        check_kv_fits(100, 16, 2048, GPU)
    with pytest.raises(
        ValueError, match=r"max_num_batched_tokens=2048: use a higher kv_memory_fraction"
    ) as cpu:
        check_kv_fits(100, 16, 2048, torch.device("cpu"))  # no GPUs to add
    assert "GPUs" not in str(cpu.value)
