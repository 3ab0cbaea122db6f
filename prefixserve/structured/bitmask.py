"""Apply a step's token bitmask to its logits on the device, before sampling.

The bitmask is xgrammar's: int32 [rows, ceil(vocab / 32)], bit ``t % 32`` of word ``t // 32`` set
where token ``t`` is allowed. It is filled on the host (``decoding.StructuredDecoding``) and applied
here in place: disallowed logits become -inf, so neither greedy nor any sampling filter can pick them.
``apply_bitmask_reference`` is the plain-PyTorch oracle.

``StepBitmasks`` holds the buffers every constrained step goes through, made once: a constrained
step on a GPU waits for this host work, so none of it allocates. The host fills one of two pinned
slots in turn (the other may still be copying to the device: a launched-ahead step's copy is only
queued), the filled rows go to the device in one ``non_blocking`` copy, and the mask is applied
there with a few torch kernels (``apply_rows``: no per-step tensor on the host, nothing compiled).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}
_BITS: dict[torch.device, torch.Tensor] = {}


def _allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [rows, vocab] from the packed int32 bitmask (on its device)."""
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Row ``rows[i]`` of ``logits`` keeps only what row ``rows[i]`` of ``bitmask`` allows (in place)."""
    vocab = logits.shape[-1]
    for r in rows:
        allowed = _allowed(bitmask[r : r + 1].to(logits.device), vocab)[0]
        logits[r].masked_fill_(~allowed, float("-inf"))


def _blocked(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [rows, vocab], True where the token is not allowed (two kernels: and, compare)."""
    bits = _BITS.get(bitmask.device)
    if bits is None:  # 1 << i as int32 words (bit 31 is the sign bit)
        values = [(1 << i) - (1 << 32 if i == 31 else 0) for i in range(32)]
        bits = _BITS[bitmask.device] = torch.tensor(values, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) & bits) == 0).view(bitmask.shape[0], bitmask.shape[1] * 32)[:, :vocab]


@torch.inference_mode()  # the logits are inference tensors: updating them in place needs the mode
def apply_rows(logits: torch.Tensor, bitmask: torch.Tensor, index: torch.Tensor | None) -> None:
    """``apply_bitmask_reference`` with the rows given as a device tensor (None: every row), the bitmask
    already on the logits' device: only device work, none of it waiting for the host."""
    vocab = logits.shape[-1]
    if index is None:
        logits.masked_fill_(_blocked(bitmask[: logits.shape[0]], vocab), float("-inf"))
        return
    picked = logits.index_select(0, index)
    picked.masked_fill_(_blocked(bitmask.index_select(0, index), vocab), float("-inf"))
    logits.index_copy_(0, index, picked)


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
    apply_rows(logits, bitmask.to(logits.device, non_blocking=True), index)


class StepBitmasks:
    """A step's bitmask buffers, made once for ``rows`` sample rows (regrown if a step has more): two
    host slots used in turn, pinned on a GPU, and there the device copy of the mask and of its rows."""

    def __init__(self, words: int, device: torch.device | str, rows: int = 64) -> None:
        self.words, self.device = words, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.slot = 0
        self.rows = 0
        self._grow(max(1, rows))

    def _grow(self, rows: int) -> None:
        if self.rows:
            self.wait()  # the old slots' copies read them until they finish
        self.rows, pin = rows, self.cuda
        self._host = [torch.empty(rows, self.words, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._index = [torch.empty(rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        if self.cuda:
            self._dev = torch.empty(rows, self.words, dtype=torch.int32, device=self.device)
            self._dev_index = torch.empty(rows, dtype=torch.int64, device=self.device)
            self._copied = [torch.cuda.Event(), torch.cuda.Event()]
            self._pending = [False, False]

    def wait(self) -> None:
        """Until no copy reads a host slot."""
        if self.cuda:
            for s in (0, 1):
                if self._pending[s]:
                    self._copied[s].synchronize()
                    self._pending[s] = False

    def host(self, n: int) -> torch.Tensor:
        """The next slot's first ``n`` rows (int32 [n, words]) to fill: no copy reads it any more.
        Rows not filled hold an older step's words; ``apply`` reads only the rows it is given."""
        if n > self.rows:
            self._grow(max(n, 2 * self.rows))
        self.slot ^= 1
        if self.cuda and self._pending[self.slot]:
            self._copied[self.slot].synchronize()  # two steps back: long done unless the device lags
            self._pending[self.slot] = False
        return self._host[self.slot][:n]

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Rows ``rows`` of ``logits`` masked by the same rows of ``bitmask`` (``host``'s last slot)."""
        if not rows:
            return
        if not self.cuda or logits.device.type != "cuda":
            apply_bitmask(logits, bitmask, rows)
            return
        n, s = bitmask.shape[0], self.slot
        dev = self._dev[:n]
        dev.copy_(bitmask, non_blocking=True)
        index = None
        if not _every_row(rows, logits.shape[0]):
            staged = self._index[s][: len(rows)]
            staged.numpy()[:] = rows
            index = self._dev_index[: len(rows)]
            index.copy_(staged, non_blocking=True)
        self._copied[s].record()
        self._pending[s] = True
        apply_rows(logits, dev, index)


@dataclass(slots=True)
class StepMask:
    """One step's mask on the host and the sample rows it constrains, applied through its buffers."""

    bitmask: torch.Tensor  # int32 [sample rows, words]; only ``rows`` are filled
    rows: list[int]
    buffers: StepBitmasks

    def apply(self, logits: torch.Tensor) -> None:
        self.buffers.apply(logits, self.bitmask, self.rows)


__all__ = ["StepBitmasks", "StepMask", "apply_bitmask", "apply_bitmask_reference", "apply_rows"]
