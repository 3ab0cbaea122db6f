"""Gated DeltaNet, the linear-attention layer of Qwen3.5 and Qwen3-Next: a projection into q, k, v
(through a short causal convolution with SiLU), an output gate z and the rule's beta and decay; the
gated delta rule (``gated_delta_ref``) over a fixed-size state per value head; a gated RMSNorm of the
output by z; the output projection.

A sequence carries two states per layer from one step to the next: the convolution's last
``kernel - 1`` inputs and the rule's [Hv, Dk, Dv] state. They live in slots (``kv/state_slots.py``):
the step hands every layer its ``LinearStep`` (through ``AttentionMetadata.linear``), which names
each sequence's slot and whether it starts fresh (its chunk begins at token 0: zero states). A
chunked prefill continues from the slot; decode reads and writes it a token at a time.

On CUDA a decode step runs this project's in-place kernel over the slots
(``kernels/gated_delta_decode.py``), and a step with a prefill fla-core's chunked kernel where it is
installed (``gated_delta_fla``); elsewhere the PyTorch forms here, one sequence at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from prefixserve.model.config import ModelConfig
from prefixserve.model.gated_delta_ref import chunked, prepare_qk, recurrent_ref
from prefixserve.model.linear import Projection

QWEN3_5, QWEN3_NEXT = "qwen3_5", "qwen3_next"  # how a checkpoint stores the input projection


@dataclass(slots=True)
class LinearStep:
    """What the linear layers read of a step: each sequence's state slot and query rows, and the slots'
    tensors, per linear layer ``(conv [N, C, K - 1], state [N, Hv, Dk, Dv] fp32)``."""

    slots: list[int]
    starts: list[int]  # [S + 1] query rows: sequence s owns starts[s]:starts[s + 1]
    fresh: list[bool]  # the chunk begins at token 0: states start at zero
    states: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # (slots, starts, fresh or None where none is) on the device, made once a step for every layer
    on_device: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
    # per sequence: (rows into its chunk, slot) of the prefix snapshots its chunk takes (may be empty)
    snapshots: list[list[tuple[int, int]]] = field(default_factory=list)

    @property
    def decode(self) -> bool:
        """One row per sequence: the batched path (a snapshot it takes is its slot's final states)."""
        return self.starts[-1] == len(self.slots)

    def end_snapshots(self) -> list[tuple[int, int]]:
        """(slot, snapshot slot) of a decode step's snapshots: each taken after its sequence's row."""
        return [
            (slot, snap) for slot, taken in zip(self.slots, self.snapshots, strict=True) for _, snap in taken
        ]

    def cuts(self, s: int) -> list[tuple[int, int | None]]:
        """Sequence ``s``'s chunk as (end row into it, the snapshot slot taken there or None)."""
        n = self.starts[s + 1] - self.starts[s]
        taken = self.snapshots[s] if self.snapshots else []
        return [*taken, (n, None)] if not taken or taken[-1][0] != n else list(taken)

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(slots, starts, fresh or None) on ``device``: copied once a step, not once a layer."""
        if self.on_device is None or self.on_device[0].device != device:
            slots = torch.tensor(self.slots, dtype=torch.long).to(device, non_blocking=True)
            starts = torch.tensor(self.starts, dtype=torch.long).to(device, non_blocking=True)
            fresh = torch.tensor(self.fresh).to(device, non_blocking=True) if any(self.fresh) else None
            self.on_device = (slots, starts, fresh)
        return self.on_device

    @classmethod
    def scratch(cls, query_lens: list[int], seq_lens: list[int]) -> LinearStep:
        """A step of sequences that all start at token 0, its states thrown away after it (a forward
        outside the engine's steps: one prefill, a test); the layers make their zero states."""
        if any(q != s for q, s in zip(query_lens, seq_lens, strict=True)):
            raise ValueError("a linear-attention layer continues a sequence only from its state slot")
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        return cls(list(range(len(query_lens))), starts, [True] * len(query_lens))


class InProj(Projection):
    """The input projection as one matmul: rows [q | k | v | z | b | a] (q, k of Hk * Dk; v, z of
    Hv * Dv; b, a of Hv). Qwen3.5 stores ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
    ``in_proj_a``; Qwen3-Next ``in_proj_qkvz`` and ``in_proj_ba`` grouped by key head, regrouped at
    load (``checkpoint_pieces``)."""

    def __init__(self, config: ModelConfig, layout: str) -> None:
        self.kh, self.vh = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.layout = layout
        key, value = self.kh * self.dk, self.vh * self.dv
        super().__init__(config.hidden_size, 2 * key + 2 * value + 2 * self.vh, bias=False)
        self.sizes = [2 * key + value, value, self.vh, self.vh]  # qkv, z, b, a

    def checkpoint_pieces(self, prefix: str) -> dict[str, list[tuple]]:
        """{parameter: [(checkpoint tensor, rows, dim, span, its shape, convert)]} (the loader's form)."""
        hidden, name = self.in_features, f"{prefix}.weight"
        base = prefix.rpartition(".")[0]
        if self.layout == QWEN3_5:
            pieces, at = [], 0
            for part, rows in zip(
                ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), self.sizes, strict=True
            ):
                pieces.append(
                    (f"{base}.{part}.weight", slice(at, at + rows), 0, (0, rows), (rows, hidden), None)
                )
                at += rows
            return {name: pieces}
        kh, dk, rep_dv, rep = self.kh, self.dk, self.vh // self.kh * self.dv, self.vh // self.kh

        def qkvz(t: torch.Tensor) -> torch.Tensor:  # [Hk (q k v z), H] -> [q | k | v | z]
            q, k, v, z = t.view(kh, -1, hidden).split([dk, dk, rep_dv, rep_dv], 1)
            return torch.cat([x.reshape(-1, hidden) for x in (q, k, v, z)])

        def ba(t: torch.Tensor) -> torch.Tensor:  # [Hk (b a), H] -> [b | a]
            b, a = t.view(kh, 2 * rep, hidden).split([rep, rep], 1)
            return torch.cat([b.reshape(-1, hidden), a.reshape(-1, hidden)])

        first = self.sizes[0] + self.sizes[1]
        rows_ba = 2 * self.vh
        return {
            name: [
                (f"{base}.in_proj_qkvz.weight", slice(0, first), 0, (0, first), (first, hidden), qkvz),
                (f"{base}.in_proj_ba.weight", slice(first, None), 0, (0, rows_ba), (rows_ba, hidden), ba),
            ]
        }


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output times SiLU(z): scales by ``w`` (not the (1 + w) of the model's
    other norms, so not an ``RMSNorm``, whose weights the loader offsets)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # [..., D] each
        dtype = x.dtype
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (self.weight * normed * F.silu(gate.float())).to(dtype)


class Conv(nn.Module):
    """The depthwise causal convolution's weight, [C, 1, K] as checkpoints hold it."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        layout = QWEN3_NEXT if config.architecture == QWEN3_NEXT else QWEN3_5
        self.in_proj = InProj(config, layout)
        p = self.in_proj
        self.key_dim, self.value_dim = p.kh * p.dk, p.vh * p.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = config.linear_conv_kernel_dim
        self.conv1d = Conv(self.conv_dim, self.kernel)
        self.A_log = nn.Parameter(torch.empty(p.vh))
        self.dt_bias = nn.Parameter(torch.empty(p.vh))
        self.norm = GatedRMSNorm(p.dv, config.rms_norm_eps)
        self.out_proj = Projection(self.value_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, step: LinearStep) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        p = self.in_proj
        qkv, z, b, a = p(x).split(p.sizes, -1)
        if self.layer not in step.states:  # a scratch step (``LinearStep.scratch``)
            n, dtype = len(step.slots), x.dtype
            step.states[self.layer] = (
                torch.zeros((n, self.conv_dim, self.kernel - 1), dtype=dtype, device=x.device),
                torch.zeros((n, p.vh, p.dk, p.dv), dtype=torch.float32, device=x.device),
            )
        conv_state, state = step.states[self.layer]
        mixed = self._conv(qkv, step, conv_state)  # [T, C]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], -1)
        tokens = x.shape[0]
        q, k = q.reshape(tokens, p.kh, p.dk), k.reshape(tokens, p.kh, p.dk)
        v = v.reshape(tokens, p.vh, p.dv)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = self._rule(q, k, v, g, beta, step, state)  # [T, Hv, Dv]
        if step.decode and any(step.snapshots):
            copy_slots(step.end_snapshots(), conv_state, state)
        out = self.norm(out.to(x.dtype), z.reshape(tokens, p.vh, p.dv))
        return self.out_proj(out.reshape(tokens, self.value_dim))

    def _conv(self, qkv: torch.Tensor, step: LinearStep, conv_state: torch.Tensor) -> torch.Tensor:
        """SiLU of the causal depthwise convolution of each sequence's rows, continuing from its
        slot's last ``K - 1`` inputs (zeros when fresh), which it then overwrites."""
        weight = self.conv1d.weight[:, 0]  # [C, K]
        keep = self.kernel - 1
        if step.decode:  # every sequence one row: all at once
            slots, _, fresh = step.tensors(qkv.device)
            prev = conv_state.index_select(0, slots)  # [S, C, K - 1]
            if fresh is not None:
                prev = prev.masked_fill(fresh[:, None, None], 0.0)
            window = torch.cat([prev, qkv[:, :, None].to(prev.dtype)], -1)  # [S, C, K]
            conv_state.index_copy_(0, slots, window[:, :, 1:])
            return F.silu((window * weight).sum(-1).to(qkv.dtype))
        out = torch.empty_like(qkv)
        for s, slot in enumerate(step.slots):
            lo, hi = step.starts[s], step.starts[s + 1]
            prev = conv_state[slot] if not step.fresh[s] else torch.zeros_like(conv_state[slot])
            window = torch.cat([prev, qkv[lo:hi].T.to(prev.dtype)], -1)  # [C, K - 1 + n]
            conv_state[slot] = window[:, -keep:]
            for rows, snap in step.snapshots[s] if step.snapshots else ():
                conv_state[snap] = window[:, rows : rows + keep]  # the inputs before row ``rows``
            out[lo:hi] = F.conv1d(window[None], self.conv1d.weight, groups=self.conv_dim)[0].T.to(qkv.dtype)
        return F.silu(out)

    def _rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        step: LinearStep,
        state: torch.Tensor,
    ) -> torch.Tensor:
        """The gated delta rule over each sequence's rows from its slot's state, written back."""
        if q.is_cuda and step.decode:  # one token each: in place over the slots
            from prefixserve.model.kernels import gated_delta_decode

            slots, _, fresh = step.tensors(q.device)
            return gated_delta_decode.decode(q, k, v, g, beta, slots, fresh, state)
        if q.is_cuda:
            from prefixserve.model import gated_delta_fla

            if gated_delta_fla.available():
                if any(step.snapshots):  # cut at their rows
                    cuts = [step.cuts(s) for s in range(len(step.slots))]
                    return gated_delta_fla.run_cut(
                        q, k, v, g, beta, step.slots, step.starts, step.fresh, state, cuts
                    )
                return gated_delta_fla.run(q, k, v, g, beta, step.tensors(q.device), state)
        qf, kf = prepare_qk(q, k, v.shape[1])
        out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        for s, slot in enumerate(step.slots):
            lo = step.starts[s]
            carry = torch.zeros_like(state[slot]) if step.fresh[s] else state[slot]
            a = lo
            for rows, snap in step.cuts(s):  # up to each snapshot, then to the chunk's end
                b = lo + rows
                form = recurrent_ref if b - a == 1 else chunked
                out[a:b], carry = form(qf[a:b], kf[a:b], v[a:b], g[a:b], beta[a:b], carry)
                if snap is not None:
                    state[snap] = carry
                a = b
            state[slot] = carry
        return out


def copy_slots(pairs: list[tuple[int, int]], *tensors: torch.Tensor) -> None:
    """Each ``src`` slot's rows of ``tensors`` copied into ``dst``. The slot ids go to the device
    from pinned memory without waiting: indexing a CUDA tensor with Python lists made the host wait
    for the stream (78 ms behind a queue of 30 matmuls on an H200), undoing launch-ahead at every
    step that takes a snapshot or forks samples."""
    index = torch.tensor(list(zip(*pairs, strict=True)), dtype=torch.long)  # [2, P]: src, dst
    device = tensors[0].device
    if device.type == "cuda":
        index = index.pin_memory().to(device, non_blocking=True)
    src, dst = index[0], index[1]
    for t in tensors:
        t.index_copy_(0, dst, t.index_select(0, src))


__all__ = ["QWEN3_5", "QWEN3_NEXT", "GatedDeltaNet", "GatedRMSNorm", "InProj", "LinearStep", "copy_slots"]
