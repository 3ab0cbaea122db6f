"""Apply a step's token bitmask to its logits on the device, before sampling.

The bitmask is xgrammar's: int32 [rows, ceil(vocab / 32)], bit ``t % 32`` of word ``t // 32`` set
where token ``t`` is allowed. It is filled on the host (``decoding.StructuredDecoding``) and applied
here in place: disallowed logits become -inf, so neither greedy nor any sampling filter can pick them.
``apply_bitmask_reference`` is the plain-PyTorch oracle.

``StepBitmasks`` holds the buffers every constrained step goes through, made once: a constrained
step on a GPU waits for this host work, so none of it allocates. The matcher process
(``matcher_process``) fills one of two host slots in turn (the other may still be copying to the
device: a launched-ahead step's copy is only queued); the slots are an anonymous shared-memory file
both processes map (``SharedSlots``), pinned on a GPU. The filled rows go to the device in one
``non_blocking`` copy, and the mask is applied there (``apply_token_mask``: no
per-step tensor on the host; one kernel on a GPU, ``sampling/token_mask.py``).
"""

from __future__ import annotations

import os
import tempfile
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from prefixserve.sampling.sampler import SampleFuture, tokens_future
from prefixserve.sampling.token_mask import apply_token_mask, blocked_tokens

if TYPE_CHECKING:
    from prefixserve.structured.gate import FillGate


def _allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [rows, vocab] from the packed int32 bitmask (on its device)."""
    return ~blocked_tokens(bitmask, vocab)


def apply_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Row ``rows[i]`` of ``logits`` keeps only what row ``rows[i]`` of ``bitmask`` allows (in place)."""
    vocab = logits.shape[-1]
    for r in rows:
        allowed = _allowed(bitmask[r : r + 1].to(logits.device), vocab)[0]
        logits[r].masked_fill_(~allowed, float("-inf"))


def _every_row(rows: list[int], n: int) -> bool:
    """Are ``rows`` (ascending, unique) all of 0..n-1?"""
    return len(rows) == n and rows[-1] == n - 1


@torch.inference_mode()
def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """As ``apply_bitmask_reference``, batched, ``bitmask`` on the host, [len(logits), words]; without
    ``StepBitmasks``' buffers (tests, one-off calls)."""
    if not rows:
        return
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        from xgrammar import apply_token_bitmask_inplace

        every = _every_row(rows, logits.shape[0])
        apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=logits.shape[-1], indices=None if every else rows, backend="cpu"
        )
        return
    index = None if _every_row(rows, logits.shape[0]) else torch.tensor(rows, device=logits.device)
    apply_token_mask(logits, bitmask.to(logits.device, non_blocking=True), index)


def _anonymous_file() -> int:
    """A descriptor of a file with no name: ``memfd_create`` (Linux), else a temporary file unlinked
    at once (macOS)."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("prefixserve-mask")
    fd, path = tempfile.mkstemp(prefix="prefixserve-mask-")
    os.unlink(path)
    return fd


def _fd_path(fd: int) -> str:
    """A path that opens what descriptor ``fd`` holds (``torch.from_file`` takes a path)."""
    return f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else f"/dev/fd/{fd}"


FLAG_WORDS = 8  # int32 words after the slots: each slot's fill flag, an int64 16 bytes apart (``flags``)


class SharedSlots:
    """Two host slots, int32 [2, rows, words], in an anonymous shared-memory file (``_anonymous_file``)
    mapped by the engine's process and the matcher process: it has no name to leak, and the child gets
    its descriptor over their socket (``matcher_process``). After the slots, each slot's fill flag
    (int64 [2]): the child writes a gated fill's number there once its rows are written, and a GPU
    waits for it (``gate.py``). Closed when collected; the mappings live as long as their tensors."""

    def __init__(self, rows: int, words: int) -> None:
        self.fd = _anonymous_file()
        os.ftruncate(self.fd, (_flags_at(rows, words) + FLAG_WORDS) * 4)
        self.rows, self.words = rows, words
        self.tensor, self.flags = self.open(self.fd, rows, words, close=False)
        weakref.finalize(self, os.close, self.fd)

    def describe(self) -> tuple[int, int]:
        """What ``open`` needs besides the descriptor."""
        return self.rows, self.words

    @staticmethod
    def open(fd: int, rows: int, words: int, close: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Map the slots of descriptor ``fd`` (a descriptor received from the engine: closed after):
        the slots, int32 [2, rows, words], and their fill flags, int64 [2], each 16-byte aligned (a
        kernel launch with an unaligned pointer takes Triton's slow path, ``triton_support/bound.py``)."""
        at = _flags_at(rows, words)
        try:
            flat = torch.from_file(_fd_path(fd), shared=True, size=at + FLAG_WORDS, dtype=torch.int32)
        finally:
            if close:
                os.close(fd)
        return flat[: 2 * rows * words].view(2, rows, words), flat[at:].view(torch.int64)[::2]


def _flags_at(rows: int, words: int) -> int:
    """Where the flags start, in int32 words: after the slots, on a 16-byte boundary."""
    return -(-2 * rows * words // 4) * 4


def _pin(t: torch.Tensor) -> bool:
    """Page-lock ``t``'s memory in place for async copies to the GPU (a mapping torch did not allocate);
    a refusal (a memlock limit) is cleared from CUDA's last error, so no later launch check sees it."""
    cudart = torch.cuda.cudart()
    size = t.untyped_storage().nbytes()  # the whole mapping: the slots and their flags
    if cudart.cudaHostRegister(t.data_ptr(), size, 0) == 0:
        return True
    cudart.cudaGetLastError()
    return False


class StepBitmasks:
    """A step's bitmask buffers, made once for ``rows`` sample rows (regrown if a step has more): two
    host slots used in turn (``SharedSlots``), pinned on a GPU, and there the device copy of the mask
    and of its rows."""

    def __init__(self, words: int, device: torch.device | str, rows: int = 64) -> None:
        self.words, self.device = words, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.slot = 0
        self.rows = 0
        self.shared: SharedSlots | None = None
        self._pinned = False
        self._grow(max(1, rows))

    def _grow(self, rows: int) -> None:
        if self.rows:
            self.wait()  # the old slots' copies read them until they finish
            self.close()
        self.rows = rows
        self.shared = SharedSlots(rows, self.words)
        pin = self.cuda
        self._pinned = pin and _pin(self.shared.tensor)
        # where the shared slots cannot be pinned, a slot's copy goes through a pinned buffer of its own
        staged = 2 if pin and not self._pinned else 0
        self._staging = [
            torch.empty(rows, self.words, dtype=torch.int32, pin_memory=True) for _ in range(staged)
        ]
        self._index = [torch.empty(rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        if self.cuda:
            self._dev = torch.empty(rows, self.words, dtype=torch.int32, device=self.device)
            self._dev_index = torch.empty(rows, dtype=torch.int64, device=self.device)
            self._events = [torch.cuda.Event(), torch.cuda.Event()]  # the slots' own (``_reading``)
            self._copied = list(self._events)  # what each slot's last read is done at
            self._pending = [False, False]

    def close(self) -> None:
        """Unpin the shared slots (before their mapping can go)."""
        if self._pinned and self.shared is not None:
            torch.cuda.cudart().cudaHostUnregister(self.shared.tensor.data_ptr())
            self._pinned = False

    def wait(self) -> None:
        """Until no copy or mask kernel reads a host slot."""
        if self.cuda:
            for s in (0, 1):
                if self._pending[s]:
                    self._copied[s].synchronize()
                    self._pending[s] = False

    def host(self, n: int) -> torch.Tensor:
        """The next slot's first ``n`` rows (int32 [n, words]) to fill: no copy or mask kernel reads
        it any more.
        Rows not filled hold an older step's words; ``apply`` reads only the rows it is given."""
        slot = self.reserve(n)  # first: it may grow the slots
        return self.shared.tensor[slot][:n]

    def reserve(self, n: int) -> int:
        """The next slot, for a fill of ``n`` rows, once no copy or mask kernel reads it (``host``
        without the view: a gated fill is read by the device from the slot's index alone)."""
        if n > self.rows:
            self._grow(max(n, 2 * self.rows))
        self.slot ^= 1
        if self.cuda and self._pending[self.slot]:
            self._copied[self.slot].synchronize()  # two steps back: long done unless the device lags
            self._pending[self.slot] = False
        return self.slot

    @property
    def device_readable(self) -> bool:
        """Can a GPU kernel read the host slots where they are (pinned in place on a GPU)?"""
        return self.cuda and self._pinned

    def read(self, logits: torch.Tensor, slot: int, number: int, rows: int, gate: FillGate) -> None:
        """Mask the first ``rows`` rows of ``logits`` by slot ``slot`` once the device sees gated fill
        ``number`` in it (``gate.py``); the slot is not given out again until that read is done."""
        shared = self.shared
        gate.apply(logits, shared.tensor, shared.flags, slot, number, rows)
        if self.cuda:
            self._reading(slot)

    def _reading(self, slot: int) -> None:
        """A read of ``slot`` was just issued: done at the slot's own event, recorded now (never a
        tokens future's event that ``choose`` lent it)."""
        event = self._copied[slot] = self._events[slot]
        event.record()
        self._pending[slot] = True

    def choose(self, logits: torch.Tensor, slot: int, number: int, rows: int, gate: FillGate) -> SampleFuture:
        """``read`` and the greedy choice in one launch (``FillGate.argmax``): each row's token, on its
        way to the host; the slot is not given out again until the tokens are."""
        shared = self.shared
        future = tokens_future(gate.argmax(logits, shared.tensor, shared.flags, slot, number, rows))
        if self.cuda:
            self._copied[slot] = future.event  # (an event of its own would cost a record a step)
            self._pending[slot] = True
        return future

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Rows ``rows`` of ``logits`` masked by the same rows of ``bitmask`` (``host``'s last slot)."""
        if not rows:
            return
        if not self.cuda or logits.device.type != "cuda":
            apply_bitmask(logits, bitmask, rows)
            return
        n, s = bitmask.shape[0], self.slot
        if self._staging:  # the slot's buffer is free: ``host`` waited for its last copy
            bitmask = self._staging[s][:n].copy_(bitmask)
        dev = self._dev[:n]
        dev.copy_(bitmask, non_blocking=True)
        index = None
        if not _every_row(rows, logits.shape[0]):
            staged = self._index[s][: len(rows)]
            staged.numpy()[:] = rows
            index = self._dev_index[: len(rows)]
            index.copy_(staged, non_blocking=True)
        self._reading(s)
        apply_token_mask(logits, dev, index)


@dataclass(slots=True)
class StepMask:
    """One step's mask on the host and the sample rows it constrains, applied through its buffers."""

    bitmask: torch.Tensor  # int32 [sample rows, words]; only ``rows`` are filled
    rows: list[int]
    buffers: StepBitmasks

    def apply(self, logits: torch.Tensor) -> None:
        self.buffers.apply(logits, self.bitmask, self.rows)


__all__ = [
    "SharedSlots",
    "StepBitmasks",
    "StepMask",
    "apply_bitmask",
    "apply_bitmask_reference",
]
