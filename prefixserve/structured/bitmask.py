"""Apply a step's token bitmask to its logits on the device, before sampling.

The bitmask is xgrammar's: int32 [rows, ceil(vocab / 32)], bit ``t % 32`` of word ``t // 32`` set
where token ``t`` is allowed. It is filled on the host (``decoding.StepMask``) and applied here in
place: disallowed logits become -inf, so neither greedy nor any sampling filter can pick them.
``apply_bitmask_reference`` is the plain-PyTorch oracle; ``apply_bitmask`` takes xgrammar's CPU
kernel for fp32 logits on the CPU and the same torch arithmetic elsewhere (one unpack on the device).
"""

from __future__ import annotations

import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


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


@torch.inference_mode()  # the logits are inference tensors: updating them in place needs the mode
def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """As ``apply_bitmask_reference``, batched: ``bitmask`` is on the host, [len(logits), words]."""
    if not rows:
        return
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        from xgrammar import apply_token_bitmask_inplace

        apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows, backend="cpu")
        return
    dev = logits.device
    if dev.type == "cuda":
        picked = bitmask[rows].pin_memory().to(dev, non_blocking=True)
        idx = torch.tensor(rows, dtype=torch.long).pin_memory().to(dev, non_blocking=True)
    else:
        picked, idx = bitmask[rows], torch.tensor(rows, dtype=torch.long)
    masked = logits.index_select(0, idx).masked_fill_(~_allowed(picked, logits.shape[-1]), float("-inf"))
    logits.index_copy_(0, idx, masked)


__all__ = ["apply_bitmask", "apply_bitmask_reference"]
