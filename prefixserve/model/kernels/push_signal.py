"""A producer kernel's products pushed to the peer rank, and the signal that they have all landed.

At two ranks a row-parallel product is summed with the peer's before the next norm. Reading the
peer's product over NVLink after a barrier costs a remote round trip and the transfer, both exposed
(docs/kernels.md §8). A producer that writes each output tile into the peer's incoming buffer from
its epilogue moves the transfer under its own compute, and the peer's norm then waits on a counter
in its own memory instead of a barrier.

The signal, per product slot (consecutive calls alternate between two): every program of the
producer, once its tile is stored here and there, bumps this rank's ticket counter (acquire-release,
system scope); the program that takes the last ticket resets the tickets, bumps this rank's
``expected`` count (the calls this rank has produced into the slot) and then the peer's ``calls``
count (release, system scope). By the release chain every program's stores come before that last
bump. The peer's norm (``wait_arrived``) reads its own ``expected`` (set by its own producer of the
same call, which ran before it on its stream) and waits until ``calls`` reaches it. The counts only
grow (int64), so CUDA graph replays need no reset. Reusing a slot two calls later is safe for the
same reason as the barrier version's (``peer_norm.py``): the peer cannot produce into it again
before this rank's norm that read it has finished, since the peer's next-but-one product depends
on this rank's next one, which this rank's stream runs after that norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixserve.triton_support import require_triton

triton, tl = require_triton()


@triton.jit
def signal_done(tickets_ptr, expected_ptr, peer_calls_ptr, n_programs):
    """End of a producer program's epilogue, after its stores (local and into the peer's memory)."""
    tl.debug_barrier()  # every thread's stores issued before the ticket below
    old = tl.atomic_add(tickets_ptr, 1, sem="acq_rel", scope="sys")
    if old == n_programs - 1:  # the last program of this call: all tiles are out
        tl.atomic_xchg(tickets_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_add(expected_ptr, 1, sem="relaxed", scope="gpu")
        tl.atomic_add(peer_calls_ptr, 1, sem="release", scope="sys")


@triton.jit
def wait_arrived(calls_ptr, expected_ptr):
    """Wait until the peer has produced as many calls into this slot as this rank has."""
    want = tl.load(expected_ptr)
    while tl.atomic_add(calls_ptr, 0, sem="acquire", scope="sys") < want:
        pass


@dataclass(frozen=True, slots=True)
class PushTarget:
    """Where a producer pushes one call's product and how it signals: the peer's incoming [M, N]
    view, and this slot's one-element int64 counters (``tickets`` and ``expected`` here, ``calls``
    in the peer's memory), each 16-byte aligned."""

    peer_out: torch.Tensor
    tickets: torch.Tensor
    expected: torch.Tensor
    peer_calls: torch.Tensor
