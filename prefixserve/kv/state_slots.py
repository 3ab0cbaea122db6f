"""State slots of linear-attention hybrids (Qwen3.5, Qwen3-Next): beside the KV blocks of the full
layers, each running sequence holds one slot, which holds per Gated DeltaNet layer its recurrent
state [Hv, Dk, Dv] (fp32) and its convolution's last inputs [C, K - 1].

``StateSlots`` hands out slot ids on the host (the block manager takes one for a sequence at its
first step and gives it back when it frees the sequence: finish, abort, preemption); a preempted
sequence recomputes from token 0, and a chunk that starts at token 0 starts from zero states
(``LinearStep.fresh``), so a slot is never cleared. A forked sample (n > 1) gets its parent's states
copied into a slot of its own before its first step. ``StatePool`` holds the slots' tensors on the
device; their bytes come off the KV pool's budget (``bytes_per_slot``).

Prefix caching: the slots past the sequences' hold snapshots, the states after a sequence's first
``b`` tokens (prompt or generated) at some multiples of ``every_tokens`` (a block boundary), keyed by
the digest of the block ending there (which names the whole prefix): the last one each step's chunk
reaches (a decode step's too, so a chat's next turn resumes after the reply), every ``spacing``
tokens within a long chunk, and before each point other prompts are known to leave the sequence at
(``mark``: a batch group's prefix). A pinned system prompt's snapshots are held for good (``pin``).
A prefix-cache hit of a hybrid is cut back to its last
snapshot (``snapshot_prefix``) and the snapshot is copied into the sequence's slot before its first
step (``restore``): the rest is recomputed from there. Snapshots are evicted least recently used,
into host memory where the prefix cache's host tier is on (``kv/snapshot_spill.py``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

import torch

from prefixserve.kv.snapshot_spill import SnapshotSpill
from prefixserve.model.config import ModelConfig
from prefixserve.model.gated_delta import LinearStep, copy_slots

log = logging.getLogger(__name__)


class StateSlots:
    """Slot ids of the sequences holding one (host side); copies queued for the next step."""

    def __init__(
        self,
        num_slots: int,
        snapshots: int = 0,
        every_tokens: int = 64,
        spacing: int | None = None,
        spill: SnapshotSpill | None = None,
    ) -> None:
        """``num_slots`` sequences; ``snapshots`` more slots for prefix snapshots (slot ids after
        the sequences'), at multiples of ``every_tokens`` (a multiple of the block size): every
        ``spacing`` tokens (``snapshot_spacing``) and at the last one a step's chunk reaches.
        ``spill``: the host memory evicted snapshots go to (the prefix cache's host tier is on)."""
        self.num_slots, self.every_tokens = num_slots, every_tokens
        self.spacing = spacing or every_tokens
        self.spill = spill
        self._free = list(range(num_slots - 1, -1, -1))  # popped lowest first
        self._of: dict[Hashable, int] = {}
        self._copies: list[tuple[int, int]] = []
        self._held_back: list[int] = []  # freed slots a queued copy still reads
        self._snap_free = list(range(num_slots + snapshots - 1, num_slots - 1, -1))
        self._snaps: OrderedDict[bytes, int] = OrderedDict()  # digest -> slot, least recent first
        self._fresh: list[bytes] = []  # snapshots the step being assembled writes
        self._fresh_before: list[bytes] = []  # and the step before it (launched ahead: maybe in flight)
        # snapshots in a sequence's output, taken before its tokens there are known (launched ahead,
        # a step feeds a token still on the device): (seq, tokens) -> (slot, spaced), given their
        # digest once the tokens are known (``resolve``)
        self._pending: dict[tuple[Hashable, int], tuple[int, bool]] = {}
        # a running sequence's last snapshot off the spacing, in its prompt and in its output
        self._newest: dict[tuple[Hashable, bool], bytes] = {}
        self._pinned: dict[bytes, int] = {}  # digest -> slot: a pinned system prompt's, never evicted
        self.max_pinned = snapshots // 2
        self._marks: dict[Hashable, list[int]] = {}  # a running sequence's points others leave it at

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

    def mark(self, seq: Hashable, tokens: int) -> None:
        """Snapshot ``seq`` at the last boundary within its first ``tokens`` too, as at the spacing:
        other prompts share that much of it (a batch group's prefix, which its leader computes)."""
        self._marks.setdefault(seq, []).append(tokens)

    def marks(self, seq: Hashable) -> list[int]:
        return self._marks.get(seq, [])

    def free(self, seq: Hashable) -> None:
        self._marks.pop(seq, None)
        for key in [k for k in self._pending if k[0] == seq]:  # never given a digest: no snapshot
            self._snap_free.append(self._pending.pop(key)[0])
        for output in (False, True):  # its last ones stay: a repeat or the chat's next turn resumes there
            self._newest.pop((seq, output), None)
        slot = self._of.pop(seq, None)
        if slot is not None:
            self._copies = [c for c in self._copies if c[1] != slot]  # a restore it will not take
            if any(c[0] == slot for c in self._copies):  # a sample's copy reads it first: kept back
                self._held_back.append(slot)
            else:
                self._free.append(slot)

    # ---- prefix snapshots --------------------------------------------------------------------
    @property
    def snapshots(self) -> bool:
        return bool(self._snap_free or self._snaps)

    def pin(self, digests: Sequence[bytes]) -> int:
        """Hold the snapshots taken at any of ``digests`` (a pinned system prompt's blocks) for good:
        out of the least-recently-used order, so a hit on the pinned prompt always resumes; at most
        half the snapshot slots (``max_pinned``), so the other prompts keep theirs. Returns how many
        were pinned."""
        count = 0
        for digest in digests:
            if len(self._pinned) >= self.max_pinned:
                log.warning(
                    "a pinned prompt's snapshot is left evictable: half the snapshot slots are pinned"
                )
                break
            slot = self._snaps.pop(digest, None)
            if slot is not None:
                self._pinned[digest] = slot
                count += 1
        return count

    def snapshot_prefix(self, digests: Sequence[bytes], hit_blocks: int, block_size: int) -> int:
        """The blocks of a hit of ``hit_blocks`` that a snapshot can resume after: the last boundary
        at or before the hit's end with a snapshot, else 0."""
        every = self.every_tokens // block_size
        for blocks in range(hit_blocks // every * every, 0, -every):
            digest = digests[blocks - 1]
            if digest in self._pinned:
                return blocks
            if digest in self._snaps:
                self._snaps.move_to_end(digest)
                return blocks
            if self.spill is not None and digest in self.spill:
                return blocks
        return 0

    def restore(self, seq: Hashable, digest: bytes) -> None:
        """Copy the snapshot of ``digest`` into ``seq``'s slot before its next step: queued from a
        device slot, or from host memory now, on the one stream (after any step in flight, whose
        sequences' slots are not ``seq``'s, and before the next)."""
        held = self._snaps.get(digest)
        if held is None:
            held = self._pinned.get(digest)
        if held is not None:
            self._copies.append((held, self.slot(seq)))
        else:
            assert self.spill is not None, "a snapshot neither on the device nor in host memory"
            self.spill.restore(digest, self.slot(seq))

    def new_snapshot(
        self, digest: bytes, seq: Hashable = None, spaced: bool = True, output: bool = False
    ) -> int | None:
        """A slot to take the snapshot of ``digest`` in (None: one is held already), the least
        recently used one given up if none is free. One off the spacing (``spaced`` False: a chunk's
        last boundary) supersedes ``seq``'s last such one of the same part (``output``: taken past
        its prompt), given up now: a later prompt that goes on past it resumes from the newer. So a
        running sequence holds one such snapshot in its prompt (where a repeat of the prompt
        resumes) and one in its output (where a chat's next turn does)."""
        if not spaced and seq is not None:
            older = self._newest.pop((seq, output), None)
            if older is not None and older in self._snaps and older not in self._fresh:
                self._snap_free.append(self._snaps.pop(older))
        if digest in self._pinned:
            return None
        if digest in self._snaps:
            self._snaps.move_to_end(digest)
            return None
        slot = self._take_slot()
        if slot is None:
            return None
        self._snaps[digest] = slot
        self._fresh.append(digest)
        if not spaced and seq is not None:
            self._newest[(seq, output)] = digest
        return slot

    def _take_slot(self) -> int | None:
        """A free snapshot slot, else the least recently used snapshot's that no step in flight
        writes (else two writers), spilled first where a host tier is on; None if none."""
        if self._snap_free:
            return self._snap_free.pop()
        writing = set(self._fresh) | set(self._fresh_before)
        victim = next((d for d in self._snaps if d not in writing), None)
        if victim is None:
            return None
        slot = self._snaps.pop(victim)
        if self.spill is not None:  # before the step that overwrites its slot is launched
            self.spill.save(victim, slot)
        return slot

    def reserve(self, seq: Hashable, tokens: int, spaced: bool) -> int | None:
        """A slot for ``seq``'s snapshot after its first ``tokens`` (in its output), taken by the
        step being assembled before those tokens are all known; ``resolve`` names it."""
        if (seq, tokens) in self._pending:
            return None
        slot = self._take_slot()
        if slot is not None:
            self._pending[(seq, tokens)] = (slot, spaced)
        return slot

    def resolve(self, seq: Hashable, known: int, digest_at: Callable[[int], bytes]) -> None:
        """``seq``'s reserved snapshots within its first ``known`` tokens (computed and known)
        registered under the digest of the block ending at each (``digest_at(tokens)``)."""
        if not self._pending:
            return
        for key in sorted(k for k in self._pending if k[0] == seq and k[1] <= known):
            slot, spaced = self._pending.pop(key)
            digest = digest_at(key[1])
            if digest in self._snaps or digest in self._pinned:  # another sequence's, the same states
                self._snap_free.append(slot)
                continue
            if not spaced:  # supersedes its last one in its output
                older = self._newest.pop((seq, True), None)
                if older is not None and older in self._snaps:
                    self._snap_free.append(self._snaps.pop(older))
                self._newest[(seq, True)] = digest
            self._snaps[digest] = slot
            self._fresh.append(digest)  # its writer, launched with the step being assembled, may run

    def forget_fresh(self) -> None:
        """A step failed: the snapshots it and the step launched beside it were to write are given
        up (a slot half written must never be restored), their slots free again. (Reserved ones go
        with their sequences, which the failure frees.)"""
        for digest in self._fresh + self._fresh_before:
            slot = self._snaps.pop(digest, None)
            if slot is not None:
                self._snap_free.append(slot)
        self._fresh, self._fresh_before = [], []

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """The child's slot, the parent's states copied into it before the next step. A sample is
        split off as the step that ends the prompt is launched, so the copy runs after that step
        and before the parent's next: launched ahead or not, it takes the prompt's end states."""
        self._copies.append((self.slot(parent), self.slot(child)))

    def take_copies(self) -> list[tuple[int, int]]:
        """The copies the next step makes first; called once a step, as it is assembled (the step
        before it is launched by then; it and this step's are ``forget_fresh``'s until the next)."""
        copies, self._copies = self._copies, []
        self._fresh_before, self._fresh = self._fresh, []
        self._free += self._held_back  # the copies reading them run first in the next step
        self._held_back = []
        return copies

    @property
    def num_held(self) -> int:
        return len(self._of)


class StatePool:
    """The slots' tensors: per linear layer (conv [N, C, K - 1] in the model's dtype, state
    [N, Hv, Dk, Dv] fp32). One slot past the ``num_slots`` asked for is scratch, which no sequence
    holds: a graphed decode step's padding rows, and its capture's warm-up, write there."""

    def __init__(self, config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        conv, state = state_shapes(config)
        self.scratch_slot = num_slots
        self.num_slots = num_slots + 1  # allocated, the scratch slot included
        self.layers = {
            i: (
                torch.zeros((self.num_slots, *conv), dtype=dtype, device=device),
                torch.zeros((self.num_slots, *state), dtype=torch.float32, device=device),
            )
            for i in config.linear_layers
        }

    def step(
        self,
        slots: list[int],
        query_lens: list[int],
        seq_lens: list[int],
        snapshots: list[list[tuple[int, int]]] | None = None,
    ) -> LinearStep:
        """A step's view: each sequence's slot, its rows, whether it starts at token 0, and the
        snapshots its chunk takes ((rows into the chunk, snapshot slot))."""
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        fresh = [s == q for q, s in zip(query_lens, seq_lens, strict=True)]
        return LinearStep(slots, starts, fresh, self.layers, snapshots=snapshots or [])

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each ``src`` slot's states into ``dst`` (a forked sample's)."""
        if pairs:
            copy_slots(pairs, *(t for layer in self.layers.values() for t in layer))


def slot_counts(
    max_num_seqs: int, prefix_caching: bool, block_size: int, snapshot_room: int | None = None
) -> tuple[int, int, int]:
    """(sequence slots, snapshot slots, tokens between snapshots): a slot per sequence; under prefix
    caching twice as many for snapshots (a running sequence's newest and the one it resumed from),
    at most ``snapshot_room``; snapshots at multiples of 64 tokens (fla's chunk) or of the block if
    larger."""
    every = max(block_size, 64 // block_size * block_size)
    snapshots = 2 * max_num_seqs if prefix_caching else 0
    if snapshot_room is not None:
        snapshots = min(snapshots, snapshot_room)
    return max_num_seqs, snapshots, every


SNAPSHOT_MEMORY_FRACTION = 0.2  # of the GPU memory free after the weights: the most snapshots take


def snapshot_room(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> int | None:
    """The snapshot slots that fit in ``SNAPSHOT_MEMORY_FRACTION`` of the device's free memory
    (None on a CPU: as many as asked), so a large state (a Qwen3.5-27B slot is ~150 MB) leaves the
    KV pool its room."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * SNAPSHOT_MEMORY_FRACTION) // bytes_per_slot(config, dtype)


def snapshot_spacing(config: ModelConfig, every: int, dtype: torch.dtype) -> int:
    """Tokens between the snapshots a long chunk takes besides its last: ``every`` times the power of
    two that makes the full layers' KV rows of that many tokens about one snapshot's bytes, so the
    snapshots along a cached prefix at most double its memory (vLLM sizes a hybrid's pages alike).
    A snapshot at the chunk's end keeps multi-turn hits whole; a prefix shared out to a point between
    two spaced snapshots resumes from the earlier one."""
    full = config.num_hidden_layers - len(config.linear_layers)
    size = torch.tensor([], dtype=dtype).element_size()
    kv_token = max(1, 2 * config.num_key_value_heads * config.head_dim * size * full)
    ratio = max(1, bytes_per_slot(config, dtype) // kv_token // every)
    return every * (1 << (ratio.bit_length() - 1))


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


__all__ = [
    "StatePool",
    "StateSlots",
    "bytes_per_slot",
    "slot_counts",
    "snapshot_room",
    "snapshot_spacing",
    "state_shapes",
]
