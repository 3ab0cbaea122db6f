"""Where each layer's K/V lives in the paged pool: its slot (which cache tensor) and its group (which
block table addresses it).

Plain layout (every model): one slot per layer that owns a cache, all in group 0, addressed by the
sequence's block table. A layer that reads another's KV (``kv_source``) shares that layer's slot.

Freeing layout (a model mixing full and sliding layers of one KV shape and one window): pages hold
``F`` layer-slots, ``F`` the number of full layers. Group 0 is the full layers, one per slot; the
sliding layers fill groups 1..R, ``F`` to a group (the last one padded). A block of a sequence is one
page of group 0 (its block table entry) plus, while some holder's window still reaches it, one page
in each sliding group (``scheduler/sliding_pages.py``); behind every window those R pages go back to
the one pool, which the full and sliding groups draw from alike, so short and long contexts both use
the whole pool. Gemma-3-12B (8 full, 40 sliding layers): F = 8, R = 5; a 32K-token sequence with a
1K window holds 2K full pages and ~5 x 65 sliding pages instead of 6 x 2K.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixserve.model.config import SLIDING, ModelConfig


@dataclass(frozen=True, slots=True)
class KVLayout:
    slot_of: tuple[int, ...]  # per layer: the cache tensor it reads and writes
    group_of: tuple[int, ...]  # per layer: 0 the block table's pages, g > 0 sliding group g's
    slot_shapes: tuple[tuple[int, int], ...]  # per slot: (kv_heads, head_dim)
    window: int | None = None  # the sliding groups' window (None: no sliding group, nothing freed)

    @property
    def num_slots(self) -> int:
        return len(self.slot_shapes)

    @property
    def sliding_groups(self) -> int:
        """R: pages a block holds beyond its block-table page while a window reaches it."""
        return max(self.group_of, default=0)

    @property
    def frees_sliding(self) -> bool:
        return self.sliding_groups > 0

    @property
    def uniform(self) -> bool:
        """Every slot the same shape (the cache is then one tensor)."""
        return len(set(self.slot_shapes)) <= 1

    @property
    def is_plain(self) -> bool:
        """One slot per layer, in order, one group: the layout the host tier and modules pack."""
        return self.slot_of == tuple(range(len(self.slot_of))) and not self.frees_sliding

    def page_elements(self, block_size: int) -> int:
        """K and V elements of one page (every slot)."""
        return sum(2 * heads * dim * block_size for heads, dim in self.slot_shapes)

    def pages_for(self, num_tokens: int, block_size: int) -> int:
        """Pages one sequence of ``num_tokens`` holds at most: its blocks, and the sliding pages of the
        blocks its window reaches (``window / block_size`` rounded up, plus the one it starts in)."""
        blocks = -(-num_tokens // block_size)
        if not self.frees_sliding:
            return blocks
        assert self.window is not None
        return blocks + self.sliding_groups * min(blocks, -(-self.window // block_size) + 1)


def kv_layout(config: ModelConfig, free_sliding: bool = True) -> KVLayout:
    """The freeing layout where ``free_sliding`` and the model allows it (``can_free_sliding``), else
    the plain one."""
    if free_sliding and can_free_sliding(config) is None:
        return _freeing_layout(config)
    return plain_layout(config)


def plain_layout(config: ModelConfig) -> KVLayout:
    n = config.num_hidden_layers
    owners = [i for i in range(n) if config.kv_source(i) == i]
    slot = {layer: s for s, layer in enumerate(owners)}
    return KVLayout(
        slot_of=tuple(slot[config.kv_source(i)] for i in range(n)),
        group_of=(0,) * n,
        slot_shapes=tuple(config.layer_kv_shape(i) for i in owners),
    )


def can_free_sliding(config: ModelConfig) -> str | None:
    """Why this model's sliding layers cannot give blocks back (None: they can)."""
    n = config.num_hidden_layers
    owners = [i for i in range(n) if config.kv_source(i) == i]
    kinds = {config.layer_spec(i).kind for i in owners}
    if SLIDING not in kinds:
        return "it has no sliding-window layers"
    if len(kinds) == 1:
        return "every layer slides (no full layer keeps the prefix cache's blocks)"
    if len({config.layer_kv_shape(i) for i in owners}) > 1:
        return "its layers' KV heads or head sizes differ"
    return None


def _freeing_layout(config: ModelConfig) -> KVLayout:
    n = config.num_hidden_layers
    owners = [i for i in range(n) if config.kv_source(i) == i]
    full = [i for i in owners if config.layer_spec(i).kind != SLIDING]
    sliding = [i for i in owners if config.layer_spec(i).kind == SLIDING]
    width = len(full)
    place = {layer: (s, 0) for s, layer in enumerate(full)}
    place |= {layer: (j % width, 1 + j // width) for j, layer in enumerate(sliding)}
    where = [place[config.kv_source(i)] for i in range(n)]
    return KVLayout(
        slot_of=tuple(s for s, _ in where),
        group_of=tuple(g for _, g in where),
        slot_shapes=(config.layer_kv_shape(full[0]),) * width,
        window=config.sliding_window,
    )


__all__ = ["KVLayout", "can_free_sliding", "kv_layout", "plain_layout"]
