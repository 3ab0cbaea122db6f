"""The grammar gate's kernels (``structured/gate.py``): the wait spins until the slot's flag holds the
fill's number, written later by another thread, then the mask read from the host slot equals the
plain-PyTorch reference; a wait that runs out of spins, or that sees the fill's number negated (a
failed fill), is reported by ``check``. On a CPU the kernels run in the Triton interpreter."""

from __future__ import annotations

import threading

import pytest
import torch
from _kernel_helpers import DEVICE

from prefixserve.structured import bitmask
from prefixserve.structured.bitmask import apply_bitmask_reference
from prefixserve.structured.gate import FillGate


@pytest.fixture
def slots():
    """Shared slots of 3 rows over a 5,000-token vocabulary, slot 1 random; pinned on a GPU."""
    vocab, rows = 5000, 3
    shared = bitmask.SharedSlots(rows, -(-vocab // 32))
    pinned = DEVICE.type == "cuda" and bitmask._pin(shared.tensor)
    assert pinned or DEVICE.type == "cpu"
    gen = torch.Generator().manual_seed(5)
    shared.tensor[1] = torch.randint(
        -(2**31), 2**31 - 1, shared.tensor[1].shape, generator=gen, dtype=torch.int32
    )
    shared.logits = torch.randn(rows, vocab, generator=gen)
    yield shared
    if pinned:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(shared.tensor.data_ptr())


def test_the_gate_waits_for_the_fill_flag_written_later(slots) -> None:
    want = slots.logits.clone()
    apply_bitmask_reference(want, slots.tensor[1], [0, 1, 2])
    gate = FillGate(DEVICE)
    slots.flags[1] = 6
    gate.apply(slots.logits.to(DEVICE), slots.tensor, slots.flags, 1, 6, 3)  # compiled now, not below
    logits = slots.logits.to(DEVICE)
    writer = threading.Timer(0.3, lambda: slots.flags.__setitem__(1, 7))
    writer.start()
    gate.apply(logits, slots.tensor, slots.flags, 1, 7, 3)
    if DEVICE.type == "cuda":
        done = torch.cuda.Event()
        done.record()
        assert not done.query()  # the device waits for the flag
        done.synchronize()
    writer.join()
    gate.check(1, 7)
    assert torch.equal(logits.cpu(), want)


def test_a_wait_out_of_spins_or_on_a_failed_fill_is_reported(slots) -> None:
    gate = FillGate(DEVICE)
    gate.set_timeout(0.001)
    logits = slots.logits.to(DEVICE)
    gate.apply(logits, slots.tensor, slots.flags, 1, 9, 3)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    with pytest.raises(TimeoutError, match="did not come in time"):
        gate.check(1, 9)
    slots.flags[0] = -4
    gate.apply(logits, slots.tensor, slots.flags, 0, 4, 3)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="failed in the matcher process"):
        gate.check(0, 4)
