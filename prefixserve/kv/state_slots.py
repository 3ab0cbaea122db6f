"""State slots of linear-attention hybrids (Qwen3.5, Qwen3-Next): beside the KV blocks of the full
layers, each running sequence holds one slot, which holds per Gated DeltaNet layer its recurrent
state [Hv, Dk, Dv] (fp32) and its convolution's last inputs [C, K - 1].

``StateSlots`` hands out slot ids on the host (the block manager takes one for a sequence at its
first step and gives it back when it frees the sequence: finish, abort, preemption); a preempted
sequence recomputes from token 0, and a chunk that starts at token 0 starts from zero states
(``LinearStep.fresh``), so a slot is never cleared. A forked sample (n > 1) gets its parent's states
copied into a slot of its own before its first step. ``StatePool`` holds the slots' tensors on the
device; their bytes come off the KV pool's budget (``bytes_per_slot``).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from prefixserve.model.config import ModelConfig
from prefixserve.model.gated_delta import LinearStep


class StateSlots:
    """Slot ids of the sequences holding one (host side); copies queued for the next step."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped lowest first
        self._of: dict[Hashable, int] = {}
        self._copies: list[tuple[int, int]] = []

    def slot(self, seq: Hashable) -> int:
        """``seq``'s slot, taken at its first step."""
        slot = self._of.get(seq)
        if slot is None:
            if not self._free:
                raise RuntimeError(
                    f"all {self.num_slots} linear-attention state slots are held: a hybrid model runs at "
                    "most max_num_seqs sequences (samples included) at once"
                )
            slot = self._of[seq] = self._free.pop()
        return slot

    def slots(self, seqs: list[Hashable]) -> list[int]:
        return [self.slot(s) for s in seqs]

    def free(self, seq: Hashable) -> None:
        slot = self._of.pop(seq, None)
        if slot is not None:
            self._free.append(slot)

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """The child's slot, the parent's states copied into it before the next step."""
        self._copies.append((self.slot(parent), self.slot(child)))

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies

    @property
    def num_held(self) -> int:
        return len(self._of)


class StatePool:
    """The slots' tensors: per linear layer (conv [N, C, K - 1] in the model's dtype, state
    [N, Hv, Dk, Dv] fp32)."""

    def __init__(self, config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        conv, state = state_shapes(config)
        self.layers = {
            i: (
                torch.zeros((num_slots, *conv), dtype=dtype, device=device),
                torch.zeros((num_slots, *state), dtype=torch.float32, device=device),
            )
            for i in config.linear_layers
        }
        self.num_slots = num_slots

    def step(self, slots: list[int], query_lens: list[int], seq_lens: list[int]) -> LinearStep:
        """A step's view: each sequence's slot, its rows, and whether it starts at token 0."""
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        fresh = [s == q for q, s in zip(query_lens, seq_lens, strict=True)]
        return LinearStep(slots, starts, fresh, self.layers)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each ``src`` slot's states into ``dst`` (a forked sample's)."""
        if not pairs:
            return
        src, dst = (list(x) for x in zip(*pairs, strict=True))
        for conv, state in self.layers.values():
            conv[dst] = conv[src]
            state[dst] = state[src]


def state_shapes(config: ModelConfig) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """(conv [C, K - 1], state [Hv, Dk, Dv]) of one slot of one linear layer."""
    key = config.linear_num_key_heads * config.linear_key_head_dim
    channels = 2 * key + config.linear_num_value_heads * config.linear_value_head_dim
    conv = (channels, config.linear_conv_kernel_dim - 1)
    heads = config.linear_num_value_heads
    return conv, (heads, config.linear_key_head_dim, config.linear_value_head_dim)


def bytes_per_slot(config: ModelConfig, dtype: torch.dtype) -> int:
    """Device bytes of one slot across the linear layers."""
    (c, k), (h, dk, dv) = state_shapes(config)
    per_layer = c * k * torch.tensor([], dtype=dtype).element_size() + h * dk * dv * 4
    return per_layer * len(config.linear_layers)


__all__ = ["StatePool", "StateSlots", "bytes_per_slot", "state_shapes"]
