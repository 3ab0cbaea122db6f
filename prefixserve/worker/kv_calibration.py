"""The e4m3 KV cache's scales, chosen once at start (``kv_cache_dtype="fp8"``; attention/kv_quant.py):
K's from a calibration (K is stored rotated), V's a checkpoint's ``v_scale`` where it has them, else
the calibration's.

One forward of a fixed calibration prompt into a small cache of the model's dtype gives each layer's
largest |K| and |V| per KV head; the scale maps twice that to e4m3's 448 (the margin leaves headroom
for values the prompt did not show; larger ones saturate), rounded up to a power of two. Measured on
SmolLM2-135M (tests/test_fp8_kv_model.py): next-token top-1 agreement with the model-dtype cache and
the mean KL are in docs/kernels.md. The same prompt on every rank and every start: the scales, which
block digests name, are the same from one start to the next, so disk and Prompt Cache entries stay valid.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from prefixserve.attention.backend import make_backend
from prefixserve.attention.kv_quant import pow2_scales, rotate
from prefixserve.attention.metadata import build_metadata
from prefixserve.kv.cache import KVCache
from prefixserve.kv.layout import plain_layout
from prefixserve.model.config import ModelConfig

CALIBRATION_TOKENS = 256
MARGIN = 2.0  # the scale covers twice the largest |K| / |V| the calibration prompt showed
_SEED = 20260  # the calibration prompt's token ids: a fixed draw, the same everywhere


def calibration_ids(vocab_size: int, tokens: int = CALIBRATION_TOKENS) -> torch.Tensor:
    """The calibration prompt: a fixed draw of ``tokens`` ids (no tokenizer is at hand here)."""
    gen = torch.Generator().manual_seed(_SEED)
    return torch.randint(0, vocab_size, (tokens,), generator=gen)


@torch.inference_mode()
def kv_amax(model: torch.nn.Module, kv: KVCache, dtype: torch.dtype, ids: torch.Tensor) -> torch.Tensor:
    """Largest |K| and |V| per layer and KV head ([layers, 2, heads], ``kv.scales``' shape) over ``ids``
    at positions 0.., from one forward into a scratch cache of ``dtype``."""
    config, bs, device = model.config, kv.block_size, kv.device
    n = len(ids)
    blocks = -(-n // bs)
    scratch = KVCache(config, blocks, bs, dtype, device, kv.shard, kv.total_kv_heads, plain_layout(config))
    meta = build_metadata(bs, [n], [n], [list(range(blocks))], device)
    ids_d, pos = ids.to(device), torch.arange(n, device=device)
    model(ids_d, pos, scratch.layers, meta, make_backend("reference"))
    assert kv.scales is not None
    amax = torch.zeros_like(kv.scales)
    for i, (k_cache, v_cache) in enumerate(scratch.layers):
        heads = k_cache.shape[-2]
        for j, cache in enumerate((k_cache, v_cache)):
            rows = cache.flatten(0, 1)[:n].float()  # [n, heads, D]
            if j == 0:  # K as the e4m3 cache stores it: rotated
                rows = rotate(rows)
            amax[i, j, :heads] = rows.abs().amax(dim=(0, 2))
    return amax


def checkpoint_scales(model: torch.nn.Module, kv: KVCache) -> torch.Tensor | None:
    """The checkpoint's ``k_scale`` / ``v_scale`` as ``kv.scales`` (this rank's heads; a scalar applies to
    every head; 1 where it has none), or None unless it has a ``v_scale`` for every layer that writes
    KV, the only one ``calibrate_kv_scales`` takes (a hybrid's linear layers and Gemma 4's KV-shared
    ones take their writer's: ``as_written``; ``loader._kv_scale``). Requiring ``k_scale`` too
    dropped the ``v_scale`` of a checkpoint that publishes V's alone."""
    found: dict[tuple[int, int], torch.Tensor] = getattr(model, "checkpoint_kv_scales", {})
    assert kv.scales is not None
    layers, _, width = kv.scales.shape
    writers = [i for i in range(layers) if model.config.kv_source(i) == i]  # the others take theirs
    if any((i, 1) not in found for i in writers):
        return None
    start, stop = kv.shard.kv_head_span(kv.total_kv_heads)
    out = torch.ones(layers, 2, width)
    for (i, j), value in found.items():
        if i < layers:
            heads = kv.layers[i][0].shape[-2]
            out[i, j, :heads] = value if value.numel() == 1 else value[start:stop][:heads]
    # up to a power of two: folding a scale into bf16 q and outputs is then exact (a checkpoint's
    # 0.0213 would be rounded there but not where the values were divided by it)
    return torch.exp2(torch.ceil(torch.log2(out.clamp_min(1e-30)))).to(kv.scales.device)


def as_written(scales: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """``scales`` with each layer that reads another's cache (Gemma 4's KV-shared layers; a hybrid's
    linear layers, handed one they never read) taking that layer's: the codes it reads were written
    under the writer's scales, whatever a checkpoint publishes for the reader."""
    out = scales.clone()
    for i in range(out.shape[0]):
        source = config.kv_source(i)
        if source != i:
            out[i] = scales[source]
    return out


def calibrate_kv_scales(model: torch.nn.Module, kv: KVCache, dtype: torch.dtype) -> None:
    """Fix ``kv``'s e4m3 scales (before any block is written): V's the checkpoint's where it has them
    for every layer, else from the calibration prompt; K's from the calibration prompt always (the
    cache stores K rotated, ``kv_quant.rotate``, whose range a checkpoint's ``k_scale`` does not
    describe)."""
    scales = pow2_scales(kv_amax(model, kv, dtype, calibration_ids(model.config.vocab_size)), MARGIN)
    published = checkpoint_scales(model, kv)
    if published is not None:
        scales[:, 1] = published[:, 1]
    kv.set_scales(as_written(scales, model.config), model_dtype=dtype)
    if kv.shard.size > 1:  # the scheme names every rank's scales (``KVCache.join_scales``)
        per_rank = [torch.empty_like(scales) for _ in range(kv.shard.size)]
        dist.all_gather(per_rank, scales.contiguous(), group=kv.shard.group)
        kv.join_scales(per_rank)
