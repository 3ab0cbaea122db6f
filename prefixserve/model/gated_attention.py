"""The full-attention layers of Qwen3.5 and Qwen3-Next: Qwen3's attention (QK-norm, KV cache, every
attention backend) with q_proj doubled into a per-head output gate (the attention output times
sigmoid(gate) before o_proj) and RoPE on the first ``partial_rotary_factor`` of each head.

The partial rotation runs on the model's one RoPE path: the loader reorders each q and k head (rows of
q_proj and k_proj, the QK-norm weights, ``rope_order``) so that HF's rotate-half pairs (j, j + r/2),
j < r/2, of the rotated dims are the whole head's first pairs (j, j + D/2); the ``partial`` RoPE turns
those and leaves the others (frequency 0). q . k is the same under one reordering of both, and V is
not reordered: the attention output is HF's.
"""

from __future__ import annotations

import torch

from prefixserve.model import fused
from prefixserve.model.config import LayerSpec, ModelConfig
from prefixserve.model.linear import Projection
from prefixserve.model.parallel import Shard
from prefixserve.model.rotary import Rope

Pieces = dict[str, list[tuple]]


def rope_order(dim: int, rotary: int) -> torch.Tensor:
    """New dim p of a head holds HF's dim ``order[p]``: the rotated dims' first halves, the passed
    dims' first half, the rotated dims' second halves, the passed dims' second half."""
    half, rest = rotary // 2, (dim - rotary) // 2
    parts = [range(half), range(rotary, rotary + rest), range(half, rotary), range(rotary + rest, dim)]
    return torch.tensor([i for part in parts for i in part], device="cpu")  # not the meta device


class GatedQKV(Projection):
    """q, k, v and the output gate as one matmul: rows [q | k | v | gate], q and k heads in
    ``rope_order``; from HF's q_proj (each head's q rows, then its gate rows), k_proj, v_proj."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, dim: int, order: torch.Tensor) -> None:
        super().__init__(hidden, (2 * heads + 2 * kv_heads) * dim, bias=False)
        self.heads, self.kv_heads, self.dim, self.order = heads, kv_heads, dim, order

    def checkpoint_pieces(self, prefix: str) -> Pieces:
        hidden, h, kv, d, order = self.in_features, self.heads, self.kv_heads, self.dim, self.order
        base = prefix.rpartition(".")[0]

        def q(t: torch.Tensor) -> torch.Tensor:
            return t.view(h, 2, d, hidden)[:, 0][:, order].reshape(h * d, hidden)

        def gate(t: torch.Tensor) -> torch.Tensor:
            return t.view(h, 2, d, hidden)[:, 1].reshape(h * d, hidden)

        def k(t: torch.Tensor) -> torch.Tensor:
            return t.view(kv, d, hidden)[:, order].reshape(kv * d, hidden)

        q_full, kv_rows = (2 * h * d, hidden), kv * d
        at = [0, h * d, h * d + kv_rows, h * d + 2 * kv_rows, 2 * h * d + 2 * kv_rows]
        return {
            f"{prefix}.weight": [
                (f"{base}.q_proj.weight", slice(at[0], at[1]), 0, (0, 2 * h * d), q_full, q),
                (f"{base}.k_proj.weight", slice(at[1], at[2]), 0, (0, kv_rows), (kv_rows, hidden), k),
                (f"{base}.v_proj.weight", slice(at[2], at[3]), 0, (0, kv_rows), (kv_rows, hidden), None),
                (f"{base}.q_proj.weight", slice(at[3], at[4]), 0, (0, 2 * h * d), q_full, gate),
            ]
        }


def ordered_norm_pieces(prefix: str, dim: int, order: torch.Tensor) -> Pieces:
    """A QK-norm's weight in ``rope_order``."""
    name = f"{prefix}.weight"
    return {name: [(name, slice(None), 0, (0, dim), (dim,), lambda t: t[order])]}


def gated_attention_init(attn: torch.nn.Module, config: ModelConfig, shard: Shard, spec: LayerSpec) -> None:
    """Make ``attn`` (an ``Attention`` just built) the gated, partially rotated attention."""
    if shard.parallel or config.attention_bias:
        raise ValueError("Qwen3.5 / Qwen3-Next attention runs on one device, without biases")
    dim = spec.head_dim
    factor = float(spec.rope.scaling_dict.get("partial_rotary_factor", 1.0))
    order = rope_order(dim, int(dim * factor))
    attn.qkv_proj = GatedQKV(config.hidden_size, attn.num_heads, attn.num_kv_heads, dim, order)
    for norm in (attn.q_norm, attn.k_norm):
        norm.checkpoint_pieces = lambda prefix, d=dim, o=order: ordered_norm_pieces(prefix, d, o)
    attn.gate = None


def gated_rotated(
    attn: torch.nn.Module, x: torch.Tensor, rope: Rope, cache: fused.KVWrite | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of ``x`` with QK-norm and RoPE (K/V written to ``cache``); the gate kept for
    ``gated_output``."""
    proj = attn.qkv_proj(x)
    split = proj.shape[1] - attn.num_heads * attn.head_dim
    attn.gate = proj[:, split:]
    norms = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps)
    shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
    return fused.rope_qkv(proj[:, :split].contiguous(), *rope, *shape, cache, x.dtype, norms)


def gated_output(attn: torch.nn.Module, out: torch.Tensor) -> torch.Tensor:  # [T, Hq, D] -> [T, Hq D]
    """The attention output times sigmoid of the gate of the same step's ``gated_rotated``."""
    gate, attn.gate = attn.gate, None
    return out.reshape(out.shape[0], -1) * torch.sigmoid(gate)


__all__ = ["GatedQKV", "gated_attention_init", "gated_output", "gated_rotated", "rope_order"]
