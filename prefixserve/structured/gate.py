"""A grammar step's mask waited for by the GPU, not by the engine's thread (on an x86 host's GPU).

A constrained row's mask needs the token before it, so a step launched ahead issues its sampling once
the tokens ahead of it are placed and the matcher process has been sent the fill. The engine's thread
then waited for the child's answer and copied the mask before it issued the sampling: on a small
model, whose step is host work end to end, that wait was most of what a constrained step cost. Here
the sampling is issued without waiting for the answer, behind a one-program kernel that spins
(``wait_for_fill``, volatile loads of host memory) until the step's fill flag in the shared slots
(``bitmask.SharedSlots.flags``) holds the fill's number; the matcher process writes it once the rows
are in the slot (``-number`` when the fill failed). The mask kernel then reads the slot straight from
pinned host memory, once its wait is done (a kernel boundary orders the loads). Every fill is sent
before the sampling that waits for it is issued (``decoding.py``), so no host wait on the device can
hold it up.

The wait is bounded (``TIMEOUT_SECONDS`` by the GPU's clock): a fill that never comes (a hung child)
releases the device with the slot as it is, and the kernel's record of the flag it saw (``seen``)
tells the engine (``FillGate.check``), which fails the step's requests instead of serving tokens no
mask checked and replaces the child. A child that ends releases the fills it held at once
(``matcher_process.release_waits``).
"""

from __future__ import annotations

import functools
import os

import torch

from prefixserve.sampling.argmax import FlaggedMask, kernel_argmax, programs_wanted
from prefixserve.sampling.token_mask import kernel_token_mask

TIMEOUT_SECONDS = 60.0  # as ``MatcherProcess.ANSWER_SECONDS``: a new spec's compile can take seconds
INTERPRETER_SPIN_SECONDS = 1e-6  # the interpreter's bound counts spins (no clock there), each at least this


@functools.cache
def _kernel():
    """The wait kernel bound for relaunches (``triton_support/host_flag.py``), made at the first
    gated step that does not take the flagged argmax."""
    from prefixserve.triton_support.bound import BoundKernel
    from prefixserve.triton_support.host_flag import wait_for_fill

    return BoundKernel(wait_for_fill)


class FillGate:
    """The engine's side of the gate: per slot, the fill number a step waits for and the words its
    wait writes back (the flag it saw; ``late``, set where a program masked without the verdict), in
    pinned host memory, and the device words of the wait."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        pin = device.type == "cuda"  # (the CPU: the kernels under Triton's interpreter, in tests)

        def words(**kw: object) -> torch.Tensor:  # per slot, at 16-byte steps (an unaligned
            return torch.zeros(4, dtype=torch.int64, **kw)[::2]  # pointer takes Triton's slow launch)

        self.expect, self.seen, self.late = (words(pin_memory=pin) for _ in range(3))
        self._spins, self._go = words(device=device), words(device=device)
        self.timed = pin and os.environ.get("TRITON_INTERPRET") != "1"
        self.set_timeout(TIMEOUT_SECONDS)
        # per slot, the wait's tensors, and numpy views of the host words (a write without torch's
        # indexing: this is on the engine's thread every constrained step)
        self._args = [
            (self._spins[s : s + 1], self.expect[s : s + 1], self.seen[s : s + 1]) for s in range(2)
        ]
        self._expect_np, self._seen_np, self._late_np = (
            w.numpy() for w in (self.expect, self.seen, self.late)
        )
        # per slot, the slots tensor and the argmax's mask of it, made at its first argmax
        self._flagged: list[tuple[torch.Tensor, FlaggedMask] | None] = [None, None]

    def set_timeout(self, seconds: float) -> None:
        """How long a step's wait may last before it gives up (``check`` then fails the step)."""
        self.limit = int(seconds * 1e9) if self.timed else max(1, int(seconds / INTERPRETER_SPIN_SECONDS))
        self._flagged = [None, None]

    def apply(self, logits: torch.Tensor, slots: torch.Tensor, flags: torch.Tensor, slot: int, number: int,
              rows: int) -> None:  # fmt: skip
        """Mask the first ``rows`` rows of ``logits`` by ``slots[slot]`` once ``flags[slot]`` says fill
        ``number`` is in it (issued; the device waits, the host does not)."""
        self._expect_np[slot] = number  # the slot's last step has sampled: its tokens came before this fill
        self._seen_np[slot] = self._late_np[slot] = 0
        spins, expect, seen = self._args[slot]
        wait = _kernel()
        wait((1,), spins, flags[slot : slot + 1], expect, seen, self.limit, TIMED=self.timed, num_warps=1)
        kernel_token_mask(logits[:rows], slots[slot][:rows], None)

    def argmax(self, logits: torch.Tensor, slots: torch.Tensor, flags: torch.Tensor, slot: int, number: int,
               rows: int) -> torch.Tensor:  # fmt: skip
        """Each row's greedy token, rows ``< rows`` among the tokens ``slots[slot]`` allows once
        ``flags[slot]`` says fill ``number`` is in it: ``apply`` and the argmax in one launch (and its
        pick), on the device (issued; nothing here waits)."""
        self._seen_np[slot] = self._late_np[slot] = 0
        made = self._flagged[slot]
        if made is None or made[0] is not slots:  # (slots regrown: a new tensor)
            made = self._flagged[slot] = slots, FlaggedMask(
                slots[slot], rows, flags[slot : slot + 1], number, self.seen[slot : slot + 1],
                self.late[slot : slot + 1], self._spins[slot : slot + 1], self._go[slot : slot + 1],
                self.limit, self.timed,
            )  # fmt: skip
        flagged = made[1]
        flagged.number, flagged.rows = number, rows
        return kernel_argmax(logits, _programs(logits.device), flagged=flagged)

    def check(self, slot: int, number: int) -> None:
        """After the step's tokens arrived: raise if its wait did not see fill ``number`` (RuntimeError:
        the fill failed; TimeoutError: it did not come within the bound), the step's masks not its own."""
        seen = int(self._seen_np[slot])
        if seen == number and not self._late_np[slot]:
            return
        why = "failed in the matcher process" if seen == -number else "did not come in time"
        spins = int(self._spins[slot])
        raise (RuntimeError if seen == -number else TimeoutError)(
            f"structured decoding: a step's grammar mask {why} (fill {number} in slot {slot}: the wait saw "
            f"{seen} after {spins} spins); its requests fail"
        )


def _programs(device: torch.device) -> int:
    """The argmax's programs: as many as keep every SM streaming (a few under the interpreter)."""
    return programs_wanted(device.index) if device.type == "cuda" else 8


__all__ = ["TIMEOUT_SECONDS", "FillGate"]
