"""All-reduce over NVLink peer memory for decode-sized messages (PyTorch's symmetric memory).

A decode step all-reduces [B, hidden] twice per layer: kilobytes to a few MB, where NCCL's ring pays
a launch floor of its own and peer copies are cheaper. PyTorch's two-shot all-reduce (each rank sums
its half of every peer's buffer, then gathers the halves) reads the peers' buffers directly over
NVLink; docs/benchmarks/tensor_parallel_allreduce/ measures it against NCCL (the choice and its size
limit come from there). Its input must live in memory every rank mapped at start-up, so a message is
copied into one such buffer, reduced there and copied back: two device copies, graph-capturable.

The all-reduces that an RMSNorm follows (after attention, after the MLP, and the embedding's before
the first layer) go further: the product is written into a product slot and one kernel reads the
other ranks' slots, sums, adds the residual and normalises (``PeerSum``): ``kernels/peer_norm.py`` at
two ranks (one barrier), ``kernels/ranks_norm.py`` at three to eight up to ``RANKS_MAX_ROWS`` rows
(docs/kernels.md has the measured gains).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

MAX_BYTES = 16 << 20  # up to [1024, 8192] bf16: two-shot stayed ahead of NCCL to 16.8 MB measured
SLOT_BYTES = 8 << 20  # each fused product slot: [512, 8192] bf16, a decode step's at B <= 512
# the fused call sites: consecutive calls never share a slot (kernels/peer_norm.py says why one
# barrier a call is then enough)
ATTENTION_SLOT, MLP_SLOT, EMBEDDING_SLOT = 0, 1, 2
SLOTS = 3
PICK_ROWS = 4096  # rows the sharded argmax trades over peer memory (more go through NCCL)
# past two ranks the fused call (every rank's whole product read: one-shot) takes at most this many
# rows; above, the two-shot's fewer bytes win (4 x H200, [32, 4096] 9.9 vs 10.9 us, [64, 4096] 11.8
# vs 11.4: docs/kernels.md §8)
RANKS_MAX_ROWS = 32


class PeerAllReduce:
    """One symmetric buffer per rank and the two-shot all-reduce through it (CUDA, NCCL group)."""

    def __init__(
        self, group: dist.ProcessGroup, device: torch.device, name: str, max_bytes: int = MAX_BYTES
    ) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        from torch._C._distributed_c10d import _register_process_group

        self.two_shot = torch.ops.symm_mem.two_shot_all_reduce_  # raises where this torch has none
        # Symmetric memory keeps each group name's store for the life of the process. A process that
        # runs a second engine gets a default group of the same name ("0") whose store is new: the
        # stale one would never meet the new workers. So the group is registered under a name of
        # this engine's own, the same on every rank.
        _register_process_group(name, group)
        self.group_name = name
        self.size = dist.get_world_size(group)
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)  # collective: every rank at start-up
        self.abort = PeerAbort(device)
        self.fused: _FusedSlots | None = None
        from prefixserve.model.kernels.ranks_norm import MAX_RANKS

        if 2 <= self.size <= MAX_RANKS:  # past MAX_RANKS: the two-shot, then the norm
            rank = dist.get_rank(group)
            self.fused = _FusedSlots(symm_mem, group, self.group_name, rank, self.size, self.abort)

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (
            x.is_cuda
            and x.is_contiguous()
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and nbytes <= self.buffer.numel()
            and x.numel() % (self.size * 16) == 0  # the halves split on whole 16-element runs
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks in place (the caller checked ``fits``)."""
        staged = self._view(x.numel() * x.element_size(), x.dtype).view(x.shape)
        staged.copy_(x)
        x.copy_(self.reduce_staged(staged))
        return x

    def staged(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A [rows, cols] view of the buffer for a product to be written into (no copy in), or None
        where such a message does not fit."""
        numel = rows * cols
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if dtype not in (torch.bfloat16, torch.float16, torch.float32) or nbytes > self.buffer.numel():
            return None
        if numel % (self.size * 16):
            return None
        return self._view(nbytes, dtype).view(rows, cols)

    def _view(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return self.buffer[:nbytes].view(dtype)

    def reduce_staged(self, staged: torch.Tensor) -> torch.Tensor:
        """Sum a ``staged`` view over the ranks in place and return it (no copy out). It holds the sum
        only until this rank's next all-reduce: the caller consumes it at once."""
        self.two_shot(staged, "sum", self.group_name)
        return staged

    def argmax(self, logits: torch.Tensor, local: torch.Tensor, start: int) -> torch.Tensor | None:
        """The two ranks' argmax tokens [R] over peer memory (``kernels/peer_argmax.py``), or None
        where this path does not apply (not two ranks, too many rows): then NCCL trades them."""
        if self.fused is None or self.fused.size != 2 or logits.shape[0] > PICK_ROWS:
            return None
        return self.fused.argmax(logits, local, start)

    def product_slot(self, slot: int, rows: int, cols: int, dtype: torch.dtype) -> PeerSum | None:
        """A ``PeerSum`` whose ``mine`` [rows, cols] is where this rank's product goes, for an RMSNorm
        to sum; None where the fused path does not apply (one rank, too large, other dtypes).
        The caller checks ``fused.peer_norm_enabled()`` first."""
        from prefixserve.model.kernels.peer_norm import MAX_HIDDEN

        nbytes = rows * cols * dtype.itemsize
        if self.fused is None:
            return None
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return None
        if nbytes > SLOT_BYTES or cols > MAX_HIDDEN:
            return None
        if self.fused.size > 2 and rows > RANKS_MAX_ROWS:
            return None
        return PeerSum(self.fused, slot, self.fused.mine(slot, rows, cols, dtype))


class PeerAbort:
    """A flag in device memory that every wait of this project's peer kernels reads: a rank whose peer
    died would otherwise spin on a signal that never comes, its stream stuck for the life of the
    process. Setting it makes every wait give up, now and in any later call (outputs then are
    meaningless; the caller has given up on the peer). NCCL's collectives have their own abort;
    PyTorch's two-shot all-reduce has none."""

    def __init__(self, device: torch.device) -> None:
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        self._one = torch.ones(1, dtype=torch.int32).pin_memory()
        self._stream = torch.cuda.Stream(device)  # a pool stream: it does not wait for the stuck one

    def set(self) -> None:
        """Raise the flag from any thread: a copy on a stream of its own, which the copy engine runs
        while the kernels still spin (a kernel launch might find no free SM)."""
        with torch.cuda.stream(self._stream):
            self.flag.copy_(self._one, non_blocking=True)


class _FusedSlots:
    """The ranks' product slots and program flags in symmetric memory, and views of the others'.

    Two ranks (``kernels/peer_norm.py``): the peer's slots and call counts, and the sharded argmax's
    exchange. More ranks
    (``kernels/ranks_norm.py``): a table of every rank's slot addresses a slot, and call counts."""

    def __init__(
        self, symm_mem: Any, group: dist.ProcessGroup, name: str, rank: int, size: int, abort: PeerAbort
    ) -> None:
        from prefixserve.model.kernels.peer_argmax import MAX_PROGRAMS as PICK_PROGRAMS
        from prefixserve.model.kernels.peer_norm import MAX_PROGRAMS

        device = abort.flag.device
        self.rank, self.size, self.abort = rank, size, abort.flag

        def every(numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
            """Every rank's zeroed buffer in symmetric memory as mapped here, this rank's at ``rank``:
            a collective rendezvous."""
            mine = symm_mem.empty(numel, dtype=dtype, device=device)
            mine.zero_()
            handle = symm_mem.rendezvous(mine, name)
            return [mine if r == rank else handle.get_buffer(r, (numel,), dtype, 0) for r in range(size)]

        def shared(numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            """(this rank's zeroed buffer in symmetric memory, the peer's) at two ranks."""
            buffers = every(numel, dtype)
            return buffers[rank], buffers[1 - rank]

        products = every(SLOTS * SLOT_BYTES, torch.uint8)
        self.products = products[rank]
        self.calls = torch.zeros(MAX_PROGRAMS, dtype=torch.int64, device=device)
        if size > 2:
            from prefixserve.model.kernels.ranks_norm import MAX_RANKS

            def addresses(buffers: list[torch.Tensor], offset: int = 0) -> torch.Tensor:
                return torch.tensor(
                    [b.data_ptr() + offset for b in buffers], dtype=torch.int64, device=device
                )

            # slot s of every rank, by rank; rank q's program i writes its call count into counts[q, i]
            self.tables = [addresses(products, s * SLOT_BYTES) for s in range(SLOTS)]
            counts = every(MAX_RANKS * MAX_PROGRAMS, torch.int64)
            self.counts, self.counts_table = counts[rank], addresses(counts)
            torch.cuda.synchronize(device)
            dist.barrier(group)  # every rank's counts are zero before any rank signals
            return
        self.peer_products = products[1 - rank]
        # the peer's program i writes its count of calls into counts[i], and calls[i] is this rank's
        # own (int64: never wraps)
        self.counts, self.peer_counts = shared(MAX_PROGRAMS, torch.int64)
        # the sharded argmax's exchange (``kernels/peer_argmax.py``): (score, column) a row, and its
        # own call counts
        picks, peer_picks = shared(2 * PICK_ROWS, torch.float32)
        self.picks, self.peer_picks = picks.view(2, PICK_ROWS), peer_picks.view(2, PICK_ROWS)
        self.pick_counts, self.peer_pick_counts = shared(PICK_PROGRAMS, torch.int64)
        self.pick_calls = torch.zeros(PICK_PROGRAMS, dtype=torch.int64, device=device)
        torch.cuda.synchronize(device)
        dist.barrier(group)  # every rank's flags are zero before any rank signals

    def argmax(self, logits: torch.Tensor, local: torch.Tensor, start: int) -> torch.Tensor:
        """The two ranks' argmax tokens [R] from this rank's ``logits`` and their best columns
        ``local`` (``kernels/peer_argmax.py``); the peer makes the same call."""
        from prefixserve.model.kernels.peer_argmax import peer_argmax

        return peer_argmax(
            logits,
            local,
            start,
            self.rank,
            self.picks,
            self.peer_picks,
            self.pick_counts,
            self.peer_pick_counts,
            self.pick_calls,
            self.abort,
        )

    def ranks_norm(
        self,
        slot: int,
        mine: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        num_warps: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Past two ranks: every rank's product in ``slot`` (this rank's is ``mine``) summed, the
        residual added and normalised (``kernels/ranks_norm.py``); the other ranks make the same call."""
        from prefixserve.model.kernels.ranks_norm import ranks_add_rms_norm

        return ranks_add_rms_norm(
            self.tables[slot],
            self.rank,
            mine,
            residual,
            weight,
            eps,
            self.counts,
            self.counts_table,
            self.calls,
            self.abort,
            num_warps=num_warps,
        )

    def mine(self, slot: int, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's [rows, cols] product in ``slot``."""
        return self._view(self.products, slot, rows, cols, dtype)

    def views(self, slot: int, rows: int, cols: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's, the peer's) [rows, cols] product in ``slot``."""
        return self._view(self.products, slot, rows, cols, dtype), self._view(
            self.peer_products, slot, rows, cols, dtype
        )

    @staticmethod
    def _view(buffer: torch.Tensor, slot: int, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        at = slot * SLOT_BYTES
        return buffer[at : at + rows * cols * dtype.itemsize].view(dtype).view(rows, cols)


@dataclass(frozen=True, slots=True)
class PeerSum:
    """The ranks' row-parallel products not yet summed: the next RMSNorm sums them with the residual
    (``add_rms_norm``) in one kernel. ``mine`` is this rank's product, in the slot it was written to."""

    slots: _FusedSlots
    slot: int
    mine: torch.Tensor

    def add_rms_norm(
        self, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(sum + residual) * weight, sum + residual)``, the sum over the ranks (no
        residual: the first layer's norm of the embedding's lookups, ``(rms_norm(sum) * weight, sum)``)."""
        from prefixserve.model.kernels.peer_norm import peer_add_rms_norm

        mine, slots = self.mine, self.slots
        if slots.size > 2:  # at most RANKS_MAX_ROWS rows (product_slot)
            return slots.ranks_norm(self.slot, mine, residual, weight, eps)
        _, peer = slots.views(self.slot, mine.shape[0], mine.shape[1], mine.dtype)  # the peer's memory
        return peer_add_rms_norm(
            mine, peer, residual, weight, eps, slots.counts, slots.peer_counts, slots.calls, abort=slots.abort
        )


def peer_allreduce_for(group: dist.ProcessGroup, device: torch.device, name: str) -> PeerAllReduce | None:
    """The peer all-reduce where this build and machine give one, else None (NCCL does it all).

    Every rank must call this at the same point, with the same ``name`` (unique to this group in
    the process's life): the buffer's exchange is collective."""
    if device.type != "cuda":
        return None
    try:
        return PeerAllReduce(group, device, name)
    except Exception as exc:  # an older torch, no peer access: NCCL alone is correct, only slower
        log.warning("peer all-reduce unavailable (%s); all-reduces go through NCCL", exc)
        return None


__all__ = [
    "ATTENTION_SLOT",
    "EMBEDDING_SLOT",
    "MAX_BYTES",
    "MLP_SLOT",
    "PeerAbort",
    "PeerAllReduce",
    "PeerSum",
    "peer_allreduce_for",
]
